"""The package's layering, enforced: headless packages never import views, `import gpu_lab` is cheap
and starts no thread, every module is reachable from where users enter (what only benchmarks use
lives in bench/), the package never imports bench/, and every declared dependency is used."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "gpu_lab"
HEADLESS = ["train", "data", "diagnostics", "export", "launch", "supervise", "rank", "record",
            "readers", "failures", "models", "cases", "hardware"]
VIEW_MODULES = ("ipywidgets", "plotly", "anywidget", "jupyter_server", "jupyterlab", "IPython",
                "ipykernel", "tornado", "gpu_lab.widgets", "gpu_lab.server")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    pkg_parts = path.relative_to(PKG.parent).with_suffix("").parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # resolve relative imports
                base = pkg_parts[: len(pkg_parts) - node.level]
                mod = ".".join(base + ((node.module,) if node.module else ()))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("sub", HEADLESS)
def test_headless_packages_never_import_views(sub):
    d = PKG / sub
    files = list(d.rglob("*.py")) if d.is_dir() else [PKG / f"{sub}.py"]
    bad = []
    for f in files:
        for name in _imports(f):
            if any(name == v or name.startswith(v + ".") for v in VIEW_MODULES):
                bad.append(f"{f.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_import_gpu_lab_is_cheap_and_quiet():
    code = ("import sys, threading; import gpu_lab; "
            "print(sorted(m for m in ('torch','pynvml','zmq','ipywidgets','plotly','accelerate') "
            "if m in sys.modules), threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] 1"


def test_headless_modules_load_without_view_libraries():
    code = ("import sys, importlib\n"
            f"for m in {['gpu_lab.' + s for s in HEADLESS]!r}:\n"
            "    importlib.import_module(m)\n"
            f"print(sorted(v for v in {list(VIEW_MODULES)!r} if v in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------- the package holds the product, bench/ the instruments

# Where users enter the package: the public API (gpu_lab/__init__.py's _API and _SUBMODULES), the
# command line, the server extension that JupyterLab loads, and the entry of headless runs.
ENTRY_POINTS = ("gpu_lab", "gpu_lab.cli", "gpu_lab.server", "gpu_lab.rank.headless")
# The named test doubles for machines without a GPU, which tests, the GPU check and
# tutorial 06 import by name; each one says so in its first line.
TEST_DOUBLES = ("gpu_lab.launch.testing", "gpu_lab.telemetry.doubles")


def _package_modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _lazy_imports(path: Path, module: str) -> set[str]:
    """Modules a file names as strings, for import_module: the lazy `_API` tables' values (any
    string constant that names a module counts: "gpu_lab.x.y", or ".y" relative to the file's own
    module, as `import_module(".y", __name__)` reads it) and the bare submodule names of a
    package's `_SUBMODULES`."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(module + node.value if node.value.startswith(".") else node.value)
        if (isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List))
                and any(isinstance(t, ast.Name) and t.id == "_SUBMODULES" for t in node.targets)):
            names.update(f"{module}.{e.value}" for e in node.value.elts if isinstance(e, ast.Constant))
    return names


def _reachable(modules: dict[str, Path]) -> set[str]:
    """The modules an import from ENTRY_POINTS (or of a test double) can load: every import in a
    file counts, at its top or inside a function (the package imports lazily), and a module loads
    its parents."""
    seen, todo = set(), [*ENTRY_POINTS, *TEST_DOUBLES]
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in modules:
            continue
        seen.add(mod)
        names = _imports(modules[mod]) | _lazy_imports(modules[mod], mod)
        names.add(mod.rpartition(".")[0])
        todo += [n for n in names if n in modules]
    return seen


@pytest.mark.slow  # over half a second
def test_every_module_is_reachable_from_where_users_enter():
    """A module that no entry point reaches serves something else (a benchmark, a test): it
    belongs in bench/ or tests/, not in what every user installs."""
    modules = _package_modules()
    assert set(ENTRY_POINTS) | set(TEST_DOUBLES) <= set(modules)
    for double in TEST_DOUBLES:
        assert modules[double].read_text().startswith('"""Test doubles'), double
    orphans = sorted(set(modules) - _reachable(modules))
    assert not orphans, (f"not reachable from {', '.join(ENTRY_POINTS)}: {', '.join(orphans)}; "
                         f"move what only benchmarks use to bench/lib")


