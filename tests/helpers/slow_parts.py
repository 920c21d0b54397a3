"""Made conditions for tests whose verdict needs one: a slow network, a slow file system.

A study that must come out communication-bound or input-bound cannot hope the machine makes it so
(2 ranks on 2 cores stretch compute as much as the all-reduce, a 5x faster disk decodes faster).
:func:`slow_parts_env` writes a ``sitecustomize.py`` that the ranks' interpreters import at start-up
(it rides on ``PYTHONPATH``, which the launchers pass on) and that, only when the module is imported,
wraps:

* DDP's default all-reduce hook (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``, the
  one the engine's timed hook calls): each bucket's result is ready ``allreduce_delay_s`` later, on
  the collective's own thread, not backward's: a link of that latency, seen by the engine as exposed
  communication, and costing no core;
* torchvision's ImageFolder loader (``torchvision.datasets.folder.pil_loader``): each image is read
  ``load_delay_s`` late: a slow shared file system, costing no core.

It also makes moments that a test must act in, instead of hoping to land in them:

* every optimizer step (a global ``torch.optim.optimizer.register_optimizer_step_post_hook``,
  installed when ``torch.optim.optimizer`` is imported) sleeps ``step_delay_s`` (a floor on step
  time), and at this process's ``hold_step``-th step it writes ``HOLD_DIR/at-K-rank-R`` and waits
  (a Python sleep loop: signal handlers still run) until ``HOLD_DIR/go`` exists. A resumed segment
  is never held: not when ``go`` exists, not when ``SLURM_RESTART_COUNT`` > 0, not when this rank
  was held once already (``HOLD_DIR/held-rank-R``, written when it holds);
* while a hold is set, every Python signal handler installed later first appends the signal's
  number to ``HOLD_DIR/signal-rank-R``: a test sees that a rank *received* a signal before it lets
  the rank go on;
* ``os.fsync`` of a DCP shard file (``__R_K.distcp``), the ``hold_shard``-th one of this process (on rank
  ``hold_shard_rank`` only, when given), writes ``HOLD_DIR/writing-shard-rank-R`` and waits until
  ``HOLD_DIR/release`` exists: an asynchronous sharded checkpoint's write surely in flight on that rank;
* ``os.fsync`` of a checkpoint's temporary file (``.ckpt-N.pt.XXXX.tmp``, see
  :func:`cyclone_kit.rundir.fileio.atomic_file`), the ``hold_write``-th one of this process, writes
  ``HOLD_DIR/writing`` and waits until ``HOLD_DIR/release`` exists: a checkpoint write that is
  surely in progress (the temporary file exists, complete but not yet renamed).

R is ``RANK``, else ``SLURM_PROCID``, else 0. :func:`hold_files` names the files for a test.

``HOLD_DIR`` is read when a hold is set, not when the file runs: ``$CK_SLOW_PARTS_HOLD_DIR`` (which
:func:`slow_parts_env` sets) when this process's environment has it, else the folder the file was written
with. Ranks forked from one process (:mod:`cyclone_kit.core.prefork`, :func:`tests.helpers.ranks.popen_group`)
ran this file once, in that process, with the first rank's environment; each still holds in its own folder
(issue 27: two held runs' ranks forked from one process, one import of torch for both), provided they agree on
everything else (``hold_step``, ``hold_write``, the delays).
"""

from __future__ import annotations

import os
from pathlib import Path

