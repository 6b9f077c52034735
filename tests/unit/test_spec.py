"""The workload spec: schema, line-numbered errors, overrides, pre-launch checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.spec import SpecError, load
from shoal.spec.loader import parse_scalar
from tests.conftest import WORKLOADS, quickstart, write_workload


def errors_of(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load(path, overrides or [])
    return [str(issue) for issue in caught.value.issues]


@pytest.mark.parametrize("name", ["quickstart.yaml", "gpt_pytext.yaml"])
def test_catalog_workloads_validate(name: str) -> None:
    loaded = load(WORKLOADS / name)
    assert loaded.workload.name == name.removesuffix(".yaml")


def test_defaults_fill_every_section() -> None:
    resolved = load(WORKLOADS / "quickstart.yaml").workload.resolved()
    assert set(resolved) == {
        "name",
        "model",
        "tokenizer",
        "data",
        "train",
        "parallel",
        "scaling",
        "checkpoint",
        "failure",
        "tracking",
        "monitor",
        "sweep",
    }
    assert resolved["monitor"] == {
        "stragglers": {
            "factor": 1.5,
            "steps": 5,
            "min_gap_s": 0.02,
            "link_min_gap_s": 0.02,
            "link_probe_every_s": 5.0,
        },
        "per_rank_up_to": 8,
        "profile": None,
        "tensorboard": False,
    }
    assert resolved["checkpoint"]["async"] is False  # written back under the user's key name
    assert resolved["train"]["schedule"]["min_lr_ratio"] == 0.1


def test_override_is_typed() -> None:
    overrides = [
        "train.optimizer.lr=1e-3",
        "scaling.workers=3",
        "train.global_batch_size=192",
        "model.args.dropout=0.5",
        "train.clip_grad_norm=null",
    ]
    workload = load(WORKLOADS / "quickstart.yaml", overrides).workload
    assert workload.train.optimizer.lr == pytest.approx(1e-3)
    assert workload.scaling.workers == 3
    assert workload.model.args["dropout"] == 0.5
    assert workload.train.clip_grad_norm is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-3", 1e-3),
        ("3", 3),
        ("-2", -2),
        ("2.5", 2.5),
        ("true", True),
        ("[1, 2]", [1, 2]),
        ("adamw", "adamw"),
        ("{min: 1, max: 2}", {"min": 1, "max": 2}),
    ],
)
def test_parse_scalar(text: str, value: object) -> None:
    assert parse_scalar(text) == value


def test_yaml_float_without_dot_is_a_float(tmp_path: Path) -> None:
    data = quickstart()
    data["model"]["args"]["dropout"] = "REPLACE"
    path = write_workload(tmp_path, data)
    path.write_text(path.read_text().replace("REPLACE", "5e-2"))
    assert load(path).workload.model.args["dropout"] == pytest.approx(0.05)


def test_bad_value_names_file_line_and_path(tmp_path: Path) -> None:
    data = quickstart()
    data["train"]["optimizer"]["lr"] = -1
    path = write_workload(tmp_path, data)
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "lr: -1" in text)
    assert errors_of(path) == [f"{path}:{line} train.optimizer.lr: must be > 0 (got -1)"]


def test_unknown_key_suggests_nearest(tmp_path: Path) -> None:
    data = quickstart()
    data["train"]["max_stepz"] = data["train"].pop("max_steps")
    path = write_workload(tmp_path, data)
    (error,) = [e for e in errors_of(path) if "max_stepz" in e]
    assert "train.max_stepz: unknown key 'max_stepz' (did you mean 'max_steps'?)" in error
    assert error.startswith(f"{path}:")


def test_unknown_section_suggests_nearest(tmp_path: Path) -> None:
    data = quickstart()
    data["trackin"] = data.pop("tracking")
    errors = errors_of(write_workload(tmp_path, data))
    assert any("unknown key 'trackin' (did you mean 'tracking'?)" in e for e in errors)


def test_wrong_type(tmp_path: Path) -> None:
    data = quickstart()
    data["data"]["batch_size"] = "sixty-four"
    (error,) = errors_of(write_workload(tmp_path, data))
    assert "data.batch_size: must be an integer (got 'sixty-four')" in error


def test_bad_override_is_blamed_on_the_override() -> None:
    errors = errors_of(WORKLOADS / "quickstart.yaml", ["train.precision=fp64"])
    assert errors == [
        "--set train.precision=fp64 train.precision: "
        "must be one of 'fp32', 'bf16', 'fp16', 'fp8' or 'auto' (got 'fp64')"
    ]
    errors = errors_of(WORKLOADS / "quickstart.yaml", ["train.optimzer.lr=1"])
    assert errors == [
        "--set train.optimzer.lr=1 train.optimzer: unknown key 'optimzer' (did you mean 'optimizer'?)"
    ]


def test_malformed_override() -> None:
    assert errors_of(WORKLOADS / "quickstart.yaml", ["train.max_steps"]) == [
        "--set train.max_steps: expected KEY.PATH=VALUE"
    ]


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodel:\n  family: cnn\n   args: {\n")
    (error,) = errors_of(path)
    assert error.startswith(f"{path}:4: malformed YAML")


def test_missing_file(tmp_path: Path) -> None:
    assert errors_of(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: no such file"]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    data = quickstart()
    data["train"]["optimizer"]["lr"] = 0
    data["scaling"]["workers"] = 0
    data["data"]["batch_size"] = -5
    assert len(errors_of(write_workload(tmp_path, data))) == 3


def test_elastic_workers_must_be_ordered() -> None:
    errors = errors_of(WORKLOADS / "quickstart.yaml", ["scaling.workers={min: 3, max: 2}"])
    assert errors == ["--set scaling.workers={min: 3, max: 2} scaling.workers: min (3) must be <= max (2)"]


def test_global_batch_must_divide() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["train.global_batch_size=100"])
    assert "train.global_batch_size: 100 is not a multiple of data.batch_size (64) x 2 workers" in error


def test_elastic_global_batch_checked_at_both_ends() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["scaling.workers={min: 2, max: 3}"])
    assert "x 3 workers" in error


def test_exactly_one_length() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["train.epochs=3"])
    assert "give exactly one of 'max_steps' or 'epochs'" in error


def test_unknown_model_family() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["model.family=resnet"])
    assert "model.family: unknown family 'resnet' (built-in: cnn, mlp, gpt)" in error


def test_model_args_are_checked_against_the_constructor() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["model.args.chanels=8"])
    assert "model.args: ConvNet does not accept these args" in error and "chanels" in error


def test_user_model_target_must_import() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["model.family=null", "model.target=no_such_pkg:Net"])
    assert "model.target: cannot import module 'no_such_pkg'" in error


def test_task_and_corpus_must_agree() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["data.builtin=pytext"])
    assert "'pytext' is a corpus for task 'lm', but the model's task is 'classify'" in error


def test_missing_data_directory(tmp_path: Path) -> None:
    data = quickstart()
    data["data"] = {"train": {"path": str(tmp_path / "absent")}, "batch_size": 64}
    path = write_workload(tmp_path, data)
    (error,) = errors_of(path)
    assert f"data.train.path: no such file or directory: '{tmp_path / 'absent'}'" in error
    assert error.startswith(f"{path}:")


def test_empty_data_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    data = quickstart()
    data["data"] = {"train": {"path": str(tmp_path / "empty")}, "batch_size": 64}
    (error,) = errors_of(write_workload(tmp_path, data))
    assert "no parquet files found" in error


def test_parquet_without_the_task_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"tokens": [[1, 2, 3]]}), tmp_path / "d" / "a.parquet")
    data = quickstart()
    data["data"] = {"train": {"path": str(tmp_path / "d")}, "batch_size": 64}
    (error,) = errors_of(write_workload(tmp_path, data))
    assert "lacks column(s) ['x', 'y'] needed for task 'classify'" in error


def test_elastic_range_must_keep_the_global_batch() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["scaling.workers={min: 1, max: 3}"])
    assert "train.global_batch_size: 128 is not a multiple of data.batch_size (64) x 3 workers" in error
    assert "kept at every worker count in 1..3" in error


def test_keep_best_needs_the_metric_at_every_checkpoint() -> None:
    overrides = ["checkpoint.keep_best={metric: val/loss}", "train.eval_every=30"]
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", overrides)
    assert "checkpoint.keep_best.metric: val/loss is measured every 30 steps" in error
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["checkpoint.keep_best={metric: val/f1}"])
    assert "'val/f1' is not one of train/loss, val/loss, val/accuracy" in error


def test_on_nan_policies() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["failure.on_nan=ignore"])
    assert "failure.on_nan" in error and "rollback" in error


def test_storage_must_be_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", [f"checkpoint.storage={tmp_path / 'file'}"])
    assert "checkpoint.storage" in error and "is not a directory" in error


def test_storage_must_be_a_directory_or_s3() -> None:
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["checkpoint.storage=gs://bucket/runs"])
    assert "checkpoint.storage: 'gs://bucket/runs' is neither a directory nor s3://bucket/prefix" in error
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", ["checkpoint.endpoint=http://127.0.0.1:9000"])
    assert "checkpoint.endpoint: 'http://127.0.0.1:9000' is for s3:// storage" in error


@pytest.mark.parametrize("alias", ["latest", "v3"])
def test_an_alias_mlflow_reserves_is_refused_before_launch(alias: str) -> None:
    overrides = ["tracking.register.name=digits", f"tracking.register.alias={alias}"]
    (error,) = errors_of(WORKLOADS / "quickstart.yaml", overrides)
    assert error.startswith(f"--set tracking.register.alias={alias}")
    assert f"MLflow reserves the alias '{alias}'" in error


def test_fused_sgd_on_sharded_parameters_is_refused_before_launch(tmp_path: Path) -> None:
    path = WORKLOADS / "quickstart.yaml"
    sgd_fused = ["train.optimizer.name=sgd", "train.optimizer.implementation=fused"]
    assert errors_of(path, [*sgd_fused, "parallel.strategy=fsdp"]) == [
        "--set train.optimizer.implementation=fused train.optimizer.implementation: torch has no fused "
        "SGD for sharded parameters (dp_shard=2 shards them); use auto or foreach"
    ]
    assert load(path, sgd_fused).workload.train.optimizer.implementation == "fused"  # ddp: plain tensors
    assert load(path, ["train.optimizer.implementation=foreach", "parallel.strategy=fsdp"])


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_a_multi_tensor_kernel_with_tp_is_refused_before_launch(kernel: str) -> None:
    overrides = [f"train.optimizer.implementation={kernel}", "parallel.strategy=tp"]
    errors = errors_of(WORKLOADS / "gpt_pytext.yaml", overrides)
    assert (
        f"--set train.optimizer.implementation={kernel} train.optimizer.implementation: {kernel} steps every "
        "parameter of a group in one call, and with tp=2 the tp-split layers and the rest sit on different "
        "device meshes (or none); use auto or for-loop"
    ) in errors, errors
