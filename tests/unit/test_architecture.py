"""The house's import rules, read from the code (ast; function-level imports included).

The map (docs/ARCHITECTURE.md): the login side runs cli -> config -> submit -> backends; a job's
ranks run runtime/; rundir/ is the only contract between the halves; analysis/ reads run
directories. core/ is the stdlib-only ground floor both halves stand on. Inside runtime/, the rank
side's rooms: engine/ (the built-in engine), checkpoint/ and watchers/ (RANK_ROOMS below).
"""

from __future__ import annotations

import ast
import importlib
import re
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
CONFIG_LOGIN_ONLY = {"cyclone_kit.config.validate", "cyclone_kit.config.jobspec", "cyclone_kit.config.sweep",
                     "cyclone_kit.config.request"}
#: Run-directory file names: spelled (as a string in code) only in their owner.
FILE_NAMES = {"spec.json", "metrics.jsonl", "failure.json", "shim.jsonl", "job.sbatch", "launch.json", "checkpoints",
              "submitted.json", "sweep.json", "network.json"}
FILE_NAME_OWNERS = {"cyclone_kit.rundir.layout", "cyclone_kit.rundir.contract"}
#: The loose modules allowed at the package root: the public face and thin compatibility aliases.
ROOT_MODULES = {"__init__", "__main__", "api", "launch", "ports", "doctor_probe"}
ALIASES = {"launch", "ports", "doctor_probe"}
#: The launcher registry: the only package that compares a launcher's name (the others ask it).
LAUNCHER_REGISTRY = "launchers"
#: Modules the launcher-name rule does not cover yet (none: runtime/watchers/rankexit.py asks LOCAL.started(environ)).
LAUNCHER_RULE_PENDING: set[str] = set()
#: The rank side's rooms inside runtime/: room -> what it may import outside itself (a module, or a
#: package and everything in it). The engine stands on the session, checkpoints, watchers and the
#: rank's bootstrap, never on the login side or the launch shim; checkpoints and watchers never on the engine.
RANK_ROOMS = {
    "cyclone_kit.runtime.engine": {
        "cyclone_kit.core", "cyclone_kit.config.job", "cyclone_kit.rundir", "cyclone_kit.runtime.session",
        "cyclone_kit.runtime.checkpoint", "cyclone_kit.runtime.watchers", "cyclone_kit.runtime.metrics",
        "cyclone_kit.runtime.phases", "cyclone_kit.runtime.power", "cyclone_kit.runtime.env", "cyclone_kit.runtime.dist",
        "cyclone_kit.runtime.signals", "cyclone_kit.runtime.hvd", "cyclone_kit.runtime.torchcompat"},
    "cyclone_kit.runtime.checkpoint": {"cyclone_kit.core", "cyclone_kit.rundir", "cyclone_kit.runtime.dist"},
    "cyclone_kit.runtime.watchers": {"cyclone_kit.core", "cyclone_kit.rundir", "cyclone_kit.launchers", "cyclone_kit.slurm",
                                     "cyclone_kit.runtime.signals", "cyclone_kit.runtime.importhook"},
}
#: room -> the only modules outside it that may import it: the engine is reached from the rank's entry alone
#: (the public API and the session never import it, eagerly or lazily).
ROOM_IMPORTERS = {"cyclone_kit.runtime.engine": {"cyclone_kit.runtime.__main__"}}
#: module -> what it imports only inside functions (at call time): the engine's entry picks a strategy's
#: engine when it runs, and the rank's entry answers --help and records failures without torch.
LAZY_ONLY = {
    "cyclone_kit.runtime.engine": {"cyclone_kit.runtime.engine.dataparallel", "cyclone_kit.runtime.engine.pipeline",
                                   "cyclone_kit.runtime.hvd"},
    "cyclone_kit.runtime.__main__": {"cyclone_kit.runtime.engine", "cyclone_kit.runtime.dist"},
    "cyclone_kit.api": {"cyclone_kit.runtime"},
}
#: Compatibility aliases inside runtime/ (old module path -> the module it is): batch scripts rendered before
#: issue 30 run ``python -m cyclone_kit.runtime.stepwatch``, and a requeued job re-runs its old script.
RUNTIME_ALIASES = {"cyclone_kit.runtime.stepwatch": "cyclone_kit.runtime.watchers.jobstep",
                   "cyclone_kit.runtime.watchdog": "cyclone_kit.runtime.watchers.rankexit"}
