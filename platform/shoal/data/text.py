"""Raw text -> token windows in shoal's data cache, packed once, reused by every run that asks the same.

A workload trains on raw text when `data.train.path` names jsonl or txt files, or
parquet with a text column (`data.text_column`) and no `tokens` column, or when it
has a `tokenizer` section. The text is tokenized (`tokenizers.py`), packed into
windows of `data.seq_len + 1` tokens (`packing.py`) and written to
`CACHE/text/KEY/{train,val}/part-*.parquet`, with the tokenizer it used in
`CACHE/text/KEY/tokenizer/` and `manifest.json` last. KEY hashes the input files
(path, size, mtime), the text column, the tokenizer's digest, `seq_len` and
`rows_per_group`: the same request finds the same windows; any change packs anew.
The result is ordinary parquet, read by the rest of shoal like any other.

A `train_bpe` tokenizer is learned from the training split and kept in
`CACHE/tokenizers/bpe-KEY/` (KEY: the training files, the text column, the
vocabulary size), so the same text gives the same tokenizer without training again.
A run keeps its tokenizer in `RUN_DIR/tokenizer/` (`keep_run_tokenizer`); a resumed
run packs with that one, whatever the tokenizer section would give today.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shoal.data.builtin import MANIFEST, cache_root, read_manifest
from shoal.data.errors import DataError
from shoal.data.packing import Packer, PackStats, WindowWriter
from shoal.data.text_sources import (
    RayWhenNeeded,
    TextFiles,
    document_batches,
    parquet_text_column,
    text_files,
    text_format,
    token_batches,
    use_ray,
)
from shoal.data.tokenizers import (
    TextTokenizer,
    from_spec,
    load_saved,
    saved_digest,
    train_bpe,
)

FORMAT_VERSION = 1
TOKENIZER_DIR = "tokenizer"  # in a packed cache directory and in a run directory
RAW_TEXT_TASKS = ("lm", "custom")


def _ignore(*args: Any) -> None:
    return None


@dataclass
class PackProgress:
    say: Callable[[str], None] = _ignore  # a line of what happens now
    advance: Callable[[str, int, int], None] = _ignore  # (split, documents done, documents in all)


@dataclass(frozen=True)
class TextRequest:
    """What to pack: the sources of each split, the windows, the tokenizer section."""

    train: TextFiles
    val: TextFiles | None
    seq_len: int
    rows_per_group: int
    tokenizer: dict[str, Any]


@dataclass
class TextPlan:
    request: TextRequest
    vocab_size: int  # the tokenizer's (train_bpe not yet trained: the vocabulary asked for)
    directory: str | None = None  # the packed cache, once packed
    tokenizer_dir: str | None = None
    tokenizer_digest: str | None = None
    train: list[str] = field(default_factory=list)
    val: list[str] | None = None
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    reused: bool = False  # found in the cache, nothing packed


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _is_text(path: str, where: str, data: dict[str, Any], task: str, tokenizer: dict | None) -> bool:
    kind = text_format(path, where)
    if kind in ("jsonl", "txt"):
        return True
    if kind is None:
        return False
    has_text = parquet_text_column(path, data.get("text_column", "text"))
    return has_text is not None and (tokenizer is not None or (task == "lm" and has_text))


def text_request(
    data: dict[str, Any], model: dict[str, Any], task: str, tokenizer: dict[str, Any] | None
) -> TextRequest | None:
    """The raw text a data section names, or None when it holds tokens (or a built-in corpus)."""
    if data.get("builtin") is not None:
        if tokenizer is not None:
            raise DataError("tokenizer", f"the built-in corpus '{data['builtin']}' is tokenized already")
        return None
    train_path = data["train"]["path"]
    if not _is_text(train_path, "data.train.path", data, task, tokenizer):
        if tokenizer is not None:
            raise DataError("tokenizer", f"'{train_path}' holds tokens; a tokenizer applies to raw text only")
        return None
    if task not in RAW_TEXT_TASKS:
        raise DataError("data.train.path", f"raw text trains language models; the model's task is '{task}'")
    column = data.get("text_column", "text")
    val = None
    if data.get("val"):
        val_path = data["val"]["path"]
        if not _is_text(val_path, "data.val.path", data, task, tokenizer):
            raise DataError("data.val.path", f"'{val_path}' holds tokens, but data.train.path is raw text")
        val = text_files(val_path, "data.val.path", column)
    seq_len = data.get("seq_len") or model.get("args", {}).get("seq_len")
    if not seq_len:
        raise DataError(
            "data.seq_len", "raw text is cut into windows of seq_len + 1 tokens: set data.seq_len"
        )
    return TextRequest(
        text_files(train_path, "data.train.path", column),
        val,
        int(seq_len),
        int(data.get("rows_per_group", 1024)),
        tokenizer or {"type": "byte"},
    )


def plan_text(
    data: dict[str, Any],
    model: dict[str, Any],
    task: str,
    tokenizer: dict[str, Any] | None,
    prepare: bool,
    progress: PackProgress | None = None,
    engine: str = "auto",
) -> TextPlan | None:
    """None for token data; else the text's plan, packed (or found in the cache) when `prepare`."""
    request = text_request(data, model, task, tokenizer)
    if request is None:
        return None
    if prepare:
        return pack(request, progress or PackProgress(), engine)
    resolved = from_spec(request.tokenizer)
    if resolved is None and request.tokenizer["vocab_size"] < 257:
        raise DataError(
            "tokenizer.vocab_size",
            f"train_bpe needs at least 257 (256 bytes + EOS); got {request.tokenizer['vocab_size']}",
        )
    vocab = resolved.vocab_size if resolved else int(request.tokenizer["vocab_size"])
    return TextPlan(request, vocab)


