"""Issue 28's CPU matrix: every strategy's GPU configuration on real engine ranks (gloo, 1 thread each).

Each case is a run of ``python -m cyclone_kit.runtime`` through tests/helpers/gpu_choices_rank.py, which
makes on the CPU the choices the engine makes on CUDA (fused SGD under DDP and in the pipeline, channels_last, the GPU's
precision with a CPU GradScaler, a forced overflow): resnet18 (20 BatchNorm layers) at 16 px, 3 steps,
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (DDP at 2 ranks: INFO, see ``DDP_DEBUG``). The fp16 cases have a loss
scaler: their step 2 overflows (rank 0's loss under DDP and Horovod, one element of one rank's gradient
shard under FSDP, one of stage 0's gradients in the pipeline), segment 1 ends with the checkpoint of
step 2 and segment 2 resumes it to step 3. Every rank of both segments is forked up front, from one
process per ``TORCH_DISTRIBUTED_DEBUG`` level, and waits at the driver's gate (its stdin) until the
module's fixture lets its group go: the cases of a segment run side by side, at most ``RANKS_AT_ONCE``
ranks at a time; each test reads its own run. One combination is
refused by the engine before its first step, with one error line: DDP on gloo under DETAIL, which torch
2.14's DDP constructor turns into a segfault (the refusal does not depend on the model: that case builds
tiny_cnn, not resnet18, and so skips torchvision's import). Every wait has a hang guard; no verdict reads
a clock.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.gpu_choices_rank import CHOICES_VAR, GATE_VAR, OVERFLOW_VAR
from tests.helpers.ranks import (
    REPO,
    final_params,
    finish,
    free_port,
    horovod_missing,
    per_run,
    popen_group,
    rank_envs,
    records,
    write_spec,
)

#: Hang guard of one case's segment (not a performance bound): ~10-30 s here on 2 busy cores.
HANG_S = 400
#: Ranks running at once (all are forked up front; the others wait at the driver's gate): the ranks (29, 19 in
#: segment 2) all run at once cost ~10% more CPU seconds than in small groups on 2 cores (227 vs 205 CPU-s for
#: 27, issue 27); the cases are independent, so only the wall time depends on it.
RANKS_AT_ONCE = 4
DRIVER = REPO / "tests" / "helpers" / "gpu_choices_rank.py"
#: torch 2.14's DistributedDataParallel segfaults in its constructor (``Logger.set_construction_data_and_log``)
#: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on gloo with resnet18 (stock DDP, outside cyclone_kit: most
#: starts, not all); the engine refuses it (the ``-refused`` case), the 2-rank DDP case that trains runs
#: under INFO, and DDP under DETAIL is left to a GPU (NCCL).
DDP_DEBUG = "INFO"

#: Step 2 overflows (a step after a good one), the checkpoint of step 2 is resumed for step 3 (issue 27: 3
#: steps, not 4; the resumed segment's one step shows the restored scale and a step that is not skipped).
STEPS, CKPT_STEP = 3, 2
#: resnet18 at 16 px (its small-image stem: layer4 at 2x2, 8 values per channel in a BatchNorm of a
#: 2-sample micro-batch), one epoch = 3 steps. Not 8 px: layer4 at 1x1 normalises 2 values per channel to
#: +-1, and bf16's rounding flips them: FSDP's and DDP's bf16 losses parted by 0.15-0.3 at steps 2-3 there
#: (16 px: at most 0.017, issue 27), too far for the comparison below; 8 px saved ~1 CPU-s a case.
BASE = dict(model="resnet18", image_size=16, batch_size=2, steps=STEPS, log_every=1, val_samples=4, warmup_steps=0,
            lr=0.05, channels_last=True, pg_timeout_s=HANG_S)
PIPE = dict(pipeline_stages=2, microbatches=2, batch_size=4)


@dataclass(frozen=True)
class Case:
    """One combination: strategy, world, precision, the forced CUDA choices; ``resume``: an fp16 case."""

    strategy: str
    world: int
    precision: str
    choices: tuple[str, ...]
    train: dict[str, Any] = field(default_factory=dict)
    debug: str = "DETAIL"
    refused: str | None = None  # the error line every rank must stop with, before its first step

    @property
    def resume(self) -> bool:
        return self.precision == "fp16" and self.refused is None


CASES = {
    "ddp-w1-bf16-fused-nhwc": Case("ddp", 1, "bf16", ("fused", "channels_last", "precision")),
    "ddp-w2-fp16-fused-nhwc-overflow-resume": Case("ddp", 2, "fp16", ("fused", "channels_last", "precision"),
                                                   debug=DDP_DEBUG),
    "ddp-w2-fp16-fused-nhwc-detail-refused": Case(
        "ddp", 2, "fp16", ("fused", "channels_last", "precision"), dict(model="tiny_cnn"),
        refused="TORCH_DISTRIBUTED_DEBUG=DETAIL with train.strategy=ddp on gloo: torch's DistributedDataParallel "
                "crashes (segmentation fault) in its constructor under DETAIL on the CPU"),
    "ddp-w2-bf16-fused-nhwc": Case("ddp", 2, "bf16", ("fused", "channels_last", "precision"), debug=DDP_DEBUG),
    "fsdp-w2-bf16-nhwc": Case("fsdp", 2, "bf16", ("channels_last", "precision")),
    "fsdp-w2-fp16-nhwc-overflow-resume": Case("fsdp", 2, "fp16", ("channels_last", "precision")),
    "horovod-w2-bf16-nhwc": Case("horovod", 2, "bf16", ("channels_last", "precision")),
    "horovod-w2-fp16-nhwc-overflow-resume": Case("horovod", 2, "fp16", ("channels_last", "precision")),
    "pipeline-w2-fp16-fused-nhwc-overflow-resume": Case("pipeline", 2, "fp16", ("fused", "channels_last", "precision"),
                                                         PIPE),
    "2d-w4-2stages-x-2replicas-bf16-nhwc": Case("pipeline", 4, "bf16", ("channels_last", "precision"), PIPE),
}

#: pytest's limit: every case's hang guard in turn (each segment's groups run one after the other), so a
#: hung case is reported by its own guard first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * len(CASES) * HANG_S + 120)]


def _spec(run: Path, case: Case, steps: int) -> None:
    per_step = case.train.get("batch_size", BASE["batch_size"]) * case.world // case.train.get("pipeline_stages", 1)
    write_spec(run, checkpoint={"every_steps": 0, "resume": True},
               **{**BASE, **case.train, "strategy": case.strategy, "precision": case.precision, "steps": steps,
                  "synthetic_samples": per_step * STEPS})


def _envs(case: Case, overflow: bool) -> list[dict[str, str]]:
    """The case's rank environments; each waits at the driver's gate (``MASTER_PORT``: the one its go line sets)."""
    choices = ",".join(case.choices + (("overflow",) if overflow else ()))
    return rank_envs(case.world, {CHOICES_VAR: choices, OVERFLOW_VAR: str(CKPT_STEP), GATE_VAR: "stdin",
                                  "TORCH_DISTRIBUTED_DEBUG": case.debug, "HOROVOD_GLOO_TIMEOUT_SECONDS": str(HANG_S)})


def _groups(cases: dict[str, Case]) -> list[list[str]]:
    """The cases in groups of at most ``RANKS_AT_ONCE`` ranks with the same ``TORCH_DISTRIBUTED_DEBUG`` (a group's
    ranks are forked from one process, and torch.distributed reads the level at its import), widest case first."""
    groups: list[list[str]] = []
    for name, case in sorted(cases.items(), key=lambda kv: -kv[1].world):
        room = [g for g in groups if CASES[g[0]].debug == case.debug
                and sum(CASES[n].world for n in g) + case.world <= RANKS_AT_ONCE]
        if room:
            room[0].append(name)
        else:
            groups.append([name])
    return groups


@dataclass
class _Ranks:
    """One segment's ranks of one case, forked and waiting at the driver's gate: ``gates``, the write ends of
    their stdin pipes (open until let go), ``results`` once they have ended (:func:`finish`)."""

    procs: list[Any]
    gates: list[int]
    results: list[Any] | None = None

    def let_go(self, world: int) -> None:
        """Each rank's go line: the rendezvous port, picked now (a port picked at the fork may be taken by the
        time the rank runs, minutes later); then end-of-file."""
        line = json.dumps({"MASTER_PORT": str(free_port())} if world > 1 else {}) + "\n"
        while self.gates:
            gate = self.gates.pop()
            os.write(gate, line.encode())
            os.close(gate)


def _run_segments(runs: dict[str, Path], segments: list[tuple[dict[str, Case], int, bool]]) -> dict[str, list[Any]]:
    """Every segment's ranks (``(cases, steps, overflow)``), one group of cases (:func:`_groups`) at a time: each
    case's results per segment. Issue 27: every rank of every segment is forked up front from one process per
    ``TORCH_DISTRIBUTED_DEBUG`` level (2 imports of torch, not one per group: 8, ~4.3 CPU-s each) and waits,
    blocked on its stdin (no CPU), until its group's turn: never more than ``RANKS_AT_ONCE`` run at once."""
    ranks: dict[tuple[int, str], _Ranks] = {}
    try:
        for level in sorted({case.debug for cases, _, _ in segments for case in cases.values()}):
            keys = [(i, n) for i, (cases, _, _) in enumerate(segments) for n, c in cases.items() if c.debug == level]
            starts, pipes = [], []
            for i, name in keys:
                envs = _envs(segments[i][0][name], overflow=segments[i][2])
                starts += [([str(DRIVER), "--run-dir", str(runs[name])], env) for env in envs]
                pipes += [os.pipe() for _ in envs]
            try:
                procs = popen_group(starts, stdin=[read for read, _ in pipes])
            except BaseException:
                for fd in (fd for pipe in pipes for fd in pipe):
                    os.close(fd)
                raise
            for read, _ in pipes:
                os.close(read)
            worlds = [segments[i][0][n].world for i, n in keys]
            gates = per_run([write for _, write in pipes], worlds)
            for key, group, gate in zip(keys, per_run(procs, worlds), gates, strict=True):
                ranks[key] = _Ranks(group, gate)
        for i, (cases, steps, _) in enumerate(segments):
            for group in _groups(cases):
                for name in group:
                    _spec(runs[name], cases[name], steps)
                    ranks[(i, name)].let_go(cases[name].world)
                for name in group:
                    ranks[(i, name)].results = finish(ranks[(i, name)].procs, timeout=HANG_S)
    finally:  # after a failure: every rank not yet waited for is killed (at its gate or running) and reaped
        for waiting in ranks.values():
            for gate in waiting.gates:
                os.close(gate)
            for proc in waiting.procs if waiting.results is None else []:
                proc.kill()
                proc.communicate()
    results: dict[str, list[Any]] = {}
    for (_, name), done in sorted(ranks.items()):
        results.setdefault(name, []).append(done.results)
    return results


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's run directory and each segment's (exit code, stdout, stderr) per rank."""
    missing = horovod_missing()
    cases = {n: c for n, c in CASES.items() if not (missing and c.strategy == "horovod")}
    root = tmp_path_factory.mktemp("gpu-matrix")
    runs = {name: root / name for name in cases}
    first = {n: c for n, c in cases.items() if c.resume}
    refused = {n: c for n, c in cases.items() if c.refused}
    rest = {n: c for n, c in cases.items() if not c.resume and not c.refused}
    # segment 1: the fp16 cases to the checkpoint of step 2 (step 2 overflowed), and the refused cases;
    # segment 2: the fp16 cases resume to step 3 (no overflow forced), with the others' only run
    segments = [({**first, **refused}, CKPT_STEP, True), ({**first, **rest}, STEPS, False)]
    return {"runs": runs, "results": _run_segments(runs, segments), "missing": missing}


def _choices(run: Path, world: int) -> list[list[dict[str, Any]]]:
    return [[json.loads(line) for line in (run / f"choices-rank-{r}.jsonl").read_text().splitlines()]
            for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_configuration_trains_on_cpu(matrix: dict[str, Any], name: str) -> None:
    """The case trains its 3 steps with finite losses and parameters and a completed end record; the CUDA
    choices were in force (the precision in the start record, fused SGD under DDP, NHWC weights where the
    strategy keeps them); an fp16 case skipped its overflowed step 2 on every rank (the scale halved, the
    ranks agreeing), wrote the checkpoint of step 2 and resumed it with the halved scale: steps 1-3 once each.
    A refused case: every rank exits 2 before its first step with the one error line (and its HINT)."""
    case = CASES[name]
    if case.strategy == "horovod" and matrix["missing"]:
        pytest.skip(f"Horovod not importable: {matrix['missing']}")
    run = matrix["runs"][name]
    if case.refused:
        [results] = matrix["results"][name]
        for rank, (code, out, err) in enumerate(results):
            lines = [x for x in err.splitlines() if x.startswith("error:")]
            assert code == 2 and len(lines) == 1, f"{name} rank {rank} exited {code}\n{out[-2000:]}\n{err[-3000:]}"
            assert case.refused in lines[0] and "HINT: use TORCH_DISTRIBUTED_DEBUG=INFO" in lines[0], lines[0]
        assert not records(run, "step") and not list(run.glob("checkpoints/*.pt"))
        return
    for segment, results in enumerate(matrix["results"][name], 1):
        for rank, (code, out, err) in enumerate(results):
            assert code == 0, f"{name} segment {segment} rank {rank} exited {code}\n{out[-2000:]}\n{err[-3000:]}"
    steps = records(run, "step")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # every step once, across the resume
    assert all(math.isfinite(r["loss"]) for r in steps), steps
    starts, ends = records(run, "start"), records(run, "end")
    assert [e["status"] for e in ends] == ["completed"] * len(starts)
    assert {(s["strategy"], s["precision"], s["world_size"]) for s in starts} == {(case.strategy, case.precision,
                                                                                   case.world)}
    if case.train.get("pipeline_stages"):
        assert {(s["stages"], s["replicas"]) for s in starts} == {(2, case.world // 2)}
    logs = _choices(run, case.world)
    for rank, seen in enumerate(logs):
        assert len(seen) == STEPS, f"rank {rank}: {seen}"
        assert {s["fused"] for s in seen} == {"fused" in case.choices}  # fused SGD: where CUDA takes it
        assert {s["weights_nhwc"] for s in seen} == {case.strategy in ("ddp", "pipeline")}  # FSDP/Horovod: contiguous
    if case.resume:
        assert [s["start_step"] for s in starts] == [0, CKPT_STEP]
        for rank, seen in enumerate(logs):
            forced = seen[CKPT_STEP - 1]
            assert forced["skipped"] and forced["after"] == forced["scale"] / 2, f"rank {rank}: {seen}"
            assert seen[CKPT_STEP]["scale"] == forced["after"], f"rank {rank}: the scale was not restored: {seen}"
            assert not any(s["skipped"] for s in seen[CKPT_STEP:]), f"rank {rank}: {seen}"
        assert all(seen == logs[0] for seen in logs), "the ranks disagree on the loss scale or the skipped steps"
    else:
        assert all(s["scale"] is None for seen in logs for s in seen)  # no loss scaler under bf16
    if case.strategy != "pipeline":  # a full .pt state dict (the pipeline's is DCP; its guard ran every step)
        bad = [k for k, v in final_params(run).items() if v.is_floating_point() and not torch.isfinite(v).all()]
        assert not bad, f"non-finite parameters in the last checkpoint: {bad}"


def test_fsdp_bf16_on_a_batchnorm_model_trains_like_ddp_bf16(matrix: dict[str, Any]) -> None:
    """Issue 28 bug 2: ``fully_shard(mp_policy=bf16)`` cast the BatchNorm weights to bf16 while
    running_mean/var stayed fp32 (FSDP2 has no buffer dtype): step 1 raised "expected scalar type BFloat16
    but found Float" on every device. The norm layers now form an fp32 unit of their own; 2 ranks of FSDP +
    bf16 + resnet18 train (3 steps, validation, the full checkpoint) and follow DDP + bf16 (the matrix's
    two bf16 cases at 2 ranks, every block an FSDP unit). At 16 px, not 32 (issue 27: 20 -> 11 and 18 -> 10
    CPU-s): the unit layout is the same (image size changes no parameter), the loss falls ~0.46 in 3 steps at
    either size, and FSDP's losses stay within 0.017 of DDP's (32 px: 0.004), each asserted parameter within
    4% of its tolerance (32 px: 1%)."""
    cases = {"fsdp": "fsdp-w2-bf16-nhwc", "ddp": "ddp-w2-bf16-fused-nhwc"}
    runs = {name: matrix["runs"][case] for name, case in cases.items()}
    for name, case in cases.items():
        for rank, (code, out, err) in enumerate(matrix["results"][case][0]):
            assert code == 0, f"{name} rank {rank} exited {code}\n{out[-2000:]}\n{err[-3000:]}"
    start = records(runs["fsdp"], "start")[0]
    assert (start["strategy"], start["precision"], start["world_size"]) == ("fsdp", "bf16", 2)
    fsdp = [r["loss"] for r in records(runs["fsdp"], "step")]
    ddp = [r["loss"] for r in records(runs["ddp"], "step")]
    print(f"resnet18 bf16, 2 ranks x batch 2: fsdp losses {fsdp}, ddp losses {ddp}")
    assert len(fsdp) == len(ddp) == 3 and all(math.isfinite(v) for v in fsdp)
    assert fsdp == pytest.approx(ddp, rel=0.05, abs=0.02)  # bf16 reduce-scatter vs DDP's fp32 all-reduce
    [end] = records(runs["fsdp"], "end")
    assert end["status"] == "completed"
    # the full checkpoint: fp32 norm weights and running statistics by the plain model's names, near DDP's
    p_fsdp, p_ddp = final_params(runs["fsdp"]), final_params(runs["ddp"])
    assert set(p_fsdp) == set(p_ddp)
    assert p_fsdp["bn1.weight"].dtype == p_fsdp["bn1.running_mean"].dtype == torch.float32
    for name in ("bn1.weight", "bn1.running_var", "layer4.1.bn2.bias", "fc.weight"):
        torch.testing.assert_close(p_fsdp[name], p_ddp[name], rtol=0.05, atol=2e-3, msg=f"parameter {name}")
