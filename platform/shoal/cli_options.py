"""The options that several `shoal` subcommands share, each defined once: argparse
parent parsers, passed as `parents=[...]` to the subcommands that take them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DASHBOARD = "http://127.0.0.1:8265"
TRACKING_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./mlflow.db)"


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


@dataclass(frozen=True)
class SharedOptions:
    overrides: argparse.ArgumentParser  # --set KEY=VALUE (repeatable) -> args.overrides
    ray_address: argparse.ArgumentParser  # --address of the Ray cluster to train on
    dashboard_address: argparse.ArgumentParser  # --address of the Ray dashboard (Jobs API)
    verbose: argparse.ArgumentParser
    run_name: argparse.ArgumentParser
    tracking_uri: argparse.ArgumentParser
    output_format: argparse.ArgumentParser  # --format table|json


def shared_options() -> SharedOptions:
    overrides = _parent()
    overrides.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec value, e.g. --set train.optimizer.lr=1e-3 (repeatable)",
    )
    ray_address = _parent()
    ray_address.add_argument(
        "--address", help="Ray cluster to attach to (HOST:PORT); default: start a local Ray"
    )
    dashboard_address = _parent()
    dashboard_address.add_argument(
        "--address", help=f"Ray dashboard URL (default: $RAY_API_SERVER_ADDRESS or {DASHBOARD})"
    )
    verbose = _parent()
    verbose.add_argument("--verbose", action="store_true", help="show Ray's own logs in the terminal")
    run_name = _parent()
    run_name.add_argument(
        "--run-name",
        help="name of the run (default: WORKLOAD-TIMESTAMP); a name with checkpoints resumes from them",
    )
    tracking_uri = _parent()
    tracking_uri.add_argument("--tracking-uri", help=TRACKING_HELP)
    output_format = _parent()
    output_format.add_argument(
        "--format",
        choices=["table", "json"],
        default="table",
        help="table (default) or json: the same data for scripts, on stdout alone",
    )
    return SharedOptions(
        overrides, ray_address, dashboard_address, verbose, run_name, tracking_uri, output_format
    )
