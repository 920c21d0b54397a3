"""Checkpoints: written atomically, the last K kept, the newest loadable one resumed.

A checkpoint is one ``torch.save`` file ``RUN_DIR/checkpoints/ckpt-<step:09d>.pt`` holding
model, optimizer, grad scaler and LR scheduler state (the built-in engine; a user script's dict from
``ck.save_checkpoint`` is kept whole under ``user_state``), the epoch/step/sampler position and the
RNG states of every rank (torch, CUDA, numpy, python). It is written to a temporary file in the
same directory, fsync'ed and renamed into place (then the directory is fsync'ed), so a kill
at any moment leaves either the old set or the new set of complete files. Loading uses
``weights_only=True``: a checkpoint can hold tensors and plain containers only, never code.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from typing import Any

import torch

from cyclone_kit.rundir.fileio import atomic_file

FORMAT = 1
#: The key under which a checkpoint written through the public API (``ck.save_checkpoint``) holds the script's dict.
USER_STATE = "user_state"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_path(folder: Path, step: int) -> Path:
    """The file name of the checkpoint after ``step`` optimizer steps."""
    return Path(folder) / f"ckpt-{step:09d}.pt"


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in ``folder``, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def save_checkpoint(folder: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically and keep only the newest ``keep``.

    Args:
        folder: the checkpoint directory (created if needed).
        state: what :func:`load_latest` returns later (tensors and plain containers only).
        step: optimizer steps done; names the file.
        keep: how many checkpoints to keep (older ones are deleted after the new one is in place).

    Returns:
        The path of the new checkpoint.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(folder, step)
    with atomic_file(final, fsync_dir=True) as f:
        torch.save({"format": FORMAT, **state}, f)
    for _, old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
    for stale in folder.glob(".ckpt-*.tmp"):  # left by a process killed while writing
        stale.unlink(missing_ok=True)
    return final


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load one checkpoint (weights_only); raises on a corrupt or foreign file."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    if (not isinstance(state, dict) or state.get("format") != FORMAT or "step" not in state
            or ("model" not in state and USER_STATE not in state)):
        raise ValueError(f"{path} is not a cyclone_kit checkpoint")
    return state


def load_latest(folder: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads, skipping (with a warning) corrupt ones; None if none."""
    for _, path in list_checkpoints(folder):
        try:
            return load_checkpoint(path, map_location), path
        except Exception as e:
            sys.stderr.write(f"cyclone_kit: warning: skipping unreadable checkpoint {path}: {type(e).__name__}: {e}\n")
    return None


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, numpy, python) as checkpoint-safe values."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _py_state(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (missing parts are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([t.cpu() for t in cuda])
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        except ImportError:
            pass


def _py_state(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]
