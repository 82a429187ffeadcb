"""Subscriber side of the event stream: one background thread per process follows any number of runs.

A run's recorder (a fresh interpreter the run's supervisor starts; in a headless job, a thread of
each rank) writes every event to the registry and then publishes it, with its sequence number, on a
PUB socket. This thread holds one SUB socket connected to the recorders
of the runs it follows and hands each run's new events, in sequence order and exactly once, to that
run's subscribers (a Run handle, widgets). What the live socket misses (events before the
subscription took hold, a slow subscriber's overflow, a run without a publisher such as a headless
job) is read back from the registry: on a gap in the sequence numbers, and about every second
without live traffic. So a subscriber never sees a gap, however late it attached.

Each connection is a CURVE client of that run's recorder, with that run's key (given to follow(),
else read from the run's folder; gpu_lab.record.channel): CURVE options are taken at connect(),
so one socket holds many runs' keys. A run whose key this process cannot read (another user's) is
followed through the registry alone, if that can be read; nothing unauthenticated is connected.

It also calls tick callbacks about every 0.25 s so that views can flush what they buffered without
a timer of their own. Subscribers and ticks run on this thread: they must be quick and must only
set traits / call batch_update (never `with output:`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..record import events as ev

log = logging.getLogger(__name__)

Subscriber = Callable[[list], None]


@dataclass
class _Follow:
    run_id: str
    fn: Subscriber
    delivered: int                  # newest sequence number handed to fn
    address: str | None = None      # the recorder's PUB address, once known
    last_live: float = 0.0          # monotonic time of the last live message
    last_check: float = 0.0         # monotonic time of the last registry check
    final: bool = False             # a final status was delivered
    registry: Any = None            # where the run is recorded (None: the default registry)
    key: Any = None                 # the run's ClientKey: without it, no live connection
    connected: bool = False         # to `address`, with `key`


class Receiver:
    TICK = 0.25
    CHECK = 1.0  # s without live traffic before the registry is asked for what was missed

    def __init__(self, registry: Any = None) -> None:
        import zmq

        self._zmq = zmq
        self._registry = registry
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 10_000)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._follows: dict[str, list[_Follow]] = {}
        self._connected: dict[str, int] = {}   # address -> follows using it
        self._topics: dict[str, int] = {}      # run id -> follows subscribed to it
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ticks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.received = 0      # events handed to subscribers
        self.read_back = 0     # of which read back from the registry
        self.errors = 0
        self.unkeyed = 0       # follows without a readable key: registry only, no live events
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu_lab-receiver", daemon=True)
        self._thread.start()

    @property
    def registry(self) -> Any:
        if self._registry is None:
            from ..record.registry import Registry

            self._registry = Registry()
        return self._registry

    # --- subscriptions -----------------------------------------------------------------------------
    def follow(self, run_id: str, fn: Subscriber, *, after: int = 0,
               address: str | None = None, registry: Any = None, key: Any = None) -> None:
        """Call fn(events) with every event of `run_id` whose seq > `after`, in order, once each.
        `address` is the recorder's PUB address; without it the registry row is asked for it.
        `registry`: where the run is recorded (default: $GPU_LAB_HOME's, as it was first asked).
        `key`: the run's ClientKey; without it, the one in the run's folder. A run whose key
        this process cannot read is followed through the registry alone (no live connection)."""
        self._commands.put(("follow", _Follow(run_id, fn, after, address, registry=registry,
                                              key=key)))

    def unfollow(self, run_id: str, fn: Subscriber) -> None:
        self._commands.put(("unfollow", (run_id, fn)))

    def add_tick(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._ticks.append(fn)

    def remove_tick(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._ticks:
                self._ticks.remove(fn)

    def poke(self, run_id: str) -> None:
        """Ask the registry about this run now (its supervisor just exited, say)."""
        self._commands.put(("poke", run_id))

    def inject(self, events: list[dict]) -> None:
        """Deliver events to the followers of their runs as if they had arrived (for tests and
        tools that make events without a recorder); seq numbers are not checked."""
        self._commands.put(("inject", events))

    # --- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        last_tick = time.monotonic()
        while not self._stop.is_set():
            self._apply_commands()
            try:
                ready = dict(poller.poll(int(self.TICK * 1000 / 2)))
            except zmq.ZMQError:  # context terminated
                break
            if self._sub in ready:
                self._drain()
            now = time.monotonic()
            self._check_registry(now)
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

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if cmd == "follow":
                    self._follows.setdefault(arg.run_id, []).append(arg)
                    self._subscribe(arg.run_id, +1)
                    if arg.address:
                        self._connect_follow(arg)
                    self._catch_up(arg, time.monotonic())
                elif cmd == "unfollow":
                    run_id, fn = arg
                    for f in [f for f in self._follows.get(run_id, []) if f.fn == fn]:
                        self._follows[run_id].remove(f)
                        self._subscribe(run_id, -1)
                        if f.connected:
                            self._connect(f.address, -1)
                    if not self._follows.get(run_id):
                        self._follows.pop(run_id, None)
                elif cmd == "poke":
                    for f in self._follows.get(arg, ()):
                        f.last_live = f.last_check = 0.0
                elif cmd == "inject":
                    by_run: dict[str, list] = {}
                    for e in arg:
                        by_run.setdefault(e.get("run", ""), []).append(e)
                    for run_id, events in by_run.items():
                        for f in list(self._follows.get(run_id, ())) + \
                                list(self._follows.get("*", ())):
                            self._call(f, events)
            except Exception:  # noqa: BLE001 - one bad command must not stop the thread
                self.errors += 1
                log.exception("gpu_lab receiver: %s failed", cmd)

    def _subscribe(self, run_id: str, delta: int) -> None:
        n = self._topics.get(run_id, 0) + delta
        topic = run_id.encode()
        if delta > 0 and n == 1:
            self._sub.setsockopt(self._zmq.SUBSCRIBE, topic)
        elif delta < 0 and n == 0:
            self._sub.setsockopt(self._zmq.UNSUBSCRIBE, topic)
        if n:
            self._topics[run_id] = n
        else:
            self._topics.pop(run_id, None)

    def _connect_follow(self, f: _Follow, row: dict | None = None) -> None:
        """Connect to f's recorder with the run's key; without the key, stay on the registry."""
        if f.key is None:
            from ..record.channel import load_client_key

            if row is None:
                try:
                    row = (f.registry or self.registry).get_run(f.run_id) or {}
                except Exception:  # noqa: BLE001 - a locked database: the next registry check
                    self.errors += 1  # learns the address (and the key) again
                    f.address = None
                    return
            f.key = load_client_key(row.get("run_dir"))
        if f.key is None:
            self.unkeyed += 1
            return
        self._connect(f.address, +1, f.key)
        f.connected = True

    def _connect(self, address: str, delta: int, key: Any = None) -> None:
        n = self._connected.get(address, 0) + delta
        if delta > 0 and n == 1:
            key.apply(self._sub)  # connect() takes the CURVE options set now: keys per connection
            self._sub.connect(address)
        elif delta < 0 and n == 0:
            try:
                self._sub.disconnect(address)
            except self._zmq.ZMQError:
                pass
        if n:
            self._connected[address] = n
        else:
            self._connected.pop(address, None)

    def _drain(self) -> None:
        zmq = self._zmq
        for _ in range(1000):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            run_id = frames[0].decode(errors="replace")
            follows = self._follows.get(run_id)
            if not follows:
                continue
            try:
                events = unpack(run_id, frames[1:])
            except (ValueError, KeyError, IndexError):
                self.errors += 1
                continue
            now = time.monotonic()
            for f in list(follows):
                f.last_live = now
                self._deliver(f, events, now)

    def _deliver(self, f: _Follow, events: list[dict], now: float) -> None:
        """Hand f the events it has not seen, reading any gap before them back from the registry."""
        fresh = [e for e in events if e.get("seq", 0) > f.delivered]
        if not fresh:
            return
        first = fresh[0]["seq"]
        if first > f.delivered + 1:
            self._catch_up(f, now, upto=first - 1)
        self._call(f, [e for e in fresh if e["seq"] > f.delivered])

    def _catch_up(self, f: _Follow, now: float, upto: int | None = None) -> None:
        f.last_check = now
        try:
            missed = (f.registry or self.registry).events(f.run_id, after=f.delivered, upto=upto)
        except Exception:  # noqa: BLE001 - a locked database: try again at the next check
            self.errors += 1
            return
        if missed:
            self.read_back += len(missed)
            self._call(f, missed)

    def _check_registry(self, now: float) -> None:
        """For runs with no live traffic lately: read back what was missed, learn the recorder's
        address, and notice an end that no event announced (a supervisor that died)."""
        for follows in list(self._follows.values()):
            for f in follows:
                if f.final or now - max(f.last_live, f.last_check) < self.CHECK:
                    continue
                self._catch_up(f, now)
                try:
                    row = (f.registry or self.registry).get_run(f.run_id)
                except Exception:  # noqa: BLE001
                    self.errors += 1
                    continue
                if row is None:
                    continue
                if not f.address and row.get("events_address"):
                    f.address = row["events_address"]
                    self._connect_follow(f, row)
                if row["status"] not in ev.ACTIVE_STATUSES and not f.final:
                    self._catch_up(f, now)  # the end's own events, written before the status
                    if not f.final:
                        self._call(f, [ev.make(f.run_id, -1, ev.STATUS, {
                            "status": row["status"], "reason": row.get("reason"),
                            "from": "registry"})])

    def _call(self, f: _Follow, events: list[dict]) -> None:
        for e in events:
            if e.get("seq"):
                f.delivered = max(f.delivered, e["seq"])
            if ev.ends_run(e):
                f.final = True
        self.received += len(events)
        try:
            f.fn(events)
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("gpu_lab receiver: subscriber failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)
        self._ctx.term()


def unpack(run_id: str, frames: list[bytes]) -> list[dict]:
    """The events of a recorder's message (see gpu_lab.record.recorder), with their numbers."""
    import json

    head = json.loads(frames[0])
    seq = int(head["first"])
    out: list[dict] = []
    for raw in frames[1:]:
        for e in ev.decode(raw):
            e["seq"], e["run"] = seq, run_id
            seq += 1
            out.append(e)
    if len(out) != int(head["count"]):
        raise ValueError(f"a recorder message announced {head['count']} events, held {len(out)}")
    return out


_receiver: Receiver | None = None
_lock = threading.Lock()


def get_receiver() -> Receiver:
    """The process-wide receiver (made, and its thread started, on first use)."""
    global _receiver
    with _lock:
        if _receiver is None or not _receiver._thread.is_alive():
            _receiver = Receiver()
        return _receiver
