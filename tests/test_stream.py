"""The event stream: report() never blocks, is bounded, counts what it drops; history is bounded."""
from __future__ import annotations

import time

import zmq

from gpu_lab.stream import MetricHistory, Reporter, Series
from gpu_lab.stream.receiver import Receiver

from proc_utils import wait_until


def test_report_reaches_the_receiver_with_rank_and_step():
    rec = Receiver()
    got = []
    rec.subscribe("r1", got.extend)
    try:
        rep = Reporter(address=rec.address, run_id="r1", rank=3, interval=0.01)
        for s in range(100):
            rep.report(s, loss=1.0 / (s + 1), lr=0.1)
        rep.close(2.0)
        wait_until(lambda: len(got) >= 100, 10, what="100 events")
    finally:
        rec.close()
    assert [e["step"] for e in got[:100]] == list(range(100))
    assert {e["rank"] for e in got} == {3}
    assert got[0]["data"] == {"loss": 1.0, "lr": 0.1}


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


def test_report_outside_a_launch_is_a_noop():
    rep = Reporter(address="", run_id="")
    rep.report(1, loss=2.0)
    assert not rep.enabled and rep._thread is None


def test_tensor_values_are_converted_off_the_training_thread():
    import torch

    rec = Receiver()
    got = []
    rec.subscribe("t", got.extend)
    try:
        rep = Reporter(address=rec.address, run_id="t", rank=0, interval=0.01)
        rep.report(0, loss=torch.tensor(0.25), acc=torch.tensor([1.0, 0.0]), bad="x")
        rep.close(2.0)
        wait_until(lambda: got, 10, what="the event")
    finally:
        rec.close()
    assert got[0]["data"] == {"loss": 0.25, "acc": 0.5}


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
