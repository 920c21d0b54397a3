"""A rank of the engine that makes, on the CPU, the choices the engine makes on CUDA (tests/integration/test_gpu_matrix.py).

``python tests/helpers/gpu_choices_rank.py --run-dir DIR`` is ``python -m cyclone_kit.runtime --run-dir DIR``
after the patches named in ``$CK_GPU_CHOICES`` (comma-separated); the product's code is untouched (each
patch wraps a name the engine looks up at call time, as tests/helpers/pipeline_rank.py does):

* ``fused``: ``train.use_fused_sgd`` answers as on CUDA (fused SGD under DDP and in the pipeline, whose
  LossScale then skips an overflowed step on the device; CPU fused SGD exists);
* ``channels_last``: the DDP/FSDP/Horovod engine's data loader sends NHWC batches and ``place_model`` gets
  ``channels_last=True`` (its CPU default is off); the pipeline engine's likewise (pipeline_rank's patch);
* ``precision``: ``resolve_precision`` answers as on a bf16-capable GPU (``fp16`` stays fp16, its CPU
  fall-back being fp32), and the engine's ``torch.amp.GradScaler("cuda")`` is a CPU GradScaler;
* ``overflow``: the first optimizer step of the process overflows: under DDP and Horovod rank 0's scaled
  loss is inf (the all-reduce spreads its NaN gradients to every rank), under FSDP the first element of
  rank 0's first gradient shard is inf (only the rank owning that element sees it), in the pipeline
  stage 0's first gradient element.

With ``$CK_GATE=stdin`` the driver first waits for one line on its stdin, a JSON object of environment
variables to set (the rendezvous port, picked when the rank is let go), before it imports the engine: the test
forks its ranks from one process long before each runs (end-of-file instead: exit 3, nothing run).

The driver also appends, per optimizer step, what it saw to ``DIR/choices-rank-N.jsonl``: the loss
scale before and after the step (``scale``, ``after``), whether the step was skipped, the optimizer's
``fused`` flag and whether the first 4-D parameter is channels_last (a pipeline without a loss scaler:
at each average of its replicas' gradients).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: The environment variable naming the patches.
CHOICES_VAR = "CK_GPU_CHOICES"
#: The environment variable naming the step of this process that ``overflow`` overflows (default 1).
OVERFLOW_VAR = "CK_OVERFLOW_STEP"
#: The environment variable that makes the driver wait for its go line on stdin (``stdin``; see the top).
GATE_VAR = "CK_GATE"
#: The exit status of a driver whose stdin ended before its go line (the test let it go never).
NOT_LET_GO = 3


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Log:
    """The per-step lines of ``DIR/choices-rank-N.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / f"choices-rank-{_rank()}.jsonl"
        self.steps = 0

    def write(self, **fields: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(fields) + "\n")


def _layout(optimizer: Any) -> dict[str, Any]:
    fused = bool(optimizer.param_groups[0].get("fused"))
    return {"fused": fused, **_weights([p for g in optimizer.param_groups for p in g["params"]])}


def _weights(params: list[Any]) -> dict[str, Any]:
    import torch

    four_d = next((p for p in params if p.dim() == 4), None)
    local = four_d.to_local() if four_d is not None and hasattr(four_d, "to_local") else four_d
    return {"weights_nhwc": bool(local is not None and not local.is_contiguous()
                                 and local.is_contiguous(memory_format=torch.channels_last))}


def _poison(grad: Any) -> None:
    """The first element of ``grad`` (any layout) becomes inf."""
    if grad.numel():
        grad[(0,) * grad.dim()] = float("inf")


def force_fused() -> None:
    """Fused SGD where the engine takes it on CUDA."""
    from cyclone_kit.runtime.engine import dataparallel as train

    choose = train.use_fused_sgd
    train.use_fused_sgd = lambda strategy, device_kind: choose(strategy, "cuda")


def force_channels_last() -> None:
    """channels_last batches and placement in both engines, as on CUDA."""
    from cyclone_kit.runtime.engine import dataparallel as train
    from tests.helpers.pipeline_rank import force_channels_last as pipeline_nhwc

    build_data, place_model = train.build_data, train.place_model

    def build_data_nhwc(*args: Any, **kwargs: Any) -> Any:
        return build_data(*args, **{**kwargs, "channels_last": True})

    def place_nhwc(model: Any, dev: Any, strategy: str, channels_last: bool) -> Any:
        return place_model(model, dev, strategy, True)

    train.build_data, train.place_model = build_data_nhwc, place_nhwc
    pipeline_nhwc()


