"""Recommendation serving at laptop scale: Wide&Deep, a dynamic-batching server loop, Triton files.

- `WideAndDeep`: the wide part is a linear model over hashed feature crosses, the deep part an MLP over
  field embeddings; both look their ids up in `nn.EmbeddingBag` tables with `sparse=True`, so a
  step's gradient holds only the rows the batch used (a table of millions of rows is not rewritten
  every step). Train the tables with `torch.optim.SparseAdam`, the rest with AdamW.
- `DynamicBatcher`: the server loop that Triton's dynamic batcher runs: requests wait in a queue;
  the loop takes the first one, waits at most `window_s` for more (up to `max_batch`), runs the
  model once on the batch and answers every request.
- `measure_serving`: closed-loop clients (each sends, waits for its answer, sends again; Triton's
  perf_analyzer --concurrency-range does the same) against a batcher: throughput and latency
  percentiles.
- `triton_config` / `check_triton_config`: the `config.pbtxt` of a Triton model repository, and a
  parse of it against Triton's own ModelConfig schema (tritonclient ships the compiled proto).
"""
from __future__ import annotations

import queue
import statistics
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch
from torch import nn


class WideAndDeep(nn.Module):
    """Wide&Deep CTR model over `len(buckets)` categorical fields (one id per field) and
    `num_dense` numeric features; `forward(ids, dense)` returns click logits (B,)."""

    def __init__(self, buckets: Sequence[int], num_dense: int = 4, dim: int = 16,
                 hidden: Sequence[int] = (64, 32), cross_buckets: int = 4096) -> None:
        super().__init__()
        self.buckets, self.cross_buckets = list(buckets), cross_buckets
        self.register_buffer("offsets", torch.tensor([0, *self.buckets[:-1]]).cumsum(0), persistent=False)
        # deep: one table for all fields (ids shifted by field offsets), summed per field below
        self.embed = nn.EmbeddingBag(sum(self.buckets), dim, mode="sum", sparse=True)
        # wide: one weight per id and per hashed pair of ids (the "memorisation" crosses)
        self.wide = nn.EmbeddingBag(sum(self.buckets) + cross_buckets, 1, mode="sum", sparse=True)
        layers: list[nn.Module] = []
        width = len(self.buckets) * dim + num_dense
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.deep = nn.Sequential(*layers, nn.Linear(width, 1))
        self.bias = nn.Parameter(torch.zeros(1))
        nn.init.zeros_(self.wide.weight)  # a linear model starts at zero, not at N(0, 1) per id
        nn.init.normal_(self.embed.weight, std=0.05)
        pairs = torch.triu_indices(len(self.buckets), len(self.buckets), offset=1)
        self.register_buffer("pairs", pairs, persistent=False)

    def crosses(self, ids: torch.Tensor) -> torch.Tensor:
        """Hashed ids of every pair of fields (B, F*(F-1)/2), in [0, cross_buckets)."""
        i, j = self.pairs
        return (ids[:, i] * 1_000_003 + ids[:, j] * 97 + i * 7919 + j) % self.cross_buckets

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        flat = ids + self.offsets  # (B, F) global row ids
        b, f = flat.shape
        per_field = self.embed(flat.reshape(-1, 1)).reshape(b, f * self.embed.embedding_dim)
        deep = self.deep(torch.cat([per_field, dense], dim=1)).squeeze(1)
        wide_ids = torch.cat([flat, self.crosses(ids) + sum(self.buckets)], dim=1)
        wide = self.wide(wide_ids).squeeze(1)  # a bag per row: the sum over its ids and crosses
        return wide + deep + self.bias

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [self.embed.weight, self.wide.weight]

    def dense_parameters(self) -> list[nn.Parameter]:
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]


