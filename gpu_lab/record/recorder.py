# Long: the recorder and its process protocol (spawn, the queue's news, end, serve) share one
# pipe format and one lifetime.
"""The run's recorder: receives every rank's events, writes them to the registry, republishes them.

Published messages are [run id, {"first": seq, "count": n}, batch, batch, ...]: the batches as
the ranks sent them, whose events, decoded in order, carry the numbers first, first + 1, ...
(a batch that held something the record refuses goes out as the list of events that were kept).

Nothing a rank sends can break the record: each event is checked on its own (events.problem); a bad
one is dropped and counted, and a `dropped` event from rank -1 says how many and why ({"count": 0,
"refused": n, "why": {reason: n}}). A batch the database refuses for what is in it is split until
the events it cannot take are found (dropped and counted the same way, as "unwritable"); only a
database that is locked, busy or failing is retried, in order. No exception ends the loop.

A launched run's recorder is a process of its own, started by the supervisor (`spawn`): the
supervisor is a fork of the kernel, and SQLite's state does not survive a fork (a forked child that
opens the kernel's database gets "disk I/O error", or loses writes), so only a freshly executed
process writes the registry. The supervisor tells it the run's end over its stdin; when stdin
closes without an end (the supervisor was killed), it records the run as lost. In a headless job
each rank runs a Recorder thread of its own (fresh processes, no fork from a kernel).

The ranks' Reporters push batches to its PULL socket; every `interval` (events.BATCH_INTERVAL)
seconds it writes what arrived to the registry in one transaction (which numbers the events) and
then publishes the numbered events on its PUB socket, topic = run id. So anything a subscriber
sees live is already durable, and a subscriber that missed some (it connected late, or fell behind
the PUB socket's high-water mark) reads the gap back from the registry by sequence number.

Both sockets are private to the run (gpu_lab.record.channel): CURVE servers that admit only
the run's client key, which its ranks and its owner's readers hold; connections with another key
are refused before anything they send is read, and counted (`refused`).

Memory is bounded: at most `max_pending` events wait for the database. When the database is slow
the recorder stops draining its socket; zmq's queues fill, and the Reporters' non-blocking sends
fail and are counted as dropped by the rank that made them (reported as a `dropped` event). A rank
never waits for the recorder.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from . import events as ev
from . import storage
from .channel import ClientKey, Gate, RunKeys

log = logging.getLogger(__name__)

BUFFER = 100_000    # default of GPU_LAB_RECORD_BUFFER: events kept while the database cannot write
RETRY_S = 1.0       # while the disk is full, a write is tried again this often


def buffer_size() -> int:
    """GPU_LAB_RECORD_BUFFER: how many events a recorder keeps in memory while its database
    cannot take them (a full disk); what arrives beyond is dropped and counted."""
    raw = os.environ.get("GPU_LAB_RECORD_BUFFER", "")
    try:
        n = int(raw) if raw else BUFFER
    except ValueError:
        raise ValueError(f"GPU_LAB_RECORD_BUFFER={raw!r}: accepted: a whole number of events "
                         f">= 1000 (default {BUFFER})") from None
    if n < 1000:
        raise ValueError(f"GPU_LAB_RECORD_BUFFER={raw!r}: accepted: a whole number of events "
                         f">= 1000 (default {BUFFER})")
    return n


class Recorder:
    def __init__(self, registry: Any, run_id: str, *, publish: bool = True,
                 interval: float = ev.BATCH_INTERVAL, max_pending: int | None = None,
                 keys: RunKeys | None = None, private: bool = True, host: str = "127.0.0.1",
                 port: int | None = None, pub_port: int | None = None,
                 on_written: Callable[[list], None] | None = None, reserve: bool = False) -> None:
        """keys: the run's channel keys (gpu_lab.record.channel); by default a fresh pair, whose
        client key (`client_key`) the ranks and readers must hold. private=False: no CURVE, any
        local process can write and read (only for measuring what the privacy costs).
        host: the interface both sockets bind on; loopback unless other hosts must reach it.
        port: the ranks' socket's port (a restarted recorder listens where the ranks send);
        None: a free one; pub_port: the same for its subscribers. on_written(events): called on
        the recorder's thread after each write. max_pending: events kept while the database
        cannot take them (GPU_LAB_RECORD_BUFFER). reserve: keep a Reserve (gpu_lab.record.storage)
        beside the registry, given back when its disk is full so that the note and the end fit."""
        import zmq

        self.registry = registry
        self.run_id = run_id
        self.interval = interval
        self.max_pending = buffer_size() if max_pending is None else max_pending
        self.host = host
        self.port, self.pub_port = port, pub_port
        # while the storage refuses (storage.FULL / QUOTA / READ_ONLY): paused, not failed
        self.storage: str | None = None
        self.paused_at = 0.0
        self.paused_s = 0.0
        self.lost_paused: dict[int, int] = {}  # dropped while paused, by rank
        self.lost_kinds: dict[str, int] = {}   # and by kind (metric points, logs, ...)
        self._next_try = 0.0
        self.reserve = storage.Reserve(os.path.dirname(str(registry.path)), run_id) \
            if reserve else None
        if self.reserve is not None:
            self.reserve.make()
        self.on_written = on_written
        self._zmq = zmq
        self._ctx = zmq.Context()
        self.keys = (keys or RunKeys.new()) if private else None
        self.client_key: ClientKey | None = self.keys.client if self.keys else None
        # the ZAP handler runs before any socket binds: without one, CURVE admits any client key
        self._gate = Gate(self._ctx, self.keys) if self.keys else None
        self._pull = self._bound(zmq.PULL, zmq.RCVHWM, 1000)
        self.address = self._pull.last_endpoint.decode()
        self._pub = None
        self.publish_address: str | None = None
        if publish:  # a slow subscriber misses, then reads back
            self._pub = self._bound(zmq.PUB, zmq.SNDHWM, 10_000)
            self.publish_address = self._pub.last_endpoint.decode()
        self._pending: list[dict] = []
        # what the pending events arrived as: a rank's batch (bytes, published as it came) or
        # events made here (a list, encoded at publishing)
        self._frames: list[bytes | list] = []
        self._end: dict | None = None  # the run's final status, written with the last events
        self._unchecked = False  # pending holds events that `checked` has not seen (record())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flushed = threading.Condition(self._lock)
        self.received = 0      # events taken from the socket or given to record()
        self.written = 0       # events in the registry
        self.published = 0
        self.write_errors = 0
        self.last_seq = 0
        self.peak_pending = 0
        self.refused_why: dict[str, int] = {}  # events (or messages) dropped here, by reason
        self.unwritable = 0    # received, then refused by the database: never written
        self.loop_errors = 0
        self._noted = 0        # refusals the record has a note of
        self._thread = threading.Thread(target=self._run, name="gpu_lab-recorder", daemon=True)
        self._thread.start()

    def _bound(self, kind: int, hwm_option: int, hwm: int) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(hwm_option, hwm)
        sock.setsockopt(self._zmq.LINGER, 0)
        if kind == self._zmq.PULL:  # before bind: a listener copies its options there
            sock.setsockopt(self._zmq.MAXMSGSIZE, ev.MAX_MESSAGE)
        if self._gate is not None:
            self._gate.secure(sock)
        port = self.port if kind == self._zmq.PULL else self.pub_port
        if port:
            sock.bind(f"tcp://{self.host}:{port}")
        else:
            sock.bind_to_random_port(f"tcp://{self.host}")
        return sock

    def admit(self, public: str) -> None:
        """Admit another node's client key (its public half) to both sockets."""
        if self._gate is None:
            raise ValueError("Recorder.admit: this recorder is not private (private=False); "
                             "it admits every client already")
        self._gate.admit(public)

    @property
    def refused(self) -> int:
        """Connections refused because they held another key (their messages were never read)."""
        return self._gate.refused if self._gate is not None else 0

    # --- input -----------------------------------------------------------------------------------
    def record(self, events: list[dict]) -> None:
        """Add events made in this process (the supervisor's status changes). They are not
        checked against the record's contract as a rank's are: the next write converts strictly,
        so that one the database cannot take is found and dropped."""
        with self._lock:
            self._unchecked = True
            self._pending.extend(events)
            self._frames.append(list(events))
            self.received += len(events)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything received so far is written and published."""
        deadline = time.monotonic() + timeout
        with self._flushed:
            target = self.received
            return self._flushed.wait_for(
                lambda: self.written + self.unwritable >= target
                or self._stop.is_set() and not self._pending,
                max(0.0, deadline - time.monotonic()))

    # --- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        next_write = time.monotonic() + self.interval
        failing = 0
        while True:
            try:
                done, next_write = self._tick(poller, next_write)
                failing = 0
            except Exception:  # noqa: BLE001 - nothing a rank sends may end the record
                self.loop_errors += 1
                failing += 1
                if failing <= 3:
                    log.exception("gpu_lab recorder: an unexpected error; recording goes on")
                if self._stop.is_set() and failing >= 3:
                    break
                time.sleep(min(self.interval, 0.1))  # a fault that repeats must not spin
                continue
            if done:
                break

    def _tick(self, poller: Any, next_write: float) -> tuple[bool, float]:
        """One turn of the loop: take what arrived, write when it is time. (done, next_write)."""
        stopping = self._stop.is_set()
        wait = max(0.0, next_write - time.monotonic())
        room = len(self._pending) < self.max_pending
        if self.storage is not None and not stopping:
            # paused: the ranks never wait; what the buffer cannot keep is dropped and counted
            if self._pull in dict(poller.poll(int(wait * 1000))):
                self._drain(keep=self.max_pending)
        elif room and not stopping:
            ready = dict(poller.poll(int(wait * 1000)))
            if self._pull in ready:
                self._drain()
        elif not stopping:
            time.sleep(min(wait, 0.01))  # full: let the socket's queue hold (and drop) the rest
        if stopping:
            self._drain(bounded=False)  # the end: take everything that arrived
        if (time.monotonic() >= next_write or stopping) and (
                stopping or self.storage is None or time.monotonic() >= self._next_try):
            end, self._end = (self._end, None) if stopping else (None, self._end)
            ok = self._write(end=end)
            next_write = time.monotonic() + self.interval
            if stopping and not ok:  # the database refuses: what is left is counted, and the
                if self.storage is not None:  # end goes in the space the reserve gave back
                    self._end_paused(end)
                return True, next_write
        return stopping and not self._pending, next_write

    def _drain(self, bounded: bool = True, keep: int | None = None) -> int:
        """Take batches from the socket until it is empty or (bounded) `max_pending` events wait:
        a batch holds at most 2,000 events (the Reporter's), so that is the most over the bound.
        keep: take everything, but keep at most this many waiting; the rest is counted by rank
        (`lost_paused`)."""
        zmq = self._zmq
        got = 0
        while keep is not None or not bounded or len(self._pending) < self.max_pending:
            try:
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            events, why = ev.checked(raw)
            if why:
                self._refused(why, raw[:120])
            if keep is not None and len(self._pending) + len(events) > keep:
                kept = events[:max(0, keep - len(self._pending))]
                for e in events[len(kept):]:
                    self._lose(e)
                events, why = kept, why or {"kept": len(kept)}  # published as decoded
            if not events:
                continue
            with self._lock:
                self._pending.extend(events)
                self._frames.append(events if why else raw)  # as decoded: the numbering holds
                self.received += len(events)
                self.peak_pending = max(self.peak_pending, len(self._pending))
            got += len(events)
        return got

    def _refused(self, why: dict[str, int], what: Any) -> None:
        for reason, n in why.items():
            if reason not in self.refused_why:
                log.warning("gpu_lab recorder: refused %d event(s) (%s) from %.120r; further "
                            "refusals of this kind are only counted", n, reason, what)
            self.refused_why[reason] = self.refused_why.get(reason, 0) + n

    def _note(self) -> dict | None:
        """The record's note of the refusals since the last note (cumulative counts), if any."""
        total = sum(self.refused_why.values())
        if total == self._noted:
            return None
        self._noted = total
        return ev.make(self.run_id, -1, ev.DROPPED, {
            "count": 0, "refused": total, "why": dict(self.refused_why),
            "text": f"the run's recorder refused {total} event(s) that cannot be recorded: "
                    + ", ".join(f"{n} {k}" for k, n in sorted(self.refused_why.items()))})

    def _write(self, end: dict | None = None) -> bool:
        with self._lock:
            batch, self._pending = self._pending, []
            frames, self._frames = self._frames, []
            unchecked, self._unchecked = self._unchecked, False
        extra = [e for e in (self._note(),) if e is not None]
        if end is not None:  # the run's last event; the row ends in the same transaction
            extra.append(ev.make(self.run_id, -1, ev.STATUS, end))
        if extra:
            batch += extra
            frames.append(extra)
            with self._lock:
                self.received += len(extra)
        if not batch:
            with self._flushed:
                self._flushed.notify_all()
            return True
        return self._commit([(batch, frames)], end, checked=not unchecked)

    def _commit(self, parts: list, end: dict | None, checked: bool = True) -> bool:
        """Write (events, frames) parts in order, the run's end with the last. A part the database
        refuses for its content is halved until its bad events are found and dropped; when the
        database itself fails, this and the following parts wait for the next write, in order."""
        parts = collections.deque(parts)
        while parts:
            batch, frames = parts.popleft()
            last = end if not parts else None
            try:
                seqs = self.registry.add_events(self.run_id, batch, end=last, checked=checked)
            except Exception as exc:  # noqa: BLE001 - sorted out below
                kind = storage.trouble(exc, self.registry.path)
                if kind is not None:
                    self._pause(kind)
                if kind is not None or _database_trouble(exc):
                    self._retry_later([batch] + [b for b, _ in parts], end, exc)
                    return False
                if len(batch) > 1:
                    half = len(batch) // 2
                    parts.extendleft([(batch[half:], [batch[half:]]), (batch[:half], [batch[:half]])])
                    continue
                self.unwritable += 1
                self._refused({"unwritable": 1}, f"{batch[0]!r:.120} ({exc})")
                note = self._note()
                if note is not None:
                    with self._lock:
                        self.received += 1
                    parts.appendleft(([note], [[note]]))
                continue
            self._publish(seqs, batch, frames)
            if self.storage is not None:
                self._resume()
        return True

    def _retry_later(self, batches: list, end: dict | None, exc: Exception) -> None:
        events = [e for b in batches for e in b]
        self.write_errors += 1
        if self.storage is None:  # a paused record said why once, in words (_pause)
            log.warning("gpu_lab recorder: %d events not yet written (%s); retrying",
                        len(events), exc)
        if end is not None:  # the end goes again with the last write (the loop hands it over)
            events = events[:-1]
            with self._lock:
                self.received -= 1
        with self._lock:  # retried in order, converted strictly (they may hold record()'s)
            self._unchecked = True
            self._pending[:0] = events
            self._frames[:0] = [events]

    # --- a full disk: paused, not failed ----------------------------------------------------------
    def _pause(self, kind: str) -> None:
        """The storage refuses (full, quota, read-only): keep what fits the buffer, try again
        every RETRY_S, give the reserve back and say so in the run's row."""
        self._next_try = time.monotonic() + RETRY_S
        if self.storage is not None:
            return
        self.storage, self.paused_at = kind, time.monotonic()
        if self.reserve is not None:
            self.reserve.release()
        self._say(storage.says(kind, self.registry.path, len(self._pending),
                               sum(self.lost_paused.values())))

    def _resume(self) -> None:
        """It writes again: note how long it waited and what it dropped, take the reserve."""
        kind, self.storage = self.storage, None
        self.paused_s += time.monotonic() - self.paused_at
        if self.reserve is not None:
            self.reserve.make()
        text = storage.says(kind, self.registry.path, 0, sum(self.lost_paused.values()),
                            self.paused_s)
        self._say(text)
        if self.lost_paused:
            self.record([self._lost_note(text)])

    def _lose(self, e: dict) -> None:
        r, kind = e.get("rank", -1), e.get("kind")
        self.lost_paused[r] = self.lost_paused.get(r, 0) + 1
        self.lost_kinds[kind] = self.lost_kinds.get(kind, 0) + 1

    def _lost_note(self, text: str) -> dict:
        lost = sum(self.lost_paused.values())
        return ev.make(self.run_id, -1, ev.DROPPED, {
            "count": lost, "refused": 0, "why": {"record paused": lost},
            "ranks": {str(r): n for r, n in sorted(self.lost_paused.items())},
            "kinds": dict(sorted(self.lost_kinds.items())), "text": text})

    def _say(self, text: str) -> None:
        log.warning("gpu_lab recorder: %s", text)
        try:
            self.registry.update(self.run_id, note=text)
        except Exception:  # noqa: BLE001 - the disk is full: the end says it with the reserve
            pass

    def _end_paused(self, end: dict | None) -> None:
        """The run ends while its storage refuses: what waits is dropped and counted, and the
        end with its note goes in the space the reserve gave back."""
        with self._lock:
            for e in self._pending:
                self._lose(e)
            self._pending, self._frames = [], []
        self.paused_s += time.monotonic() - self.paused_at
        text = storage.says(self.storage, self.registry.path, 0, sum(self.lost_paused.values()),
                            self.paused_s)
        extra = [self._lost_note(text)]
        if end is not None:
            extra.append(ev.make(self.run_id, -1, ev.STATUS, end))
        try:
            self.registry.add_events(self.run_id, extra, end=end)
            self.registry.update(self.run_id, note=text)
        except Exception as exc:  # noqa: BLE001 - nothing more can be done: the log says it
            log.warning("gpu_lab recorder: the run's end could not be recorded either (%s)", exc)

    def _publish(self, seqs: list[int], batch: list, frames: list) -> None:
        if seqs:
            self.last_seq = seqs[-1]
        if self._pub is not None and seqs:
            # the numbers are implied: the events of these frames, decoded in order, are seqs[0],
            # seqs[0] + 1, ...; the ranks' batches travel as they came, without a second encoding
            head = json.dumps({"first": seqs[0], "count": len(batch)}).encode()
            try:
                self._pub.send_multipart([self.run_id.encode(), head] + [
                    f if isinstance(f, bytes) else ev.encode(f) for f in frames], self._zmq.NOBLOCK)
                self.published += len(batch)
            except self._zmq.Again:  # subscribers read it back from the registry
                pass
        with self._flushed:
            self.written += len(batch)
            self._flushed.notify_all()
        if self.on_written is not None:
            self.on_written(batch)

    def close(self, end: dict | None = None, quiet: float = 0.2, timeout: float = 10.0) -> None:
        """Take what the ranks still send (until `quiet` s pass without a message), write and
        publish everything, and close the sockets. `end` ({"status", "reason", "exitcode",
        "error"}) ends the run: the final status event and the row, in one transaction."""
        deadline = time.monotonic() + timeout
        seen, last_change = self.received, time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last_change < quiet:
            time.sleep(0.02)
            if self.received != seen:
                seen, last_change = self.received, time.monotonic()
        self._end = end
        self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        for s in (self._pull, self._pub):
            if s is not None:
                s.close(0)
        if self._gate is not None:
            self._gate.close()
        self._ctx.term()
        if self.reserve is not None:
            self.reserve.release()

    def __repr__(self) -> str:
        return (f"Recorder(run={self.run_id!r}, received={self.received}, written={self.written}, "
                f"pending={len(self._pending)}, write_errors={self.write_errors})")


def _database_trouble(exc: BaseException) -> bool:
    """A locked, busy, full or failing database (retry), not an event it cannot take (split)."""
    import sqlite3

    return isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError


# --- the recorder process of a launched run ---------------------------------------------------------


def spawn(registry_path: str, run_id: str, log_path: str, keys: RunKeys,
          host: str = "127.0.0.1", ports: tuple[int, int] | None = None) -> tuple[Any, dict]:
    """Start the recorder process of a launched run; returns (its RecorderProcess, its
    addresses). Called by the supervisor: `end(proc, status)` tells it the run's end. The run's
    keys go over the process's stdin: never on its command line, which every local user can
    read. host: where it binds; ports: (the ranks', the subscribers') for a replacement."""
    proc, where = _start(registry_path, run_id, log_path, keys, host, ports)
    return RecorderProcess(proc, where, (registry_path, run_id, log_path, keys, host)), where


def _start(registry_path: str, run_id: str, log_path: str, keys: RunKeys, host: str,
           ports: tuple[int, int] | None) -> tuple[Any, dict]:
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])  # gpu_lab's parent: importable from a clone
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "gpu_lab.record.recorder", registry_path,
                                 run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log_file, env=env)
    first = {"keys": keys.encode(), "host": host}
    if ports:
        first.update(port=ports[0], pub_port=ports[1])
    try:
        proc.stdin.write((json.dumps(first) + "\n").encode())
        proc.stdin.flush()
    except OSError:  # it died at once: its log says why
        pass
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"the run's recorder did not start (exit code {proc.returncode}); "
                           f"see {log_path}")
    return proc, json.loads(line)


