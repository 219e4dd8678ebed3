"""Where arrays live: the data-parallel mesh, replicated and batch shardings, host/device memory kinds.

One 1-D mesh over all global devices with axis ``"data"`` (docs/design.md section 4). Layer weights and
optimizer state are replicated (``P()``); batches are split over the axis (``P("data")``). With offload,
weights and optimizer state live in the ``pinned_host`` memory kind between uses, with the same
replicated sharding. With ``ReversibleTrainer.shard_state`` every large leaf of a layer's weights and
optimizer state is instead split along one of its axes over ``"data"`` (`shard_spec`; ZeRO-3, Rajbhandari
et al. 2020, and ZeRO-Infinity, 2021, partition the same state over data-parallel ranks): each device holds
1/N of it, in the same memory kind. Inside ``shard_map`` over ``"data"`` the trainers' programs mark, gather
and reduce through `per_device`, `gather_params` and `reduce_grads`.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
HOST_MEMORY = "pinned_host"
PAGEABLE_MEMORY = "unpinned_host"  # ordinary (pageable) host memory: the streamed host store's
DEVICE_MEMORY = "device"


def make_mesh(devices=None) -> Mesh:
    """A 1-D mesh over ``devices`` (default: every global device), axis name ``"data"``."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """Sharding that copies an array onto every device of ``mesh`` (in ``memory_kind`` if given)."""
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding that splits the leading (batch) dimension over the ``"data"`` axis."""
    return NamedSharding(mesh, P(DATA_AXIS))


def host_memory_supported(mesh: Mesh, kind: str = HOST_MEMORY) -> bool:
    """True when every device of ``mesh`` exposes the memory space ``kind`` (default ``pinned_host``)."""
    try:
        return all(any(m.kind == kind for m in d.addressable_memories()) for d in mesh.devices.flat
                   if d.process_index == jax.process_index())
    except Exception:  # backends without memory spaces
        return False


def move_inside(tree, space):
    """Inside a compiled program: every leaf of ``tree`` moved to memory ``space``
    (``jax.memory.Space.Device`` or ``.Host``); a leaf already there is left as it is."""
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


# Leaves with fewer elements stay replicated when the state is sharded: a gather of a few KiB costs more
# than the bytes it saves (biases and norm scales; the matrices hold nearly all the bytes).
MIN_SHARD_ELEMENTS = 4096


def shard_axis(shape, num_devices: int, min_elements: int = MIN_SHARD_ELEMENTS) -> int | None:
    """The axis along which a leaf of ``shape`` is split over ``num_devices`` devices, or None (replicated).

    The largest axis whose size is a multiple of ``num_devices`` (the first of equal ones), for a leaf of at
    least ``min_elements`` elements; None when there is no such axis, the leaf is smaller, or there is one
    device. The rule depends on the shape alone, so a parameter and its optimizer moments (same shape) are
    split alike and an elementwise update runs on matching local pieces.
    """
    shape = tuple(shape)
    if num_devices <= 1 or int(np.prod(shape, dtype=np.int64)) < min_elements:
        return None
    candidates = [a for a, n in enumerate(shape) if n % num_devices == 0]
    if not candidates:
        return None
    return max(candidates, key=lambda a: (shape[a], -a))


def shard_spec(shape, num_devices: int, min_elements: int = MIN_SHARD_ELEMENTS, leading: int = 0) -> P:
    """The ``PartitionSpec`` of a leaf of ``shape`` split by `shard_axis` (``P()`` when replicated).

    ``leading``: number of leading axes (a stacked run's layer axis) left out of the choice and never split.
    """
    shape = tuple(shape)
    axis = shard_axis(shape[leading:], num_devices, min_elements)
    if axis is None:
        return P()
    parts = [None] * len(shape)
    parts[leading + axis] = DATA_AXIS
    return P(*parts)


def spec_axis(spec: P) -> int | None:
    """The axis a ``PartitionSpec`` of `shard_spec` splits over ``"data"``, or None."""
    for a, name in enumerate(tuple(spec)):
        if name == DATA_AXIS:
            return a
    return None


def per_device(tree):
    """Marks replicated values (layer params) as per-device inside ``shard_map`` over ``"data"``.

    Under ``shard_map``'s varying-axes typing, differentiating with respect to a replicated (invariant)
    input already sums its cotangent over devices (the transpose of the implicit broadcast is a ``psum``),
    so an explicit ``psum`` on top would multiply gradients by the device count. Differentiating with
    respect to ``per_device(params)`` instead returns each device's own gradient, which the trainers then
    sum explicitly: pmap's semantics, one all-reduce per layer.

    Leaves that already vary over ``"data"`` (weights gathered from shards by `gather_params`) are left
    as they are: their cotangent is each device's own already.
    """
    def mark(x):
        if DATA_AXIS in jax.typeof(x).mat.varying:
            return x
        return lax.pcast(x, DATA_AXIS, to="varying")

    return jax.tree.map(mark, tree)


def _split(spec) -> int | None:
    return None if spec is None else spec_axis(spec)


def gather_params(tree, specs=None):
    """Inside ``shard_map`` over ``"data"``: the whole of every leaf of ``tree`` that is held split
    (``specs``: a matching tree of ``PartitionSpec``, `placement.shard_spec`; None: nothing is split). Each
    split leaf is all-gathered (tiled) along its split axis; the result is the same on every device (pmap
    semantics during compute) and typed as varying over ``"data"``.
    """
    if specs is None:
        return tree
    def gather(x, spec):
        axis = _split(spec)
        return x if axis is None else lax.all_gather(x, DATA_AXIS, axis=axis, tiled=True)
    return jax.tree.map(gather, tree, specs)


