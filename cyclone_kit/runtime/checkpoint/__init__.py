"""Checkpoints: written atomically, the last K kept, the newest loadable one resumed.

A checkpoint is one ``torch.save`` file ``RUN_DIR/checkpoints/ckpt-<step:09d>.pt`` holding
model, optimizer, grad scaler and LR scheduler state (the built-in engine; a user script's dict from
``ck.save_checkpoint`` is kept whole under ``user_state``), the epoch/step/sampler position and the
RNG states of every rank (torch, CUDA, numpy, python). It is written to a temporary file in the
same directory, fsync'ed and renamed into place (then the directory is fsync'ed), so a kill
at any moment leaves either the old set or the new set of complete files. Loading uses
``weights_only=True``: a checkpoint can hold tensors and plain containers only, never code.

Every checkpoint has a checksum file beside it (``ckpt-<step:09d>.pt.sha256``: the SHA-256 of
the bytes written, in ``sha256sum`` format), written before the checkpoint is renamed into
place and verified before it is loaded: a flipped bit or a torn file is skipped with its
reason, and the previous checkpoint is loaded instead (:func:`scan_latest`).

Asynchronous writes (``checkpoint.async_write``, the default): :func:`snapshot` copies the state
to host memory at the step boundary (every tensor cloned, every container rebuilt, so later
optimizer steps cannot change what is written), and a :class:`BackgroundWriter` runs
:func:`save_checkpoint` on that copy in one thread, under the same rules as above. At most one
write is in flight: the next one waits for it (:meth:`BackgroundWriter.wait`), and a write that
failed raises its error there, or at the end of the segment, as the synchronous write would have.
:func:`copy_checkpoint` copies a node-local first copy into the run directory under the same rules,
its bytes verified against the first copy's checksum. FSDP's sharded checkpoints are asynchronous on
every rank (:class:`PendingShards`): the small ``.pt`` that names the shards is written only once every
rank's shards are in place, so a ``.pt`` file is always a complete checkpoint.

The package is the rank side's one place for checkpoints: this module (the file format, the atomic
write, the checksum, the newest-good rule, :func:`load_states`: a state into a model and optimizer,
whichever writer made it), :mod:`~cyclone_kit.runtime.checkpoint.fsdp` (FSDP's sharded variant) and
:mod:`~cyclone_kit.runtime.checkpoint.pipeline` (the pipeline's stages under the full model's names).
"""

from __future__ import annotations

import hashlib
import random
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cyclone_kit.core.errors import CycloneError, DiskFullError, ValidationError
from cyclone_kit.rundir.fileio import atomic_file, disk_full_message, free_bytes, is_disk_full, write_atomic

FORMAT = 1
#: The key under which a checkpoint written through the public API (``ck.save_checkpoint``) holds the script's dict.
USER_STATE = "user_state"
#: The suffix of a checkpoint's checksum file (``ckpt-000000100.pt.sha256``, in ``sha256sum`` format).
DIGEST_SUFFIX = ".sha256"
#: Set to 1 by ``cyclone-kit run --resume``: the run must continue from a checkpoint.
RESUME_VAR = "CYCLONE_RESUME"
#: Set to 1 (``--restart-from-scratch``) to start at step 0 although no checkpoint could be loaded.
FROM_SCRATCH_VAR = "CYCLONE_RESTART_FROM_SCRATCH"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_CHUNK = 1 << 20


class DamagedCheckpoint(ValueError):
    """A checkpoint file whose bytes are not the bytes written (checksum mismatch) or not a checkpoint."""


@dataclass(frozen=True)
class Skipped:
    """A checkpoint passed over while looking for the newest loadable one.

    Attributes:
        path: the file.
        reason: why, in words (``checksum mismatch: ...``, ``RuntimeError: ...``).
    """

    path: Path
    reason: str

    def line(self) -> str:
        """``skipping damaged checkpoint PATH (REASON)``."""
        return f"skipping damaged checkpoint {self.path} ({self.reason})"


@dataclass(frozen=True)
class Scan:
    """What :func:`scan_latest` found: the newest loadable checkpoint (or None) and what it skipped."""

    found: tuple[dict[str, Any], Path] | None
    skipped: tuple[Skipped, ...] = ()


