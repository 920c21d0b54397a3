"""The public API: a few calls that give any PyTorch script metrics, requeue and scaling reports.

::

    import cyclone_kit as ck

    ctx = ck.init()                    # process group (nccl on GPU, gloo on CPU) from any launcher or none
    state = ck.load_checkpoint()       # newest complete checkpoint of this run (a dict) or None, on every rank
    for step in range(start, steps):
        ...                            # forward, backward, optimizer step
        ck.log_step(step + 1, samples=global_batch, loss=loss)   # rank 0 writes the metrics contract
        if ck.stop_requested():        # the time-limit/requeue signal, agreed across ranks at the same step
            ck.save_checkpoint({"model": ..., "optimizer": ..., "step": step + 1})
            break
    ck.finish()                        # end record (completed | preempted), requeue when preempted, teardown

Opt-in: ``loader = ck.instrument(model=ddp_model, loader=loader, optimizer=optimizer)`` before the
loop gives every ``step`` record the phases of the step (data wait, compute, gradient
communication total and exposed, the rest: :mod:`cyclone_kit.runtime.phases`), as the built-in
engine writes them. Without it the records carry the step time only, and the report says what it
cannot break down.

Where things go: the run directory is ``ck.init(run_dir=...)``, else ``$CYCLONE_RUN_DIR`` (set by
``cyclone-kit run/submit`` and the sbatch templates), else a new ``./runs/<script>-<stamp>``
(created by rank 0). Its ``spec.json``, when there is one, supplies ``[checkpoint]`` (keep,
signal, requeue, max_requeues, poll_s, async_write) and ``train.log_every``; defaults otherwise.
``$CYCLONE_LOG_EVERY`` sets the steps per ``step`` record for a script job (whose spec has no [train]).

Rules: :func:`init` first and once, :func:`finish` last; every rank calls every function the
same number of times (:func:`stop_requested`, :func:`save_checkpoint` and
:func:`load_checkpoint` are collectives). A call out of order raises :class:`ApiUsageError`,
a one-line :class:`~cyclone_kit.core.errors.CycloneError` naming the fix; left uncaught it prints
that one line and exits with code 2 (no traceback). Any other uncaught exception after
:func:`init` still writes the run's ``failed`` end record and this rank's error record.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from cyclone_kit.core.errors import CycloneError, ValidationError

__all__ = ["ApiUsageError", "Context", "finish", "init", "instrument", "load_checkpoint", "log_step",
           "save_checkpoint", "stop_requested"]

#: ``train.log_every`` when neither the call, the environment nor the run's spec says otherwise.
DEFAULT_LOG_EVERY = 10
#: The environment variable that sets the steps per ``step`` record (a script job's spec has no [train]).
LOG_EVERY_VAR = "CYCLONE_LOG_EVERY"
#: The environment variable that sets how many consecutive non-finite losses stop the run (0: never).
NONFINITE_VAR = "CYCLONE_MAX_NONFINITE_STEPS"


class ApiUsageError(CycloneError):
    """A ``ck.*`` call out of order or with a bad argument; the message names the fix."""


@dataclass(frozen=True)
class Context:
    """What :func:`init` returns: where this process sits in the run.

    Attributes:
        rank: global rank, 0 .. world_size-1.
        world_size: processes in the run.
        local_rank: rank among the processes of this node (the GPU index to use).
        local_world_size: processes on this node.
        device: the ``torch.device`` to train on (``cuda:local_rank`` on GPUs, else the CPU).
        is_main: True on rank 0 (the rank that writes metrics and checkpoints).
        node_rank: index of this node.
        num_nodes: nodes in the run.
        restart_count: how often the job was requeued before this segment (0 on the first).
        run_dir: the run directory (metrics, checkpoints, per-rank records).
        launcher: who started the processes (``torchrun``, ``slurm``, ``local``, ``single``, ...).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: Any
    is_main: bool
    node_rank: int
    num_nodes: int
    restart_count: int
    run_dir: Path
    launcher: str


