"""Per-process figures: one entry per training process, and the run's figures when only children trained.

``workload["ranks"]`` lists every process that trained: the watch's own when its probes saw
steps, then each child that iterated a DataLoader or joined a process group (by rank, then
pid). Each entry is a :class:`~gpuwidget.facts.RankEntry`: the public figures of
:data:`PUBLIC_KEYS` (``Run.ranks``), the same figures the summary gives a single process
(:func:`loop_figures` reads them from :func:`~gpuwidget.figures.summary.summarize`, so a rank's
steps are counted as the run's are), its steps one by one (the rank rules' evidence), its
time over the run (:func:`~gpuwidget.figures.summary.time_breakdown`: the parts sum to the
run's duration), its CPU seconds, ``loaders`` (without the per-step lists), ``model``,
``cuda``, ``host`` evidence (``run_delay_fraction``, ``cpu_fraction`` of its main thread) and
``finished`` (False: it was killed or crashed, and its figures are those it last sent).

When the watch's own process did not train (a launcher, ``subprocess.run``, ``gpuwatch``)
the workload's loaders, model, CUDA facts, training steps and stack samples (``loop_waits``) are
the busiest child's (the one with the most
time in its loop), so the rules judge that process as they would judge the notebook's own
loop, and "this process" is the training processes: ``process_cpu_mean`` their CPU summed
(all their threads, over the run), ``workers_cpu_mean`` their loader workers' (over each one's
loop), ``process_run_delay_mean`` the busiest one's main thread. With several training
processes, the summary's loop figures describe the job: ``samples_per_s`` is the sum over the
ranks (the job's throughput), ``data_wait_fraction`` the mean (the share of the processes'
loop time spent blocked on data; the worst rank is ``rank-straggler``'s business),
``step_time_p50``/``p95`` the slowest rank's (a synchronous job moves at its slowest rank's
pace) and ``steps`` the busiest child's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from gpuwidget.children.channel import ChildRecord
from gpuwidget.children.protocol import Identity, Progress
from gpuwidget.facts import (
    LoaderFacts,
    MachineFacts,
    MainThreadFigures,
    RankEntry,
    Summary,
    TrainedIn,
    TrainingFacts,
    WorkloadFacts,
    uuid_key,
)
from gpuwidget.figures.summary import paired, percentiles, primary_loader, summarize, time_breakdown
from gpuwidget.probes import STEP_SPAN, TRAIN_STEP_SPAN
from gpuwidget.trace import Trace

PER_STEP_LISTS = ("step_times", "wait_times", "step_ends")
# Step sources whose steps are the training probe's (train.step spans), not a DataLoader's.
TRAINING_SOURCES = ("optimizer", "forward")
PUBLIC_KEYS = ("rank", "pid", "gpu", "steps", "samples_per_s", "data_wait_fraction",
               "step_time_p50_s", "step_time_p95_s")
# Steps kept one by one per rank for the rank rules: enough for medians and a significance test
# across steps, small enough that a saved run of eight ranks stays small.
SERIES_STEPS = 1024
NO_LOOP: RankEntry = {"steps": 0, "samples_per_s": None, "data_wait_fraction": None, "step_time_p50_s": None,
           "step_time_p95_s": None, "step_times": [], "wait_times": []}


def public(entries: Iterable[RankEntry]) -> list[RankEntry]:
    """``Run.ranks``: each entry reduced to the public keys."""
    return [cast(RankEntry, {key: entry.get(key) for key in PUBLIC_KEYS}) for entry in entries
            if isinstance(entry, Mapping)]


def per_step(step_times: Sequence[float], wait_times: Sequence[float]) -> tuple[list[float], list[float]]:
    """The latest :data:`SERIES_STEPS` steps and each one's data wait, paired (``figures.summary.paired``)."""
    steps, waits = paired(step_times, wait_times)
    return steps[-SERIES_STEPS:], waits[-SERIES_STEPS:]


def loop_figures(workload: WorkloadFacts | None) -> RankEntry:
    """Steps, samples/s, data wait and step-time percentiles of a process's training loop, as the
    summary of a run of that process alone gives them, and its steps one by one."""
    facts: WorkloadFacts = workload or {}
    summary = summarize(Trace(), facts, duration_s=0.0)
    if not summary.get("steps"):
        return NO_LOOP.copy()
    training = facts.get("training") or {}
    if summary.get("step_source") in TRAINING_SOURCES and training.get("step_times"):
        steps, waits = per_step(training["step_times"], [])
    else:
        loader = primary_loader(facts) or {}
        steps, waits = per_step(loader.get("step_times") or [], loader.get("wait_times") or [])
    return {"steps": summary.get("steps") or 0, "step_source": summary.get("step_source"),
            "samples_per_s": summary.get("samples_per_s"),
            "data_wait_fraction": summary.get("data_wait_fraction"),
            "step_time_p50_s": summary.get("step_time_p50"), "step_time_p95_s": summary.get("step_time_p95"),
            "loop_time_s": summary.get("loop_time_s") or 0.0, "step_times": steps, "wait_times": waits}


