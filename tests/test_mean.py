"""The mean over ranks (gpu_lab.record.mean), its one home: at rest from per-rank arrays, live
as a fold over events, and the live form started from a real registry wherever a reader stands
agreeing with the mean of the whole record."""
from __future__ import annotations

import math
import random

import pytest

from gpu_lab.record import mean
from gpu_lab.record.registry import Registry
from gpu_lab.server import runview


def metric(rank, step, t=None, **data):
    return {"rank": rank, "kind": "metric", "t": 1000.0 + step if t is None else t, "step": step,
            "data": data}


# --- at rest -----------------------------------------------------------------------------------
def test_exact_mean_is_over_the_ranks_that_reported_each_step():
    steps, times, vals = mean.over_ranks([([0, 1, 2], [10, 11, 12], [1.0, 1.0, 1.0]),
                                          ([0, 2], [10.5, 13], [3.0, 5.0])], exact=True)
    assert list(steps) == [0, 1, 2] and list(vals) == [2.0, 1.0, 3.0]
    assert list(times) == [10.5, 11, 13]  # the newest report of the step


def test_a_ranks_nan_shows_in_the_mean_and_a_point_without_step_is_left_out():
    _, _, vals = mean.over_ranks([([0, 1], [0, 1], [1.0, float("nan")]),
                                  ([0, 1, float("nan")], [0, 1, 2], [3.0, 1.0, 7.0])], exact=True)
    assert vals[0] == 2.0 and math.isnan(vals[1]) and len(vals) == 2


def test_decimated_series_are_interpolated_within_each_ranks_range():
    steps, _, vals = mean.over_ranks([([0, 10], [0, 10], [0.0, 10.0]),
                                      ([5, 20], [5, 20], [100.0, 100.0])], exact=False)
    assert list(steps) == [0, 5, 10, 20]
    # step 0: rank 0 alone (rank 1 starts at 5); 5, 10: both; 20: rank 1 alone
    assert list(vals) == pytest.approx([0.0, 52.5, 55.0, 100.0])


def test_no_points_give_empty_arrays():
    assert [len(a) for a in mean.over_ranks([([], [], [])], exact=True)] == [0, 0, 0]


# --- live --------------------------------------------------------------------------------------
def test_a_step_goes_once_every_rank_reported_it():
    fold = mean.Fold(2)
    assert fold.add(0, 1.0, {"loss": 1.0}) == []
    assert fold.add(0, 2.0, {"loss": 3.0, "note": "text", "flag": True}) == [("loss", 0, 2.0, 2.0)]


def test_a_rank_that_stops_reporting_does_not_hold_the_mean_back():
    fold = mean.Fold(2, window=4)
    out = []
    for step in range(7):
        out += fold.add(step, float(step), {"loss": float(step)})  # rank 0 only
    assert [p[1] for p in out] == [0, 1]  # a step goes once one more than 4 newer arrived
    assert [p[1] for p in fold.flush()] == [2, 3, 4, 5, 6]


def test_a_late_report_gives_its_step_again_with_the_new_mean():
    fold = mean.Fold(2, window=2)
    for step in range(4):
        fold.add(step, float(step), {"loss": 1.0})
    assert fold.add(1, 9.0, {"loss": 3.0}) == [("loss", 1, 9.0, 2.0)]


@pytest.mark.parametrize("seed", range(6))
def test_live_points_from_any_cursor_end_as_the_mean_of_the_whole_record(tmp_path, seed):
    """A run view opens at some seq (its snapshot's mean, whole at that seq), then gets the live
    points in batches of any size, each started from the registry: replacing points at their
    steps, it ends with the mean of the whole record."""
    rng = random.Random(seed)
    reg = Registry(tmp_path / "registry.db")
    reg.create_run("r", num_processes=3, status="running")
    events = []
    for step in range(60):
        for rank in rng.sample(range(3), 3):  # ranks in any order, some a little behind
            if (rank, step) != (2, 17):  # one report lost
                events.append(metric(rank, step, t=step + rank / 10, loss=float(rng.random())))
    rng.shuffle(events[30:60])
    reg.add_events("r", events)
    everything = reg.events("r")
    whole = mean.over_ranks([([e["step"] for e in everything if e["rank"] == r],
                              [e["t"] for e in everything if e["rank"] == r],
                              [e["data"]["loss"] for e in everything if e["rank"] == r])
                             for r in range(3)], exact=True)

    opened = rng.randrange(1, len(everything))  # the snapshot: exact mean up to `opened`
    shown = dict(zip(*mean.over_ranks([([e["step"] for e in everything[:opened] if e["rank"] == r],
                                        [e["t"] for e in everything[:opened] if e["rank"] == r],
                                        [e["data"]["loss"] for e in everything[:opened]
                                         if e["rank"] == r]) for r in range(3)],
                                      exact=True)[::2]))
    reg.set_status("r", "succeeded")
    row = reg.get_run("r")
    at = opened
    while at < len(everything):
        upto = min(len(everything), at + rng.randrange(1, 40))
        batch = everything[at:upto]
        got = runview.live_mean(reg, row, everything[at - 1]["seq"], batch,
                                ended=upto == len(everything))
        for s, v in zip(got["loss"]["step"], got["loss"]["value"]) if got else ():
            shown[s] = v
        at = upto
    assert sorted(shown) == list(whole[0])
    assert [shown[s] for s in sorted(shown)] == pytest.approx(list(whole[2]))
