"""What the endpoints send: telemetry samples and registry rows as plain JSON-safe dicts.

Samples keep the sampler's own field names (gpu_lab.telemetry: `host.cpu_pct`, `host.ram_used_mb`,
`gpus[i].util_gpu`, `gpus[i].mem_used_mb`, ...), so the lab extension and the Prometheus exposition
read the same names the notebook widgets do. NaN and infinities become null (JSON has neither).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

# Registry columns the browser needs; config (possibly large) only goes out for one run at a time.
RUN_FIELDS = ("id", "name", "status", "num_processes", "num_nodes", "host", "started", "ended",
              "notebook", "output_dir", "run_dir", "error", "reason", "resumed_from", "detach",
              "kind", "last_step", "last_loss", "queue_position", "priority", "devices",
              "sweep", "job", "note")


def json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_safe(dataclasses.asdict(value))
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return json_safe(to_dict())
    return str(value)


def sample_to_wire(sample: Any) -> dict:
    """A telemetry sample as {"t": ..., "host": {...}, "gpus": [{...}, ...], ...}."""
    out = json_safe(sample)
    if not isinstance(out, dict):
        raise TypeError(f"telemetry sample: expected a mapping, got {type(sample).__name__}")
    out.setdefault("host", {})
    out.setdefault("gpus", [])
    return out


def run_to_wire(row: dict) -> dict:
    from ..record.registry import precision_words

    out = {k: json_safe(row.get(k)) for k in RUN_FIELDS}
    out["precision"] = precision_words(row) or None  # what the ranks train with
    return out
