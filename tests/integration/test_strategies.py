"""Strategies other than DDP, on 2 CPU ranks (gloo, 1 thread each): FSDP, the pipeline split, Horovod.

The ranks are real ``python -m cyclone_kit.runtime`` processes (helpers from test_ddp); every
wait has a timeout. Same data, seed and steps under each strategy, so the losses must agree.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cyclone_kit.runtime import checkpoint as ck
from tests.helpers.ranks import final_params, finish, horovod_missing, records, run_ranks, start_ranks, write_spec

#: Hang guard (not a performance bound) for the module's reference runs: 6 ranks at once on 2 cores
#: took 51 s on this machine under load (~9); >= 10x an idle run.
RUNS_HANG_S = 600
#: pytest-timeout of every test here: the first one also pays for the reference runs, the Horovod
#: ones run horovodrun twice (each under run_horovodrun's 240 s guard).
TEST_TIMEOUT_S = 900

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TEST_TIMEOUT_S)]

#: 640 samples, batch 32 x 2 ranks: 10 optimizer steps per epoch, 12 steps cross one epoch boundary.
COMMON = dict(batch_size=32, log_every=1, synthetic_samples=640, steps=12, val_samples=128)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("strategies")
    runs = {name: base / name for name in ("ddp", "fsdp", "pipeline")}
    for name, run in runs.items():
        write_spec(run, strategy=name, **COMMON)
    # The pipeline has no data parallelism: each of its 2 stages sees the whole batch of 64.
    write_spec(runs["pipeline"], strategy="pipeline", microbatches=4, **{**COMMON, "batch_size": 64})
    # every_steps=10 in smoke.toml: checkpoints at step 10 and the final 12.
    procs = start_ranks(runs["ddp"], 2) + start_ranks(runs["fsdp"], 2) + start_ranks(runs["pipeline"], 2)
    for i, (code, out, err) in enumerate(finish(procs, timeout=RUNS_HANG_S)):
        assert code == 0, f"process {i} exited {code}\n{out}\n{err}"
    return runs


def test_fsdp_and_ddp_reach_the_same_loss(runs: dict[str, Path]) -> None:
    ddp = [r["loss"] for r in records(runs["ddp"], "step")]
    fsdp = [r["loss"] for r in records(runs["fsdp"], "step")]
    assert len(ddp) == len(fsdp) == 12
    diff = max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True))
    print(f"ddp vs fsdp, 12 steps x 2 ranks: max |loss difference| {diff:.2e}; final {ddp[-1]:.5f} / {fsdp[-1]:.5f}")
    assert fsdp == pytest.approx(ddp, rel=1e-3, abs=1e-4)
    assert ddp[-1] < ddp[0]  # it trained
    start = records(runs["fsdp"], "start")[0]
    assert start["strategy"] == "fsdp" and start["world_size"] == 2
    p_ddp, p_fsdp = final_params(runs["ddp"]), final_params(runs["fsdp"])
    assert set(p_ddp) == set(p_fsdp)  # the FSDP checkpoint holds full, unsharded tensors by the same names
    for name in p_ddp:
        torch.testing.assert_close(p_fsdp[name], p_ddp[name], rtol=1e-3, atol=1e-4, msg=f"parameter {name}")


def test_fsdp_checkpoint_resumes_on_the_uninterrupted_trajectory(runs: dict[str, Path], tmp_path: Path) -> None:
    """A new run dir holding only the step-10 FSDP checkpoint resumes at 10 and ends like the full run."""
    src = runs["fsdp"]
    run = tmp_path / "fsdp-resume"
    shutil.copy(src / "spec.json", (run.mkdir() or run) / "spec.json")
    (run / "checkpoints").mkdir()
    ten = ck.checkpoint_path(src / "checkpoints", 10)
    assert ten.is_file(), sorted(p.name for p in (src / "checkpoints").iterdir())
    shutil.copy(ten, run / "checkpoints" / ten.name)
    results = run_ranks(run, 2)
    assert "resumed from" in results[0][1] and "at step 10" in results[0][1]
    resumed = {r["step"]: r["loss"] for r in records(run, "step")}
    full = {r["step"]: r["loss"] for r in records(src, "step")}
    assert sorted(resumed) == [11, 12]
    assert [resumed[s] for s in (11, 12)] == pytest.approx([full[s] for s in (11, 12)], rel=1e-5, abs=1e-6)
    p_full, p_resumed = final_params(src), final_params(run)
    for name in p_full:
        torch.testing.assert_close(p_resumed[name], p_full[name], rtol=1e-5, atol=1e-6, msg=f"parameter {name}")



def test_fsdp_sharded_checkpoint_saves_shards_per_rank_and_resumes(runs: dict[str, Path], tmp_path: Path) -> None:
    """checkpoint.sharded=true: every rank writes its shards with torch.distributed.checkpoint into
    ckpt-N.dcp/ (keep=2 prunes old ones); training is unchanged and a copy of step 10 resumes exactly."""
    import json

    run = tmp_path / "fsdp-dcp"
    write_spec(run, strategy="fsdp", **COMMON)
    spec = json.loads((run / "spec.json").read_text())
    spec["checkpoint"].update(sharded=True, every_steps=5)  # checkpoints at 5, 10 and 12; keep=2
    (run / "spec.json").write_text(json.dumps(spec))
    run_ranks(run, 2)
    losses = [r["loss"] for r in records(run, "step")]
    assert losses == [r["loss"] for r in records(runs["fsdp"], "step")]
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "ckpt-000000010.dcp", "ckpt-000000010.pt", "ckpt-000000012.dcp", "ckpt-000000012.pt"]
    assert len(list((folder / "ckpt-000000012.dcp").glob("*.distcp"))) == 2  # one shard file per rank
    state = ck.load_checkpoint(folder / "ckpt-000000012.pt")
    assert state["optimizer_format"] == "dcp" and state["model"] == {"dcp": "ckpt-000000012.dcp"}

    again = tmp_path / "fsdp-dcp-resume"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "spec.json", again / "spec.json")
    shutil.copy(folder / "ckpt-000000010.pt", again / "checkpoints")
    shutil.copytree(folder / "ckpt-000000010.dcp", again / "checkpoints" / "ckpt-000000010.dcp")
    assert "at step 10" in run_ranks(again, 2)[0][1]
    resumed = {r["step"]: r["loss"] for r in records(again, "step")}
    assert sorted(resumed) == [11, 12]
    assert [resumed[s] for s in (11, 12)] == pytest.approx(losses[10:], rel=1e-5, abs=1e-6)
    (code, _, err), = finish(start_ranks(again, 1))  # one process (no FSDP) cannot take the shards
    assert code != 0 and "holds FSDP shards" in err


# ------------------------------------------------------------------------ pipeline
PIPELINE_CHILD = r"""
import contextlib, sys, torch, torch.distributed as dist
from torch import nn
from cyclone_kit.runtime.models import build_model
from cyclone_kit.runtime.pipeline import pipeline_forward, pipeline_step, split_model, stage_input_shapes
rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
torch.manual_seed(0)
model = build_model(sys.argv[5], 10, 32, 3)
x, y = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(12) % 10
stages = split_model(model, world)
shapes = stage_input_shapes(stages, x)
stage = stages[rank]
stage.module.eval()  # BatchNorm (resnet18): running statistics, as the unsplit model in eval mode
logits = pipeline_forward(stage, x, 3, shapes[rank])
stage.module.train()
loss = pipeline_step(stage, x, y, int(sys.argv[6]), shapes[rank], nn.CrossEntropyLoss(), 1.0, contextlib.nullcontext)
grads = {f"{n}.{k}": p.grad for n, m in stage.layers if n for k, p in m.named_parameters()}
torch.save({"logits": logits, "loss": loss, "grads": grads, "layers": [n for n, _ in stage.layers]}, out)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("model", "microbatches"), [("tiny_cnn", 3), ("resnet18", 1)])
def test_pipelined_outputs_and_gradients_match_the_unsplit_model(model: str, microbatches: int,
                                                                 tmp_path: Path) -> None:
    """2 stages in 2 processes: the last stage's logits (3 micro-batches, eval mode) and every
    stage's gradients equal the unsplit model's on the same weights and batch. Gradients use 3
    micro-batches on the GroupNorm CNN; BatchNorm (resnet18) normalises per micro-batch, so
    its training-mode gradients match the whole batch only with 1 micro-batch."""
    import subprocess
    import sys

    from cyclone_kit.runtime.models import build_model
    from tests.helpers.ranks import TIMEOUT_S, clean_env, free_port

    port = free_port()
    outs = [tmp_path / f"stage{r}.pt" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", PIPELINE_CHILD, str(r), "2", str(port), str(outs[r]), model,
                               str(microbatches)],
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=TIMEOUT_S)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, f"stage {r}: {err}"
    first, last = (torch.load(o, weights_only=True) for o in outs)
    assert first["logits"] is None and first["layers"] and last["layers"]  # two non-empty stages
    torch.manual_seed(0)
    reference = build_model(model, 10, 32, 3)
    x, y = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(12) % 10
    reference.eval()
    with torch.no_grad():
        expected = reference(x)
    torch.testing.assert_close(last["logits"], expected, rtol=1e-5, atol=1e-5)
    reference.train()
    loss = torch.nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    assert float(last["loss"]) == pytest.approx(float(loss.detach()), rel=1e-5)
    grads = {**first["grads"], **last["grads"]}
    named = dict(reference.named_parameters())
    assert set(grads) == set(named)
    for name, g in grads.items():
        torch.testing.assert_close(g, named[name].grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def test_pipeline_run_through_the_engine_trains_like_ddp(runs: dict[str, Path]) -> None:
    """Batch 64 through 2 stages x 4 micro-batches follows DDP with 2 ranks x 32 (the same
    global batch, LR and data order); metrics contract and a full-model checkpoint."""
    ddp = [r["loss"] for r in records(runs["ddp"], "step")]
    pipe = [r["loss"] for r in records(runs["pipeline"], "step")]
    diff = max(abs(a - b) for a, b in zip(ddp, pipe, strict=True))
    print(f"ddp vs pipeline, 12 steps: max |loss difference| {diff:.2e}; final {ddp[-1]:.5f} / {pipe[-1]:.5f}")
    assert len(pipe) == 12 and pipe == pytest.approx(ddp, rel=2e-3, abs=2e-4)
    recs = records(runs["pipeline"])
    start, end = recs[0], recs[-1]
    assert start["kind"] == "start" and start["strategy"] == "pipeline" and start["world_size"] == 2
    assert start["stages"] == 2 and start["microbatches"] == 4 and start["global_batch_size"] == 64
    assert end["kind"] == "end" and end["status"] == "completed" and end["steps"] == 12
    assert [e["val_accuracy"] is not None for e in records(runs["pipeline"], "epoch")] == [True, True]
    for rank in (0, 1):
        assert (runs["pipeline"] / "ranks" / f"rank-{rank:05d}.json").is_file()
    p_ddp, p_pipe = final_params(runs["ddp"]), final_params(runs["pipeline"])
    assert set(p_pipe) == set(p_ddp)  # the unsplit model's names: a DDP run can load it
    for name in p_ddp:
        torch.testing.assert_close(p_pipe[name], p_ddp[name], rtol=1e-2, atol=2e-3, msg=f"parameter {name}")


def test_pipeline_checkpoint_resumes_on_the_uninterrupted_trajectory(runs: dict[str, Path], tmp_path: Path) -> None:
    src = runs["pipeline"]
    run = tmp_path / "pipeline-resume"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(src / "spec.json", run / "spec.json")
    ten = ck.checkpoint_path(src / "checkpoints", 10)
    shutil.copy(ten, run / "checkpoints" / ten.name)
    results = run_ranks(run, 2)
    assert "at step 10" in results[0][1]
    resumed = {r["step"]: r["loss"] for r in records(run, "step")}
    full = {r["step"]: r["loss"] for r in records(src, "step")}
    assert sorted(resumed) == [11, 12]
    assert [resumed[s] for s in (11, 12)] == pytest.approx([full[s] for s in (11, 12)], rel=1e-5, abs=1e-6)



# ------------------------------------------------------------------------ analysis
def test_one_report_over_ddp_fsdp_and_pipeline_runs_groups_them_by_strategy(runs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    import pandas as pd

    from cyclone_kit.analysis.report import write_report

    out = tmp_path / "report"
    write_report([runs["ddp"], runs["fsdp"], runs["pipeline"]], out)
    table = pd.read_csv(out / "scaling.csv")
    assert sorted(table["strategy"]) == ["ddp", "fsdp", "pipeline"]
    assert (table["world_size"] == 2).all() and (table["samples_per_s"] > 0).all()
    md = (out / "report.md").read_text()
    for strategy in ("ddp", "fsdp", "pipeline"):
        assert f"Scaling table ({strategy})" in md


# ------------------------------------------------------------------------ Horovod (when built)


#: horovodrun's --start-timeout and HOROVOD_GLOO_TIMEOUT_SECONDS (hang guards, not performance bounds):
#: the engine's workers start in ~8 s here, so 150 s leaves a machine 5x slower room.
HVD_START_S = 150


def run_horovodrun(run_dir: Path, np: int = 2, timeout: float = 240) -> str:
    """The engine on ``run_dir`` under ``horovodrun --gloo`` (the whole process tree killed on timeout)."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    from cyclone_kit.runtime.hvd import horovodrun_command
    from tests.helpers.ranks import REPO, clean_env

    cmd = horovodrun_command(str(run_dir), np, python=sys.executable)
    cmd = [sys.executable, str(Path(sys.executable).parent / "horovodrun"), *cmd[1:2], "--start-timeout", str(HVD_START_S),
           *cmd[2:]]
    env = {**clean_env(), "HOROVOD_GLOO_TIMEOUT_SECONDS": str(HVD_START_S), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import psutil  # a Horovod dependency

        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"horovodrun did not finish in {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"horovodrun exited {proc.returncode}:\n{out[-4000:]}"
    return out


def test_horovod_trains_like_ddp_and_resumes(runs: dict[str, Path], tmp_path: Path) -> None:
    """horovodrun --gloo, 2 ranks x batch 32: the DDP losses; a copy of its step-10 checkpoint resumes."""
    missing = horovod_missing()
    if missing:
        pytest.skip(f"Horovod not importable: {missing}")
    run = tmp_path / "horovod"
    write_spec(run, strategy="horovod", **COMMON)
    out = run_horovodrun(run)
    ddp = [r["loss"] for r in records(runs["ddp"], "step")]
    hvd = [r["loss"] for r in records(run, "step")]
    diff = max(abs(a - b) for a, b in zip(ddp, hvd, strict=True))
    print(f"ddp vs horovod, 12 steps x 2 ranks: max |loss difference| {diff:.2e}; final {ddp[-1]:.5f} / {hvd[-1]:.5f}")
    assert len(hvd) == 12 and hvd == pytest.approx(ddp, rel=2e-3, abs=2e-4)
    start, end = records(run, "start")[0], records(run, "end")[-1]
    assert (start["strategy"], start["world_size"], start["launcher"]) == ("horovod", 2, "horovodrun"), out[-2000:]
    assert end["status"] == "completed" and end["steps"] == 12
    assert sorted(p.name for p in (run / "ranks").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    p_ddp, p_hvd = final_params(runs["ddp"]), final_params(run)
    for name in p_ddp:
        torch.testing.assert_close(p_hvd[name], p_ddp[name], rtol=1e-2, atol=2e-3, msg=f"parameter {name}")

    again = tmp_path / "horovod-resume"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "spec.json", again / "spec.json")
    ten = ck.checkpoint_path(run / "checkpoints", 10)
    shutil.copy(ten, again / "checkpoints" / ten.name)
    assert "at step 10" in run_horovodrun(again)
    resumed = {r["step"]: r["loss"] for r in records(again, "step")}
    full = {r["step"]: r["loss"] for r in records(run, "step")}
    assert sorted(resumed) == [11, 12]
    assert [resumed[s] for s in (11, 12)] == pytest.approx([full[s] for s in (11, 12)], rel=1e-5, abs=1e-6)


def test_horovod_fp16_allreduce_with_accumulation_stays_close_to_ddp(runs: dict[str, Path], tmp_path: Path) -> None:
    """2 ranks x 16 x 2 accumulated passes (backward_passes_per_step=2), fp16 gradient compression:
    the same global batch of 64, so the DDP losses up to fp16 rounding of the gradients."""
    missing = horovod_missing()
    if missing:
        pytest.skip(f"Horovod not importable: {missing}")
    run = tmp_path / "horovod-fp16"
    write_spec(run, strategy="horovod", fp16_allreduce=True, grad_accum=2, **{**COMMON, "batch_size": 16})
    run_horovodrun(run)
    ddp = [r["loss"] for r in records(runs["ddp"], "step")]
    hvd = [r["loss"] for r in records(run, "step")]
    diff = max(abs(a - b) for a, b in zip(ddp, hvd, strict=True))
    print(f"ddp vs horovod fp16 allreduce + grad_accum 2: max |loss difference| {diff:.2e}")
    assert records(run, "start")[0]["grad_accum"] == 2
    assert len(hvd) == 12 and hvd == pytest.approx(ddp, rel=2e-2, abs=2e-3)


def test_horovod_ranks_from_another_launcher_meet_through_the_gloo_rendezvous(runs: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """Two torchrun-style processes (no horovodrun, a Gloo-only Horovod): cyclone_kit runs Horovod's
    rendezvous itself, so they form one Horovod world of 2 and train like DDP (as srun's tasks do)."""
    missing = horovod_missing()
    if missing:
        pytest.skip(f"Horovod not importable: {missing}")
    run = tmp_path / "hvd-torchrun-style"
    write_spec(run, strategy="horovod", **COMMON)
    run_ranks(run, 2)
    start, end = records(run, "start")[0], records(run, "end")[-1]
    assert (start["strategy"], start["world_size"], start["launcher"]) == ("horovod", 2, "torchrun")
    assert end["status"] == "completed" and end["steps"] == 12
    ddp = [r["loss"] for r in records(runs["ddp"], "step")]
    hvd = [r["loss"] for r in records(run, "step")]
    assert len(hvd) == 12 and hvd == pytest.approx(ddp, rel=2e-3, abs=2e-4)