class _Run:
    """The module's state between :func:`init` and :func:`finish` (private)."""

    def __init__(self, session: Any, ctx: Context, log_every: int, info: dict[str, Any]) -> None:
        self.session, self.ctx, self.log_every, self.info = session, ctx, log_every, info
        self.started = False  # the start record is written at the first step (the batch is known then)
        self.start_step = 0
        self.last_step: int | None = None
        self.polls = 0
        self.window_t0 = time.perf_counter()
        self.window_steps = 0
        self.window_samples = 0.0
        self.window_losses: list[Any] = []
        self.timer: Any = None  # ck.instrument's PhaseTimer
        self.data_timed = False  # ck.instrument was given the loader
        from cyclone_kit.runtime import power

        self.energy = power.start_meter(ctx.device)  # GPU energy for the rank summary (NVML), else None

    def begin(self, samples: float | None) -> None:
        if self.started:
            return
        self.started = True
        world = self.ctx.world_size
        per_device = int(samples) // world if samples and int(samples) % world == 0 else None
        fields: dict[str, Any] = {
            "per_device_batch_size": per_device, "global_batch_size": int(samples) if samples else None,
            "model": _script_name(), "dataset": None, "precision": None, "strategy": "script",
            "start_step": self.start_step, "api": True, "script": sys.argv[0] if sys.argv else None,
        }
        if self.timer is not None:
            fields.update(phase_timing=self.timer.phase_timing, comm_timing=self.timer.comm_timing)
        fields.update(self.info)
        self.session.begin(**fields)

    def flush_window(self, step: int) -> None:
        if not self.window_steps:
            return
        # The window ends when its steps are done on the device, not when the host has queued them:
        # the clock is read after the loss read (its .item() waits for the device), or after a device
        # synchronize when the script logged no tensor loss. Every rank waits, so each rank's own rate
        # (its summary) is measured the same way as rank 0's.
        loss, bad = _mean_loss(self.window_losses)
        if not any(hasattr(x, "float") for x in self.window_losses):
            _synchronize(self.ctx.device)
        now = time.perf_counter()
        phases, opened = None, now
        if self.timer is not None:
            phases = self.timer.close().fields()  # CUDA events: read after the sync above
            self.timer.open()
            # the next window's clock starts with its phase chain (as the engine's does), so that its
            # phases add up to its step time whatever the close above took
            opened = time.perf_counter()
            if not self.data_timed:
                phases["data_time_s"] = None  # no loader given: data loading is inside other_time_s
        samples = self.window_samples
        main = self.ctx.is_main  # rank 0 records the loss and counts the non-finite steps
        self.session.log_window(step, None, loss if main else None, self.window_steps, now - self.window_t0, None,
                                samples, samples / self.ctx.world_size, nonfinite_steps=bad if main else 0,
                                phases=phases)
        self.window_t0, self.window_steps, self.window_samples = opened, 0, 0.0
        self.window_losses = []


_run: _Run | None = None
_finished = False
_previous_hook: Any = None


