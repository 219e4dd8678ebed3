"""A bound on the host memory that the C allocator keeps after it is freed.

XLA's CPU client and numpy allocate their buffers with the C library's ``malloc``. glibc serves a request of at
least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` (returned to the kernel when freed) and smaller ones from
its heap arenas (kept by the process after ``free``). The threshold starts at 128 KiB but is *dynamic*: every
freed mmapped chunk raises it to that chunk's size, up to 32 MiB on 64-bit systems. A training process frees
many buffers of a few MiB (each layer's activations, gradients and optimizer update every step), so after the
first step most of its buffers come from arenas, and what is freed stays resident: on a 91 M-parameter Llama
(AdamW, float32) the process held 2.6 GiB through the first steps against 1.8 GiB with a fixed threshold, and
peaked at 4.9 / 6.2 GiB (train / resume) against 3.8 / 3.1 GiB (docs/memory.md).

`bound_retention` fixes the threshold (which also turns the dynamic adjustment off) and the trim threshold
through ``mallopt``, so buffers from ``MMAP_THRESHOLD`` up are always mapped and unmapped, and the heap's top is
returned to the kernel past ``TRIM_THRESHOLD``. The ``revtrain`` command calls it first thing. The environment
variables glibc reads itself (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) win when set. Other C
libraries (musl) have no ``mallopt``; then nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc's malloc.h)
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 20  # bytes: every buffer of 1 MiB or more is its own mapping
TRIM_THRESHOLD = 1 << 20  # bytes: free heap top beyond this goes back to the kernel


def bound_retention(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Fixes glibc's mmap and trim thresholds (see the module note), unless the environment sets them.

    Args:
      mmap_threshold: bytes; requests at least this large are served by ``mmap``.
      trim_threshold: bytes; free memory at the heap's top beyond this is returned to the kernel.

    Returns:
      True when both were set; False on a C library without ``mallopt`` or when the environment sets them.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


def release_free_memory() -> bool:
    """Returns the free memory of every glibc arena to the kernel (``malloc_trim(0)``): after a phase whose
    buffers were made and freed by other threads (a checkpoint's writer threads), whose arenas the trim
    threshold does not shrink. Returns whether anything was released (False without glibc)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))
