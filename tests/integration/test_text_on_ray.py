"""Raw text on the shared Ray cluster: Ray Data packs what the driver packs; a GPT trains on a
jsonl corpus with a BPE tokenizer trained by the workload, and a resumed run keeps that tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from shoal.data import DataError, load_saved
from shoal.data.text import plan_text
from tests.integration.conftest import run_workload

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "big", "small"]


def corpus(documents: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(5, 40))) + "." for _ in range(documents)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def packed(source: Path, engine: str, tokenizer: dict | None = None):
    data = {"train": {"path": str(source)}, "seq_len": 31, "rows_per_group": 16}
    return plan_text(data, {}, "lm", tokenizer, prepare=True, engine=engine)


def test_ray_data_packs_what_the_driver_packs(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, ray_cluster: str
) -> None:
    docs = corpus(120)
    (workdir / "txt").mkdir()
    for i, doc in enumerate(docs):
        (workdir / "txt" / f"{i:04d}.txt").write_text(doc)
    pq.write_table(pa.table({"text": docs}), workdir / "docs.parquet", row_group_size=25)
    sources = [write_jsonl(workdir / "docs.jsonl", docs), workdir / "docs.parquet", workdir / "txt"]
    bpe = {"type": "train_bpe", "vocab_size": 290}
    for source, tokenizer in [(s, None) for s in sources] + [(sources[0], bpe)]:
        results = {}
        for engine in ("local", "ray"):
            monkeypatch.setenv("SHOAL_DATA_CACHE", str(workdir / f"cache-{engine}"))
            results[engine] = packed(source, engine, tokenizer)
        local, ray = results["local"], results["ray"]
        assert not ray.reused and ray.tokenizer_digest == local.tokenizer_digest
        assert pq.read_table(ray.train).equals(pq.read_table(local.train)), source
        assert ray.stats == local.stats
    (workdir / "bad").mkdir()
    (workdir / "bad" / "x.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(DataError, match="not UTF-8") as caught:
        packed(workdir / "bad", "ray")
    assert caught.value.path == "data.train.path"
    (workdir / "numbers.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(DataError, match="not JSON lines with a text"):
        packed(workdir / "numbers.jsonl", "ray")


def test_gpt_trains_on_jsonl_with_its_own_bpe_and_resumes_with_it(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = workdir / "cache"
    monkeypatch.setenv("SHOAL_DATA_CACHE", str(cache))
    source = write_jsonl(workdir / "corpus.jsonl", corpus(400))
    workload = {
        "name": "text_gpt",
        "model": {"family": "gpt", "args": {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 300}},
        "data": {"train": {"path": str(source)}, "seq_len": 32, "batch_size": 8, "rows_per_group": 64},
        "tokenizer": {"type": "train_bpe", "vocab_size": 300},
        "train": {"max_steps": 20, "optimizer": {"lr": 0.01}},
        "scaling": {"workers": 1},
    }
    first = run_workload(workdir, workload, run_name="text")
    assert first.ok, first.reason
    client = MlflowClient(first.tracking_uri)
    losses = [
        m.value for m in sorted(client.get_metric_history(first.run_id, "train/loss"), key=lambda m: m.step)
    ]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    run_tokenizer = workdir / "shoal_runs" / "text" / "tokenizer"
    trained = load_saved(run_tokenizer)
    assert (run_tokenizer / "tokenizer.json").is_file() and trained.vocab_size <= 300
    logged = {Path(a.path).name for a in client.list_artifacts(first.run_id, "tokenizer")}
    assert {"tokenizer.json", "tokenizer_config.json"} <= logged

    write_jsonl(source, corpus(400, seed=1))  # train_bpe on this text would learn another tokenizer
    refused = run_workload(workdir, workload, ["train.max_steps=24"], run_name="text")
    assert not refused.ok and "the data changed since the checkpoint was written" in refused.reason
    assert "data.accept_changed_data: true" in refused.reason
    accept = ["train.max_steps=24", "data.accept_changed_data=true"]
    resumed = run_workload(workdir, workload, accept, run_name="text")
    assert resumed.ok, resumed.reason
    assert resumed.run_id == first.run_id and resumed.resumed_from == 20 and resumed.step == 24
    assert load_saved(run_tokenizer).digest == trained.digest
    manifests = [json.loads(p.read_text()) for p in cache.glob("text/*/manifest.json")]
    digests = sorted(m["tokenizer"]["digest"] for m in manifests)
    assert digests.count(trained.digest) == 2 and len(digests) == 3  # old text, new text x (run's, fresh)
