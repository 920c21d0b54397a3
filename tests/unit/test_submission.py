"""The submit path's run directory: rendered once for its final name, all or nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.toolbox import read_toml
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.submit import submission
from tests.helpers.cli import REPO


def _job():
    return resolve(spec_from_dict(read_toml(REPO / "jobs" / "smoke.toml")), load_profile("local"))


def test_the_script_is_rendered_once_for_the_final_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real = submission.render_script

    def counting(job, run_dir, *args, **kwargs):
        calls.append(Path(run_dir))
        return real(job, run_dir, *args, **kwargs)

    monkeypatch.setattr(submission, "render_script", counting)
    run_dir = submission.prepare_run_dir(_job(), tmp_path)
    assert calls == [run_dir]
    assert re.findall(r"^export CYCLONE_RUN_DIR=(.*)$", (run_dir / "job.sbatch").read_text(), re.M) == [str(run_dir)]


def test_a_render_failure_leaves_no_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*_args, **_kwargs):
        raise ValidationError("a value the template refuses", hint="fix it")

    monkeypatch.setattr(submission, "render_script", failing)
    with pytest.raises(ValidationError):
        submission.prepare_run_dir(_job(), tmp_path)
    assert list(tmp_path.iterdir()) == []
