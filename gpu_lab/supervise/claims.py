# Long: the queue file, its locks and the order between users are one protocol that every
# claimant on the host must read and write the same way.
"""Host-wide device claims and the queue in front of them: many runs, of many users, on one host.

No daemon: the process that will run the ranks (a run's supervisor) claims the devices itself,
with `wait_for_devices()`, and holds the claim until `Claim.release()` or its death.

Where: one folder for the whole host: GPU_LAB_CLAIMS_DIR, else ADMIN_FOLDER
(/var/lib/gpu_lab/claims) where an administrator made it (`gpu-lab admin init-host`: root's,
mode 1777, out of reach of /tmp cleaners), else DEFAULT_FOLDER (/tmp/gpu_lab-claims), created
sticky and writable by every user (1777) by the first claimant. Who can write what there:
- `ticket-<uid>-<id>.json`: one claimant's ticket (JSON lines: its `enter`, then its `hold`),
  created by that claimant (O_EXCL), mode 0644: every user reads it, only its owner (or the
  folder's owner, or root) can change, rename or delete it (the folder is sticky). A reader
  believes a file only when its owner is the uid its name gives, and takes the ticket's user
  from that owner, never from what the file says. Waiting tickets are served in the order the
  kernel made their files (ctime, which no user can set back), so a ticket keeps its place
  whatever other files say. A claimant that finds its file gone or replaced writes it again
  (behind the others then); one that holds devices does so within a second (its keeper).
- `<device>.lock` (`gpu-<UUID>.lock`, `cpu-<slot>.lock`), empty, 0644: a claim holds a shared
  flock on each of its devices, and its ranks inherit the descriptors; the kernel drops the
  flock with the last holder, so a claimant that dies frees its devices once its ranks are gone.
A device is taken while a live claimant's ticket says it holds it, or while its lock is held:
deleting or recreating lock files (as a /tmp cleaner would) frees nothing, and a forged line in
one's own file can only stand in one's own way. Decisions (who starts with what) are made under
an exclusive flock on the folder itself, which no user can remove while it holds tickets. A
claimant touches its files every hour, so that cleaners that age files leave them alone.

Order: between users, first come, first served; a user's own tickets take that user's places in
priority order (higher first), then in submission order, so a priority never moves anyone else
back. A ticket starts when it is first among those that fit in the free devices; a later ticket
that fits may start ahead of one that does not (backfill), but a ticket that has been bypassed
GPU_LAB_QUEUE_BYPASSES times (default 3), or has waited GPU_LAB_QUEUE_RESERVE_S seconds (default
600), reserves: nothing behind it starts until it has started. A ticket that could not start
even on an idle host (foreign processes hold what it needs) never reserves, so a foreign process
cannot stall the queue.

Waiting: each waiter re-reads the tickets every POLL_S (0.2 s) and on a bell, a datagram that a
release, a start or a withdrawal sends to every waiter's abstract Unix socket, so a hand-off does
not wait out a poll. All processes must share one pid namespace (one host, one container).

Keys: claims with the same `key` (the nodes of one multi-node run on this host) and the same
user share one ticket and its devices; the devices stay taken until the last member releases or
dies.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import pwd
import re
import select
import socket
import stat
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable

from .devices import HostDevice, Request, Resources, env_number

DEFAULT_FOLDER = "/tmp/gpu_lab-claims"
ADMIN_FOLDER = "/var/lib/gpu_lab/claims"  # `gpu-lab admin init-host`: root's, lasting
POLL_S = 0.2
KEEP_S = 1.0        # a holder looks at its files this often (gone: written again)
TOUCH_S = 3600.0    # and touches them this often (cleaners age files by their times)
MAX_TICKET_BYTES = 64 * 1024  # a ticket file is a few lines; a bigger one is not read
BYPASSES, RESERVE_S = 3, 600.0      # defaults of GPU_LAB_QUEUE_BYPASSES, GPU_LAB_QUEUE_RESERVE_S


class DevicesBusy(RuntimeError):
    """queue=False and the devices are taken; `holders`: [{run_id, user, pid, devices}]."""

    def __init__(self, message: str, holders: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.holders = holders


class ClaimCancelled(RuntimeError):
    """The waiter's `cancelled()` said so; its ticket was withdrawn."""


