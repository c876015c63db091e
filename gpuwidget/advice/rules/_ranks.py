"""Facts the multi-process rules share: the training processes of a run and each one's model."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any, cast

from gpuwidget.facts import ModelFacts, Summary, WorkloadFacts


def ranks(workload: WorkloadFacts) -> list[dict[str, Any]]:
    """``workload["ranks"]``: one dict per training process (the kernel's own included when it
    trained), as the child probes report them; empty for a single-process run."""
    listed = cast(Mapping[str, Any], workload).get("ranks") or []
    return [dict(rank) for rank in listed if isinstance(rank, Mapping)]


def rank_label(rank: dict[str, Any]) -> str:
    """``rank 1`` where torch.distributed (or the launcher) numbered it, else ``pid 4242``."""
    if rank.get("rank") is not None:
        return f"rank {rank['rank']}"
    return f"pid {rank.get('pid')}"


def processes_with_models(summary: Summary, workload: WorkloadFacts) -> list[tuple[ModelFacts, float | None, str]]:
    """(model facts, median step time in s, who) for every process whose model the probes saw: each
    rank's (the watched process's own entry among them when it trained beside children), or the
    watched process's model alone in a single-process run."""
    found: list[tuple[ModelFacts, float | None, str]] = []
    for rank in ranks(workload):
        model = rank.get("model")
        if model:
            found.append((model, rank.get("step_time_p50_s"), rank_label(rank)))
    own = workload.get("model")
    if own and not found:
        found.append((own, summary.get("step_time_p50"), "this process"))
    return found


def median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


NS = 1e-9


def ddp_exposed_comm_s(ddp: Mapping[str, Any] | None) -> float | None:
    """Seconds per step DDP's all-reduce ran past the end of backward (``backward_comm_time -
    backward_compute_comm_overlap_time``), the smaller of its average over the iterations DDP samples
    and its latest sample: the first iterations, in the average, include waiting for the other ranks
    to start at all (process start-up, imports). None without DDP's timings."""
    if not ddp:
        return None
    estimates = [(int(ddp[f"{prefix}backward_comm_time"])
                  - int(ddp.get(f"{prefix}backward_compute_comm_overlap_time") or 0)) * NS
                 for prefix in ("avg_", "") if ddp.get(f"{prefix}backward_comm_time")]
    return max(0.0, min(estimates)) if estimates else None
