"""What a failure's message means, and what to try, cheapest first, with its exact numbers.

For the failures people meet most, the triage carries the numbers: out of memory (requested, free
and total memory, the batch size), communication timeouts (the collective, its timeout, how long it
ran), data errors (the shard, the sample) and storage errors (the checkpoint, its folder, the bytes
it needed and found free). The `parse_*` functions find them in a message; `*_suggestions` and
`*_report` build the advice from numbers (the out-of-memory advice in gpu_lab.failures.oom);
`explain` fills a RankFailure (gpu_lab.failures.kinds) from its message, its traceback and what
the training code `note()`d, inside the failing rank.
"""
from __future__ import annotations

import os
import re

from .frameworks import world_suggestions
from .kinds import COMM, DATA, NODE, OOM, SIGNAL, STORAGE, USER, RankFailure
from .oom import oom_sentence, oom_suggestions
from ..units import fmt_bytes, parse_size

_context: dict = {}


def note(**facts) -> None:
    """Tell the triage what only the training code knows, in the rank, before the step that may
    fail: batch_size, grad_accum_steps, num_processes, model, image_size, mixed_precision,
    activation_checkpointing, zero. A value of None forgets the fact. Costs a dict update."""
    for key, value in facts.items():
        if value is None:
            _context.pop(key, None)
        else:
            _context[key] = value


def noted() -> dict:
    """What `note()` recorded in this process."""
    return dict(_context)


_SIZE = r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(bytes|byte|[KMGT]i?B|B)\b"


def _size_after(pattern: str, text: str) -> int | None:
    m = re.search(pattern + _SIZE, text, flags=re.IGNORECASE)
    return parse_size(f"{m.group(1)} {m.group(2)}") if m else None


def parse_oom(text: str) -> dict:
    """The numbers in an out-of-memory message: CUDA's caching allocator, the CPU allocator, or
    gpu_lab's TrainingOutOfMemoryError. Keys present only where the text has them."""
    d: dict = {}
    req = _size_after(r"Tried to allocate\s+", text)
    if req is None:
        m = re.search(r"you tried to allocate (\d+) bytes", text)
        if m:
            req, d["device"] = int(m.group(1)), "CPU"
    if req is not None:
        d["requested_bytes"] = req
    m = re.search(r"GPU (\d+) has a total capac\w* of " + _SIZE + r" of which " + _SIZE + " is free",
                  text, flags=re.IGNORECASE)
    if m:
        d["device"] = f"GPU {m.group(1)}"
        d["total_bytes"] = parse_size(f"{m.group(2)} {m.group(3)}")
        d["free_bytes"] = parse_size(f"{m.group(4)} {m.group(5)}")
    alloc = _size_after(r"Of the allocated memory\s+", text)
    if alloc is not None:
        d["allocated_bytes"] = alloc
    cached = re.search(_SIZE + r" is reserved by PyTorch but unallocated", text, flags=re.IGNORECASE)
    if cached:
        d["reserved_unallocated_bytes"] = parse_size(f"{cached.group(1)} {cached.group(2)}")
    m = re.search(r"per-device batch of (\d+)", text)  # gpu_lab.train's TrainingOutOfMemoryError
    if m:
        d["batch_size"], d["batch_size_source"] = int(m.group(1)), "the fit loop"
    return d


def _batch_from_frames(exc: BaseException | None) -> tuple[int, str] | None:
    """The batch size where the code that failed held it: a local `batch_size`, else the first
    dimension of an input tensor (x, inputs, images, batch, ...), innermost user frame first."""
    if exc is None:
        return None
    frames = []
    t = exc.__traceback__
    while t is not None:
        frames.append(t.tb_frame)
        t = t.tb_next
    user = [f for f in reversed(frames)
            if "site-packages" not in f.f_code.co_filename
            and f"{os.sep}gpu_lab{os.sep}launch{os.sep}" not in f.f_code.co_filename]
    for f in user:
        v = f.f_locals.get("batch_size")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, f"local batch_size in {f.f_code.co_name}()"
    for f in user:
        for name in ("x", "xb", "inputs", "input", "images", "imgs", "batch"):
            v = f.f_locals.get(name)
            if isinstance(v, (tuple, list)) and v:
                v = v[0]
            shape = getattr(v, "shape", None)
            if shape is not None and len(shape) >= 2 and int(shape[0]) > 0:
                return int(shape[0]), f"{name}.shape[0] in {f.f_code.co_name}()"
    return None


