"""Where arrays live: the data-parallel mesh, replicated and batch shardings, host/device memory kinds.

One 1-D mesh over all global devices with axis ``"data"`` (DESIGN.md section 4). Layer weights and
optimizer state are replicated (``P()``); batches are split over the axis (``P("data")``). With offload,
weights and optimizer state live in the ``pinned_host`` memory kind between uses, with the same
replicated sharding.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
HOST_MEMORY = "pinned_host"
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


def host_memory_supported(mesh: Mesh) -> bool:
    """True when every device of ``mesh`` exposes a ``pinned_host`` memory space."""
    try:
        return all(any(m.kind == HOST_MEMORY for m in d.addressable_memories()) for d in mesh.devices.flat
                   if d.process_index == jax.process_index())
    except Exception:  # backends without memory spaces
        return False


def put_replicated(tree, mesh: Mesh, memory_kind: str | None = None):
    """Places every leaf of ``tree`` (host numpy or jax arrays) replicated over ``mesh``."""
    sharding = replicated(mesh, memory_kind)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def global_batch(local_batch: dict, mesh: Mesh) -> dict:
    """Turns this process's share of a batch into global arrays split over ``"data"``.

    Args:
      local_batch: dict of numpy arrays ``[B_local, ...]``; ``B_local`` = global batch / process count.
      mesh: the data mesh.

    Returns:
      dict of global ``jax.Array`` ``[B_local * process_count, ...]`` sharded with ``P("data")``.
    """
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