# --------------------------------------------------------------------------- the API
def init(run_dir: str | Path | None = None, *, log_every: int | None = None, max_nonfinite_steps: int | None = None,
         **info: Any) -> Context:
    """Join the run: signal handlers, device, process group, run directory. Call once, first, on every rank.

    Works under torchrun, srun, mpirun/horovodrun, ``cyclone-kit run`` and with no launcher at
    all (a world of one). The process group is NCCL on CUDA and gloo on the CPU; it exists
    even for one process (so ``DistributedDataParallel`` works unchanged); a group the script
    created before is reused.

    Args:
        run_dir: the run directory (default ``$CYCLONE_RUN_DIR``, else a new ``./runs/<script>-<stamp>``).
        log_every: steps per ``step`` record (default: ``$CYCLONE_LOG_EVERY``, else the run's
            ``train.log_every``, else 10).
        max_nonfinite_steps: stop with a one-line error after this many consecutive steps whose
            loss (given to :func:`log_step`) was NaN or infinite (default:
            ``$CYCLONE_MAX_NONFINITE_STEPS``, else the run's ``train.max_nonfinite_steps``, else 0: never).
        **info: extra ``start`` record fields (``model``, ``dataset``, ``precision`` ...: they label the report).

    Returns:
        The :class:`Context` (rank, world_size, local_rank, local_world_size, device, is_main ...).

    Raises:
        ApiUsageError: called twice, or after :func:`finish`.
        ValidationError: the launcher's variables contradict each other, or the run's spec is invalid.
    """
    global _run
    if _run is not None:
        raise ApiUsageError("ck.init() was called twice", hint="call ck.init() once and keep the ctx it returns")
    if _finished:
        raise ApiUsageError("ck.init() after ck.finish()",
                            hint="ck.finish() ends the run; call ck.init() once at the start of the script")
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise ApiUsageError(f"ck.init(log_every={log_every!r}) must be a positive int", hint="e.g. log_every=10")
    if max_nonfinite_steps is not None and (isinstance(max_nonfinite_steps, bool)
                                            or not isinstance(max_nonfinite_steps, int) or max_nonfinite_steps < 0):
        raise ApiUsageError(f"ck.init(max_nonfinite_steps={max_nonfinite_steps!r}) must be an int >= 0",
                            hint="e.g. max_nonfinite_steps=20 (0: never stop)")
    t_start = time.perf_counter()
    environ = os.environ
    from cyclone_kit.config.job import CheckpointConfig

    given = run_dir if run_dir is not None else environ.get("CYCLONE_RUN_DIR") or None
    folder = Path(given).absolute() if given else None
    cc, spec_log_every, spec_nonfinite = _spec_settings(folder) if folder is not None else (CheckpointConfig(), None, 0)
    _install_hook()
    from cyclone_kit.runtime.env import detect
    from cyclone_kit.runtime.session import open_session
    from cyclone_kit.runtime.watchers.scriptsteps import BUSY_SHARE

    env = detect(environ)
    # busy_share: the script's own validation passes are no step ck is told of, so not stalls
    session = open_session(env, environ, folder or Path(), cc, group_for_one=True, t_start=t_start,
                           busy_share=BUSY_SHARE)
    if folder is None:
        folder = _new_run_dir(session)
        session.run_dir = folder
    import torch

    ctx = Context(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                  local_world_size=env.local_world_size, device=torch.device(session.device.torch_device),
                  is_main=env.is_main, node_rank=env.node_rank, num_nodes=env.num_nodes,
                  restart_count=env.restart_count, run_dir=folder, launcher=session.launcher)
    _run = _Run(session, ctx, log_every or _env_log_every(environ) or spec_log_every or DEFAULT_LOG_EVERY, info)
    limit = _env_log_every(environ, NONFINITE_VAR, least=0)
    session.max_nonfinite_steps = next(v for v in (max_nonfinite_steps, limit, spec_nonfinite) if v is not None)
    return ctx


def load_checkpoint(map_location: Any = "cpu") -> dict[str, Any] | None:
    """The newest complete checkpoint of this run (the dict given to :func:`save_checkpoint`), or None.

    Call on every rank (a collective): rank 0 picks the newest file that loads (a torn or
    corrupt one is skipped with a warning) and every rank loads that same one. Files are read
    with ``weights_only=True``: tensors and plain containers only.

    Args:
        map_location: where tensors are loaded (``"cpu"`` by default; ``ctx.device`` works too).
    """
    run = _require("load_checkpoint")
    from cyclone_kit.runtime.checkpoint import USER_STATE

    found = run.session.load_latest(map_location)
    if found is None:
        return None
    state, path = found
    step = int(state["step"])
    run.start_step = step
    if run.timer is not None:
        run.timer.open()  # (ck.instrument's window too)
    run.window_t0 = time.perf_counter()  # the first window times steps, not the load
    if run.ctx.is_main:
        print(f"cyclone_kit: resumed from {path} at step {step}", flush=True)
    if USER_STATE in state:
        return dict(state[USER_STATE])
    return {k: v for k, v in state.items() if k != "format"}


def log_step(step: int, samples: float | None = None, loss: Any = None) -> None:
    """Record that optimizer step ``step`` is done (call on every rank, after every step).

    Rank 0 writes a ``step`` record every ``log_every`` steps: global samples/s over the window,
    time per step and rank 0's mean loss. A tensor loss is read only at the window's end (no
    per-step device sync); the window's clock stops after that read (or, with no tensor loss, after
    a CUDA synchronize), so the rate counts work the device finished, not work the host queued.
    The first call also writes the run's ``start`` record, with the
    batch sizes taken from ``samples``.

    Args:
        step: optimizer steps done so far (1 after the first step; increasing, continuing after a resume).
        samples: samples processed by all ranks together in this step (the global batch).
        loss: this step's loss (a float or a 0-d tensor), or None.
    """
    run = _require("log_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ApiUsageError(f"ck.log_step(step={step!r}): step must be a non-negative int",
                            hint="pass the number of optimizer steps done so far, e.g. ck.log_step(step + 1, ...)")
    if run.last_step is not None and step <= run.last_step:
        raise ApiUsageError(f"ck.log_step(step={step}) after step {run.last_step}: steps must increase",
                            hint="pass the number of optimizer steps done so far, once per step")
    if not run.started:
        run.begin(samples)
    run.last_step = step
    run.session.progress(step)  # the progress watchdog: a rank with no step for its bound ends the job
    run.window_steps += 1
    if samples:
        run.window_samples += samples
    if loss is not None:
        run.window_losses.append(loss.detach() if hasattr(loss, "detach") else loss)
    if run.timer is not None:
        run.timer.script_step_done()
    if step % run.log_every == 0:
        run.flush_window(step)


