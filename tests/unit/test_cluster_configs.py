"""Every file in cluster_configs/ is checked against the schema of the tool that reads it, and
every shoal command in them against the workload it names."""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from shoal.spec import load
from tests.conftest import REPO

CONFIGS = REPO / "cluster_configs"
CRDS = REPO / "tests" / "data" / "kuberay"
CONTAINER_PINS = ("torch", "ray", "mlflow")
CLUSTER_SIDE_SETTINGS = ("checkpoint.storage", "tracking.uri")  # paths and servers of the cluster


@functools.cache
def ray_launcher_schema() -> dict:
    return json.loads(importlib.resources.files("ray").joinpath("autoscaler/ray-schema.json").read_text())


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*/*.yaml")), ids=lambda p: p.name)
def test_every_yaml_parses(path: Path) -> None:
    assert all(doc is not None for doc in yaml.safe_load_all(path.read_text()))


LAUNCHER_CONFIGS = sorted([*CONFIGS.glob("aws/*.yaml"), *CONFIGS.glob("gcp/*.yaml")])


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_configs_match_rays_schema(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, ray_launcher_schema())
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t["min_workers"] <= t["max_workers"] <= config["max_workers"] for t in workers)
    assert all(t["resources"].get("GPU", 0) > 0 for t in workers)  # GPU nodes, a CPU head
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}


def test_the_launcher_schema_check_can_fail() -> None:
    config = yaml.safe_load((CONFIGS / "aws" / "h100-p5.yaml").read_text())
    config["available_node_types"]["h100_workers"]["min_workers"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, ray_launcher_schema())


def strict(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema as JSON schema that also rejects unknown keys (like
    `kubectl apply --validate=strict`), except where Kubernetes keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schema(kind: str) -> dict:
    crd = yaml.load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=yaml.CSafeLoader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def kuberay_documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(CONFIGS.glob("kuberay/*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found.append((f"{path.name}:{doc['kind']}", doc))
    return found


@pytest.mark.parametrize("name,doc", kuberay_documents(), ids=[n for n, _ in kuberay_documents()])
def test_kuberay_manifests_match_the_crds(name: str, doc: dict) -> None:
    assert {"apiVersion", "kind", "metadata"} <= doc.keys()
    if doc["kind"] not in ("RayCluster", "RayJob"):
        return  # Kubernetes' own kinds (PVC, Deployment, Service): shape checked above
    assert doc["apiVersion"] == "ray.io/v1"
    jsonschema.validate(doc, crd_schema(doc["kind"]))
    cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == pinned_versions()["ray"]
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_the_crd_check_rejects_a_misspelt_key() -> None:
    (cluster,) = [doc for name, doc in kuberay_documents() if name == "raycluster.yaml:RayCluster"]
    cluster = copy.deepcopy(cluster)
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 4
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(cluster, crd_schema("RayCluster"))


def sbatch_options(path: Path) -> dict[str, str]:
    options = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").strip().partition("=")
            options[key.lstrip("-")] = value
    return options


def test_slurm_script_is_valid_bash_with_sbatch_options() -> None:
    script = CONFIGS / "slurm" / "shoal.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    options = sbatch_options(script)
    assert int(options["nodes"]) >= 2 and options["ntasks-per-node"] == "1"  # one Ray node per host
    assert int(options["gpus-per-node"]) >= 1 and int(options["cpus-per-task"]) >= 1
    assert re.fullmatch(r"\d+:\d\d:\d\d", options["time"])


@pytest.mark.parametrize("script", sorted(CONFIGS.glob("local/*.sh")), ids=lambda p: p.name)
def test_local_scripts_are_valid_bash_and_never_ray_stop(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    code = [line for line in script.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not any("ray stop" in line or 'ray" stop' in line for line in code)


def pinned_versions() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip()
    return pins


def test_container_images_use_the_tested_versions() -> None:
    pins = pinned_versions()
    for path in (CONFIGS / "container" / "Dockerfile", CONFIGS / "container" / "shoal.def"):
        text = path.read_text()
        assert f'"torch=={pins["torch"]}"' in text and "-c constraints.txt" in text.replace("/opt/shoal/", "")
    header = (CONFIGS / "container" / "Dockerfile").read_text()
    for name in CONTAINER_PINS:
        assert f"{name} {pins[name]}" in header, name


def shoal_commands() -> list[tuple[str, list[str]]]:
    """(file, argv after the workload path's command) for every shoal command in the configs."""
    found = []
    for path in sorted(p for p in CONFIGS.rglob("*") if p.is_file()):
        text = re.sub(r"\\\n\s*#?\s*", " ", path.read_text())  # join continued lines
        text = re.sub(r"\n\s+(--set)", r" \1", text)  # YAML folded entrypoints
        for match in re.finditer(
            r"(?:shoal\"? (?:run|submit|sweep)|shoal\.sbatch) (workloads/\S+\.yaml)([^\n]*)", text
        ):
            found.append((path.name, [match.group(1), *shlex.split(match.group(2), comments=True)]))
    return found


def test_configs_name_shoal_commands() -> None:
    names = {name for name, _ in shoal_commands()}
    expected = {
        "h100-p5.yaml",
        "l40s-g6e.yaml",
        "a3-h100.yaml",
        "raycluster.yaml",
        "rayjob.yaml",
        "shoal.sbatch",
    }
    assert expected <= names | {"README.md"}, names


@pytest.mark.parametrize(
    "where,argv", shoal_commands(), ids=[f"{n}-{i}" for i, (n, _) in enumerate(shoal_commands())]
)
def test_every_shoal_command_names_a_workload_that_validates(where: str, argv: list[str]) -> None:
    workload, *rest = argv
    overrides = [rest[i + 1] for i, arg in enumerate(rest) if arg == "--set" and i + 1 < len(rest)]
    overrides = [o for o in overrides if o.partition("=")[0] not in CLUSTER_SIDE_SETTINGS]
    load(REPO / workload, overrides)  # raises SpecError naming the problem
