"""A loop whose step takes about one sampler interval: its wait's share, at a fixed cadence and dithered.

A nanoGPT-style loop (``get_batch`` sleeps for a storage read, a tiny model trains on the batch,
AdamW every step) is watched at ``--interval 0.01`` with ``gpuwidget.watch(quiet=True)``, its sleep
chosen so that a step takes 8-12 ms here. The wait it injects is timed around ``get_batch`` in the
same run; loop-waits' share of it comes from the stack samples. Each sleep is run ``--rounds``
times each way, in rotating order, in one process: ``fixed`` (``gpuwidget.sampler.DITHER`` set to 0:
tick ``k`` due at ``start + k * interval``) and ``dithered`` (as shipped). Reported: the step's time,
the injected share and the error of the stack's figure (its share less the injected), per sleep and
way, and the mean error of each way.

    .venv/bin/python benchmarks/stack_aliasing.py [--quick] [--json PATH] [--rounds N]
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _common import parse_args, print_header, setup_paths, table, write_json
from torch import nn
from torch.nn import functional as F

setup_paths()

import gpuwidget  # noqa: E402
from gpuwidget import sampler  # noqa: E402

SHIPPED = sampler.DITHER
SLEEPS_S = (0.004, 0.0055, 0.0072, 0.0078, 0.0085)
STEPS = 400


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        return self.head(x + self.mlp(x))


def one_run(sleep_s: float, dither: float, steps: int) -> dict[str, float]:
    sampler.DITHER = dither
    torch.manual_seed(0)
    data = torch.randint(0, 64, (50_000,))
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(sleep_s)  # reading the token file
        ix = torch.randint(len(data) - 16, (8,))
        return (torch.stack([data[i:i + 16] for i in ix]), torch.stack([data[i + 1:i + 17] for i in ix]))

    fetch_s = 0.0
    with gpuwidget.watch(quiet=True, interval=0.01) as run:
        started = time.perf_counter()
        for _ in range(steps):
            fetch_started = time.perf_counter()
            x, y = get_batch()
            fetch_s += time.perf_counter() - fetch_started
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        loop_s = time.perf_counter() - started
    sampler.DITHER = SHIPPED
    waits = [w for w in run.workload.get("loop_waits", []) if w["function"] == "get_batch"]
    share = waits[0]["share"] if waits else 0.0
    return {"step_ms": 1e3 * loop_s / steps, "injected": fetch_s / loop_s, "error": share - fetch_s / loop_s}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--rounds", {"type": int, "default": 2})])
    info = print_header("Stack samples of a loop whose step takes about one interval: fixed and dithered ticks")
    torch.set_num_threads(1)
    sleeps = SLEEPS_S[1:3] if args.quick else SLEEPS_S
    rounds = 1 if args.quick else args.rounds
    steps = 150 if args.quick else STEPS
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    ways = (("fixed", 0.0), ("dithered", SHIPPED))
    for round_ in range(rounds):
        for sleep_s in sleeps:
            order = ways if (round_ + sleeps.index(sleep_s)) % 2 == 0 else ways[::-1]
            for name, dither in order:
                results.setdefault(f"{sleep_s:g}", {}).setdefault(name, []).append(one_run(sleep_s, dither, steps))
    rows: list[list[Any]] = []
    errors: dict[str, list[float]] = {name: [] for name, _ in ways}
    for sleep, by_way in results.items():
        for name, _ in ways:
            runs = by_way[name]
            errors[name].extend(r["error"] for r in runs)
            rows.append([f"{float(sleep) * 1e3:g} ms sleep", name,
                         " ".join(f"{r['step_ms']:.1f}" for r in runs),
                         " ".join(f"{r['injected']:.2f}" for r in runs),
                         " ".join(f"{r['error']:+.3f}" for r in runs)])
    table(["loop", "ticks", "step ms", "injected", "stack share - injected"], rows)
    for name, values in errors.items():
        print(f"  {name}: mean error {sum(values) / len(values):+.3f}, worst {max(values, key=abs):+.3f}"
              f" ({len(values)} runs)")
    write_json(args.json, {"machine": info, "results": results,
                           "mean_error": {name: sum(v) / len(v) for name, v in errors.items()}})


if __name__ == "__main__":
    main()
