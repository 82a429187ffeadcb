"""Flush throttling for views fed by background threads.

Events arrive as fast as training reports them (thousands per second on a fast GPU with
log_every=1); a browser redraws a plotly figure in tens of milliseconds. Views therefore only mark
themselves dirty when data arrives and redraw at most `max_hz` times a second, from the thread that
owns them (the receiver's tick, or the telemetry sampler). The clock is injectable so tests can
prove the bound without sleeping.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

MAX_HZ = 4.0


class Throttle:
    """`due()` says True at most `max_hz` times per second of `clock` time."""

    def __init__(self, max_hz: float = MAX_HZ, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_hz, bool) or not isinstance(max_hz, (int, float)) or max_hz <= 0:
            raise ValueError(f"Throttle max_hz: got {max_hz!r}; expected a positive number")
        self.min_interval = 1.0 / max_hz
        self.clock = clock
        self._last = float("-inf")
        self.passed = 0

    def due(self) -> bool:
        now = self.clock()
        if now - self._last >= self.min_interval:
            self._last = now
            self.passed += 1
            return True
        return False

    def __repr__(self) -> str:
        return f"Throttle(max_hz={1.0 / self.min_interval:g}, passed={self.passed})"


class Flusher:
    """Dirty flag + throttle + lock: `mark()` from any thread, `maybe_flush()` from the owning
    thread, `flush_now()` from the kernel's main thread (a toggle was clicked).

    `fn` does the actual redraw; calls never overlap. `max_share` caps the CPU the redraws may
    take: after a redraw that took d seconds the next one waits at least d / max_share (at most
    MAX_WAIT), so on a slow or busy machine the plot updates less often instead of slowing
    training down (the kernel shares the cores with the workers on a CPU-only host).
    """

    MAX_WAIT = 5.0  # however slow a redraw was, the next one comes within this many seconds

    def __init__(self, fn: Callable[[], None], max_hz: float = MAX_HZ,
                 clock: Callable[[], float] = time.monotonic,
                 max_share: float | None = 0.02) -> None:
        if max_share is not None and not 0 < max_share <= 1:
            raise ValueError(f"Flusher max_share: got {max_share!r}; expected 0 < share <= 1 or None")
        self._fn = fn
        self.throttle = Throttle(max_hz, clock)
        self.max_share = max_share
        self._dirty = False
        self._lock = threading.RLock()
        self._not_before = float("-inf")
        self.flushes = 0
        self.busy = 0.0  # seconds spent redrawing

    def mark(self) -> None:
        self._dirty = True

    @property
    def dirty(self) -> bool:
        return self._dirty

    def maybe_flush(self) -> bool:
        """Redraw if something changed and the throttle allows it; True if it redrew."""
        if not self._dirty or self.throttle.clock() < self._not_before or not self.throttle.due():
            return False
        return self.flush_now()

    def flush_now(self) -> bool:
        with self._lock:
            self._dirty = False
            self.flushes += 1
            clock = self.throttle.clock
            t0 = clock()
            try:
                self._fn()
            finally:
                now = clock()
                took = max(0.0, now - t0)
                self.busy += took
                if self.max_share:
                    self._not_before = now + min(took / self.max_share, self.MAX_WAIT)
        return True

    def __repr__(self) -> str:
        return f"Flusher(flushes={self.flushes}, dirty={self._dirty}, max_share={self.max_share})"


class Flushes:
    """A view that redraws through `self._flusher` (a Flusher)."""

    _flusher: Flusher

    def flush(self) -> None:
        """Redraw now (the kernel's main thread: construction and the toggles)."""
        self._flusher.flush_now()

    @property
    def flushes(self) -> int:
        return self._flusher.flushes


class FollowsRun(Flushes):
    """A view that follows `self.run`: its `on_events` gets the run's events and its `tick` runs
    on the receiver's thread about every 0.25 s, until `detach()`."""

    run: object
    _attached: bool = False

    def attach(self) -> None:
        if self._attached or self.run is None:
            return
        from ..readers.receiver import get_receiver

        sub = getattr(self.run, "subscribe", None)
        if sub is not None:
            sub(self.on_events)
        get_receiver().add_tick(self.tick)
        self._attached = True

    def detach(self) -> None:
        if not self._attached:
            return
        from ..readers.receiver import get_receiver

        unsub = getattr(self.run, "unsubscribe", None)
        if unsub is not None:
            unsub(self.on_events)
        get_receiver().remove_tick(self.tick)
        self._attached = False

    def on_events(self, events: list) -> None:  # pragma: no cover - every view defines it
        raise NotImplementedError

    def tick(self) -> None:  # pragma: no cover - every view defines it
        raise NotImplementedError
