"""``run``: train right here with N local rank processes that see a Slurm-like environment."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cyclone_kit.backends.local import LocalBackend
    from cyclone_kit.config.job import JobSpec
    from cyclone_kit.config.validate import ResolvedJob


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``run``."""
    from cyclone_kit.config.jobspec import add_job_arguments

    p = sub.add_parser(
        "run",
        help="run a job on this machine with N local ranks (Slurm-like environment, gloo on CPU)",
        description="Start N real rank processes on this machine, each with the environment srun would give "
        "it (SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST, ...), MASTER_ADDR=127.0.0.1 and a free "
        "MASTER_PORT, so the same bootstrap path as on the cluster runs. No cluster profile checks. "
        "If a rank dies the others are stopped within seconds, the first failure is printed first and "
        "written to RUN_DIR/failure.json. Ctrl-C stops every rank.",
    )
    add_job_arguments(p, with_resources=False)
    p.add_argument("--nproc", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--nodes", type=int, default=1,
                   help="pretend nodes (all on this host; --nproc must be a multiple; default 1)")
    p.add_argument("--threads", type=int,
                   help="torch threads (and torch.compile workers) per rank (default: this machine's cores / --nproc)")
    p.add_argument("--runs-dir", default="runs", help="where run directories are created (default: ./runs)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="stop every rank after this many seconds")
    p.add_argument("--stop-grace", type=float, metavar="SECONDS",
                   help="after Ctrl-C, SIGTERM or --timeout: seconds the ranks get to agree on a step and write "
                   "their stop checkpoint before they are killed (default 30, Slurm's default KillWait); "
                   "raise it for checkpoints that take longer to write")
    p.add_argument("--cpu", action="store_true", help="hide every GPU from the ranks (CUDA_VISIBLE_DEVICES=''); "
                   "needed when --nproc is larger than the number of GPUs here")
    p.add_argument("--quiet", action="store_true", help="do not echo rank 0's output")
    p.add_argument("--horovod", action="store_true",
                   help="a Horovod script: run Horovod's Gloo rendezvous before it, so hvd.init() finds every rank")
    p.add_argument("--resume", metavar="RUN_DIR", help="run an existing run directory again (its spec.json); "
                   "training resumes from its newest checkpoint that verifies (refused, exit 2, when none does)")
    p.add_argument("--restart-from-scratch", action="store_true",
                   help="with --resume: start over at step 0 when no checkpoint can be loaded (else refused)")
    p.set_defaults(func=run)


#: The ranks' variables for --resume and --restart-from-scratch (read by cyclone_kit.runtime.checkpoint).
RESUME_VAR, FROM_SCRATCH_VAR = "CYCLONE_RESUME", "CYCLONE_RESTART_FROM_SCRATCH"


def resume_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment that tells the ranks they must resume (and whether they may start over)."""
    env = {RESUME_VAR: "1"} if args.resume else {}
    if args.restart_from_scratch:
        env[FROM_SCRATCH_VAR] = "1"
    return env


def _backend(args: argparse.Namespace, job: ResolvedJob) -> LocalBackend:
    """The local backend as ``run``'s flags set it: its threads, timeout, echo and the ranks' extra variables."""
    from cyclone_kit.backends.local import LocalBackend

    return LocalBackend(quiet=args.quiet, threads=job.cpus_per_task, timeout_s=args.timeout,
                        stop_grace_s=args.stop_grace,
                        extra_env={**({"CUDA_VISIBLE_DEVICES": ""} if args.cpu else {}), **resume_env(args)})


def spec_for_run(args: argparse.Namespace) -> JobSpec:
    """The spec a new ``run`` trains (reads the spec file and the profile): the command line's spec, refused
    when it asks for in-job restarts (the local launcher has no step watcher), ``--horovod``'s launcher, and
    the profile's ``[container]`` under the job's own (:func:`~cyclone_kit.config.container.merged`: the job's
    runtime, image and python win, binds are the profile's then the job's), as ``submit`` merges them.

    Raises:
        ValidationError: in-job restart settings, ``--horovod`` without a script, a container table without
            an image or a runtime, or the spec's profile cannot be loaded.
    """
    import dataclasses

    from cyclone_kit.config.container import merged
    from cyclone_kit.config.jobspec import spec_from_args
    from cyclone_kit.config.profile import load_profile
    from cyclone_kit.config.validate import refuse_restart_flags
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.launchers import HOROVOD

    spec = spec_from_args(args)
    res = spec.resources
    if res.spare_nodes or 0 < res.min_nodes < res.nodes:  # the local launcher has no step watcher
        keys = [k for k, on in (("spare_nodes", bool(res.spare_nodes)),
                                ("min_nodes", 0 < res.min_nodes < res.nodes)) if on]
        refuse_restart_flags([f"resources.{k}={getattr(res, k)}" for k in keys],
                             [f"drop resources.{k}" for k in keys], "`cyclone-kit run` (ranks on this machine)",
                             "submit it with cyclone-kit submit (the slurm backend), or")
    if args.horovod:
        if spec.script is None:
            raise ValidationError("--horovod is for a script run",
                                  hint="give SCRIPT.py, or use --set train.strategy=horovod")
        spec = dataclasses.replace(spec, resources=dataclasses.replace(spec.resources, launcher=HOROVOD.name))
    container = merged(spec.container, load_profile(spec.resources.profile).container)
    return spec if container == spec.container else dataclasses.replace(spec, container=container)


def run(args: argparse.Namespace) -> int:
    """Create the run directory, launch the ranks, report the outcome; returns 0, 1 (a rank failed) or 130.

    The run directory holds the local backend's plan, written as ``submit --backend local`` writes it
    (:func:`cyclone_kit.submit.submission.prepare`), and the ranks run that same plan.
    """
    from cyclone_kit.backends.local import local_job
    from cyclone_kit.backends.local_env import gpu_slices, visible_gpus
    from cyclone_kit.backends.srun_emulator import format_failure
    from cyclone_kit.config.container import check_container
    from cyclone_kit.config.job import load_spec
    from cyclone_kit.config.script import checked_job
    from cyclone_kit.config.validate import check_backend
    from cyclone_kit.core.errors import ValidationError
    from cyclone_kit.rundir.layout import RunDir
    from cyclone_kit.submit.submission import prepare

    for flag in ("nproc", "nodes", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValidationError(f"--{flag}={value} must be at least 1", hint=f"e.g. --{flag} 2")
    if args.timeout is not None and args.timeout <= 0:
        raise ValidationError(f"--timeout={args.timeout:g} must be positive", hint="e.g. --timeout 600")
    if args.stop_grace is not None and not args.stop_grace > 0:  # `not >` also refuses nan
        raise ValidationError(f"--stop-grace={args.stop_grace:g} must be positive", hint="e.g. --stop-grace 120")
    if args.restart_from_scratch and not args.resume:
        raise ValidationError("--restart-from-scratch is for --resume RUN_DIR",
                              hint="a new run starts at step 0 anyway; drop the flag or add --resume RUN_DIR")
    if args.nproc and args.nodes:  # before any run directory: ranks that would share a GPU
        gpu_slices(visible_gpus({**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.cpu else {})}),
                   args.nproc, args.nodes)
    if args.resume:
        rd = RunDir(Path(args.resume).absolute())
        if not rd.is_run_dir():
            raise ValidationError(f"--resume {args.resume!r} is not a run directory (no spec.json)",
                                  hint="give the run dir printed by the first `run`")
        if args.spec or args.overrides or args.module or getattr(args, "script_args", None):
            raise ValidationError("--resume takes the run directory's own spec",
                                  hint="drop SPEC, SCRIPT, -m, -- ARGS and --set, or start a new run without --resume")
        job = local_job(load_spec(rd.spec), args.nproc, args.nodes, args.threads)
        backend = _backend(args, job)
        plan = backend.plan(job, rd.path, rerun=True)  # the directory and its files exist: only the threads change
        rd.set_threads(int(plan.parameters["threads_per_rank"]))
    else:
        job = local_job(spec_for_run(args), args.nproc, args.nodes, args.threads)
        check_backend(job.spec, "local")  # a container the local launcher cannot run (pyxis needs srun)
        job = check_container(checked_job(job, data_check=False), Path(args.runs_dir))
        backend = _backend(args, job)
        plan = prepare(job, Path(args.runs_dir), backend)  # the run directory holds the plan's files
        rd = RunDir(plan.run_dir)
    run_dir = rd.path
    print(f"run dir: {run_dir}")
    print(f"starting {job.world_size} rank(s) on {job.nodes} local node(s), {job.cpus_per_task} thread(s) each; "
          f"logs in {rd.logs}", flush=True)
    result = backend.launch(plan)
    if not result.ok:  # the root cause first, then (on a full disk) why the run directory could not record it
        sys.stderr.write((format_failure(result) if result.first_failure is not None else
                          f"error: interrupted; every rank was stopped. HINT: see {rd.failure}") + "\n")
    backend.record(run_dir, result)
    if result.ok:
        status = rd.end_status() or "ended"
        hint = f"; resume with: cyclone-kit run --resume {run_dir} --nproc {job.world_size}" if status == "preempted" else ""
        print(f"{status} in {result.wall_time_s:.1f} s; metrics: {rd.metrics}{hint}")
        if rd.script_warning():
            print(f"warning: {rd.script_warning()}")
        return 0
    return result.returncode