class RecorderProcess:
    """The supervisor's handle on its run's recorder process: replaced by a new one, on the same
    ports with the same keys, when it dies before the run's end (the OOM killer, say); the
    ranks' and the readers' sockets reconnect to it by themselves. `replaced` counts that."""

    def __init__(self, proc: Any, where: dict, how: tuple) -> None:
        self.proc, self.where, self._how = proc, where, how
        self.replaced = 0
        self.ended = False
        self._admitted: list[dict] = []  # other nodes' keys: a new recorder admits them again
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # stdin, stdout, wait, kill, poll, returncode
        return getattr(self.proc, name)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def replace(self) -> bool:
        """A new recorder where the dead one was; False when the run has ended meanwhile."""
        with self._lock:
            if self.ended or self.alive():
                return False
            code = self.proc.returncode
            t0 = time.monotonic()
            ports = tuple(int(a.rsplit(":", 1)[1]) for a in (self.where["address"],
                                                             self.where["publish"]))
            self.proc, _ = _start(*self._how, ports=ports)
            self.replaced += 1
            _tell(self.proc, {"replaced": {"exitcode": code, "count": self.replaced,
                                           "took_s": round(time.monotonic() - t0, 3)}})
            for msg in self._admitted:
                _tell(self.proc, msg)
                self.proc.stdout.readline()  # its "admitted"
            return True

    def keep(self, interval: float = 0.2) -> threading.Thread:
        """Watch it from a thread of the supervisor, and replace it when it dies."""
        def watch() -> None:
            while not self.ended:
                try:
                    self.proc.wait(interval)
                except Exception:  # noqa: BLE001 - still running (TimeoutExpired)
                    continue
                if not self.ended:
                    try:
                        self.replace()
                    except Exception as exc:  # noqa: BLE001 - it cannot start: say why, once
                        print(f"gpu_lab supervisor: the run's recorder died and could not be "
                              f"replaced ({exc})", file=sys.stderr, flush=True)
                        return
        t = threading.Thread(target=watch, name="gpu_lab-recorder-keeper", daemon=True)
        t.start()
        return t


