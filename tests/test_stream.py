"""The event stream: report() never blocks, is bounded, counts what it drops; history is bounded."""
from __future__ import annotations

import pytest

import time

import zmq

from gpu_lab.record.registry import Registry
from gpu_lab.readers import MetricHistory, Series
from gpu_lab.record import Reporter
from gpu_lab.readers.receiver import Receiver
from gpu_lab.record.recorder import Recorder

from proc_utils import wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds


def _recorder(tmp_path, run_id, **kw):
    reg = Registry(tmp_path / "registry.db")
    reg.create_run(run_id, status="running")
    return reg, Recorder(reg, run_id, **kw)


def test_report_is_recorded_numbered_and_followed_live(tmp_path):
    reg, rec = _recorder(tmp_path, "r1")
    follower = Receiver(registry=reg)
    got = []
    follower.follow("r1", got.extend, address=rec.publish_address, key=rec.client_key)
    try:
        rep = Reporter(address=rec.address, key=rec.client_key, run_id="r1", rank=3, interval=0.01)
        for s in range(100):
            rep.report(s, loss=1.0 / (s + 1), lr=0.1)
        rep.close(2.0)
        wait_until(lambda: len(got) >= 100, 10, what="100 events")
    finally:
        rec.close()
        follower.close()
    assert [e["step"] for e in got] == list(range(100))  # each once, in order
    assert [e["seq"] for e in got] == list(range(1, 101))
    assert {e["rank"] for e in got} == {3}
    assert got[0]["data"] == {"loss": 1.0, "lr": 0.1}
    stored = reg.events("r1")
    assert [e["step"] for e in stored] == list(range(100))
    assert reg.last_values("r1") == {"last_step": 99, "last_loss": 0.01}


def test_a_late_follower_gets_the_whole_record_then_live_events(tmp_path):
    reg, rec = _recorder(tmp_path, "late")
    rep = Reporter(address=rec.address, key=rec.client_key, run_id="late", rank=0, interval=0.01)
    try:
        for s in range(50):
            rep.report(s, loss=float(s))
        rep.flush(2.0)
        assert rec.flush(5.0)
        follower = Receiver(registry=reg)
        got = []
        follower.follow("late", got.extend, address=rec.publish_address,
                        key=rec.client_key)
        wait_until(lambda: len(got) >= 50, 10, what="the recorded history")
        for s in range(50, 80):
            rep.report(s, loss=float(s))
        rep.close(2.0)
        wait_until(lambda: len(got) >= 80, 10, what="the live events")
    finally:
        rec.close()
        follower.close()
    assert [e["step"] for e in got] == list(range(80))
    assert follower.read_back >= 50  # the first 50 came from the registry


