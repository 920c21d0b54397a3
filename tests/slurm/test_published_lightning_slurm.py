"""Lightning's own MNIST examples, byte for byte as published, through `cyclone-kit submit` on 2 nodes (issue 29).

The same checkout as tests/integration/test_published_lightning.py (tests/helpers/published.py): each
script is submitted from the folder its author runs it from, under the default snapshot, as 2 nodes x 1
task of the local cluster. Both jobs are submitted at once and run one after the other (the cpu
partition has 2 nodes). Lightning's Trainer is told its nodes the way Lightning's Slurm guide says
(``--trainer.num_nodes=2``); ``Fabric()`` is given nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone_kit.backends.slurm import SlurmBackend
from cyclone_kit.slurm.states import JobState
from tests.helpers.cli import run_cli
from tests.helpers.published import BACKBONE, FABRIC, SHORT_FABRIC, SHORT_TRAINER, lightning_checkout
from tests.helpers.slurm_jobs import cancel_quietly, parse_submit_output, read_records

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1200)]
#: hang guard of each wait (not a performance bound)
HANG_S = 900
NODES = ("--profile", "local", "--partition", "cpu", "--nodes", "2", "--ntasks-per-node", "1", "--time", "00:10:00")


def test_both_published_lightning_examples_train_on_two_nodes_with_their_data_next_to_their_files(
        slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    checkout = lightning_checkout(tmp_path / "pytorch-lightning")
    runs = tmp_path / "runs"
    submitted = {}
    for (folder, script), args in ((BACKBONE, (*SHORT_TRAINER, "--trainer.num_nodes=2", "--trainer.devices=1")),
                                   (FABRIC, SHORT_FABRIC)):
        result = run_cli("submit", script, *NODES, "--runs-dir", str(runs), "--", *args, cwd=checkout / folder,
                         timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        submitted[script] = parse_submit_output(result.stdout)
    backend = SlurmBackend()
    try:
        infos = {script: backend.wait(job_id, timeout=HANG_S) for script, (job_id, _) in submitted.items()}
    finally:
        for job_id, _ in submitted.values():
            cancel_quietly(backend, job_id)
    for script, (job_id, run_dir) in submitted.items():
        logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
        assert infos[script].state is JobState.COMPLETED, f"{script}: job {job_id} {infos[script].state}\n{logs}"
        assert "Downloading" not in logs, logs
        records = read_records(run_dir)
        (start,), (end,) = ([r for r in records if r["kind"] == k] for k in ("start", "end"))
        assert (start["world_size"], sorted(start["hostnames"])) == (2, ["c1", "c2"]), start
        assert end["status"] == "completed" and end["process_group_world"] == 2, end
        status = run_cli("status", str(run_dir), timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        print(f"{script}: job {job_id} completed on c1, c2 in {end['wall_time_s']:.1f} s")
    backbone_logs = checkout / BACKBONE[0] / "lightning_logs"
    assert sorted(p.name for p in backbone_logs.iterdir()) == ["version_0"], "one Trainer world, not two copies"
