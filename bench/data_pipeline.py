"""Ray Data alone: read parquet -> preprocess -> iterate, as one shoal worker's shard would.

`python bench/data_pipeline.py --out F` writes rows/s through iter_torch_batches
on one consumer, the ceiling that the trainer's consumption is compared against.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray

from bench.common import MICRO_BATCH, data_dir, write_result

ROWS = 20_000


def widen(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    batch["tokens"] = np.stack(batch["tokens"]).astype(np.int64)  # a typical preprocessing step
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().print_on_execution_start = False
    dataset = ray.data.read_parquet(str(data_dir() / "train")).limit(ROWS)
    dataset = dataset.map_batches(widen, batch_format="numpy")
    started, rows = time.perf_counter(), 0
    # Iterate to the end: breaking off leaves Ray Data threads that fail the shutdown.
    for batch in dataset.iter_torch_batches(batch_size=MICRO_BATCH):
        rows += len(batch["tokens"])
    write_result(args.out, rows_per_s=rows / (time.perf_counter() - started))
    ray.shutdown()


if __name__ == "__main__":
    main()