SITECUSTOMIZE = '''\
"""Written by tests/helpers/slow_parts.py: sleeps injected into torch's all-reduce hook / torchvision's loader."""
import importlib.abc
import importlib.machinery
import sys
import time

ALLREDUCE_DELAY_S = {allreduce}
LOAD_DELAY_S = {load}
STEP_DELAY_S = {step_delay}
HOLD_DIR = {hold_dir}
HOLD_DIR_VAR = {hold_dir_var}
HOLD_STEP = {hold_step}
HOLD_WRITE = {hold_write}
HOLD_SHARD = {hold_shard}
HOLD_SHARD_RANK = {hold_shard_rank}


def _slow_allreduce(module):
    original = module.allreduce_hook

    def allreduce_hook(state, bucket):
        def late(fut):
            time.sleep(ALLREDUCE_DELAY_S)
            return fut.value()
        return original(state, bucket).then(late)

    module.allreduce_hook = allreduce_hook


def _slow_loader(module):
    original = module.pil_loader

    def pil_loader(path):
        time.sleep(LOAD_DELAY_S)
        return original(path)

    module.pil_loader = pil_loader


def _rank():
    import os
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _hold_dir():
    """This process's hold folder: its environment's (a rank forked from a process that ran this file with
    another rank's environment), else the one this file was written with."""
    import os
    return os.environ.get(HOLD_DIR_VAR) or HOLD_DIR


def _wait_for(path):
    import os
    while not os.path.exists(path):
        time.sleep(0.01)  # in Python, so signal handlers run while held


def _touch(path, text=""):
    with open(path, "a") as f:
        f.write(text)


def _fresh_segment():
    import os
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return not restarts.isdigit() or int(restarts) == 0


_steps = [0]


def _step_hooks(module):
    import os

    def after_step(optimizer, args, kwargs):
        _steps[0] += 1
        if STEP_DELAY_S > 0:
            time.sleep(STEP_DELAY_S)
        if HOLD_STEP is None or _steps[0] != HOLD_STEP or not _fresh_segment():
            return
        rank = _rank()
        hold_dir = _hold_dir()
        held = os.path.join(hold_dir, "held-rank-%d" % rank)
        go = os.path.join(hold_dir, "go")
        if os.path.exists(go) or os.path.exists(held):
            return
        _touch(held)
        _touch(os.path.join(hold_dir, "at-%d-rank-%d" % (HOLD_STEP, rank)))
        _wait_for(go)

    module.register_optimizer_step_post_hook(after_step)


def _note_signals():
    import os
    import signal

    install = signal.signal

    def noting(signum, handler):
        if not callable(handler):
            return install(signum, handler)

        def handle(number, frame):
            _touch(os.path.join(_hold_dir(), "signal-rank-%d" % _rank()), "%d\\n" % number)
            return handler(number, frame)

        handle.__wrapped__ = handler
        return install(signum, handle)

    signal.signal = noting


def _hold_fsyncs(pattern, nth, marker, when=None):
    """Hold the ``nth`` fsync of a file whose name matches ``pattern`` until the test releases it
    (the file is complete, not yet renamed or recorded); ``marker`` says which one is held (``%d``: the
    rank). ``when`` is asked at the fsync, not here: a rank forked from the local launcher's fork server
    (cyclone_kit.core.prefork) ran this file once, in the process it was forked from, with rank 0's
    environment."""
    import os
    import re

    fsync = os.fsync
    name = re.compile(pattern)
    seen = [0]

    def held_fsync(fd):
        try:
            target = os.readlink("/proc/self/fd/%d" % int(fd))
        except (OSError, TypeError, ValueError):
            target = ""
        if name.match(os.path.basename(target)):
            seen[0] += 1
            hold_dir = _hold_dir()
            release = os.path.join(hold_dir, "release")
            if seen[0] == nth and not os.path.exists(release) and (when is None or when()):
                _touch(os.path.join(hold_dir, marker % _rank() if "%d" in marker else marker), target + "\\n")
                _wait_for(release)
        return fsync(fd)

    os.fsync = held_fsync


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after it is first executed."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_PATCHES = {{}}
if ALLREDUCE_DELAY_S > 0:
    _PATCHES["torch.distributed.algorithms.ddp_comm_hooks.default_hooks"] = _slow_allreduce
if LOAD_DELAY_S > 0:
    _PATCHES["torchvision.datasets.folder"] = _slow_loader
if STEP_DELAY_S > 0 or HOLD_STEP is not None:
    _PATCHES["torch.optim.optimizer"] = _step_hooks
if HOLD_STEP is not None or HOLD_WRITE is not None:
    _note_signals()
if HOLD_WRITE is not None:  # rank 0's checkpoint file
    _hold_fsyncs("^[.]ckpt-[0-9]+[.]pt[.][^.]+[.]tmp$", HOLD_WRITE, "writing")
if HOLD_SHARD is not None:  # a DCP shard, on rank HOLD_SHARD_RANK (all when None) of a fresh segment
    _hold_fsyncs("^__[0-9]+_[0-9]+[.]distcp$", HOLD_SHARD, "writing-shard-rank-%d",
                 when=lambda: _fresh_segment() and HOLD_SHARD_RANK in (None, _rank()))
if _PATCHES:
    sys.meta_path.insert(0, _AfterImport(_PATCHES))
'''