def checkpoint_path(folder: Path, step: int) -> Path:
    """The file name of the checkpoint after ``step`` optimizer steps."""
    return Path(folder) / f"ckpt-{step:09d}.pt"


def digest_path(path: Path) -> Path:
    """The checksum file of checkpoint ``path`` (``ckpt-N.pt`` -> ``ckpt-N.pt.sha256``)."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in ``folder``, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


class _Hashing:
    """A binary file wrapper that hashes (and counts) every byte written through it."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += len(view)
        return self.f.write(view) if self.f is not None else len(view)

    def flush(self) -> None:
        if self.f is not None:
            self.f.flush()


def serialized_size(state: dict[str, Any]) -> int:
    """How many bytes ``torch.save`` writes for ``state`` as a checkpoint (serialised, not stored)."""
    sink = _Hashing(None)
    torch.save({"format": FORMAT, **state}, sink)
    return sink.size


def save_checkpoint(folder: Path, state: dict[str, Any], step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically and keep only the newest ``keep``.

    The SHA-256 of the bytes written goes into ``<checkpoint>.sha256`` (``sha256sum -c`` reads
    it) before the checkpoint is renamed into place; loading verifies it. Older checkpoints are
    deleted only after the new one is complete, so a failed write leaves them as they were.

    Args:
        folder: the checkpoint directory (created if needed).
        state: what :func:`load_latest` returns later (tensors and plain containers only).
        step: optimizer steps done; names the file.
        keep: how many checkpoints to keep (older ones are deleted after the new one is in place).

    Returns:
        The path of the new checkpoint.

    Raises:
        DiskFullError: the file system is full (the message names the path, the space needed and free).
    """
    return _write_verified(Path(folder), step, keep, lambda out: torch.save({"format": FORMAT, **state}, out),
                           lambda: serialized_size(state))


def copy_checkpoint(source: Path, folder: Path, keep: int) -> Path:
    """Copy the checkpoint ``source`` (a node-local first copy) into ``folder`` under the rules of
    :func:`save_checkpoint`: a temporary file there, fsync, its checksum file before the atomic
    rename, the directory fsync'ed, the newest ``keep`` kept. The bytes copied must hash to the
    checksum recorded beside ``source``, else nothing is renamed into place.

    Raises:
        DamagedCheckpoint: ``source`` has no checksum, or its bytes are not the bytes written.
        DiskFullError: ``folder``'s file system is full.
    """
    source = Path(source)
    expected = recorded_digest(source)
    m = _NAME.match(source.name)
    if expected is None or m is None:
        raise DamagedCheckpoint(f"{source} is no checkpoint with a checksum: it cannot be copied and verified")

    def fill(out: _Hashing) -> None:
        with open(source, "rb") as f:
            while chunk := f.read(_CHUNK):
                out.write(chunk)

    return _write_verified(Path(folder), int(m.group(1)), keep, fill, lambda: source.stat().st_size, expected)


def _write_verified(folder: Path, step: int, keep: int, fill: Callable[[_Hashing], None], needed: Callable[[], int],
                    expected: str | None = None) -> Path:
    """The one atomic checkpoint writer: ``fill`` the temporary file, check ``expected`` (when given),
    write the checksum file, rename, prune to ``keep``; a full disk raises one clear DiskFullError."""
    final = checkpoint_path(folder, step)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_file(final, fsync_dir=True) as f:
            out = _Hashing(f)
            fill(out)
            digest = out.sha.hexdigest()
            if expected is not None and digest != expected:  # raised inside: the temporary file is removed
                raise DamagedCheckpoint(f"copying into {final}: sha256 {digest[:12]}... but {expected[:12]}... "
                                        "was written: the first copy is damaged")
            write_atomic(digest_path(final), f"{digest}  {final.name}\n")  # before the rename
    except Exception as e:
        if not is_disk_full(e):
            raise
        digest_path(final).unlink(missing_ok=True)
        raise DiskFullError(
            disk_full_message("checkpoint", final, needed(), free_bytes(folder))
            + f"; the older checkpoints are intact ({len(list_checkpoints(folder))} in {folder})",
            hint=f"free space there (or lower checkpoint.keep, now {keep}), then run the job again: "
                 "it resumes from the newest checkpoint") from None
    for _, old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
        digest_path(old).unlink(missing_ok=True)
    for stale in folder.glob(".ckpt-*"):  # temporary files of a process killed while writing
        if stale.is_file():
            stale.unlink(missing_ok=True)
    for digest_file in folder.glob(f"ckpt-*.pt{DIGEST_SUFFIX}"):  # checksums whose checkpoint is gone
        if not digest_file.with_name(digest_file.name[: -len(DIGEST_SUFFIX)]).exists():
            digest_file.unlink(missing_ok=True)
    return final


def snapshot(state: Any, into: Any = None) -> Any:
    """A copy of ``state`` in host memory that nothing the caller does later can change.

    Tensors are detached and copied to the CPU (a real copy, also for CPU tensors: a parameter's
    or momentum buffer's storage is updated in place by the next optimizer step); dicts, lists and
    tuples are rebuilt (a dict keeps its type and attributes, e.g. a state dict's ``_metadata``);
    anything else (ints, floats, strings, None, ``torch.Size`` ...) is kept as it is. Tensors
    that shared storage in ``state`` (tied weights) are copied separately.

    ``into``: an earlier snapshot of the same structure that nothing uses any more (its write is
    finished): a CPU tensor of the same shape, dtype and strides at the same place is reused
    (``copy_``) instead of allocating (and page-faulting in) a new one.

    A CUDA tensor is copied into page-locked (pinned) host memory without a wait per tensor, and the
    copies are waited for once, on each device involved, before this returns. On an H200, ResNet-50 with
    SGD momentum (195 MiB in 481 tensors) took 158 ms as one synchronous pageable copy per tensor (1.2
    GiB/s: more than a training step at batch 128), 5.8 ms this way (bench/snapshot_cuda.py). The pinned
    buffers are reused through ``into`` at the next checkpoint.
    """
    devices: set[torch.device] = set()
    copy = _snapshot(state, into, devices)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()  # the copies ran on that stream, after the step's kernels
    return copy


def _snapshot(state: Any, into: Any, devices: set[torch.device]) -> Any:
    """:func:`snapshot`'s walk; ``devices`` collects the CUDA devices whose copies are still in flight."""
    if isinstance(state, torch.Tensor):
        t = state.detach()
        if (isinstance(into, torch.Tensor) and into.device.type == "cpu" and into.layout == t.layout == torch.strided
                and into.dtype == t.dtype and into.shape == t.shape and into.stride() == t.stride()
                and not t.is_conj() and not t.is_neg()):
            if t.is_cuda and into.is_pinned():
                devices.add(t.device)
                return into.copy_(t, non_blocking=True)
            return into.copy_(t)
        if t.is_cuda and t.layout == torch.strided and not t.is_conj() and not t.is_neg():
            try:
                out = torch.empty_like(t, device="cpu", pin_memory=True)  # the same strides (channels_last too)
            except RuntimeError:  # no page-locked memory to be had (a limit of the node): the pageable copy
                out = None
            if out is not None and out.stride() == t.stride():
                devices.add(t.device)
                return out.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True)
    if isinstance(state, dict):
        out = state.copy()
        old = into if isinstance(into, dict) else {}
        for key, value in state.items():
            out[key] = _snapshot(value, old.get(key), devices)
        if getattr(state, "__dict__", None):
            out.__dict__.update(state.__dict__)
        return out
    if isinstance(state, list | tuple) and (type(state) is list or type(state) is tuple):
        old_items = list(into) if isinstance(into, list | tuple) and len(into) == len(state) else [None] * len(state)
        items = [_snapshot(v, o, devices) for v, o in zip(state, old_items, strict=True)]
        return items if type(state) is list else tuple(items)
    return state


@dataclass(frozen=True)
class Waited:
    """What :meth:`BackgroundWriter.wait` found: whether a write was still running, for how long it waited."""

    busy: bool
    seconds: float


class BackgroundWriter:
    """One checkpoint write at a time, in a background thread (rank 0's; see the module's notes).

    The thread is not a daemon: an interpreter that exits normally finishes the write first. A
    failure is kept and raised by the next :meth:`wait` (so by the next :meth:`start` too),
    exactly once.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None

    @property
    def busy(self) -> bool:
        """True while a write is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], Any], step: int) -> Waited:
        """Wait for the previous write (raising its failure), then run ``write()`` in the background.

        Returns:
            The wait for the previous write (``busy`` True: it was still running).
        """
        waited = self.wait()
        self.step = step
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"cyclone-ckpt-{step}", daemon=False)
        self._thread.start()
        return waited

    def _run(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except BaseException as e:  # kept for the caller's thread: a background failure is never silent
            self._error = e

    def wait(self, timeout_s: float | None = None, raise_error: bool = True) -> Waited:
        """Wait for the write in flight (at most ``timeout_s`` seconds when given); raise its failure.

        Raises:
            DiskFullError: the background write found the disk full (the synchronous write's error).
            Exception: whatever else the write raised (once; it is cleared).
        """
        busy = self.busy
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None
        waited = Waited(busy, time.perf_counter() - t0)
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error
        if error is not None:
            sys.stderr.write(f"cyclone_kit: warning: the checkpoint of step {self.step} was not written: {error}\n")
        return waited


class ShardWriteFailed(CycloneError):
    """The shards of an asynchronous sharded checkpoint were not all written: no ``.pt`` names them."""

    exit_code = 1


@dataclass(frozen=True)
class PendingShards:
    """A sharded checkpoint whose shards every rank is writing in the background (FSDP's
    ``checkpoint.sharded`` with ``checkpoint.async_write``): the ``.pt`` that names them is written
    by rank 0 only once every rank's write is done (``Session.finish_shards``).

    Attributes:
        step: the checkpoint's step.
        future: this rank's write (``concurrent.futures.Future``: ``done``, ``result``).
        state: rank 0's ``.pt`` state (a host copy); None on the other ranks.
        after_write: run by rank 0 after the ``.pt`` is in place (the shard directories' prune).
    """

    step: int
    future: Any
    state: dict[str, Any] | None
    after_write: Callable[[Path], Any] | None = None


def shard_verdict(step: int, errors: list[str | None]) -> str | None:
    """Why the ``.pt`` of sharded checkpoint ``step`` must not be written, or None when it may (pure):
    ``errors`` holds every rank's failure in rank order (None: its shards are written)."""
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return None
    ranks = ", ".join(str(rank) for rank, _ in failed)
    return (f"the shards of checkpoint step {step} were not written on rank(s) {ranks} "
            f"(rank {failed[0][0]}: {failed[0][1]}); that checkpoint is not kept")


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def recorded_digest(path: Path) -> str | None:
    """The SHA-256 recorded for checkpoint ``path`` at save time; None for a checkpoint saved
    without one (by cyclone_kit before checksums, or copied without its ``.sha256`` file).

    Raises:
        DamagedCheckpoint: the checksum file exists but is not one.
    """
    try:
        text = digest_path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    digest = text.split()[0] if text.split() else ""
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise DamagedCheckpoint(f"its checksum file {digest_path(path).name} is damaged")
    return digest


def verify_checkpoint(path: Path) -> bool:
    """Check the file's bytes against the checksum recorded when it was written.

    Returns:
        True when verified, False when no checksum was recorded (nothing to check against).

    Raises:
        DamagedCheckpoint: the bytes differ (a flipped bit, a truncated or overwritten file).
    """
    expected = recorded_digest(path)
    if expected is None:
        return False
    actual = file_sha256(path)
    if actual != expected:
        raise DamagedCheckpoint(f"checksum mismatch: sha256 {actual[:12]}... but {expected[:12]}... was written")
    return True


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify one checkpoint's checksum and load it (weights_only).

    Raises:
        DamagedCheckpoint: its bytes are not the bytes written, or it is no cyclone_kit checkpoint.
        Exception: torch could not read it (a torn or foreign file).
    """
    verify_checkpoint(path)
    state = torch.load(path, map_location=map_location, weights_only=True)
    if (not isinstance(state, dict) or state.get("format") != FORMAT or "step" not in state
            or ("model" not in state and USER_STATE not in state)):
        raise DamagedCheckpoint(f"{path} is not a cyclone_kit checkpoint")
    return state


def scan_latest(folder: Path, map_location: str | torch.device = "cpu") -> Scan:
    """The newest checkpoint that verifies and loads, and every newer one skipped with its reason."""
    skipped = []
    for _, path in list_checkpoints(folder):
        try:
            return Scan((load_checkpoint(path, map_location), path), tuple(skipped))
        except DamagedCheckpoint as e:
            skipped.append(Skipped(path, str(e)))
        except Exception as e:
            skipped.append(Skipped(path, f"unreadable: {type(e).__name__}: {e}"))
    return Scan(None, tuple(skipped))


def load_latest(folder: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads, skipping (with a warning on stderr) damaged ones; None if none."""
    scan = scan_latest(folder, map_location)
    for skip in scan.skipped:
        sys.stderr.write(f"cyclone_kit: warning: {skip.line()}\n")
    return scan.found


def fresh_start_refusal(scan: Scan, folder: Path, *, resuming: bool, from_scratch: bool) -> str | None:
    """Why this run must not start over at step 0, or None when it may (pure).

    A run whose checkpoints all failed to load, or one told to resume (``run --resume``) that
    finds no checkpoint, would silently repeat every step done so far (and rotate away the damaged
    files a user might still repair); it stops instead, unless ``from_scratch`` says otherwise.
    """
    if scan.found is not None or from_scratch:
        return None
    if scan.skipped:
        reasons = "; ".join(f"{s.path.name}: {s.reason.split(':')[0]}" for s in scan.skipped)
        return (f"refusing to start over at step 0: none of the {len(scan.skipped)} checkpoint(s) in {folder} "
                f"can be loaded ({reasons})")
    if resuming:
        return f"refusing to start over at step 0: there is no checkpoint to resume from in {folder}"
    return None


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, numpy, python) as checkpoint-safe values."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _py_state(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (missing parts are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([t.cpu() for t in cuda])
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        except ImportError:
            pass


