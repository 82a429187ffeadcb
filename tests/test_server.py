"""The Jupyter server extension, through a real Jupyter server (pytest-jupyter's jp_serverapp):
authentication on every endpoint, XSRF, the shared sampler under websocket clients, the runs list,
Stop on a real process, and the Prometheus exposition.

pytest-jupyter's fixtures are imported into this module only (not registered as a global plugin):
its autouse fixtures make a fresh event loop and a ServerApp cleanup for every test they apply to,
which the rest of the suite does not want.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import psutil
import pytest
import tornado.httpclient
from prometheus_client.parser import text_string_to_metric_families
from pytest_jupyter.jupyter_server import *  # noqa: F401,F403  (fixtures for this module only)

from gpu_lab.record.registry import Registry
from gpu_lab.server.runview import COMPARE_POINTS, MAX_COMPARE
from gpu_lab.telemetry import NVMLSampler, Sampler
from gpu_lab.telemetry import sampler as sampler_mod
from gpu_lab.telemetry.doubles import FakeNVML
from gpu_lab.telemetry.probe import gpu_count

ENDPOINTS_GET = [
    ("gpu-lab", "api", "info"),
    ("gpu-lab", "api", "telemetry"),
    ("gpu-lab", "api", "runs"),
    ("gpu-lab", "api", "runs", "RUNID"),
    ("gpu-lab", "api", "runs", "RUNID", "events"),
    ("gpu-lab", "api", "runs", "RUNID", "logs", "rank0.log"),
    ("gpu-lab", "api", "compare"),
    ("gpu-lab", "metrics"),
]
ENDPOINTS_POST = ["stop", "checkpoint", "resume"]


@pytest.fixture
def jp_server_config():
    # only gpu_lab: no terminals, no lab; what we test is our extension
    return {"ServerApp": {"jpserver_extensions": {"gpu_lab": True,
                                                  "jupyter_server_terminals": False}}}


@pytest.fixture
def sampler(monkeypatch, gpu_lab_home):
    """A fresh process-wide sampler for the server under test (real psutil, no GPU here)."""
    s = Sampler(interval=0.25)
    monkeypatch.setattr(sampler_mod, "_sampler", s)
    monkeypatch.setattr(sampler_mod, "_sampler_pid", os.getpid())
    yield s
    s.close()


@pytest.fixture
def run_loop(jp_asyncio_loop):
    def run(aw, timeout=30):
        return jp_asyncio_loop.run_until_complete(asyncio.wait_for(aw, timeout))
    return run


@pytest.fixture
def live_run(gpu_lab_home):
    """A registry run backed by a real process in its own session (what a supervisor is)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)
    reg = Registry()
    run_id = f"srv-{uuid.uuid4().hex[:8]}"
    reg.create_run(run_id, name="server-test", num_processes=2, status="running",
                   run_dir=str(gpu_lab_home / "runs" / run_id))
    reg.update(run_id, pid=proc.pid, pgid=proc.pid, pid_started=psutil.Process(proc.pid).create_time())
    reg.add_metrics([(run_id, 0, s, time.time() + s * 1e-3, "loss", 2.0 / (s + 1)) for s in range(50)])
    yield run_id, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _wait_for(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _read_until(run_loop, ws, kind: str, limit: int = 50) -> dict:
    """The next websocket message of type `kind` (samples may arrive in between)."""
    for _ in range(limit):
        msg = json.loads(run_loop(ws.read_message()))
        if msg["type"] == kind:
            return msg
    raise AssertionError(f"no {kind!r} message in {limit} messages")


# --- authentication --------------------------------------------------------------------------------
def test_every_endpoint_answers_403_without_token(jp_fetch, jp_ws_fetch, run_loop, sampler,
                                                  live_run):
    run_id, proc = live_run
    for parts in ENDPOINTS_GET:
        parts = tuple(run_id if p == "RUNID" else p for p in parts)
        with pytest.raises(tornado.httpclient.HTTPClientError) as e:
            run_loop(jp_fetch(*parts, headers={"Authorization": ""}))
        assert e.value.code == 403, ("/".join(parts), e.value.code)
        # a wrong token is no better than none
        with pytest.raises(tornado.httpclient.HTTPClientError) as e:
            run_loop(jp_fetch(*parts, headers={"Authorization": "token not-the-token"}))
        assert e.value.code == 403, ("/".join(parts), e.value.code)
    for action in ENDPOINTS_POST:
        for auth in ("", "token not-the-token"):
            with pytest.raises(tornado.httpclient.HTTPClientError) as e:
                run_loop(jp_fetch("gpu-lab", "api", "runs", run_id, action, method="POST",
                                  body=b"", headers={"Authorization": auth}))
            assert e.value.code == 403, (action, e.value.code)
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        run_loop(jp_ws_fetch("gpu-lab", "api", "telemetry", "ws", headers={"Authorization": ""}))
    assert e.value.code == 403
    # nothing was stopped, checkpointed or resumed, and the tokenless websocket never made the
    # hub subscribe
    assert proc.poll() is None
    reg = Registry()
    assert reg.get_run(run_id)["status"] == "running"
    assert not (Path(reg.get_run(run_id)["run_dir"]) / "control").exists()
    assert [r["id"] for r in reg.list_runs()] == [run_id]
    assert sampler.stats["subscribers"] == 0


def test_cross_origin_post_without_xsrf_is_refused(jp_fetch, jp_serverapp, jp_http_port,
                                                   jp_base_url, run_loop, sampler, live_run):
    run_id, proc = live_run
    token = jp_serverapp.identity_provider.token
    # log in the way a browser does (token in the URL): the server answers with a login cookie
    r = run_loop(jp_fetch("gpu-lab", "api", "runs", params={"token": token},
                          headers={"Authorization": ""}))
    cookies = [v.split(";", 1)[0] for k, v in r.headers.get_all() if k.lower() == "set-cookie"]
    login = [c for c in cookies if c.startswith("username-")]
    assert login, cookies
    cookie = "; ".join(login)
    # the cookie alone authenticates a GET ...
    r = run_loop(jp_fetch("gpu-lab", "api", "runs", headers={"Authorization": "", "Cookie": cookie}))
    assert run_id in [x["id"] for x in json.loads(r.body)["runs"]]
    # ... but a POST from another origin carrying that cookie and no XSRF token is refused
    for origin in ("http://evil.example", None):
        headers = {"Authorization": "", "Cookie": cookie}
        if origin:
            headers["Origin"] = origin
        with pytest.raises(tornado.httpclient.HTTPClientError) as e:
            run_loop(jp_fetch("gpu-lab", "api", "runs", run_id, "stop", method="POST", body=b"",
                              headers=headers))
        assert e.value.code in (403, 404), e.value.code  # 404: jupyter_server's origin check
    assert proc.poll() is None, "a refused POST must not stop the run"
    assert Registry().get_run(run_id)["status"] == "running"
    # control: the same cookie with a matching XSRF cookie/header pair (what JupyterLab sends) works
    r = run_loop(jp_fetch("gpu-lab", "api", "runs", run_id, "stop", method="POST", body=b"",
                          headers={"Authorization": "", "Cookie": f"{cookie}; _xsrf=5eed",
                                   "X-XSRFToken": "5eed"}))
    assert json.loads(r.body)["status"] == "stopped"
    assert proc.wait(20) is not None


def test_no_auth_warning_with_unauthenticated_access_disallowed(jp_configurable_serverapp,
                                                                 jp_server_config, sampler):
    config = {"ServerApp": {**jp_server_config["ServerApp"],
                            "allow_unauthenticated_access": False}}
    from jupyter_server.utils import JupyterServerAuthWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app = jp_configurable_serverapp(config=config)
    assert app.allow_unauthenticated_access is False
    assert "gpu_lab" in app.web_app.settings, "the extension did not load"
    auth_warnings = [str(w.message) for w in caught
                     if issubclass(w.category, JupyterServerAuthWarning)]
    assert not auth_warnings, auth_warnings


# --- telemetry -------------------------------------------------------------------------------------
def test_telemetry_rest_returns_host_stats_and_history(jp_fetch, run_loop, sampler):
    r = run_loop(jp_fetch("gpu-lab", "api", "telemetry", params={"n": 5}))
    body = json.loads(r.body)
    latest = body["latest"]
    assert latest["gpus"] == []  # no GPU on this host
    assert 0.0 <= latest["host"]["cpu_pct"] <= 100.0
    assert latest["host"]["ram_total_mb"] > 0
    assert body["min_interval"] == 0.25
    assert len(body["history"]) >= 1
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        run_loop(jp_fetch("gpu-lab", "api", "telemetry", params={"n": "lots"}))
    assert e.value.code == 400 and b"query parameter n" in e.value.response.body


@pytest.mark.slow  # over half a second
def test_websocket_streams_one_sampler_for_many_clients(jp_ws_fetch, run_loop, sampler,
                                                        jp_serverapp):
    hub = jp_serverapp.web_app.settings["gpu_lab"].hub
    clients = [run_loop(jp_ws_fetch("gpu-lab", "api", "telemetry", "ws")) for _ in range(3)]
    for ws in clients:
        first = json.loads(run_loop(ws.read_message()))
        assert first["type"] == "snapshot"
    _wait_for(lambda: hub.subscribed, what="hub subscription")
    assert sampler.stats["subscribers"] == 1, "three clients must share one subscription"
    assert sampler.stats["threads_started"] == 1
    # a client asking for 100 Hz is clamped to 4 Hz; the sampler follows the fastest client
    clients[0].write_message(json.dumps({"interval": 0.01}))
    assert _read_until(run_loop, clients[0], "interval") == {"type": "interval", "interval": 0.25}
    assert sampler.interval == 0.25
    clients[1].write_message("not json")
    assert "interval" in _read_until(run_loop, clients[1], "error")["error"]
    for ws in clients:
        assert _read_until(run_loop, ws, "sample")["sample"]["host"]["ram_total_mb"] > 0
    for ws in clients:
        ws.close()
    deadline = time.monotonic() + 20
    while hub.subscribed and time.monotonic() < deadline:
        run_loop(asyncio.sleep(0.05))  # let the server's IOLoop see the closes
    assert not hub.subscribed
    _wait_for(lambda: not sampler.running, what="sampler thread to stop")
    assert sampler.stats["subscribers"] == 0


# --- runs ------------------------------------------------------------------------------------------
def test_runs_list_detail_and_stop_a_real_process(jp_fetch, run_loop, sampler, live_run):
    run_id, proc = live_run
    runs = json.loads(run_loop(jp_fetch("gpu-lab", "api", "runs")).body)["runs"]
    mine = next(r for r in runs if r["id"] == run_id)
    assert mine["status"] == "running"
    assert mine["last_step"] == 49
    assert mine["last_loss"] == pytest.approx(2.0 / 50)
    detail = json.loads(run_loop(jp_fetch("gpu-lab", "api", "runs", run_id,
                                          params={"points": 10})).body)
    loss = detail["series"]["loss"]["0"]
    assert loss["step"][0] == 0 and loss["step"][-1] == 49
    assert len(loss["value"]) <= 10

    r = run_loop(jp_fetch("gpu-lab", "api", "runs", run_id, "stop", method="POST", body=b""))
    assert json.loads(r.body)["status"] == "stopped"
    assert proc.wait(20) is not None  # the process group got the signal
    row = Registry().get_run(run_id)
    assert row["status"] == "stopped" and row["reason"] == "stopped from JupyterLab"
    runs = json.loads(run_loop(jp_fetch("gpu-lab", "api", "runs")).body)["runs"]
    assert next(r for r in runs if r["id"] == run_id)["status"] == "stopped"

    for parts, method in ((("gpu-lab", "api", "runs", "no-such-run", "stop"), "POST"),
                          (("gpu-lab", "api", "runs", "no-such-run"), "GET")):
        with pytest.raises(tornado.httpclient.HTTPClientError) as e:
            run_loop(jp_fetch(*parts, method=method, body=b"" if method == "POST" else None))
        assert e.value.code == 404
        assert b"no-such-run" in e.value.response.body


# --- the run view: detail, events, logs, controls, comparison, live feed -------------------------
def _get(run_loop, jp_fetch, *parts, **params):
    return json.loads(run_loop(jp_fetch("gpu-lab", "api", *parts, params=params or None)).body)


def _post(run_loop, jp_fetch, *parts):
    return json.loads(run_loop(jp_fetch("gpu-lab", "api", *parts, method="POST", body=b"")).body)


def _http_error(run_loop, jp_fetch, *parts, method="GET", **params):
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        run_loop(jp_fetch("gpu-lab", "api", *parts, method=method,
                          body=b"" if method == "POST" else None, params=params or None))
    return e.value.code, json.loads(e.value.response.body).get("message", "")


def _write_log(run_dir: Path, name: str, text: str) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "logs" / name, "a") as f:
        f.write(text)


