# Long: the queue file, its locks and the order between users are one protocol that every
# claimant on the host must read and write the same way.
"""Host-wide device claims and the queue in front of them: many runs, of many users, on one host.

No daemon: the process that will run the ranks (a run's supervisor) claims the devices itself,
with `wait_for_devices()`, and holds the claim until `Claim.release()` or its death.

Where: one folder for the whole host, GPU_LAB_CLAIMS_DIR or DEFAULT_FOLDER (/tmp/gpu_lab-claims),
sticky and writable by every user (mode 1777, set explicitly whatever the umask), on a local file
system. Every file in it is created readable and writable by all (0666, set explicitly):
- `<device>.lock` (`gpu-<UUID>.lock`, `cpu-<slot>.lock`): holds no data. A claim holds a shared
  flock on each of its devices; a device is free when an exclusive flock on it can be taken. The
  kernel drops a flock with the last descriptor of its holder: a claimant that dies frees its
  devices by itself, once the ranks it forked (which inherit the descriptors) are gone too.
- `queue`: the shared ticket queue, JSON lines appended under an exclusive flock on the file
  itself. A ticket names its claimant (pid, process start time, boot id, user, run id, priority,
  request); later lines record members that join it, the devices it took, the runs it was
  bypassed by, and its withdrawal or release. What a line says about holding is only a name: the
  locks are the truth, and a line whose claimant is gone (pid dead, or reused by a process that
  started later, or from an earlier boot) is ignored. Once the queue is empty, or past
  COMPACT_BYTES, it is rewritten without its closed tickets; the dead waiters and unreadable lines
  dropped are counted in its first line (`queue_stats()`).

Order: between users, first come, first served (the order of the tickets in the file); a user's
own tickets take that user's places in priority order (higher first), then in submission order,
so a priority never moves anyone else back. A ticket starts when it is first among those that fit
in the free devices; a later ticket that fits may start ahead of one that does not (backfill),
but a ticket that has been bypassed GPU_LAB_QUEUE_BYPASSES times (default 3), or has waited
GPU_LAB_QUEUE_RESERVE_S seconds (default 600), reserves: nothing behind it starts until it has
started. A ticket that could not start even on an idle host (foreign processes hold what it
needs) never reserves, so a foreign process cannot stall the queue.

Waiting: each waiter re-reads the queue every POLL_S (0.2 s) and on a bell, a datagram that a
release, a start or a withdrawal sends to every waiter's abstract Unix socket, so a hand-off does
not wait out a poll. All processes must share one pid namespace (one host, one container).

Keys: claims with the same `key` (the nodes of one multi-node run on this host) share one ticket
and its devices; the devices stay taken until the last member releases or dies.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import pwd
import re
import select
import socket
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from .devices import HostDevice, Request, Resources, env_number

DEFAULT_FOLDER = "/tmp/gpu_lab-claims"
POLL_S = 0.2
COMPACT_BYTES = 256 * 1024
BYPASSES, RESERVE_S = 3, 600.0      # defaults of GPU_LAB_QUEUE_BYPASSES, GPU_LAB_QUEUE_RESERVE_S


class DevicesBusy(RuntimeError):
    """queue=False and the devices are taken; `holders`: [{run_id, user, pid, devices}]."""

    def __init__(self, message: str, holders: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.holders = holders


class ClaimCancelled(RuntimeError):
    """The waiter's `cancelled()` said so; its ticket was withdrawn."""


# --------------------------------------------------------------------------- the shared folder
def claims_folder(path: str | os.PathLike | None = None) -> Path:
    """The host's claims folder (created 1777 where missing); an error with advice where another
    user made it unusable."""
    p = Path(path or os.environ.get("GPU_LAB_CLAIMS_DIR") or DEFAULT_FOLDER)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"claims folder {p} is not a folder (a link or a file): remove it, or "
                           f"set GPU_LAB_CLAIMS_DIR to another folder that every user can reach")
    deadline = time.monotonic() + 1.0
    while stat.S_IMODE(st.st_mode) != 0o1777 and st.st_uid != os.geteuid():
        if time.monotonic() > deadline:
            raise RuntimeError(f"claims folder {p} has mode {stat.S_IMODE(st.st_mode):o} and "
                               f"belongs to {_user_name(st.st_uid)}: other users cannot claim "
                               f"there. Ask them to run `chmod 1777 {p}`")
        time.sleep(0.05)  # its creator may be between its mkdir and its chmod
        st = os.lstat(p)
    if stat.S_IMODE(st.st_mode) != 0o1777:
        os.chmod(p, 0o1777)
    return p


