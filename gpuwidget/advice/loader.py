"""What the DataLoader measurements say: is the loop starved, why, and which settings fix it.

Shared by the three loader rules (``dataloader-starved``, ``dataloader-cpu-bound``,
``io-bound``) so they agree on one diagnosis; the code they offer is written by
gpuwidget.advice.code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gpuwidget.advice.evidence import enough_evidence
from gpuwidget.facts import LoaderChange, LoaderFacts, LoaderSettings, MachineFacts, Summary, WorkloadFacts
from gpuwidget.figures.summary import primary_loader
from gpuwidget.figures.warmup import split_run
from gpuwidget.probes.torch_data import CPU_SAMPLE_EVERY

# The loop is starved when at least this share of its time is spent blocked in next().
# PyTorch's profiler recommendations flag DataLoader time above 5% of a step; we ask for
# 10% so that a finding is worth acting on and timing noise of short cells stays below it.
STARVED_WAIT_FRACTION = 0.10
# How long the loop must run at its steady state before a cause is named: see
# gpuwidget.advice.evidence (MIN_CAUSE_STEPS, MIN_CAUSE_LOOP_S); warm-up steps are left out of
# every figure below (gpuwidget.figures.warmup).
# The looping thread's CPU while blocked in next() (num_workers=0) tells CPU work from sleep over
# enough sampled waits (one in probes.torch_data.CPU_SAMPLE_EVERY, spread over the loop): at least
# MIN_SAMPLED_WAITS of them, or MIN_SAMPLED_WAIT_S of them in all. Each is read from the thread's CPU
# clock, exact at the call, so over many waits the ratio errs only by which were sampled: for waits
# whose CPU share varies by 0.5 at most, 0.5 / sqrt(64) = 0.06, a quarter of the gap between
# IO_WAIT_RATIO and CPU_WORK_RATIO that tells the causes apart; a few long waits (a 100 ms read) each
# tell it themselves.
MIN_SAMPLED_WAITS = 64
# Runs saved before 2026-12-04 read the CPU from schedstat, whose figure moves in scheduler ticks (and,
# read by the thread itself, lags: gpuwidget.sources.schedstat.thread_run_delay): over W seconds of
# sampled waits their ratio errs by about sqrt(tick / W), 0.2 at this minimum, which is all they have.
# The 32 in-memory batches once called io-bound had sampled four waits of well under a millisecond
# each, which read as 0.0 CPU.
MIN_SAMPLED_WAIT_S = 0.1
# The batch builders are the looping thread while it is blocked in next() (num_workers=0)
# or the worker processes. Per wall second, each builder is on a core (CPU), runnable but
# queued for a core (run delay, /proc/<pid>/schedstat), or asleep (storage, network).
# On a core at least half the time: CPU work; at most a quarter: mostly not computing.
CPU_WORK_RATIO = 0.5
IO_WAIT_RATIO = 0.25
# Builders asleep at most this share of the time are not waiting on storage: what they do
# not spend on a core they spend queued for one (CPU work on cores other processes hold).
# A storage-bound builder keeps sleeping its storage latency however busy the host is.
# Measured on this 2-core machine with two or four unrelated busy processes (6 ms storage
# reads, batch 16): storage-bound builders slept 67-89% of the time (main thread or 4
# workers); a CPU-bound looping thread 0-2%, CPU-bound workers 22-30% (a worker also sleeps
# while its prefetch queue is full). The cut-offs sit between, the looping thread's low so
# that a storage wait followed by a long queue for a core (a heavily loaded host) stays io.
CPU_ASLEEP_MAX = 0.2
WORKER_ASLEEP_MAX = 0.5
# The same cut-offs per worker process (num_workers > 0), as a share of one core each.
WORKER_BUSY = 0.5
WORKER_IDLE = 0.25
# Host CPU (all cores) at or above this mean is saturated: when the builders do CPU work,
# more workers cannot help. It does not make sleeping builders CPU-bound.
HOST_SATURATED_PERCENT = 85.0
# Other processes contend for the cores when the loop's thread or its batch builders spent
# at least this share of wall time runnable but waiting for a core: the same 10% as a starved
# loop (STARVED_WAIT_FRACTION), the share of time worth acting on...
CONTENTION_DELAY_FRACTION = 0.10
# ...while processes outside this process tree kept at least half a core busy on the CPUs it
# may use (less cannot queue it measurably; its own workers queueing for each other are not
# contention but too many workers).
OTHER_CORES_MIN = 0.5
# Other processes holding at least this share of the usable cores is worth saying (as
# information) even when little time was lost yet: a storage-bound loop waiting on its one
# reader seldom queues for a core (0-9% of its time lost with two busy processes on this
# 2-core machine, against 13-36% in other runs), but the workers it is told to add will.
OTHERS_HOLD_SHARE = 0.5
# Workers are sized to produce batches this much faster than the loop consumes them.
WORKER_MARGIN = 1.2
# Storage-bound loading overlaps waits, not CPU: workers beyond the core count help, up to
# this multiple of the cores (and a hard cap, as each worker holds a dataset copy).
IO_WORKERS_PER_CORE = 4
MAX_WORKERS = 32
# Waits are bursty when the 95th percentile wait exceeds this multiple of the median.
BURSTY_WAIT_RATIO = 4.0
DEFAULT_PREFETCH = 2
# What a worker process costs, for the gain a worker change should bring. Start-up, once per
# epoch unless persistent: iter() to first batch of a trivial dataset took 31 ms with 1 worker
# and 211 ms with 8 on the 2-vCPU test VM (fork, imports, queues). Each batch then also
# crosses a process boundary: 0.6-1.8 ms per batch of 8 small tensors there (1-8 workers).
WORKER_START_S = 0.025
WORKER_BATCH_S = 0.001
# Fewer workers than the steady-state need are advised only when they are expected to gain
# more than this share beyond it over the loop as measured: fitted to one-epoch sweeps of
# 64 steps on the test VM, the start-up cost per worker came out 12-29 ms depending on the
# count, so the model cannot tell counts apart more finely than this.
WORKER_GAIN_SLACK = 0.10


@dataclass
class LoaderDiagnosis:
    """The measured state of the primary loader and the settings that would feed the loop."""

    loader: LoaderFacts
    wait_fraction: float
    wait_per_step: float
    compute_per_step: float
    starved: bool
    cause: str  # "cpu", "io" or "unknown"
    cpu_saturated: bool
    num_workers: int
    usable_cpus: int
    workers_busy: float | None
    change: LoaderChange = field(default_factory=lambda: LoaderChange())
    evidence: dict[str, float] = field(default_factory=dict)  # the measured figures, by name
    # Kernel counters (None where the platform lacks them): share of wall time the builders
    # and the loop's thread were runnable but waiting for a core; cores other processes held.
    builder_delay: float | None = None
    loop_delay: float | None = None
    other_cores: float | None = None
    contended: bool = False
    # The speed-up expected from `change` (expected_gain), at most expected_speedup.
    gain: float = 1.0
    # Warm-up steps left out of the figures above (figures.warmup); the loop's seconds as measured
    # and the least its steps could take (each at the steady compute time): expected_speedup.
    warmup_steps: int = 0
    loop_s: float = 0.0
    least_loop_s: float = 0.0

    @property
    def name(self) -> str:
        return self.loader.get("name") or "the DataLoader"

    @property
    def waited(self) -> str:
        """The loop's share of time waiting for data in words: "41% of the time", or where a warm-up was
        left out (figures.warmup), "29% of the time after its warm-up", as that figure is not the headline's."""
        from gpuwidget.report import fmt_fraction

        return f"{fmt_fraction(self.wait_fraction)} of the time" + (" after its warm-up" if self.warmup_steps else "")

    @property
    def time_lost_to_contention(self) -> float | None:
        """The larger share of wall time the loop's thread or the batch builders were ready to
        run but waited for a core; None without run-delay counters."""
        measured = [share for share in (self.loop_delay, self.builder_delay) if share is not None]
        return max(measured) if measured else None

    @property
    def expected_speedup(self) -> float:
        """Upper bound if no waiting remained: the loop time as measured over the least those
        steps can take, each at the steady compute time and none waiting::

            T / (N * c)    T: loop seconds, N: its steps, c: steady compute seconds per step

        Without a warm-up that is ``1 / (1 - w)``, ``w`` the share of the loop spent in next().
        It used to be that in every case, with the warm-up counted as compute: a slow start then
        diluted ``w``, and a run that followed the change in a warm process (no first CUDA use
        or compilation again, a dataset already cached) gained more than the bound, as an
        io-bound "at most 1.46x" that measured 1.81x. Whatever the re-run pays again of the
        warm-up, it cannot take less than ``N * c``."""
        return self.loop_s / max(1e-9, self.least_loop_s) if self.least_loop_s else \
            1.0 / max(1e-9, 1.0 - self.wait_fraction)


