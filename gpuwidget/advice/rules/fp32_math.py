"""fp32-math: FP32 weights on an Ampere-or-newer GPU with no autocast and TF32 off.

Since Ampere (compute capability 8.0) Tensor Cores run TF32 and BF16 matrix math faster than the
FP32 units, by a ratio that depends on the chip (dense figures from NVIDIA's datasheets, below);
with TF32 off (``fp32_precision == "ieee"``, legacy ``float32_matmul_precision == "highest"``) and no
autocast, matmuls skip them. Where GPM reports tensor-pipe activity (Hopper and newer), tensor pipes
already busy mean the Tensor Cores are in use and there is nothing to say.

Autocast is judged over the trained model's forward calls (``workload["training"]["autocast_share"]``),
not its first call alone: a loop whose first call (a shape check, a warm-up pass) runs outside
``torch.autocast`` and its steps inside it trains in bf16. Where the counted step's FLOPs ran in a
Tensor Core dtype (``flops_dtype``), that settles it.
"""

from __future__ import annotations

from gpuwidget.advice.finding import Finding
from gpuwidget.advice.rules._gpu import busy, capability, gpu_measured, model_name, model_on_cuda
from gpuwidget.facts import MachineFacts, ModelFacts, Summary, WorkloadFacts

RULE = "fp32-math"
MIN_CAPABILITY = (8, 0)
# Share of parameters in float32 above which the model counts as FP32.
FP32_SHARE = 0.5
# Dense TF32 Tensor Core peak over FP32 peak, per compute capability (NVIDIA datasheets; the
# doubled "with sparsity" figures do not apply to training): A100 156/19.5 = 8x; A40 74.8/37.4 and
# A10 62.5/31.2 = 2x; L40S 183/91.6 and L4 60/30.3 = 2x; H100 SXM 494.7/67 = 7.4x.
TF32_OVER_FP32 = {(8, 0): 8.0, (8, 6): 2.0, (8, 9): 2.0, (9, 0): 7.4}
# Another chip: the smallest ratio above, so the gain is never overstated.
DEFAULT_TF32_OVER_FP32 = 2.0
# GPM tensor-pipe activity at or above this share of time: the Tensor Cores already carry work.
TENSOR_ACTIVE_IN_USE_PERCENT = 10.0
# Share of the trained model's forward calls under torch.autocast from which the model counts as
# trained under autocast: most of its math then runs in bf16/fp16 (the rest, typically evaluation
# passes or a first shape check, is the smaller part and not what the finding is about).
AUTOCAST_SHARE_ENOUGH = 0.5
# Dtypes the counted step's FLOPs may run in on Tensor Cores (probes.torch_steps: flops_dtype).
TENSOR_CORE_DTYPES = frozenset({"fp8", "bf16", "fp16", "tf32"})


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
    under_autocast = autocast_share(workload)
    if under_autocast >= AUTOCAST_SHARE_ENOUGH or _matmul_tf32(model):
        return None
    if ((workload.get("training") or {}).get("flops_dtype") or "fp32") in TENSOR_CORE_DTYPES:
        return None
    tensor_active = summary.get("gpu_tensor_active_mean")
    if tensor_active is not None and tensor_active >= TENSOR_ACTIVE_IN_USE_PERCENT:
        return None
    ratio = TF32_OVER_FP32.get(cap, DEFAULT_TF32_OVER_FP32)
    worked = busy(summary)
    # Amdahl: at most the busy share of the time speeds up, by at most the chip's ratio. The busy figure is
    # SM activity where GPM has it (below utilisation, so the bound is the smaller, never overstated).
    share = worked.percent / 100.0
    bound = 1.0 / (1.0 - share * (1.0 - 1.0 / ratio))
    name = model_name(workload)
    conv_off = model.get("cudnn_allow_tf32") is False
    evidence: dict[str, object] = {
        "param_dtypes": dtypes, "autocast": False, "autocast_share": round(under_autocast, 2),
        "capability": f"{cap[0]}.{cap[1]}",
        "float32_matmul_precision": model.get("float32_matmul_precision"),
        "cudnn_allow_tf32": model.get("cudnn_allow_tf32"), "tf32_over_fp32": ratio,
        **worked.evidence,
    }
    if tensor_active is not None:
        evidence["tensor_active_percent"] = round(tensor_active, 1)
    return Finding(
        rule=RULE,
        severity="warn",
        title=f"FP32 math skips the Tensor Cores (compute capability {cap[0]}.{cap[1]})",
        evidence=evidence,
        suggestion=("The model's weights are float32, autocast is off and TF32 is disabled, so matrix math "
                    f"runs on the FP32 units. On this GPU TF32 Tensor Cores are up to {ratio:g}x faster: allow "
                    "TF32 (one line, tiny precision change) or train under bfloat16 autocast (larger gain, keeps "
                    "FP32 master weights)."
                    + (" cuDNN's TF32 is off too, which slows convolutions the same way." if conv_off else "")),
        change={"float32_matmul_precision": "high", "autocast_dtype": "bfloat16",
                **({"cudnn_allow_tf32": True} if conv_off else {})},
        code="import torch\n" + _tf32_code(model, conv_off) + ("# or, in the training step:\n"
                                                         '# with torch.autocast("cuda", dtype=torch.bfloat16):\n'
                                                         f"#     loss = loss_fn({name or 'model'}(x), y)"),
        expected_speedup=round(bound, 2),
    )


def autocast_share(workload: WorkloadFacts) -> float:
    """Share of the trained model's forward calls that ran under autocast; without counted calls (no
    optimizer stepped), 1 or 0 from its first call."""
    training = workload.get("training") or {}
    if training.get("forward_calls"):
        return float(training.get("autocast_share") or 0.0)
    return 1.0 if ((workload.get("model") or {}).get("autocast") or {}).get("enabled") else 0.0


def _matmul_tf32(model: ModelFacts) -> bool:
    """TF32 allowed for matmuls, by whichever API the probe could read."""
    allowed = model.get("cuda_matmul_allow_tf32")
    if allowed is not None:
        return bool(allowed)
    return model.get("float32_matmul_precision", "highest") != "highest"


def _tf32_code(model: ModelFacts, conv_off: bool) -> str:
    """TF32 on, in the API this torch has: mixing the legacy and new switches makes torch raise."""
    if model.get("tf32_api") == "fp32_precision":
        return ('torch.backends.cuda.matmul.fp32_precision = "tf32"  # TF32 on Tensor Cores\n'
                + ('torch.backends.cudnn.conv.fp32_precision = "tf32"\n' if conv_off else ""))
    return ('torch.set_float32_matmul_precision("high")  # TF32 on Tensor Cores\n'
            + ("torch.backends.cudnn.allow_tf32 = True\n" if conv_off else ""))
