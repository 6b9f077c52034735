"""The `shoal` command: parse, call the Python API, print. Exit codes:
0 done, 1 training failed, 2 bad input (spec, data, cluster, tracking), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from shoal.launch import RunOptions
    from shoal.spec import LoadedWorkload

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
console = Console(highlight=False)
errors = Console(stderr=True, highlight=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Elastic multi-GPU training on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="train a workload")
    run.add_argument("file", help="workload YAML")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec value, e.g. --set train.optimizer.lr=1e-3 (repeatable)",
    )
    run.add_argument("--address", help="Ray cluster to attach to (HOST:PORT); default: start a local Ray")
    run.add_argument("--run-name", help="name of the run; reuse it to resume that run")
    run.add_argument("--verbose", action="store_true", help="show Ray's own logs in the terminal")

    resume = commands.add_parser("resume", help="resume an MLflow run from its latest checkpoint")
    resume.add_argument("run_id", help="the MLflow run id that `shoal run` printed")
    resume.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./mlflow.db)"
    )
    resume.add_argument("--address", help="Ray cluster to attach to (HOST:PORT); default: start a local Ray")
    resume.add_argument("--verbose", action="store_true", help="show Ray's own logs in the terminal")

    validate = commands.add_parser("validate", help="check a workload without running it")
    validate.add_argument("file")
    validate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    data = commands.add_parser("data", help="datasets")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    prepare = data_commands.add_parser("prepare", help="prepare a built-in corpus as parquet shards")
    prepare.add_argument("name", help="digits | pytext")
    prepare.add_argument("dir", nargs="?", help="target directory (default: shoal's data cache)")
    prepare.add_argument("--seed", type=int, default=0)
    prepare.add_argument("--seq-len", type=int, default=256, help="pytext window length in tokens")
    prepare.add_argument("--force", action="store_true", help="prepare again even if present")
    return parser


def _user_error(message: str) -> int:
    errors.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    return EXIT_USAGE


def cmd_validate(args: argparse.Namespace) -> int:
    from shoal.spec import load

    loaded = load(args.file, args.overrides)
    w = loaded.workload
    low, high = w.scaling.worker_range()
    workers = str(low) if low == high else f"{low}-{high}"
    console.print(
        f"[green]ok[/] {args.file}: '{w.name}', {w.model.family or w.model.target}, "
        f"{workers} worker(s), {w.parallel.strategy}, {w.train.precision}"
    )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from shoal.data import BUILTINS, prepare

    if args.name not in BUILTINS:
        return _user_error(f"unknown corpus '{args.name}' (available: {', '.join(BUILTINS)})")
    if args.seq_len < 1:
        return _user_error(f"--seq-len must be >= 1 (got {args.seq_len})")
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
        return _user_error(str(exc))
    console.print(f"[green]ready[/] {args.name}: {path}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from shoal.launch import RunOptions
    from shoal.spec import load

    loaded = load(args.file, args.overrides, prepare_data=True)
    return _train(loaded, RunOptions(address=args.address, run_name=args.run_name, verbose=args.verbose))


def cmd_resume(args: argparse.Namespace) -> int:
    """Re-run what an MLflow run recorded (its resolved workload, its checkpoint location)."""
    import os
    import tempfile
    from pathlib import Path

    from shoal.launch import RunOptions
    from shoal.spec import load
    from shoal.tracking import resolve_uri
    from shoal.tracking.mlflow_run import recorded_job

    uri = resolve_uri(args.tracking_uri)
    job = recorded_job(uri, args.run_id)
    if job.status == "FINISHED":
        return _user_error(f"MLflow run {args.run_id} ({job.run_name}) already FINISHED; nothing to resume")
    if job.cwd and Path(job.cwd).is_dir():
        os.chdir(job.cwd)  # relative paths in the recorded spec mean what they meant then
    storage = job.run_dir.rsplit("/", 1)[0]
    overrides = [f"checkpoint.storage={storage}", f"tracking.uri={uri}"]
    with tempfile.TemporaryDirectory(prefix="shoal-resume-") as tmp:
        spec_file = Path(tmp) / f"{job.run_name}.yaml"
        spec_file.write_text(job.spec_yaml)
        loaded = load(spec_file, overrides, prepare_data=True)
    console.print(f"resuming {job.run_name} (MLflow run {job.run_id}) from {job.run_dir}")
    return _train(loaded, RunOptions(address=args.address, run_name=job.run_name, verbose=args.verbose))


def _train(loaded: LoadedWorkload, options: RunOptions) -> int:
    from shoal.launch import run
    from shoal.launch.progress import TerminalProgress, summary_table

    with TerminalProgress(console) as progress:
        result = run(loaded, options, progress)
    console.print(summary_table(result))
    console.print(f"MLflow run id: {result.run_id}")
    if result.status == "KILLED":
        return EXIT_INTERRUPTED
    return 0 if result.ok else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from shoal.data import DataError
    from shoal.launch import ClusterError
    from shoal.launch.storage import StorageError
    from shoal.models import ModelError
    from shoal.spec import SpecError
    from shoal.tracking import TrackingError

    handlers = {"run": cmd_run, "resume": cmd_resume, "validate": cmd_validate, "data": cmd_data}
    try:
        return handlers[args.command](args)
    except SpecError as exc:
        for issue in exc.issues:
            errors.print(f"[red]error:[/] {escape(str(issue))}", soft_wrap=True)
        return EXIT_USAGE
    except (DataError, ClusterError, StorageError, TrackingError, ModelError) as exc:
        return _user_error(str(exc))
    except KeyboardInterrupt:
        errors.print("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
