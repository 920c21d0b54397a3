"""Where each training step's time goes: the phases of every ``step`` record.

Per optimizer step, averaged over a log window, as rank 0 saw it (the contract's fields,
:data:`cyclone_kit.rundir.contract.PHASE_FIELDS`). In synchronous data parallelism every rank's
step takes as long as the slowest's, so a rank that is slower (its loader, its core) shows on rank 0
as communication: the all-reduce waits for it.

* ``data_time_s``: waiting for the next batch: the loader's ``next()`` with its host-to-device
  copy. Host clock: the time the training thread spent in it. CUDA events: the compute stream's
  time between an event before and one after it, i.e. the copy plus the time the GPU sat idle
  waiting for the host to hand it the batch (a loader that is slow while the GPU is still busy
  with queued work costs nothing and shows nothing).
* ``comm_time_s``: gradient communication in flight: the union of the intervals from handing a
  gradient bucket (DDP), a shard (FSDP's all-gather / reduce-scatter) or the first gradient
  (Horovod) to the library until its result is ready. It includes time queued behind earlier
  buckets and the time a collective waits for a slower rank (a straggler shows as communication).
  Horovod gives no per-tensor completion times: its figure runs from the first gradient of the
  step to ``synchronize()`` returning, an upper bound.
* ``comm_exposed_s``: the part of ``comm_time_s`` not hidden behind computation, derived per
  strategy (docstrings of :class:`PhaseTimer`'s recorders say how; where it is an estimate):
  DDP: from the moment the last bucket became ready (backward has computed its last gradient)
  to the moment all buckets are reduced, clipped to the end of backward (an estimate: it assumes
  backward has no compute left after the last bucket, which holds for DDP's reverse-order
  buckets); FSDP on the host clock: the whole time the training thread was blocked in the
  (synchronous) all-gathers and reduce-scatters (measured); FSDP on CUDA: not measured (null);
  Horovod: the time the training thread was blocked in ``optimizer.synchronize()`` (measured).
* ``compute_time_s``: forward + backward + optimizer (+ the LR scheduler and zero_grad), minus
  ``comm_exposed_s`` (when it is measured; else the exposed part is inside compute).
* ``other_time_s``: the rest of the step: the loop's bookkeeping, the stop poll, checkpoints and
  validation passes that fell in the window, and the log window's own loss reduce.
* ``bubble_time_s``: pipeline engines only (idle time per stage waiting for micro-batches);
  null here.

So ``data + compute + comm_exposed + other`` is the step: exactly on the host clock (the marks
form one chain over the window), and on CUDA the events' timeline of the compute stream against
the host's window clock (the window ends with a host sync, so both end together).

No per-step host sync: on the host clock the marks are ``time.perf_counter()`` floats; on CUDA
they are pooled timing events recorded on the stream doing the work and read only when the
window closes, after the log window's sync.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``start.phase_timing``: how the phases were timed.
HOST_CLOCK = "host-clock"
CUDA_EVENTS = "cuda-events"
#: ``start.comm_timing``: where the gradient communication was timed.
DDP_HOOK = "ddp-comm-hook"
FSDP_COMMS = "fsdp-collectives"
HOROVOD_SYNC = "horovod-synchronize"
#: ``start.comm_timing`` of a world of one: there is no gradient communication (its fields are 0).
NO_COMM = "none"
#: ``start.comm_timing`` of the pipeline engine: activations/gradients sent between stages (its
#: ``bubble_time_s``: the idle time of a stage waiting for micro-batches, outside compute).
PIPELINE = "pipeline"

#: Chain phases (a mark starts the phase it names).
DATA, COMPUTE, OTHER = 0, 1, 2
#: The environment variable that turns the timing off (``0``), e.g. for the overhead benchmark.
PHASES_VAR = "CYCLONE_PHASES"


def enabled(environ: Any) -> bool:
    """Phase timing is on unless ``$CYCLONE_PHASES`` is ``0``/``false``/``off`` (pure)."""
    return str(environ.get(PHASES_VAR, "1")).strip().lower() not in ("0", "false", "off", "no")


# --------------------------------------------------------------------------- clocks
class HostClock:
    """Marks are ``time.perf_counter()`` floats (CPU training: the host does the work)."""

    kind = HOST_CLOCK

    mark = staticmethod(time.perf_counter)

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b``."""
        return float(b - a)

    def recycle(self) -> None:
        """Nothing to give back."""


