"""`shoal data`: prepare a built-in corpus, tokenize and pack a workload's raw text, or
rewrite parquet into row groups the epoch plan can split finely."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from shoal.cli_options import SharedOptions
from shoal.errors import ShoalError


def add_parser(commands: Any, shared: SharedOptions) -> None:
    data = commands.add_parser("data", help="datasets")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prepare = data_commands.add_parser("prepare", help="prepare a built-in corpus as parquet shards")
    prepare.add_argument("name", help="digits | pytext")
    prepare.add_argument("dir", nargs="?", help="target directory (default: shoal's data cache)")
    prepare.add_argument("--seed", type=int, default=0)
    prepare.add_argument("--seq-len", type=int, default=256, help="pytext window length in tokens")
    prepare.add_argument("--force", action="store_true", help="prepare again even if present")
    pack = data_commands.add_parser(
        "pack",
        help="tokenize and pack a workload's raw text into the data cache a run reads (FILE); "
        "or rewrite parquet SRC into DST with smaller row groups (SRC DST --rows-per-group N)",
        parents=[shared.overrides],
    )
    pack.add_argument("file", help="workload YAML whose data section names raw text, or parquet SRC")
    pack.add_argument("dst", nargs="?", help="with SRC: a new or empty directory (or s3:// prefix)")
    pack.add_argument("--rows-per-group", type=int, help="with SRC DST: rows per parquet row group")
    pack.add_argument("--address", help="Ray cluster for SRC DST (default: $RAY_ADDRESS, else a local one)")


def cmd_data(console: Console, args: argparse.Namespace) -> int:
    if args.data_command == "pack" and (args.dst or args.rows_per_group is not None):
        return cmd_data_regroup(console, args)
    if args.data_command == "pack":
        return cmd_data_pack(console, args)
    return cmd_data_prepare(console, args)


def cmd_data_regroup(console: Console, args: argparse.Namespace) -> int:
    """`shoal data pack SRC DST --rows-per-group N`."""
    if not args.dst or args.rows_per_group is None:
        raise ShoalError("shoal data pack SRC DST --rows-per-group N: give both SRC and DST, and N")
    if args.overrides:
        raise ShoalError("--set goes with a workload FILE, not with SRC DST")
    # deferred: the data layer imports pyarrow and torch, and launch/ Ray (seconds)
    from shoal.data.regroup import check_target, regroup_parquet
    from shoal.data.sources import parquet_files
    from shoal.launch.cluster import ray_session

    parquet_files(args.file, "SRC")  # refused before Ray starts
    check_target(args.dst)
    with ray_session(args.address, cpus_wanted=0):
        manifest = regroup_parquet(args.file, args.dst, args.rows_per_group)
    sizes = sorted(g.rows for g in manifest.row_groups)
    console.print(f"[green]packed[/] {args.dst}", soft_wrap=True)
    console.print(
        f"  {manifest.total_rows:,} rows in {len(manifest.files)} file(s), {len(sizes)} row groups "
        f"of {sizes[0]:,}-{sizes[-1]:,} rows; digest {manifest.digest[:12]}",
        soft_wrap=True,
    )
    return 0


def cmd_data_prepare(console: Console, args: argparse.Namespace) -> int:
    # deferred: the data layer imports pyarrow and torch (seconds); `shoal --help` needs neither
    from shoal.data import BUILTINS, prepare

    if args.name not in BUILTINS:
        raise ShoalError(f"unknown corpus '{args.name}' (available: {', '.join(BUILTINS)})")
    if args.seq_len < 1:
        raise ShoalError(f"--seq-len must be >= 1 (got {args.seq_len})")
    try:
        path = prepare(
            args.name,
            args.dir,
            seed=args.seed,
            seq_len=args.seq_len,
            force=args.force,
            on_progress=lambda m: console.print(m),
        )
    except FileExistsError as exc:
        raise ShoalError(str(exc)) from None
    console.print(f"[green]ready[/] {args.name}: {path}")
    return 0


def cmd_data_pack(console: Console, args: argparse.Namespace) -> int:
    # deferred: the data layer imports pyarrow and torch (seconds); `shoal --help` needs neither
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from shoal.data import PackProgress, plan_text
    from shoal.spec import load

    loaded = load(args.file, args.overrides)
    w, plan = loaded.workload, loaded.data
    if plan is None or plan.text is None:
        where = "data.builtin" if w.data.builtin else "data.train.path"
        raise ShoalError(f"{args.file}: {where} names token data, not raw text; there is nothing to pack")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        tasks: dict[str, Any] = {}

        def advance(split: str, done: int, total: int) -> None:
            if split not in tasks:
                tasks[split] = bar.add_task(f"{split} documents", total=total)
            bar.update(tasks[split], completed=done)

        text = plan_text(
            w.data.model_dump(mode="json"),
            w.model.model_dump(),
            plan.task,
            w.tokenizer.model_dump() if w.tokenizer else None,
            prepare=True,
            progress=PackProgress(say=lambda m: bar.console.print(m, soft_wrap=True), advance=advance),
        )
    assert text is not None
    _print_packed(console, text)
    return 0


def _print_packed(console: Console, text: Any) -> None:
    state = "found in the cache" if text.reused else "packed"
    console.print(f"[green]{state}[/] {text.directory}", soft_wrap=True)
    window = text.request.seq_len + 1
    for split, stats in text.stats.items():
        console.print(
            f"  {split}: {stats['documents']:,} documents -> {stats['windows']:,} windows x {window} "
            f"= {stats['tokens']:,} tokens ({stats['dropped_tokens']:,} left over, dropped)",
            soft_wrap=True,
        )
    kind = text.request.tokenizer.get("type", "byte")
    console.print(
        f"  tokenizer: {kind}, vocabulary {text.vocab_size:,}, in {text.tokenizer_dir}", soft_wrap=True
    )
