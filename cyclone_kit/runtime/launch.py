"""The launch shim: run a user's training script on this rank, unchanged.

``python -m cyclone_kit.runtime.launch [--run-dir DIR] [--horovod] (SCRIPT.py | -m MODULE) [ARGS...]``
is what every rank of a script job runs (the sbatch templates and ``cyclone-kit run`` put it in
front of the script). On this rank it:

1. detects where the process sits from the launcher's variables (:func:`cyclone_kit.runtime.env.detect`:
   srun, torchrun, Open MPI/PMI, submitit, the local launcher, or none) and exports the torchrun
   variables from that :class:`~cyclone_kit.runtime.env.DistEnv` (:func:`torchrun_variables`: RANK,
   LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, besides Slurm's),
   so ``init_process_group(init_method="env://")``, Lightning, Accelerate and ``ck.init()`` all
   find their ranks;
2. with ``--horovod``, runs Horovod's Gloo rendezvous the runtime already has
   (:mod:`cyclone_kit.runtime.hvd`) when this Horovod build needs it (no MPI, or
   ``HOROVOD_CONTROLLER=gloo``), so a script's ``hvd.init()`` finds its peers;
3. on rank 0, appends a ``start`` record to ``RUN_DIR/shim.jsonl`` (script, its hash, world size,
   hosts, launcher) and, when the script ends, an ``end`` record (exit status, wall time);
4. runs a progress watchdog fed by the script's optimizer steps (:mod:`cyclone_kit.runtime.watchers.scriptsteps`),
   so a rank that hangs ends the job within the stall bound instead of its wall time;
5. keeps the job's time-limit warning signal (``checkpoint.signal``, USR2) from killing a script
   that does not handle it (:func:`note_requeue_signal`);
6. runs the script **in this process** (:func:`runpy.run_path` / :func:`runpy.run_module`, as
   ``python SCRIPT`` / ``python -m MODULE`` would, with ``sys.argv = [SCRIPT, *ARGS]``); a run
   directory's snapshot of the script runs with ``__file__`` and ``sys.argv[0]`` the submitted
   file's own path (:func:`run_script`), so paths built from them mean what they mean there.

Why in-process rather than a child process or ``exec``: the script *is* the rank process, so
srun's, scancel's and the local launcher's signals reach it directly with nothing to forward
(Slurm's ``--signal`` and SIGTERM, a requeue, Ctrl-C), its exit status is the process's own
(``sys.exit(3)`` exits 3, a SIGKILL is a SIGKILL), and no second interpreter starts (start-up
costs only this module's small imports). ``os.execv`` would be as exact but leaves nobody to write
the end record. Under Slurm the rank still runs below cyclone_kit's watchdog
(:mod:`cyclone_kit.runtime.watchers.rankexit`), which forwards what reaches it alone and records a death by
signal that the rank cannot record itself.

When the script raises, this rank writes its error record (``ranks/error-rank-N.json``: type,
message, traceback; the root cause the launcher and ``status`` print first), prints the
traceback and leaves at once with exit code 1, without waiting for peers that may never answer;
a non-zero ``sys.exit`` is recorded the same way. After a completed script the exit handlers run
and the process leaves without running interpreter tear-down, so a gloo process group left alive
by the script cannot abort a finished run (torch 2.14).

A script that never calls ``ck.log_step`` still gets a scaling report: when rank 0's script
wrote nothing to ``metrics.jsonl``, the shim appends a ``start``/``end`` pair there in the metrics
contract, with strategy ``time-to-solution`` and ``samples_per_s`` = 1 / wall time (solutions
per second), so the report's speed-up is T(N0) / T(N) of the whole script for the same work.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone_kit.launchers import LOCAL, TORCHRUN
from cyclone_kit.rundir.layout import RunDir

#: The strategy label of the records written for a script without ``ck.log_step``.
TIME_TO_SOLUTION = "time-to-solution"
#: The variables a torchrun worker sees, all set by :func:`torchrun_variables`.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
USAGE = ("usage: python -m cyclone_kit.runtime.launch [--run-dir DIR] [--horovod] (SCRIPT.py | -m MODULE) [ARGS...]")


@dataclass(frozen=True)
class ShimArgs:
    """The shim's command line: its own options, then the script (or module) and its arguments."""

    run_dir: str | None
    horovod: bool
    script: str | None
    module: str | None
    args: tuple[str, ...]

    @property
    def target(self) -> str:
        """The script path, or ``-m MODULE``."""
        return self.script if self.script is not None else f"-m {self.module}"


