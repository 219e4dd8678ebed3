"""The memory meter: peak device bytes of a training step (docs/design.md section 3).

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
logged step cost O(layers^2): docs/design.md section 8). ``start()`` walks the live arrays once; after that the
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


def _shard_bytes(arr) -> int:
    """Bytes of one device's shard of ``arr``, whatever its memory kind."""
    return math.prod(arr.sharding.shard_shape(arr.shape)) * arr.dtype.itemsize


def _bytes_on(arr, device, cache: dict | None = None) -> int:
    """Bytes of ``arr`` held in device memory on ``device`` (0 for host memory kinds and other devices).
    ``cache``: a dict remembering the answer per (sharding, shape, dtype)."""
    try:
        sharding = arr.sharding
        key = (sharding, arr.shape, arr.dtype)
        if cache is not None and key in cache:
            return cache[key]
        if sharding.memory_kind in HOST_KINDS or device not in sharding.device_set:
            nbytes = 0
        else:
            nbytes = _shard_bytes(arr)
    except Exception:  # an array without a usable sharding (deleted, or a backend that has none)
        return 0
    if cache is not None:
        cache[key] = nbytes
    return nbytes


def _distinct_buffers(arrays, device) -> list:
    """``arrays`` less those whose buffer on ``device`` an earlier one already holds. JAX keeps the
    single-device array that ``addressable_data`` returns cached on its parent, both alive and both sharing
    one buffer (Orbax reads every array it saves that way): counted once, not twice, as the parent when
    ``arrays`` are oldest first (the calls then count the same parent by identity)."""
    seen, out = set(), []
    for x in arrays:
        try:
            if x.is_deleted() or device not in x.sharding.device_set:
                continue
            if len(x.sharding.device_set) == 1:
                pointer = x.unsafe_buffer_pointer()
            else:
                pointer = next(s.data.unsafe_buffer_pointer() for s in x.addressable_shards if s.device == device)
        except Exception:  # no buffer pointer on this backend or memory kind: counted as before
            out.append(x)
            continue
        if pointer not in seen:
            seen.add(pointer)
            out.append(x)
    return out