def instrument(model: Any = None, loader: Any = None, optimizer: Any = None) -> Any:
    """Time the phases of every step of this script, as the built-in engine does (opt-in).

    Call once on every rank after :func:`init` and before the first :func:`log_step`. Each
    ``step`` record then carries the step's data wait, compute, gradient communication (total and
    the part not hidden behind backward) and the rest (:mod:`cyclone_kit.runtime.phases` defines
    them; host clock on the CPU, CUDA events read once per window on GPUs). What is timed:

    * ``model``: a ``DistributedDataParallel`` model gets a comm hook wrapping the default
      all-reduce that times every bucket (so do not register another hook); an FSDP2 model its
      all-gathers and reduce-scatters; its first forward of a step starts the compute phase.
    * ``loader``: the returned wrapper times every ``next()`` as data wait (iterate the wrapper;
      other attributes are the loader's). Without it data loading counts as ``other_time_s`` and
      ``data_time_s`` is null.
    * ``optimizer``: its ``step()`` ends the compute phase (else :func:`log_step` does).

    Returns:
        The timed loader to iterate, or None when no ``loader`` is given.

    Raises:
        ApiUsageError: called twice, after the first :func:`log_step`, with nothing to time, or on
            a DDP model that already has a comm hook.
    """
    run = _require("instrument")
    if run.timer is not None:
        raise ApiUsageError("ck.instrument() was called twice", hint="call it once, before the training loop")
    if run.started:
        raise ApiUsageError("ck.instrument() after the first ck.log_step()",
                            hint="call ck.instrument(model=..., loader=...) before the training loop")
    if model is None and loader is None and optimizer is None:
        raise ApiUsageError("ck.instrument() was given nothing to time",
                            hint="pass model=ddp_model and loader=train_loader (optimizer= too, if you like)")
    from cyclone_kit.runtime import phases

    timer = phases.PhaseTimer(phases.clock_for(run.ctx.device))
    try:
        wrapped = phases.instrument_script(timer, model, loader, optimizer, distributed=run.ctx.world_size > 1)
    except RuntimeError as e:
        raise ApiUsageError(f"ck.instrument(model=...) could not register its DDP comm hook ({e})",
                            hint="leave out model= or remove your own register_comm_hook call") from None
    if timer.comm_note and run.ctx.is_main:  # an older torch: the communication is not timed
        sys.stderr.write(f"cyclone_kit: warning: {timer.comm_note}\n")
    run.timer, run.data_timed = timer, loader is not None
    timer.open()
    if not run.window_steps:
        run.window_t0 = time.perf_counter()  # the first window starts here, with the timer
    return wrapped


def stop_requested() -> bool:
    """True once every rank has agreed to stop (the requeue signal, SIGTERM, or a time limit).

    Call on every rank once per step, at the same point of the loop: ranks agree about every
    ``checkpoint.poll_s`` seconds on a side channel (an asynchronous all-reduce, no device
    sync), so all of them see True after the same step. Then save a checkpoint and leave the
    loop; :func:`finish` requeues the job when the signal asked for it.
    """
    run = _require("stop_requested")
    from cyclone_kit.runtime.signals import NONE

    run.polls += 1
    return run.session.poll(run.polls) != NONE