def test_run_detail_series_of_every_rank_and_their_mean_bounded(jp_fetch, run_loop, sampler,
                                                                live_run):
    run_id, _ = live_run
    reg = Registry()
    t = time.time()
    # 3000 more steps on two ranks, with one spike on rank 1 that decimation must keep
    reg.add_metrics([(run_id, rank, s, t + s * 1e-3, "loss",
                      (50.0 if (rank, s) == (1, 1234) else 1.0 + rank)) for s in range(50, 3050)
                     for rank in (0, 1)])
    d = _get(run_loop, jp_fetch, "runs", run_id, points=100)
    assert d["seq"] == reg.last_seq(run_id) and d["status"] == "running"
    series = d["series"]["loss"]
    assert set(series) == {"0", "1", "mean"}
    for key in ("0", "1", "mean"):
        assert len(series[key]["value"]) <= 100
        assert len(series[key]["step"]) == len(series[key]["t"]) == len(series[key]["value"])
        assert series[key]["step"][-1] == 3049
    assert max(series["1"]["value"]) == 50.0 and 1234 in series["1"]["step"]
    # the mean over both ranks at each step: 1.5, except the spike's step
    assert series["mean"]["step"][0] == 0  # rank 0 alone reported steps 0-49: its own mean
    mean = dict(zip(series["mean"]["step"], series["mean"]["value"]))
    assert mean[1234] == pytest.approx(25.5)
    assert {v for s, v in mean.items() if 50 <= s != 1234} == {1.5}
    assert d["failure"] is None and d["logs"] == []
    assert d["config"] == {} and d["reason"] is None