class CudaClock:
    """Marks are CUDA timing events recorded on ``device``'s current stream, pooled and reused.

    The current stream is the one doing the work at the mark: the compute stream in the loop, the
    autograd stream in DDP's comm hook, in a collective's ``then`` callback the stream torch makes
    wait for the collective (so that event completes when the collective does), FSDP's all-gather or
    reduce-scatter stream around its collectives. The device is named explicitly: a callback's
    thread may have another current device.
    """

    kind = CUDA_EVENTS

    def __init__(self, device: Any = None) -> None:
        import torch

        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._free: list[Any] = []
        self._used: list[Any] = []

    def mark(self) -> Any:
        """Record an event on the current stream of the device (no sync)."""
        torch = self._torch
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._used.append(ev)
        return ev

    @staticmethod
    def seconds(a: Any, b: Any) -> float:
        """Seconds from event ``a`` to event ``b`` (both complete: read after the window's sync)."""
        b.synchronize()
        return float(a.elapsed_time(b)) / 1000.0

    def recycle(self) -> None:
        """Return the window's events to the pool."""
        self._free.extend(self._used)
        self._used.clear()


def clock_for(device: Any) -> HostClock | CudaClock:
    """CUDA events on a GPU (``device``: a ``torch.device`` or its name), the host clock otherwise."""
    import torch

    device = torch.device(device)
    return CudaClock(device) if device.type == "cuda" else HostClock()


# --------------------------------------------------------------------------- pure maths
def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once; pure)."""
    total, end = 0.0, None
    start = 0.0
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def exposed_after_last_ready(buckets: Sequence[tuple[float, float]], backward_end: float) -> float:
    """DDP's exposed communication of one step (pure): from the last bucket becoming ready to the
    last result, clipped to the end of backward (which waits for every bucket)."""
    if not buckets:
        return 0.0
    last_ready = max(a for a, _ in buckets)
    done = min(max(b for _, b in buckets), backward_end)
    return max(0.0, done - last_ready)


@dataclass(frozen=True)
class Phases:
    """One window's phases per step (seconds; None where not measured)."""

    data_time_s: float | None
    compute_time_s: float | None
    comm_time_s: float | None
    comm_exposed_s: float | None
    other_time_s: float | None
    bubble_time_s: float | None = None

    def fields(self) -> dict[str, float | None]:
        """The step record's phase fields."""
        return {"data_time_s": self.data_time_s, "compute_time_s": self.compute_time_s,
                "comm_time_s": self.comm_time_s, "comm_exposed_s": self.comm_exposed_s,
                "other_time_s": self.other_time_s, "bubble_time_s": self.bubble_time_s}


