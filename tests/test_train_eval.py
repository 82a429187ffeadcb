"""Evaluation counts every validation sample exactly once, over all ranks together.

fit() evaluates `eval_fns.IdProbe`, a model that records the id carried by every image it
evaluates, on 1 and 2 gloo ranks: WebDataset shards (1, 2 and 5 validation shards, an uneven last
shard, a partial last batch, 0 and 2 loader workers), an ImageFolder tree, the synthetic data set,
a map-style Dataset, a user's DataLoader (shuffled), and a DataLoader smaller than one batch (one
rank evaluates nothing). Every case checks the ids (a duplicate or a gap fails it), the metric
(known in advance from the ids) and eval_samples. The 2-rank cases run in one notebook_launcher
launch; the 1-rank cases in this process. The last test trains tiny_cnn on real handwritten digits
through shards on 2 ranks with gpu_lab.launch.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import eval_fns
import proc_utils

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

CASES = eval_fns.cases(Path())
SCRIPT = Path(eval_fns.__file__)


def _env(**extra) -> dict:
    env = dict(os.environ)
    for k in ("GPU_LAB_RUN_DIR", "GPU_LAB_EVENTS", "GPU_LAB_RUN_ID", "RANK", "WORLD_SIZE",
              "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)  # one thread per rank, 2 cores
    return env


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("id_images")
    eval_fns.make_data(root)
    return root


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> dict:
    """{case: [rank 0's evaluations, rank 1's]} from one launch of 2 gloo ranks."""
    out = tmp_path_factory.mktemp("two_ranks")
    p = proc_utils.run_or_dump([sys.executable, str(SCRIPT), "matrix", str(data), str(out), "2"],
                               env=_env(), timeout=200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {case: [r[case] for r in ranks] for case in CASES}


@pytest.fixture(scope="module")
def one_rank(data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("one_rank")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {case: [eval_fns.run_case(case, data, out)] for case in CASES}
    finally:
        torch.set_num_threads(threads)


def _expected_ids(case: str) -> list[int]:
    if case == "synthetic":
        from gpu_lab.train.classifier import synthetic_sizes

        return list(range(synthetic_sizes()[1]))
    return list(range(eval_fns.TINY if case == "tiny_dataloader" else eval_fns.N_VAL))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_evaluation_counts_every_sample_exactly_once(case, world, request):
    per_rank = request.getfixturevalue("one_rank" if world == 1 else "two_ranks")[case]
    assert len(per_rank) == world
    assert all(len(evals) == 1 for evals in per_rank), "one evaluation, at the end of the run"
    evals = [e[0] for e in per_rank]
    expected = _expected_ids(case)
    seen = Counter(i for e in evals for i in e["ids"])
    duplicates = sorted(i for i, c in seen.items() if c > 1)
    gaps = sorted(set(expected) - set(seen))
    assert not duplicates and not gaps and set(seen) == set(expected), \
        f"{case} on {world} rank(s): duplicates {duplicates}, gaps {gaps}"
    if world == 2 and case != "tiny_dataloader":
        assert all(e["ids"] for e in evals), "each rank evaluates its own share"
    if case == "tiny_dataloader" and world == 2:
        assert [len(e["ids"]) for e in evals] == [eval_fns.TINY, 0]  # and rank 1 did not hang

    # the metric over exactly these samples: the probe is right on the ids divisible by 3
    n = len(expected)
    right = sum(1 for i in expected if i % 3 == 0)
    for e in evals:  # every rank reports the same, summed over the ranks
        m = e["metrics"]
        assert m["eval_samples"] == n and e["summary_eval_samples"] == n
        assert m["accuracy"] == pytest.approx(right / n, abs=1e-12) == e["summary_accuracy"]
        assert m["eval_loss"] == pytest.approx(20 * (n - right) / n, abs=1e-3)
    # every rank evaluated rank 0's model: its buffer, not the one its own training step left
    assert {x for e in evals for x in e["markers"]} == {0.0}


def test_each_rank_share_of_a_loader_partitions_it(data):
    """eval_batches in one process, for 1 to 3 ranks: the shares of a shuffled DataLoader, of an
    uncollated one, of one with a DistributedSampler (it would pad) and of an IterableDataset
    together hold every sample once; samplers that draw at random, and resampled shard loaders,
    are refused."""
    from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, TensorDataset,
                                  WeightedRandomSampler)

    from gpu_lab.data import shard_loader
    from gpu_lab.train.evaluation import eval_batches

    ds = TensorDataset(torch.zeros(23, 1), torch.arange(23))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.zeros(1), i) for i in range(23)])

    def labels(batches) -> list[int]:
        return [int(v) for _, y in batches for v in y.reshape(-1)]

    for world in (1, 2, 3):
        makers = {"shuffled": lambda r: DataLoader(ds, batch_size=4, shuffle=True),
                  "uncollated": lambda r: DataLoader(ds, batch_size=None),
                  "distributed": lambda r: DataLoader(ds, batch_size=4, sampler=DistributedSampler(
                      ds, num_replicas=world, rank=r, shuffle=True)),
                  "iterable": lambda r: Stream()}
        for name, make in makers.items():
            got = []
            for rank in range(world):
                share = eval_batches(make(rank), rank=rank, world=world, batch_size=4,
                                     num_workers=0, seed=0)
                got += labels(share)
            assert sorted(got) == list(range(23)), f"{name} on {world} ranks"
    weighted = DataLoader(ds, sampler=WeightedRandomSampler([1.0] * 23, 23))
    with pytest.raises(ValueError, match="eval_data: the DataLoader's WeightedRandomSampler"):
        eval_batches(weighted, rank=0, world=1, batch_size=4, num_workers=0, seed=0)
    resampled = shard_loader(str(data / "train_shards"), 4, image_size=8, num_workers=0,
                             resampled=True, rank=0, world_size=2)
    with pytest.raises(ValueError, match="eval_data: a resampled shard loader"):
        eval_batches(resampled, rank=0, world=2, batch_size=4, num_workers=0, seed=0)


# ------------------------------------------------------------------------------ real images

@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, gpu_lab_home_module) -> dict:
    out = tmp_path_factory.mktemp("digits")
    try:
        p = proc_utils.run_or_dump([sys.executable, str(SCRIPT), "digits", str(out)],
                                   env=_env(GPU_LAB_HOME=str(gpu_lab_home_module)), timeout=240)
    except AssertionError as e:  # the ranks' stacks are in their run's logs
        logs = sorted(gpu_lab_home_module.glob("runs/*/logs/*"))
        raise AssertionError(str(e) + "".join(f"\n--- {f}:\n{f.read_text(errors='replace')[-6000:]}"
                                              for f in logs)) from None
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads((out / "digits.json").read_text())


@pytest.fixture(scope="module")
def gpu_lab_home_module(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu_lab_home")


def test_real_digits_learn_on_two_ranks_through_shards(digits_run, gpu_lab_home_module,
                                                       monkeypatch):
    """tiny_cnn on scikit-learn's 8x8 handwritten digits (1,500 to train, 297 to validate), written
    as PNG shards and trained with gpu_lab.launch(train_classifier) on 2 gloo ranks.

    Threshold 0.90, nine times chance (0.10: ten balanced classes): the run reaches about 0.99
    after its 5 epochs, so 0.90 leaves room for other hardware's arithmetic, while a run that
    trains on the wrong labels, on a fraction of the data, or not at all stays far below it."""
    r = digits_run
    assert r["status"] == "succeeded", r["logs"]
    s = r["summary"]
    assert s["num_processes"] == 2
    assert s["eval_samples"] == r["n_val"] == 297, "the metric covers the whole validation set"
    assert s["accuracy"] >= 0.90, s
    assert r["reported_eval_samples"] == 297  # reported, so the dashboard can show it

    from gpu_lab.widgets.dashboard import Dashboard

    monkeypatch.setenv("GPU_LAB_HOME", str(gpu_lab_home_module))
    d = Dashboard(r["run_id"])  # a finished run, read back from the registry
    try:
        assert f"accuracy {s['accuracy']:.4g} on 297 samples" in d.info.status_line.value
    finally:
        d.close()