def test_the_recorder_stays_bounded_and_every_report_is_stored_or_counted(tmp_path):
    """A database that is busy for a while (another writer holds its lock): the recorder stops
    taking events, zmq's queues fill, and the ranks drop and count instead of waiting."""
    import sqlite3

    reg, rec = _recorder(tmp_path, "busy", max_pending=5_000)
    blocker = sqlite3.connect(tmp_path / "registry.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the recorder's next write waits for this
    rep = Reporter(address=rec.address, key=rec.client_key, run_id="busy", rank=0, interval=0.005,
                   maxlen=2_000)
    worst = 0.0
    try:
        for s in range(100_000):
            t0 = time.perf_counter()
            rep.report(s, loss=1.0)
            worst = max(worst, time.perf_counter() - t0)
        wait_until(lambda: rep.dropped > 0, 10, what="drops at the rank")
        blocker.execute("COMMIT")
        rep.close(2.0)
        assert rec.flush(30.0)
    finally:
        blocker.close()
        rec.close()
    stored = sum(1 for e in reg.events("busy") if e["kind"] == "metric")
    assert rec.peak_pending < 5_000 + 2_000  # one batch (2,000 events at most) over the bound
    assert stored + rep.dropped == 100_000, (stored, rep.dropped)
    drops = [e for e in reg.events("busy") if e["kind"] == "dropped"]
    assert drops and drops[-1]["data"]["count"] == rep.dropped  # the count is in the record
    print(f"stored {stored}, dropped and counted {rep.dropped}, slowest report() "
          f"{worst * 1e6:.0f} µs, peak pending {rec.peak_pending}")


def test_report_never_blocks_when_nobody_listens_and_counts_drops():
    # a port with no receiver behind it: the kernel is gone
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(0)
    ctx.term()
    rep = Reporter(address=f"tcp://127.0.0.1:{port}", run_id="gone", maxlen=1000, interval=0.01)
    t0 = time.perf_counter()
    for i in range(50_000):
        rep.report(i, loss=float(i))
    elapsed = time.perf_counter() - t0
    rep.close(1.0)
    assert rep.reported == 50_000
    assert rep.dropped > 0 and rep.sent + rep.dropped <= 50_000
    print(f"50,000 report() calls with no listener: {elapsed * 1e6 / 50_000:.2f} µs/call, "
          f"dropped {rep.dropped}")


def test_a_rank_done_before_its_recorder_listens_still_delivers(tmp_path):
    """A short rank reports and exits while its recorder is not up yet (a job's, whose follower
    is busy): close() waits for the connection instead of dropping what is queued."""
    import threading

    from gpu_lab.supervise.ports import free_port

    port = free_port()
    rep = Reporter(address=f"tcp://127.0.0.1:{port}", run_id="late", rank=0, interval=0.01)
    for s in range(12):
        rep.report(s, loss=1.0 / (s + 1))
    closing = threading.Thread(target=rep.close)
    closing.start()
    # close() must still be waiting past the socket's 0.5 s linger (the old close had returned,
    # its reports dropped); then the recorder binds
    closing.join(1.5)
    assert closing.is_alive(), "close() returned before its recorder listened"
    reg, rec = _recorder(tmp_path, "late", private=False, port=port)
    try:
        closing.join(30)
        assert not closing.is_alive()
        wait_until(lambda: len(reg.events("late")) >= 12, 10, what="the 12 reports")
    finally:
        rec.close()
    assert [e["step"] for e in reg.events("late")] == list(range(12))


def test_report_outside_a_launch_is_a_noop():
    rep = Reporter(address="", run_id="")
    rep.report(1, loss=2.0)
    assert not rep.enabled and rep._thread is None


def test_tensor_values_are_converted_off_the_training_thread(tmp_path):
    import torch

    reg, rec = _recorder(tmp_path, "t")
    try:
        rep = Reporter(address=rec.address, key=rec.client_key, run_id="t", rank=0, interval=0.01)
        rep.report(0, loss=torch.tensor(0.25), acc=torch.tensor([1.0, 0.0]), bad="x")
        rep.close(2.0)
        wait_until(lambda: reg.events("t"), 10, what="the event")
    finally:
        rec.close()
    assert reg.events("t")[0]["data"] == {"loss": 0.25, "acc": 0.5}


def test_series_stays_bounded_and_keeps_spikes():
    s = Series(capacity=1000)
    for i in range(1_000_000):
        s.append(i, float(i), 100.0 if i == 777_777 else 1.0)
    assert len(s) <= 1000
    assert 100.0 in s.values
    assert s.count == 1_000_000
    assert s.steps[0] == 0 and s.steps[-1] == 999_999


def test_metric_history_per_rank():
    h = MetricHistory(capacity=64)
    h.add(0, 1, 0.0, {"loss": 2.0, "note": "x"})
    h.add(1, 1, 0.0, {"loss": 3.0})
    assert h.ranks() == [0, 1]
    assert h.series("loss", 1) == ([1], [3.0])
    assert h.last("loss") == 2.0
    assert h.names() == ["loss"]