class UsageError(Exception):
    """The shim's command line is wrong."""


def parse_args(argv: Sequence[str], environ: Mapping[str, str]) -> ShimArgs:
    """Parse the shim's arguments like ``python`` does: options until the script (pure).

    Raises:
        UsageError: no script, or an unknown option before it.
    """
    run_dir = environ.get("CYCLONE_RUN_DIR") or None
    horovod = False
    rest = list(argv)
    while rest:
        head = rest[0]
        if head == "--run-dir" and len(rest) >= 2:
            run_dir, rest = rest[1], rest[2:]
        elif head.startswith("--run-dir="):
            run_dir, rest = head.split("=", 1)[1], rest[1:]
        elif head == "--horovod":
            horovod, rest = True, rest[1:]
        elif head == "--":
            rest = rest[1:]
            break
        elif head == "-m":
            if len(rest) < 2:
                raise UsageError("-m needs a module name")
            return ShimArgs(run_dir, horovod, None, rest[1], tuple(rest[2:]))
        elif head.startswith("-"):
            raise UsageError(f"unknown option {head!r}")
        else:
            break
    if not rest:
        raise UsageError("no script to run")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise UsageError("-m needs a module name")
        return ShimArgs(run_dir, horovod, None, rest[1], tuple(rest[2:]))
    return ShimArgs(run_dir, horovod, rest[0], None, tuple(rest[1:]))


def torchrun_variables(env: Any) -> dict[str, str]:
    """The variables torchrun gives a worker, from a :class:`~cyclone_kit.runtime.env.DistEnv` (pure)."""
    return {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "ROLE_RANK": str(env.rank),
        "ROLE_WORLD_SIZE": str(env.world_size),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }


def shim_command(script: Any, run_dir: Path | str, *, python: str | None = None,
                 horovod: bool = False) -> list[str]:
    """The argv a rank runs for ``script`` (a :class:`~cyclone_kit.config.job.ScriptConfig`; pure)."""
    from cyclone_kit.rundir.entry import script_target, shim_words

    return [python or sys.executable, *shim_words(run_dir, script_target(script), horovod=horovod)]


def exit_status(code: object) -> int:
    """The process exit status ``sys.exit(code)`` gives (None: 0; an int; anything else: 1; pure)."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else (256 + code) & 0xFF
    return 1


def start_record(env: Any, shim: ShimArgs, spec: Any, when: str,
                 environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Rank 0's shim ``start`` record (pure): under the local launcher (``CYCLONE_LAUNCHER=local``
    in ``environ``) the launcher is ``local`` and there is no job id (its SLURM_JOB_ID is made up),
    as in the engine's and the API's records."""
    script = getattr(spec, "script", None)
    local = LOCAL.started(environ or {})
    return {
        "kind": "start", "schema": 1, "source": "launch", "time": when,
        "script": shim.target, "args": list(shim.args),
        "sha256": _file_hash(shim.script) or getattr(script, "sha256", "") or None,
        "world_size": env.world_size, "num_nodes": env.num_nodes, "local_world_size": env.local_world_size,
        "launcher": LOCAL.name if local else env.launcher,
        "hostnames": list(env.hostnames) or [env.host or socket.gethostname()],
        "slurm_job_id": None if local else env.job_id, "restart_count": env.restart_count, "pid": os.getpid(),
    }


def end_record(status: str, exit_code: int, wall_time_s: float, when: str, error: str | None = None, *,
               process_group_world: int | None = None, warning: str = "") -> dict[str, Any]:
    """Rank 0's shim ``end`` record (pure); ``status`` is ``completed`` or ``failed``.

    ``process_group_world``: the largest process group the script formed on rank 0 (None: none);
    ``warning``: :func:`cyclone_kit.runtime.pgcheck.verdict` when that is not the launched world.
    """
    rec = {"kind": "end", "schema": 1, "source": "launch", "time": when, "status": status,
           "exit_code": exit_code, "wall_time_s": round(wall_time_s, 6), "error": error,
           "process_group_world": process_group_world}
    if warning:
        rec["warning"] = warning
    return rec


