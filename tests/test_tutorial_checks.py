"""No tutorial check depends on quick mode's literals: what a check cell expects is computed from
the mode and the machine, so the same check passes on a GPU server in full mode.

The full-mode context is recorded, not imagined: each notebook's setup cell (its first code cell,
where the sizes are chosen) is executed twice, with GPU_LAB_QUICK=1 and GPU_LAB_QUICK=0, and every
value that differs is mode-bound; so is every constant of a `quick if QUICK else full` anywhere in
the notebook, and the words a CPU host gives for a GPU's (cpu, gloo, MULTI_CPU). A check cell's
typed text (its string literals and the fixed parts of its f-strings) must name none of them: it
reads them from the notebook's variables instead. One subprocess per mode; no training runs, so a
setup cell chooses sizes and builds nothing.

A number can match a quick-mode size by coincidence (float32's 32 bits, an example's 8 GPUs): the
check cell's metadata then says so, `{"gpu_lab": {"not_mode_bound": {"32": "float32's bits"}}}`,
and the reason is part of the notebook a reviewer reads.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.notebooks  # executes every notebook's setup cell in both modes

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# What a CPU host shows where a GPU server shows nccl / MULTI_GPU / cuda.
MACHINE_WORDS = {"cpu", "gloo", "MULTI_CPU"}
# Numbers too common to mean a size (a pair, a count of one); a size of 0, 1 or 2 in quick mode
# would escape this test, and none of the notebooks chooses one.
TOO_COMMON = {0, 1, 2}

_RECORDER = r'''
import contextlib, dataclasses, io, json, os, sys
os.chdir(sys.argv[1])
out = {}
for path, src in json.load(sys.stdin).items():
    ns = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(src, path, "exec"), ns)
    vals = {}
    for name, v in ns.items():
        if name.startswith("_"):
            continue
        items = [(name, v)]
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            items += [(f"{name}.{f.name}", getattr(v, f.name)) for f in dataclasses.fields(v)]
        for key, x in items:
            if isinstance(x, (bool, int, float, str)) or (
                    isinstance(x, tuple) and all(isinstance(e, (int, float, str)) for e in x)):
                vals[key] = x
    out[path] = vals
json.dump(out, sys.stdout)
'''


def _code(cell) -> str:
    """A cell's Python, its IPython magics dropped."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in cell.source.splitlines())


def _setup_cells() -> dict[str, str]:
    return {p.name: _code(next(c for c in nbformat.read(p, as_version=4).cells
                                if c.cell_type == "code")) for p in NOTEBOOKS}