def click_data(n: int, buckets: Sequence[int], num_dense: int = 4, seed: int = 0):
    """Synthetic clicks (ids (n, F), dense (n, D), labels (n,)) from a hidden logistic model with
    per-id effects, one strong pairwise interaction and a dense term: learnable, not trivial.
    `seed` draws the samples; the hidden model is the same for every seed."""
    g = torch.Generator().manual_seed(seed)
    f = len(buckets)
    # popular ids are drawn more often (a Zipf-like tail, as real catalogues have)
    ids = torch.stack([(torch.rand(n, generator=g) ** 2 * b).long().clamp_max(b - 1) for b in buckets], 1)
    dense = torch.randn(n, num_dense, generator=g)
    # the hidden model does not depend on `seed`: data sets drawn with other seeds (a validation
    # set) follow the same rules
    effects = [torch.randn(b, generator=torch.Generator().manual_seed(10_000 + k))
               for k, b in enumerate(buckets)]
    logit = sum(effects[k][ids[:, k]] for k in range(f)) * 0.8 - 0.5
    logit = logit + 1.5 * ((ids[:, 0] % 3 == 0) & (ids[:, 1 % f] % 2 == 0)).float()  # a cross
    logit = logit + dense[:, 0] - 0.5 * dense[:, 1 % num_dense]
    labels = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return ids, dense, labels


# ----------------------------------------------------------------------------------- the server

class DynamicBatcher:
    """A server loop with dynamic batching. `submit(*inputs)` returns a Future; a thread takes the
    oldest request, collects more for at most `window_s` (or until `max_batch`), stacks each input
    along a new first dimension, runs `fn` once and hands each request its row of the output.

    `window_s=0` batches only what is already waiting; `max_batch=1` is a server without batching.
    Use it as a context manager: the thread stops, and requests still queued fail, on exit.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], max_batch: int = 64, window_s: float = 0.002) -> None:
        if max_batch < 1 or window_s < 0:
            raise ValueError(f"DynamicBatcher: max_batch={max_batch!r}, window_s={window_s!r}; expected "
                             "max_batch >= 1 and window_s >= 0 (seconds)")
        self.fn, self.max_batch, self.window_s = fn, max_batch, window_s
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.batch_sizes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-lab-batcher", daemon=True)

    def __enter__(self) -> "DynamicBatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.requests.put(None)  # wake the loop
        self._thread.join()
        while True:  # nothing is dropped silently: queued requests fail with a reason
            try:
                item = self.requests.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(RuntimeError("DynamicBatcher stopped before this request ran"))

    def submit(self, *inputs: torch.Tensor) -> Future:
        if self._stop.is_set():
            raise RuntimeError("DynamicBatcher: submit() after the server stopped")
        fut: Future = Future()
        self.requests.put((inputs, fut))
        return fut

    def _loop(self) -> None:
        while not self._stop.is_set():
            first = self.requests.get()
            if first is None:
                continue
            batch = [first]
            deadline = time.perf_counter() + self.window_s
            while len(batch) < self.max_batch:
                left = deadline - time.perf_counter()
                try:
                    item = self.requests.get(timeout=left) if left > 0 else self.requests.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    break
                batch.append(item)
            self.batch_sizes.append(len(batch))
            try:
                stacked = [torch.stack(parts) for parts in zip(*(b[0] for b in batch))]
                with torch.inference_mode():
                    out = self.fn(*stacked)
                for row, (_, fut) in zip(out, batch):
                    fut.set_result(row)
            except Exception as exc:  # noqa: BLE001 - every waiting client gets the error
                for _, fut in batch:
                    fut.set_exception(exc)


def measure_serving(fn: Callable[..., torch.Tensor], make_request: Callable[[int], tuple],
                    *, max_batch: int, window_s: float, concurrency: int = 32,
                    duration_s: float = 1.0, warmup_s: float = 0.2) -> dict[str, float]:
    """Closed-loop load: `concurrency` client threads, each sending `make_request(i)` and waiting for
    the answer, for `duration_s` after `warmup_s`. Returns requests/s, latency percentiles (ms) and
    the mean batch the server ran."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    start = time.perf_counter()
    t_measure, t_end = start + warmup_s, start + warmup_s + duration_s
    with DynamicBatcher(fn, max_batch=max_batch, window_s=window_s) as server:

        def client(c: int) -> None:
            i = c
            while True:
                t0 = time.perf_counter()
                if t0 >= t_end:
                    return
                server.submit(*make_request(i)).result()
                if t0 >= t_measure:
                    latencies[c].append(time.perf_counter() - t0)
                i += concurrency

        threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sizes = list(server.batch_sizes)
    lat = sorted(x for per in latencies for x in per)
    if not lat:
        raise RuntimeError("measure_serving: no request completed in the measured window; "
                           "raise duration_s")

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3

    return {"requests_per_s": len(lat) / duration_s, "p50_ms": pct(0.50), "p95_ms": pct(0.95),
            "p99_ms": pct(0.99), "mean_batch": statistics.mean(sizes), "requests": len(lat),
            "max_batch": max_batch, "window_ms": window_s * 1e3}


