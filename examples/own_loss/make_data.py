"""Writes data/train.parquet and data/val.parquet: houses with 8 features and a price that
is a fixed linear function of them plus noise (so the loss has somewhere to fall to)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FEATURES = 8


def houses(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    weights = np.random.default_rng(0).normal(size=FEATURES)  # the same market in both splits
    features = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    price = (features @ weights + 0.1 * rng.normal(size=rows)).astype(np.float32)
    return pa.table(
        {
            "house_id": np.arange(rows, dtype=np.int64),
            "measurements": pa.FixedSizeListArray.from_arrays(features.reshape(-1), FEATURES),
            "sale_price": price,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--rows", type=int, default=4096)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(houses(args.rows, seed=1), out / "train.parquet")
    pq.write_table(houses(args.rows // 8, seed=2), out / "val.parquet")
    print(f"wrote {args.rows} + {args.rows // 8} houses to {out}")


if __name__ == "__main__":
    main()