def _py_state(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def load_states(state: dict[str, Any], model: Any, optimizer: torch.optim.Optimizer, sharded: bool,
                folder: Path | None) -> None:
    """Load the model and optimizer of checkpoint ``state`` (found in ``folder``), whichever writer made it:
    FSDP shards (``dcp``, an FSDP run of several ranks only), a pipeline's stages (``pipeline-dcp``, by the
    full model's names), full state dicts by parameter names (``fqn``: FSDP's full state; needed by a
    ``sharded`` model), or plain ``state_dict``s (DDP, Horovod, one rank).

    Raises:
        ValidationError: the checkpoint's format cannot be resumed by this run.
    """
    fqn = state.get("optimizer_format") == "fqn"
    if state.get("optimizer_format") == "dcp":  # FSDP shards (checkpoint.sharded) in folder/ckpt-N.dcp
        from cyclone_kit.runtime.checkpoint import fsdp as fsdp_ckpt

        if not sharded or folder is None:
            raise ValidationError(
                f"checkpoint of step {state['step']} holds FSDP shards (checkpoint.sharded); "
                "only an FSDP run with several ranks can resume it",
                hint="resume with train.strategy=fsdp on 2 or more ranks, or start a new run directory",
            )
        fsdp_ckpt.load_sharded(folder, state, model, optimizer)
    elif state.get("optimizer_format") == "pipeline-dcp" and not sharded and folder is not None:
        from cyclone_kit.runtime.checkpoint import pipeline as pipeline_ckpt  # a pipeline's stages, by the full model's names

        pipeline_ckpt.load_full(folder / state["model"]["dcp"], model, optimizer)
    elif sharded or fqn:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not fqn:
            raise ValidationError(
                f"checkpoint of step {state['step']} was written by a {state.get('strategy', 'ddp')} run; "
                "an FSDP run cannot resume its optimizer state",
                hint="resume with the strategy that wrote it, or start a new run directory",
            )
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=full)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=full)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