def test_run_events_after_a_sequence_number_in_pages(jp_fetch, run_loop, sampler, live_run):
    run_id, _ = live_run
    head = Registry().last_seq(run_id)  # 50 metric events
    page = _get(run_loop, jp_fetch, "runs", run_id, "events", after=10, limit=15)
    assert [e["seq"] for e in page["events"]] == list(range(11, 26))
    assert page["seq"] == 25 and page["more"] is True and page["run"]["id"] == run_id
    assert page["events"][0]["data"] == {"loss": pytest.approx(2.0 / 11)}
    # with the mean over ranks those events make due (a view that polls draws it, computes
    # none): rank 1 never reported, so a step goes once 16 newer came, with rank 0 alone
    assert page["mean"]["loss"]["step"] == list(range(8))
    assert page["mean"]["loss"]["value"] == pytest.approx([2.0 / (s + 1) for s in range(8)])
    last = _get(run_loop, jp_fetch, "runs", run_id, "events", after=head)
    assert last["events"] == [] and last["seq"] == head and last["more"] is False
    assert last["mean"] == {}
    Registry().set_status(run_id, "failed")  # the end gives every step still waiting
    assert _get(run_loop, jp_fetch, "runs", run_id, "events", after=head)["mean"]["loss"][
        "step"] == list(range(33, 50))
    code, msg = _http_error(run_loop, jp_fetch, "runs", run_id, "events", after=-1)
    assert code == 400 and "after" in msg


def test_run_log_tail_and_offsets(jp_fetch, run_loop, sampler, live_run):
    run_id, _ = live_run
    run_dir = Path(Registry().get_run(run_id)["run_dir"])
    _write_log(run_dir, "rank0.log", "".join(f"line {i}\n" for i in range(5000)) + "partial")
    tail = _get(run_loop, jp_fetch, "runs", run_id, "logs", "rank0.log")
    assert tail["text"].startswith("line ") and tail["text"].endswith("line 4999\n")
    assert len(tail["text"]) <= 16 * 1024 and tail["size"] > tail["to"]  # "partial" waits
    _write_log(run_dir, "rank0.log", " now whole\nline 5001\n")
    more = _get(run_loop, jp_fetch, "runs", run_id, "logs", "rank0.log", offset=tail["to"])
    assert more["text"] == "partial now whole\nline 5001\n" and more["to"] == more["size"]
    for name in ("registry.db", "..", "rank0.txt"):
        code, msg = _http_error(run_loop, jp_fetch, "runs", run_id, "logs", name)
        assert code == 400 and "rank<N>.log or supervisor.log" in msg, (name, code, msg)
    # the detail lists each log's tail, in rank order, the supervisor's last
    _write_log(run_dir, "supervisor.log", "supervisor up\n")
    _write_log(run_dir, "rank1.log", "rank one\n")
    logs = _get(run_loop, jp_fetch, "runs", run_id)["logs"]
    assert [x["file"] for x in logs] == ["rank0.log", "rank1.log", "supervisor.log"]
    assert logs[1]["text"] == "rank one\n" and logs[1]["to"] == len("rank one\n")


def test_run_detail_carries_the_triage_of_a_failed_run(jp_fetch, run_loop, sampler,
                                                       gpu_lab_home):
    from gpu_lab.failures import triage

    reg = Registry()
    rid = f"failed-{uuid.uuid4().hex[:6]}"
    run_dir = gpu_lab_home / "runs" / rid
    (run_dir / "errors").mkdir(parents=True)
    try:
        raise ValueError("rank one broke on purpose")
    except ValueError as e:
        failure = triage.from_exception(1, e)
    (run_dir / "errors" / "rank1.json").write_text(json.dumps(failure.to_dict()))
    reg.create_run(rid, name="broken", num_processes=2, status="failed", run_dir=str(run_dir),
                   error="rank 1: ValueError: rank one broke on purpose [user code]")
    d = _get(run_loop, jp_fetch, "runs", rid)
    f = d["failure"]
    assert f["category"] == "user code"
    assert "rank 1: ValueError: rank one broke on purpose" in f["text"]
    assert "What to try (user code)" in f["text"]
    assert [r["rank"] for r in f["ranks"]] == [1]
    assert "raise ValueError" in f["ranks"][0]["traceback"]
    # the one line an end notice gives: the triage's first, root cause first
    assert f["headline"] == f["text"].splitlines()[0] == \
        "rank 1: ValueError: rank one broke on purpose [user code]"
    # a failure recorded without the rank files (a headless job): the registry's text
    (run_dir / "errors" / "rank1.json").unlink()
    f = _get(run_loop, jp_fetch, "runs", rid)["failure"]
    assert "rank one broke" in f["text"]
    assert f["headline"] == "rank 1: ValueError: rank one broke on purpose [user code]"


def test_checkpoint_now_writes_the_control_file_of_a_running_run_only(jp_fetch, run_loop,
                                                                       sampler, live_run):
    run_id, _ = live_run
    run_dir = Path(Registry().get_run(run_id)["run_dir"])
    out = _post(run_loop, jp_fetch, "runs", run_id, "checkpoint")
    # what gpu_lab.control_requested("checkpoint") looks for inside the ranks
    assert out["requested"] == str(run_dir / "control" / "checkpoint")
    assert (run_dir / "control" / "checkpoint").is_file()
    Registry().set_status(run_id, "succeeded")
    code, msg = _http_error(run_loop, jp_fetch, "runs", run_id, "checkpoint", method="POST")
    assert code == 409 and "succeeded" in msg and "only a running run" in msg
    code, _ = _http_error(run_loop, jp_fetch, "runs", "no-such-run", "checkpoint", method="POST")
    assert code == 404


