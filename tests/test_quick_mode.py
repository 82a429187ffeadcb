"""Quick mode has one definition (gpu_lab.quickmode): no module, notebook, bench script or Makefile
reads GPU_LAB_QUICK other than through it. Setting it (a test, a bench script, a notebook cell,
the Makefile) stays allowed."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from gpu_lab import quickmode

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / "gpu_lab" / "quickmode.py"
VAR = quickmode.VARIABLE
# os.environ["X"] = v, env["X"] = v, os.environ.setdefault("X", v), env.pop("X"), setenv("X", v)
SETTERS = {"setdefault", "pop", "setenv", "delenv"}


def python_reads(source: str) -> list[int]:
    """Lines where `source` uses the variable's name other than to set or unset it."""
    tree = ast.parse(source)
    setting: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript):
                    setting.add(id(t.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in SETTERS and node.args:
            setting.add(id(node.args[0]))
        elif isinstance(node, ast.Dict):  # {**os.environ, "X": "1"}: an environment being made
            setting.update(id(k) for k in node.keys if k is not None)
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value == VAR and id(n) not in setting]


def shell_reads(text: str) -> list[int]:
    """Lines of a Makefile or shell script that expand the variable ($X, ${X}, $(X), $$X)."""
    pattern = re.compile(r"\$\$?(\{|\()?" + VAR + r"\b")
    return [i for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def _notebook_code(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    lines = []
    for cell in nb.cells:
        if cell.cell_type == "code":  # IPython's magics and shell lines are not Python
            lines += ["" if ln.lstrip().startswith(("%", "!")) else ln
                      for ln in cell.source.splitlines()]
    return "\n".join(lines)


def _readers() -> list[str]:
    found = []
    pys = [*ROOT.joinpath("gpu_lab").rglob("*.py"), *ROOT.joinpath("bench").rglob("*.py"),
           ROOT / "conftest.py", ROOT / "notebooks" / "refresh.py"]
    for path in pys:
        if path != HOME:
            found += [f"{path.relative_to(ROOT)}:{n}" for n in python_reads(path.read_text())]
    for path in sorted(ROOT.joinpath("notebooks").glob("*.ipynb")):
        found += [f"{path.relative_to(ROOT)} (code line {n})"
                  for n in python_reads(_notebook_code(path))]
    for path in (ROOT / "Makefile", *ROOT.joinpath(".ci").glob("*")):
        if path.is_file():
            found += [f"{path.relative_to(ROOT)}:{n}" for n in shell_reads(path.read_text())]
    return found


def test_only_quickmode_reads_the_variable():
    readers = _readers()
    assert not readers, ("these read GPU_LAB_QUICK themselves; call gpu_lab.quickmode.quick() "
                         "(gpu_lab.tutorial.quick() in a notebook) instead:\n" + "\n".join(readers))


@pytest.mark.parametrize("code, reads", [
    ('os.environ.get("GPU_LAB_QUICK")', True),
    ('os.environ["GPU_LAB_QUICK"] == "1"', True),
    ('os.getenv("GPU_LAB_QUICK", "")', True),
    ('"GPU_LAB_QUICK" in os.environ', True),
    ('os.environ["GPU_LAB_QUICK"] = "1"', False),
    ('os.environ.setdefault("GPU_LAB_QUICK", "1")', False),
    ('env.pop("GPU_LAB_QUICK", None)', False),
    ('monkeypatch.setenv("GPU_LAB_QUICK", "0")', False),
    ('env = {**os.environ, "GPU_LAB_QUICK": "1"}', False),
    ('print("set GPU_LAB_QUICK=1 for quick mode")', False),
])
def test_the_check_tells_a_read_from_a_setting(code, reads):
    assert bool(python_reads(code)) is reads


def test_the_check_reads_makefiles():
    assert shell_reads("a:\n\techo $(GPU_LAB_QUICK)\n\tif [ \"$$GPU_LAB_QUICK\" ]; then :; fi")\
        == [2, 3]
    assert shell_reads("test:\n\tGPU_LAB_QUICK=1 pytest") == []


@pytest.mark.parametrize("value, gpus, quick", [
    ("1", 4, True), ("0", 0, False), ("", 0, True), ("", 2, False), ("no", 0, False),
    ("true", 8, True)])
def test_one_definition_of_quick(monkeypatch, value, gpus, quick):
    import gpu_lab.telemetry.probe as probe
    from gpu_lab import tutorial
    from gpu_lab.diagnostics.allreduce import FULL_RANGE, QUICK_RANGE, parse_sizes
    from gpu_lab.train.classifier import QUICK_TRAIN, SYNTHETIC_TRAIN, synthetic_sizes

    monkeypatch.setenv(VAR, value)
    monkeypatch.setattr(probe, "gpu_count", lambda: gpus)
    assert quickmode.quick() is tutorial.quick() is quick
    assert tutorial.mode() == ("quick" if quick else "full")
    assert synthetic_sizes()[0] == (QUICK_TRAIN if quick else SYNTHETIC_TRAIN)
    assert max(parse_sizes()) == (QUICK_RANGE if quick else FULL_RANGE)[1]


@pytest.mark.parametrize("value, gpus, start", [
    ("", 0, "quick mode (no GPU found; GPU_LAB_QUICK=0 forces full mode)"),
    ("", 2, "full mode (a GPU found; GPU_LAB_QUICK=1 picks the quick sizes)"),
    ("0", 0, "full mode (GPU_LAB_QUICK=0; GPU_LAB_QUICK=1 picks the quick sizes)"),
    ("1", 8, "quick mode (GPU_LAB_QUICK=1; GPU_LAB_QUICK=0 forces full mode)")])
def test_the_line_a_tutorial_opens_with_says_why_and_how_to_switch(monkeypatch, value, gpus, start):
    import gpu_lab.telemetry.probe as probe
    from gpu_lab import tutorial

    monkeypatch.setenv(VAR, value)
    monkeypatch.setattr(probe, "gpu_count", lambda: gpus)
    assert tutorial.mode_line() == start
    assert tutorial.mode_line("800 images") == start + ": 800 images"


def test_every_tutorial_opens_with_its_mode_line():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        assert "tutorial.mode_line(" in first.source, f"{path.name}: its first code cell prints no mode line"
