"""The step phases' maths (runtime/phases.py): unions, DDP's exposed estimate, one window's split.

Pure functions with hand-made interval tables, and the PhaseTimer on a clock the test moves by
hand (no process, no sleep): the chain of marks must add up to the window exactly.
"""

from __future__ import annotations

import pytest

from cyclone_kit.rundir import contract
from cyclone_kit.runtime import phases as ph


def test_union_length_counts_overlaps_once() -> None:
    assert ph.union_length([]) == 0.0
    assert ph.union_length([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)
    assert ph.union_length([(0.0, 2.0), (1.0, 3.0), (2.5, 2.6)]) == pytest.approx(3.0)
    assert ph.union_length([(5.0, 6.0), (0.0, 1.0), (0.5, 0.7)]) == pytest.approx(2.0)
    assert ph.union_length([(1.0, 1.0), (2.0, 1.5)]) == 0.0  # empty and reversed intervals


@pytest.mark.parametrize(("buckets", "backward_end", "exposed"), [
    ([], 1.0, 0.0),                                        # no buckets: nothing to wait for
    ([(0.2, 0.5), (0.6, 0.9)], 1.0, 0.3),                  # the last bucket's reduce after backward's end
    ([(0.2, 0.5), (0.6, 0.62)], 0.7, 0.02),                # reduced almost at once: little exposed
    ([(0.1, 0.95), (0.6, 0.7)], 1.0, 0.35),                # an earlier, long bucket ends last
    ([(0.2, 0.5), (0.6, 1.4)], 1.0, 0.4),                  # clipped to the end of backward
])
def test_ddp_exposed_is_from_the_last_ready_bucket_to_the_last_result(
        buckets: list[tuple[float, float]], backward_end: float, exposed: float) -> None:
    assert ph.exposed_after_last_ready(buckets, backward_end) == pytest.approx(exposed)


def test_window_phases_split_the_window_and_carve_exposed_comm_out_of_compute() -> None:
    # Two steps: other 0-0.1, data 0.1-0.2, compute 0.2-1.0, other 1.0-1.1, data, compute 1.2-2.0, other to 2.1.
    chain = [(ph.OTHER, 0.0), (ph.DATA, 0.1), (ph.COMPUTE, 0.2), (ph.OTHER, 1.0),
             (ph.DATA, 1.1), (ph.COMPUTE, 1.2), (ph.OTHER, 2.0)]
    ddp = [([(0.5, 0.7), (0.8, 0.95)], 0.96), ([(1.5, 1.6), (1.8, 1.99)], 1.99)]
    got = ph.window_phases(chain, 2.1, [], [], ddp, steps=2, comm_measured=True, exposed_measured=True)
    assert got.data_time_s == pytest.approx(0.1)
    assert got.comm_time_s == pytest.approx((0.35 + 0.29) / 2)
    assert got.comm_exposed_s == pytest.approx((0.15 + 0.19) / 2)
    assert got.compute_time_s == pytest.approx((1.6 - 0.34) / 2)
    assert got.other_time_s == pytest.approx(0.15)
    total = got.data_time_s + got.compute_time_s + got.comm_exposed_s + got.other_time_s
    assert total == pytest.approx(2.1 / 2)
    assert set(got.fields()) == {"data_time_s", *contract.PHASE_FIELDS}


def test_window_phases_blocking_comm_is_exposed_and_unmeasured_comm_is_null() -> None:
    chain = [(ph.OTHER, 0.0), (ph.DATA, 0.0), (ph.COMPUTE, 0.1), (ph.OTHER, 1.0)]
    blocked = [(0.2, 0.3), (0.6, 0.8)]  # FSDP's synchronous collectives on the host clock
    got = ph.window_phases(chain, 1.0, blocked, blocked, [], steps=1, comm_measured=True, exposed_measured=True)
    assert (got.comm_time_s, got.comm_exposed_s, got.compute_time_s) == pytest.approx((0.3, 0.3, 0.6))
    cuda_fsdp = ph.window_phases(chain, 1.0, blocked, [], [], steps=1, comm_measured=True, exposed_measured=False)
    assert cuda_fsdp.comm_exposed_s is None and cuda_fsdp.compute_time_s == pytest.approx(0.9)
    untimed = ph.window_phases(chain, 1.0, [], [], [], steps=1, comm_measured=False, exposed_measured=True)
    assert untimed.comm_time_s is None and untimed.comm_exposed_s is None


class _Clock(ph.HostClock):
    """A host clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:  # type: ignore[override]
        return self.now


def test_timer_chain_adds_up_to_the_window_and_a_world_of_one_has_no_communication() -> None:
    clock = _Clock()
    timer = ph.PhaseTimer(clock)
    timer.no_communication()
    timer.open()
    for _ in range(3):
        clock.now += 0.01
        timer.mark(ph.DATA)
        clock.now += 0.02
        timer.mark(ph.COMPUTE)
        clock.now += 0.5
        timer.backward_done()
        clock.now += 0.05
        timer.step_done()
    clock.now += 0.03  # the window's loss reduce
    got = timer.close()
    assert (got.data_time_s, got.compute_time_s, got.comm_time_s, got.comm_exposed_s) == pytest.approx(
        (0.02, 0.55, 0.0, 0.0))
    assert got.other_time_s == pytest.approx((3 * 0.01 + 0.03) / 3)
    assert timer.phase_timing == ph.HOST_CLOCK and timer.comm_timing == ph.NO_COMM


def test_phase_timing_can_be_turned_off_for_benchmarks() -> None:
    assert ph.enabled({}) and ph.enabled({ph.PHASES_VAR: "1"})
    assert not any(ph.enabled({ph.PHASES_VAR: v}) for v in ("0", "false", "off", "no"))


def test_timed_loader_marks_data_then_compute_and_passes_attributes_through() -> None:
    clock = _Clock()
    timer = ph.PhaseTimer(clock)
    timer.open()
    loader = ph.TimedLoader([1, 2], lambda: timer.mark(ph.DATA), lambda: timer.mark(ph.COMPUTE))
    assert list(loader) == [1, 2] and len(loader) == 2 and loader.count(1) == 1  # list.count, passed through
    assert timer.phase == ph.DATA  # the final next() that ended the iteration
