"""Atomic checkpoints: complete-or-absent under SIGKILL, verified on load, never unpickled unsafely."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from gpu_lab.train import checkpoint as ck
from train_helpers import one_thread  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _files(step: int, big: int = 0) -> dict:
    """Writers for a small checkpoint whose contents depend on `step` (big: extra MB of weights)."""
    from safetensors.torch import save_file

    w = torch.full((64, 64), float(step))
    extra = {"big": torch.full((big * 262144,), float(step))} if big else {}
    return {
        "model.safetensors": lambda p: save_file({"w": w, **extra}, str(p)),
        "optimizer.pt": lambda p: torch.save({"state": {0: {"m": w * 2}}, "step": step}, p),
        "trainer_state.json": lambda p: ck.write_json(p, {"step": step}),
    }


def _load_all(info: ck.CheckpointInfo) -> int:
    """Load every file the way resume does; returns the step all of them agree on."""
    w = ck.load_tensors(info.path, "model.safetensors", info.manifest)["w"]
    opt = ck.load_object(info.path, "optimizer.pt", info.manifest)
    st = ck.load_json(info.path, "trainer_state.json", info.manifest)
    assert int(w[0, 0]) == opt["step"] == st["step"] == info.step
    return info.step


def test_save_verify_prune(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        ck.save_checkpoint(root, step, _files(step), meta={"reason": "test"}, keep_last=2)
    infos = ck.list_checkpoints(root, verify_files=True)
    assert [i.step for i in infos] == [3, 4]
    latest = ck.latest_checkpoint(root)
    assert latest.step == 4 and latest.meta == {"reason": "test"}
    assert _load_all(latest) == 4
    manifest = json.loads((latest.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.pt", "trainer_state.json"}
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp / trash left


def test_failed_save_keeps_previous_and_leaves_nothing(tmp_path):
    root = tmp_path / "checkpoints"
    ck.save_checkpoint(root, 1, _files(1), keep_last=1)

    def broken(p):
        p.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(root, 2, {**_files(2), "optimizer.pt": broken}, keep_last=1)
    assert [p.name for p in root.iterdir()] == ["step_000000001"]  # pruning never happened
    assert _load_all(ck.latest_checkpoint(root)) == 1


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_file", "bad_manifest",
                                    "no_manifest"])
def test_damaged_newest_is_skipped(tmp_path, damage):
    root = tmp_path / "checkpoints"
    ck.save_checkpoint(root, 1, _files(1))
    newest = ck.save_checkpoint(root, 2, _files(2))
    f = newest / "optimizer.pt"
    if damage == "flip_byte":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:10])
    elif damage == "delete_file":
        f.unlink()
    elif damage == "bad_manifest":
        (newest / "manifest.json").write_text("{not json")
    else:
        (newest / "manifest.json").unlink()
    with pytest.raises(ck.CheckpointError):
        ck.verify(newest)
    assert ck.latest_checkpoint(root).step == 1


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_unlisted_and_malicious_pickles_are_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    root = tmp_path / "checkpoints"
    evil_pickle = pickle.dumps({"state": Evil()})
    path = ck.save_checkpoint(root, 1, {**_files(1), "optimizer.pt": lambda p: p.write_bytes(evil_pickle)})
    (path / "evil.pkl").write_bytes(evil_pickle)  # a stray file the manifest does not list
    info = ck.latest_checkpoint(root)  # the manifest matches: this is a "complete" checkpoint
    assert info is not None and info.step == 1
    with pytest.raises(ck.CheckpointError, match="refused to load"):
        ck.load_object(info.path, "optimizer.pt", info.manifest)
    with pytest.raises(ck.CheckpointError, match="not listed"):
        ck.load_object(info.path, "evil.pkl", info.manifest)
    # a pickle posing as safetensors weights: safetensors parses a JSON header, never unpickles
    (path / "model.safetensors").write_bytes(evil_pickle)
    with pytest.raises(Exception):
        ck.load_tensors(path, "model.safetensors", info.manifest)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_fit_refuses_a_malicious_checkpoint(tmp_path):
    """Resume through fit(): the manifest checks out, the optimizer file is a code-running pickle."""
    from gpu_lab.config import TrainConfig
    from gpu_lab.models import build
    from gpu_lab.train import fit
    from gpu_lab.train.state import MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    from safetensors.torch import save_model

    model = build("tiny_cnn", 4, 16)
    ck.save_checkpoint(ck.checkpoint_dir(tmp_path), 5, {
        MODEL_FILE: lambda p: save_model(model, str(p)),
        OPTIMIZER_FILE: lambda p: p.write_bytes(pickle.dumps(Evil())),
        RNG_FILE: lambda p: torch.save([], p),
        STATE_FILE: lambda p: ck.write_json(p, {"step": 5, "epoch": 0, "batch_in_epoch": 0}),
    })
    cfg = TrainConfig(model="tiny_cnn", image_size=16, num_classes=4, max_steps=8, num_workers=0,
                      output_dir=str(tmp_path), tensorboard=False)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,)))
    with pytest.raises(ck.CheckpointError, match="refused to load"):
        fit(model, data, cfg)
    assert not marker.exists()


# --- SIGKILL during saves ----------------------------------------------------------------------------
def _saver(root: str, conn, start: int, kill_at_call: int, big: int) -> None:
    """Child: save checkpoints start, start+1, … (keep_last=2), telling the parent after each.
    With kill_at_call > 0, SIGKILL itself at that durability call (fsync / rename / rmtree)."""
    import shutil

    calls = [0]
    if kill_at_call:
        def hooked(fn):
            def wrapper(*a, **kw):
                calls[0] += 1
                if calls[0] == kill_at_call:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*a, **kw)
            return wrapper

        os.fsync = hooked(os.fsync)
        os.rename = hooked(os.rename)
        shutil.rmtree = hooked(shutil.rmtree)
    step = start
    while True:
        t0 = time.perf_counter()
        ck.save_checkpoint(root, step, _files(step, big), keep_last=2)
        conn.send((step, time.perf_counter() - t0, calls[0]))
        step += 1
        if kill_at_call and step > start + 1:
            return


def _check_after_kill(root: Path, last_reported: int) -> bool:
    """Assert resume's view is sound; True when the kill left a half-done save or prune behind."""
    leftovers = any(p.name.startswith(".") for p in root.iterdir())
    info = ck.latest_checkpoint(root)
    assert info is not None, "no complete checkpoint left"
    assert info.step >= last_reported
    assert _load_all(info) == info.step  # what resume would take, loads
    older = [i for i in ck.list_checkpoints(root, verify_files=True) if i.step < info.step]
    if older:  # the previous checkpoint still loads
        assert _load_all(older[-1]) == older[-1].step
    ck.sweep(root)  # the dead saver's temp / trash dirs are removed
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    return leftovers


