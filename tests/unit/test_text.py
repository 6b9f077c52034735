"""Raw text: format detection, packing into windows, the cache, a run's own tokenizer (no Ray)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from shoal import cli
from shoal.data import DataError, load_saved, plan_data
from shoal.data.packing import Packer, WindowWriter
from shoal.data.text import PackProgress, keep_run_tokenizer, plan_text
from shoal.errors import EXIT_USAGE
from tests.conftest import write_workload

DOCS = [f"doc {i}: " + "words and more words " * (i % 5) for i in range(40)] + [""]


def write_jsonl(path: Path, docs: list[str], column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({column: d, "other": 1}) + "\n" for d in docs))
    return path


def write_parquet(path: Path, docs: list[str], column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), path)
    return path


def write_txt(directory: Path, docs: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / f"{i:03d}.txt").write_text(doc)
    return directory


def data(path: Path, seq_len: int = 15, **more) -> dict:
    return {"train": {"path": str(path)}, "seq_len": seq_len, "rows_per_group": 8, **more}


def pack(source: Path, tokenizer: dict | None = None, task: str = "lm", **more):
    return plan_text(data(source, **more), {}, task, tokenizer, prepare=True, engine="local")


def windows(files: list[str]) -> np.ndarray:
    return np.array(pq.read_table(files)["tokens"].to_pylist())


def test_packer_keeps_every_token_once_in_order_with_eos_between_documents(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    documents = [rng.integers(1, 250, size=n).astype(np.uint8) for n in (5, 0, 17, 3, 40, 1, 9)]
    writer = WindowWriter(tmp_path / "w", window=7, rows_per_group=3, token_type=np.uint8, first_id=100)
    packer = Packer(eos_id=0, window=7, writer=writer)
    packer.add(documents[:3])
    packer.add(documents[3:])
    stats = packer.finish()
    stream = np.concatenate([x for d in documents if len(d) for x in (d, [0])])
    table = pq.read_table(sorted(str(p) for p in (tmp_path / "w").glob("*.parquet")))
    rows = np.array(table["tokens"].to_pylist())
    assert rows.shape == (len(stream) // 7, 7) == (stats.windows, 7)
    assert (rows.reshape(-1) == stream[: rows.size]).all()
    assert stats.dropped_tokens == len(stream) % 7 and stats.documents == 6
    assert table["id"].to_pylist() == list(range(100, 100 + stats.windows))
    groups = pq.ParquetFile(tmp_path / "w" / "part-00000.parquet").metadata
    sizes = [groups.row_group(i).num_rows for i in range(groups.num_row_groups)]
    assert sizes[:-1] == [3] * (len(sizes) - 1) and 0 < sizes[-1] <= 3 and sum(sizes) == stats.windows


def test_jsonl_parquet_and_txt_give_the_same_windows(tmp_path: Path) -> None:
    plans = [
        pack(write_jsonl(tmp_path / "a.jsonl", DOCS)),
        pack(write_parquet(tmp_path / "p" / "a.parquet", DOCS)),
        pack(write_txt(tmp_path / "txt", DOCS)),  # one document per file
    ]
    first = windows(plans[0].train)
    assert first.shape[1] == 16
    assert pq.read_schema(plans[0].train[0]).field("tokens").type.value_type == pa.uint8()
    for plan in plans[1:]:
        assert (windows(plan.train) == first).all()
    stream = b"".join(d.encode() + b"\0" for d in DOCS if d)
    assert bytes(first.reshape(-1).tolist()) == stream[: first.size]
    assert plans[0].stats["train"]["documents"] == len(DOCS) - 1


def test_packed_cache_is_parquet_with_row_groups_and_a_tokenizer(tmp_path: Path) -> None:
    plan = pack(write_jsonl(tmp_path / "a.jsonl", DOCS))
    metadata = pq.ParquetFile(plan.train[0]).metadata
    assert metadata.row_group(0).num_rows == 8
    assert pq.read_schema(plan.train[0]).names == ["id", "tokens"]
    assert Path(plan.directory, "manifest.json").is_file()
    assert load_saved(plan.tokenizer_dir).digest == plan.tokenizer_digest


def test_cache_is_reused_and_missed_when_input_tokenizer_or_settings_change(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", DOCS)
    first = pack(source)
    stamp = Path(first.directory, "manifest.json").stat().st_mtime_ns
    again = pack(source)
    assert again.reused and again.directory == first.directory
    assert Path(first.directory, "manifest.json").stat().st_mtime_ns == stamp
    changed = {
        "seq_len": pack(source, seq_len=7).directory,
        "rows_per_group": pack(source, rows_per_group=4).directory,
        "tokenizer": pack(source, {"type": "train_bpe", "vocab_size": 270}).directory,
    }
    write_jsonl(source, DOCS + ["one more document"])
    changed["input"] = pack(source).directory
    assert first.directory not in changed.values() and len(set(changed.values())) == 4


def test_train_bpe_is_trained_once_and_reused(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", DOCS * 3)
    said: list[str] = []
    progress = PackProgress(say=said.append)
    spec = {"type": "train_bpe", "vocab_size": 280}
    first = plan_text(data(source), {}, "lm", spec, True, progress, engine="local")
    assert any("training a BPE tokenizer" in line for line in said)
    said.clear()
    second = plan_text(data(source, seq_len=9), {}, "lm", spec, True, progress, engine="local")
    assert not any("training" in line for line in said) and not second.reused
    assert second.tokenizer_digest == first.tokenizer_digest
    assert windows(first.train).max() < first.vocab_size <= 280


def test_a_resumed_run_packs_with_its_own_tokenizer(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", DOCS)
    spec = {"type": "train_bpe", "vocab_size": 270}
    run_dir = tmp_path / "run"
    plan = plan_data(data(source), {}, "lm", True, spec)
    assert keep_run_tokenizer(plan, run_dir) is plan
    saved = load_saved(run_dir / "tokenizer")
    assert saved.digest == plan.text.tokenizer_digest and (run_dir / "tokenizer" / "tokenizer.json").is_file()
    write_jsonl(source, [d.upper() for d in DOCS])  # train_bpe would learn another tokenizer now
    fresh = plan_data(data(source), {}, "lm", True, spec)
    assert fresh.text.tokenizer_digest != saved.digest
    kept = keep_run_tokenizer(fresh, run_dir)
    assert kept.text.tokenizer_digest == saved.digest and kept.train != fresh.train
    assert saved.decode(windows(kept.train)[0]).startswith("DOC 0: <|endoftext|>DOC 1: W")


def test_val_windows_continue_the_ids(tmp_path: Path) -> None:
    train, val = write_jsonl(tmp_path / "t.jsonl", DOCS), write_jsonl(tmp_path / "v.jsonl", DOCS[:20])
    plan = pack(train, val={"path": str(val)})
    train_ids = pq.read_table(plan.train)["id"].to_pylist()
    val_ids = pq.read_table(plan.val)["id"].to_pylist()
    assert val_ids[0] == len(train_ids) and plan.stats["val"]["windows"] == len(val_ids)


def test_token_parquet_is_not_text_and_takes_no_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"tokens": [[1, 2, 3]], "text": ["x"]}), path)
    assert pack(path) is None
    with pytest.raises(DataError, match="holds tokens") as caught:
        pack(path, {"type": "byte"})
    assert caught.value.path == "tokenizer"
    labelled = write_parquet(tmp_path / "labelled.parquet", ["a review"])
    assert pack(labelled, task="classify") is None  # a text column of a classifier's data is its own


@pytest.mark.parametrize(
    ("setup", "path", "match"),
    [
        (
            lambda d: write_txt(d / "mix", ["a"]) and write_jsonl(d / "mix" / "b.jsonl", ["b"]),
            "mix",
            "mixes formats",
        ),
        (lambda d: write_jsonl(d / "a.jsonl", ["a"], column="body"), "a.jsonl", "no string field 'text'"),
        (lambda d: write_parquet(d / "a.parquet", ["a"], column="body"), "a.parquet", "no column 'text'"),
        (lambda d: (d / "bin.txt").write_bytes(b"\xff\xfe bad"), "bin.txt", "not UTF-8"),
        (lambda d: write_jsonl(d / "tiny.jsonl", ["ab"]), "tiny.jsonl", "fill no window of 16"),
        (lambda d: (d / "a.jsonl").write_text('{"text": 3}\n'), "a.jsonl", "not JSON lines"),
        (lambda d: None, "absent.jsonl", "no such file"),
    ],
)
def test_bad_text_is_one_clear_error(tmp_path: Path, setup, path: str, match: str) -> None:
    setup(tmp_path)
    with pytest.raises(DataError, match=match):
        pack(tmp_path / path, {"type": "byte"})


def test_raw_text_needs_a_language_model_and_a_window(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(DataError, match="task is 'classify'"):
        pack(source, task="classify")
    with pytest.raises(DataError, match="set data.seq_len") as caught:
        plan_text({"train": {"path": str(source)}}, {}, "lm", None, prepare=False)
    assert caught.value.path == "data.seq_len"
    plan = plan_text({"train": {"path": str(source)}}, {"args": {"seq_len": 8}}, "lm", None, prepare=False)
    assert plan.request.seq_len == 8 and plan.directory is None and plan.vocab_size == 256


def gpt_on_text(tmp_path: Path, vocab_size: int, tokenizer: dict) -> Path:
    source = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    workload = {
        "name": "text",
        "model": {
            "family": "gpt",
            "args": {"n_layers": 1, "d_model": 16, "n_heads": 2, "vocab_size": vocab_size},
        },
        "data": {"train": {"path": str(source)}, "seq_len": 16, "batch_size": 2},
        "tokenizer": tokenizer,
        "train": {"max_steps": 2},
        "checkpoint": {"storage": str(tmp_path / "runs")},
    }
    return write_workload(tmp_path, workload)


def test_validate_refuses_a_model_vocabulary_smaller_than_the_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = gpt_on_text(tmp_path, 256, {"type": "train_bpe", "vocab_size": 300})
    assert cli.main(["validate", str(path)]) == EXIT_USAGE
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "model.args.vocab_size" in err[0] and "(256)" in err[0] and "(300, train_bpe)" in err[0]
    assert (
        cli.main(["validate", str(gpt_on_text(tmp_path, 300, {"type": "train_bpe", "vocab_size": 300}))]) == 0
    )
    assert cli.main(["validate", str(gpt_on_text(tmp_path, 256, {"type": "byte"}))]) == 0
    assert not list((tmp_path / "runs").glob("*")) and "SHOAL_DATA_CACHE" in os.environ


def test_shoal_data_pack_packs_once_and_says_where(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = gpt_on_text(tmp_path, 300, {"type": "train_bpe", "vocab_size": 300})
    assert cli.main(["data", "pack", str(path)]) == 0
    out = capsys.readouterr().out
    assert "training a BPE tokenizer" in out and "packed " in out
    assert "train: 40 documents -> " in out and "windows x 17 = " in out and "tokenizer: train_bpe" in out
    assert cli.main(["data", "pack", str(path), "--set", "data.seq_len=16"]) == 0
    assert "found in the cache" in capsys.readouterr().out
    workload = yaml.safe_load(path.read_text())
    workload["model"]["args"]["seq_len"] = 16
    tokens = write_workload(tmp_path, {**workload, "data": {"builtin": "pytext"}, "tokenizer": None})
    assert cli.main(["data", "pack", str(tokens)]) == EXIT_USAGE
    assert "nothing to pack" in capsys.readouterr().err
