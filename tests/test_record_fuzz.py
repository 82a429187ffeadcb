"""A run's record that nothing can break (issue #30, part 1): bad reports are refused and counted
at the rank, bad events are dropped and counted at the recorder, a batch the database refuses is
split until the bad event is found, and every reader takes whatever a record holds."""
from __future__ import annotations

import json
import math
import sqlite3
import types

import pytest

import gpu_lab
from gpu_lab.record.registry import Registry
from gpu_lab.record import Reporter
from gpu_lab.record import events as ev
from gpu_lab.record.recorder import Recorder

import record_fns
from proc_utils import wait_until


def _strict_json(text: str):
    """JSON as a browser parses it: NaN and Infinity are not JSON."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _why(events: list[dict], rank: int) -> dict:
    """The newest refusal counts a rank (or the recorder, -1) put in the record."""
    notes = [e["data"] for e in events if e["kind"] == ev.DROPPED and e["rank"] == rank]
    return notes[-1].get("why", {}) if notes else {}


@pytest.mark.slow  # over half a second
def test_a_text_step_among_good_reports_no_longer_loses_the_run():
    run = gpu_lab.launch(record_fns.one_text_step, 50, num_processes=1)
    assert run.wait(120) == "succeeded", run.logs(None) + run.logs(0)
    assert [p["step"] for p in Registry().metrics(run.id, "loss")] == list(range(50))
    log = run.logs(0, tail=None)
    assert "refused step='5'" in log and "a step is an int >= 0" in log
    assert _why(Registry().events(run.id), 0) == {"step": 1}


@pytest.mark.slow  # over half a second
def test_two_ranks_of_good_and_bad_reports_keep_every_good_one(gpu_lab_home):
    n = 40
    run = gpu_lab.launch(record_fns.mixed_reports, n, num_processes=2, name="fuzz")
    assert run.wait(240) == "succeeded", run.logs(None) + run.logs(0) + run.logs(1)
    assert run.result()["every"] == [n + 2.0, n + 2.0]
    reg = Registry()
    events = reg.events(run.id)
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        metric = [e for e in mine if e["kind"] == ev.METRIC]
        # n + 2 reports, and the good event among the raw ones: one by one, nothing else
        assert len(metric) == n + 3, [e["step"] for e in metric]
        assert [e["step"] for e in metric if "loss" in e["data"]] == list(range(n + 1))
        assert [e["data"] for e in metric if "raw_ok" in e["data"]] == [{"raw_ok": 1.0}]
        assert [e["data"] for e in metric if e["step"] is None] == [{"lr": 0.1}]
        losses = {e["step"]: e["data"]["loss"] for e in metric if "loss" in e["data"]}
        assert math.isnan(losses[10]) and losses[11] == math.inf and losses[12] == -math.inf
        assert math.isnan(losses[n])  # the report's junk="text" was refused, its loss kept
        assert _why(events, rank) == record_fns.REFUSED_AT_RANK
        log = run.logs(rank, tail=None)
        for what in ("refused step='5'", "refused junk='text'", "refused a metric named 'nnn",
                     "refused data='not a dict'"):
            assert what in log, (what, log[-3000:])
        assert log.count(f"gpu_lab.report (rank {rank}): refused") == 4  # once per kind
        texts = [e["data"]["text"] for e in mine if e["kind"] == ev.LOG]
        assert [len(t) < ev.MAX_TEXT + 100 and t.startswith("yyy") for t in texts] == [True]
    assert _why(events, -1) == {k: 2 * v for k, v in record_fns.REFUSED_AT_RECORDER.items()}
    assert events[-1]["kind"] == ev.STATUS and events[-1]["data"]["status"] == "succeeded"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    _every_reader_works(run, reg, n)


def _every_reader_works(run, reg: Registry, n: int) -> None:
    for handle in (run, gpu_lab.attach(run.id)):
        for rank in (0, 1):
            steps, values = handle.metrics.series("loss", rank)
            assert steps == list(range(n + 1))
            assert math.isnan(values[10]) and values[11:13] == [math.inf, -math.inf]
            assert handle.metrics.series("raw_ok", rank) == ([3], [1.0])
    from gpu_lab.server import runview

    out = runview.detail(reg, run.id)
    text = json.dumps(out)  # what the handler sends: valid JSON, NaN and inf as null
    wire = _strict_json(text)["series"]["loss"]
    for key in ("0", "1"):
        assert wire[key]["step"] == list(range(n + 1))
        assert wire[key]["value"][10:13] == [None, None, None]
        assert wire[key]["nonfinite"] == [[10, "NaN"], [11, "Infinity"], [12, "-Infinity"],
                                          [n, "NaN"]]
    # (the ranks did not report in step, so the mean may close a step before both reported it)
    assert {"NaN", "Infinity", "-Infinity"} <= {v for _, v in wire["mean"]["nonfinite"]}
    compared = runview.compare(reg, [run.id])
    _strict_json(json.dumps(compared))
    assert "NaN" in {v for _, v in compared["metrics"]["loss"][run.id]["nonfinite"]}
    prom = _prometheus(reg)
    assert f'gpu_lab_run_last_loss{{run_id="{run.id}"}} NaN' in prom
    assert f'gpu_lab_run_last_step{{run_id="{run.id}"}} {float(n)}' in prom
    fig = gpu_lab.compare([run.id], metric="loss")
    y = list(fig.data[0].y)
    assert len(y) == n + 1 and math.isnan(y[10]) and y[11] == math.inf
    _strict_json(fig.to_json())


def _prometheus(reg: Registry) -> str:
    """The run families of a scrape, by server/metrics.py's own renderer."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gpu_lab.server.metrics import GpuLabCollector

    settings = types.SimpleNamespace(gpu_lab_metrics=False, run_metrics=True)
    scrape = CollectorRegistry(auto_describe=False)
    scrape.register(GpuLabCollector(types.SimpleNamespace(registry=reg), settings, None))
    return generate_latest(scrape).decode()


