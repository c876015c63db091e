"""Stack samples in child processes: a script run by the watched code (as ``gpuwatch`` runs one) has
its main thread's stack sampled by its own agent, and its ``loop_waits`` become the run's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import gpuwidget
from gpuwidget.children.protocol import (
    DEFAULT_STACK_INTERVAL_S,
    FLUSH_INTERVAL_S,
    INTERVAL_VAR,
    MIN_STACK_INTERVAL_S,
    stack_interval,
)

pytestmark = pytest.mark.slow

# A loop that fetches its own batches from a slow function, nanoGPT's way; 200 steps of ~8 ms: past the
# evidence gate (advice.evidence: a second of steady steps) that loop-waits names nothing under.
SCRIPT = textwrap.dedent("""
    import time
    import torch

    def fetch_batch():
        time.sleep(0.006)  # the slow read
        return torch.randn(8, 16)

    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(200):
        x = fetch_batch()
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
""")


def test_a_child_scripts_slow_batch_function_is_named_from_its_own_stack_samples(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with gpuwidget.watch(interval=0.02, display=False) as run:
        assert os.environ[INTERVAL_VAR] == "0.02"  # the children sample as often as the watch
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the watch's variables with it
        subprocess.run([sys.executable, str(script)], check=True, timeout=120, env=env)
    assert INTERVAL_VAR not in os.environ
    assert run.summary["steps"] == 200, (run.workload.get("ranks"), run.workload.get("probe_errors"))
    assert run.workload["trained_in"]["pid"] != os.getpid()
    stack = run.workload["stack_samples"]
    assert stack["steps"] >= 199 and stack["loop_samples"] >= 10  # the child's samples, not the watch's
    wait = run.workload["loop_waits"][0]
    assert (wait["function"], wait["name"], wait["line"]) == ("fetch_batch", "fetch_batch", 6)
    assert wait["share"] >= 0.3
    finding = next(f for f in run.findings if f.rule == "loop-waits")
    assert finding.code.endswith("fetch_batch = Prefetcher(fetch_batch)")
    # Each process keeps its top wait (the rank rules name it); the stack facts are carried once, in the workload.
    assert run.workload["ranks"][0]["loop_waits"] == run.workload["loop_waits"][:1]
    assert "stack_samples" not in run.workload["ranks"][0]


@pytest.mark.parametrize(("value", "interval"), [
    (None, DEFAULT_STACK_INTERVAL_S), ("", DEFAULT_STACK_INTERVAL_S), ("0.05", 0.05), ("nan", DEFAULT_STACK_INTERVAL_S),
    ("x", DEFAULT_STACK_INTERVAL_S), ("0.001", MIN_STACK_INTERVAL_S), ("5", FLUSH_INTERVAL_S)])
def test_the_childs_stack_interval_is_the_watchs_within_its_bounds(value, interval):
    assert stack_interval(value) == interval
