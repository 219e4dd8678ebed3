"""Pinned host memory: where the host tier's state lives when the backend has no pageable host memory, and what
XLA's pinned host pool on a GPU costs.

A GPU device has two memory spaces, ``device`` and ``pinned_host`` (XLA's GPU client allocates no other host
kind; JAX's ``tests/memories_test.py`` skips its ``unpinned_host`` cases on GPU). There the host tier
(``ReversibleTrainer.offload = True``, `revtrain.tiers.host.HostTier`) keeps its state in ``pinned_host``
arrays, which XLA allocates from one pool of its own: a BFC allocator ("xla_gpu_host_bfc", tsl's
``BFCAllocator`` over ``cudaHostAlloc``) of ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB (an integer; default 64,
or 16 when ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`` is true), read once when the GPU client is made
(openxla/xla ``GetGpuHostAllocator``). Grown on demand (the default), the pool adds regions of 2 MiB, 4 MiB,
8 MiB, ... (a region doubles after each one that was large enough; a larger request doubles it until it
fits: ``BFCAllocator::Extend``) and never returns one, so S bytes of state cost up to the next sum of doubling
regions (`grown_pool_bytes`), nearly 2 S. Preallocated, the pool is the limit, allocated whole at its first use.

What revtrain does (docs/gpu.md, "Pinned host memory"): ``revtrain train`` computes the state's bytes from
shapes before the backend starts (`need_from_shapes`: the model built under ``jax.eval_shape``, which starts no
backend) and, unless the user set them, sets both variables so that the pool is preallocated at that size plus
`STAGING_BYTES` (`train_environment`); the memory plan counts the pool as the backend makes it
(`pool_bytes`) in a ``pinned`` tier against its limit, and the host tier logs one line naming the memory its
state lives in (`describe`). None of this has been measured on a GPU yet (the report's first-contact group
measures the pool's resident memory with and without preallocation: docs/gpu.md).

A test switch makes the pageable kind unavailable where it exists (the CPU): `NO_PAGEABLE_ENV` = 1, or
``HostResidency(..., pageable=False)``; the host tier then uses ``pinned_host`` there too, as on a GPU.
"""

from __future__ import annotations

import math
import os

PINNED = "pinned_host"
PAGEABLE = "unpinned_host"

# The test switch: with it set to 1, the host tier and the memory plan act as if the backend had no pageable
# host memory (the CPU backend then keeps the state in pinned_host, ordinary memory there).
NO_PAGEABLE_ENV = "REVTRAIN_NO_PAGEABLE_HOST"

PREALLOCATE_ENV = "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"
LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_LIMIT_GB = 64  # XLA's pool limit when it grows
PREALLOCATED_DEFAULT_GB = 16  # ... and when it is preallocated without a limit given
FIRST_REGION_BYTES = 2 * 2**20  # the BFC allocator's first region with allow_growth (min(limit, 2 MiB))
MIN_ALLOCATION_BYTES = 256  # the BFC allocator rounds each request up to a multiple of this

# What the pool holds beside the state: the runtime stages host -> device copies of numpy arrays (batches,
# restored leaves) through the same pool. Not measured: a margin of one GiB (docs/gpu.md).
STAGING_BYTES = 2**30

# What `train_environment` did in this process (None: nothing): {"need": bytes, "set": {var: value}}.
TRAIN_SETTING: dict | None = None


def pageable_switched_off(environ=None) -> bool:
    """True when the test switch `NO_PAGEABLE_ENV` is ``1`` (the pageable host kind treated as absent)."""
    return (os.environ if environ is None else environ).get(NO_PAGEABLE_ENV, "") == "1"


def state_kind(platform: str, pageable_available: bool | None = None, pageable: bool | None = None) -> str:
    """The memory kind of the host tier's state: ``unpinned_host`` where the backend has it and it is not
    switched off, else ``pinned_host``.

    Args:
      platform: the backend (``"cpu"``, ``"gpu"``, ``"tpu"``); used when ``pageable_available`` is None: a GPU
        has no pageable kind, the others are taken to have it.
      pageable_available: whether every device has ``unpinned_host`` (`placement.host_memory_supported`).
      pageable: False forces pinned memory (the constructor switch); None reads `NO_PAGEABLE_ENV`.
    """
    if pageable is None:
        pageable = not pageable_switched_off()
    if pageable_available is None:
        pageable_available = platform != "gpu"
    return PAGEABLE if pageable and pageable_available else PINNED


def _env_bool(raw: str | None, default: bool) -> bool:
    # tsl::ReadBoolFromEnvVar: "true"/"1" and "false"/"0", any case; anything else is an error and the default.
    value = (raw or "").strip().lower()
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    return default


def preallocated(environ=None) -> bool:
    """Whether XLA preallocates its pinned pool (`PREALLOCATE_ENV`, read as XLA reads it)."""
    return _env_bool((os.environ if environ is None else environ).get(PREALLOCATE_ENV), False)


def limit(environ=None) -> tuple[int, str]:
    """The pool's limit in bytes and where it came from, as XLA reads it: `LIMIT_ENV` GiB (an integer: XLA's
    ``ReadInt64FromEnvVar`` rejects anything else and falls back to its default), default 64, or 16 when
    preallocated."""
    environ = os.environ if environ is None else environ
    pre = preallocated(environ)
    default = PREALLOCATED_DEFAULT_GB if pre else DEFAULT_LIMIT_GB
    raw = environ.get(LIMIT_ENV)
    how = "preallocated" if pre else "grown on demand"
    if raw is not None and raw.strip().lstrip("-").isdigit():
        return int(raw) * 2**30, f"{LIMIT_ENV}={int(raw)}, {how}"
    note = f" ({LIMIT_ENV}={raw!r} is not an integer: XLA ignores it)" if raw is not None else ""
    return default * 2**30, f"XLA's pinned pool default, {default} GiB, {how}{note}"


