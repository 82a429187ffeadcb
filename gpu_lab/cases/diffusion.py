"""Text-to-image diffusion at toy scale: a Stable Diffusion fine-tuning flow, offline.

Stable Diffusion fine-tuning, as it is usually done, is: captioned images as WebDataset shards,
a config dict (batch 16, 20 epochs, lr 3e-5, AdamW, cosine, accumulation 4), `torchrun ... --precision
bf16`, then FID and CLIP score. Every piece of that runs here, small and with no downloaded weights:

- `write_captioned_shards`: synthetic images (gpu_lab.data.synthetic) with a caption generated from
  what is drawn ("a red disk with stripes"), as `.jpg` + `.txt` tar members;
- `CaptionedShards`: this rank's `(inputs, caption ids)` batches, read back with webdataset;
- `TextToImageDiffusion`: a randomly initialised pixel-space `diffusers.UNet2DModel` conditioned on
  the caption (a bag-of-words text encoder added to the timestep embedding), the DDPM noise
  objective, EMA weights, and DDIM sampling with classifier-free guidance;
- `train_diffusion(config)`: the training function. It runs `gpu_lab.train.fit` (bf16, gradient
  accumulation, warmup + cosine, atomic checkpoints) under `gpu_lab.launch` and, unchanged, under
  `torchrun -m gpu_lab.rank.headless gpu_lab.cases.diffusion:train_diffusion`;
- `fid_and_clip`: FID and CLIP score with torchmetrics where the Inception and CLIP weights exist
  locally; `fid_clip_status` says what is missing instead of inventing a number.
"""
from __future__ import annotations

import copy
import importlib.util
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..data.synthetic import COLOURS, SHAPES, class_spec, render
from ..train.callbacks import Callback

_TEXTURE_WORDS = {"solid": "", "stripes": "with stripes", "dots": "with dots", "checker": "with checks"}
PAD = "<pad>"


def caption_for(label: int) -> str:
    """The caption of synthetic class `label`: what is drawn, in words ("a red disk with stripes")."""
    shape, colour, texture = class_spec(label)
    article = "an" if colour[0] in "aeiou" else "a"
    return " ".join(w for w in (article, colour, shape, _TEXTURE_WORDS[texture]) if w)


class CaptionTokenizer:
    """Word-level tokenizer over the captions' vocabulary; id 0 is padding (the empty caption)."""

    def __init__(self, max_words: int = 6) -> None:
        words = {"a", "an", *COLOURS, *SHAPES, *(w for t in _TEXTURE_WORDS.values() for w in t.split())}
        self.vocab = [PAD, *sorted(words)]
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.max_words = max_words

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        words = text.lower().split()
        unknown = [w for w in words if w not in self.ids]
        if unknown:
            raise ValueError(f"caption {text!r}: unknown word(s) {unknown}; this toy text encoder "
                             f"knows: {', '.join(self.vocab[1:])}")
        if len(words) > self.max_words:
            raise ValueError(f"caption {text!r}: {len(words)} words; at most {self.max_words}")
        return [self.ids[w] for w in words] + [0] * (self.max_words - len(words))

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocab[int(i)] for i in ids if int(i) != 0)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        return torch.tensor([self.encode(t) for t in texts], dtype=torch.long)


# ------------------------------------------------------------------------------------------- data

