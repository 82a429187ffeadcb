"""A private one-node Slurm cluster in a temp dir, for `sbatch --test-only` on generated scripts.

Debian's slurmctld, slurmd and munged (installed by `make test`, target `slurm`) run as this user
with everything — munge key and socket, slurm.conf, state, spool, logs, pid files — under one
directory, on free ports, addressed through 127.0.0.1, with process tracking that needs no cgroups.
Nothing touches /etc or a system cluster: commands find it through SLURM_CONF. On exit the
controller shuts the cluster down and munged is stopped; any daemon still alive is killed.
"""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from lab_utils import free_port

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/mungekey", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


def installed() -> bool:
    return shutil.which("sbatch") is not None and all(os.access(d, os.X_OK) for d in DAEMONS)


def _run(cmd: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _logs(d: Path) -> str:
    out = []
    for name in ("munged.log", "slurmctld.log", "slurmd.log"):
        p = d / name
        if p.exists():
            out.append(f"--- {name}\n" + "".join(p.read_text(errors="replace").splitlines(True)[-20:]))
    return "\n".join(out)


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


@contextlib.contextmanager
def private_cluster(d: Path, cpus: int = 2) -> Iterator[dict]:
    """Start the cluster in `d`; yield the environment (SLURM_CONF) for sbatch and friends."""
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)  # munged checks the permissions of its directories
    (d / "state").mkdir(exist_ok=True)
    (d / "spool").mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    key = d / "munge.key"
    env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))
    try:
        made = _run(["mungekey", "--create", f"--keyfile={key}"])
        assert made.returncode == 0, made.stderr
        key.chmod(0o400)
        munged = _run(["munged", "--force", f"--key-file={key}", f"--socket={d / 'munge.sock'}",
                       f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                       f"--seed-file={d / 'munged.seed'}"])
        assert munged.returncode == 0, munged.stderr + _logs(d)
        user = os.environ.get("USER") or subprocess.run(["id", "-un"], capture_output=True,
                                                        text=True).stdout.strip()
        (d / "slurm.conf").write_text(f"""\
ClusterName=gpulabtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={d / 'munge.sock'}
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        for daemon in ("slurmctld", "slurmd"):
            started = _run([daemon], env=env)
            assert started.returncode == 0, f"{daemon}: {started.stderr}\n{_logs(d)}"
        deadline = time.monotonic() + 60
        while True:  # the node registers with the controller: poll until it is usable
            state = _run(["sinfo", "-h", "-o", "%t"], env=env, timeout=30).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                break
            assert time.monotonic() < deadline, f"node state {state!r} after 60 s\n{_logs(d)}"
            time.sleep(0.2)
        yield env
    finally:
        if (d / "slurmctld.pid").exists():
            _run(["scontrol", "shutdown"], env=env, timeout=30)
        for name in ("slurmd", "slurmctld"):
            _kill_pidfile(d / f"{name}.pid", name)
        if (d / "munge.sock").exists():
            _run(["munged", "--stop", f"--socket={d / 'munge.sock'}"], timeout=30)
        _kill_pidfile(d / "munged.pid", "munged")
