"""fit() in one process: learning, reporting, accumulation, precision, guards, OOM, profiler, resume."""
from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from gpu_lab.config import TrainConfig
from gpu_lab.models import build
from gpu_lab.train import (Callback, MemoryGuard, NonFiniteLossError, Preempted,
                           TrainingOutOfMemoryError, fit, latest_checkpoint, train_classifier)
from gpu_lab.train.checkpoint import checkpoint_dir, load_tensors
from train_helpers import one_thread, tiny_images  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(model="tiny_cnn", image_size=16, num_classes=4, batch_size=8, max_steps=6,
                num_workers=0, output_dir=str(tmp_path / "out"), tensorboard=False, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def model_for(c: TrainConfig):
    torch.manual_seed(c.seed)
    return build(c.model, c.num_classes, c.image_size)


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_close(a: dict, b: dict, atol=1e-6):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max difference {worst:.3g} > {atol}"


# --- learning and reporting -------------------------------------------------------------------------
@pytest.fixture
def event_socket(monkeypatch):
    """A real zmq PULL socket posing as the kernel's receiver; the worker-side reporter sends to it."""
    import zmq

    from gpu_lab.record import events as ev
    from gpu_lab.record import reporter as rep

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    monkeypatch.setenv(ev.ENV_ADDRESS, f"tcp://127.0.0.1:{port}")
    monkeypatch.setenv(ev.ENV_RUN_ID, "test-run")
    rep.reset_reporter()
    yield sock
    rep.get_reporter().close()
    rep.reset_reporter()
    sock.close(0)
    ctx.term()


def _drain(sock, until: set, last_step: int, log: str, timeout: float = 20.0) -> list[dict]:
    """Events until every name in `until`, a loss at `last_step` and a log line containing `log`
    arrived (or the deadline passed)."""
    import zmq

    from gpu_lab.record import events as ev

    events, seen, last, logged = [], set(), False, False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (until <= seen and last and logged):
        if sock.poll(100, zmq.POLLIN):
            for e in ev.decode(sock.recv()):
                events.append(e)
                if e["kind"] == ev.METRIC:
                    seen |= set(e["data"])
                    last = last or (e["step"] == last_step and "loss" in e["data"])
                elif e["kind"] == ev.LOG:
                    logged = logged or log in e["data"]["text"]
    return events


@pytest.mark.slow  # over half a second
def test_train_classifier_learns_and_reports_through_the_stream(tmp_path, event_socket):
    c = cfg(tmp_path, model="tiny_cnn", image_size=32, num_classes=4, batch_size=32, max_steps=24,
            lr=3e-3, eval_every=12, augment="none")
    summary = train_classifier(c)  # synthetic images: gpu_lab.data.SyntheticImages
    assert summary["steps"] == 24 and summary["num_processes"] == 1
    assert summary["accuracy"] > 0.5, summary  # 4 classes: chance is 0.25
    assert summary["samples_per_s"] > 0 and summary["global_batch"] == 32
    assert Path(summary["checkpoint"]).name == "step_000000024"
    wanted = {"loss", "lr", "samples_per_s", "step_time", "data_wait", "accuracy", "eval_loss"}
    events = _drain(event_socket, wanted, last_step=24, log="checkpoint step 24")
    metrics = [e for e in events if e["kind"] == "metric"]
    names = set().union(*(e["data"] for e in metrics))
    assert wanted <= names, names
    steps = sorted({e["step"] for e in metrics if "loss" in e["data"]})
    assert steps == list(range(1, 25))
    assert all(e["run"] == "test-run" and e["rank"] == 0 for e in metrics)
    logs = [e["data"]["text"] for e in events if e["kind"] == "log"]
    assert any("checkpoint step 24" in t for t in logs)


def test_callbacks_are_called_in_order(tmp_path):
    calls = []

    class Recorder(Callback):
        def on_fit_start(self, s): calls.append(("fit_start", s.step))
        def on_step_start(self, s): calls.append(("step_start", s.step))
        def on_step_end(self, s): calls.append(("step_end", s.step))
        def on_log(self, s, m): calls.append(("log", s.step))
        def on_eval_end(self, s, m): calls.append(("eval", s.step))
        def on_checkpoint(self, s, p, r): calls.append(("checkpoint", s.step, r))
        def on_fit_end(self, s, summary): calls.append(("fit_end", summary["steps"]))

    c = cfg(tmp_path, max_steps=4, log_every=2, eval_every=2, checkpoint_every=3)
    fit(model_for(c), tiny_images(32), c, eval_data=tiny_images(16, seed=1), callbacks=[Recorder()])
    assert calls == [("fit_start", 0),
                     ("step_start", 0), ("step_end", 1),
                     ("step_start", 1), ("step_end", 2), ("log", 2), ("eval", 2),
                     ("step_start", 2), ("step_end", 3), ("checkpoint", 3, "periodic"),
                     ("step_start", 3), ("step_end", 4), ("log", 4), ("eval", 4),
                     ("checkpoint", 4, "final"), ("fit_end", 4)]


# --- accumulation and precision ---------------------------------------------------------------------
def test_grad_accumulation_4x8_equals_one_batch_of_32(tmp_path):
    """tiny_vit: no BatchNorm, so splitting the batch does not change the gradient."""
    common = dict(model="tiny_vit", optimizer="sgd", lr=0.1, scheduler="constant", warmup_ratio=0.0,
                  max_grad_norm=None, max_steps=3, resume=False)
    ref_cfg = cfg(tmp_path / "a", batch_size=32, grad_accum_steps=1, **common)
    acc_cfg = cfg(tmp_path / "b", batch_size=8, grad_accum_steps=4, **common)
    ref, accum = model_for(ref_cfg), model_for(acc_cfg)
    assert_close(params(ref), params(accum), 0)
    data = tiny_images(96)
    fit(ref, data, ref_cfg)
    s = fit(accum, data, acc_cfg)
    assert s["global_batch"] == 32 and s["steps"] == 3
    moved = max((a - b).abs().max().item() for a, b in zip(params(ref).values(),
                                                            params(model_for(ref_cfg)).values()))
    assert moved > 1e-3  # the comparison below is not between untrained models
    assert_close(params(ref), params(accum), 1e-5)


def test_bf16_autocast_end_to_end_on_cpu(tmp_path):
    c = cfg(tmp_path, mixed_precision="bf16", max_steps=4)
    model = model_for(c)
    dtypes = []
    model.head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    s = fit(model, tiny_images(64), c)
    assert dtypes and set(dtypes) == {torch.bfloat16}  # the matmuls ran in bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert math.isfinite(s["loss"]) and s["mixed_precision"] == "bf16"
    weights = load_tensors(s["checkpoint"])
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())


