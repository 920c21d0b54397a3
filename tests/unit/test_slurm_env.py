"""cyclone_kit.slurm.env: facts about the current job, read from a mapping."""

from __future__ import annotations

import pytest

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.slurm.env import requeue_target, restart_count


# ------------------------------------------------------------------------------------ slurm.env
@pytest.mark.parametrize(
    ("environ", "target"),
    [
        ({"SLURM_JOB_ID": "123"}, "123"),
        ({"SLURM_JOB_ID": "125", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "2"}, "123_2"),
        ({"SLURM_JOB_ID": "123", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "0"}, "123_0"),
        ({"SLURM_JOB_ID": " 7 ", "SLURM_ARRAY_TASK_ID": "3"}, "7"),  # task id without array id: not an array
    ],
)
def test_requeue_target(environ: dict[str, str], target: str) -> None:
    assert requeue_target(environ) == target


@pytest.mark.parametrize(
    "environ",
    [{}, {"SLURM_JOB_ID": ""}, {"SLURM_JOB_ID": "abc"}, {"SLURM_ARRAY_JOB_ID": "1", "SLURM_ARRAY_TASK_ID": "x"}],
)
def test_requeue_target_rejects_with_hint(environ: dict[str, str]) -> None:
    with pytest.raises(ValidationError) as info:
        requeue_target(environ)
    assert "HINT:" in str(info.value)


@pytest.mark.parametrize(("environ", "count"), [({}, 0), ({"SLURM_RESTART_COUNT": "0"}, 0), ({"SLURM_RESTART_COUNT": "2"}, 2)])
def test_restart_count(environ: dict[str, str], count: int) -> None:
    assert restart_count(environ) == count


def test_restart_count_rejects_garbage() -> None:
    with pytest.raises(ValidationError):
        restart_count({"SLURM_RESTART_COUNT": "-1"})
