"""The event schema: the only thing that crosses the process boundary between workers and kernel.

An event is a plain dict, JSON-serialisable, with these keys:

    run   str    the run id
    rank  int    global rank of the sender (-1: the supervisor)
    kind  str    one of KINDS
    t     float  wall time (time.time()) when the event was made
    step  int | None
    data  dict   kind-specific payload: for "metric", {name: float}; for "status", {"status": str,
                 "reason": str, ...}; for "error", {"type", "message", "traceback", "category"};
                 for "log", {"text": str}; for "dropped", {"count": int, "refused": int,
                 "why": {reason: int}} (count: events lost on the way, refused: reports that
                 could not be recorded, both since the sender started; rank -1: the recorder's);
                 for "config", the run's hyperparameters as a flat {name: value} (what
                 accelerate's init_trackers(config=...) or a Trainer's arguments say): merged
                 into the run's row, shown as its config; for "checkpoint", {"path": str} of a
                 checkpoint the run's code saved (a Trainer's, Lightning's), at `step`: listed
                 on the run (Run.checkpoints), what run.resume() points a framework at
    seq   int    given by the run's recorder when it writes the event to the registry: the
                 event's position in the run's record (absent on the way from a rank)

Events travel in batches (a JSON list) so that one send carries many reports; a message is at
most MAX_MESSAGE bytes, one event at most MAX_EVENT. Metric values may be NaN or +-inf: they are
recorded as they are (JSON's NaN/Infinity tokens, which Python's json reads and writes). On the
wire (`encode`) an event's data is its own JSON text under "dj"; `checked` and `decode` give it
back as a dict, and the recorder stores the text it checked as it came.

`problem(e)` is the record's contract: the recorder writes only events it finds no problem with,
so a record holds nothing else. Readers still go through `step_of` and `numbers`, because
records written before that contract may hold a text step or a data that is not a dict.
"""
from __future__ import annotations

import json
import math
from typing import Any

METRIC = "metric"
STATUS = "status"
ERROR = "error"
LOG = "log"
DROPPED = "dropped"
CONFIG = "config"
CHECKPOINT = "checkpoint"
KINDS = (METRIC, STATUS, ERROR, LOG, DROPPED, CONFIG, CHECKPOINT)

# A run's status, as the registry keeps it and status events carry it.
ACTIVE_STATUSES = ("pending", "queued", "running", "stopping")
# pruned: stopped with a checkpoint by its sweep (gpu_lab.sweep), its trial judged hopeless
FINAL_STATUSES = ("succeeded", "failed", "stopped", "lost", "pruned")
LOST = "its supervisor process ended without recording a final status"  # a lost run's reason
STATUSES = ACTIVE_STATUSES + FINAL_STATUSES
# The `from` of a Slurm job supervisor's status events. Its final word can overtake the ranks'
# last reports (other sockets): the follower writes the run's end once they are in, and a
# handle finishes on that, not on this.
FROM_JOB = "job"

# seconds between a Reporter's batches and between the recorder's writes: a run view shows a
# report within about two of these and the server's read (bench/live_latency.py); each batch or
# write takes what arrived meanwhile, so throughput does not shrink with it
BATCH_INTERVAL = 0.05

# Environment variables that a launch sets for its workers (and gpu_lab.rank.headless for headless runs).
ENV_RUN_ID = "GPU_LAB_RUN_ID"
ENV_ADDRESS = "GPU_LAB_EVENTS"       # zmq address the run's recorder listens on
ENV_RUN_DIR = "GPU_LAB_RUN_DIR"      # logs, result, control files of this run
ENV_RESUME = "GPU_LAB_RESUME_FROM"   # a checkpoint a framework's train()/fit() continues from
ENV_DEVICE = "GPU_LAB_DEVICE"        # "cuda" or "cpu": what gpu_lab.accelerator() should use


def make(run: str, rank: int, kind: str, data: dict[str, Any], step: int | None = None,
         t: float | None = None) -> dict[str, Any]:
    import time

    if kind not in KINDS:
        raise ValueError(f"event kind: got {kind!r}; accepted: {', '.join(KINDS)}")
    return {"run": run, "rank": int(rank), "kind": kind, "t": time.time() if t is None else t,
            "step": step, "data": data}


# On the wire an event's data travels as its own JSON text (key TEXT), which the recorder stores
# as it came once it has checked it: the registry's row needs that text, and writing it again from
# the decoded dict cost the recorder a fifth of its time. A decoded event keeps it under TEXT.
TEXT = "_text"
_WIRE = "dj"


def encode(batch: list[dict[str, Any]]) -> bytes:
    return json.dumps([_wire(e) for e in batch], separators=(",", ":"), default=_default).encode()


def _wire(e: Any) -> Any:
    if type(e) is not dict or "data" not in e:
        return e
    out = {k: v for k, v in e.items() if k != "data" and k != TEXT}
    text = e.get(TEXT)
    out[_WIRE] = text if type(text) is str else json.dumps(e["data"], separators=(",", ":"),
                                                             default=_default)
    return out


def _unwire(e: Any, _scan: Any = json.scanner.make_scanner(json.JSONDecoder())) -> Any:
    """An event as it came (data as its JSON text) with its data decoded; TEXT keeps the text.
    Data whose text is not JSON (or not all of it) becomes None: `problem` refuses it."""
    text = e.pop(_WIRE)
    data = None
    if type(text) is str:
        try:
            data, end = _scan(text, 0)
            if end != len(text):
                data = None
        except (ValueError, RecursionError, StopIteration):
            data = None
    e["data"], e[TEXT] = data, text
    return e


