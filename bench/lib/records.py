"""Long run records written fast, for bench/attach_scale.py and tests/test_record_long.py: metric
events straight into Registry.add_events in big batches (what a run's recorder does, without
the run), with one spike to find again.
"""
from __future__ import annotations

import math
from typing import Any

SPIKE = 1000.0
FIT = ("samples_per_s", "step_time", "data_wait", "epoch")  # what fit logs besides loss and lr


def loss_at(rank: int, step: int) -> float:
    """A smooth, noisy-looking loss that never reaches SPIKE."""
    return 2.0 / (1.0 + step * 1e-4) + 0.05 * math.sin(step * 0.37 + rank) + 0.1 * rank


def write_record(registry: Any, run_id: str, events: int, *, ranks: int = 2,
                 spike: tuple[int, int] | None = None, batch: int = 20_000,
                 t0: float = 1.7e9, status: str = "succeeded", fit: bool = False) -> int:
    """A finished run of `events` metric events (loss, lr; `fit`: also fit's other four) over
    `ranks` ranks, one event per rank per step, rank r's loss at step s is loss_at(r, s) except
    SPIKE at `spike` (rank, step); a running status event per rank first and a few log events.
    Returns the last step."""
    registry.create_run(run_id, name=run_id, num_processes=ranks, status="running")
    registry.add_events(run_id, [{"rank": r, "kind": "status", "t": t0, "step": None,
                                  "data": {"status": "running", "pid": 1000 + r}}
                                 for r in range(ranks)])
    steps = events // ranks
    for a in range(0, steps, batch // ranks):
        out = []
        for s in range(a, min(steps, a + batch // ranks)):
            for r in range(ranks):
                v = SPIKE if (r, s) == spike else loss_at(r, s)
                data = {"loss": v, "lr": 1e-3 * (1.0 - s / steps)}
                if fit:
                    data.update(samples_per_s=1000.0 + (s * 7919 % 101), step_time=0.01 + (
                        s % 13) * 1e-4, data_wait=(s % 7) * 1e-4, epoch=float(s // 1000))
                out.append({"rank": r, "kind": "metric", "t": t0 + s * 0.01, "step": s,
                            "data": data})
        registry.add_events(run_id, out)
    registry.add_events(run_id, [{"rank": 0, "kind": "log", "t": t0 + steps * 0.01, "step": None,
                                  "data": {"text": f"line {i}"}} for i in range(3)],
                        end={"status": status})
    return steps - 1
