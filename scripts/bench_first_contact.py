"""The GPU runtime's facts the offload engine depends on, one point per process (scripts/gpu_report.sh, group
``first_contact``): one JSON line out.

* ``--point memories``: the device's ``addressable_memories()`` (JAX's memory kinds there: a GPU is expected to
  have ``device`` and ``pinned_host`` only), its default memory, ``memory_stats()`` (``bytes_limit``, under the
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` this process ran with, so the card's total is ``bytes_limit / fraction``),
  the JAX and jaxlib versions;
* ``--point overlap``: does a host-to-device copy (``pinned_host`` -> device, ``--mib`` MiB) overlap a long
  matmul? The matmul alone, the copy alone, then both, the copy issued before the matmul is dispatched and
  after it (XLA's GPU client makes a copy into a fresh device buffer wait for the programs queued before the
  allocation: docs/gpu.md); each the median of ``--repeats``;
* ``--point pinned_pool``: the resident memory (``VmRSS``) of XLA's pinned pool after placing ``--gib`` GiB of
  ``pinned_host`` arrays in ``--chunk_mib`` MiB pieces (a layer's leaves), against `revtrain.pinned`'s
  prediction (the grown pool's doubling regions, or the preallocated limit): run it with and without
  ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`` (the caller sets the variables: XLA reads them at start).

The bandwidths (each direction alone and both at once) are scripts/bench_transfer.py's.

  python scripts/bench_first_contact.py --point memories
  python scripts/bench_first_contact.py --point overlap [--mib 1024 --matmul 8192 --repeats 3]
  XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=21 \\
      python scripts/bench_first_contact.py --point pinned_pool --gib 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import bench_common  # noqa: F401  (the repository on sys.path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from revtrain import pinned  # noqa: E402


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes (0 where /proc is absent)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out["VmRSS"], out["VmHWM"]


def memories() -> dict:
    """The device's memory spaces and limits."""
    import jaxlib
    device = jax.devices()[0]
    rec = {"platform": device.platform, "device_kind": device.device_kind, "num_devices": jax.device_count(),
           "jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "memories": [m.kind for m in device.addressable_memories()],
           "default_memory": device.default_memory().kind,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_PYTHON_CLIENT", "XLA_PJRT_GPU"))}}
    stats = device.memory_stats() or {}
    rec["memory_stats"] = {k: int(v) for k, v in stats.items() if isinstance(v, (int, float))}
    if "bytes_limit" in stats:
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        rec["device_bytes_limit"] = int(stats["bytes_limit"])
        rec["device_total_bytes_estimate"] = int(stats["bytes_limit"] / fraction)
    rec["status"] = "ok"
    return rec


def _median(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which waits for its own work) over ``repeats`` calls after one more."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overlap(mib: int, n: int, loops: int, repeats: int) -> dict:
    """A host-to-device copy against a long matmul: alone, together in both orders."""
    device = jax.devices()[0]
    on_device = SingleDeviceSharding(device)
    host_kind = pinned.PINNED if any(m.kind == pinned.PINNED for m in device.addressable_memories()) else None
    source = jax.device_put(np.ones(mib * 2**20 // 4, np.float32), SingleDeviceSharding(device, memory_kind=host_kind))
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16) / n, on_device)

    @jax.jit
    def matmul(a):
        return jax.lax.fori_loop(0, loops, lambda i, x: (x @ a).astype(jnp.bfloat16), a)

    copy = lambda: jax.device_put(source, on_device)  # noqa: E731
    t_mm = _median(lambda: matmul(a).block_until_ready(), repeats)
    t_cp = _median(lambda: copy().block_until_ready(), repeats)

    def copy_first():
        y = copy()
        jax.block_until_ready((y, matmul(a)))

    def matmul_first():
        z = matmul(a)
        jax.block_until_ready((z, copy()))

    t_cf, t_mf = _median(copy_first, repeats), _median(matmul_first, repeats)
    longer = max(t_mm, t_cp)
    return {"status": "ok", "platform": device.platform, "copy_bytes": mib * 2**20, "copy_from": host_kind or "default",
            "matmul_n": n, "matmul_loops": loops, "matmul_s": t_mm, "copy_s": t_cp, "copy_first_s": t_cf,
            "matmul_first_s": t_mf, "copy_first_to_max": t_cf / longer, "matmul_first_to_max": t_mf / longer,
            "sum_to_max": (t_mm + t_cp) / longer, "copy_bytes_per_sec": mib * 2**20 / t_cp,
            "matmul_tflops": 2 * n**3 * loops / t_mm / 1e12}


def pinned_pool(gib: float, chunk_mib: int) -> dict:
    """RSS after placing ``gib`` GiB of pinned_host arrays, against the pool `revtrain.pinned` predicts."""
    device = jax.devices()[0]
    kinds = [m.kind for m in device.addressable_memories()]
    kind = pinned.PINNED if pinned.PINNED in kinds else None
    chunk = np.ones(chunk_mib * 2**20 // 4, np.float32)
    count = max(1, int(gib * 2**30) // chunk.nbytes)
    rss0, _ = _rss()
    t0 = time.perf_counter()
    held = [jax.device_put(chunk, SingleDeviceSharding(device, memory_kind=kind)) for _ in range(count)]
    jax.block_until_ready(held)
    seconds = time.perf_counter() - t0
    rss1, hwm = _rss()
    placed = count * chunk.nbytes
    limit_bytes, source = pinned.limit()
    predicted = (limit_bytes if pinned.preallocated() else pinned.grown_pool_bytes([chunk.nbytes] * count, limit_bytes))
    return {"status": "ok", "platform": device.platform, "memory_kind": kind or "default", "placed_bytes": placed,
            "chunk_bytes": chunk.nbytes, "preallocated": pinned.preallocated(), "pool_limit_bytes": limit_bytes,
            "pool_source": source, "rss_before_bytes": rss0, "rss_after_bytes": rss1, "rss_added_bytes": rss1 - rss0,
            "hwm_bytes": hwm, "predicted_pool_bytes": predicted if device.platform == "gpu" else placed,
            "rss_added_to_placed": (rss1 - rss0) / placed, "place_s": seconds,
            "place_bytes_per_sec": placed / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--point", required=True, choices=("memories", "overlap", "pinned_pool"))
    p.add_argument("--mib", type=int, default=1024, help="overlap: MiB copied")
    p.add_argument("--matmul", type=int, default=8192, help="overlap: the matmul's n (bfloat16 n x n)")
    p.add_argument("--loops", type=int, default=40, help="overlap: matmuls in the program")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gib", type=float, default=20.0, help="pinned_pool: GiB placed")
    p.add_argument("--chunk_mib", type=int, default=256, help="pinned_pool: MiB per array")
    a = p.parse_args()
    try:
        if a.point == "memories":
            rec = memories()
        elif a.point == "overlap":
            rec = overlap(a.mib, a.matmul, a.loops, a.repeats)
        else:
            rec = pinned_pool(a.gib, a.chunk_mib)
    except Exception as e:  # noqa: BLE001 (the record says what failed)
        rec = {"status": "error", "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    rec["point"] = a.point
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
