"""A private Slurm cluster in a folder, to try gpu_lab.submit where no cluster is at hand
(tutorial 10 and the tests use it): one node on this host, or several `Hosts` (root only), each
node in network, host-name and mount namespaces of its own: another machine on a private network.

Debian's slurmctld, slurmd and munged (`apt install slurmctld slurmd slurm-client munge`; `make
test` installs them) run as this user with everything (munge key and socket, slurm.conf, state,
spool, logs, pid files) under one folder, on free ports, addressed through 127.0.0.1 (or the
Hosts' bridge), with
process tracking that needs no cgroups. The node declares `cpus` CPUs whatever the machine has,
so jobs can ask for more tasks than it has cores. Job credentials last 10 s (not 120), which is
also how long Slurm holds a requeued job before it starts again. Nothing touches /etc or a system cluster:
commands find it through SLURM_CONF, which `start()` sets in this process for sbatch, squeue and
the job's processes. `stop()` shuts the controller down, stops munged and kills any daemon left.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/mungekey", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


def installed() -> bool:
    """Slurm's daemons and commands and munge are on this machine."""
    return shutil.which("sbatch") is not None and all(os.access(d, os.X_OK) for d in DAEMONS)


class PrivateSlurm:
    """The cluster in `folder`: `start()` (returns the environment with SLURM_CONF), `stop()`;
    also a context manager."""

    def __init__(self, folder: str | os.PathLike, cpus: int = 2, *,
                 controller_addr: str = "127.0.0.1", node_addr: str = "127.0.0.1",
                 node_prefix: tuple[str, ...] = (), hosts: "Hosts | None" = None,
                 slurmd_timeout: int | None = None) -> None:
        """controller_addr, node_addr: where slurmctld and slurmd are reached; node_prefix: a
        command that slurmd starts under, e.g. ("nsenter", "--net=/run/netns/ns") to put the
        node, and so its jobs, in a network namespace of its own: another host on the network.
        hosts: one node on each of these Hosts (made by the caller), the controller on their
        bridge. slurmd_timeout: seconds without an answer before a node is DOWN (its jobs
        NODE_FAIL; None: Slurm's 300)."""
        self.folder = Path(folder)
        self.cpus = int(cpus)
        self.hosts = hosts
        if hosts is not None:
            controller_addr = hosts.bridge_addr
        self.controller_addr, self.node_addr = controller_addr, node_addr
        self.node_prefix = tuple(node_prefix)
        self.slurmd_timeout = slurmd_timeout
        self.env: dict = {}
        self._old_conf: str | None = None
        # Unix sockets (munge's, slurmstepd's in the spool) must fit in 108 bytes: a deep folder
        # gets them in a short one of its own
        self.sockets = self.folder if len(str(self.folder.resolve())) < 48 else None

    def start(self, timeout: float = 60.0) -> dict:
        if not installed():
            raise RuntimeError("a private Slurm cluster needs slurmctld, slurmd, munge and "
                               "Slurm's client commands: apt install slurmctld slurmd "
                               "slurm-client munge")
        d = self.folder
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)  # munged refuses folders others may write
        if self.sockets is None:
            self.sockets = Path(tempfile.mkdtemp(prefix="gpulab-slurm-", dir="/tmp"))
            os.chmod(self.sockets, 0o755)
        (d / "state").mkdir(exist_ok=True)
        for node in self.node_names:
            (self.sockets / "spool" / node).mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))
        atexit.register(self.stop)
        key = d / "munge.key"
        made = _run(["mungekey", "--create", f"--keyfile={key}"])
        self._check(made, "mungekey")
        key.chmod(0o400)
        self._check(_run(["munged", "--force", f"--key-file={key}", f"--socket={self._munge}",
                          f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                          f"--seed-file={d / 'munged.seed'}"]), "munged")
        (d / "slurm.conf").write_text(self._conf())
        self._check(_run(["slurmctld"], env=self.env), "slurmctld")
        for node in self.node_names:
            self.start_node(node, timeout)
        self._old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.env["SLURM_CONF"]
        return self.env

    @property
    def node_names(self) -> list[str]:
        return [h.name for h in self.hosts.hosts] if self.hosts else [_hostname()]

    def start_node(self, node: str, timeout: float = 60.0) -> None:
        """Start `node`'s slurmd (again, after kill_node) and wait until it takes jobs."""
        prefix = self.hosts.prefix(node) if self.hosts else self.node_prefix
        self._check(_run([*prefix, "slurmd"], env=self.env), f"slurmd on {node}")
        deadline = time.monotonic() + timeout
        while True:  # the node registers with the controller: poll until it takes jobs
            state = _run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], env=self.env,
                         timeout=30).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the private Slurm node {node} is {state!r} after "
                                   f"{timeout:.0f} s\n{self.logs()}")
            time.sleep(0.2)

    def kill_node(self, node: str) -> int:
        """What a node's power cut does to the cluster: its slurmd, job steps and ranks die by
        SIGKILL, with no word to anyone. Returns how many processes were killed."""
        if self.hosts is None:
            raise ValueError("kill_node needs a cluster on Hosts: the one node is this host")
        return self.hosts.kill_all(node)

    @property
    def _munge(self) -> Path:
        return self.sockets / "munge.sock"

    def _conf(self) -> str:
        d, host = self.folder, _hostname()
        user = _user()
        if self.hosts is None:
            nodes = (f"NodeName={host} NodeAddr={self.node_addr} CPUs={self.cpus} "
                     "RealMemory=1000 State=UNKNOWN")
        else:  # each slurmd finds its NodeName by its host name, in its own UTS namespace
            nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs={self.cpus} "
                              "RealMemory=1000 State=UNKNOWN" for h in self.hosts.hosts)
        if self.slurmd_timeout is not None:
            nodes = f"SlurmdTimeout={int(self.slurmd_timeout)}\n{nodes}"
        return f"""\
ClusterName=gpulabsandbox
SlurmctldHost={host}({self.controller_addr})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self._munge},cred_expire=10
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={self.sockets / 'spool' / '%n'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd-%n.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
DefMemPerCPU=250
# ^ jobs share the node by CPU; without it each takes all its memory and runs alone
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _check(self, done: subprocess.CompletedProcess, what: str) -> None:
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"{what} failed: {done.stderr.strip()}\n{self.logs()}")

    def logs(self, lines: int = 20) -> str:
        out = []
        for name in ("munged.log", "slurmctld.log",
                     *(f"slurmd-{n}.log" for n in self.node_names)):
            p = self.folder / name
            if p.exists():
                tail = "".join(p.read_text(errors="replace").splitlines(True)[-lines:])
                out.append(f"--- {name}\n{tail}")
        return "\n".join(out)

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel every job, wait until they are gone (slurmd would otherwise leave their
        processes behind), then stop the daemons."""
        d = self.folder
        if (d / "slurmctld.pid").exists():
            self._cancel_all(timeout)
            _run(["scontrol", "shutdown"], env=self.env or None, timeout=30)
        for node in self.node_names:
            _kill_pidfile(d / f"slurmd-{node}.pid", "slurmd")
        _kill_pidfile(d / "slurmctld.pid", "slurmctld")
        if self.sockets is not None and self._munge.exists():
            _run(["munged", "--stop", f"--socket={self._munge}"], timeout=30)
        _kill_pidfile(d / "munged.pid", "munged")
        if self.sockets is not None and self.sockets != self.folder:
            shutil.rmtree(self.sockets, ignore_errors=True)
        if self.env and os.environ.get("SLURM_CONF") == self.env.get("SLURM_CONF"):
            if self._old_conf is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = self._old_conf
        atexit.unregister(self.stop)

    def _cancel_all(self, timeout: float) -> None:
        user = _user()
        if _run(["scancel", f"--user={user}"], env=self.env, timeout=30).returncode != 0:
            return  # the controller is not up: no job can be running
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = _run(["squeue", "-h", f"--user={user}", "-o", "%i"], env=self.env, timeout=30)
            if left.returncode != 0 or not left.stdout.strip():
                return
            time.sleep(0.2)

    def __enter__(self) -> dict:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Host:
    name: str  # its host name, and its Slurm node name
    addr: str  # its address on the bridge
    netns: str  # its network namespace (ip netns)


