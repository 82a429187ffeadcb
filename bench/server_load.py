"""Load on the server extension: 50 run views following a live run for 30 s on loopback.

A real Jupyter server (with gpu_lab's server extension, as installed) runs in its own process with a
token, and a stand-in for a training run records 2 ranks' reports (20 metric events/s) and log
lines (a line per rank per step) the way a run's recorder and ranks do. Each client is what a run
view is: it opens with GET runs/<id>, then follows the run over the lab websocket (events, log
lines, status), which also streams telemetry, at the fastest interval the server allows (0.25 s).
Phase 1: one client for 10 s. Phase 2: fifty clients for 30 s; meanwhile clients without a (valid)
token keep trying the websocket and the REST endpoints. Measured side by side in this one run:

- the sampler's NVML/psutil call rate (from the server's own Prometheus counters): must stay what it
  is with one client (ratio <= 1.25), with one sampler subscription;
- the run feed's reads of the registry and the logs (shared: one per run per tick): the same with
  fifty clients as with one (ratio <= 1.25); reads of a follower's own (catch-up) are counted too;
- server CPU (user+system of its process) per wall second: must stay under 0.5 of a core;
- every client got every event in order and every log byte once (gaps must be 0);
- tokenless clients: how many got any data (must be 0).

    .venv/bin/python bench/server_load.py [--clients 50] [--seconds 30]

Exits 1 when a bound is broken.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

MAX_RATE_RATIO = 1.25
MAX_SERVER_CORES = 0.5
INTERVAL = 0.25


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, home: Path | None = None, extra: tuple | list = ()) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}/"
        self.home = home or tmp / "home"
        env = dict(os.environ, GPU_LAB_HOME=str(self.home),
                   JUPYTER_CONFIG_DIR=str(tmp / "cfg"), JUPYTER_RUNTIME_DIR=str(tmp / "rt"))
        cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={tmp}",
               "--ServerApp.log_level=WARN", *extra]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(tmp / "server.log", "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {(tmp / 'server.log').read_text()[-3000:]}")
            try:
                if self.get("gpu-lab/api/info")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit("server did not start in 120 s")

    def get(self, path: str, token: str | None = "", method: str = "GET") -> tuple[int, bytes]:
        token = self.token if token == "" else token
        headers = {"Authorization": f"token {token}"} if token else {}
        req = urllib.request.Request(self.base + path, headers=headers, method=method,
                                     data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def counters(self) -> dict[str, float]:
        _, body = self.get("gpu-lab/metrics")
        out: dict[str, float] = {"t": time.monotonic()}
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                if s.name == "gpu_lab_telemetry_sampler_calls_total":
                    out[s.labels["kind"]] = s.value
                elif s.name == "gpu_lab_telemetry_samples_total":
                    out["samples"] = s.value
                elif s.name == "gpu_lab_telemetry_sampler_subscribers":
                    out["subscribers"] = s.value
                elif s.name == "gpu_lab_telemetry_websocket_clients":
                    out["clients"] = s.value
                elif s.name == "gpu_lab_server_run_feed_reads_total":
                    out[f"feed_{s.labels['kind']}"] = s.value
                elif s.name == "gpu_lab_server_run_feed_followers":
                    out["followers"] = s.value
        cpu = self.ps.cpu_times()
        out["cpu"] = cpu.user + cpu.system
        return out

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


class FakeRun:
    """A stand-in for a training run: a process that records 2 ranks' metric events in the
    registry (in batches, like a run's recorder) and appends a line per rank and step to the
    run's logs, STEPS_PER_S steps a second, until it is stopped."""

    def __init__(self, home: Path) -> None:
        self.run_id = f"bench-{secrets.token_hex(3)}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--fake-run", str(home),
                                      self.run_id], env=dict(os.environ, GPU_LAB_HOME=str(home)))

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


STEPS_PER_S = 10


def fake_run(home: Path, run_id: str) -> None:
    from gpu_lab.record.registry import Registry

    reg = Registry(home / "registry.db")
    run_dir = home / "runs" / run_id
    (run_dir / "logs").mkdir(parents=True)
    reg.create_run(run_id, name="bench-run", num_processes=2, status="running",
                   run_dir=str(run_dir), pid=os.getpid(),
                   pid_started=psutil.Process().create_time())
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    logs = [open(run_dir / "logs" / f"rank{r}.log", "a") for r in (0, 1)]
    step = 0
    while not stop:
        t = time.time()
        reg.add_events(run_id, [{"rank": r, "kind": "metric", "t": t, "step": step,
                                 "data": {"loss": 2.0 / (1 + step / 100) + r * 0.01, "lr": 1e-3,
                                          "samples_per_s": 500.0}} for r in (0, 1)])
        for r, f in enumerate(logs):
            f.write(f"rank {r} step {step} loss {2.0 / (1 + step / 100):.4f}\n")
            f.flush()
        step += 1
        time.sleep(1.0 / STEPS_PER_S)
    reg.set_status(run_id, "stopped", reason="the bench ended")


