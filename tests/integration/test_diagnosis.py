"""Two studies made to fail in known ways, run for real (local launcher, gloo), are diagnosed right.

Each condition is made, not hoped for (issue 27): a 5x faster or slower machine gives the same verdict.

* input-bound: an ImageFolder read through a slow file system (every image read 25 ms late,
  :mod:`tests.helpers.slow_parts`), ``num_workers = 0``: the data wait is nearly the whole step at
  every N, so the report calls the run input-bound and recommends loader workers and node-local
  data first;
* communication-bound: every gradient bucket's all-reduce result ready 250 ms late (a slow link, on
  the collective's thread: no core is used), a tiny CNN whose compute is milliseconds: at N = 2 the
  exposed all-reduce is nearly all the lost time, so the report names it and recommends compression
  and bucket size, not loader workers.

Both need the step phases (issue 23 item 1, the engine's timers): without them the report names no
cause, so these tests skip until the metrics contract carries them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone_kit.rundir import contract
from tests.helpers.cli import run_cli
from tests.helpers.slow_parts import slow_parts_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("compute_time_s" not in contract.STEP_FIELDS,
                       reason="needs the step phases in the metrics contract (issue 23 item 1)"),
]
#: Hang guard for a 2-point study and its report (~1-2 min here).
HANG_S = 900


def _pngs(root: Path, per_class: int = 24, px: int = 16) -> None:
    """Two classes of small noise PNGs (the slow file system, not decoding, makes the wait)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8)).save(root / label / f"{i}.png")


def _study(tmp_path: Path, name: str, train: str, batch: int, env: dict[str, str]) -> str:
    """Run a 1- and 2-rank strong study with the local backend, which reports it (``report = true``: the
    ``report`` command run in the sweep's process once the points ended, ``report STUDY -o STUDY/report``; no
    process of its own, issue 27); returns its report.md."""
    spec = tmp_path / f"{name}.toml"
    spec.write_text(
        f'[sweep]\nname = "{name}"\nmode = "strong"\nglobal_batch_size = {batch}\nreport = true\n'
        "points = [{nodes = 1, ntasks_per_node = 1}, {nodes = 1, ntasks_per_node = 2}]\n"
        f'[base]\nname = "{name}"\n[base.train]\n{train}steps = 24\nlog_every = 4\nval_every_epochs = 0\n'
        'precision = "fp32"\nlr_scaling = "none"\n'
        '[base.resources]\nprofile = "local"\npartition = "cpu"\ncpus_per_task = 1\n'
        "[base.checkpoint]\nrequeue = false\nevery_steps = 0\n")
    runs = tmp_path / "runs"
    result = run_cli("sweep", str(spec), "--backend", "local", "--runs-dir", str(runs), "--quiet", env=env,
                     timeout=HANG_S)
    assert result.returncode == 0, result.stderr  # the report's exit code too
    (study,) = [p for p in runs.iterdir() if p.name.startswith(name)]
    assert f"== report: {study / 'report'}" in result.stdout, result.stdout
    return (study / "report" / "report.md").read_text()


def _section(md: str) -> str:
    """The "Where the time goes" section (up to the next study-level heading)."""
    start = md.index("### Where the time goes")
    end = md.find("\n## ", start)
    return md[start:end if end > 0 else None]


@pytest.mark.timeout(2 * HANG_S)
def test_an_input_bound_study_is_named_input_bound(tmp_path: Path) -> None:
    _pngs(tmp_path / "images")
    env = slow_parts_env(tmp_path / "slow-fs", load_delay_s=0.025)
    md = _section(_study(tmp_path, "input-bound", f'model = "tiny_cnn"\ndataset = "imagefolder"\ndata_dir = '
                         f'"{tmp_path / "images"}"\nimage_size = 16\nnum_workers = 0\n', batch=16, env=env))
    assert "the run is input-bound" in md, md
    assert "train.num_workers" in md and "local disk" in md, md
    advice = md.split("What acts on that cause:", 1)[1]
    assert advice.lstrip().startswith("- more loader workers"), advice  # the loader's changes first


@pytest.mark.timeout(2 * HANG_S)
def test_a_communication_bound_study_names_the_exposed_all_reduce(tmp_path: Path) -> None:
    env = slow_parts_env(tmp_path / "slow-link", allreduce_delay_s=0.25)
    md = _section(_study(tmp_path, "comm-bound", 'model = "tiny_cnn"\ndataset = "synthetic"\nimage_size = 8\n'
                         "synthetic_samples = 512\n", batch=4, env=env))
    assert "of the lost efficiency is gradient all-reduce" in md, md
    assert "fp16_allreduce" in md and "bucket_cap_mb" in md, md
    assert "train.num_workers" not in md, md
