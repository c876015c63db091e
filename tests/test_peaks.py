"""The chip peak table: each device name NVML and torch give matched to its own row, dense figures only."""

from __future__ import annotations

import pytest

from gpuwidget.peaks import CHIPS, chip, peak_flops


@pytest.mark.parametrize(("name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10", "A10"),
    ("Tesla T4", "T4"),
    ("Tesla V100-SXM2-16GB", "V100 SXM2"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ("NVIDIA GeForce RTX 4080", "GeForce RTX 4080"),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090"),
    ("NVIDIA RTX A6000", "RTX A6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
])
def test_each_device_name_finds_its_own_row(name, expected):
    row = chip(name)
    assert row is not None and row.chip == expected


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40", "NVIDIA GeForce RTX 3090 Ti",
                                  "NVIDIA GeForce RTX 4080 SUPER", "NVIDIA GeForce RTX 4090 D", "NVIDIA A40",
                                  "NVIDIA GH200 480GB", "", None])
def test_a_chip_the_table_lacks_has_no_peak(name):
    # Near names with other clocks or SM counts are not a row's: no MFU beats one against the wrong peak.
    assert chip(name) is None and peak_flops(name, "bf16") is None


def test_peaks_are_the_dense_figures_not_the_sparsity_ones():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12  # the datasheet prints 1,979* with sparsity
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == 1978.9e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494.7e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 67e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no FP8 Tensor Cores


def test_every_row_has_a_source_and_rising_peaks_down_the_precisions():
    order = ("fp8", "bf16", "tf32", "fp32")
    for row in CHIPS:
        assert "datasheet" in row.source or "whitepaper" in row.source
        listed = [row.peaks[dtype] for dtype in order if dtype in row.peaks]
        assert listed == sorted(listed, reverse=True), row.chip
        assert row.peaks.get("bf16", row.peaks["fp16"]) == row.peaks["fp16"], row.chip  # same Tensor Core rate