def _record(quick: str) -> dict:
    env = dict(os.environ, GPU_LAB_QUICK=quick)
    proc = subprocess.run([sys.executable, "-c", _RECORDER, str(ROOT / "notebooks")],
                          input=json.dumps(_setup_cells()), capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, f"a setup cell failed with GPU_LAB_QUICK={quick}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def contexts() -> tuple[dict, dict]:
    return _record("1"), _record("0")


def _scalars(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _if_quick_constants(tree: ast.AST) -> list[tuple[object, object]]:
    """(quick, full) pairs of `a if QUICK else b` (or `if quick`, `if not QUICK`) constants."""
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.IfExp):
            continue
        test, body, orelse = node.test, node.body, node.orelse
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, body, orelse = test.operand, orelse, body
        if not (isinstance(test, ast.Name) and test.id.lower() == "quick"):
            continue
        try:
            q, f = ast.literal_eval(body), ast.literal_eval(orelse)
        except ValueError:
            continue
        q, f = _scalars(q), _scalars(f)
        pairs += list(zip(q, f)) if len(q) == len(f) else []
    return pairs


def _mode_bound(path: Path, quick_ctx: dict, full_ctx: dict) -> dict[str, str]:
    """{token: where it comes from} for this notebook's quick-mode values that full mode changes."""
    bound = {w: "what a CPU host shows instead of a GPU's" for w in MACHINE_WORDS}
    for name, q in quick_ctx.items():
        f = full_ctx.get(name)
        for qv, fv in zip(_scalars(q), _scalars(f)) if isinstance(q, tuple) else [(q, f)]:
            if qv != fv and not isinstance(qv, bool):
                bound[str(qv)] = f"{name} in quick mode (full mode: {fv!r})"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            for qv, fv in _if_quick_constants(ast.parse(_code(cell))):
                if qv != fv and not isinstance(qv, bool):
                    bound.setdefault(str(qv), f"`{qv!r} if QUICK else {fv!r}`")
    # a short word ("no" of mixed_precision) is English before it is a value
    return {k: v for k, v in bound.items() if len(k) >= 3 or (
        k.isdigit() and int(k) not in TOO_COMMON)}


def _typed_text(expr: ast.AST) -> list[str]:
    """The parts of an expected-output expression that are typed, not read from a variable (a
    format spec such as `{x:.2f}` is how a value is shown, not a value)."""
    specs = {id(c) for n in ast.walk(expr) if isinstance(n, ast.FormattedValue) and n.format_spec
             for c in ast.walk(n.format_spec)}
    return [n.value for n in ast.walk(expr)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in specs]


def _checks(path: Path):
    """(cell index, the cell's declared coincidences, the expected-output expression) of each
    `check_output(captured, expected)`."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "check_output(" not in cell.source:
            continue
        for node in ast.walk(ast.parse(_code(cell))):
            if (isinstance(node, ast.Call) and len(node.args) == 2
                    and getattr(node.func, "attr", getattr(node.func, "id", "")) == "check_output"):
                yield i, cell.metadata.get("gpu_lab", {}).get("not_mode_bound", {}), node.args[1]


def _tokens(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*|\d+(?:\.\d+)?(?:e-?\d+)?", text))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_check_types_a_value_that_quick_mode_chose(path, contexts):
    quick_ctx, full_ctx = (c[path.name] for c in contexts)
    bound = _mode_bound(path, quick_ctx, full_ctx)
    found = []
    for i, declared, expr in _checks(path):
        for token, why in declared.items():
            assert isinstance(why, str) and why.strip(), (
                f"{path.name} cell {i}: not_mode_bound[{token!r}] needs the reason it is no size")
        for text in _typed_text(expr):
            for token in sorted((_tokens(text) & bound.keys()) - declared.keys()):
                found.append(f"cell {i}: {token!r} ({bound[token]}) in {text[:90]!r}")
    assert not found, (f"{path.name}: checks type what quick mode printed; compute it from the "
                       "notebook's variables (the mode's sizes, tutorial.expected_group(), ...):\n"
                       + "\n".join(found))


def test_the_recorded_contexts_differ_by_mode(contexts):
    """The recording is real: full mode changes the sizes of the notebooks that size work."""
    quick_ctx, full_ctx = contexts
    assert quick_ctx["02_data_pipeline.ipynb"]["N_IMAGES"] < full_ctx["02_data_pipeline.ipynb"]["N_IMAGES"]
    assert all(q["QUICK"] is True for q in quick_ctx.values() if "QUICK" in q)
    assert all(f["QUICK"] is False for f in full_ctx.values() if "QUICK" in f)


def test_a_planted_literal_is_found_and_a_computed_one_is_not(tmp_path):
    """The scan itself: a check typing quick mode's 800 fails, one reading N_IMAGES passes, and a
    declared coincidence needs its reason."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("QUICK = True\nN_IMAGES = 800 if QUICK else 10_000"),
                nbformat.v4.new_code_cell("check_output(captured, '800 files on cpu\\n')"),
                nbformat.v4.new_code_cell("check_output(captured, f'{N_IMAGES} files, {N_IMAGES:5d}\\n')"),
                nbformat.v4.new_code_cell("check_output(captured, 'float32: 800 bits\\n')",
                                          metadata={"gpu_lab": {"not_mode_bound": {"800": "bits"}}})]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    bound = _mode_bound(path, {"N_IMAGES": 800, "QUICK": True}, {"N_IMAGES": 10_000, "QUICK": False})
    hits = {i: sorted((_tokens(t) & bound.keys()) - declared.keys())
            for i, declared, expr in _checks(path) for t in _typed_text(expr)}
    assert hits[1] == ["800", "cpu"]
    assert 2 not in hits or hits[2] == []
    assert hits[3] == []