# --- the recorder alone ------------------------------------------------------------------------------
def _recorder(tmp_path, run_id: str) -> tuple[Registry, Recorder]:
    reg = Registry(tmp_path / "registry.db")
    reg.create_run(run_id, status="running")
    return reg, Recorder(reg, run_id, interval=0.02)


def _metric(step, **kw) -> dict:
    return {"rank": 0, "kind": ev.METRIC, "t": 1.0, "step": step, "data": {"loss": 1.0}, **kw}


def test_a_batch_with_one_unwritable_event_writes_all_the_good_ones(tmp_path):
    reg, rec = _recorder(tmp_path, "split")
    try:
        good = [_metric(s) for s in range(37)]
        bad = _metric(99, t="not a time")  # record() trusts its caller: the database refuses it
        rec.record(good[:20] + [bad] + good[20:])
        assert rec.flush(10.0)
    finally:
        rec.close(end={"status": "succeeded"})
    events = reg.events("split")
    assert [e["step"] for e in events if e["kind"] == ev.METRIC] == list(range(37))  # in order
    assert rec.unwritable == 1 and rec.written == len(events)
    assert _why(events, -1) == {"unwritable": 1}
    assert reg.get_run("split")["status"] == "succeeded"


def test_add_events_names_the_event_it_cannot_record(tmp_path):
    reg = Registry(tmp_path / "registry.db")
    reg.create_run("strict", status="running")
    for bad, said in ((_metric("5"), "step '5'"), (_metric(1, data=[1]), "data of type list"),
                      (_metric(1, t=math.nan), "time nan"), (_metric(1, rank="x"), "'x'")):
        with pytest.raises(ValueError, match="event 2 of 2 cannot be recorded") as err:
            reg.add_events("strict", [_metric(0), bad])
        assert said in str(err.value)
    assert reg.events("strict") == []  # nothing of a refused transaction


class _Impatient(Registry):
    """A registry that answers "database is locked" at once instead of after 30 s."""

    def _conn(self):
        c = super()._conn()
        c.execute("PRAGMA busy_timeout=0")
        return c


