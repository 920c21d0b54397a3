"""Find study directories for the notebook: the newest ``make demo`` study, or a path given by the user.

Study directories are ``RUNS_DIR/<name>-<YYYYmmdd-HHMMSS>[-k]/`` (see :mod:`cyclone_kit.rundir.layout`).
A notebook's kernel usually runs in ``analysis/``, while users write paths relative to the
repository (``runs/demo-strong-...``): relative paths are tried from the current directory and
then from every parent up to the repository root.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.contract import METRICS_FILE
from cyclone_kit.rundir.layout import SWEEP_FILE

#: The study name ``make demo`` uses (jobs/demo_strong.toml).
DEMO_STUDY = "demo-strong"

_STAMP = re.compile(r"-(\d{8}-\d{6})(?:-(\d+))?$")


def _bases(start: Path) -> list[Path]:
    """``start`` and its parents, then the checkout this package was imported from."""
    bases = [start, *start.parents]
    package_root = Path(__file__).resolve().parents[2]
    if package_root not in bases:
        bases.append(package_root)
    return bases


def _candidates(runs_dir: Path, name: str) -> list[Path]:
    """Study directories of ``name`` under ``runs_dir`` that hold at least one metrics file."""
    if not runs_dir.is_dir():
        return []
    out = []
    for path in runs_dir.iterdir():
        if not path.is_dir() or not path.name.startswith(f"{name}-") or not _STAMP.search(path.name):
            continue
        if (path / SWEEP_FILE).is_file() and next(path.rglob(METRICS_FILE), None) is not None:
            out.append(path)
    return out


def _newest_key(path: Path) -> tuple[str, int, float]:
    """Sort key: the stamp in the name, then its -k suffix, then the modification time."""
    match = _STAMP.search(path.name)
    assert match is not None
    return match.group(1), int(match.group(2) or 1), path.stat().st_mtime


def newest_study(name: str = DEMO_STUDY, start: str | Path | None = None) -> Path:
    """The newest study directory ``runs/<name>-<stamp>`` that has metrics.

    Looks in ``runs/`` of ``start`` (default: the current directory) and of each parent, then in
    the checkout this package came from; the first ``runs/`` holding such a study wins.

    Raises:
        ValidationError: no such study anywhere (the message lists where it looked).
    """
    start = Path(start or Path.cwd()).resolve()
    looked = []
    for base in _bases(start):
        runs_dir = base / "runs"
        looked.append(str(runs_dir))
        found = _candidates(runs_dir, name)
        if found:
            return max(found, key=_newest_key)
    raise ValidationError(
        f"no {name}-<stamp> study with metrics under {', '.join(looked[:3])}"
        + (f" (and {len(looked) - 3} more)" if len(looked) > 3 else ""),
        hint="run `make demo` first, or set STUDY to a study directory, e.g. STUDY = 'runs/<study>-<stamp>'",
    )


def resolve_study(study: str | Path | Sequence[str | Path] | None, start: str | Path | None = None) -> list[Path]:
    """The study/run directories a notebook parameter names.

    Args:
        study: None for the newest ``make demo`` study; a path, or a list of paths. Relative paths
            are tried from ``start`` (default: the current directory) and then from its parents,
            so ``runs/...`` works from ``analysis/`` too.
        start: where relative paths start.

    Raises:
        ValidationError: a path exists nowhere it was tried.
    """
    if study is None:
        return [newest_study(start=start)]
    items = [study] if isinstance(study, str | Path) else list(study)
    base = Path(start or Path.cwd()).resolve()
    out = []
    for item in items:
        path = Path(item)
        tried = [path] if path.is_absolute() else [b / path for b in _bases(base)]
        found = next((p for p in tried if p.exists()), None)
        if found is None:
            raise ValidationError(
                f"study {str(item)!r} not found (tried {tried[0]} and {len(tried) - 1} parent(s))",
                hint="give a study directory relative to the repository, e.g. 'runs/demo-strong-<stamp>', "
                "or None for the newest `make demo` study",
            )
        out.append(found)
    return out
