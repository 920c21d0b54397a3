"""A Python that has torch and nothing else, like a preinstalled GPU image: a fresh venv that sees, through
one .pth file, only torch, torchvision, pip and what they require, linked from this environment. (pip is
linked like torch, not installed into the venv by ensurepip: ~5.5 CPU-s a venv, issue 27.)"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

#: What a torch image is taken to hold: these and everything they require (the images hold pip).
IMAGE = ("torch", "torchvision", "pip")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_closure(roots: tuple[str, ...] = IMAGE) -> dict[str, md.Distribution]:
    """Normalized name -> installed distribution of ``roots`` and their requirements (markers evaluated)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _key(name) in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[_key(name)] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def torch_only_python(root: Path) -> Path:
    """Make ``root/venv`` (a venv of the base interpreter) that imports torch and pip from ``root/image``
    (symlinks to this environment's copies) and nothing of the project; its python."""
    image = root / "image"
    image.mkdir(parents=True)
    for dist in image_closure().values():
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            if top in ("..", "__pycache__") or top.endswith(".pth") or (image / top).exists():
                continue
            (image / top).symlink_to(base / top)
    venv = root / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True, timeout=300)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "torch_image.pth").write_text(f"{image}\n", encoding="utf-8")
    return venv / "bin" / "python"
