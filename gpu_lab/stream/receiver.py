"""Kernel side of the event stream: one background thread for every run of this process.

The receiver binds a zmq PULL socket on loopback *before* any fork, so the workers only need its
address. Its thread drains batches, hands each run's events to that run's subscribers (the Run
handle, widgets), and calls tick callbacks about every 0.25 s so that views can flush what they
buffered without a timer of their own. Subscribers run on this thread: they must be quick and must
only set traits / call batch_update (never `with output:`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from . import events as ev

log = logging.getLogger(__name__)

Subscriber = Callable[[list], None]


class Receiver:
    TICK = 0.25

    def __init__(self) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._subs: dict[str, list[Subscriber]] = {}
        self._ticks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.received = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu_lab-receiver", daemon=True)
        self._thread.start()

    # --- subscriptions -----------------------------------------------------------------------------
    def subscribe(self, run_id: str, fn: Subscriber) -> None:
        with self._lock:
            self._subs.setdefault(run_id, []).append(fn)

    def unsubscribe(self, run_id: str, fn: Subscriber) -> None:
        with self._lock:
            lst = self._subs.get(run_id, [])
            if fn in lst:
                lst.remove(fn)
            if not lst:
                self._subs.pop(run_id, None)

    def add_tick(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._ticks.append(fn)

    def remove_tick(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._ticks:
                self._ticks.remove(fn)

    def inject(self, events: list[dict]) -> None:
        """Deliver events as if they had arrived (the supervisor-less paths and tests use it)."""
        self._dispatch(events)

    # --- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(int(self.TICK * 1000)))
            except zmq.ZMQError:  # context terminated
                break
            if self._sock in ready:
                batch: list[dict] = []
                for _ in range(1000):
                    try:
                        raw = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        batch.extend(ev.decode(raw))
                    except ValueError:
                        self.errors += 1
                if batch:
                    self._dispatch(batch)
            now = time.monotonic()
            if now - last_tick >= self.TICK:
                last_tick = now
                with self._lock:
                    ticks = list(self._ticks)
                for fn in ticks:
                    try:
                        fn()
                    except Exception:  # a broken view must not stop the stream
                        self.errors += 1
                        log.exception("gpu_lab receiver: tick callback failed")

    def _dispatch(self, batch: list[dict]) -> None:
        self.received += len(batch)
        by_run: dict[str, list[dict]] = {}
        for e in batch:
            by_run.setdefault(e.get("run", ""), []).append(e)
        for run_id, events in by_run.items():
            with self._lock:
                subs = list(self._subs.get(run_id, ())) + list(self._subs.get("*", ()))
            for fn in subs:
                try:
                    fn(events)
                except Exception:
                    self.errors += 1
                    log.exception("gpu_lab receiver: subscriber failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()
        self._ctx.term()


_receiver: Receiver | None = None
_lock = threading.Lock()


def get_receiver() -> Receiver:
    """The process-wide receiver (made, and its thread started, on first use)."""
    global _receiver
    with _lock:
        if _receiver is None:
            _receiver = Receiver()
        return _receiver
