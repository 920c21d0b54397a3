"""Validation of a job against a cluster profile: what is filled in, and every refusal."""

import pytest

from cyclone_kit.config.job import spec_from_dict
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.validate import resolve
from cyclone_kit.core.errors import ValidationError


def job(profile="cyclone", **resources):
    return resolve(spec_from_dict({"resources": {"profile": profile, **resources}}), load_profile(profile))


def test_cyclone_gpu_defaults():
    j = job(partition="gpu", nodes=4)
    assert (j.nodes, j.gpus_per_node, j.ntasks_per_node, j.cpus_per_task, j.world_size) == (4, 4, 4, 10, 16)


def test_cpu_partition_defaults():
    j = job(partition="cpu", nodes=2)
    assert (j.gpus_per_node, j.ntasks_per_node, j.cpus_per_task, j.world_size) == (0, 1, 40, 2)
    j = job("local", nodes=2, ntasks_per_node=2)
    assert (j.partition.name, j.cpus_per_task, j.world_size) == ("cpu", 2, 4)


def test_torchrun_one_task_per_node():
    j = job(partition="gpu", nodes=2, launcher="torchrun")
    assert (j.ntasks_per_node, j.procs_per_node, j.cpus_per_task, j.world_size) == (1, 4, 40, 8)


def test_fewer_gpus_per_node():
    j = job(partition="gpu", gpus_per_node=2)
    assert (j.ntasks_per_node, j.world_size) == (2, 2)


@pytest.mark.parametrize(
    ("resources", "fragment", "fix"),
    [
        ({"partition": "gpu", "nodes": 17}, "has 16 nodes", "--nodes between 1 and 16"),
        ({"partition": "gpu", "gpus_per_node": 8}, "has 4 GPUs per node", "--gpus-per-node=4"),
        ({"partition": "cpu", "gpus_per_node": 1}, "has 0 GPUs per node", "--partition"),
        ({"partition": "gpu", "ntasks_per_node": 3}, "--ntasks-per-node=3 but --gpus-per-node=4", "--ntasks-per-node=4"),
        ({"partition": "gpu", "time": "2-00:00:00"}, "above the 1-00:00:00 limit", "--time=1-00:00:00"),
        ({"partition": "gpu", "cpus_per_task": 12}, "more than the 10 cores per GPU", "--cpus-per-task=10"),
        ({"partition": "cpu", "ntasks_per_node": 4, "cpus_per_task": 20}, "= 80 CPUs", "--cpus-per-task"),
        ({"partition": "gpux"}, "unknown partition 'gpux'", "cpu, gpu"),
        ({"partition": "gpu", "launcher": "torchrun", "ntasks_per_node": 3}, "torchrun launcher", "drop --ntasks-per-node"),
            ({"partition": "cpu", "launcher": "torchrun", "ntasks_per_node": 4, "cpus_per_task": 2}, "4 torchrun workers",
             "--cpus-per-task=4"),
    ],
)
def test_refusals(resources, fragment, fix):
    with pytest.raises(ValidationError) as e:
        job(**resources)
    text = str(e.value)
    assert fragment in text and "HINT" in text and fix in text.split("HINT")[1]
    assert "\n" not in text


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"resources": {"nodes": 0}}, "resources.nodes must be at least 1"),
        ({"resources": {"nodes": -2}}, "resources.nodes must be at least 1"),
        ({"resources": {"time": "1:2:3:4"}}, "malformed time"),
        ({"resources": {"launcher": "mpirun"}}, "unknown resources.launcher"),
        ({"train": {"model": "resnet9000"}}, "unknown train.model"),
        ({"train": {"dataset": "mnist"}}, "unknown train.dataset"),
        ({"train": {"dataset": "cifar10"}}, "needs train.data_dir"),
        ({"train": {"steps": 0, "epochs": 0}}, "both 0"),
        ({"train": {"lr": -1.0}}, "train.lr must be > 0"),
        ({"train": {"batch_size": "64"}}, "train.batch_size must be int"),
        ({"checkpoint": {"signal": "KILL"}}, "unknown checkpoint.signal"),
        ({"name": "a b"}, "job name 'a b' is not allowed"),
        ({"name": "x;rm -rf"}, "is not allowed"),
        ({"bogus": 1}, "unknown job spec key(s): bogus"),
        ({"resources": {"account": "p1; rm"}}, "contains characters"),
        ({"train": 3}, "must be a table"),
    ],
)
def test_spec_refusals(data, fragment):
    with pytest.raises(ValidationError) as e:
        spec_from_dict(data)
    assert fragment in str(e.value) and "HINT" in str(e.value)