#: Module paths that job scripts, older run directories and pickled submitit callables name.
CALLED_BY_NAME = {"cyclone_kit.runtime", "cyclone_kit.runtime.__main__", "cyclone_kit.runtime.launch",
                  "cyclone_kit.runtime.stepwatch", "cyclone_kit.runtime.watchdog", "cyclone_kit.launch",
                  "cyclone_kit.ports", "cyclone_kit.doctor_probe", "cyclone_kit.core.ports", "cyclone_kit.doctor.probe",
                  "cyclone_kit.backends.submitit_"}


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


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def room_violations(root: Path) -> list[str]:
    """Imports that break the rank side's rooms (:data:`RANK_ROOMS`, :data:`ROOM_IMPORTERS`)."""
    top = root.name
    bad = []
    for e in edges(root):
        importer = top + e.importer[len(top):]
        imported = top + e.imported[len(top):]
        where = f"{importer}:{e.line} imports {imported}"
        for room, allowed in RANK_ROOMS.items():
            room = top + room[len("cyclone_kit"):]
            if _within(importer, room) and not _within(imported, room) and not any(
                    _within(imported, top + a[len("cyclone_kit"):]) for a in allowed):
                bad.append(f"{where} ({room} may import only {sorted(allowed)} outside itself)")
        for room, importers in ROOM_IMPORTERS.items():
            if _within(imported, room) and not _within(importer, room) and importer not in importers:
                bad.append(f"{where} (only {sorted(importers)} may import {room}: the entry picks the engine)")
    return bad


