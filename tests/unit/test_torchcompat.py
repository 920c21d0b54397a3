"""Issue 28: the feature tests for the torch APIs newer than the declared floor (torch>=2.6), on stand-ins
shaped like each release and on the installed torch. The runs under torch 2.6.0 itself: README, "Requirements"."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cyclone_kit.runtime import phases, torchcompat


class _Schedule27:  # torch 2.7-2.14's constructor
    def __init__(self, stage: Any, n_microbatches: int, loss_fn: Any = None, scale_grads: bool = True) -> None:
        self.scale_grads = scale_grads


class _Schedule26:  # torch 2.6's: no scale_grads (and it never rescales the gradients)
    def __init__(self, stage: Any, n_microbatches: int, loss_fn: Any = None) -> None:
        pass


def test_schedules_leave_the_gradients_unscaled_on_every_torch() -> None:
    assert torchcompat.schedule_kwargs(_Schedule27) == {"scale_grads": False}
    assert torchcompat.schedule_kwargs(_Schedule26) == {}
    assert _Schedule26(None, 2, **torchcompat.schedule_kwargs(_Schedule26)) is not None  # no TypeError
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    expected = {} if torch.__version__ < "2.7" else {"scale_grads": False}  # the argument came in 2.7
    for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B):  # the installed torch
        assert torchcompat.schedule_kwargs(cls) == expected, (cls, torch.__version__)


def test_pipeline_validation_needs_schedule_eval() -> None:
    assert torchcompat.has_schedule_eval(SimpleNamespace(eval=lambda *a, **k: None, step=print))
    assert not torchcompat.has_schedule_eval(SimpleNamespace(step=print))  # torch 2.6-2.8
    assert not torchcompat.has_schedule_eval(SimpleNamespace(eval=None))
    line = torchcompat.schedule_eval_line("2.8.0")
    assert line == ("pipeline validation skipped: torch 2.8.0 has no schedule.eval() (torch >= 2.9); "
                    "no val_accuracy is recorded, training is unaffected")


def _fsdp_unit(hooks: bool) -> Any:
    unit = SimpleNamespace(gather=None, scatter=None)
    if hooks:
        unit.set_custom_all_gather = lambda comm: setattr(unit, "gather", comm)
        unit.set_custom_reduce_scatter = lambda comm: setattr(unit, "scatter", comm)
    return unit


@pytest.mark.parametrize(("units", "timed"), [
    ((True, True), True),  # torch 2.9+
    ((False, False), False),  # torch 2.6-2.8
    ((True, False), False),  # never half timed
])
def test_fsdp_communication_is_timed_only_where_every_unit_takes_custom_collectives(units: tuple[bool, ...],
                                                                                   timed: bool) -> None:
    modules = [_fsdp_unit(h) for h in units]
    assert torchcompat.has_fsdp_custom_comms(modules) is timed
    timer = phases.PhaseTimer(phases.HostClock())
    timer.attach_fsdp(iter(modules))
    if timed:
        assert (timer.comm_timing, timer.comm_note) == (phases.FSDP_COMMS, None)
        assert all(m.gather is not None and m.scatter is not None for m in modules)
    else:
        assert timer.comm_timing is None  # the phases' comm fields are null, not wrong
        assert timer.comm_note == torchcompat.fsdp_comms_line(torch.__version__)
        assert all(m.gather is None for m in modules)
    assert "(torch >= 2.9)" in torchcompat.fsdp_comms_line("2.6.0")


def test_a_torch_from_2_9_has_every_optional_feature() -> None:
    """torch 2.9+ (2.14 in this environment) has them all: nothing is degraded there."""
    if torch.__version__ < "2.9":
        pytest.skip(f"torch {torch.__version__} predates the optional features (the degraded runs are the point)")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    assert callable(getattr(_PipelineSchedule, "eval", None))
    assert callable(getattr(FSDPModule, "set_custom_all_gather", None))


def test_fsdp_on_the_cpu_needs_cpu_streams_that_record_events() -> None:
    class Stream26:  # torch 2.6's torch.cpu.Stream
        def wait_stream(self, stream: Any) -> None:
            pass

    class Stream27(Stream26):
        def record_event(self) -> None:
            pass

    assert not torchcompat.fsdp_runs_on_cpu(Stream26) and torchcompat.fsdp_runs_on_cpu(Stream27)
    error, hint = torchcompat.fsdp_cpu_refusal("2.6.0")
    assert error.startswith("train.strategy=fsdp on the CPU needs torch >= 2.7: torch 2.6.0's FSDP2") and "\n" not in error
    assert "train.strategy=ddp" in hint
    if torch.__version__ >= "2.7":
        assert torchcompat.fsdp_runs_on_cpu(torch.cpu.Stream)


@pytest.mark.parametrize(("schedule", "device", "version", "refused"), [
    ("1f1b", "cpu", "2.6.0+cu124", True),         # seen hanging in its first step on gloo
    ("interleaved_1f1b", "cpu", "2.12.1", True),  # not run between 2.6 and 2.13: refused, with the way out
    ("1f1b", "cpu", "2.13.0+cpu", False),         # seen completing
    ("1f1b", "cpu", "2.14.1", False),
    ("gpipe", "cpu", "2.6.0", False),             # completes on 2.6 too
    ("1f1b", "cuda", "2.6.0", False),             # NCCL is not refused
])
def test_a_1f1b_schedule_that_hangs_on_gloo_under_an_old_torch_is_refused(schedule, device, version, refused):
    answer = torchcompat.pipeline_schedule_refusal(schedule, device, version)
    assert (answer is not None) is refused
    if answer is not None:
        error, hint = answer
        assert error.startswith(f"train.pipeline_schedule={schedule} on the CPU (gloo) hangs") and version in error
        assert "train.pipeline_schedule=gpipe" in hint and "torch>=2.13" in hint


def test_this_torch_runs_the_1f1b_schedule_on_gloo_if_it_is_recent_enough():
    assert (torchcompat.pipeline_schedule_refusal("1f1b", "cpu", torch.__version__) is None) == (
        torch.__version__ >= "2.13")
