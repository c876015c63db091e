"""benchmarks/gpu_check.py: its dry run passes against the fake NVML and a fake nvidia-smi, each of its
checks FAILs when the one reading or fact it judges is made wrong, and its workloads run as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import _gpu_workloads  # noqa: E402
import gpu_check  # noqa: E402

from gpuwidget.facts import Summary  # noqa: E402
from gpuwidget.sources.nvml import METRICS  # noqa: E402

# What the lent GPU machine lacks: the check must run without importing any of it.
NOT_ON_THE_GPU_MACHINE = ("IPython", "ipywidgets", "ipykernel", "bokeh", "jupyter_bokeh", "jupyter_server",
                          "jupyter_client", "jupyterlab", "traitlets", "tornado", "comm", "nbformat")
BLOCKED_RUN = """
import importlib.abc, runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)
sys.meta_path.insert(0, Blocker())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def pending(check: gpu_check.Check) -> bool:
    """A FAIL on a name this build does not define yet (a reading of the NVML source, a summary key)."""
    return check.verdict == "FAIL" and check.detail.startswith("absent:") and (
        "not among gpuwidget's NVML readings" in check.detail or "not defined in this build" in check.detail)


def undefined_names() -> set[str]:
    readings = {item.metric for item in gpu_check.FIELDS if item.metric not in METRICS}
    keys = {key for key in gpu_check.CONTRACT if key not in Summary.__annotations__}
    return readings | keys


@pytest.fixture(scope="module")
def baseline() -> dict[str, str]:
    return gpu_check.dry_run().verdicts()


def test_dry_run_runs_without_the_notebook_stack_and_passes_all_but_names_not_built_yet(tmp_path):
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", BLOCKED_RUN, ",".join(NOT_ON_THE_GPU_MACHINE),
                           str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    elapsed = time.perf_counter() - started
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = [gpu_check.Check(**item) for item in report["checks"]]
    failed = [check for check in checks if check.verdict == "FAIL"]
    assert all(pending(check) for check in failed), "\n".join(map(str, failed)) + done.stderr
    missing = undefined_names()
    for check in failed:  # each FAIL names one of the names this build lacks, and nothing else fails
        assert any(name in check.detail for name in missing), check
    assert done.returncode == (1 if missing else 0), done.stdout + done.stderr
    assert not [check for check in checks if check.verdict == "SKIP"]
    assert sorted(path.name for path in (tmp_path / "fixtures").iterdir()) == sorted(
        f"{name}.json" for name in _gpu_workloads.EXPECTED)
    assert (tmp_path / "gpu_check.log").read_text().splitlines()[-1].startswith("gpu_check: ")
    assert elapsed < 60, f"the dry run took {elapsed:.0f} s"


@pytest.mark.parametrize("flip", sorted(gpu_check.FLIPS))
def test_each_wrong_reading_or_fact_fails_its_check_and_moves_no_other(flip, baseline):
    expected = gpu_check.FLIPS[flip]
    flipped = gpu_check.dry_run(flip).verdicts()
    assert set(flipped) == set(baseline)
    for name in expected.must:
        assert flipped[name] == "FAIL", f"{flip}: {name} did not fail"
    moved = {name for name in baseline if flipped[name] != baseline[name]} - expected.must - expected.may
    assert not moved, f"{flip} also changed {sorted(moved)}"


def test_every_check_of_the_dry_run_has_a_flip_that_fails_it(baseline):
    covered = set().union(*(flip.must for flip in gpu_check.FLIPS.values()))
    assert set(baseline) - covered == set()


def test_readings_are_paired_with_nvidia_smi_by_uuid_not_by_index():
    fields = ["uuid", "power.draw", "temperature.gpu"]
    # nvidia-smi lists GPUs in NVML order: its first row is CUDA's gpu1 here.
    rows = gpu_check.parse_query("GPU-aaaa, 80.50, 40\nGPU-bbbb, 650.00, 71\n", fields)
    devices = [{"id": "gpu0", "uuid": "GPU-bbbb"}, {"id": "gpu1", "uuid": "GPU-aaaa"}]
    ours = [{"gpu0.power": 640.0, "gpu0.temperature": 71.0, "gpu1.power": 81.0, "gpu1.temperature": 41.0}]
    report = gpu_check.Report(quiet=True)
    gpu_check.compare_readings(report, "busy", devices, ours, [rows])
    verdicts = report.verdicts()
    assert [verdicts[f"busy gpu{i} {m}"] for i in (0, 1) for m in ("power", "temperature")] == ["PASS"] * 4