def _open_shared(path: Path, append: bool = False) -> int:
    """A descriptor on a file every user may use. Opened without O_CREAT where it exists: with
    fs.protected_regular, O_CREAT on another user's file in a sticky folder is refused."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    for _ in range(10):
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue  # someone else created it between our two opens
        os.fchmod(fd, 0o666)  # the umask narrowed it
        return fd
    raise RuntimeError(f"could not open {path}: it keeps appearing and vanishing")


# --------------------------------------------------------------------------- who is alive
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process; None where /proc does not
    show it (gone, or hidden: /proc mounted with hidepid)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def _alive(pid: int, start: int | None, boot: str) -> bool:
    if boot != _BOOT:
        return False
    got = _proc_start(pid)
    if got is None:  # gone, or hidden by hidepid: then a signal check is all there is
        import psutil  # here only: the claims need nothing outside the stdlib otherwise

        return psutil.pid_exists(pid)
    if got[0] in ("Z", "X"):
        return False
    return start is None or got[1] == start


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


_BOOT = _boot_id()


def _me() -> dict[str, Any]:
    got = _proc_start(os.getpid())
    return {"pid": os.getpid(), "start": got[1] if got else None, "boot": _BOOT,
            "uid": os.geteuid(), "user": _user_name(os.geteuid())}


# --------------------------------------------------------------------------- policy
def _policy() -> tuple[int, float]:
    return (int(env_number("GPU_LAB_QUEUE_BYPASSES", BYPASSES,
                           "how many later runs may start ahead of a waiting one", whole=True)),
            env_number("GPU_LAB_QUEUE_RESERVE_S", RESERVE_S,
                       "seconds a run waits before nothing may start ahead of it"))


# --------------------------------------------------------------------------- the queue file
@dataclasses.dataclass
class Ticket:
    """One ticket as the queue file tells it (see the module docstring)."""

    id: str
    seq: int
    entry: dict[str, Any]
    want: Request
    members: list[dict[str, Any]]
    left: set[int] = dataclasses.field(default_factory=set)
    hold: list[dict[str, Any]] | None = None
    bypasses: int = 0
    lines: list[str] = dataclasses.field(default_factory=list)
    state: str = "closed"       # waiting | holding | closed (set by the view)

    @property
    def pool(self) -> list[str]:
        return self.entry["pool"]

    def live_members(self) -> list[dict[str, Any]]:
        return [m for m in self.members
                if m["pid"] not in self.left and _alive(m["pid"], m["start"], m["boot"])]


class _Queue:
    """`with _Queue(folder) as q:` the queue file, locked exclusively and parsed, for the block."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __enter__(self) -> "_Queue":
        self.fd = _open_shared(self.folder / "queue", append=True)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            self._parse(_read_all(self.fd))
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)  # drops the flock

    def _parse(self, data: bytes) -> None:
        self.size = len(data)
        self.stats = {"dropped_dead_waiters": 0, "bad_lines": 0}
        self.tickets: dict[str, Ticket] = {}
        self.holder: dict[str, str] = {}   # device id -> ticket of the latest hold line
        for n, raw in enumerate(data.decode("utf-8", "replace").splitlines()):
            try:
                self._apply(n, json.loads(raw), raw)
            except (ValueError, KeyError, TypeError, AttributeError):
                self.stats["bad_lines"] += 1

    def _apply(self, n: int, d: dict[str, Any], raw: str) -> None:
        op = d["op"]
        if op == "stats":
            for k in self.stats:
                self.stats[k] += int(d.get(k, 0))
            return
        if op == "enter":
            want = Request.from_dict(d["want"])
            _check_ids([*d["pool"], *(want.ids or ())])
            self.tickets[d["ticket"]] = Ticket(d["ticket"], n, d, want, [_member(d)], lines=[raw])
            return
        t = self.tickets[d["ticket"]]
        if op == "join":
            t.members.append(_member(d))
        elif op == "hold":
            _check_ids([dev["id"] for dev in d["devices"]])
            t.hold = d["devices"]
            for dev in t.hold:
                self.holder[dev["id"]] = t.id
        elif op == "bypass":
            t.bypasses += 1
        elif op == "leave":
            t.left.add(int(d["pid"]))
        else:
            raise ValueError(op)
        t.lines.append(raw)

    def append(self, **line: Any) -> None:
        os.write(self.fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())

    def classify(self, locks: "_Locks") -> None:
        """Sets each ticket's state from its members' lives and the device locks."""
        for t in self.tickets.values():
            everyone_left = all(m["pid"] in t.left for m in t.members)
            if t.hold is not None:
                mine = [d["id"] for d in t.hold if self.holder.get(d["id"]) == t.id]
                held = not everyone_left and any(locks.locked(i) for i in mine)
                t.state = "holding" if held else "closed"
            else:
                t.state = "waiting" if t.live_members() else "closed"

    def waiting(self, kind: str | None = None) -> list[Ticket]:
        return [t for t in self.tickets.values() if t.state == "waiting"
                and (kind is None or t.entry["kind"] == kind)]

    def compact(self) -> None:
        """Rewrite without closed tickets once none is live, or once the file is large."""
        live = [t for t in self.tickets.values() if t.state != "closed"]
        closed = len(self.tickets) - len(live)
        if not closed or (live and self.size < COMPACT_BYTES):
            return
        dead = sum(1 for t in self.tickets.values() if t.state == "closed" and t.hold is None
                   and not all(m["pid"] in t.left for m in t.members))
        stats = dict(self.stats, dropped_dead_waiters=self.stats["dropped_dead_waiters"] + dead)
        lines = [json.dumps({"op": "stats", **stats})] + [x for t in live for x in t.lines]
        os.ftruncate(self.fd, 0)
        os.write(self.fd, ("\n".join(lines) + "\n").encode())  # O_APPEND: from offset 0 now
        self.stats = stats


