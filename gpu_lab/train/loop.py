# Long: the fit loop reads top to bottom in one file; its parts (checkpoints, evaluation, guards,
# schedules, resume) live in modules of their own.
"""fit(): one training loop that carries the documents' optimisations as TrainConfig switches.

It reads top to bottom: build the Accelerator, prepare model / optimizer / data, restore the newest
complete checkpoint, then for each optimizer step run `grad_accum_steps` micro-batches through
`accelerator.accumulate`, step, report, let the callbacks speak, agree across ranks on what they
asked for (checkpoint, stop, preemption, memory, NaN), act on it. The same function runs under
gpu_lab.launch, bare `accelerate.notebook_launcher` and `torchrun`: it creates its Accelerator
through `gpu_lab.accelerator()` (gloo on CPU-only hosts) and reports through `gpu_lab.report`,
which is a no-op outside a gpu_lab launch.

The loop's state has three parts: `_Setup`, frozen, what was prepared once (model, optimizer,
scheduler, loaders, callbacks, the config's constants; an OOM retry replaces it with a smaller
micro-batch); `TrainState`, the position the callbacks see (step, epoch, data position, samples
seen, loss, lr); `_Progress`, the loop's own counters (the last step boundary, what was saved and
evaluated when, throughput). Each step below takes them explicitly.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

from ..record import get_reporter, report
from . import activation, oom
from .callbacks import REQUESTS, Callback, CallbackList, TrainState
from .checkpoint import CheckpointError, checkpoint_dir, latest_checkpoint
from .data import is_per_rank, make_loader, micro_batches_per_epoch, split_batch, steps_per_epoch
from .evaluation import eval_batches, evaluate
from .guards import NonFiniteLossError, Preempted, PreemptionGuard, default_guards
from .optim import build_optimizer
from .profiling import ProfilerWindow
from .resume import check_compatible, find_checkpoint
from .schedules import Schedule, build_scheduler
from .state import load_training_state, save_training_state, set_rng_state
from .validate import validate

log = logging.getLogger(__name__)


def make_accelerator(config, output_dir: Path):
    """The Accelerator for `config`, through gpu_lab.accelerator() (cpu=True on GPU-less hosts, so
    N workers form a gloo group instead of training N independent copies)."""
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    from ..rank.accelerator import accelerator as gpu_lab_accelerator
    from ..rank.adopt import without_tracker

    # accelerate keeps precision and the torch.compile plugin in a process-wide singleton that a
    # second Accelerator silently reuses (or refuses to change): each fit() starts from a clean one.
    # The process group (PartialState) is kept.
    release_accelerator_state()
    kw: dict[str, Any] = {
        # at its default, the launcher's word: `accelerate launch` or gpu_lab.launch() put the
        # user's accelerate config in ACCELERATE_MIXED_PRECISION, which Accelerator reads
        "mixed_precision": None if config.mixed_precision == "no" else config.mixed_precision,
        "gradient_accumulation_steps": config.grad_accum_steps,
        # the same shuffled order on every rank and after a resume: seed + epoch
        "dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        "project_config": ProjectConfiguration(project_dir=str(output_dir),
                                               logging_dir=str(output_dir / "tensorboard")),
    }
    if config.tensorboard:
        kw["log_with"] = "tensorboard"
    if config.compile:
        kw["dynamo_backend"] = "inductor"
    acc = gpu_lab_accelerator(**kw)
    without_tracker(acc)  # fit reports every rank itself: acc.log is TensorBoard's only
    return acc


def release_accelerator_state() -> None:
    """Forget accelerate's AcceleratorState singleton (not the process group). Also done when fit()
    returns: notebook_launcher refuses to start when a previous Accelerator left its state behind."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state:
        AcceleratorState._reset_state(reset_partial_state=False)


