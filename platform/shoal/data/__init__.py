"""Datasets: built-in corpora, parquet sources, Ray datasets for the trainer."""

from shoal.data.builtin import BUILTINS, cache_dir, prepare
from shoal.data.sources import DataError, DataPlan, build_datasets, plan_data

__all__ = [
    "BUILTINS",
    "DataError",
    "DataPlan",
    "build_datasets",
    "cache_dir",
    "plan_data",
    "prepare",
]
