"""Slurm's commands, as gpu_lab uses them: sbatch, squeue (sacct where accounting is on), scancel
and scontrol. Each call is one process with a timeout; nothing here keeps state.

The commands find the cluster as a user's shell does (SLURM_CONF, /etc/slurm, DNS); a login node
needs nothing more. An error names the command, what it said, and what to check.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass
from typing import Iterable

TIMEOUT = 60.0  # seconds for any one command: a busy controller answers slowly, a dead one never
# squeue's fields, in this order, "|"-separated (-O keeps reasons with spaces in one field)
_FIELDS = ("JobID", "State", "Reason", "NodeList", "BatchHost", "Restartcnt", "exit_code")
_FORMAT = ",".join(f"{f}:|" for f in _FIELDS)


class SlurmError(RuntimeError):
    """A Slurm command failed or could not be run; the message says which and why."""


@dataclass(frozen=True)
class JobState:
    """One job as Slurm sees it. `exit_code` is the batch script's (None: unknown or signalled);
    `signal` the signal that ended it (0: none)."""

    job_id: str
    state: str
    reason: str | None = None
    nodes: str | None = None
    batch_host: str | None = None
    restarts: int = 0
    exit_code: int | None = None
    signal: int = 0

    def as_record(self) -> dict:
        return {"state": self.state, "reason": self.reason, "nodes": self.nodes,
                "restarts": self.restarts, "exit_code": self.exit_code, "signal": self.signal}


def missing() -> str | None:
    """Why this machine cannot submit (no sbatch on PATH), or None."""
    absent = [c for c in ("sbatch", "squeue", "scancel", "scontrol") if shutil.which(c) is None]
    if absent:
        return (f"{', '.join(absent)} not on the PATH: submit from a Slurm login node, or install "
                "Slurm's client commands and point SLURM_CONF at the cluster's slurm.conf")
    return None


def _run(argv: list[str], *, cwd: str | None = None, env: dict | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    # a question (what Slurm knows) may be asked again; an order (sbatch, scancel) is not given twice
    asks = argv[0] in ("sinfo", "squeue", "sacct") or argv[:2] == ["scontrol", "show"]
    for _ in range(2 if asks else 1):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd,
                                  env=env, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]}: not found. {missing() or ''}".strip()) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(argv[:3])}: no answer within {TIMEOUT:.0f} s; is the "
                             "Slurm controller up? (`scontrol ping`)") from None
        # killed by a signal: in a job, Slurm's SIGTERM to the job's processes (a node failure,
        # a cancel) reaches the command its supervisor was running; a question is asked once more
        if done.returncode >= 0:
            break
    if check and done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(argv[:2])} failed (exit {done.returncode}): "
                         f"{said[-1] if said else 'no message'}")
    return done


def sbatch(script: str, *, cwd: str | None = None, env: dict | None = None,
           extra: Iterable[str] = ()) -> str:
    """Submit a batch script (`extra`: options before it); return the job id."""
    out = _run(["sbatch", "--parsable", *extra, script], cwd=cwd, env=env).stdout.strip()
    job_id = out.split(";", 1)[0]  # --parsable: "id" or "id;cluster"
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {out!r}; expected a job id")
    return job_id


def states(job_ids: Iterable[str]) -> dict[str, JobState]:
    """The jobs Slurm still knows, by id: squeue (every state, until MinJobAge after the end),
    then sacct for the rest where accounting is on. A job neither knows is absent."""
    ids = [str(j) for j in dict.fromkeys(job_ids)]
    if not ids:
        return {}
    found = _squeue(ids)
    if len(ids) > 1 and found is None:  # one id Slurm no longer knows fails the whole call
        found = {}
        for one in ids:
            found.update(_squeue([one]) or {})
    found = found or {}
    rest = [j for j in ids if j not in found]
    if rest:
        found.update(_sacct(rest))
    return found


def _squeue(ids: list[str]) -> dict[str, JobState] | None:
    done = _run(["squeue", "-h", "--states=all", "-j", ",".join(ids), "-O", _FORMAT], check=False)
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise SlurmError(f"squeue failed (exit {done.returncode}): {done.stderr.strip()}")
    out = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < len(_FIELDS) or cells[0] not in ids:  # array or het job parts aside
            continue
        code = _int(cells[6])
        # squeue gives the wait status: exit code << 8, or the signal in the low bits
        exit_code, sig = (None, 0) if code is None else ((code >> 8) & 0xFF, code & 0x7F)
        out[cells[0]] = JobState(cells[0], cells[1].split()[0], _none(cells[2]), _none(cells[3]),
                                 _none(cells[4]), _int(cells[5]) or 0,
                                 None if sig else exit_code, sig)
    return out


def _sacct(ids: list[str]) -> dict[str, JobState]:
    """Jobs past MinJobAge, from accounting; nothing where accounting is off."""
    if shutil.which("sacct") is None:
        return {}
    done = _run(["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o",
                 "JobID,State,Reason,NodeList,ExitCode"], check=False)
    out = {}
    if done.returncode != 0:
        return out
    for line in done.stdout.splitlines():
        cells = line.split("|")
        if len(cells) < 5 or cells[0] not in ids:
            continue
        code, _, sig = cells[4].partition(":")
        out[cells[0]] = JobState(cells[0], cells[1].split()[0], _none(cells[2]), _none(cells[3]),
                                 exit_code=None if _int(sig) else _int(code),
                                 signal=_int(sig) or 0)
    return out


def hostnames(nodelist: str | None) -> list[str]:
    """A node list as Slurm writes it ("n[0-1],gpu7") as its host names, in the job's order."""
    if not nodelist:
        return []
    return _run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def lost_nodes(nodelist: str | None) -> dict[str, str]:
    """The nodes of `nodelist` that Slurm finds down or not answering: {node: "state, reason"}."""
    if not nodelist:
        return {}
    done = _run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%t|%E"], check=False)
    out = {}
    for line in done.stdout.splitlines():
        node, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        # "*": not answering; down, fail: taken out of service (a failed node is both)
        if state.endswith("*") or state.rstrip("*~#!%$@^-") in ("down", "fail", "failg"):
            out[node.strip()] = f"Slurm: {state.strip()}" + (
                f", {reason.strip()}" if _none(reason.strip()) and reason.strip() != "none" else "")
    return out


