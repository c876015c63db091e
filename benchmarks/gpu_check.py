"""Real-GPU check: PASS/FAIL per check that gpuwidget reads an NVIDIA GPU right and judges it right.

    .venv/bin/python benchmarks/gpu_check.py [--out DIR]   # on a machine with an NVIDIA GPU, under 5 minutes
    .venv/bin/python benchmarks/gpu_check.py --dry-run     # the same logic against tests/fakenvml.py

1. Readings against ``nvidia-smi --query-gpu``, matched by UUID (an index pairing is wrong under
   CUDA_VISIBLE_DEVICES and CUDA's fastest-first order), in a busy phase (a matmul loop on CUDA device
   0) and an idle phase (the same GPU left alone: its utilisation must fall, not freeze).
2. GPM SM and tensor activity against ``nvidia-smi dmon --gpm-metrics`` where the GPU has GPM (SKIP
   otherwise).
3. Four small workloads with a known cause: the expected rule must fire, and following its change
   must pay (samples/s after over before): a starved loader, batch 8, FP32 math with TF32 off, a
   loop of tiny kernels. ``--out`` saves each run (fixtures for replay tests).

Exits 1 on any FAIL. ``--dry-run`` runs checks 1 and 2 through the real NVML source against the fake
driver (with CUDA_VISIBLE_DEVICES reversed, and an idle GPU whose sample buffer stays empty) and
check 3's judging on the figures a GPU run gives; only the CUDA workloads themselves need a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpuwidget.sources.nvml import uuid_key  # noqa: E402

QUERY = "uuid,utilization.gpu,memory.used,power.draw,temperature.gpu,clocks.sm"
# nvidia-smi field -> (gpuwidget metric, scale to SI units).
FIELDS = {"utilization.gpu": ("util", 1.0), "memory.used": ("mem_used", 2.0**20), "power.draw": ("power", 1.0),
          "temperature.gpu": ("temperature", 1.0), "clocks.sm": ("sm_clock", 1e6)}
# How far gpuwidget's reading may be from nvidia-smi's, as (absolute, relative): the two read at
# slightly different moments, and NVML's utilisation is a mean over the driver's samples since the
# last tick where nvidia-smi shows the latest sample; nvidia-smi's memory.used may include memory the
# driver reserves (the v1 struct), which gpuwidget leaves out (v2).
TOLERANCE = {"util": (15.0, 0.0), "mem_used": (768 * 2.0**20, 0.02), "power": (25.0, 0.15),
             "temperature": (3.0, 0.0), "sm_clock": (0.0, 0.10)}
# The loaded GPU must read at least this busy, and at most this once left alone (percent).
BUSY_MIN_PERCENT = 80.0
IDLE_MAX_PERCENT = 10.0
# GPM activity against nvidia-smi dmon's (percentage points).
GPM_TOLERANCE = 15.0
# NVML GPM metric ids for dmon --gpm-metrics: SM activity, any tensor pipe (nvml.h).
DMON_GPM_IDS = "2,5"
# Paired reads per phase; the medians are compared.
ROUNDS = 5


@dataclass
class Check:
    name: str
    verdict: str  # PASS, FAIL or SKIP
    detail: str

    def __str__(self) -> str:
        return f"{self.verdict} {self.name}: {self.detail}"


# ------------------------------------------------------------------ 1. readings against nvidia-smi


def parse_query(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`` -> one dict per GPU in SI units."""
    rows = []
    for line in text.strip().splitlines():
        uuid, *values = [v.strip() for v in line.split(",")]
        row: dict[str, Any] = {"uuid": uuid}
        for (metric, scale), value in zip(FIELDS.values(), values):
            with contextlib.suppress(ValueError):  # [N/A], [Not Supported]
                row[metric] = float(value) * scale
        rows.append(row)
    return rows


def within(metric: str, mine: float, theirs: float) -> bool:
    absolute, relative = TOLERANCE[metric]
    return abs(mine - theirs) <= max(absolute, relative * abs(theirs))