def test_resume_refuses_with_the_librarys_message(jp_fetch, run_loop, sampler, live_run,
                                                  gpu_lab_home):
    run_id, _ = live_run
    code, msg = _http_error(run_loop, jp_fetch, "runs", run_id, "resume", method="POST")
    assert code == 409 and "stop it first" in msg
    # a finished run whose training function was defined in a notebook (no importable entry)
    reg = Registry()
    nb = f"nb-{uuid.uuid4().hex[:6]}"
    reg.create_run(nb, name="from-a-notebook", num_processes=2, status="stopped",
                   output_dir=str(gpu_lab_home / "out" / nb), run_dir=str(gpu_lab_home / nb))
    code, msg = _http_error(run_loop, jp_fetch, "runs", nb, "resume", method="POST")
    assert code == 409 and "not importable (defined in a notebook?)" in msg, msg
    assert len(reg.list_runs()) == 2  # nothing launched


@pytest.mark.slow  # over half a second
def test_resume_launches_a_run_that_continues_from_the_checkpoint(jp_fetch, run_loop, sampler,
                                                                  gpu_lab_home, tmp_path):
    import gpu_lab
    import launch_fns

    cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=8, max_steps=4,
                              num_workers=0, tensorboard=False, num_processes=1,
                              output_dir=str(tmp_path / "runs"))
    first = gpu_lab.launch(launch_fns.fit_params, cfg, name="to-resume")
    assert first.wait(300) == "succeeded", first.error
    out = _post(run_loop, jp_fetch, "runs", first.id, "resume")
    assert out["resumed"] == first.id
    new = out["run"]
    assert new["id"] != first.id and new["name"] == "to-resume"
    assert new["resumed_from"]["run"] == first.id and new["resumed_from"]["step"] == 4
    _wait_for(lambda: Registry().get_run(new["id"])["status"] not in ("pending", "running"),
              timeout=300, what="the resumed run to end")
    assert Registry().get_run(new["id"])["status"] == "succeeded"


def test_compare_names_runs_by_the_config_fields_that_differ(jp_fetch, run_loop, sampler,
                                                             gpu_lab_home):
    import gpu_lab

    reg = Registry()
    ids = []
    for lr in (1e-3, 3e-3):
        rid = f"cmp-{uuid.uuid4().hex[:6]}"
        cfg = gpu_lab.TrainConfig(lr=lr, max_steps=10, output_dir=str(gpu_lab_home / rid))
        reg.create_run(rid, name="sweep", config=cfg.to_dict(), num_processes=2,
                       status="succeeded")
        reg.add_metrics([(rid, rank, s, 100.0 + s, "loss", lr * 1000 + rank) for s in range(10)
                         for rank in (0, 1)])
        ids.append(rid)
    out = _get(run_loop, jp_fetch, "compare", runs=",".join(ids))
    assert out["differ"] == ["lr"]  # output_dir differs too, but per run by construction
    assert [r["label"] for r in out["runs"]] == ["lr=0.001", "lr=0.003"]
    loss = out["metrics"]["loss"]
    assert set(loss) == set(ids)
    assert loss[ids[1]]["value"] == [pytest.approx(3.5)] * 10  # the mean over both ranks
    assert loss[ids[0]]["step"] == list(range(10))
    for bad in (ids[0], f"{ids[0]},not a run id!"):
        code, msg = _http_error(run_loop, jp_fetch, "compare", runs=bad)
        assert code == 400 and f"2 to {MAX_COMPARE} run ids" in msg
    code, msg = _http_error(run_loop, jp_fetch, "compare", runs=f"{ids[0]},nope")
    assert code == 404 and "nope" in msg


@pytest.mark.slow  # 50,000 events written first
def test_a_whole_sweep_compares_each_run_decimated(jp_fetch, run_loop, gpu_lab_home):
    """Fifty runs overlaid: each is decimated to its share of what is drawn."""
    reg = Registry()
    ids = []
    for i in range(50):
        rid = f"sw-{i:02d}-{uuid.uuid4().hex[:4]}"
        reg.create_run(rid, name="sweep", config={"lr": 1e-4 * (i + 1)}, num_processes=1,
                       status="succeeded")
        reg.add_metrics([(rid, 0, s, 100.0 + s, "loss", 1.0 / (s + 1)) for s in range(1000)])
        ids.append(rid)
    out = _get(run_loop, jp_fetch, "compare", runs=",".join(ids))
    loss = out["metrics"]["loss"]
    assert set(loss) == set(ids) and len(out["runs"]) == 50 and out["differ"] == ["lr"]
    drawn = sum(len(loss[r]["step"]) for r in ids)
    assert drawn <= COMPARE_POINTS and all(loss[r]["step"][0] == 0 for r in ids)
    assert all(loss[r]["step"][-1] == 999 for r in ids)  # each run's whole length, decimated


@pytest.mark.slow  # 250 runs written first
def test_the_panel_finds_any_run_and_pages_through_them(jp_fetch, run_loop, gpu_lab_home):
    reg = Registry()
    for i in range(250):
        reg.create_run(f"many-{i:03d}", name=f"trial {i}" if i != 17 else "the-needle",
                       config={"lr": 0.1 if i % 50 == 0 else 0.01, "model": "tiny_cnn"},
                       num_processes=1, status="failed" if i % 25 == 0 else "succeeded")
        reg.update(f"many-{i:03d}", started=1_000_000.0 + i)
    first = _get(run_loop, jp_fetch, "runs", limit="100")
    assert first["total"] == 250 and len(first["runs"]) == 100
    assert first["runs"][0]["id"] == "many-249"  # newest first
    last = _get(run_loop, jp_fetch, "runs", limit="100", offset="200")
    assert [r["id"] for r in last["runs"]] == [f"many-{i:03d}" for i in range(49, -1, -1)]
    assert [r["id"] for r in _get(run_loop, jp_fetch, "runs", q="NEEDLE")["runs"]] == ["many-017"]
    failed = _get(run_loop, jp_fetch, "runs", status="failed")
    assert failed["total"] == 10 and {r["status"] for r in failed["runs"]} == {"failed"}
    lr = _get(run_loop, jp_fetch, "runs", config="lr:0.1")
    assert sorted(r["id"] for r in lr["runs"]) == [f"many-{i:03d}" for i in (0, 50, 100, 150, 200)]
    dated = _get(run_loop, jp_fetch, "runs", since="1000100", until="1000103")
    assert [r["id"] for r in dated["runs"]] == ["many-102", "many-101", "many-100"]
    both = _get(run_loop, jp_fetch, "runs", q="trial", status="failed", config="model:tiny_cnn")
    assert both["total"] == 10
    for bad, words in ((dict(status="finished"), "accepted: pending"),
                       (dict(config="lr=0.1"), "field:value pairs"),
                       (dict(since="yesterday"), "seconds since 1970")):
        code, msg = _http_error(run_loop, jp_fetch, "runs", **bad)
        assert code == 400 and words in msg, msg