@pytest.mark.slow  # over half a second
def test_channels_last_activation_checkpointing_and_tensorboard(tmp_path):
    c = cfg(tmp_path, model="tiny_resnet", channels_last=True, activation_checkpointing=True,
            tensorboard=True, max_steps=3)
    model = model_for(c)
    s = fit(model, tiny_images(32), c)
    conv = model.stem[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert math.isfinite(s["loss"])
    events = list((tmp_path / "out" / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {"loss", "lr", "samples_per_s"} <= set(acc.Tags()["scalars"])


def test_compile_switch_asks_accelerate_for_inductor(tmp_path):
    """torch.compile itself takes minutes on a 2-core box; check the switch reaches accelerate."""
    from gpu_lab.train.loop import make_accelerator

    acc = make_accelerator(cfg(tmp_path, compile=True), tmp_path)
    assert acc.state.dynamo_plugin.backend.value.lower() == "inductor"


# --- guards -----------------------------------------------------------------------------------------
class At(Callback):
    def __init__(self, step, fn):
        self.step, self.fn = step, fn

    def on_step_end(self, state):
        if state.step == self.step:
            self.fn(state)


def test_sigusr1_checkpoints_and_exits_143(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    c = cfg(tmp_path, max_steps=20)
    with pytest.raises(Preempted) as e:
        fit(model_for(c), tiny_images(64), c,
            callbacks=[At(3, lambda s: os.kill(os.getpid(), signal.SIGUSR1))])
    assert e.value.code == 143 and e.value.step == 4  # the guard saw it at the next boundary
    assert "SIGUSR1" in str(e.value)
    info = latest_checkpoint(checkpoint_dir(c.output_dir))
    assert info.step == 4 and info.meta["reason"] == "preempt"
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers restored


def test_kernel_checkpoint_and_stop_requests(tmp_path, monkeypatch):
    from gpu_lab.record import events as ev

    run_dir = tmp_path / "run"
    control = run_dir / "control"
    control.mkdir(parents=True)
    monkeypatch.setenv(ev.ENV_RUN_DIR, str(run_dir))
    c = cfg(tmp_path, max_steps=20)
    s = fit(model_for(c), tiny_images(64), c, callbacks=[
        At(2, lambda s: (control / "checkpoint").write_text("x")),   # Run.request_checkpoint()
        At(5, lambda s: (control / "stop").write_text("x"))])
    steps = {p.name for p in checkpoint_dir(c.output_dir).iterdir()}
    assert steps == {"step_000000003", "step_000000006"}
    assert s["stopped"] == "stop" and s["steps"] == 6
    # a checkpoint request is consumed; a stop stays for the supervisor to report "stopped"
    assert [p.name for p in control.iterdir()] == ["stop"]


def test_memory_threshold_saves_one_checkpoint_and_snapshot(tmp_path):
    readings = iter([0.5, 0.6, 0.96, 0.99, 0.99, 0.99, 0.99, 0.99])
    guard = MemoryGuard(threshold=0.95, probe=lambda: next(readings))  # a probe double (no GPU)
    c = cfg(tmp_path, max_steps=8, keep_last=5)
    fit(model_for(c), tiny_images(64), c, callbacks=[guard])
    saved = sorted(p.name for p in checkpoint_dir(c.output_dir).iterdir())
    assert saved == ["step_000000003", "step_000000008"]  # once at 96%, then the final one
    assert guard.fired and len(guard.snapshots) == 1
    snap = json.loads(guard.snapshots[0].read_text())
    assert snap["step"] == 3 and snap["fraction"] == 0.96 and snap["host_rss_bytes"] > 0


def test_memory_guard_does_nothing_on_cpu_without_a_probe(tmp_path):
    guard = MemoryGuard(threshold=0.01)
    c = cfg(tmp_path, max_steps=3)
    fit(model_for(c), tiny_images(32), c, callbacks=[guard])
    assert guard.probe is None and not guard.fired


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    c = cfg(tmp_path, max_steps=10, checkpoint_every=2)
    calls = [0]

    def loss_fn(out, y):
        calls[0] += 1
        loss = torch.nn.functional.cross_entropy(out, y)
        return loss * float("nan") if calls[0] == 5 else loss

    with pytest.raises(NonFiniteLossError, match="step 5"):
        fit(model_for(c), tiny_images(64), c, loss_fn=loss_fn)
    assert latest_checkpoint(checkpoint_dir(c.output_dir)).step == 4


class Hungry(torch.nn.Module):
    """A model whose forward needs more memory than any host has when the batch exceeds `limit`:
    the allocator raises its real out-of-memory error (a CPU stand-in for CUDA OOM)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.lin = torch.nn.Linear(3 * 16 * 16, 4)

    def forward(self, x):
        if x.shape[0] > self.limit:
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB
        return self.lin(x.flatten(1))


@pytest.mark.slow  # over half a second
def test_oom_triage_names_batch_and_ordered_suggestions(tmp_path):
    c = cfg(tmp_path, batch_size=16, grad_accum_steps=2, max_steps=2)
    with pytest.raises(TrainingOutOfMemoryError) as e:
        fit(Hungry(limit=4), tiny_images(64), c)
    msg = str(e.value)
    assert "per-device batch of 16" in msg and "global batch 32" in msg
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()[:2] in ("1.", "2.", "3.")]
    assert lines[0].startswith("1. batch_size=8 (from 16) with grad_accum_steps=4")
    assert "mixed_precision='bf16'" in lines[1] and "activation_checkpointing" in lines[2]
    assert "can't allocate memory" in msg  # the allocator's own words are kept


@pytest.mark.slow  # over half a second
def test_oom_retry_halves_the_batch_and_keeps_the_math(tmp_path):
    common = dict(max_steps=3, optimizer="sgd", scheduler="constant", warmup_ratio=0.0,
                  max_grad_norm=None, lr=0.1)
    c = cfg(tmp_path / "retry", batch_size=16, grad_accum_steps=1, oom_retry=True, **common)
    torch.manual_seed(0)
    hungry = Hungry(limit=4)
    torch.manual_seed(0)
    reference = Hungry(limit=1000)
    s = fit(hungry, tiny_images(64), c)
    assert (s["micro_batch_size"], s["grad_accum_steps"], s["global_batch"]) == (4, 4, 16)
    assert s["oom_retries"] == 2 and s["steps"] == 3
    fit(reference, tiny_images(64), cfg(tmp_path / "ref", batch_size=4, grad_accum_steps=4, **common))
    assert_close(params(hungry), params(reference), 1e-6)


def test_profiler_window_writes_a_chrome_trace(tmp_path):
    c = cfg(tmp_path, max_steps=6, profile_steps=2)
    s = fit(model_for(c), tiny_images(64), c)
    trace = Path(s["profile_trace"])
    assert trace.parent == tmp_path / "out" / "profile" and trace.name.endswith(".pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2  # exactly the window: Perfetto / TensorBoard show these as spans


# --- resume -----------------------------------------------------------------------------------------
@pytest.mark.slow  # over half a second
def test_resume_after_stop_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    """One process: stop at step 5 (a kernel request; the end of an epoch whose last step is short),
    resume, compare with a straight run. Data order, optimizer, schedule and dropout RNG must all
    continue exactly."""
    from gpu_lab.record import events as ev

    def with_dropout(c):
        m = model_for(c)
        m.head = torch.nn.Sequential(torch.nn.Dropout(0.3), m.head)
        return m

    common = dict(max_steps=14, grad_accum_steps=2, batch_size=4, warmup_ratio=0.2)
    straight_cfg = cfg(tmp_path / "straight", **common)
    straight = with_dropout(straight_cfg)
    # 36 samples = 9 micro-batches of 4: every epoch's 5th step has a single micro-batch
    fit(straight, tiny_images(36), straight_cfg)

    run_dir = tmp_path / "run"
    (run_dir / "control").mkdir(parents=True)
    monkeypatch.setenv(ev.ENV_RUN_DIR, str(run_dir))
    c = cfg(tmp_path / "resumed", **common)
    first = fit(with_dropout(c), tiny_images(36), c,
                callbacks=[At(4, lambda s: (run_dir / "control" / "stop").write_text("x"))])
    assert first["stopped"] == "stop" and first["steps"] == 5
    monkeypatch.delenv(ev.ENV_RUN_DIR)  # a relaunch is a new run, with a new run directory
    resumed = with_dropout(c)
    second = fit(resumed, tiny_images(36), c)
    assert second["resumed_from"].endswith("step_000000005") and second["steps"] == 14
    assert_close(params(straight), params(resumed), 0)


def test_resume_with_a_longer_run_follows_the_new_schedule(tmp_path):
    c = cfg(tmp_path, max_steps=4, scheduler="cosine", warmup_ratio=0.0, lr=0.01)
    fit(model_for(c), tiny_images(64), c)
    longer = c.replace(max_steps=8)
    seen = []
    fit(model_for(longer), tiny_images(64), longer,
        callbacks=[At(5, lambda s: seen.append(s.lr))])
    from gpu_lab.train.schedules import cosine

    assert seen[0] == pytest.approx(0.01 * cosine(5, 8, 0))  # not the 4-step schedule's 0


# --- data from gpu_lab.data -------------------------------------------------------------------------
def test_train_classifier_on_webdataset_shards(tmp_path):
    """data_dir with train/ and val/ shard folders: fit uses gpu_lab.data.shard_loader's per-rank
    batches as they are (no second sharding by accelerate)."""
    from gpu_lab.data import make_synthetic_images, write_shards

    for split, n, seed in (("train", 96, 0), ("val", 32, 1)):
        make_synthetic_images(tmp_path / f"img_{split}", n, image_size=16, num_classes=4, seed=seed)
        write_shards(tmp_path / f"img_{split}", tmp_path / "shards" / split, maxcount=16,
                     progress=False)
    c = cfg(tmp_path, data_dir=str(tmp_path / "shards"), batch_size=16, grad_accum_steps=4,
            max_steps=None, epochs=2, augment="none", lr=3e-3)
    s = train_classifier(c)
    # 96 samples = 6 batches of 16 per epoch: one full step of 4, the 2 left over are dropped
    assert s["steps"] == 2 and s["epoch"] == 2 and s["total_steps"] == 2
    assert s["accuracy"] is not None and 0.0 <= s["accuracy"] <= 1.0
    assert s["checkpoint"].endswith("step_000000002")
