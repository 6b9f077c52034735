"""Datasets: built-in corpora, parquet sources, raw text packed into token windows, Ray datasets."""

from shoal.data.builtin import BUILTINS, cache_dir, prepare
from shoal.data.errors import DataError
from shoal.data.sources import (
    DataPlan,
    plan_data,
    row_group_warning,
    training_manifest,
    validation_manifest,
)
from shoal.data.text import PackProgress, TextPlan, keep_run_tokenizer, plan_text
from shoal.data.tokenizers import TextTokenizer, load_saved

__all__ = [
    "BUILTINS",
    "DataError",
    "DataPlan",
    "PackProgress",
    "TextPlan",
    "TextTokenizer",
    "cache_dir",
    "keep_run_tokenizer",
    "load_saved",
    "plan_data",
    "plan_text",
    "prepare",
    "row_group_warning",
    "training_manifest",
    "validation_manifest",
]
