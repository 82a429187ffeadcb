"""The run registry under concurrent first use: every rank of a torchrun job opens the same fresh
database at once (seen failing in CI: "database is locked" from the WAL switch)."""
from __future__ import annotations

import pytest

import multiprocessing as mp
from pathlib import Path

from gpu_lab.record.registry import Registry

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds


def _open_and_write(path: str, start, i: int) -> None:
    start.wait()  # every process opens the fresh database at the same moment
    Registry(path).create_run(f"run-{i}", name=f"p{i}", num_processes=1)
    Registry(path).set_status(f"run-{i}", "running")  # a second handle, as a headless rank makes


def test_many_processes_open_a_fresh_registry_at_once(tmp_path: Path):
    ctx = mp.get_context("fork")
    n = 8
    for trial in range(40):  # without the lock, about 1 trial in 8 failed here
        path = tmp_path / f"trial{trial}" / "registry.db"
        start = ctx.Barrier(n)
        procs = [ctx.Process(target=_open_and_write, args=(str(path), start, i)) for i in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * n, f"trial {trial}"
        runs = Registry(path).list_runs()
        assert sorted(r["id"] for r in runs) == sorted(f"run-{i}" for i in range(n))
        assert {r["status"] for r in runs} == {"running"}
        assert Registry(path)._conn().execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_runs_are_found_by_name_config_and_date_and_older_registries_are_indexed(tmp_path):
    import sqlite3

    from gpu_lab.record.registry import RunQuery

    path = tmp_path / "registry.db"
    reg = Registry(path)
    for i, (name, lr) in enumerate([("resnet-baseline", 0.1), ("resnet-warmup", 0.01),
                                    ("vit-long", 0.01)]):
        reg.create_run(f"r{i}", name=name, config={"lr": lr, "model": name.split("-")[0]})
        reg.update(f"r{i}", started=100.0 + i)

    def found(**kw) -> list[str]:
        return [r["id"] for r in Registry(path).list_runs(find=RunQuery(**kw))]

    assert found(text="RESNET") == ["r1", "r0"] and found(text="warm") == ["r1"]
    assert found(text="vit") == ["r2"] and found(text="r1") == ["r1"]  # short: no index
    assert found(config=(("lr", 0.01),)) == ["r2", "r1"]
    assert found(since=101.0, until=102.0) == ["r1"]
    reg.update("r2", name="vit-renamed")  # the index follows the row
    assert found(text="renamed") == ["r2"] and found(text="long") == []
    # a registry from before the index: its runs are indexed when it is next opened
    c = sqlite3.connect(path)
    c.execute("DELETE FROM runs_text")
    c.execute("PRAGMA user_version=0")
    c.commit()
    c.close()
    assert found(text="baseline") == ["r0"]
