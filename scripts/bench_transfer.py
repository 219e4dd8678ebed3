"""Host <-> device bandwidth, in this process (for scripts/gpu_report.sh): one JSON line out.

Copies of one ``--mib`` MiB float32 array, each direction timed ``--repeats`` times (median; the first copy of
each kind, which may allocate or compile, is left out):

* ``h2d_pinned``: a ``pinned_host`` array to device memory, ``d2h_pinned``: device memory to ``pinned_host``
  (how the host tier moves a layer's state, ``jax.device_put`` between memory kinds), each alone;
* ``both_pinned``: one of each at once (both issued, then both waited on): on a GPU the two directions have
  copy engines of their own, so at once they should take about the longer one alone (``both_to_max`` near 1;
  ``both_to_sum`` near 1 means they ran one after the other);
* ``h2d_pageable``: a numpy array to device memory, ``d2h_pageable``: device memory to numpy
  (``jax.device_get``; the runtime stages pageable memory through pinned buffers of its own).

The record gives bytes per second for each (``*_bytes_per_sec``) and the bytes copied. gpu_report.sh divides
each offload step's bytes moved in each direction by that direction's (``h2d_pinned``, ``d2h_pinned``) and
takes the larger, the directions running at once.

  python scripts/bench_transfer.py [--mib 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import bench_common  # noqa: F401  (the repository on sys.path)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (which returns what to wait on) over ``repeats`` calls after one more."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(mib: int, repeats: int) -> dict:
    device = jax.devices()[0]
    nbytes = mib * 2**20
    host = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    on_device = SingleDeviceSharding(device)
    rec = {"bytes": nbytes, "repeats": repeats, "platform": device.platform, "device_kind": device.device_kind}
    try:
        pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
        x_pinned = jax.device_put(host, pinned)
        x_device = jax.device_put(host, on_device)
        seconds = {"h2d_pinned": timed(lambda: jax.device_put(x_pinned, on_device), repeats),
                   "d2h_pinned": timed(lambda: jax.device_put(x_device, pinned), repeats)}
        both = timed(lambda: (jax.device_put(x_pinned, on_device), jax.device_put(x_device, pinned)), repeats)
        rec["both_pinned_s"] = both
        rec["both_pinned_bytes_per_sec"] = 2 * nbytes / both
        rec["both_to_max"] = both / max(seconds.values())
        rec["both_to_sum"] = both / sum(seconds.values())
    except Exception as e:  # noqa: BLE001 (a backend without a pinned_host memory: the pageable figures only)
        seconds, rec["pinned_error"] = {}, f"{type(e).__name__}: {e}".splitlines()[0][:200]
        x_device = jax.device_put(host, on_device)
    seconds["h2d_pageable"] = timed(lambda: jax.device_put(host, on_device), repeats)
    # A device array keeps the numpy copy jax.device_get made of it: each timed copy reads a fresh array.
    fresh = iter([jax.device_put(host, on_device) for _ in range(repeats + 1)])
    seconds["d2h_pageable"] = timed(lambda: np.asarray(jax.device_get(next(fresh))), repeats)
    for name, s in seconds.items():
        rec[f"{name}_s"] = s
        rec[f"{name}_bytes_per_sec"] = nbytes / s
    rec["status"] = "ok"
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="MiB copied each time")
    p.add_argument("--repeats", type=int, default=5, help="timed copies of each kind")
    a = p.parse_args()
    print(json.dumps(run(a.mib, a.repeats)), flush=True)


if __name__ == "__main__":
    main()
