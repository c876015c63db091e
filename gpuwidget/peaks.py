"""The dense peak FLOP/s of NVIDIA and AMD chips per math dtype, for model FLOPs utilisation (MFU).

MFU is achieved FLOP/s over the chip's peak *for the dtype the matmuls ran in*: a bf16 model on
an H100 is judged against 989 TFLOP/s, an fp32 one without TF32 against 67. Every figure is the
dense one (NVIDIA's datasheets print the 2:4-sparsity figure, twice as high, with an asterisk:
training does not use structured sparsity) at the board's boost clock, and each row names the
datasheet it comes from. GeForce cards' tensor peaks are those with FP32 accumulation (what
PyTorch's matmuls use; the cards run FP16 accumulation twice as fast), from NVIDIA's architecture
whitepapers.

AMD Instinct rows are the dense matrix-core peaks of AMD's datasheets (the sparsity figures, twice as
high, are left out the same way). An MI250X is two graphics compute dies (GCDs), each a device of its
own to HIP and torch: its row is one GCD's, half the module's datasheet figure.

A chip is matched by the name its driver and torch give it (``NVIDIA H100 80GB HBM3``, ``Tesla T4``,
``NVIDIA A100-SXM4-40GB``, ``AMD Instinct MI300X``); one the table lacks, or a dtype a chip has no peak
for, gives None: no MFU is better than one against the wrong peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class ChipPeaks:
    """One chip's dense peaks, FLOP/s per dtype ("fp8", "bf16", "fp16", "tf32", "fp32")."""

    chip: str
    pattern: str  # regular expression over the normalised device name (upper case, "-"/"_" as spaces)
    peaks: dict[str, float]
    source: str

    def peak(self, dtype: str) -> float | None:
        return self.peaks.get(dtype)


def _tflops(**values: float) -> dict[str, float]:
    return {dtype: value * TERA for dtype, value in values.items()}