def _sweep_rows(reg: Registry, sweep_id: str, trials: dict, seeds: int = 1) -> None:
    """A sweep's spec as gpu_lab.sweep writes it, and its trials' runs as its driver names and
    tags them: {trial: [(status, accuracy or None) per seed]}."""
    from gpu_lab.sweep import study

    study.spec_path(sweep_id).write_text(json.dumps(
        {"id": sweep_id, "name": "lr search", "metric": "accuracy", "direction": "maximize",
         "trials": 6, "seeds": seeds, "parallel": 2, "space": {"lr": [1e-3, 1e-2]}}))
    for trial, runs in trials.items():
        for seed, (status, acc) in enumerate(runs):
            name = study.run_name(sweep_id, trial, seed if seeds > 1 else None)
            rid = f"{name}-run"
            reg.create_run(rid, name=name, status=status, num_processes=1, sweep=sweep_id)
            if acc is not None:
                reg.add_metrics([(rid, 0, 10, time.time(), "accuracy", acc)])


def test_runs_list_groups_a_sweeps_trials_with_a_summary(jp_fetch, run_loop, sampler,
                                                         gpu_lab_home):
    reg = Registry()
    reg.create_run("solo-1", name="solo", status="succeeded")
    _sweep_rows(reg, "sweep-a", {0: [("succeeded", 0.5)], 1: [("pruned", 0.9)],
                                 2: [("succeeded", 0.7)], 3: [("queued", None)]})
    _sweep_rows(reg, "sweep-b", {0: [("succeeded", 0.2), ("succeeded", 0.4)],
                                 1: [("succeeded", 0.5), ("running", 0.9)]}, seeds=2)
    out = _get(run_loop, jp_fetch, "runs")
    runs = {r["id"]: r for r in out["runs"]}
    assert runs["solo-1"]["sweep"] is None and "trial" not in runs["solo-1"]
    t1 = runs["sweep-a-t1-run"]
    assert (t1["sweep"], t1["trial"], t1["trial_seed"], t1["status"], t1["sweep_value"]) == \
        ("sweep-a", 1, None, "pruned", pytest.approx(0.9))
    assert runs["sweep-b-t1-s1-run"]["trial_seed"] == 1
    a = out["sweeps"]["sweep-a"]
    # the pruned trial's 0.9 is not a result; the queued trial is not done
    assert {k: a[k] for k in ("name", "metric", "direction", "trials", "started", "done",
                              "active", "pruned", "best_run")} == \
        {"name": "lr search", "metric": "accuracy", "direction": "maximize", "trials": 6,
         "started": 4, "done": 3, "active": 1, "pruned": 1, "best_run": "sweep-a-t2-run"}
    assert a["best"] == pytest.approx(0.7)
    b = out["sweeps"]["sweep-b"]
    # a trial of two seeds is done when both are, and valued by their mean
    assert (b["started"], b["done"], b["active"], b["seeds"]) == (2, 1, 1, 2)
    assert b["best"] == pytest.approx(0.3) and b["best_run"] == "sweep-b-t0-s0-run"

    # a list that does not hold every run: each sweep shown is still summed up whole
    few = _get(run_loop, jp_fetch, "runs", limit="2")
    assert [r["id"] for r in few["runs"]] == ["sweep-b-t1-s1-run", "sweep-b-t1-s0-run"]
    assert set(few["sweeps"]) == {"sweep-b"} and few["sweeps"]["sweep-b"] == b
    # a sweep whose settings are not on this host: grouped, named by its id, no best
    reg.create_run("stray-t0", name="stray-t0", status="succeeded", sweep="stray")
    stray = _get(run_loop, jp_fetch, "runs")["sweeps"]["stray"]
    assert (stray["name"], stray["done"], stray["metric"], stray["best"]) == \
        ("stray", 1, None, None)


def _run_messages(run_loop, ws, run_id, until, timeout=60.0):
    """Read 'run' messages of run_id until until(state) holds; state accumulates them."""
    state = {"seqs": [], "logs": {}, "rows": [], "mean": {}}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = json.loads(run_loop(ws.read_message(), timeout=timeout))
        if msg.get("type") == "error":
            raise AssertionError(msg)
        if msg.get("type") != "run" or msg["run"] != run_id:
            continue
        state["seqs"] += [e["seq"] for e in msg.get("events", [])]
        for step, value in zip(*(msg.get("mean", {}).get("loss", {}).get(k, []) for k in
                                 ("step", "value"))):
            state["mean"][step] = value  # a step given again replaces what the view had
        for chunk in msg.get("logs", []):
            state["logs"][chunk["file"]] = state["logs"].get(chunk["file"], "") + chunk["text"]
        if "row" in msg:
            state["rows"].append(msg["row"])
        if until(state):
            return state
    raise AssertionError(f"condition not met in {timeout} s: {state}")


