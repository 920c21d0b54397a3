"""CUDA-path fixes of issue 24 that a CPU can show, in real processes: Horovod with channels_last forced
(gloo, 2 ranks under horovodrun), FSDP2 with a MixedPrecisionPolicy (gloo, 2 ranks), fused SGD where
it is valid, and ck.log_step's clock read after the loss sync."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.child_ranks import RANK_TIMEOUT_S, child_env, run_child_ranks

#: Hang guard of the compile run (not a performance bound): a cold torch.compile of TinyCNN under FSDP
#: takes ~30-60 s per rank on a quiet 2-core machine, several minutes at a load of 40.
COMPILE_HANG_S = 1200

HVD_CHANNELS_LAST = r"""
import json, sys
import torch
import torch.nn.functional as F
import horovod.torch as hvd
from cyclone_kit.runtime.dist import DeviceChoice
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.dataparallel import make_optimizer, place_model, strategy_for, wrap_model
from cyclone_kit.config.job import TrainConfig

mode, out = sys.argv[1], sys.argv[2]
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(hvd.rank())  # a different start on each rank: the broadcast must make them one
model = build_model("tiny_cnn", 10, 32, 3)
cpu, tc = DeviceChoice("cpu", None, "cpu", "gloo"), TrainConfig(strategy="horovod")
result = {}
if mode == "old":  # what train() did before: every conv weight channels_last, then Horovod's broadcast
    model = model.to(memory_format=torch.channels_last)
    try:
        wrap_model("horovod", model, cpu, tc, True)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
else:
    model = place_model(model, torch.device("cpu"), "horovod", True)  # channels_last forced, as on CUDA
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
    result.update(loss=float(loss), same=bool(torch.equal(both[0], both[1])),
                  out_channels_last=bool(model.features[0](x).is_contiguous(memory_format=torch.channels_last)))
json.dump(result, open(f"{out}-{hvd.rank()}.json", "w"))
"""


@pytest.mark.slow
def test_horovod_trains_with_channels_last_inputs_where_channels_last_weights_failed(tmp_path: Path) -> None:
    """Item 1: with channels_last on (the CUDA default), the old placement made Horovod's first
    broadcast raise "Tensor is required to be contiguous." (on one rank at least: the other may see
    Horovod shut down by it); now the weights stay contiguous, the convolutions still run
    channels_last, and 3 DistributedOptimizer steps leave both ranks equal."""
    try:
        import horovod.torch  # noqa: F401
    except Exception as exc:
        pytest.skip(f"Horovod not importable ({type(exc).__name__}: {exc}); build it with make horovod")
    child = tmp_path / "child.py"
    child.write_text(HVD_CHANNELS_LAST)
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    env = child_env(HOROVOD_GLOO_TIMEOUT_SECONDS="120")
    results = {}
    for mode in ("old", "new"):
        cmd = [sys.executable, horovodrun, "--gloo", "--start-timeout", "120", "-np", "2", "-H", "localhost:2",
               "--network-interfaces", "lo", sys.executable, str(child), mode, str(tmp_path / mode)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[mode] = [json.loads((tmp_path / f"{mode}-{r}.json").read_text()) for r in range(2)]
    # Horovod's first rank to raise shuts Horovod down: the other may see that shutdown, not the cause.
    errors = [r.get("error", "") for r in results["old"]]
    assert any("Tensor is required to be contiguous" in e for e in errors), errors
    assert all("Tensor is required to be contiguous" in e or e.startswith("HorovodInternalError") for e in errors), errors
    for r in results["new"]:
        assert r["same"] and r["out_channels_last"] and r["loss"] == r["loss"], r  # equal ranks, NHWC, not NaN


FSDP_MIXED = r"""
import datetime, json, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from cyclone_kit.runtime.dist import DeviceChoice
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.dataparallel import make_optimizer, place_model, wrap_model
from cyclone_kit.config.job import TrainConfig

rank, port, precision, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
cpu, tc = DeviceChoice("cpu", None, "cpu", "gloo"), TrainConfig(strategy="fsdp", precision=precision)
model = wrap_model("fsdp", place_model(build_model("tiny_cnn", 10, 32, 3), torch.device("cpu"), "fsdp", True), cpu, tc, True)
seen = []
model.features[0].register_forward_pre_hook(lambda m, a: seen.append(str(m.weight.dtype)))
try:  # fused SGD on FSDP2's DTensor parameters (why use_fused_sgd says no to FSDP)
    fused = make_optimizer(model, 0.1, tc, fused=True)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)).float(), torch.arange(2)).backward()
    fused.step()
    fused_error = None
except NotImplementedError as e:
    fused_error = str(e)
model.zero_grad(set_to_none=True)
opt = make_optimizer(model, 0.1, tc, fused=False)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
losses = []
for _ in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(float(loss))
sharded = sorted({str(p.dtype) for p in model.parameters()})
json.dump({"forward": sorted(set(seen)), "sharded": sharded, "losses": losses, "fused_error": fused_error},
          open(f"{out}-{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp2_computes_in_bf16_and_keeps_fp32_shards(tmp_path: Path) -> None:
    """Likely item: FSDP2 gets a MixedPrecisionPolicy (bf16 here; fp16 below cc 8.0 on CUDA), so the
    unsharded parameters (and the all-gathers and reduce-scatters) are bf16 while the shards and
    the optimizer stay fp32 (fp32 runs keep no policy: tests/unit). Fused SGD is refused by DTensor."""
    run_child_ranks(FSDP_MIXED, 2, "bf16", str(tmp_path / "r"))
    for r in (json.loads((tmp_path / f"r-{k}.json").read_text()) for k in range(2)):
        assert r["forward"] == ["torch.bfloat16"] and r["sharded"] == ["torch.float32"], r
        assert all(loss == loss for loss in r["losses"]), r  # finite training
        assert r["fused_error"] and "_fused_sgd_" in r["fused_error"], r


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
    """Item 3: each window's time includes the wait for the device (the loss read); before, the
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
