"""A Hugging Face Trainer script as its users write one: a tiny BERT built from a config (no
download), TrainingArguments from the command line, report_to left alone. It never imports
gpu_lab."""
import argparse
import json
import os
import time

import torch
from torch.utils.data import Dataset
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                          TrainingArguments)


class Tokens(Dataset):
    """Sequences whose label is whether their first token is above the middle: learnable."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(5, 100, (n, 16), generator=g)
        self.y = (self.x[:, 0] > 52).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


class Pace(TrainerCallback):
    """Steps that take at least `pace` seconds: a run long enough to stop."""

    def __init__(self, pace: float) -> None:
        self.pace = pace

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.pace)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pace", type=float, default=0.0)
    a = p.parse_args()
    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, learning_rate=a.lr,
                             per_device_train_batch_size=8, per_device_eval_batch_size=16,
                             logging_steps=2, save_steps=a.save_steps, eval_strategy="steps",
                             eval_steps=10, disable_tqdm=True, seed=0)
    trainer = Trainer(model=BertForSequenceClassification(cfg), args=args,
                      train_dataset=Tokens(256), eval_dataset=Tokens(64, seed=1),
                      callbacks=[Pace(a.pace)] if a.pace else None)
    seen = {"world_size": args.world_size, "num_processes": trainer.accelerator.num_processes,
            "process_index": trainer.accelerator.process_index,
            "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{seen['process_index']}.json"), "w") as f:
        json.dump(seen, f)
    trainer.train()


if __name__ == "__main__":
    main()
