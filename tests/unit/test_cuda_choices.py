"""Pure choices of the CUDA paths (issue 24), checked with torch on the CPU: which optimizer is fused,
what GradScaler.step then syncs, FSDP2's mixed-precision policy, which strategies keep contiguous weights."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cyclone_kit.config.job import TrainConfig
from cyclone_kit.runtime.engine.dataparallel import (
    CONTIGUOUS_PARAMS,
    fsdp_mixed_precision,
    fsdp_norm_policy,
    make_optimizer,
    place_model,
    use_fused_sgd,
)
from cyclone_kit.runtime.engine.models import build_model


class HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what ``.item()`` dispatches to (a host sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("strategy", "kind", "fused"), [
    ("ddp", "cuda", True), ("pipeline", "cuda", True), ("fsdp", "cuda", False), ("horovod", "cuda", False),
    ("ddp", "cpu", False), ("pipeline", "cpu", False),
])
def test_fused_sgd_only_where_it_is_valid(strategy: str, kind: str, fused: bool) -> None:
    assert use_fused_sgd(strategy, kind) is fused


def _scaled_step(fused: bool, inf: bool) -> tuple[int, bool, float]:
    """One GradScaler step (the path torch takes on CUDA too); (host reads, weights changed, new scale)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = make_optimizer(model, 0.1, TrainConfig(), fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.randn(3, 8)).sum()).backward()
    if inf:
        model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    before = model.weight.detach().clone()
    with HostReads() as reads:
        scaler.step(opt)
        scaler.update()
    return reads.count, not torch.equal(before, model.weight.detach()), scaler.get_scale()


def test_fused_sgd_takes_the_grad_scaler_step_without_reading_found_inf_on_the_host() -> None:
    """Item 2: plain SGD goes through GradScaler._maybe_opt_step's found_inf.item() (a host sync
    per fp16 step on CUDA); fused SGD gets grad_scale/found_inf as tensors: no host read at all."""
    assert _scaled_step(fused=False, inf=False)[0] >= 1
    assert _scaled_step(fused=True, inf=False) == (0, True, 1024.0)
    assert _scaled_step(fused=True, inf=True) == (0, False, 512.0)  # the overflow skipped on the device


def _pipeline_scaled_step(fused: bool, inf: bool) -> tuple[int, float, bool, float]:
    """One LossScale step of a pipeline stage; (host reads, the flag, weights changed, new scale)."""
    from cyclone_kit.runtime.engine.pipeline import LossScale

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = make_optimizer(model, 0.1, TrainConfig(), fused=fused)
    scaler = LossScale("cpu", init_scale=1024.0)
    (model(torch.randn(3, 8)).sum() * scaler.scale).backward()
    if inf:
        model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    before = model.weight.detach().clone()
    with HostReads() as reads:
        found = scaler.step(opt)
    return reads.count, float(found), not torch.equal(before, model.weight.detach()), float(scaler.scale)


def test_pipeline_loss_scale_skips_an_overflow_on_the_device_with_fused_sgd() -> None:
    """Issue 28: the pipeline's fp16 step read its inf flag on the host (``.cpu()``, ``.item()``) every
    optimizer step; with fused SGD (the pipeline's on CUDA) the flag stays a device tensor: no host read,
    the overflowed step skipped by the kernel and the scale halved, a good step unscaled as plain SGD's."""
    assert _pipeline_scaled_step(fused=False, inf=False)[0] >= 1  # plain SGD (the CPU): the host decides
    assert _pipeline_scaled_step(fused=True, inf=True) == (0, 1.0, False, 512.0)
    reads, found, changed, scale = _pipeline_scaled_step(fused=True, inf=False)
    assert (reads, found, changed, scale) == (0, 0.0, True, 1024.0)
    fused, plain = (_weights_after(fused) for fused in (True, False))
    torch.testing.assert_close(fused, plain)  # the kernel unscaled what plain SGD got unscaled


