"""The failure model of a run: each failed rank (RankFailure, from gpu_lab.failures.kinds), the
run's failures in root-cause order (RunError), and the category a failure falls in.

`from_exception` and `from_exitcode` make a RankFailure inside the failing rank (or the supervisor);
what the failure's message means and what to try, with its exact numbers, is
gpu_lab.failures.explain's job.
"""
from __future__ import annotations

import signal
import time
import traceback as tb

from .explain import SUGGESTIONS, explain, noted
from .kinds import (CATEGORIES, COMM, DATA, NODE, OOM, SIGNAL, STOP_EXIT_CODE, STORAGE, USER,
                    RankFailure)

_PATTERNS = (
    (OOM, ("OutOfMemoryError", "out of memory", "CUDA error: out of memory", "MemoryError",
           "can't allocate memory", "DefaultCPUAllocator")),
    (COMM, ("NCCL", "ProcessGroupGloo", "DistBackendError", "DistNetworkError", "c10d",
            "Connection reset by peer", "Connection closed by peer", "collective",
            "Broken pipe", "Watchdog caught collective operation timeout")),
    (DATA, ("DataLoader worker", "webdataset", "ReadError", "tarfile", "UnidentifiedImageError",
            "shard", "decode", "truncated", "gpu_lab.data")),
    (STORAGE, ("No space left on device", "Disk quota exceeded", "Read-only file system",
               "os error 28")),
)

_ONEDNN_FAILED = "could not create a primitive"


def categorize(type_name: str, message: str, traceback_text: str = "") -> str:
    text = f"{type_name}\n{message}\n{traceback_text[-4000:]}"
    if "CheckpointStorageError" in text:  # the checkpoint writer's own verdict, on any rank
        return STORAGE
    for category, needles in _PATTERNS:
        if any(n.lower() in text.lower() for n in needles):
            return category
    return USER


def from_exception(rank: int, exc: BaseException) -> RankFailure:
    text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
    cat = categorize(type(exc).__name__, str(exc), text)
    if cat == USER and _ONEDNN_FAILED in str(exc) and noted().get("memory_cap_bytes"):
        # oneDNN says this when its scratchpad allocation fails; under memory_cap, which
        # allocation meets the cap first (oneDNN's or torch's) depends on the other threads
        cat = OOM
    failure = RankFailure(rank=rank, type=type(exc).__name__, message=str(exc), traceback=text,
                          category=cat, suggestions=list(SUGGESTIONS[cat]), t=time.time())
    try:
        explain(failure, exc)
    except Exception as e:  # noqa: BLE001 - a triage bug must never hide the original error
        failure.details["triage_error"] = f"{type(e).__name__}: {e}"
    return failure


USAGE_EXIT = 2  # argparse's exit code for a command line it refuses


def from_exit(rank: int, code: int, said: str | None, output: str = "") -> RankFailure:
    """A rank whose code called sys.exit(code) with code != 0 (a script's way to fail). `said`:
    the text of sys.exit("text"); `output`: the end of the rank's log, whose last line is the
    message when it says what went wrong (argparse's "train.py: error: ..." above its usage)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if said:
        message = said
    elif last and "error" in last.lower():
        message = last
    else:
        message = f"exited with code {code}" + (f"; its last output: {last}" if last else
                                                " and printed nothing")
    suggestions = list(SUGGESTIONS[USER])
    usage = next((ln for ln in reversed(lines) if ln.startswith("usage:")), None)
    if code == USAGE_EXIT and usage:
        suggestions.insert(0, "The script refused its command line (argparse's exit code 2): "
                              f"check the arguments given to launch(). {usage}")
    else:
        suggestions.insert(0, f"The code called sys.exit({code}): its log (run.logs(rank)) says "
                              "why; sys.exit(0) or sys.exit() ends a rank as a success")
    return RankFailure(rank=rank, type=f"SystemExit({code})", message=message,
                       traceback="\n".join(lines[-20:]), category=USER, exitcode=code,
                       suggestions=suggestions, t=time.time())


def from_exitcode(rank: int, exitcode: int | None, pid: int | None = None,
                  t: float | None = None) -> RankFailure:
    """A rank that died without a Python exception (killed, or os._exit)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        msg = (f"rank {rank} (pid {pid}) was killed by {name} before it could raise an exception")
        return RankFailure(rank=rank, type=name, message=msg, category=SIGNAL, exitcode=exitcode,
                           pid=pid, suggestions=list(SUGGESTIONS[SIGNAL]), t=t or time.time())
    if exitcode == STOP_EXIT_CODE:
        # the rank's own stop handler ran: the launcher ending it after a peer failed, or a stop
        msg = f"rank {rank} (pid {pid}) ended on a stop signal (exit code {exitcode})"
        return RankFailure(rank=rank, type="Stopped", message=msg, category=SIGNAL,
                           exitcode=exitcode, pid=pid, suggestions=list(SUGGESTIONS[SIGNAL]),
                           t=t or time.time())
    msg = f"rank {rank} (pid {pid}) exited with code {exitcode} without a Python exception"
    return RankFailure(rank=rank, type="ExitCode", message=msg, category=USER, exitcode=exitcode,
                       pid=pid, suggestions=list(SUGGESTIONS[USER]), t=t or time.time())


