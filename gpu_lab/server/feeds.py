"""Live run feeds: a followed run's new events, log lines and status, pushed over the lab websocket
to every browser that follows it, for one read per run however many browsers follow.

A browser follows a run with {"follow": run_id, "after": seq, "logs": {file: byte offset}}: where
its run view stopped reading (the view opens with GET runs/<id>, which says both). The feed reads,
once per followed run, what is new after its own cursor: events (registry), whole new lines of the
run's log files, and the row's status, reason and error. That is encoded once and offered to every
follower whose cursor equals the feed's.

When does it read? As soon as the run's recorder has taken new events: the recorder writes each
batch to the registry, then publishes it, and the feed follows that publication (a
gpu_lab.readers.receiver Receiver, with the run's key) as a doorbell, reading at most every
MIN_GAP; and at the latest every FEED_INTERVAL, for log lines, status changes, and runs that
publish nothing it can hear (a headless job, another user's run). The registry stays the only
source of what is sent, so the guarantees below hold for pushed and polled reads alike.

A follower whose cursor differs is "behind" (it has just followed; its socket was still sending the
previous message; a log file appeared) and gets a read of its own, at most EVENTS_LIMIT events and
LOG_CHUNK_BYTES per file, up to the feed's cursor, until it is level. So nothing is dropped, nothing
queues in the server (a busy socket is skipped, not buffered), and fifty browsers on one run cost
the registry and the disk what one does. While a live run is followed, the shared telemetry sampler
also watches its processes, so that samples say which GPUs the run's ranks hold memory on.
Messages to the browser:

    {"type": "run", "run": id, "from": seq, "events": [...], "mean": {metric: points},
     "logs": [{file, from, to, text}], "row": {...}}   (each part only when there is something new)

"mean" is the mean over ranks that the events make due (gpu_lab.record.mean), read with them:
the browser draws it and computes none.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from concurrent.futures import Executor
from typing import Any, Callable, Protocol

from gpu_lab.record.events import ACTIVE_STATUSES as ACTIVE

from .runview import EVENTS_LIMIT, event_to_wire, live_mean, log_sizes, read_log, row_to_wire

FEED_INTERVAL = 1.0  # s: the latest a followed run is read again
MIN_GAP = 0.05       # s: the soonest, after new events rang (a run reporting at 1 kHz costs 20
                     # reads a second, not a thousand)
MAX_FOLLOWS = 16     # runs one connection may follow at once


class Follower(Protocol):
    """What a feed needs from a websocket connection."""

    def feed_send(self, message: str) -> bool:
        """Send now; False when the connection is closed or still busy with the last message."""


@dataclasses.dataclass
class Cursor:
    """Where a reader of one run stands: events up to `seq`, log files up to their byte offsets,
    and the row it last got (by its key)."""

    seq: int
    logs: dict[str, int]
    row_key: tuple | None = None


def row_key(row: dict | None) -> tuple | None:
    return None if row is None else tuple(row.get(k) for k in ("status", "reason", "error", "ended",
                                                              "note"))


class _Feed:
    def __init__(self, run_id: str, run_dir: str | None, seq: int, logs: dict[str, int],
                 row: dict, pid: int | None) -> None:
        self.run_id, self.run_dir, self.row, self.pid = run_id, run_dir, row, pid
        self.cursor = Cursor(seq, logs, row_key(row))
        self.followers: dict[Follower, Cursor] = {}
        self.watched: int | None = None  # the supervisor pid the sampler watches for this feed


class RunFeeds:
    def __init__(self, registry: Callable[[], Any], executor: Executor, log: logging.Logger,
                 interval: float = FEED_INTERVAL, sampler: Callable[[], Any] | None = None,
                 receiver: Callable[[], Any] | None = None, min_gap: float = MIN_GAP) -> None:
        self._registry = registry
        self._sampler = sampler
        self._executor = executor
        self._log = log
        self.interval = interval
        self.min_gap = min_gap
        self._receiver_factory = receiver
        self._receiver: Any = None
        self._feeds: dict[str, _Feed] = {}
        self._task: asyncio.Task | None = None
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._rung: set[str] = set()   # runs whose recorder published since the last read
        self._bells: dict[str, Callable[[list], None]] = {}
        self.rings = 0                 # doorbells heard (a push), for the tests
        self.reads = {"shared": 0, "catchup": 0}  # registry+disk reads, for the load check
        self.messages_sent = 0

    @property
    def followers(self) -> int:
        return sum(len(f.followers) for f in self._feeds.values())

    @property
    def runs(self) -> list[str]:
        return sorted(self._feeds)

    async def _off_loop(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- following ------------------------------------------------------------------------------
    async def follow(self, follower: Follower, run_id: str, after: int,
                     logs: dict[str, int]) -> None:
        """Start pushing `run_id` to `follower` from its cursor; it gets what it lacks at once.
        KeyError for an unknown run; ValueError past MAX_FOLLOWS runs on one connection."""
        following = [f for f in self._feeds.values() if follower in f.followers]
        if run_id not in self._feeds or follower not in self._feeds[run_id].followers:
            if len(following) >= MAX_FOLLOWS:
                raise ValueError(f"follow: this connection already follows {len(following)} runs "
                                 f"(at most {MAX_FOLLOWS}); unfollow one first")
        feed = self._feeds.get(run_id)
        if feed is None:
            start = await self._off_loop(self._open, run_id)
            feed = self._feeds.get(run_id)
            if feed is None:
                feed = self._feeds[run_id] = _Feed(run_id, **start)
                self._watch(feed)
                self._listen(feed)
        cursor = Cursor(int(after), dict(logs))
        feed.followers[follower] = cursor
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())
        await self._catch_up([(feed, follower, cursor)])

    def unfollow(self, follower: Follower, run_id: str | None = None) -> None:
        """Stop pushing one run (or every run, when the connection closes) to `follower`."""
        for rid in [run_id] if run_id is not None else list(self._feeds):
            feed = self._feeds.get(rid)
            if feed is None:
                continue
            feed.followers.pop(follower, None)
            if not feed.followers:
                del self._feeds[rid]
                self._unwatch(feed)
                self._unlisten(feed)

    def _open(self, run_id: str) -> dict:
        reg = self._registry()
        row = reg.get_run(run_id)
        if row is None:
            raise KeyError(run_id)
        return {"run_dir": row.get("run_dir"), "seq": reg.last_seq(run_id),
                "logs": log_sizes(row.get("run_dir")), "row": row_to_wire(reg, row),
                "pid": row.get("pid")}

    # --- the run's GPUs ---------------------------------------------------------------------
    def _watch(self, feed: _Feed) -> None:
        """While a live run is followed, the shared sampler reports the device memory its
        processes hold on each GPU (process_mem_mb), which tells a view the run's GPUs."""
        if self._sampler is None or feed.pid is None or feed.row.get("status") not in ACTIVE:
            return
        try:
            self._sampler().watch(int(feed.pid))
            feed.watched = int(feed.pid)
        except Exception as e:  # noqa: BLE001 - telemetry is a nicety here: the feed goes on
            self._log.warning("gpu_lab: could not watch run %s's processes: %s", feed.run_id, e)

    def _unwatch(self, feed: _Feed) -> None:
        if feed.watched is not None and self._sampler is not None:
            self._sampler().unwatch(feed.watched)
            feed.watched = None

    # --- the doorbell: the run's recorder published new events --------------------------------
    def _listen(self, feed: _Feed) -> None:
        """Follow the run's publication (only to know when to read); a run whose recorder this
        server cannot hear is read every FEED_INTERVAL."""
        if self._receiver_factory is None or feed.row.get("status") not in ACTIVE:
            return
        try:
            if self._receiver is None:
                self._receiver = self._receiver_factory()
            if self._loop_ref is None:
                self._loop_ref = asyncio.get_running_loop()
            loop, run_id = self._loop_ref, feed.run_id

            def ring(_events: list) -> None:  # the receiver's thread
                loop.call_soon_threadsafe(self._ring, run_id)

            self._bells[run_id] = ring
            self._receiver.follow(run_id, ring, after=feed.cursor.seq)
        except Exception as e:  # noqa: BLE001 - the poll still reads it
            self._log.warning("gpu_lab: run %s is read every %.0f s (no live feed: %s)",
                              feed.run_id, self.interval, e)

    def _unlisten(self, feed: _Feed) -> None:
        ring = self._bells.pop(feed.run_id, None)
        if ring is not None and self._receiver is not None:
            self._receiver.unfollow(feed.run_id, ring)

    def _ring(self, run_id: str) -> None:
        if run_id in self._feeds:
            self.rings += 1
            self._rung.add(run_id)
            if self._wake is not None:
                self._wake.set()

    # --- the tick -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        """Read the runs that rang (at most every min_gap), and every run every interval."""
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        last_all = last = loop.time()
        while self._feeds:
            try:
                await asyncio.wait_for(self._wake.wait(),
                                       timeout=max(0.0, last_all + self.interval - loop.time()))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await asyncio.sleep(max(0.0, last + self.min_gap - loop.time()))
            everything = loop.time() - last_all >= self.interval
            only = None if everything else set(self._rung)
            self._rung.clear()
            last = loop.time()
            if everything:
                last_all = last
            try:
                await self.tick(only)
            except Exception:  # noqa: BLE001 - a bad read must not end every other run's feed
                self._log.exception("gpu_lab: run feed tick failed")

    async def tick(self, only: set[str] | None = None) -> None:
        """One round: read what is new for each followed run (those in `only`, if given) once,
        offer it to the followers that are level with the feed, then give each follower that is
        not its own read."""
        feeds = [f for f in self._feeds.values() if only is None or f.run_id in only]
        if not feeds:
            return
        news = await self._off_loop(self._read_shared, [
            (f.run_id, f.run_dir, f.cursor.seq, dict(f.cursor.logs), f.cursor.row_key)
            for f in feeds])
        behind = []
        for feed, new in zip(feeds, news):
            if self._feeds.get(feed.run_id) is not feed:
                continue  # unfollowed meanwhile
            before = dataclasses.replace(feed.cursor, logs=dict(feed.cursor.logs))
            message = self._advance(feed, new)
            for follower, cur in list(feed.followers.items()):
                if cur != before:
                    behind.append((feed, follower, cur))
                elif message is not None and follower.feed_send(message):
                    self.messages_sent += 1
                    cur.seq, cur.logs, cur.row_key = (feed.cursor.seq, dict(feed.cursor.logs),
                                                      feed.cursor.row_key)
        if behind:
            await self._catch_up(behind)

    def _advance(self, feed: _Feed, new: dict) -> str | None:
        """Move the feed's cursor over what was read; the message for level followers, if any."""
        c = feed.cursor
        payload: dict[str, Any] = {"type": "run", "run": feed.run_id}
        if new["events"]:
            payload["from"] = c.seq
            payload["events"] = new["events"]
            c.seq = new["events"][-1]["seq"]
        if new["mean"]:
            payload["mean"] = new["mean"]
        chunks = []
        for chunk in new["logs"]:
            c.logs[chunk["file"]] = chunk["to"]
            if chunk["text"]:
                chunks.append(chunk)
        if chunks:
            payload["logs"] = chunks
        if new["row"] is not None and row_key(new["row"]) != c.row_key:
            feed.row = new["row"]
            c.row_key = row_key(new["row"])
            payload["row"] = new["row"]
            if feed.row.get("status") not in ACTIVE:
                self._unwatch(feed)
        if len(payload) == 2:
            return None
        return json.dumps(payload, separators=(",", ":"))

    def _read_shared(self, items: list[tuple]) -> list[dict]:
        """Blocking: for each run, its row, the events after `seq`, new whole lines of its logs
        (a log file that appeared since the feed opened is new from its first byte)."""
        reg = self._registry()
        out = []
        for run_id, run_dir, seq, logs, was in items:
            self.reads["shared"] += 1
            row = reg.get_run(run_id)
            events = reg.events(run_id, after=seq, limit=EVENTS_LIMIT) if row else []
            chunks = []
            for name, size in log_sizes(run_dir).items():
                if size > logs.get(name, 0):
                    chunks.append(read_log(run_dir, name, logs.get(name, 0)))
            wire = row_to_wire(reg, row) if row else None
            # the run's end gives the steps still waiting for a rank: once, with its new row
            mean = live_mean(reg, row, seq, events, ended=len(events) < EVENTS_LIMIT) if row and (
                events or row_key(wire) != was) else {}
            out.append({"row": wire, "events": [event_to_wire(e) for e in events],
                        "mean": mean, "logs": chunks})
        return out

    async def _catch_up(self, behind: list[tuple]) -> None:
        """Each follower that is not level gets what it lacks, up to the feed's cursor."""
        jobs = [(feed.run_id, feed.run_dir, dataclasses.replace(cur, logs=dict(cur.logs)),
                 dataclasses.replace(feed.cursor, logs=dict(feed.cursor.logs)), feed.row)
                for feed, _, cur in behind]
        reads = await self._off_loop(self._read_personal, jobs)
        for (feed, follower, cur), (_, _, was, upto, _), got in zip(behind, jobs, reads):
            if feed.followers.get(follower) is not cur or cur != was:
                continue  # unfollowed, or followed again from elsewhere, meanwhile
            payload: dict[str, Any] = {"type": "run", "run": feed.run_id}
            if got["events"]:
                payload["from"] = cur.seq
                payload["events"] = got["events"]
            if got["mean"]:
                payload["mean"] = got["mean"]
            texts = [c for c in got["logs"] if c["text"]]
            if texts:
                payload["logs"] = texts
            if cur.row_key != upto.row_key:
                payload["row"] = feed.row
            if len(payload) > 2:
                if not follower.feed_send(json.dumps(payload, separators=(",", ":"))):
                    continue  # busy: it stays where it was and is caught up next tick
                self.messages_sent += 1
            if got["events"]:
                cur.seq = got["events"][-1]["seq"]
            elif cur.seq < upto.seq:
                cur.seq = upto.seq  # nothing recorded in between (a deleted run)
            for c in got["logs"]:
                cur.logs[c["file"]] = c["to"]
            cur.row_key = upto.row_key

    def _read_personal(self, jobs: list[tuple]) -> list[dict]:
        reg = self._registry()
        out = []
        for run_id, run_dir, cur, upto, row in jobs:
            self.reads["catchup"] += 1
            events = reg.events(run_id, after=cur.seq, upto=upto.seq, limit=EVENTS_LIMIT) \
                if upto.seq > cur.seq else []
            reached = not events or events[-1]["seq"] >= upto.seq
            mean = live_mean(reg, {**row, "id": run_id}, cur.seq, events, ended=reached) if (
                events or cur.row_key != upto.row_key) else {}
            chunks = []
            for name, end in upto.logs.items():
                have = cur.logs.get(name)
                if have is None:
                    chunks.append(read_log(run_dir, name, -1, upto=end))  # its tail
                elif have < end:
                    chunks.append(read_log(run_dir, name, have, upto=end))
            out.append({"events": [event_to_wire(e) for e in events], "mean": mean,
                        "logs": chunks})
        return out

    def close(self) -> None:
        for feed in self._feeds.values():
            self._unwatch(feed)
            self._unlisten(feed)
        self._feeds.clear()
        if self._task is not None:
            self._task.cancel()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
