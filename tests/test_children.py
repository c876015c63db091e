"""Training in child processes: real forked, spawned, subprocess and DDP (gloo) children report to the watch."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import site
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from gloo_job import Items as Samples
from gloo_job import fit
from torch import nn
from torch.utils.data import DataLoader

import gpuwidget
from gpuwidget.children import ENV_VAR
from gpuwidget.children.agent import physical_gpu
from gpuwidget.children.channel import ChildChannel
from gpuwidget.children.protocol import MAX_MESSAGE_BYTES, encode
from gpuwidget.children.ranks import watch_gpu
from gpuwidget.report import run_html, run_text
from gpuwidget.run import Run
from gpuwidget.trace import Trace

pytestmark = pytest.mark.slow

PTH = "gpuwidget_children.pth"
PUBLIC_KEYS = {"rank", "pid", "gpu", "steps", "samples_per_s", "data_wait_fraction",
               "step_time_p50_s", "step_time_p95_s"}


def train(batches: int, delay: float = 0.0, num_workers: int = 0, work_s: float = 0.002) -> None:
    """A real loop: ``batches`` batches of 4, a linear model, SGD."""
    loader = DataLoader(Samples(4 * batches, delay), batch_size=4, num_workers=num_workers)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in loader:
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(work_s)


def ddp_rank(rank: int, world_size: int, port: int, slow_rank: int) -> None:
    """One DDP rank on gloo; ``slow_rank``'s loader sleeps 10 ms a sample (12 batches of 4 a rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    fit(rank, world_size, 12, 0.01 if rank == slow_rank else 0.0)
    dist.destroy_process_group()


SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    train_loader = DataLoader(TensorDataset(torch.randn(80, 4), torch.randn(80, 1)), batch_size=8)
    model = torch.nn.Linear(4, 1)
    epochs = int(sys.argv[1])  # 0: until killed
    print(os.getpid(), flush=True)
    epoch = 0
    while epochs == 0 or epoch < epochs:
        for x, y in train_loader:
            model(x).sum().backward()
            time.sleep(0.003)
        epoch += 1
