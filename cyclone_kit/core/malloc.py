"""glibc malloc settings for the training processes cyclone_kit starts (pure data and one helper).

Why: PyTorch's CPU tensors come straight from glibc malloc. With glibc's defaults every
activation and gradient buffer above the dynamic mmap threshold is a fresh ``mmap``, so each
step page-faults its working set in again: TinyCNN at batch 256 took ~19,000 minor faults a step
and 133-146 ms; with the settings below 0 faults and 93 ms (1.4x); at batch 1024, 238,000 faults
and 832 ms against 3,400 and 384 ms (2.2x; bench/RESULTS.md). It also made identical runs
agree to ~1% instead of +-10%. On GPU nodes the same holds for the CPU side (decoding and
collating batches in DataLoader workers).

* ``mmap_threshold`` at glibc's maximum (32 MiB) and a 4 GiB ``trim_threshold``: buffers up to
  32 MiB come from the heap and freed memory is kept for the next step instead of being
  returned to the kernel (the process's RSS stays at its peak, as with PyTorch's CUDA cache);
* ``hugetlb=1``: larger buffers, and the heap, are backed by transparent huge pages where the
  kernel offers them (``madvise`` mode), 512x fewer faults.

An exported ``GLIBC_TUNABLES`` is kept as it is; export it empty to keep glibc's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The value cyclone_kit gives GLIBC_TUNABLES when the environment has none.
GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296:glibc.malloc.hugetlb=1"


def malloc_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``{"GLIBC_TUNABLES": ...}`` to add to a training process's environment, or ``{}`` when
    ``environ`` already sets it (also to the empty string: the user's opt-out; pure)."""
    return {} if "GLIBC_TUNABLES" in environ else {"GLIBC_TUNABLES": GLIBC_TUNABLES}