def slurmd_silent(node: str, timeout: float = 3.0) -> str | None:
    """Why `node`'s slurmd takes no connection ("no answer at addr:port: ..."), or None when it
    does or where it listens is unknown. Slurm marks a node down only after SlurmdTimeout (300 s
    by default): a job that lost a node learns it sooner by knocking."""
    line = _run(["scontrol", "show", "node", "-o", node], check=False).stdout
    fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    addr, port = fields.get("NodeAddr"), fields.get("Port") or _config("SlurmdPort")
    if not addr or not (port or "").isdigit():
        return None
    try:
        socket.create_connection((addr, int(port)), timeout).close()
    except OSError as exc:
        return f"its slurmd does not answer at {addr}:{port} ({exc.strerror or exc})"
    return None


def _config(name: str) -> str | None:
    """One value of `scontrol show config` ("SlurmdPort = 6818" lines)."""
    for line in _run(["scontrol", "show", "config"], check=False).stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == name:
            return value.strip()
    return None


def signal(job_id: str, name: str) -> None:
    """Send signal `name` (e.g. "USR1") to the job's steps, the ranks srun started; the batch
    script is not signalled."""
    _run(["scancel", f"--signal={name}", str(job_id)])


def cancel(job_id: str) -> None:
    """Cancel the job: withdrawn if pending; its processes get SIGTERM, then SIGKILL."""
    _run(["scancel", str(job_id)])


def requeue(job_id: str) -> None:
    """Put a running job back in the queue (it starts again from its batch script)."""
    _run(["scontrol", "requeue", str(job_id)])


def _none(cell: str) -> str | None:
    return None if cell in ("", "None", "(null)", "n/a") else cell


def _int(cell: str) -> int | None:
    try:
        return int(cell)
    except (TypeError, ValueError):
        return None