def _memory_now(device: str | None) -> dict:
    """Free and total memory at failure time, asked in the failing rank itself."""
    import sys

    if device and device.startswith("GPU"):
        torch = sys.modules.get("torch")
        # only where this rank already uses CUDA: never initialise it here
        if torch is not None and torch.cuda.is_initialized():
            try:
                free, total = torch.cuda.mem_get_info()
                return {"free_bytes": int(free), "total_bytes": int(total)}
            except RuntimeError:
                return {}
        return {}
    cap = _context.get("memory_cap_bytes")
    if cap:
        used = int(_context.get("memory_cap_used_bytes", 0))
        out = {"total_bytes": int(cap), "free_bytes": max(0, int(cap) - used), "memory_cap": True}
        if _context.get("memory_cap_op"):
            out["operation"] = _context["memory_cap_op"]
        return out
    try:
        import psutil

        vm = psutil.virtual_memory()
        return {"free_bytes": int(vm.available), "total_bytes": int(vm.total)}
    except (ImportError, OSError):
        return {}


_C10D_FRAME = re.compile(r'distributed_c10d\.py", line \d+, in (\w+)')


def parse_comm(text: str) -> dict:
    """The collective, its timeout and how long it ran, from NCCL's watchdog message, gloo's
    timeout message and the traceback (the torch.distributed function that was waiting)."""
    d: dict = {}
    m = re.search(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+)(?:, NumelIn=(\d+))?.*?Timeout\(ms\)=(\d+)\)"
                  r"(?: ran for (\d+) milliseconds)?", text, flags=re.S)
    if m:
        d["backend"] = "nccl"
        d["seq"] = int(m.group(1))
        d["collective"] = m.group(2).lower()
        if m.group(3):
            d["numel"] = int(m.group(3))
        d["timeout_s"] = int(m.group(4)) / 1000
        if m.group(5):
            d["elapsed_s"] = int(m.group(5)) / 1000
    m = re.search(r"Timed out waiting (\d+)\s*ms for (\w+) operation", text)
    if m:
        d.setdefault("backend", "gloo")
        d["timeout_s"] = int(m.group(1)) / 1000
        d["transport_op"] = m.group(2)
    frames = _C10D_FRAME.findall(text)
    public = [f for f in frames if not f.startswith("_") and f not in ("wrapper", "wait")]
    if public and "collective" not in d:
        d["collective"] = public[-1]
    if re.search(r"Connection (reset|closed) by peer|Broken pipe", text):
        d["peer_lost"] = True
    if "backend" not in d:
        if "NCCL" in text:
            d["backend"] = "nccl"
        elif "gloo" in text.lower():
            d["backend"] = "gloo"
    return d


def comm_suggestions(collective: str | None = None, timeout_s: float | None = None, *,
                     peer_lost: bool = False, backend: str | None = None) -> list[str]:
    op = collective or "the collective"
    out = []
    if peer_lost:
        out.append("a peer rank went away mid-collective: its own error (above, or in its log) is "
                   "the cause; this rank only saw the connection drop")
    out.append(f"read the other ranks' errors and logs first: a rank that crashed, or sits in a "
               f"slow step the others skip (rank-0-only evaluation or checkpoint writing), never "
               f"reaches {op}")
    out.append("give every rank the same number of steps: uneven batches per rank leave one rank "
               "waiting in a collective the others never call (resampled shards with with_epoch)")
    out.append("rerun with " + ("NCCL_DEBUG=INFO and " if backend != "gloo" else "")
               + "TORCH_DISTRIBUTED_DEBUG=DETAIL: each rank logs the collectives it calls, so the "
               "odd one out shows")
    out.append("measure the links: `gpu-lab bench allreduce` (busbw far below the hardware's "
               "means a slow path: PCIe instead of NVLink, TCP instead of InfiniBand)")
    if timeout_s is not None:
        out.append(f"only when one rank is legitimately slow: raise the timeout above "
                   f"{timeout_s:g} s, e.g. accelerate's InitProcessGroupKwargs(timeout="
                   f"timedelta(seconds={int(max(2 * timeout_s, 60))}))")
    else:
        out.append("only when one rank is legitimately slow: raise the collective timeout "
                   "(accelerate's InitProcessGroupKwargs(timeout=...))")
    return out


