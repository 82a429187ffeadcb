"""A year of runs within reach: what the side panel, a search, runs(), a run's view and a 50-run
comparison cost at 100, 1,000 and 10,000 runs in one registry.

Each size is a registry of its own, filled the way runs fill it (2 ranks x 200 points of loss a
run, a config with a learning rate and a seed, one run in 25 failed, starts a minute apart), and
served by a real Jupyter server with gpu_lab's extension. Timed, the median of 5, as the lab asks:

- the panel's first lines: GET runs?limit=100 (what the side panel opens with);
- a search: GET runs?q=<an old run's name> (the panel's search box);
- runs(limit=100): the notebook's table, in this process;
- a run's view: GET runs/<id> (the oldest run);
- a 50-run comparison: GET compare?runs=<50 ids> (a sweep overlaid).

    .venv/bin/python bench/many_runs.py [--sizes 100,1000,10000]

Each is bounded at 10,000 runs by 0.5 s and by twice its own time at 100 runs; exits 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import Server  # noqa: E402 - a real Jupyter server with a token, its home

BOUND_S, BOUND_RATIO = 0.5, 2.0
POINTS = 200


def fill(home: Path, n: int) -> list[str]:
    """n runs in home's registry; their ids, oldest first."""
    from gpu_lab.record.registry import Registry

    reg = Registry(home / "registry.db")
    ids = []
    t0 = time.time() - n * 60
    for i in range(n):
        rid = f"run-{i:05d}"
        reg.create_run(rid, name=f"trial-{i:05d}", config={"lr": 1e-4 * (1 + i % 50), "seed": i},
                       num_processes=2, status="failed" if i % 25 == 0 else "succeeded")
        reg.update(rid, started=t0 + i * 60, ended=t0 + i * 60 + 50)
        reg.add_events(rid, [{"rank": r, "kind": "metric", "t": t0 + i * 60 + s * 0.25,
                              "step": s, "data": {"loss": 2.0 / (1 + s / 20) + r * 0.01}}
                             for s in range(POINTS) for r in (0, 1)], checked=True)
        ids.append(rid)
    return ids


def timed(fn, repeat: int = 5) -> float:
    fn()  # warm: the server's first query of a registry opens it
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(n: int, tmp: Path) -> dict[str, float]:
    home = tmp / f"home-{n}"
    home.mkdir(parents=True)
    ids = fill(home, n)
    os.environ["GPU_LAB_HOME"] = str(home)
    server = Server(tmp / f"srv-{n}", home=home)
    try:
        def get(path: str) -> dict:
            code, body = server.get(path)
            assert code == 200, (path, code, body[:300])
            return json.loads(body)

        def search() -> None:
            assert [r["id"] for r in get(f"gpu-lab/api/runs?q=trial-{3:05d}")["runs"]] == [ids[3]]

        def table() -> None:
            from gpu_lab.record.registry import runs

            assert len(runs(limit=100)) == min(100, n)

        sweep = ",".join(ids[:50])
        return {"panel": timed(lambda: get("gpu-lab/api/runs?limit=100")), "search": timed(search),
                "runs()": timed(table), "view": timed(lambda: get(f"gpu-lab/api/runs/{ids[0]}")),
                "compare 50": timed(lambda: get(f"gpu-lab/api/compare?runs={sweep}"))}
    finally:
        server.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000,10000")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="gpu_lab_bench_many_"))
    rows = {}
    for n in sizes:
        t = time.perf_counter()
        rows[n] = measure(n, tmp)
        print(f"{n} runs measured ({time.perf_counter() - t:.0f} s with the filling)", flush=True)
    names = list(rows[sizes[0]])
    print(f"{'':12s}" + "".join(f"{n:>10,d}" for n in sizes) + f"{'ratio':>8s}")
    ok = True
    for name in names:
        ratio = rows[sizes[-1]][name] / rows[sizes[0]][name]
        good = rows[sizes[-1]][name] <= BOUND_S and ratio <= BOUND_RATIO
        ok &= good
        print(f"{name:12s}" + "".join(f"{rows[n][name] * 1e3:8.1f}ms" for n in sizes)
              + f"{ratio:7.2f}x" + ("" if good else "  over the bound"))
    print(json.dumps({str(n): r for n, r in rows.items()}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
