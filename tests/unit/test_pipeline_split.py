"""The pipeline's split (runtime/engine/pipeline_split.py), layout and report figures (issue 24).

Pure parts against brute force; the block split of resnet18/50 and mobilenet_v3 at 2, 4 and 8
stages on block times measured here on the CPU (tiny inputs): every stage has parameters, the
stages chained equal the model, and the slowest stage is within 15 % of the mean, or, where it
is not, no contiguous split of those blocks could do better (the block granularity is the limit,
and the balance says so).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cyclone_kit.analysis.pipeline import ideal_bubble, pipeline_summary, section
from cyclone_kit.core.errors import ValidationError
from cyclone_kit.runtime.engine import pipeline_split as ps
from cyclone_kit.runtime.engine.models import build_model
from cyclone_kit.runtime.engine.pipeline import input_format, layout


def _brute_force_bottleneck(times: list[float], stages: int) -> float:
    """The smallest possible slowest stage over every contiguous split (for checking the DP)."""
    n, best = len(times), float("inf")
    for inner in itertools.combinations(range(1, n), stages - 1):
        cuts = (0, *inner, n)
        best = min(best, max(sum(times[a:b]) for a, b in itertools.pairwise(cuts)))
    return best


def test_balance_cuts_find_the_optimal_contiguous_split() -> None:
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(1, 11)
        times = [rng.uniform(0.1, 5.0) for _ in range(n)]
        for stages in range(1, n + 1):
            cuts = ps.balance_cuts(times, stages)
            assert cuts[0] == 0 and cuts[-1] == n and len(cuts) == stages + 1
            assert all(a < b for a, b in itertools.pairwise(cuts)), cuts  # no empty stage
            got = max(sum(times[a:b]) for a, b in itertools.pairwise(cuts))
            assert got == pytest.approx(_brute_force_bottleneck(times, stages), rel=1e-12)
    assert ps.balance_cuts([1, 1, 1, 1], 2) == (0, 2, 4)
    assert ps.balance_cuts([10, 1, 1, 1], 2) == (0, 1, 4)
    with pytest.raises(ValidationError, match="has 2 blocks, too few for 3 pipeline stages"):
        ps.balance_cuts([1, 1], 3)


def test_parameter_free_parts_join_a_neighbour() -> None:
    relu, flat, lin = torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(2, 2)
    conv = torch.nn.Conv2d(1, 1, 1)
    blocks = ps.merge_parameter_free([[("a", relu)], [("b", conv)], [("c", relu)], [("d", lin)], [("", flat)]])
    assert [[p for p, _ in b.parts] for b in blocks] == [["a", "b", "c"], ["d", ""]]
    with pytest.raises(ValidationError, match="no parameters"):
        ps.merge_parameter_free([[("a", relu)]])


def test_vit_has_no_chain_form() -> None:
    with pytest.raises(ValidationError, match="cannot cut a VisionTransformer"):
        ps.model_blocks(build_model("vit_b_16", 10, 32, 3))


def test_layout_is_stages_by_replicas_and_refuses_what_cannot_run() -> None:
    lay = layout(16, 4, "1f1b", 8, 64)
    assert (lay.stages, lay.replicas, lay.virtual, lay.num_stages) == (4, 4, 1, 4)
    assert [lay.pp_rank(r) for r in (0, 3, 4, 13)] == [0, 3, 0, 1] and lay.dp_rank(13) == 3
    inter = layout(4, 2, "interleaved_1f1b", 4, 8)
    assert inter.num_stages == 4 and inter.stage_indices(1) == [1, 3]
    assert layout(4, 0, "gpipe", 2, 8).stages == 4  # 0: every rank is a stage
    for args, match in (((6, 4, "gpipe", 2, 8), "does not divide the 6 ranks"),
                        ((4, 2, "gpipe", 3, 8), "does not split into 3 equal micro-batches"),
                        ((4, 4, "1f1b", 2, 8), "needs train.microbatches >= 4")):
        with pytest.raises(ValidationError, match=match) as err:
            layout(*args)
        assert err.value.hint


def test_stage_0_declares_its_input_in_the_layout_the_loader_sends() -> None:
    """Issue 28 bug 3: NHWC images under channels_last (the loader's batches), contiguous otherwise."""
    assert input_format(True, (3, 32, 32)) == torch.channels_last
    assert input_format(False, (3, 32, 32)) == torch.contiguous_format
    assert input_format(True, (16,)) == torch.contiguous_format  # no image: nothing to lay out


def test_report_figures_of_a_pipeline_run() -> None:
    assert ideal_bubble(4, 8) == pytest.approx(3 / 11) and ideal_bubble(2, 4, 2) == pytest.approx(1 / 9)
    balance = {"blocks": ["stem", "b1", "b2", "head"], "cuts": [0, 2, 4], "stage_times_s": [0.2, 0.3],
               "max_over_mean": 1.2, "granularity_limited": True}
    start = {"kind": "start", "strategy": "pipeline", "stages": 2, "microbatches": 4, "replicas": 2,
             "virtual_stages": 1, "pipeline_schedule": "gpipe", "balance": balance, "model": "m"}
    steps = [{"kind": "step", "stage_compute_s": [1.0, 1.0], "stage_idle_s": [9.0, 9.0]}] + [
        {"kind": "step", "stage_compute_s": [0.8, 0.6], "stage_idle_s": [0.2, 0.4]}] * 3
    summary = pipeline_summary([start, *steps])
    assert summary is not None and summary["windows"] == 3  # the first window is warm-up
    assert summary["bubble"] == pytest.approx([0.2, 0.4]) and summary["ideal"] == pytest.approx(1 / 5)
    sec = section("run-1", summary)
    assert [r[:2] for r in sec.rows] == [("0", "stem..b1"), ("1", "b2..head")]
    assert sec.rows[1][6] == "40.0 %" and sec.rows[0][7] == "20.0 %" and "granularity" in sec.text
    assert pipeline_summary([{"kind": "start", "strategy": "ddp"}]) is None


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[list[ps.Block], list[float], torch.nn.Module]]:
    """Blocks and their forward+backward times measured on this CPU (batch 2, 32 px, 1 thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for name in ("resnet18", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large"):
            torch.manual_seed(0)
            model = build_model(name, 10, 32, 3)
            blocks = ps.model_blocks(model)
            out[name] = (blocks, ps.measure_block_times(blocks, torch.randn(2, 3, 32, 32), repeats=2), model)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large"])
def test_every_stage_has_parameters_and_the_measured_split_is_balanced(name: str, measured: dict) -> None:
    blocks, times, model = measured[name]
    assert all(t > 0 for t in times) and all(b.num_params > 0 for b in blocks)
    names = {p for b in blocks for p, _ in b.parts if p}
    assert {k.split(".")[0] for k in model.state_dict()} <= {n.split(".")[0] for n in names}
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        expected = model(x)
    for stages in (2, 4, 8):
        bal = ps.balance([b.name for b in blocks], times, stages)
        params = [sum(b.num_params for b in blocks[a:c]) for a, c in itertools.pairwise(bal.cuts)]
        assert len(params) == stages and min(params) > 0, (stages, bal.cuts)
        optimum = _brute_force_bottleneck(times, stages)
        mean = sum(times) / stages
        print(f"{name} {stages} stages: cuts {bal.cuts}, slowest/mean {bal.max_over_mean:.3f}, "
              f"best possible {optimum / mean:.3f}")
        assert max(bal.stage_times_s) == pytest.approx(optimum, rel=1e-9)
        assert bal.max_over_mean <= 1 + ps.BALANCE_TOLERANCE or bal.granularity_limited
        with torch.no_grad():  # the stages chained are the model
            out = x
            for a, c in itertools.pairwise(bal.cuts):
                for block in blocks[a:c]:
                    out = ps.block_module(block)(out)
        torch.testing.assert_close(out, expected)
