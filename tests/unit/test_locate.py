"""The notebook's study lookup: the newest `make demo` study, and paths relative to the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cyclone_kit.analysis.locate import newest_study, resolve_study
from cyclone_kit.analysis.synthetic import SyntheticRun, write_study
from cyclone_kit.core.errors import ValidationError


def _demo(runs: Path, stamp: str, with_metrics: bool = True) -> Path:
    if with_metrics:
        return write_study(runs, f"demo-strong-{stamp}", "strong", [("p0", SyntheticRun(1, 10.0))])
    path = runs / f"demo-strong-{stamp}"
    path.mkdir(parents=True)
    (path / "sweep.json").write_text("{}")
    return path


def test_the_newest_demo_study_with_metrics_wins_from_analysis_dir(tmp_path: Path) -> None:
    runs = tmp_path / "repo" / "runs"
    _demo(runs, "20260101-120000")
    newest = _demo(runs, "20260101-120000-2")  # same second, second study
    _demo(runs, "20260301-000000", with_metrics=False)  # newer, but nothing ran
    (runs / ".demo-strong.abc123").mkdir()  # a study being created
    _demo(runs, "19990101-000000")
    old = runs / "demo-strong-19990101-000000"
    os.utime(old, (2e9, 2e9))  # a newer mtime does not beat the stamp
    analysis = tmp_path / "repo" / "analysis"
    analysis.mkdir()
    assert newest_study(start=analysis) == newest.resolve()
    assert resolve_study(None, start=analysis) == [newest.resolve()]
    assert resolve_study("runs/demo-strong-20260101-120000", start=analysis) == [
        (runs / "demo-strong-20260101-120000").resolve()]
    assert resolve_study([str(newest)], start=tmp_path) == [newest]


def test_missing_studies_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="no no-such-study-<stamp> study with metrics under") as info:
        newest_study(name="no-such-study", start=tmp_path)
    assert "make demo" in info.value.hint
    with pytest.raises(ValidationError, match="study 'runs/nope' not found"):
        resolve_study("runs/nope", start=tmp_path)