def write_captioned_shards(out_dir: str | Path, n: int, image_size: int = 32, num_classes: int = 16,
                           seed: int = 0, maxcount: int = 128, quality: int = 90) -> list[str]:
    """Write `n` synthetic images with their captions as WebDataset shards: `<key>.jpg` (the image)
    and `<key>.txt` (its caption, UTF-8) per sample, `maxcount` samples per shard, captions mixed
    in every shard. Returns the shard paths."""
    import webdataset as wds
    from torchvision.io import encode_jpeg

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("captions-*.tar")):
        raise FileExistsError(f"out_dir={str(out)!r} already holds captions-*.tar shards; write to "
                              "an empty directory (old and new shards would mix)")
    if n < 1 or maxcount < 1:
        raise ValueError(f"n={n!r}, maxcount={maxcount!r}: expected positive ints")
    order = list(range(n))
    random.Random(seed).shuffle(order)  # every shard holds every caption
    paths: list[str] = []
    writer = None
    for j, i in enumerate(order):
        if j % maxcount == 0:
            if writer is not None:
                writer.close()
            paths.append(str(out / f"captions-{len(paths):06d}.tar"))
            writer = wds.TarWriter(paths[-1])
        label = i % num_classes
        pixels = torch.from_numpy(render(i, label, image_size, seed)).permute(2, 0, 1).contiguous()
        writer.write({"__key__": f"{i:08d}", "jpg": encode_jpeg(pixels, quality=quality).numpy().tobytes(),
                      "txt": caption_for(label)})
    writer.close()
    return paths