def _weights_after(fused: bool) -> torch.Tensor:
    from cyclone_kit.runtime.engine.pipeline import LossScale

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = make_optimizer(model, 0.1, TrainConfig(), fused=fused)
    scaler = LossScale("cpu", init_scale=1024.0)
    (model(torch.randn(3, 8)).sum() * scaler.scale).backward()
    scaler.step(opt)
    return model.weight.detach().clone()


def test_fsdp_policy_follows_the_resolved_precision() -> None:
    assert fsdp_mixed_precision("fp32") is None
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = fsdp_mixed_precision(name)
        # torch 2.6 stores a reduce_dtype equal to param_dtype as None (the same reduction: in param_dtype)
        assert (policy.param_dtype, policy.reduce_dtype or policy.param_dtype) == (dtype, dtype)
        # the BatchNorm unit (issue 28 bug 2): fp32 weights next to the fp32 running statistics
        norm = fsdp_norm_policy(policy)
        assert (norm.param_dtype, norm.reduce_dtype, norm.output_dtype) == (None, torch.float32, dtype)
        assert norm.cast_forward_inputs is False
    assert fsdp_norm_policy(None) is None


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "horovod"])
def test_channels_last_converts_the_weights_only_where_the_collectives_take_them(strategy: str) -> None:
    """Item 1: Horovod (and FSDP) need contiguous parameters; DDP gets channels_last weights."""
    model = place_model(build_model("tiny_cnn", 10, 32, 3), torch.device("cpu"), strategy, True)
    weight = model.features[0].weight
    assert weight.is_contiguous() is (strategy in CONTIGUOUS_PARAMS)
    assert weight.is_contiguous(memory_format=torch.channels_last) is (strategy not in CONTIGUOUS_PARAMS)


@pytest.mark.parametrize(("environ", "listed", "gpus"), [
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, 8, ["2", "3"]),
    ({"CUDA_VISIBLE_DEVICES": ""}, 8, []),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, 8, []),
    ({}, 4, ["0", "1", "2", "3"]),
    ({}, 0, []),
])
def test_visible_gpus_from_the_environment_or_the_driver(tmp_path, environ, listed, gpus) -> None:
    from cyclone_kit.backends.local_env import visible_gpus

    driver = tmp_path / "gpus"
    driver.mkdir()
    for i in range(listed):
        (driver / f"0000:{i:02x}:00.0").mkdir()
    assert visible_gpus(environ, driver) == gpus
    assert visible_gpus({}, tmp_path / "no-driver") == []


@pytest.mark.parametrize(("gpus", "nproc", "nodes", "slices"), [
    ([], 4, 2, None),                                  # no GPU: the CPU, as before
    (["0", "1", "2", "3"], 2, 1, ["0,1,2,3"]),         # one node sees them all: cuda:LOCAL_RANK
    (["0", "1", "2", "3"], 4, 2, ["0,1", "2,3"]),      # two pretend nodes: disjoint halves
    (["4", "5"], 2, 2, ["4", "5"]),
])
def test_pretend_nodes_get_disjoint_gpus(gpus, nproc, nodes, slices) -> None:
    from cyclone_kit.backends.local_env import gpu_slices, rank_environments

    assert gpu_slices(gpus, nproc, nodes) == slices
    if slices:  # every rank then sees its node's slice, and no GPU is seen by two nodes
        envs = rank_environments(nproc, nodes, job_id="1", master_port=1, threads=1, run_dir=".")
        seen = [slices[int(e["SLURM_NODEID"])].split(",")[int(e["SLURM_LOCALID"])] for e in envs]
        assert len(set(seen)) == nproc


