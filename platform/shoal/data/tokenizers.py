"""Tokenizers: how raw text becomes token ids (the workload's `tokenizer` section).

One small interface, four kinds:

- `byte`: UTF-8 bytes, ids 0-255 (vocabulary 256). EOS is id 0, the NUL byte, which
  ordinary text never holds; so a byte model keeps its 256 ids (the built-in `pytext`
  corpus, which joins files with a blank line and has no EOS, is prepared apart).
- `hf`: a Hugging Face tokenizer from a local `tokenizer.json` or a folder
  (`tokenizer.json`, else anything `AutoTokenizer` reads with `local_files_only`). EOS is
  the folder's `eos_token`, else the first of KNOWN_EOS in its vocabulary.
- `tiktoken_file`: a local `.tiktoken` file (ranks only; tiktoken downloads anything else).
  Its split pattern and EOS id follow the OpenAI encoding its file name names
  (`cl100k_base.tiktoken`, ...), else GPT-2's pattern and EOS = the next free id.
- `train_bpe`: a byte-level BPE trained with HF `tokenizers` on the training text
  (all 256 bytes in its alphabet, EOS `<|endoftext|>` = id 0), saved as an `hf` one.

A tokenizer saves itself into a folder (`save`): SAVED_INFO (kind, EOS, vocabulary,
digest) beside its own files (`tokenizer.json` + `tokenizer_config.json` for HF ones,
readable by `AutoTokenizer.from_pretrained(folder)`; `tokenizer.tiktoken`); `load_saved`
reads it back. `digest` names the tokenizer's exact behaviour in cache keys.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shoal.data.errors import DataError

SAVED_INFO = "shoal_tokenizer.json"
BPE_EOS = "<|endoftext|>"
KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
HF_EXTRA = "pip install 'shoal[hf]'"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# OpenAI's encodings by file name: (split pattern, id of <|endoftext|>), as in tiktoken_ext.
TIKTOKEN_KNOWN = {
    "gpt2": (GPT2_PATTERN, 50256),
    "r50k_base": (GPT2_PATTERN, 50256),
    "p50k_base": (GPT2_PATTERN, 50256),
    "cl100k_base": (CL100K_PATTERN, 100257),
    "o200k_base": (O200K_PATTERN, 199999),
}


def _sha256(*parts: str | bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part.encode() if isinstance(part, str) else part)
        hasher.update(b"\0")
    return hasher.hexdigest()


class TextTokenizer(ABC):
    """Texts -> token ids; every kind below fills these in."""

    kind: str
    eos_id: int
    vocab_size: int
    digest: str

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One int array per text, without EOS (packing adds it between documents)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def _save_files(self, directory: Path) -> dict[str, Any]:
        """Write the kind's own files into `directory`; what SAVED_INFO records of them."""

    def save(self, directory: str | Path) -> Path:
        """Write this tokenizer's files and SAVED_INFO into `directory`; returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        info = {
            "type": self.kind,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "digest": self.digest,
        }
        info.update(self._save_files(directory))
        (directory / SAVED_INFO).write_text(json.dumps(info, indent=2) + "\n")
        return directory

    @property
    def token_type(self) -> type[np.integer]:
        """The smallest numpy type of packed windows that holds every id."""
        return np.uint8 if self.vocab_size <= 256 else np.int32


class ByteTokenizer(TextTokenizer):
    kind = "byte"
    eos_id = 0
    vocab_size = 256
    digest = _sha256("byte", "utf-8", "eos=0")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def _save_files(self, directory: Path) -> dict[str, Any]:
        return {}


class HfTokenizer(TextTokenizer):
    """A fast tokenizer of HF `tokenizers` (what `hf` loads and `train_bpe` trains)."""

    kind = "hf"

    def __init__(self, tokenizer: Any, eos_token: str, config: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.eos_token = eos_token
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"EOS token {eos_token!r} is not in the vocabulary")
        self.eos_id = int(eos_id)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.config = {"tokenizer_class": "PreTrainedTokenizerFast", **(config or {}), "eos_token": eos_token}
        self.digest = _sha256("hf", tokenizer.to_str(), eos_token)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        self.tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        return {"eos_token": self.eos_token, "file": "tokenizer.json"}


class TiktokenTokenizer(TextTokenizer):
    kind = "tiktoken"

    def __init__(self, path: Path, pattern: str, eos_id: int | None):
        """`eos_id` None: the next id after the file's ranks."""
        tiktoken = _import_tiktoken()
        from tiktoken.load import load_tiktoken_bpe  # optional library, imported with tiktoken

        self.source = path
        ranks = load_tiktoken_bpe(str(path))
        if not ranks:
            raise ValueError("it holds no tokens")
        self.pattern = pattern
        self.eos_id = max(ranks.values()) + 1 if eos_id is None else eos_id
        self.encoding = tiktoken.Encoding(
            path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens={BPE_EOS: self.eos_id}
        )
        self.vocab_size = int(self.encoding.n_vocab)
        self.digest = _sha256("tiktoken", path.read_bytes(), pattern, str(self.eos_id))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # ordinary: a literal "<|endoftext|>" in a text is text, never the EOS id
        return [np.asarray(ids, dtype=np.int32) for ids in self.encoding.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def _save_files(self, directory: Path) -> dict[str, Any]:
        shutil.copyfile(self.source, directory / "tokenizer.tiktoken")
        return {"file": "tokenizer.tiktoken", "pattern": self.pattern}


def _import_tokenizers() -> Any:
    try:
        import tokenizers  # optional library: the `hf` extra
    except ImportError:
        raise DataError(
            "tokenizer.type", f"this tokenizer needs the `tokenizers` package: {HF_EXTRA}"
        ) from None
    return tokenizers


def _import_tiktoken() -> Any:
    try:
        import tiktoken  # optional library: the `hf` extra
    except ImportError:
        raise DataError(
            "tokenizer.type", "tiktoken_file needs the `tiktoken` package: pip install tiktoken"
        ) from None
    return tiktoken


def _hf_eos(folder: Path | None, vocab: dict[str, int], where: str) -> str:
    """The folder's declared eos_token, else the first known EOS name in the vocabulary."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name if folder else None
        if path and path.is_file():
            declared = json.loads(path.read_text()).get("eos_token")
            if isinstance(declared, dict):
                declared = declared.get("content")
            if isinstance(declared, str) and declared in vocab:
                return declared
    for token in KNOWN_EOS:
        if token in vocab:
            return token
    raise DataError(
        where,
        f"the tokenizer has no EOS token (none declared as eos_token, none of {', '.join(KNOWN_EOS)} "
        "in its vocabulary); set eos_token in its tokenizer_config.json",
    )


def _folder_config(folder: Path | None) -> dict[str, Any]:
    path = folder / "tokenizer_config.json" if folder else None
    if path and path.is_file():
        return {k: v for k, v in json.loads(path.read_text()).items() if k != "added_tokens_decoder"}
    return {}


def load_hf(path: str, where: str = "tokenizer.path") -> HfTokenizer:
    """A `tokenizer.json`, or a folder holding one (else what AutoTokenizer reads there)."""
    tokenizers = _import_tokenizers()
    source = Path(path).expanduser()
    if not source.exists():
        raise DataError(where, f"no such file or directory: '{path}'")
    folder = source if source.is_dir() else None
    file = source / "tokenizer.json" if folder else source
    try:
        if file.is_file():
            tokenizer = tokenizers.Tokenizer.from_file(str(file))
        else:
            tokenizer = _auto_tokenizer(source, where)
    except DataError:
        raise
    except Exception as exc:  # tokenizers and transformers raise many types for a bad file
        raise DataError(where, f"cannot load a Hugging Face tokenizer from '{path}': {exc}") from None
    eos = _hf_eos(folder, tokenizer.get_vocab(with_added_tokens=True), where)
    return HfTokenizer(tokenizer, eos, _folder_config(folder))


def _auto_tokenizer(folder: Path, where: str) -> Any:
    """A folder without tokenizer.json (vocab + merges, sentencepiece): transformers converts it."""
    try:
        from transformers import AutoTokenizer  # optional library: the `hf` extra
    except ImportError:
        raise DataError(
            where, f"'{folder}' has no tokenizer.json; reading it needs transformers: {HF_EXTRA}"
        ) from None
    loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise DataError(
            where, f"'{folder}' holds a slow tokenizer only; save it as a fast one (tokenizer.json)"
        )
    return backend


def load_tiktoken(path: str, where: str = "tokenizer.path") -> TiktokenTokenizer:
    _import_tiktoken()
    source = Path(path).expanduser()
    if not source.is_file():
        raise DataError(where, f"no such file: '{path}' (a local .tiktoken file)")
    pattern, eos_id = TIKTOKEN_KNOWN.get(source.stem, (GPT2_PATTERN, None))
    try:
        return TiktokenTokenizer(source, pattern, eos_id)
    except (ValueError, OSError) as exc:
        raise DataError(where, f"cannot read '{path}' as a .tiktoken file: {exc}") from None


def train_bpe(batches: Iterable[Sequence[str]], vocab_size: int) -> HfTokenizer:
    """A byte-level BPE learned from `batches` of texts; the same texts give the same tokenizer."""
    if vocab_size < 257:
        raise DataError(
            "tokenizer.vocab_size", f"train_bpe needs at least 257 (256 bytes + EOS); got {vocab_size}"
        )
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers  # submodules of the library above

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((text for batch in batches for text in batch), trainer)
    return HfTokenizer(tokenizer, BPE_EOS)


def from_spec(spec: dict[str, Any] | None) -> TextTokenizer | None:
    """The tokenizer a `tokenizer` section names; None for train_bpe (it needs the text first)."""
    kind = (spec or {}).get("type", "byte")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return load_hf(spec["path"])
    if kind == "tiktoken_file":
        return load_tiktoken(spec["path"])
    return None


def expected_vocab_size(spec: dict[str, Any] | None) -> int:
    """The vocabulary a model needs for this tokenizer, without training anything."""
    tokenizer = from_spec(spec)
    return tokenizer.vocab_size if tokenizer else int(spec["vocab_size"])


def load_saved(directory: str | Path) -> TextTokenizer:
    """A tokenizer written by `save` (a run's `tokenizer/`, a packed cache's)."""
    directory = Path(directory)
    where = str(directory)
    try:
        info = json.loads((directory / SAVED_INFO).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(where, f"not a saved shoal tokenizer ({SAVED_INFO}: {exc})") from None
    if info["type"] == "byte":
        return ByteTokenizer()
    if info["type"] == "hf":
        tokenizers = _import_tokenizers()
        tokenizer = tokenizers.Tokenizer.from_file(str(directory / info["file"]))
        return HfTokenizer(tokenizer, info["eos_token"], _folder_config(directory))
    _import_tiktoken()
    return TiktokenTokenizer(directory / info["file"], info["pattern"], info["eos_id"])


def saved_digest(directory: str | Path) -> str | None:
    """The digest recorded in a saved tokenizer folder, or None when there is none."""
    try:
        return json.loads((Path(directory) / SAVED_INFO).read_text())["digest"]
    except (OSError, ValueError, KeyError):
        return None
