"""The memory meter: peak device bytes of a training step (DESIGN.md section 3).

Two methods, and every reading says which one it used:

* ``"memory_stats"`` (GPU/TPU): ``device.memory_stats()["peak_bytes_in_use"]`` of the first local device,
  the allocator's own high-water mark. XLA offers no way to reset it, so it is the peak since the process
  started; the benchmark runs one configuration per process.
* ``"estimate"`` (CPU, where host and device are the same RAM and there is no allocator to ask): the
  maximum over the step's compiled calls of

      bytes of live arrays in the ``device`` memory kind on the first local device, just before the call
    + that call's temporary bytes + its output bytes not aliased to donated inputs
      (``compiled.memory_analysis()``).

  Arrays in the ``pinned_host`` memory kind are not counted: on an accelerator they are in host RAM.
"""

from __future__ import annotations

import jax

HOST_KINDS = ("pinned_host", "unpinned_host")


def _device_bytes_on(device) -> int:
    total = 0
    for arr in jax.live_arrays():
        try:
            kind = arr.sharding.memory_kind
        except Exception:
            kind = None
        if kind in HOST_KINDS:
            continue
        for shard in arr.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes if hasattr(shard.data, "nbytes") else 0
    return total


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))),
                           str(getattr(getattr(x, "sharding", None), "memory_kind", None))) for x in leaves)


class MemoryMeter:
    """Measures the peak device bytes of the calls made between ``start()`` and ``stop()``.

    Args:
      device: the device to account for (default: the first local device).
      method: ``"memory_stats"``, ``"estimate"`` or ``None`` to pick by platform (CPU: estimate).

    Usage: the trainers call ``observe(jitted_fn, args)`` before each compiled call while ``active``.
    """

    def __init__(self, device=None, method: str | None = None):
        self.device = device or jax.local_devices()[0]
        if method is None:
            stats = None
            if self.device.platform != "cpu":
                try:
                    stats = self.device.memory_stats()
                except Exception:
                    stats = None
            method = "memory_stats" if stats and "peak_bytes_in_use" in stats else "estimate"
        if method not in ("memory_stats", "estimate"):
            raise ValueError(f"unknown memory meter method {method!r}")
        self.method = method
        self.active = False
        self.peak = 0
        self._temp_cache: dict = {}

    def start(self) -> None:
        """Starts a measurement (one step)."""
        self.active = True
        self.peak = 0

    def observe(self, fn, args) -> None:
        """Accounts for one compiled call of ``fn(*args)`` that is about to run (estimate method only)."""
        if not self.active or self.method != "estimate":
            return
        key = (id(fn), _signature(args))
        extra = self._temp_cache.get(key)
        if extra is None:
            try:
                analysis = fn.lower(*args).compile().memory_analysis()
                extra = int(analysis.temp_size_in_bytes) + max(
                    0, int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes))
            except Exception:  # a backend without memory analysis: count live arrays only
                extra = 0
            self._temp_cache[key] = extra
        self.peak = max(self.peak, _device_bytes_on(self.device) + extra)

    def stop(self) -> int:
        """Ends the measurement; returns the peak device bytes (int)."""
        self.active = False
        if self.method == "memory_stats":
            self.peak = int(self.device.memory_stats().get("peak_bytes_in_use", 0))
        else:
            self.peak = max(self.peak, _device_bytes_on(self.device))
        return self.peak
