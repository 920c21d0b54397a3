"""CUDA-path fixes of issues 16 and 24 that a CPU can show, in real processes: Horovod with channels_last
forced and Horovod's fp16 all-reduce under a GradScaler (one horovodrun of 2 gloo ranks for both,
``horovod_pair``), ck.log_step's clock read after the loss sync, the run refusing more ranks than GPUs, and
FSDP2 + torch.compile + bf16 through the runtime. (FSDP2's MixedPrecisionPolicy and fused SGD:
tests/integration/test_cuda_paths.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.child_ranks import RANK_TIMEOUT_S, child_env
from tests.helpers.ranks import REPO, horovod_missing

#: Hang guard of the compile run (not a performance bound): a cold torch.compile of TinyCNN under FSDP
#: takes ~30-60 s per rank on a quiet 2-core machine, several minutes at a load of 40.
COMPILE_HANG_S = 1200

#: One horovodrun of 2 ranks for both Horovod tests (issue 27: was 4 horovodruns, 8 rank starts). Each part
#: has its own model and names; the old channels_last order goes last, since the first rank to raise shuts
#: Horovod down. Each rank writes one JSON file with every part's result.
HVD_PAIR = r"""
import json, sys
import torch
import torch.nn.functional as F
import horovod.torch as hvd
from cyclone_kit.config.job import TrainConfig
from cyclone_kit.runtime.dist import DeviceChoice
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.dataparallel import (make_optimizer, optimizer_step, place_model, strategy_for,
                                                     wrap_model)

out = sys.argv[1]
hvd.init()
torch.set_num_threads(1)
result = {}


def fp16_allreduce_update(mode):
    # loss scale 65536 and fp16 compression: the SGD(lr=1) update over the ranks' mean unscaled gradient
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    named = [(f"{mode}.{n}", p) for n, p in model.named_parameters()]
    start = {n: p.detach().clone() for n, p in named}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=named,
                                   compression=hvd.Compression.fp16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    g = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 8, (32,), generator=g)
    loss = F.cross_entropy(model(x), y)
    # the gradient each rank would have without scaling, averaged over ranks: the update SGD(lr=1) must make
    ref = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    mean = [hvd.allreduce(r, name=f"{mode}.ref{i}") for i, r in enumerate(ref)]
    scaler.scale(loss).backward()
    if mode == "old":  # the engine before issue 16: GradScaler's step straight on Horovod's optimizer
        scaler.step(opt)
        scaler.update()
    else:
        optimizer_step(opt, scaler, horovod=True)
    ratios = [float(((start[n] - p.detach()).abs().sum() / m.abs().sum())) for (n, p), m in zip(named, mean)]
    return {"ratios": ratios, "scale": scaler.get_scale()}


result["fp16"] = {mode: fp16_allreduce_update(mode) for mode in ("new", "old")}

# channels_last forced, as on CUDA: the weights stay contiguous, the inputs are NHWC
torch.manual_seed(hvd.rank())  # a different start on each rank: the broadcast must make them one
cpu, tc = DeviceChoice("cpu", None, "cpu", "gloo"), TrainConfig(strategy="horovod")
model = place_model(build_model("tiny_cnn", 10, 32, 3), torch.device("cpu"), "horovod", True)
model = wrap_model("horovod", model, cpu, tc, True)
opt = strategy_for("horovod").optimizer(make_optimizer(model, 0.1, tc, fused=False), model, tc)
g = torch.Generator().manual_seed(hvd.rank())
x = torch.randn(8, 3, 32, 32, generator=g).to(memory_format=torch.channels_last)
y = torch.randint(0, 10, (8,), generator=g)
for _ in range(3):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
both = hvd.allgather(flat.unsqueeze(0))
result["nhwc_new"] = dict(loss=float(loss), same=bool(torch.equal(both[0], both[1])),
                          out_channels_last=bool(model.features[0](x).is_contiguous(memory_format=torch.channels_last)))

# what train() did before: every conv weight channels_last, then Horovod's broadcast (last: it shuts Horovod down)
torch.manual_seed(hvd.rank())
model = build_model("tiny_cnn", 10, 32, 3).to(memory_format=torch.channels_last)
result["nhwc_old_error"] = ""
try:
    wrap_model("horovod", model, cpu, tc, True)
except Exception as e:
    result["nhwc_old_error"] = f"{type(e).__name__}: {e}"
