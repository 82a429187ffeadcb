"""Training functions that report bad things among good ones (tests/test_record_fuzz.py)."""
from __future__ import annotations

import json
import math
import os

import gpu_lab
from gpu_lab.record.events import ENV_ADDRESS, ENV_RUN_ID

DEEP = 10_000
BIG = 10 * 1024 * 1024  # a 10 MB string

# what each rank's reporter refuses, by reason (see bad_reports)
REFUSED_AT_RANK = {"step": 4, "value": 3, "name": 1, "data": 2}
# what the recorder refuses of each rank's raw messages and odd internals, by reason
REFUSED_AT_RECORDER = {"kind": 2, "t": 2, "step": 2, "rank": 1, "data": 1, "value": 1,
                       "undecodable": 2, "size": 1}
SPECIAL = {10: math.nan, 11: math.inf, 12: -math.inf}  # step -> the loss reported there


def push_raw(messages: list[bytes], address: str | None = None, key: object = None) -> None:
    """Send messages straight to the run's recorder socket, as a rank's own code could: with the
    run's key from the rank's environment (a process without it is refused: test_record_private)."""
    import zmq

    from gpu_lab.record.channel import ENV_KEY, ClientKey

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    (key or ClientKey.decode(os.environ[ENV_KEY])).apply(sock)
    sock.connect(address or os.environ[ENV_ADDRESS])
    for m in messages:
        sock.send(m)
    sock.close()
    ctx.term()


def _nested_dict(depth: int) -> dict:
    d: dict = {}
    for _ in range(depth):
        d = {"a": d}
    return d


def _nested_list(depth: int) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def one_text_step(steps: int = 50) -> int:
    """The bug of issue #30: one report with a text step among good ones."""
    for s in range(steps):
        gpu_lab.report(step=s, loss=1.0 / (s + 1))
        if s == 5:
            gpu_lab.report(step="5", loss=0.5)
    return steps


def good_reports(n: int) -> int:
    """n + 2 valid reports (NaN and infinities among them); returns how many."""
    import numpy as np
    import torch

    for s in range(n):
        step = np.int64(s) if s % 3 == 0 else torch.tensor(s) if s % 3 == 1 else s
        gpu_lab.report(step, loss=SPECIAL.get(s, 1.0 / (s + 1)), acc=np.float32(0.5),
                       grad=torch.tensor(0.25))
    gpu_lab.report(None, lr=0.1)
    gpu_lab.report(n, loss=math.nan, junk="text")  # junk is refused, loss kept: the last loss
    return n + 2


def bad_reports(rank: int) -> None:
    """Every kind of mistake through gpu_lab's own calls (REFUSED_AT_RANK)."""
    from gpu_lab.record import events as ev
    from gpu_lab.record.reporter import get_reporter

    for step in ("5", 2.5, -1, True):
        gpu_lab.report(step, loss=1.0)
    gpu_lab.report(1, loss="x" * BIG)
    gpu_lab.report(1, loss=_nested_list(DEEP))
    gpu_lab.report(1, **{"n" * 300: 1.0})
    rep = get_reporter()
    rep._put(ev.LOG, "not a dict")
    rep._put(ev.LOG, _nested_dict(DEEP))
    rep._put("bogus", {"x": 1})  # a kind the record does not know: the recorder refuses it
    rep.log("y" * BIG)  # recorded, cut to MAX_TEXT characters


def raw_messages(rank: int, run_id: str) -> list[bytes]:
    """Messages no Reporter makes (REFUSED_AT_RECORDER less the reporter's bogus kind), and one
    good event among them that must be recorded."""
    import time

    t = time.time()

    def e(**kw):
        return {"run": run_id, "rank": rank, "kind": "metric", "t": t, "step": 3,
                "data": {"raw_ok": 1.0}, **kw}

    mixed = [e(), e(kind="bogus"), {k: v for k, v in e().items() if k != "t"}, e(t=math.nan),
             e(step="7"), e(step=2.5), e(rank="0"), e(data="x"), e(data={"loss": "text"})]
    return [json.dumps(mixed).encode(),
            b"[" * DEEP + b"]" * DEEP,
            b"\xff not json",
            json.dumps([e(kind="log", data={"text": "z" * (3 * 1024 * 1024)})]).encode()]


def mixed_reports(n: int = 40) -> dict:
    """On every rank: good reports, every kind of bad one, raw messages to the recorder; then
    an all-reduce, so the ranks are a real group to the end."""
    import torch

    acc = gpu_lab.accelerator()
    rank = acc.process_index
    good = good_reports(n)
    bad_reports(rank)
    push_raw(raw_messages(rank, os.environ[ENV_RUN_ID]))
    push_raw([b"0" * (BIG + 1)])  # over the socket's limit: zmq drops it and that connection
    every = acc.gather(torch.tensor([float(good)]))
    return {"good": good, "every": every.tolist()}
