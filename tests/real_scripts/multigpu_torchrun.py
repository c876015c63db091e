"""A DDP training job started by torchrun, in the shape of PyTorch's
examples/distributed/ddp-tutorial-series/multigpu_torchrun.py.

Kept from that script's shape: ``ddp_setup()`` from torchrun's environment, the ``Trainer`` class
(``_run_batch``, ``_run_epoch`` with ``sampler.set_epoch``, ``_save_snapshot`` every
``save_every`` epochs on rank 0, ``_load_snapshot`` to resume), ``load_train_objs()`` (a dataset
of random pairs, a linear model, SGD), ``prepare_dataloader()`` with a ``DistributedSampler``,
``main(save_every, total_epochs, batch_size, snapshot_path)`` and its argparse (``total_epochs``,
``save_every``, ``--batch_size``).

Changed for this machine: the CPU and gloo instead of CUDA devices and nccl (no
``torch.cuda.set_device``, no ``device_ids``, ``pin_memory`` off); the dataset has 512 pairs of
20 features by default (``--size``); ``--straggler RANK --delay S`` makes one rank spend S seconds
more on each batch (a slower node, a noisy neighbour); the snapshot goes to ``--snapshot_path``.
"""

import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        generator = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, straggler=-1, delay=0.0):
        self.rank = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.delay = delay if self.rank == straggler else 0.0
        self.steps = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self.steps += 1

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[rank{self.rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            if self.delay:
                time.sleep(self.delay)  # this rank's node is slower
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs(size):
    train_set = MyTrainDataset(size)
    model = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt", size=512, straggler=-1, delay=0.0):
    ddp_setup()
    dataset, model, optimizer = load_train_objs(size)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, straggler, delay)
    trainer.train(total_epochs)
    print(f"[rank{trainer.rank}] trained {trainer.steps} steps")
    del trainer, model  # DDP's model before its group: tests/gloo_job.py's fit() says why
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=8, type=int, help="Input batch size on each device (default: 8)")
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--size", default=512, type=int)
    parser.add_argument("--straggler", default=-1, type=int, help="the rank that is slower")
    parser.add_argument("--delay", default=0.0, type=float, help="seconds more per batch on that rank")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.size, args.straggler,
         args.delay)
