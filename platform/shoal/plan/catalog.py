"""The GPUs shoal plans for: memory, dense peak FLOP/s per precision, and links.

Peaks are the vendors' dense (no sparsity) tensor-core figures for the SXM/
OAM parts (PCIe for the L40S); fp32 training runs on TF32 tensor cores.
"""

from __future__ import annotations

from dataclasses import dataclass

TERA = 1e12
INTERCONNECTS = ("pcie", "nvlink", "ib")  # between GPUs: in a node (pcie, nvlink), across nodes (ib)


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_gb: float  # usable device memory, GB (10^9 bytes), as sold
    peak_tflops: dict[str, float]  # by train.precision
    nvlink: bool
    matches: tuple[str, ...]  # substrings of torch.cuda.get_device_name()

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def peak_flops(self, precision: str) -> float:
        return self.peak_tflops[precision] * TERA


CATALOG = {
    gpu.key: gpu
    for gpu in (
        Gpu(
            "h100-80gb",
            "NVIDIA H100 80GB SXM",
            80,
            {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            True,
            ("H100",),
        ),
        Gpu(
            "h200-141gb",
            "NVIDIA H200 141GB SXM",
            141,
            {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            True,
            ("H200",),
        ),
        Gpu(
            "l40s-48gb",
            "NVIDIA L40S 48GB PCIe",
            48,
            {"fp32": 183.0, "bf16": 362.1, "fp16": 362.1, "fp8": 733.0},
            False,
            ("L40S",),
        ),
        Gpu(
            "a100-80gb",
            "NVIDIA A100 80GB SXM",
            80,
            # Ampere has no fp8: fp8 falls back to bf16 speed (shoal refuses fp8 there anyway).
            {"fp32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": 312.0},
            True,
            ("A100",),
        ),
    )
}


def gpu_for_device(device_name: str) -> Gpu | None:
    """The catalog entry for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), if any."""
    for gpu in CATALOG.values():
        if any(text in device_name for text in gpu.matches):
            return gpu
    return None