@dataclass(frozen=True)
class SteadyLoop:
    """The primary loader's totals over its steady steps (warm-up left out)."""

    steps: int
    wait_s: float
    loop_s: float
    warmup_steps: int

    @property
    def compute_s(self) -> float:
        return max(0.0, self.loop_s - self.wait_s)


def steady_loop(loader: LoaderFacts) -> SteadyLoop:
    """The loader's steps, waits and loop time without its warm-up steps (figures.warmup)."""
    steps, wait, loop = int(loader["steps"]), loader["wait_total_s"], loader["loop_time_s"]
    split = split_run(loader.get("step_times") or [], steps)
    if split.all_warmup or not split.steps or split.steps >= steps:
        return SteadyLoop(steps, wait, loop, 0)
    warm_wait = float(sum((loader.get("wait_times") or [])[:split.steps]))
    return SteadyLoop(steps - split.steps, max(0.0, wait - warm_wait), max(1e-9, loop - split.seconds), split.steps)


def sampled_enough(loader: LoaderFacts) -> bool:
    """Enough of the loop's waits had their CPU read to tell CPU work from sleep: MIN_SAMPLED_WAIT_S of them,
    or, read from the thread's CPU clock (runs saved before 2026-12-04 were not), MIN_SAMPLED_WAITS."""
    if loader.get("wait_cpu_clock") == "thread" and int(loader.get("wait_samples") or 0) >= MIN_SAMPLED_WAITS:
        return True
    return sampled_wait_s(loader) >= MIN_SAMPLED_WAIT_S


