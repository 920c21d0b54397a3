"""The package version (one place; ``cyclone_kit.__version__`` re-exports it), and the reading of torch's."""

__version__ = "0.1.0"


def torch_release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version such as ``2.6.0+cu124`` or ``2.10.0a0`` (None: not a version; pure)."""
    parts = version.split("+", 1)[0].split(".")
    digits = ["".join(ch for ch in part if ch.isdigit()) for part in parts[:2]]
    if len(digits) < 2 or not all(digits):
        return None
    return int(digits[0]), int(digits[1])