def test_not_supported_in_nvidia_smi_is_absent_and_a_reading_there_then_fails():
    rows = gpu_check.parse_query("GPU-aaaa, [N/A], 40\n", ["uuid", "power.draw", "temperature.gpu"])
    assert rows == [{"uuid": "GPU-aaaa", "temperature.gpu": 40.0}]
    report = gpu_check.Report(quiet=True)
    gpu_check.compare_readings(report, "busy", [{"id": "gpu0", "uuid": "GPU-aaaa"}],
                               [{"gpu0.power": 300.0, "gpu0.temperature": 40.0}], [rows])
    assert report.verdicts()["busy gpu0 power"] == "FAIL"
    assert report.verdicts()["busy gpu0 temperature"] == "PASS"


def test_an_unknown_nvidia_smi_field_is_a_fail_that_says_so():
    report = gpu_check.Report(quiet=True)
    gpu_check.compare_readings(report, "busy", [{"id": "gpu0", "uuid": "GPU-a"}], [{"gpu0.mem_util": 3.0}],
                               [[{"uuid": "GPU-a"}]], unknown_fields=["utilization.memory"])
    check = next(c for c in report.checks if c.name == "busy gpu0 mem_util")
    assert check.verdict == "FAIL" and "no --query-gpu=utilization.memory" in check.detail


@pytest.mark.parametrize(("mine", "verdict"), [(655.0 + 98.2, "PASS"), (655.0 + 98.3, "FAIL")])
def test_power_tolerance_is_the_larger_of_25_w_and_15_percent(mine, verdict):
    report = gpu_check.Report(quiet=True)
    gpu_check.compare_readings(report, "busy", [{"id": "gpu0", "uuid": "GPU-a"}], [{"gpu0.power": mine}],
                               [[{"uuid": "GPU-a", "power.draw": 655.0}]])
    assert report.verdicts()["busy gpu0 power"] == verdict  # 15% of 655 W = 98.25 W


def test_memory_used_allows_nvidia_smis_reserve_on_top_of_64_mib():
    rows = [{"uuid": "GPU-a", "memory.used": 2000.0, "memory.reserved": 500.0}]
    for used_mib, verdict in ((2000 - 563, "PASS"), (2000 - 565, "FAIL")):
        report = gpu_check.Report(quiet=True)
        gpu_check.compare_readings(report, "busy", [{"id": "gpu0", "uuid": "GPU-a"}],
                                   [{"gpu0.mem_used": used_mib * gpu_check.MIB}], [rows])
        assert report.verdicts()["busy gpu0 mem_used"] == verdict, used_mib


def test_dmon_rows_give_the_last_two_columns_per_gpu_and_apps_sum_per_pid():
    dmon = gpu_check.parse_dmon("# gpu smUtil anyTensorUtil\n# Idx % %\n    1   70   40\n    0    5    0\n"
                                "    1   72   44\n")
    assert dmon == {1: (71.0, 42.0), 0: (5.0, 0.0)}
    # a column dmon cannot fill keeps its place; a GPM slot it cannot fill gives no row
    assert gpu_check.parse_dmon("    0  650  -  1980  96  70\n    0  650  40  1980  -  70\n") == {0: (96.0, 70.0)}
    assert gpu_check.parse_apps("123, 1000\n123, 24\n77, 5\n") == {123: 1024 * gpu_check.MIB, 77: 5 * gpu_check.MIB}


