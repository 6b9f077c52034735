"""The error of the data layer: a source, a tokenizer or a text that cannot be used."""

from __future__ import annotations

from shoal.errors import ShoalError


class DataError(ShoalError, ValueError):
    """Data that cannot be found or does not fit the model's task; `path` is the setting at fault."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(message, where=path)