def progress_figures(progress: Progress, step_times: Sequence[float],
                     wait_times: Sequence[float] = ()) -> RankEntry:
    """The same figures from a child's last running totals (it died before sending its facts)."""
    loop_time = float(progress.get("loop_s") or 0.0)
    steps = int(progress.get("steps") or 0)
    p50, p95 = percentiles(list(step_times), (50, 95))
    series, waits = per_step(step_times, wait_times)
    return {"steps": steps,
            "samples_per_s": progress["samples"] / loop_time if loop_time > 0 and progress.get("samples") else None,
            "data_wait_fraction": float(progress.get("wait_s") or 0.0) / loop_time if loop_time > 0 else None,
            "step_time_p50_s": p50, "step_time_p95_s": p95, "loop_time_s": loop_time,
            "step_times": series, "wait_times": waits}


def watch_gpu(identity: Identity, machine: MachineFacts | None) -> int | None:
    """The process's GPU in the watch's numbering: by its device's UUID where NVML listed it, else as it said."""
    uuid = identity.get("gpu_uuid")
    if uuid:
        for gpu in (machine or {}).get("gpus") or []:
            if gpu.get("uuid") and gpu.get("index") is not None and uuid_key(gpu["uuid"]) == uuid_key(str(uuid)):
                return int(gpu["index"])
    said = identity.get("gpu")
    return said if isinstance(said, int) else None


def child_entry(record: ChildRecord, machine: MachineFacts | None = None) -> RankEntry | None:
    """The rank entry of one child, or None when it did not train (a launcher, a helper, a loader's worker)."""
    ident = record.identity
    figures = loop_figures(record.workload) if record.workload is not None else NO_LOOP.copy()
    if not figures["steps"]:
        figures = progress_figures(record.progress, record.step_times, record.wait_times)
    if not figures["steps"] and not ident.get("distributed"):
        return None
    workload = record.workload or {}
    return {"rank": ident.get("rank"), "local_rank": ident.get("local_rank"), "world_size": ident.get("world_size"),
            "pid": record.pid, "gpu": watch_gpu(ident, machine), **figures,
            "loaders": list(workload.get("loaders") or []), "model": workload.get("model"),
            "training": workload.get("training"),
            "cuda": workload.get("cuda"), "host": record.host.copy(), "cpu": record.cpu.copy(),
            "finished": record.finished, "argv": ident.get("argv"),
            # the process's stack samples (probes.stack): the workload's when it is the busiest (merge)
            "loop_waits": list(workload.get("loop_waits") or []), "stack_samples": workload.get("stack_samples") or {}}


def own_entry(workload: WorkloadFacts, identity: Identity, summary_host: MainThreadFigures) -> RankEntry:
    """The watch's own process as a rank entry (only used when it trained)."""
    figures = loop_figures(workload)
    return {"rank": identity.get("rank"), "local_rank": identity.get("local_rank"),
            "world_size": identity.get("world_size"), "pid": os.getpid(), "gpu": identity.get("gpu"), **figures,
            "loaders": list(workload.get("loaders") or []), "model": workload.get("model"),
            "training": workload.get("training"),
            "cuda": workload.get("cuda"), "host": summary_host.copy(), "finished": True, "argv": None}


def _order(entry: RankEntry) -> tuple[bool, int, int]:
    rank = entry.get("rank")
    return (rank is None, rank if isinstance(rank, int) else 0, int(entry.get("pid") or 0))


def merge(workload: WorkloadFacts, records: Iterable[ChildRecord], identity: Identity,
          machine: MachineFacts | None = None) -> WorkloadFacts:
    """``workload`` with ``ranks``; the busiest child's loaders, model and CUDA facts if the watch's own
    process did not train (``trained_in`` then names that child)."""
    merged = workload.copy()
    children = sorted((entry for record in records if (entry := child_entry(record, machine)) is not None),
                      key=_order)
    own_trained = bool(loop_figures(workload)["steps"])
    own: Identity = {**identity, "gpu": watch_gpu(identity, machine)}
    entries = ([own_entry(workload, own, {})] if own_trained else []) + children
    if not entries:
        return workload
    merged["ranks"] = entries
    trained = [entry for entry in children if entry["steps"]]
    if not own_trained and trained:
        busiest = max(trained, key=lambda entry: (entry.get("loop_time_s") or 0.0, -_order(entry)[1]))
        merged["loaders"] = busiest["loaders"]
        merged["model"] = busiest["model"]
        merged["cuda"] = busiest["cuda"]
        merged["training"] = busiest.get("training")
        merged["loop_waits"] = busiest.get("loop_waits") or []
        merged["stack_samples"] = busiest.get("stack_samples") or {}
        merged["trained_in"] = {"pid": busiest["pid"], "rank": busiest["rank"]}
    for entry in entries:  # each keeps its top wait (the rank rules name it), the workload has the rest
        entry["loop_waits"] = list(entry.get("loop_waits") or [])[:1]
        entry.pop("stack_samples", None)
        # the entry has the percentiles: the per-step lists would only repeat them per rank
        entry["loaders"] = [cast(LoaderFacts, {key: value for key, value in loader.items()
                                               if key not in PER_STEP_LISTS})
                            for loader in entry["loaders"]]
        if training := entry.get("training"):  # a copy: the workload's own training facts keep their step times
            entry["training"] = cast(TrainingFacts, {key: value for key, value in training.items()
                                                     if key not in PER_STEP_LISTS})
    return merged


