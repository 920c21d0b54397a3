"""CUDA-path fixes of issues 16 and 24 that a CPU can show, in real processes: FSDP with channels_last,
pipeline stages agreeing on an fp16 skip, FSDP2's MixedPrecisionPolicy (one pair of gloo ranks for the
three, ``gloo_pair``), the torchrun agent forwarding the requeue signal, DataLoader workers that survive
SIGTERM and the requeue signal. (Horovod's: tests/integration/test_gpu_readings.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.child_ranks import RANK_TIMEOUT_S, child_env, free_port
from tests.helpers.ranks import TIMEOUT_S, all_ok, clean_env, finish, popen_group

#: One pair of gloo ranks for the tests below that need 2 ranks of plain torch (issue 27: 2 rank starts,
#: were 8 in 4 runs), forked from one process that imported torch (ranks.popen_group: one import, not one per
#: rank; 6.9 -> ~3.5 CPU-s); each part uses its own model and ends with a barrier, and the results are one
#: JSON file per rank that each test reads its part of.
GLOO_PAIR = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from cyclone_kit.config.job import TrainConfig
from cyclone_kit.runtime.dist import DeviceChoice
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.dataparallel import gather_to_main, make_optimizer, place_model, wrap_model
from cyclone_kit.runtime.engine.pipeline import LossScale, to_cpu

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
cpu = DeviceChoice("cpu", None, "cpu", "gloo")
result = {}

# FSDP with channels_last: what train() did before (every parameter channels_last, then fully_shard) ...
torch.manual_seed(0)
model = build_model("tiny_cnn", 10, 32, 3).to(memory_format=torch.channels_last)
try:
    wrap_model("fsdp", model, cpu, TrainConfig(), True)
    result["fsdp_old_error"] = None
except Exception as e:
    result["fsdp_old_error"] = str(e)
dist.barrier()
# ... and now: place_model, then wrap_model; 2 steps on channels_last inputs
torch.manual_seed(0)
model = place_model(build_model("tiny_cnn", 10, 32, 3), torch.device("cpu"), "fsdp", True)
wrapped = wrap_model("fsdp", model, cpu, TrainConfig(), True)
opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(rank)).to(memory_format=torch.channels_last)
y = torch.arange(8) % 10
for _ in range(2):
    loss = F.cross_entropy(wrapped(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
result["fsdp_new_loss"] = float(loss)
dist.barrier()

# pipeline stages: only stage 1 overflows, every stage skips; the checkpoint gather goes to rank 0 only
p = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([p], lr=1.0)
scaler = LossScale("cpu", init_scale=8.0, distributed=True)
p.grad = torch.full((4,), float("inf")) if rank == 1 else torch.full((4,), 8.0)
first = float(scaler.step(opt))  # 1.0: skipped
p.grad = torch.full((4,), 4.0)
second = float(scaler.step(opt))
env = DistEnv(rank=rank, world_size=2)
gathered = gather_to_main(to_cpu({"rank": rank, "state": opt.state_dict()}), env, True)
result["stages"] = {"first": first, "second": second, "scale": float(scaler.scale), "p": p.tolist(),
                    "gathered": [g["rank"] for g in gathered]}
dist.barrier()

# FSDP2 with a bf16 MixedPrecisionPolicy
torch.manual_seed(0)
tc = TrainConfig(strategy="fsdp", precision="bf16")
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
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(float(loss))
result["mixed"] = {"forward": sorted(set(seen)), "sharded": sorted({str(p.dtype) for p in model.parameters()}),
                   "losses": losses, "fused_error": fused_error}

with open(f"{out}-{rank}.json", "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
# torch 2.14 sometimes aborts in interpreter teardown after gloo groups ("terminate called without an
# active exception"), as cyclone_kit.runtime.launch notes; the result is written, so leave without teardown.
os._exit(0)
"""


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results of GLOO_PAIR (both ranks exited 0)."""
    root = tmp_path_factory.mktemp("gloo-pair")
    script, out, port = root / "pair.py", root / "r", str(free_port())
    script.write_text(GLOO_PAIR)
    all_ok(finish(popen_group([([str(script), str(r), port, str(out)], child_env()) for r in range(2)]),
                  timeout=RANK_TIMEOUT_S))
    return [json.loads(Path(f"{out}-{r}.json").read_text()) for r in range(2)]


def test_fsdp_with_channels_last_forced_trains_on_gloo(gloo_pair: list[dict[str, Any]]) -> None:
    """Issue 16 item 2: channels_last on (the CUDA default) with FSDP; the old order crashed in fully_shard."""
    assert all(r["fsdp_old_error"] and "non-contiguous" in r["fsdp_old_error"] for r in gloo_pair), gloo_pair
    assert all(isinstance(r["fsdp_new_loss"], float) for r in gloo_pair), gloo_pair


def test_pipeline_stages_agree_on_skipping_an_fp16_step_and_only_rank_0_gathers_the_checkpoint(
        gloo_pair: list[dict[str, Any]]) -> None:
    """Issue 16 items 1 and 6 on 2 gloo ranks: an inf gradient on one stage makes every stage skip the
    step and halve the scale; the checkpoint gather hands the stages' states to rank 0 only."""
    r0, r1 = (r["stages"] for r in gloo_pair)
    for r in (r0, r1):
        assert (r["first"], r["second"], r["scale"]) == (1.0, 0.0, 4.0)  # skipped, then stepped
        assert r["p"] == [0.0, 0.0, 0.0, 0.0]  # only the second step: 1 - 4/4
    assert r0["gathered"] == [0, 1] and r1["gathered"] == []