def force_precision() -> None:
    """The GPU's precision choice, and a CPU GradScaler for the engine's CUDA one."""
    import torch

    from cyclone_kit.runtime.engine import dataparallel as train
    from cyclone_kit.runtime.engine import pipeline, plan

    resolve = plan.resolve_precision

    def gpu_precision(requested: str, device_kind: str, bf16_supported: bool) -> str:
        return resolve(requested, "cuda", True)

    train.resolve_precision = pipeline.resolve_precision = gpu_precision

    class CpuGradScaler(torch.amp.GradScaler):
        def __init__(self, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu", *args, **kwargs)

    torch.amp.GradScaler = CpuGradScaler  # type: ignore[misc]


def watch_steps(run_dir: Path, overflow: bool) -> None:
    """Log every optimizer step (scale before/after, skipped, fused, layout); overflow the first one."""
    import torch

    from cyclone_kit.runtime.engine import dataparallel as train
    from cyclone_kit.runtime.engine import pipeline

    spec = json.loads((run_dir / "spec.json").read_text())["train"]
    strategy, precision = spec["strategy"], spec["precision"]
    log = _Log(run_dir)
    step, loss_scale_step, scale = train.optimizer_step, pipeline.LossScale.step, torch.amp.GradScaler.scale
    allreduce = pipeline.allreduce_replicas

    at = int(os.environ.get(OVERFLOW_VAR, "1"))

    def first() -> bool:
        return overflow and log.steps == at - 1

    def overflowed_scale(self: Any, outputs: Any) -> Any:
        scaled = scale(self, outputs)
        if strategy != "fsdp" and first() and _rank() == 0:
            return scaled * float("inf")  # rank 0's backward overflows; the all-reduce spreads its NaN
        return scaled

    def logged_step(optimizer: Any, scaler: Any, horovod: bool = False) -> None:
        if strategy == "fsdp" and first():  # one element of the first shard overflows, on the rank owning it
            p = next(p for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if _rank() == 0:
                _poison(local)
        before = scaler.get_scale() if scaler is not None else None
        step(optimizer, scaler, horovod)
        after = scaler.get_scale() if scaler is not None else None
        log.steps += 1
        log.write(scale=before, after=after, skipped=bool(after is not None and after < before), **_layout(optimizer))

    def logged_loss_scale_step(self: Any, optimizer: Any) -> Any:
        if first() and _rank() == 0:  # stage 0's gradient overflows
            p = next(p for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            _poison(p.grad)
        before = float(self.scale)  # the scale is a device tensor updated in place
        found = loss_scale_step(self, optimizer)
        log.steps += 1
        log.write(scale=before, after=float(self.scale), skipped=bool(found.item()), **_layout(optimizer))
        return found

    def logged_allreduce(params: Any, group: Any, replicas: int) -> Any:
        if precision != "fp16":  # no LossScale step to log: the replicas' gradient average marks the step
            log.steps += 1
            log.write(scale=None, after=None, skipped=False, fused=False, **_weights(list(params)))
        return allreduce(params, group, replicas)

    train.optimizer_step = logged_step
    pipeline.allreduce_replicas = logged_allreduce
    pipeline.LossScale.step = logged_loss_scale_step  # type: ignore[method-assign]
    torch.amp.GradScaler.scale = overflowed_scale  # type: ignore[method-assign]


def wait_at_gate() -> None:
    """Block (no CPU) until one line arrives on stdin, set its JSON object's variables, and give stdin
    ``/dev/null`` again; end-of-file first: exit :data:`NOT_LET_GO`."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 4096)
        if not chunk:
            raise SystemExit(NOT_LET_GO)
        line += chunk
    os.environ.update({str(k): str(v) for k, v in json.loads(line).items()})
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def main(argv: list[str]) -> int:
    if os.environ.get(GATE_VAR) == "stdin":
        wait_at_gate()
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    choices = [c for c in os.environ.get(CHOICES_VAR, "").split(",") if c]
    for name in choices:
        if name == "fused":
            force_fused()
        elif name == "channels_last":
            force_channels_last()
        elif name == "precision":
            force_precision()
        elif name != "overflow":
            raise SystemExit(f"unknown choice {name!r} in ${CHOICES_VAR}")
    watch_steps(run_dir, overflow="overflow" in choices)
    from cyclone_kit.runtime.__main__ import main as rank_main

    return rank_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
