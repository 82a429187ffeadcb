"""The tutorials' verdicts: every function fails a measurement that should fail its claim, passes
one that should pass, and refuses what is not a measurement; every claim row of every notebook
gets its verdict from one of these functions (which show their tolerance), never from a typed
string or the bare label of `tutorial.verdict`."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from gpu_lab import tutorial as t

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
VERDICT_NOTEBOOKS = [n for n in NOTEBOOKS
                     if "Claim(" in (ROOT / "notebooks" / f"{n}.ipynb").read_text()]
VERDICT_FUNCTIONS = {"ratio_verdict", "at_least", "at_most", "gain", "follows", "equivalent",
                     "arithmetic", "needs_gpu", "not_attempted",
                     "verdict"}  # Devices.verdict(): a row that needs more devices than the host has


# ---------------------------------------------------------------- each cell's verdict function

def test_ratio_verdict_fails_a_speed_up_below_the_claim():
    """12: fp16 latency 5.7× claimed; 1.3× measured must not hold."""
    assert t.ratio_verdict(1.3, 5.7).label == t.FAILS
    assert t.ratio_verdict(5.5, 5.7).holds
    assert t.ratio_verdict(9.0, 5.7).label == t.EXCEEDS
    assert t.ratio_verdict(9.0, 5.7, higher_is_better=False).label == t.FAILS
    assert "±25%" in str(t.ratio_verdict(5.5, 5.7))
    assert t.verdict(1.3, 5.7) == t.FAILS and t.verdict(1.0, 0) == "n/a"  # the label alone (02, 03)


def test_at_least_fails_below_its_threshold_and_says_why():
    """12: batching 64 images instead of 1 must be at least 1.5× faster; 1.1× fails."""
    v = t.at_least(1.1, 1.5, "above the timing noise", unit="×")
    assert v.label == t.FAILS and "1.5×" in v.reason and "timing noise" in v.reason
    assert t.at_least(2.0, 1.5, "x").holds


def test_at_most_fails_above_its_limit():
    """12: the sparse gradient must touch at most half the table; all rows touched fails."""
    assert t.at_most(1000, 500, "half the table").label == t.FAILS
    assert t.at_most(120, 500, "half the table").holds


def test_gain_fails_a_difference_inside_the_seed_noise():
    """07: a 2-point gain is no gain when the seeds spread by 8 points."""
    v = t.gain([0.80, 0.88, 0.72], [0.84, 0.90, 0.76], 0.02, "beyond two standard errors")
    assert v.label == t.FAILS and "within the noise" in v.reason
    v = t.gain([0.85, 0.86, 0.84], [0.51, 0.47, 0.56], 0.01, "x")
    assert v.label == t.FAILS and "opposite" in v.reason
    assert t.gain([0.69, 0.67, 0.71], [0.76, 0.87, 0.92], 0.02, "x").holds


def test_gain_needs_a_gain_of_the_claimed_size_even_without_noise():
    assert t.gain([0.5, 0.5], [0.505, 0.505], 0.02, "two points").label == t.FAILS


def test_gain_needs_seeds():
    with pytest.raises(ValueError, match="at least 2 runs"):
        t.gain([0.7], [0.8, 0.9], 0.01, "x")


def test_follows_fails_a_batch_that_does_not_follow_the_load():
    """12: a mean batch that stays put (or falls) as the concurrency grows does not follow it."""
    assert t.follows([1, 4, 16, 64], [30, 31, 30, 31], 4, "x").label == t.FAILS
    assert t.follows([1, 4, 16, 64], [1, 8, 3, 40], 4, "x").label == t.FAILS
    assert t.follows([64, 1, 16, 4], [40, 1, 14, 3.9], 4, "x").holds  # any order of the sweep
    with pytest.raises(ValueError, match="2 drivers but 3"):
        t.follows([1, 2], [1, 2, 3], 2, "x")


def test_equivalent_fails_the_mean_of_micro_batch_means():
    """12: the mean of per-micro-batch means of a masked loss is not the large batch's loss."""
    import torch

    g = torch.Generator().manual_seed(0)
    losses = torch.rand(4, 16, generator=g)
    masks = torch.arange(16) < torch.tensor([[1], [4], [9], [15]])  # 1 to 15 hidden tokens
    big = float(losses[masks].mean())
    mean_of_means = float(torch.stack([losses[i][masks[i]].mean() for i in range(4)]).mean())
    token_weighted = float(sum(losses[i][masks[i]].sum() for i in range(4)) / masks.sum())
    assert t.equivalent(mean_of_means, big, 1e-5, "x").label == t.FAILS
    assert t.equivalent(token_weighted, big, 1e-5, "x").holds


