"""Fan the one shared telemetry sampler out to any number of websocket clients.

The hub holds at most one subscription to `gpu_lab.telemetry.get_sampler()`, taken when the first
client connects and dropped when the last one leaves: fifty browser tabs cost NVML and psutil what
one does (nvdashboard-style "one poller per client" is what this avoids). The sampler runs at the
fastest interval any client asked for, never faster than MIN_INTERVAL. Each sample is encoded to
JSON once and offered to every client; a client receives it only if its own interval has elapsed and
its previous message has left the socket, so a slow client drops samples instead of growing a buffer.

Without any websocket client the sampler thread is not running; REST and Prometheus readers then get
a sample taken on demand, at most one per sampler interval however often they ask.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, Protocol

from .wire import sample_to_wire

MIN_INTERVAL = 0.25  # s; a client may ask for slower updates, never faster than 4 Hz
MAX_INTERVAL = 60.0
DEFAULT_INTERVAL = 1.0
MAX_HISTORY = 600


def clamp_interval(value: Any) -> float:
    """A client's requested update interval in seconds, clamped to [MIN_INTERVAL, MAX_INTERVAL]."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"interval: got {value!r}; expected a number of seconds >= {MIN_INTERVAL}")
    if v != v:  # NaN
        raise ValueError(f"interval: got NaN; expected a number of seconds >= {MIN_INTERVAL}")
    return min(MAX_INTERVAL, max(MIN_INTERVAL, v))


class Client(Protocol):
    """What the hub needs from a websocket connection."""

    interval: float

    def offer(self, message: str, now: float) -> None: ...


class TelemetryHub:
    def __init__(self, sampler_factory: Callable[[], Any], executor: Executor,
                 log: logging.Logger) -> None:
        self._sampler_factory = sampler_factory
        self._executor = executor
        self._log = log
        self._clients: set[Client] = set()
        self._lock = threading.Lock()  # guards the subscription; clients are IOLoop-only
        self._subscribed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._default_interval: float | None = None
        self._fresh_lock = threading.Lock()
        self.samples_seen = 0
        self.messages_sent = 0

    # --- sampler side ---------------------------------------------------------------------------
    def _sampler(self) -> Any:
        return self._sampler_factory()

    def _on_sample(self, sample: Any) -> None:
        """Called on the sampler's thread: hand the sample to the IOLoop and return at once."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._broadcast, sample)

    def _set_subscribed(self, want: bool) -> None:
        """Subscribe or unsubscribe the hub's one callback (blocking: runs in the executor)."""
        with self._lock:
            if want == self._subscribed:
                return
            s = self._sampler()
            if want:
                s.subscribe(self._on_sample)
            else:
                s.unsubscribe(self._on_sample)
            self._subscribed = want

    # --- IOLoop side ----------------------------------------------------------------------------
    async def add(self, client: Client) -> None:
        self._loop = asyncio.get_running_loop()
        self._clients.add(client)
        self.retune()
        await self._loop.run_in_executor(self._executor, self._set_subscribed, True)

    async def remove(self, client: Client) -> None:
        self._clients.discard(client)
        self.retune()
        if not self._clients and self._loop is not None:
            await self._loop.run_in_executor(self._executor, self._sync_subscription)

    def retune(self) -> None:
        """Run the sampler at the fastest interval a client wants (>= MIN_INTERVAL); back to its
        default when nobody is connected. Call after a client joins, leaves or changes interval."""
        wanted = min((c.interval for c in self._clients), default=None)
        s = self._sampler()
        if self._default_interval is None:
            self._default_interval = s.interval
        s.interval = max(MIN_INTERVAL, wanted if wanted is not None else self._default_interval)

    def _sync_subscription(self) -> None:
        # re-check in the executor: a client may have connected while this was queued
        self._set_subscribed(bool(self._clients))

    def _broadcast(self, sample: Any) -> None:
        self.samples_seen += 1
        if not self._clients:
            return
        message = json.dumps({"type": "sample", "sample": sample_to_wire(sample)})
        now = time.monotonic()
        for client in list(self._clients):
            client.offer(message, now)

    @property
    def clients(self) -> int:
        return len(self._clients)

    @property
    def subscribed(self) -> bool:
        return self._subscribed

    # --- snapshots (blocking: call from the executor) --------------------------------------------
    def snapshot(self, n: int) -> dict:
        """The latest sample and the last n samples, in wire format."""
        n = max(0, min(int(n), MAX_HISTORY))
        s = self._sampler()
        latest = self.fresh_latest()
        history = s.history(n) if n else []
        return {
            "latest": sample_to_wire(latest) if latest is not None else None,
            "history": [sample_to_wire(x) for x in history],
            "min_interval": MIN_INTERVAL,
        }

    def fresh_latest(self) -> Any:
        """The sampler's newest sample; taken now if the sampler thread is idle and the newest one
        is older than the sampler interval (blocking: call from the executor)."""
        s = self._sampler()
        with self._fresh_lock:
            latest = s.latest()
            if s.running and latest is not None:
                return latest
            t = latest.get("t") if isinstance(latest, dict) else None
            if t is None or time.time() - t >= s.interval:
                latest = s.sample_once()
            return latest

    def close(self) -> None:
        self._clients.clear()
        try:
            self._set_subscribed(False)
        except Exception as e:  # noqa: BLE001 - shutting down: log, never raise into cleanup
            self._log.warning("gpu_lab: could not unsubscribe from the telemetry sampler: %s", e)