# --------------------------------------------------------------------------- the shared folder
def default_folder() -> Path:
    """GPU_LAB_CLAIMS_DIR, else the administrator's folder where it exists, else /tmp's."""
    env = os.environ.get("GPU_LAB_CLAIMS_DIR")
    if env:
        return Path(env)
    return Path(ADMIN_FOLDER) if os.path.isdir(ADMIN_FOLDER) else Path(DEFAULT_FOLDER)


def claims_folder(path: str | os.PathLike | None = None) -> Path:
    """The host's claims folder (created 1777 where missing); an error with advice where another
    user made it unusable."""
    p = Path(path) if path else default_folder()
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
                               f"there. Ask them to run `chmod 1777 {p}`, or an administrator "
                               "to run `gpu-lab admin init-host`")
        time.sleep(0.05)  # its creator may be between its mkdir and its chmod
        st = os.lstat(p)
    if stat.S_IMODE(st.st_mode) != 0o1777:
        os.chmod(p, 0o1777)
    return p


def init_host(path: str | os.PathLike = ADMIN_FOLDER) -> Path:
    """What `gpu-lab admin init-host` does (as root): the host's claims folder, root's and sticky
    (1777), where /tmp's cleaners do not go; every user's runs use it from then on."""
    if os.geteuid() != 0:
        raise PermissionError("gpu-lab admin init-host must run as root (sudo): the folder it "
                              "makes belongs to root, so that no user can remove another's files")
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{p} is not a folder")
    os.chown(p, 0, 0)
    os.chmod(p, 0o1777)
    return p


def protection(folder: str | os.PathLike | None = None) -> dict[str, Any]:
    """What the host's claims folder protects, for `gpu_lab.doctor()`: {"folder", "owner",
    "mode", "lasting", "protected", "says"}."""
    p = Path(folder) if folder else default_folder()
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return {"folder": str(p), "owner": None, "mode": None, "lasting": None,
                "protected": False,
                "says": f"no claims folder yet at {p}: the first run makes it, owned by its user. "
                        "Ask an administrator to run `gpu-lab admin init-host` on a shared host"}
    owner, mode = _user_name(st.st_uid), stat.S_IMODE(st.st_mode)
    lasting = not str(p.resolve()).startswith(("/tmp/", "/var/tmp/"))
    rooted = st.st_uid == 0 and mode == 0o1777
    says = [f"host queue in {p} (owner {owner}, mode {mode:o})"]
    if rooted:
        says.append("no user can change, move or remove another user's tickets or locks")
    else:
        says.append(f"{owner} owns it and can remove other users' tickets and locks (a run "
                    "then writes its ticket again, behind the others); other users cannot")
    if not lasting:
        says.append("it is under /tmp, which cleaners may age: runs touch their files hourly")
    if not rooted or not lasting:
        says.append("for a shared server: `sudo gpu-lab admin init-host`")
    return {"folder": str(p), "owner": owner, "mode": f"{mode:o}", "lasting": lasting,
            "protected": rooted, "says": "; ".join(says)}


def _open_shared(path: Path) -> int:
    """A descriptor on a lock file every user may use: read-only (flock needs no more), so
    the file can be 0644 and no other user can write it. Opened without O_CREAT where it exists:
    with fs.protected_regular, O_CREAT on another user's file in a sticky folder is refused."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(10):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue  # someone else created it between our two opens
            os.fchmod(fd, 0o644)  # whatever the umask: every user opens it
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{path} is not a regular file")
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


# --------------------------------------------------------------------------- the tickets
_TICKET_FILE = re.compile(r"ticket-(\d+)-([0-9a-f]{32})\.json")
_ID = re.compile(r"gpu-[A-Za-z0-9][A-Za-z0-9-]*|cpu-[0-9]+")
_BELL = re.compile(r"\0gpu_lab-claims-[0-9a-f]{32}")
_TICKET_ID = re.compile(r"[0-9a-f]{32}")


@dataclasses.dataclass
class Ticket:
    """One ticket as its members' files tell it (see the module docstring)."""

    id: str
    seq: tuple            # (ctime of its first file, file name): its place among the waiting
    entry: dict[str, Any]
    want: Request
    owner: int            # the uid that owns its files: the user, whatever the files say
    members: list[dict[str, Any]]
    hold: list[dict[str, Any]] | None = None
    passed: list[str] = dataclasses.field(default_factory=list)  # whom its start passed over
    passed_by: set[str] = dataclasses.field(default_factory=set)  # who passed it, as it noted
    state: str = "closed"       # waiting | holding | closed (set by the view)

    @property
    def bypasses(self) -> int:
        return len(self.passed_by)

    @property
    def pool(self) -> list[str]:
        return self.entry["pool"]

    @property
    def user(self) -> str:
        return _user_name(self.owner)

    @property
    def since(self) -> float:
        return self.seq[0] / 1e9

    def live_members(self) -> list[dict[str, Any]]:
        return [m for m in self.members if _alive(m["pid"], m["start"], m["boot"])]


