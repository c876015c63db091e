"""fp32-math: FP32 weights on an Ampere-or-newer GPU with no autocast and TF32 off.

Since Ampere (compute capability 8.0) Tensor Cores run TF32 and BF16 matrix math at many
times FP32's rate (A100: 156 TF32 / 312 BF16 vs 19.5 FP32 TFLOPS, NVIDIA's datasheet);
with ``float32_matmul_precision == "highest"`` and no autocast, matmuls skip them.
"""

from __future__ import annotations

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import capability, gpu_measured, model_name, model_on_cuda
from gpuwidget.facts import MachineFacts, Summary, WorkloadFacts

RULE = "fp32-math"
MIN_CAPABILITY = (8, 0)
# Share of parameters in float32 above which the model counts as FP32.
FP32_SHARE = 0.5
# TF32 vs FP32 peak on A100: an upper bound for the matmul share of busy GPU time.
TENSOR_CORE_RATIO = 8.0


def check(summary: Summary, workload: WorkloadFacts, machine: MachineFacts) -> Finding | None:
    if not gpu_measured(summary, machine) or not model_on_cuda(workload):
        return None
    cap = capability(workload)
    model = workload.get("model") or {}
    if cap is None or cap < MIN_CAPABILITY:
        return None
    dtypes = model.get("param_dtypes") or {}
    total = sum(dtypes.values())
    if not total or dtypes.get("float32", 0) / total < FP32_SHARE:
        return None
    if (model.get("autocast") or {}).get("enabled") or model.get("float32_matmul_precision") != "highest":
        return None
    busy = summary["gpu_busy_mean"] / 100.0
    bound = 1.0 / (1.0 - busy * (1.0 - 1.0 / TENSOR_CORE_RATIO))
    name = model_name(workload)
    return Finding(
        rule=RULE,
        severity="warn",
        title=f"FP32 math skips the Tensor Cores (compute capability {cap[0]}.{cap[1]})",
        evidence={"param_dtypes": dtypes, "autocast": False,
                  "float32_matmul_precision": model.get("float32_matmul_precision"),
                  "capability": f"{cap[0]}.{cap[1]}", "gpu_busy_percent": round(100 * busy, 1)},
        suggestion=("The model's weights are float32, autocast is off and TF32 is disabled, so matrix math "
                    "runs on the FP32 units. Allow TF32 (one line, tiny precision change) or train under "
                    "bfloat16 autocast (larger gain, keeps FP32 master weights)."),
        change={"float32_matmul_precision": "high", "autocast_dtype": "bfloat16"},
        code=('torch.set_float32_matmul_precision("high")  # TF32 on Tensor Cores\n'
              "# or, in the training step:\n"
              'with torch.autocast("cuda", dtype=torch.bfloat16):\n'
              f"    loss = loss_fn({name}(x), y)"),
        expected_speedup=round(bound, 2),
    )
