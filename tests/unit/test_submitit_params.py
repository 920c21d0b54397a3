"""What the submitit backend asks submitit for, checked on the sbatch text submitit itself renders."""

from __future__ import annotations

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from cyclone_kit.backends.submitit_ import SubmititBackend, local_parameters, slurm_parameters
from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError


def _job(profile: str = "local", **resources: object):
    spec = spec_from_dict({"name": "sj", "train": {"model": "tiny_cnn"},
                           "checkpoint": {"signal": "USR1", "signal_lead_s": 90},
                           "resources": {"profile": profile, **resources}})
    return resolve(spec, load_profile(profile))


def test_gpu_job_maps_nodes_tasks_gres_signal_and_requeue() -> None:
    job = _job(partition="gpu", nodes=2, time="00:30:30")
    text = _make_sbatch_string(command="python -m x", folder="/f", **slurm_parameters(job, "/runs/a b"))
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gres=gpu:4",
                 "#SBATCH --cpus-per-task=1", "#SBATCH --time=31", "#SBATCH --partition=gpu",
                 "#SBATCH --signal=USR1@90", "#SBATCH --requeue", "#SBATCH --job-name=sj",
                 "export CYCLONE_RUN_DIR='/runs/a b'", "export SUBMITIT_PREEMPT_SIGNAL=USR1",
                 "--cpus-per-task 1 python -m x"):
        assert line in text, line


def test_profile_modules_env_and_account_are_carried() -> None:
    import dataclasses

    job = _job("cyclone", partition="gpu", nodes=1, account="p163")
    # issue 16: the cyclone profile loads no modules now; carry those of a profile that has some
    job = dataclasses.replace(job, profile=dataclasses.replace(
        job.profile, modules=("Python/3.10.4-GCCcore-11.3.0", "CUDA/12.1.1")))
    params = slurm_parameters(job, "/r")
    assert params["account"] == "p163" and params["gres"] == "gpu:4" and params["cpus_per_task"] == 10
    assert params["setup"][:3] == ["module purge", "module load Python/3.10.4-GCCcore-11.3.0", "module load CUDA/12.1.1"]
    assert params["srun_args"][:3] == ["--cpu-bind=cores", "--distribution=block:block", "--gpu-bind=none"]


def test_cpu_job_asks_no_gpus() -> None:
    params = slurm_parameters(_job(partition="cpu", ntasks_per_node=2), "/r")
    assert "gres" not in params and "gpus_per_node" not in params and params["ntasks_per_node"] == 2


def test_local_parameters_one_node_only() -> None:
    assert local_parameters(_job(partition="cpu", ntasks_per_node=2), timeout_min=3) == {
        "tasks_per_node": 2, "timeout_min": 3, "signal_delay_s": 90, "gpus_per_node": 0}
    with pytest.raises(ValidationError, match="runs on one node"):
        local_parameters(_job(partition="cpu", nodes=2))


def test_executor_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CYCLONE_SUBMITIT_EXECUTOR", "local")
    assert SubmititBackend().chosen_executor() == "local"
    assert SubmititBackend(executor="slurm").chosen_executor() == "slurm"
    monkeypatch.setenv("CYCLONE_SUBMITIT_EXECUTOR", "pbs")
    with pytest.raises(ValidationError, match="CYCLONE_SUBMITIT_EXECUTOR"):
        SubmititBackend().chosen_executor()
    with pytest.raises(ValidationError, match="unknown submitit executor"):
        SubmititBackend(executor="pbs")