class _Queue:
    """`with _Queue(folder) as q:` every ticket of the host, read under an exclusive flock on the
    folder itself (the lock of every decision), for the block."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __enter__(self) -> "_Queue":
        for _ in range(10):
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held, now = os.fstat(fd), os.lstat(self.folder)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                break
            os.close(fd)  # the folder was replaced meanwhile: lock the one that is there now
        else:
            raise RuntimeError(f"claims folder {self.folder} keeps being replaced")
        self.fd = fd
        try:
            self.load()
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)  # drops the flock

    def load(self) -> None:
        self.stats = {"bad_lines": 0, "foreign_files": 0, "dead_tickets": 0}
        self.tickets: dict[str, Ticket] = {}
        files = []
        for name in os.listdir(self.folder):
            m = _TICKET_FILE.fullmatch(name)
            if m is None:
                continue
            got = _read_ticket_file(self.folder / name, int(m[1]))
            if got is None:  # not its owner's, not a plain file, too big, or gone meanwhile
                self.stats["foreign_files"] += 1
                continue
            files.append((got[0], name, int(m[1]), got[1]))
        for ctime, name, uid, text in sorted(files):
            self._apply_file((ctime, name), uid, text)

    def _apply_file(self, seq: tuple, uid: int, text: str) -> None:
        lines = text.splitlines()
        try:
            d = json.loads(lines[0])
            if d["op"] != "enter" or not _TICKET_ID.fullmatch(d["ticket"]):
                raise ValueError("a ticket starts with its enter line")
            want = Request.from_dict(d["want"])
            _check_ids([*d["pool"], *(want.ids or ())])
            member = dict(_member(d), file=seq[1], uid=uid)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            self.stats["bad_lines"] += max(1, len(lines))
            return
        t = self.tickets.get(d["ticket"])
        if t is None:
            t = self.tickets[d["ticket"]] = Ticket(d["ticket"], seq, d, want, uid, [])
        elif t.owner != uid:  # no one joins another user's ticket
            self.stats["bad_lines"] += len(lines)
            return
        t.members.append(member)
        for raw in lines[1:]:
            try:
                h = json.loads(raw)
                if h["op"] == "passed-by":  # a waiter's own note of who started ahead of it
                    t.passed_by.add(str(h["by"]))
                    continue
                if h["op"] != "hold":
                    raise ValueError(h["op"])
                _check_ids([dev["id"] for dev in h["devices"]])
                passed = [b for b in h.get("bypassed", []) if isinstance(b, str)]
            except (ValueError, KeyError, TypeError, AttributeError):
                self.stats["bad_lines"] += 1
                continue
            t.hold, t.passed = h["devices"], passed

    def classify(self, locks: "_Locks") -> None:
        """Sets each ticket's state from its members' lives and the device locks. A ticket with a
        live member holds what its hold line names (each ticket on its own: no file can take a
        device from another's); one whose members are gone still holds the devices whose locks
        are held and that no live ticket holds (its ranks outlive it a moment)."""
        live_held: set[str] = set()
        for t in self.tickets.values():
            live = bool(t.live_members())
            t.state = ("holding" if t.hold is not None else "waiting") if live else "closed"
            if live and t.hold is not None:
                live_held.update(d["id"] for d in t.hold)
        for t in self.tickets.values():
            if t.state == "closed" and t.hold is not None and any(
                    d["id"] not in live_held and locks.locked(d["id"]) for d in t.hold):
                t.state = "holding"
        self.stats["dead_tickets"] = sum(1 for t in self.tickets.values() if t.state == "closed")

    def waiting(self, kind: str | None = None) -> list[Ticket]:
        return [t for t in self.tickets.values() if t.state == "waiting"
                and (kind is None or t.entry["kind"] == kind)]

    def taken(self) -> set[str]:
        """The devices that holding tickets name: taken, whatever their lock files say."""
        return {d["id"] for t in self.tickets.values() if t.state == "holding"
                for d in t.hold or []}

    def tidy(self) -> None:
        """Remove this user's files of tickets that are over (a claimant killed before its own
        clean-up); other users' are ignored until they tidy theirs."""
        me = os.geteuid()
        for t in self.tickets.values():
            if t.state != "closed":
                continue
            for m in t.members:
                if m["uid"] == me:
                    try:
                        os.unlink(self.folder / m["file"])
                    except OSError:
                        pass