async def client(server: Server, run_id: str, stop: asyncio.Event, stats: dict, i: int) -> None:
    """A run view: the run's summary over REST, then its live feed and telemetry over the
    websocket; checks that events come in order, once, and log bytes without a gap."""
    _, body = await asyncio.to_thread(server.get, f"gpu-lab/api/runs/{run_id}?points=1000")
    detail = json.loads(body)
    seq = detail["seq"]
    logs = {c["file"]: c["to"] for c in detail["logs"]}
    url = f"ws://127.0.0.1:{server.port}/gpu-lab/api/telemetry/ws?interval={INTERVAL}"
    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {server.token}"}))
    ws.write_message(json.dumps({"follow": run_id, "after": seq, "logs": logs}))
    try:
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(ws.read_message(), 1.0)
            except asyncio.TimeoutError:
                continue
            if raw is None:
                break
            msg = json.loads(raw)
            if msg["type"] == "sample":
                stats["samples"][i] += 1
            elif msg["type"] == "run":
                stats["feed"][i] += 1
                for e in msg.get("events", []):
                    if e["seq"] != seq + 1:
                        stats["gaps"][i] += 1
                    seq = e["seq"]
                    stats["events"][i] += 1
                for c in msg.get("logs", []):
                    if c["file"] in logs and c["from"] != logs[c["file"]]:
                        stats["gaps"][i] += 1
                    logs[c["file"]] = c["to"]
                    stats["log_bytes"][i] += c["to"] - c["from"]
            elif msg["type"] == "error":
                stats["errors"].append(msg)
    finally:
        stats["seq"][i] = seq
        ws.close()


async def intruder(server: Server, run_id: str, stop: asyncio.Event, result: dict) -> None:
    """Keeps trying without a valid token: websocket (none / wrong / in the query) and REST."""
    wrong = secrets.token_hex(16)
    while not stop.is_set():
        for headers, query in (({}, ""), ({"Authorization": f"token {wrong}"}, ""),
                               ({}, f"&token={wrong}")):
            url = f"ws://127.0.0.1:{server.port}/gpu-lab/api/telemetry/ws?interval=0.25{query}"
            result["attempts"] += 1
            try:
                ws = await websocket_connect(HTTPRequest(url, headers=headers))
            except HTTPClientError as e:
                result["codes"][e.code] = result["codes"].get(e.code, 0) + 1
                continue
            msg = await asyncio.wait_for(ws.read_message(), 5)
            if msg is not None:
                result["got_data"] += 1
            ws.close()
        for method, path in (("GET", "gpu-lab/api/telemetry"), ("GET", "gpu-lab/api/runs"),
                             ("GET", "gpu-lab/metrics"), ("GET", f"gpu-lab/api/runs/{run_id}"),
                             ("GET", f"gpu-lab/api/runs/{run_id}/events?after=0"),
                             ("GET", f"gpu-lab/api/runs/{run_id}/logs/rank0.log"),
                             ("POST", f"gpu-lab/api/runs/{run_id}/checkpoint")):
            result["attempts"] += 1
            code, _ = await asyncio.to_thread(server.get, path, None, method)
            result["codes"][code] = result["codes"].get(code, 0) + 1
            if code == 200:
                result["got_data"] += 1
        await asyncio.sleep(0.5)