def grown_pool_bytes(allocations, limit_bytes: int = DEFAULT_LIMIT_GB * 2**30) -> int:
    """The pool's size after a grown BFC pool served ``allocations`` (bytes, in order, none freed), as
    ``BFCAllocator::Extend`` grows it: each request rounded up to 256 bytes goes into a region's free tail if one
    is large enough (best fit), else a new region is added of ``r`` bytes (``r`` starts at 2 MiB; doubled until
    the request fits, and doubled after a region that needed no doubling), at most what the limit leaves.

    An int ``allocations`` is taken as that many bytes in requests no larger than the region being filled
    (many small leaves): then the pool is the least sum 2 MiB + 4 MiB + ... + 2^k MiB that holds them.

    Returns the pool's bytes; ``limit_bytes + 1`` when the requests do not fit under the limit (XLA then fails
    the allocation).
    """
    if isinstance(allocations, int):
        if allocations <= 0:
            return 0
        total, region = 0, FIRST_REGION_BYTES
        while total < allocations:
            if total >= limit_bytes:
                return limit_bytes + 1
            total += min(region, limit_bytes - total)
            region *= 2
        return total
    region, total, free = FIRST_REGION_BYTES, 0, []  # free: each region's free tail
    for size in allocations:
        size = -(-int(size) // MIN_ALLOCATION_BYTES) * MIN_ALLOCATION_BYTES
        fits = [i for i, f in enumerate(free) if f >= size]
        if fits:
            i = min(fits, key=lambda i: free[i])
            free[i] -= size
            continue
        if size > limit_bytes - total:
            return limit_bytes + 1
        doubled = False
        while size > region:
            region, doubled = region * 2, True
        got = min(region, (limit_bytes - total) // MIN_ALLOCATION_BYTES * MIN_ALLOCATION_BYTES)
        total += got
        free.append(got - size)
        if not doubled:
            region *= 2
    return total


def pool_bytes(need: int, environ=None) -> int:
    """What XLA's pinned pool costs for ``need`` bytes of pinned arrays: the limit when preallocated (allocated
    whole at its first use), else the grown pool (`grown_pool_bytes`, many small requests)."""
    limit_bytes, _ = limit(environ)
    if preallocated(environ):
        return limit_bytes
    return grown_pool_bytes(int(need), limit_bytes)


def limit_gb_for(need: int) -> int:
    """The integer GiB `LIMIT_ENV` that holds ``need`` bytes and `STAGING_BYTES` beside them."""
    return max(1, math.ceil((need + STAGING_BYTES) / 2**30))


def train_environment(need: int, environ=None) -> tuple[dict, str | None]:
    """Sets the pinned pool's variables in ``environ`` (default ``os.environ``) for a state of ``need`` bytes
    in pinned memory, before the backend starts: `PREALLOCATE_ENV` = ``true`` and `LIMIT_ENV` = `limit_gb_for`,
    each only where the user has not set it.

    Returns ``(what was set, refusal)``: the refusal is one line when the user's own limit is below the need
    (the run would fail at an allocation, after minutes of start-up), else None.
    """
    global TRAIN_SETTING
    environ = os.environ if environ is None else environ
    own_limit = LIMIT_ENV in environ
    values = {PREALLOCATE_ENV: "true", LIMIT_ENV: str(limit_gb_for(need))}
    chosen = {k: v for k, v in values.items() if k not in environ}
    environ.update(chosen)
    TRAIN_SETTING = {"need": int(need), "set": chosen}
    cap, source = limit(environ)
    if own_limit and need > cap:
        return chosen, (f"the host tier's state needs {need / 2**30:.2f} GiB of pinned host memory, over XLA's "
                        f"pinned pool of {cap / 2**30:.0f} GiB ({source}); raise {LIMIT_ENV} to at least "
                        f"{limit_gb_for(need)}" + "".join(f", or use ReversibleTrainer.offload = {v!r}"
                                                          for v in _outside_memory()))
    return chosen, None


def _outside_memory() -> list:
    """The ``ReversibleTrainer.offload`` values of the registered tiers whose state waits in a store of their
    own, not in memory (`revtrain.tiers.base.Tier.state_memory` None): what a refusal of the pool suggests."""
    from revtrain import tiers
    return [cls.gin_value for cls in map(tiers.lookup, tiers.names())
            if cls.state_memory is None and cls.gin_value is not None]


def describe(kind: str, platform: str, switched: bool = False, environ=None) -> str:
    """The host tier's one log line: the memory its state lives in, and on a GPU the pool's size."""
    if kind == PAGEABLE:
        return "host tier: the state lives in unpinned_host memory (pageable)"
    why = (f"the pageable kind is switched off ({NO_PAGEABLE_ENV}=1 or pageable=False)" if switched
           else f"the {platform} backend has no pageable host memory")
    if platform != "gpu":
        return f"host tier: the state lives in pinned_host memory ({why}; on the {platform} it is ordinary host memory)"
    cap, source = limit(environ)
    setting = TRAIN_SETTING
    by = ""
    if setting and setting["set"]:
        by = f"; set by revtrain train for {setting['need'] / 2**30:.2f} GiB of state: " + ", ".join(
            f"{k}={v}" for k, v in setting["set"].items())
    return (f"host tier: the state lives in pinned_host memory ({why}), XLA's pinned pool of {cap / 2**30:.0f} GiB "
            f"({source}{by})")