def decode(raw: bytes) -> list[dict[str, Any]]:
    """The events of a message; what is not an event of a known kind is left out. A message
    from a rank is checked further by `checked` before it is recorded."""
    batch = json.loads(raw)
    if isinstance(batch, dict):
        batch = [batch]
    out = [_unwire(e) if _WIRE in e else e for e in batch
           if isinstance(e, dict) and e.get("kind") in KINDS]
    for e in out:  # a reader has no use for the text
        e.pop(TEXT, None)
    return out


def _default(o: Any) -> Any:
    try:
        return float(o)
    except Exception:  # noqa: BLE001 - what json cannot take is kept as its repr
        return repr(o)


# --- the record's contract ------------------------------------------------------------------------
MAX_MESSAGE = 4 * 1024 * 1024   # bytes: the recorder's socket refuses larger messages
MAX_BATCH = 1024 * 1024         # bytes: a Reporter's batch stays below this (well below the above)
MAX_EVENT = 256 * 1024          # bytes: one encoded event
MAX_TEXT = 64 * 1024            # characters of a log text (or an error's text) a Reporter keeps
MAX_NAME = 200                  # characters of a metric name
MAX_DEPTH = 8                   # nesting of a non-metric event's data
_MAX_INT = 2 ** 63              # SQLite's integers are 64-bit


def problem(e: Any, _finite: Any = math.isfinite) -> str | None:
    """None when `e` can go in a run's record, else what is wrong, as a short reason (the key
    under which refusals are counted: kind, t, rank, step, data, value, name, size). On the
    recorder's path for every event: checks done in C (map, set) where they can be."""
    if type(e) is not dict:
        return "event"
    kind = e.get("kind")
    if kind not in _KIND_SET:
        return "kind"
    t = e.get("t")
    if not (type(t) is float and _finite(t) or type(t) is int and 0 <= t < _MAX_INT):
        return "t"
    rank = e.get("rank")
    if type(rank) is not int or not -1 <= rank < 2 ** 31:
        return "rank"
    step = e.get("step")
    if step is not None and (type(step) is not int or not 0 <= step < _MAX_INT):
        return "step"
    data = e.get("data")
    if type(data) is not dict:
        return "data"
    if kind != METRIC:
        return None if within_depth(data, MAX_DEPTH) else "data"
    if not data:
        return None
    types = set(map(type, data.values()))
    if not types <= _FLOAT and (not types <= _NUMBER or any(
            type(v) is int and not -_MAX_INT <= v < _MAX_INT for v in data.values())):
        return "value"
    if not data.keys() <= _NAMES_SEEN:  # metric names repeat: check each new one once
        if max(map(len, data)) > MAX_NAME or "" in data:
            return "name"
        if len(_NAMES_SEEN) < 10_000:
            _NAMES_SEEN.update(data)
    return None


_NAMES_SEEN: set = set()  # metric names known to be fine


_KIND_SET = frozenset(KINDS)
_FLOAT = frozenset((float,))
_NUMBER = frozenset((float, int))


def within_depth(o: Any, depth: int) -> bool:
    if isinstance(o, dict):
        return depth > 0 and all(within_depth(v, depth - 1) for v in o.values())
    if isinstance(o, list):
        return depth > 0 and all(within_depth(v, depth - 1) for v in o)
    return True


def checked(raw: bytes) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The recordable events of a message from a rank, and {reason: count} of those refused. A
    message that is not JSON (or nests deeper than the decoder goes) counts as one refusal."""
    try:
        batch = json.loads(raw)
    except (ValueError, RecursionError, MemoryError):
        return [], {"undecodable": 1}
    if isinstance(batch, dict):
        batch = [batch]
    elif not isinstance(batch, list):
        return [], {"undecodable": 1}
    good, why = [], {}
    for e in batch:
        if type(e) is dict and _WIRE in e:
            _unwire(e)
        p = problem(e)
        if p is None:
            good.append(e)
        else:
            why[p] = why.get(p, 0) + 1
    if len(raw) > MAX_EVENT and good:  # only then can one event be over the limit
        small = [e for e in good if not _maybe_big(e) or _size(e) <= MAX_EVENT]
        if len(small) != len(good):
            why["size"] = why.get("size", 0) + len(good) - len(small)
            good = small
    return good, why


def _maybe_big(e: dict) -> bool:
    """Whether an event that passed `problem` may encode to over MAX_EVENT bytes: a metric's name
    encodes to at most 12 bytes a character (JSON's surrogate pairs), its number to 25."""
    if e["kind"] != METRIC:
        return True
    return 200 + len(e["data"]) * (12 * MAX_NAME + 30) > MAX_EVENT


def _size(e: dict) -> int:
    try:
        return len(encode([e]))
    except (ValueError, TypeError, RecursionError):
        return MAX_EVENT + 1


def ends_run(e: Any) -> bool:
    """Whether a reader takes this event as the run's end: a final status, except a Slurm job's
    own word (the follower writes the end once the ranks' last reports are in)."""
    data = e.get("data") if isinstance(e, dict) else None
    return e.get("kind") == STATUS and isinstance(data, dict) and \
        data.get("status") in FINAL_STATUSES and data.get("from") != FROM_JOB


def step_of(e: dict) -> int | None:
    """An event's step for a reader: an int, or None (no step, or one an older record holds
    that is not an int)."""
    s = e.get("step")
    return s if type(s) is int else None


def numbers(data: Any):
    """(name, value) of a metric event's numbers (NaN and +-inf included); anything else an
    older record might hold is left out."""
    if type(data) is not dict:
        return
    for k, v in data.items():
        if isinstance(v, float):
            yield k, float(v)
        elif isinstance(v, int) and not isinstance(v, bool) and -_MAX_INT <= v < _MAX_INT:
            yield k, float(v)
