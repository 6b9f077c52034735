"""shoal: elastic multi-GPU training on Ray.

The Python API (`shoal.run`, `shoal.sweep`, `shoal.load_workload`, `shoal.export`,
`shoal.load_export`) lives in `shoal.api` and is loaded on first use, so that
`import shoal` (and `shoal --help`) loads neither torch nor Ray nor MLflow.
"""

from __future__ import annotations

from typing import Any

from shoal.version import __version__

API = ("run", "sweep", "load_workload", "export", "load_export")
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        # deferred: the API's layers import torch, Ray and MLflow (seconds); `import shoal` stays light
        from shoal import api

        return getattr(api, name)
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
