"""A nanoGPT-style trainer (the shape of karpathy/nanoGPT's train.py), small enough for a CPU.

Kept from that script's shape: module-level config globals overridden by ``--key=value``
arguments (its configurator), ``get_batch(split)`` taking random slices of a token file opened
anew with ``np.memmap`` per batch, the next batch fetched between a micro-step's forward and its
backward, gradient accumulation, gradient clipping, a cosine learning rate with linear warm-up,
``estimate_loss()`` and a checkpoint every ``eval_interval`` iterations, ``log_interval`` logging,
DDP when ``RANK`` is set, ``max_iters``.

Changed for this machine: the device is the CPU and the DDP backend gloo; the model is a tiny GPT
of this file's own (one block, 32 dims, a byte vocabulary: 256 tokens, no tokenizer); the token
files are written by :func:`prepare` from bytes made in code (no dataset download);
``storage_latency`` (seconds per ``get_batch`` call, default 0) stands for a slow network volume,
and ``eval_interval`` defaults past ``max_iters`` (no evaluation) unless set.
"""

import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# -----------------------------------------------------------------------------
# default config values
out_dir = "out-nanogpt"
eval_interval = 10_000
log_interval = 10
eval_iters = 4
always_save_checkpoint = True
gradient_accumulation_steps = 1
batch_size = 8
block_size = 32
n_layer = 1
n_head = 2
n_embd = 32
dropout = 0.0
learning_rate = 1e-3
max_iters = 60
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 10
lr_decay_iters = 60
min_lr = 1e-4
backend = "gloo"
device = "cpu"
storage_latency = 0.0
seed = 1337
# -----------------------------------------------------------------------------
config_keys = [k for k, v in list(globals().items())
               if not k.startswith("_") and isinstance(v, (int, float, bool, str))]


def configure(argv):
    """nanoGPT's configurator: ``--key=value`` overrides a global of the same name and type."""
    for arg in argv:
        key, _, value = arg[2:].partition("=")
        if not arg.startswith("--") or key not in config_keys:
            raise SystemExit(f"unknown config key: {arg}")
        current = globals()[key]
        if isinstance(current, bool):
            globals()[key] = value.lower() in ("1", "true", "yes")
        else:
            globals()[key] = type(current)(value)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), 1))

    def forward(self, idx, targets=None):
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def prepare(data_dir):
    """The dataset's train.bin and val.bin: uint16 tokens of a byte vocabulary, made here."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    text = bytes(rng.integers(32, 127, 200_000, dtype=np.uint8))
    for split, part in (("train", text[:180_000]), ("val", text[180_000:])):
        np.frombuffer(part, dtype=np.uint8).astype(np.uint16).tofile(os.path.join(data_dir, f"{split}.bin"))


# -----------------------------------------------------------------------------
configure(sys.argv[1:])
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    torch.distributed.init_process_group(backend=backend)
    rank = int(os.environ["RANK"])
    master_process = rank == 0
    seed_offset = rank
    world = int(os.environ["WORLD_SIZE"])
    assert gradient_accumulation_steps % world == 0 or gradient_accumulation_steps < world
    accumulation = max(1, gradient_accumulation_steps // world)
else:
    master_process, seed_offset, accumulation = True, 0, gradient_accumulation_steps
torch.manual_seed(seed + seed_offset)
data_dir = os.path.join(out_dir, "data")
if master_process:
    os.makedirs(out_dir, exist_ok=True)
    prepare(data_dir)
if ddp:
    torch.distributed.barrier()

# poor man's data loader
def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    if storage_latency:
        time.sleep(storage_latency)  # the volume's round trip
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)

model = GPT(vocab_size=256).to(device)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
raw_model = model
if ddp:
    model = nn.parallel.DistributedDataParallel(model)

@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            losses[k] = model(X, Y)[1].item()
        out[split] = losses.mean()
    model.train()
    return out

def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

iter_num, best_val_loss = 0, 1e9
X, Y = get_batch("train")
t0 = time.time()
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % eval_interval == 0 and iter_num > 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                          "iter_num": iter_num, "best_val_loss": best_val_loss}
            torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(accumulation):
        if ddp:
            model.require_backward_grad_sync = micro_step == accumulation - 1
        _, loss = model(X, Y)
        loss = loss / accumulation
        X, Y = get_batch("train")  # the next batch, while the device would still be busy
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        print(f"iter {iter_num}: loss {loss.item() * accumulation:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num >= max_iters:
        break
if ddp:
    del model  # DDP's model before its group: tests/gloo_job.py's fit() says why
    torch.distributed.destroy_process_group()
print(f"trained {iter_num} iterations")
