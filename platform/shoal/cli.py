"""The `shoal` command: parse, call the Python API, print. Exit codes (shoal.errors):
0 done, 1 training failed, 2 bad input (any ShoalError), 130 interrupted.

Start-up: each command imports the layer it needs when it runs. The layers below
import torch, MLflow and Ray (`import shoal.launch`: 3-5 s on 2 cores); `shoal --help`
imports none of them and answers in ~0.15 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from shoal import cli_inspect, cli_runs
from shoal.cli_options import shared_options
from shoal.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, ShoalError
from shoal.output import Col, FittedTable, Fold, iso_time, print_json

if TYPE_CHECKING:
    from shoal.launch import RunOptions
    from shoal.spec import LoadedWorkload

console = Console(highlight=False)
errors = Console(stderr=True, highlight=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Elastic multi-GPU training on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    shared = shared_options()
    to_train = [shared.overrides, shared.ray_address]

    run = commands.add_parser(
        "run", help="train a workload", parents=[*to_train, shared.run_name, shared.verbose]
    )
    run.add_argument("file", help="workload YAML")
    run.add_argument("--mlflow-run-id", help=argparse.SUPPRESS)  # made beforehand by `shoal submit`

    resume = commands.add_parser(
        "resume",
        help="resume an MLflow run from its latest checkpoint",
        parents=[shared.tracking_uri, shared.ray_address, shared.verbose],
    )
    resume.add_argument("run_id", help="the MLflow run id that `shoal run` printed")

    sweep = commands.add_parser(
        "sweep",
        help="search hyperparameters with Ray Tune (the 'sweep' section)",
        parents=[*to_train, shared.verbose],
    )
    sweep.add_argument("file", help="workload YAML with a 'sweep' section")
    sweep.add_argument("--name", help="name of the sweep (default: WORKLOAD-sweep-TIMESTAMP)")
    sweep.add_argument(
        "--resume", action="store_true", help="continue the latest (or --name) sweep of this workload"
    )

    submit = commands.add_parser(
        "submit",
        help="run a workload as a Ray job on a (remote) cluster",
        parents=[shared.dashboard_address, shared.overrides, shared.run_name],
    )
    submit.add_argument("file", help="workload YAML, inside the working directory")
    submit.add_argument("--working-dir", help="directory uploaded with the job (default: the current one)")
    submit.add_argument(
        "--python", help="interpreter on the cluster (default: this one on this machine, else python3)"
    )
    submit.add_argument("--detach", action="store_true", help="print the job id and return")

    jobs = commands.add_parser(
        "jobs",
        help="Ray jobs on a cluster: list | status | logs | stop",
        parents=[shared.dashboard_address, shared.output_format],
    )
    jobs.add_argument("action", choices=["list", "status", "logs", "stop"])
    jobs.add_argument("job_id", nargs="?", help="the job id that `shoal submit` printed")
    jobs.add_argument("--follow", action="store_true", help="logs: keep streaming until the job ends")

    validate = commands.add_parser(
        "validate", help="check a workload without running it", parents=[shared.overrides]
    )
    validate.add_argument("file")

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
        help="tokenize and pack a workload's raw text into the data cache a run reads",
        parents=[shared.overrides],
    )
    pack.add_argument("file", help="workload YAML whose data section names raw text")
    cli_inspect.add_parsers(commands, shared)
    cli_runs.add_parser(commands, shared)
    return parser


def _say(message: str) -> None:
    console.print(escape(message), soft_wrap=True)


def _user_error(message: str) -> int:
    errors.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    return EXIT_USAGE


def cmd_validate(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.spec import load

    loaded = load(args.file, args.overrides)
    w = loaded.workload
    low, high = w.scaling.worker_range()
    workers = str(low) if low == high else f"{low}-{high}"
    console.print(
        f"[green]ok[/] {args.file}: '{w.name}', {w.model.family or w.model.target}, "
        f"{workers} worker(s), {w.parallel.strategy}, {w.train.precision}"
    )
    if sweep := w.sweep:
        console.print(
            f"   sweep: {', '.join(sweep.space)}; {sweep.samples} samples, {sweep.scheduler}, "
            f"{sweep.searcher} search, {sweep.mode} {sweep.metric}"
        )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    return cmd_data_pack(args) if args.data_command == "pack" else cmd_data_prepare(args)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
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


def cmd_data_pack(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from shoal.data import PackProgress, plan_text
    from shoal.spec import load

    loaded = load(args.file, args.overrides)
    w, plan = loaded.workload, loaded.data
    if plan is None or plan.text is None:
        where = "data.builtin" if w.data.builtin else "data.train.path"
        return _user_error(f"{args.file}: {where} names token data, not raw text; there is nothing to pack")
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
    _print_packed(text)
    return 0


def _print_packed(text: Any) -> None:
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


def cmd_run(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.launch import RunOptions
    from shoal.launch.jobs import leave_job_working_dir
    from shoal.spec import load

    leave_job_working_dir()
    loaded = load(args.file, args.overrides, prepare_data=True, on_progress=_say)
    options = RunOptions(
        address=args.address, run_name=args.run_name, verbose=args.verbose, mlflow_run_id=args.mlflow_run_id
    )
    return _train(loaded, options)


def cmd_resume(args: argparse.Namespace) -> int:
    """Re-run what an MLflow run recorded (its resolved workload, its checkpoint location)."""
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
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
        loaded = load(spec_file, overrides, prepare_data=True, on_progress=_say)
    console.print(f"resuming {job.run_name} (MLflow run {job.run_id}) from {job.run_dir}")
    return _train(loaded, RunOptions(address=args.address, run_name=job.run_name, verbose=args.verbose))


def cmd_sweep(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.launch.sweep import SweepOptions, sweep
    from shoal.launch.sweep_view import SweepTable, summary
    from shoal.spec import load

    loaded = load(args.file, args.overrides, prepare_data=True, on_progress=_say)
    spec = loaded.workload.sweep
    if spec is None:
        return _user_error(f"{args.file}: no 'sweep' section (see README, 'Sweeps')")
    options = SweepOptions(address=args.address, name=args.name, resume=args.resume, verbose=args.verbose)
    with SweepTable(console, list(spec.space), spec.metric, spec.mode):
        result = sweep(loaded, options)
    console.print(summary(result))
    if result.best_yaml:
        console.print(f"best configuration ({result.best_file}):", soft_wrap=True)
        console.print(result.best_yaml, markup=False, soft_wrap=True)
        console.print(f"train it: shoal run {result.best_file}", soft_wrap=True)
    return 0 if result.ok else EXIT_FAILED


def cmd_submit(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.launch import jobs

    done = jobs.submit(args.file, args.address, args.working_dir, args.overrides, args.run_name, args.python)
    if done.warning:
        errors.print(f"[yellow]warning:[/] {escape(done.warning)}", soft_wrap=True)
    console.print(f"submitted Ray job [bold]{done.job_id}[/] (run {done.run_name})")
    if done.mlflow_run_id:
        console.print(f"MLflow run id: {done.mlflow_run_id} ({done.tracking_uri})", soft_wrap=True)
    if args.detach:
        console.print(
            f"follow it: shoal jobs logs {done.job_id} --follow; stop it: shoal jobs stop {done.job_id}"
        )
        return 0
    client = jobs.client(args.address)
    try:
        status = jobs.follow(client, done.job_id)
    except KeyboardInterrupt:
        errors.print(f"stopped following; the job goes on (shoal jobs stop {done.job_id} ends it)")
        return EXIT_INTERRUPTED
    console.print(f"job {done.job_id}: {status}")
    return 0 if status == "SUCCEEDED" else EXIT_FAILED


JOB_COLUMNS = (
    Col("job", fold=Fold.NEVER),
    Col("status", fold=Fold.NEVER),
    Col("run", min_width=12),
    Col("MLflow run", priority=2, min_width=12),
    Col("entrypoint", priority=1, fold=Fold.FREELY, min_width=16),
)


def jobs_table(rows: list[dict[str, Any]], address: str) -> FittedTable:
    cells = [
        [
            escape(row["job_id"] or "-"),
            row["status"],
            escape(row["run_name"] or "-"),
            row["mlflow_run_id"] or "-",
            escape(row["entrypoint"][:80]),
        ]
        for row in rows
    ]
    return FittedTable(JOB_COLUMNS, cells, f"Ray jobs at {address}", left_out_hint="--format json has all")


def jobs_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    times = ("start_time", "end_time")
    return [{k: iso_time(v) if k in times else v for k, v in row.items()} for row in rows]


def _print_jobs(client: Any, output_format: str) -> None:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.launch.jobs import job_rows

    rows = job_rows(client)
    if output_format == "json":
        print_json(console, jobs_json(rows))
    else:
        console.print(jobs_table(rows, client.get_address()))


def _print_job_status(client: Any, job_id: str, output_format: str) -> None:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.launch.jobs import job_status

    status = job_status(client, job_id)
    if output_format == "json":
        print_json(console, status)
        return
    message = f" ({status['message']})" if status["message"] else ""
    console.print(f"{job_id}: {status['status']}{message}")
    for key, value in sorted(status["metadata"].items()):
        console.print(f"  {key}: {value}", soft_wrap=True)


def cmd_jobs(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.launch import jobs

    if args.action != "list" and not args.job_id:
        return _user_error(f"shoal jobs {args.action} needs a JOB id (see shoal jobs list)")
    if args.format == "json" and args.action not in ("list", "status"):
        return _user_error(f"--format json: shoal jobs {args.action} prints logs or a status, not data")
    client = jobs.client(args.address)
    if args.action == "list":
        _print_jobs(client, args.format)
    elif args.action == "status":
        _print_job_status(client, args.job_id, args.format)
    elif args.action == "logs":
        jobs.info(client, args.job_id)
        if args.follow:
            jobs.follow(client, args.job_id)
        else:
            console.out(client.get_job_logs(args.job_id), end="")
    else:
        console.print(f"{args.job_id}: {jobs.stop(client, args.job_id)}")
    return 0


def _train(loaded: LoadedWorkload, options: RunOptions) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
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
    handlers = {
        "run": cmd_run,
        "resume": cmd_resume,
        "sweep": cmd_sweep,
        "submit": cmd_submit,
        "jobs": cmd_jobs,
        "validate": cmd_validate,
        "data": cmd_data,
        "runs": lambda a: cli_runs.cmd_runs(console, a),
        "plan": lambda a: cli_inspect.cmd_plan(console, a),
        "doctor": lambda a: cli_inspect.cmd_doctor(console, a),
    }
    try:
        return handlers[args.command](args)
    except ShoalError as exc:
        for line in exc.lines():
            errors.print(f"[red]error:[/] {escape(line)}", soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        errors.print("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