def comm_report(collective: str | None, timeout_s: float | None, *,
                elapsed_s: float | None = None, backend: str | None = None,
                numel: int | None = None, peer_lost: bool = False, rank: int | None = None) -> str:
    """The communication triage as text: the collective and its timeout, then what to try."""
    head = _comm_sentence(collective, timeout_s, elapsed_s, backend, numel, peer_lost, rank)
    tips = comm_suggestions(collective, timeout_s, peer_lost=peer_lost, backend=backend)
    return "\n".join([head, "What to try, cheapest first:"]
                     + [f"  {i}. {s}" for i, s in enumerate(tips, 1)])


def _comm_sentence(collective, timeout_s, elapsed_s=None, backend=None, numel=None,
                   peer_lost=False, rank=None) -> str:
    who = f"rank {rank}" if rank is not None else "a rank"
    op = collective or "a collective"
    via = f" ({backend})" if backend else ""
    size = f" of {numel:,} elements" if numel else ""
    if timeout_s is not None:
        ran = f" after {elapsed_s:g} s" if elapsed_s is not None else ""
        return (f"Communication timeout: {who} waited in {op}{size}{via}{ran} and gave up at its "
                f"timeout of {timeout_s:g} s: at least one other rank did not join {op} in time.")
    if peer_lost:
        return f"Communication error: {who} lost its peer during {op}{size}{via}."
    return f"Communication error in {op}{size}{via} on {who}."


def parse_data(text: str) -> dict:
    """The shard (and sample, and progress) a data error names."""
    d: dict = {}
    m = re.search(r"shard (\S+?):\s", text)
    if m:
        d["shard"] = m.group(1)
    else:
        m = re.search(r"(\S+\.(?:tar|tar\.gz|tgz|tar\.zst))\b", text)
        if m:
            d["shard"] = m.group(1).strip("'\"(")
    m = re.search(r"sample '([^']+)'", text)
    if m:
        d["sample"] = m.group(1)
    m = re.search(r"after (\d+) samples; (\d+) lost", text)
    if m:
        d["samples_read"], d["samples_lost"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"DataLoader worker (?:process )?(\d+)", text)
    if m:
        d["loader_worker"] = int(m.group(1))
    if "shard" not in d:
        m = re.search(r"cannot identify image file '([^']+)'", text)
        if m:
            d["file"] = m.group(1)
    return d


def data_suggestions(shard: str | None = None, *, sample: str | None = None,
                     file: str | None = None) -> list[str]:
    target = shard or file or "the shard or file the error names"
    out = [f"check {target}: `gpu_lab.data.verify_shards(<shard dir>)` re-hashes every shard "
           f"against manifest.json and lists those that are missing or differ"]
    if sample:
        out.append(f"look at sample {sample!r} in it (`tar tvf {shard or '<shard>'}`): a truncated or "
                   f"non-image member")
    out.append(f"rebuild {target} from its source (`gpu-lab shards SRC OUT`) or drop it from the "
               f"shard list")
    out.append("handler='warn' skips and counts bad samples and shards, so the run goes on while you "
               "investigate (the loader reports how many it lost)")
    out.append("reproduce without training: `gpu-lab bench loader --data ...` reads the same files")
    return out


def data_report(shard: str | None, *, sample: str | None = None, file: str | None = None,
                samples_read: int | None = None, samples_lost: int | None = None,
                error: str | None = None) -> str:
    """The data triage as text: the shard (and sample), then what to try."""
    head = _data_sentence(shard, sample, file, samples_read, samples_lost, error)
    tips = data_suggestions(shard, sample=sample, file=file)
    return "\n".join([head, "What to try, cheapest first:"]
                     + [f"  {i}. {s}" for i, s in enumerate(tips, 1)])