def reduce_grads(grads, specs=None):
    """Inside ``shard_map``: each device's gradients summed over ``"data"``: ``lax.psum`` (every device gets
    the sum) for a replicated leaf, ``lax.psum_scatter`` (each device gets the sum of its own piece, along
    the split axis of ``specs``) for a split one, so the optimizer then updates only the local piece."""
    if specs is None:
        return lax.psum(grads, DATA_AXIS)
    def reduce(g, spec):
        axis = _split(spec)
        if axis is None:
            return lax.psum(g, DATA_AXIS)
        return lax.psum_scatter(g, DATA_AXIS, scatter_dimension=axis, tiled=True)
    return jax.tree.map(reduce, grads, specs)


def put_sharded(tree, mesh: Mesh, specs, memory_kind: str | None = None):
    """Places every leaf of ``tree`` (host numpy arrays, the same value on every process) with its
    ``PartitionSpec`` in ``specs`` (a matching tree); each process builds only its own devices' pieces."""
    def put(x, spec):
        value = np.asarray(x)
        sharding = NamedSharding(mesh, spec, memory_kind=memory_kind)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, tree, specs)


def put_replicated(tree, mesh: Mesh, memory_kind: str | None = None):
    """Places every leaf of ``tree`` (host numpy or jax arrays) replicated over ``mesh``."""
    sharding = replicated(mesh, memory_kind)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def batch_divisibility_error(batch_size: int, num_devices: int) -> str | None:
    """The message for a global batch that cannot be split evenly over the devices, or None."""
    if num_devices and batch_size % num_devices:
        return f"batch size {batch_size} is not divisible by the {num_devices} devices"
    return None


# -- bounded asynchronous dispatch on the XLA CPU backend ----------------------------------------------
#
# XLA's CPU client (jaxlib 0.10) runs a multi-device program by scheduling one "launch" per device on a
# thread pool of max(cores, devices) threads; each launch first takes a slot of its device's in-flight
# semaphore (32 computations) and the device's share then executes on the same pool, where the shares of
# a collective wait for each other. When a long stream of programs is dispatched asynchronously (the
# reversible trainer issues ~2 programs per layer per step), the queues fill up, launches of the newest
# program block on the semaphore while holding pool threads, and the older program's shares that would
# free those slots cannot get a thread to join their all-reduce: the process deadlocks ("This thread has
# been waiting for `all reduce RendezvousKey{...}` ... may be stuck"), then aborts. A backtrace shows it:
# pool threads in ``Semaphore::Acquire`` under ``ExecuteLaunch`` and in the rendezvous of ``AllReduce``.
#
# The cure is to never let a device's queue fill: on the CPU backend with several devices, wait for every
# ``CPU_DISPATCH_WINDOW``-th program to finish before dispatching more. The trainers' programs form one
# dependency chain (each consumes the previous one's outputs), so after the wait at most the window is in
# flight. GPUs and TPUs (and a single CPU device, which executes inline) never wait.
CPU_DISPATCH_WINDOW = 8


def needs_dispatch_limit(mesh: Mesh) -> bool:
    """True when ``mesh`` has several addressable devices on the XLA CPU backend (see above)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return len(local) > 1 and all(d.platform == "cpu" for d in local)


class DispatchLimiter:
    """Bounds the number of asynchronously dispatched multi-device programs on the CPU backend.

    Call it with the outputs of every program the trainer dispatches; it returns them unchanged and, on
    the CPU backend with several devices, blocks on every ``window``-th call until those outputs are
    ready. On other backends it never blocks.
    """

    def __init__(self, mesh: Mesh, window: int = CPU_DISPATCH_WINDOW):
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.enabled = needs_dispatch_limit(mesh)
        self.window = window
        self._count = 0

    def __call__(self, outputs):
        if self.enabled:
            self._count += 1
            if self._count % self.window == 0:
                jax.block_until_ready(outputs)
        return outputs


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
    """Turns this process's share of a batch into global arrays split over ``"data"``.

    Args:
      local_batch: dict of numpy arrays ``[B_local, ...]``; ``B_local`` = global batch / process count.
      mesh: the data mesh.

    Returns:
      dict of global ``jax.Array`` ``[B_local * process_count, ...]`` sharded with ``P("data")``.

    Raises:
      ValueError: the global batch size is not divisible by the number of devices.
    """
    sharding = batch_sharding(mesh)
    for v in local_batch.values():
        global_size = np.shape(v)[0] * jax.process_count()
        message = batch_divisibility_error(global_size, mesh.size)
        if message:
            raise ValueError(message)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def placer(mesh: Mesh, split: bool = False):
    """The function that places one host leaf (a numpy array read by a store, `revtrain.streaming`) over
    ``mesh`` in device memory: replicated, or with ``split`` (``shard_state``) split as the trainer's specs
    split a leaf of its shape (`shard_spec`: a function of the shape alone), so each device holds its piece
    of the layers in flight."""
    if not split or mesh.size == 1:
        sharding = replicated(mesh)
        return lambda x: jax.device_put(x, sharding)
    return lambda x: jax.device_put(x, NamedSharding(mesh, shard_spec(x.shape, mesh.size)))