def _read_ticket_file(path: Path, uid: int) -> tuple[int, str] | None:
    """(ctime in ns, text) of a ticket file whose owner is `uid`, a plain file of at most
    MAX_TICKET_BYTES; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size > MAX_TICKET_BYTES:
            return None
        return st.st_ctime_ns, os.read(fd, MAX_TICKET_BYTES + 1).decode("utf-8", "replace")
    finally:
        os.close(fd)


class _TicketFile:
    """This process's own ticket file: made with O_EXCL (so it is ours), readable by everyone,
    writable by us alone; noticed when it is gone or replaced, and written again then."""

    def __init__(self, folder: Path, lines: list[dict[str, Any]]) -> None:
        self.folder, self.lines = folder, list(lines)
        self.rewritten = 0
        self._create()

    def _create(self) -> None:
        self.path = self.folder / f"ticket-{os.geteuid()}-{uuid.uuid4().hex}.json"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_APPEND | os.O_CLOEXEC, 0o644)
        os.fchmod(fd, 0o644)  # whatever the umask: every user's claimants read it
        self.fd = fd
        os.write(fd, "".join(json.dumps(x, separators=(",", ":")) + "\n"
                             for x in self.lines).encode())
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)

    @property
    def name(self) -> str:
        return self.path.name

    def append(self, line: dict[str, Any]) -> None:
        self.lines.append(line)
        os.write(self.fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())

    def intact(self) -> bool:
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def repair(self) -> bool:
        """Write it again where it is gone or replaced (then it is a new file, behind the
        others); True when it had to."""
        if self.intact():
            return False
        os.close(self.fd)
        self._create()
        self.rewritten += 1
        return True

    def touch(self) -> None:
        try:
            os.utime(self.fd)
        except OSError:
            pass

    def remove(self) -> None:
        if self.intact():
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)


def _check_ids(ids: list[str]) -> None:
    bad = [i for i in ids if not isinstance(i, str) or not _ID.fullmatch(i)]
    if bad:
        raise ValueError(f"device ids {bad}")


def _member(d: dict[str, Any]) -> dict[str, Any]:
    m = {"pid": int(d["pid"]), "start": d["start"], "boot": d["boot"], "bell": d["bell"]}
    if not _BELL.fullmatch(m["bell"]):
        raise ValueError(f"bell {m['bell']!r}")
    return m


class _Locks:
    """Descriptors on device lock files, kept open for probing: a device is locked when an
    exclusive flock on it cannot be taken (which also sees this process's own other claims)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fds: dict[str, int] = {}

    def fd(self, dev_id: str) -> int | None:
        if dev_id not in self.fds:
            try:
                self.fds[dev_id] = _open_shared(self.folder / f"{dev_id}.lock")
            except OSError:  # not a plain file (someone put something else there): the
                return None  # holders' tickets still say who holds the device
        return self.fds[dev_id]

    def locked(self, dev_id: str) -> bool:
        """Its lock file is flocked, or its name is bound (a holder whose files were removed)."""
        fd = self.fd(dev_id)
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
        sock = _bind(self.folder, dev_id)
        if sock is None:
            return True
        sock.close()
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
        places.setdefault(t.owner, []).append(i)
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
    """Walk the queue in order, giving each ticket that fits the devices it would take. `now`:
    time.time(), against which a ticket's wait counts from when its file was made."""
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
        if could and (t.bypasses >= limit or now - t.since >= reserve_s):
            out.reserved.add(t.id)
            break  # it reserves: nothing behind it may start
        blocked.append(t.id)
    return out


# --------------------------------------------------------------------------- the claim
class Claim:
    """Devices this process holds until release() (or its death). A context manager.

    `devices`: the HostDevices (GPUs with NVML index and UUID, or CPU slots); `kind`: "gpu" or
    "cpu"; `ticket`: its queue ticket; `waited_s`: how long the claimant waited for it. While it
    is held, a keeper thread writes its ticket file and its lock files again where they are
    removed (within KEEP_S) and touches them every TOUCH_S."""

    def __init__(self, folder: Path, ticket: str, run_id: str, kind: str,
                 devices: list[HostDevice], held: tuple[list[int], dict[str, socket.socket]],
                 waited_s: float, file: _TicketFile) -> None:
        self.folder, self.ticket, self.run_id, self.kind = folder, ticket, run_id, kind
        self.devices, self.waited_s = devices, waited_s
        self._fds, self._names = held
        _CLAIMS.add(self)
        self.pid = os.getpid()
        self._file = file
        self._ids = [d.id for d in devices]
        self._mutex = threading.Lock()  # the keeper against release()
        self._done = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name="gpu_lab-claim-keeper",
                                        daemon=True)
        self._keeper.start()

    @property
    def held(self) -> bool:
        return bool(self._fds)

    @property
    def repaired(self) -> int:
        """How often its ticket file was written again after someone removed it."""
        return self._file.rewritten

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
        self._done.set()
        locks = _Locks(self.folder)
        try:
            with self._mutex, _Queue(self.folder) as q:
                for fd in self._fds:
                    fcntl.flock(fd, fcntl.LOCK_UN)  # a close alone would wait for the children
                    os.close(fd)
                self._fds = []
                for sock in self._names.values():
                    sock.close()
                self._names = {}
                self._file.remove()
                q.load()
                q.classify(locks)
                _ring(q)
                q.tidy()
        finally:
            locks.close()

    def _keep(self) -> None:
        """Until release: write again what a cleaner or another user removed, touch the rest."""
        touched = time.monotonic()
        while not self._done.wait(KEEP_S):
            try:
                with self._mutex:
                    if self._done.is_set():
                        return
                    if not self._file.intact():
                        with _Queue(self.folder):
                            self._file.repair()
                    self._fds += _relock(self.folder, self._ids, self._fds)
                    for dev_id in set(self._ids) - set(self._names):  # a member left: its
                        sock = _bind(self.folder, dev_id)             # names come to us
                        if sock is not None:
                            self._names[dev_id] = sock
                    if time.monotonic() - touched >= TOUCH_S:
                        touched = time.monotonic()
                        self._file.touch()
                        for fd in self._fds:
                            os.utime(fd)
            except OSError:  # the folder is gone or full: the next look tries again
                continue

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"Claim({self.run_id!r}, {self.kind}, {[d.index for d in self.devices]}, "
                f"{'held' if self.held else 'released'})")


