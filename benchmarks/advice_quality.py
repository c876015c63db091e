"""Advice quality: does each workload get the right finding, and does following it (or the tuner) pay off?

For six real torch workloads with known causes (tests/workloads.py), the cell is watched
and the rules that fired are listed. For each loader case the finding's ``.change`` is
applied to the same loader and its throughput (samples/s over one epoch, worker start-up
included, unwatched) is compared with the best of an exhaustive sweep of ``num_workers``
on this machine. Target: following the advice reaches >= 90% of the sweep's best on every
loader case. The tuner (``tune_for_run``, 20 s budget) is run on the same loaders: its
choice's throughput against the sweep's best (target >= 0.95) and its wall time (target
<= 20 s). Last, the batch-size probe on the CPU: the throughput of its recommended size
against the best of a sweep of batch sizes.

    .venv/bin/python benchmarks/advice_quality.py [--quick] [--json PATH]
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from _common import parse_args, print_header, setup_paths, table, verdict, write_json

setup_paths(fake_nvml=True)

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import gpuwidget  # noqa: E402
from gpuwidget.measure.batch_probe import probe_batch_size  # noqa: E402
from gpuwidget.measure.tuner import tune_for_run  # noqa: E402
from gpuwidget.probes.torch_data import loader_kwargs  # noqa: E402

import workloads  # noqa: E402

# torch warns when workers outnumber cores; beyond-core workers are the point for storage waits.
warnings.filterwarnings("ignore", message="This DataLoader will create")

TARGET = 0.90
TUNER_TARGET = 0.95
TUNER_BUDGET_S = 20.0
SWEEP = (0, 1, 2, 3, 4, 6, 8, 12)


def throughput(workload: workloads.Workload, loader: DataLoader, repeats: int) -> float:
    """Best-of-``repeats`` samples/s for one epoch (the best run is the least disturbed)."""
    best = 0.0
    samples = len(loader.dataset)  # type: ignore[arg-type]
    for _ in range(repeats):
        started = time.perf_counter()
        workload.train(loader)
        best = max(best, samples / (time.perf_counter() - started))
    return best


def watched(workload: workloads.Workload) -> gpuwidget.Run:
    train_loader, train_ds, model = workload.loader, workload.loader.dataset, workload.model  # noqa: F841
    with gpuwidget.watch(quiet=True, interval=0.1) as run:
        workload.train(train_loader)
    return run


def cases(quick: bool) -> list[workloads.Workload]:
    scale = 0.5 if quick else 1.0
    items = int(480 * scale)
    under_provisioned = workloads.cpu_heavy_transform(items=items, cost=0.004)
    under_provisioned.loader = DataLoader(under_provisioned.loader.dataset, batch_size=16, shuffle=True,
                                          num_workers=1)
    under_provisioned.name = "cpu-heavy transform, num_workers=1"
    sleeping_workers = workloads.slow_storage(items=items)
    sleeping_workers.loader = DataLoader(sleeping_workers.loader.dataset, batch_size=16, shuffle=True,
                                         num_workers=2)
    sleeping_workers.name = "storage-bound dataset, num_workers=2"
    return [
        workloads.cpu_heavy_transform(items=items),
        workloads.slow_storage(items=items),
        under_provisioned,
        sleeping_workers,
        workloads.healthy(items=int(2048 * scale)),
        workloads.periodic_checkpoint(),  # short runs have too few stalls to show a period
    ]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    info = print_header("Advice quality: the finding each workload gets, and the gain from following it")
    torch.set_num_threads(1)
    repeats = 1 if args.quick else 2
    rows: list[list[Any]] = []
    results: list[dict[str, Any]] = []
    verdicts = []
    for workload in cases(args.quick):
        run = watched(workload)
        fired = [f.rule for f in run.findings]
        with_change = next((f for f in run.findings if f.change and "num_workers" in f.change), None)
        result: dict[str, Any] = {"workload": workload.name, "expected": sorted(workload.expected),
                                  "rules": fired, "data_wait_fraction": run.summary.get("data_wait_fraction")}
        if with_change is None:
            rows.append([workload.name, ", ".join(fired) or "(none)", "-", "-", "-", "-", "-"])
            results.append(result)
            continue
        advised = throughput(workload, DataLoader(**loader_kwargs(workload.loader, with_change.change)), repeats)
        sweep = {}
        for workers in SWEEP:
            loader = DataLoader(**loader_kwargs(workload.loader, {"num_workers": workers}))
            sweep[workers] = throughput(workload, loader, repeats)
        best_workers = max(sweep, key=sweep.__getitem__)
        ratio = advised / sweep[best_workers]
        result.update(change=with_change.change, advised_samples_per_s=advised, sweep=sweep,
                      best_num_workers=best_workers, ratio_to_best=ratio,
                      baseline_samples_per_s=sweep.get(workload.loader.num_workers))
        tuned = tune_for_run(run, workload.loader, budget_s=TUNER_BUDGET_S)
        tuned_rate = throughput(workload, tuned.loader(), repeats)
        tuner_ratio = tuned_rate / sweep[best_workers]
        result.update(tuner_change=tuned.change, tuner_samples_per_s=tuned_rate, tuner_ratio=tuner_ratio,
                      tuner_wall_s=tuned.elapsed_s)
        rows.append([workload.name, ", ".join(fired), str(with_change.change), f"{advised:.0f}",
                     f"{sweep[best_workers]:.0f} (num_workers={best_workers})", f"{ratio:.2f}",
                     f"{tuned.change.get('num_workers')} workers, {tuner_ratio:.2f}, {tuned.elapsed_s:.1f} s"])
        results.append(result)
        verdicts.append(verdict(f"{workload.name}: advice / best sweep", ratio, TARGET, higher_is_better=True,
                                shown=f"{ratio:.2f}", target_shown=f"{TARGET:.2f}"))
        verdicts.append(verdict(f"{workload.name}: tuner / best sweep", tuner_ratio, TUNER_TARGET,
                                higher_is_better=True, shown=f"{tuner_ratio:.2f}", target_shown=f"{TUNER_TARGET:.2f}"))
        verdicts.append(verdict(f"{workload.name}: tuner wall time", tuned.elapsed_s, TUNER_BUDGET_S,
                                higher_is_better=False, shown=f"{tuned.elapsed_s:.1f} s",
                                target_shown=f"{TUNER_BUDGET_S:.0f} s"))
    print()
    table(["workload", "rules fired", "change", "advised samples/s", "best of sweep", "ratio",
           "tuner: choice, ratio, wall"], rows)
    for result in results:
        missing = set(result["expected"]) - set(result["rules"])
        if missing:
            print(f"MISS  {result['workload']}: expected {sorted(missing)} not fired")
    batch = batch_probe_quality(args.quick)
    verdicts.append(batch.pop("verdict"))
    write_json(args.json, {"machine": info, "results": results, "batch_probe": batch, "verdicts": verdicts})


def batch_probe_quality(quick: bool) -> dict[str, Any]:
    """The probe's recommended batch size against an exhaustive sweep of sizes, on the CPU."""
    model = workloads.mlp(hidden=1024, layers=3)
    example = (torch.randn(32, 256), torch.randint(0, 10, (32,)))
    loss = torch.nn.functional.cross_entropy
    probe = probe_batch_size(model, example, loss, max_batch=1024, budget_s=20)
    sizes = [8, 16, 32, 64, 128, 256, 512] + ([] if quick else [1024])
    sweep = {}
    for size in sizes:
        best = 0.0
        for _ in range(3):
            x, y = torch.randn(size, 256), torch.randint(0, 10, (size,))
            started = time.perf_counter()
            steps = 0
            while time.perf_counter() - started < 0.3:
                model.zero_grad()
                loss(model(x), y).backward()
                steps += 1
            best = max(best, steps * size / (time.perf_counter() - started))
        sweep[size] = best
    best_size = max(sweep, key=sweep.__getitem__)
    chosen = sweep.get(probe.recommended) or next(t.samples_per_s for t in probe.trials
                                                   if t.batch_size == probe.recommended)
    ratio = chosen / sweep[best_size]
    print()
    print(f"Batch-size probe on the CPU: recommended {probe.recommended} in {probe.elapsed_s:.1f} s; "
          f"sweep best {best_size} at {sweep[best_size]:,.0f} samples/s; recommended size at {chosen:,.0f}")
    table(["batch size", "samples/s (sweep)"], [[str(k), f"{v:,.0f}"] for k, v in sweep.items()])
    return {"recommended": probe.recommended, "elapsed_s": probe.elapsed_s, "sweep": sweep,
            "best_size": best_size, "ratio": ratio,
            "verdict": verdict("batch probe: recommended size / best of sweep", ratio, TUNER_TARGET,
                               higher_is_better=True, shown=f"{ratio:.2f}", target_shown=f"{TUNER_TARGET:.2f}")}


if __name__ == "__main__":
    main()