def save_checkpoint(state: Mapping[str, Any], step: int | None = None, *, blocking: bool | None = None) -> Path | None:
    """Save ``state`` as this run's checkpoint, atomically (call on every rank; rank 0 writes).

    The newest ``checkpoint.keep`` checkpoints are kept. :func:`load_checkpoint` gives the
    dict back. It may hold tensors and plain containers (``model.state_dict()``,
    ``optimizer.state_dict()``, ints, floats, strings, lists, dicts).

    By default (``checkpoint.async_write = true``) the call returns once rank 0 has copied
    ``state`` to host memory (every tensor cloned: later optimizer steps do not reach the file);
    the file is written in a background thread while training goes on. The next call waits for
    that write, and :func:`finish` (or the end of a failed run) finishes it; a write that failed
    (a full disk) raises its error there, the same one-line error as a blocking save.

    Args:
        state: what to save (rank 0's copy is written).
        step: the step it belongs to (default: ``state["step"]`` when an int, else the last
            :func:`log_step`, else the number of :func:`stop_requested` calls).
        blocking: True: the file is complete (checksum, rename) when the call returns; False:
            written in the background; None (default): as the run's ``checkpoint.async_write`` says.

    Returns:
        The checkpoint's path on rank 0 (when written in the background: the path it will
        have), None on the other ranks.

    Raises:
        DiskFullError: this checkpoint, or the previous one written in the background, found the disk full.
    """
    run = _require("save_checkpoint")
    if not isinstance(state, Mapping):
        raise ApiUsageError(f"ck.save_checkpoint() takes a dict, not {type(state).__name__}",
                            hint="pass e.g. {'model': model.state_dict(), 'optimizer': opt.state_dict(), 'step': s}")
    if step is None:
        own = state.get("step")
        step = own if isinstance(own, int) and not isinstance(own, bool) else (
            run.last_step if run.last_step is not None else run.polls)
    if blocking is not None and not isinstance(blocking, bool):
        raise ApiUsageError(f"ck.save_checkpoint(blocking={blocking!r}) must be True, False or None",
                            hint="blocking=True waits for the file; None follows checkpoint.async_write")
    from cyclone_kit.runtime.checkpoint import USER_STATE

    payload = {"step": int(step), USER_STATE: dict(state)} if run.ctx.is_main else None
    return run.session.save(payload, int(step), blocking=blocking)


def finish(status: str | None = None) -> str:
    """End the run on this rank: the ``end`` record, requeue when preempted, teardown. Call last, on every rank.

    Args:
        status: ``completed``, ``preempted``, ``cancelled`` or ``failed``; by default, when
            :func:`stop_requested` said True, ``preempted`` (``cancelled`` after the user's
            ``cyclone-kit cancel``), else ``completed``.

    Returns:
        The status written.
    """
    global _run, _finished
    run = _require("finish")
    from cyclone_kit.runtime.metrics import STATUSES
    from cyclone_kit.runtime.signals import NONE

    if status is None:
        status = run.session.stop_status() if run.session.agreed != NONE else "completed"
    if status not in STATUSES:
        raise ApiUsageError(f"ck.finish(status={status!r}) is not a status", hint=f"use one of: {', '.join(STATUSES)}")
    steps = run.last_step if run.last_step is not None else run.start_step
    run.begin(None)
    run.flush_window(steps)
    energy = run.energy.stop() if run.energy is not None else None
    run.session.end(status, steps, release_signals=False,  # kept through the teardown: a requeue's SIGTERM is recorded
                    energy_j=energy)
    run.session.close()
    _run, _finished = None, True
    return status


# --------------------------------------------------------------------------- helpers
def _require(name: str) -> _Run:
    if _run is None:
        if _finished:
            raise ApiUsageError(f"ck.{name}() after ck.finish()", hint="call ck.finish() last, once the loop is done")
        raise ApiUsageError(f"ck.{name}() before ck.init()",
                            hint="call ctx = ck.init() once at the start of the script, before any other ck call")
    return _run