json.dump(result, open(f"{out}-{hvd.rank()}.json", "w"))
"""


@pytest.fixture(scope="module")
def horovod_pair(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results of HVD_PAIR under one horovodrun (it exited 0)."""
    missing = horovod_missing()
    if missing:
        pytest.skip(f"Horovod not importable: {missing}")
    root = tmp_path_factory.mktemp("horovod-pair")
    child = root / "child.py"
    child.write_text(HVD_PAIR)
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    env = child_env(HOROVOD_GLOO_TIMEOUT_SECONDS="120", PYTHONPATH=str(REPO))
    cmd = [sys.executable, horovodrun, "--gloo", "--start-timeout", "120", "-np", "2", "-H", "localhost:2",
           "--network-interfaces", "lo", sys.executable, str(child), str(root / "r")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((root / f"r-{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_horovod_trains_with_channels_last_inputs_where_channels_last_weights_failed(
        horovod_pair: list[dict[str, Any]]) -> None:
    """Issue 24 item 1: with channels_last on (the CUDA default), the old placement made Horovod's first
    broadcast raise "Tensor is required to be contiguous." (on one rank at least: the other may see
    Horovod shut down by it); now the weights stay contiguous, the convolutions still run
    channels_last, and 3 DistributedOptimizer steps leave both ranks equal."""
    # Horovod's first rank to raise shuts Horovod down: the other may see that shutdown, not the cause.
    errors = [r["nhwc_old_error"] for r in horovod_pair]
    assert any("Tensor is required to be contiguous" in e for e in errors), errors
    assert all("Tensor is required to be contiguous" in e or e.startswith("HorovodInternalError") for e in errors), errors
    for r in (rank["nhwc_new"] for rank in horovod_pair):
        assert r["same"] and r["out_channels_last"] and r["loss"] == r["loss"], r  # equal ranks, NHWC, not NaN


@pytest.mark.slow
def test_horovod_fp16_allreduce_with_a_grad_scaler_updates_by_the_unscaled_mean_gradient(
        horovod_pair: list[dict[str, Any]]) -> None:
    """Issue 16 item 3, Horovod on CPU (gloo, 2 ranks): loss scale 65536 and fp16 compression; with
    synchronize -> unscale_ -> step under skip_synchronize, the SGD(lr=1) update equals the
    ranks' mean unscaled gradient on both ranks (the old order gives a wrong update)."""
    new, old = ([rank["fp16"][mode] for rank in horovod_pair] for mode in ("new", "old"))
    for rank in new:
        assert rank["ratios"] == pytest.approx([1.0, 1.0], rel=2e-3), rank  # fp16 rounding of the all-reduce
    assert new[0] == new[1]
    print("old order, update / mean gradient:", [r["ratios"] for r in old])
    # before: unscale_ ran before Horovod wrote the all-reduced (still scaled) gradients: 65536x too large
    for rank in old:
        assert rank["ratios"] == pytest.approx([2.0**16, 2.0**16], rel=1e-2), rank


LOG_STEP_BEHIND = r"""
import time, torch
import cyclone_kit as ck
from torch.overrides import TorchFunctionMode

class DeviceBehind(TorchFunctionMode):
    # Stands for a GPU 0.3 s behind the host: reading a loss (.item or .tolist) waits for the device to finish.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.tolist):
            time.sleep(0.3)
        return func(*args, **(kwargs or {}))

ck.init(log_every=2)
with DeviceBehind():
    for step in range(1, 5):
        ck.log_step(step, samples=8, loss=torch.tensor(float(step)))
ck.finish()
"""


def test_log_step_stops_the_window_clock_after_the_loss_sync(tmp_path: Path) -> None:
    """Issue 24 item 3: each window's time includes the wait for the device (the loss read); before, the
    clock was read first, so the first window measured only how far the host ran ahead (0.03 s
    instead of >= 0.15 s per step here) and every later one carried its predecessor's wait."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(LOG_STEP_BEHIND))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=RANK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [2, 4]
    assert all(s["step_time_s"] >= 0.15 for s in steps), steps  # 0.3 s of device wait per 2-step window


def test_run_refuses_more_ranks_than_gpus_before_making_a_run_dir(tmp_path: Path) -> None:
    """Likely item: `run --nodes 2` on a one-GPU box put both pretend nodes on cuda:0 (NCCL:
    "Duplicate GPU detected"); now it is one line, exit 2, and no half-made run directory."""
    from tests.helpers.cli import REPO, run_cli

    proc = run_cli("run", str(REPO / "jobs" / "smoke.toml"), "--nproc", "2", "--nodes", "2", "--runs-dir",
                   str(tmp_path / "runs"), env={"CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "Duplicate GPU" in proc.stderr and "HINT:" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.timeout(COMPILE_HANG_S + 60)
def test_fsdp_with_torch_compile_and_bf16_trains_through_the_runtime(tmp_path: Path) -> None:
    """FSDP2 + torch.compile (+ the bf16 MixedPrecisionPolicy) where torch allows it on the CPU: two
    gloo ranks through `cyclone-kit run` complete their steps and agree on the loss they log."""
    from tests.helpers.cli import REPO, run_cli

    # jobs/smoke.toml's pg_timeout_s (60 s) would fail a collective whose peer still compiles (a cold compile
    # may put the two ranks minutes apart under load): the process-group timeout is the hang guard's length.
    sets = ["train.strategy=fsdp", "train.compile=true", "train.precision=bf16", "train.steps=3", "train.log_every=1",
            "train.val_every_epochs=0", "checkpoint.every_steps=0", f"train.pg_timeout_s={COMPILE_HANG_S}"]
    argv = ["run", str(REPO / "jobs" / "smoke.toml"), "--nproc", "2", "--threads", "1", "--cpu", "--quiet",
            "--runs-dir", str(tmp_path / "runs")]
    for item in sets:
        argv += ["--set", item]
    proc = run_cli(*argv, timeout=COMPILE_HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start, end = recs[0], recs[-1]
    assert (start["strategy"], start["precision"], start["world_size"]) == ("fsdp", "bf16", 2)
    assert (end["kind"], end["status"], end["steps"]) == ("end", "completed", 3)
    assert [r["step"] for r in recs if r["kind"] == "step"] == [1, 2, 3]