class CaptionedShards:
    """This rank's batches from captioned shards: `({"pixel_values", "input_ids"}, input_ids)`.

    Shards are drawn with replacement (webdataset's ResampledShards, seeded per rank, worker and
    epoch) and every rank stops after the same `len()` micro-batches, so no rank waits alone in an
    all-reduce. Pixels are in [-1, 1], the range the noise objective assumes. fit() uses a loader
    with `set_epoch` as it is (it already splits by rank).
    """

    def __init__(self, urls: str | Path | list, batch_size: int, image_size: int, *,
                 samples_per_epoch: int | None = None, num_workers: int = 0, seed: int = 0,
                 tokenizer: CaptionTokenizer | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        from ..data.loader import dist_info
        from ..data.shards import resolve_shards

        self.urls, _ = resolve_shards(urls)
        self.rank, self.world_size = dist_info(rank, world_size)
        self.batch_size, self.image_size = batch_size, image_size
        self.num_workers, self.seed, self.epoch = num_workers, seed, 0
        self.tokenizer = tokenizer or CaptionTokenizer()
        if samples_per_epoch is None:
            samples_per_epoch = sum(_count_samples(u) for u in self.urls)
        self.batches = max(1, samples_per_epoch // (self.world_size * batch_size))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches

    def _pipeline(self):
        import webdataset as wds

        base = (self.seed, self.epoch, self.rank)

        def worker_seed() -> int:
            info = torch.utils.data.get_worker_info()
            return hash((*base, info.id if info is not None else 0)) & 0x7FFFFFFF

        workers = max(1, self.num_workers)
        return wds.DataPipeline(
            wds.ResampledShards(self.urls, worker_seed=worker_seed, deterministic=True),
            wds.tarfile_to_samples(),
            wds.shuffle(256, initial=64, rng=random.Random(hash(base))),
            wds.to_tuple("jpg", "txt"),
            wds.map_tuple(self._pixels, self._ids),
            wds.batched(self.batch_size, partial=False),
            wds.slice(-(-self.batches // workers)),  # per worker; the loader cuts at len() below
        )

    def _pixels(self, data: bytes) -> torch.Tensor:
        from ..data.transforms import decode

        x = decode(data).float().div_(127.5).sub_(1.0)
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = nn.functional.interpolate(x[None], size=(self.image_size,) * 2, mode="bilinear",
                                          antialias=True, align_corners=False)[0]
        return x

    def _ids(self, text: bytes | str) -> torch.Tensor:
        text = text.decode() if isinstance(text, (bytes, bytearray)) else text
        return torch.tensor(self.tokenizer.encode(text), dtype=torch.long)

    def __iter__(self) -> Iterator:
        from itertools import islice

        loader = torch.utils.data.DataLoader(self._pipeline(), batch_size=None,
                                             num_workers=self.num_workers)
        for images, ids in islice(loader, self.batches):
            yield {"pixel_values": images, "input_ids": ids}, ids

    def __repr__(self) -> str:
        return (f"CaptionedShards({len(self.urls)} shards, rank {self.rank}/{self.world_size}, "
                f"{self.batches} batches of {self.batch_size} per epoch)")


def _count_samples(url: str) -> int:
    import tarfile

    with tarfile.open(url) as tar:
        return sum(1 for m in tar.getmembers() if m.name.endswith(".txt"))


# ------------------------------------------------------------------------------------------ model

class TextToImageDiffusion(nn.Module):
    """A caption-conditioned pixel-space UNet (diffusers' UNet2DModel) and the DDPM objective.

    `forward(inputs)` noises the images at random timesteps and returns each sample's squared error
    of the predicted noise (fit's loss_fn averages it); captions are dropped for `caption_dropout` of
    the samples so that the same model also predicts unconditionally, which classifier-free
    guidance needs at sampling time. `ema` holds the exponential moving average of the weights (not
    trained, saved in every checkpoint with the rest); samples are drawn with it.
    """

    def __init__(self, image_size: int, vocab_size: int, widths: Sequence[int] = (32, 64, 64),
                 attention: bool = False, ema_decay: float = 0.999, caption_dropout: float = 0.1,
                 num_train_timesteps: int = 1000, prediction_type: str = "v_prediction") -> None:
        super().__init__()
        from diffusers import DDPMScheduler, UNet2DModel

        down = ["DownBlock2D"] * len(widths)
        if attention:  # self-attention at the lowest resolution, as Stable Diffusion's UNet has
            down[-1] = "AttnDownBlock2D"
        up = [b.replace("Down", "Up") for b in reversed(down)]
        self.unet = UNet2DModel(sample_size=image_size, in_channels=3, out_channels=3,
                                layers_per_block=1, block_out_channels=tuple(widths),
                                down_block_types=tuple(down), up_block_types=tuple(up),
                                norm_num_groups=min(8, widths[0]), class_embed_type="identity")
        # the caption's embedding is added to the timestep embedding (time_embed_dim = 4 x width)
        self.text = nn.EmbeddingBag(vocab_size, 4 * widths[0], mode="mean", padding_idx=0)
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps,
                                             beta_schedule="squaredcos_cap_v2",
                                             prediction_type=prediction_type)
        self.ema = nn.ModuleDict({"unet": copy.deepcopy(self.unet), "text": copy.deepcopy(self.text)})
        self.ema.requires_grad_(False)
        self.ema_decay, self.caption_dropout = ema_decay, caption_dropout
        self.image_size = image_size

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(self, inputs: dict) -> torch.Tensor:
        x0, ids = inputs["pixel_values"], inputs["input_ids"]
        if self.training and self.caption_dropout > 0:
            drop = torch.rand(len(ids), device=ids.device) < self.caption_dropout
            ids = ids.masked_fill(drop[:, None], 0)  # all padding: the empty caption
        noise = torch.randn_like(x0)
        t = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (len(x0),),
                          device=x0.device)
        noisy = self.noise_scheduler.add_noise(x0, noise, t)
        pred = self.unet(noisy, t, class_labels=self.text(ids)).sample
        if self.noise_scheduler.config.prediction_type == "v_prediction":
            target = self.noise_scheduler.get_velocity(x0, noise, t)
        else:
            target = noise
        return (pred.float() - target.float()).pow(2).mean(dim=(1, 2, 3))

    @torch.no_grad()
    def update_ema(self, step: int) -> float:
        """One EMA step; the decay warms up as (1 + step) / (10 + step) (diffusers' EMAModel), so a
        short run's average is not dominated by the random initial weights."""
        decay = min(self.ema_decay, (1 + step) / (10 + step))
        live = [*self.unet.parameters(), *self.text.parameters()]
        ema = [*self.ema["unet"].parameters(), *self.ema["text"].parameters()]
        torch._foreach_lerp_(ema, live, 1.0 - decay)
        return decay

    @torch.no_grad()
    def sample(self, ids: torch.Tensor, steps: int = 25, guidance: float = 2.0, seed: int = 0,
               use_ema: bool = True) -> torch.Tensor:
        """Images in [0, 1] for caption ids (N, words): DDIM, `steps` denoising steps, classifier-free
        guidance `guidance` (1: none)."""
        from diffusers import DDIMScheduler

        unet = self.ema["unet"] if use_ema else self.unet
        text = self.ema["text"] if use_ema else self.text
        device = next(unet.parameters()).device
        ids = ids.to(device)
        sched = DDIMScheduler.from_config(self.noise_scheduler.config)
        sched.set_timesteps(steps)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(len(ids), 3, self.image_size, self.image_size, generator=gen).to(device)
        cond = torch.cat([text(ids), text(torch.zeros_like(ids))])  # with and without the caption
        for t in sched.timesteps:
            eps_c, eps_u = unet(torch.cat([x, x]), t, class_labels=cond).sample.chunk(2)
            x = sched.step(eps_u + guidance * (eps_c - eps_u), t, x).prev_sample
        return x.clamp(-1, 1).add(1).div(2).float().cpu()


def image_grid(images: torch.Tensor, nrow: int = 8):
    """A PIL image of a batch of (N, 3, H, W) images in [0, 1], `nrow` per row, 2 px apart."""
    from PIL import Image
    from torchvision.utils import make_grid

    grid = make_grid(images, nrow=nrow, padding=2, pad_value=1.0)
    return Image.fromarray(grid.mul(255).round().byte().permute(1, 2, 0).numpy())


# --------------------------------------------------------------------------------------- training

DEFAULT_PROMPTS = tuple(caption_for(c) for c in range(8))


class EMAAndSamples(Callback):
    """After each optimizer step: update the EMA weights; every `sample_every` steps (and at the
    end) rank 0 draws one image per prompt with them and saves the grid as
    `<output_dir>/samples/step_<N>.png` (the prompts in the `.txt` beside it)."""

    def __init__(self, sample_every: int, prompts: Sequence[str], tokenizer: CaptionTokenizer,
                 steps: int = 25, guidance: float = 2.0) -> None:
        self.sample_every, self.prompts, self.tokenizer = sample_every, list(prompts), tokenizer
        self.steps, self.guidance = steps, guidance
        self.grids: list[str] = []

    def on_step_end(self, state) -> None:
        model = state.accelerator.unwrap_model(state.model)
        model.update_ema(state.step)
        due = self.sample_every and state.step % self.sample_every == 0
        if (due or state.step == state.total_steps) and state.is_main_process:
            self.grids.append(self.save_grid(model, state.output_dir, state.step))

    def save_grid(self, model: TextToImageDiffusion, output_dir: Path, step: int) -> str:
        was_training = model.training
        model.eval()
        images = model.sample(self.tokenizer(self.prompts), steps=self.steps, guidance=self.guidance)
        model.train(was_training)
        folder = Path(output_dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{step:06d}.png"
        image_grid(images, nrow=min(8, len(images))).save(path)
        path.with_suffix(".txt").write_text("\n".join(self.prompts) + "\n")
        return str(path)


def _mean_loss(outputs: torch.Tensor, _ids: torch.Tensor) -> torch.Tensor:
    return outputs.mean()


def default_widths(image_size: int) -> tuple[int, ...]:
    """UNet widths by resolution: one down-sampling stage per factor 2 down to 8 px."""
    if image_size <= 32:
        return (16, 32, 32)
    if image_size <= 64:
        return (64, 128, 128, 256)
    return (64, 128, 128, 256, 256)


def train_diffusion(config, *, widths: Sequence[int] | None = None, attention: bool | None = None,
                    prompts: Sequence[str] = DEFAULT_PROMPTS, sample_steps: int = 25,
                    guidance: float = 2.0, ema_decay: float = 0.999) -> dict[str, Any]:
    """Train TextToImageDiffusion on the captioned shards in `config.data_dir`; call on every rank.

    Read from the TrainConfig: data_dir, image_size, batch_size, epochs / max_steps, lr, optimizer,
    weight_decay, scheduler, warmup_ratio, grad_accum_steps, max_grad_norm, mixed_precision,
    num_workers, seed, output_dir, checkpoint_every, keep_last, resume, log_every and eval_every (the
    sample-grid interval). model, num_classes and augment are classifier fields and are not read.
    Returns fit's summary with the sample grids' paths and the parameter count.
    """
    from ..train.loop import fit
    from ..train.validate import validate

    cfg = validate(config)
    if not cfg.data_dir:
        raise ValueError("TrainConfig.data_dir: got None; the diffusion training function needs a "
                         "folder of captioned shards (.jpg + .txt), e.g. from "
                         "gpu_lab.cases.write_captioned_shards")
    tokenizer = CaptionTokenizer()
    data = CaptionedShards(cfg.data_dir, cfg.batch_size, cfg.image_size,
                           num_workers=cfg.num_workers, seed=cfg.seed, tokenizer=tokenizer)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    widths = tuple(widths or default_widths(cfg.image_size))
    model = TextToImageDiffusion(cfg.image_size, len(tokenizer), widths,
                                 attention=cfg.image_size > 32 if attention is None else attention,
                                 ema_decay=ema_decay)
    samples = EMAAndSamples(cfg.eval_every, prompts, tokenizer, steps=sample_steps, guidance=guidance)
    summary = fit(model, data, cfg, callbacks=[samples], loss_fn=_mean_loss)
    return {**summary, "sample_grids": samples.grids, "parameters": model.trainable_parameters(),
            "batches_per_epoch": len(data)}


# ------------------------------------------------------------------------------------- evaluation

FID_WEIGHTS = "weights-inception-2015-12-05-6726825d.pth"  # torch-fidelity's Inception (TF port)
CLIP_MODEL = "openai/clip-vit-base-patch16"


def fid_clip_status() -> list[str]:
    """What FID and CLIP score still need on this machine (empty: `fid_and_clip` can run). Looks
    only at installed packages and local caches: it never downloads."""
    missing = [f"the {m} package" for m in ("torchmetrics", "torch_fidelity", "transformers")
               if importlib.util.find_spec(m) is None]
    fid = Path(torch.hub.get_dir()) / "checkpoints" / FID_WEIGHTS
    if not fid.is_file():
        missing.append(f"the FID Inception weights ({fid})")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(CLIP_MODEL, "config.json"), str):
        missing.append(f"the CLIP weights ({CLIP_MODEL} in the Hugging Face cache)")
    return missing


def fid_and_clip(real: torch.Tensor, fake: torch.Tensor, captions: Sequence[str]) -> dict[str, float]:
    """FID between real and generated images, and the CLIP score of the generated images against
    their captions (uint8 tensors (N, 3, H, W)). Needs what `fid_clip_status()` lists, and in
    practice thousands of images: FID's 2048-dimensional covariance from fewer is biased upward."""
    missing = fid_clip_status()
    if missing:
        raise RuntimeError("FID / CLIP score cannot run here: missing " + "; ".join(missing))
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the cache or nothing: never a download
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.multimodal.clip_score import CLIPScore

    fid = FrechetInceptionDistance(feature=2048)
    fid.update(real, real=True)
    fid.update(fake, real=False)
    clip = CLIPScore(model_name_or_path=CLIP_MODEL)
    clip.update(fake, list(captions))
    return {"fid": float(fid.compute()), "clip_score": float(clip.compute())}


__all__ = ["caption_for", "CaptionTokenizer", "write_captioned_shards", "CaptionedShards",
           "TextToImageDiffusion", "EMAAndSamples", "image_grid", "train_diffusion",
           "default_widths", "fid_clip_status", "fid_and_clip"]