def test_a_locked_database_is_retried_in_order_not_split(tmp_path):
    reg = _Impatient(tmp_path / "registry.db")
    reg.create_run("locked", status="running")
    rec = Recorder(reg, "locked", interval=0.02)
    blocker = sqlite3.connect(tmp_path / "registry.db", isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        rec.record([_metric(s) for s in range(10)])
        wait_until(lambda: rec.write_errors >= 2, 20, what="the recorder to meet the lock")
        blocker.execute("COMMIT")
        assert rec.flush(10.0)
    finally:
        blocker.close()
        rec.close()
    assert [e["step"] for e in reg.events("locked")] == list(range(10))
    assert rec.unwritable == 0 and not rec.refused_why


def test_the_recorder_survives_whatever_arrives_and_keeps_the_good(tmp_path):
    reg, rec = _recorder(tmp_path, "raw")
    try:
        msgs = record_fns.raw_messages(0, "raw")
        record_fns.push_raw(msgs + [json.dumps(_metric(5)).encode()], rec.address,
                            rec.client_key)
        wait_until(lambda: sum(rec.refused_why.values()) >= 11 and rec.written >= 2, 20,
                   what="the recorder to take every message")
        assert rec._thread.is_alive()
    finally:
        rec.close(end={"status": "succeeded"})
    events = reg.events("raw")
    assert [(e["step"], e["data"]) for e in events if e["kind"] == ev.METRIC] == [
        (3, {"raw_ok": 1.0}), (5, {"loss": 1.0})]
    want = dict(record_fns.REFUSED_AT_RECORDER, kind=1)  # the reporter's bogus kind is not here
    assert _why(events, -1) == want


# --- the reporter alone ------------------------------------------------------------------------------
def test_report_refuses_counts_and_tells_once_per_kind(tmp_path, capsys):
    import numpy as np

    reg, rec = _recorder(tmp_path, "rep")
    rep = Reporter(address=rec.address, run_id="rep", rank=2, interval=0.01,
                   key=rec.client_key)
    try:
        for step in ("1", 1.5, -3, True, np.float64(2.0), 2 ** 70, object()):
            rep.report(step, loss=1.0)  # never raises
        rep.report(np.int32(4), loss=np.float16(0.5), x=True, y=None, z=[1.0], w=1e400)
        rep.report(5, ok=2 ** 80)
        rep.close(2.0)
        assert rec.flush(10.0)
    finally:
        rec.close()
    err = capsys.readouterr().err
    assert err.count("gpu_lab.report (rank 2): refused") == 2, err
    assert "refused step='1': a step is an int >= 0" in err
    assert rep.refused_why == {"step": 7, "value": 3}
    metric = [e for e in reg.events("rep") if e["kind"] == ev.METRIC]
    assert [(e["step"], e["data"]) for e in metric] == [(4, {"loss": 0.5, "w": math.inf}),
                                                        (5, {"ok": float(2 ** 80)})]
    assert _why(reg.events("rep"), 2) == {"step": 7, "value": 3}


def test_readers_skip_what_an_older_record_holds(tmp_path):
    """Records written before the contract may hold a text step or data that is not a dict."""
    from gpu_lab.server import runview

    reg = Registry(tmp_path / "registry.db")
    reg.create_run("old", status="succeeded", num_processes=1)
    reg.add_events("old", [_metric(s) for s in range(5)])
    c = reg._conn()
    c.execute("INSERT INTO events VALUES ('old', 6, 0, 'metric', 2.0, 'abc', '{\"loss\": 3}')")
    c.execute("INSERT INTO events VALUES ('old', 7, 0, 'metric', 2.0, 7, '[1, 2]')")
    c.execute("INSERT INTO events VALUES ('old', 8, 0, 'status', 2.0, NULL, '\"x\"')")
    c.execute("INSERT INTO events VALUES ('old', 9, 0, 'dropped', 2.0, NULL, '{\"count\": \"z\"}')")
    c.execute("UPDATE runs SET last_step='abc' WHERE id='old'")
    run = gpu_lab.attach("old", registry=reg)
    assert run.metrics.series("loss", 0)[0] == [0, 1, 2, 3, 4, 5]  # the text step: no step
    out = runview.detail(reg, "old")
    _strict_json(json.dumps(out))
    assert out["series"]["loss"]["0"]["step"] == [0, 1, 2, 3, 4, 5]
    assert out["series"]["loss"]["mean"]["step"] == [0, 1, 2, 3, 4]
    assert "gpu_lab_run_last_step{" not in _prometheus(reg)
    fig = gpu_lab.compare(["old"], metric="loss", registry=reg)
    assert sorted(fig.data[0].y) == [1.0] * 5 + [3.0]  # the text step's point placed by time
    frame = run.metrics.frame()  # full resolution: the list data left out, the text step none
    assert frame["seq"].tolist() == [1, 2, 3, 4, 5, 6] and frame["step"].isna().tolist()[-1]
    assert len(reg.metrics("old", "loss")) == 6


def test_the_record_contract_event_by_event():
    ok = {"run": "r", "rank": 0, "kind": ev.METRIC, "t": 1.5, "step": 0,
          "data": {"loss": math.nan, "acc": math.inf, "n": 3}}
    assert ev.problem(ok) is None and ev.problem({**ok, "step": None, "rank": -1}) is None
    for change, why in (({"kind": "x"}, "kind"), ({"t": math.inf}, "t"), ({"t": "1"}, "t"),
                        ({"rank": -2}, "rank"), ({"rank": True}, "rank"), ({"step": -1}, "step"),
                        ({"step": 2 ** 63}, "step"), ({"step": True}, "step"),
                        ({"data": None}, "data"), ({"data": {"loss": True}}, "value"),
                        ({"data": {"loss": None}}, "value"), ({"data": {"x": 2 ** 64}}, "value"),
                        ({"data": {"n" * 201: 1.0}}, "name"), ({"data": {"": 1.0}}, "name"),
                        ({"kind": ev.LOG, "data": record_fns._nested_dict(9)}, "data")):
        assert ev.problem({**ok, **change}) == why, change
    assert ev.problem([ok]) == "event"
    assert ev.problem({**ok, "kind": ev.LOG, "data": record_fns._nested_dict(7)}) is None


def test_data_travels_as_its_own_text_and_is_stored_as_it_came(tmp_path):
    """On the wire a rank's event carries its data as JSON text; the recorder checks the decoded
    data and stores that text, so NaN and inf arrive as they left, and a text that is not JSON, or
    holds more than one value, is refused like any bad data."""
    e = {"run": "w", "rank": 0, "kind": ev.METRIC, "t": 1.0, "step": 3,
         "data": {"loss": math.nan, "lr": math.inf}}
    raw = ev.encode([e])
    assert b'"data"' not in raw and b'"dj":"{' in raw
    (got,), why = ev.checked(raw)
    assert not why and math.isnan(got["data"]["loss"]) and got["data"]["lr"] == math.inf
    assert got[ev.TEXT] == '{"loss":NaN,"lr":Infinity}'
    (read,) = ev.decode(raw)  # a subscriber's copy: the data, not the text
    assert ev.TEXT not in read and read["data"]["lr"] == math.inf
    bad = [dict(e, data=None, dj=text) for text in ('{"loss":', '{"loss":1}{"x":2}', "[1]", "7")]
    for b in bad:
        b.pop("data")
    good, why = ev.checked(json.dumps(bad).encode())
    assert good == [] and why == {"data": 4}, why
    reg, rec = _recorder(tmp_path, "w")
    try:
        record_fns.push_raw([ev.encode([dict(e, run="w")])], rec.address, rec.client_key)
        wait_until(lambda: rec.written >= 1, 20, what="the event to be written")
    finally:
        rec.close(end={"status": "succeeded"})
    stored = sqlite3.connect(tmp_path / "registry.db").execute(
        "SELECT data FROM events WHERE run_id='w' AND kind='metric'").fetchall()
    assert stored == [('{"loss":NaN,"lr":Infinity}',)]
