"""gpu_lab.data: synthetic image sets, WebDataset shards and a loader that keeps the GPU fed
(gpu_lab.diagnostics.loader_bench shows whether the loader or the model is the bottleneck).

    make_synthetic_images(out_dir, n, image_size, num_classes, seed)  JPEG/PNG ImageFolder tree
    SyntheticImages(n, image_size, num_classes, seed)                 the same images, in memory
    write_shards(source, out_dir, maxcount=, maxsize=, compress=)      tar shards + manifest.json
    shard_loader(urls, batch_size, train=, image_size=, augment=, num_workers=, resampled=, ...)

Never imports widgets; names are imported on first use (torch is not loaded by `import gpu_lab.data`).
"""
from __future__ import annotations

from gpu_lab._lazy import lazy_api


_API = {
    "make_synthetic_images": "gpu_lab.data.synthetic",
    "SyntheticImages": "gpu_lab.data.synthetic",
    "SyntheticImageSet": "gpu_lab.data.synthetic",
    "class_names": "gpu_lab.data.synthetic",
    "write_shards": "gpu_lab.data.shards",
    "ShardManifest": "gpu_lab.data.shards",
    "WriteReport": "gpu_lab.data.shards",
    "resolve_shards": "gpu_lab.data.shards",
    "verify_shards": "gpu_lab.data.shards",
    "shard_loader": "gpu_lab.data.loader",
    "ShardLoader": "gpu_lab.data.loader",
    "ShardError": "gpu_lab.data.loader",
    "LoaderStallError": "gpu_lab.data.loader",
    "ErrorPolicy": "gpu_lab.data.loader",
    "LoaderStats": "gpu_lab.data.loader",
    "build_transform": "gpu_lab.data.transforms",
    "normalize_batch": "gpu_lab.data.transforms",
}

__getattr__, __dir__, __all__ = lazy_api(__name__, _API)
