"""What a failure is: the categories a failure falls in, and one failed rank (RankFailure) as the
supervisor, the run handle and the run view read it back from its JSON."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

OOM = "out of memory"
COMM = "communication"
DATA = "data loading"
STORAGE = "storage"
USER = "user code"
SIGNAL = "killed by a signal"
NODE = "node lost"  # a cluster node went down under the rank (Slurm: NODE_FAIL)
CATEGORIES = (OOM, COMM, DATA, STORAGE, USER, SIGNAL, NODE)
# a rank that checkpointed on a stop signal exits with this (128 + SIGTERM): a signal's end, never a
# root cause; gpu_lab.rank.outcome gives it to the ranks
STOP_EXIT_CODE = 143


@dataclass
class RankFailure:
    """One failed rank: its exception (or the signal that ended it) and a triage."""

    rank: int
    type: str
    message: str
    traceback: str = ""
    category: str = USER
    exitcode: int | None = None
    pid: int | None = None
    suggestions: list[str] = field(default_factory=list)
    t: float = 0.0  # when it failed: the earliest failure is the root cause
    # the exact numbers (requested/free/total bytes, batch_size; collective, timeout_s; shard) and
    # the sentence built from them; empty where the failure carries none
    details: dict = field(default_factory=dict)
    explanation: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RankFailure":
        keys = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in keys})

    def summary(self) -> str:
        return f"rank {self.rank}: {self.type}: {self.message} [{self.category}]"

    def report(self) -> str:
        """The explanation with its numbers, then what to try, cheapest first."""
        lines = [self.explanation] if self.explanation else [self.summary()]
        lines.append(f"What to try ({self.category}), cheapest first:")
        lines += [f"  {i}. {s}" for i, s in enumerate(self.suggestions, 1)]
        return "\n".join(lines)


__all__ = ["RankFailure", "CATEGORIES", "OOM", "COMM", "DATA", "STORAGE", "USER", "SIGNAL",
           "NODE"]
