"""gpu_lab.cases: worked cases at a scale a laptop can run.

    diffusion   captioned WebDataset shards (.jpg + .txt), a caption-conditioned pixel-space UNet
                (diffusers), EMA weights and sample grids; `train_diffusion(config)` runs under
                gpu_lab.launch and torchrun alike
    pruning     structured channel pruning that really removes channels, FLOPs and latency
    serving     Wide&Deep with EmbeddingBag tables, a dynamic-batching server loop measured under
                load, and the Triton model-repository files for the same model

Headless like train/ and data/: never imports widgets. Names are imported on first use.
"""
from __future__ import annotations

from gpu_lab._lazy import lazy_api


_API = {
    "caption_for": ".diffusion",
    "CaptionTokenizer": ".diffusion",
    "write_captioned_shards": ".diffusion",
    "CaptionedShards": ".diffusion",
    "TextToImageDiffusion": ".diffusion",
    "train_diffusion": ".diffusion",
    "EMAAndSamples": ".diffusion",
    "image_grid": ".diffusion",
    "fid_clip_status": ".diffusion",
    "fid_and_clip": ".diffusion",
    "prune_channels": ".pruning",
    "count_params": ".pruning",
    "count_flops": ".pruning",
    "latency": ".pruning",
    "conv_widths": ".pruning",
    "compare": ".pruning",
    "WideAndDeep": ".serving",
    "click_data": ".serving",
    "DynamicBatcher": ".serving",
    "measure_serving": ".serving",
    "triton_config": ".serving",
    "check_triton_config": ".serving",
}

__getattr__, __dir__, __all__ = lazy_api(__name__, _API)