""")


def gpuwidget_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("gpuwidget") and t.is_alive()]


def watched(body, **options):
    """Run ``body()`` in a watch; (run, the socket directory the watch exported, body's result)."""
    with gpuwidget.watch(display=False, **options) as run:
        address = os.environ[ENV_VAR]
        result = body()
    return run, Path(address).parent, result


def assert_nothing_left(directory: Path) -> None:
    assert ENV_VAR not in os.environ
    assert not directory.exists()
    for thread in gpuwidget_threads():
        thread.join(3.0)
    assert not gpuwidget_threads(), gpuwidget_threads()


def by_pid(run: Run) -> dict[int, dict]:
    return {entry["pid"]: entry for entry in run.ranks}


# --------------------------------------------------------------------------- start-up hook


def test_startup_hook_is_installed_and_inert_without_a_watch() -> None:
    installed = [Path(d) for d in site.getsitepackages() if (Path(d) / PTH).is_file()]
    assert installed, "make install puts gpuwidget_children.pth in site-packages"
    source = Path(gpuwidget.__file__).parent / "children"
    for name, copy in (("gpuwidget_children.pth", PTH), ("_boot.py", "gpuwidget_children_boot.py")):
        assert (installed[0] / copy).read_text() == (source / name).read_text(), "stale copy: run make install"
    probe = "import sys; print(sorted(m for m in sys.modules if m.startswith('gpuwidget')))"
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    quiet = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert quiet.stdout.strip() == "[]"
    # With the variable but without torch only the tiny boot module loads: gpuwidget waits for torch.
    active = subprocess.run([sys.executable, "-c", probe], env={**env, ENV_VAR: "/nonexistent/children.sock"},
                            capture_output=True, text=True, check=True)
    assert active.stdout.strip() == "['gpuwidget_children_boot']"


def test_child_of_a_dead_watch_trains_unwatched(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, ENV_VAR: str(tmp_path / "gone.sock")}
    done = subprocess.run([sys.executable, str(script), "1"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


# --------------------------------------------------------------------------- subprocess


def test_subprocess_script_is_the_runs_training_process(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    previous = os.environ.pop(ENV_VAR, None)
    os.environ[ENV_VAR] = "a value of the user's"
    try:
        run, directory, done = watched(lambda: subprocess.run([sys.executable, str(script), "2"],
                                                              capture_output=True, text=True, timeout=120))
        assert os.environ[ENV_VAR] == "a value of the user's"  # put back as it was
    finally:
        os.environ.pop(ENV_VAR, None)
        if previous is not None:
            os.environ[ENV_VAR] = previous
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    assert [set(entry) for entry in run.ranks] == [PUBLIC_KEYS]
    (entry,) = run.ranks
    assert entry["pid"] == pid and entry["rank"] is None and entry["gpu"] is None
    assert entry["steps"] == 20  # 2 epochs of 10 batches
    assert entry["samples_per_s"] > 0 and 0 <= entry["data_wait_fraction"] < 1
    assert 0 < entry["step_time_p50_s"] <= entry["step_time_p95_s"]
    # Only the child trained: the run's loop figures and loader facts are the script's.
    assert run.summary["steps"] == 20 and run.summary["training_processes"] == 1
    assert run.summary["samples_per_s"] == pytest.approx(entry["samples_per_s"])
    assert run.workload["trained_in"] == {"pid": pid, "rank": None}
    assert run.workload["loaders"][0]["name"] == "train_loader"
    assert run.workload["model"]["class"] == "Linear"
    steps = [span for span in run.trace.spans("step") if span.attrs.get("pid") == pid]
    assert len(steps) == 20 and all(0 <= span.start <= span.end <= run.summary["duration_s"] for span in steps)
    assert_nothing_left(directory)
    # Saved and loaded, the ranks are the same.
    path = run.save(tmp_path / "run.json")
    assert json.loads(path.read_text())["ranks"] == run.ranks
    assert Run.load(path).ranks == run.ranks


def test_shell_escape_in_a_watched_cell_is_the_runs_rank(ip, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = ip.run_cell(f"%%gpuwatch --quiet\n!{sys.executable} {script} 1\n")
    assert result.error_in_exec is None
    (entry,) = gpuwidget.last_run().ranks
    assert entry["pid"] != os.getpid() and entry["steps"] == 10
    assert gpuwidget.last_run().summary["steps"] == 10
    assert ENV_VAR not in os.environ


def test_gpu_is_the_hosts_number_behind_cuda_visible_devices() -> None:
    assert physical_gpu(0, None) == 0
    assert physical_gpu(1, "4,6") == 6
    assert physical_gpu(0, "GPU-8a3c,GPU-77f1") is None  # named by UUID: the watch matches the device's UUID
    assert physical_gpu(2, "4,6") is None
    machine = {"gpus": [{"index": 0, "uuid": "GPU-11aa"}, {"index": 1, "uuid": "GPU-8A3C"}]}
    assert watch_gpu({"gpu": None, "gpu_uuid": "8a3c"}, machine) == 1
    assert watch_gpu({"gpu": 6, "gpu_uuid": "ffff"}, machine) == 6
    assert watch_gpu({"gpu": None}, machine) is None


def test_killed_child_does_not_break_the_watch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    def body() -> int:
        child = subprocess.Popen([sys.executable, str(script), "0"], stdout=subprocess.PIPE, text=True)
        pid = int(child.stdout.readline())
        run = gpuwidget.session._active.run
        deadline = time.monotonic() + 60
        while not [s for s in run.trace.spans("step") if s.attrs.get("pid") == pid]:
            assert time.monotonic() < deadline, "no spans from the child"
            time.sleep(0.1)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        return pid

    run, directory, pid = watched(body)
    (entry,) = run.workload["ranks"]
    assert entry["pid"] == pid and entry["finished"] is False
    assert entry["steps"] > 0 and entry["samples_per_s"] > 0
    assert run.summary["steps"] is None  # no loader facts: it never sent them
    assert_nothing_left(directory)


OUTLIVES = textwrap.dedent("""
    import pathlib, sys, threading, time
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    def state():
        threads = [t.name for t in threading.enumerate() if t.name.startswith("gpuwidget")]
        return hasattr(_BaseDataLoaderIter.__next__, "__wrapped__"), threads

    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    print(*state(), flush=True)
    while not pathlib.Path(sys.argv[1]).exists():  # "train": sends spans; "idle": never says anything
        for (x,) in (loader if sys.argv[2] == "train" else []):
            time.sleep(0.01)
        time.sleep(0.01)
    time.sleep(1.0)
    print(*state(), flush=True)
""")


def test_child_that_outlives_the_watch_drops_its_probes(tmp_path: Path) -> None:
    script, flag = tmp_path / "outlives.py", tmp_path / "watch-ended"
    script.write_text(OUTLIVES)
    with gpuwidget.watch(display=False):
        children = [subprocess.Popen([sys.executable, str(script), str(flag), mode], stdout=subprocess.PIPE, text=True)
                    for mode in ("train", "idle")]
        during = [child.stdout.readline().strip() for child in children]
    flag.touch()
    after = [child.communicate(timeout=60)[0].strip() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert during == ["True ['gpuwidget-child']"] * 2
    assert after == ["False []"] * 2


# --------------------------------------------------------------------------- multiprocessing


def test_forked_and_spawned_children_report_and_loader_workers_do_not() -> None:
    def body() -> list[int]:
        forked = multiprocessing.get_context("fork").Process(target=train, args=(12,), kwargs={"num_workers": 2})
        spawned = multiprocessing.get_context("spawn").Process(target=train, args=(8,))
        for process in (forked, spawned):
            process.start()
        for process in (forked, spawned):
            process.join(120)
            assert process.exitcode == 0
        return [forked.pid, spawned.pid]

    run, directory, (fork_pid, spawn_pid) = watched(body)
    ranks = by_pid(run)
    assert set(ranks) == {fork_pid, spawn_pid}  # the fork child's two DataLoader workers are no ranks
    assert ranks[fork_pid]["steps"] == 12 and ranks[spawn_pid]["steps"] == 8
    assert all(entry["finished"] for entry in run.workload["ranks"])
    assert run.summary["training_processes"] == 2
    # Only children trained: the job's figures (throughput summed, data wait the mean, the slowest rank's step).
    assert run.summary["samples_per_s"] == pytest.approx(sum(e["samples_per_s"] for e in run.ranks))
    assert run.summary["data_wait_fraction"] == pytest.approx(sum(e["data_wait_fraction"] for e in run.ranks) / 2)
    assert run.summary["step_time_p50"] == max(e["step_time_p50_s"] for e in run.ranks)
    assert all("step_times" not in loader for entry in run.workload["ranks"] for loader in entry["loaders"])
    assert run.workload["loaders"][0]["step_times"]  # the busiest child's own, in full
    assert_nothing_left(directory)


def test_watched_process_with_loader_workers_is_one_rank() -> None:
    run, directory, _ = watched(lambda: train(10, num_workers=2))
    assert [entry["pid"] for entry in run.ranks] == [os.getpid()]
    assert run.ranks[0]["steps"] == 10 == run.summary["steps"]
    assert "trained_in" not in run.workload
    assert "per process" not in run_text(run) and "gpuwidget-ranks" not in run_html(run)  # one process: no table
    assert_nothing_left(directory)


def test_ddp_ranks_on_gloo_name_the_slow_loader() -> None:
    import torch.multiprocessing as torch_mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run, directory, _ = watched(lambda: torch_mp.spawn(ddp_rank, args=(2, port, 1), nprocs=2, join=True))
    ranks = {entry["rank"]: entry for entry in run.workload["ranks"]}
    assert sorted(ranks) == [0, 1]
    assert all(entry["world_size"] == 2 and entry["steps"] == 12 for entry in ranks.values())
    assert ranks[1]["data_wait_fraction"] > ranks[0]["data_wait_fraction"] + 0.3
    assert {span.attrs["rank"] for span in run.trace.spans("loader.wait")} == {0, 1}
    assert run.summary["training_processes"] == 2
    # The panel's per-process table, one row per rank, in the text and the HTML.
    table = run_text(run).split("per process: ", 1)[1].splitlines()
    assert table[0] == "rank | pid | GPU | steps | samples/s | data wait | step p50 | step p95"
    rows = [row.strip().split(" | ")[:2] for row in table[1:3]]
    assert rows == [["0", str(ranks[0]["pid"])], ["1", str(ranks[1]["pid"])]]
    assert run_html(run).count("<tr>") == 3
    assert_nothing_left(directory)


# --------------------------------------------------------------------------- the channel itself


def test_channel_survives_bad_peers_and_cleans_up() -> None:
    trace = Trace()
    channel = ChildChannel(trace)
    assert oct(os.stat(channel.directory).st_mode & 0o777) == "0o700"
    try:
        for payload in (b"\x00\x00\x00\x05nope!", (MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"), b"\x00\x00"):
            with socket.socket(socket.AF_UNIX) as bad:
                bad.connect(channel.path)
                bad.sendall(payload)
        with socket.socket(socket.AF_UNIX) as good:
            good.connect(channel.path)
            ident = {"pid": 4242, "rank": 3}
            progress = {"steps": 2, "samples": 8, "wait_s": 0.5, "loop_s": 1.0}
            good.sendall(encode({"kind": "spans", "id": ident, "progress": progress,
                                 "spans": {"step": [[trace.start_clock + 1.0, trace.start_clock + 1.5]]}}))
    finally:
        channel.close()
    (record,) = channel.snapshot()
    assert record.pid == 4242 and record.rank == 3 and record.progress["steps"] == 2
    assert [(s.start, s.end, dict(s.attrs)) for s in trace.spans("step")] == [(1.0, 1.5, {"pid": 4242, "rank": 3})]
    assert len(channel.errors) == 2  # not an object; too large (the cut-off frame is no error)
    assert not Path(channel.directory).exists()


def test_a_childs_open_step_and_cpu_reach_the_watch_marked_as_such() -> None:
    from gpuwidget.children.agent import SpanBuffer, cpu_seconds

    buffer = SpanBuffer()
    buffer.add_span("step", 1.0, 2.0)
    buffer.add_span("step", 2.0, 5.0, {"open": True})  # the probes closed a step the loop never finished
    spans = buffer.take()
    assert spans == {"step": [(1.0, 2.0)], "step.open": [(2.0, 5.0)]}
    cpu = cpu_seconds(live_children=True)
    assert set(cpu) == {"process_s", "workers_s"} and cpu["process_s"] > 0
    trace = Trace()
    channel = ChildChannel(trace)
    try:
        with socket.socket(socket.AF_UNIX) as child:
            child.connect(channel.path)
            origin = trace.start_clock
            child.sendall(encode({"kind": "spans", "id": {"pid": 4242, "rank": None}, "progress": {},
                                  "cpu": cpu, "spans": {kind: [[origin + start, origin + end] for start, end in items]
                                                        for kind, items in spans.items()}}))
    finally:
        channel.close()
    (record,) = channel.snapshot()
    assert record.cpu == cpu
    assert list(record.step_times) == [1.0]  # the open step is no whole step
    assert [(s.start, s.end, s.attrs.get("open", False)) for s in trace.spans("step")] == [(1.0, 2.0, False),
                                                                                          (2.0, 5.0, True)]
