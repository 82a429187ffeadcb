"""Each tutorial from 02 on ends with an exercise: its check cell, run from the notebook itself,
says "not done yet" with the task left undone (so nbval passes), "done" for the right answer and
why not for a wrong one. The right answers are computed by gpu_lab.exercises, never typed here."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import nbformat
import pytest

from gpu_lab.exercises import EXERCISES, verdict

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NEEDS_ONE = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if p.stem >= "02")


def _cells(name: str) -> tuple[str, str]:
    """The exercise's answer cell and check cell, as the notebook has them."""
    nb = nbformat.read(NOTEBOOKS / f"{EXERCISES[name].notebook}.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    i = next(i for i, src in enumerate(code) if f'check("{name}", ANSWER)' in src)
    assert code[i - 1].startswith("ANSWER = ..."), code[i - 1]
    return code[i - 1], code[i]


def _run(answer_cell: str, check_cell: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns: dict = {}
        exec(answer_cell, ns)  # noqa: S102 - the notebook's own cells
        exec(check_cell, ns)  # noqa: S102
    return out.getvalue().strip()


def test_every_tutorial_from_02_on_has_an_exercise():
    assert sorted({ex.notebook for ex in EXERCISES.values()}) == NEEDS_ONE


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_left_undone_the_check_says_so(name):
    said = _run(*_cells(name))
    assert said.startswith("not done yet: ") and EXERCISES[name].task in said


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_the_right_answer_is_done_and_a_wrong_one_says_why(name):
    answer_cell, check_cell = _cells(name)
    right = EXERCISES[name].expected()
    said = _run(answer_cell.replace("...", repr(right), 1), check_cell)
    assert said.startswith("done: "), said
    wrong = "float64" if isinstance(right, str) else right * 3 + 1
    said = _run(answer_cell.replace("...", repr(wrong), 1), check_cell)
    assert said.startswith("not yet: ") and EXERCISES[name].hint in said, said
    said = _run(answer_cell.replace("...", "'twelve'", 1), check_cell)
    assert said.startswith("not yet: "), said


def test_a_close_enough_number_passes_where_the_exercise_allows_it():
    assert verdict("05-adamw", EXERCISES["05-adamw"].expected() * 1.005)[0] == "done"
    assert verdict("02-shards", 40.0)[0] == "done" and verdict("02-shards", 41)[0] == "not yet"
    assert verdict("03-precision", "torch.float16")[0] == "done"
