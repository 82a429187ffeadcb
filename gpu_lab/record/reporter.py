"""Worker side of the event stream: report() never blocks training, and never raises.

`report()` appends to a bounded in-process deque (well under a microsecond) and returns. A sender
thread, started lazily in the process that reports, drains the deque every `interval` seconds
(events.BATCH_INTERVAL), converts values to floats there (so a CUDA tensor's .item() sync happens off the training thread),
and pushes one batch over a zmq PUSH socket with NOBLOCK to the run's recorder (the process its
supervisor started, which writes the record and republishes it). If the recorder is slow or gone,
the batch is dropped and counted, never waited for.

What cannot be recorded is refused, never raised: a step that is not an int >= 0 (or None) drops
its whole report, at once; a metric value that is not a number (int, float, a tensor or numpy
scalar; NaN and inf are numbers and are recorded) or a name over MAX_NAME characters drops that
metric, in the sender thread. Each refusal is counted by reason (`refused`, `refused_why`, sent
in the `dropped` events of the record), and the first of each reason is told on the rank's
stderr, which is the rank's log. Log texts are cut to MAX_TEXT characters, and batches stay
under MAX_BATCH bytes, so every message fits the recorder's limit.
"""
from __future__ import annotations

import atexit
import collections
import operator
import os
import socket
import reprlib
import sys
import threading
import time
from typing import Any

from . import events as ev
from .channel import ENV_KEY, ClientKey

_MAX_STEP = 2 ** 63
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
# what each refusal reason accepts: the advice of its warning
ACCEPTED = {
    "step": "a step is an int >= 0 (a numpy or torch integer too) or None; pass step=int(step). "
            "The whole report was dropped",
    "value": "a metric value is a number: int, float, a tensor (one element, or its mean is "
             "taken) or a numpy scalar; NaN and inf are recorded. This metric was dropped, the "
             "report's others were kept",
    "name": f"a metric name is at most {ev.MAX_NAME} characters. This metric was dropped",
    "data": f"an event's data is a dict of plain values nested at most {ev.MAX_DEPTH} deep. "
            "The event was dropped",
    "size": f"one report is at most {ev.MAX_EVENT // 1024} KiB once encoded; report fewer "
            "metrics per call. It was dropped",
}


def _to_float(v: Any) -> float | None:
    """The number a metric value stands for, or None when it is not one (bool and text are not)."""
    t = type(v)
    if t is float or t is int:
        try:
            return float(v)
        except OverflowError:
            return None
    if isinstance(v, (bool, str, bytes)):
        return None
    if getattr(v, "item", None) is not None:  # torch / numpy scalars
        try:
            if hasattr(v, "detach"):
                v = v.detach()
                v = v.float().mean() if v.numel() != 1 else v
            x = v.item()
        except Exception:  # noqa: BLE001 - whatever it is, it is not a number we can record
            return None
        return None if isinstance(x, (bool, str, bytes, complex)) else _to_float(x)
    try:
        return float(v)  # numbers.Real and the like
    except Exception:  # noqa: BLE001
        return None


# seconds a closing reporter whose connection is not up yet waits for it: a short rank can be
# done before a busy recorder took its handshake, and its reports would die with it
CONNECT_AT_CLOSE_S = 5.0


