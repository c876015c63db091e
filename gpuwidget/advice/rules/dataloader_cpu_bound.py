"""dataloader-cpu-bound: starved while the CPUs are already saturated by building batches.

More workers cannot help when every core is busy; the batch has to get cheaper: decode or
augment on the GPU (torchvision transforms v2 on tensors, NVIDIA DALI), cache decoded
samples, or do fixed preprocessing once, ahead of training. Thresholds live in
gpuwidget.advice.loader (HOST_SATURATED_PERCENT, CPU_WORK_RATIO, WORKER_BUSY).
"""

from __future__ import annotations

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.loader import diagnose
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "dataloader-cpu-bound"

CODE = """\
# Build each sample once, ahead of training, and keep it (decoded, resized) in memory:
cached = [dataset[i] for i in range(len(dataset))]
# ...or move the expensive transforms to the GPU, on whole batches:
from torchvision.transforms import v2
gpu_augment = v2.Compose([v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()])
for x, y in {name}:
    x = gpu_augment(x.to(device, non_blocking=True))
"""


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    d = diagnose(summary, workload, machine)
    if d is None or not d.starved or not d.cpu_saturated:
        return None
    return Finding(
        rule=RULE,
        severity="critical" if d.wait_fraction >= 0.4 else "warn",
        title=f"Building batches saturates the CPU ({d.name})",
        evidence=d.evidence,
        suggestion=(f"The loop waits {100 * d.wait_fraction:.0f}% of the time while the host CPU is "
                    f"{d.evidence.get('host_cpu_percent', 0):.0f}% busy across {d.usable_cpus} cores, so more "
                    "workers would only compete for the same cores. Make each batch cheaper: cache decoded "
                    "samples, preprocess once ahead of training, or run the augmentations on the GPU "
                    "(torchvision transforms v2 on batched tensors, or NVIDIA DALI)."),
        change={},
        code=CODE.format(name=d.name),
        expected_speedup=round(d.expected_speedup, 2),
    )