@pytest.mark.slow
def test_fsdp2_computes_in_bf16_and_keeps_fp32_shards(gloo_pair: list[dict[str, Any]]) -> None:
    """Issue 24: FSDP2 gets a MixedPrecisionPolicy (bf16 here; fp16 below cc 8.0 on CUDA), so the
    unsharded parameters (and the all-gathers and reduce-scatters) are bf16 while the shards and
    the optimizer stay fp32 (fp32 runs keep no policy: tests/unit). Fused SGD is refused by DTensor."""
    for r in (rank["mixed"] for rank in gloo_pair):
        assert r["forward"] == ["torch.bfloat16"] and r["sharded"] == ["torch.float32"], r
        assert all(loss == loss for loss in r["losses"]), r  # finite training
        assert r["fused_error"] and "_fused_sgd_" in r["fused_error"], r


WORKER = r"""
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = os.environ["RANK"]
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
(out / f"ready-{rank}").write_text(os.environ.get("OMP_NUM_THREADS", ""))
while not got:
    time.sleep(0.05)
(out / f"got-{rank}").write_text("USR2")
"""


def _launch_lines(profile: str = "local") -> str:
    """The lines the torchrun template runs before its srun (exports), from a real render of a
    node with 2 GPUs (2 workers)."""
    from cyclone_kit.config.job import spec_from_dict
    from cyclone_kit.config.profile import load_profile
    from cyclone_kit.config.validate import resolve
    from cyclone_kit.submit.render import render_script

    spec = spec_from_dict({"name": "t", "resources": {"profile": profile, "partition": "gpu", "nodes": 1,
                                                       "gpus_per_node": 2, "launcher": "torchrun"}})
    text = render_script(resolve(spec, load_profile(profile)), "/tmp/run", python=sys.executable,
                         environ={"CYCLONE_KIT_TEMPLATES": "/nonexistent"})
    launch = text[text.index("# One torchrun agent per node"):text.index("srun ")]
    return "\n".join(line for line in launch.splitlines() if not line.startswith("#"))


