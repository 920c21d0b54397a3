"""cyclone_kit: take a PyTorch vision training script from one GPU to many Slurm nodes.

The public API for user scripts (:mod:`cyclone_kit.api`) is re-exported here::

    import cyclone_kit as ck
    ctx = ck.init()
    loader = ck.instrument(model=ddp_model, loader=loader)   # optional: the phases of every step
    state = ck.load_checkpoint()
    ck.log_step(step, samples=global_batch, loss=loss)
    if ck.stop_requested():
        ck.save_checkpoint(state_dict)
    ck.finish()

Submodules, that API included, are imported lazily: ``import cyclone_kit`` imports nothing
else, and the CLI must answer ``--help`` and ``submit --dry-run`` without importing torch,
pandas or matplotlib.
"""

from __future__ import annotations

from cyclone_kit.core.version import __version__

#: The names ``cyclone_kit`` re-exports from :mod:`cyclone_kit.api` on first use.
API_NAMES = ("init", "instrument", "load_checkpoint", "log_step", "stop_requested", "save_checkpoint", "finish",
             "Context", "ApiUsageError")
__all__ = ["__version__", *API_NAMES]


def __getattr__(name: str) -> object:
    """``ck.init`` and friends: import :mod:`cyclone_kit.api` on first use (PEP 562)."""
    if name in API_NAMES:
        from cyclone_kit import api

        return getattr(api, name)
    raise AttributeError(f"module 'cyclone_kit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *API_NAMES})
