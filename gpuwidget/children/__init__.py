"""Training in child processes: probes in every Python process a watch's code starts, streaming back.

While a watch runs it owns a :class:`~gpuwidget.children.channel.ChildChannel` (a Unix socket
in a private directory) and exports its address in ``os.environ`` (:data:`ENV_VAR`), so every
process the watched code starts inherits it: ``subprocess``, ``multiprocessing`` with
``spawn``/``forkserver``, torchrun's workers and launchers built on them load the probes
through the start-up hook (``gpuwidget_children.pth``, the opt-in pattern of coverage.py's
``COVERAGE_PROCESS_START``); children ``multiprocessing`` forks from the watched process get
theirs from its after-fork registry. DataLoader worker processes are left out: they are a
loader's helpers, not training processes. :mod:`gpuwidget.children.agent` is the child's side,
:mod:`gpuwidget.children.ranks` turns what children sent into ``workload["ranks"]``.

When the watch ends, the variable is removed (a previous value is put back), the channel
reads what exited children left, closes and its directory is removed.
"""

from __future__ import annotations

import os
from typing import Any

from gpuwidget.children.agent import register_after_fork, start_in_forked_child, unregister_after_fork
from gpuwidget.children.channel import ChildChannel, ChildRecord
from gpuwidget.children.protocol import ENV_VAR, INTERVAL_VAR, Identity
from gpuwidget.children.ranks import job_summary, merge
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts
from gpuwidget.trace import Trace

__all__ = ["ENV_VAR", "ChildRecord", "ChildWatch"]


class ChildWatch:
    """The children side of one watch: channel, environment variable, after-fork hook."""

    def __init__(self, trace: Trace, probes: Any = None, machine: MachineFacts | None = None) -> None:
        self.probes = probes
        self.machine = machine  # NVML's GPUs, to number a child's GPU by its UUID
        self.channel = ChildChannel(trace)
        self._previous = os.environ.get(ENV_VAR)
        self._previous_interval = os.environ.get(INTERVAL_VAR)
        self._closed = False
        os.environ[ENV_VAR] = self.channel.path
        interval = trace.meta.get("interval")
        if interval:  # the children sample their stacks as often as the watch samples
            os.environ[INTERVAL_VAR] = repr(float(interval))
        register_after_fork(self, _after_fork_in_watch)

    def close(self) -> None:
        """Remove the variable and the hook, then close the channel (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        if os.environ.get(ENV_VAR) == self.channel.path:
            for name, previous in ((ENV_VAR, self._previous), (INTERVAL_VAR, self._previous_interval)):
                if previous is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = previous
        unregister_after_fork(self)
        self.channel.close()

    def records(self) -> list[ChildRecord]:
        return self.channel.snapshot()

    def workload(self, workload: WorkloadFacts) -> WorkloadFacts:
        """The watch's own workload facts with ``ranks`` (and the busiest child's facts when only children trained)."""
        merged = merge(workload, self.records(), _identity(), self.machine)
        errors = self.channel.errors[-10:]
        if self.channel.dropped_processes:
            errors.append(f"{self.channel.dropped_processes} child processes not recorded (limit reached)")
        if errors:
            merged["probe_errors"] = [*merged.get("probe_errors", []), *(f"children: {e}" for e in errors)]
        return merged

    def summary(self, summary: Summary, workload: WorkloadFacts) -> Summary:
        return job_summary(summary, workload, self.channel.trace)


def _after_fork_in_watch(watch: ChildWatch) -> None:
    """In a child multiprocessing forked from the watched process: the watch's copies go, an agent comes."""
    watch.channel.close_in_forked_child()
    if watch.probes is not None:
        watch.probes.detach_after_fork()
    start_in_forked_child()


def _identity() -> Identity:
    from gpuwidget.children.agent import update_identity

    return update_identity({"pid": os.getpid(), "rank": None, "local_rank": None, "world_size": None})
