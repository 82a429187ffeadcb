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
