"""The `shoal` command: parse, call the Python API, print. Exit codes (shoal.errors):
0 done, 1 training failed, 2 bad input (any ShoalError), 130 interrupted.

Start-up: each command imports the layer it needs when it runs. The layers below
import torch, MLflow and Ray (`import shoal.launch`: 3-5 s on 2 cores); `shoal --help`
imports none of them and answers in ~0.15 s.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from shoal import cli_data, cli_inspect, cli_runs
from shoal.cli_options import shared_options
from shoal.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, ShoalError
from shoal.hardware import for_workers
from shoal.output import Col, FittedTable, Fold, RedactingConsole, iso_time, print_json
from shoal.redact import redact_logs

if TYPE_CHECKING:
    from shoal.launch import RunOptions
    from shoal.spec import LoadedWorkload

console = RedactingConsole(highlight=False)
errors = RedactingConsole(stderr=True, highlight=False)


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

    cli_data.add_parser(commands, shared)
    export = commands.add_parser(
        "export",
        help="write a consolidated model from a checkpoint of a recorded run",
        parents=[shared.tracking_uri],
    )
    export.add_argument("run", help="MLflow run id or run name")
    export.add_argument("dir", help="target directory")
    export.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    export.add_argument(
        "--format",
        choices=["torch", "hf"],
        default="torch",
        help="torch: state dict + workload; hf: save_pretrained",
    )
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
    from shoal.api import load_workload

    loaded = load_workload(args.file, args.overrides)
    w = loaded.workload
    low, high = w.scaling.worker_range()
    workers = str(low) if low == high else f"{low}-{high}"
    precision, slow = for_workers(w.train.precision, w.scaling.gpus_per_worker)
    console.print(
        f"[green]ok[/] {args.file}: '{w.name}', {w.model.family or w.model.target or w.model.hf.class_}, "
        f"{workers} worker(s), {w.parallel.strategy}, {precision}"
    )
    if slow:
        console.print(f"[yellow]warning[/] {escape(slow)}", soft_wrap=True)
    if sweep := w.sweep:
        console.print(
            f"   sweep: {', '.join(sweep.space)}; {sweep.samples} samples, {sweep.scheduler}, "
            f"{sweep.searcher} search, {sweep.mode} {sweep.metric}"
        )
    if loaded.data is not None and (coarse := _row_group_warning(loaded)):
        console.print(f"[yellow]warning[/] {escape(coarse)}", soft_wrap=True)
    return 0


def _row_group_warning(loaded: Any) -> str | None:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.data import row_group_warning
    from shoal.worker.batching import global_batch_size

    w = loaded.workload
    return row_group_warning(loaded.data, w.data.batch_size, global_batch_size(w), w.data.shuffle_buffer)


def cmd_run(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.api import load_workload
    from shoal.launch import RunOptions
    from shoal.launch.jobs import leave_job_working_dir

    leave_job_working_dir()
    loaded = load_workload(args.file, args.overrides, prepare_data=True, on_progress=_say)
    options = RunOptions(
        address=args.address, run_name=args.run_name, verbose=args.verbose, mlflow_run_id=args.mlflow_run_id
    )
    return _train(loaded, options)


def cmd_resume(args: argparse.Namespace) -> int:
    """Re-run what an MLflow run recorded (its resolved workload, its checkpoint location)."""
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.api import load_workload
    from shoal.launch import RunOptions
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
        loaded = load_workload(spec_file, overrides, prepare_data=True, on_progress=_say)
    console.print(f"resuming {job.run_name} (MLflow run {job.run_id}) from {job.run_dir}")
    return _train(loaded, RunOptions(address=args.address, run_name=job.run_name, verbose=args.verbose))


def cmd_sweep(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.api import load_workload, sweep
    from shoal.launch.sweep_view import SweepTable, summary

    loaded = load_workload(args.file, args.overrides, prepare_data=True, on_progress=_say)
    spec = loaded.workload.sweep
    if spec is None:
        return _user_error(f"{args.file}: no 'sweep' section (see README, 'Sweeps')")
    _warn_of_emulated_precision(loaded)
    with SweepTable(console, list(spec.space), spec.metric, spec.mode):
        result = sweep(loaded, address=args.address, name=args.name, resume=args.resume, verbose=args.verbose)
    console.print(summary(result))
    if result.model_uri:
        console.print(f"best trial's model: {result.model_uri}", soft_wrap=True)
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


def cmd_export(args: argparse.Namespace) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.api import export

    done = export(args.run, args.dir, args.format, args.step, args.tracking_uri)
    console.print(
        f"[green]exported[/] {escape(done.run_name)} step {done.step} ({done.format}) "
        f"to {escape(done.directory)}: {', '.join(done.files)}",
        soft_wrap=True,
    )
    return 0


def _warn_of_emulated_precision(loaded: LoadedWorkload) -> None:
    """One line when the workers' hardware, as far as this machine can tell, emulates the precision."""
    if slow := for_workers(loaded.workload.train.precision, loaded.workload.scaling.gpus_per_worker)[1]:
        console.print(f"[yellow]warning[/] {escape(slow)}", soft_wrap=True)


def _train(loaded: LoadedWorkload, options: RunOptions) -> int:
    # deferred: this layer imports torch, Ray or MLflow (seconds); see the module docstring
    from shoal.api import run
    from shoal.launch.progress import TerminalProgress, summary_table

    _warn_of_emulated_precision(loaded)
    with TerminalProgress(console) as progress:
        result = run(loaded, options=options, observer=progress)
    console.print(summary_table(result))
    console.print(f"MLflow run id: {result.run_id}")
    if result.model_uri:
        console.print(f"model: {result.model_uri}", soft_wrap=True)
    if result.status == "KILLED":
        return EXIT_INTERRUPTED
    return 0 if result.ok else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    redact_logs(logging.getLogger("shoal"))
    handlers = {
        "run": cmd_run,
        "resume": cmd_resume,
        "sweep": cmd_sweep,
        "submit": cmd_submit,
        "jobs": cmd_jobs,
        "validate": cmd_validate,
        "data": lambda a: cli_data.cmd_data(console, a),
        "export": cmd_export,
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