@pytest.mark.slow  # over half a second
def test_the_package_never_imports_the_benchmarks():
    bad = []
    for f in PKG.rglob("*.py"):
        tree = ast.parse(f.read_text(), str(f))
        named = {n.args[0].value for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) in ("import_module",
                                                                             "__import__")}
        for name in _imports(f) | {n for n in named if isinstance(n, str)}:
            if name == "bench" or name.startswith("bench."):
                bad.append(f"{f.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


# What a dependency does without being imported by name.
USED_WITHOUT_IMPORT = {
    "jupyterlab": "the application that serves the tutorials and loads the lab extension",
    "tensorboard": "accelerate's tracker behind TrainConfig.tensorboard (log_with='tensorboard')",
    "anywidget": "plotly's FigureWidget (every live plot) is an anywidget: plotly imports it and "
                 "refuses to make one without it",
}


@pytest.mark.slow  # over half a second
def test_every_declared_dependency_is_imported():
    """A dependency that nothing imports costs every install for nothing. The import names come
    from the installed distributions; notebooks count (the tutorials are the product too)."""
    import importlib.metadata
    import re
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    provides: dict[str, set[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(canonicalize_name(dist), set()).add(top)
    imported = {name.split(".")[0] for f in PKG.rglob("*.py") for name in _imports(f)}
    for nb in (PKG.parent / "notebooks").glob("*.ipynb"):
        imported.update(re.findall(r'"\s*(?:from|import) ([A-Za-z_]\w*)', nb.read_text()))
    unused = sorted(d for d in declared - set(USED_WITHOUT_IMPORT)
                    if not provides.get(d, set()) & imported)
    assert not unused, f"declared in pyproject.toml, imported nowhere: {unused}"


# ------------------------------------------------------------------- no cycles, however hidden

def _lazy_table(tree: ast.AST, module: str) -> dict[str, tuple[str, int]]:
    """name -> (module it loads on first use, line) for a package's lazy_api(...) table: the api
    dict's names (their module absolute, or ".x" relative to the package) and its `submodules`;
    plus each import_module("...") with a constant name, keyed by that name. Narrower than
    _lazy_imports: a string that only names a module (for `python -m`) starts a process, which
    imports nothing into this one."""
    assigned = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}

    def literal(node):  # a table written inline, or assigned to a name first (_API = {...})
        return assigned.get(node.id, node) if isinstance(node, ast.Name) else node

    table = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        name = getattr(call.func, "id", getattr(call.func, "attr", None))
        if name == "import_module" and call.args and isinstance(call.args[0], ast.Constant):
            table[call.args[0].value] = (call.args[0].value, call.lineno)
        if name != "lazy_api" or len(call.args) < 2:
            continue
        api = literal(call.args[1])
        for k, v in zip(api.keys, api.values) if isinstance(api, ast.Dict) else ():
            if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                table[k.value] = (module + v.value if v.value.startswith(".") else v.value,
                                  v.lineno)
        for kw in call.keywords:
            subs = literal(kw.value)
            if kw.arg == "submodules" and isinstance(subs, (ast.Tuple, ast.List)):
                table.update({e.value: (f"{module}.{e.value}", e.lineno) for e in subs.elts
                              if isinstance(e, ast.Constant)})
    return table


def _module_graph() -> dict[str, dict[str, int]]:
    """module -> {gpu_lab module it imports: line}: every import statement of every file, at its
    top or inside a function, relative imports resolved, each to the module it loads
    (`from pkg import sub` loads pkg.sub; `from pkg import name` the module pkg's lazy table
    names for it), plus what each package's lazy table can load."""
    modules = _package_modules()
    trees = {m: ast.parse(f.read_text(), str(f)) for m, f in modules.items()}
    lazy = {m: _lazy_table(t, m) for m, t in trees.items()}

    def known(name: str) -> str | None:  # the module itself, or the package that holds the name
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, tree in trees.items():
        parts = modules[mod].relative_to(PKG.parent).with_suffix("").parts
        edges = {target: line for target, line in lazy[mod].values()}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(parts[: len(parts) - node.level] + ((base,) if base else ()))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules
                                   else lazy.get(base, {}).get(a.name, (base,))[0])
            for t in targets:
                edges.setdefault(t, node.lineno)
        graph[mod] = {k: line for t, line in edges.items() if (k := known(t)) and k != mod}
    return graph


def _layer(module: str) -> str:
    """The package a module belongs to: gpu_lab's top-level subpackage or module (gpu_lab.x)."""
    return ".".join(module.split(".")[:2])


def _cycles(graph: dict[str, set[str]]) -> list[tuple[set[str], list[str]]]:
    """Each strongly connected part of `graph` that holds a cycle, with the shortest cycle
    through the part's first node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[set[str]] = []

    def visit(v):  # Tarjan's algorithm; a few hundred modules stay far from the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set(stack[stack.index(v):])
            del stack[stack.index(v):]
            parts.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for part in (p for p in parts if len(p) > 1):
        start = min(part)
        paths, seen = [[start]], {start}
        while paths:  # breadth first: the shortest way back to start inside the part
            path = paths.pop(0)
            nxt = sorted(w for w in graph.get(path[-1], ()) if w in part)
            if start in nxt:
                cycles.append((part, path + [start]))
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return cycles


def _cycle_report(part: set[str], cycle: list[str], graph: dict[str, dict[str, int]],
                  of=lambda m: m) -> str:
    """The cycle, each step with the imports that make it, then the other imports that tie the
    part together (all of them must go for the part to fall apart)."""
    paths = _package_modules()

    def imports(a, b):
        return [f"      {m} imports {t} ({paths[m].relative_to(PKG.parent)}:{line})"
                for m, ts in sorted(graph.items()) if of(m) == a
                for t, line in sorted(ts.items()) if of(t) == b]

    steps = list(zip(cycle, cycle[1:]))
    lines = ["  " + " -> ".join(cycle)]
    for a, b in steps:
        lines += [f"    {a} -> {b}:", *imports(a, b)]
    others = sorted({(of(m), of(t)) for m, ts in graph.items() for t in ts
                     if of(m) in part and of(t) in part and of(m) != of(t)} - set(steps))
    if others:
        lines.append(f"    and inside {', '.join(sorted(part))}:")
        for a, b in others:
            lines += [f"    {a} -> {b}:", *imports(a, b)]
    return "\n".join(lines)


@pytest.mark.slow  # over half a second
def test_no_import_cycle_between_packages():
    """The packages stack in one direction (failures, the record and the rank side at the bottom;
    the views, the server and the command line at the top): no chain of imports, at a module's
    top or inside a function, or through a lazy table, leads from a package back to itself. A
    package is gpu_lab's top-level subpackage or module; there are no exceptions."""
    graph = _module_graph()
    layers: dict[str, set[str]] = {}
    for m, ts in graph.items():
        layers.setdefault(_layer(m), set()).update(_layer(t) for t in ts if _layer(t) != _layer(m))
    cycles = _cycles(layers)
    assert not cycles, "import cycles between packages:\n" + "\n".join(
        _cycle_report(part, c, graph, _layer) for part, c in cycles)


@pytest.mark.slow  # over half a second
def test_no_import_cycle_inside_a_package():
    """Nor between two modules of one package (launcher -> run -> launcher)."""
    graph = _module_graph()
    inside = {m: {t for t in ts if _layer(t) == _layer(m)} for m, ts in graph.items()}
    cycles = _cycles(inside)
    assert not cycles, "import cycles between modules:\n" + "\n".join(
        _cycle_report(part, c, graph) for part, c in cycles)


def test_every_module_is_in_the_layout_table_of_the_architecture_notes():
    """docs/architecture.md's layout names every module of the package, so that the map a new
    engineer reads first is the whole map."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## Layout"):doc.index("\n## ", doc.index("## Layout") + 1)]
    missing = sorted(str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
                     if p.name != "__init__.py" and "labextension" not in p.parts
                     and f"`{p.name}`" not in table)
    assert not missing, "modules docs/architecture.md's layout does not name: " + ", ".join(missing)
