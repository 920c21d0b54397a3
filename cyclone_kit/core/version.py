"""The package version (one place; ``cyclone_kit.__version__`` re-exports it)."""

__version__ = "0.1.0"