def window_phases(chain: Sequence[tuple[int, float]], end: float, comm: Sequence[tuple[float, float]],
                  blocked: Sequence[tuple[float, float]], ddp_steps: Sequence[tuple[Sequence[tuple[float, float]],
                                                                                   float]],
                  steps: int, comm_measured: bool, exposed_measured: bool) -> Phases:
    """The per-step phases of one window from its marks in seconds (pure).

    Args:
        chain: (phase, time) marks; each starts the phase it names and ends the previous one.
        end: the window's end.
        comm: communication intervals (their union is the communication time).
        blocked: intervals the training thread was blocked on communication (exposed, measured).
        ddp_steps: per step, its bucket intervals and the end of its backward (exposed, estimated).
        steps: optimizer steps in the window.
        comm_measured: communication was timed (else its fields are None).
        exposed_measured: the exposed part is known (else None and left inside compute).
    """
    totals = [0.0, 0.0, 0.0]
    for (phase, t), nxt in zip(chain, [*(t for _, t in chain[1:]), end], strict=True):
        totals[phase] += max(0.0, nxt - t)
    n = max(steps, 1)
    if not comm_measured:
        return Phases(totals[DATA] / n, totals[COMPUTE] / n, None, None, totals[OTHER] / n)
    comm_s = union_length(comm) + sum(union_length(b) for b, _ in ddp_steps)
    exposed: float | None = None
    compute = totals[COMPUTE]
    if exposed_measured:
        exposed = union_length(blocked) + sum(exposed_after_last_ready(b, e) for b, e in ddp_steps)
        exposed = min(exposed, compute)
        compute -= exposed
    return Phases(totals[DATA] / n, compute / n, comm_s / n, None if exposed is None else exposed / n,
                  totals[OTHER] / n)


# --------------------------------------------------------------------------- the timer
@dataclass
class _Window:
    chain: list[tuple[int, Any]] = field(default_factory=list)
    comm: list[tuple[Any, Any]] = field(default_factory=list)
    blocked: list[tuple[Any, Any]] = field(default_factory=list)
    ddp_steps: list[tuple[list[tuple[Any, Any]], Any]] = field(default_factory=list)
    buckets: list[tuple[Any, Any]] = field(default_factory=list)
    steps: int = 0


