"""`shoal doctor`: is this machine (and cluster, and tracking store) ready to train?

Each check says ✓ (fine), ✗ (will not work; with a hint), ! (works, slowly: a
precision this hardware emulates) or – (does not apply here, e.g. NCCL on a
machine without GPUs).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlflow
import ray
import torch
from mlflow.tracking import MlflowClient

from shoal.hardware import (
    EMULATED,
    NATIVE,
    Cpu,
    cpu_slowdown,
    for_workers,
    support,
    this_cpu,
    this_gpu,
    workers_hardware,
)
from shoal.launch.cluster import ClusterError
from shoal.launch.cluster import probe as probe_cluster
from shoal.launch.storage import StorageError, open_storage
from shoal.launch.storage import probe as probe_storage
from shoal.plan.catalog import gpu_for_device
from shoal.tracking.mlflow_run import CLIENT_ENV

OK, FAIL, WARN, NOT_APPLICABLE = "✓", "✗", "!", "–"
SLOW = 3.0  # a precision measured at this many times fp32's time is slow, whatever the flags say
PINNED = {"torch": "2.13", "ray": "2.60", "mlflow": "3.17"}  # pyproject's tested versions
MIN_FREE_BYTES = 5e9


@dataclass
class Check:
    name: str
    mark: str
    detail: str
    hint: str = ""


def versions() -> list[Check]:
    checks = []
    python = platform.python_version()
    python_ok = tuple(int(p) for p in python.split(".")[:2]) >= (3, 10)
    checks.append(
        Check("python", OK if python_ok else FAIL, python, "" if python_ok else "shoal needs >= 3.10")
    )
    for name, module in (("torch", torch), ("ray", ray), ("mlflow", mlflow)):
        version = module.__version__
        ok = version.startswith(PINNED[name])
        hint = "" if ok else f"tested with {name} {PINNED[name]}.x: pip install -c constraints.txt -e ."
        checks.append(Check(name, OK if ok else FAIL, version, hint))
    return checks


def gpus() -> list[Check]:
    if not torch.cuda.is_available():
        return [
            Check(
                "cuda",
                NOT_APPLICABLE,
                f"no CUDA GPU (torch built for CUDA {torch.version.cuda or 'none'})",
                "shoal trains on CPU with gloo here; set scaling.gpus_per_worker: 0",
            ),
            Check("nccl", NOT_APPLICABLE, "needs CUDA"),
        ]
    checks = [Check("cuda", OK, f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")]
    nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
    checks.append(Check("nccl", OK, nccl))
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        known = gpu_for_device(props.name)
        detail = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}"
        hint = "" if known else "not in shoal's GPU catalog: no MFU, shoal plan cannot target it"
        checks.append(Check(f"gpu {index}", OK if known else NOT_APPLICABLE, detail, hint))
    return checks


def _cpu_detail(cpu: Cpu) -> str:
    if not cpu.probed:
        return f"torch capability {cpu.capability}; this torch cannot say whether it has AVX512-BF16 or AMX"
    features = ", ".join(cpu.features) if cpu.features else "no AVX512-BF16 or AMX"
    return f"torch capability {cpu.capability}; {features}"


def cpu_precisions() -> list[Check]:
    """This CPU's capability, then bf16 and fp16 on it: native or emulated by its flags, and
    an autocast Linear forward+backward timed against fp32 now (well under a second)."""
    cpu = this_cpu()
    checks = [Check("cpu", OK, _cpu_detail(cpu))]
    for name, ratio in cpu_slowdown(("bf16", "fp16"), budget_s=0.3).items():
        native = support(name, cpu).status == NATIVE
        verdict = "native" if native else "emulated"
        measured = f"{verdict} by its flags; {ratio:.2g}x fp32's time (a Linear fwd+bwd, measured now)"
        if native and ratio < SLOW:
            checks.append(Check(f"{name} on cpu", OK, measured))
        else:
            checks.append(Check(f"{name} on cpu", WARN, measured, _cpu_hint(name, native, cpu)))
    return checks


def _cpu_hint(name: str, native: bool, cpu: Cpu) -> str:
    if native:
        return "native by the CPU's flags, yet slow: is ONEDNN_MAX_CPU_ISA set? fp32 may be faster"
    better = "auto or bf16" if name == "fp16" and cpu.bf16 else "auto or fp32"
    return f"CPU workers: train.precision {better}"


def gpu_precisions() -> list[Check]:
    """bf16 and fp8 on each GPU, by its CUDA capability."""
    checks = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        gpu = this_gpu(index)
        for name in ("bf16", "fp8"):
            found = support(name, gpu)
            if found.status == NATIVE:
                checks.append(Check(f"{name} on gpu {index}", OK, "native"))
            else:
                hint = found.advice if found.status == EMULATED else "the workers refuse it on this GPU"
                checks.append(Check(f"{name} on gpu {index}", WARN, f"{found.status}: {found.cost}", hint))
    return checks


def topology() -> list[Check]:
    checks = []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        checks.append(Check("topology", NOT_APPLICABLE, "no nvidia-smi"))
    else:
        result = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
        ok = result.returncode == 0
        detail = result.stdout.strip() if ok else result.stderr.strip()[:300]
        links = "NV" in result.stdout
        hint = "" if links else "no NVLink between GPUs: prefer ddp/fsdp over tp (see shoal plan)"
        checks.append(
            Check("topology", OK if ok else FAIL, detail, hint if ok else "nvidia-smi topo -m failed")
        )
    devices = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    if devices:
        checks.append(Check("infiniband", OK, ", ".join(devices)))
    else:
        checks.append(
            Check(
                "infiniband",
                NOT_APPLICABLE,
                "no InfiniBand devices",
                "multi-node FSDP/TP will run over Ethernet",
            )
        )
    return checks


def ray_cluster(address: str | None) -> list[Check]:
    if address is None:
        cpus = os.cpu_count() or 1
        return [
            Check("ray", NOT_APPLICABLE, f"no --address: shoal run starts a local Ray ({cpus} CPUs here)")
        ]
    try:
        probe_cluster(address)  # ray.init would wait minutes for an address nobody listens at
    except ClusterError as exc:
        return [Check("ray", FAIL, str(exc), "is `ray start --head` running there?")]
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        resources, nodes = ray.cluster_resources(), [n for n in ray.nodes() if n["Alive"]]
    except Exception as exc:  # the cluster's own error says why (refused, auth, version)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return [
            Check(
                "ray", FAIL, f"{address}: {first}", "is `ray start --head` running there? same Ray version?"
            )
        ]
    finally:
        if ray.is_initialized():
            ray.shutdown()
    cpus, gpu_count = resources.get("CPU", 0), resources.get("GPU", 0)
    return [Check("ray", OK, f"{address}: {len(nodes)} node(s), {cpus:g} CPUs, {gpu_count:g} GPUs")]


def tracking(uri: str) -> list[Check]:
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        if not database.exists():  # connecting would create it: check where it would go instead
            parent = database.parent
            ok = parent.is_dir() and os.access(parent, os.W_OK)
            hint = "" if ok else f"{parent} is not a writable directory: set tracking.uri"
            return [Check("mlflow", OK if ok else FAIL, f"{uri}: created on the first run", hint)]
    for key, value in CLIENT_ENV.items():
        os.environ.setdefault(key, value)
    try:
        count = len(MlflowClient(tracking_uri=uri).search_experiments(max_results=100))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300]
        return [Check("mlflow", FAIL, f"{uri}: {first}", "start it (mlflow server ...) or fix tracking.uri")]
    return [Check("mlflow", OK, f"{uri}: reachable, {count} experiment(s)")]


def storage(where: str, endpoint: str | None) -> list[Check]:
    if "://" in where and not where.startswith("file://"):
        try:
            probe_storage(open_storage(where, endpoint))
        except (StorageError, OSError) as exc:
            return [
                Check("checkpoints", FAIL, f"{where}: {exc}", "check the bucket, endpoint and credentials")
            ]
        return [Check("checkpoints", OK, f"{where}: writable")]
    path = Path(where.removeprefix("file://")).resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    ok = free >= MIN_FREE_BYTES and os.access(existing, os.W_OK)
    hint = "" if ok else f"under {MIN_FREE_BYTES / 1e9:.0f} GB free or not writable: set checkpoint.storage"
    return [Check("checkpoints", OK if ok else FAIL, f"{path}: {free / 1e9:.1f} GB free", hint)]


def workload_precision(precision: str | None, gpus_per_worker: float) -> list[Check]:
    """A workload's train.precision on the hardware its workers would run on here."""
    if precision is None:
        return []
    hardware = workers_hardware(gpus_per_worker)
    if hardware is None:
        return [Check("precision", NOT_APPLICABLE, f"{precision}: GPU workers, and no GPU here to ask")]
    shown, found = for_workers(precision, gpus_per_worker)[0], support(precision, hardware)
    detail = f"{shown}: {found.status} on {found.hardware}"
    if found.status == EMULATED:
        return [Check("precision", WARN, f"{detail}: {found.cost}", found.advice)]
    if found.status != NATIVE:
        return [Check("precision", FAIL, f"{detail}: {found.cost}", "train.precision: bf16 or auto")]
    return [Check("precision", OK, detail)]


def run_checks(
    address: str | None,
    tracking_uri: str,
    checkpoint_storage: str,
    endpoint: str | None,
    precision: str | None = None,
    gpus_per_worker: float = 0,
) -> list[Check]:
    """Every check; with a workload's precision, also how this machine would run it."""
    return [
        *versions(),
        *cpu_precisions(),
        *gpus(),
        *gpu_precisions(),
        *workload_precision(precision, gpus_per_worker),
        *topology(),
        *ray_cluster(address),
        *tracking(tracking_uri),
        *storage(checkpoint_storage, endpoint),
    ]