@pytest.mark.parametrize(("overhead_mib", "verdict"), [(-1, "FAIL"), (0, "PASS"), (1536, "PASS"), (1537, "FAIL")])
def test_proc_mem_must_exceed_torchs_reserve_by_at_most_the_drivers_overhead(overhead_mib, verdict):
    report = gpu_check.Report(quiet=True)
    reserved = 4 * gpu_check.GIB
    proc_mem = reserved + overhead_mib * gpu_check.MIB
    gpu_check.check_own_process(report, "gpu0", proc_mem, reserved, {42: proc_mem}, 42, False)
    assert report.verdicts()["own gpu0 proc_mem vs torch memory_reserved"] == verdict


@pytest.mark.parametrize(("rules", "ok"), [
    (["launch-bound"], True),
    (["launch-bound", "pageable-transfer"], True),  # a rule the expectation neither asks for nor forbids
    ([], False),
    (["launch-bound", "small-batch"], False),  # the rival diagnosis speaks too
])
def test_judge_rules_needs_the_expected_rule_and_no_forbidden_one(rules, ok):
    assert _gpu_workloads.judge_rules("launch_bound", rules)[0] is ok


def test_a_workload_with_nothing_to_find_fails_on_any_finding():
    assert _gpu_workloads.judge_rules("bf16_matmul", [])[0]
    assert not _gpu_workloads.judge_rules("bf16_matmul", ["periodic-stall"])[0]


def test_a_starved_loader_may_not_be_claimed_by_any_gpu_rule():
    for rule in _gpu_workloads.GPU_RULES:
        assert not _gpu_workloads.judge_rules("dataloader_starved", ["dataloader-starved", rule])[0], rule


def test_the_bf16_workloads_analytic_flops_count_each_matmul_of_a_training_step():
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    width, layers, batch = 32, 3, 16
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(batch, width)).square().mean().backward()
    saved = _gpu_workloads.BF16_WIDTH, _gpu_workloads.BF16_LAYERS, _gpu_workloads.BF16_BATCH
    try:
        _gpu_workloads.BF16_WIDTH, _gpu_workloads.BF16_LAYERS, _gpu_workloads.BF16_BATCH = width, layers, batch
        assert _gpu_workloads.bf16_matmul_flops() == counter.get_total_flops()
    finally:
        _gpu_workloads.BF16_WIDTH, _gpu_workloads.BF16_LAYERS, _gpu_workloads.BF16_BATCH = saved


def test_an_oversized_fixture_loses_its_oldest_spans_and_still_replays(tmp_path):
    run = gpu_check.fake_run("small_batch", gpu_check.FakeWorkload(
        **{**gpu_check.asdict(gpu_check.FAKE_WORKLOADS["small_batch"]), "step_s": 0.0005}))
    text, dropped = gpu_check.fixture_text(run, limit=150_000)
    assert len(text) <= 150_000 and dropped > 0
    path = tmp_path / "small_batch.json"
    path.write_text(text)
    rules, _ = gpu_check.replay_rules(path)
    assert sorted(rules) == sorted(f.rule for f in run.findings)


@pytest.fixture
def on_the_cpu(monkeypatch):
    """The workloads' own code, small, on the CPU (the GPU machine runs it at full size on CUDA)."""
    pytest.importorskip("torch")
    for name, value in {"DEVICE": "cpu", "FP32_WIDTH": 64, "FP32_BATCH": 16, "SMALL_SAMPLES": 2048,
                        "BF16_WIDTH": 32, "BF16_BATCH": 32}.items():
        monkeypatch.setattr(_gpu_workloads, name, value)


