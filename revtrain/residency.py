"""Residency: where a layer's weights and optimizer state live between uses, as one object.

A trainer holds each layer's weights and optimizer state in one *tier* between the programs that use them:

* ``"device"``: device memory (the default; on a CPU that is host RAM);
* ``"host"``: host memory (``ReversibleTrainer.offload = True``; ZeRO-Offload, Ren et al. 2021, keeps the same
  state in CPU memory), a `revtrain.streaming.HostStore`'s (memory kind ``unpinned_host``, pageable, where the
  backend has it, else ``pinned_host``): the streaming engine moves each layer to the device ahead of its
  program and the update back behind it;
* ``"disk"``: files, one per layer (``ReversibleTrainer.offload = 'disk'``; `revtrain.disk_tier`, whose
  `DiskTier` is this object's ``store``): each layer is read ahead of its program into device memory and
  written back after its update by the same engine, so memory holds only the layers in flight;

and either replicated on every device (pmap semantics) or, with ``shard_state``, each large leaf split over the
``"data"`` devices (`placement.shard_spec`; ZeRO-3). The trainer, checkpoint restore templates, generation and
the memory plan ask this object instead of reading flags: what tier, which sharding a leaf has, how to place a
layer's numpy values, and the shape-only (abstract) form of a state to restore into.

It also places a state *one layer at a time* (`place_layers`): the initial values of a lazy model
(`revtrain.layers.Layer.lazy`) are made per layer, put where they live, and dropped, so a whole model never
exists twice in host memory (docs/memory.md). A run of stacked identical layers is filled into one host buffer
per leaf and placed leaf by leaf, each buffer released as soon as it is placed.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.placement import HOST_MEMORY, PAGEABLE_MEMORY, host_memory_supported, shard_spec
from revtrain.streaming import HostStore

TIERS = ("device", "host", "disk")


class Residency:
    """Where weights and optimizer state live between uses (see the module note).

    Args:
      mesh: the data mesh.
      tier: ``"device"``, ``"host"`` (host memory) or ``"disk"`` (layer files).
      sharded: split each large leaf over the ``"data"`` axis (``shard_state``) instead of replicating it.
      store: the disk tier's `revtrain.disk_tier.DiskTier` (the host tier makes its own
        `revtrain.streaming.HostStore`; the device tier has none).

    Raises:
      ValueError: an unknown tier, a disk tier without a store or another tier with one.
    """

    def __init__(self, mesh: Mesh, tier: str = "device", sharded: bool = False, store=None):
        if tier not in TIERS:
            raise ValueError(f"residency tier must be one of {', '.join(map(repr, TIERS))}, got {tier!r}")
        if (tier == "disk") != (store is not None):
            raise ValueError("the disk tier needs its store, the other tiers take none")
        self.mesh, self.tier, self.sharded = mesh, tier, sharded
        # The host store in pageable memory where every device has it: only the engine's copies touch it,
        # never a program.
        self._kind = None if tier != "host" else (
            PAGEABLE_MEMORY if host_memory_supported(mesh, PAGEABLE_MEMORY) else HOST_MEMORY)
        self.store = HostStore(self._kind) if tier == "host" else store

    @property
    def disk(self):
        """The disk tier's `revtrain.disk_tier.DiskTier` (None for the other tiers)."""
        return self.store if self.tier == "disk" else None

    @property
    def streamed(self) -> bool:
        """True when the streaming engine moves the state (`revtrain.streaming`): the host and disk tiers."""
        return self.store is not None

    @property
    def offloaded(self) -> bool:
        """True when the state lives outside device memory (the engine moves it in and out)."""
        return self.tier != "device"

    @property
    def memory_kind(self) -> str | None:
        """The JAX memory kind of the state (None: the device's default; the disk tier's programs compute on
        device arrays read from its files)."""
        return self._kind

    def specs(self, shapes, leading: int = 0):
        """A tree of ``PartitionSpec`` matching ``shapes`` (a tree of arrays or ``ShapeDtypeStruct``):
        `placement.shard_spec` of each leaf when sharded (``leading`` stacked axes never split), else ``P()``."""
        if not self.sharded:
            return jax.tree.map(lambda x: P(), shapes)
        n = self.mesh.size
        return jax.tree.map(lambda x: shard_spec(np.shape(x), n, leading=leading), shapes)

    def sharding(self, spec: P = P()) -> NamedSharding:
        """The sharding of a leaf with ``spec`` in this residency's memory kind."""
        return NamedSharding(self.mesh, spec, memory_kind=self.memory_kind)

    def place(self, value: np.ndarray, spec: P = P()) -> jax.Array:
        """One host numpy leaf (the same value on every process) placed with ``spec``: each process builds
        only its own devices' pieces."""
        value = np.asarray(value)
        sharding = self.sharding(spec)
        if sharding.is_fully_replicated:
            # Then copied into a buffer the runtime owns: XLA:CPU may alias the numpy memory, and such a buffer
            # cannot be donated, so the first step would allocate a second copy of it (measured on a Llama:
            # 1.2 GB more at 0.3 B parameters during step 1). The copy costs one leaf, once.
            return jax.device_put(jax.device_put(value, sharding), sharding, may_alias=False)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def place_tree(self, tree, specs=None):
        """`place` of every leaf of ``tree`` (``specs``: a matching tree of ``PartitionSpec``, default from
        `specs`). The leaves are released from ``tree``'s list as they are placed only by `place_layers`."""
        specs = self.specs(tree) if specs is None else specs
        return jax.tree.map(self.place, tree, specs)

    def abstract(self, shapes, specs=None):
        """``shapes`` as ``jax.ShapeDtypeStruct`` leaves with this residency's shardings: a restore template
        that allocates nothing."""
        specs = self.specs(shapes) if specs is None else specs
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=self.sharding(s)),
                            shapes, specs)

    def place_stacked(self, stack: "HostStack", specs) -> object:
        """Places a `HostStack` one leaf at a time, releasing each host buffer once it is placed, so at most
        the stack's numpy copy and one placed leaf exist beside what is already placed. ``specs``: a tree of
        ``PartitionSpec`` matching the stacked tree, or None (`specs`)."""
        tree = stack.tree()
        specs = self.specs(tree, leading=1) if specs is None else specs
        flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        if len(flat_specs) == 1 and len(stack.buffers) != 1:  # a prefix for the whole tree
            flat_specs = flat_specs * len(stack.buffers)
        placed = []
        for k in range(len(stack.buffers)):
            placed.append(self.place(stack.buffers[k], flat_specs[k]))
            stack.buffers[k] = None  # released: the placed leaf is the only copy
        return jax.tree.unflatten(stack.treedef, placed)

    def describe(self) -> str:
        """A few words for logs and the memory plan, e.g. ``"host memory, replicated"``."""
        where = {"device": "device memory", "host": f"host memory ({self.memory_kind})",
                 "disk": f"layer files in {getattr(self.disk, 'directory', None) or 'the offload directory'}"}[self.tier]
        return f"{where}, {'split over the devices' if self.sharded else 'replicated'}"


class HostStack:
    """Host buffers for ``count`` layers' trees of one structure, stacked on a new leading axis and filled one
    layer at a time (`put`), so the layers' own copies can be dropped as they come (see `Residency.place_stacked`)."""

    def __init__(self, count: int):
        self.count, self.buffers, self.treedef = count, None, None

    def put(self, j: int, tree) -> None:
        """Copies layer ``j``'s tree (numpy or jax leaves) into slice ``j``."""
        leaves, treedef = jax.tree.flatten(tree)
        if self.buffers is None:
            self.treedef = treedef
            self.buffers = [np.empty((self.count, *np.shape(x)), np.asarray(x).dtype) for x in leaves]
        elif treedef != self.treedef:
            raise ValueError(f"layer {j}'s tree differs from the first layer's: {treedef} vs {self.treedef}")
        for k, x in enumerate(leaves):
            self.buffers[k][j] = np.asarray(x)

    def tree(self):
        """The stacked tree (numpy leaves; None where a leaf was placed already)."""
        return jax.tree.unflatten(self.treedef, self.buffers)
