"""Before launch, `shoal validate` checks that the data fits the model: columns against the
forward's signature, then one micro-batch traced on the meta device (in-process, no Ray)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shoal import cli
from shoal.data.sources import column_shapes
from shoal.errors import EXIT_USAGE
from tests.conftest import write_workload

REGRESSOR = (
    "import torch\n"
    "class Regressor(torch.nn.Module):\n"
    "    task = 'custom'\n"
    "    def __init__(self, features=4):\n"
    "        super().__init__()\n"
    "        self.fc = torch.nn.Linear(features, 1)\n"
    "    def forward(self, features, target):\n"
    "        error = self.fc(features).squeeze(-1) - target\n"
    "        return {'loss': (error ** 2).mean(), 'mae': error.abs().mean()}\n"
)


def regression_data(directory: Path, rows: int = 16, width: int = 4) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    flat = pa.array(generator.standard_normal(rows * width).astype(np.float32))
    table = pa.table(
        {
            "id": pa.array(np.arange(rows)),
            "f": pa.FixedSizeListArray.from_arrays(flat, width),
            "t": pa.array(generator.standard_normal(rows)),
        }
    )
    pq.write_table(table, directory / "part-0.parquet")
    return directory


def spec(module: str, **changes: Any) -> dict[str, Any]:
    data = {
        "name": "contract",
        "model": {"target": f"{module}:Regressor", **changes.pop("model", {})},
        "data": {"train": {"path": "data"}, "batch_size": 4, **changes.pop("data", {})},
        "train": {"max_steps": 2},
    }
    return {**data, **changes}


def validate(tmp_path: Path, capsys: pytest.CaptureFixture, data: dict[str, Any]) -> tuple[int, list[str]]:
    path = write_workload(tmp_path, data)
    code = cli.main(["validate", str(path)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    return code, [re.sub(r"^error: \S+w\.yaml(:\d+)? ", "error: ", line) for line in lines]  # file:line aside


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    regression_data(tmp_path / "data")
    return tmp_path


def test_a_user_model_on_its_own_columns_validates(user_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (user_dir / "reg_ok.py").write_text(REGRESSOR)
    code, err = validate(user_dir, capsys, spec("reg_ok", data={"columns": {"f": "features", "t": "target"}}))
    assert (code, err) == (0, [])


def test_a_column_mapped_to_an_argument_the_forward_does_not_take(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    (user_dir / "reg_bad_column.py").write_text(REGRESSOR)
    columns = {"f": "features", "t": "target", "id": "row_id"}
    code, err = validate(user_dir, capsys, spec("reg_bad_column", data={"columns": columns}))
    assert code == EXIT_USAGE
    assert err == [
        "error: data.columns: column 'id' feeds 'row_id', which forward(features (required), "
        "target (required)) does not take"
    ]


def test_a_required_argument_no_column_feeds(user_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (user_dir / "reg_missing.py").write_text(REGRESSOR)
    code, err = validate(user_dir, capsys, spec("reg_missing", data={"columns": {"f": "features"}}))
    assert code == EXIT_USAGE and len(err) == 1
    assert "data.columns: forward(features (required), target (required)) needs 'target'" in err[0]
    assert "which no data column feeds (data.columns maps {'f': 'features'})" in err[0]


def test_without_columns_a_custom_model_names_the_file(user_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (user_dir / "reg_names.py").write_text(REGRESSOR)
    code, err = validate(user_dir, capsys, spec("reg_names"))  # the data has f and t, not features/target
    assert code == EXIT_USAGE and len(err) == 2
    assert (
        "error: data.train.path: forward(features (required), target (required)) needs 'features'" in err[0]
    )
    assert "part-0.parquet' has columns ['id', 'f', 't']" in err[0]


def test_a_shape_error_in_the_forward_is_one_issue_from_the_meta_trace(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    (user_dir / "reg_shape.py").write_text(REGRESSOR)
    data = spec(
        "reg_shape", model={"args": {"features": 7}}, data={"columns": {"f": "features", "t": "target"}}
    )
    code, err = validate(user_dir, capsys, data)
    assert code == EXIT_USAGE and len(err) == 1
    assert err[0].startswith(
        "error: model: one micro-batch (id: int64[4], f: float32[4, 4], t: float64[4]) through the model "
        "and loss on the meta device failed: RuntimeError: "
    )
    assert "[4, 4] X [7, 1]" in err[0]


def test_a_metric_named_like_shoals_own_is_refused(user_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (user_dir / "reg_lr.py").write_text(REGRESSOR.replace("'mae'", "'lr'"))
    code, err = validate(user_dir, capsys, spec("reg_lr", data={"columns": {"f": "features", "t": "target"}}))
    assert code == EXIT_USAGE
    assert err == ["error: model: metric name 'lr' is shoal's own (train/lr); rename it"]


def test_a_model_that_only_fails_on_meta_is_not_refused(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    data_dependent = REGRESSOR.replace(
        "        error =", "        float(target.sum().item())\n        error ="
    )
    (user_dir / "reg_item.py").write_text(data_dependent)
    code, err = validate(
        user_dir, capsys, spec("reg_item", data={"columns": {"f": "features", "t": "target"}})
    )
    assert (code, err) == (0, [])


def test_a_custom_task_is_refused_with_pipeline_parallelism(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    (user_dir / "reg_pp.py").write_text(REGRESSOR)
    data = spec(
        "reg_pp",
        data={"columns": {"f": "features", "t": "target"}},
        model={"family": "gpt", "target": None, "task": "custom"},
    )
    data["model"].pop("target")
    data |= {"parallel": {"pp": 2}, "scaling": {"workers": 2}}
    code, err = validate(user_dir, capsys, data)
    assert code == EXIT_USAGE
    assert "error: parallel: pipeline parallelism trains task lm only (the model's task is custom)" in err


def test_a_language_model_without_any_window_length_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = {
        "name": "lm",
        "model": {"family": "gpt", "args": {"n_layers": 1, "d_model": 16, "n_heads": 2}},
        "data": {"builtin": "pytext", "batch_size": 4},
        "train": {"max_steps": 2},
    }
    code, err = validate(tmp_path, capsys, data)
    assert code == EXIT_USAGE and len(err) == 1
    assert "data.seq_len: the 'pytext' corpus is cut into windows of data.seq_len + 1 tokens" in err[0]
    data["data"]["seq_len"] = 32  # a window length in the data section is all it takes
    assert validate(tmp_path, capsys, data) == (0, [])


def test_a_user_lm_without_a_seq_len_argument_validates(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    (user_dir / "byte_lm.py").write_text(
        "import torch\n"
        "class Regressor(torch.nn.Module):\n"
        "    task = 'lm'\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embedding = torch.nn.Embedding(256, 256)\n"
        "    def forward(self, tokens):\n"
        "        return self.embedding(tokens)\n"
    )
    data = {
        "name": "lm",
        "model": {"target": "byte_lm:Regressor"},
        "data": {"builtin": "pytext", "seq_len": 16, "batch_size": 4},
        "train": {"max_steps": 2},
    }
    assert validate(user_dir, capsys, data) == (0, [])


def test_column_shapes_reads_fixed_and_variable_lists(tmp_path: Path) -> None:
    table = pa.table(
        {"ids": [[1, 2, 3], [4, 5, 6]], "name": ["a", "b"], "w": pa.array([1.0, 2.0], pa.float32())}
    )
    pq.write_table(table, tmp_path / "a.parquet")
    assert column_shapes(str(tmp_path / "a.parquet")) == {"ids": ((3,), "int64"), "w": ((), "float32")}


def test_shoal_plan_traces_a_custom_model_on_its_own_columns(user_dir: Path) -> None:
    from shoal.plan.planner import model_cost, sample_shapes
    from shoal.spec.schema import Workload

    (user_dir / "reg_plan.py").write_text(REGRESSOR)
    workload = Workload.model_validate(spec("reg_plan", data={"columns": {"f": "features", "t": "target"}}))
    assert {name: shape for name, (shape, _) in sample_shapes(workload).items()} == {
        "id": (),
        "f": (4,),
        "t": (),
    }
    cost = model_cost(workload, "fp32")
    assert cost.parameters == 5 and cost.flops_per_sample > 0


def test_shoal_plan_windows_pytext_by_data_seq_len() -> None:
    from shoal.plan.planner import sample_shapes
    from shoal.spec.schema import Workload

    workload = Workload.model_validate(
        {
            "name": "lm",
            "model": {"family": "gpt", "args": {"n_layers": 1}},
            "data": {"builtin": "pytext", "seq_len": 48},
            "train": {"max_steps": 1},
        }
    )
    assert sample_shapes(workload)["tokens"][0] == (49,)