class Reporter:
    """Sends events of one process (one rank) to the run's recorder.

    Without an address (outside gpu_lab.launch and gpu_lab.rank.headless) it only counts: report() stays a
    cheap no-op, so a training function runs the same under bare notebook_launcher or torchrun.
    """

    def __init__(self, address: str | None = None, run_id: str | None = None,
                 rank: int | None = None, maxlen: int = 20_000, interval: float = ev.BATCH_INTERVAL,
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
        self._why_hot: dict[str, int] = {}     # counted by the reporting thread (the step) ...
        self._why_sender: dict[str, int] = {}  # ... and by the sender thread (values, names)
        self._q: collections.deque = collections.deque()
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self._reported_dropped = (0, 0)
        self._connected = threading.Event()  # the recorder took the handshake (wait_connected)

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    @property
    def refused_why(self) -> dict[str, int]:
        """{reason: refusals}: reports (a bad step) and metrics (a bad value or name) refused."""
        out = dict(self._why_hot)
        for k, n in list(self._why_sender.items()):
            out[k] = out.get(k, 0) + n
        return out

    @property
    def refused(self) -> int:
        return sum(self.refused_why.values())

    # --- the hot path ----------------------------------------------------------------------------
    def report(self, step: int | None = None, **scalars: Any) -> None:
        """Record scalars for `step`. Never blocks or raises; values may be floats, ints or
        tensors. A step that is not an int >= 0 or None drops the report (counted, told once)."""
        self.reported += 1
        if not self.address:
            return
        if step is not None and (type(step) is not int or not 0 <= step < _MAX_STEP):
            step = self._checked_step(step)
            if step is None:
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

    def _checked_step(self, step: Any) -> int | None:
        """A numpy/torch integer as an int; None (refused, counted, told) for anything else."""
        if not isinstance(step, bool):
            try:
                s = operator.index(step)
                if 0 <= s < _MAX_STEP:
                    return s
            except Exception:  # noqa: BLE001 - not an integer: refused below
                pass
        self._refuse(self._why_hot, "step", f"step={_short.repr(step)}")
        return None

    def _refuse(self, counts: dict, why: str, what: str) -> None:
        """Count a refusal; the first of its reason goes to stderr (the rank's log) at once."""
        n = counts[why] = counts.get(why, 0) + 1
        other = self._why_sender if counts is self._why_hot else self._why_hot
        if n == 1 and why not in other:
            try:
                sys.stderr.write(f"gpu_lab.report (rank {self.rank}): refused {what}: "
                                 f"{ACCEPTED[why]}. Further refusals of this kind are only "
                                 "counted (the run's dropped events).\n")
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - a closed stderr must not break training
                pass

    def _put(self, kind: str, data: dict, step: int | None = None) -> None:
        if not self.address:
            return
        if self._pid != os.getpid():
            self._reset_after_fork()
        self._q.append((kind, step, time.time(), data))
        if self._thread is None:
            self._start()

    def log(self, text: str) -> None:
        self._put(ev.LOG, {"text": _cut(str(text))})

    def status(self, status: str, **extra: Any) -> None:
        self._put(ev.STATUS, {"status": status, **extra})

    def running(self) -> None:
        """A rank's first word: its pid (what NVML lists on the GPUs it uses) and its host (the
        node it runs on, which the run view names on a multi-node run's curves)."""
        self.status("running", pid=os.getpid(), host=socket.gethostname())

    def error(self, data: dict) -> None:
        self._put(ev.ERROR, data)

    def config(self, values: dict) -> None:
        """The run's hyperparameters ({name: plain value}): merged into the run's config."""
        self._put(ev.CONFIG, dict(values))

    def checkpoint(self, path: str, step: int | None = None) -> None:
        """A checkpoint the run's code saved at `step` (a folder or a file): listed on the run."""
        self._put(ev.CHECKPOINT, {"path": os.path.abspath(os.fspath(path))}, step)

    # --- the sender thread -----------------------------------------------------------------------
    def _reset_after_fork(self) -> None:
        self._pid = os.getpid()
        self._q = collections.deque()
        self._thread = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._connected = threading.Event()

    def wait_connected(self, timeout: float) -> bool:
        """Whether the recorder has taken this reporter's connection (its handshake, key
        included) within `timeout` s: what a job's supervisor waits for before it starts ranks
        that would otherwise report to a port nobody listens on yet."""
        if not self.enabled:
            return False
        self._start()
        return self._connected.wait(timeout)

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
        mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.address)
        try:
            while True:
                self._wake.wait(self.interval)
                self._wake.clear()
                if mon is not None and mon.poll(0):
                    self._connected.set()
                    sock.disable_monitor()
                    mon.close(0)
                    mon = None
                self._drain(sock, zmq)
                if self._closing:
                    self._drain(sock, zmq)
                    if mon is not None and self.sent and mon.poll(int(CONNECT_AT_CLOSE_S * 1e3)):
                        self._connected.set()  # the linger below now delivers what is queued
                    break
        finally:
            if mon is not None:
                mon.close(0)
            sock.close()
            ctx.term()

    def _drain(self, sock: Any, zmq: Any) -> None:
        q = self._q
        batch, size = [], 0
        while q:
            kind, step, t, data = q.popleft()
            if kind == ev.METRIC:
                had, data = bool(data), self._metric_data(data)
                if had and not data:  # every metric of it was refused: nothing to record
                    continue
                est = 60 + 30 * len(data) + sum(map(len, data))  # ASCII names; _send checks
            else:
                data, est = self._other_data(data)
                if data is None:
                    continue
            batch.append({"run": self.run_id, "rank": self.rank, "kind": kind, "t": t,
                          "step": step, "data": data})
            size += est
            if len(batch) >= 2000 or size >= ev.MAX_BATCH:
                self._send(sock, zmq, batch)
                batch, size = [], 0
        counts = (self.dropped, self.refused)
        if counts != self._reported_dropped:
            self._reported_dropped = counts
            batch.append({"run": self.run_id, "rank": self.rank, "kind": ev.DROPPED,
                          "t": time.time(), "step": None,
                          "data": {"count": counts[0], "refused": counts[1],
                                   "why": self.refused_why}})
        if batch:
            self._send(sock, zmq, batch)

    def _metric_data(self, data: dict) -> dict:
        """Values as floats; what is not a number, or has too long a name, is refused."""
        out = {}
        for k, v in data.items():
            f = _to_float(v)
            if f is None:
                self._refuse(self._why_sender, "value", f"{_short.repr(k)[1:-1]}={_short.repr(v)}")
            elif len(k) > ev.MAX_NAME or not k:
                self._refuse(self._why_sender, "name", f"a metric named {_short.repr(k)} "
                                                       f"({len(k)} characters)")
            else:
                out[k] = f
        return out

    def _other_data(self, data: Any) -> tuple[dict | None, int]:
        """A status/error/log event's data with long texts cut, and its encoded size; None when
        it cannot be recorded (refused)."""
        if type(data) is not dict or not ev.within_depth(data, ev.MAX_DEPTH):
            self._refuse(self._why_sender, "data", f"data={_short.repr(data)}")
            return None, 0
        data = {k: _cut(v) if isinstance(v, str) else v for k, v in data.items()}
        try:
            size = len(ev.encode([data]))
        except Exception:  # noqa: BLE001 - a cycle, or an object json cannot take
            size = ev.MAX_EVENT + 1
        if size > ev.MAX_EVENT:
            self._refuse(self._why_sender, "size", f"data of {size} bytes")
            return None, 0
        return data, size

    def _send(self, sock: Any, zmq: Any, batch: list) -> None:
        try:
            raw = ev.encode(batch)
        except Exception:  # noqa: BLE001 - found below, event by event
            raw = None
        if raw is None or len(raw) > ev.MAX_BATCH and len(batch) > 1:
            if len(batch) == 1:
                self._refuse(self._why_sender, "size", "an event that cannot be encoded")
                return
            half = len(batch) // 2  # (names of many non-ASCII characters) halves until it fits
            self._send(sock, zmq, batch[:half])
            self._send(sock, zmq, batch[half:])
            return
        if len(raw) > ev.MAX_EVENT and len(batch) == 1:
            self._refuse(self._why_sender, "size", f"a report of {len(raw)} bytes")
            return
        n = sum(1 for e in batch if e["kind"] != ev.DROPPED)  # the drop notice itself isn't counted
        try:
            sock.send(raw, zmq.NOBLOCK)
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
        """Send what is queued (up to `timeout` s; a reporter whose recorder has not taken its
        connection yet waits up to CONNECT_AT_CLOSE_S for it) and stop the sender thread."""
        t = self._thread
        if t is None or self._pid != os.getpid():
            return
        self._closing = True
        self._wake.set()
        t.join(timeout if self._connected.is_set() else max(timeout, CONNECT_AT_CLOSE_S + 1.0))
        self._thread = None

    def __repr__(self) -> str:
        return (f"Reporter(run={self.run_id!r}, rank={self.rank}, enabled={self.enabled}, "
                f"reported={self.reported}, dropped={self.dropped})")


def _cut(text: str) -> str:
    """At most MAX_TEXT characters, saying how much was cut."""
    if len(text) <= ev.MAX_TEXT:
        return text
    return text[:ev.MAX_TEXT] + f" ... [{len(text) - ev.MAX_TEXT} more characters cut]"


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

    Never blocks and never raises because the run's recorder is slow or gone; outside a gpu_lab
    launch it does nothing, so the same function runs under torchrun or bare notebook_launcher.
    """
    r = _reporter
    if r is None or r._pid != os.getpid():
        r = get_reporter()
    r.report(step, **scalars)
