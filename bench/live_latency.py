"""From report() to the browser: how late a run's reports and the host's telemetry reach a run
view's websocket on a real Jupyter server.

Two real Jupyter servers (gpu_lab's server extension as installed), side by side on loopback: one
as configured by default (the feed reads a run when its recorder publishes), one with
`--GpuLabServer.live_push=False` (the feed reads every run once a second, as before). One real
run, launched here with gpu_lab.launch, reports a step every 0.1 s on one rank. A client on each
server follows it as the run view does (GET runs/<id>, then the lab websocket) and takes, for each
metric event, the time it arrived less the time report() stamped on it; and for each telemetry
sample, the time it arrived less the sample's own time. Same host, same clock.

    .venv/bin/python bench/live_latency.py [--events 150]

Prints p50/p95/max of both latencies on both servers, and their ratio. Exits 1 when the pushing
server's p95 from report() to the websocket is over 0.25 s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import Server  # noqa: E402 - a real Jupyter server with a token, its home

BOUND_P95 = 0.25


def reporter(every: float, steps: int) -> None:
    """The run: one rank that reports a step every `every` seconds."""
    import time as _time

    import gpu_lab

    for step in range(steps):
        gpu_lab.report(step, loss=1.0 / (1 + step))
        _time.sleep(every)


async def follow(server: Server, run_id: str, want: int, latencies: dict) -> None:
    _, body = await asyncio.to_thread(server.get, f"gpu-lab/api/runs/{run_id}?points=10")
    seq = json.loads(body)["seq"]
    url = f"ws://127.0.0.1:{server.port}/gpu-lab/api/telemetry/ws?interval=0.25"
    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {server.token}"}))
    ws.write_message(json.dumps({"follow": run_id, "after": seq}))
    since = time.time()  # what was reported before the view followed arrives with its catch-up
    while len(latencies["report"]) < want:
        raw = await asyncio.wait_for(ws.read_message(), 30)
        now = time.time()
        msg = json.loads(raw)
        if msg["type"] == "sample" and msg["sample"].get("t"):
            latencies["sample"].append(now - msg["sample"]["t"])
        elif msg["type"] == "run":
            latencies["report"] += [now - e["t"] for e in msg.get("events", [])
                                    if e["kind"] == "metric" and e["t"] >= since]
    ws.close()


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "p95": xs[min(len(xs) - 1, int(0.95 * len(xs)))],
            "max": xs[-1], "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=150, help="metric events to time (≥ 100)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_lab_bench_live_"))
    home = tmp / "home"
    os.environ["GPU_LAB_HOME"] = str(home)  # the run and both servers share one registry
    servers = {"push": Server(tmp / "push", home=home),
               "poll": Server(tmp / "poll", home=home, extra=["--GpuLabServer.live_push=False"])}
    import gpu_lab

    run = gpu_lab.launch(reporter, 0.1, a.events + 100, num_processes=1, name="live-latency")
    try:
        assert run.wait_for_step(1, timeout=120), run.status
        lat = {k: {"report": [], "sample": []} for k in servers}

        async def both() -> None:
            await asyncio.gather(*(follow(s, run.id, a.events, lat[k]) for k, s in servers.items()))

        asyncio.run(both())
    finally:
        run.stop()
        for s in servers.values():
            s.close()
    rows = {k: {what: quantiles(v) for what, v in d.items() if v} for k, d in lat.items()}
    print(f"{'server':6s} {'what':28s} {'p50 ms':>8s} {'p95 ms':>8s} {'max ms':>8s} {'n':>5s}")
    for k, d in rows.items():
        for what, q in d.items():
            label = "report() -> websocket" if what == "report" else "telemetry sample -> websocket"
            print(f"{k:6s} {label:28s} {q['p50'] * 1e3:8.0f} {q['p95'] * 1e3:8.0f} "
                  f"{q['max'] * 1e3:8.0f} {q['n']:5d}")
    ratio = rows["poll"]["report"]["p95"] / rows["push"]["report"]["p95"]
    p95 = rows["push"]["report"]["p95"]
    print(f"p95 from report() to the websocket: {p95 * 1e3:.0f} ms pushed, "
          f"{rows['poll']['report']['p95'] * 1e3:.0f} ms polled ({ratio:.1f}x); bound "
          f"{BOUND_P95 * 1e3:.0f} ms: {'met' if p95 <= BOUND_P95 else 'NOT met'}")
    print(json.dumps({"rows": rows, "ratio_p95": ratio}))
    return 0 if p95 <= BOUND_P95 else 1


if __name__ == "__main__":
    sys.exit(main())