def _bpe_dir(request: TextRequest) -> Path:
    # deferred: the optional `tokenizers` package, only for train_bpe
    import tokenizers

    key = _digest(
        {
            "format": FORMAT_VERSION,
            "train": request.train.fingerprint(),
            "column": request.train.column,
            "vocab_size": request.tokenizer["vocab_size"],
            "tokenizers": tokenizers.__version__,
        }
    )
    return cache_root() / "tokenizers" / f"bpe-{key[:24]}"


def _publish(staging: Path, target: Path) -> None:
    """Move a finished staging directory into place; another process may have won the race."""
    if target.exists():
        shutil.rmtree(target)
    try:
        staging.rename(target)
    except OSError:
        if read_manifest(target) is None and saved_digest(target) is None:
            raise


def _trained_bpe(request: TextRequest, ray: RayWhenNeeded, progress: PackProgress) -> TextTokenizer:
    target = _bpe_dir(request)
    if saved_digest(target) is not None:
        return load_saved(target)
    vocab = int(request.tokenizer["vocab_size"])
    progress.say(f"training a BPE tokenizer ({vocab} tokens) on {len(request.train.files)} file(s)")
    ray.ensure()
    tokenizer = train_bpe(document_batches(request.train, ray.wanted), vocab)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save(staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def _pack_key(request: TextRequest, tokenizer: TextTokenizer) -> str:
    def inputs(source: TextFiles | None) -> Any:
        return source and {"files": source.fingerprint(), "format": source.format, "column": source.column}

    return _digest(
        {
            "format": FORMAT_VERSION,
            "train": inputs(request.train),
            "val": inputs(request.val),
            "seq_len": request.seq_len,
            "rows_per_group": request.rows_per_group,
            "tokenizer": tokenizer.digest,
        }
    )


def _pack_split(
    source: TextFiles,
    split: str,
    tokenizer: TextTokenizer,
    request: TextRequest,
    directory: Path,
    first_id: int,
    ray: RayWhenNeeded,
    progress: PackProgress,
) -> PackStats:
    window = request.seq_len + 1
    writer = WindowWriter(directory / split, window, request.rows_per_group, tokenizer.token_type, first_id)
    packer = Packer(tokenizer.eos_id, window, writer)
    total, done = source.count_documents(), 0

    def advance(documents: int) -> None:
        nonlocal done
        done += documents
        progress.advance(split, done, total)

    progress.advance(split, 0, total)
    for documents in token_batches(source, tokenizer, ray.wanted, advance):
        packer.add(documents)
    stats = packer.finish()
    if not stats.windows:
        raise DataError(
            source.where,
            f"its {stats.dropped_tokens} tokens fill no window of {window} (data.seq_len + 1); "
            "lower data.seq_len or give more text",
        )
    return stats


def _write_pack(
    request: TextRequest, tokenizer: TextTokenizer, target: Path, key: str, ray: RayWhenNeeded, progress
) -> None:
    progress.say(f"packing text into windows of {request.seq_len + 1} tokens in {target}")
    ray.ensure()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer.save(staging / TOKENIZER_DIR)
        stats = {"train": _pack_split(request.train, "train", tokenizer, request, staging, 0, ray, progress)}
        if request.val:
            first = stats["train"].windows
            stats["val"] = _pack_split(request.val, "val", tokenizer, request, staging, first, ray, progress)
        manifest = {
            "format": FORMAT_VERSION,
            "key": key,
            "seq_len": request.seq_len,
            "rows_per_group": request.rows_per_group,
            "tokenizer": {
                "type": tokenizer.kind,
                "digest": tokenizer.digest,
                "vocab_size": tokenizer.vocab_size,
            },
            "inputs": {s: {"files": len(f.files), "format": f.format} for s, f in _splits(request).items()},
            "splits": {split: s.to_dict() for split, s in stats.items()},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _splits(request: TextRequest) -> dict[str, TextFiles]:
    return {"train": request.train, **({"val": request.val} if request.val else {})}


def pack(
    request: TextRequest,
    progress: PackProgress,
    engine: str = "auto",
    tokenizer_dir: str | Path | None = None,
) -> TextPlan:
    """Pack `request` into the cache (or find it there); `tokenizer_dir`: a saved tokenizer to use."""
    with RayWhenNeeded(use_ray(list(_splits(request).values()), engine)) as ray:
        if tokenizer_dir is not None:
            tokenizer = load_saved(tokenizer_dir)
        else:
            tokenizer = from_spec(request.tokenizer) or _trained_bpe(request, ray, progress)
        key = _pack_key(request, tokenizer)
        target = cache_root() / "text" / key[:24]
        manifest = read_manifest(target)
        reused = bool(manifest and manifest.get("key") == key)
        if not reused:
            _write_pack(request, tokenizer, target, key, ray, progress)
            manifest = read_manifest(target)
    assert manifest is not None
    return TextPlan(
        request,
        tokenizer.vocab_size,
        directory=str(target),
        tokenizer_dir=str(target / TOKENIZER_DIR),
        tokenizer_digest=tokenizer.digest,
        train=sorted(str(p) for p in (target / "train").glob("*.parquet")),
        val=sorted(str(p) for p in (target / "val").glob("*.parquet")) if request.val else None,
        stats=manifest["splits"],
        reused=reused,
    )


def keep_run_tokenizer(plan: Any, run_dir: str | Path, say: Callable[[str], None] = _ignore) -> Any:
    """A DataPlan whose text uses the run's own tokenizer (`RUN_DIR/tokenizer/`); a new run
    gets a copy of the plan's. A resumed run whose tokenizer section now gives another one
    (other text for train_bpe, an edited file) packs again with the run's."""
    text: TextPlan | None = getattr(plan, "text", None)
    if text is None or text.tokenizer_dir is None:
        return plan
    saved = Path(run_dir) / TOKENIZER_DIR
    digest = saved_digest(saved)
    if digest is None:
        shutil.copytree(text.tokenizer_dir, saved, dirs_exist_ok=True)
        return plan
    if digest == text.tokenizer_digest:
        return plan
    say(f"this run started with the tokenizer in {saved}; packing the text with it")
    repacked = pack(text.request, PackProgress(say=say), tokenizer_dir=saved)
    return replace(plan, train=repacked.train, val=repacked.val, text=repacked)