def time_to_solution_records(start: Mapping[str, Any], end: Mapping[str, Any], spec: Any,
                             name: str) -> list[dict[str, Any]]:
    """The metrics-contract ``start``/``end`` pair for a script without ``ck.log_step`` (pure).

    ``samples_per_s`` is 1 / wall time: the report's speed-up T(N)/T(N0) of this figure is the
    time-to-solution speed-up T(N0)/T(N) of the wall times, for the same work.
    """
    from cyclone_kit.rundir.contract import end_record as metrics_end
    from cyclone_kit.rundir.contract import record

    per_device = getattr(getattr(spec, "script", None), "batch_size", 0) or None
    samples_per_run = getattr(getattr(spec, "script", None), "samples_per_run", 0) or None
    world = int(start["world_size"])
    wall = float(end["wall_time_s"])
    head = record(
        "start", run_id=f"{name}-{start['slurm_job_id'] or start['pid']}", world_size=world,
        num_nodes=start["num_nodes"], local_world_size=start["local_world_size"],
        per_device_batch_size=per_device, global_batch_size=per_device * world if per_device else None,
        model=name, dataset="script", precision=None, strategy=TIME_TO_SOLUTION,
        launcher=start["launcher"], device=_device_kind(spec),
        device_name=None, hostnames=start["hostnames"], slurm_job_id=start["slurm_job_id"], time=start["time"],
        versions={"cyclone_kit": _version()}, git_commit=None, restart_count=start["restart_count"],
        phase_timing=None, comm_timing=None, basis=TIME_TO_SOLUTION, samples_per_run=samples_per_run,
    )
    status = "completed" if end["status"] == "completed" else "failed"
    tail = metrics_end(status, 0, 1.0 / wall if wall > 0 and status == "completed" else None, wall, end["time"])
    finding = {"warning": end["warning"]} if end.get("warning") else {}
    return [head, {**tail, "steps": None, "basis": TIME_TO_SOLUTION,
                   "process_group_world": end.get("process_group_world"), **finding}]


def _device_kind(spec: Any) -> str | None:
    """``cuda`` when the job was given GPUs, ``cpu`` when it was given none, None when unknown (pure)."""
    gpus = getattr(getattr(spec, "resources", None), "gpus_per_node", None)
    return None if gpus is None else ("cuda" if gpus else "cpu")


# --------------------------------------------------------------------------- side effects
def _version() -> str:
    from cyclone_kit.core.version import __version__

    return __version__


def _append(path: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Append records, one JSON line each, flushed (rank 0 only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":"), default=str) + "\n")
        f.flush()


def _load_spec(run_dir: Path | None) -> Any:
    if run_dir is None or not RunDir(run_dir).is_run_dir():
        return None
    try:
        from cyclone_kit.config.job import load_spec

        return load_spec(RunDir(run_dir).spec)
    except Exception:  # the spec is a record here, not an input: a script runs without it
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _say(text: str) -> None:
    sys.stderr.write(f"cyclone_kit.runtime.launch: {text}\n")
    sys.stderr.flush()


def _file_hash(script: str | None) -> str:
    """The SHA-256 of the file this rank runs ('' for a module or an unreadable file)."""
    if script is None:
        return ""
    import hashlib

    try:
        return hashlib.sha256(Path(script).read_bytes()).hexdigest()
    except OSError:
        return ""


def _check_hash(shim: ShimArgs, spec: Any) -> None:
    """Warn when the script (``--live-code``) is no longer the one whose hash was recorded at submission."""
    expected = getattr(getattr(spec, "script", None), "sha256", "")
    actual = _file_hash(shim.script)
    if expected and actual and actual != expected:
        _say(f"warning: {shim.script} changed since submission (sha256 {actual[:12]}, recorded {expected[:12]}); "
             "the run directory's script/ folder holds the submitted copy")