def _data_sentence(shard, sample=None, file=None, samples_read=None, samples_lost=None,
                   error=None) -> str:
    what = f"shard {shard}" if shard else (f"file {file}" if file else "an unnamed source")
    s = f"Data error in {what}"
    if sample:
        s += f", sample {sample!r}"
    if samples_read is not None:
        s += f", after {samples_read} good samples ({samples_lost} lost)"
    if error:
        s += f": {error}"
    return s + "."


def parse_storage(text: str) -> dict:
    """The checkpoint, folder, bytes needed and free, and keep_last a storage error names (the
    text of gpu_lab's CheckpointStorageError; any subset for other messages)."""
    d: dict = {}
    m = re.search(r"checkpoint (step_\d+):", text)
    if m:
        d["checkpoint"] = m.group(1)
    for reason, pattern in (("space", r"not enough space in (.+?): it needs"),
                            ("read-only", r"checkpoint step_\d+: (.+?) is on a read-only file system"),
                            ("permission", r"no permission to write in (.+?): it needs"),
                            ("missing", r"the folder (.+?) cannot be created")):
        m = re.search(pattern, text)
        if m:
            d["reason"], d["folder"] = reason, m.group(1)
            break
    else:
        if re.search(r"No space left on device|Disk quota exceeded|os error 28", text):
            d["reason"] = "space"
        elif "Read-only file system" in text:
            d["reason"] = "read-only"
    m = re.search(r"it needs about [^(]*\(([\d,]+) bytes\)", text)
    if m:
        d["needed_bytes"] = int(m.group(1).replace(",", ""))
    m = re.search(r"; [^(;]*\(([\d,]+) bytes\) free", text)
    if m:
        d["free_bytes"] = int(m.group(1).replace(",", ""))
    m = re.search(r"keep_last=(\d+)", text)
    if m:
        d["keep_last"] = int(m.group(1))
    return d


def storage_suggestions(reason: str | None = "space", folder: str | None = None,
                        needed: int | None = None, free: int | None = None,
                        keep_last: int | None = None) -> list[str]:
    """What to try when a checkpoint does not fit or cannot be written, cheapest first."""
    where = folder or "output_dir"
    each = f" (each one is about {fmt_bytes(needed)})" if needed is not None else ""
    other = "point output_dir at a file system with room (a scratch or data volume; `df -h` lists them)"
    if reason in ("read-only", "permission", "missing"):
        first = {"read-only": f"{where} is on a read-only file system: remount it read-write or "
                              f"mount a writable volume there (containers often mount data "
                              f"read-only)",
                 "permission": f"make {where} writable for the user the run runs as "
                               f"(`ls -ld {where}`)",
                 "missing": f"create {where} (or fix the path in output_dir), and check that the "
                            f"volume it lives on is mounted"}[reason]
        return [first, other.replace("with room", "you can write to, with room")]
    room = (f"it has {fmt_bytes(free)} free, the checkpoint needs about {fmt_bytes(needed)}; "
            if free is not None and needed is not None else "")
    return [f"free space in {where}: {room}delete old runs or checkpoints you no longer need "
            f"(`df -h {where}` shows the file system, `du -sh <folder>/*` what fills it)",
            (f"lower keep_last (now {keep_last}) so fewer checkpoints stay on disk{each}"
             if keep_last is not None else f"lower keep_last so fewer checkpoints stay on disk{each}"),
            other]


def _storage_sentence(d: dict) -> str:
    what = {"space": "out of space", "read-only": "a read-only file system",
            "permission": "no permission to write", "missing": "a folder that cannot be created"}
    s = f"Storage error ({what.get(d.get('reason'), 'the file system refused the write')})"
    if d.get("checkpoint"):
        s += f" writing checkpoint {d['checkpoint']}"
    if d.get("folder"):
        s += f" in {d['folder']}"
    if d.get("needed_bytes") is not None:
        s += f": it needs about {fmt_bytes(d['needed_bytes'])}"
        if d.get("free_bytes") is not None:
            s += f", {fmt_bytes(d['free_bytes'])} free"
    return s + ". The earlier checkpoints are untouched."


