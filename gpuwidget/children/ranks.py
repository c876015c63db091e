"""Per-process figures: one entry per training process, and the run's figures when only children trained.

``workload["ranks"]`` lists every process that trained: the watch's own when its probes saw
steps, then each child that iterated a DataLoader or joined a process group (by rank, then
pid). Each entry has the public figures of :data:`PUBLIC_KEYS` (``Run.ranks``) plus that
process's ``local_rank``, ``world_size``, ``loaders`` (without the per-step lists: the entry
has their percentiles), ``model``, ``cuda``, ``host`` evidence (``run_delay_fraction``,
``cpu_fraction`` of its main thread) and ``finished`` (False: it was killed or crashed, and its
figures are those it last sent).

When the watch's own process did not train (a launcher, ``subprocess.run``, ``gpuwatch``)
the workload's loaders, model and CUDA facts are the busiest child's (the one with the most
time in its loop), so the rules judge that process as they would judge the notebook's own
loop. With several training processes, the summary's loop figures describe the job:
``samples_per_s`` is the sum over the ranks (the job's throughput), ``data_wait_fraction``
the mean (the share of the processes' loop time spent blocked on data; the worst rank is
``rank-straggler``'s business), ``step_time_p50``/``p95`` the slowest rank's (a synchronous
job moves at its slowest rank's pace) and ``steps`` the busiest child's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from gpuwidget.advice.summary import optimizer_loop, percentiles, primary_loader
from gpuwidget.children.channel import ChildRecord
from gpuwidget.facts import Summary, TrainingFacts, WorkloadFacts
from gpuwidget.sources.nvml import uuid_key

PER_STEP_LISTS = ("step_times", "wait_times", "step_ends")
PUBLIC_KEYS = ("rank", "pid", "gpu", "steps", "samples_per_s", "data_wait_fraction",
               "step_time_p50_s", "step_time_p95_s")


def public(entries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``Run.ranks``: each entry reduced to the public keys."""
    return [{key: entry.get(key) for key in PUBLIC_KEYS} for entry in entries if isinstance(entry, Mapping)]


def loop_figures(workload: Mapping[str, Any] | None) -> dict[str, Any]:
    """Steps, samples/s, data wait and step-time percentiles of a process's training loop: its primary
    DataLoader, or its optimizer's steps where no DataLoader fed them."""
    loader = primary_loader(cast(WorkloadFacts, workload or {}))
    loop_time = (loader or {}).get("loop_time_s") or 0.0
    if loader is None or loop_time <= 0:
        steps = optimizer_loop(cast(TrainingFacts, (workload or {}).get("training") or {}))
        if steps:
            return {"steps": steps["steps"], "samples_per_s": steps["samples_per_s"], "data_wait_fraction": None,
                    "step_time_p50_s": steps["step_time_p50"], "step_time_p95_s": steps["step_time_p95"],
                    "loop_time_s": steps["loop_time_s"]}
        return {"steps": 0, "samples_per_s": None, "data_wait_fraction": None,
                "step_time_p50_s": None, "step_time_p95_s": None}
    p50, p95 = percentiles(loader.get("step_times") or [], (50, 95))
    return {"steps": loader.get("steps") or 0,
            "samples_per_s": loader["samples"] / loop_time if loader.get("samples") else None,
            "data_wait_fraction": (loader.get("wait_total_s") or 0.0) / loop_time,
            "step_time_p50_s": p50, "step_time_p95_s": p95, "loop_time_s": loop_time}


def progress_figures(progress: Mapping[str, Any], step_times: Sequence[float]) -> dict[str, Any]:
    """The same figures from a child's last running totals (it died before sending its facts)."""
    loop_time = float(progress.get("loop_s") or 0.0)
    steps = int(progress.get("steps") or 0)
    p50, p95 = percentiles(list(step_times), (50, 95))
    return {"steps": steps,
            "samples_per_s": progress["samples"] / loop_time if loop_time > 0 and progress.get("samples") else None,
            "data_wait_fraction": float(progress.get("wait_s") or 0.0) / loop_time if loop_time > 0 else None,
            "step_time_p50_s": p50, "step_time_p95_s": p95, "loop_time_s": loop_time}


def watch_gpu(identity: Mapping[str, Any], machine: Mapping[str, Any] | None) -> int | None:
    """The process's GPU in the watch's numbering: by its device's UUID where NVML listed it, else as it said."""
    uuid = identity.get("gpu_uuid")
    if uuid:
        for gpu in (machine or {}).get("gpus") or []:
            if gpu.get("uuid") and gpu.get("index") is not None and uuid_key(gpu["uuid"]) == uuid_key(str(uuid)):
                return int(gpu["index"])
    gpu = identity.get("gpu")
    return gpu if isinstance(gpu, int) else None


