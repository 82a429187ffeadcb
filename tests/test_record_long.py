"""Opening a long run reads what it shows: attach, the run view and compare read the registry's
downsampled levels (gpu_lab.record.levels); a spike survives, the min/max envelope is exact,
the live events continue the bounded history without a gap or a duplicate, and full resolution
(frame(), to_csv()) and older registries still work."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import gpu_lab
import launch_fns
from proc_utils import wait_until
from test_registry_faults import read_only_view  # noqa: F401 - the fixture, as that file makes it
from bench.lib.records import SPIKE, loss_at, write_record
from gpu_lab.launch.run import attach_run
from gpu_lab.record.registry import Registry
from gpu_lab.server import runview
from gpu_lab.record import levels
from gpu_lab.readers.runmetrics import ATTACH_POINTS

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

EVENTS = 200_000
STEPS = EVENTS // 2
SPIKE_AT = (1, 90_000)
EXTRA_LOGS = 600


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    reg = Registry(tmp_path_factory.mktemp("long") / "registry.db")
    write_record(reg, "long", EVENTS, spike=SPIKE_AT)
    reg.add_events("long", [{"rank": 0, "kind": "log", "t": 2e9, "step": None,
                             "data": {"text": f"extra {i}"}} for i in range(EXTRA_LOGS)])
    return reg


def _expected(rank: int) -> np.ndarray:
    v = np.array([loss_at(rank, s) for s in range(STEPS)])
    if rank == SPIKE_AT[0]:
        v[SPIKE_AT[1]] = SPIKE
    return v


def _is_data(steps, values, rank: int) -> bool:
    exact = _expected(rank)
    return all(exact[int(s)] == v for s, v in zip(steps, values))


def test_attach_shows_the_spike_in_at_most_the_dashboards_points(long_run):
    run = attach_run("long", registry=long_run)
    assert run.status == "succeeded" and run.done
    for rank in (0, 1):
        steps, values = run.metrics.series("loss", rank)
        assert 1000 <= len(values) <= ATTACH_POINTS
        assert steps[0] == 0 and steps[-1] == STEPS - 1
        assert all(a < b for a, b in zip(steps, steps[1:]))
        assert _is_data(steps, values, rank)  # real points only, at their steps
        exact = _expected(rank)
        assert min(values) == exact.min() and max(values) == exact.max()
        assert run.metrics.count("loss", rank) == STEPS  # the true length, not what is held
    steps, values = run.metrics.series("loss", 1)
    assert steps[values.index(SPIKE)] == SPIKE_AT[1]
    # the other kinds are bounded too, and say how many there were
    assert run.history_counts["log"] == 3 + EXTRA_LOGS
    assert len(run._log_events) <= 500
    assert run._log_events[-1]["data"]["text"] == f"extra {EXTRA_LOGS - 1}"


def test_the_envelope_holds_each_buckets_exact_min_and_max(long_run):
    snap = long_run.series("long", ATTACH_POINTS)
    for rank in (0, 1):
        p = snap.series[(rank, "loss")]
        assert p.level >= 1 and p.count == STEPS
        size = levels.SIZES[p.level - 1]
        exact = _expected(rank)
        env_steps, env_values = np.asarray(p.env[0]), np.asarray(p.env[2])
        for b in range(0, STEPS // size):
            region = (env_steps >= b * size) & (env_steps < (b + 1) * size)
            seg = exact[b * size:(b + 1) * size]
            assert env_values[region].min() == seg.min(), (rank, b)
            assert env_values[region].max() == seg.max(), (rank, b)


def test_run_view_and_compare_show_the_spike_bounded(long_run):
    d = runview.detail(long_run, "long", points=500)
    loss = d["series"]["loss"]
    assert set(loss) == {"0", "1", "mean"}
    for key, s in loss.items():
        assert len(s["value"]) <= 500 and len(s["step"]) == len(s["t"]) == len(s["value"])
        assert s["step"][-1] == STEPS - 1
    one = loss["1"]
    assert one["step"][one["value"].index(SPIKE)] == SPIKE_AT[1]
    mean = dict(zip(loss["mean"]["step"], loss["mean"]["value"]))
    assert mean[SPIKE_AT[1]] == pytest.approx((SPIKE + loss_at(0, SPIKE_AT[1])) / 2, abs=0.2)
    assert d["seq"] == long_run.last_seq("long")
    assert d["pids"] == {"0": 1000, "1": 1001}
    assert len(d["notes"]) == runview.NOTES_KEPT
    assert d["notes"][-1]["data"]["text"] == f"extra {EXTRA_LOGS - 1}"

    out = runview.compare(long_run, ["long"], points=300)
    s = out["metrics"]["loss"]["long"]
    assert len(s["value"]) <= 300 and max(s["value"]) > SPIKE / 2 - 1

    from gpu_lab.widgets.compare import compare

    fig = compare(["long"], metric="loss", rank=1, max_points=400, registry=long_run)
    (trace,) = fig.data
    assert len(trace.y) <= 400 and max(trace.y) == SPIKE
    assert list(trace.x)[list(trace.y).index(SPIKE)] == SPIKE_AT[1]


def test_frame_and_csv_hold_every_point(long_run, tmp_path):
    run = attach_run("long", registry=long_run)
    df = run.metrics.frame()
    assert len(df) == 2 * EVENTS  # loss and lr of every event
    assert list(df.columns) == ["seq", "rank", "step", "t", "name", "value"]
    for rank in (0, 1):
        loss = df[(df["name"] == "loss") & (df["rank"] == rank)]
        assert loss["step"].tolist() == list(range(STEPS))
        assert np.array_equal(loss["value"].to_numpy(), _expected(rank))
    assert df["seq"].is_monotonic_increasing
    one = run.metrics.frame(name="loss", rank=1)
    assert len(one) == STEPS and one["value"].max() == SPIKE

    path = tmp_path / "long.csv"
    assert run.metrics.to_csv(path) == len(df)
    back = pd.read_csv(path)
    assert back.shape == df.shape
    for col in ("seq", "rank", "step", "t", "value"):
        assert np.array_equal(back[col].to_numpy(), df[col].to_numpy()), col
    assert back["name"].tolist() == df["name"].astype(str).tolist()


# The layout before levels (and its first schema's per-scalar metrics table): what an older
# gpu_lab left on disk.
OLD_SCHEMA = """
CREATE TABLE runs (id TEXT PRIMARY KEY, name TEXT, status TEXT NOT NULL, config TEXT,
    num_processes INTEGER, num_nodes INTEGER DEFAULT 1, node_rank INTEGER DEFAULT 0, host TEXT,
    pid INTEGER, pgid INTEGER, pid_started REAL, started REAL, ended REAL, notebook TEXT,
    output_dir TEXT, run_dir TEXT, error TEXT, kind TEXT DEFAULT 'launch');