@pytest.mark.parametrize(("nproc", "nodes"), [(2, 2), (2, 1)])
def test_more_ranks_than_gpus_is_refused_before_nccl_says_duplicate_gpu(nproc: int, nodes: int) -> None:
    """Likely item: `run --nodes 2` on a one-GPU box gave both pretend nodes cuda:0."""
    from cyclone_kit.backends.local_env import gpu_slices
    from cyclone_kit.core.errors import ValidationError

    with pytest.raises(ValidationError, match="Duplicate GPU") as err:
        gpu_slices(["0"], nproc, nodes)
    assert "HINT: use --nproc 1 or fewer" in str(err.value) and "--cpu" in str(err.value)


def _gpu_job(profile_changes: dict, script: bool, extra_sbatch: tuple[str, ...] = (), launcher: str = "srun"):
    import dataclasses

    from cyclone_kit.config.job import spec_from_dict
    from cyclone_kit.config.profile import load_profile
    from cyclone_kit.config.validate import resolve

    data = {"name": "t", "resources": {"profile": "cyclone", "partition": "gpu", "nodes": 1, "account": "p1",
                                       "launcher": launcher, "extra_sbatch": list(extra_sbatch)}}
    if script:
        data["script"] = {"path": "/x/train.py"}
    profile = dataclasses.replace(load_profile("cyclone"), **profile_changes)
    return resolve(spec_from_dict(data), profile)


@pytest.mark.parametrize(("changes", "extra", "launcher"), [
    ({"gpu_bind": "single:1"}, (), "srun"),
    ({"gpu_bind": "closest"}, (), "srun"),
    ({"gpu_bind": "verbose,per_task:1"}, (), "srun"),
    ({}, ("--gpus-per-task=1",), "srun"),
    ({}, ("--gpus-per-task=1",), "torchrun"),
])
def test_a_script_job_whose_tasks_each_see_one_gpu_is_refused(changes, extra, launcher) -> None:
    """Likely item: under --gpus-per-task=1 a script taking cuda:LOCAL_RANK fails on local rank 1."""
    from cyclone_kit.core.errors import ValidationError

    with pytest.raises(ValidationError, match="cuda:LOCAL_RANK") as err:
        _gpu_job(changes, script=True, extra_sbatch=extra, launcher=launcher)
    assert 'gpu_bind = "none"' in str(err.value)
    _gpu_job(changes, script=False, extra_sbatch=extra, launcher=launcher)  # the built-in trainer copes


def test_a_script_job_with_every_gpu_visible_is_accepted() -> None:
    job = _gpu_job({}, script=True)  # the cyclone profile: gpu_bind = "none", 4 ranks per node
    assert job.ntasks_per_node == 4


@pytest.mark.parametrize(("visible", "local_rank", "local_world", "warns"), [
    ("1", 1, 4, True), ("0", 0, 4, True), ("0,1,2,3", 1, 4, False), ("", 1, 4, False), ("0", 0, 1, False),
])
def test_the_shim_names_a_one_gpu_per_task_layout(visible, local_rank, local_world, warns) -> None:
    from cyclone_kit.runtime.launch import one_gpu_layout

    text = one_gpu_layout({"CUDA_VISIBLE_DEVICES": visible}, local_rank, local_world)
    assert (text is not None) is warns
    if warns:
        assert "invalid device ordinal" in text and "HINT:" in text and "\n" not in text


def test_a_plain_sgd_checkpoint_resumed_into_fused_sgd_keeps_the_fused_kernel() -> None:
    """A state dict carries fused=False from its writer; loaded as is, the next GradScaler step of the
    fused optimizer would give grad_scale/found_inf to the plain kernel, which asserts they are None."""
    from cyclone_kit.runtime.engine.dataparallel import keep_kernel_choice

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    written = make_optimizer(model, 0.1, TrainConfig(), fused=False).state_dict()
    for keep in (False, True):
        opt = make_optimizer(model, 0.1, TrainConfig(), fused=True)
        with keep_kernel_choice(opt) if keep else contextlib.nullcontext():
            opt.load_state_dict(written)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(model(torch.randn(3, 8)).sum()).backward()
        if keep:
            scaler.step(opt)
            assert opt.param_groups[0]["fused"] is True
        else:
            # torch 2.14 says "Expected grad_scale and found_inf to be None"; 2.6 has a bare assert
            with pytest.raises(AssertionError, match=r"^(Expected grad_scale and found_inf to be None)?$"):
                scaler.step(opt)
        model.zero_grad(set_to_none=True)


