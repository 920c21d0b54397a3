"""One run segment on this rank: the set-up, metrics, stop, checkpoint and requeue path every trainer shares.

The public API (:mod:`cyclone_kit.api`, for user scripts) and the built-in engines
(:mod:`cyclone_kit.runtime.engine.dataparallel`, :mod:`cyclone_kit.runtime.engine.pipeline`) all go through a
:class:`Session`, so there is one implementation of each of these:

* **set-up** (:func:`open_session`): the stop-signal handlers, torch threads, the device
  (``cuda:local_rank`` or the CPU), the process group (NCCL on CUDA, gloo on CPU; a group that
  already exists is reused and left alone), every rank's host name, and the stop agreement's
  side group;
* **metrics** (:meth:`Session.begin`, :meth:`Session.log_window`, :meth:`Session.write`): the
  contract's records (:mod:`cyclone_kit.runtime.metrics`), written by rank 0;
* **stop** (:meth:`Session.poll`): the requeue/time-limit signal, agreed across ranks at the
  same step (:class:`~cyclone_kit.runtime.signals.StopAgreement`);
* **checkpoints** (:meth:`Session.save`, :meth:`Session.load_latest`): atomic files kept and
  rotated as ``checkpoint.keep`` says; the newest loadable one chosen by rank 0 and loaded by
  every rank; FSDP's shards written in the background on every rank (:meth:`Session.save_after_shards`),
  their ``.pt`` written once all are done (:meth:`Session.finish_shards`: the next checkpoint, the end);
* **end** (:meth:`Session.end`): the ``end`` record, the rank summary, ``scontrol requeue``
  when the agreed stop was the requeue signal, and (:meth:`Session.close`) the teardown.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cyclone_kit.config.job import CheckpointConfig
from cyclone_kit.core.errors import CommandError, DiskFullError, ResumeRefused, TrainingDiverged, ValidationError
from cyclone_kit.runtime import metrics as mx
from cyclone_kit.runtime.dist import (
    DeviceChoice,
    group_timeout_s,
    init_process_group,
    probe_device,
    setup_threads,
    side_group,
    warn,
)
from cyclone_kit.runtime.env import DistEnv
from cyclone_kit.runtime.signals import NONE, StopAgreement, StopFlag, catch_stop_signals, requeue, should_requeue, under_slurm
from cyclone_kit.runtime.watchers.stall import END_TIME_VAR, STEPWATCH_VAR, collective_timeout


@dataclass
class Session:
    """The shared state of one run segment on this rank (built by :func:`open_session`).

    Attributes:
        env: where this rank sits (rank, sizes, launcher, restart count).
        environ: the process environment the session was opened with.
        run_dir: the run directory (metrics, checkpoints, rank records).
        cc: the spec's ``[checkpoint]`` table (keep, signal, requeue, max_requeues, poll_s).
        stop_flag: this rank's installed signal handlers.
        device: the device this rank trains on.
        distributed: more than one rank (collectives are needed).
        owns_group: the session created the process group (and destroys it in :meth:`close`).
        threads: torch's intra-op threads.
        host: this rank's node name.
        hostnames: every rank's node, deduplicated in rank order.
        t_start: ``time.perf_counter()`` at the start of the segment.
        pg_timeout_s: the timeout of the process group's collectives (the group the session created, or the
            one the script made as torch reports it; None: a world of one, or unknown), which the progress
            watchdog's bound stays below.
        busy_share: the progress watchdog's rule for a loop that does not say what is not a step (a script's
            own validation pass between ``ck.log_step`` calls): past the bound, a rank computing in Python
            outside a collective is working (:func:`~cyclone_kit.runtime.watchers.stall.idle_verdict`); None
            (the built-in engines, which mark their pauses): no such exception.
    """

    env: DistEnv
    environ: Mapping[str, str]
    run_dir: Path
    cc: CheckpointConfig
    stop_flag: StopFlag
    device: DeviceChoice
    distributed: bool
    owns_group: bool
    threads: int
    host: str
    hostnames: list[str]
    t_start: float
    pg_timeout_s: float | None = None
    busy_share: float | None = None
    agreement: Any = None
    writer: mx.MetricsWriter | None = None
    global_rates: list[float] = field(default_factory=list)
    local_rates: list[float] = field(default_factory=list)
    agreed: int = NONE
    ended: bool = False
    checkpoint_notes: dict[str, Any] = field(default_factory=dict)
    max_nonfinite_steps: int = 0
    nonfinite_run: int = 0
    nonfinite_warned: bool = False
    watch: Any = None
    ckpt_writer: Any = None
    ckpt_stats: dict[str, Any] = field(default_factory=dict)
    ckpt_spare: Any = None
    shards: Any = None  # the asynchronous sharded checkpoint in flight (checkpoint.PendingShards), if any

    @property
    def checkpoint_dir(self) -> Path:
        """``RUN_DIR/checkpoints`` (the layout is :class:`cyclone_kit.rundir.layout.RunDir`'s)."""
        from cyclone_kit.rundir.layout import RunDir

        return RunDir(self.run_dir).checkpoints

    @property
    def launcher(self) -> str:
        """The launcher for the start record (``local`` for cyclone-kit run, else the detected one)."""
        return self.environ.get("CYCLONE_LAUNCHER") or self.env.launcher

    # ------------------------------------------------------------------ metrics
    def start_fields(self) -> dict[str, Any]:
        """The ``start`` record's fields this session knows (the trainer adds the rest)."""
        env, environ = self.env, self.environ
        return dict(
            run_id=self.run_dir.name, world_size=env.world_size, num_nodes=env.num_nodes,
            local_world_size=env.local_world_size, launcher=self.launcher, device=self.device.kind,
            device_name=self.device.name, hostnames=self.hostnames,
            slurm_job_id=environ.get("SLURM_JOB_ID") if under_slurm(environ) else None,
            time=mx.utc_now(), versions=versions(),
            git_commit=mx.git_commit(environ.get("SLURM_SUBMIT_DIR") or os.getcwd()) if env.is_main else None,
            restart_count=env.restart_count, threads=self.threads,
            phase_timing=None, comm_timing=None,  # a trainer that times the step phases says how
        )

    def begin(self, **fields: Any) -> mx.MetricsWriter:
        """Open the metrics file (rank 0) and write the ``start`` record: :meth:`start_fields`
        updated with ``fields`` (model, batch sizes, start_step, ...)."""
        self.writer = mx.MetricsWriter(self.run_dir / mx.METRICS_FILE if self.env.is_main else None)
        self.writer.write(mx.record("start", **{**self.start_fields(), **self.checkpoint_notes, **fields}))
        return self.writer

    def write(self, rec: dict[str, Any]) -> None:
        """Write one record (rank 0; a no-op elsewhere and before :meth:`begin`)."""
        if self.writer is not None:
            self.writer.write(rec)

    def log_window(self, step: int, epoch: int | None, loss: float | None, steps: int, elapsed_s: float,
                   data_s: float | None, global_samples: float, local_samples: float,
                   nonfinite_steps: int | None = None, phases: Mapping[str, float | None] | None = None,
                   **extra: Any) -> float:
        """Record a window of ``steps`` steps ending at ``step``: a ``step`` record (rank 0) and
        the window's rates (for the end record's steady state); returns the global samples/s.
        ``extra``: more fields for the step record (the pipeline's per-stage times).

        ``data_s`` is the window's data wait in seconds (None: not measured); ``phases``, when the
        step phases were timed, the per-step figures of :mod:`cyclone_kit.runtime.phases`
        (``data_time_s`` and the contract's ``PHASE_FIELDS``), which take precedence.

        A loss that is not finite is recorded as such (``"NaN"``, ``"Infinity"``), warned about
        once, and counted: ``nonfinite_steps`` of the window (default: all of them when the
        window's mean loss is not finite).

        Raises:
            TrainingDiverged: ``max_nonfinite_steps`` consecutive steps had a non-finite loss.
        """
        elapsed_s = max(elapsed_s, 1e-9)
        n = max(steps, 1)
        rate = global_samples / elapsed_s
        self.global_rates.append(rate)
        self.local_rates.append(local_samples / elapsed_s)
        per_step = dict(phases or {})
        data = per_step.pop("data_time_s", None if data_s is None else data_s / n)
        rec = mx.step_record(step, epoch, loss, elapsed_s / n, data, rate, mx.utc_now(), **per_step, **extra)
        bad = nonfinite_steps if nonfinite_steps is not None else (
            n if loss is not None and not math.isfinite(loss) else 0)
        if bad:
            rec["nonfinite_steps"] = bad
        self.write(rec)
        self._count_nonfinite(step, bad, n)
        return rate

    def _count_nonfinite(self, step: int, bad: int, steps: int) -> None:
        """Warn at the first non-finite loss; stop after ``max_nonfinite_steps`` in a row."""
        if not bad:
            self.nonfinite_run = 0
            return
        self.nonfinite_run = bad if bad < steps else self.nonfinite_run + bad
        if not self.nonfinite_warned and self.env.is_main:
            self.nonfinite_warned = True
            limit = (f"training stops after {self.max_nonfinite_steps} such steps in a row"
                     if self.max_nonfinite_steps else "training goes on (set train.max_nonfinite_steps to stop)")
            print(f"cyclone_kit: warning: the loss is not finite (NaN or inf) in the window ending at step {step}; "
                  f"recorded as such; {limit}", flush=True)
        if self.max_nonfinite_steps and self.nonfinite_run >= self.max_nonfinite_steps:
            raise TrainingDiverged(
                f"the loss was not finite for {self.nonfinite_run} step(s) in a row up to step {step} "
                f"(limit {self.max_nonfinite_steps})",
                hint="lower the learning rate or use fp32/bf16 precision, then resume from the newest checkpoint "
                     "(written before the loss diverged) or raise the limit")

    # ------------------------------------------------------------------ progress
    def progress(self, step: int) -> None:
        """Optimizer step ``step`` is done on this rank: feeds the progress watchdog
        (:mod:`cyclone_kit.runtime.watchers.stall`), started at the first call. Call after every step."""
        if self.watch is None:
            self.watch = start_watch(self)
        if self.watch:
            self.watch.beat(step)

    def not_a_step(self, what: str = "work that is not a step") -> Any:
        """A context for work between steps that is not a step (``what``: e.g. ``"the validation pass of epoch
        3"``, ``"the checkpoint of step 8"``; a stall inside names it)."""
        import contextlib

        return self.watch.paused(what) if self.watch else contextlib.nullcontext()

    def stop_watch(self) -> None:
        """The segment ends here: the watchdog stops and marks this rank's progress record ended."""
        if self.watch:
            self.watch.stop()

    # ------------------------------------------------------------------ stop
    def poll(self, step: int) -> int:
        """The stop flag agreed by every rank after ``step`` (NONE, STOP or REQUEUE); call on every
        rank with the same ``step`` sequence. Once a stop is agreed it stays agreed."""
        if self.agreed == NONE:
            self.agreed = self.agreement.poll(step)
            if self.agreed != NONE:
                self.agreement.finish()
        return self.agreed

    def settle(self) -> None:
        """Wait for an outstanding stop reduce (after the loop, before other collectives)."""
        if self.agreement is not None:
            self.agreement.finish()

    # ------------------------------------------------------------------ checkpoints
    def save(self, state: dict[str, Any] | None, step: int, after_write: Any = None,
             blocking: bool | None = None) -> Path | None:
        """Rank 0 writes ``state`` as the checkpoint of ``step`` (atomic; the newest
        ``checkpoint.keep`` kept) and runs ``after_write(checkpoint_dir)`` if given; every rank
        then waits for it (other ranks pass None). Call on every rank.

        Asynchronous (``blocking`` False; None: ``not checkpoint.async_write``): rank 0 first waits
        for its previous write (raising its failure), copies ``state`` to host memory
        (:func:`~cyclone_kit.runtime.checkpoint.snapshot`) and writes the copy in a background
        thread; the ranks wait only for the copy. A save with ``after_write`` (the sharded formats,
        whose shards every rank has just written) is always written before it returns.

        Returns:
            The checkpoint's path on rank 0 (asynchronous: the path it will have), None elsewhere.

        Raises:
            DiskFullError: this write, or the previous asynchronous one, found the disk full.
        """
        from cyclone_kit.runtime import checkpoint as ckpt

        if blocking is None:
            blocking = not self.cc.async_write
        blocking = blocking or after_write is not None
        path = None
        with self.not_a_step(f"the checkpoint of step {step}"):
            if self.env.is_main and state is not None:
                before = self.ckpt_writer.step if self.ckpt_writer is not None else None
                waited = self.finish_checkpoint()  # at most one write in flight; a failed one raises here
                if blocking:
                    path = self._write_checkpoint(state, step, after_write)
                else:
                    t0 = time.perf_counter()
                    copy = ckpt.snapshot(state, into=self.ckpt_spare)  # the finished write's buffers, reused
                    self.ckpt_spare = copy
                    self._count("checkpoint_snapshot_s", time.perf_counter() - t0)
                    if self.ckpt_writer is None:
                        self.ckpt_writer = ckpt.BackgroundWriter()
                    self.ckpt_writer.start(lambda: self._write_checkpoint(copy, step, None), step)
                    self._count("checkpoints_async", 1)
                    path = ckpt.checkpoint_path(self.checkpoint_dir, step)
                if waited is not None and waited.busy:
                    print(f"cyclone_kit: checkpoint of step {step} waited {waited.seconds:.2f} s for the write of "
                          f"step {before} before it", flush=True)
            self.barrier()
        return path

    def _write_checkpoint(self, state: dict[str, Any], step: int, after_write: Any) -> Path:
        """Write one checkpoint now (rank 0, in the caller's thread or the background writer's)."""
        from cyclone_kit.runtime import checkpoint as ckpt

        if self.cc.local_dir:  # node-local first (the newest one kept there), then copied and verified into the run
            local = ckpt.save_checkpoint(Path(self.cc.local_dir) / self.run_dir.name, state, step, 1)
            path = ckpt.copy_checkpoint(local, self.checkpoint_dir, self.cc.keep)
        else:
            path = ckpt.save_checkpoint(self.checkpoint_dir, state, step, self.cc.keep)
        print(f"cyclone_kit: checkpoint of step {step} written: {path}", flush=True)  # the log names the last one
        if after_write is not None:
            after_write(self.checkpoint_dir)
        return path

    def _count(self, name: str, value: float) -> None:
        self.ckpt_stats[name] = self.ckpt_stats.get(name, 0) + value

    def finish_checkpoint(self, raise_error: bool = True, timeout_s: float | None = None) -> Any:
        """Wait for rank 0's checkpoint write in flight, if any (a no-op elsewhere); raise its failure.

        Returns:
            The :class:`~cyclone_kit.runtime.checkpoint.Waited` (None: no background writer yet).
            A wait for a running write is counted for the ``end`` record (``checkpoint_waits``,
            ``checkpoint_wait_s``).

        Raises:
            DiskFullError: the background write found the disk full (unless ``raise_error`` is
                False: then a warning on stderr says which checkpoint was not written).
        """
        writer = self.ckpt_writer
        if writer is None:
            return None
        waited = writer.wait(timeout_s=timeout_s, raise_error=raise_error)
        if waited.busy:
            self._count("checkpoint_waits", 1)
            self._count("checkpoint_wait_s", waited.seconds)
        return waited

    def save_after_shards(self, state: dict[str, Any] | None, step: int, future: Any, after_write: Any = None,
                          staged_s: float = 0.0) -> None:
        """Register the sharded checkpoint of ``step`` whose shards every rank is now writing in the
        background (``future``, this rank's write); rank 0 passes the ``.pt``'s ``state`` (the others
        None), copied here to host memory. Nothing is written now: :meth:`finish_shards` writes the ``.pt``
        once every rank's shards are done. Call on every rank, after :meth:`finish_shards` (at most one
        in flight) and after starting the write; ``staged_s``: the seconds that start took (the copy
        of the shards to host memory), counted as ``checkpoint_snapshot_s``.
        """
        from cyclone_kit.runtime import checkpoint as ckpt

        if self.shards is not None:
            raise RuntimeError(f"the shards of step {self.shards.step} are still in flight: finish_shards() first")
        t0 = time.perf_counter()
        copy = ckpt.snapshot(state) if state is not None else None  # written later: later steps must not reach it
        self._count("checkpoint_snapshot_s", staged_s + time.perf_counter() - t0)
        self._count("checkpoints_async", 1)
        self.shards = ckpt.PendingShards(step, future, copy, after_write)

    def finish_shards(self, failed: bool = False, timeout_s: float | None = None,
                      before: int | None = None) -> Path | None:
        """Complete the sharded checkpoint in flight, if any: wait for this rank's shards, agree with
        every rank that all are written (one gather over the gloo side group), then rank 0 writes the
        ``.pt`` that names them (:meth:`save`: atomic, checksum, the newest ``checkpoint.keep`` kept,
        the orphaned shard directories pruned). A wait for a write still running is counted like the
        full-state writer's (``checkpoint_waits``, ``checkpoint_wait_s``).

        Call on every rank at the same point (the next checkpoint, the end of the segment), unless
        ``failed``: a failing rank only waits for its own write (at most ``timeout_s``), never for its
        peers (they may be dead), and writes no ``.pt``: the shard directory is never loaded, and is
        pruned by the next checkpoint written. ``before``: the step of the checkpoint about to start
        (a wait for a write still running is then said on rank 0's console, as the full-state writer's).

        Returns:
            The ``.pt``'s path on rank 0 when one was written, else None.

        Raises:
            ShardWriteFailed: on every rank, when some rank's shards were not written (unless ``failed``).
        """
        from concurrent.futures import TimeoutError as FutureTimeout

        import torch.distributed as dist

        from cyclone_kit.runtime import checkpoint as ckpt

        pending, self.shards = self.shards, None
        if pending is None:
            return None
        busy = not pending.future.done()
        t0 = time.perf_counter()
        error: str | None = None
        try:
            pending.future.result(timeout=timeout_s)
        except FutureTimeout:
            error = f"still writing after {timeout_s:g} s"
        except Exception as e:  # any rank's failure fails the checkpoint on every rank, below
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if busy:
            self._count("checkpoint_waits", 1)
            self._count("checkpoint_wait_s", time.perf_counter() - t0)
            if self.env.is_main and before is not None:
                print(f"cyclone_kit: checkpoint of step {before} waited {time.perf_counter() - t0:.2f} s for the "
                      f"shards of step {pending.step}", flush=True)
        if failed:
            if error is not None:
                warn(f"the sharded checkpoint of step {pending.step} was not completed ({error}); it is not kept")
            return None
        errors: list[Any] = [error]
        if self.distributed:
            errors = [None] * self.env.world_size
            dist.all_gather_object(errors, error, group=side_group())
        verdict = ckpt.shard_verdict(pending.step, errors)
        if verdict is not None:
            raise ckpt.ShardWriteFailed(verdict, hint="the named rank's error says why (a full disk, a quota, a "
                                        "lost peer); fix that and run the job again: it resumes from the newest "
                                        "complete checkpoint")
        return self.save(pending.state, pending.step, after_write=pending.after_write, blocking=True)

    def load_latest(self, map_location: Any = "cpu") -> tuple[dict[str, Any], Path] | None:
        """The newest loadable checkpoint of the run, chosen by rank 0 and loaded by every rank
        (so all resume from the same step); None when there is none. Call on every rank.

        Damaged checkpoints (checksum mismatch, torn) are skipped with a warning on rank 0's
        console, and recorded for the ``start`` record (``status`` shows them).

        Raises:
            ResumeRefused: on every rank, when checkpoints exist but none loads, or the run was
                told to resume (``run --resume``) and finds none; unless ``--restart-from-scratch``.
        """
        import torch.distributed as dist

        from cyclone_kit.runtime import checkpoint as ckpt

        scan = ckpt.scan_latest(self.checkpoint_dir, map_location) if self.env.is_main else None
        refusal = None
        if scan is not None:
            for skip in scan.skipped:
                print(f"cyclone_kit: warning: {skip.line()}", flush=True)
            self.checkpoint_notes = {"skipped_checkpoints": [{"path": s.path.name, "reason": s.reason}
                                                             for s in scan.skipped]} if scan.skipped else {}
            refusal = ckpt.fresh_start_refusal(scan, self.checkpoint_dir,
                                               resuming=self.environ.get(ckpt.RESUME_VAR) == "1",
                                               from_scratch=self.environ.get(ckpt.FROM_SCRATCH_VAR) == "1")
            if scan.found is None and scan.skipped and refusal is None:
                print(f"cyclone_kit: warning: no checkpoint could be loaded; starting over at step 0 "
                      f"({ckpt.FROM_SCRATCH_VAR}=1)", flush=True)
        found = scan.found if scan is not None else None
        choice: list[Any] = [str(found[1]) if found else None, refusal]
        if self.distributed:
            dist.broadcast_object_list(choice, src=0, group=side_group())  # rank 0 may take minutes to load it
        if choice[1] is not None:
            raise ResumeRefused(choice[1], hint=f"repair or restore a checkpoint there; or start over at step 0 "
                                f"with cyclone-kit run --resume {self.run_dir} --restart-from-scratch "
                                f"(a batch job: export {ckpt.FROM_SCRATCH_VAR}=1 and submit it again)")
        if choice[0] is None:
            return None
        if found is None:
            found = ckpt.load_checkpoint(Path(choice[0]), map_location), Path(choice[0])
        self.checkpoint_notes = {**self.checkpoint_notes, "resumed_from": found[1].name}
        return found

    def barrier(self) -> None:
        """Wait for every rank (a no-op for one rank), on the gloo side group: off NCCL's watchdog
        while rank 0 writes and fsyncs a checkpoint."""
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=side_group())

    def gather_to_main(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order on rank 0, [] on the others (:func:`gather_to_main`)."""
        return gather_to_main(obj, self.env, self.distributed)

    # ------------------------------------------------------------------ end
    def stop_status(self) -> str:
        """The end status of a segment that stopped on a signal: ``cancelled`` when the user asked
        for the cancel (recorded in the run directory), else ``preempted``."""
        from cyclone_kit.rundir.layout import RunDir

        return RunDir(self.run_dir).stop_status()

    def end(self, status: str, steps: int, total_steps: int | None = None, peak_memory_bytes: int | None = None,
            wall_time_s: float | None = None, release_signals: bool = True, energy_j: float | None = None) -> None:
        """Close the segment: the ``end`` record (rank 0), this rank's summary, the closing line,
        ``scontrol requeue`` (rank 0) when the agreed stop was the requeue signal under Slurm and
        requeues are left, then the signal handlers restored (unless ``release_signals`` is False:
        then :meth:`close` restores them after the teardown). ``energy_j``: the rank's GPU energy
        for its summary (:mod:`cyclone_kit.runtime.power`), when measured."""
        if self.ended:
            return
        if status == "failed":  # the failure is what matters: a write that fails too is only warned about
            self.finish_shards(failed=True, timeout_s=FAILED_WRITE_WAIT_S)  # no .pt: its peers may be dead
            self.finish_checkpoint(raise_error=False, timeout_s=FAILED_WRITE_WAIT_S)
        else:
            with self.not_a_step("the last checkpoint's writes"):
                self.finish_shards()  # every rank's shards, agreed, then the .pt (a stop's checkpoint too)
                self.finish_checkpoint()  # the last checkpoint (a stop's too) is complete before the end record
        self.ended = True
        if status != "failed" or not (self.watch and self.watch.stalled):
            self.stop_watch()
        wall = time.perf_counter() - self.t_start if wall_time_s is None else wall_time_s
        rate = mx.steady_state(self.global_rates)
        try:
            self.write({**mx.end_record(status, steps, rate, wall, mx.utc_now()), **self._checkpoint_fields()})
        except DiskFullError as e:
            if status != "failed":
                raise
            warn(f"the failed end record was not written: {e.message}")  # the failure itself is what matters
        if self.writer is not None:
            self.writer.close()
        if status == "failed":
            if release_signals:
                self.stop_flag.uninstall()
            return
        mx.write_rank_summary(self.run_dir, self.env.rank, self.host, self.device.torch_device,
                              mx.steady_state(self.local_rates), peak_memory_bytes
                              if peak_memory_bytes is not None else peak_memory(self.device), energy_j=energy_j)
        if self.env.is_main:
            of = f"/{total_steps}" if total_steps is not None else ""
            print(f"cyclone_kit: {status} at step {steps}{of} in {wall:.1f} s"
                  + (f", {rate:.1f} samples/s" if rate else ""), flush=True)
        if self.agreed != NONE and self.env.is_main:
            yes, why = should_requeue(self.agreed, self.cc.requeue, self.env.restart_count, self.cc.max_requeues,
                                      self.environ)
            print(f"cyclone_kit: stopped on a signal after a checkpoint; {why}", flush=True)
            if yes:
                try:
                    requeue(self.environ)
                except (CommandError, ValidationError) as e:
                    warn(f"requeue failed: {e}")
        if release_signals:  # after the requeue: Slurm's SIGTERM for the requeued job is only recorded
            self.stop_flag.uninstall()

    def _checkpoint_fields(self) -> dict[str, Any]:
        """The ``end`` record's account of asynchronous checkpoints (empty when there were none):
        how many, the seconds spent copying them to host memory, and how many saves had to wait
        for the previous write (and for how long)."""
        stats = self.ckpt_stats
        if not stats.get("checkpoints_async"):
            return {}
        return {"checkpoints_async": int(stats["checkpoints_async"]),
                "checkpoint_snapshot_s": round(float(stats.get("checkpoint_snapshot_s", 0.0)), 6),
                "checkpoint_waits": int(stats.get("checkpoint_waits", 0)),
                "checkpoint_wait_s": round(float(stats.get("checkpoint_wait_s", 0.0)), 6)}

    def close(self) -> None:
        """Tear down: wait for an outstanding stop reduce, then (when the session created it) a
        barrier and the process group destroyed (a gloo group left alive at exit can abort), and
        the signal handlers restored. A checkpoint write still in flight is finished first (sharded
        shards not completed by :meth:`end` are only waited for: no ``.pt`` names them)."""
        self.finish_shards(failed=True, timeout_s=FAILED_WRITE_WAIT_S)
        self.finish_checkpoint(raise_error=False)
        self.settle()
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
            self.owns_group = False
        self.stop_flag.uninstall()


#: How long a failing segment waits for its checkpoint write in flight (a hung file system must not
#: keep a failed or stalled rank from exiting; a write cut short never loads as good).
FAILED_WRITE_WAIT_S = 120.0


def open_session(env: DistEnv, environ: Mapping[str, str], run_dir: Path, cc: CheckpointConfig, *,
                 pg_timeout_s: int = 600, stop_flag: StopFlag | None = None, group_for_one: bool = False,
                 t_start: float | None = None, backend: str | None = None,
                 busy_share: float | None = None) -> Session:
    """Set up this rank: signal handlers, threads, device, process group, hosts, stop agreement.

    Args:
        env: this rank's place (:func:`cyclone_kit.runtime.env.detect`).
        environ: the environment (``os.environ`` at the edge).
        run_dir: the run directory.
        cc: the ``[checkpoint]`` table.
        pg_timeout_s: process-group timeout (a dead peer fails the others after this long).
        stop_flag: handlers installed earlier (to catch a signal during slow imports); else new ones.
        group_for_one: create a process group for a world of one too (a user script may wrap
            its model in DDP unconditionally; the built-in engine does not need one).
        t_start: when the segment started (default: now).
        backend: the process group's backend instead of the device's (gloo for Horovod, whose
            own ring moves the gradients).
        busy_share: the progress watchdog's rule for passes between steps it is not told of
            (:attr:`Session.busy_share`; a script on the API).
    """
    t_start = time.perf_counter() if t_start is None else t_start
    stop_flag = stop_flag or catch_stop_signals(cc.signal)
    pg_timeout_s = collective_timeout(pg_timeout_s, environ.get(END_TIME_VAR), time.time())
    threads = setup_threads(environ)
    device = probe_device(env, environ)
    if device.warning and env.local_rank == 0:
        warn(device.warning)
    owns = False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # the script (or Horovod, Lightning ...) made one
        if dist.get_world_size() != env.world_size:
            raise ValidationError(
                f"a process group of {dist.get_world_size()} rank(s) exists but the launcher says "
                f"{env.world_size}",
                hint="let cyclone_kit create the process group (call ck.init() before init_process_group)",
            )
    elif env.is_distributed:
        owns = init_process_group(env, device, pg_timeout_s, backend=backend)
    else:
        init_process_group(env, device, pg_timeout_s, backend=backend)  # selects the CUDA device
        if group_for_one:
            _group_of_one(device, pg_timeout_s)
            owns = True
    host = env.host or socket.gethostname()
    session = Session(env=env, environ=environ, run_dir=Path(run_dir), cc=cc, stop_flag=stop_flag, device=device,
                      distributed=env.is_distributed, owns_group=owns, threads=threads, host=host,
                      hostnames=gather_hosts(host, env.is_distributed), t_start=t_start,
                      pg_timeout_s=(pg_timeout_s if owns else group_timeout_s(device.kind))
                      if env.is_distributed else None, busy_share=busy_share)
    session.agreement = StopAgreement(stop_flag, env.is_distributed, interval_s=cc.poll_s)
    return session


def start_watch(session: Session) -> Any:
    """This rank's progress watchdog, started (False when ``checkpoint.stall_floor_s`` is 0)."""
    from cyclone_kit.rundir.failures import segment_id
    from cyclone_kit.runtime.watchers import scriptsteps
    from cyclone_kit.runtime.watchers.stall import ProgressWatch, RunDirRecords, StallPolicy

    scriptsteps.hand_over()  # a script that calls ck.log_step: the shim's optimizer-step watchdog stops here
    policy = StallPolicy.below_collectives(session.cc.stall_floor_s, session.cc.stall_factor, session.pg_timeout_s)
    if not policy.enabled:
        return False
    env = session.env
    watch = ProgressWatch(RunDirRecords(session.run_dir), env.rank, env.world_size, session.host, policy,
                          segment_id(session.environ), lambda stuck, records, own: on_stall(session, stuck, records),
                          busy_share=session.busy_share)
    return watch.start()


def on_stall(session: Session, stuck: list[int], records: dict[int, Any]) -> None:
    """A stalled rank's last acts (from the watchdog's thread): the records, the ``failed`` end
    record (rank 0), and the requeue (the rank that wrote ``failure.json``, under Slurm, when
    allowed and no step watcher does it)."""
    from cyclone_kit.rundir.failures import record_stall, segment_id
    from cyclone_kit.runtime.watchers.stall import stall_failure, stall_requeue

    env, environ = session.env, session.environ
    job_id = environ.get("SLURM_JOB_ID")
    doc, errors = stall_failure(stuck, records, env.world_size, job_id, segment_id(environ))
    own = errors.get(env.rank)
    # every other stuck rank's record, by the winner: the launcher may stop a stuck rank before it writes its own
    on_behalf = [e for r, e in errors.items() if r != env.rank]
    won = record_stall(session.run_dir, doc, own, on_behalf)
    if won:
        sys.stderr.write(f"cyclone_kit: stalled: {doc['root_cause']}\n")
    step = session.watch.step if session.watch else None
    session.end("failed", int(step or 0), release_signals=False)
    if won and under_slurm(environ) and not environ.get(STEPWATCH_VAR):
        yes, why = stall_requeue(session.cc.requeue, session.cc.max_requeues, env.restart_count)
        sys.stderr.write(f"cyclone_kit: {why}\n")
        if yes:
            try:
                requeue(environ)
            except (CommandError, ValidationError) as e:
                warn(f"requeue failed: {e}")


def _group_of_one(device: DeviceChoice, timeout_s: int) -> None:
    """A process group of one rank on an in-memory store (no port, no rendezvous)."""
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if device.kind == "cuda":
        kwargs["device_id"] = torch.device(device.torch_device)
    dist.init_process_group(backend=device.backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def gather_hosts(host: str, distributed: bool) -> list[str]:
    """Every rank's host, deduplicated in rank order (rank 0's node first)."""
    hosts: list[Any] = [host]
    if distributed:
        import torch.distributed as dist

        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, host, group=side_group())
    return list(dict.fromkeys(str(h) for h in hosts))


def gather_to_main(obj: Any, env: DistEnv, distributed: bool) -> list[Any]:
    """Every rank's ``obj`` (picklable, on the CPU) in rank order on rank 0, [] on the others;
    over the gloo side group, so no rank unpickles another's state onto its own GPU."""
    if not distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, out, dst=0, group=side_group())
    return out if out is not None else []


def versions() -> dict[str, str | None]:
    """Versions for the start record; torchvision's from its metadata (importing it costs ~0.3-1 s)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from cyclone_kit.core.version import __version__

    tv_module = sys.modules.get("torchvision")
    try:
        tv: str | None = tv_module.__version__ if tv_module is not None else version("torchvision")
    except PackageNotFoundError:
        tv = None
    return {"torch": torch.__version__, "torchvision": tv, "cyclone_kit": __version__}


def peak_memory(device: DeviceChoice) -> int:
    """Peak memory of this rank: CUDA's max allocated on a GPU, the process's max RSS on the CPU."""
    if device.kind == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device.torch_device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
