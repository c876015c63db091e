"""Advice on real frameworks: does every loader finding's code run as pasted, keep the samples,
name the right cause and pay off, on training code written the way frameworks write it?

The cases are tests/frameworks.py's: a batch_sampler= loader, dict batches, tqdm, a sharded and
an unsharded IterableDataset, a torchvision-style transform pipeline, a loader built in an
imported function, accelerate, the Hugging Face Trainer and the Lightning Trainer. Each runs
starved (storage: a sleep per item; the transforms: CPU decoding per item), healthy (no
latency, more compute per step), and the storage-bound ones again under two unrelated CPU
hogs (``while True: pass`` processes that are not ours). Per case: the rules fired; the cause
diagnosed against the right one; every loader finding's ``.code`` executed in the case's
namespace (ok / the error) and the loader's samples compared before and after (one seeded
epoch); the advice applied (the code where it rebinds a loader, else the finding's change
where the loader is built) and its samples/s against the best of a num_workers sweep of the
same loader (one epoch with the loop's per-step compute; batches an unsharded stream repeats
per worker do not count); the gain the finding expected against the one measured over the
loader as it was. Targets: every .code runs and keeps the samples; the right cause in every
starved case, hogs included; advice >= 0.9 of the sweep's best; no loader finding on a
healthy loop.

    .venv/bin/python benchmarks/advice_wild.py [--quick] [--json PATH]

With ``--real-scripts``: well-known public training scripts in their own shapes instead (loops that
fetch their own batches, a DDP job, the warm-up cases): benchmarks/_real_scripts.py.

    .venv/bin/python benchmarks/advice_wild.py --real-scripts [--quick] [--json PATH]
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from typing import Any

from _common import parse_args, print_header, setup_paths, verdict, write_json

setup_paths(fake_nvml=True)  # also puts tests/ on the path, for tests/frameworks.py

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gpuwidget.advice.loader import diagnose  # noqa: E402
from gpuwidget.measure.tuner import copies_per_batch  # noqa: E402
from gpuwidget.probes.torch_data import loader_kwargs  # noqa: E402

import frameworks  # noqa: E402
from support import hogs  # noqa: E402

warnings.filterwarnings("ignore")  # torch's worker-count warning, frameworks' deprecations
for noisy in ("pytorch_lightning", "lightning", "lightning.pytorch", "transformers"):
    logging.getLogger(noisy).setLevel(logging.ERROR)

RATIO_TARGET = 0.9
SWEEP = (0, 1, 2, 4, 8, 12, 16)
QUICK_SWEEP = (0, 2, 8)
STARVED_LATENCY_S = 0.004  # per item: 32 ms per batch of 8 to read or decode
STARVED_STEP_S = 0.002  # the loop's own compute per step
HEALTHY_STEP_S = 0.010  # 8 samples through torch-op transforms take ~0.4 ms: a 4% wait
HOG_LIFETIME_S = 600  # a hog ends by itself after this, whatever happens to the benchmark


def epoch_rate(loader: Any, step_s: float) -> float:
    """New samples per second over one epoch, the loop computing ``step_s`` per batch (worker
    start-up included; copies an unsharded stream's workers repeat are not new)."""
    started = time.perf_counter()
    samples = 0
    for batch in loader:
        samples += frameworks.batch_size(batch)
        frameworks.burn(step_s)
    elapsed = time.perf_counter() - started
    return samples / copies_per_batch(getattr(loader, "base_dataloader", loader), loader.num_workers) / elapsed


def rebuilt(loader: Any, change: dict[str, Any]) -> DataLoader:
    return DataLoader(**loader_kwargs(getattr(loader, "base_dataloader", loader), change))


def measure(case: frameworks.Case, variant: str, items: int, sweep: tuple[int, ...],
            repeats: int) -> dict[str, Any]:
    starved = variant != "healthy"
    step_s = STARVED_STEP_S if starved else HEALTHY_STEP_S
    case = next(c for c in frameworks.cases(STARVED_LATENCY_S if starved else 0.0, items) if c.name == case.name)
    namespace, run = frameworks.run_case(case, tempfile.mkdtemp(prefix="advice_wild"), step_s=step_s)
    findings = frameworks.loader_findings(run)
    diagnosis = diagnose(run.summary, run.workload, run.machine)
    result: dict[str, Any] = {
        "case": case.name, "variant": variant, "rules": [f.rule for f in run.findings],
        "loader_rules": [f.rule for f in findings], "expected_cause": case.cause if starved else None,
        "cause": diagnosis.cause if diagnosis else None,
        "data_wait_fraction": run.summary.get("data_wait_fraction"),
    }
    if not starved or not findings:
        return result
    torch.manual_seed(0)
    base = eval(case.sweep_loader, namespace)  # the loader as the loop had it, before any code runs
    checks = [frameworks.check_code(f.code, namespace, case) for f in findings]
    result["code"] = [c.error or "ok" for c in checks]
    result["samples_equal"] = [c.same_samples for c in checks]
    with_workers = next((f for f in findings if "num_workers" in f.change), findings[0])
    result["change"] = dict(with_workers.change)
    result["expected_gain"] = with_workers.evidence.get("expected_gain")
    applied_by_code = case.loader is not None and any(c.changed for c in checks)
    if applied_by_code:
        torch.manual_seed(0)
        applied = eval(case.loader, namespace)
    elif with_workers.change and not frameworks.shows_sharding(with_workers.code):
        applied = rebuilt(base, with_workers.change)
    else:
        # The code only explains (sharding first, what to cache): the loader stays as it was.
        applied = base
    # Round-robin, best of `repeats` each: the least disturbed epoch of every setting.
    loaders: dict[Any, Any] = {"advised": applied, "as it was": base}
    loaders.update({workers: rebuilt(base, {"num_workers": workers}) for workers in sweep})
    best_rates: dict[Any, float] = {key: 0.0 for key in loaders}
    for _ in range(repeats):
        for key, loader in loaders.items():
            best_rates[key] = max(best_rates[key], epoch_rate(loader, step_s))
    advised, as_it_was = best_rates.pop("advised"), best_rates.pop("as it was")
    rates = {int(key): rate for key, rate in best_rates.items()}
    best = max(rates, key=rates.__getitem__)
    result.update(applied_by_code=applied_by_code, samples_per_s=advised, as_it_was=as_it_was, sweep=rates,
                  best_workers=best, ratio_to_best=advised / rates[best])
    if applied is not base:
        result["measured_gain"] = advised / as_it_was
    return result


def row(result: dict[str, Any]) -> list[str]:
    def fmt(value: Any, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    cause = "-" if result["expected_cause"] is None else (
        f"{result['cause']} ({'right' if result['cause'] == result['expected_cause'] else 'WRONG'})")
    code = ", ".join(result.get("code") or []) or "-"
    compared = result.get("samples_equal") or []
    samples = ", ".join("equal" if same is not False else "CHANGED" for same in compared) or "-"
    ratio = "-" if "ratio_to_best" not in result else (
        f"{result['ratio_to_best']:.2f} ({result['samples_per_s']:.0f} / {result['sweep'][result['best_workers']]:.0f}"
        f" at {result['best_workers']})")
    gain = "-" if "measured_gain" not in result else f"{fmt(result['expected_gain'])} / {result['measured_gain']:.2f}"
    return [result["case"], result["variant"], ", ".join(result["rules"]) or "(none)", cause, code, samples,
            ratio, gain]


def all_of(name: str, hits: int, total: int) -> dict[str, Any]:
    return verdict(name, hits / max(1, total), 1.0, higher_is_better=True, shown=f"{hits}/{total}",
                   target_shown="all")


def real_scripts(args: Any) -> None:
    import _real_scripts

    info = print_header("Advice on real public training scripts: steps, cause, code as pasted, gain")
    rows = _real_scripts.run_all(args.quick)
    print()
    print("| " + " | ".join(_real_scripts.HEADERS) + " |")
    print("|" + "---|" * len(_real_scripts.HEADERS))
    for row in rows:
        print("| " + " | ".join(_real_scripts.format_row(row)) + " |")
    print()
    codes = [row["code"] for row in rows if row["code"] != "-"]
    verdicts = [all_of("right cause (none critical on a steady loop)", sum(row["right"] for row in rows), len(rows)),
                all_of(".code runs as pasted", codes.count("ok"), len(codes))]
    write_json(args.json, {"machine": info, "results": rows, "verdicts": verdicts})


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], [("--real-scripts", {"action": "store_true",
                                                                      "help": "the real public scripts instead"})])
    if args.real_scripts:
        real_scripts(args)
        return
    info = print_header("Advice on real frameworks: code runs as pasted, samples kept, cause, gain")
    torch.set_num_threads(1)
    # 64 steps an epoch: short next to real training, long enough that starting 8 workers
    # (about 0.2 s here) is not most of it.
    items = 64 if args.quick else 512
    sweep = QUICK_SWEEP if args.quick else SWEEP
    repeats = 1 if args.quick else 3
    results = []
    for case in frameworks.cases():
        if not frameworks.available(case):
            print(f"skipped {case.name}: {case.frameworks} not installed")
            continue
        variants = ["starved", "healthy"] + (["starved, 2 hogs"] if case.cause == "io" and not args.quick else [])
        for variant in variants:
            if variant.endswith("hogs"):
                with hogs(2, HOG_LIFETIME_S):
                    result = measure(case, variant, items, sweep, repeats)
            else:
                result = measure(case, variant, items, sweep, repeats)
            results.append(result)
            print("  " + " | ".join(row(result)), flush=True)
    headers = ["case", "variant", "rules fired", "cause", ".code", "samples", "advice / sweep best (samples/s)",
               "gain expected / measured"]
    print()
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for result in results:
        print("| " + " | ".join(row(result)) + " |")
    print()
    starved = [r for r in results if r["variant"] != "healthy"]
    codes = [c for r in starved for c in r.get("code") or []]
    samples = [s for r in starved for s in r.get("samples_equal") or []]
    ratios = [r["ratio_to_best"] for r in starved if "ratio_to_best" in r]
    healthy_with_finding = sum(bool(r["loader_rules"]) for r in results if r["variant"] == "healthy")
    verdicts = [
        all_of("loader finding on every starved loop", sum(bool(r["loader_rules"]) for r in starved), len(starved)),
        all_of(".code runs as pasted", codes.count("ok"), len(codes)),
        all_of(".code keeps the samples", sum(s is not False for s in samples), len(samples)),
        all_of("right cause", sum(r["cause"] == r["expected_cause"] for r in starved), len(starved)),
        verdict("advice / sweep best, worst case", min(ratios, default=0.0), RATIO_TARGET, higher_is_better=True,
                shown=f"{min(ratios, default=0.0):.2f}", target_shown=f"{RATIO_TARGET:.2f}"),
        verdict("healthy loops with a loader finding", healthy_with_finding, 0, higher_is_better=False,
                shown=str(healthy_with_finding), target_shown="0"),
    ]
    write_json(args.json, {"machine": info, "results": results, "verdicts": verdicts})


if __name__ == "__main__":
    main()