CREATE TABLE events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, rank INTEGER NOT NULL,
    kind TEXT NOT NULL, t REAL NOT NULL, step INTEGER, data TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)) WITHOUT ROWID;
CREATE TABLE checkpoints (run_id TEXT NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL,
    t REAL NOT NULL);
CREATE TABLE metrics (run_id TEXT NOT NULL, rank INTEGER NOT NULL, step INTEGER, t REAL NOT NULL,
    name TEXT NOT NULL, value REAL);
"""


def test_a_registry_from_before_levels_opens_and_keeps_them_from_then_on(tmp_path: Path):
    path = tmp_path / "old.db"
    c = sqlite3.connect(path)
    c.executescript(OLD_SCHEMA)
    n = 40_000
    c.execute("INSERT INTO runs (id, name, status, num_processes, started) VALUES "
              "('old', 'old', 'succeeded', 2, 1.7e9)")
    c.executemany("INSERT INTO events VALUES ('old', ?, ?, 'metric', ?, ?, ?)",
                  [(i + 1, i % 2, 1.7e9 + i, i // 2, json.dumps({"loss": (
                      SPIKE if i == 30_001 else 1.0 + i % 2)})) for i in range(n)])
    c.execute("INSERT INTO runs (id, name, status, num_processes, started) VALUES "
              "('first', 'first', 'succeeded', 1, 1.7e9)")
    c.executemany("INSERT INTO metrics VALUES ('first', 0, ?, ?, 'loss', ?)",
                  [(s, 1.7e9 + s, 3.0 - s * 1e-3) for s in range(100)])
    c.commit()
    c.close()

    reg = Registry(path)  # upgrades: level tables, the notes index, the metrics table moved, and
    run = attach_run("old", registry=reg)  # the old runs' levels built from their events, once
    steps, values = run.metrics.series("loss", 1)
    assert SPIKE in values and steps[values.index(SPIKE)] == 15_000
    assert len(values) <= ATTACH_POINTS and run.metrics.count("loss", 1) == n // 2
    first = attach_run("first", registry=reg)
    assert first.metrics.series("loss", 0)[0] == list(range(100))

    # from then on add_events keeps the old run's levels
    reg.add_events("old", [{"rank": 0, "kind": "metric", "t": 2e9, "step": n // 2,
                            "data": {"loss": -5.0}}])
    p = reg.series("old", 1000, names=["loss"], ranks=[0]).series[(0, "loss")]
    assert p.count == n // 2 + 1 and p.steps[-1] == n // 2 and min(p.values) == -5.0
    # and an older gpu_lab that adds events without levels leaves them to the next write or read
    c = sqlite3.connect(path)
    for i, step in enumerate((n // 2 + 1, n // 2 + 3)):
        c.execute("INSERT INTO events VALUES ('old', ?, 0, 'metric', 2e9, ?, ?)",
                  (n + 2 + 2 * i, step, json.dumps({"loss": -6.0 - i})))
        c.commit()
        if i == 0:
            reg.add_events("old", [{"rank": 0, "kind": "metric", "t": 2e9, "step": n // 2 + 2,
                                    "data": {"loss": -5.5}}])
    c.close()
    p = reg.series("old", 1000, names=["loss"], ranks=[0]).series[(0, "loss")]
    assert p.count == n // 2 + 4 and p.level == 0
    steps, _, values = p.env  # the raw points, before decimation to 1000
    assert steps[-4:].tolist() == [n // 2 + k for k in range(4)]
    assert values[-4:].tolist() == [-5.0, -6.0, -5.5, -7.0]


def test_live_events_continue_an_attached_history_without_gap_or_duplicate():
    run = gpu_lab.launch(launch_fns.train_forever, 0.002, num_processes=1)
    try:
        assert run.wait_for_step(30, timeout=120)
        other = attach_run(run.id)  # bounded history from the registry, then the live events
        seeded = other.metrics.count("loss", 0)
        assert seeded >= 31
        assert other.wait_for_step(seeded + 60, timeout=120)
    finally:
        assert run.stop() == "stopped"
    assert other.wait(60) == "stopped"
    recorded = len(other.metrics.frame(name="loss", rank=0))
    # the end may be announced before the receiver hands over the last batch it reads back
    wait_until(lambda: other.metrics.count("loss", 0) >= recorded, 30, what="the last points")
    steps, _ = other.metrics.series("loss", 0)
    assert steps == list(range(len(steps)))  # every step once, in order
    assert other.metrics.count("loss", 0) == recorded == len(steps)


def test_a_run_without_levels_in_a_registry_we_may_only_read(read_only_view):  # noqa: F811
    src, make = read_only_view
    path = src / "registry.db"
    c = sqlite3.connect(path)
    c.executescript(OLD_SCHEMA)
    c.execute("INSERT INTO runs (id, name, status, num_processes, started) VALUES "
              "('old', 'old', 'succeeded', 1, 1.7e9)")
    c.executemany("INSERT INTO events VALUES ('old', ?, 0, 'metric', ?, ?, ?)",
                  [(s + 1, 1.7e9 + s, s, json.dumps({"loss": SPIKE if s == 700 else 1.0}))
                   for s in range(5000)])
    c.commit()
    c.close()
    Registry(path)  # upgraded (level tables), but the run's levels are not built yet
    view = make()
    with pytest.warns(UserWarning, match="read-only"):
        reg = Registry(view / "registry.db")
    p = reg.series("old", 100).series[(0, "loss")]  # built in memory: nothing can be written
    assert p.count == 5000 and len(p.values) <= 100 and SPIKE in p.values
    assert attach_run("old", registry=reg).metrics.series("loss", 0)[0][-1] == 4999
