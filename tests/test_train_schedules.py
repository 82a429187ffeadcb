"""Schedules are pure functions of the step: warmup over the first 5%, then cosine / constant / step."""
from __future__ import annotations

import math

import pytest
import torch

from gpu_lab.config import TrainConfig
from gpu_lab.train.schedules import Schedule, build_scheduler, cosine, step_decay, warmup_steps
from train_helpers import one_thread  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def test_warmup_then_cosine():
    total = 200
    w = warmup_steps(total, 0.05)
    assert w == 10
    lrs = [cosine(s, total, w) for s in range(total + 1)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))           # linear rise
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))          # then never rises again
    assert lrs[10 + 95] == pytest.approx(0.5, abs=0.01)             # half way down
    assert lrs[total] == pytest.approx(0.0, abs=1e-12)


def test_step_and_constant():
    s = Schedule("step", total_steps=100, warmup=0, step_size=30, gamma=0.5)
    assert [s(i) for i in (0, 29, 30, 59, 60, 99)] == [1, 1, 0.5, 0.5, 0.25, 0.125]
    c = Schedule("constant", total_steps=100, warmup=4)
    assert [c(i) for i in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]
    assert step_decay(3, 4, 10, 0.1) == 1.0  # still warming up


def test_scheduler_matches_pure_function_and_saves_plain_data(tmp_path):
    cfg = TrainConfig(lr=0.1, scheduler="cosine", warmup_ratio=0.1)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=50)
    fn = Schedule.from_config(cfg, 50)
    for step in range(50):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * fn(step))
        opt.step()
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)  # no pickled callables inside
    assert state["last_epoch"] == 50 and state["lr_lambdas"][0]["total_steps"] == 50


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="accepted: cosine, constant, step"):
        Schedule("linear", 10, 0)(0)
    assert math.isclose(Schedule("cosine", 10, 0)(0), 1.0)
