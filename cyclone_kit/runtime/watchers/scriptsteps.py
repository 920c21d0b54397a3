"""The progress watchdog of a user's script that does not call ``ck.log_step``: fed by its optimizer steps.

A script run by the launch shim may never tell cyclone_kit about its steps, yet a rank of it can
hang like any other (a deadlock, a dead file system, a rank that sleeps in a collective's
partner), and the job would burn its wall time. The shim therefore calls :func:`arm` before the
script runs: once the script imports ``torch.optim`` (nothing is imported for it), a global
optimizer step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``, which every
``torch.optim`` optimizer runs after ``step()``: plain loops, DDP, FSDP, Lightning, Accelerate,
Horovod's ``DistributedOptimizer``) feeds a :class:`~cyclone_kit.runtime.watchers.stall.ProgressWatch`
started at the first step, with the job's ``checkpoint.stall_floor_s`` and ``stall_factor``.

What the shim cannot see is what is not a step: a validation pass or a checkpoint between
optimizer steps. Past the bound, a rank whose main thread is not inside a collective, keeps
returning to Python (a probe the watchdog posts with ``Py_AddPendingCall`` runs between two
bytecodes of the main thread) and kept at least :data:`BUSY_SHARE` of a core busy since its last
step is counted as working and the wait starts again
(:func:`~cyclone_kit.runtime.watchers.stall.idle_verdict`). A rank that sleeps, waits on a lock, a dead
file system, or a peer inside a collective for the whole bound (counted from when its watchdog first saw
it there, not from its last step: a rank whose own validation pass ended first waits for a peer's) is
stalled; so is one whose main thread sat in one C call for the whole
bound, however busy: a GPU rank hung behind a collective that never ends waits at its next host
sync (``loss.item()``), which spins a core under CUDA's default scheduling in no frame of a known
wait. The usual rules follow (its stack in its error record, ``failure.json`` naming the stuck
rank, a requeue under Slurm when ``checkpoint.requeue`` allows it, exit 124). A single call that
rightly outlasts the bound (joining a thread that validates) counts as a stall too: raise
``checkpoint.stall_floor_s``. A rank that spins in a Python loop of its own is not caught by its
own watchdog; its peers, waiting for it in a collective, are.

``ck.init()`` + ``ck.log_step`` in the script take over (:func:`hand_over`): the API's watchdog knows the
script's steps and its checkpoints (``ck.save_checkpoint``); the script's own passes between two steps
it judges by the same rule, :data:`BUSY_SHARE`. Stdlib only.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The share of a core a rank must keep busy, with no step past its bound, to count as working.
BUSY_SHARE = 0.1


@dataclass
class _State:
    run_dir: Path
    env: Any  # the rank's DistEnv
    checkpoint: Any  # the job's CheckpointConfig
    environ: Mapping[str, str]
    on_stalled: Callable[[str], None]  # the shim's end record, given the root cause (by one rank)
    steps: int = 0
    watch: Any = None
    hook: Any = None  # the optimizer hook's handle
    done: bool = False  # stopped, or handed over to ck's watchdog


_STATE: _State | None = None


def arm(run_dir: Path, env: Any, checkpoint: Any, environ: Mapping[str, str],
        on_stalled: Callable[[str], None]) -> bool:
    """Watch this rank's optimizer steps once the script imports ``torch.optim``; False when the
    job's ``checkpoint.stall_floor_s`` is 0 (the watchdog is off)."""
    global _STATE
    from cyclone_kit.runtime.importhook import after_import

    if not getattr(checkpoint, "stall_floor_s", 0) > 0:
        return False
    _STATE = _State(Path(run_dir), env, checkpoint, environ, on_stalled)
    after_import("torch.optim.optimizer", _register)
    return True


def hand_over() -> None:
    """The script's ``ck`` session watches from now on: this watchdog stops (its record says ended)."""
    stop()


def stop() -> None:
    """The script ended (or ck took over): stop watching and remove the optimizer hook."""
    state = _STATE
    if state is None or state.done:
        return
    state.done = True
    if state.hook is not None:
        with contextlib.suppress(Exception):
            state.hook.remove()
    if state.watch is not None:
        state.watch.stop()


def _register(optimizer_module: Any) -> None:
    """On ``torch.optim.optimizer``'s import: register the step hook (once)."""
    state = _STATE
    if state is None or state.done or state.hook is not None:
        return
    state.hook = optimizer_module.register_optimizer_step_post_hook(_on_step)


def _on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """After every optimizer step of the script: a beat (the watchdog starts at the first)."""
    state = _STATE
    if state is None or state.done:
        return
    state.steps += 1
    if state.watch is None:
        state.watch = _start(state)
    state.watch.beat(state.steps)


def _start(state: _State) -> Any:
    from cyclone_kit.rundir.failures import segment_id
    from cyclone_kit.runtime.watchers.stall import ProgressWatch, RunDirRecords, StallPolicy

    cc, env = state.checkpoint, state.env
    policy = StallPolicy(float(cc.stall_floor_s), float(cc.stall_factor))
    return ProgressWatch(RunDirRecords(state.run_dir), env.rank, env.world_size, env.host or "?", policy,
                         segment_id(state.environ), lambda stuck, records, own: _on_stall(state, stuck, records),
                         busy_share=BUSY_SHARE).start()


def _on_stall(state: _State, stuck: list[int], records: dict[int, Any]) -> None:
    """A stalled rank's last acts (from the watchdog's thread): the records; and, by the rank that wrote
    ``failure.json``, the shim's end record and the requeue (under Slurm, when allowed and no step
    watcher does it)."""
    from cyclone_kit.rundir.failures import record_stall, segment_id
    from cyclone_kit.runtime.signals import requeue, under_slurm
    from cyclone_kit.runtime.watchers.stall import STEPWATCH_VAR, stall_failure, stall_requeue

    env, environ = state.env, state.environ
    doc, errors = stall_failure(stuck, records, env.world_size, environ.get("SLURM_JOB_ID"), segment_id(environ))
    # every other stuck rank's record, by the winner: the launcher may stop a stuck rank before it writes its own
    on_behalf = [e for r, e in errors.items() if r != env.rank]
    won = record_stall(state.run_dir, doc, errors.get(env.rank), on_behalf)
    if not won:
        return
    sys.stderr.write(f"cyclone_kit: stalled: {doc['root_cause']}\n")
    state.on_stalled(str(doc["root_cause"]))  # one end record: the other ranks may be stopped by now
    if under_slurm(environ) and not environ.get(STEPWATCH_VAR):
        yes, why = stall_requeue(state.checkpoint.requeue, state.checkpoint.max_requeues, env.restart_count)
        sys.stderr.write(f"cyclone_kit: {why}\n")
        if yes:
            try:
                requeue(environ)
            except Exception as e:  # the job ends anyway; say why it was not requeued
                sys.stderr.write(f"cyclone_kit: requeue failed: {e}\n")
