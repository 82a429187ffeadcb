"""Worker side of the event stream: report() never blocks training.

`report()` appends to a bounded in-process deque (well under a microsecond) and returns. A sender
thread, started lazily in the process that reports, drains the deque every `interval` seconds,
converts values to floats there (so a CUDA tensor's .item() sync happens off the training thread),
and pushes one batch over a zmq PUSH socket with NOBLOCK. If the kernel is slow or gone, the batch
is dropped and counted, never waited for.
"""
from __future__ import annotations

import atexit
import collections
import os
import threading
import time
from typing import Any

from . import events as ev
from .channel import ENV_KEY, ClientKey


def _to_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    item = getattr(v, "item", None)  # torch / numpy scalars
    if item is not None:
        try:
            if hasattr(v, "detach"):
                v = v.detach()
            return float(v.float().mean().item() if getattr(v, "numel", lambda: 1)() != 1 else v.item())
        except Exception:
            return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class Reporter:
    """Sends events of one process (one rank) to the kernel's receiver.

    Without an address (outside gpu_lab.launch and run_entry) it only counts: report() stays a
    cheap no-op, so a training function runs the same under bare notebook_launcher or torchrun.
    """

    def __init__(self, address: str | None = None, run_id: str | None = None,
                 rank: int | None = None, maxlen: int = 20_000, interval: float = 0.1,
                 key: ClientKey | str | None = None) -> None:
        self.address = address if address is not None else os.environ.get(ev.ENV_ADDRESS)
        # the run's channel key (a launch sets it with the address); without one, the connection
        # is plain, which a run's recorder refuses: only for an open recorder (benchmarks)
        key = key if key is not None or address is not None else (os.environ.get(ENV_KEY) or None)
        self.key = ClientKey.decode(key) if isinstance(key, (str, bytes)) else key
        self.run_id = run_id if run_id is not None else os.environ.get(ev.ENV_RUN_ID, "")
        self.rank = int(rank if rank is not None else os.environ.get("RANK", 0))
        self.maxlen = maxlen
        self.interval = interval
        self.dropped = 0   # events dropped because the queue was full or the socket would block
        self.sent = 0      # events handed to zmq
        self.reported = 0  # calls to report()
        self._q: collections.deque = collections.deque()
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self._reported_dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    # --- the hot path ----------------------------------------------------------------------------
    def report(self, step: int | None = None, **scalars: Any) -> None:
        """Record scalars for `step`. Never blocks; values may be floats, ints or 0-d tensors."""
        self.reported += 1
        if not self.address:
            return
        if self._pid != os.getpid():  # forked (a DataLoader worker, say): start afresh
            self._reset_after_fork()
        q = self._q
        if len(q) >= self.maxlen:
            self.dropped += 1
            return
        q.append((ev.METRIC, step, time.time(), scalars))
        if self._thread is None:
            self._start()

    def _put(self, kind: str, data: dict, step: int | None = None) -> None:
        if not self.address:
            return
        if self._pid != os.getpid():
            self._reset_after_fork()
        self._q.append((kind, step, time.time(), data))
        if self._thread is None:
            self._start()

    def log(self, text: str) -> None:
        self._put(ev.LOG, {"text": str(text)})

    def status(self, status: str, **extra: Any) -> None:
        self._put(ev.STATUS, {"status": status, **extra})

    def error(self, data: dict) -> None:
        self._put(ev.ERROR, data)

    # --- the sender thread -----------------------------------------------------------------------
    def _reset_after_fork(self) -> None:
        self._pid = os.getpid()
        self._q = collections.deque()
        self._thread = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closing = False

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            t = threading.Thread(target=self._run, name="gpu_lab-reporter", daemon=True)
            self._thread = t
            t.start()
            atexit.register(self.close)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 100)  # batches, not events: a gone kernel costs at most this
        sock.setsockopt(zmq.LINGER, 500)      # at exit, give the last batch half a second at most
        if self.key is not None:
            self.key.apply(sock)
        sock.connect(self.address)
        try:
            while True:
                self._wake.wait(self.interval)
                self._wake.clear()
                self._drain(sock, zmq)
                if self._closing:
                    self._drain(sock, zmq)
                    break
        finally:
            sock.close()
            ctx.term()

    def _drain(self, sock: Any, zmq: Any) -> None:
        q = self._q
        batch = []
        while q:
            kind, step, t, data = q.popleft()
            if kind == ev.METRIC:
                data = {k: f for k, f in ((k, _to_float(v)) for k, v in data.items()) if f is not None}
            batch.append({"run": self.run_id, "rank": self.rank, "kind": kind, "t": t,
                          "step": step, "data": data})
            if len(batch) >= 2000:
                self._send(sock, zmq, batch)
                batch = []
        if self.dropped != self._reported_dropped:
            self._reported_dropped = self.dropped
            batch.append({"run": self.run_id, "rank": self.rank, "kind": ev.DROPPED,
                          "t": time.time(), "step": None, "data": {"count": self.dropped}})
        if batch:
            self._send(sock, zmq, batch)

    def _send(self, sock: Any, zmq: Any, batch: list) -> None:
        n = sum(1 for e in batch if e["kind"] != ev.DROPPED)  # the drop notice itself isn't counted
        try:
            sock.send(ev.encode(batch), zmq.NOBLOCK)
            self.sent += n
        except zmq.Again:
            self.dropped += n

    def flush(self, timeout: float = 1.0) -> None:
        """Wait up to `timeout` s for queued events to be handed to zmq (end of a rank's work)."""
        if self._thread is None or self._pid != os.getpid():
            return
        deadline = time.monotonic() + timeout
        self._wake.set()
        while self._q and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.005)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout` s) and stop the sender thread."""
        t = self._thread
        if t is None or self._pid != os.getpid():
            return
        self._closing = True
        self._wake.set()
        t.join(timeout)
        self._thread = None

    def __repr__(self) -> str:
        return (f"Reporter(run={self.run_id!r}, rank={self.rank}, enabled={self.enabled}, "
                f"reported={self.reported}, dropped={self.dropped})")


_reporter: Reporter | None = None
_reporter_lock = threading.Lock()


def get_reporter() -> Reporter:
    """The process-wide Reporter, configured from the environment a launch sets."""
    global _reporter
    with _reporter_lock:
        r = _reporter
        if r is None or r._pid != os.getpid():
            r = _reporter = Reporter()
    return r


def reset_reporter() -> None:
    """Forget the process-wide Reporter (a worker calls this right after the fork)."""
    global _reporter
    _reporter = None


def report(step: int | None = None, **scalars: Any) -> None:
    """Report scalars from inside a training function, on any rank: `report(step, loss=l, lr=lr)`.

    Never blocks and never raises because the kernel is slow or gone; outside a gpu_lab launch it
    does nothing, so the same function runs under torchrun or bare notebook_launcher.
    """
    r = _reporter
    if r is None or r._pid != os.getpid():
        r = get_reporter()
    r.report(step, **scalars)