def test_torchrun_agent_forwards_the_requeue_signal_to_its_workers(tmp_path: Path) -> None:
    """Issue 16 item 9: with the template's exports, SIGUSR2 to the torchrun agent reaches every worker
    (the agent's default signal list would let USR2 kill the agent and orphan the workers);
    item 12: each worker's OMP_NUM_THREADS is the task's CPUs / workers."""
    import os
    import signal
    import time

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    exports = _launch_lines()
    assert "SIGUSR2" in exports
    cmd = (f"{exports}\nexec {sys.executable} -m torch.distributed.run --standalone --nproc-per-node=2 "
           f"{worker} {tmp_path}")
    env = {**clean_env(), "SLURM_CPUS_PER_TASK": "4"}
    agent = subprocess.Popen(["bash", "-c", cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all((tmp_path / f"ready-{r}").exists() for r in range(2)):
            assert agent.poll() is None, agent.communicate()
            assert time.monotonic() < deadline, "workers never started"
            time.sleep(0.1)
        os.kill(agent.pid, signal.SIGUSR2)
        _, err = agent.communicate(timeout=TIMEOUT_S)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert all((tmp_path / f"got-{r}").read_text() == "USR2" for r in range(2)), err
    assert [(tmp_path / f"ready-{r}").read_text() for r in range(2)] == ["2", "2"]


def _png_tree(root: Path, classes: int = 2, per_class: int = 16) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / "train" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.png")


@pytest.mark.slow
def test_imagefolder_run_with_workers_checkpoints_when_slurm_signals_every_process(tmp_path: Path) -> None:
    """Issue 16 item 10: SIGTERM to the rank's whole process group (what Slurm does to a step: the
    DataLoader workers get it too) ends the run "preempted" with a checkpoint, not with
    "DataLoader worker ... killed by signal: Terminated"."""
    import json
    import os
    import signal

    from cyclone_kit.backends.srun_emulator import LAUNCH_FILE
    from tests.helpers.cli import REPO
    from tests.helpers.ranks import alive, records
    from tests.helpers.slurm_jobs import wait_for

    data = tmp_path / "data"
    _png_tree(data)
    sets = ["train.dataset=imagefolder", f"train.data_dir={data}", "train.image_size=16", "train.batch_size=4",
            "train.num_workers=2", "train.steps=100000", "train.log_every=1", "train.val_every_epochs=0",
            "checkpoint.every_steps=0", "checkpoint.requeue=false", "resources.ntasks_per_node=1"]
    argv = [sys.executable, "-m", "cyclone_kit", "run", str(REPO / "jobs" / "smoke.toml"), "--nproc", "1",
            "--threads", "1", "--quiet", "--runs-dir", str(tmp_path / "runs")]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**clean_env(), "CUDA_VISIBLE_DEVICES": ""})
    rank_pid = None
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("run dir: "), first + proc.stderr.read()  # type: ignore[union-attr]
        run_dir = Path(first.split(": ", 1)[1].strip())
        wait_for((run_dir / LAUNCH_FILE).is_file, TIMEOUT_S, "launch.json")
        rank_pid = json.loads((run_dir / LAUNCH_FILE).read_text())["ranks"][0]["pid"]
        wait_for(lambda: len(records(run_dir, "step")) >= 3, TIMEOUT_S, "3 logged steps (workers running)")
        workers = [int(p) for t in Path(f"/proc/{rank_pid}/task").iterdir()
                   for p in (t / "children").read_text().split()]
        assert len(workers) >= 2, workers  # the DataLoader's workers are the rank's children
        os.killpg(rank_pid, signal.SIGTERM)  # the rank and its workers, as Slurm signals a step
        code = proc.wait(timeout=TIMEOUT_S)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        if rank_pid is not None and alive(rank_pid):
            os.killpg(rank_pid, signal.SIGKILL)
    ends = records(run_dir, "end")
    rank_err = (run_dir / "logs" / "rank-0.err").read_text()[-2000:]
    assert code == 0 and ends and ends[-1]["status"] == "preempted", (code, ends, err, rank_err)
    assert list((run_dir / "checkpoints").glob("*.pt")), "no checkpoint written on the stop"