def node_lost(rank: int, node: str, state: str) -> RankFailure:
    """A rank that ended with its node: the node stopped answering (Slurm took it down), so the
    rank could say nothing. Its peers' errors are what they saw of it."""
    msg = (f"node {node} stopped answering ({state}); rank {rank} ran there and ended with it")
    return RankFailure(rank=rank, type="NodeLost", message=msg, category=NODE,
                       suggestions=list(SUGGESTIONS[NODE]), t=time.time(),
                       details={"node": node, "node_state": state})


def failures_of(errors) -> list[RankFailure]:
    """The failures in the error files the run's ranks (or its supervisor, for a killed rank)
    wrote (RunFolder.read_errors()); one that does not parse is skipped (a rank died writing it)."""
    failures = []
    for d in errors:
        try:
            failures.append(RankFailure.from_dict(d))
        except (ValueError, TypeError, AttributeError):
            continue
    return failures


#: a rank the launcher ended because another rank failed first: never the root cause
_CLEANUP = ("SIGTERM", "SignalException", "Stopped")


class RunError:
    """The failures of a run, first failure first. `str()` is the readable report."""

    def __init__(self, failures: list[RankFailure], supervisor: str | None = None) -> None:
        # Root cause first: a SIGTERM is the launcher cleaning up, and a communication error is
        # usually a peer's death seen from the other end; otherwise the earliest failure wins.
        self.failures = sorted(failures, key=lambda f: (f.type in _CLEANUP, f.category == COMM,
                                                        f.t or float("inf"), f.rank))
        self.supervisor = supervisor

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    def __getitem__(self, rank: int) -> RankFailure:
        for f in self.failures:
            if f.rank == rank:
                return f
        raise KeyError(f"rank {rank} did not fail; failed ranks: {self.ranks}")

    @property
    def first(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None

    @property
    def category(self) -> str | None:
        return self.first.category if self.first else None

    @property
    def headline(self) -> str:
        """One line for a notice: the root cause's summary (the report's first line), else the
        supervisor's last line; "" when neither is known."""
        if self.first:
            return self.first.summary()
        lines = (self.supervisor or "").strip().splitlines()
        return lines[-1].strip() if lines else ""

    def __str__(self) -> str:
        lines = []
        for f in self.failures:
            lines.append(f.summary())
            if f.traceback:
                lines.append("  " + f.traceback.rstrip().splitlines()[-1])
        if self.first:
            if self.first.explanation:
                lines.append(self.first.explanation)
            lines.append(f"What to try ({self.first.category}), cheapest first:")
            lines += [f"  {i}. {s}" for i, s in enumerate(self.first.suggestions, 1)]
        if self.supervisor:
            lines.append(f"supervisor: {self.supervisor}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RunError(ranks={self.ranks}, category={self.category!r})"

    def _repr_html_(self) -> str:
        import html

        return f"<pre style='color:#b00'>{html.escape(str(self))}</pre>"


__all__ = ["RankFailure", "RunError", "categorize", "from_exception", "from_exitcode", "failures_of",
           "node_lost", "CATEGORIES", "OOM", "COMM", "DATA", "STORAGE", "USER", "SIGNAL", "NODE"]