@pytest.mark.parametrize("name", list(_gpu_workloads.EXPECTED))
def test_each_workload_loop_trains_under_watch_as_built(name, on_the_cpu):
    import gpuwidget

    build, changed = _gpu_workloads.BUILDERS[name]
    loop = build()
    _gpu_workloads.warm(loop)
    loop.reset()
    with gpuwidget.watch(quiet=True, interval=0.1, label=name) as run:
        rate = _gpu_workloads.run_for(loop, 0.4)
    assert rate > 0
    model = run.workload.get("model") or {}
    assert model.get("training") and model.get("param_devices") == ["cpu"]
    loaders = run.workload.get("loaders") or []
    if name == "small_batch":
        # the watch saw the loader's iter() (its settings), and the GPU-resident batches cost no wait
        assert loaders and loaders[0]["settings"]["batch_size"] == 8
        assert run.summary["data_wait_fraction"] < 0.05
        assert model["autocast"]["dtype"] == "bfloat16"
    elif name == "dataloader_starved":
        assert loaders and loaders[0]["settings"]["num_workers"] == 0
        assert run.summary["data_wait_fraction"] > 0.1
    else:
        assert not loaders  # data made on the device: no loader, no wait
    if name == "fp32_math":
        assert model["param_dtypes"] == {"float32": sum(model["param_dtypes"].values())}
    else:
        assert "float32" not in model["param_dtypes"] or model["autocast"]["enabled"]
    if changed is not None and name != "launch_bound":  # the CUDA graph needs CUDA
        better = changed({"batch_size": 64, "num_workers": 1})
        _gpu_workloads.warm(better)
        assert _gpu_workloads.run_for(better, 0.2) > 0


def test_the_device_command_is_documented_and_fits_the_device_tool():
    command = gpu_check.DEVICE_COMMAND
    assert len(command) < 2000
    for doc in ("README.md", "BENCHMARKS.md"):
        assert command in (ROOT / doc).read_text(), doc


def test_watch_trains_saves_and_renders_without_the_notebook_stack(tmp_path):
    """The GPU machine has no IPython, Jupyter, bokeh or ipywidgets: watch() must not need them."""
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, gpuwidget\n"
        "with gpuwidget.watch(interval=0.1, label='plain') as run:\n"
        "    model = torch.nn.Linear(16, 4); optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 16)), batch_size=8)\n"
        "    for (x,) in loader:\n"
        "        model(x).sum().backward(); optimizer.step(); optimizer.zero_grad()\n"
        f"run.save({str(tmp_path / 'run.json')!r})\n"
        "print(run._repr_mimebundle_()['text/plain'].splitlines()[0])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", BLOCKED_RUN, ",".join(NOT_ON_THE_GPU_MACHINE), str(script),
                           *NOT_ON_THE_GPU_MACHINE], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["gpuwidget run: plain finished", "[]"], done.stdout
    assert json.loads((tmp_path / "run.json").read_text())["summary"]["steps"] == 32


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*)
    fields="${1#--query-gpu=}"
    case ",$fields," in *,clocks.mem,*) echo 'Field "clocks.mem" is not a valid field to query.'; exit 2;; esac
    echo "$fields" | awk -F, '{for (i = 1; i <= NF; i++)
      printf "%s%s", ($i == "uuid" ? "GPU-a" : i), (i < NF ? ", " : "\\n")}'
    ;;
  --query-compute-apps=*) echo "4242, 1024";;
  dmon) printf '# gpu sm gpm:2 gpm:5\\n# Idx %% %% %%\\n    0  99  95  70\\n    0  99  97  72\\n';;
  *) exit 3;;
esac
"""


def test_the_real_machines_nvidia_smi_calls_drop_a_field_this_nvidia_smi_lacks(tmp_path, monkeypatch):
    """The subprocess side of the real run, against a stand-in nvidia-smi on PATH (no GPU needed)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    machine = object.__new__(gpu_check.RealMachine)  # without torch.cuda: only its nvidia-smi calls
    machine.fields = [*gpu_check.AUX_FIELDS, *(item.smi for item in gpu_check.FIELDS)]
    machine.unknown_fields, machine._dmon, machine.dmon_text = [], None, ""
    rows = machine.smi()
    assert machine.unknown_fields == ["clocks.mem"]
    assert rows[0]["uuid"] == "GPU-a" and "clocks.mem" not in rows[0] and rows[0]["power.draw"] > 0
    assert machine.smi_apps() == {4242: 1024 * gpu_check.MIB}
    machine.dmon_start()
    assert machine.dmon_result() == {0: (96.0, 71.0)}
    report = gpu_check.Report(quiet=True)
    gpu_check.compare_readings(report, "busy", [{"id": "gpu0", "uuid": "GPU-a"}], [{}], [rows],
                               machine.unknown_fields)
    assert "no --query-gpu=clocks.mem" in next(c.detail for c in report.checks if c.name == "busy gpu0 mem_clock")