def explain(failure: RankFailure, exc: BaseException | None = None) -> RankFailure:
    """Fill `failure.details`, `.explanation` and numbered `.suggestions` from the numbers in its
    message and traceback, what `note()` recorded, and (in the failing rank) the memory state."""
    text = f"{failure.message}\n{failure.traceback}"
    ctx = noted()
    facts = {k: ctx[k] for k in ("grad_accum_steps", "num_processes", "mixed_precision",
                                 "activation_checkpointing", "zero") if k in ctx}
    if failure.category == OOM:
        d = parse_oom(text)
        if "batch_size" in ctx:
            d["batch_size"], d["batch_size_source"] = int(ctx["batch_size"]), "note()"
        elif "batch_size" not in d:
            found = _batch_from_frames(exc)
            if found:
                d["batch_size"], d["batch_size_source"] = found
        d.setdefault("device", "GPU ?" if "CUDA" in text else "CPU")
        if "free_bytes" not in d:
            d.update({k: v for k, v in _memory_now(d["device"]).items() if k not in d})
        d.update(facts)
        failure.details = d
        failure.explanation = oom_sentence(d.get("requested_bytes"), d.get("free_bytes"),
                                            d.get("total_bytes"), d.get("batch_size"),
                                            d["device"], d.get("allocated_bytes"),
                                            d.get("reserved_unallocated_bytes"),
                                            bool(d.get("memory_cap")))
        if d.get("operation"):
            failure.explanation += f" It failed in {d['operation']}."
        failure.suggestions = oom_suggestions(
            d.get("requested_bytes"), d.get("free_bytes"), d.get("total_bytes"),
            d.get("batch_size"), device=d["device"],
            reserved_unallocated=d.get("reserved_unallocated_bytes"),
            memory_cap=bool(d.get("memory_cap")), **facts)
    elif failure.category == COMM:
        d = parse_comm(text)
        failure.details = d
        failure.explanation = _comm_sentence(d.get("collective"), d.get("timeout_s"),
                                             d.get("elapsed_s"), d.get("backend"),
                                             d.get("numel"), bool(d.get("peer_lost")),
                                             failure.rank)
        failure.suggestions = comm_suggestions(d.get("collective"), d.get("timeout_s"),
                                               peer_lost=bool(d.get("peer_lost")),
                                               backend=d.get("backend"))
    elif failure.category == DATA:
        d = parse_data(text)
        failure.details = d
        first = failure.message.strip().splitlines()[0] if failure.message.strip() else None
        if first and d.get("shard"):
            first = first.split(f"shard {d['shard']}:", 1)[-1].strip() or None
        failure.explanation = _data_sentence(d.get("shard"), d.get("sample"), d.get("file"),
                                             d.get("samples_read"), d.get("samples_lost"), first)
        failure.suggestions = data_suggestions(d.get("shard"), sample=d.get("sample"),
                                               file=d.get("file"))
    elif failure.category == USER and world_suggestions(text):
        failure.explanation, failure.suggestions = world_suggestions(text)
    elif failure.category == STORAGE:
        d = parse_storage(text)
        failure.details = d
        failure.explanation = _storage_sentence(d)
        failure.suggestions = storage_suggestions(d.get("reason"), d.get("folder"),
                                                  d.get("needed_bytes"), d.get("free_bytes"),
                                                  d.get("keep_last"))
    return failure


#: What to try in each category before the numbers are known (the builders above, without them).
SUGGESTIONS = {
    OOM: oom_suggestions(),
    COMM: comm_suggestions(),
    DATA: data_suggestions(),
    STORAGE: storage_suggestions(),
    USER: ["read the traceback: the last frame in your training function is the place"],
    SIGNAL: ["SIGKILL without a Python traceback is usually the host's out-of-memory killer: "
             "check `dmesg`, `free -h`, and lower num_workers or batch_size",
             "a scheduler (Slurm, Kubernetes) may have ended the job: check its logs"],
    NODE: ["resume the run once the node is back (run.resume()): it continues from the newest "
           "complete checkpoint, so checkpoint_every sets how much is done again",
           "`sinfo -R` says why Slurm took the node down; if it stays down, ask the cluster's "
           "administrators, or resume on a partition without it (run.resume(partition=...))"],
}

__all__ = ["SUGGESTIONS", "explain", "note", "noted", "parse_oom", "parse_comm", "parse_data",
           "parse_storage", "comm_suggestions", "data_suggestions", "storage_suggestions",
           "comm_report", "data_report"]