# --------------------------------------------------------------------------------------- Triton

_DTYPES = {torch.float32: "TYPE_FP32", torch.float16: "TYPE_FP16", torch.int64: "TYPE_INT64",
           torch.int32: "TYPE_INT32", torch.bool: "TYPE_BOOL"}


def triton_config(name: str, inputs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                  outputs: Sequence[tuple[str, torch.dtype, Sequence[int]]], *, max_batch_size: int = 64,
                  preferred_batch_sizes: Sequence[int] = (16, 32, 64), max_queue_delay_us: int = 2000,
                  platform: str = "onnxruntime_onnx", instances: int = 1, kind: str = "KIND_GPU",
                  versions: Sequence[int] = (1,)) -> str:
    """The `config.pbtxt` of a Triton model: tensors (name, dtype, shape without the batch
    dimension), dynamic batching, instance groups, and the versions to serve side by side
    (an A/B test routes requests to version 1 or 2 by name; nothing is reloaded to switch)."""
    def tensor(kind_: str, n: str, dt: torch.dtype, dims: Sequence[int]) -> str:
        if dt not in _DTYPES:
            raise ValueError(f"triton_config: {kind_} {n!r} has dtype {dt}; supported: {list(_DTYPES)}")
        # Triton's dims leave out the batch dimension and cannot be empty: a per-request scalar
        # is declared [1] and reshaped to [] (the tensor the model really takes or gives)
        shape = f'dims: [ {", ".join(map(str, dims))} ]' if dims else "dims: [ 1 ]\n    reshape: { shape: [ ] }"
        return f'  {{\n    name: "{n}"\n    data_type: {_DTYPES[dt]}\n    {shape}\n  }}'

    ins = ",\n".join(tensor("input", *t) for t in inputs)
    outs = ",\n".join(tensor("output", *t) for t in outputs)
    return (f'name: "{name}"\nplatform: "{platform}"\nmax_batch_size: {max_batch_size}\n'
            f"version_policy: {{ specific: {{ versions: [ {', '.join(map(str, versions))} ] }} }}\n"
            f"input [\n{ins}\n]\noutput [\n{outs}\n]\n"
            f"dynamic_batching {{\n  preferred_batch_size: [ {', '.join(map(str, preferred_batch_sizes))} ]\n"
            f"  max_queue_delay_microseconds: {max_queue_delay_us}\n}}\n"
            f"instance_group [ {{ count: {instances}\n  kind: {kind} }} ]\n")


def check_triton_config(text: str):
    """Parse `text` as Triton's ModelConfig (protobuf text format, the schema Triton itself
    loads); returns the message, or raises ValueError naming the line that does not parse or the
    rule it breaks."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ValueError(f"config.pbtxt does not parse as Triton's ModelConfig: {e}") from None
    problems = []
    if cfg.max_batch_size > 0:
        too_big = [b for b in cfg.dynamic_batching.preferred_batch_size if b > cfg.max_batch_size]
        if too_big:
            problems.append(f"preferred_batch_size {too_big} > max_batch_size {cfg.max_batch_size}")
    elif cfg.HasField("dynamic_batching"):
        problems.append("dynamic_batching needs max_batch_size > 0")
    if not cfg.input or not cfg.output:
        problems.append("a model needs at least one input and one output")
    if problems:
        raise ValueError("config.pbtxt: " + "; ".join(problems))
    return cfg


__all__ = ["WideAndDeep", "click_data", "DynamicBatcher", "measure_serving", "triton_config",
           "check_triton_config"]