def end(proc: Any, status: dict, timeout: float = 30.0) -> int | None:
    """Hand the recorder process the run's final status and wait until it has written it (a
    RecorderProcess that died meanwhile is replaced first, and told how many times it was)."""
    if isinstance(proc, RecorderProcess):
        with proc._lock:
            proc.ended = True
        if not proc.alive():
            proc.ended = False
            proc.replace()
            proc.ended = True
        status = dict(status, replaced=proc.replaced)
        proc = proc.proc
    try:
        proc.stdin.write((json.dumps({"end": status}) + "\n").encode())
        proc.stdin.close()
    except OSError:  # it is gone already
        pass
    try:
        return proc.wait(timeout)
    except Exception:  # noqa: BLE001 - stuck: the run's end is still in status.json
        proc.kill()
        return None


def queued(proc: Any, position: int) -> None:
    """Tell the recorder process the run waits in the host's queue, at `position` (1 = next)."""
    _tell(proc, {"queued": {"position": position}})


def started(proc: Any, devices: dict) -> None:
    """Tell the recorder process the run holds its devices (claims.Claim.as_record()) and starts."""
    _tell(proc, {"start": devices})


def admit(proc: Any, public: str, note: dict | None = None, timeout: float = 30.0) -> None:
    """Have the recorder process admit another node's client key; returns once it has. note:
    who that node is ({node_rank, host, run}), for the record."""
    import select

    _tell(proc, {"admit": public, "node": note or {}})
    if isinstance(proc, RecorderProcess):
        proc._admitted.append({"admit": public, "node": note or {}})
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    if json.loads(line or b"{}").get("admitted") != public:
        raise RuntimeError(f"the run's recorder did not admit another node's key within "
                           f"{timeout:.0f} s (it said {line[:200]!r}); see the run's log")