class PhaseTimer:
    """Marks the phases of the training loop and the gradient communication, per log window.

    The loop calls :meth:`open` when a window starts, :meth:`mark` with :data:`DATA` /
    :data:`COMPUTE` / :data:`OTHER` at each boundary, :meth:`backward_done` after the last
    backward of a step and :meth:`step_done` after its optimizer step, and :meth:`close` after the
    window's host sync (it returns the :class:`Phases`). Recorders attached with
    :meth:`attach_ddp`, :meth:`attach_fsdp` or :meth:`attach_horovod` time the communication.
    """

    def __init__(self, clock: HostClock | CudaClock) -> None:
        self.clock = clock
        self.comm_timing: str | None = None
        self.comm_note: str | None = None  # why the communication is not timed (one line), for rank 0 to print
        self.exposed_measured = True
        self.phase = OTHER  # the phase the last mark started
        self._w = _Window()

    @property
    def phase_timing(self) -> str:
        """``start.phase_timing``: :data:`HOST_CLOCK` or :data:`CUDA_EVENTS`."""
        return self.clock.kind

    # -- the loop's marks
    def open(self) -> None:
        """Start a window (its first phase is OTHER until the first step's data mark)."""
        self._w = _Window()
        self._w.chain.append((OTHER, self.clock.mark()))
        self.phase = OTHER

    def mark(self, phase: int) -> None:
        """Start ``phase`` now (ends the one before)."""
        self._w.chain.append((phase, self.clock.mark()))
        self.phase = phase

    def backward_done(self) -> None:
        """The step's last backward returned: its DDP buckets are closed with this end."""
        w = self._w
        if w.buckets:
            w.ddp_steps.append((w.buckets, self.clock.mark()))
            w.buckets = []

    def step_done(self) -> None:
        """The optimizer step is done: the rest of the step is OTHER."""
        self.mark(OTHER)
        self._w.steps += 1

    def script_step_done(self) -> None:
        """A user script's step ended (``ck.log_step``): its buckets closed, compute ended unless
        the optimizer's hook ended it already, the step counted."""
        self.backward_done()
        if self.phase == COMPUTE:
            self.mark(OTHER)
        self._w.steps += 1

    def close(self) -> Phases:
        """End the window (call after its host sync) and return its per-step phases."""
        w, clock = self._w, self.clock
        end = clock.mark()
        origin = w.chain[0][1] if w.chain else end

        def rel(t: Any) -> float:
            return clock.seconds(origin, t)

        def pairs(items: Sequence[tuple[Any, Any]]) -> list[tuple[float, float]]:
            return [(rel(a), rel(b)) for a, b in items]

        result = window_phases([(p, rel(t)) for p, t in w.chain], rel(end), pairs(w.comm), pairs(w.blocked),
                               [(pairs(b), rel(e)) for b, e in w.ddp_steps], w.steps,
                               self.comm_timing is not None, self.exposed_measured)
        clock.recycle()
        self._w = _Window()
        return result

    # -- communication recorders
    def no_communication(self) -> None:
        """A world of one: no gradient communication (``comm_time_s`` and ``comm_exposed_s`` are 0)."""
        self.comm_timing = NO_COMM

    def _bucket(self, ready: Any, done: Any) -> None:
        self._w.buckets.append((ready, done))

    def _comm(self, a: Any, b: Any, blocked: bool) -> None:
        self._w.comm.append((a, b))
        if blocked:
            self._w.blocked.append((a, b))

    def attach_ddp(self, ddp_model: Any, process_group: Any = None) -> None:
        """Register a DDP comm hook that wraps the default all-reduce and times every bucket.

        Each bucket's interval runs from the hook's call (the bucket is ready: backward has
        produced all its gradients) to the all-reduce's result (a ``then`` callback: on CUDA an
        event recorded on the stream that waits for the collective). Exposed per step:
        :func:`exposed_after_last_ready` (an estimate, see the module docstring).

        Raises:
            RuntimeError: the model already has a comm hook (DDP allows one).
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        clock, record = self.clock, self._bucket

        def timed_allreduce(state, bucket):  # unannotated: DDP compares annotations with its own types
            ready = clock.mark()
            fut = default_hooks.allreduce_hook(state, bucket)

            def done(f: Any) -> Any:
                record(ready, clock.mark())
                return f.value()

            return fut.then(done)

        ddp_model.register_comm_hook(process_group, timed_allreduce)
        self.comm_timing = DDP_HOOK

    def attach_fsdp(self, modules: Iterable[Any]) -> None:
        """Time every FSDP2 all-gather and reduce-scatter (``set_custom_all_gather`` /
        ``set_custom_reduce_scatter`` with the default collectives wrapped).

        Host clock: a synchronous collective blocks the training thread for its whole length, so
        it is exposed (measured); an asynchronous one (explicit prefetch) counts as communication
        from its call to its future's completion and as hidden. CUDA: intervals between events on
        the collective's stream; the exposed part is not measured (null, left inside compute).
        A torch without these hooks (before 2.9) leaves the communication untimed (null fields) and
        says why in :attr:`comm_note`.
        """
        from cyclone_kit.runtime import torchcompat

        modules = list(modules)
        if not torchcompat.has_fsdp_custom_comms(modules):  # torch < 2.9: the fields stay null
            import torch

            self.comm_note = torchcompat.fsdp_comms_line(torch.__version__)
            return
        gather, scatter = _TimedCollective(self, "all_gather"), _TimedCollective(self, "reduce_scatter")
        for module in modules:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
        self.comm_timing = FSDP_COMMS
        self.exposed_measured = self.clock.kind == HOST_CLOCK

    def attach_horovod(self, optimizer: Any, params: Iterable[Any]) -> None:
        """Time Horovod's gradient all-reduces through its ``DistributedOptimizer``.

        Exposed (measured): the time the training thread is blocked in ``synchronize()``, which
        waits for every outstanding all-reduce. Communication (an upper-bound estimate: Horovod's
        background thread gives no per-tensor completion times): from the first gradient of the
        step becoming ready (a post-accumulate-grad hook on every parameter) to ``synchronize()``
        returning.
        """
        first: list[Any] = []
        clock = self.clock

        def ready(_param: Any) -> None:
            if not first:
                first.append(clock.mark())

        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(ready)
        original = optimizer.synchronize

        def synchronize(*args: Any, **kwargs: Any) -> Any:
            t0 = clock.mark()
            out = original(*args, **kwargs)
            t1 = clock.mark()
            self._w.blocked.append((t0, t1))
            self._w.comm.append((first[0] if first else t0, t1))
            first.clear()
            return out

        optimizer.synchronize = synchronize
        self.comm_timing = HOROVOD_SYNC


def fsdp_modules(model: Any) -> list[Any]:
    """Every FSDP2 unit of ``model`` (``fully_shard`` modules, the root included)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class _TimedCollective:
    """FSDP2's default all-gather or reduce-scatter, timed (duck-typed ``AllGather``/``ReduceScatter``)."""

    def __init__(self, timer: PhaseTimer, kind: str) -> None:
        self.timer, self.kind = timer, kind

    def allocate(self, size: Sequence[int], *, dtype: Any, device: Any) -> Any:
        """A plain tensor, as FSDP's default collectives allocate."""
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any = None,
                 async_op: bool = False) -> Any:
        import torch.distributed as dist

        clock, timer = self.timer.clock, self.timer
        t0 = clock.mark()
        if self.kind == "all_gather":
            work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        else:
            work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if work is None or not async_op:
            timer._comm(t0, clock.mark(), blocked=True)
        else:
            work.get_future().then(lambda f: timer._comm(t0, clock.mark(), blocked=False))
        return work


