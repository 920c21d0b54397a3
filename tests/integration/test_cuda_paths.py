"""CUDA-path fixes of issue 16 that a CPU can show, in real processes: FSDP with channels_last
(gloo, 2 ranks), the torchrun agent forwarding the requeue signal, DataLoader workers that
survive SIGTERM and the requeue signal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import TIMEOUT_S, clean_env, free_port

FSDP_CHILD = r"""
import sys, datetime
import torch, torch.distributed as dist
from cyclone_kit.config.job import TrainConfig
from cyclone_kit.runtime.dist import DeviceChoice
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.dataparallel import place_model, wrap_model

rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
model = build_model("tiny_cnn", 10, 32, 3)
cpu = DeviceChoice("cpu", None, "cpu", "gloo")
if mode == "old":  # what train() did before: every parameter channels_last, then fully_shard
    model = model.to(memory_format=torch.channels_last)
    try:
        wrap_model("fsdp", model, cpu, TrainConfig(), True)
    except Exception as e:
        print("OLD-ERROR", e)
else:
    model = place_model(model, torch.device("cpu"), "fsdp", True)
    wrapped = wrap_model("fsdp", model, cpu, TrainConfig(), True)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(rank)).to(memory_format=torch.channels_last)
    y = torch.arange(8) % 10
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("OK", float(loss))
dist.barrier()
dist.destroy_process_group()
"""


def _two_ranks(script: str, *args: str) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(port), *args], env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=TIMEOUT_S)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, f"rank {r}: {err}"
        outs.append(out)
    return outs


def test_fsdp_with_channels_last_forced_trains_on_gloo() -> None:
    """Item 2: channels_last on (the CUDA default) with FSDP; the old order crashed in fully_shard."""
    old = _two_ranks(FSDP_CHILD, "old")
    assert all("OLD-ERROR" in out and "non-contiguous" in out for out in old), old
    new = _two_ranks(FSDP_CHILD, "new")
    assert all(out.startswith("OK ") for out in new), new


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
    """Item 9: with the template's exports, SIGUSR2 to the torchrun agent reaches every worker
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
    """Item 10: SIGTERM to the rank's whole process group (what Slurm does to a step: the
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


HVD_CHILD = r"""
import json, sys
import torch
import horovod.torch as hvd
from cyclone_kit.runtime.engine.dataparallel import optimizer_step

mode, out = sys.argv[1], sys.argv[2]
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(64, 8)
start = {k: v.detach().clone() for k, v in model.named_parameters()}
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters(),
                               compression=hvd.Compression.fp16)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
g = torch.Generator().manual_seed(hvd.rank())
x, y = torch.randn(32, 64, generator=g), torch.randint(0, 8, (32,), generator=g)
loss = torch.nn.functional.cross_entropy(model(x), y)
# the gradient each rank would have without scaling, averaged over ranks: the update SGD(lr=1) must make
ref = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
mean = [hvd.allreduce(r, name=f"ref{i}") for i, r in enumerate(ref)]
scaler.scale(loss).backward()
if mode == "old":  # the engine before issue 16: GradScaler's step straight on Horovod's optimizer
    scaler.step(opt)
    scaler.update()
else:
    optimizer_step(opt, scaler, horovod=True)
ratios = [float(((start[n] - p.detach()).abs().sum() / m.abs().sum())) for (n, p), m in zip(model.named_parameters(), mean)]
json.dump({"ratios": ratios, "scale": scaler.get_scale()}, open(f"{out}-{hvd.rank()}.json", "w"))
"""


@pytest.mark.slow
def test_horovod_fp16_allreduce_with_a_grad_scaler_updates_by_the_unscaled_mean_gradient(tmp_path: Path) -> None:
    """Item 3, Horovod on CPU (gloo, 2 ranks): loss scale 65536 and fp16 compression; with
    synchronize -> unscale_ -> step under skip_synchronize, the SGD(lr=1) update equals the
    ranks' mean unscaled gradient on both ranks (the old order gives a wrong update)."""
    import json
    import os

    from tests.helpers.ranks import horovod_missing

    missing = horovod_missing()
    if missing:
        pytest.skip(f"Horovod not importable: {missing}")
    child = tmp_path / "child.py"
    child.write_text(HVD_CHILD)
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    env = {**clean_env(), "HOROVOD_GLOO_TIMEOUT_SECONDS": "60", "PYTHONPATH": str(Path(__file__).parents[2])}
    results = {}
    for mode in ("new", "old"):
        cmd = [sys.executable, horovodrun, "--gloo", "--start-timeout", "60", "-np", "2", "-H", "localhost:2",
               "--network-interfaces", "lo", sys.executable, str(child), mode, str(tmp_path / mode)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[mode] = [json.loads((tmp_path / f"{mode}-{r}.json").read_text()) for r in range(2)]
    for rank in results["new"]:
        assert rank["ratios"] == pytest.approx([1.0, 1.0], rel=2e-3), rank  # fp16 rounding of the all-reduce
    assert results["new"][0] == results["new"][1]
    print("old order, update / mean gradient:", [r["ratios"] for r in results["old"]], os.linesep)
    # before: unscale_ ran before Horovod wrote the all-reduced (still scaled) gradients: 65536x too large
    for rank in results["old"]:
        assert rank["ratios"] == pytest.approx([2.0**16, 2.0**16], rel=1e-2), rank


STAGES_CHILD = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.engine.pipeline import LossScale, to_cpu
from cyclone_kit.runtime.engine.dataparallel import gather_to_main

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
p = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([p], lr=1.0)
scaler = LossScale("cpu", init_scale=8.0, distributed=True)
p.grad = torch.full((4,), float("inf")) if rank == 1 else torch.full((4,), 8.0)  # only stage 1 overflows
first = float(scaler.step(opt))  # 1.0: skipped
p.grad = torch.full((4,), 4.0)
second = float(scaler.step(opt))
env = DistEnv(rank=rank, world_size=2)
gathered = gather_to_main(to_cpu({"rank": rank, "state": opt.state_dict()}), env, True)
with open(f"{out}-{rank}.json", "w") as f:
    json.dump({"first": first, "second": second, "scale": float(scaler.scale), "p": p.tolist(),
               "gathered": [g["rank"] for g in gathered]}, f)
dist.barrier()
dist.destroy_process_group()
# torch 2.14 sometimes aborts in interpreter teardown after gloo groups ("terminate called without an
# active exception"), as cyclone_kit.runtime.launch notes; the result is written, so leave without teardown.
import os
os._exit(0)
"""


def test_pipeline_stages_agree_on_skipping_an_fp16_step_and_only_rank_0_gathers_the_checkpoint(
        tmp_path: Path) -> None:
    """Items 1 and 6 on 2 gloo ranks: an inf gradient on one stage makes every stage skip the step
    and halve the scale; the checkpoint gather hands the stages' states to rank 0 only."""
    import json

    _two_ranks(STAGES_CHILD, str(tmp_path / "r"))
    r0, r1 = (json.loads((tmp_path / f"r-{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert (r["first"], r["second"], r["scale"]) == (1.0, 0.0, 4.0)  # skipped, then stepped
        assert r["p"] == [0.0, 0.0, 0.0, 0.0]  # only the second step: 1 - 4/4
    assert r0["gathered"] == [0, 1] and r1["gathered"] == []
