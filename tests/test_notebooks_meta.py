"""The tutorials as files: stored stripped, each names the article sections it follows (by the
article's title and the section's heading), hides its fact checks from the reader, ends with what to try, and
the README links every one of them."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
EXPECTED = ["00_first_run", "00_overview", "00_your_own_code", "01_environment_setup", "02_data_pipeline", "03_mixed_precision",
            "04_distributed_training", "05_memory_optimization", "06_monitoring_profiling",
            "07_tuning", "08_troubleshooting", "09_cost_control", "10_scale_out",
            "11_diffusion_finetune", "12_case_studies"]


def test_every_tutorial_exists():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_stripped(path):
    nb = nbformat.read(path, as_version=4)
    assert "widgets" not in nb.metadata, "widget state is stored: run notebooks/refresh.py"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert not cell.outputs and cell.execution_count is None, (
            f"{path.name} cell {i} stores output; run notebooks/refresh.py --strip-only")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_checks_deterministic_facts_in_the_notebook_itself(path):
    nb = nbformat.read(path, as_version=4)
    checks = [c for c in nb.cells if c.cell_type == "code" and "check_output(captured" in c.source]
    assert checks, f"{path.name} checks no deterministic fact"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_fact_checks_are_hidden_from_the_reader(path):
    """The cells that assert a fact are collapsed in JupyterLab (nbval still runs them); the cells
    that show the fact stay open."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        hidden = cell.metadata.get("jupyter", {}).get("source_hidden", False)
        is_check = "check_output(captured" in cell.source
        assert hidden == is_check, (f"{path.name} cell {i}: source_hidden={hidden}, but it "
                                    f"{'is' if is_check else 'is not'} a fact check")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_names_its_article_sections_and_ends_with_what_to_try(path):
    """A learner can follow a citation: the article's title and a section heading
    (tutorial.cite's words), never a file id ("000 §3.2") or a bare section number ("§2.2")."""
    from gpu_lab.tutorial import ARTICLES, SECTIONS

    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    cited = [(a, s) for a, title in ARTICLES.items() for s, heading in SECTIONS[a].items()
             if f"{title}, “{heading}”" in text]
    assert cited, f"{path.name} cites no article by its title and a section heading"
    everything = "\n".join(c.source for c in nb.cells)
    assert not re.search(r"\b[Ss]eeds? 00[03]|\b00[03] §|§\s*\d", everything), (
        f"{path.name} cites an article by a file or a section number; name its title and the "
        "section's heading (gpu_lab.tutorial.cite)")
    last_md = [c for c in nb.cells if c.cell_type == "markdown"][-1].source
    assert "What you learned" in last_md and "GPU" in last_md


def test_readme_links_every_tutorial():
    readme = (ROOT / "README.md").read_text()
    for name in EXPECTED:
        assert f"notebooks/{name}.ipynb" in readme, f"README does not link {name}"
