"""Two studies made to fail in known ways, run for real (local launcher, gloo), are diagnosed right.

* input-bound: an ImageFolder of large JPEGs decoded and resized to 32 px on the ranks themselves
  (``num_workers = 0``): the report calls the run input-bound and recommends loader workers and
  node-local data, not gradient compression;
* communication-bound: a wide model (ResNet-18, 11 M parameters: 45 MB of gradients a step) on
  8 px images with a tiny batch (2 per rank), so that there is little compute to hide the all-reduce
  behind: the report names the exposed gradient all-reduce and recommends compression and bucket
  size, not loader workers.

Both need the step phases (issue 23 item 1, the engine's timers): without them the report names no
cause, so these tests skip until the metrics contract carries them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone_kit.rundir import contract
from tests.helpers.cli import run_cli

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("compute_time_s" not in contract.STEP_FIELDS,
                       reason="needs the step phases in the metrics contract (issue 23 item 1)"),
]
#: Hang guard for a 2-point study and its report (~1-2 min here).
HANG_S = 900


def _jpegs(root: Path, per_class: int = 24, px: int = 1200) -> None:
    """Two classes of noise JPEGs, large enough that decoding them dominates a step."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (px, px, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i}.jpg", quality=95)


def _study(tmp_path: Path, name: str, train: str, batch: int) -> str:
    """Run a 1- and 2-rank strong study with the local backend and report it; returns report.md."""
    spec = tmp_path / f"{name}.toml"
    spec.write_text(
        f'[sweep]\nname = "{name}"\nmode = "strong"\nglobal_batch_size = {batch}\nreport = false\n'
        "points = [{nodes = 1, ntasks_per_node = 1}, {nodes = 1, ntasks_per_node = 2}]\n"
        f'[base]\nname = "{name}"\n[base.train]\n{train}steps = 24\nlog_every = 4\nval_every_epochs = 0\n'
        'precision = "fp32"\nlr_scaling = "none"\n'
        '[base.resources]\nprofile = "local"\npartition = "cpu"\ncpus_per_task = 1\n'
        "[base.checkpoint]\nrequeue = false\nevery_steps = 0\n")
    runs = tmp_path / "runs"
    result = run_cli("sweep", str(spec), "--backend", "local", "--runs-dir", str(runs), "--quiet", timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    (study,) = [p for p in runs.iterdir() if p.name.startswith(name)]
    out = tmp_path / f"{name}-report"
    report = run_cli("report", str(study), "-o", str(out), timeout=HANG_S)
    assert report.returncode == 0, report.stderr
    return (out / "report.md").read_text()


def _section(md: str) -> str:
    """The "Where the time goes" section (up to the next study-level heading)."""
    start = md.index("### Where the time goes")
    end = md.find("\n## ", start)
    return md[start:end if end > 0 else None]


@pytest.mark.timeout(2 * HANG_S)
def test_an_input_bound_study_is_named_input_bound(tmp_path: Path) -> None:
    _jpegs(tmp_path / "images")
    md = _section(_study(tmp_path, "input-bound", f'model = "tiny_cnn"\ndataset = "imagefolder"\ndata_dir = '
                         f'"{tmp_path / "images"}"\nimage_size = 32\nnum_workers = 0\n', batch=16))
    assert "the run is input-bound" in md, md
    assert "train.num_workers" in md and "local disk" in md, md
    advice = md.split("What acts on that cause:", 1)[1]
    assert advice.lstrip().startswith("- more loader workers"), advice  # the loader's changes first
    # The all-reduce's changes only when it is what grew: with a data wait that scaled as well as the
    # batch shrank (a quiet machine), the 2-rank all-reduce is all of the lost efficiency, and named so.
    if "of the lost efficiency is gradient all-reduce" not in md:
        assert "fp16_allreduce" not in md, md


@pytest.mark.timeout(2 * HANG_S)
def test_a_communication_bound_study_names_the_exposed_all_reduce(tmp_path: Path) -> None:
    md = _section(_study(tmp_path, "comm-bound", 'model = "resnet18"\ndataset = "synthetic"\nimage_size = 8\n'
                         "synthetic_samples = 512\n", batch=4))
    assert "of the lost efficiency is gradient all-reduce" in md, md
    assert "fp16_allreduce" in md and "bucket_cap_mb" in md, md
    assert "train.num_workers" not in md, md
