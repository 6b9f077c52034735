"""shoal: elastic multi-GPU training on Ray."""

__version__ = "0.1.0"