def child_entry(record: ChildRecord, machine: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The rank entry of one child, or None when it did not train (a launcher, a helper, a loader's worker)."""
    ident = record.identity
    if record.workload is not None and loop_figures(record.workload)["steps"]:
        figures = loop_figures(record.workload)
    else:
        figures = progress_figures(record.progress, record.step_times)
    if not figures["steps"] and not ident.get("distributed"):
        return None
    workload = record.workload or {}
    return {"rank": ident.get("rank"), "local_rank": ident.get("local_rank"), "world_size": ident.get("world_size"),
            "pid": record.pid, "gpu": watch_gpu(ident, machine), **figures,
            "loaders": list(workload.get("loaders") or []), "model": workload.get("model"),
            "training": workload.get("training"),
            "cuda": workload.get("cuda"), "host": dict(record.host), "finished": record.finished,
            "argv": ident.get("argv")}


def own_entry(workload: WorkloadFacts, identity: Mapping[str, Any], summary_host: Mapping[str, Any]) -> dict[str, Any]:
    """The watch's own process as a rank entry (only used when it trained)."""
    figures = loop_figures(workload)
    return {"rank": identity.get("rank"), "local_rank": identity.get("local_rank"),
            "world_size": identity.get("world_size"), "pid": os.getpid(), "gpu": identity.get("gpu"), **figures,
            "loaders": list(workload.get("loaders") or []), "model": workload.get("model"),
            "training": workload.get("training"),
            "cuda": workload.get("cuda"), "host": dict(summary_host), "finished": True, "argv": None}


def _order(entry: Mapping[str, Any]) -> tuple[bool, int, int]:
    rank = entry.get("rank")
    return (rank is None, rank if isinstance(rank, int) else 0, int(entry.get("pid") or 0))


def merge(workload: WorkloadFacts, records: Iterable[ChildRecord], identity: Mapping[str, Any],
          machine: Mapping[str, Any] | None = None) -> WorkloadFacts:
    """``workload`` with ``ranks``; the busiest child's loaders, model and CUDA facts if the watch's own
    process did not train (``trained_in`` then names that child)."""
    merged = cast(dict[str, Any], dict(workload))
    children = sorted((entry for record in records if (entry := child_entry(record, machine)) is not None),
                      key=_order)
    own_trained = bool(loop_figures(workload)["steps"])
    own = {**identity, "gpu": watch_gpu(identity, machine)}
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
        merged["trained_in"] = {"pid": busiest["pid"], "rank": busiest["rank"]}
    for entry in entries:  # the entry has the percentiles: the per-step lists would only repeat them per rank
        entry["loaders"] = [{key: value for key, value in loader.items() if key not in PER_STEP_LISTS}
                            for loader in entry["loaders"]]
        if entry.get("training"):  # a copy: the workload's own training facts keep their step times
            entry["training"] = {key: value for key, value in entry["training"].items() if key not in PER_STEP_LISTS}
    return cast(WorkloadFacts, merged)


def job_summary(summary: Summary, workload: WorkloadFacts) -> Summary:
    """The summary's loop figures for the job when only children trained, several of them (module docstring)."""
    listed = cast(Mapping[str, Any], workload).get("ranks") or []
    for entry in listed:
        if entry.get("pid") == os.getpid() and not entry.get("host"):  # the watch's own: the host figures
            delay, cpu = summary.get("process_run_delay_mean"), summary.get("process_cpu_mean")
            entry["host"] = {key: value / 100 for key, value in (("run_delay_fraction", delay),
                                                                 ("cpu_fraction", cpu)) if value is not None}
    entries = [entry for entry in listed if entry.get("steps")]
    summary["training_processes"] = len(entries)
    if not cast(Mapping[str, Any], workload).get("trained_in") or len(entries) < 2:
        return summary
    rates = [entry["samples_per_s"] for entry in entries if entry.get("samples_per_s") is not None]
    waits = [entry["data_wait_fraction"] for entry in entries if entry.get("data_wait_fraction") is not None]
    if rates:
        summary["samples_per_s"] = sum(rates)
    if waits:
        summary["data_wait_fraction"] = sum(waits) / len(waits)
    for key, public_key in (("step_time_p50", "step_time_p50_s"), ("step_time_p95", "step_time_p95_s")):
        values = [entry[public_key] for entry in entries if entry.get(public_key) is not None]
        if values:
            summary[key] = max(values)  # type: ignore[literal-required]
    return summary