#: The environment variable naming a process's hold folder (see the module's docstring).
HOLD_DIR_VAR = "CK_SLOW_PARTS_HOLD_DIR"


def slow_parts_env(folder: Path, *, allreduce_delay_s: float = 0.0, load_delay_s: float = 0.0,
                   step_delay_s: float = 0.0, hold_step: int | None = None, hold_write: int | None = None,
                   hold_shard: int | None = None, hold_shard_rank: int | None = None,
                   hold_dir: Path | None = None) -> dict[str, str]:
    """Write the ``sitecustomize.py`` into ``folder``; returns the environment that makes every rank load it
    (``PYTHONPATH``) and names its hold folder (:data:`HOLD_DIR_VAR`).

    Args:
        folder: where the file goes (created).
        allreduce_delay_s, load_delay_s: the slow link and the slow file system (0: none).
        step_delay_s: a sleep after every optimizer step (0: none).
        hold_step: hold each rank after this optimizer step of a fresh process until ``hold_dir/go``.
        hold_write: hold this process's N-th checkpoint temporary-file fsync until ``hold_dir/release``.
        hold_shard: hold this process's N-th fsync of a DCP shard file (``__R_K.distcp``, FSDP's sharded
            checkpoints, in the write's thread) until ``hold_dir/release``; on rank ``hold_shard_rank``
            only when given; a resumed segment (``SLURM_RESTART_COUNT`` > 0) is never held.
        hold_dir: the folder of the hold files (default ``folder/hold``; created).
    """
    folder.mkdir(parents=True, exist_ok=True)
    holds = hold_step is not None or hold_write is not None or hold_shard is not None
    hold = Path(hold_dir) if hold_dir is not None else folder / "hold"
    if holds:
        hold.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(
        allreduce=float(allreduce_delay_s), load=float(load_delay_s), step_delay=float(step_delay_s),
        hold_dir=repr(str(hold.resolve())), hold_dir_var=repr(HOLD_DIR_VAR),
        hold_step=None if hold_step is None else int(hold_step),
        hold_write=None if hold_write is None else int(hold_write),
        hold_shard=None if hold_shard is None else int(hold_shard),
        hold_shard_rank=None if hold_shard_rank is None else int(hold_shard_rank)))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, HOLD_DIR_VAR: str(hold.resolve())}


class Holds:
    """The files of a hold folder (see :func:`slow_parts_env`), for the test that drives it."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def at(self, step: int, ranks: range | list[int]) -> bool:
        """Whether every rank of ``ranks`` is held after optimizer step ``step``."""
        return all((self.folder / f"at-{step}-rank-{r}").exists() for r in ranks)

    def signalled(self, ranks: range | list[int]) -> bool:
        """Whether every rank of ``ranks`` ran a Python signal handler since it started."""
        return all((self.folder / f"signal-rank-{r}").exists() for r in ranks)

    def writing(self) -> bool:
        """Whether a checkpoint write is held (its temporary file complete, not renamed)."""
        return (self.folder / "writing").exists()

    def writing_shard(self, rank: int) -> bool:
        """Whether ``rank``'s DCP shard write is held (its shard file written, not yet fsync'ed)."""
        return (self.folder / f"writing-shard-rank-{rank}").exists()

    def go(self) -> None:
        """Let the ranks held at their step go on."""
        (self.folder / "go").touch()

    def release(self) -> None:
        """Let the held checkpoint write go on."""
        (self.folder / "release").touch()


def hold_files(folder: Path) -> Holds:
    """The hold files of ``slow_parts_env(folder, ...)`` (its default ``hold_dir``)."""
    return Holds(Path(folder) / "hold")


def watchdog_out_of_reach(hang_s: float) -> tuple[str, ...]:
    """``--set`` options for a job whose ranks a test holds while it acts (finds and kills a node's processes):
    the progress watchdog stays armed (the step watcher tells a vanished rank by its progress record) with a bound
    no hold the test allows can reach: the floor at the test's hang guard ``hang_s``, ``train.pg_timeout_s`` twice
    that (the bound stays below 0.6 x the timeout). With smoke.toml's 60 s timeout a hold had to end within 36 s,
    a margin a 5x slower machine could eat (docs/TESTING.md item 9). A killed peer is still seen at once: the
    survivors' all-reduce fails on the lost connection, not on the timeout."""
    return ("--set", f"checkpoint.stall_floor_s={hang_s:g}", "--set", f"train.pg_timeout_s={int(2 * hang_s)}")
