"""A Lightning script: a LightningModule with save_hyperparameters and self.log, a Trainer with
strategy="ddp", checkpoints every few steps. It never imports gpu_lab."""
import argparse
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self, lr: float, width: int, pace: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 2))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        time.sleep(self.hparams.pace)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10, help="a checkpoint every N steps")
    p.add_argument("--pace", type=float, default=0.0)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, 0] > 0).long()
    trainer = L.Trainer(strategy="ddp", devices=a.devices, accelerator="cpu", max_steps=a.steps,
                        log_every_n_steps=2, default_root_dir=a.out, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[ModelCheckpoint(every_n_train_steps=a.every, save_top_k=-1)])
    trainer.fit(Model(lr=0.05, width=16, pace=a.pace), DataLoader(TensorDataset(x, y),
                                                                 batch_size=16))


if __name__ == "__main__":
    main()
