"""benchmarks/gpu_check.py: its dry run passes against the fake NVML, and each of its checks can fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

DEVICES = [{"id": "gpu0", "uuid": "GPU-bbbb", "nvml_index": 1, "gpm": True},
           {"id": "gpu1", "uuid": "GPU-aaaa", "nvml_index": 0, "gpm": True}]
# nvidia-smi lists GPUs in NVML order: its first row is CUDA's gpu1 here.
SMI = "GPU-aaaa, 3, 1024, 80.5, 40, 1410\nGPU-bbbb, 97, 30720, 650.0, 71, 1980\n"


def test_dry_run_exercises_every_check_against_the_fake_and_passes():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for fragment in ("PASS busy gpu0 utilisation", "PASS idle gpu0 utilisation", "PASS gpm gpu0 sm_active",
                     "PASS tiny kernels vs CUDA graph rule", "0 failed"):
        assert fragment in done.stdout


def test_readings_are_paired_with_nvidia_smi_by_uuid_not_by_index():
    theirs = [gpu_check.parse_query(SMI)]
    ours = [{"gpu0.util": 96.0, "gpu0.mem_used": 30720 * 2**20, "gpu0.power": 640.0, "gpu0.temperature": 71.0,
             "gpu0.sm_clock": 1.98e9, "gpu1.util": 2.0}]
    checks = gpu_check.compare("busy", DEVICES, ours, theirs, "gpu0", lambda u: u >= 80, ">= 80%")
    assert all(c.verdict in ("PASS", "SKIP") for c in checks), [str(c) for c in checks]


def test_a_frozen_utilisation_fails_the_idle_phase():
    theirs = [gpu_check.parse_query(SMI.replace(", 97,", ", 0,"))]
    frozen = [{"gpu0.util": 97.0}]
    checks = gpu_check.compare("idle", DEVICES, frozen, theirs, "gpu0", lambda u: u <= 10, "<= 10%")
    failed = {c.name for c in checks if c.verdict == "FAIL"}
    assert failed == {"idle gpu0 util", "idle gpu0 utilisation"}


def test_a_gpu_missing_from_nvidia_smi_fails():
    checks = gpu_check.compare("busy", DEVICES, [{}], [gpu_check.parse_query(SMI.splitlines()[0])], "gpu0",
                               lambda u: True, "")
    assert [str(c) for c in checks if c.verdict == "FAIL"] == ["FAIL busy gpu0 uuid: nvidia-smi lists no GPU GPU-bbbb"]


def test_gpm_against_dmon_fails_beyond_its_tolerance_and_skips_without_gpm():
    dmon = gpu_check.parse_dmon("# gpu smUtil anyTensorUtil\n# Idx % %\n    1   70   40\n    0    5    0\n")
    assert dmon == {1: (70.0, 40.0), 0: (5.0, 0.0)}
    ours = [{"gpu0.sm_active": 30.0, "gpu0.tensor_active": 41.0}]
    checks = gpu_check.compare_gpm([DEVICES[0], {**DEVICES[1], "gpm": False}], ours, dmon)
    assert [c.verdict for c in checks] == ["FAIL", "PASS", "SKIP"]


@pytest.mark.parametrize(("rules", "after", "verdicts"), [(["fp32-math"], 300.0, ["PASS", "PASS"]),
                                                          (["small-batch"], 300.0, ["FAIL", "PASS"]),
                                                          (["fp32-math"], 140.0, ["PASS", "FAIL"])])
def test_a_workload_fails_when_its_rule_is_silent_or_its_change_does_not_pay(rules, after, verdicts):
    outcome = gpu_check.Outcome("FP32", ("fp32-math",), rules, before=100.0, after=after, min_gain=1.5)
    assert [c.verdict for c in gpu_check.judge(outcome)] == verdicts


def test_any_fail_makes_the_script_exit_non_zero(monkeypatch, capsys):
    silent = gpu_check.Outcome("tiny kernels", ("launch-bound",), [], before=100.0, after=90.0, min_gain=2.0)
    monkeypatch.setattr(gpu_check, "recorded_outcomes", lambda: [silent])
    assert gpu_check.main(["--dry-run"]) == 1
    assert "FAIL tiny kernels rule" in capsys.readouterr().out
