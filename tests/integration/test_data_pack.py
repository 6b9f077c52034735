"""`shoal data pack SRC DST --rows-per-group N` on the session's Ray cluster, and the
coarse-row-group warning of `shoal validate` before and after."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shoal.cli import main
from shoal.data.manifest import build_manifest
from shoal.data.sources import parquet_files
from tests.conftest import write_workload

ROWS = 3000


def one_coarse_file(directory: Path) -> Path:
    directory.mkdir()
    ids = np.arange(ROWS)
    x = np.random.default_rng(0).random((ROWS, 4), dtype=np.float32)
    table = pa.table(
        {
            "id": ids,
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
            "y": pa.array(ids % 3),
        }
    )
    pq.write_table(table, directory / "all.parquet")  # one row group of 3,000 rows
    return directory


def test_pack_rewrites_row_groups_and_validate_stops_warning(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = one_coarse_file(workdir / "coarse"), workdir / "fine"
    workload = write_workload(
        workdir,
        {
            "name": "pack",
            "model": {
                "family": "mlp",
                "args": {"in_features": 4, "hidden": 8, "layers": 1, "num_classes": 3},
            },
            "data": {"train": {"path": str(src)}, "batch_size": 8},
            "train": {"max_steps": 2, "global_batch_size": 32},
        },
    )
    assert main(["validate", str(workload)]) == 0
    warned = capsys.readouterr().out
    assert "too coarse" in warned and "--rows-per-group 37" in warned  # 4 lanes of 744 rows

    assert main(["data", "pack", str(src), str(dst), "--rows-per-group", "37"]) == 0
    assert "3,000 rows in" in capsys.readouterr().out
    manifest = build_manifest(parquet_files(str(dst), "DST"))
    assert manifest.total_rows == ROWS and max(g.rows for g in manifest.row_groups) <= 37
    assert len(manifest.row_groups) >= ROWS // 37
    packed = pq.read_table(parquet_files(str(dst), "DST"))
    assert packed.column("id").to_pylist() == list(range(ROWS))  # same rows, same order
    assert packed.schema.equals(pq.read_schema(src / "all.parquet"), check_metadata=False)

    spec = {**_spec(workload), "data": {"train": {"path": str(dst)}, "batch_size": 8}}
    fine = write_workload(workdir, spec, name="fine.yaml")
    assert main(["validate", str(fine)]) == 0
    assert "warning" not in capsys.readouterr().out

    # DST now holds files: packing into it again is refused, and nothing in it is touched
    before = sorted(p.stat().st_mtime_ns for p in dst.rglob("*.parquet"))
    assert main(["data", "pack", str(src), str(dst), "--rows-per-group", "37"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: DST:") and "already holds files" in line
    assert sorted(p.stat().st_mtime_ns for p in dst.rglob("*.parquet")) == before


def _spec(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())
