"""The error of a model that cannot be found or built: its own module, so that every part of
models/ (the registry, Hugging Face models, outputs) can raise it without importing another."""

from __future__ import annotations

from shoal.errors import ShoalError


class ModelError(ShoalError, ValueError):
    """A model that cannot be found or built from the given arguments; `where` names the
    setting at fault (model.hf.path, ...) when the message alone does not."""