def test_unknown_profile():
    with pytest.raises(ValidationError, match=r"unknown profile 'nope'.*HINT.*cyclone"):
        load_profile("nope")


@pytest.mark.parametrize(("train", "fragment"), [
    ({"pipeline_stages": 3}, "train.pipeline_stages=3 does not divide the job's 4 ranks"),
    ({"batch_size": 30, "microbatches": 4}, "does not split into 4 equal micro-batches"),
    ({"pipeline_schedule": "1f1b", "microbatches": 2}, "needs train.microbatches >= 4 stages"),
])
def test_pipeline_layout_refusals_before_the_queue(train, fragment):
    spec = spec_from_dict({"train": {"strategy": "pipeline", **train},
                           "resources": {"profile": "local", "nodes": 2, "ntasks_per_node": 2}})
    with pytest.raises(ValidationError, match=fragment) as err:
        resolve(spec, load_profile("local"))
    assert err.value.hint
    ok = spec_from_dict({"train": {"strategy": "pipeline", "pipeline_stages": 2},
                         "resources": {"profile": "local", "nodes": 2, "ntasks_per_node": 2}})
    assert resolve(ok, load_profile("local")).world_size == 4


@pytest.mark.parametrize(("launcher", "signal", "release", "refused"), [
    ("torchrun", "USR2", (2, 6), True),    # the agent dies of SIGUSR2; no worker checkpoints
    ("torchrun", "USR1", (2, 9), True),
    ("torchrun", "USR2", (2, 10), False),  # TORCHELASTIC_SIGNALS_TO_HANDLE from 2.10
    ("torchrun", "TERM", (2, 6), False),   # every agent passes SIGTERM on
    ("torchrun", "USR2", None, False),     # torch not installed on the login node: nothing to judge
    ("srun", "USR2", (2, 6), False),       # Slurm signals the ranks themselves
    ("horovod", "USR1", (2, 6), False),
])
def test_a_requeue_signal_that_torchruns_agent_would_not_pass_on_is_refused(monkeypatch, launcher, signal, release,
                                                                              refused):
    from cyclone_kit.config import validate

    monkeypatch.setattr(validate, "installed_torch_release", lambda: release)
    spec = spec_from_dict({"resources": {"partition": "gpu", "nodes": 2, "launcher": launcher},
                           "checkpoint": {"signal": signal}})
    if not refused:
        assert resolve(spec, load_profile("cyclone")).spec.checkpoint.signal == signal
        return
    with pytest.raises(ValidationError) as err:
        resolve(spec, load_profile("cyclone"))
    assert f"checkpoint.signal={signal} with the torchrun launcher under torch {release[0]}.{release[1]}" in str(err.value)
    assert "checkpoint.signal=TERM" in err.value.hint and "torch>=2.10" in err.value.hint


@pytest.mark.parametrize(("version", "release"), [("2.6.0+cu124", (2, 6)), ("2.10.0a0+git1234", (2, 10)),
                                                   ("2.14.1", (2, 14)), ("nightly", None), ("2", None)])
def test_torch_release_reads_major_and_minor(version, release):
    from cyclone_kit.core.version import torch_release

    assert torch_release(version) == release
