"""cyclone_kit.runtime.importhook: a function runs on a module right after its import, never before,
and a failing one never breaks the import (real imports of modules written here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cyclone_kit.runtime import importhook


@pytest.fixture
def fresh_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A module ``ck_hooked_<n>`` on sys.path, not imported yet; forgotten afterwards."""
    names = []

    def make(source: str) -> str:
        name = f"ck_hooked_{len(names)}_{abs(hash(tmp_path)) % 10**6}"
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for name in names:
        sys.modules.pop(name, None)
        importhook._HOOKS.pop(name, None)


def test_the_hook_runs_after_the_module_ran_and_only_on_import(fresh_module) -> None:
    import importlib

    name = fresh_module("VALUE = 41\n")
    seen = []
    importhook.after_import(name, lambda m: seen.append(m.VALUE))
    assert seen == [] and name not in sys.modules  # registering imports nothing
    module = importlib.import_module(name)
    assert seen == [41] and module.VALUE == 41
    importhook.after_import(name, lambda m: seen.append(m.VALUE + 1))  # loaded already: at once
    assert seen == [41, 42]


def test_a_failing_hook_does_not_break_the_import(fresh_module) -> None:
    import importlib

    name = fresh_module("VALUE = 7\n")

    def broken(module) -> None:
        raise RuntimeError("a bug in the hook")

    importhook.after_import(name, broken)
    assert importlib.import_module(name).VALUE == 7
