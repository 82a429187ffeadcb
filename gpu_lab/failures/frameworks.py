"""What a training framework's own refusal means in a run gpu_lab started, and the way out.

Lightning checks that its devices × nodes equal the world size; under gpu_lab the world is the
launch's ranks, so the advice names both numbers to change.
"""
from __future__ import annotations

import re

_LIGHTNING_WORLD = re.compile(r"devices=(\d+)`? and `?num_nodes=(\d+)`? in Lightning, but the "
                              r"product \(\d+ \* \d+\) does not match the world size \((\d+)\)")


def world_suggestions(text: str) -> tuple[str, list[str]] | None:
    """A Lightning Trainer asked for another number of processes than were started: the
    sentence and the two ways out, or None for another message."""
    m = _LIGHTNING_WORLD.search(text)
    if not m:
        return None
    devices, nodes, world = map(int, m.groups())
    per_node = max(1, world // max(1, nodes))
    return (f"Lightning's Trainer asks for {devices} device(s) × {nodes} node(s) = "
            f"{devices * nodes} processes, but {world} ranks were started.",
            [f"pass devices={per_node} (or devices=\"auto\") to the Trainer: every rank is one "
             "device of the launch",
             f"or launch {devices * nodes} ranks: launch(..., num_processes={devices * nodes})"])
