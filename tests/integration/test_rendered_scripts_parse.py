"""Every golden sbatch script (each rendered case of tests/unit/test_render.py and the doctor's) parses with ``bash -n``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.mark.parametrize("script", sorted(GOLDEN.glob("*.sbatch")), ids=lambda p: p.stem)
def test_bash_accepts(script: Path) -> None:
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_golden_case_is_checked() -> None:
    assert len(list(GOLDEN.glob("*.sbatch"))) >= 6