def compare(phase: str, devices: Sequence[Mapping[str, Any]], ours: Sequence[Mapping[str, float]],
            theirs: Sequence[Sequence[Mapping[str, Any]]], loaded: str,
            expect: Callable[[float], bool], expectation: str) -> list[Check]:
    """Median readings of each GPU against nvidia-smi's row with the same UUID, and the loaded GPU's
    utilisation against the phase's expectation."""
    checks = []
    for device in devices:
        label, key = device["id"], uuid_key(device["uuid"])
        rows = [row for rounds in theirs for row in rounds if uuid_key(row["uuid"]) == key]
        if not rows:
            checks.append(Check(f"{phase} {label} uuid", "FAIL", f"nvidia-smi lists no GPU {device['uuid']}"))
            continue
        for metric in TOLERANCE:
            mine = [reading[f"{label}.{metric}"] for reading in ours if f"{label}.{metric}" in reading]
            smi = [row[metric] for row in rows if metric in row]
            if not mine or not smi:
                checks.append(Check(f"{phase} {label} {metric}", "SKIP", "not reported by both"))
                continue
            a, b = statistics.median(mine), statistics.median(smi)
            checks.append(Check(f"{phase} {label} {metric}", "PASS" if within(metric, a, b) else "FAIL",
                                f"gpuwidget {a:.4g} vs nvidia-smi {b:.4g}"))
        if label == loaded:
            utils = [reading[f"{label}.util"] for reading in ours if f"{label}.util" in reading]
            value = statistics.median(utils) if utils else float("nan")
            checks.append(Check(f"{phase} {label} utilisation", "PASS" if expect(value) else "FAIL",
                                f"{value:.0f}% (expected {expectation})"))
    return checks


def read_phase(source: Any, smi: Callable[[], list[dict[str, Any]]], seconds: float,
               tick: Callable[[], None]) -> tuple[list[dict[str, float]], list[list[dict[str, Any]]]]:
    ours, theirs = [], []
    for _ in range(ROUNDS):
        for _ in range(5):
            tick()
            time.sleep(seconds / ROUNDS / 5)
            reading = source.read()
        ours.append(reading)
        theirs.append(smi())
    return ours, theirs


# ------------------------------------------------------------------ 2. GPM against nvidia-smi dmon


def parse_dmon(text: str) -> dict[int, tuple[float, float]]:
    """``nvidia-smi dmon --gpm-metrics 2,5`` -> {nvidia-smi index: (SM activity, tensor activity)}: the
    last two numeric columns of each row, as the metrics asked for come last."""
    found: dict[int, list[tuple[float, float]]] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or line.lstrip().startswith("#"):
            continue
        numbers = []
        for field in fields:
            with contextlib.suppress(ValueError):
                numbers.append(float(field))
        if len(numbers) >= 3:
            found.setdefault(int(numbers[0]), []).append((numbers[-2], numbers[-1]))
    return {index: (statistics.median(s for s, _ in rows), statistics.median(t for _, t in rows))
            for index, rows in found.items()}


def compare_gpm(devices: Sequence[Mapping[str, Any]], ours: Sequence[Mapping[str, float]],
                dmon: Mapping[int, tuple[float, float]]) -> list[Check]:
    checks = []
    for device in devices:
        label = device["id"]
        if not device.get("gpm"):
            checks.append(Check(f"gpm {label}", "SKIP", "no GPM on this GPU (Hopper and newer)"))
            continue
        if device["nvml_index"] not in dmon:
            checks.append(Check(f"gpm {label}", "SKIP", "nvidia-smi dmon gave no GPM row"))
            continue
        for slot, metric in enumerate(("sm_active", "tensor_active")):
            mine = [reading[f"{label}.{metric}"] for reading in ours if f"{label}.{metric}" in reading]
            if not mine:
                checks.append(Check(f"gpm {label} {metric}", "FAIL", "GPM metric missing from the readings"))
                continue
            a, b = statistics.median(mine), dmon[device["nvml_index"]][slot]
            checks.append(Check(f"gpm {label} {metric}", "PASS" if abs(a - b) <= GPM_TOLERANCE else "FAIL",
                                f"gpuwidget {a:.1f} vs dmon {b:.1f}"))
    return checks


