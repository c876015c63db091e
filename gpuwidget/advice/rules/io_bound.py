"""io-bound: starved while the process (or its workers) mostly sleeps: batches wait on storage.

Storage is named only from the batch builders' measured sleep (their CPU and run delay, from
thread's CPU clock and kernel counters, over enough sampled waits: gpuwidget.advice.loader.MIN_SAMPLED_WAITS), never
from waiting alone, and only over a loop long enough to judge (gpuwidget.advice.evidence).

Waiting on storage overlaps, so workers beyond the core count help here (the starved
finding already sizes them); beyond that, the data should come from faster or local
storage, or be cached after the first epoch. Thresholds live in gpuwidget.advice.loader
(IO_WAIT_RATIO, WORKER_IDLE, IO_WORKERS_PER_CORE).
"""

from __future__ import annotations

from gpuwidget.advice.code import SHARDING_SENTENCE, loader_code, unsharded
from gpuwidget.advice.finding import Finding, FindingChange
from gpuwidget.advice.loader import diagnose
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.report import fmt_count, fmt_fraction

RULE = "io-bound"


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    d = diagnose(summary, workload, machine)
    if d is None or not d.starved or d.cause != "io":
        return None
    if d.num_workers == 0:
        why = (f"while blocked in next() the process used only {d.evidence.get('cpu_while_waiting', 0):.2f} "
               "CPU seconds per second: it was waiting on storage, not computing")
    else:
        why = (f"its {fmt_count(d.num_workers, 'worker')} {'was' if d.num_workers == 1 else 'were'} busy only "
               f"{fmt_fraction(d.workers_busy or 0)} of the time: "
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
        suggestion=(f"The loop waits {d.waited} and {why}. Because the waits overlap, "
                    f"{fmt_count(workers, 'worker')} ({_beside_cores(workers, d.usable_cpus)}) "
                    f"{'hides' if workers == 1 else 'hide'} them; copying the data to local disk or memory, or "
                    "caching samples after the first epoch, removes them."
                    + (SHARDING_SENTENCE if unsharded(d.loader, d.change) else "")),
        change=FindingChange(**d.change),
        code=loader_code(d.loader, d.change, workload),
        expected_speedup=round(d.gain, 2),
    )


def _beside_cores(workers: int, cores: int) -> str:
    """How the advised workers stand to the cores: "more than the 2 cores", "as many as the 4 cores"."""
    relation = "more than" if workers > cores else "as many as" if workers == cores else "fewer than"
    return f"{relation} the {fmt_count(cores, 'core')}"
