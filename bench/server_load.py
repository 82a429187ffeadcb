"""Load on the server extension: 50 websocket clients streaming telemetry for 30 s on loopback.

A real Jupyter server (with gpu_lab's server extension, as installed) runs in its own process with a
token. Phase 1: one client for 10 s. Phase 2: fifty clients for 30 s, all at the fastest interval
the server allows (0.25 s); meanwhile clients without a (valid) token keep trying the websocket and
the REST endpoints. Measured side by side in this one run:

- the sampler's NVML/psutil call rate (from the server's own Prometheus counters): must stay what it
  is with one client (ratio <= 1.25), with one sampler subscription;
- server CPU (user+system of its process) per wall second: must stay under 0.5 of a core;
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
    def __init__(self, tmp: Path) -> None:
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}/"
        env = dict(os.environ, GPU_LAB_HOME=str(tmp / "home"),
                   JUPYTER_CONFIG_DIR=str(tmp / "cfg"), JUPYTER_RUNTIME_DIR=str(tmp / "rt"))
        cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={tmp}",
               "--ServerApp.log_level=WARN"]
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

    def get(self, path: str, token: str | None = "") -> tuple[int, bytes]:
        token = self.token if token == "" else token
        headers = {"Authorization": f"token {token}"} if token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base + path, headers=headers),
                                        timeout=30) as r:
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


async def client(server: Server, stop: asyncio.Event, counts: list[int], i: int) -> None:
    url = f"ws://127.0.0.1:{server.port}/gpu-lab/api/telemetry/ws?interval={INTERVAL}"
    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {server.token}"}))
    try:
        while not stop.is_set():
            try:
                msg = await asyncio.wait_for(ws.read_message(), 1.0)
            except asyncio.TimeoutError:
                continue
            if msg is None:
                break
            if json.loads(msg)["type"] == "sample":
                counts[i] += 1
    finally:
        ws.close()


async def intruder(server: Server, stop: asyncio.Event, result: dict) -> None:
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
        for path in ("gpu-lab/api/telemetry", "gpu-lab/api/runs", "gpu-lab/metrics"):
            result["attempts"] += 1
            code, _ = await asyncio.to_thread(server.get, path, None)
            result["codes"][code] = result["codes"].get(code, 0) + 1
            if code == 200:
                result["got_data"] += 1
        await asyncio.sleep(0.5)


async def phase(server: Server, n: int, seconds: float, with_intruder: bool) -> dict:
    stop = asyncio.Event()
    counts = [0] * n
    tasks = [asyncio.create_task(client(server, stop, counts, i)) for i in range(n)]
    intr = {"attempts": 0, "got_data": 0, "codes": {}}
    if with_intruder:
        tasks.append(asyncio.create_task(intruder(server, stop, intr)))
    # let every client connect and the sampler settle at its new interval before measuring
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = await asyncio.to_thread(server.counters)
        if c.get("clients") == n and min(counts) > 0:
            break
        await asyncio.sleep(0.2)
    before = await asyncio.to_thread(server.counters)
    counts_before = list(counts)
    await asyncio.sleep(seconds)
    after = await asyncio.to_thread(server.counters)
    counts_after = list(counts)
    stop.set()
    await asyncio.gather(*tasks)
    dt = after["t"] - before["t"]
    per_client = [(b - a) / dt for a, b in zip(counts_before, counts_after)]
    return {
        "clients": n, "seconds": dt,
        "nvml_per_s": (after.get("nvml", 0) - before.get("nvml", 0)) / dt,
        "psutil_per_s": (after["psutil"] - before["psutil"]) / dt,
        "samples_per_s": (after["samples"] - before["samples"]) / dt,
        "subscribers": after.get("subscribers"),
        "server_cores": (after["cpu"] - before["cpu"]) / dt,
        "msgs_per_client_per_s": sum(per_client) / len(per_client),
        "min_msgs_per_client_per_s": min(per_client),
        "intruder": intr,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--baseline-seconds", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu_lab_server_load_") as tmp:
        server = Server(Path(tmp))
        try:
            one = asyncio.run(phase(server, 1, args.baseline_seconds, with_intruder=False))
            many = asyncio.run(phase(server, args.clients, args.seconds, with_intruder=True))
        finally:
            server.close()

    print(f"{'':28}{'1 client':>12}{f'{args.clients} clients':>14}{'ratio':>8}")
    for key, label in (("samples_per_s", "sampler samples/s"),
                       ("psutil_per_s", "psutil calls/s"), ("nvml_per_s", "NVML calls/s"),
                       ("subscribers", "sampler subscriptions"),
                       ("server_cores", "server CPU (cores)"),
                       ("msgs_per_client_per_s", "msgs/s per client"),
                       ("min_msgs_per_client_per_s", "min msgs/s of a client")):
        a, b = one[key], many[key]
        ratio = f"{b / a:8.2f}" if a else f"{'–':>8}"
        print(f"{label:28}{a:12.2f}{b:14.2f}{ratio}")
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
