"""Object storage: an S3-compatible server (moto) on loopback.

A run writes its checkpoints to s3://shoal-test/runs; the latest one is then
corrupted in the bucket, and resuming the run passes over it for the one before,
with the rejection in MLflow's events. Another run trains on data in a bucket:
each rank reads its own share of it, counted in bytes served.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from shoal.data import prepare
from shoal.data.sources import parquet_files
from shoal.launch.storage import open_storage
from tests.conftest import WORKLOADS
from tests.integration.helpers import assert_exactly_once, events, loss_steps, shoal_cli

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    moto = str(Path(sys.executable).with_name("moto_server"))
    server = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


def shoal(args: list[str], cwd: Path) -> tuple[int, str, str]:
    proc = shoal_cli(args, cwd, **CREDENTIALS)
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def test_s3_checkpoints_and_fallback_from_a_corrupt_one(workdir: Path, s3_endpoint: str) -> None:
    storage = open_storage("s3://shoal-test/runs", s3_endpoint)
    host = s3_endpoint.split("://")[1]
    pafs.S3FileSystem(endpoint_override=host, scheme="http", allow_bucket_creation=True).create_dir(
        "shoal-test"
    )
    spec = str(WORKLOADS / "quickstart.yaml")
    common = [
        "--run-name",
        "s3job",
        "--set",
        "checkpoint.storage=s3://shoal-test/runs",
        "--set",
        f"checkpoint.endpoint={s3_endpoint}",
        "--set",
        "checkpoint.every_steps=20",
        "--set",
        "train.eval_every=1000",
    ]
    code, out, err = shoal(["run", spec, *common, "--set", "train.max_steps=60"], workdir)
    assert code == 0, err[-3000:]
    assert storage.checkpoints("s3job") == [
        "checkpoint-00000020",
        "checkpoint-00000040",
        "checkpoint-00000060",
    ]
    files = storage.filesystem.get_file_info(pafs.FileSelector("shoal-test/runs/s3job/checkpoint-00000060"))
    names = {f.base_name for f in files}
    assert {"manifest-rank0.json", "manifest-rank1.json", "trainer_state.json", ".metadata"} <= names
    assert not (workdir / "shoal_runs" / "s3job" / "checkpoint-00000060").exists()  # only logs stay local

    shard = next(f.path for f in files if f.base_name.endswith(".distcp"))
    with storage.filesystem.open_output_stream(shard) as stream:
        stream.write(b"not a checkpoint")  # the newest checkpoint is now corrupt

    code, out, err = shoal(["run", spec, *common, "--set", "train.max_steps=100"], workdir)
    assert code == 0, err[-3000:]
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert run.info.status == "FINISHED"
    history = events(client, run.info.run_id, workdir)
    rejected = [e for e in history if e["kind"] == "checkpoint_rejected"]
    assert rejected and rejected[0]["checkpoint"].endswith("checkpoint-00000060")
    assert "does not match its manifest" in rejected[0]["reason"]
    starts = [e for e in history if e["kind"] == "attempt_started"]
    assert starts[-1]["restored_step"] == 40 and starts[-1]["restored_from"].endswith("checkpoint-00000040")
    assert loss_steps(client, run.info.run_id) == list(range(1, 101))
    assert "checkpoint-00000100" in storage.checkpoints("s3job")


def test_s3_training_data_is_read_once_per_epoch_by_each_rank_for_its_share(
    workdir: Path, s3_endpoint: str
) -> None:
    """The digits training set in a bucket (row groups of 32 rows), 2 workers, 30 steps of 128
    rows (11 a epoch: almost 3 epochs): every epoch's samples once each, and each rank's bytes
    from the bucket at most 1.10 x its share (summed: 1.10 x the data), footers included. The
    file is written uncompressed so that its footer weighs what a real dataset's does (3 % of
    the file here; compressed, the 1,438 digits are 99 KB and 15 KB of it is footer, which
    every rank must read once)."""
    host = s3_endpoint.split("://")[1]
    bucket = pafs.S3FileSystem(endpoint_override=host, scheme="http", allow_bucket_creation=True)
    bucket.create_dir("shoal-data")
    digits = prepare("digits")
    table = pq.read_table(parquet_files(str(digits / "train"), "digits"))
    pq.write_table(
        table,
        "shoal-data/digits/train/part-0.parquet",
        filesystem=bucket,
        row_group_size=32,
        compression="none",
        use_dictionary=False,
    )
    pq.write_table(
        pq.read_table(parquet_files(str(digits / "val"), "digits")),
        "shoal-data/digits/val/v.parquet",
        filesystem=bucket,
    )
    size = bucket.get_file_info("shoal-data/digits/train/part-0.parquet").size
    workload = yaml.safe_load((WORKLOADS / "quickstart.yaml").read_text())
    workload["data"] = {
        "train": {"path": "s3://shoal-data/digits/train/"},
        "val": {"path": "s3://shoal-data/digits/val/"},
        "batch_size": 64,
    }
    path = workdir / "s3data.yaml"
    path.write_text(yaml.safe_dump(workload))
    proc = shoal_cli(
        [
            "run",
            str(path),
            "--run-name",
            "s3data",
            "--set",
            "train.max_steps=30",
            "--set",
            "train.eval_every=1000",
        ],
        workdir,
        **CREDENTIALS,
        AWS_ENDPOINT_URL=s3_endpoint,
        SHOAL_AUDIT_SAMPLES="1",
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert_exactly_once(workdir / "shoal_runs" / "s3data", steps=30, global_batch=128, rows=table.num_rows)
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    for rank in (0, 1):
        per_epoch = client.get_metric_history(run.info.run_id, f"data/{rank}/bytes_read")
        assert [m.step for m in per_epoch] == [11, 22]  # the two whole epochs' last steps
        assert all(0 < m.value <= 1.10 * size / 2 for m in per_epoch)
    summed = client.get_metric_history(run.info.run_id, "data/bytes_read")
    assert all(m.value <= 1.10 * size for m in summed)
    trained = client.get_metric_history(run.info.run_id, "data/rows_trained")
    assert [m.value for m in trained] == [11 * 128, 11 * 128]