# --------------------------------------------------------------------------- user scripts
def instrument_script(timer: PhaseTimer, model: Any = None, loader: Any = None, optimizer: Any = None,
                      distributed: bool = True) -> TimedLoader | None:
    """Attach ``timer`` to a user's model, loader and optimizer (``ck.instrument``'s work).

    Compute starts at the batch's arrival from ``loader`` or at the model's first forward of the
    step (a forward pre-hook), whichever comes first; it ends at the optimizer's step (a step
    post-hook) when ``optimizer`` is given, else at ``ck.log_step``. A DDP model's buckets are timed
    by :meth:`PhaseTimer.attach_ddp`, an FSDP2 model's collectives by :meth:`PhaseTimer.attach_fsdp`;
    any other model (or a world of one) has no gradient communication to time. Returns the timed
    loader to iterate (None without ``loader``).

    Raises:
        RuntimeError: the DDP model already has a comm hook.
    """
    if model is not None:
        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel) and distributed:
            timer.attach_ddp(model)
        elif isinstance(model, FSDPModule) and distributed:
            timer.attach_fsdp(fsdp_modules(model))
        elif not distributed:
            timer.no_communication()

        def forward_started(_module: Any, _args: Any) -> None:
            if timer.phase != COMPUTE:
                timer.mark(COMPUTE)

        model.register_forward_pre_hook(forward_started)
    elif not distributed:
        timer.no_communication()
    if optimizer is not None:
        optimizer.register_step_pre_hook(lambda *_: timer.backward_done())
        optimizer.register_step_post_hook(lambda *_: timer.mark(OTHER))
    if loader is None:
        return None
    return TimedLoader(loader, lambda: timer.mark(DATA), lambda: timer.mark(COMPUTE))


# --------------------------------------------------------------------------- loaders
class TimedLoader:
    """An iterable of batches whose every ``next()`` is timed as :data:`DATA` (the rest of the
    step, from the batch's arrival, as :data:`COMPUTE`); other attributes are the loader's."""

    def __init__(self, loader: Any, on_data: Callable[[], None], on_batch: Callable[[], None]) -> None:
        self._loader, self._on_data, self._on_batch = loader, on_data, on_batch

    def __iter__(self) -> Iterator[Any]:
        it = iter(self._loader)
        while True:
            self._on_data()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._on_batch()
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