def eager_imports(path: Path) -> list[tuple[str, int]]:
    """The package modules a module imports when it is imported (module level, under if/try too; not in functions)."""
    found: list[tuple[str, int]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((a.name, node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.extend((f"{node.module}.{a.name}", node.lineno) for a in node.names)
            elif isinstance(node, ast.If | ast.Try):
                for block in (node.body, node.orelse, *([h.body for h in node.handlers] if isinstance(node, ast.Try) else [])):
                    visit(block)

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def lazy_violations(root: Path) -> list[str]:
    """Module-level imports that :data:`LAZY_ONLY` wants at call time."""
    mods, top, bad = modules(root), root.name, []
    for module, lazy in LAZY_ONLY.items():
        module = top + module[len("cyclone_kit"):]
        for name, line in eager_imports(mods[module]):
            name = top + name[len("cyclone_kit"):] if name.startswith("cyclone_kit") else name
            hit = [x for x in lazy if _within(name, top + x[len("cyclone_kit"):])]
            if hit:
                bad.append(f"{module}:{line} imports {name} when imported (import it inside the function that uses it)")
    return bad


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


def test_the_rank_sides_rooms_hold() -> None:
    assert room_violations(PACKAGE) == []


def test_the_engine_and_its_strategies_are_imported_only_when_they_run() -> None:
    assert lazy_violations(PACKAGE) == []


def test_module_paths_called_by_name_keep_working() -> None:
    mods = modules(PACKAGE)
    rendered = set()
    for template in (PACKAGE.parent / "templates").glob("*.j2"):
        rendered |= set(re.findall(r"-m (cyclone_kit[\w.]*)", template.read_text()))
    entry = (PACKAGE / "rundir" / "entry.py").read_text()
    rendered |= set(re.findall(r'_MODULE = "(cyclone_kit[\w.]*)"', entry))
    # new scripts name the watcher by its own module; the alias stays for scripts rendered before (CALLED_BY_NAME)
    assert {"cyclone_kit.runtime.watchers.jobstep", "cyclone_kit.runtime", "cyclone_kit.runtime.launch"} <= rendered
    assert "cyclone_kit.runtime.stepwatch" not in rendered
    for name in rendered | CALLED_BY_NAME:
        assert name in mods or f"{name}.__main__" in mods, f"{name} is named by job scripts or run directories"
    for old, new in RUNTIME_ALIASES.items():
        alias = mods[old]
        assert len(alias.read_text().splitlines()) < 16, f"{old} must stay a thin alias"
        assert f'runpy.run_module("{new}"' in alias.read_text(), f"python -m {old} must run {new}"
        assert importlib.import_module(old) is importlib.import_module(new)  # stdlib-only watchers: no torch
    submitit = ast.parse((PACKAGE / "backends" / "submitit_.py").read_text())
    assert "train" in {n.name for n in submitit.body if isinstance(n, ast.FunctionDef)}, "pickled callables name it"
    assert "run_training" in {n.name for n in ast.parse(mods["cyclone_kit.runtime.__main__"].read_text()).body
                              if isinstance(n, ast.FunctionDef)}


#: Where a study or a submission is driven: the backend (``Backend.foreground``, ``for_study``, ``run_here``, its
#: plan) says how its jobs run; these never compare a backend's name (issue 30).
NO_BACKEND_NAMES = ("submit", "cli")
BACKEND_NAMES = {"slurm", "submitit", "local"}


def backend_name_branches(root: Path) -> list[str]:
    """``module:line`` of every comparison with a backend's name in :data:`NO_BACKEND_NAMES`' modules."""
    found = []
    for package in NO_BACKEND_NAMES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                sides += [e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts]
                if any(isinstance(s, ast.Constant) and s.value in BACKEND_NAMES for s in sides):
                    found.append(f"{module_name(path, root)}:{node.lineno}")
    return found


def test_studies_and_submissions_never_branch_on_a_backends_name() -> None:
    assert backend_name_branches(PACKAGE) == []


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


def test_a_planted_backend_name_branch_is_found(planted: Path) -> None:
    study = planted / "submit" / "study.py"
    study.write_text(study.read_text() + "\n\ndef _late(backend):\n    return backend in ('local', 'submitit')\n")
    sweep = planted / "cli" / "sweep.py"
    sweep.write_text(sweep.read_text() + "\n\ndef _late(args):\n    return args.backend != 'local'\n")
    found = backend_name_branches(planted)
    assert any(v.startswith("cyclone_kit.submit.study:") for v in found)
    assert any(v.startswith("cyclone_kit.cli.sweep:") for v in found)


def test_planted_breaches_of_the_rank_sides_rooms_are_found(planted: Path) -> None:
    session = planted / "runtime" / "session.py"
    session.write_text(session.read_text() + "\n\ndef _late():\n    from cyclone_kit.runtime.engine.dataparallel import train\n")
    loop = planted / "runtime" / "engine" / "loop.py"
    loop.write_text(loop.read_text() + "\n\ndef _late():\n    from cyclone_kit.backends.slurm import SlurmBackend\n")
    ckpt = planted / "runtime" / "checkpoint" / "fsdp.py"
    ckpt.write_text(ckpt.read_text() + "\n\ndef _late():\n    from cyclone_kit.runtime.engine import plan\n")
    found = room_violations(planted)
    assert any("runtime.session" in v and "the entry picks the engine" in v for v in found)
    assert any("engine.loop" in v and "backends.slurm" in v for v in found)
    assert any("checkpoint.fsdp" in v and "runtime.engine.plan" in v for v in found)


def test_a_planted_eager_strategy_import_is_found(planted: Path) -> None:
    entry = planted / "runtime" / "engine" / "__init__.py"
    entry.write_text(entry.read_text().replace("from __future__ import annotations\n",
                                               "from __future__ import annotations\n\n"
                                               "from cyclone_kit.runtime.engine import dataparallel\n", 1))
    assert any("engine.dataparallel" in v and "when imported" in v for v in lazy_violations(planted))
