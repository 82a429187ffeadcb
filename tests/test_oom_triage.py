"""Triage in this process, without a training run: which messages count as out of memory under
gpu_lab's memory cap, what the report says when the request is unknown, and which rank's failure
comes first."""
from __future__ import annotations

import pytest

from gpu_lab.diagnostics import memory_cap
from gpu_lab.failures import explain, triage
from gpu_lab.failures.kinds import OOM, USER

MiB = 2**20
ONEDNN = "could not create a primitive"


@pytest.fixture
def clean_notes():
    yield
    explain.note(memory_cap_bytes=None, memory_cap_used_bytes=None, memory_cap_op=None,
                 batch_size=None)


def _failure_inside_cap(cap: int, message: str):
    import torch

    explain.note(batch_size=96)
    try:
        with memory_cap(cap):
            torch.ones(1024).add_(1)  # an operation for the cap to name
            raise RuntimeError(message)
    except RuntimeError as e:
        return triage.from_exception(0, e)


def test_onednn_failing_under_a_memory_cap_is_out_of_memory_with_the_caps_numbers(clean_notes):
    f = _failure_inside_cap(64 * MiB, ONEDNN)
    assert f.category == OOM
    d = f.details
    assert d["memory_cap"] is True and d["total_bytes"] == 64 * MiB and d["batch_size"] == 96
    assert "requested_bytes" not in d and "aten.add_" in d["operation"]
    assert f.explanation.startswith("Out of memory on CPU (a memory cap of 64.00 MiB): an "
                                    "allocation failed with ")
    assert "?" not in f.explanation and "batch size 96" in f.explanation
    assert any("batch_size=48 (from 96)" in s for s in f.suggestions)


def test_onednn_failing_without_a_cap_stays_the_users_to_read(clean_notes):
    # outside a cap the same words also mean an unsupported layout or type: not a memory verdict
    e = RuntimeError(ONEDNN)
    assert triage.from_exception(0, e).category == USER


def test_another_error_under_a_cap_is_not_called_out_of_memory(clean_notes):
    assert _failure_inside_cap(64 * MiB, "shapes cannot be multiplied").category == USER


def test_a_rank_that_ended_on_a_stop_signal_is_never_the_root_cause():
    """The launcher ends the other ranks once one fails; a rank whose stop handler ran exits 143
    rather than dying of the signal, and its line must not hide the real failure."""
    from gpu_lab.failures.kinds import COMM, SIGNAL, RankFailure

    ended = triage.from_exitcode(1, 143, pid=42, t=1.0)  # recorded first, by the supervisor
    assert (ended.type, ended.category) == ("Stopped", SIGNAL)
    assert ended.message == "rank 1 (pid 42) ended on a stop signal (exit code 143)"
    timeout = RankFailure(rank=0, type="RuntimeError", message="Timed out waiting 2000ms for recv",
                          category=COMM, t=2.0)
    assert triage.RunError([ended, timeout]).ranks == [0, 1]
    assert triage.from_exitcode(1, 3, pid=42).type == "ExitCode"  # any other code: the user's


def test_a_node_lost_under_a_rank_comes_before_what_its_peers_saw():
    """A node that went down takes its rank silently; its peer's lost connection (recorded first,
    by the rank itself) is a consequence, so the node is the run's root cause and headline."""
    from gpu_lab.failures.kinds import COMM, NODE, RankFailure

    peer = RankFailure(rank=0, type="RuntimeError", message="Connection reset by peer",
                       category=COMM, t=1.0)
    lost = triage.node_lost(1, "gpu-n7", "Slurm: down*, Not responding")
    report = triage.RunError([peer, lost])
    assert report.ranks == [1, 0] and report.category == NODE
    assert report.headline == ("rank 1: NodeLost: node gpu-n7 stopped answering (Slurm: down*, "
                               "Not responding); rank 1 ran there and ended with it [node lost]")
    assert "run.resume()" in str(report)