def _last_reported(conn, default: int) -> int:
    """The last step the dead child reported complete (the pipe ends with EOF)."""
    step = default
    try:
        while conn.poll():
            step = conn.recv()[0]
    except EOFError:
        pass
    return step


def _run_child(root: Path, start: int, kill_at_call: int = 0, big: int = 1):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_saver, args=(str(root), child, start, kill_at_call, big))
    proc.start()
    child.close()
    return proc, parent


@pytest.mark.slow  # over half a second
def test_sigkill_at_random_points_never_leaves_a_bad_checkpoint(tmp_path):
    rng = random.Random(0)
    root = tmp_path / "checkpoints"
    ck.save_checkpoint(root, 0, _files(0))
    last, trials, durations, mid_save = 0, 24, [], 0
    for trial in range(trials):
        proc, conn = _run_child(root, last + 1)
        deadline = time.monotonic() + 60
        while not conn.poll(0.01):  # wait for one complete save: we know how long a save takes
            assert time.monotonic() < deadline and proc.is_alive()
        step, duration, _ = conn.recv()
        durations.append(duration)
        time.sleep(rng.uniform(0, 2.5 * duration))  # the random point: anywhere in the next saves
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        mid_save += _check_after_kill(root, _last_reported(conn, step))
        last = ck.latest_checkpoint(root).step
    print(f"\n{trials} SIGKILL trials ({mid_save} left a half-written save or prune behind); a save "
          f"took {1000 * sum(durations) / len(durations):.1f} ms on average; the newest complete "
          f"checkpoint always loaded, and so did the one before it")


@pytest.mark.slow  # over half a second
def test_sigkill_at_every_durability_step(tmp_path):
    """Kill at each fsync / rename / rmtree of a save that also prunes: every phase of the protocol."""
    # count the durability calls of one save that prunes (two checkpoints exist, keep_last=2)
    probe = tmp_path / "probe"
    ck.save_checkpoint(probe, 1, _files(1))
    ck.save_checkpoint(probe, 2, _files(2))
    proc, conn = _run_child(probe, 3, kill_at_call=10**6, big=0)
    proc.join(30)
    per_save = conn.recv()[2]
    assert per_save >= 8  # 3 files + manifest + temp dir + rename + parent + prune (rename, rmtree…)

    root = tmp_path / "checkpoints"
    ck.save_checkpoint(root, 1, _files(1))
    ck.save_checkpoint(root, 2, _files(2))
    for k in range(1, per_save + 1):
        last = ck.latest_checkpoint(root).step
        proc, conn = _run_child(root, last + 1, kill_at_call=k, big=0)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, f"call {k} of {per_save} did not happen"
        _check_after_kill(root, _last_reported(conn, last))
        assert len(ck.list_checkpoints(root, verify_files=True)) >= 1
