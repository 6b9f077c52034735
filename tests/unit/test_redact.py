"""Credentials in URIs: masked wherever shoal writes or shows text, dropped from URIs it
hands on, and never in what a run records (params, tags, workload.yaml, events)."""

from __future__ import annotations

import io
import json
import logging
import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from rich.table import Table

from shoal.launch.jobs import _sent_override
from shoal.launch.progress import browse_command
from shoal.launch.storage import _endpoint_options
from shoal.output import RedactingConsole
from shoal.redact import (
    has_credentials,
    redact,
    redact_data,
    redact_logs,
    without_credentials,
    without_credentials_data,
)
from shoal.tracking import open_run

SECRET = "Zq9SECRETmarker"

WITH_CREDENTIALS = {
    f"http://shoal:{SECRET}@127.0.0.1:5000": "http://shoal:***@127.0.0.1:5000",
    f"https://{SECRET}@mlflow.example.com/": "https://***@mlflow.example.com/",
    f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix/train": "s3://AKIAEXAMPLE:***@bucket/prefix/train",
    f"databricks://token:{SECRET}@workspace": "databricks://token:***@workspace",
    f"https://host/data.parquet?token={SECRET}": "https://host/data.parquet?token=***",
    f"https://host/x?a=1&X-Amz-Signature={SECRET}&X-Amz-Credential={SECRET}%2F20261205&b=2": (
        "https://host/x?a=1&X-Amz-Signature=***&X-Amz-Credential=***&b=2"
    ),
    f"https://host/x?sig={SECRET}": "https://host/x?sig=***",
    f"https://host/x?api_key={SECRET}#top": "https://host/x?api_key=***#top",
    f"https://host/x?Password={SECRET}": "https://host/x?Password=***",
    f"error: MLflow at 'http://u:{SECRET}@h:1': refused": "error: MLflow at 'http://u:***@h:1': refused",
}
WITHOUT_CREDENTIALS = [
    "http://127.0.0.1:5000",
    "sqlite:///runs/mlflow.db",
    "s3://bucket/prefix/train",
    "/data/train.parquet",
    "https://host/x?page=2&limit=10",
    "train.lr=0.001",
    "user@example.com wrote this",  # an address, not a URI's user info
]


@pytest.mark.parametrize("text", WITH_CREDENTIALS)
def test_credentials_in_a_uri_are_masked(text: str) -> None:
    assert redact(text) == WITH_CREDENTIALS[text]
    assert SECRET not in redact(text) and has_credentials(text)
    assert SECRET not in without_credentials(text)


@pytest.mark.parametrize("text", WITHOUT_CREDENTIALS)
def test_text_without_credentials_is_left_as_it_is(text: str) -> None:
    assert redact(text) == text and without_credentials(text) == text and not has_credentials(text)


def test_a_uri_handed_on_keeps_its_address_and_loses_its_credentials() -> None:
    assert without_credentials(f"http://shoal:{SECRET}@127.0.0.1:5000/x") == "http://127.0.0.1:5000/x"
    assert without_credentials(f"https://h/x?token={SECRET}&page=2") == "https://h/x?page=2"
    assert without_credentials(f"https://h/x?page=2&token={SECRET}") == "https://h/x?page=2"
    data = {"uri": f"s3://K:{SECRET}@b/p", "items": [f"https://h?sig={SECRET}", 3], "n": 1}
    assert without_credentials_data(data) == {"uri": "s3://b/p", "items": ["https://h", 3], "n": 1}
    assert SECRET not in json.dumps(redact_data(data))


def test_submitted_overrides_and_endpoints_carry_no_credentials() -> None:
    assert _sent_override(f"tracking.uri=http://u:{SECRET}@h:5000") == "tracking.uri=http://h:5000"
    assert _sent_override("train.lr=0.01") == "train.lr=0.01"
    options = _endpoint_options(f"http://KEY:{SECRET}@127.0.0.1:9000")
    assert options["endpoint_override"] == "127.0.0.1:9000" and options["scheme"] == "http"
    assert (options["access_key"], options["secret_key"]) == ("KEY", SECRET)  # used, in memory
    plain = _endpoint_options("minio.local:9000")
    assert plain == {"endpoint_override": "minio.local:9000", "scheme": "https"}


def test_logs_and_the_terminal_show_no_credentials() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("shoal.test_redact")
    logger.addHandler(handler)
    redact_logs(handler)
    redact_logs(handler)  # once is enough: a second call adds no filter
    try:
        logger.warning("MLflow at %s is unreachable", f"http://u:{SECRET}@h:1")
        try:
            raise ConnectionError(f"cannot reach https://h/x?token={SECRET}")
        except ConnectionError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert len(handler.filters) == 1
    assert SECRET not in stream.getvalue() and "http://u:***@h:1" in stream.getvalue()
    assert "token=***" in stream.getvalue()  # the traceback is masked too

    console = RedactingConsole(file=io.StringIO(), width=200)
    console.print(f"MLflow run id: abc (http://u:{SECRET}@h:1)")
    console.out(f"s3://K:{SECRET}@b/p")
    table = Table()
    table.add_column("where")
    table.add_row(f"open http://u:{SECRET}@h:1")
    console.print(table)
    assert SECRET not in console.file.getvalue() and "http://u:***@h:1" in console.file.getvalue()
    assert browse_command(f"http://u:{SECRET}@h:1").startswith("open http://h:1 ")


def test_a_run_records_no_credentials(tmp_path: Path) -> None:
    """Params, tags, the workload.yaml artifact and events of a run whose spec and tracking
    URI hold credentials: the secret is nowhere in the store's database or artifacts."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = {
        "tracking": {"uri": f"http://shoal:{SECRET}@127.0.0.1:5000"},
        "checkpoint": {"storage": "s3://bucket/runs", "endpoint": f"http://KEY:{SECRET}@127.0.0.1:9000"},
        "data": {"path": f"https://host/train.parquet?X-Amz-Signature={SECRET}"},
    }
    run = open_run(
        uri,
        "secrets",
        "r1",
        run_dir=f"s3://KEY:{SECRET}@bucket/runs/r1",
        resume=False,
        resolved_spec=spec,
        spec_yaml=json.dumps(without_credentials_data(spec)),
        tags={"shoal.failure": f"cannot reach http://u:{SECRET}@h"},
    )
    run.log_json([{"kind": "error", "message": f"s3://K:{SECRET}@b/x"}], "events.json")
    run.finish("FINISHED")
    client = MlflowClient(uri)
    recorded = client.get_run(run.run_id)
    assert recorded.data.params["checkpoint.endpoint"] == "http://KEY:***@127.0.0.1:9000"
    assert recorded.data.tags["shoal.run_dir"] == "s3://bucket/runs/r1"
    stored = [row for table in ("params", "tags", "metrics", "runs") for row in _rows(tmp_path, table)]
    assert stored and not any(SECRET in str(row) for row in stored)
    listed = [a.path for a in client.list_artifacts(run.run_id)]
    assert sorted(listed) == ["events.json", "workload.yaml"]
    for name in listed:
        text = Path(client.download_artifacts(run.run_id, name, str(tmp_path))).read_text()
        assert SECRET not in text, (name, text)
    assert "127.0.0.1:9000" in Path(tmp_path / "workload.yaml").read_text()  # the address stays


def _rows(tmp_path: Path, table: str) -> list[tuple]:
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        return db.execute(f"select * from {table}").fetchall()  # noqa: S608 (a fixed table name)
