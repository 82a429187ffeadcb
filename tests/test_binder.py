"""binder/ agrees with pyproject.toml: every conda package it pins is one pyproject requires (with a
compatible version), the rest of the install is `pip install .` itself, postBuild fails loudly
(`set -e`) and checks both extensions, and Binder opens the same tutorials index as `make lab`."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# conda-forge name -> PyPI name, for the packages binder takes from conda
CONDA_TO_PYPI = {"pytorch": "torch", "torchvision": "torchvision"}
# what a conda environment needs besides the project's requirements
INFRASTRUCTURE = {"python", "pip", "nodejs"}


def _pyproject_requirements() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def _conda_spec(dep: str) -> tuple[str, str | None]:
    """('pytorch', '>=2.6') from "pytorch[version='>=2.6',build='cpu*']" or 'nodejs>=20.19'."""
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\[(.*)\]", dep)
    if m:
        fields = dict(re.findall(r"(\w+)\s*=\s*'([^']*)'", m.group(2)))
        return m.group(1), fields.get("version")
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(?:=([^=<>!]+)|([<>=!].*))?", dep)
    assert m, f"binder/environment.yml: cannot parse dependency {dep!r}"
    name, exact, spec = m.groups()
    if exact is not None:
        spec = f"=={exact}.*" if exact.count(".") < 2 else f"=={exact}"
    return name, spec


def _lowest(spec: str) -> Version:
    """The lowest version a >=/== specifier allows."""
    m = re.search(r"(?:>=|==)\s*([0-9][0-9.]*)", spec)
    assert m, f"binder pins {spec!r}: give it a lower bound (>= or ==) so it can be compared"
    return Version(m.group(1).rstrip("."))


def _environment() -> dict:
    return yaml.safe_load((BINDER / "environment.yml").read_text())


def test_conda_packages_agree_with_pyproject():
    env = _environment()
    assert env["channels"] == ["conda-forge"]
    reqs = _pyproject_requirements()
    deps = [d for d in env["dependencies"] if isinstance(d, str)]
    assert not [d for d in env["dependencies"] if isinstance(d, dict)], \
        "no pip: section in environment.yml; postBuild's `pip install .` reads pyproject.toml"
    seen = set()
    for dep in deps:
        name, spec = _conda_spec(dep)
        if name in INFRASTRUCTURE:
            continue
        assert name in CONDA_TO_PYPI, (
            f"binder/environment.yml installs {name!r}, which pyproject.toml does not require "
            f"(known: {sorted(CONDA_TO_PYPI)}); add it to pyproject or drop it here")
        pypi = canonicalize_name(CONDA_TO_PYPI[name])
        assert pypi in reqs, f"{name} ({pypi}) is not a pyproject dependency"
        seen.add(pypi)
        wanted = reqs[pypi].specifier
        if spec:
            low = _lowest(spec)
            assert wanted.contains(low, prereleases=True), (
                f"binder allows {name} {spec} (down to {low}) but pyproject requires "
                f"{pypi}{wanted}")
        else:
            assert not wanted, f"pyproject requires {pypi}{wanted}; pin {name} in binder to match"
    assert seen == {"torch", "torchvision"}


def test_python_and_node_versions_agree():
    specs = dict(_conda_spec(d) for d in _environment()["dependencies"] if isinstance(d, str))
    requires_python = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert requires_python.contains(_lowest(specs["python"])), specs["python"]
    engines = json.loads((ROOT / "extension" / "package.json").read_text())["engines"]["node"]
    assert _lowest(specs["nodejs"]) >= _lowest(engines), (specs["nodejs"], engines)


def test_postbuild_installs_the_project_and_fails_loudly():
    text = (BINDER / "postBuild").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert text.startswith("#!/usr/bin/env bash") or text.startswith("#!/bin/bash")
    assert re.match(r"set -[a-z]*e", lines[0]), f"postBuild must start with set -e, got {lines[0]!r}"
    assert (BINDER / "postBuild").stat().st_mode & 0o111, "postBuild must be executable"
    pip_lines = [ln for ln in lines if re.search(r"\bpip install\b", ln)]
    assert pip_lines, "postBuild must pip install the project"
    for ln in pip_lines:
        args = [a.strip("'\"") for a in ln.split("pip install", 1)[1].split()
                if not a.startswith("-")]
        extras = PYPROJECT["project"]["optional-dependencies"]
        assert args in (["."], *([f".[{e}]"] for e in extras)), (
            f"postBuild: {ln!r} installs {args}; only the project itself (`.`, or with one of its "
            "extras) may be installed with pip here, so that its dependencies come from "
            "pyproject.toml")
    assert re.search(r"labextension list .*gpu_lab", text)
    assert re.search(r"server extension list .*gpu_lab", text)


def test_binder_opens_the_same_tutorials_index_as_make_lab():
    post = (BINDER / "postBuild").read_text()
    binder_url = re.search(r'"default_url":\s*"/lab/tree/([^"]+)"', post).group(1)
    make = (ROOT / "Makefile").read_text()
    make_url = re.search(r"default_url=/lab/tree/(\S+)", make).group(1)
    # make lab serves notebooks/ as the root, Binder serves the repository
    assert binder_url == f"notebooks/{make_url}", (binder_url, make_url)
    start = (BINDER / "start").read_text()
    assert 'exec "$@"' in start and "GPU_LAB_QUICK=1" in start
