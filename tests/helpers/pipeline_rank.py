"""A rank of the pipeline engine with made conditions (tests/integration/test_pipeline_paths.py).

``python tests/helpers/pipeline_rank.py --run-dir DIR`` is ``python -m cyclone_kit.runtime --run-dir DIR``
after the patches named in ``$CK_PIPELINE_PATCHES`` (comma-separated), each a condition a CPU cannot
make by itself; the product's code is untouched (the patches wrap names it looks up at call time):

* ``channels_last``: the pipeline engine runs channels_last on the CPU as it does on CUDA (the data
  loader sends NHWC batches, the stages hold NHWC weights);
* ``clock``: every read of the pipeline's stage clock appends, to ``DIR/clock-rank-N.jsonl``, how many
  computations (forward / backward chunks) and schedule steps it collected since the last read;
* ``slow_save``: the rank's first DCP write of its stages takes ``2 x bound + 1`` s more, the bound being the
  rank's own progress watchdog's (a slow shared file system slower than the stall bound, on any machine):
  a blocking ``torch.distributed.checkpoint.save`` sleeps that long first; an ``async_save``'s future
  completes that long after its write did (the rank waits for it at its next checkpoint or at the end);
  what it slept and the bound go to ``DIR/slow-save-rank-N.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

#: The environment variable naming the patches.
PATCHES_VAR = "CK_PIPELINE_PATCHES"


def _run_dir(argv: list[str]) -> Path:
    return Path(argv[argv.index("--run-dir") + 1])


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def force_channels_last() -> None:
    """channels_last in the pipeline engine on any device (its CPU default is off)."""
    from cyclone_kit.runtime.engine import pipeline

    build_data, build = pipeline.build_data, pipeline._build

    def build_data_nhwc(*args: Any, **kwargs: Any) -> Any:
        return build_data(*args, **{**kwargs, "channels_last": True})

    def build_nhwc(session: Any, lay: Any, tc: Any, info: Any, found: Any, dev: Any, dtype: Any,
                   channels_last: bool) -> Any:
        return build(session, lay, tc, info, found, dev, dtype, True)

    pipeline.build_data, pipeline._build = build_data_nhwc, build_nhwc


def count_clock(run_dir: Path) -> None:
    """Each read of the stage clock logs the computations and steps it collected."""
    from cyclone_kit.runtime.engine import pipeline

    out = run_dir / f"clock-rank-{_rank()}.jsonl"
    counts = {"computations": 0, "steps": 0}
    add, read = pipeline.Clock.add, pipeline.Clock.read

    def counted_add(self: Any, start: Any, end: Any, step: bool = False) -> None:
        counts["steps" if step else "computations"] += 1
        add(self, start, end, step)

    def counted_read(self: Any) -> tuple[float, float]:
        with out.open("a") as f:
            f.write(json.dumps(counts) + "\n")
        counts.update(computations=0, steps=0)
        return read(self)

    pipeline.Clock.add, pipeline.Clock.read = counted_add, counted_read


def slow_first_save(run_dir: Path) -> None:
    """The rank's first DCP write (blocking or in the background) takes its progress watchdog's bound twice."""
    import concurrent.futures
    import threading

    import torch.distributed.checkpoint as dcp

    from cyclone_kit.runtime import session as session_mod

    watches: list[Any] = []
    start_watch, save, async_save = session_mod.start_watch, dcp.save, dcp.async_save
    record = run_dir / f"slow-save-rank-{_rank()}.json"
    started: list[bool] = []  # the first write was started (the record is written when it has slept)

    def keep_watch(session: Any) -> Any:
        watch = start_watch(session)
        watches.append(watch)
        return watch

    def sleep_past_the_bound() -> None:
        bound = watches[0].bound() if watches and watches[0] else None
        sleep_s = 2 * (bound or 0.0) + 1.0
        time.sleep(sleep_s)
        record.write_text(json.dumps({"bound_s": bound, "slept_s": sleep_s}))

    def slow_save(*args: Any, **kwargs: Any) -> Any:
        if not started:
            started.append(True)
            sleep_past_the_bound()
        return save(*args, **kwargs)

    def slow_async_save(*args: Any, **kwargs: Any) -> Any:
        future = async_save(*args, **kwargs)
        if started:
            return future
        started.append(True)
        slow: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def finish() -> None:
            try:
                result = future.result()
            except BaseException as e:  # the write's own failure, passed on
                slow.set_exception(e)
                return
            sleep_past_the_bound()
            slow.set_result(result)

        threading.Thread(target=finish, name="slow-save", daemon=True).start()
        return slow

    session_mod.start_watch, dcp.save, dcp.async_save = keep_watch, slow_save, slow_async_save


def main(argv: list[str]) -> int:
    run_dir = _run_dir(argv)
    patches = [p for p in os.environ.get(PATCHES_VAR, "").split(",") if p]
    for name in patches:
        if name == "channels_last":
            force_channels_last()
        elif name == "clock":
            count_clock(run_dir)
        elif name == "slow_save":
            slow_first_save(run_dir)
        else:
            raise SystemExit(f"unknown patch {name!r} in ${PATCHES_VAR}")
    from cyclone_kit.runtime.__main__ import main as rank_main

    return rank_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
