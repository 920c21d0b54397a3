"""Issue 28 on a real engine rank (``python -m cyclone_kit.runtime``, 1 thread, on the CPU): weights that
stopped being finite. (FSDP2 with a bf16 MixedPrecisionPolicy on a BatchNorm model, against DDP + bf16:
tests/integration/test_gpu_matrix.py, on two of its cases' runs.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.ranks import finish, records, start_runs, write_spec

#: Hang guard (not a performance bound): two tiny_cnn ranks side by side, 8 steps each.
RUNS_HANG_S = 400

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUNS_HANG_S + 120)]


#: tiny_cnn, 1 rank: an LR of 1e30 blows the weights up within a few steps (the loss is NaN from then on).
BLOW_UP = dict(lr=1e30, lr_scaling="none", warmup_steps=0, steps=8, log_every=2, val_samples=0)


@pytest.fixture(scope="module")
def blown_up(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Path, tuple[int, str, str]]]:
    """Both runs (``allow_nonfinite_params`` off and on), their one rank each forked from one process (issue 27:
    one import of torch for the two, not one each: 8.5 -> ~5 CPU-s): per ``allowed``, the run directory and
    its rank's (exit code, stdout, stderr)."""
    root = tmp_path_factory.mktemp("blow-up")
    runs = {allowed: root / f"allowed-{allowed}" for allowed in (False, True)}
    for allowed, run in runs.items():
        write_spec(run, checkpoint={"every_steps": 0, "resume": False},
                   **BLOW_UP, **({"allow_nonfinite_params": True} if allowed else {}))
    results = finish(start_runs([(run, 1) for run in runs.values()]), timeout=RUNS_HANG_S)
    return {allowed: (run, result) for (allowed, run), result in zip(runs.items(), results, strict=True)}


@pytest.mark.parametrize("allowed", [False, True])
def test_weights_that_stopped_being_finite_stop_the_run_unless_allowed(blown_up: dict[bool, Any], allowed: bool) -> None:
    """Bug 1's guard: a run whose parameters hold NaN/inf after a step trained on garbage and went on
    (the loss check is off by default: fp16's skipped overflow steps have a NaN loss too). Checked at
    the log interval (no extra host sync): one line with a HINT, exit 1, no checkpoint of the NaN
    weights; ``train.allow_nonfinite_params = true`` warns and trains on."""
    run, (code, out, err) = blown_up[allowed]
    steps = records(run, "step")
    if allowed:
        assert code == 0, out[-2000:] + err[-3000:]
        assert "parameters are not finite" in out and len(steps) == 4
        assert records(run, "end")[-1]["status"] == "completed"
        return
    assert code == 1, out[-2000:] + err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "parameter tensor(s) of the model hold NaN or inf after step" in line and "HINT:" in line
    assert "train.allow_nonfinite_params" in line
    assert steps and steps[-1]["step"] < BLOW_UP["steps"]
    assert records(run, "end")[-1]["status"] == "failed"
    assert not list((run / "checkpoints").glob("*.pt"))  # the NaN weights were not written