class Hosts:
    """Machines on a private network, made of namespaces (root only): each host a network
    namespace with an address on a bridge that this host also has an address on, a host name
    of its own (UTS namespace) and an /etc/hosts of its own that names them all (mount
    namespace), entered by `prefix(name)` for each command it runs. Traffic stays on the
    bridge. `create()` / `remove()`, or a with-block; `available()` says why not, if not."""

    def __init__(self, folder: str | os.PathLike, count: int = 2) -> None:
        self.folder, self.count = Path(folder), int(count)
        self._name(os.getpid() % 200 + 20)
        self.hosts_file = self.folder / "etc-hosts"

    def _name(self, n: int) -> None:
        """Names and addresses from network number n (10.81.n.0/24)."""
        self.bridge, self.bridge_addr = f"glbr{n}", f"10.81.{n}.1"
        self.hosts = [Host(f"gplab{n}-n{i}", f"10.81.{n}.{i + 2}", f"gplab{n}n{i}")
                      for i in range(self.count)]

    @staticmethod
    def available() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "private hosts need root (network and mount namespaces)"
        missing = [c for c in ("ip", "nsenter", "unshare", "mount") if shutil.which(c) is None]
        return f"{', '.join(missing)} not found" if missing else None

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ValueError(f"no host {name!r}; these are: {', '.join(h.name for h in self.hosts)}")

    def prefix(self, name: str) -> tuple[str, ...]:
        """The command that runs the rest of a command line on host `name`. nsenter, not `ip
        netns exec`: that remounts /sys, where slurmd looks for cgroups."""
        h = self.host(name)
        return ("nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"',
                "sh", str(self.hosts_file), h.name)

    def create(self) -> "Hosts":
        why = self.available()
        if why:
            raise RuntimeError(f"cannot make private hosts: {why}")
        self.folder.mkdir(parents=True, exist_ok=True)
        first = int(self.bridge[4:])
        for n in [*range(first, 220), *range(20, first)]:  # the bridge's name is the lock
            self._name(n)
            made = _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            if made.returncode == 0:
                break
            if "exists" not in made.stderr:
                raise RuntimeError(f"ip link add {self.bridge} type bridge failed: "
                                   f"{made.stderr.strip()}")
        else:
            raise RuntimeError("no free network for private hosts (10.81.20-219.0/24 all taken)")
        atexit.register(self.remove)
        here = _hostname()
        lines = ["127.0.0.1 localhost", f"{self.bridge_addr} {here}"]
        lines += [f"{h.addr} {h.name}" for h in self.hosts]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self.hosts_file.chmod(0o644)  # what /etc/hosts is: every process reads names from it
        steps = [["ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge],
                 ["ip", "link", "set", self.bridge, "up"]]
        for i, h in enumerate(self.hosts):
            outer, inner = f"{self.bridge}v{i}", f"{self.bridge}i{i}"
            inside = ["ip", "netns", "exec", h.netns]
            steps += [["ip", "netns", "add", h.netns],
                      ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner],
                      ["ip", "link", "set", inner, "netns", h.netns],
                      ["ip", "link", "set", outer, "master", self.bridge],
                      ["ip", "link", "set", outer, "up"],
                      [*inside, "ip", "addr", "add", f"{h.addr}/24", "dev", inner],
                      [*inside, "ip", "link", "set", inner, "up"],
                      [*inside, "ip", "link", "set", "lo", "up"]]
        for step in steps:
            done = _run(step)
            if done.returncode != 0:
                self.remove()
                raise RuntimeError(f"{' '.join(step)} failed: {done.stderr.strip()}")
        return self

    def pids(self, name: str) -> list[int]:
        """The processes on host `name` (in its network namespace)."""
        try:
            ns = os.stat(f"/run/netns/{self.host(name).netns}").st_ino
        except FileNotFoundError:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino == ns:
                        out.append(int(entry))
                except OSError:
                    continue  # it exited
        return out

    def kill_all(self, name: str) -> int:
        """SIGKILL every process on host `name`; returns how many there were."""
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def remove(self) -> None:
        """Kill what still runs on the hosts and remove them and the bridge."""
        for h in self.hosts:
            self.kill_all(h.name)
            _run(["ip", "netns", "del", h.netns])
        _run(["ip", "link", "del", self.bridge])  # its veths went with their namespaces
        atexit.unregister(self.remove)

    def __enter__(self) -> "Hosts":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()


@contextlib.contextmanager
def private_cluster(folder: str | os.PathLike, cpus: int = 2) -> Iterator[dict]:
    """A PrivateSlurm for the duration of a with-block; yields its environment."""
    with PrivateSlurm(folder, cpus) as env:
        yield env


def _run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _hostname() -> str:
    return socket.gethostname().split(".")[0]


def _user() -> str:
    import getpass

    return getpass.getuser()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_pidfile(p: Path, name: str) -> None:
    """End the daemon whose pid `p` holds, if that pid is still that daemon (not a reused pid).
    A pidfd pins the process and becomes readable when it exits: waited on, not polled."""
    try:
        pid = int(p.read_text().strip())
        fd = os.pidfd_open(pid)
    except (OSError, ValueError):
        return  # no pid file, or the process is gone
    try:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != name:
                return
        except OSError:
            return
        signal.pidfd_send_signal(fd, signal.SIGTERM)
        if not select.select([fd], [], [], 10)[0]:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            select.select([fd], [], [], 10)
    finally:
        os.close(fd)