def _relock(folder: Path, ids: list[str], fds: list[int]) -> list[int]:
    """Shared flocks on the lock files of `ids` that are no longer the files `fds` lock (someone
    removed them): the new ones are locked too, so that a dead claimant's ranks still keep the
    device. Returns the new descriptors."""
    held = set()
    for fd in fds:
        st = os.fstat(fd)
        held.add((st.st_dev, st.st_ino))
    new = []
    for dev_id in ids:
        path = folder / f"{dev_id}.lock"
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in held:
                continue
        except FileNotFoundError:
            pass
        try:
            fd = _open_shared(path)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            new.append(fd)
        except BlockingIOError:
            os.close(fd)
    return new


def _take(locks: _Locks, ids: list[str], exclusive_first: bool
          ) -> tuple[list[int], dict[str, socket.socket]] | None:
    """Shared flocks on fresh descriptors for `ids` and their names, or None (and nothing held)
    if any is taken. A new holder first checks with an exclusive lock that nobody holds the
    device, and must bind its name; a member joining its ticket's devices takes the shared lock
    beside the others (the name stays with whoever bound it). A lock file that is not a plain
    file is skipped: the ticket and the name say who holds the device."""
    fds: list[int] = []
    names: dict[str, socket.socket] = {}
    try:
        for dev_id in ids:
            try:
                fd = _open_shared(locks.folder / f"{dev_id}.lock")
            except OSError:
                fd = None
            if fd is not None:
                fds.append(fd)
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive_first else fcntl.LOCK_SH)
                            | fcntl.LOCK_NB)
                if exclusive_first:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # under the queue lock: no one can slip in
            sock = _bind(locks.folder, dev_id)
            if sock is not None:
                names[dev_id] = sock
            elif exclusive_first:
                raise BlockingIOError(f"{dev_id}'s name is bound")
        return fds, names
    except BlockingIOError:
        for fd in fds:
            os.close(fd)
        for sock in names.values():
            sock.close()
        return None


