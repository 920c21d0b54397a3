"""Make a wheelhouse of cyclone_kit's pure-Python dependencies, for a machine that has torch and nothing else.

A GPU machine with a preinstalled torch image (a cloud GPU box, a container, the device machine
of this workplace) usually has torch, torchvision, numpy and Pillow but not the project's small
pure-Python dependencies (python-hostlist, submitit, cloudpickle), and it may reach no package
registry. Made here beforehand, the wheelhouse travels with the repository;
``bench/gpu_check.sh`` installs from it what its preflight finds missing, with
``pip install --no-index --no-deps --target`` into a folder of its own (nothing else is touched).

The wheels are rebuilt from the distributions installed in *this* environment (offline, and the
very versions the tests ran with): the files listed in each distribution's RECORD, its
``.dist-info`` with a fresh RECORD, no scripts and no bytecode. Only pure-Python distributions
(``Root-Is-Purelib: true``, no compiled extension) can travel this way; any other is refused by
name, since it must come with the machine's image.

Usage: ``python bench/wheelhouse.py [--out .whl] [DIST ...]``. Without names: every pure-Python
distribution that the project's dependencies (``pyproject.toml``) require, directly or not, minus
what a torch image brings (torch, torchvision and their own requirements); the compiled ones
left out are named (pandas, matplotlib: the report's, not gpu_check's). Prints one line per
wheel and exits 0; exits 2 with a one-line error (HINT) for a named distribution that is not
installed here or is not pure Python.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import re
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path, PurePosixPath

#: What a torch image brings: these distributions and everything they require.
IMAGE_ROOTS = ("torch", "torchvision")
#: Files of an installed distribution that are the installer's, not the package's.
INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}
_COMPILED = (".so", ".pyd", ".dylib", ".dll")


class WheelhouseError(Exception):
    """A distribution cannot be made into a pure wheel (one line, with a HINT)."""


def normalize(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427/503: runs of -_. become _; pure)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_files(dist: md.Distribution) -> list[PurePosixPath]:
    """The files of ``dist`` a wheel carries: its RECORD minus bytecode, scripts outside
    site-packages and the installer's own files (pure given the RECORD)."""
    out = []
    for f in dist.files or []:
        path = PurePosixPath(str(f))
        if path.parts[0] == ".." or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        if path.parts[0].endswith(".dist-info") and path.name in INSTALLER_FILES:
            continue
        out.append(path)
    return out


def check_pure(dist: md.Distribution, files: Sequence[PurePosixPath]) -> None:
    """Refuse a distribution that is not pure Python.

    Raises:
        WheelhouseError: compiled files, or a WHEEL file that says ``Root-Is-Purelib: false``.
    """
    name = dist.metadata["Name"]
    compiled = [str(f) for f in files if f.suffix in _COMPILED or ".so." in f.name]
    wheel_meta = dist.read_text("WHEEL") or ""
    if compiled or "Root-Is-Purelib: false" in wheel_meta:
        what = compiled[0] if compiled else "Root-Is-Purelib: false"
        raise WheelhouseError(f"{name} {dist.version} is not pure Python ({what}): it cannot travel as a wheelhouse "
                              f"wheel. HINT: use a machine image that has {name}, or leave it out")


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def build_wheel(dist: md.Distribution, out: Path) -> Path:
    """Write ``dist`` as ``NAME-VERSION-py3-none-any.whl`` into ``out`` (a fresh RECORD); returns its path.

    Raises:
        WheelhouseError: the distribution is not pure Python, or lists no files.
    """
    files = wheel_files(dist)
    if not files:
        raise WheelhouseError(f"{dist.metadata['Name']} lists no files (no RECORD). HINT: reinstall it with pip")
    check_pure(dist, files)
    name, version = normalize(dist.metadata["Name"]), dist.version
    info = f"{name}-{version}.dist-info"
    path = out / f"{name}-{version}-py3-none-any.whl"
    records: list[str] = []
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel in sorted(files, key=str):
            data = Path(dist.locate_file(rel)).read_bytes()  # type: ignore[arg-type]
            arcname = str(rel)
            if rel.parts[0].endswith(".dist-info"):
                arcname = str(PurePosixPath(info, *rel.parts[1:]))
                if rel.name == "WHEEL":
                    data = _pure_wheel_meta(data.decode())
            zf.writestr(arcname, data)
            records.append(_record_line(arcname, data))
        records.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return path


def _pure_wheel_meta(text: str) -> bytes:
    """The WHEEL file with the one tag this wheel has (py3-none-any)."""
    lines = [line for line in text.splitlines() if not line.startswith("Tag:")]
    return ("\n".join(lines).rstrip("\n") + "\nTag: py3-none-any\n").encode()


def make(names: Iterable[str], out: Path) -> list[Path]:
    """Build a wheel of each installed distribution in ``names`` into ``out`` (created; old wheels of
    the same names replaced).

    Raises:
        WheelhouseError: a name is not installed here, or is not pure Python.
    """
    out.mkdir(parents=True, exist_ok=True)
    built = []
    for name in names:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise WheelhouseError(f"{name} is not installed in {sys.prefix}. HINT: run this with the project's "
                                  f"environment (.venv/bin/python bench/wheelhouse.py), where make setup put it") from None
        for old in out.glob(f"{normalize(name)}-*.whl"):
            old.unlink()
        built.append(build_wheel(dist, out))
    return built


def requirement_names(dist: md.Distribution) -> list[str]:
    """The distributions ``dist`` requires in this environment (markers evaluated, extras left out)."""
    from packaging.requirements import Requirement

    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def is_pure(dist: md.Distribution) -> bool:
    """Whether ``dist`` can travel as a pure wheel (:func:`check_pure` passes)."""
    try:
        check_pure(dist, wheel_files(dist))
    except WheelhouseError:
        return False
    return True


def closure(roots: Iterable[str], descend: Callable[[md.Distribution], bool] = lambda d: True,
            ) -> dict[str, md.Distribution]:
    """Normalized name -> installed distribution, for ``roots`` and what they require, through the
    distributions ``descend`` accepts (uninstalled ones skipped)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if normalize(name) in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[normalize(name)] = dist
        if descend(dist):
            todo.extend(requirement_names(dist))
    return seen


def project_dependencies(pyproject: Path) -> list[str]:
    """The names in ``[project].dependencies`` of ``pyproject``."""
    import tomllib
    from packaging.requirements import Requirement

    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    return [Requirement(text).name for text in data["project"]["dependencies"]]


def default_dists(pyproject: Path) -> tuple[list[str], list[str]]:
    """(pure distributions to bring, compiled ones left out) for the project's dependencies beyond
    a torch image; a compiled one's own requirements are left out with it."""
    image = closure(IMAGE_ROOTS)
    wanted = {k: d for k, d in closure(project_dependencies(pyproject), is_pure).items() if k not in image}
    pure = sorted(k for k, d in wanted.items() if is_pure(d))
    return pure, sorted(set(wanted) - set(pure))


def main(argv: Sequence[str] | None = None) -> int:
    """Build the wheelhouse; one line per wheel."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / ".whl")
    p.add_argument("dists", nargs="*", help="distributions (default: the project's pure-Python dependencies)")
    args = p.parse_args(argv)
    names = args.dists
    if not names:
        names, compiled = default_dists(Path(__file__).resolve().parents[1] / "pyproject.toml")
        if compiled:
            print(f"left out (not pure Python; the machine's image must have them if needed): {', '.join(compiled)}")
    try:
        for path in make(names, args.out):
            print(f"wheel: {path} ({path.stat().st_size} bytes)")
    except WheelhouseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