async def phase(server: Server, run_id: str, n: int, seconds: float,
                with_intruder: bool) -> dict:
    stop = asyncio.Event()
    stats = {k: [0] * n for k in ("samples", "feed", "events", "log_bytes", "gaps", "seq")}
    stats["errors"] = []
    tasks = [asyncio.create_task(client(server, run_id, stop, stats, i)) for i in range(n)]
    intr = {"attempts": 0, "got_data": 0, "codes": {}}
    if with_intruder:
        tasks.append(asyncio.create_task(intruder(server, run_id, stop, intr)))
    # let every client connect, catch up and the sampler settle at its interval before measuring
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = await asyncio.to_thread(server.counters)
        if c.get("clients") == n and c.get("followers") == n and min(stats["feed"]) > 0 \
                and min(stats["samples"]) > 0:
            break
        await asyncio.sleep(0.2)
    before = await asyncio.to_thread(server.counters)
    took = {k: list(stats[k]) for k in ("samples", "feed", "events")}
    await asyncio.sleep(seconds)
    after = await asyncio.to_thread(server.counters)
    now = {k: list(stats[k]) for k in ("samples", "feed", "events")}
    stop.set()
    await asyncio.gather(*tasks)
    dt = after["t"] - before["t"]

    def per_client(key: str) -> list[float]:
        return [(b - a) / dt for a, b in zip(took[key], now[key])]

    def rate(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / dt

    return {
        "clients": n, "seconds": dt,
        "nvml_per_s": rate("nvml"), "psutil_per_s": rate("psutil"),
        "samples_per_s": rate("samples"), "subscribers": after.get("subscribers"),
        "feed_shared_per_s": rate("feed_shared"), "feed_catchup_per_s": rate("feed_catchup"),
        "server_cores": (after["cpu"] - before["cpu"]) / dt,
        "msgs_per_client_per_s": sum(per_client("samples")) / n,
        "min_msgs_per_client_per_s": min(per_client("samples")),
        "feed_msgs_per_client_per_s": sum(per_client("feed")) / n,
        "events_per_client_per_s": sum(per_client("events")) / n,
        "gaps": sum(stats["gaps"]), "errors": stats["errors"],
        "log_bytes": min(stats["log_bytes"]),
        "intruder": intr,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--baseline-seconds", type=float, default=10.0)
    ap.add_argument("--fake-run", nargs=2, metavar=("HOME", "RUN_ID"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fake_run:
        fake_run(Path(args.fake_run[0]), args.fake_run[1])
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu_lab_server_load_") as tmp:
        server = Server(Path(tmp))
        run = FakeRun(server.home)
        try:
            deadline = time.monotonic() + 60
            while server.get(f"gpu-lab/api/runs/{run.run_id}")[0] != 200:
                if time.monotonic() > deadline or run.proc.poll() is not None:
                    raise SystemExit("the stand-in run did not start")
                time.sleep(0.2)
            one = asyncio.run(phase(server, run.run_id, 1, args.baseline_seconds,
                                    with_intruder=False))
            many = asyncio.run(phase(server, run.run_id, args.clients, args.seconds,
                                     with_intruder=True))
        finally:
            run.close()
            server.close()

    print(f"{'':32}{'1 client':>12}{f'{args.clients} clients':>14}{'ratio':>8}")
    for key, label in (("samples_per_s", "sampler samples/s"),
                       ("psutil_per_s", "psutil calls/s"), ("nvml_per_s", "NVML calls/s"),
                       ("subscribers", "sampler subscriptions"),
                       ("feed_shared_per_s", "run feed reads/s (shared)"),
                       ("feed_catchup_per_s", "run feed reads/s (catch-up)"),
                       ("server_cores", "server CPU (cores)"),
                       ("msgs_per_client_per_s", "telemetry msgs/s per client"),
                       ("min_msgs_per_client_per_s", "min telemetry msgs/s of a client"),
                       ("feed_msgs_per_client_per_s", "run msgs/s per client"),
                       ("events_per_client_per_s", "run events/s per client"),
                       ("gaps", "events or log bytes missed")):
        a, b = one[key], many[key]
        ratio = f"{b / a:8.2f}" if a else f"{'–':>8}"
        print(f"{label:32}{a:12.2f}{b:14.2f}{ratio}")
    intr = many["intruder"]
    print(f"tokenless attempts: {intr['attempts']}, answered {intr['codes']}, "
          f"got data: {intr['got_data']}")

    failures = []
    ratio = many["psutil_per_s"] / one["psutil_per_s"]
    if ratio > MAX_RATE_RATIO:
        failures.append(f"psutil call rate grew {ratio:.2f}x with {args.clients} clients "
                        f"(bound {MAX_RATE_RATIO}x)")
    if one["nvml_per_s"] and many["nvml_per_s"] / one["nvml_per_s"] > MAX_RATE_RATIO:
        failures.append("NVML call rate grew with the number of clients")
    ratio = many["feed_shared_per_s"] / one["feed_shared_per_s"]
    if ratio > MAX_RATE_RATIO:
        failures.append(f"the run feed read the run {ratio:.2f}x as often with {args.clients} "
                        f"clients (bound {MAX_RATE_RATIO}x)")
    for p in (one, many):
        if p["gaps"] or p["errors"] or not p["events_per_client_per_s"] or not p["log_bytes"]:
            failures.append(f"{p['clients']} client(s): {p['gaps']} gaps, errors {p['errors']}, "
                            f"{p['events_per_client_per_s']:.1f} events/s, {p['log_bytes']} "
                            "log bytes")
    if many["subscribers"] != 1:
        failures.append(f"{many['subscribers']} sampler subscriptions for {args.clients} clients")
    if many["server_cores"] > MAX_SERVER_CORES:
        failures.append(f"server CPU {many['server_cores']:.2f} cores > {MAX_SERVER_CORES}")
    if intr["got_data"] or not intr["attempts"] or set(intr["codes"]) != {403}:
        failures.append(f"tokenless clients: {intr}")
    for f in failures:
        print("FAIL:", f)
    print("OK" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