@pytest.mark.slow  # over half a second
def test_run_feed_one_read_per_tick_for_many_followers(jp_ws_fetch, jp_fetch, jp_serverapp,
                                                       run_loop, sampler, live_run):
    run_id, proc = live_run
    feeds = jp_serverapp.web_app.settings["gpu_lab"].feeds
    feeds.interval = 0.1
    reg = Registry()
    run_dir = Path(reg.get_run(run_id)["run_dir"])
    _write_log(run_dir, "rank0.log", "before anyone followed\n")
    head = reg.last_seq(run_id)
    clients = [run_loop(jp_ws_fetch("gpu-lab", "api", "telemetry", "ws")) for _ in range(3)]
    # two views level with the registry, one from scratch (it is caught up by a read of its own)
    for i, ws in enumerate(clients):
        ws.write_message(json.dumps({"follow": run_id, "after": head if i else 0,
                                     "logs": {"rank0.log": len("before anyone followed\n")}
                                     if i else {}}))
    first = _run_messages(run_loop, clients[0], run_id, lambda st: len(st["seqs"]) >= head)
    assert first["seqs"] == list(range(1, head + 1))
    assert first["logs"]["rank0.log"] == "before anyone followed\n"  # the tail
    assert first["rows"][0]["status"] == "running"
    _pump_until(run_loop, lambda: feeds.followers == 3, "three followers")
    fams = _families(run_loop(jp_fetch("gpu-lab", "metrics")).body)  # what bench/server_load reads
    assert fams["gpu_lab_server_run_feed_followers"].samples[0].value == 3
    assert {x.labels["kind"] for x in fams["gpu_lab_server_run_feed_reads"].samples} == {
        "shared", "catchup"}
    # new events and log lines (rank1.log appears meanwhile) reach every follower, in order,
    # once, over several ticks; with the mean over ranks, each step once both gave it (rank 1
    # a step behind, so a tick often ends between a step's two reports)
    catchups = feeds.reads["catchup"]
    ticks = feeds.reads["shared"]
    t = time.time()
    for s in range(50, 80):
        reg.add_metrics([(run_id, 0, s, t + s, "loss", 1.0)]
                        + [(run_id, 1, s - 1, t + s, "loss", 3.0)] * (s > 50))
        _write_log(run_dir, "rank0.log", f"step {s}\n")
        _write_log(run_dir, "rank1.log", f"rank 1 step {s}\n")
        if s % 10 == 9:
            done = feeds.reads["shared"]
            _pump_until(run_loop, lambda: feeds.reads["shared"] > done, "a feed tick")
    end = reg.last_seq(run_id)
    for ws in clients:
        st = _run_messages(run_loop, ws, run_id,
                           lambda st: st["seqs"] and st["seqs"][-1] == end
                           and st["logs"].get("rank0.log", "").endswith("step 79\n")
                           and st["logs"].get("rank1.log", "").endswith("step 79\n"))
        assert st["seqs"] == list(range(head + 1, end + 1))
        assert st["logs"]["rank0.log"] == "".join(f"step {s}\n" for s in range(50, 80))
        assert {s: st["mean"].get(s) for s in range(50, 80)} == {
            **{s: 2.0 for s in range(50, 79)}, 79: None}  # 79 waits for rank 1
    assert feeds.reads["shared"] - ticks >= 3
    # one read per tick for the run however many follow: followers that are level read nothing
    # of their own (one that was busy when a tick came would: not here, on loopback)
    assert feeds.reads["catchup"] - catchups < 3
    # a status change reaches every follower as a row
    Registry().set_status(run_id, "stopped", reason="stopped in a test")
    for ws in clients:
        st = _run_messages(run_loop, ws, run_id, lambda st: bool(st["rows"]))
        assert st["rows"][-1]["status"] == "stopped"
        assert st["mean"] == {79: 1.0}  # the end gives the step that waited, with rank 0 alone
        assert st["rows"][-1]["reason"] == "stopped in a test"
    # follow errors name what was wrong; unfollowing and closing leave no feed behind
    clients[0].write_message(json.dumps({"follow": "no-such-run"}))
    assert "no run with id 'no-such-run'" in _read_until(run_loop, clients[0], "error")["error"]
    clients[0].write_message(json.dumps({"follow": run_id, "after": -3}))
    assert "after=-3" in _read_until(run_loop, clients[0], "error")["error"]
    clients[0].write_message(json.dumps({"follow": run_id, "logs": {"../registry.db": 0}}))
    assert "rank<N>.log" in _read_until(run_loop, clients[0], "error")["error"]
    clients[0].write_message(json.dumps({"unfollow": run_id}))
    _pump_until(run_loop, lambda: feeds.followers == 2, "the unfollow")
    for ws in clients:
        ws.close()
    _pump_until(run_loop, lambda: not feeds.runs, "the feed to close with its last follower")
    assert feeds.followers == 0


def test_a_followed_live_run_says_which_gpus_its_ranks_use(jp_ws_fetch, jp_fetch, run_loop,
                                                           monkeypatch, live_run):
    """While a view follows a live run, the shared sampler watches the run's processes: samples
    carry the device memory they hold per GPU, and the view matches it to the ranks' pids."""
    from gpu_lab.telemetry.doubles import FakeGPU

    run_id, proc = live_run
    other = proc.pid + 100000  # a process of someone else's on the second board
    boards = [FakeGPU(uuid="GPU-run", processes={proc.pid: 3 * 1024**3}),
              FakeGPU(uuid="GPU-other", processes={other: 1024**3})]
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML(boards), visible=None))
    monkeypatch.setattr(sampler_mod, "_sampler", s)
    monkeypatch.setattr(sampler_mod, "_sampler_pid", os.getpid())
    try:
        Registry().add_events(run_id, [{"rank": 0, "kind": "status", "t": time.time(),
                                        "data": {"status": "running", "pid": proc.pid}}])
        detail = _get(run_loop, jp_fetch, "runs", run_id)
        assert detail["pids"] == {"0": proc.pid}
        ws = run_loop(jp_ws_fetch("gpu-lab", "api", "telemetry", "ws", params={"interval": 0.25}))
        ws.write_message(json.dumps({"follow": run_id, "after": detail["seq"]}))
        for _ in range(40):
            msg = _read_until(run_loop, ws, "sample")["sample"]
            if msg["gpus"][0].get("process_mem_mb"):
                break
        assert msg["gpus"][0]["process_mem_mb"] == {str(proc.pid): 3072.0}
        assert not msg["gpus"][1].get("process_mem_mb")  # not the run's
        ws.close()

        def watched() -> bool:
            body = json.loads(run_loop(jp_fetch("gpu-lab", "api", "telemetry")).body)
            return bool(body["latest"]["gpus"][0].get("process_mem_mb"))

        _pump_until(run_loop, lambda: not watched(),
                    "the sampler to stop watching the run once nobody follows it")
    finally:
        s.close()