def _name(folder: Path, dev_id: str) -> str:
    """The abstract socket name that a holder of `dev_id` binds: in no file system, so no user
    can remove it; bound while the holder lives (never inherited by its forks: _forget_names)."""
    h = hashlib.sha1(os.path.realpath(folder).encode()).hexdigest()[:16]
    return f"\0gpu_lab-dev-{h}-{dev_id}"


def _bind(folder: Path, dev_id: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(_name(folder, dev_id))
    except OSError:  # in use: someone holds the device
        sock.close()
        return None
    return sock


_CLAIMS: "weakref.WeakSet[Claim]" = weakref.WeakSet()


def _forget_names() -> None:
    """In a forked child (a rank, a loader worker): close the claim names it inherited, so that a
    release in the claimant frees them at once (the flocks the child keeps hold the device while
    it lives)."""
    for claim in list(_CLAIMS):
        for sock in claim._names.values():
            sock.close()
        claim._names = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_names)


def _ring(q: _Queue) -> None:
    """Wake every waiter now (best effort: a waiter polls anyway)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        for t in q.tickets.values():
            if t.state != "waiting":  # only waiters listen
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
        self.file: _TicketFile | None = None
        self.t0 = time.monotonic()
        self.bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.bell.bind(f"\0gpu_lab-claims-{uuid.uuid4().hex}")
        self.position: int | None = None
        self.last: _Queue | None = None
        self.claimed = False

    def close(self) -> None:
        self.locks.close()
        self.bell.close()
        if self.file is not None and not self.claimed:
            self.file.remove()

    def _enter(self, q: _Queue) -> None:
        me = _me()
        bell = self.bell.getsockname()
        bell = bell.decode("latin-1") if isinstance(bell, bytes) else bell
        member = {"pid": me["pid"], "start": me["start"], "boot": me["boot"], "bell": bell}
        same = [t for t in q.tickets.values() if self.key is not None and t.state != "closed"
                and t.entry.get("key") == self.key and t.owner == me["uid"]]
        if same:  # another node of the same run on this host: its ticket, as a member
            self.ticket = same[0].id
            lines = [dict(same[0].entry, **member)]
        else:
            self.ticket = uuid.uuid4().hex
            by_id = self.res.by_id()
            indices = None if self.want.ids is None else [by_id[i].index for i in self.want.ids]
            lines = [{"op": "enter", "ticket": self.ticket, "run": self.run_id, "key": self.key,
                      "user": me["user"], "uid": me["uid"], "prio": self.priority,
                      "kind": self.res.kind, "indices": indices, "want": self.want.as_dict(),
                      "pool": [d.id for d in self.res.devices], "t": time.time(),
                      "sub": self.submitted, **member}]
        self.file = _TicketFile(self.folder, lines)
        q.load()
        q.classify(self.locks)

    def turn(self) -> Claim | None:
        """One look at the queue, under its lock: take the devices if it is this ticket's turn."""
        busy = self.res.foreign_busy()
        with _Queue(self.folder) as q:
            if self.file is None:
                q.classify(self.locks)
                self._enter(q)
            elif self.file.repair():  # removed by its folder's owner or root: behind the others
                q.load()
            q.classify(self.locks)
            self.last = q
            t = q.tickets.get(self.ticket)
            if t is None or t.state == "closed":
                raise RuntimeError(f"run {self.run_id}: its queue ticket {self.file.path} "
                                   "cannot be read back (a full or read-only file system?)")
            self._note_passed(q, t)
            claim = self._join_held(q, t) if t.state == "holding" else self._start(q, t, busy)
            if claim is not None:
                self.claimed = True
                q.tidy()
            return claim

    def _note_passed(self, q: _Queue, t: Ticket) -> None:
        """Note in its own file each run that started ahead of it (only the owner writes a
        ticket's file: the count that makes it reserve is its own)."""
        if t.state != "waiting":
            return
        for other in q.tickets.values():
            if t.id in other.passed and other.id not in t.passed_by:
                self.file.append({"op": "passed-by", "by": other.id})
                t.passed_by.add(other.id)

    def _join_held(self, q: _Queue, t: Ticket) -> Claim | None:
        ids = [d["id"] for d in t.hold or []]
        held = _take(self.locks, ids, exclusive_first=False)
        if held is None:
            return None
        self.file.append({"op": "hold", "devices": t.hold, "t": time.time()})
        return self._claim(t, held)

    def _start(self, q: _Queue, t: Ticket, busy: dict[str, str]) -> Claim | None:
        waiting = q.waiting(t.entry["kind"])
        order = queue_order(waiting)
        self.position = [w.id for w in order].index(t.id) + 1
        ids = set().union(*(w.pool for w in waiting))
        taken = q.taken()
        free = {i for i in ids if i not in busy and i not in taken and not self.locks.locked(i)}
        p = plan(order, free, ids - set(busy), time.time())
        got = p.starts.get(t.id)
        if got is None:
            return None
        held = _take(self.locks, got, exclusive_first=True)
        if held is None:
            return None
        by_id = self.res.by_id()
        t.hold = [_describe(i, by_id) for i in got]
        self.file.append({"op": "hold", "devices": t.hold, "t": time.time(),
                          "bypassed": p.bypassed[t.id]})
        t.state = "holding"
        _ring(q)
        return self._claim(t, held)

    def _claim(self, t: Ticket, held: tuple) -> Claim:
        devices = [HostDevice(d["kind"], d["index"], d["uuid"]) for d in t.hold or []]
        return Claim(self.folder, t.id, self.run_id, t.entry["kind"], devices, held,
                     time.monotonic() - self.t0, self.file)

    def withdraw(self) -> None:
        if self.file is None or self.claimed:
            return
        with _Queue(self.folder) as q:
            self.file.remove()
            self.file = None
            q.load()
            q.classify(self.locks)
            _ring(q)
            q.tidy()

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
        mine = [d for d in (t.hold or []) if d["id"] in need]
        if t.state == "holding" and mine:
            pids = [m["pid"] for m in t.live_members()] or [t.members[0]["pid"]]
            holders.append({"run_id": t.entry["run"], "user": t.user, "pid": pids[0],
                            "devices": [d["index"] for d in mine]})
    unit = "GPUs" if me.entry["kind"] == "gpu" else "CPU slots"
    said = "; ".join(f"{unit} {h['devices']} by run {h['run_id']!r} of user {h['user']} "
                     f"(pid {h['pid']})" for h in holders) or "nothing held, but"
    order = [x.id for x in queue_order(q.waiting(me.entry["kind"]))]
    ahead = [q.tickets[x] for x in order[:order.index(me.id)]]
    if ahead:
        said += f"; {len(ahead)} run(s) wait ahead, first {ahead[0].entry['run']!r} of user " \
                f"{ahead[0].user}"
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
            taken = q.taken()
            for kind in sorted({t.entry["kind"] for t in q.waiting()}):
                order = queue_order(q.waiting(kind))
                ids = set().union(*(t.pool for t in order))
                free = {i for i in ids if i not in taken and not locks.locked(i)}
                reserved = plan(order, free, ids, time.time()).reserved
                rows += [_row(t, n, t.id in reserved) for n, t in enumerate(order, 1)]
            q.tidy()
            return rows
    finally:
        locks.close()


def _row(t: Ticket, position: int | None, reserved: bool) -> QueueRow:
    e = t.entry
    devices = [d["index"] for d in t.hold] if t.hold is not None else e.get("indices")
    live = t.live_members()
    return QueueRow(e["run"], t.user, e["prio"], t.state, position, devices, t.want.count,
                    e["kind"], (live or t.members)[0]["pid"], t.since, reserved, e.get("key"), t.id)


def queue_stats(folder: str | os.PathLike | None = None) -> dict[str, int]:
    """What the host's queue ignores, counted: tickets whose claimants are gone (their owners'
    next claimant removes them), lines that do not read as a ticket's, and files named as tickets
    that are not their named owner's or not plain files."""
    locks = _Locks(claims_folder(folder))
    try:
        with _Queue(locks.folder) as q:
            q.classify(locks)
            return dict(q.stats)
    finally:
        locks.close()