def loop_totals(entry: RankEntry) -> tuple[float, float]:
    """(seconds in its loaders' loops, seconds blocked on data) of one process, every loader summed."""
    loaders = entry.get("loaders") or []
    if loaders:
        return (sum(loader.get("loop_time_s") or 0.0 for loader in loaders),
                sum(loader.get("wait_total_s") or 0.0 for loader in loaders))
    loop = float(entry.get("loop_time_s") or 0.0)
    return loop, loop * float(entry.get("data_wait_fraction") or 0.0)


def job_summary(summary: Summary, workload: WorkloadFacts, trace: Trace | None = None) -> Summary:
    """Each process's time over the run (from ``trace``, where its spans are); "this process" and the
    loop figures for the job when only children trained (module docstring)."""
    listed = workload.get("ranks") or []
    duration = float(summary.get("duration_s") or 0.0)
    for entry in listed:
        own = entry.get("pid") == os.getpid()
        if own and not entry.get("host"):  # the watch's own: the host figures
            delay, cpu = summary.get("process_run_delay_mean"), summary.get("process_cpu_mean")
            entry["host"] = cast(MainThreadFigures, {key: value / 100 for key, value in (("run_delay_fraction", delay),
                                                                                     ("cpu_fraction", cpu))
                                                     if value is not None})
        if trace is not None and duration > 0:
            loop_s, wait_s = loop_totals(entry)
            kind = TRAIN_STEP_SPAN if entry.get("step_source") in TRAINING_SOURCES else STEP_SPAN
            entry["time_breakdown"] = time_breakdown(duration, trace, None if own else entry.get("pid"),
                                                     loop_s=loop_s, wait_s=wait_s, kind=kind)
    entries = [entry for entry in listed if entry.get("steps")]
    summary["training_processes"] = len(entries)
    trained_in = workload.get("trained_in")
    if not trained_in:
        return summary
    _training_processes_cpu(summary, entries, trained_in, duration)
    if len(entries) < 2:
        return summary
    rates = [rate for entry in entries if (rate := entry.get("samples_per_s")) is not None]
    waits = [wait for entry in entries if (wait := entry.get("data_wait_fraction")) is not None]
    if rates:
        summary["samples_per_s"] = sum(rates)
    if waits:
        summary["data_wait_fraction"] = sum(waits) / len(waits)
    for key, public_key in (("step_time_p50", "step_time_p50_s"), ("step_time_p95", "step_time_p95_s")):
        values = [entry[public_key] for entry in entries if entry.get(public_key) is not None]  # type: ignore[literal-required]
        if values:
            summary[key] = max(values)  # type: ignore[literal-required]
    return summary


def _training_processes_cpu(summary: Summary, entries: Sequence[RankEntry], trained_in: TrainedIn,
                            duration: float) -> None:
    """"This process" when only children trained: theirs, not the watch's (a launcher, gpuwatch itself).

    Their own CPU is summed over the run's duration, as the watch's own figure is its mean over
    the run; their loader workers' over each one's loop, as the watch's own workers' figure is
    taken from the first batch to the last; the run delay is the busiest one's main thread's.
    """
    measured = [entry for entry in entries if "process_s" in (entry.get("cpu") or {})]
    if not measured or duration <= 0:
        return
    summary["process_cpu_mean"] = 100.0 * sum(entry["cpu"]["process_s"] for entry in measured) / duration
    workers = [100.0 * entry["cpu"].get("workers_s", 0.0) / entry["loop_time_s"]
               for entry in measured if (entry.get("loop_time_s") or 0.0) > 0]
    if workers:
        summary["workers_cpu_mean"] = sum(workers)
    summary["process_cpu_processes"] = len(measured)
    busiest = next((entry for entry in entries if entry.get("pid") == trained_in.get("pid")), None)
    delay = ((busiest or {}).get("host") or {}).get("run_delay_fraction")
    if delay is not None:
        summary["process_run_delay_mean"] = 100.0 * delay