def one_gpu_layout(environ: Mapping[str, str], local_rank: int, local_world_size: int) -> str | None:
    """A warning when this task sees one GPU while its node runs several ranks (pure), else None.

    Then ``cuda:LOCAL_RANK``, torchrun's layout that the exported variables promise, does not
    exist on local rank 1 and above ("invalid device ordinal"): ``--gpus-per-task=1`` or
    ``--gpu-bind=single:1`` in a hand-written job script (``submit`` refuses such a script job).
    The script may pick ``cuda:0`` or ``ctx.device`` and be right, so this warns and runs it.
    """
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) != 1 or local_world_size < 2 or visible[0] in ("-1", "none", "NoDevFiles"):
        return None
    return (f"warning: this task sees one GPU (CUDA_VISIBLE_DEVICES={visible[0]}) but its node runs {local_world_size} "
            f"ranks (LOCAL_RANK={local_rank}): a script that takes cuda:LOCAL_RANK fails with 'invalid device ordinal'. "
            "HINT: let every task see its node's GPUs (srun --gpu-bind=none, no --gpus-per-task), or take the "
            "device from ck.init()'s ctx.device or cuda:LOCAL_RANK % torch.cuda.device_count()")


def dist_env_choice(spec: Any, environ: Mapping[str, str]) -> str:
    """What this rank sees of torchrun's variables: ``script.dist_env`` of the run's spec, else
    ``CYCLONE_DIST_ENV`` (a shim started without a run directory), else ``auto`` (pure)."""
    from cyclone_kit.config.job import DIST_ENV_CHOICES

    chosen = getattr(getattr(spec, "script", None), "dist_env", "") or environ.get("CYCLONE_DIST_ENV", "") or "auto"
    return chosen if chosen in DIST_ENV_CHOICES else "auto"


def exports_torchrun_variables(env: Any, dist_env: str, requires: bool = False) -> bool:
    """Whether this rank is given torchrun's variables (pure): the rule of ``script.dist_env``.

    torchrun sets them for every worker, also under ``--nproc 1``; ``python SCRIPT`` sets none;
    srun sets only Slurm's. ``auto`` gives them to every rank of a world of two or more (the
    scripts written for torchrun find their ranks), and none to a world of one, so a script that
    branches on them (nanoGPT: ``ddp = int(os.environ.get('RANK', -1)) != -1``) takes the path
    it takes under ``python SCRIPT``; but a script that cannot run without them (``requires``:
    :func:`requires_torchrun_variables`, e.g. pytorch/examples' ``int(os.environ["LOCAL_RANK"])``)
    is a torchrun script and gets them at a world of one too. Real torchrun's own variables are
    never taken away. ``torchrun`` gives them to a world of one always, as ``torchrun --nproc 1``.
    """
    return dist_env == "torchrun" or env.world_size > 1 or env.launcher == TORCHRUN.name or (dist_env == "auto" and requires)


def requires_torchrun_variables(source: str) -> bool:
    """Whether a script's own source reads a torchrun variable with no default and no guard (pure).

    ``os.environ["RANK"]`` (or ``environ["LOCAL_RANK"]``, any of :data:`TORCHRUN_VARIABLES`) outside
    any ``if``/``try``/``while`` fails without torchrun, so such a script was written for torchrun only
    (pytorch/examples' ``ddp_setup()``). A read under a branch (nanoGPT's ``if ddp:`` after
    ``os.environ.get('RANK', -1)``, a ``try``/``except KeyError``), ``.get`` and ``in`` are not
    counted. Source that does not parse: False.
    """
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False

    def unguarded_read(node: ast.AST) -> bool:
        if isinstance(node, (ast.If, ast.IfExp, ast.Try, ast.While)):
            return False  # a read below a branch is the script's choice, not its need
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target, key = node.value, node.slice
            named = (isinstance(target, ast.Attribute) and target.attr == "environ") or \
                (isinstance(target, ast.Name) and target.id == "environ")
            if named and isinstance(key, ast.Constant) and key.value in TORCHRUN_VARIABLES:
                return True
        return any(unguarded_read(child) for child in ast.iter_child_nodes(node))

    return unguarded_read(tree)