# Any user may write the queue: what names a file or a socket is checked before it is used.
_ID = re.compile(r"gpu-[A-Za-z0-9][A-Za-z0-9-]*|cpu-[0-9]+")
_BELL = re.compile(r"\0gpu_lab-claims-[0-9a-f]{32}")


def _check_ids(ids: list[str]) -> None:
    bad = [i for i in ids if not isinstance(i, str) or not _ID.fullmatch(i)]
    if bad:
        raise ValueError(f"device ids {bad}")


def _member(d: dict[str, Any]) -> dict[str, Any]:
    m = {"pid": int(d["pid"]), "start": d["start"], "boot": d["boot"], "bell": d["bell"]}
    if not _BELL.fullmatch(m["bell"]):
        raise ValueError(f"bell {m['bell']!r}")
    return m


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


class _Locks:
    """Descriptors on device lock files, kept open for probing: a device is locked when an
    exclusive flock on it cannot be taken (which also sees this process's own other claims)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fds: dict[str, int] = {}

    def fd(self, dev_id: str) -> int:
        if dev_id not in self.fds:
            self.fds[dev_id] = _open_shared(self.folder / f"{dev_id}.lock")
        return self.fds[dev_id]

    def locked(self, dev_id: str) -> bool:
        fd = self.fd(dev_id)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


# --------------------------------------------------------------------------- order and placement
def queue_order(waiting: list[Ticket]) -> list[Ticket]:
    """First come, first served between users; each user's own tickets fill that user's places
    by priority (higher first), then submission."""
    by_seq = sorted(waiting, key=lambda t: t.seq)
    places: dict[int, list[int]] = {}
    for i, t in enumerate(by_seq):
        places.setdefault(t.entry["uid"], []).append(i)
    out = list(by_seq)
    for idxs in places.values():
        mine = sorted((by_seq[i] for i in idxs),
                      key=lambda t: (-t.entry["prio"], _submitted(t), t.seq))
        for i, t in zip(idxs, mine):
            out[i] = t
    return out


def _submitted(t: Ticket) -> float:
    """When the run was submitted (its launch), which may be before its ticket entered: runs one
    user launches in a row queue in that order, whichever supervisor gets to the file first."""
    for v in (t.entry.get("sub"), t.entry.get("t")):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return 0.0


def _fit(t: Ticket, free: set[str]) -> list[str] | None:
    if t.want.ids is not None:
        return list(t.want.ids) if set(t.want.ids) <= free else None
    fits = [d for d in t.pool if d in free]
    return fits[:t.want.count] if len(fits) >= t.want.count else None


@dataclasses.dataclass
class Plan:
    """Who may start now, with which devices, and whom each bypasses; who reserves."""

    starts: dict[str, list[str]]
    bypassed: dict[str, list[str]]
    reserved: set[str]


def plan(order: list[Ticket], free: set[str], usable: set[str], now: float) -> Plan:
    """Walk the queue in order, giving each ticket that fits the devices it would take."""
    limit, reserve_s = _policy()
    out = Plan({}, {}, set())
    blocked: list[str] = []
    for t in order:
        got = _fit(t, free)
        if got is not None:
            out.starts[t.id], out.bypassed[t.id] = got, list(blocked)
            free = free - set(got)
            continue
        could = _fit(t, usable) is not None
        if could and (t.bypasses >= limit or now - t.entry["mono"] >= reserve_s):
            out.reserved.add(t.id)
            break  # it reserves: nothing behind it may start
        blocked.append(t.id)
    return out


# --------------------------------------------------------------------------- the claim
class Claim:
    """Devices this process holds until release() (or its death). A context manager.

    `devices`: the HostDevices (GPUs with NVML index and UUID, or CPU slots); `kind`: "gpu" or
    "cpu"; `ticket`: its queue ticket; `waited_s`: how long the claimant waited for it."""

    def __init__(self, folder: Path, ticket: str, run_id: str, kind: str,
                 devices: list[HostDevice], fds: list[int], waited_s: float) -> None:
        self.folder, self.ticket, self.run_id, self.kind = folder, ticket, run_id, kind
        self.devices, self._fds, self.waited_s = devices, fds, waited_s
        self.pid = os.getpid()

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def cuda_visible_devices(self, form: str = "index") -> str:
        """The CUDA_VISIBLE_DEVICES value for the ranks: NVML indices ("0,2"; the launcher sets
        CUDA_DEVICE_ORDER=PCI_BUS_ID, under which they are CUDA's too) or, with form="uuid",
        UUIDs. "" for CPU slots: a CPU run sees no GPU."""
        if form not in ("index", "uuid"):
            raise ValueError(f"form: got {form!r}; accepted: 'index', 'uuid'")
        if self.kind != "gpu":
            return ""
        return ",".join(str(d.index) if form == "index" else str(d.uuid) for d in self.devices)

    def env(self) -> dict[str, str]:
        """What the ranks' environment needs so that they see exactly these devices."""
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices(),
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def as_record(self) -> dict[str, Any]:
        """The claim as the run's registry record keeps it."""
        return {"kind": self.kind, "ticket": self.ticket, "waited_s": round(self.waited_s, 3),
                "devices": [{"index": d.index, "uuid": d.uuid} for d in self.devices]}

    def release(self) -> None:
        """Frees the devices now (idempotent), even while forked children still hold copies of
        its descriptors. Only the claiming process releases: in a forked child it does nothing."""
        if not self._fds or os.getpid() != self.pid:
            return
        locks = _Locks(self.folder)
        try:
            with _Queue(self.folder) as q:
                q.append(op="leave", ticket=self.ticket, pid=self.pid, t=time.time())
                for fd in self._fds:
                    fcntl.flock(fd, fcntl.LOCK_UN)  # a close alone would wait for the children
                    os.close(fd)
                self._fds = []
                _ring(q)
                t = q.tickets.get(self.ticket)
                if t is not None:
                    t.left.add(self.pid)
                q.classify(locks)
                q.compact()
        finally:
            locks.close()

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"Claim({self.run_id!r}, {self.kind}, {[d.index for d in self.devices]}, "
                f"{'held' if self.held else 'released'})")


