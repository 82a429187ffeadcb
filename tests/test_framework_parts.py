"""The parts under the Trainer, Lightning and %%gpu_lab support, in one process: the magic's line,
patching a module when it is imported, a checkpoint event into the registry, and the advice for
a Lightning Trainer that asks for another world size. The real libraries in real ranks:
tests/test_frameworks.py."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from gpu_lab.failures.frameworks import world_suggestions
from gpu_lab.rank import imports
from gpu_lab.record import events as ev
from gpu_lab.widgets.magic import CellFunction, MagicError, parse


def test_the_magic_line_reads_as_launch_s_arguments():
    assert parse("--ranks 2 --gpus 0,1 --name a --detach --priority 3 --as r") == {
        "num_processes": 2, "gpus": [0, 1], "name": "a", "detach": True, "priority": 3,
        "mixed_precision": None, "queue": True, "bind": "r"}
    assert parse("")["bind"] == "run" and parse("")["num_processes"] is None
    assert parse("--gpus all --no-queue").items() >= {"gpus": "all", "queue": False}.items()
    assert parse("-n 4 --gpus 2")["gpus"] == 2


@pytest.mark.parametrize("line, named", [
    ("--ranks two", "--ranks"), ("--ranks 0", "--ranks 0"), ("--gpu 1", "--gpu 1"),
    ("--gpus 0;1", "--gpus '0;1'"), ("--as 1x", "--as '1x'"), ("--name 'open", "cannot read"),
    ("--mixed-precision fp8", "fp8")])
def test_a_bad_magic_line_names_what_was_wrong_and_what_is_accepted(line, named):
    with pytest.raises(MagicError) as e:
        parse(line)
    assert named in str(e.value) and str(e.value).startswith("%%gpu_lab: "), str(e.value)


def test_a_cell_runs_in_a_copy_of_the_namespace_it_was_given():
    ns = {"WIDTH": 7}
    fn = CellFunction("seen = WIDTH * 2\nWIDTH = 0\n", ns, "<gpu_lab cell test>")
    fn()
    assert ns == {"WIDTH": 7}  # the kernel's copy is not the ranks'
    with pytest.raises(SyntaxError):
        CellFunction("def f(:\n", ns, "<gpu_lab cell bad>")


def test_a_module_is_patched_when_imported_and_at_once_if_it_is_loaded(tmp_path, monkeypatch):
    (tmp_path / "gl_hooked_mod.py").write_text("class Trainer:\n    pass\n")
    (tmp_path / "gl_hook.py").write_text(
        "seen = []\ndef hook(module):\n    seen.append(module.__name__)\n"
        "    module.Trainer.patched = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gl_hook

    imports.when_imported("gl_hooked_mod", "gl_hook:hook")
    assert "gl_hooked_mod" not in sys.modules and gl_hook.seen == []  # nothing imported early
    import gl_hooked_mod

    assert gl_hook.seen == ["gl_hooked_mod"] and gl_hooked_mod.Trainer.patched
    imports.when_imported("gl_hooked_mod", "gl_hook:hook")  # loaded already: at once
    assert gl_hook.seen == ["gl_hooked_mod"] * 2
    for name in ("gl_hooked_mod", "gl_hook"):
        sys.modules.pop(name)


def test_wrap_wraps_once():
    class T:
        def f(self):
            return 1

    calls = []

    def wrapper(orig):
        def f(self):
            calls.append(1)
            return orig(self) + 1
        return f

    imports.wrap(T, "f", wrapper)
    imports.wrap(T, "f", wrapper)
    assert T().f() == 2 and calls == [1]


def test_checkpoint_events_are_listed_on_the_run(gpu_lab_home, tmp_path):
    from gpu_lab.record.registry import Registry

    reg = Registry()
    reg.create_run("r1", name="x", num_processes=1)
    saved = tmp_path / "checkpoint-10"
    saved.mkdir()
    t = time.time()
    reg.add_events("r1", [ev.make("r1", 0, ev.CHECKPOINT, {"path": str(saved)}, step=10, t=t),
                          ev.make("r1", 0, ev.CHECKPOINT, {"path": "/gone/checkpoint-20"},
                                  step=20, t=t + 1),
                          ev.make("r1", 0, ev.CHECKPOINT, {"path": 3}, step=30, t=t + 2)])
    assert [(c["step"], c["path"]) for c in reg.checkpoints("r1")] == [
        (10, str(saved)), (20, "/gone/checkpoint-20")]  # a path that is not text is not listed
    reg.delete_run("r1")
    assert reg.checkpoints("r1") == []


def test_a_lightning_world_size_refusal_gets_both_ways_out():
    said = world_suggestions("ValueError: You set `devices=4` and `num_nodes=1` in Lightning, "
                             "but the product (4 * 1) does not match the world size (2).")
    assert said is not None
    sentence, ways = said
    assert "4 processes, but 2 ranks" in sentence
    assert "devices=2" in ways[0] and "num_processes=4" in ways[1]
    assert world_suggestions("ValueError: something else") is None


@pytest.mark.slow  # starts a run
def test_a_port_taken_before_the_store_binds_it_is_replaced(gpu_lab_home, monkeypatch):
    """The launcher finds a free port, then something else takes it before the ranks' store
    listens (seen under a busy test suite): the supervisor picks another instead of failing."""
    import socket

    import gpu_lab
    from gpu_lab.launch import checks

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    monkeypatch.setattr(checks, "free_port", lambda host="127.0.0.1": port)
    try:
        script = Path(__file__).parent / "own_code" / "exits.py"
        run = gpu_lab.launch(str(script), "exit0", num_processes=2)
        assert run.wait(120) == "succeeded", run.logs(None)
        assert f"port {port} was taken" in run.logs(None), run.logs(None)
    finally:
        taken.close()
