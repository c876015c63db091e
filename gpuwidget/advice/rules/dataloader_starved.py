"""dataloader-starved: the loop spends a measurable share of its time blocked in ``next()``.

The suggested settings come from the measurement (see gpuwidget.advice.loader): the
number of workers from the time to produce a batch against the time to consume one,
capped by the cores this process may use; pin_memory with CUDA; persistent_workers when
the loader was iterated more than once; a larger prefetch_factor when waits are bursty.
Thresholds live in gpuwidget.advice.loader.
"""

from __future__ import annotations

from gpuwidget.advice.code import SHARDING_SENTENCE, loader_code, unsharded
from gpuwidget.advice.finding import Finding, FindingChange
from gpuwidget.advice.loader import diagnose
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.report import fmt_count, fmt_seconds

RULE = "dataloader-starved"
# Above this share of the loop spent waiting, the finding is critical.
CRITICAL_WAIT_FRACTION = 0.4


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    d = diagnose(summary, workload, machine)
    # Saturated CPUs and storage waits have their own findings, which carry the change.
    if d is None or not d.starved or d.cpu_saturated or d.cause == "io" or not d.change:
        return None
    change = d.change
    parts = []
    if "num_workers" in change:
        workers = change["num_workers"]
        parts.append(f"use {fmt_count(workers, 'worker process', 'worker processes')} (now {d.num_workers}) so "
                     "batches are built while the model works")
    if change.get("pin_memory"):
        parts.append("pin host memory so copies to the GPU are faster and can overlap")
    if change.get("persistent_workers"):
        parts.append("keep workers alive between epochs instead of restarting them")
    if "prefetch_factor" in change:
        parts.append(f"let each worker prepare {change['prefetch_factor']} batches ahead to absorb bursts")
    return Finding(
        rule=RULE,
        severity="critical" if d.wait_fraction >= CRITICAL_WAIT_FRACTION else "warn",
        title=f"The loop waits for data {d.waited} ({d.name})",
        evidence=d.evidence,
        suggestion=(f"Each step waited {fmt_seconds(d.wait_per_step)} for a batch and then computed for "
                    f"{fmt_seconds(d.compute_per_step)}. " + _sentence("; ".join(parts))
                    + (SHARDING_SENTENCE if unsharded(d.loader, change) else "")),
        change=FindingChange(**change),
        code=loader_code(d.loader, change, workload),
        expected_speedup=round(d.gain, 2),
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."