def _take(locks: _Locks, ids: list[str], exclusive_first: bool) -> list[int] | None:
    """Shared flocks on fresh descriptors for `ids`, or None (and nothing held) if any is taken.
    A new holder first checks with an exclusive lock that nobody holds the device; a member
    joining its ticket's devices takes the shared lock beside the others."""
    fds: list[int] = []
    try:
        for dev_id in ids:
            fd = _open_shared(locks.folder / f"{dev_id}.lock")
            fds.append(fd)
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive_first else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            if exclusive_first:
                fcntl.flock(fd, fcntl.LOCK_SH)  # under the queue lock: no one can slip in
        return fds
    except BlockingIOError:
        for fd in fds:
            os.close(fd)
        return None


def _ring(q: _Queue) -> None:
    """Wake every waiter now (best effort: a waiter polls anyway)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        for t in q.tickets.values():
            if t.hold is not None:  # only waiters listen
                continue
            for m in t.members:
                try:
                    s.sendto(b"!", m["bell"].encode("latin-1"))
                except OSError:
                    pass


# --------------------------------------------------------------------------- waiting
class _Waiter:
    """One claimant's ticket in the queue and its turns (see wait_for_devices)."""

    def __init__(self, folder: Path, res: Resources, want: Request, run_id: str, priority: int,
                 key: str | None, submitted: float | None = None) -> None:
        self.folder, self.res, self.want = folder, res, want
        self.submitted = time.time() if submitted is None else float(submitted)
        self.run_id, self.priority, self.key = run_id, priority, key
        self.locks = _Locks(folder)
        self.ticket: str | None = None
        self.t0 = time.monotonic()
        self.bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.bell.bind(f"\0gpu_lab-claims-{uuid.uuid4().hex}")
        self.position: int | None = None
        self.last: _Queue | None = None

    def close(self) -> None:
        self.locks.close()
        self.bell.close()

    def _enter(self, q: _Queue) -> None:
        me = _me()
        bell = self.bell.getsockname()
        bell = bell.decode("latin-1") if isinstance(bell, bytes) else bell
        member = {"pid": me["pid"], "start": me["start"], "boot": me["boot"], "bell": bell}
        same = [t for t in q.tickets.values() if self.key is not None and t.state != "closed"
                and t.entry.get("key") == self.key]
        if same:
            self.ticket = same[0].id
            q.append(op="join", ticket=self.ticket, **member)
            same[0].members.append(member)
            return
        self.ticket = uuid.uuid4().hex
        by_id = self.res.by_id()
        indices = None if self.want.ids is None else [by_id[i].index for i in self.want.ids]
        q.append(op="enter", ticket=self.ticket, run=self.run_id, key=self.key, user=me["user"],
                 uid=me["uid"], prio=self.priority, kind=self.res.kind, indices=indices,
                 want=self.want.as_dict(), pool=[d.id for d in self.res.devices],
                 mono=time.monotonic(), t=time.time(), sub=self.submitted, **member)
        q._parse(_read_all(q.fd))
        q.classify(self.locks)

    def turn(self) -> Claim | None:
        """One look at the queue, under its lock: take the devices if it is this ticket's turn."""
        busy = self.res.foreign_busy()
        with _Queue(self.folder) as q:
            q.classify(self.locks)
            if self.ticket is None:
                self._enter(q)
            self.last = q
            t = q.tickets.get(self.ticket)
            if t is None or t.state == "closed":
                raise RuntimeError(f"run {self.run_id}: its queue ticket vanished (the queue "
                                   f"file {self.folder / 'queue'} was edited by hand?)")
            claim = self._join_held(q, t) if t.state == "holding" else self._start(q, t, busy)
            if claim is not None:
                q.compact()
            return claim

    def _join_held(self, q: _Queue, t: Ticket) -> Claim | None:
        ids = [d["id"] for d in t.hold or []]
        fds = _take(self.locks, ids, exclusive_first=False)
        return None if fds is None else self._claim(t, fds)

    def _start(self, q: _Queue, t: Ticket, busy: dict[str, str]) -> Claim | None:
        waiting = q.waiting(t.entry["kind"])
        order = queue_order(waiting)
        self.position = [w.id for w in order].index(t.id) + 1
        ids = set().union(*(w.pool for w in waiting))
        free = {i for i in ids if i not in busy and not self.locks.locked(i)}
        p = plan(order, free, ids - set(busy), time.monotonic())
        got = p.starts.get(t.id)
        if got is None:
            return None
        fds = _take(self.locks, got, exclusive_first=True)
        if fds is None:
            return None
        by_id = self.res.by_id()
        t.hold = [_describe(i, by_id) for i in got]
        q.append(op="hold", ticket=t.id, pid=os.getpid(), devices=t.hold, t=time.time())
        for w in p.bypassed[t.id]:
            q.append(op="bypass", ticket=w, by=t.id)
        t.state = "holding"
        _ring(q)
        return self._claim(t, fds)

    def _claim(self, t: Ticket, fds: list[int]) -> Claim:
        devices = [HostDevice(d["kind"], d["index"], d["uuid"]) for d in t.hold or []]
        return Claim(self.folder, t.id, self.run_id, t.entry["kind"], devices, fds,
                     time.monotonic() - self.t0)

    def withdraw(self) -> None:
        if self.ticket is None:
            return
        with _Queue(self.folder) as q:
            q.append(op="leave", ticket=self.ticket, pid=os.getpid(), t=time.time())
            q.classify(self.locks)
            _ring(q)
            q.compact()

    def sleep(self, timeout: float) -> None:
        """Until a bell or `timeout` seconds, whichever first."""
        if select.select([self.bell], [], [], timeout)[0]:
            while True:
                try:
                    self.bell.recv(64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break


def _describe(dev_id: str, by_id: dict[str, HostDevice]) -> dict[str, Any]:
    dev = by_id.get(dev_id)
    if dev is not None:
        return dev.as_dict()
    kind, _, rest = dev_id.partition("-")  # a device only another claimant's view names
    return {"id": dev_id, "kind": kind, "index": int(rest) if kind == "cpu" else -1,
            "uuid": rest if kind == "gpu" else None}


def wait_for_devices(gpus: Any, run_id: str, priority: int = 0, *, queue: bool = True,
                     key: str | None = None, on_position: Callable[[int], None] | None = None,
                     cancelled: Callable[[], bool] | None = None, nvml: Any = None,
                     kind: str | None = None, folder: str | os.PathLike | None = None,
                     poll: float = POLL_S, submitted: float | None = None) -> Claim:
    """Claim the devices `gpus` asks for (`N`, `[indices]` or `"all"`; see devices.py), waiting
    in the host's queue until it is this run's turn; returns the Claim.

    `priority` orders this user's own runs (higher first). `queue=False`: raise DevicesBusy at
    once, naming who holds the devices, instead of waiting. `key`: claims with the same key (the
    nodes of one multi-node run) share one ticket and its devices. `on_position(n)` is called
    with the run's place among the waiting (1 = next) whenever it changes; `cancelled()` is asked
    at every look, and True withdraws the ticket and raises ClaimCancelled. A waiter that dies
    leaves the queue by itself. `nvml` (a stand-in such as FakeNVML) and `kind` ("gpu"/"cpu")
    choose the resources (see devices.Resources); `folder` the claims folder. `submitted`
    (time.time() of the launch; default now) orders this user's runs of equal priority.
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority: got {priority!r}; accepted: a whole number (higher first)")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id: got {run_id!r}; accepted: a non-empty string")
    if poll <= 0:
        raise ValueError(f"poll: got {poll!r}; accepted: seconds > 0")
    res = Resources.detect(nvml, kind)
    waiter: _Waiter | None = None
    try:
        want = res.parse(gpus)
        waiter = _Waiter(claims_folder(folder), res, want, run_id, priority, key, submitted)
        return _wait(waiter, queue, on_position, cancelled, poll)
    finally:
        if waiter is not None:
            waiter.close()
        res.close()


def _wait(w: _Waiter, queue: bool, on_position: Callable[[int], None] | None,
          cancelled: Callable[[], bool] | None, poll: float) -> Claim:
    told = None
    try:
        while True:
            claim = w.turn()
            if claim is not None:
                return claim
            if not queue:
                raise _busy(w)
            if on_position is not None and w.position != told:
                told = w.position
                on_position(w.position)
            if cancelled is not None and cancelled():
                raise ClaimCancelled(f"run {w.run_id}: withdrawn from the queue")
            w.sleep(poll)
    except BaseException:
        w.withdraw()
        raise


def _busy(w: _Waiter) -> DevicesBusy:
    """What stands in the way of a queue=False claim, in words."""
    q = w.last
    assert q is not None and w.ticket is not None
    me = q.tickets[w.ticket]
    need = set(me.want.ids if me.want.ids is not None else me.pool)
    holders = []
    for t in q.tickets.values():
        mine = [d for d in (t.hold or []) if d["id"] in need and q.holder.get(d["id"]) == t.id]
        if t.state == "holding" and mine:
            pids = [m["pid"] for m in t.live_members()] or [t.members[0]["pid"]]
            holders.append({"run_id": t.entry["run"], "user": t.entry["user"], "pid": pids[0],
                            "devices": [d["index"] for d in mine]})
    unit = "GPUs" if me.entry["kind"] == "gpu" else "CPU slots"
    said = "; ".join(f"{unit} {h['devices']} by run {h['run_id']!r} of user {h['user']} "
                     f"(pid {h['pid']})" for h in holders) or "nothing held, but"
    order = [x.id for x in queue_order(q.waiting(me.entry["kind"]))]
    ahead = [q.tickets[x] for x in order[:order.index(me.id)]]
    if ahead:
        said += f"; {len(ahead)} run(s) wait ahead, first {ahead[0].entry['run']!r} of user " \
                f"{ahead[0].entry['user']}"
    busy = w.res.foreign_busy()
    if busy:
        said += "; in use outside gpu_lab: " + "; ".join(busy.values())
    return DevicesBusy(f"run {w.run_id}: the {me.want.count} {unit} it needs are taken: {said}. "
                       f"Launch with queue=True to wait for them, or ask for fewer.", holders)


# --------------------------------------------------------------------------- the table
@dataclasses.dataclass
class QueueRow:
    """One line of the host's queue table (gpu_lab.queue())."""

    run_id: str
    user: str
    priority: int
    state: str                 # "holding" | "waiting"
    position: int | None       # 1 = next to start; None while holding
    devices: list[int] | None  # held, or asked for by index; None: any `count`
    count: int
    kind: str
    pid: int
    since: float               # time.time() it entered the queue
    reserved: bool             # waiting, and nothing behind it may start before it
    key: str | None
    ticket: str


def host_queue(folder: str | os.PathLike | None = None) -> list[QueueRow]:
    """The host's claims and queue, all users: holders first, then waiters in order."""
    locks = _Locks(claims_folder(folder))
    try:
        with _Queue(locks.folder) as q:
            q.classify(locks)
            rows = [_row(t, None, False) for t in q.tickets.values() if t.state == "holding"]
            for kind in sorted({t.entry["kind"] for t in q.waiting()}):
                order = queue_order(q.waiting(kind))
                ids = set().union(*(t.pool for t in order))
                free = {i for i in ids if not locks.locked(i)}
                reserved = plan(order, free, ids, time.monotonic()).reserved
                rows += [_row(t, n, t.id in reserved) for n, t in enumerate(order, 1)]
            q.compact()
            return rows
    finally:
        locks.close()


def _row(t: Ticket, position: int | None, reserved: bool) -> QueueRow:
    e = t.entry
    devices = [d["index"] for d in t.hold] if t.hold is not None else e.get("indices")
    live = t.live_members()
    return QueueRow(e["run"], e["user"], e["prio"], t.state, position, devices, t.want.count,
                    e["kind"], (live or t.members)[0]["pid"], e["t"], reserved, e.get("key"), t.id)


def queue_stats(folder: str | os.PathLike | None = None) -> dict[str, int]:
    """What the queue dropped, counted: dead waiters' tickets and unreadable lines."""
    with _Queue(claims_folder(folder)) as q:
        return dict(q.stats)


