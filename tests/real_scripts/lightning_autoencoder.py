"""An autoencoder trained by the Lightning Trainer, in the shape of Lightning's
examples/pytorch/basics/autoencoder.py.

Kept from that example's shape: ``LitAutoEncoder`` (encoder and decoder ``nn.Sequential``,
``training_step``/``validation_step``/``test_step`` through one ``_common_step`` that logs its
loss, ``configure_optimizers`` with Adam), ``MyDataModule`` (a train/val ``random_split`` of the
training images, a test set, the four ``*_dataloader`` methods), the ``ImageSampler`` callback
that generates images from the decoder and saves them as a grid, ``cli_main()`` that fits, then
tests the best checkpoint.

Changed for this machine: the CPU (``accelerator="cpu"``); ``LightningCLI`` needs jsonargparse,
which is not installed here, so argparse reads the same settings (``--max_epochs``,
``--batch_size``, ``--hidden_dim``, ``--learning_rate``); the images are random 28x28 tensors
made in code instead of MNIST (no download); the grid is written as a PGM file without
torchvision. ``--sample_every_n_steps N`` makes ``ImageSampler`` run every N training batches
(the example runs it at each epoch end), generating ``--num_samples`` images each time, as a
callback that watches the model learn does.
"""

import argparse
import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning import Callback, LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split


class ImageSampler(Callback):
    """Images from the decoder, saved as one grid (a PGM file)."""

    def __init__(self, out_dir, num_samples=8, every_n_steps=0):
        super().__init__()
        self.out_dir, self.num_samples, self.every_n_steps = out_dir, num_samples, every_n_steps
        self.saved = 0

    def _sample(self, pl_module, tag):
        with torch.no_grad():
            pl_module.eval()
            z = torch.randn(self.num_samples, 3)
            images = pl_module.decoder(z).clamp(0, 1).reshape(-1, 28, 28)
            pl_module.train()
        grid = images[:64].reshape(-1, 28)  # a column of the first images
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"grid_{tag}.pgm"), "wb") as f:
            f.write(f"P5 28 {grid.shape[0]} 255\n".encode())
            f.write((grid * 255).to(torch.uint8).numpy().tobytes())
        self.saved += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every_n_steps and (trainer.global_step % self.every_n_steps == 0):
            self._sample(pl_module, f"step{trainer.global_step}")

    def on_train_epoch_end(self, trainer, pl_module):
        if not self.every_n_steps:
            self._sample(pl_module, f"epoch{trainer.current_epoch}")


class LitAutoEncoder(LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32, images: int = 2400):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        dataset = TensorDataset(torch.rand(images, 1, 28, 28, generator=generator), torch.zeros(images))
        self.mnist_test = TensorDataset(torch.rand(images // 8, 1, 28, 28, generator=generator),
                                        torch.zeros(images // 8))
        val = images // 8
        self.mnist_train, self.mnist_val = random_split(dataset, [images - val, val],
                                                        generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


def cli_main(argv=None):
    parser = argparse.ArgumentParser(description="Lightning autoencoder (tiny)")
    parser.add_argument("--max_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--images", type=int, default=2400)
    parser.add_argument("--hidden_dim", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=10e-3)
    parser.add_argument("--default_root_dir", type=str, default="lightning_logs_tiny")
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--sample_every_n_steps", type=int, default=0)
    args = parser.parse_args(argv)
    pl.seed_everything(1234, verbose=False)
    model = LitAutoEncoder(args.hidden_dim, args.learning_rate)
    datamodule = MyDataModule(args.batch_size, args.images)
    sampler = ImageSampler(os.path.join(args.default_root_dir, "samples"), args.num_samples,
                           args.sample_every_n_steps)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=args.max_epochs, callbacks=[sampler],
                      default_root_dir=args.default_root_dir, enable_progress_bar=False, logger=False,
                      enable_model_summary=False)
    trainer.fit(model, datamodule=datamodule)
    trainer.test(ckpt_path="best", datamodule=datamodule, verbose=False)
    print(f"trained {trainer.global_step} steps, saved {sampler.saved} sample grids")
    return trainer


if __name__ == "__main__":
    cli_main()
