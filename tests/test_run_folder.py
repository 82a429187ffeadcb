"""The run folder has one home (gpu_lab.record.runfolder), and a rank's outcome another
(gpu_lab.rank.outcome): the file and folder names of GPU_LAB_HOME/runs/<id>/ appear in the
package's code nowhere else, however they are spelled, and the stop exit code and the stop signals
are defined once. The folder's own reads and writes are atomic and owner-only."""
from __future__ import annotations

import ast
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_lab.record.runfolder import RunFolder, check_log_name

PKG = Path(__file__).resolve().parents[1] / "gpu_lab"
HOME = "gpu_lab/record/runfolder.py"

# names that say "run folder" wherever they appear in a string
FILE_NAMES = re.compile(r"(result\.pkl|status\.json|channel\.key|supervisor\.log|job\.(sbatch|json)"
                        r"|rank(\{\}|\*|<N>|\d+)?\.(json|pid|log|preempted)|\*?\.preempted"
                        r"|(^|/)\*?\.pid$|(^|/)(control|errors|ranks|logs|elastic)/)")
# names that are run-folder paths only where a path is built from them
DIR_NAMES = {"control", "stop", "checkpoint", "errors", "ranks", "logs", "elastic", "runs",
             "channel", "result", "status"}
PATH_CALLS = {"Path", "PurePath", "joinpath", "join", "glob", "rglob", "with_name", "mkdir"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _text(node: ast.AST) -> str | None:
    """A string constant as written, an f-string with {} for each value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "rank" + ".json"
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


def _is_dir_name(node: ast.AST) -> bool:
    text = _text(node)
    return text is not None and any(part in DIR_NAMES for part in text.split("/") if part)


def run_folder_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of every place in `source` that names a run-folder file or folder: a string
    or f-string holding a file name, or a folder name used to build a path (`/`, Path(), join)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for v in node.values:  # their parts are visited on their own: skip them once
                docs.add(id(v))
        text = _text(node)
        if text is not None and id(node) not in docs and FILE_NAMES.search(text) \
                and "api/" not in text:  # the server's URLs are not paths in the folder
            found.append((node.lineno, text))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found += [(n.lineno, _text(n)) for n in (node.left, node.right) if _is_dir_name(n)]
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name in PATH_CALLS:
                found += [(a.lineno, _text(a)) for a in node.args if _is_dir_name(a)]
    return sorted(set(found))


def test_the_scan_finds_every_spelling():
    """It must be able to fail: each way of naming a run-folder file is found."""
    planted = '''
from pathlib import Path
import os
a = run_dir / "control" / "stop"
b = Path(run_dir, "errors")
c = f"rank{r}.json"
d = os.path.join(run_dir, "result.pkl")
e = "status.json"
f = ranks.glob("rank*.pid")
g = run_dir / "channel.key"
h = f"{run_dir}/logs/supervisor.log"
i = run_dir / f"ranks"
j = "control/checkpoint"
k = p.with_name("rank3.preempted")
l = "rank" + str(r) + ".log"
m = "result" + ".pkl"
'''
    lines = {line for line, _ in run_folder_names(planted)}
    assert lines == set(range(4, 15)) | {16}, run_folder_names(planted)
    # and what is not a run-folder path is left alone
    innocent = '''
"""Writes result.pkl and status.json (a docstring)."""
x = {"logs": [], "errors": 0, "stop": True}
state.request("checkpoint")
worker_name = f"rank{state.rank}"
'''
    assert run_folder_names(innocent) == []


@pytest.mark.slow  # over half a second
def test_run_folder_names_appear_only_in_runfolder():
    """Every other module asks RunFolder for the run folder's paths."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        rel = str(f.relative_to(PKG.parent))
        if rel == HOME:
            continue
        bad += [f"{rel}:{line}: {text!r}" for line, text in run_folder_names(f.read_text())]
    assert not bad, "run-folder names outside RunFolder:\n" + "\n".join(bad)
    assert run_folder_names((PKG.parent / HOME).read_text())  # the scan sees the home itself


def _defined(name: str) -> list[str]:
    out = []
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    elts = t.elts if isinstance(t, ast.Tuple) else [t]
                    if any(isinstance(e, ast.Name) and e.id == name for e in elts):
                        out.append(str(f.relative_to(PKG.parent)))
    return sorted(set(out))


@pytest.mark.slow  # over half a second
def test_one_stop_exit_code_and_one_set_of_stop_signals():
    from gpu_lab.rank.outcome import STOP_EXIT_CODE, STOP_SIGNALS
    from gpu_lab.train.guards import PREEMPT_EXIT_CODE, PREEMPT_SIGNALS

    assert STOP_EXIT_CODE == PREEMPT_EXIT_CODE == 143
    assert PREEMPT_SIGNALS is STOP_SIGNALS
    for name in ("STOP_EXIT_CODE", "STOP_SIGNALS", "EXIT_STOPPED", "EXIT_PREEMPTED",
                 "PREEMPT_EXIT_CODE", "PREEMPT_SIGNALS"):
        assert len(_defined(name)) <= 1, (name, _defined(name))
    # the code in the failure model (the bottom of the stack: the triage reads it without
    # importing the rank side), the signals with the ranks
    assert _defined("STOP_EXIT_CODE") == ["gpu_lab/failures/kinds.py"]
    assert _defined("STOP_SIGNALS") == ["gpu_lab/rank/outcome.py"]
    # the number itself, as an exit code, is written once
    where = [str(f.relative_to(PKG.parent)) for f in sorted(PKG.rglob("*.py"))
             if any(isinstance(n, ast.Constant) and n.value == 143 and type(n.value) is int
                    for n in ast.walk(ast.parse(f.read_text())))]
    assert where == ["gpu_lab/failures/kinds.py"], where
    # a set of signals built from signal.SIG* names lives there too
    sets = []
    for f in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Tuple) and len(n.elts) > 1 and all(
                    isinstance(e, ast.Attribute) and e.attr in ("SIGTERM", "SIGUSR1", "SIGHUP")
                    for e in n.elts):
                sets.append(str(f.relative_to(PKG.parent)))
    assert sets == ["gpu_lab/rank/outcome.py"], sets