def test_labels_that_are_not_measurements_say_so():
    assert t.arithmetic("16 bytes per parameter").label == "arithmetic, not measured"
    v = t.needs_gpu("Tensor Cores")
    assert v.label == t.NEEDS_GPU and "full mode measures it" in str(v) and not v.measured
    v = t.not_attempted("no CLIP weights in the local caches")
    assert not v.holds and not v.measured and "CLIP" in str(v)


@pytest.mark.parametrize("bad", [None, "3", float("nan"), True])
def test_a_verdict_refuses_what_is_not_a_measurement(bad):
    with pytest.raises(ValueError, match="expected a measured number"):
        t.at_least(bad, 1.0, "x")


def test_claim_table_shows_the_verdict_and_its_reason():
    table = t.ClaimTable([t.Claim("batching", "faster", "1.1×", "here", t.at_least(1.1, 1.5, "noise"))])
    assert "does not hold here (1.1 against a threshold of 1.5: noise)" in str(table)
    assert "does not hold here (1.1 against" in table._repr_html_()


# ------------------------------------------------------------------- the notebooks' claim rows

def _claim_calls(name: str):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "Claim(" not in cell.source:
            continue
        tree = ast.parse("\n".join(line for line in cell.source.splitlines()
                                   if not line.startswith("%")))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Claim":
                yield i, node


def _verdict_arg(call: ast.Call):
    if len(call.args) >= 5:
        return call.args[4]
    return next((k.value for k in call.keywords if k.arg == "verdict"), None)


def _called_functions(node) -> set[str]:
    return {n.func.attr for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


@pytest.mark.parametrize("name", VERDICT_NOTEBOOKS)
def test_every_claim_row_gets_a_computed_verdict(name):
    """No row of a claim table carries a typed verdict such as "holds": each calls one of the
    verdict functions, on both branches of a quick/full conditional."""
    calls = list(_claim_calls(name))
    assert calls, f"{name} has no claim table"
    for i, call in calls:
        arg = _verdict_arg(call)
        assert arg is not None, f"{name} cell {i}: a Claim without a verdict"
        branches = [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]
        for branch in branches:
            assert not isinstance(branch, ast.Constant), (
                f"{name} cell {i}: the verdict {branch.value!r} is typed, not computed")
            assert _called_functions(branch) & VERDICT_FUNCTIONS, (
                f"{name} cell {i}: the verdict {ast.unparse(branch)[:80]} calls no verdict function")


def test_the_claim_tables_are_found():
    assert len(VERDICT_NOTEBOOKS) >= 11, VERDICT_NOTEBOOKS


@pytest.mark.parametrize("name", VERDICT_NOTEBOOKS)
def test_no_check_restates_a_comparison_that_is_true_by_construction(name):
    """The two shapes the review found: a check of `x == (not y)` where y decides x, and an
    expected output that hard-codes the order a seeded shuffle gave."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "(scores is not None) == (not missing)" not in text
    assert "first members: ['0" not in text


TYPED = re.compile(r"\s*(holds|does not hold|exceeds the claim|consistent\b|confirmed\b)", re.I)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_no_verdict_is_typed_anywhere(name):
    """Outside the claim tables too (a printed summary, a dict of results): a string that starts
    like a verdict is one, and comes from a verdict function instead."""
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tree = ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                   for line in cell.source.splitlines()))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not TYPED.match(node.value), (
                    f"{name} cell {i}: {node.value[:60]!r} is a typed verdict; call one of "
                    f"gpu_lab.tutorial's verdict functions")
