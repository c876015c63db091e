"""io-bound: starved while the process (or its workers) mostly sleeps: batches wait on storage.

Storage is named only from the batch builders' measured sleep (their CPU and run delay, from
kernel counters, over enough sampled time: gpuwidget.advice.loader.MIN_SAMPLED_WAIT_S), never
from waiting alone, and only over a loop long enough to judge (gpuwidget.advice.evidence).

Waiting on storage overlaps, so workers beyond the core count help here (the starved
finding already sizes them); beyond that, the data should come from faster or local
storage, or be cached after the first epoch. Thresholds live in gpuwidget.advice.loader
(IO_WAIT_RATIO, WORKER_IDLE, IO_WORKERS_PER_CORE).
"""

from __future__ import annotations

from gpuwidget.advice.code import SHARDING_SENTENCE, loader_code, unsharded
from gpuwidget.advice.finding import Finding
from gpuwidget.advice.loader import diagnose
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "io-bound"


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    d = diagnose(summary, workload, machine)
    if d is None or not d.starved or d.cause != "io":
        return None
    if d.num_workers == 0:
        why = (f"while blocked in next() the process used only {d.evidence.get('cpu_while_waiting', 0):.2f} "
               "CPU seconds per second: it was waiting on storage, not computing")
    else:
        why = (f"its {d.num_workers} workers were busy only {100 * (d.workers_busy or 0):.0f}% of the time: "
               "they wait on storage")
    workers = d.change.get("num_workers", d.num_workers)
    evidence = dict(d.evidence)
    if summary.get("psi_io_some_mean") is not None:  # the host's own I/O pressure, beside the builders' sleep
        evidence["psi_io_some_percent"] = round(summary["psi_io_some_mean"], 1)
    return Finding(
        rule=RULE,
        severity="warn",
        title=f"Batches wait on storage ({d.name})",
        evidence=evidence,
        suggestion=(f"The loop waits {100 * d.wait_fraction:.0f}% of the time and {why}. Because the waits "
                    f"overlap, {workers} workers (more than the {d.usable_cpus} cores) hide them; copying the "
                    "data to local disk or memory, or caching samples after the first epoch, removes them."
                    + (SHARDING_SENTENCE if unsharded(d.loader, d.change) else "")),
        change=dict(d.change),
        code=loader_code(d.loader, d.change, workload),
        expected_speedup=round(d.gain, 2),
    )