def _pump_until(run_loop, cond, what, timeout=20.0):
    """Wait for the server (on this test's event loop) to get somewhere."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        run_loop(asyncio.sleep(0.05))


# --- prometheus ------------------------------------------------------------------------------------
def _families(body: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_prometheus_exposition_host_and_runs(jp_fetch, run_loop, sampler, live_run):
    run_id, _ = live_run
    r = run_loop(jp_fetch("gpu-lab", "metrics"))
    assert r.headers["Content-Type"].startswith("text/plain")
    fams = _families(r.body)
    cpu = fams["gpu_lab_host_cpu_percent"].samples[0].value
    assert 0.0 <= cpu <= 100.0
    assert fams["gpu_lab_host_memory_total_bytes"].samples[0].value > 0
    assert fams["gpu_lab_gpus"].samples[0].value == 0
    running = [s for s in fams["gpu_lab_runs"].samples if s.labels["status"] == "running"]
    assert running[0].value >= 1
    loss = {s.labels["run_id"]: s.value for s in fams["gpu_lab_run_last_loss"].samples}
    assert loss[run_id] == pytest.approx(2.0 / 50)
    step = {s.labels["run_id"]: s.value for s in fams["gpu_lab_run_last_step"].samples}
    assert step[run_id] == 49


def test_prometheus_exposition_gpus_with_nvml_double(jp_fetch, run_loop, monkeypatch,
                                                     gpu_lab_home):
    # No GPU on CI: the NVML path is fed by FakeNVML, a named test double (two fake H100s).
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML(2), visible=None))
    monkeypatch.setattr(sampler_mod, "_sampler", s)
    monkeypatch.setattr(sampler_mod, "_sampler_pid", os.getpid())
    try:
        fams = _families(run_loop(jp_fetch("gpu-lab", "metrics")).body)
        util = fams["gpu_lab_gpu_utilization_percent"].samples
        assert sorted(x.labels["gpu"] for x in util) == ["0", "1"]
        assert all(x.value == 85 for x in util)
        mem = fams["gpu_lab_gpu_memory_used_bytes"].samples
        assert all(x.value == 20 * 1024**3 for x in mem)
        assert fams["gpu_lab_gpus"].samples[0].value == 2
        nvml_calls = [x for x in fams["gpu_lab_telemetry_sampler_calls"].samples
                      if x.labels["kind"] == "nvml"]
        assert nvml_calls[0].value > 0
        # the same sample over REST, in the sampler's own field names
        body = json.loads(run_loop(jp_fetch("gpu-lab", "api", "telemetry")).body)
        assert [g["util_gpu"] for g in body["latest"]["gpus"]] == [85.0, 85.0]
    finally:
        s.close()


def test_info_finds_the_tutorials_index(jp_fetch, run_loop, sampler, jp_root_dir):
    body = json.loads(run_loop(jp_fetch("gpu-lab", "api", "info")).body)
    assert body["tutorials_index"] is None and body["gpu_count"] == 0
    (jp_root_dir / "notebooks").mkdir()
    (jp_root_dir / "notebooks" / "00_overview.ipynb").write_text("{}")
    body = json.loads(run_loop(jp_fetch("gpu-lab", "api", "info")).body)
    assert body["tutorials_index"] == "notebooks/00_overview.ipynb"


@pytest.mark.skipif(gpu_count() == 0,
                    reason="no GPU visible to NVML on this host; the NVML path is covered "
                           "with FakeNVML in test_prometheus_exposition_gpus_with_nvml_double")
def test_prometheus_exposition_real_gpus(jp_fetch, run_loop, sampler):
    fams = _families(run_loop(jp_fetch("gpu-lab", "metrics")).body)
    assert fams["gpu_lab_gpus"].samples[0].value == gpu_count()
    total = fams["gpu_lab_gpu_memory_total_bytes"].samples
    assert len(total) == gpu_count() and all(x.value > 0 for x in total)
    util = fams["gpu_lab_gpu_utilization_percent"].samples
    assert all(0 <= x.value <= 100 for x in util)
    # the same boards under DCGM-exporter's names, in DCGM's units (MiB, W, MHz); DCGM's `gpu`
    # label is the NVML index, gpu_lab's the CUDA one, so compare totals
    fb_total = _by_gpu(fams, "DCGM_FI_DEV_FB_TOTAL")
    assert len(fb_total) == gpu_count()
    assert sum(v.value for v in fb_total.values()) == pytest.approx(
        sum(x.value for x in total) / 1024**2)
    for x in fb_total.values():
        assert x.labels["UUID"].startswith(("GPU-", "MIG-")), x.labels
        assert x.labels["device"] == f"nvidia{x.labels['gpu']}" and x.labels["modelName"]
    assert all(0 <= x.value <= 100 for x in fams["DCGM_FI_DEV_GPU_UTIL"].samples)
    assert all(0 < x.value < 2000 for x in fams["DCGM_FI_DEV_POWER_USAGE"].samples)
    assert all(0 < x.value < 5000 for x in fams["DCGM_FI_DEV_SM_CLOCK"].samples)


# --- prometheus: DCGM-exporter names, per-run training series, the family switches --------------
@pytest.fixture
def fake_gpus(monkeypatch, gpu_lab_home):
    """The server's sampler fed by FakeNVML (a named double: no GPU on CI), two boards, the second
    without a fan sensor or ECC (a value NVML does not give must be left out, not sent as 0)."""
    from gpu_lab.telemetry.doubles import FakeGPU

    boards = [FakeGPU(uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000"),
              FakeGPU(uuid="GPU-bbbbbbbb-0000-0000-0000-000000000001", name="Fake A100 \"SXM\"",
                      mem_used=1024**3, unsupported={"nvmlDeviceGetFanSpeed",
                                                     "nvmlDeviceGetTotalEccErrors"})]
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML(boards), visible=None))
    monkeypatch.setattr(sampler_mod, "_sampler", s)
    monkeypatch.setattr(sampler_mod, "_sampler_pid", os.getpid())
    yield s
    s.close()


def _by_gpu(fams: dict, name: str) -> dict:
    return {x.labels["gpu"]: x for x in fams[name].samples}


def test_prometheus_dcgm_names_units_and_labels(jp_fetch, run_loop, fake_gpus):
    import socket

    from gpu_lab.server import dcgm

    body = run_loop(jp_fetch("gpu-lab", "metrics")).body
    fams = _families(body)
    util = _by_gpu(fams, "DCGM_FI_DEV_GPU_UTIL")
    assert set(util) == {"0", "1"}
    g0, g1 = util["0"].labels, util["1"].labels
    assert g0 == {"gpu": "0", "UUID": "GPU-aaaaaaaa-0000-0000-0000-000000000000",
                  "device": "nvidia0", "modelName": "Fake H100 80GB HBM3",
                  "Hostname": socket.gethostname()}
    assert g1["modelName"] == 'Fake A100 "SXM"'  # escaped on the wire, intact after parsing
    assert util["0"].value == 85
    # DCGM's units: MiB, W, MHz, C (gpu_lab's own series stay in bytes and hertz)
    assert _by_gpu(fams, "DCGM_FI_DEV_FB_USED")["0"].value == 20 * 1024
    assert _by_gpu(fams, "DCGM_FI_DEV_FB_USED")["1"].value == 1024
    assert _by_gpu(fams, "DCGM_FI_DEV_FB_FREE")["0"].value == 60 * 1024
    assert _by_gpu(fams, "DCGM_FI_DEV_FB_TOTAL")["0"].value == 80 * 1024
    assert _by_gpu(fams, "DCGM_FI_DEV_POWER_USAGE")["0"].value == 350.0
    assert _by_gpu(fams, "DCGM_FI_DEV_GPU_TEMP")["0"].value == 61
    assert _by_gpu(fams, "DCGM_FI_DEV_SM_CLOCK")["0"].value == 1755
    assert _by_gpu(fams, "DCGM_FI_DEV_MEM_CLOCK")["0"].value == 2619
    assert _by_gpu(fams, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")["0"].value == 0x4
    assert _by_gpu(fams, "gpu_lab_gpu_memory_used_bytes")["0"].value == 20 * 1024**3
    assert _by_gpu(fams, "gpu_lab_gpu_sm_clock_hertz")["0"].value == 1755e6
    # what board 1 lacks is absent rather than 0
    assert set(_by_gpu(fams, "DCGM_FI_DEV_FAN_SPEED")) == {"0"}
    # every DCGM family is declared with dcgm-exporter's type; counters keep DCGM's own names
    text = body.decode()
    for name, kind, _, _ in dcgm.FIELDS:
        assert f"# TYPE {name} {kind}\n" in text, name
    assert "\nDCGM_FI_DEV_ECC_SBE_VOL_TOTAL{" in text and "_TOTAL_total" not in text


def _metric_names(body: bytes) -> set[str]:
    return {ln.split()[2] for ln in body.decode().splitlines() if ln.startswith("# TYPE ")}


_ONLY_GPU_LAB = {"jpserver_extensions": {"gpu_lab": True, "jupyter_server_terminals": False}}


@pytest.mark.parametrize("jp_server_config, gone, kept", [
    ({"ServerApp": _ONLY_GPU_LAB, "GpuLabServer": {"dcgm_metrics": False}},
     "DCGM_FI_DEV_", "gpu_lab_gpu_"),
    ({"ServerApp": _ONLY_GPU_LAB, "GpuLabServer": {"gpu_lab_metrics": False}},
     "gpu_lab_gpu_", "DCGM_FI_DEV_"),
    ({"ServerApp": _ONLY_GPU_LAB, "GpuLabServer": {"run_metrics": False}},
     "gpu_lab_run", "gpu_lab_host_"),
], ids=["dcgm-off", "gpu_lab-off", "runs-off"])
def test_prometheus_families_switch_off_in_the_server_config(jp_server_config, gone, kept,
                                                             jp_fetch, run_loop, fake_gpus,
                                                             live_run):
    names = _metric_names(run_loop(jp_fetch("gpu-lab", "metrics")).body)
    assert not [n for n in names if n.startswith(gone)], names
    assert [n for n in names if n.startswith(kept)], names


@pytest.mark.parametrize("jp_argv", [["--GpuLabServer.dcgm_metrics=False",
                                      "--GpuLabServer.gpu_lab_metrics=False"]])
def test_prometheus_families_switch_off_on_the_command_line(jp_argv, jp_fetch, run_loop,
                                                            fake_gpus, live_run):
    names = _metric_names(run_loop(jp_fetch("gpu-lab", "metrics")).body)
    assert not [n for n in names if n.startswith(("DCGM_", "gpu_lab_gpu", "gpu_lab_host"))], names
    assert "gpu_lab_run_last_loss" in names
    # with both telemetry families off, a scrape costs no NVML call at all
    assert fake_gpus.stats["nvml_calls"] == 0


def test_prometheus_training_series_of_active_runs(jp_fetch, run_loop, sampler, live_run,
                                                   gpu_lab_home):
    run_id, _ = live_run
    reg = Registry()
    # what gpu_lab.train.fit logs every log_every steps, on both ranks
    t = time.time()
    reg.add_metrics([(run_id, rank, 60, t + 1, k, v) for rank in (0, 1) for k, v in
                     (("samples_per_s", 512.0), ("step_time", 0.25), ("data_wait", 0.05),
                      ("lr", 3e-4))])
    done = f"done-{uuid.uuid4().hex[:6]}"
    reg.create_run(done, name="finished", num_processes=1, status="succeeded")
    reg.add_metrics([(done, 0, 9, t, k, v) for k, v in (("loss", 0.5), ("samples_per_s", 99.0))])
    fams = _families(run_loop(jp_fetch("gpu-lab", "metrics")).body)

    def series(name):
        return {x.labels["run_id"]: x.value for x in fams[name].samples}

    assert series("gpu_lab_run_samples_per_second") == {run_id: 512.0}  # active runs only
    assert series("gpu_lab_run_data_wait_ratio") == {run_id: pytest.approx(0.2)}
    assert series("gpu_lab_run_learning_rate") == {run_id: pytest.approx(3e-4)}
    assert series("gpu_lab_run_step_seconds") == {run_id: 0.25}
    assert series("gpu_lab_run_last_step")[run_id] == 60
    assert series("gpu_lab_run_last_loss") == {run_id: pytest.approx(2.0 / 50), done: 0.5}
    info = {x.labels["run_id"]: x.labels for x in fams["gpu_lab_run_info"].samples}
    assert info[done]["status"] == "succeeded" and info[run_id]["name"] == "server-test"


@pytest.mark.slow  # launches a run
def test_a_live_run_is_pushed_as_its_recorder_takes_events(jp_ws_fetch, jp_serverapp, run_loop,
                                                           sampler, gpu_lab_home):
    """The feed reads a followed run when its recorder publishes, not on a timer: with the poll
    an hour apart, a launched run's reports still arrive, in order, each once."""
    import gpu_lab
    import launch_fns

    feeds = jp_serverapp.web_app.settings["gpu_lab"].feeds
    feeds.interval = 3600.0
    run = gpu_lab.launch(launch_fns.train_forever, 0.05, num_processes=1, name="pushed")
    try:
        assert run.wait_for_step(2, timeout=120), run.status
        ws = run_loop(jp_ws_fetch("gpu-lab", "api", "telemetry", "ws"))
        ws.write_message(json.dumps({"follow": run.id, "after": 0}))
        head = Registry().last_seq(run.id)
        # under load one write can take twenty steps: wait for a second publication too
        st = _run_messages(run_loop, ws, run.id, lambda st: st["seqs"] and
                           st["seqs"][-1] >= head + 20 and feeds.rings >= 2)
        assert st["seqs"] == list(range(1, st["seqs"][-1] + 1))  # no gap, no duplicate
        assert feeds.rings >= 2  # the recorder's publications, not the (hour-long) poll
        ws.close()
    finally:
        run.stop()
