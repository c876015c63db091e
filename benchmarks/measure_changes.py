"""Run.measure on real CPU training loops: per change and model, the measured speed-up against the
predicted one, the interval's width and the time to decide.

For an MLP, a small conv net and a tiny GPT-2 (from a config), each trained under ``gpuwidget.watch``
with the loss the loop used: every uncompiled change key measured with ``run.measure(change,
budget_s=30)`` (``--compile`` adds ``compile`` on the MLP). For each: the median speed-up and its 95%
interval (gpuwidget.measure.stats), the interval's half-width, the verdict, the time at which the
verdict last changed to its final value ("decided") and the whole measurement's time. "Predicted" is
the bound a finding gives (the GPU rules: none on the CPU, shown as "-"); "own" is a timing of the same
change done here by hand (interleaved steps, each side's fastest), as a check on the verdict.

Targets: a verdict within 30 s for an uncompiled change; the interval's half-width <= 5%.

    .venv/bin/python benchmarks/measure_changes.py [--quick] [--compile] [--threads N] [--json PATH]
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

from _common import parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths()

TARGET_DECIDE_S = 30.0
TARGET_HALF_WIDTH = 0.05


def mlp() -> tuple[Any, Callable[[Any, Any], Any], Any]:
    import torch
    from torch import nn

    import gpuwidget

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    features, labels = torch.randn(64, 128), torch.randint(0, 10, (64,))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(12):
            x, y = features, labels
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run, lambda m, b: criterion(m(b[0]), b[1]), ((features, labels), model, optimizer)


def conv() -> tuple[Any, Callable[[Any, Any], Any], Any]:
    import torch
    from torch import nn

    import gpuwidget

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    images, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(12):
            x, y = images, labels
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run, lambda m, b: criterion(m(b[0]), b[1]), ((images, labels), model, optimizer)


def gpt2() -> tuple[Any, Callable[[Any, Any], Any], Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import gpuwidget

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (8, 32))
    with gpuwidget.watch(quiet=True) as run:
        for _ in range(10):
            batch = {"input_ids": ids, "labels": ids}
            loss = model(**batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run, lambda m, b: m(**b).loss, ({"input_ids": ids, "labels": ids}, model, optimizer)


def own_ratio(loss: Callable[[Any, Any], Any], objects: Any, change: dict[str, Any], steps: int) -> float:
    """The change by hand on copies: throughput changed / unchanged, each side's fastest of ``steps``."""
    import torch

    batch, model, optimizer = objects

    def make(apply: bool) -> tuple[Callable[[], None], int]:
        m, o = copy.deepcopy((model, optimizer))
        b = batch
        rows = next(iter(b.values())).shape[0] if isinstance(b, dict) else b[0].shape[0]
        if apply and change.get("channels_last"):
            m = m.to(memory_format=torch.channels_last)
            b = tuple(t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t for t in b)
        if apply and change.get("fused_optimizer"):
            o = type(o)([{"params": g["params"]} for g in o.param_groups], fused=True, lr=o.param_groups[0]["lr"])
        if apply and "batch_size" in change:
            index = torch.arange(change["batch_size"]) % rows
            b = {k: v[index] for k, v in b.items()} if isinstance(b, dict) else tuple(t[index] for t in b)
            rows = change["batch_size"]
        forward = torch.compile(m) if apply and change.get("compile") else m
        dtype = change.get("autocast") if apply else None

        def step() -> None:
            with torch.autocast("cpu", dtype=getattr(torch, dtype or "bfloat16"), enabled=dtype is not None):
                value = loss(forward, b)
            value.backward()
            o.step()
            o.zero_grad(set_to_none=True)

        return step, rows

    (a, rows_a), (b_step, rows_b) = make(False), make(True)
    for step in (a, b_step, a, b_step):
        step()
    best = [math.inf, math.inf]
    for _ in range(steps):
        for index, step in enumerate((a, b_step)):
            began = time.perf_counter()
            step()
            best[index] = min(best[index], time.perf_counter() - began)
    return (rows_b / best[1]) / (rows_a / best[0])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [
        ("--compile", {"action": "store_true", "help": "also measure torch.compile on the MLP (slow)"}),
        ("--threads", {"type": int, "default": 0, "help": "torch threads (default: torch's own)"})])
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    info = print_header(f"Run.measure on CPU training loops ({torch.get_num_threads()} torch threads)")
    budget = 5.0 if args.quick else 30.0
    changes: dict[str, list[dict[str, Any]]] = {
        "mlp": [{"autocast": "bfloat16"}, {"tf32": True}, {"fused_optimizer": True}, {"batch_size": 256}],
        "conv": [{"autocast": "bfloat16"}, {"channels_last": True}, {"fused_optimizer": True}],
        "gpt2": [{"autocast": "bfloat16"}, {"fused_optimizer": True}, {"batch_size": 4}],
    }
    if args.compile:
        changes["mlp"].append({"compile": True})
    if args.quick:
        changes = {"mlp": changes["mlp"][:2]}
    rows, results, verdicts = [], [], []
    for name, case in (("mlp", mlp), ("conv", conv), ("gpt2", gpt2)):
        if name not in changes:
            continue
        run, loss, objects = case()
        for change in changes[name]:
            measured = run.measure(change, budget_s=budget)
            own = own_ratio(loss, objects, change, steps=10 if args.quick else 30)
            half = measured.half_width
            key = ", ".join(f"{k}={v}" for k, v in change.items())
            rows.append([name, key, "-", measured.speedup or float("nan"),
                         f"[{measured.ci[0]:.2f}, {measured.ci[1]:.2f}]" if measured.ci else "-",
                         f"{100 * half:.1f}%" if half is not None else "-", measured.verdict, own,
                         f"{measured.decided_s:.1f} s" if measured.decided_s is not None else "-",
                         f"{measured.elapsed_s:.1f} s", measured.blocks])
            results.append({"model": name, "change": change, "predicted": None, "own": own, **measured.to_dict()})
    table(["model", "change", "predicted", "measured", "95% interval", "half-width", "verdict", "own",
           "decided", "took", "blocks"], rows)
    uncompiled = [r for r in results if "compile" not in r["change"]]
    slowest = max((r["elapsed_s"] for r in uncompiled), default=float("nan"))
    widths = sorted(r["ci"][1] / 2 / r["speedup"] - r["ci"][0] / 2 / r["speedup"] for r in uncompiled if r["ci"])
    median_width = widths[len(widths) // 2] if widths else float("nan")
    verdicts.append(verdict("verdict of an uncompiled change within", slowest, TARGET_DECIDE_S,
                            higher_is_better=False, shown=f"{slowest:.1f} s (the slowest)", target_shown="30 s"))
    verdicts.append(verdict("interval half-width (median over changes)", median_width, TARGET_HALF_WIDTH,
                            higher_is_better=False, shown=f"{100 * median_width:.1f}%", target_shown="5%"))
    disagree = [r for r in results if (r["own"] < 0.9 and r["verdict"] == "faster")
                or (r["own"] > 1.1 and r["verdict"] == "slower")]
    print(f"verdicts against the own timing: {len(results) - len(disagree)} of {len(results)} agree")
    write_json(args.json, {"machine": info, "results": results, "verdicts": verdicts})


if __name__ == "__main__":
    main()
