"""A private Prometheus server (Debian's `prometheus`, installed by `make test`) on 127.0.0.1.

Config, TSDB and log all live in one temp directory; the server listens on a free loopback port
and is stopped (SIGTERM, then SIGKILL) when the context exits, which checks that it is gone.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml

from lab_utils import ARTIFACTS, free_port

BINARY = "prometheus"


def installed() -> bool:
    return shutil.which(BINARY) is not None


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen
    log: Path

    def api(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}api/v1/{path}" + (f"?{q}" if q else ""),
                                    timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector; a PromQL syntax error fails the call (HTTP 400)."""
        try:
            return self.api("query", query=expr)["result"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"Prometheus refused {expr!r}: {e.read().decode()}") from None

    def targets(self) -> dict[str, dict]:
        """The active scrape targets by job name: health ("up"/"down"/"unknown"), lastError."""
        return {t["labels"]["job"]: t for t in self.api("targets")["activeTargets"]}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "-/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@contextlib.contextmanager
def prometheus(tmp: Path, scrape_configs: list[dict], interval: str = "1s",
               name: str = "prometheus") -> Iterator[Prometheus]:
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": interval, "scrape_timeout": interval,
                   "evaluation_interval": interval},
        "scrape_configs": scrape_configs}))
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [BINARY, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    prom = Prometheus(f"http://127.0.0.1:{port}/", proc, log)
    try:
        deadline = time.monotonic() + 60
        while not _ready(prom.url):
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {proc.returncode}:\n"
                                     f"{prom.log_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready after 60 s:\n{prom.log_text()[-3000:]}")
            time.sleep(0.1)
        yield prom
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # flushes the head block and exits
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