def test_outcome_is_cheap_and_torch_free():
    code = ("import sys, gpu_lab.rank.outcome, gpu_lab.export.slurm, gpu_lab.record.runfolder; "
            "print(sorted(m for m in ('torch', 'zmq', 'accelerate', 'psutil', 'gpu_lab.supervise',"
            " 'gpu_lab.launch', 'gpu_lab.data') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_supervisor_never_imports_the_data_package():
    for f in (PKG / "supervise").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert not re.match(r"^(\.\.|gpu_lab\.)data\b", mod), (f, mod)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_writes_are_atomic_private_and_reads_never_raise(tmp_path, monkeypatch):
    monkeypatch.delenv("GPU_LAB_SHARE_GROUP", raising=False)
    old = os.umask(0)
    try:
        folder = RunFolder(tmp_path / "runs" / "r1").create(fresh=True)
        with pytest.raises(FileExistsError):
            RunFolder(folder.path).create(fresh=True)  # a fresh id never reuses a folder
        assert folder.stop_reason() is None and folder.read_status() is None
        assert folder.read_errors() == [] and folder.rank_pids() == {} and folder.log_names() == []
        assert folder.read_result() is None and folder.read_key() is None
        assert not folder.control_requested("checkpoint")
        written = [folder.request("stop", "the user asked"), folder.request("checkpoint"),
                   folder.write_pid(1, 4242), folder.write_error(1, {"rank": 1}),
                   folder.write_status({"status": "stopped"}), folder.write_result(b"x"),
                   folder.write_key("k"), folder.mark_preempted(0)]
    finally:
        os.umask(old)
    for p in written:
        assert _mode(p) == 0o600 and _mode(p.parent) == 0o700, p
    assert not [p for p in folder.path.rglob(".*.tmp")]  # the temp files were renamed
    assert folder.stop_reason() == "the user asked"
    assert folder.control_requested("checkpoint", consume=True)
    assert not folder.control_requested("checkpoint")  # consumed
    assert folder.control_requested("stop") and folder.control_requested("stop")  # stays
    assert folder.rank_pids() == {1: 4242} and folder.rank_pids(skip={1}) == {}
    assert folder.read_errors() == [{"rank": 1}] and folder.has_error(1) and folder.has_errors()
    assert folder.preempted_ranks() == ["rank0"]
    assert folder.read_status() == {"status": "stopped"}
    folder.error_file(2).write_text("{half a fil")  # a torn file is left out, not raised on
    assert folder.read_errors() == [{"rank": 1}]
    folder.request("stop", "1733000000.5")  # an older request holds a time stamp
    assert folder.stop_reason() == "stopped by the user"
    for name in ("rank0.log", "supervisor.log", "rank10.log", "rank2.log", "notes.txt"):
        (folder.logs_dir / name).write_text("")
    assert folder.log_names() == ["rank0.log", "rank2.log", "rank10.log", "supervisor.log"]


def test_bad_names_are_refused_with_what_is_accepted(tmp_path):
    folder = RunFolder(tmp_path)
    with pytest.raises(ValueError, match=r"run control: got 'pause'; accepted: 'checkpoint', 'stop'"):
        folder.request("pause")
    for name in ("../registry.db", "rank0.log/../x", "", 3):
        with pytest.raises(ValueError, match=r"accepted: rank<N>\.log or supervisor\.log"):
            check_log_name(name)
    assert folder.log_path("rank3.log") == folder.logs_dir / "rank3.log"


def test_an_unpicklable_result_is_one_explained_outcome(tmp_path, capfd):
    """Both launch paths store it the same way; Run.result() raises with the reason."""
    from gpu_lab.rank import outcome

    folder = RunFolder(tmp_path)
    logged = []

    class Reporter:
        def log(self, text):
            logged.append(text)

    assert outcome.write_result(folder, {"acc": 0.9}, Reporter()) is None
    assert outcome.read_result(folder) == {"acc": 0.9} and logged == []
    got = outcome.write_result(folder, lambda: 1, Reporter())
    assert isinstance(got, outcome.Unpicklable) and "function" in got.reason
    back = outcome.read_result(folder)
    assert isinstance(back, outcome.Unpicklable) and back.reason == got.reason
    assert len(logged) == 1 and "could not be pickled" in logged[0]
    assert "could not be pickled" in capfd.readouterr().err


class SignalException(Exception):
    """Named as torch elastic's: the agent's way of saying a stop signal reached it."""


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return e


def test_the_end_of_a_run_is_decided_in_one_place(tmp_path):
    """decide_end reads what ended the launch and the run folder: every status the supervisor can
    record, with its exit code and reason."""
    from gpu_lab.supervise.supervisor import _Stop, decide_end

    def end(error, in_launch=True, **files):
        folder = RunFolder(tmp_path / str(len(list(tmp_path.iterdir())))).create()
        if "stop" in files:
            folder.request("stop", files["stop"])
        for r in files.get("preempted", ()):
            folder.mark_preempted(r)
        for r in files.get("errors", ()):
            folder.write_error(r, {"rank": r})
        e = decide_end(folder, error, in_launch)
        return e.status, e.code, e.reason

    assert end(None) == ("succeeded", 0, None)
    assert end(None, stop="the user asked") == ("stopped", 143, "the user asked")
    assert end(None, stop="1733000000.5") == ("stopped", 143, "stopped by the user")
    assert end(_raised(SignalException("15")), True) == \
        ("stopped", 143, "stopped by a signal (SignalException)")
    assert end(_raised(RuntimeError("x")), True, stop="the launching kernel exited")[:2] == \
        ("stopped", 143)
    assert end(_raised(RuntimeError("agent")), True, preempted=[0, 1]) == \
        ("stopped", 143, "preempted: rank0, rank1 checkpointed and exited 143")
    assert end(_raised(RuntimeError("agent")), True, preempted=[0], errors=[1])[:2] == \
        ("failed", 1)
    assert end(_raised(RuntimeError("rank 1 broke")), True) == ("failed", 1, None)
    assert end(_raised(_Stop(15)), False) == ("stopped", 143, "stopped by a signal")
    assert end(_raised(OSError("no recorder")), False) == ("failed", 1, None)


def test_a_requeued_attempt_reads_its_own_failures_and_keeps_the_last_ones(tmp_path):
    # a two-node job requeued after a node loss reported attempt 0's "connection reset" as
    # attempt 1's root cause: the error files of the attempt before were still there
    folder = RunFolder(tmp_path / "run")
    folder.write_error(0, {"rank": 0, "type": "RuntimeError", "message": "Connection reset"})
    folder.mark_preempted(1)
    kept = folder.set_aside_attempt(0)
    assert folder.read_errors() == [] and not folder.has_errors() and not folder.has_error(0)
    assert folder.preempted_ranks() == []
    assert sorted(p.name for p in kept.iterdir()) == ["rank0.json", "rank1.preempted"]
    assert stat.S_IMODE(kept.stat().st_mode) & 0o077 == 0  # the user's own, like the run folder
    folder.write_error(1, {"rank": 1, "type": "NodeLost", "message": "lost"})
    assert [e["type"] for e in folder.read_errors()] == ["NodeLost"]
