"""Tokenizers: round trips, EOS, vocabulary, digests, saving, train_bpe (no Ray)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shoal.data import DataError, load_saved
from shoal.data.tokenizers import (
    BPE_EOS,
    SAVED_INFO,
    ByteTokenizer,
    expected_vocab_size,
    from_spec,
    load_hf,
    load_tiktoken,
    train_bpe,
)

TEXTS = ["héllo wörld ☃", "", "the quick brown fox jumps over the lazy dog " * 3, "line\nbreaks\tand tabs"]
CORPUS = [f"the {w} of the {v} is {n}" for n in range(60) for w, v in (("cat", "dog"), ("sun", "moon"))]


def round_trips(tokenizer) -> None:
    for text, ids in zip(TEXTS, tokenizer.encode_batch(TEXTS), strict=True):
        assert ids.ndim == 1 and (ids < tokenizer.vocab_size).all()
        assert tokenizer.eos_id not in ids.tolist()
        assert tokenizer.decode(ids) == text


def test_byte_tokenizer_is_utf8_with_nul_as_eos(tmp_path: Path) -> None:
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eos_id, tokenizer.token_type) == (256, 0, np.uint8)
    assert tokenizer.encode_batch(["é"])[0].tolist() == list("é".encode())
    round_trips(tokenizer)
    assert ByteTokenizer().digest == tokenizer.digest
    again = load_saved(tokenizer.save(tmp_path / "byte"))
    assert isinstance(again, ByteTokenizer) and again.digest == tokenizer.digest


@pytest.fixture(scope="module")
def bpe():
    return train_bpe([CORPUS[:50], CORPUS[50:]], 300)


def test_train_bpe_learns_bytes_and_eos_and_round_trips(bpe) -> None:
    assert bpe.eos_id == 0 and bpe.tokenizer.id_to_token(0) == BPE_EOS
    assert 257 < bpe.vocab_size <= 300
    assert bpe.token_type == np.int32
    round_trips(bpe)  # every byte is in the alphabet: text never seen in training still round-trips
    assert len(bpe.encode_batch(["the cat of the dog"])[0]) < len(b"the cat of the dog")


def test_train_bpe_is_deterministic_across_processes(bpe) -> None:
    script = (
        "from tests.unit.test_tokenizers import CORPUS;"
        "from shoal.data.tokenizers import train_bpe;"
        "print(train_bpe([CORPUS], 300).digest)"
    )
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == bpe.digest == train_bpe([CORPUS], 300).digest
    assert train_bpe([[t.upper() for t in CORPUS]], 300).digest != bpe.digest


def test_train_bpe_needs_room_for_bytes_and_eos() -> None:
    with pytest.raises(DataError, match="at least 257") as caught:
        train_bpe([CORPUS], 256)
    assert caught.value.path == "tokenizer.vocab_size"


def test_hf_tokenizer_from_file_and_folder_saves_what_transformers_reads(bpe, tmp_path: Path) -> None:
    bpe.tokenizer.save(str(tmp_path / "tokenizer.json"))
    from_file = load_hf(str(tmp_path / "tokenizer.json"))
    assert (from_file.eos_id, from_file.vocab_size) == (bpe.eos_id, bpe.vocab_size)
    assert from_file.digest == bpe.digest
    round_trips(from_file)
    saved = from_file.save(tmp_path / "saved")
    assert json.loads((saved / SAVED_INFO).read_text())["digest"] == bpe.digest
    again = load_saved(saved)
    assert again.digest == bpe.digest
    assert load_hf(str(saved)).digest == bpe.digest  # a folder: tokenizer.json + tokenizer_config.json

    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    assert auto.eos_token == BPE_EOS and auto.eos_token_id == bpe.eos_id
    text = TEXTS[2]
    assert auto(text, add_special_tokens=False)["input_ids"] == bpe.encode_batch([text])[0].tolist()


def test_hf_folder_declares_its_own_eos(tmp_path: Path) -> None:
    own = train_bpe([CORPUS], 300)
    own.tokenizer.add_special_tokens(["<stop>"])
    folder = tmp_path / "tok"
    folder.mkdir()
    own.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<stop>"}}))
    loaded = load_hf(str(folder))
    assert loaded.eos_token == "<stop>" and loaded.eos_id == own.tokenizer.token_to_id("<stop>")
    assert loaded.vocab_size == own.vocab_size + 1


def test_hf_without_eos_or_file_is_a_clear_error(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match="no EOS token") as caught:
        load_hf(str(tmp_path / "t.json"))
    assert caught.value.path == "tokenizer.path"
    with pytest.raises(DataError, match="no such file"):
        load_hf(str(tmp_path / "missing"))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load"):
        load_hf(str(tmp_path / "junk.json"))


def write_tiktoken(path: Path) -> Path:
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"he"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(ranks)))
    return path


def test_tiktoken_file_round_trips_with_eos_after_its_ranks(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    tokenizer = load_tiktoken(str(write_tiktoken(tmp_path / "mine.tiktoken")))
    assert (tokenizer.eos_id, tokenizer.vocab_size) == (260, 261)
    round_trips(tokenizer)
    assert tokenizer.encode_batch([" the"])[0].tolist() == [258]
    assert tokenizer.encode_batch(["<|endoftext|>"])[0].tolist() != [260]  # text, never the EOS id
    again = load_saved(tokenizer.save(tmp_path / "saved"))
    assert again.digest == tokenizer.digest
    assert load_tiktoken(str(tmp_path / "mine.tiktoken")).digest == tokenizer.digest
    known = load_tiktoken(str(write_tiktoken(tmp_path / "cl100k_base.tiktoken")))
    assert known.eos_id == 100257 and known.digest != tokenizer.digest


def test_tiktoken_missing_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    with pytest.raises(DataError, match="pip install tiktoken"):
        load_tiktoken(str(write_tiktoken(tmp_path / "x.tiktoken")))


def test_tiktoken_bad_file(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(DataError, match="cannot read"):
        load_tiktoken(str(tmp_path / "bad.tiktoken"))
    with pytest.raises(DataError, match="no such file"):
        load_tiktoken(str(tmp_path / "none.tiktoken"))


def test_spec_sections_give_their_tokenizer_and_vocabulary(bpe, tmp_path: Path) -> None:
    bpe.tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert isinstance(from_spec(None), ByteTokenizer)
    assert expected_vocab_size({"type": "byte"}) == 256
    assert expected_vocab_size({"type": "hf", "path": str(tmp_path / "tokenizer.json")}) == bpe.vocab_size
    assert from_spec({"type": "train_bpe", "vocab_size": 500}) is None
    assert expected_vocab_size({"type": "train_bpe", "vocab_size": 500}) == 500
