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

The live bytes are a running total, not a walk over every live array at each call (that walk made a
logged step cost O(layers^2): DESIGN.md section 8). ``start()`` walks the live arrays once; after that the
meter counts each array it is shown (the arguments of ``observe``, the outputs of ``record``) once, and
takes its bytes off the total when it is freed (a weak reference) or donated to a call (``record`` looks at
that call's arguments). Each call then costs O(its own arguments and outputs) whatever the number of live
arrays. Arrays made and freed between two calls without being shown are not seen, as in the walk (which
only looked just before each call).
"""

from __future__ import annotations

import math
import weakref

import jax

HOST_KINDS = ("pinned_host", "unpinned_host")


def _bytes_on(arr, device) -> int:
    """Bytes of ``arr`` held in device memory on ``device`` (0 for host memory kinds and other devices)."""
    try:
        sharding = arr.sharding
        if sharding.memory_kind in HOST_KINDS or device not in sharding.device_set:
            return 0
        return math.prod(sharding.shard_shape(arr.shape)) * arr.dtype.itemsize
    except Exception:  # an array without a usable sharding (deleted, or a backend that has none)
        return 0


def _signature(treedef, leaves) -> tuple:
    return treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x))) for x in leaves)


class MemoryMeter:
    """Measures the peak device bytes of the calls made between ``start()`` and ``stop()``.

    Args:
      device: the device to account for (default: the first local device).
      method: ``"memory_stats"``, ``"estimate"`` or ``None`` to pick by platform (CPU: estimate).

    Usage: the trainers call ``observe(jitted_fn, args)`` before each compiled call while ``active`` and
    ``record(outputs)`` after it. Both cost O(number of arguments / outputs).
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
        self._tracked: dict = {}  # id(array) -> (weak reference, bytes on the device)
        self._total = 0  # bytes on the device of the tracked arrays that are alive
        self._arguments = ()  # the leaves of the call being observed

    def _release(self, key: int, ref) -> None:
        entry = self._tracked.get(key)
        if entry is not None and entry[0] is ref:
            del self._tracked[key]
            self._total -= entry[1]

    def _track(self, arr) -> None:
        key = id(arr)
        entry = self._tracked.get(key)
        if entry is not None and entry[0]() is arr:
            return
        if arr.is_deleted():  # donated to an earlier call: its buffer is gone
            return
        nbytes = _bytes_on(arr, self.device)
        ref = weakref.ref(arr, lambda r, key=key: self._release(key, r))
        if entry is not None:  # a dead array's id reused before its callback ran
            self._total -= entry[1]
        self._tracked[key] = (ref, nbytes)
        self._total += nbytes

    def _forget(self, arr) -> None:
        entry = self._tracked.get(id(arr))
        if entry is not None and entry[0]() is arr:
            del self._tracked[id(arr)]
            self._total -= entry[1]

    def _track_all(self, leaves) -> None:
        for x in leaves:
            if isinstance(x, jax.Array):
                self._track(x)

    def start(self) -> None:
        """Starts a measurement (one step): counts the arrays alive now (one walk)."""
        self.active = True
        self.peak = 0
        self._tracked, self._total = {}, 0
        if self.method == "estimate":
            self._track_all(jax.live_arrays())
            self.peak = self._total

    def observe(self, fn, args) -> None:
        """Accounts for one compiled call of ``fn(*args)`` that is about to run (estimate method only)."""
        if not self.active or self.method != "estimate":
            return
        leaves, treedef = jax.tree.flatten(args)
        self._track_all(leaves)
        self._arguments = leaves
        key = (id(fn), _signature(treedef, leaves))
        extra = self._temp_cache.get(key)
        if extra is None:
            try:
                analysis = fn.lower(*args).compile().memory_analysis()
                extra = int(analysis.temp_size_in_bytes) + max(
                    0, int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes))
            except Exception:  # a backend without memory analysis: count live arrays only
                extra = 0
            self._temp_cache[key] = extra
        self.peak = max(self.peak, self._total + extra)

    def record(self, outputs) -> None:
        """Counts the outputs of the call just made (after ``observe`` of it), and no longer counts the
        arguments it consumed (donated buffers are freed even while Python still refers to them)."""
        if not self.active or self.method != "estimate":
            return
        for x in self._arguments:
            if isinstance(x, jax.Array) and x.is_deleted():
                self._forget(x)
        self._arguments = ()
        self._track_all(jax.tree.leaves(outputs))

    def stop(self) -> int:
        """Ends the measurement; returns the peak device bytes (int)."""
        self.active = False
        if self.method == "memory_stats":
            self.peak = int(self.device.memory_stats().get("peak_bytes_in_use", 0))
        else:
            self.peak = max(self.peak, self._total)
        self._tracked, self._total, self._arguments = {}, 0, ()
        return self.peak
