"""Real-GPU check: record a Trace of a small training loop and compare NVML readings with nvidia-smi.

Run only where an NVIDIA GPU is at hand (it exits with a message elsewhere):

    .venv/bin/python benchmarks/gpu_check.py [--out build/gpu_check]

It writes, under ``--out``:

* ``trace.json``: the Run of a watched CUDA training loop (a starved phase with
  ``num_workers=0`` and a CPU-heavy dataset, then a fed phase with workers), to be committed
  as a test fixture (``tests/fixtures/h200_run.json``) for replay-based tests;
* ``compare.json``: gpuwidget's NVML readings next to ``nvidia-smi --query-gpu`` taken at
  the same moments (utilisation, memory used, power, temperature, SM clock), with the
  differences;
* ``advice.txt``: the panel text of both phases (the advisor on a real GPU case).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUERY = "utilization.gpu,memory.used,power.draw,temperature.gpu,clocks.sm"
FIELDS = {"utilization.gpu": ("util", 1.0), "memory.used": ("mem_used", 2**20), "power.draw": ("power", 1.0),
          "temperature.gpu": ("temperature", 1.0), "clocks.sm": ("sm_clock", 1e6)}


def nvidia_smi() -> list[dict[str, float]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        rows.append({name: float(v) * scale for (name, scale), v in zip(FIELDS.values(), values)
                     if v not in ("[N/A]", "N/A", "")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "build" / "gpu_check"))
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("gpu_check: no nvidia-smi here; this check needs an NVIDIA GPU.")
        return
    import torch
    from torch.utils.data import DataLoader, Dataset

    import gpuwidget
    from gpuwidget.sources.nvml import NvmlSource

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (a CPU build of torch?).")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # 1. NVML against nvidia-smi, while the GPU works.
    source = NvmlSource()
    compare = []
    stop = threading.Event()

    def load() -> None:
        a = torch.randn(8192, 8192, device="cuda")
        while not stop.is_set():
            a = (a @ a).tanh_()
        torch.cuda.synchronize()

    worker = threading.Thread(target=load)
    worker.start()
    try:
        for _ in range(10):
            time.sleep(0.5)
            ours = source.read()
            theirs = nvidia_smi()
            for index, row in enumerate(theirs):
                for name, value in row.items():
                    mine = ours.get(f"gpu{index}.{name}")
                    compare.append({"gpu": index, "metric": name, "gpuwidget": mine, "nvidia_smi": value,
                                    "difference": None if mine is None else mine - value})
    finally:
        stop.set()
        worker.join()
        source.close()
    (out / "compare.json").write_text(json.dumps(compare, indent=1))

    # 2. A watched training loop on the GPU: starved, then fed.
    class Decoded(Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int):
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:
                pass
            return torch.randn(3, 64, 64), i % 10

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(loader: DataLoader, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if time.perf_counter() > end:
                    break

    texts = []
    for phase, workers in (("starved", 0), ("fed", 8)):
        train_loader = DataLoader(Decoded(), batch_size=64, shuffle=True, num_workers=workers,  # noqa: F841
                                  pin_memory=True, persistent_workers=workers > 0)
        with gpuwidget.watch(quiet=True, interval=0.1) as run:
            train(train_loader, args.seconds / 2)
        run.save(out / f"{phase}_run.json")
        texts.append(f"== {phase}\n" + run._repr_mimebundle_()["text/plain"])
    (out / "advice.txt").write_text("\n\n".join(texts) + "\n")
    print("\n\n".join(texts))
    print(f"\nwritten to {out}: compare.json, starved_run.json, fed_run.json, advice.txt")


if __name__ == "__main__":
    main()
