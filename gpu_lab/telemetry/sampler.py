"""One sampler thread per process, shared by every view that wants telemetry.

The GPU panel of each Dashboard, the server extension's REST/WebSocket handlers and its Prometheus
endpoint all read from `get_sampler()`. However many of them listen, NVML and psutil are asked once
per interval: `stats` counts the calls so a load test can prove the rate stays flat.

    s = get_sampler()
    s.subscribe(fn)      # fn(sample) on the sampler thread, once per interval; starts the thread
    s.latest()           # newest sample (None before the first)
    s.history(60)        # the last 60 samples, oldest first (bounded, `history_len`)
    s.unsubscribe(fn)    # the thread ends when the last subscriber leaves

A sample is a plain dict: {"seq": int, "t": wall time, "host": {HOST_FIELDS...},
"gpus": [{index, nvml_index, uuid, name, GPU_FIELDS...}, ...]}. Without NVML or a GPU, "gpus" is
empty, `notice` says why (logged once), and the host part keeps coming.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable

from .host import HostSampler
from .nvml import NVMLSampler

log = logging.getLogger("gpu_lab.telemetry")

Subscriber = Callable[[dict], None]

MIN_INTERVAL = 0.25  # NVML's PCIe counters alone block 2 × 20 ms per GPU: faster buys nothing
DEFAULT_INTERVAL = 1.0

_notice_logged = False


class Sampler:
    """The shared sampler (see module docstring). Use `get_sampler()`; construct one directly only
    to inject doubles: `Sampler(gpu=NVMLSampler(nvml=FakeNVML(2)))`."""

    def __init__(self, interval: float = DEFAULT_INTERVAL, history_len: int = 300,
                 gpu: NVMLSampler | None = None, host: HostSampler | None = None) -> None:
        if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"Sampler history_len: got {history_len!r}; expected an int >= 1")
        self.gpu = gpu if gpu is not None else NVMLSampler()
        self.host = host if host is not None else HostSampler()
        self._interval = DEFAULT_INTERVAL
        self.interval = interval
        self._history: collections.deque = collections.deque(maxlen=history_len)
        self._subs: list[Subscriber] = []
        self._watched: collections.Counter = collections.Counter()
        self._lock = threading.Lock()         # subscribers, thread, watched pids
        self._sample_lock = threading.Lock()  # one sample at a time (NVMLSampler isn't thread-safe)
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._gpu_ok: bool | None = None
        self.notice: str | None = None
        self.samples = 0
        self.errors = 0
        self.pid_calls = 0  # psutil calls spent finding the watched processes' children
        self.threads_started = 0

    # --- configuration ---------------------------------------------------------------------------
    @property
    def interval(self) -> float:
        return self._interval

    @interval.setter
    def interval(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"Sampler interval: got {value!r}; expected seconds > 0 "
                             f"(values below {MIN_INTERVAL} are raised to {MIN_INTERVAL})")
        self._interval = max(MIN_INTERVAL, float(value))

    # --- subscriptions ---------------------------------------------------------------------------
    def subscribe(self, fn: Subscriber) -> Subscriber:
        """Call fn(sample) on the sampler thread after every sample; starts the thread if needed."""
        if not callable(fn):
            raise TypeError(f"Sampler.subscribe: expected a callable, got {type(fn).__name__}")
        with self._lock:
            if fn not in self._subs:
                self._subs.append(fn)
            if self._thread is None or not self._thread.is_alive() or self._stop.is_set():
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                                name="gpu_lab-telemetry", daemon=True)
                self.threads_started += 1
                self._thread.start()
        return fn

    def unsubscribe(self, fn: Subscriber) -> None:
        """Stop calling fn; the thread ends (within one interval) when nobody is left."""
        with self._lock:
            if fn in self._subs:
                self._subs.remove(fn)
            if not self._subs and self._stop is not None:
                self._stop.set()

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive() and not self._stop.is_set()

    def watch(self, pid: int) -> None:
        """Report the GPU memory of process `pid` and its descendants (a run's supervisor)."""
        with self._lock:
            self._watched[int(pid)] += 1

    def unwatch(self, pid: int) -> None:
        with self._lock:
            self._watched[int(pid)] -= 1
            if self._watched[int(pid)] <= 0:
                del self._watched[int(pid)]

    # --- reading ---------------------------------------------------------------------------------
    def latest(self) -> dict | None:
        """The newest sample, or None before the first."""
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self, n: int | None = None) -> list[dict]:
        """The last n samples (all kept ones if n is None), oldest first."""
        with self._lock:
            items = list(self._history)
        return items if n is None else items[-n:] if n > 0 else []

    @property
    def stats(self) -> dict[str, Any]:
        """Counters for tests and the server's load check."""
        return {"samples": self.samples, "nvml_calls": self.gpu.calls,
                "psutil_calls": self.host.calls + self.pid_calls, "subscribers": len(self._subs),
                "running": self.running, "interval": self.interval, "errors": self.errors,
                "threads_started": self.threads_started, "gpu_count": len(self.gpu.devices),
                "nvml": bool(self._gpu_ok), "notice": self.notice}

    # --- sampling --------------------------------------------------------------------------------
    def sample_once(self) -> dict:
        """Take one sample now (the thread calls this; tests may too) and keep it in the history."""
        with self._sample_lock:
            if self._gpu_ok is None:
                self._gpu_ok = self.gpu.available
                if not self._gpu_ok:
                    self._host_only_notice(self.gpu.reason or "NVML unavailable")
            host = self.host.sample()
            gpus = self.gpu.sample(self._watched_pids()) if self._gpu_ok else []
            s = {"seq": self.samples, "t": time.time(), "host": host, "gpus": gpus}
            self.samples += 1
        with self._lock:
            self._history.append(s)
        return s

    def _host_only_notice(self, reason: str) -> None:
        global _notice_logged
        self.notice = f"gpu_lab telemetry: {reason}; sampling host metrics only"
        if not _notice_logged:
            _notice_logged = True
            log.warning(self.notice)

    def _watched_pids(self) -> set[int]:
        with self._lock:
            roots = list(self._watched)
        if not roots:
            return set()
        import psutil

        pids: set[int] = set()
        for root in roots:
            pids.add(root)
            try:
                self.pid_calls += 1
                pids.update(p.pid for p in psutil.Process(root).children(recursive=True))
            except psutil.Error:
                pass  # the run ended between two samples
        return pids

    def _run(self, stop: threading.Event) -> None:
        next_t = time.monotonic()
        while not stop.is_set():
            try:
                sample = self.sample_once()
            except Exception:  # a sampler bug must not kill the thread every view depends on
                self.errors += 1
                log.exception("gpu_lab telemetry: sampling failed")
                sample = None
            if sample is not None:
                with self._lock:
                    subs = list(self._subs)
                for fn in subs:
                    if stop.is_set():
                        break
                    try:
                        fn(sample)
                    except Exception:
                        self.errors += 1
                        log.exception("gpu_lab telemetry: subscriber %r failed", fn)
            next_t += self._interval
            delay = next_t - time.monotonic()
            if delay < 0:  # a slow sample (or a suspended laptop): don't try to catch up
                next_t, delay = time.monotonic(), 0.0
            stop.wait(delay)

    def close(self) -> None:
        """Stop the thread, drop subscribers, shut NVML down."""
        with self._lock:
            self._subs.clear()
            stop, t = self._stop, self._thread
        if stop is not None:
            stop.set()
        if t is not None and t is not threading.current_thread():
            t.join(5)
        with self._sample_lock:
            self.gpu.close()

    def __repr__(self) -> str:
        return (f"Sampler(interval={self.interval}, subscribers={len(self._subs)}, "
                f"running={self.running}, samples={self.samples})")


_sampler: Sampler | None = None
_sampler_pid: int | None = None
_lock = threading.Lock()


def get_sampler() -> Sampler:
    """The process-wide sampler (made on first use; its thread starts on the first subscribe)."""
    global _sampler, _sampler_pid
    with _lock:
        if _sampler is None or _sampler_pid != os.getpid():  # a forked child starts afresh
            _sampler, _sampler_pid = Sampler(), os.getpid()
        return _sampler
