"""How a device runs each `train.precision`: natively, emulated (slower than fp32), or not at all.

CPU: bf16 matmuls run in hardware with AVX512-BF16 or AMX; without them (an AVX2-only
CPU) autocast emulates bf16, and a Linear forward+backward took 22.9x fp32's time
(gpt_pytext.yaml: 108 tokens/s against ~5,100 with native bf16). fp16 runs in hardware
with AMX-FP16 only. GPU: bf16 from CUDA capability 8.0 (Ampere), fp16 tensor cores from
7.0 (Volta), fp8 from 8.9 (Ada, Hopper). `auto` is bf16 where it is native, else fp32.

The CPU facts come from torch's own probes (`torch.cpu._is_avx512_bf16_supported` and
kin, private: a torch without them is taken to have no native bf16). Used by `shoal
validate`, `shoal plan` and `shoal doctor`, and by the workers to resolve `auto`. torch is
imported only by the probes: the planner's GPU catalog, which `shoal --help` loads, uses
this module's descriptions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NATIVE, EMULATED, UNSUPPORTED = "native", "emulated", "unsupported"
BF16_CUDA, FP16_CUDA, FP8_CUDA = (8, 0), (7, 0), (8, 9)
# torch.cpu probe -> the feature's name, in the order they are shown
CPU_PROBES = {
    "_is_avx512_bf16_supported": "AVX512-BF16",
    "_is_amx_tile_supported": "AMX",
    "_is_amx_fp16_supported": "AMX-FP16",
}
CPU_COST = {  # what emulation costs on a CPU, as measured (`shoal doctor` measures this CPU)
    "bf16": "~23x fp32's time (measured: a Linear forward+backward on an AVX2-only CPU)",
    "fp16": "~10-30x fp32's time (measured: a Linear forward+backward on CPUs without AMX-FP16)",
}


@dataclass(frozen=True)
class Cpu:
    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    features: tuple[str, ...]  # of CPU_PROBES' names, those this CPU has
    probed: bool = True  # False: this torch has none of the probes

    @property
    def bf16(self) -> bool:
        return "AVX512-BF16" in self.features or "AMX" in self.features

    @property
    def fp16(self) -> bool:
        return "AMX-FP16" in self.features

    def describe(self) -> str:
        if not self.probed:
            return f"CPU {self.capability} (this torch does not say whether it has AVX512-BF16 or AMX)"
        if self.features:
            return f"CPU {self.capability} with {', '.join(self.features)}"
        return f"CPU {self.capability} without AVX512-BF16 or AMX"


@dataclass(frozen=True)
class Cuda:
    name: str
    capability: tuple[int, int]

    def describe(self) -> str:
        return f"{self.name} (CUDA capability {self.capability[0]}.{self.capability[1]})"


Hardware = Cpu | Cuda


@dataclass(frozen=True)
class Support:
    precision: str
    status: str  # NATIVE, EMULATED or UNSUPPORTED
    hardware: str  # what was asked, in words
    cost: str = ""  # what emulation costs, or why it cannot run
    advice: str = "use auto or fp32 for full speed"

    def warning(self) -> str | None:
        """One line for a person, or None where the precision runs natively."""
        if self.status == EMULATED:
            return (
                f"train.precision {self.precision} is emulated on {self.hardware}: {self.cost}; {self.advice}"
            )
        if self.status == UNSUPPORTED:
            return f"train.precision {self.precision} cannot run on {self.hardware}: {self.cost}"
        return None


def _probe(name: str) -> bool | None:
    # deferred: torch takes seconds to import; see the module docstring
    import torch

    check = getattr(torch.cpu, name, None)
    if check is None:
        return None
    try:
        return bool(check())
    except Exception:  # a build whose probe fails is a build that cannot say
        return None


def this_cpu() -> Cpu:
    """The CPU this process runs on, as torch sees it."""
    # deferred: torch takes seconds to import; see the module docstring
    import torch

    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older or unusual builds
        capability = "unknown"
    found = {label: _probe(name) for name, label in CPU_PROBES.items()}
    probed = any(value is not None for value in found.values())
    return Cpu(capability, tuple(label for label, value in found.items() if value), probed)


def this_gpu(index: int = 0) -> Cuda | None:
    """CUDA device `index` of this process, or None without CUDA."""
    # deferred: torch takes seconds to import; see the module docstring
    import torch

    if not torch.cuda.is_available():  # get_device_capability() raises on a CPU build
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return Cuda(torch.cuda.get_device_name(index), (major, minor))


def device_hardware(device: torch.device) -> Hardware:
    gpu = this_gpu(device.index or 0) if device.type == "cuda" else None
    return gpu if gpu is not None else this_cpu()


def _cpu_support(precision: str, cpu: Cpu) -> Support:
    where = f"this machine's {cpu.describe()}"
    if precision == "fp8":
        return Support(precision, UNSUPPORTED, where, "fp8 needs CUDA GPUs of capability >= 8.9")
    native = {"fp32": True, "bf16": cpu.bf16, "fp16": cpu.fp16}[precision]
    return Support(precision, NATIVE if native else EMULATED, where, "" if native else CPU_COST[precision])


def _cuda_support(precision: str, gpu: Cuda) -> Support:
    where, have = gpu.describe(), gpu.capability
    if precision == "fp8" and have < FP8_CUDA:
        return Support(precision, UNSUPPORTED, where, "fp8 needs capability >= 8.9 (Ada, Hopper or newer)")
    if precision == "bf16" and have < BF16_CUDA:
        cost = "no bf16 tensor cores before capability 8.0 (Ampere): fp32's speed at best"
        return Support(precision, EMULATED, where, cost, "use fp16, or auto (fp32 there)")
    if precision == "fp16" and have < FP16_CUDA:
        return Support(precision, EMULATED, where, "no tensor cores before capability 7.0 (Volta)")
    return Support(precision, NATIVE, where)


def support(precision: str, hardware: Hardware) -> Support:
    """How `hardware` runs `precision` (`auto`: what it resolves to there)."""
    if precision == "auto":
        precision = resolve_auto(hardware)
    if isinstance(hardware, Cuda):
        return _cuda_support(precision, hardware)
    return _cpu_support(precision, hardware)


def resolve_auto(hardware: Hardware) -> str:
    """bf16 where the hardware runs it natively, else fp32: a pure function of the device."""
    return "bf16" if support("bf16", hardware).status == NATIVE else "fp32"


def workers_hardware(gpus_per_worker: float) -> Hardware | None:
    """What will run the workers, as far as this machine can tell: its CPU for CPU workers,
    its first GPU for GPU workers (None where it has no GPU: the workers' is unknown here)."""
    return this_gpu() if gpus_per_worker else this_cpu()


def for_workers(precision: str, gpus_per_worker: float) -> tuple[str, str | None]:
    """train.precision as `shoal validate` shows it (`auto` with what it becomes here), and the
    warning where the workers' hardware, as far as this machine can tell, emulates it."""
    hardware = workers_hardware(gpus_per_worker)
    if hardware is None:
        return precision, None
    shown = f"auto ({resolve_auto(hardware)} here)" if precision == "auto" else precision
    return shown, support(precision, hardware).warning()


def _autocast_step(layer: torch.nn.Linear, x: torch.Tensor, dtype: Any) -> float:
    # deferred: torch takes seconds to import; see the module docstring
    import torch

    started = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = layer(x)
    out.float().sum().backward()
    return time.perf_counter() - started


def cpu_slowdown(precisions: tuple[str, ...] = ("bf16", "fp16"), budget_s: float = 0.5) -> dict[str, float]:
    """Each precision's autocast Linear forward+backward time over fp32's on this CPU, on one
    thread: the best of interleaved rounds (at least 3) within about `budget_s` seconds."""
    # deferred: torch takes seconds to import; see the module docstring
    import torch

    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier on a busy machine; the ratio is what counts
    try:
        generator = torch.Generator().manual_seed(0)
        layer = torch.nn.Linear(256, 256)
        x = torch.randn(64, 256, generator=generator, requires_grad=True)
        names = ("fp32", *precisions)
        best = {name: _autocast_step(layer, x, dtypes[name]) for name in names}  # warm-up
        deadline, rounds = time.perf_counter() + budget_s, 0
        while rounds < 3 or time.perf_counter() < deadline:
            for name in names:
                best[name] = min(best[name], _autocast_step(layer, x, dtypes[name]))
            rounds += 1
    finally:
        torch.set_num_threads(threads)
    return {name: best[name] / best["fp32"] for name in precisions}