# ------------------------------------------------------------------ 3. workloads with a known cause


@dataclass
class Outcome:
    """One workload: what the advisor said on the first run, and samples/s before and after its change."""

    name: str
    expected: tuple[str, ...]  # the rule ids any of which names the cause
    rules: list[str]
    before: float
    after: float
    min_gain: float


def judge(outcome: Outcome) -> list[Check]:
    fired = [rule for rule in outcome.expected if rule in outcome.rules]
    gain = outcome.after / outcome.before if outcome.before > 0 else 0.0
    return [
        Check(f"{outcome.name} rule", "PASS" if fired else "FAIL",
              f"fired {fired or outcome.rules or 'nothing'} (expected {' or '.join(outcome.expected)})"),
        Check(f"{outcome.name} change pays", "PASS" if gain >= outcome.min_gain else "FAIL",
              f"{outcome.before:.0f} -> {outcome.after:.0f} samples/s = {gain:.2f}x (needs {outcome.min_gain}x)"),
    ]


def run_workloads(seconds: float, out: Path | None) -> list[Outcome]:  # pragma: no cover - needs CUDA
    import torch
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    import gpuwidget

    def timed(label: str, loop: Callable[[], int]) -> tuple[Any, float]:
        with gpuwidget.watch(quiet=True, interval=0.1, label=label) as run:
            start = time.perf_counter()
            samples = loop()
            torch.cuda.synchronize()
            rate = samples / (time.perf_counter() - start)
        if out is not None:
            run.save(out / f"{label}.json")
        return run, rate

    def train(model: torch.nn.Module, loader: DataLoader, step: Callable[..., Any] | None = None) -> Callable[[], int]:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if step is None else None

        def default_step(x: torch.Tensor, y: torch.Tensor) -> None:
            assert optimizer is not None
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        def loop() -> int:
            samples, end = 0, time.perf_counter() + seconds
            while time.perf_counter() < end:
                for x, y in loader:
                    x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                    (step or default_step)(x, y)
                    samples += len(x)
                    if time.perf_counter() >= end:
                        break
            return samples

        return loop

    def rules(run: Any) -> list[str]:
        return [finding.rule for finding in run.findings]

    outcomes = []

    # a. A loader that decodes on the main process: 1.5 ms of CPU per sample.
    class Decoded(Dataset):
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            end = time.perf_counter() + 0.0015
            while time.perf_counter() < end:
                pass
            return torch.randn(3, 32, 32), i % 10

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
    run, before = timed("starved_before", train(conv, DataLoader(Decoded(), batch_size=64)))
    change = next((f.change for f in run.findings if f.rule == "dataloader-starved"), {}) or {"num_workers": 8}
    fed = DataLoader(Decoded(), batch_size=64, num_workers=int(change.get("num_workers") or 8), pin_memory=True,
                     persistent_workers=True)
    _, after = timed("starved_after", train(conv, fed))
    outcomes.append(Outcome("starved loader", ("dataloader-starved",), rules(run), before, after, 1.5))

    # b. Batches of 8 through an MLP that fills the GPU at 512.
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                              torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
    data = TensorDataset(torch.randn(65536, 1024), torch.randint(0, 10, (65536,)))
    run, before = timed("batch8_before", train(mlp, DataLoader(data, batch_size=8, pin_memory=True)))
    _, after = timed("batch8_after", train(mlp, DataLoader(data, batch_size=512, pin_memory=True)))
    outcomes.append(Outcome("batch 8 vs 512", ("small-batch", "launch-bound"), rules(run), before, after, 2.0))

    # c. FP32 matmuls with TF32 off, then under bfloat16 autocast.
    matmuls = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)], torch.nn.Linear(4096, 10)).cuda()
    wide = TensorDataset(torch.randn(16384, 4096), torch.randint(0, 10, (16384,)))
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision if hasattr(matmul, "fp32_precision") else None
    if saved is not None:
        matmul.fp32_precision = "ieee"
    else:
        torch.set_float32_matmul_precision("highest")
    try:
        loader = DataLoader(wide, batch_size=256, pin_memory=True, num_workers=4, persistent_workers=True)
        run, before = timed("fp32_before", train(matmuls, loader))
        optimizer = torch.optim.SGD(matmuls.parameters(), lr=1e-3)

        def bf16_step(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(matmuls(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        _, after = timed("fp32_after", train(matmuls, loader, bf16_step))
    finally:
        if saved is not None:
            matmul.fp32_precision = saved
    outcomes.append(Outcome("FP32 vs bf16 autocast", ("fp32-math",), rules(run), before, after, 1.5))

    # d. A step of 200 tiny kernels, then the same step replayed as one CUDA graph.
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(64))  # on CUDA, so the probe sees where the model runs

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(100):
                x = (x * self.scale).add_(0.0001)
            return x

    tiny = Tiny().cuda()
    small = TensorDataset(torch.randn(65536, 64), torch.zeros(65536))

    def eager(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            tiny(x)

    static_in = torch.zeros(64, 64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            tiny(static_in)  # warm up before capture, as torch.cuda.graph requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tiny(static_in)

    def replay(x: torch.Tensor, y: torch.Tensor) -> None:
        static_in[: len(x)].copy_(x)
        graph.replay()

    run, before = timed("tiny_before", train(tiny, DataLoader(small, batch_size=64, drop_last=True), eager))
    _, after = timed("tiny_after", train(tiny, DataLoader(small, batch_size=64, drop_last=True), replay))
    outcomes.append(Outcome("tiny kernels vs CUDA graph", ("launch-bound",), rules(run), before, after, 2.0))
    return outcomes


# ------------------------------------------------------------------ the GPU and its driver: real or fake


def real_smi() -> list[dict[str, Any]]:  # pragma: no cover - needs nvidia-smi
    out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return parse_query(out)


def real_dmon() -> dict[int, tuple[float, float]] | str:  # pragma: no cover - needs nvidia-smi
    done = subprocess.run(["nvidia-smi", "dmon", "--gpm-metrics", DMON_GPM_IDS, "-c", "5"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:  # a driver or GPU without GPM support in nvidia-smi
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    return parse_dmon(done.stdout)


@contextlib.contextmanager
def busy_gpu() -> Iterator[None]:  # pragma: no cover - needs CUDA
    import torch

    stop = threading.Event()

    def load() -> None:
        a = torch.randn(8192, 8192, device="cuda")
        while not stop.is_set():
            a = (a @ a).tanh_()
        torch.cuda.synchronize()

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(1.0)  # the driver's utilisation window fills
    try:
        yield
    finally:
        stop.set()
        worker.join()


def fake_driver() -> Any:
    """Two GPUs on the fake driver, CUDA_VISIBLE_DEVICES reversed (an index pairing is wrong), GPU 1
    (CUDA device 0) busy until ``idle()`` and then idle with an empty sample buffer."""
    from fakenvml import FakeNvml

    fake = FakeNvml.gpus(2, util=3, mem_util=1)
    fake.cuda_visible_devices = "1,0"
    state = {"busy": True}
    fake.set(1, util=lambda tick: 97 if state["busy"] else 0, sm_active=lambda tick: 71.0 if state["busy"] else 0.0,
             tensor_active=lambda tick: 40.0 if state["busy"] else 0.0)
    fake.idle = lambda: state.update(busy=False)  # type: ignore[attr-defined]
    return fake


def fake_smi(fake: Any) -> Callable[[], list[dict[str, Any]]]:
    """nvidia-smi's rows as it would print them for the fake's GPUs, in NVML order."""
    from fakenvml import _at

    def rows() -> list[dict[str, Any]]:
        lines = []
        for gpu in fake.devices:
            tick = fake.tick
            used = (int(_at(gpu.memory_used, tick)) + gpu.memory_reserved) / 2**20
            lines.append(f"{gpu.uuid}, {int(_at(gpu.util, tick))}, {used:.0f}, {_at(gpu.power_mw, tick) / 1000:.2f}, "
                         f"{_at(gpu.temperature, tick)}, {_at(gpu.sm_clock_mhz, tick)}")
        return parse_query("\n".join(lines))

    return rows


def fake_dmon(fake: Any) -> dict[int, tuple[float, float]]:
    from fakenvml import _at

    text = ["# gpu  smUtil  anyTensorUtil", "# Idx       %        %"]
    for gpu in fake.devices:
        text.append(f"    {gpu.index}  {_at(gpu.sm_active, fake.tick):.0f}  {_at(gpu.tensor_active, fake.tick):.0f}")
    return parse_dmon("\n".join(text))


def recorded_outcomes() -> list[Outcome]:
    """The four workloads as a GPU run leaves them, for the dry run: the advisor's real rules on the
    figures such runs give, and throughputs of the size the changes bring."""
    from gpuwidget.advice.advisor import advise

    machine: Any = {"gpus": [{"index": 0, "id": "gpu0", "name": "NVIDIA H200", "uuid": "GPU-0"}], "usable_cpus": 16}
    loader: Any = {"name": "loader", "steps": 400, "samples": 400 * 64, "loop_time_s": 8.0, "wait_total_s": 6.4,
              "compute_total_s": 1.6, "wait_cpu_ratio": 1.0, "step_times": [0.02] * 400, "wait_times": [0.016] * 400,
              "settings": {"batch_size": 64, "num_workers": 0, "pin_memory": False, "default_collate": True}}
    model: Any = {"name": "model", "class": "Sequential", "param_devices": ["cuda"], "param_dtypes": {"float32": 10**7},
             "autocast": {"enabled": False}, "float32_matmul_precision": "highest", "cuda_matmul_allow_tf32": False,
             "cudnn_allow_tf32": True, "tf32_api": "fp32_precision", "compiled": False}
    cuda = {"devices": [{"index": 0, "name": "NVIDIA H200", "capability": [9, 0], "total_memory": 141 * 2**30,
                         "peak_allocated": 4 * 2**30, "peak_reserved": 5 * 2**30}]}
    base = {"gpu_busy_mean": 95.0, "gpus_used": [0], "peak_gpu_mem_fraction": 0.05, "process_cpu_mean": 60.0,
            "cpu_util_mean": 10.0, "data_wait_fraction": 0.02, "workers_cpu_mean": None}
    cases: list[tuple[str, tuple[str, ...], dict[str, Any], dict[str, Any], float, float, float]] = [
        ("starved loader", ("dataloader-starved",), {"data_wait_fraction": 0.8, "gpu_busy_mean": 15.0,
                                                     "process_cpu_mean": 99.0, "gpu_sm_active_mean": 10.0},
         {"loaders": [loader]}, 480.0, 3100.0, 1.5),
        ("batch 8 vs 512", ("small-batch", "launch-bound"), {"gpu_busy_mean": 35.0, "gpu_sm_active_mean": 12.0},
         {"loaders": [{**loader, "wait_total_s": 0.1, "settings": {**loader["settings"], "batch_size": 8}}]},
         2900.0, 61000.0, 2.0),
        ("FP32 vs bf16 autocast", ("fp32-math",), {"gpu_sm_active_mean": 88.0, "gpu_tensor_active_mean": 0.0},
         {"loaders": [{**loader, "wait_total_s": 0.1}]}, 9000.0, 41000.0, 1.5),
        ("tiny kernels vs CUDA graph", ("launch-bound",), {"gpu_busy_mean": 92.0, "gpu_sm_active_mean": 6.0,
                                                           "process_cpu_mean": 100.0},
         {"loaders": [{**loader, "wait_total_s": 0.1}]}, 12000.0, 70000.0, 2.0),
    ]
    outcomes = []
    for name, expected, figures, workload, before, after, gain in cases:
        summary: Any = {**base, **figures}
        findings = advise(summary, {**workload, "model": model, "cuda": cuda}, machine)  # type: ignore[typeddict-item]
        outcomes.append(Outcome(name, expected, [f.rule for f in findings], before, after, gain))
    return outcomes


# ------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="against tests/fakenvml.py, no GPU needed")
    parser.add_argument("--seconds", type=float, default=8.0, help="per workload phase (real run)")
    parser.add_argument("--out", help="save each workload's runs here (real run)")
    args = parser.parse_args(argv)
    checks: list[Check] = []
    smi: Callable[[], list[dict[str, Any]]]
    dmon: Callable[[], dict[int, tuple[float, float]] | str]
    busy: Callable[[], contextlib.AbstractContextManager[Any]]
    with contextlib.ExitStack() as stack:
        if args.dry_run:
            fake = stack.enter_context(fake_driver().patched())
            smi, dmon = fake_smi(fake), (lambda: fake_dmon(fake))
            tick, busy, idle = fake.step, contextlib.nullcontext, fake.idle
        else:  # pragma: no cover - needs a GPU
            if shutil.which("nvidia-smi") is None:
                print("gpu_check: no nvidia-smi here; run with --dry-run, or on a machine with an NVIDIA GPU.")
                return 2
            import torch

            if not torch.cuda.is_available():
                print("gpu_check: torch sees no CUDA device (a CPU build of torch?).")
                return 2
            torch.cuda.init()  # the source then numbers devices by torch's UUIDs
            smi, dmon, tick, busy, idle = real_smi, real_dmon, (lambda: None), busy_gpu, (lambda: None)
        from gpuwidget.sources.nvml import NvmlSource

        source = NvmlSource()
        stack.callback(source.close)
        devices = source.describe()["devices"]
        if not devices:
            print(f"FAIL nvml: {source.describe()['reason']}")
            return 1
        pace = 0.0 if args.dry_run else 1.0  # the fake's clock moves by ticks, not by waiting
        with busy():
            ours, theirs = read_phase(source, smi, 5.0 * pace, tick)
            measured = dmon()
        checks += compare("busy", devices, ours, theirs, "gpu0", lambda u: u >= BUSY_MIN_PERCENT,
                          f">= {BUSY_MIN_PERCENT:.0f}% while a matmul loop runs")
        if isinstance(measured, str):
            checks.append(Check("gpm", "SKIP", f"nvidia-smi dmon --gpm-metrics: {measured}"))
        else:
            checks += compare_gpm(devices, ours, measured)
        idle()
        time.sleep(2.0 * pace)  # the driver's utilisation window empties
        ours, theirs = read_phase(source, smi, 3.0 * pace, tick)
        checks += compare("idle", devices, ours, theirs, "gpu0", lambda u: u <= IDLE_MAX_PERCENT,
                          f"<= {IDLE_MAX_PERCENT:.0f}% once left alone, not its last busy value")
        if args.dry_run:
            outcomes = recorded_outcomes()
        else:  # pragma: no cover - needs a GPU
            out = Path(args.out) if args.out else None
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
            outcomes = run_workloads(args.seconds, out)
        for outcome in outcomes:
            checks += judge(outcome)
    for check in checks:
        print(check)
    failed = sum(check.verdict == "FAIL" for check in checks)
    passed = sum(check.verdict == "PASS" for check in checks)
    print(f"gpu_check{' --dry-run' if args.dry_run else ''}: {passed} passed, {failed} failed, "
          f"{len(checks) - passed - failed} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
