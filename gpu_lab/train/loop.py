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
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

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

    # accelerate keeps precision and the torch.compile plugin in a process-wide singleton that a
    # second Accelerator silently reuses (or refuses to change): each fit() starts from a clean one.
    # The process group (PartialState) is kept.
    release_accelerator_state()
    kw: dict[str, Any] = {
        "mixed_precision": config.mixed_precision,
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
    return gpu_lab_accelerator(**kw)


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


@dataclass
class _Loop:
    """Everything the loop's steps share: what fit() built (the prepared model, optimizer, ...)
    and the loop's own state, which survives an OOM retry (what a restart from a step boundary
    needs). TrainState is the part the callbacks see."""

    acc: Any = None
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    state: TrainState | None = None
    cbs: CallbackList | None = None
    cfg: Any = None
    loss_fn: Callable | None = None
    eval_loader: Any = None
    train_data: Any = None
    pin: bool = False
    loader: Any = None
    per_rank: bool = False       # the loader yields this rank's batches already (shard_loader)
    micro: int = 0
    accum: int = 1
    boundary_batch: int = 0      # data position (micro-batches in epoch) at the last step boundary
    pending_rng: Any = None      # RNG states to apply right before the first step after a resume
    steps_time: float = 0.0      # time inside optimizer steps (for the overall samples/s)
    run_samples: int = 0
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
    import torch
    from accelerate.utils import set_seed

    set_seed(cfg.seed)
    world = acc.num_processes
    zero = cfg.zero and world > 1
    if cfg.zero and not zero:
        log.warning("zero=True ignored: one process has no optimizer state to shard with others")

    # --- model, optimizer, data ------------------------------------------------------------------
    if cfg.activation_checkpointing:
        activation.enable(model)
    # on the device before the optimizer exists: ZeRO sizes its buckets on the parameters' device
    model = model.to(acc.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, cfg, zero=zero)
    lp = _Loop(micro=cfg.batch_size, accum=cfg.grad_accum_steps)
    pin = acc.device.type == "cuda"
    lp.per_rank = is_per_rank(train_data)
    if lp.per_rank:  # already this rank's batches: used as they are (batches moved to the device)
        lp.loader = train_data
        _batches_to(lp.loader, acc.device)
        n = micro_batches_per_epoch(lp.loader)
        spe = None if n is None else max(1, n // lp.accum)  # only full accumulations step
    else:
        raw_loader = make_loader(train_data, lp.micro, shuffle=True, num_workers=cfg.num_workers,
                                 seed=cfg.seed, pin_memory=pin)
        lp.loader = acc.prepare(raw_loader)  # sharded: each rank sees len(lp.loader) micro-batches
        spe = steps_per_epoch(micro_batches_per_epoch(lp.loader), lp.accum)
    if cfg.max_steps is None and spe is None:
        raise ValueError("TrainConfig.max_steps: the training data has no length (an iterable "
                         "pipeline), so epochs cannot be counted; set max_steps")
    total_steps = cfg.total_steps(spe)
    if cfg.powersgd and world > 1:
        acc.ddp_handler = powersgd_handler(total_steps)
    # accelerate round-trips an optimizer's state_dict to place it on the device; a ZeRO optimizer
    # only has a full state_dict after a consolidation (and its state is created on the device)
    model, optimizer = acc.prepare(model, optimizer, device_placement=[True, not zero])
    eval_loader = None
    if eval_data is not None:  # this rank's share, never padded or resampled (see evaluation.py)
        eval_loader = eval_batches(eval_data, rank=acc.process_index, world=world,
                                   batch_size=lp.micro, num_workers=cfg.num_workers,
                                   seed=cfg.seed, pin_memory=pin)
        _batches_to(eval_loader, acc.device)
    scheduler = build_scheduler(getattr(optimizer, "optimizer", optimizer), cfg, total_steps)

    state = TrainState(config=cfg, accelerator=acc, model=model, optimizer=optimizer,
                       scheduler=scheduler, total_steps=total_steps, micro_batch_size=lp.micro,
                       grad_accum_steps=lp.accum, output_dir=out_dir,
                       lr=scheduler.get_last_lr()[0], is_main_process=acc.is_main_process,
                       rank=acc.process_index)
    extra: list[Callback] = default_guards(cfg) if guards else []
    if cfg.profile_steps:
        extra.append(ProfilerWindow(cfg.profile_steps))
    cbs = CallbackList([*extra, *callbacks])
    lp.acc, lp.model, lp.optimizer, lp.scheduler, lp.state, lp.cbs = (acc, model, optimizer,
                                                                      scheduler, state, cbs)
    lp.cfg, lp.loss_fn, lp.eval_loader, lp.train_data, lp.pin = (cfg, loss_fn, eval_loader,
                                                                 train_data, pin)

    # --- resume ------------------------------------------------------------------------------------
    # On purpose (resume_from, set by launch(..., resume=...)), or from this output folder's newest
    # complete checkpoint (resume: what a requeued batch job needs). Either way the checkpoint's
    # config must fit this one, checked before anything is loaded.
    resumed_from = None
    if cfg.resume_from:
        info = _agreed_checkpoint(acc, lambda: find_checkpoint(cfg.resume_from))
    elif cfg.resume:
        info = _agreed_checkpoint(acc, lambda: latest_checkpoint(checkpoint_dir(out_dir)))
    else:
        info = None
    if info is not None:
        check_compatible(info, cfg)
        restored = load_training_state(acc, model, optimizer, scheduler, info)
        state.step = int(restored["step"])
        state.epoch = int(restored["epoch"])
        state.samples_seen = int(restored.get("samples_seen", 0))
        # the position is counted in micro-batches of the saved run's size
        saved_micro = int(restored.get("micro_batch_size", lp.micro))
        state.batch_in_epoch = int(restored["batch_in_epoch"]) * saved_micro // lp.micro
        lp.boundary_batch = state.batch_in_epoch
        lp.pending_rng = restored["rng"]
        lp.last_saved_step = state.step if Path(info.path).parent == checkpoint_dir(out_dir) \
            else -1  # a checkpoint in another run's folder: this run saves its own at the end
        state.last_checkpoint = info.path
        state.lr = _follow_config_schedule(scheduler, cfg, total_steps)
        resumed_from = str(info.path)
        if acc.is_main_process:
            line = f"resuming from step {state.step} ({info.path})"
            print(line, flush=True)  # the terminal of a headless job, the rank's log under launch
            get_reporter().log(line)

    if cfg.tensorboard:
        acc.init_trackers(os.environ.get("GPU_LAB_RUN_ID") or "run", config=_hparams(cfg))

    # --- train -------------------------------------------------------------------------------------
    cbs.call("on_fit_start", state)
    try:
        while True:
            failure = None
            try:
                _train(lp)
                break
            except Exception as e:  # noqa: BLE001 - only OOM is handled; the rest is re-raised
                if not oom.is_oom(e):
                    raise
                failure = oom.triage(cfg, step=state.step, micro_batch=lp.micro,
                                     accum=lp.accum, num_processes=world, error=e)
            # out of the except block: the traceback (and the tensors its frames hold) is gone
            oom.free_memory()
            smaller = oom.smaller_batch(lp.micro, lp.accum)
            rebuildable = not (_is_loader(train_data) or lp.per_rank)
            if not (cfg.oom_retry and world == 1 and smaller and rebuildable):
                raise oom.TrainingOutOfMemoryError(failure)
            _retry_smaller(lp, smaller)

        # --- the end: final evaluation and checkpoint ----------------------------------------------
        if eval_loader is not None and lp.last_eval_step != state.step:
            _evaluate(lp)
        if lp.last_saved_step != state.step:
            _save(lp, "final")
    except BaseException as exc:
        if not isinstance(exc, Preempted):  # a preemption already ran on_fit_end
            cbs.call("on_exception", state, exc)
        raise

    summary = _summary(lp, t_start, resumed_from)
    cbs.call("on_fit_end", state, summary)
    return summary


def _batches_to(loader, device) -> None:
    """A shard loader left on the CPU (device=None) sends its uint8 batches to the GPU and
    normalises them there: a quarter of the bytes over PCIe and no float pass on the CPU."""
    if device.type != "cpu" and hasattr(loader, "device") and loader.device is None:
        loader.device = device


def _train(lp: _Loop) -> None:
    """Optimizer steps from the current position until total_steps, a stop, or an exception."""
    import torch
    from accelerate.utils import send_to_device

    acc, model, optimizer, scheduler, state, cbs, cfg = (lp.acc, lp.model, lp.optimizer,
                                                         lp.scheduler, lp.state, lp.cbs, lp.cfg)
    loss_fn, eval_loader, run = lp.loss_fn, lp.eval_loader, lp

    world = acc.num_processes
    channels_last = cfg.channels_last
    max_norm = cfg.max_grad_norm
    log_every = cfg.log_every
    ckpt_every = cfg.checkpoint_every
    eval_every = cfg.eval_every
    perf = time.perf_counter
    gradient_state = acc.gradient_state
    model.train()
    t_log = perf()
    log_steps = log_samples = 0
    log_wait = 0.0
    loss = None

    while state.step < state.total_steps:
        # the shuffled order of an epoch depends only on (seed, epoch): resumable without a state
        run.loader.set_epoch(state.epoch)
        skip = run.boundary_batch
        per_rank_len = None
        if run.per_rank:
            per_rank_len = micro_batches_per_epoch(run.loader)  # may change with the epoch
            it = iter(run.loader)
            for _ in range(skip):  # no sampler to skip with: read past what was trained on
                next(it, None)
            acc.step = 0  # accelerate counts micro-batches itself to decide when to sync
        else:
            it = iter(acc.skip_first_batches(run.loader, skip) if skip else run.loader)
        state.batch_in_epoch = skip
        if run.pending_rng is not None:
            # after the iterator exists: creating it must not shift the restored RNG streams
            set_rng_state(run.pending_rng, acc.device)
            run.pending_rng = None
        epoch_done = False
        while state.step < state.total_steps and not epoch_done:
            cbs.call("on_step_start", state)
            t0 = perf()
            wait = 0.0
            got = samples = 0
            for _ in range(run.accum):
                tw = perf()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                wait += perf() - tw
                if run.per_rank:
                    batch = send_to_device(batch, acc.device, non_blocking=True)
                x, y = split_batch(batch)
                if channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                with acc.accumulate(model):
                    out = model(x)
                    loss = loss_fn(out, y)
                    acc.backward(loss)
                    if acc.sync_gradients and max_norm is not None:
                        acc.clip_grad_norm_(model.parameters(), max_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                got += 1
                samples += len(y)
                if gradient_state.end_of_dataloader:
                    epoch_done = True
                    break
            if (per_rank_len is not None and got == run.accum
                    and state.batch_in_epoch + got + run.accum > per_rank_len):
                epoch_done = True  # what is left of this epoch cannot make a full step
            if got == 0:  # the epoch ended exactly at the last step boundary
                break
            if got < run.accum and run.per_rank:
                # an epoch's leftover micro-batches: no optimizer step happened (accelerate syncs
                # at the end of the loaders it prepared, not of this one), drop their gradients
                getattr(optimizer, "optimizer", optimizer).zero_grad(set_to_none=True)
                break
            # --- an optimizer step is complete ----------------------------------------------------
            scheduler.step()
            dt = perf() - t0
            state.step += 1
            state.loss = loss.detach()
            state.lr = scheduler.get_last_lr()[0]
            n = samples * world
            state.samples_seen += n
            run.run_samples += n
            run.steps_time += dt
            if epoch_done:
                state.epoch += 1
                state.batch_in_epoch = 0
            else:
                state.batch_in_epoch += got
            run.boundary_batch = state.batch_in_epoch
            log_steps += 1
            log_samples += n
            log_wait += wait
            cbs.call("on_step_end", state)

            if state.step % log_every == 0 or state.step == state.total_steps:
                now = perf()
                span = max(now - t_log, 1e-9)
                metrics = {"loss": loss.item(),  # CPU-GPU sync point, once per log_every steps
                           "lr": state.lr, "samples_per_s": log_samples / span,
                           "step_time": span / log_steps, "data_wait": log_wait / log_steps,
                           "epoch": state.epoch}
                t_log, log_steps, log_samples, log_wait = now, 0, 0, 0.0
                state.metrics.update(metrics)
                report(step=state.step, **metrics)
                if cfg.tensorboard:
                    acc.log(metrics, step=state.step)
                cbs.call("on_log", state, metrics)
                if _act_on_requests(lp):
                    return

            if ckpt_every and state.step % ckpt_every == 0 and run.last_saved_step != state.step:
                _save(lp, "periodic")
            if eval_loader is not None and (
                    (eval_every and state.step % eval_every == 0) or (not eval_every and epoch_done)):
                _evaluate(lp)
                model.train()
                t_log = perf()  # evaluation time is not training throughput
        if not epoch_done and state.step < state.total_steps:  # got == 0: next epoch
            state.epoch += 1
            state.batch_in_epoch = run.boundary_batch = 0


def _act_on_requests(lp: _Loop) -> bool:
    """Agree on the callbacks' requests across ranks and act; True when training must end."""
    acc, state, cbs, cfg = lp.acc, lp.state, lp.cbs, lp.cfg
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
        _save(lp, "+".join(saving))
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
        lp.stopped = "stop"
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


def _save(lp: _Loop, reason: str) -> None:
    acc, state, cfg, run = lp.acc, lp.state, lp.cfg, lp
    if run.last_saved_step != state.step:
        trainer_state = {"step": state.step, "epoch": state.epoch,
                         "batch_in_epoch": state.batch_in_epoch, "samples_seen": state.samples_seen,
                         "micro_batch_size": run.micro, "grad_accum_steps": run.accum,
                         "num_processes": acc.num_processes, "reason": reason,
                         "config": cfg.to_dict(), "time": time.time()}
        path = save_training_state(acc, lp.model, lp.optimizer, lp.scheduler,
                                   root=checkpoint_dir(state.output_dir), step=state.step,
                                   trainer_state=trainer_state, keep_last=cfg.keep_last)
        run.last_saved_step = state.step
        state.last_checkpoint = path
        if acc.is_main_process:
            get_reporter().log(f"checkpoint step {state.step} ({reason}): {path}")
    lp.cbs.call("on_checkpoint", state, state.last_checkpoint, reason)


def _evaluate(lp: _Loop) -> dict:
    """Accuracy and mean loss over the whole eval set, every sample exactly once over all ranks
    (evaluation.evaluate), and how many samples that was (eval_samples)."""
    acc, model, loader, loss_fn, state, cbs = (lp.acc, lp.model, lp.eval_loader, lp.loss_fn,
                                               lp.state, lp.cbs)
    module = acc.unwrap_model(model, keep_torch_compile=False)  # no DDP collectives per batch
    metrics = evaluate(module, loader, None if loss_fn is default_loss else loss_fn,
                       device=acc.device, world=acc.num_processes,
                       channels_last=state.config.channels_last)
    if not metrics["eval_samples"]:
        log.warning("evaluation at step %d saw no samples: the eval data is empty (or every sample "
                    "was skipped by the loader's error policy)", state.step)
    lp.eval_metrics = metrics
    lp.last_eval_step = state.step
    state.metrics.update(metrics)
    report(step=state.step, **metrics)
    if state.config.tensorboard:  # the curves; the sample count is in the stream and the summary
        acc.log({k: v for k, v in metrics.items() if k != "eval_samples"}, step=state.step)
    cbs.call("on_eval_end", state, metrics)
    return metrics


def _retry_smaller(lp: _Loop, smaller: tuple[int, int]) -> None:
    """Continue from the last step boundary with a smaller per-device batch and more accumulation
    (the global batch, and so the training math, unchanged)."""
    acc, optimizer, state, cfg, run = lp.acc, lp.optimizer, lp.state, lp.cfg, lp
    micro, accum = smaller
    optimizer.zero_grad(set_to_none=True)  # drop the half-accumulated gradients of the failed step
    position = run.boundary_batch * run.micro  # samples into the epoch, per rank
    msg = (f"out of memory with a per-device batch of {run.micro}: retrying from step {state.step} "
           f"with batch {micro} × {accum} accumulation (same global batch)")
    log.warning(msg)
    if acc.is_main_process:
        get_reporter().log(msg)
    run.micro, run.accum = micro, accum
    run.boundary_batch = position // micro
    run.oom_retries += 1
    state.micro_batch_size, state.grad_accum_steps = micro, accum
    acc.gradient_accumulation_steps = accum
    acc.step = 0
    run.loader = acc.prepare(make_loader(lp.train_data, micro, shuffle=True,
                                         num_workers=cfg.num_workers, seed=cfg.seed,
                                         pin_memory=lp.pin))


def _summary(lp: _Loop, t_start: float, resumed_from: str | None) -> dict:
    cfg, state, run, world = lp.cfg, lp.state, lp, lp.acc.num_processes
    loss = state.metrics.get("loss")
    return {
        "steps": state.step, "total_steps": state.total_steps, "epoch": state.epoch,
        "loss": loss, "accuracy": run.eval_metrics.get("accuracy"),
        "eval_loss": run.eval_metrics.get("eval_loss"),
        "eval_samples": run.eval_metrics.get("eval_samples"),
        "samples_per_s": run.run_samples / run.steps_time if run.steps_time else None,
        "wall_s": time.perf_counter() - t_start,
        "checkpoint": str(state.last_checkpoint) if state.last_checkpoint else None,
        "resumed_from": resumed_from, "stopped": run.stopped, "num_processes": world,
        "micro_batch_size": run.micro, "grad_accum_steps": run.accum,
        "global_batch": run.micro * run.accum * world, "oom_retries": run.oom_retries,
        "mixed_precision": cfg.mixed_precision, "output_dir": str(Path(cfg.output_dir)),
    }


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
