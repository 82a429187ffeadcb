"""A private one-node Slurm cluster in a folder, to try gpu_lab.submit where no cluster is at hand
(tutorial 10 and the tests use it).

Debian's slurmctld, slurmd and munged (`apt install slurmctld slurmd slurm-client munge`; `make
test` installs them) run as this user with everything (munge key and socket, slurm.conf, state,
spool, logs, pid files) under one folder, on free ports, addressed through 127.0.0.1, with
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
                 node_prefix: tuple[str, ...] = ()) -> None:
        """controller_addr, node_addr: where slurmctld and slurmd are reached; node_prefix: a
        command that slurmd starts under, e.g. ("ip", "netns", "exec", "ns") to put the node,
        and so its jobs, in a network namespace of its own: another host on the network."""
        self.folder = Path(folder)
        self.cpus = int(cpus)
        self.controller_addr, self.node_addr = controller_addr, node_addr
        self.node_prefix = tuple(node_prefix)
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
        (self.sockets / "spool").mkdir(exist_ok=True)
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
        self._check(_run([*self.node_prefix, "slurmd"], env=self.env), "slurmd")
        deadline = time.monotonic() + timeout
        while True:  # the node registers with the controller: poll until it takes jobs
            state = _run(["sinfo", "-h", "-o", "%t"], env=self.env, timeout=30).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the private Slurm node is {state!r} after {timeout:.0f} s\n"
                                   f"{self.logs()}")
            time.sleep(0.2)
        self._old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = self.env["SLURM_CONF"]
        return self.env

    @property
    def _munge(self) -> Path:
        return self.sockets / "munge.sock"

    def _conf(self) -> str:
        d, host = self.folder, socket.gethostname().split(".")[0]
        user = _user()
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
SlurmdSpoolDir={self.sockets / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
DefMemPerCPU=250
# ^ jobs share the node by CPU; without it each takes all its memory and runs alone
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
NodeName={host} NodeAddr={self.node_addr} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _check(self, done: subprocess.CompletedProcess, what: str) -> None:
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"{what} failed: {done.stderr.strip()}\n{self.logs()}")

    def logs(self, lines: int = 20) -> str:
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
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
        for name in ("slurmd", "slurmctld"):
            _kill_pidfile(d / f"{name}.pid", name)
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


@contextlib.contextmanager
def private_cluster(folder: str | os.PathLike, cpus: int = 2) -> Iterator[dict]:
    """A PrivateSlurm for the duration of a with-block; yields its environment."""
    with PrivateSlurm(folder, cpus) as env:
        yield env


def _run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


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