def part_of(proc: Any, where: dict) -> None:
    """Tell the recorder process this node's ranks report to another node's run (`where`)."""
    _tell(proc, {"part_of": where})


def _tell(proc: Any, message: dict) -> None:
    try:
        proc.stdin.write((json.dumps(message) + "\n").encode())
        proc.stdin.flush()
    except OSError:  # it is gone: the registry will say lost
        pass


def _queue_news(reg: Any, rec: "Recorder", run_id: str, said: dict) -> None:
    """The supervisor's word on the host queue: queued at a place, or started on its devices."""
    if isinstance(said.get("queued"), dict):
        pos = said["queued"].get("position")
        pos = pos if type(pos) is int else None
        reg.update(run_id, status="queued", queue_position=pos)
        rec.record([ev.make(run_id, -1, ev.STATUS, {"status": "queued", "position": pos})])
    if isinstance(said.get("start"), dict):
        reg.update(run_id, status="running", devices=said["start"], queue_position=None,
                   started=time.time())
        rec.record([ev.make(run_id, -1, ev.STATUS, {"status": "running"})])


def _node_news(reg: Any, rec: "Recorder", run_id: str, said: dict) -> None:
    """A multi-node run's word: admit another node's key (node 0), or where this node's ranks
    report (the others: their row points at node 0's run)."""
    import sys

    if isinstance(said.get("admit"), str):
        try:
            rec.admit(said["admit"])
            answer = {"admitted": said["admit"]}
            node = said.get("node") if isinstance(said.get("node"), dict) else {}
            rec.record([ev.make(run_id, -1, ev.LOG, {"text": f"a node joined the run: "
                                                              f"{node.get('host')}, its launch "
                                                              f"{node.get('run')}"})])
        except ValueError as exc:
            answer = {"refused": str(exc)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    if isinstance(said.get("part_of"), dict):
        reg.update(run_id, part_of=said["part_of"])
        rec.record([ev.make(run_id, -1, ev.LOG, {"text": f"this node's ranks report to run "
                                                          f"{said['part_of'].get('run')} on "
                                                          f"{said['part_of'].get('host')}"})])


def _try(fn: Callable, *args: Any, **kw: Any) -> None:
    try:
        fn(*args, **kw)
    except Exception:  # noqa: BLE001 - a note is a courtesy (a full disk may refuse it)
        pass


def _say_replaced(rec: Recorder, run_id: str, said: dict) -> None:
    text = (f"the run's recorder process ended (exit code {said.get('exitcode')}) and was "
            f"replaced in {said.get('took_s', 0):.1f} s; the ranks went on and report to the new "
            "one. What was on the way is counted at the run's end")
    rec.record([ev.make(run_id, -1, ev.LOG, {"text": text})])
    _try(rec.registry.update, run_id, note=f"its recorder was replaced {said.get('count', 1)} "
                                           "time(s) (it died); lost reports are counted at the end")


def count_undelivered(registry: Any, run_id: str, rec: Recorder, sent: dict[int, int],
                      why: str) -> int:
    """Events the ranks sent (`sent`, by rank: what they said at their end) that are not in the
    record: counted in a `dropped` note, by rank, never lost silently. Returns how many."""
    rec.flush()
    have = registry.events_by_rank(run_id)
    lost = {r: n - have.get(r, 0) for r, n in sent.items() if n > have.get(r, 0)}
    total = sum(lost.values())
    if total:
        text = f"{total} report(s) the ranks sent never reached the record: {why}"
        rec.record([ev.make(run_id, -1, ev.DROPPED, {
            "count": total, "refused": 0, "ranks": {str(r): n for r, n in lost.items()},
            "text": text})])
        _try(registry.update, run_id, note=text)
    return total


NO_METRICS = ("this run recorded no metrics: accelerator.log({...}, step=s) is recorded as it "
              "is, and gpu_lab.report(step, loss=...) from any rank; what the code prints is in "
              "its rank's log only (run.logs(0))")


def _say_if_silent(reg: Any, rec: "Recorder", run_id: str) -> None:
    """A run that ends well without a single metric gets a note saying how to record some."""
    rec.flush()
    row = reg.get_run(run_id)
    if row is not None and not row.get("summary"):
        rec.record([ev.make(run_id, -1, ev.LOG, {"text": NO_METRICS})])


def serve(registry_path: str, run_id: str) -> int:
    """The recorder process: bind, say where, record until the supervisor says the run ended."""
    import signal
    import sys

    from .registry import Registry

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a stop is for the ranks: the
        signal.signal(sig, signal.SIG_IGN)                      # record must outlive them
    sys.stderr = storage.LogStream(2)  # the supervisor's log: a full disk must not end it
    try:
        first = json.loads(sys.stdin.readline())
        keys, host = RunKeys.decode(first["keys"]), str(first.get("host") or "127.0.0.1")
    except (ValueError, KeyError, TypeError) as exc:
        print(f"gpu_lab recorder: expected the run's keys as the first line of stdin "
              f"({exc}); it is started by gpu_lab.record.recorder.spawn", file=sys.stderr)
        return 2
    reg = Registry(registry_path)
    rec = Recorder(reg, run_id, keys=keys, host=host, port=first.get("port"),
                   pub_port=first.get("pub_port"), reserve=True)
    reg.update(run_id, events_address=rec.publish_address)
    sys.stdout.write(json.dumps({"address": rec.address, "publish": rec.publish_address}) + "\n")
    sys.stdout.flush()
    final = None
    # until the supervisor says the run ended, or dies (EOF). Not EOF alone: a DataLoader worker
    # of a rank forked from the supervisor holds the pipe open until it notices its parent is gone
    for line in sys.stdin:
        try:
            said = json.loads(line)
        except ValueError:
            continue
        if not isinstance(said, dict):
            continue
        _queue_news(reg, rec, run_id, said)
        _node_news(reg, rec, run_id, said)
        if isinstance(said.get("replaced"), dict):  # this one stands in for one that died
            _say_replaced(rec, run_id, said["replaced"])
        final = said.get("end") or final
        if final is not None:
            break
    if final is None:
        final = {"status": "lost", "reason": ev.LOST}
    replaced = final.pop("replaced", 0)
    if replaced:  # what was on the way to a recorder that died: counted, by rank
        from .runfolder import RunFolder

        lost = count_undelivered(reg, run_id, rec,
                                 RunFolder(reg.get_run(run_id)["run_dir"]).sent(),
                                 f"the run's recorder died and was replaced ({replaced} "
                                 "time(s)): what was on the way to it was lost")
        if not lost:
            _try(reg.update, run_id, note=f"its recorder was replaced {replaced} time(s) (it "
                                          "died); every report the ranks sent is in the record")
    if final.get("status") == "succeeded":
        _say_if_silent(reg, rec, run_id)
    rec.close(end=final)
    lost = rec.received - rec.written
    print(f"gpu_lab recorder: run {run_id} {final['status']}: {rec.written} events recorded, "
          f"at most {rec.peak_pending} waiting for the database"
          + (f"; {lost} could not be written to {registry_path}" if lost else "")
          + (f"; {rec.refused} connection(s) with another key refused" if rec.refused else ""),
          file=sys.stderr, flush=True)
    from .notify import after_end

    after_end(reg, run_id)  # the end notice, if the run has URLs: once its end is written
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(serve(sys.argv[1], sys.argv[2]))
