"""cyclone_kit: take a PyTorch vision training script from one GPU to many Slurm nodes.

Submodules are imported lazily: the CLI must answer ``--help`` and ``submit --dry-run``
without importing torch, pandas or matplotlib.
"""

__version__ = "0.1.0"