def _poison_allocator(numel: int) -> None:
    """Fill freed memory with NaN, as a GPU's caching allocator hands back a freed activation: what
    ``torch.empty_like`` then returns is whatever was there (glibc malloc reuses these blocks)."""
    junk = [torch.full((numel,), float("nan")) for _ in range(64)]
    del junk


def _overflow_then_good_step(opt: torch.optim.Optimizer, model: torch.nn.Module, scaler: Any,
                             x: torch.Tensor) -> list[Any]:
    """Step 1: an inf gradient (GradScaler skips it); step 2: a finite one. Returns the momentum
    buffers as they were between the two steps."""
    from cyclone_kit.runtime.engine.dataparallel import optimizer_step

    scaler.scale(model(x).square().mean()).backward()
    model.weight.grad[0, 0] = float("inf")  # type: ignore[index]
    _poison_allocator(model.weight.numel())
    optimizer_step(opt, scaler)
    opt.zero_grad(set_to_none=True)
    between = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
    between = [None if b is None else b.clone() for b in between]
    scaler.scale(model(x).square().mean()).backward()
    optimizer_step(opt, scaler)
    opt.zero_grad(set_to_none=True)
    return between


@pytest.mark.parametrize("start", ["fresh", "resumed_without_momentum_state"])
def test_fused_sgd_after_an_overflowed_first_step_trains_like_plain_sgd(start: str) -> None:
    """Issue 28 bug 1: fused SGD allocates its momentum buffers with empty_like on the first step and
    the kernel returns at once on found_inf, yet the buffers are kept: the next step computed
    momentum * garbage + grad (NaN weights). The engine's optimizer (make_optimizer; the resume path
    _restore) zero-seeds them, so a skipped first step then a good one equals plain SGD's run."""
    from cyclone_kit.runtime.engine.dataparallel import _restore
    from cyclone_kit.runtime.env import DistEnv

    tc = TrainConfig(momentum=0.9, weight_decay=5e-4)
    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        x = torch.randn(8, 256)
        opt = make_optimizer(model, 0.1, tc, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        if start == "resumed_without_momentum_state":  # a checkpoint written before any optimizer step
            written = make_optimizer(model, 0.1, tc, fused=False)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
            state = {"model": model.state_dict(), "optimizer": written.state_dict(),
                     "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "step": 0}
            assert _restore(state, model, opt, sched, scaler, DistEnv()) == 0
        between = _overflow_then_good_step(opt, model, scaler, x)
        if fused:
            for buf in between:  # no garbage kept from the skipped step: absent or zeros
                assert buf is None or not buf.any(), f"{buf.isnan().sum()} NaN of {buf.numel()} kept from the skip"
        results[fused] = [p.detach().clone() for p in model.parameters()]
        assert scaler.get_scale() == 2.0 ** 15  # the overflow halved the scale; the good step kept it
    for plain, fused_p in zip(results[False], results[True], strict=True):
        assert torch.isfinite(fused_p).all()
        torch.testing.assert_close(fused_p, plain)


def test_nonfinite_params_counts_the_tensors_holding_nan_or_inf_without_reading_the_host() -> None:
    from cyclone_kit.runtime.engine.dataparallel import nonfinite_params

    ok = [torch.ones(3), torch.full((2,), 1e30), torch.ones(2, dtype=torch.bfloat16), torch.empty(0)]
    with HostReads() as reads:
        none = nonfinite_params(ok)
        bad = nonfinite_params([*ok, torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf")])])
    assert reads.count == 0
    assert (none.item(), bad.item()) == (0, 2)
    assert nonfinite_params([]).item() == 0