def fabric_variables(source: str, env: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables ``fabric run`` gives a Lightning Fabric script, for a script that uses Fabric (pure).

    ``Fabric(devices=N)`` outside ``fabric run`` refuses more than one device until ``.launch()`` is
    called ("you must call `.launch()` or use the CLI"), and a script written for ``fabric run``
    never calls it. So: ``LT_DEVICES`` / ``LT_NUM_NODES`` from the launched layout (ranks per node,
    nodes: the job's layout wins over the script's ``devices=``, as under ``fabric run``), and
    ``LT_CLI_USED=1`` (processes exist already: ``Fabric()`` sets up the process group itself)
    only for a script that does not call ``.launch(`` (with it, Fabric refuses a second launch; without
    ``LT_CLI_USED`` its ``launch()`` finds the ranks started). Variables the user set are kept; a
    script that does not mention ``Fabric`` gets none.
    """
    if "Fabric" not in source or env.world_size < 2:
        return {}
    wanted = {"LT_DEVICES": str(env.local_world_size), "LT_NUM_NODES": str(env.num_nodes)}
    if ".launch(" not in source:
        wanted["LT_CLI_USED"] = "1"
    return {k: v for k, v in wanted.items() if k not in environ}


def _script_source(shim: ShimArgs) -> str:
    """The shim's script file's text ('' for ``-m MODULE`` or an unreadable file)."""
    if shim.script is None:
        return ""
    try:
        return Path(shim.script).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def missing_variable_hint(exc: BaseException, world_size: int, dist_env: str) -> str:
    """The HINT for a world of one whose script failed reading a torchrun variable it was not given ('' else; pure)."""
    name = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
    if world_size != 1 or dist_env != "auto" or name not in TORCHRUN_VARIABLES:
        return ""
    return (f"a world of one gets no {name}, as under `python SCRIPT` (torchrun sets it even with --nproc 1). "
            "HINT: pass --dist-env torchrun (dist_env = \"torchrun\" in [script]) to give every rank "
            "torchrun's variables, a world of one too")


def prepare_rank(shim: ShimArgs, environ: dict[str, str] | os._Environ[str], dist_env: str = "auto") -> Any:
    """Detect this rank, export the torchrun variables (and Horovod's), return the DistEnv.

    A world of one under ``dist_env="auto"`` gets none of them (:func:`exports_torchrun_variables`):
    those the launcher set (``MASTER_ADDR``, ``MASTER_PORT``) are taken out of ``environ`` and held
    by :func:`cyclone_kit.runtime.pgcheck.hold_world_of_one`, which hands them back the moment the
    script starts a process group from the environment anyway (``init_process_group(init_method=
    "env://")``: a world of one, as ``torchrun --nproc 1`` would give it).
    """
    from cyclone_kit.runtime.env import detect

    env = detect(environ)
    layout = one_gpu_layout(environ, env.local_rank, env.local_world_size)
    if layout and env.local_rank > 0:  # the ranks whose cuda:LOCAL_RANK is missing say so
        _say(layout)
    variables = torchrun_variables(env)
    if env.launcher == "single" and not environ.get("MASTER_PORT"):
        with socket.socket() as s:  # alone on this host: any free port, not a fixed default
            s.bind(("127.0.0.1", 0))
            variables["MASTER_PORT"] = str(s.getsockname()[1])
    from cyclone_kit.runtime import pgcheck

    source = _script_source(shim)
    if exports_torchrun_variables(env, dist_env, env.world_size == 1 and requires_torchrun_variables(source)):
        environ.update(variables)
    else:  # a world of one, as `python SCRIPT` sees it (see exports_torchrun_variables)
        for name in TORCHRUN_VARIABLES:
            environ.pop(name, None)
        pgcheck.hold_world_of_one(variables)
    # who really started the ranks (detection inside the script now says torchrun): for ck's records
    environ.setdefault("CYCLONE_LAUNCHER", env.launcher)
    # a bare accelerate.Accelerator() joins the ranks on a node without GPUs only with this
    pgcheck.cpu_accelerate_default(environ, pgcheck.gpus_present())
    environ.update(fabric_variables(source, env, environ))  # a Fabric script written for `fabric run`
    if shim.horovod:
        from cyclone_kit.runtime import hvd

        horovod = hvd.import_horovod()
        if hvd.uses_gloo_rendezvous(env, environ, horovod.mpi_built()):
            environ.update(hvd.gloo_rendezvous(env, timeout_s=int(environ.get("CYCLONE_HOROVOD_TIMEOUT_S", "600"))))
    return env


def note_requeue_signal(spec: Any) -> int | None:
    """Keep the job's early-warning signal from killing a script that does not handle it.

    The sbatch header asks Slurm for ``checkpoint.signal`` (USR2 by default) some minutes before the
    time limit, for scripts that checkpoint on it (``ck.stop_requested()`` installs its own handler,
    as do Lightning and others, replacing this one). A script that ignores it would otherwise die
    of it, minutes of work early: this handler prints one line and lets it run on. TERM, INT and
    HUP keep their meaning (stop). Returns the signal number handled, or None.
    """
    import signal

    name = getattr(getattr(spec, "checkpoint", None), "signal", "USR2")
    if name not in ("USR1", "USR2", "URG"):
        return None
    signum = int(getattr(signal, f"SIG{name}"))

    def note(received: int, frame: object) -> None:
        _say(f"SIG{name} received (the job's time-limit warning); this script does not handle it, so it "
             "runs on until Slurm stops it (ck.stop_requested() would checkpoint and requeue)")

    if signal.getsignal(signum) in (signal.SIG_DFL, None):
        signal.signal(signum, note)
    return signum


def script_location(shim: ShimArgs, spec: Any, run_dir: Path | None) -> str | None:
    """The script's own path when this rank runs the run directory's snapshot of it, else None (pure).

    That path is what ``__file__`` and ``sys.argv[0]`` are under ``python SCRIPT``, so a script
    that finds its data next to itself (``os.path.dirname(__file__)``) finds it (see :func:`run_script`).
    """
    script = getattr(spec, "script", None)
    if shim.script is None or run_dir is None or script is None or not script.path or script.live:
        return None
    snapshot = RunDir(run_dir).user_script_copy(Path(script.path).name)
    return script.path if os.path.abspath(shim.script) == os.path.abspath(snapshot) else None


def run_script(shim: ShimArgs, location: str | None = None) -> None:
    """Run the script or module as ``__main__`` in this process (raises what it raises).

    With ``location`` (:func:`script_location`), the file run is the snapshot, but the script sees
    itself where it was submitted from: ``__file__`` and ``sys.argv[0]`` are ``location``, as under
    ``python SCRIPT``, while ``sys.path[0]`` is the snapshot's folder, so the modules it imports
    from beside it are the snapshot's too (what runs is what was submitted). Tracebacks name the
    snapshot's file, whose lines are the ones that ran.
    """
    import runpy

    if shim.module is not None:
        sys.argv = [shim.module, *shim.args]
        runpy.run_module(shim.module, run_name="__main__", alter_sys=True)
        return
    assert shim.script is not None
    sys.argv = [location or shim.script, *shim.args]
    # python SCRIPT puts the script's folder first on sys.path (sibling imports): the snapshot's
    sys.path.insert(0, os.path.dirname(os.path.abspath(shim.script)))
    if location is None:
        runpy.run_path(shim.script, run_name="__main__")
    else:
        _exec_as_main(shim.script, location)


def _exec_as_main(code_path: str, file: str) -> None:
    """Execute ``code_path``'s source as ``__main__`` with ``__file__ = file`` (runpy.run_path cannot)."""
    import builtins
    import types

    code = compile(Path(code_path).read_bytes(), code_path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __cached__=None, __loader__=None, __spec__=None, __package__=None,
                         __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def whole_lines(stream: Any) -> None:
    """Make ``stream`` write each line it is given in one ``write`` (best effort; a stream that cannot is left).

    Under ``PYTHONUNBUFFERED=1`` (the profiles set it, so logs are live) ``print`` writes its text and
    its newline in two system calls; where ranks share one pipe (torchrun's workers of a node) another
    rank's line can land between them, mid-line. Line buffering without write-through sends a line and
    its newline together and still flushes at every newline.
    """
    with contextlib.suppress(AttributeError, ValueError, OSError):
        stream.reconfigure(line_buffering=True, write_through=False)


def _utc_now() -> str:
    from cyclone_kit.rundir.contract import utc_now

    return utc_now()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the shim (see the module doc); returns only on a usage error, else leaves with the script's status."""
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        shim = parse_args(raw, os.environ)
    except UsageError as e:
        sys.stderr.write(f"error: {e} HINT: {USAGE}\n")
        return 2
    from cyclone_kit.runtime.watchers import rankexit

    if rankexit.wanted(os.environ):  # under Slurm: a parent records how this rank died (see watchdog)
        from cyclone_kit.rundir.entry import SHIM_MODULE

        return rankexit.supervise([sys.executable, "-m", SHIM_MODULE, *raw], shim.run_dir)
    _leave(_run(shim))
    return 0  # not reached


def _run(shim: ShimArgs) -> int:
    """Everything between the parsed arguments and the exit status."""
    from cyclone_kit.core.errors import CycloneError

    # `python -m cyclone_kit.runtime.launch` runs this module as __main__: register it under its own name too,
    # so code in the script (ck's exception hook) can tell that the shim records the end and exits.
    sys.modules.setdefault(__spec__.name if __spec__ else "cyclone_kit.runtime.launch", sys.modules[__name__])

    started = time.monotonic()
    for stream in (sys.stdout, sys.stderr):
        whole_lines(stream)
    run_dir = Path(shim.run_dir).absolute() if shim.run_dir else None
    if run_dir is not None:
        os.environ["CYCLONE_RUN_DIR"] = str(run_dir)
    rank, host = watchdog_rank(), socket.gethostname()
    spec = _load_spec(run_dir)
    dist_env = dist_env_choice(spec, os.environ)
    try:
        env = prepare_rank(shim, os.environ, dist_env)
    except CycloneError as e:
        sys.stderr.write(f"error: [rank {rank}] {e}\n")
        _record_error(run_dir, rank, host, e)
        return e.exit_code
    except Exception as e:
        sys.stderr.write(f"cyclone_kit.runtime.launch: rank {rank} could not join its peers:\n{traceback.format_exc()}")
        _record_error(run_dir, rank, host, e)
        return 1
    rank, host = env.rank, env.host or host
    main_rank = env.rank == 0 and run_dir is not None
    start = start_record(env, shim, spec, _utc_now(), os.environ)
    metrics = RunDir(run_dir).metrics if run_dir is not None else None
    metrics_before = _size(metrics) if metrics is not None else -1
    if main_rank:
        _check_hash(shim, spec)
        _append(RunDir(run_dir).shim, [start])
    if spec is not None:
        note_requeue_signal(spec)
    from cyclone_kit.runtime import pgcheck

    pgcheck.watch()
    from cyclone_kit.runtime.watchers import scriptsteps

    if spec is not None and run_dir is not None:  # a stalled step ends the job (see watchers.scriptsteps)
        from cyclone_kit.runtime.watchers.stall import STALL_EXIT_CODE

        def stalled(cause: str) -> None:
            end = end_record("failed", STALL_EXIT_CODE, time.monotonic() - started, _utc_now(), f"stalled: {cause}")
            _append(RunDir(run_dir).shim, [end])

        scriptsteps.arm(run_dir, env, spec.checkpoint, os.environ, stalled)
    if main_rank:  # stopped by the local launcher (a peer failed): the end record first (see end_on_sigterm)
        def stopped_end(code: int, error: str) -> None:
            scriptsteps.stop()
            _write_end(run_dir, shim, spec, start, metrics_before, code, time.monotonic() - started, error,
                       pgcheck.formed_world())

        end_on_sigterm(stopped_end, os.environ)
    code, error = 0, None
    try:
        try:
            run_script(shim, script_location(shim, spec, run_dir))
        except BaseException:
            from cyclone_kit.runtime.watchers.stall import park_if_stalling

            park_if_stalling()  # this rank's watchdog is ending it: the rank that waited is not blamed
            raise
    except SystemExit as e:
        code = exit_status(e.code)
        if code:
            error = f"the script exited with code {code}"
            _record_error(run_dir, rank, host, e, message=f"{shim.target} called sys.exit({e.code!r})")
    except KeyboardInterrupt as e:
        code, error = 130, "interrupted"
        _record_error(run_dir, rank, host, e, message="interrupted (SIGINT)")
    except BaseException as e:
        code, error = 1, f"{type(e).__name__}: {e}"
        if isinstance(e, CycloneError):  # e.g. a ck.* call out of order: one line, its own exit code
            code = e.exit_code
        else:
            sys.stderr.write(f"cyclone_kit: rank {rank} failed in {shim.target}:\n")
        sys.excepthook(type(e), e, e.__traceback__)  # as for any uncaught exception (ck's hook records it too)
        hint = missing_variable_hint(e, env.world_size, dist_env)
        if hint:
            _say(hint)
        _record_error(run_dir, rank, host, e)
    scriptsteps.stop()  # a no-op when it was not armed
    wall = time.monotonic() - started
    formed, used = pgcheck.formed_world(), pgcheck.collectives()
    warning = pgcheck.verdict(env.world_size, formed, used) if code == 0 else ""
    if warning and main_rank:
        _say(f"warning: {warning} (torch.distributed.init_process_group, ck.init() or hvd.init() joins them; "
             "on CPU nodes accelerate needs ACCELERATE_USE_CPU=1)")
    if main_rank:
        _write_end(run_dir, shim, spec, start, metrics_before, code, wall, error, formed, warning)
    return code


def _write_end(run_dir: Path | None, shim: ShimArgs, spec: Any, start: Mapping[str, Any], metrics_before: int,
               code: int, wall: float, error: str | None, formed: int | None, warning: str = "") -> None:
    """Rank 0's end record, and the time-to-solution pair when the script wrote no metrics."""
    assert run_dir is not None
    status = "completed" if code == 0 else "failed"
    end = end_record(status, code, wall, _utc_now(), error, process_group_world=formed, warning=warning)
    _append(RunDir(run_dir).shim, [end])
    metrics = RunDir(run_dir).metrics
    if _size(metrics) == metrics_before:  # the script wrote no metrics: time to solution
        name = Path(shim.script).stem if shim.script else str(shim.module)
        _append(metrics, time_to_solution_records(start, end, spec, name))


def end_on_sigterm(write_end: Any, environ: Mapping[str, str]) -> bool:
    """Under the local launcher, let rank 0 write its end record when it is stopped (SIGTERM); True: installed.

    The local launcher stops the other ranks when one fails (SIGTERM, SIGKILL after a grace
    period); a rank waiting on the failed peer would otherwise die of the SIGTERM before its end
    record. The handler writes it (``failed``, exit code 143, "stopped by SIGTERM": no error
    record, the root cause is the peer's) and then dies of SIGTERM as before, so the rank's exit
    status is unchanged. Installed only where SIGTERM has its default action (a script's own
    handler, ``ck.stop_requested()``'s or Lightning's, replaces it) and only under the local
    launcher: under Slurm the watchdog (:mod:`cyclone_kit.runtime.watchers.rankexit`) records a death by
    signal, and Lightning's auto-requeue, which lets a SIGTERM pass, chains to the handler it found.
    """
    import signal

    if not LOCAL.started(environ) or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return False

    def stopped(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            write_end(128 + signum, "stopped by SIGTERM (the launcher stopped the run)")
        except Exception as e:  # dying as the signal says matters more than the record
            _say(f"could not write the end record: {e}")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, stopped)
    return True


def watchdog_rank() -> int:
    """This process's rank from the launcher's variables, before detection (0 when none says)."""
    from cyclone_kit.rundir.failures import rank_guess

    return rank_guess(os.environ)


def _record_error(run_dir: Path | None, rank: int, host: str, exc: BaseException, message: str | None = None) -> None:
    """Write this rank's error record (the root cause the launcher prints first) and ``failure.json``.

    The script's own record (ck's exception hook) is kept. ``failure.json`` is written here, by
    the rank that saw the failure, unless someone wrote it first; under the local launcher, which
    writes the whole record itself once it has seen every rank end, it is left to the launcher.
    """
    if run_dir is None:
        return
    try:
        from cyclone_kit.rundir import failures

        if not RunDir(run_dir).error_record(rank).exists():
            if message is not None:
                exc = type(exc)(message) if not isinstance(exc, SystemExit) else ScriptExit(message)
            failures.write_error_record(run_dir, rank, host, exc, traceback.format_exc())
        if not LOCAL.started(os.environ):
            failures.record_rank_failure(run_dir, rank, written_by="rank", job_id=os.environ.get("SLURM_JOB_ID"))
    except Exception as write_error:  # never hide the script's own failure behind this one
        _say(f"could not write the error record: {write_error}")


class ScriptExit(Exception):
    """A non-zero ``sys.exit`` of the script, as its error record names it."""


def _leave(code: int) -> None:
    """Run the exit handlers, flush, and leave without interpreter tear-down (see the module doc).

    A failed rank leaves at once (no exit handlers that could wait on a dead peer).
    """
    if code == 0:
        import atexit

        atexit._run_exitfuncs()  # prints (and swallows) a failing handler's error, as at a normal exit
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
