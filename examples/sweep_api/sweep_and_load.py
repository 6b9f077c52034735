"""Sweep through shoal's Python API, then load the best trial's registered model from MLflow
and classify held-out digits with it: what a notebook would do.

    python sweep_and_load.py [--set train.max_steps=20 ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import torch

import shoal
from shoal.data.builtin import cache_dir

HERE = Path(__file__).parent


def held_out_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits corpus's validation split, which no trial trained on."""
    table = pq.read_table(cache_dir("digits") / "val").to_pydict()
    return torch.tensor(table["x"], dtype=torch.float32), torch.tensor(table["y"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    args = parser.parse_args()

    result = shoal.sweep(HERE / "workload.yaml", overrides=args.overrides)
    if not result.ok or result.model_uri is None:
        raise SystemExit(f"the sweep did not end with a registered model: {result.trials}")
    best = result.best
    print(f"best trial {best.trial_id}: {best.params}, {result.metric} {best.metric:.3f}")

    mlflow.set_tracking_uri(result.tracking_uri)
    model = mlflow.pytorch.load_model(result.model_uri)
    images, labels = held_out_digits()
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=-1) == labels).float().mean().item()
    print(f"{result.model_uri}: accuracy {accuracy:.3f} on {len(labels)} held-out digits")


if __name__ == "__main__":
    main()