class _Counted(weakref.ref):
    """A weak reference to a counted array, with the array's id (``key``) and bytes on the device."""

    __slots__ = ("key", "nbytes")


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
        self._sizes: dict = {}  # (sharding, shape, dtype) -> bytes on the device
        self._outputs: dict = {}  # call signature -> (donated argument positions, bytes of each output)
        self._callback = self._released  # one bound method for every weak reference (no closure per array)
        self._reset()

    # The running total: _live maps id(array) -> a weak reference to it that also holds its id and its
    # bytes (`_Counted`), for every counted array that is alive. The loops below are written out (no helper
    # call per array): they run for every argument and output of every call of a logged step.
    def _reset(self) -> None:
        self._live, self._total, self._call = {}, 0, None

    def _released(self, ref) -> None:
        """Weak-reference callback: a counted array was freed."""
        if self._live.get(ref.key) is ref:
            del self._live[ref.key]
            self._total -= ref.nbytes

    def _count(self, arrays, sizes=None) -> None:
        """Counts each array of ``arrays`` not counted yet (``sizes``: their bytes on the device, if known)."""
        live, callback, total = self._live, self._callback, 0
        for k, x in enumerate(arrays):
            key = id(x)
            ref = live.get(key)
            if ref is not None and ref() is x:
                continue
            if sizes is None:
                if not isinstance(x, jax.Array) or x.is_deleted():  # deleted: donated to an earlier call
                    continue
                nbytes = _bytes_on(x, self.device, self._sizes)
            else:
                nbytes = sizes[k]
            if nbytes:  # arrays in host memory are never counted
                if ref is not None:  # a dead array's id, reused before its callback ran
                    total -= ref.nbytes
                ref = _Counted(x, callback)
                ref.key, ref.nbytes = key, nbytes
                live[key] = ref
                total += nbytes
        self._total += total

    def _uncount(self, arrays) -> None:
        live, total = self._live, 0
        for x in arrays:
            ref = live.get(id(x))
            if ref is not None and ref() is x:
                del live[id(x)]
                total += ref.nbytes
        self._total -= total

    def start(self) -> None:
        """Starts a measurement (one step): counts the arrays alive now (one walk)."""
        self.active = True
        self.peak = 0
        self._reset()
        if self.method == "estimate":
            self._count(_distinct_buffers(jax.live_arrays()[::-1], self.device))  # (oldest first: see there)
            self.peak = self._total

    def observe(self, fn, args) -> None:
        """Accounts for one compiled call of ``fn(*args)`` that is about to run (estimate method only)."""
        if not self.active or self.method != "estimate":
            return
        leaves, treedef = jax.tree.flatten(args)
        self._count(leaves)
        key = (id(fn), treedef, tuple(getattr(x, "shape", None) for x in leaves))
        self._call = (key, leaves)
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
        if not self.active or self.method != "estimate" or self._call is None:
            return
        (key, arguments), self._call = self._call, None
        out = jax.tree.leaves(outputs)
        known = self._outputs.get(key)  # the same program: the same donations and output placements
        if known is None:
            donated = [i for i, x in enumerate(arguments) if isinstance(x, jax.Array) and x.is_deleted()]
            sizes = [_bytes_on(x, self.device, self._sizes) if isinstance(x, jax.Array) else 0 for x in out]
            known = self._outputs[key] = (donated, sizes)
        self._uncount([arguments[i] for i in known[0]])
        self._count(out, known[1])

    def stop(self) -> int:
        """Ends the measurement; returns the peak device bytes (int)."""
        self.active = False
        if self.method == "memory_stats":
            self.peak = int(self.device.memory_stats().get("peak_bytes_in_use", 0))
        else:
            self.peak = max(self.peak, self._total)
        self._reset()
        return self.peak


def host_state_bytes(ts, device=None) -> int:
    """Bytes of weights and optimizer state that one device holds in host memory (``pinned_host``).

    Args:
      ts: a `TrainState` (either layout; nothing is copied).
      device: the device to account for (default: the first local device).

    Returns:
      The sum over the leaves in a host memory kind of that device's piece of each (the whole leaf when
      replicated, 1/N of it when split over N devices: ``ReversibleTrainer.shard_state``); 0 without
      offload (the state is then in device memory, counted by the meter).
    """
    device = device or jax.local_devices()[0]
    params, opt_state, _ = ts.held()
    total = 0
    for x in jax.tree.leaves((params, opt_state)):
        if isinstance(x, jax.Array) and not x.is_deleted() and x.sharding.memory_kind in HOST_KINDS \
                and device in x.sharding.device_set:
            total += _shard_bytes(x)
    return total


def device_state_bytes(ts, device=None) -> int:
    """Bytes of weights, optimizer state and layer state that one device holds in device memory (the
    complement of `host_state_bytes`, layer state included).

    Args:
      ts: a `TrainState` (either layout; nothing is copied).
      device: the device to account for (default: the first local device).

    Returns:
      The sum over the leaves in device memory of that device's piece of each; 0 for a state held wholly in
      host memory or on disk.
    """
    device = device or jax.local_devices()[0]
    return sum(_bytes_on(x, device) for x in jax.tree.leaves(ts.held())
               if isinstance(x, jax.Array) and not x.is_deleted())


def host_resident(status: str = "/proc/self/status") -> tuple[int, int]:
    """This process's host memory: ``(resident bytes now, peak resident bytes)`` (``VmRSS`` and ``VmHWM``
    of /proc/self/status, the kernel's own counts; what a memory cgroup or the OOM killer sees). ``(0, 0)``
    where the file is missing (not Linux)."""
    values = {}
    try:
        with open(status) as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    values[name] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    return values.get("VmRSS", 0), values.get("VmHWM", 0)
