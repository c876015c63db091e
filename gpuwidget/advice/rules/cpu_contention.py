"""cpu-contention: other processes hold the cores the loop and its batch builders need.

On a shared GPU server other users' jobs often fill the cores. The loop's thread and the
DataLoader's builders are then ready to run but queued for a core (the kernel's run delay,
/proc/<pid>/schedstat), while processes outside this process tree keep the cores busy. That
is the machine, not the code: the finding names the share of time lost and who to look at.
It is named whenever the loop's own threads lose time waiting for a core, whether the loader
is starved or not (a loop beside two busy processes ran 3.5x slower, its main thread queued
65% of the time, without waiting for data), and also without a DataLoader (the main thread's
run delay). It does not replace the loader's own finding: a storage-bound loader still gains
from more workers (they wait on storage, and need little CPU to do it), a CPU-bound one still
needs cheaper batches. The gain it states is bounded by the run delay measured: at most
``1 / (1 - delay)``, the wall time less the time queued for a core; it is the finding's
``expected_speedup``, so it ranks by it like any finding, marked as the machine's. Thresholds live in
gpuwidget.advice.loader (CONTENTION_DELAY_FRACTION, OTHER_CORES_MIN, OTHERS_HOLD_SHARE) and
gpuwidget.advice.evidence; the severity follows the share of time lost.
"""

from __future__ import annotations

from gpuwidget.advice.evidence import MIN_CAUSE_LOOP_S, loop_evidence
from gpuwidget.advice.finding import Finding, Severity
from gpuwidget.advice.loader import CONTENTION_DELAY_FRACTION, LoaderDiagnosis, contended, diagnose
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.report import fmt_count, fmt_fraction, fmt_speedup

RULE = "cpu-contention"
# Above this share of wall time lost to waiting for a core, the finding is critical (as a
# loop starved 40% of the time is: dataloader_starved.CRITICAL_WAIT_FRACTION, rounded down).
CRITICAL_LOST_FRACTION = 0.3

# Runs as pasted in the notebook: the busiest processes outside this one, like `top`.
CODE = """\
# Who holds the cores: the busiest processes outside this kernel, over one second (like `top`).
import os, time, psutil
def _cpu(process):
    try:
        return process.cpu_percent(None)
    except psutil.Error:  # it ended meanwhile
        return 0.0
_mine = {os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))}
_others = [p for p in psutil.process_iter(["name", "username"]) if p.pid not in _mine]
[_cpu(p) for p in _others]
time.sleep(1)
for _percent, _pid, _name, _user in sorted(((_cpu(p), p.pid, p.info["name"], p.info["username"])
                                            for p in _others), reverse=True)[:5]:
    print(f"{_percent:5.0f}% of a core  pid {_pid}  {_name}  ({_user})")
"""


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    d = diagnose(summary, workload, machine)
    usable = int(machine.get("usable_cpus") or 1)
    if d is not None:
        lost, others, loop_delay, builder_delay = (d.time_lost_to_contention, d.other_cores, d.loop_delay,
                                                   d.builder_delay)
        named = d.contended
    else:
        # No loader diagnosis: the loop's main thread alone (a loop that fetches its own batches),
        # judged once the loop ran long enough at its steady state, or the cell did without a loop.
        seen = loop_evidence(workload)
        if seen is not None and not seen.enough:
            return None
        if seen is None and (summary.get("duration_s") or 0.0) < MIN_CAUSE_LOOP_S:
            return None
        delay, other = summary.get("process_run_delay_mean"), summary.get("other_cpu_mean")
        loop_delay = None if delay is None else delay / 100.0
        others = None if other is None else other / 100.0
        lost, builder_delay = loop_delay, None
        named = contended(lost, others, usable, starved=False)
    if not named:
        return None
    others = others or 0.0
    evidence: dict[str, object] = {"other_cpu_cores": round(others, 2)}
    bound = None
    if lost is not None:
        evidence["run_delay_fraction"] = round(lost, 3)
        # Upper bound if no core were taken by others: the wall time less the time queued for
        # one. It is the finding's expected_speedup, so it ranks where its gain puts it (the panel
        # marks it as the machine's, not the code's: Finding.machine_level).
        bound = 1.0 / max(1e-9, 1.0 - lost)
        evidence["speedup_without_contention"] = round(bound, 2)
    evidence["usable_cpus"] = usable
    wait_fraction = d.wait_fraction if d is not None else summary.get("data_wait_fraction")
    if wait_fraction is not None:
        evidence["data_wait_fraction"] = round(wait_fraction, 3)
    if loop_delay is not None:
        evidence["loop_run_delay_fraction"] = round(loop_delay, 3)
    if builder_delay is not None:
        evidence["builder_run_delay_fraction"] = round(builder_delay, 3)
    if summary.get("cpu_util_mean") is not None:
        evidence["host_cpu_percent"] = round(summary["cpu_util_mean"] or 0.0, 1)
    pressure = summary.get("psi_cgroup_cpu_some_mean", summary.get("psi_cpu_some_mean"))
    if pressure is not None:
        evidence["psi_cpu_some_percent"] = round(pressure, 1)
    cause = d.cause if d is not None and d.starved else None
    if cause == "io":
        still = ("The batches still wait on storage, so more workers still help (io-bound): waiting "
                 "workers need little CPU. ")
    elif cause == "cpu":
        still = "Building batches is CPU work, and the cores it needs are taken: make batches cheaper too. "
    else:
        still = ""
    lost_share = lost or 0.0
    if lost_share >= CRITICAL_LOST_FRACTION:
        severity: Severity = "critical"
    elif lost_share >= CONTENTION_DELAY_FRACTION:
        severity = "warn"
    else:
        severity = "info"  # the cores are taken, little time lost yet
    if lost is None or bound is None:
        waited, title = "", "Other processes hold the cores"
    else:
        waited = (f", and {_who(d)} ready to run but waited for a core {fmt_fraction(lost)} of the time: "
                  f"with the cores to itself it would run at most {fmt_speedup(bound)} faster")
        title = f"Other processes hold the cores ({fmt_fraction(lost)} of the time lost waiting for one)"
    return Finding(
        rule=RULE,
        severity=severity,
        title=title,
        evidence=evidence,
        suggestion=(f"Processes outside this one kept {others:.1f} cores busy on the {fmt_count(usable, 'CPU')} it may "
                    f"use{waited}. That is the machine, not the code. {still}Run when the machine is quieter, "
                    "ask who runs "
                    "the busy processes (the code lists them), reserve cores for this job (a CPU request for "
                    "the pod, a scheduler's CPU allocation, taskset), or lower the others' priority (renice)."),
        change={},
        code=CODE,
        expected_speedup=round(bound, 2) if bound is not None and bound >= 1.0 else None,
    )


def _who(d: LoaderDiagnosis | None) -> str:
    if d is None:
        return "the training loop was"
    if d.builder_delay is not None and d.builder_delay >= (d.loop_delay or 0.0):
        if d.num_workers == 0:
            return "the loop's batch builders were"
        return "its loader worker was" if d.num_workers == 1 else f"its {d.num_workers} loader workers were"
    return "the training loop was"
