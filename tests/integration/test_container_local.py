"""``cyclone-kit run --container``: the local backend runs its ranks in a Charliecloud image (issue 30).

The image is the one scripts/build-container-image.sh builds (``make container-image``): Debian 12
with its own python3, no torch; the job binds this venv in. Two ranks of the tiny CNN train a few
steps inside it and the run directory records the wrapped command. Without ch-run or the image the
test skips saying how to build it; with CK_REQUIRE_CONTAINER=1 it fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.cli import REPO

IMAGE = Path(os.environ.get("CK_CONTAINER_IMAGE", "/var/tmp/cyclone-images/debian12-python3"))


def _image_or_skip() -> None:
    missing = "ch-run on PATH" if shutil.which("ch-run") is None else (
        "" if (IMAGE / ".complete").is_file() else f"the image {IMAGE}")
    if missing:
        message = (f"Charliecloud container tests need {missing}: build it with `make container-image` "
                   "(scripts/build-container-image.sh)")
        if os.environ.get("CK_REQUIRE_CONTAINER") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def test_run_trains_two_ranks_inside_the_image(tmp_path: Path, cli) -> None:
    _image_or_skip()
    result = cli("run", str(REPO / "jobs" / "smoke.toml"), "--nproc", "2", "--container", str(IMAGE), "--set",
                 "container.runtime=charliecloud", "--set", "train.steps=3", "--runs-dir", str(tmp_path / "runs"),
                 cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["command"][0] == "ch-run" and str(IMAGE) in launch["command"], launch["command"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ends = [r for r in records if r["kind"] == "end"]
    assert [e["status"] for e in ends] == ["completed"] and ends[0]["steps"] == 3, ends
    assert json.loads((run_dir / "spec.json").read_text())["container"]["pythonpath"]  # the venv, bound in
