"""The house's import rules, read from the code (ast; function-level imports included).

The map (docs/ARCHITECTURE.md): the login side runs cli -> config -> submit -> backends; a job's
ranks run runtime/; rundir/ is the only contract between the halves; analysis/ reads run
directories. core/ is the stdlib-only ground floor both halves stand on.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cyclone_kit"

#: package -> the packages it may import (besides itself). Absent: no rule beyond the others.
MAY_IMPORT = {
    "core": set(),
    "launchers": {"core"},
    "rundir": {"core", "launchers"},
    "slurm": {"core"},
    "config": {"core", "slurm", "rundir", "launchers"},
    "submit": {"core", "slurm", "config", "rundir", "backends", "launchers"},
    "backends": {"core", "slurm", "config", "rundir", "launchers"},
}
#: (importer, imported) allowed across the rules above, each with its reason.
EXCEPTIONS = {
    # submitit pickles a callable that runs the built-in trainer on the ranks: it must name it.
    ("cyclone_kit.backends.submitit_", "cyclone_kit.runtime.__main__"),
}
#: Modules of config/ the rank side must not use (validation against a profile, argument handling).
CONFIG_LOGIN_ONLY = {"cyclone_kit.config.validate", "cyclone_kit.config.jobspec", "cyclone_kit.config.sweep"}
#: Run-directory file names: spelled (as a string in code) only in their owner.
FILE_NAMES = {"spec.json", "metrics.jsonl", "failure.json", "shim.jsonl", "job.sbatch", "launch.json", "checkpoints",
              "submitted.json", "sweep.json", "network.json"}
FILE_NAME_OWNERS = {"cyclone_kit.rundir.layout", "cyclone_kit.rundir.contract"}
#: The loose modules allowed at the package root: the public face and thin compatibility aliases.
ROOT_MODULES = {"__init__", "__main__", "api", "launch", "ports", "doctor_probe"}
ALIASES = {"launch", "ports", "doctor_probe"}
#: The launcher registry: the only package that compares a launcher's name (the others ask it).
LAUNCHER_REGISTRY = "launchers"
#: Modules the launcher-name rule does not cover yet (none: runtime/watchdog.py asks LOCAL.started(environ)).
LAUNCHER_RULE_PENDING: set[str] = set()


@dataclass(frozen=True)
class Edge:
    """One import: ``importer`` imports ``imported`` at ``line`` (``names``: what it takes)."""

    importer: str
    imported: str
    line: int
    names: tuple[str, ...]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in root.rglob("*.py")}


def edges(root: Path) -> Iterator[Edge]:
    """Every import of a package module by a package module (nested in functions too)."""
    mods = modules(root)
    top = root.name
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == top:
                        yield Edge(name, a.name, node.lineno, ())
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                if target.split(".")[0] != top:
                    continue
                taken = tuple(a.name for a in node.names)
                subs = [f"{target}.{n}" for n in taken if f"{target}.{n}" in mods]
                for sub in subs:
                    yield Edge(name, sub, node.lineno, ())
                rest = tuple(n for n in taken if f"{target}.{n}" not in mods)
                if rest or not subs:
                    yield Edge(name, target, node.lineno, rest)


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for e in edges(root):
        if e.imported in graph and e.imported != e.importer:
            graph[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] not in ROOT_MODULES) else ""


def layer_violations(root: Path) -> list[str]:
    """Imports that break the one-way flow (see the module doc)."""
    bad = []
    for e in edges(root):
        if (e.importer, e.imported) in EXCEPTIONS:
            continue
        src, dst = package_of(e.importer), package_of(e.imported)
        where = f"{e.importer}:{e.line} imports {e.imported}"
        if src in MAY_IMPORT and dst and dst != src and dst not in MAY_IMPORT[src]:
            bad.append(f"{where} ({src}/ may import only {sorted(MAY_IMPORT[src]) or 'the standard library'})")
        if dst == "cli" and src != "cli" and e.importer != "cyclone_kit.__main__":
            bad.append(f"{where} (nothing below cli/ imports cli/)")
        if src == "runtime" and (dst == "submit" or e.imported in CONFIG_LOGIN_ONLY):
            bad.append(f"{where} (the rank side never imports the login side)")
        if src == "analysis" and dst in {"runtime", "submit", "cli", "backends"}:
            bad.append(f"{where} (analysis reads run directories, not the engine or the submit path)")
    return bad


def private_crossings(root: Path) -> list[str]:
    """``from cyclone_kit.x import _name`` or ``module._name`` on a cyclone_kit module."""
    bad = []
    mods = modules(root)
    for e in edges(root):
        bad += [f"{e.importer}:{e.line} takes {e.imported}.{n}" for n in e.names
                if n.startswith("_") and not n.startswith("__")]
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(root.name):
                for a in node.names:
                    if f"{node.module}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return bad


def file_name_spellings(root: Path) -> list[str]:
    """Run-directory file names written as strings outside their owner (docstrings excluded)."""
    bad = []
    for name, path in modules(root).items():
        if name in FILE_NAME_OWNERS:
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                value = node.value.strip("/")
                if value in FILE_NAMES:
                    bad.append(f"{name}:{node.lineno} spells {node.value!r}")
    return bad


def launcher_name_comparisons(root: Path) -> list[str]:
    """Comparisons of a launcher (an operand whose code says ``launcher``) with a registered launcher's
    name spelled as a string (``==``, ``!=``, ``in`` a literal tuple/list/set), outside the registry."""
    from cyclone_kit.launchers import LAUNCHERS

    def names(node: ast.expr) -> set[str]:
        items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return {n.value for n in items if isinstance(n, ast.Constant) and n.value in LAUNCHERS}

    bad = []
    for name, path in modules(root).items():
        if package_of(name) == LAUNCHER_REGISTRY or name in LAUNCHER_RULE_PENDING:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                spelled = names(operand)
                if spelled and any("launcher" in ast.unparse(o).lower() for j, o in enumerate(operands) if j != i):
                    bad.append(f"{name}:{node.lineno} compares a launcher with {sorted(spelled)}: "
                               "ask cyclone_kit.launchers (get_launcher(...) and its rules)")
    return bad


def run_directory_writers(root: Path) -> set[str]:
    """Modules that create a run directory (``RunDir.create``) or write its ``spec.json`` (``write_spec``)."""
    found = set()
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and (node.func.attr == "write_spec" or (node.func.attr == "create" and isinstance(node.func.value, ast.Name)
                                                            and node.func.value.id == "RunDir"))):
                found.add(name)
    return found


def test_no_import_cycles() -> None:
    assert cycles(PACKAGE) == []


def test_imports_run_one_way() -> None:
    assert layer_violations(PACKAGE) == []


def test_no_private_name_crosses_modules() -> None:
    assert private_crossings(PACKAGE) == []


def test_each_run_directory_file_name_has_one_owner() -> None:
    assert file_name_spellings(PACKAGE) == []


def test_only_the_launcher_registry_compares_launcher_names() -> None:
    assert launcher_name_comparisons(PACKAGE) == []


def test_run_directories_and_their_spec_are_written_by_the_submit_side_alone() -> None:
    # submit, run and a study's points: submit.submission writes every plan's files (issue 30)
    assert run_directory_writers(PACKAGE) == {"cyclone_kit.submit.submission"}


def test_only_the_public_face_sits_at_the_root() -> None:
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose <= ROOT_MODULES, sorted(loose - ROOT_MODULES)
    for alias in ALIASES & loose:
        assert len((PACKAGE / f"{alias}.py").read_text().splitlines()) < 12, f"{alias}.py must stay a thin alias"


@pytest.fixture()
def planted(tmp_path: Path) -> Path:
    """A copy of the package to plant faults in."""
    copy = tmp_path / "cyclone_kit"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_a_planted_cycle_is_found(planted: Path) -> None:
    errors = planted / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _late():\n    from cyclone_kit.core import proc\n    return proc\n")
    assert ["cyclone_kit.core.errors", "cyclone_kit.core.proc"] in cycles(planted)


def test_a_planted_runtime_to_submit_import_is_found(planted: Path) -> None:
    env = planted / "runtime" / "env.py"
    env.write_text(env.read_text() + "\n\ndef _late():\n    from cyclone_kit.submit.render import render_job\n")
    assert any("runtime.env" in v and "rank side" in v for v in layer_violations(planted))


def test_a_planted_private_crossing_and_file_name_are_found(planted: Path) -> None:
    api = planted / "api.py"
    api.write_text(api.read_text() + "\n\ndef _late():\n    from cyclone_kit.runtime.env import _x\n    return 'metrics.jsonl'\n")
    assert any("_x" in v for v in private_crossings(planted))
    assert any("metrics.jsonl" in v for v in file_name_spellings(planted))


def test_the_unit_tier_refuses_to_start_a_process() -> None:
    import subprocess

    with pytest.raises(AssertionError, match="tests/unit starts no process"):
        subprocess.run(["true"], check=False)


def test_a_planted_launcher_name_comparison_is_found(planted: Path) -> None:
    sweep = planted / "config" / "sweep.py"
    sweep.write_text(sweep.read_text() + "\n\ndef _late(res):\n    return res.launcher in ('srun', 'horovod')\n")
    render = planted / "submit" / "render.py"
    render.write_text(render.read_text() + "\n\ndef _late(job):\n    return 'torchrun' == job.spec.resources.launcher\n")
    found = launcher_name_comparisons(planted)
    assert any("config.sweep" in v and "horovod" in v for v in found)
    assert any("submit.render" in v and "torchrun" in v for v in found)
