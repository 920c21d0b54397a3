"""Preflight of bench/gpu_check.sh: name every package its stages need that this Python lacks, and
bring the pure-Python ones from a wheelhouse (stdlib only: it must run where nothing is installed).

``python bench/gpu_preflight.py [--wheelhouse DIR] [--target DIR]``

1. Checks each import of :data:`NEEDS` (``importlib.util.find_spec``: nothing is imported).
2. With ``--wheelhouse`` (made beforehand by ``bench/wheelhouse.py``) and ``--target``, installs
   the wheels of the missing pure-Python distributions, and only those, with
   ``pip install --no-index --no-deps --target TARGET`` (or, where this Python has no pip, by
   unpacking them: a pure wheel is a zip of site-packages files), then checks again with TARGET
   first on the path. The caller puts TARGET on ``PYTHONPATH``.
3. Prints one ``preflight:`` line per package (``ok``, ``installed from the wheelhouse``,
   ``MISSING``) and exits 0 when nothing is missing; else prints one ``error:`` line naming every
   missing package and the fix (HINT) and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Need:
    """A package the stages import: its import name, its distribution, and whether a wheelhouse can bring it."""

    module: str
    dist: str
    pure: bool
    why: str


#: What the stages import, read off their processes (launcher, rank, bare loop) with only torch's
#: image on the path: the CLI's ``run`` imports no third-party package, the rank imports torch,
#: torchvision (models), numpy and python-hostlist (its bootstrap), the ImageFolder check Pillow.
#: jinja2, submitit, pandas and matplotlib are not needed by any stage.
NEEDS: tuple[Need, ...] = (
    Need("torch", "torch", False, "every stage"),
    Need("torchvision", "torchvision", False, "the models (ResNet-50)"),
    Need("numpy", "numpy", False, "torch, the ImageFolder check"),
    Need("PIL", "pillow", False, "the ImageFolder check"),
    Need("hostlist", "python-hostlist", True, "the rank bootstrap's Slurm hostlists"),
)


def normalize(name: str) -> str:
    """A distribution name as wheel file names spell it (runs of -_. become _, lower case; pure)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def missing(needs: Iterable[Need], found: Callable[[str], bool]) -> list[Need]:
    """The needs whose module ``found`` does not find (pure given ``found``)."""
    return [n for n in needs if not found(n.module)]


def wheels_for(needs: Iterable[Need], wheelhouse: Path) -> dict[str, Path]:
    """distribution -> its wheel in ``wheelhouse``, for each pure need that has one."""
    out: dict[str, Path] = {}
    for need in needs:
        if not need.pure:
            continue
        hits = sorted(wheelhouse.glob(f"{normalize(need.dist)}-*.whl"))
        if hits:
            out[need.dist] = hits[-1]
    return out


def install(wheels: Sequence[Path], target: Path) -> str:
    """Install ``wheels`` into ``target``: pip without an index, else unpacking; returns how."""
    target.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("pip") is not None:
        argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", str(target),
                *map(str, wheels)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            return "pip install --no-index --target"
        sys.stderr.write(proc.stdout + proc.stderr)
    for wheel in wheels:  # a pure wheel's root is site-packages (no .data scripts needed here)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
    return "unpacked"


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def error_line(gone: Sequence[Need], wheelhouse: Path | None) -> str:
    """The one-line error naming every missing package and how to bring it (pure)."""
    names = ", ".join(f"{n.dist} (import {n.module}: {n.why})" for n in gone)
    pure = [n.dist for n in gone if n.pure]
    image = [n.dist for n in gone if not n.pure]
    fixes = []
    if pure:
        where = f"{wheelhouse} has no wheel of {', '.join(pure)}" if wheelhouse else "no --wheelhouse given"
        fixes.append(f"{where}: on a machine with the project's venv run `.venv/bin/python bench/wheelhouse.py` "
                     "and bring its .whl/ folder (gpu_check.sh installs from REPO/.whl by default)")
    if image:
        fixes.append(f"{', '.join(image)} must come with the machine's Python (not pure Python)")
    return f"error: missing: {names}. HINT: {'; '.join(fixes)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Check, install from the wheelhouse, check again; 0 when nothing is missing, else 2."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheelhouse", type=Path, help="folder of wheels made by bench/wheelhouse.py")
    p.add_argument("--target", type=Path, help="folder to install the missing wheels into")
    args = p.parse_args(argv)
    gone = missing(NEEDS, _found)
    brought: dict[str, Path] = {}
    if gone and args.wheelhouse and args.wheelhouse.is_dir() and args.target:
        brought = wheels_for(gone, args.wheelhouse)
        if brought:
            how = install(list(brought.values()), args.target)
            print(f"preflight: {len(brought)} wheel(s) from {args.wheelhouse} into {args.target} ({how})")
            sys.path.insert(0, str(args.target))
            importlib.invalidate_caches()
            gone = missing(NEEDS, _found)
    for need in NEEDS:
        state = "MISSING" if need in gone else ("installed from the wheelhouse" if need.dist in brought else "ok")
        print(f"preflight: {need.dist:<18} {state}")
    if gone:
        print(error_line(gone, args.wheelhouse))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
