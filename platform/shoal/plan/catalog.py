"""The GPUs shoal plans for: memory, dense peak FLOP/s per precision, links and CUDA capability.

Peaks are the vendors' dense (no sparsity) tensor-core figures for the SXM/
OAM parts (PCIe for the L40S and T4); fp32 training runs on TF32 tensor cores
from Ampere on, on the CUDA cores before. The capability says which precisions
run natively (shoal/hardware.py): bf16 from 8.0, fp8 from 8.9.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.hardware import Cuda

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
    capability: tuple[int, int]  # CUDA compute capability

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def peak_flops(self, precision: str) -> float:
        return self.peak_tflops[precision] * TERA

    @property
    def hardware(self) -> Cuda:
        """As shoal/hardware.py describes a GPU: which precisions it runs natively."""
        return Cuda(self.name, self.capability)


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
            (9, 0),
        ),
        Gpu(
            "h200-141gb",
            "NVIDIA H200 141GB SXM",
            141,
            {"fp32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
            True,
            ("H200",),
            (9, 0),
        ),
        Gpu(
            "l40s-48gb",
            "NVIDIA L40S 48GB PCIe",
            48,
            {"fp32": 183.0, "bf16": 362.1, "fp16": 362.1, "fp8": 733.0},
            False,
            ("L40S",),
            (8, 9),
        ),
        Gpu(
            "a100-80gb",
            "NVIDIA A100 80GB SXM",
            80,
            # Ampere has no fp8: fp8 falls back to bf16 speed (shoal refuses fp8 there anyway).
            {"fp32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": 312.0},
            True,
            ("A100",),
            (8, 0),
        ),
        # Before Ampere: no bf16 tensor cores (bf16 at fp32's rate at best) and no fp8
        # (shown at fp16's rate; shoal refuses fp8 there).
        Gpu(
            "v100-32gb",
            "NVIDIA V100 32GB SXM2",
            32,
            {"fp32": 15.7, "bf16": 15.7, "fp16": 125.0, "fp8": 125.0},
            True,
            ("V100",),
            (7, 0),
        ),
        Gpu(
            "t4-16gb",
            "NVIDIA T4 16GB PCIe",
            16,
            {"fp32": 8.1, "bf16": 8.1, "fp16": 65.0, "fp8": 65.0},
            False,
            ("Tesla T4",),
            (7, 5),
        ),
    )
}


def gpu_for_device(device_name: str) -> Gpu | None:
    """The catalog entry for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), if any."""
    for gpu in CATALOG.values():
        if any(text in device_name for text in gpu.matches):
            return gpu
    return None
