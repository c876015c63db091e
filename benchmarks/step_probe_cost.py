"""Step probe cost: what counting a loop's optimizer steps adds per step, and what counting one
step's FLOPs adds per watch.

(a) Per step, on the loop's thread: a minimal training step (a 1x1 ``nn.Linear`` forward and an
    ``SGD.step()`` with no gradients: almost nothing but torch's own call overhead) timed with and
    without the watch's probes installed (``gpuwidget.probes.Probes``: the optimizer's post hook and
    the trained model's forward pre-hook, after the model probe's first calls and the counted step),
    in alternating blocks, thread CPU time. The difference is the probe's cost per step. Also the
    sampler thread's cost per step of making spans of what the hooks queued (``Probes.poll``).
(b) Once per process, on the sampler thread: loading the FLOP counter (every torch dispatch mode
    imports ``torch._dynamo`` at its first dispatch), ``StepProbe.prepare``, wall and thread CPU
    seconds in this fresh process; counting waits for it, so it never lands in a step.
(c) Per watch: the counted step (FlopCounterMode entered at its first forward, left at its
    optimizer step) against the median of the steady steps, for an MLP, a small conv net and a tiny
    GPT-2 on the CPU, as "extra steps" (counted step / median step - 1).

Targets: (a) <= 2 us per step (the probes' hot-path budget); (b) <= 1 extra step per watch is the
aim (a CPU step of a tiny model is mostly Python dispatch, which the counter's dispatch mode
multiplies; it is reported as measured).

    .venv/bin/python benchmarks/step_probe_cost.py [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
import time
from typing import Any

from _common import median, parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths()

TARGET_NS_PER_STEP = 2000.0
TARGET_EXTRA_STEPS = 1.0


def step_cost(blocks: int, steps: int) -> dict[str, Any]:
    """Alternating blocks of bare and watched steps; each arm's lower decile of per-block means (on a
    shared host other tasks only ever add time, so the low end is the code's own cost)."""
    import torch

    from gpuwidget.clock import now
    from gpuwidget.probes import Probes
    from gpuwidget.trace import Trace

    torch.set_num_threads(1)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.zeros(1, 1)

    def run(count: int) -> float:
        """Thread CPU ns per step of ``count`` steps."""
        clock = time.thread_time_ns
        start = clock()
        for _ in range(count):
            model(x)
            optimizer.step()
        return (clock() - start) / count

    bare, watched, flush = [], [], []
    trace = Trace()
    trace.start_clock = now()
    probes = Probes(trace)
    probes.poll()
    run(64)  # past the model probe's first calls and the counted step: the steady state
    probes.poll()
    handles = list(probes._steps._handles) + list(probes._steps._forward_handles)
    try:
        for _ in range(blocks):
            watched.append(run(steps))
            started = time.thread_time_ns()
            probes.poll()
            flush.append((time.thread_time_ns() - started) / steps)
            # The same step without the hooks: torch's own hook dicts emptied and refilled in place.
            dicts = [(handle.hooks_dict_ref(), handle.id) for handle in handles]
            hooks = [(hooks, key, hooks[key]) for hooks, key in dicts if hooks is not None and key in hooks]
            for hooks_dict, key, _ in hooks:
                del hooks_dict[key]
            bare.append(run(steps))
            for hooks_dict, key, hook in hooks:
                hooks_dict[key] = hook
    finally:
        probes.uninstall()

    def low(values: list[float]) -> float:
        return sorted(values)[max(0, len(values) // 10)]

    return {"bare_ns": low(bare), "watched_ns": low(watched), "probe_ns": low(watched) - low(bare),
            "median_difference_ns": median(watched) - median(bare), "flush_ns": median(flush),
            "blocks": blocks, "steps_per_block": steps}


def prepare_cost() -> dict[str, Any]:
    from gpuwidget.probes.torch_steps import StepProbe
    from gpuwidget.trace import Trace

    already = "torch._dynamo" in sys.modules
    probe = StepProbe(Trace(), None)
    probe.steps, probe._model_class = 1, "Linear"  # as after a trained model's first step
    wall, cpu = time.perf_counter(), time.thread_time()
    probe.prepare()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu, "dynamo_was_loaded": already}


def counter_cost(steps: int, repeats: int) -> list[dict[str, Any]]:
    """Each model watched ``repeats`` times (one counted step per watch); the median watch is reported."""
    import torch
    from torch import nn

    import gpuwidget

    torch.manual_seed(0)
    from transformers import GPT2Config, GPT2LMHeadModel

    cases: list[tuple[str, nn.Module, Any]] = [
        ("MLP 64-256-256-10, batch 32",
         nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)),
         lambda m: nn.functional.cross_entropy(m(torch.randn(32, 64)), torch.randint(0, 10, (32,)))),
        ("conv net, 8x3x32x32",
         nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                       nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)),
         lambda m: nn.functional.cross_entropy(m(torch.randn(8, 3, 32, 32)), torch.randint(0, 10, (8,)))),
        ("GPT-2 2 layers, n_embd 64, 4x32 tokens",
         GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)),
         lambda m: (lambda ids: m(input_ids=ids, labels=ids).loss)(torch.randint(0, 256, (4, 32)))),
    ]
    rows = []
    for name, model, loss in cases:
        watches = []
        for _ in range(repeats):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with gpuwidget.watch(quiet=True, interval=0.1) as run:
                for _ in range(steps):
                    value = loss(model)
                    optimizer.zero_grad()
                    value.backward()
                    optimizer.step()
            training = run.workload["training"]
            step = median(training["step_times"][3:])
            counted = training.get("flops_step_s")
            watches.append({"case": name, "flops_per_step": training.get("flops_per_step"), "median_step_s": step,
                            "counted_step_s": counted,
                            "extra_steps": (counted / step - 1.0) if counted and step else float("nan")})
        rows.append(sorted(watches, key=lambda row: row["extra_steps"])[len(watches) // 2])
    return rows


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    info = print_header("gpuwidget step probe cost")
    blocks, steps, watched_steps = (20, 500, 20) if args.quick else (200, 2000, 60)
    prepared = prepare_cost()
    cost = step_cost(blocks, steps)
    print()
    print("(a) per step on the loop's thread, thread CPU ns (lower decile of alternating blocks)")
    table(["step", "bare", "probes installed", "probe's cost (median difference)", "spans made on the sampler thread"],
          [["1x1 Linear forward + SGD.step()", cost["bare_ns"], cost["watched_ns"],
            f"{cost['probe_ns']:.0f} ({cost['median_difference_ns']:.0f})", cost["flush_ns"]]])
    print()
    print("(b) loading the FLOP counter, once per process, on the sampler thread")
    table(["torch._dynamo loaded before", "wall", "thread CPU"],
          [[str(prepared["dynamo_was_loaded"]), f"{prepared['wall_s']:.2f} s", f"{prepared['cpu_s']:.2f} s"]])
    print()
    rows = counter_cost(watched_steps, 1 if args.quick else 5)
    print("(c) the counted step per watch (FlopCounterMode, forward and backward; the median of the watches)")
    table(["model", "FLOPs per step", "median step", "counted step", "extra steps"],
          [[r["case"], f"{r['flops_per_step']:.3g}", f"{1e3 * r['median_step_s']:.2f} ms",
            f"{1e3 * r['counted_step_s']:.2f} ms", r["extra_steps"]] for r in rows])
    print()
    worst = max(r["extra_steps"] for r in rows)
    verdicts = [
        verdict("step probe, ns per step on the loop's thread", cost["probe_ns"], TARGET_NS_PER_STEP,
                higher_is_better=False, shown=f"{cost['probe_ns']:.0f} ns",
                target_shown=f"{TARGET_NS_PER_STEP:.0f} ns"),
        verdict("FLOP counter, extra steps per watch (worst model)", worst, TARGET_EXTRA_STEPS,
                higher_is_better=False, shown=f"{worst:.2f}", target_shown=f"{TARGET_EXTRA_STEPS:.0f}"),
    ]
    write_json(args.json, {"benchmark": "step_probe_cost", "machine": info, "quick": args.quick,
                           "per_step": cost, "prepare": prepared, "counter": rows, "verdicts": verdicts})


if __name__ == "__main__":
    sys.exit(main())
