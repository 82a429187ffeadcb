"""A sweep's search space: plain Python values mapped onto TrainConfig fields.

    {"lr": gpu_lab.loguniform(1e-4, 1e-1), "batch_size": [32, 64], "augment": ["basic", "none"]}

A list is a choice among its values; `loguniform(lo, hi)` and `uniform(lo, hi)` are ranges (drawn
as integers for an int field). `check(base, space)` refuses, before any trial starts, a field
TrainConfig does not have and any value TrainConfig refuses (each choice, both ends of a range),
naming the field and what is accepted: TrainConfig's own validation decides. The space travels
to the driver as JSON (`to_json` / `from_json`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Range:
    """A numeric range of a sweep's space: uniform or log-uniform between lo and hi."""

    lo: float
    hi: float
    log: bool = False

    def __post_init__(self) -> None:
        name = "loguniform" if self.log else "uniform"
        for v in (self.lo, self.hi):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"gpu_lab.{name}: got {v!r}; accepted: finite numbers")
        if not self.lo < self.hi:
            raise ValueError(f"gpu_lab.{name}({self.lo!r}, {self.hi!r}): lo must be below hi")
        if self.log and self.lo <= 0:
            raise ValueError(f"gpu_lab.loguniform({self.lo!r}, {self.hi!r}): a log range needs "
                             "lo > 0")


def loguniform(lo: float, hi: float) -> Range:
    """A range drawn evenly on a log scale (a learning rate, a weight decay)."""
    return Range(lo, hi, log=True)


def uniform(lo: float, hi: float) -> Range:
    """A range drawn evenly between lo and hi."""
    return Range(lo, hi)


_PLAIN = (bool, int, float, str, type(None))  # what an Optuna categorical holds


def check(base: Any, space: Mapping[str, Any], *, seeds: int = 1) -> dict[str, Any]:
    """The space with TrainConfig's field names (aliases resolved), every value checked by
    TrainConfig against `base`; ValueError naming the field and what is accepted otherwise."""
    from ..config import TrainConfig

    if not isinstance(space, Mapping) or not space:
        raise ValueError(f"gpu_lab.sweep: space must be a non-empty dict of TrainConfig fields; "
                         f"got {space!r}")
    out: dict[str, Any] = {}
    for key, value in space.items():
        try:  # an unknown field is named with the closest one and every accepted name
            TrainConfig.from_dict({**base.to_dict(), key: _sample(value)})
        except (TypeError, ValueError) as e:
            raise ValueError(f"gpu_lab.sweep: space field {key!r}: {e}") from None
        name = _canonical(key)
        if name in ("output_dir", "resume_from"):
            raise ValueError(f"gpu_lab.sweep: space field {key!r} cannot be swept: every trial "
                             "gets its own folder")
        if name == "seed" and seeds > 1:
            raise ValueError("gpu_lab.sweep: space field 'seed' with seeds>1: the seeds are the "
                             "sweep's own (seeds=K runs each trial with K seeds); drop one")
        values = _choices(key, value) if isinstance(value, (list, tuple)) else _range(key, value)
        for v in values:
            try:
                base.replace(**{name: v})
            except (TypeError, ValueError) as e:
                raise ValueError(f"gpu_lab.sweep: space field {key!r}, value {v!r}: {e}") from None
        out[name] = value
    return out


def _canonical(key: str) -> str:
    from ..config import ALIASES

    return ALIASES.get(key, key)


def _sample(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and value:
        return value[0]
    return value.lo if isinstance(value, Range) else value


def _choices(key: str, value: list | tuple) -> list:
    if not value:
        raise ValueError(f"gpu_lab.sweep: space field {key!r}: an empty list of choices")
    for v in value:
        if not isinstance(v, _PLAIN):
            raise ValueError(f"gpu_lab.sweep: space field {key!r}, choice {v!r}: accepted: "
                             "None, bool, int, float or str")
    return list(value)


def _range(key: str, value: Any) -> list:
    if not isinstance(value, Range):
        raise ValueError(f"gpu_lab.sweep: space field {key!r}: got {value!r}; accepted: a list "
                         "of choices, gpu_lab.uniform(lo, hi) or gpu_lab.loguniform(lo, hi)")
    if _is_int(_canonical(key)):
        if value.lo != int(value.lo) or value.hi != int(value.hi):
            raise ValueError(f"gpu_lab.sweep: space field {key!r} is an integer; its range "
                             f"({value.lo!r}, {value.hi!r}) needs whole ends")
        return [int(value.lo), int(value.hi)]
    return [float(value.lo), float(value.hi)]


def _is_int(name: str) -> bool:
    from ..config import TrainConfig

    f = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    return str(f.type).split("|")[0].strip() == "int"


def suggest(trial: Any, space: Mapping[str, Any]) -> dict[str, Any]:
    """Optuna's draw of every field of the (checked) space for `trial`."""
    params = {}
    for name, value in space.items():
        if isinstance(value, (list, tuple)):
            params[name] = trial.suggest_categorical(name, list(value))
        elif _is_int(name):
            params[name] = trial.suggest_int(name, int(value.lo), int(value.hi), log=value.log)
        else:
            params[name] = trial.suggest_float(name, value.lo, value.hi, log=value.log)
    return params


def grid(space: Mapping[str, Any]) -> dict[str, list]:
    """The grid sampler's search space: every field must be a list of choices."""
    ranges = [k for k, v in space.items() if not isinstance(v, (list, tuple))]
    if ranges:
        raise ValueError(f"gpu_lab.sweep: sampler='grid' needs a list of choices for every field; "
                         f"{', '.join(ranges)} is a range: list its values, or use sampler='tpe'")
    return {k: list(v) for k, v in space.items()}


def to_json(space: Mapping[str, Any]) -> dict:
    return {k: (list(v) if isinstance(v, (list, tuple)) else
                {"lo": v.lo, "hi": v.hi, "log": v.log}) for k, v in space.items()}


def from_json(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, list) else Range(v["lo"], v["hi"], v["log"]))
            for k, v in d.items()}