def sampled_wait_s(loader: LoaderFacts) -> float:
    """Seconds of the waits whose CPU and run delay the probe read: the basis of ``wait_cpu_ratio``. Facts
    from before the probe said so: one step in probes.torch_data.CPU_SAMPLE_EVERY, from the second."""
    sampled = loader.get("wait_sampled_s")
    if isinstance(sampled, (int, float)):
        return float(sampled)
    waits = loader.get("wait_times") or []
    if len(waits) >= int(loader.get("steps") or 0):
        return float(sum(waits[1::CPU_SAMPLE_EVERY]))
    return float(loader.get("wait_total_s") or 0.0) / CPU_SAMPLE_EVERY  # the history lost the first steps


def diagnose(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> LoaderDiagnosis | None:
    """None when no DataLoader ran long enough at its steady state to judge (advice.evidence)."""
    loader = primary_loader(workload)
    if loader is None or not loader.get("loop_time_s") or not enough_evidence(workload):
        return None
    settings = loader.get("settings") or {}
    steady = steady_loop(loader)
    wait_fraction = steady.wait_s / steady.loop_s
    wait = steady.wait_s / steady.steps
    compute = max(steady.compute_s / steady.steps, 1e-6)
    num_workers = int(settings.get("num_workers") or 0)
    usable = int(machine.get("usable_cpus") or 1)

    workers_busy = None
    workers_cpu = summary.get("workers_cpu_mean")
    if num_workers > 0 and workers_cpu is not None:
        workers_busy = workers_cpu / 100.0 / num_workers
    wait_cpu = loader.get("wait_cpu_ratio") if sampled_enough(loader) else None
    host = summary.get("cpu_util_mean")
    cpus_busy = _cpus_busy_percent(summary, machine, usable)
    host_saturated = cpus_busy is not None and cpus_busy >= HOST_SATURATED_PERCENT
    if num_workers == 0:
        busy, builder_delay = wait_cpu, loader.get("wait_delay_ratio") if wait_cpu is not None else None
        cause = _cause(busy, builder_delay, host_saturated, CPU_WORK_RATIO, IO_WAIT_RATIO, CPU_ASLEEP_MAX)
    else:
        workers_delay = summary.get("workers_run_delay_mean")
        builder_delay = None if workers_delay is None else workers_delay / 100.0 / num_workers
        cause = _cause(workers_busy, builder_delay, host_saturated, WORKER_BUSY, WORKER_IDLE, WORKER_ASLEEP_MAX)
    loop_delay = summary.get("process_run_delay_mean")
    others = summary.get("other_cpu_mean")
    # Saturated by the loader itself or by other processes, more CPU workers gain nothing:
    # the kernel shares the cores between sessions and cgroups (autogroup, a pod's CPU
    # weight), not between processes, so extra workers do not win the loader a larger share.
    cpu_saturated = cause == "cpu" and host_saturated

    diagnosis = LoaderDiagnosis(
        loader=loader, wait_fraction=wait_fraction, wait_per_step=wait, compute_per_step=compute,
        starved=wait_fraction >= STARVED_WAIT_FRACTION, cause=cause, cpu_saturated=cpu_saturated,
        num_workers=num_workers, usable_cpus=usable, workers_busy=workers_busy,
        builder_delay=builder_delay, loop_delay=None if loop_delay is None else loop_delay / 100.0,
        other_cores=None if others is None else others / 100.0, warmup_steps=steady.warmup_steps,
        loop_s=loader["loop_time_s"], least_loop_s=loader["steps"] * compute,
    )
    lost = diagnosis.time_lost_to_contention
    other_cores = diagnosis.other_cores
    diagnosis.contended = contended(lost, other_cores, usable, diagnosis.starved)
    diagnosis.evidence = _evidence(diagnosis, host, wait_cpu)
    if cpus_busy is not None and cpus_busy >= (host or 0.0) + 1.0:
        diagnosis.evidence["cpus_busy_percent"] = round(cpus_busy, 1)  # the container's CPUs, not the node's
    if diagnosis.starved:
        diagnosis.change = _change(diagnosis, settings, workload, machine)
        diagnosis.gain = expected_gain(diagnosis, diagnosis.change, main_uses_cpu=not machine.get("gpus"))
        diagnosis.evidence["expected_gain"] = round(diagnosis.gain, 2)
        diagnosis.evidence["upper_bound_speedup"] = round(diagnosis.expected_speedup, 2)
    return diagnosis


def contended(lost: float | None, other_cores: float | None, usable: int, starved: bool) -> bool:
    """Other processes contend for the loop's cores: they held at least OTHER_CORES_MIN of the
    usable cores and the loop's thread or its batch builders lost at least
    CONTENTION_DELAY_FRACTION of wall time waiting for a core, starved or not; or, for a starved
    loop (whose advice adds workers), they held OTHERS_HOLD_SHARE of the cores."""
    if other_cores is None or other_cores < OTHER_CORES_MIN:
        return False
    return (lost is not None and lost >= CONTENTION_DELAY_FRACTION) or (
        starved and other_cores >= OTHERS_HOLD_SHARE * usable)


def _cpus_busy_percent(summary: Summary, machine: MachineFacts, usable: int) -> float | None:
    """How busy the CPUs this process may use were, percent: the host's all-core figure or,
    where its own limits say more, theirs. A pod whose CPU quota is used up (its process tree
    at the quota) is saturated on an idle 64-core node; so is a process whose allowed CPUs
    (cpuset, taskset) are busy, with its own tree and other processes together."""
    measures = [summary.get("cpu_util_mean")]
    tree = (summary.get("process_cpu_mean") or 0.0) + (summary.get("workers_cpu_mean") or 0.0)
    quota = machine.get("cpu_limit")
    others = summary.get("other_cpu_mean")  # measured on the CPUs this process may use
    if quota:
        measures.append(tree / quota)
    elif others is not None:
        measures.append((tree + others) / usable)
    known = [value for value in measures if value is not None]
    return min(100.0, max(known)) if known else None


def _cause(busy: float | None, delay: float | None, host_saturated: bool, cpu_work: float,
           idle: float, asleep_max: float) -> str:
    """"cpu", "io" or "unknown" from what the batch builders did per wall second (see CPU_WORK_RATIO).

    Without run-delay counters (not Linux), builders that use little CPU on a saturated host
    may be asleep or queued for a core: that is not told apart, so it stays "unknown".
    """
    if busy is None:
        return "unknown"
    if busy >= cpu_work:
        return "cpu"
    if delay is not None:
        if 1.0 - busy - delay <= asleep_max:
            return "cpu"  # hardly ever asleep: queued for the cores it needs
        return "io" if busy <= idle else "unknown"
    return "io" if busy <= idle and not host_saturated else "unknown"


def _evidence(d: LoaderDiagnosis, host: float | None, wait_cpu: float | None) -> dict[str, float]:
    evidence: dict[str, float] = {
        "data_wait_fraction": round(d.wait_fraction, 3),
        "wait_per_step_ms": round(1000 * d.wait_per_step, 2),
        "compute_per_step_ms": round(1000 * d.compute_per_step, 2),
        "steps": d.loader["steps"],
        "num_workers": d.num_workers,
        "usable_cpus": d.usable_cpus,
    }
    if d.warmup_steps:
        evidence["warmup_steps"] = d.warmup_steps  # left out of the figures: not the steady state
    if host is not None:
        evidence["host_cpu_percent"] = round(host, 1)
    if d.workers_busy is not None:
        evidence["worker_busy_fraction"] = round(d.workers_busy, 2)
    if wait_cpu is not None and d.num_workers == 0:
        evidence["cpu_while_waiting"] = round(wait_cpu, 2)
    if d.builder_delay is not None:
        evidence["builder_run_delay_fraction"] = round(d.builder_delay, 3)
    return evidence


def production_time(d: LoaderDiagnosis) -> float:
    """Seconds one worker needs to produce one batch, from what was measured.

    Without workers the main process built each batch during its wait. With ``k``
    starved workers, the loop received one batch per (wait + compute), so each worker
    needed about ``k`` times that.
    """
    if d.num_workers == 0:
        return d.wait_per_step
    return d.num_workers * (d.wait_per_step + d.compute_per_step)


def workers_needed(d: LoaderDiagnosis) -> int:
    """Workers that produce batches WORKER_MARGIN times faster than the loop consumes them,
    capped by the cores for CPU work (beyond them, workers only contend), or by
    IO_WORKERS_PER_CORE per core for storage waits."""
    needed = max(1, math.ceil(WORKER_MARGIN * production_time(d) / d.compute_per_step))
    cap = min(MAX_WORKERS, IO_WORKERS_PER_CORE * d.usable_cpus) if d.cause == "io" else d.usable_cpus
    return max(1, min(needed, cap))


def expected_gain(d: LoaderDiagnosis, change: LoaderChange, main_uses_cpu: bool = True) -> float:
    """The speed-up ``change`` should bring: the step as measured (wait + compute) over the step
    with its workers, from the measured production and consumption times.

    With ``w`` workers a batch arrives every ``production_time / w`` seconds and the loop takes
    one every ``compute`` seconds, so a step lasts the longer of the two. Building batches on
    the CPU (cause "cpu" or "unknown") also cannot go faster than the cores allow: all workers
    together get at most ``usable_cpus`` cores, less the core the loop itself computes on when
    there is no GPU to compute on (``main_uses_cpu``). Settings that add no producer (pinning,
    persistence) are not modelled: 1.0. Over the loop as measured (its steps and epochs),
    new workers also start (:data:`WORKER_START_S` each, per epoch unless persistent) and
    fill the pipeline (one production time), and each batch crosses a process boundary
    (:data:`WORKER_BATCH_S`); both take CPU, so where other processes held cores
    (``other_cores``) they take longer in proportion to the share of the cores left.
    Never above the no-waiting bound, never below 1.
    """
    workers = int(change.get("num_workers", d.num_workers) or 0)
    if workers <= d.num_workers:
        return 1.0
    production = production_time(d)
    step_now = d.wait_per_step + d.compute_per_step
    # Start-up and hand-over are CPU work: slower by the cores others held (fair share).
    slowdown = 1.0 + (d.other_cores or 0.0) / max(1, d.usable_cpus)
    step = max(d.compute_per_step + slowdown * WORKER_BATCH_S, production / workers)
    if d.cause != "io":
        cores = d.usable_cpus - (d.compute_per_step / step_now if main_uses_cpu else 0.0)
        step = max(step, production / max(1.0, cores))
        if main_uses_cpu:
            # One step's CPU work, the batch and the loop's own compute, over all usable cores.
            step = max(step, (production + d.compute_per_step) / d.usable_cpus)
    steps = max(1, int(d.loader.get("steps") or 1))
    persistent = change.get("persistent_workers") or (d.loader.get("settings") or {}).get("persistent_workers")
    starts = 1 if persistent else max(1, int(d.loader.get("epochs") or 1))
    time_now = steps * step_now
    time_new = steps * step + starts * (production + slowdown * workers * WORKER_START_S)
    return min(d.expected_speedup, max(1.0, time_now / time_new))


def workers_worth_it(d: LoaderDiagnosis, main_uses_cpu: bool = True) -> int:
    """The worker count to advise: the steady-state need (:func:`workers_needed`), unless over
    the loop as measured fewer workers are expected to gain more than :data:`WORKER_GAIN_SLACK`
    beyond it (each worker starts again every epoch: on a short epoch, the start-up of the
    last few can cost more than they save); then the count with the best expected gain."""
    needed = workers_needed(d)
    gains = {count: expected_gain(d, {"num_workers": count}, main_uses_cpu)
             for count in range(d.num_workers + 1, needed + 1)}
    if not gains:
        return needed
    best = min(gains, key=lambda count: (-round(gains[count], 3), count))  # the fewest on a tie
    return needed if gains[needed] >= (1.0 - WORKER_GAIN_SLACK) * gains[best] else best


def host_batches(loader: LoaderFacts) -> bool:
    """The loader hands out batches in host memory (or where they live was not read): only those can be
    pinned; a dataset already on the GPU copies nothing, and ``pin_memory`` on its tensors raises."""
    return loader.get("batch_device") in (None, "cpu")


def _uses_cuda(workload: WorkloadFacts, machine: MachineFacts) -> bool:
    model = workload.get("model") or {}
    return "cuda" in (model.get("param_devices") or []) or bool(workload.get("cuda"))


def _change(d: LoaderDiagnosis, settings: LoaderSettings, workload: WorkloadFacts,
            machine: MachineFacts) -> LoaderChange:
    change: LoaderChange = {}
    workers = d.num_workers
    if not d.cpu_saturated:
        target = workers_worth_it(d, main_uses_cpu=not machine.get("gpus"))
        if target > workers:
            change["num_workers"] = workers = target
    if workers > 0:
        waits = np.asarray(d.loader.get("wait_times") or [0.0])
        median = float(np.median(waits))
        if median > 0 and float(np.percentile(waits, 95)) > BURSTY_WAIT_RATIO * median:
            current = settings.get("prefetch_factor") or DEFAULT_PREFETCH
            change["prefetch_factor"] = max(4, 2 * current)
        if d.loader.get("epochs", 0) >= 2 and not settings.get("persistent_workers"):
            change["persistent_workers"] = True
    if _uses_cuda(workload, machine) and not settings.get("pin_memory") and host_batches(d.loader):
        change["pin_memory"] = True
    return change