def powersgd_handler(total_steps: int):
    """DDP kwargs that register the PowerSGD hook (low-rank gradients: far less all-reduce traffic).

    PowerSGD runs plain all-reduce for its first `start_powerSGD_iter` iterations (the gradients
    are still large and noisy), then rank-1 compression with error feedback; here that warm-up is
    10% of the run, between 2 and 1000 iterations."""
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    start = max(2, min(1000, total_steps // 10))
    return DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD,
                                         comm_state_option={"matrix_approximation_rank": 1,
                                                            "start_powerSGD_iter": start})


def default_loss(outputs, targets):
    """Cross-entropy (mean over the micro-batch; accelerate divides by the accumulation steps)."""
    from torch.nn.functional import cross_entropy

    return cross_entropy(outputs, targets)


@dataclass(frozen=True)
class _Setup:
    """What fit() prepared once and the loop only reads: the prepared model, optimizer, scheduler
    and loaders, the callbacks, and the config's constants. An OOM retry replaces it with one of a
    smaller micro-batch (dataclasses.replace); nothing else changes it."""

    acc: Any
    model: Any
    optimizer: Any
    scheduler: Any
    cfg: Any
    cbs: CallbackList
    loss_fn: Callable
    train_data: Any              # what the caller gave: an OOM retry rebuilds the loader from it
    loader: Any
    per_rank: bool               # the loader yields this rank's batches already (shard_loader)
    eval_loader: Any
    pin: bool                    # pinned host memory for the loaders (a CUDA device)
    micro: int                   # per-device micro-batch
    accum: int                   # micro-batches per optimizer step
    total_steps: int
    sharding: str = "none"       # what the ranks really split: none | zero1 | fsdp
    fsdp_model: bool = False     # sharded by fully_shard, not prepared by accelerate (autocast here)


@dataclass
class _Progress:
    """The loop's own bookkeeping beside TrainState (which holds the step, epoch, data position and
    samples seen that the callbacks read); it survives an OOM retry, which restarts from a step
    boundary."""

    boundary_batch: int = 0      # data position (micro-batches in epoch) at the last step boundary
    pending_rng: Any = None      # RNG states to apply right before the first step after a resume
    steps_time: float = 0.0      # time inside optimizer steps (for the overall samples/s)
    timed_samples: int = 0       # samples over all ranks in those steps
    last_saved_step: int = -1
    last_eval_step: int = -1
    eval_metrics: dict = field(default_factory=dict)
    stopped: str | None = None
    oom_retries: int = 0


def fit(model, train_data, config, eval_data=None, callbacks: Iterable[Callback] = (), *,
        loss_fn: Callable | None = None, guards: bool = True) -> dict[str, Any]:
    """Train `model` on `train_data` as `config` (a TrainConfig or a dict) says; returns a summary.

    `train_data` / `eval_data`: a map-style Dataset (fit builds the DataLoader; needed for the
    OOM retry), an IterableDataset, or a DataLoader; batches are (inputs, targets) or dicts.
    `callbacks` run after the default guards (preemption, kernel control requests, memory
    threshold, NaN loss; `guards=False` leaves them out). Call it on every rank.

    The summary: steps, total_steps, epoch, loss, accuracy / eval_loss / eval_samples (with
    eval_data: every eval sample counted exactly once over all ranks; eval_samples says how many),
    samples_per_s, wall_s, checkpoint (the last one written), resumed_from, stopped (None, "stop"),
    num_processes, micro_batch_size, grad_accum_steps, global_batch, output_dir, profile_trace.
    Preemption raises Preempted (a SystemExit with code 143) after the checkpoint.
    """
    cfg = validate(config)
    t_start = time.perf_counter()
    out_dir = Path(cfg.output_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    acc = make_accelerator(cfg, out_dir)
    try:
        return _fit(acc, model, train_data, cfg, eval_data, callbacks, loss_fn or default_loss,
                    guards, out_dir, t_start)
    finally:
        _end_trackers(acc, cfg)
        release_accelerator_state()


def _fit(acc, model, train_data, cfg, eval_data, callbacks, loss_fn, guards, out_dir, t_start):
    """fit() once its Accelerator exists: prepare, resume, train, then evaluate and save last."""
    from accelerate.utils import set_seed

    set_seed(cfg.seed)
    setup = _prepare(acc, model, train_data, cfg, eval_data, callbacks, loss_fn, guards)
    state = TrainState(config=cfg, accelerator=acc, model=setup.model, optimizer=setup.optimizer,
                       scheduler=setup.scheduler, total_steps=setup.total_steps,
                       micro_batch_size=setup.micro, grad_accum_steps=setup.accum,
                       output_dir=out_dir, lr=setup.scheduler.get_last_lr()[0],
                       is_main_process=acc.is_main_process, rank=acc.process_index)
    progress = _Progress()
    resumed_from = _resume(setup, state, progress)
    if cfg.tensorboard:
        acc.init_trackers(os.environ.get("GPU_LAB_RUN_ID") or "run", config=_hparams(cfg))

    setup.cbs.call("on_fit_start", state)
    try:
        setup = _train_retrying_smaller(setup, state, progress)
        # --- the end: final evaluation and checkpoint ----------------------------------------------
        if setup.eval_loader is not None and progress.last_eval_step != state.step:
            _evaluate(setup, state, progress)
        if progress.last_saved_step != state.step:
            _save(setup, state, progress, "final")
    except BaseException as exc:
        if not isinstance(exc, Preempted):  # a preemption already ran on_fit_end
            setup.cbs.call("on_exception", state, exc)
        raise

    summary = _summary(setup, state, progress, t_start, resumed_from)
    setup.cbs.call("on_fit_end", state, summary)
    return summary


def _prepare(acc, model, train_data, cfg, eval_data, callbacks, loss_fn, guards) -> _Setup:
    """Model, optimizer, loaders and schedule, prepared by `acc`; the callbacks after the guards."""
    import torch

    world = acc.num_processes
    sharding = cfg.sharding if world > 1 else "none"
    if cfg.sharding != "none" and world == 1:
        _note(acc, f"sharding={cfg.sharding!r}: one rank has no other rank to split the model's "
                   "memory with; this run holds all of it, as without sharding (it shards from 2 "
                   "ranks on)" + ("; the offload to CPU memory still applies" if cfg.offload
                                  else ""))
    zero = sharding == "zero1"
    fsdp = cfg.sharding == "fsdp" and (world > 1 or cfg.offload)
    if cfg.activation_checkpointing:
        activation.enable(model)
    # on the device before the optimizer exists: ZeRO sizes its buckets on the parameters' device
    model = model.to(acc.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if fsdp:
        return _prepare_sharded(acc, model, train_data, cfg, eval_data, callbacks, loss_fn,
                                guards, sharding)
    optimizer = build_optimizer(model, cfg, zero=zero)
    pin = acc.device.type == "cuda"
    loader, per_rank, spe = _train_loader(acc, train_data, cfg, pin)
    if cfg.max_steps is None and spe is None:
        raise ValueError("TrainConfig.max_steps: the training data has no length (an iterable "
                         "pipeline), so epochs cannot be counted; set max_steps")
    total_steps = cfg.total_steps(spe)
    if cfg.powersgd and world > 1:
        acc.ddp_handler = powersgd_handler(total_steps)
    # accelerate round-trips an optimizer's state_dict to place it on the device; a ZeRO optimizer
    # only has a full state_dict after a consolidation (and its state is created on the device)
    model, optimizer = acc.prepare(model, optimizer, device_placement=[True, not zero])
    if zero:
        from ..rank.adopt import report_used

        report_used(acc, sharding="zero1")  # the run says what its ranks really shard
    return _finish_setup(acc, model, optimizer, loader, per_rank, cfg, eval_data, callbacks,
                         loss_fn, guards, pin, total_steps, sharding, train_data)


def _prepare_sharded(acc, model, train_data, cfg, eval_data, callbacks, loss_fn, guards,
                     sharding) -> _Setup:
    """FSDP (gpu_lab.train.sharding): the model sharded by torch's fully_shard, never wrapped
    in DDP by accelerate; the optimizer made over the shards and prepared alone."""
    from . import sharding as fsdp

    model = fsdp.shard(model, offload=cfg.offload)
    optimizer = acc.prepare_optimizer(build_optimizer(model, cfg), device_placement=False)
    pin = acc.device.type == "cuda"
    loader, per_rank, spe = _train_loader(acc, train_data, cfg, pin)
    if cfg.max_steps is None and spe is None:
        raise ValueError("TrainConfig.max_steps: the training data has no length (an iterable "
                         "pipeline), so epochs cannot be counted; set max_steps")
    from ..rank.adopt import report_used

    report_used(acc, sharding="fsdp2" if sharding == "fsdp" else "none")
    setup = _finish_setup(acc, model, optimizer, loader, per_rank, cfg, eval_data, callbacks,
                          loss_fn, guards, pin, cfg.total_steps(spe), sharding, train_data)
    return replace(setup, fsdp_model=True)


def _finish_setup(acc, model, optimizer, loader, per_rank, cfg, eval_data, callbacks, loss_fn,
                  guards, pin, total_steps, sharding, train_data) -> _Setup:
    """The evaluation loader, the schedule and the callbacks: the same whatever the sharding."""
    world = acc.num_processes
    eval_loader = None
    if eval_data is not None:  # this rank's share, never padded or resampled (see evaluation.py)
        eval_loader = eval_batches(eval_data, rank=acc.process_index, world=world,
                                   batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                                   seed=cfg.seed, pin_memory=pin)
        _batches_to(eval_loader, acc.device)
    scheduler = build_scheduler(getattr(optimizer, "optimizer", optimizer), cfg, total_steps)
    extra: list[Callback] = default_guards(cfg) if guards else []
    if cfg.profile_steps:
        extra.append(ProfilerWindow(cfg.profile_steps))
    return _Setup(acc=acc, model=model, optimizer=optimizer, scheduler=scheduler, cfg=cfg,
                  cbs=CallbackList([*extra, *callbacks]), loss_fn=loss_fn, train_data=train_data,
                  loader=loader, per_rank=per_rank, eval_loader=eval_loader, pin=pin,
                  micro=cfg.batch_size, accum=cfg.grad_accum_steps, total_steps=total_steps,
                  sharding=sharding)


def _note(acc, text: str) -> None:
    """A line in the run's notes (rank 0), and in the log where no run records it."""
    log.warning(text)
    if acc.is_main_process:
        get_reporter().log(text)


def _train_loader(acc, train_data, cfg, pin: bool) -> tuple[Any, bool, int | None]:
    """(this rank's training loader, whether it came per rank, steps per epoch or None)."""
    if is_per_rank(train_data):  # already this rank's batches: used as they are (moved to device)
        _batches_to(train_data, acc.device)
        n = micro_batches_per_epoch(train_data)
        spe = None if n is None else max(1, n // cfg.grad_accum_steps)  # full accumulations only
        return train_data, True, spe
    raw_loader = make_loader(train_data, cfg.batch_size, shuffle=True, num_workers=cfg.num_workers,
                             seed=cfg.seed, pin_memory=pin)
    loader = acc.prepare(raw_loader)  # sharded: each rank sees len(loader) micro-batches
    return loader, False, steps_per_epoch(micro_batches_per_epoch(loader), cfg.grad_accum_steps)


def _batches_to(loader, device) -> None:
    """A shard loader left on the CPU (device=None) sends its uint8 batches to the GPU and
    normalises them there: a quarter of the bytes over PCIe and no float pass on the CPU."""
    if device.type != "cpu" and hasattr(loader, "device") and loader.device is None:
        loader.device = device


def _resume(setup: _Setup, state: TrainState, progress: _Progress) -> str | None:
    """Restore a checkpoint into the prepared objects and the position; returns its path or None.

    From this output folder's newest complete checkpoint (resume: what a requeued batch job
    needs, and it is newer than any other), else on purpose (resume_from, set by launch(...,
    resume=...)). Either way the checkpoint's config must fit this one, checked before anything
    is loaded."""
    acc, cfg, ckpts = setup.acc, setup.cfg, checkpoint_dir(state.output_dir)
    info = _agreed_checkpoint(acc, lambda: latest_checkpoint(ckpts)) if cfg.resume else None
    if info is None and cfg.resume_from:
        info = _agreed_checkpoint(acc, lambda: find_checkpoint(cfg.resume_from))
    if info is None:
        return None
    check_compatible(info, cfg)
    restored = load_training_state(acc, setup.model, setup.optimizer, setup.scheduler, info)
    state.step = int(restored["step"])
    state.epoch = int(restored["epoch"])
    state.samples_seen = int(restored.get("samples_seen", 0))
    # the position is counted in micro-batches of the saved run's size
    saved_micro = int(restored.get("micro_batch_size", setup.micro))
    state.batch_in_epoch = int(restored["batch_in_epoch"]) * saved_micro // setup.micro
    progress.boundary_batch = state.batch_in_epoch
    progress.pending_rng = restored["rng"]
    progress.last_saved_step = state.step if Path(info.path).parent == ckpts \
        else -1  # a checkpoint in another run's folder: this run saves its own at the end
    state.last_checkpoint = info.path
    state.lr = _follow_config_schedule(setup.scheduler, cfg, state.total_steps)
    if acc.is_main_process:
        line = f"resuming from step {state.step} ({info.path})"
        print(line, flush=True)  # the terminal of a headless job, the rank's log under launch
        get_reporter().log(line)
    return str(info.path)


def _train_retrying_smaller(setup: _Setup, state: TrainState, progress: _Progress) -> _Setup:
    """_train; after an out-of-memory error, again from the last step boundary with a smaller
    micro-batch where the data can be re-batched. Returns the setup that finished."""
    cfg, world = setup.cfg, setup.acc.num_processes
    while True:
        try:
            _train(setup, state, progress)
            return setup
        except Exception as e:  # noqa: BLE001 - only OOM is handled; the rest is re-raised
            if not oom.is_oom(e):
                raise
            failure = oom.triage(cfg, step=state.step, micro_batch=setup.micro,
                                 accum=setup.accum, num_processes=world, error=e)
        # out of the except block: the traceback (and the tensors its frames hold) is gone
        oom.free_memory()
        smaller = oom.smaller_batch(setup.micro, setup.accum)
        rebuildable = not (_is_loader(setup.train_data) or setup.per_rank)
        if not (cfg.oom_retry and world == 1 and smaller and rebuildable):
            raise oom.TrainingOutOfMemoryError(failure)
        setup = _retry_smaller(setup, state, progress, smaller)


@dataclass
class _LogWindow:
    """The steps since the last report, which samples_per_s, step_time and data_wait average."""

    start: float
    steps: int = 0
    samples: int = 0
    wait: float = 0.0


def _train(setup: _Setup, state: TrainState, progress: _Progress) -> None:
    """Optimizer steps from the current position until total_steps, a stop, or an exception."""
    cfg, cbs, accum = setup.cfg, setup.cbs, setup.accum
    perf = time.perf_counter
    setup.model.train()
    window = _LogWindow(perf())
    while state.step < state.total_steps:
        batches, epoch_len = _epoch_batches(setup, state, progress)
        epoch_done = False
        while state.step < state.total_steps and not epoch_done:
            cbs.call("on_step_start", state)
            t0 = perf()
            done = _micro_batches(setup, batches)
            epoch_done = done.loader_ended
            if (epoch_len is not None and done.got == accum
                    and state.batch_in_epoch + done.got + accum > epoch_len):
                epoch_done = True  # what is left of this epoch cannot make a full step
            if done.got == 0:  # the epoch ended exactly at the last step boundary
                break
            if done.got < accum and setup.per_rank:
                # an epoch's leftover micro-batches: no optimizer step happened (accelerate syncs
                # at the end of the loaders it prepared, not of this one), drop their gradients
                getattr(setup.optimizer, "optimizer", setup.optimizer).zero_grad(set_to_none=True)
                break
            # --- an optimizer step is complete ----------------------------------------------------
            _count_step(setup, state, progress, window, done, t0, epoch_done)
            cbs.call("on_step_end", state)
            if state.step % cfg.log_every == 0 or state.step == state.total_steps:
                _report_window(setup, state, window, done.loss)
                if _act_on_requests(setup, state, progress):
                    return
            if (cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0
                    and progress.last_saved_step != state.step):
                _save(setup, state, progress, "periodic")
            if setup.eval_loader is not None and (
                    (cfg.eval_every and state.step % cfg.eval_every == 0)
                    or (not cfg.eval_every and epoch_done)):
                _evaluate(setup, state, progress)
                setup.model.train()
                window.start = perf()  # evaluation time is not training throughput
        if not epoch_done and state.step < state.total_steps:  # got == 0: next epoch
            state.epoch += 1
            state.batch_in_epoch = progress.boundary_batch = 0


def _epoch_batches(setup: _Setup, state: TrainState, progress: _Progress):
    """(an iterator over this epoch's micro-batches from the last step boundary on, the epoch's
    length in micro-batches for a per-rank loader or None)."""
    acc, loader = setup.acc, setup.loader
    # the shuffled order of an epoch depends only on (seed, epoch): resumable without a state
    loader.set_epoch(state.epoch)
    skip = progress.boundary_batch
    epoch_len = None
    if setup.per_rank:
        epoch_len = micro_batches_per_epoch(loader)  # may change with the epoch
        it = iter(loader)
        for _ in range(skip):  # no sampler to skip with: read past what was trained on
            next(it, None)
        acc.step = 0  # accelerate counts micro-batches itself to decide when to sync
    else:
        it = iter(acc.skip_first_batches(loader, skip) if skip else loader)
    state.batch_in_epoch = skip
    if progress.pending_rng is not None:
        # after the iterator exists: creating it must not shift the restored RNG streams
        set_rng_state(progress.pending_rng, acc.device)
        progress.pending_rng = None
    return it, epoch_len


class _MicroBatches(NamedTuple):
    """What one optimizer step's micro-batches did."""

    got: int                     # micro-batches run
    samples: int                 # on this rank
    wait: float                  # seconds waited for the data
    loss: Any                    # the last micro-batch's loss (a tensor)
    loader_ended: bool           # accelerate's end_of_dataloader (it syncs the gradients there)


def _micro_batches(setup: _Setup, batches) -> _MicroBatches:
    """Up to `accum` micro-batches through forward and backward, the optimizer stepping on the
    last (accelerate.accumulate decides)."""
    import torch
    from accelerate.utils import send_to_device

    acc, model, optimizer, loss_fn = setup.acc, setup.model, setup.optimizer, setup.loss_fn
    channels_last, max_norm = setup.cfg.channels_last, setup.cfg.max_grad_norm
    perf = time.perf_counter
    wait, got, samples, loss = 0.0, 0, 0, None
    for _ in range(setup.accum):
        tw = perf()
        try:
            batch = next(batches)
        except StopIteration:
            break
        wait += perf() - tw
        if setup.per_rank:
            batch = send_to_device(batch, acc.device, non_blocking=True)
        x, y = split_batch(batch)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with acc.accumulate(model):
            with acc.autocast() if setup.fsdp_model else contextlib.nullcontext():
                out = model(x)  # (a model accelerate prepared casts in its own forward)
            loss = loss_fn(out, y)
            acc.backward(loss)
            if acc.sync_gradients and max_norm is not None:
                acc.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        got += 1
        samples += len(y)
        if acc.gradient_state.end_of_dataloader:
            return _MicroBatches(got, samples, wait, loss, True)
    return _MicroBatches(got, samples, wait, loss, False)


def _count_step(setup: _Setup, state: TrainState, progress: _Progress, window: _LogWindow,
                done: _MicroBatches, t0: float, epoch_done: bool) -> None:
    """Step the schedule and move the position, the counters and the log window past one step."""
    setup.scheduler.step()
    dt = time.perf_counter() - t0
    state.step += 1
    state.loss = done.loss.detach()
    state.lr = setup.scheduler.get_last_lr()[0]
    n = done.samples * setup.acc.num_processes
    state.samples_seen += n
    progress.timed_samples += n
    progress.steps_time += dt
    if epoch_done:
        state.epoch += 1
        state.batch_in_epoch = 0
    else:
        state.batch_in_epoch += done.got
    progress.boundary_batch = state.batch_in_epoch
    window.steps += 1
    window.samples += n
    window.wait += done.wait


def _report_window(setup: _Setup, state: TrainState, window: _LogWindow, loss) -> None:
    """Report the loss and the log window's throughput, then start a new window."""
    now = time.perf_counter()
    span = max(now - window.start, 1e-9)
    metrics = {"loss": loss.item(),  # CPU-GPU sync point, once per log_every steps
               "lr": state.lr, "samples_per_s": window.samples / span,
               "step_time": span / window.steps, "data_wait": window.wait / window.steps,
               "epoch": state.epoch}
    window.start, window.steps, window.samples, window.wait = now, 0, 0, 0.0
    state.metrics.update(metrics)
    report(step=state.step, **metrics)
    if setup.cfg.tensorboard:
        setup.acc.log(metrics, step=state.step)
    setup.cbs.call("on_log", state, metrics)


def _act_on_requests(setup: _Setup, state: TrainState, progress: _Progress) -> bool:
    """Agree on the callbacks' requests across ranks and act; True when training must end."""
    acc, cbs, cfg = setup.acc, setup.cbs, setup.cfg
    agreed = _agree(acc, state.requests)
    state.requests.clear()
    if not agreed:
        return False
    if "nonfinite" in agreed:
        raise NonFiniteLossError(
            f"the loss is {state.metrics.get('loss')} at step {state.step} (lr {state.lr:.3g}); "
            f"stopped without saving, the last good checkpoint is {state.last_checkpoint}. Try a "
            f"lower lr, a longer warmup_ratio, max_grad_norm (now {cfg.max_grad_norm}), or bf16 "
            f"instead of fp16.")
    saving = [r for r in ("preempt", "memory", "stop", "checkpoint") if r in agreed]
    if saving:
        _save(setup, state, progress, "+".join(saving))
    if "preempt" in agreed:
        signum = next((cb.received for cb in cbs if isinstance(cb, PreemptionGuard)), None)
        summary = {"steps": state.step, "checkpoint": str(state.last_checkpoint),
                   "stopped": "preempt"}
        cbs.call("on_fit_end", state, summary)
        preempted = Preempted(state.step, str(state.last_checkpoint), signum)
        if acc.is_main_process:
            log.warning("%s", preempted)  # a SystemExit prints nothing by itself
            get_reporter().log(str(preempted))
            get_reporter().flush(1.0)
        raise preempted
    if "stop" in agreed:
        progress.stopped = "stop"
        return True
    return False


def _follow_config_schedule(scheduler, cfg, total_steps: int) -> float:
    """After a resume: the checkpoint gives the position (the step), this run's config gives the
    shape (peak lr, warmup, length), so a run resumed with a larger max_steps decays over the new
    length instead of the old one. With an unchanged config this recomputes the same numbers."""
    fn = Schedule.from_config(cfg, total_steps)
    groups = scheduler.optimizer.param_groups
    scheduler.lr_lambdas = [fn] * len(groups)
    scheduler.base_lrs = [cfg.lr] * len(groups)
    lrs = [base * fn(scheduler.last_epoch) for base in scheduler.base_lrs]
    for g, lr in zip(groups, lrs):
        g["initial_lr"], g["lr"] = cfg.lr, lr
    scheduler._last_lr = lrs
    return lrs[0]


def _agree(acc, requests: set) -> set:
    """The union of every rank's requests (one tiny all-reduce MAX; nothing on one process)."""
    if acc.num_processes == 1:
        return set(requests)
    import torch
    import torch.distributed as dist

    flags = torch.tensor([1 if r in requests else 0 for r in REQUESTS], dtype=torch.int32,
                         device=acc.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return {r for r, f in zip(REQUESTS, flags.tolist()) if f}


def _agreed_checkpoint(acc, find: Callable):
    """Rank 0 finds the checkpoint (`find()`: a CheckpointInfo or None); every rank gets the same
    answer, or the same error."""
    if acc.num_processes == 1:
        return find()
    import torch.distributed as dist

    info, box = None, [None]
    if acc.is_main_process:
        try:
            info = find()
            box = [str(info.path) if info is not None else None]
        except Exception as e:  # noqa: BLE001 - handed to every rank, raised everywhere
            box = [f"!{type(e).__name__}: {e}"]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str) and box[0].startswith("!"):
        raise CheckpointError(box[0][1:])
    if box[0] is None:
        return None
    if info is None:
        from .checkpoint import CheckpointInfo, read_manifest

        p = Path(box[0])
        info = CheckpointInfo(path=p, step=int(p.name.split("_")[1]), manifest=read_manifest(p))
    return info


def _save(setup: _Setup, state: TrainState, progress: _Progress, reason: str) -> None:
    acc, cfg = setup.acc, setup.cfg
    if progress.last_saved_step != state.step:
        trainer_state = {"step": state.step, "epoch": state.epoch,
                         "batch_in_epoch": state.batch_in_epoch, "samples_seen": state.samples_seen,
                         "micro_batch_size": setup.micro, "grad_accum_steps": setup.accum,
                         "num_processes": acc.num_processes, "reason": reason,
                         "config": cfg.to_dict(), "time": time.time()}
        path = save_training_state(acc, setup.model, setup.optimizer, setup.scheduler,
                                   root=checkpoint_dir(state.output_dir), step=state.step,
                                   trainer_state=trainer_state, keep_last=cfg.keep_last)
        progress.last_saved_step = state.step
        state.last_checkpoint = path
        if acc.is_main_process:
            get_reporter().log(f"checkpoint step {state.step} ({reason}): {path}")
    setup.cbs.call("on_checkpoint", state, state.last_checkpoint, reason)


def _evaluate(setup: _Setup, state: TrainState, progress: _Progress) -> dict:
    """Accuracy and mean loss over the whole eval set, every sample exactly once over all ranks
    (evaluation.evaluate), and how many samples that was (eval_samples)."""
    acc, loss_fn = setup.acc, setup.loss_fn
    module = acc.unwrap_model(setup.model, keep_torch_compile=False)  # no DDP collectives per batch
    metrics = evaluate(module, setup.eval_loader, None if loss_fn is default_loss else loss_fn,
                       device=acc.device, world=acc.num_processes,
                       channels_last=state.config.channels_last)
    if not metrics["eval_samples"]:
        log.warning("evaluation at step %d saw no samples: the eval data is empty (or every sample "
                    "was skipped by the loader's error policy)", state.step)
    progress.eval_metrics = metrics
    progress.last_eval_step = state.step
    state.metrics.update(metrics)
    report(step=state.step, **metrics)
    if state.config.tensorboard:  # the curves; the sample count is in the stream and the summary
        acc.log({k: v for k, v in metrics.items() if k != "eval_samples"}, step=state.step)
    setup.cbs.call("on_eval_end", state, metrics)
    return metrics


def _retry_smaller(setup: _Setup, state: TrainState, progress: _Progress,
                   smaller: tuple[int, int]) -> _Setup:
    """The setup to continue from the last step boundary with: a smaller per-device batch and more
    accumulation (the global batch, and so the training math, unchanged)."""
    acc, cfg = setup.acc, setup.cfg
    micro, accum = smaller
    # drop the half-accumulated gradients of the failed step
    setup.optimizer.zero_grad(set_to_none=True)
    position = progress.boundary_batch * setup.micro  # samples into the epoch, per rank
    msg = (f"out of memory with a per-device batch of {setup.micro}: retrying from step "
           f"{state.step} with batch {micro} × {accum} accumulation (same global batch)")
    log.warning(msg)
    if acc.is_main_process:
        get_reporter().log(msg)
    progress.boundary_batch = position // micro
    progress.oom_retries += 1
    state.micro_batch_size, state.grad_accum_steps = micro, accum
    acc.gradient_accumulation_steps = accum
    acc.step = 0
    loader = acc.prepare(make_loader(setup.train_data, micro, shuffle=True,
                                     num_workers=cfg.num_workers, seed=cfg.seed,
                                     pin_memory=setup.pin))
    return replace(setup, micro=micro, accum=accum, loader=loader)


def _summary(setup: _Setup, state: TrainState, progress: _Progress, t_start: float,
             resumed_from: str | None) -> dict:
    cfg, world, evals = setup.cfg, setup.acc.num_processes, progress.eval_metrics
    return {
        "steps": state.step, "total_steps": state.total_steps, "epoch": state.epoch,
        "loss": state.metrics.get("loss"), "accuracy": evals.get("accuracy"),
        "eval_loss": evals.get("eval_loss"), "eval_samples": evals.get("eval_samples"),
        "samples_per_s": (progress.timed_samples / progress.steps_time
                          if progress.steps_time else None),
        "wall_s": time.perf_counter() - t_start,
        "checkpoint": str(state.last_checkpoint) if state.last_checkpoint else None,
        "resumed_from": resumed_from, "stopped": progress.stopped, "num_processes": world,
        "micro_batch_size": setup.micro, "grad_accum_steps": setup.accum,
        "global_batch": setup.micro * setup.accum * world, "oom_retries": progress.oom_retries,
        "mixed_precision": str(setup.acc.mixed_precision), "output_dir": str(Path(cfg.output_dir)),
        "sharding": setup.sharding, **_memory_split(setup),
    }


def _memory_split(setup: _Setup) -> dict:
    """What this rank (rank 0's summary) holds of the model: its parameters' and optimizer
    state's bytes; with sharding, about 1/N of an unsharded run's."""
    from .sharding import local_bytes, optimizer_bytes

    model = setup.acc.unwrap_model(setup.model, keep_torch_compile=False)
    return {"rank_param_bytes": local_bytes(model.parameters()),
            "rank_optimizer_bytes": optimizer_bytes(setup.optimizer)}


def _is_loader(data) -> bool:
    from .data import is_loader

    return is_loader(data)


def _hparams(cfg) -> dict:
    # TensorBoard's hparams accept numbers, strings and bools only
    return {k: ("" if v is None else v) for k, v in cfg.to_dict().items()}


def _end_trackers(acc, cfg) -> None:
    # not acc.end_training(): that also destroys the process group, which belongs to the caller
    if cfg.tensorboard and acc.is_main_process:
        for tracker in acc.trackers:
            tracker.finish()


__all__ = ["fit", "make_accelerator", "default_loss"]
