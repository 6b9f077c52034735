"""shoal's version, in a module of its own: importing it does not import the package's API."""

__version__ = "0.1.0"