def _env_log_every(environ: Mapping[str, str], var: str = LOG_EVERY_VAR, least: int = 1) -> int | None:
    """``$CYCLONE_LOG_EVERY`` (or ``var``) as an int >= ``least`` (None when unset).

    Raises:
        ValidationError: it is set to something else.
    """
    raw = environ.get(var, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < least:
        raise ValidationError(f"{var}={raw!r} is not an integer >= {least}", hint=f"e.g. {var}=10")
    return int(raw)


def _spec_settings(run_dir: Path) -> tuple[Any, int | None, int]:
    """(``[checkpoint]`` as a CheckpointConfig, ``train.log_every`` or None, ``train.max_nonfinite_steps``)
    from ``run_dir/spec.json``."""
    from cyclone_kit.config.job import CheckpointConfig, spec_from_dict
    from cyclone_kit.rundir.layout import RunDir

    path = RunDir(run_dir).spec
    if not path.is_file():
        return CheckpointConfig(), None, 0
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValidationError(f"{path}: not valid JSON ({e})", hint="regenerate it with cyclone-kit submit") from None
    if not isinstance(data, dict):
        raise ValidationError(f"{path}: a job spec must be a table", hint="regenerate it with cyclone-kit submit")
    cc = spec_from_dict({"checkpoint": data.get("checkpoint") or {}}).checkpoint
    every = None
    for table in ("train", "script"):
        value = (data.get(table) or {}).get("log_every") if isinstance(data.get(table), dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            every = value
            break
    limit = (data.get("train") or {}).get("max_nonfinite_steps") if isinstance(data.get("train"), dict) else None
    return cc, every, limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0


def _new_run_dir(session: Any) -> Path:
    """``./runs/<script>-<stamp>``, created by rank 0 and shared with the others."""
    path: list[Any] = [None]
    if session.env.is_main:
        from cyclone_kit.rundir.layout import create_run_dir

        path[0] = str(create_run_dir(Path("runs").absolute(), _script_name(), {}))
    if session.distributed:
        import torch.distributed as dist

        dist.broadcast_object_list(path, src=0)
    return Path(path[0])


def _script_name() -> str:
    name = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c", "-") else ""
    return name or "script"


def _synchronize(device: Any) -> None:
    """Wait for ``device``'s queued work (CUDA only; the CPU runs its ops as they are called)."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _mean_loss(losses: list[Any]) -> tuple[float | None, int]:
    """(the mean of the window's losses, how many of them were not finite); (None, 0) for none."""
    if not losses:
        return None, 0
    total, bad = 0.0, 0
    tensors = [x for x in losses if hasattr(x, "float")]
    if tensors:
        import torch

        values = torch.stack([t.float().reshape(()) for t in tensors])
        both = torch.stack([values.sum(), (~torch.isfinite(values)).sum().float()]).tolist()  # one device sync
        total, bad = both[0], int(both[1])
    plain = [float(x) for x in losses if not hasattr(x, "float")]
    total += sum(plain)
    bad += sum(1 for x in plain if not math.isfinite(x))
    return total / len(losses), bad


def _install_hook() -> None:
    """Uncaught exceptions after init: a CycloneError prints one line and exits 2; anything else
    first writes the ``failed`` end record and this rank's error record, then the usual traceback."""
    global _previous_hook
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def _stderr() -> Any:
    """The real stderr: torch.distributed's own excepthook runs ours with sys.stderr swapped for a buffer."""
    return sys.__stderr__ or sys.stderr


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    from cyclone_kit.runtime.watchers.stall import park_if_stalling

    park_if_stalling()  # this rank's watchdog is ending it: the rank that waited is not blamed
    run = _run
    if run is not None:
        from cyclone_kit.core.errors import ResumeRefused

        try:
            if not isinstance(exc, ResumeRefused):  # a refused resume leaves the metrics as they were
                steps = run.last_step if run.last_step is not None else run.start_step
                run.begin(None)
                run.session.end("failed", steps)
        except Exception as e:  # the record is a courtesy: never hide the real error
            _stderr().write(f"cyclone_kit: could not write the failed end record: {e}\n")
        try:
            from cyclone_kit.runtime.metrics import write_error_record

            write_error_record(run.ctx.run_dir, run.ctx.rank, run.session.host, exc,
                               "".join(traceback.format_exception(kind, exc, tb)))
        except Exception as e:
            _stderr().write(f"cyclone_kit: could not write the error record: {e}\n")
    if isinstance(exc, CycloneError):
        rank = f"[rank {run.ctx.rank}] " if run is not None and run.ctx.world_size > 1 else ""
        out = _stderr()
        out.write(f"error: {rank}{exc}\n")
        out.flush()
        sys.stdout.flush()
        if "cyclone_kit.runtime.launch" in sys.modules:  # the launch shim called us: it records the end and exits
            return
        os._exit(exc.exit_code)  # no teardown that could wait on a peer
    (_previous_hook or sys.__excepthook__)(kind, exc, tb)


_install_hook()  # before any ck call, so that even the first call out of order fails in one line