# Most specific first: "H100 NVL" and "H100 PCIe" before the SXM part's plain "H100".
CHIPS: tuple[ChipPeaks, ...] = (
    # AMD Instinct (CDNA 3, CDNA 2). MI325X and MI300X share their compute die and clocks.
    ChipPeaks("MI325X", r"\bMI325X\b", _tflops(fp8=2614.9, bf16=1307.4, fp16=1307.4, tf32=653.7, fp32=163.4),
              "AMD Instinct MI325X accelerator datasheet (peak FP8 5,229.8 / FP16 2,614.9 / TF32 1,307.4 TFLOPS "
              "shown with sparsity; FP32 matrix 163.4)"),
    ChipPeaks("MI300X", r"\bMI300X\b", _tflops(fp8=2614.9, bf16=1307.4, fp16=1307.4, tf32=653.7, fp32=163.4),
              "AMD Instinct MI300X accelerator datasheet (peak FP8 5,229.8 / FP16 2,614.9 / TF32 1,307.4 TFLOPS "
              "shown with sparsity; FP32 matrix 163.4)"),
    ChipPeaks("MI250X (one GCD)", r"\bMI250X\b", _tflops(bf16=191.5, fp16=191.5, fp32=47.85),
              "AMD Instinct MI250X accelerator datasheet (FP16/BF16 383, FP32 matrix 95.7 TFLOPS per module of "
              "two GCDs; no TF32), halved per GCD"),
    ChipPeaks("H200 NVL", r"\bH200\b.*\bNVL\b", _tflops(fp8=1670.5, bf16=835.5, fp16=835.5, tf32=417.5, fp32=60),
              "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL column; 3,341/1,671/835 TFLOPS shown with sparsity)"),
    ChipPeaks("H200 SXM", r"\bH200\b", _tflops(fp8=1978.9, bf16=989.4, fp16=989.4, tf32=494.7, fp32=67),
              "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column; 3,958/1,979/989 TFLOPS shown with sparsity)"),
    ChipPeaks("H100 NVL", r"\bH100\b.*\bNVL\b", _tflops(fp8=1670.5, bf16=835.5, fp16=835.5, tf32=417.5, fp32=60),
              "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL column; 3,341/1,671/835 TFLOPS shown with sparsity)"),
    ChipPeaks("H100 PCIe", r"\bH100\b.*\bPCIE\b", _tflops(fp8=1513, bf16=756.5, fp16=756.5, tf32=378, fp32=51),
              "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column; 3,026/1,513/756 TFLOPS shown with sparsity)"),
    ChipPeaks("H100 SXM", r"\bH100\b", _tflops(fp8=1978.9, bf16=989.4, fp16=989.4, tf32=494.7, fp32=67),
              "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; 3,958/1,979/989 TFLOPS shown with sparsity)"),
    ChipPeaks("B200", r"\bB200\b", _tflops(fp8=4500, bf16=2250, fp16=2250, tf32=1100, fp32=75),
              "NVIDIA HGX B200 datasheet, per GPU (9/4.5/2.2 PFLOPS shown with sparsity)"),
    # The A100 datasheet lists the same peaks for the 40 GB and 80 GB, SXM and PCIe boards.
    ChipPeaks("A100", r"\bA100\b", _tflops(bf16=312, fp16=312, tf32=156, fp32=19.5),
              "NVIDIA A100 Tensor Core GPU datasheet (624/312 TFLOPS shown with sparsity)"),
    ChipPeaks("L40S", r"\bL40S\b", _tflops(fp8=733, bf16=362.05, fp16=362.05, tf32=183, fp32=91.6),
              "NVIDIA L40S datasheet (1,466/733/366 TFLOPS shown with sparsity)"),
    ChipPeaks("L4", r"\bL4\b", _tflops(fp8=242.5, bf16=121, fp16=121, tf32=60, fp32=30.3),
              "NVIDIA L4 Tensor Core GPU datasheet (485/242/120 TFLOPS shown with sparsity)"),
    ChipPeaks("A10", r"\bA10\b", _tflops(bf16=125, fp16=125, tf32=62.5, fp32=31.2),
              "NVIDIA A10 Tensor Core GPU datasheet (250/125 TFLOPS shown with sparsity)"),
    # Turing: FP16 Tensor Cores only (no BF16, no TF32).
    ChipPeaks("T4", r"\bT4\b", _tflops(fp16=65, fp32=8.1),
              "NVIDIA T4 datasheet (mixed precision FP16/FP32 65 TFLOPS, single precision 8.1)"),
    ChipPeaks("V100S PCIe", r"\bV100S\b", _tflops(fp16=130, fp32=16.4),
              "NVIDIA V100 datasheet (V100S PCIe column: tensor 130 TFLOPS, single precision 16.4)"),
    ChipPeaks("V100 PCIe", r"\bV100\b.*\bPCIE\b", _tflops(fp16=112, fp32=14),
              "NVIDIA V100 datasheet (V100 PCIe column: tensor 112 TFLOPS, single precision 14)"),
    ChipPeaks("V100 SXM2", r"\bV100\b", _tflops(fp16=125, fp32=15.7),
              "NVIDIA V100 datasheet (V100 SXM2 column: tensor 125 TFLOPS, single precision 15.7)"),
    ChipPeaks("RTX 6000 Ada", r"\bRTX 6000 ADA\b", _tflops(fp8=728.5, bf16=364.2, fp16=364.2, tf32=182.1, fp32=91.1),
              "NVIDIA RTX 6000 Ada Generation datasheet and Ada Lovelace architecture whitepaper (1,457 FP8 "
              "TFLOPS shown with sparsity)"),
    ChipPeaks("RTX A6000", r"\bRTX A6000\b", _tflops(bf16=154.8, fp16=154.8, tf32=77.4, fp32=38.7),
              "NVIDIA RTX A6000 datasheet (309.7 tensor TFLOPS shown with sparsity)"),
    # GeForce: the "Ti" and "SUPER" boards have other clocks and SM counts; they are not these rows.
    ChipPeaks("GeForce RTX 4090", r"\bRTX 4090\b(?! ?(TI|D)\b)",
              _tflops(fp8=330.3, bf16=165.2, fp16=165.2, tf32=82.6, fp32=82.6),
              "NVIDIA Ada Lovelace GPU architecture whitepaper, RTX 4090 (FP32 accumulate, dense)"),
    ChipPeaks("GeForce RTX 4080", r"\bRTX 4080\b(?! ?(SUPER|TI)\b)",
              _tflops(fp8=194.9, bf16=97.5, fp16=97.5, tf32=48.7, fp32=48.7),
              "NVIDIA Ada Lovelace GPU architecture whitepaper, RTX 4080 (FP32 accumulate, dense)"),
    ChipPeaks("GeForce RTX 3090", r"\bRTX 3090\b(?! ?TI\b)", _tflops(bf16=71, fp16=71, tf32=35.6, fp32=35.6),
              "NVIDIA Ampere GA102 GPU architecture whitepaper, RTX 3090 (FP32 accumulate, dense)"),
)


def normalise(name: str) -> str:
    """Upper case, "-" and "_" as spaces, spaces collapsed: "NVIDIA A100-SXM4-40GB" -> "NVIDIA A100 SXM4 40GB"."""
    return " ".join(re.sub(r"[-_]", " ", name).upper().split())


def chip(name: str | None) -> ChipPeaks | None:
    """The table's row for a device name, or None for a chip it lacks."""
    if not name:
        return None
    text = normalise(name)
    return next((row for row in CHIPS if re.search(row.pattern, text)), None)


def peak_flops(name: str | None, dtype: str) -> float | None:
    """The chip's dense peak FLOP/s for ``dtype``, or None (an unknown chip, or no peak for that dtype)."""
    row = chip(name)
    return None if row is None else row.peak(dtype)
