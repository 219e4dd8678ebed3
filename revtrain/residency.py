"""Residency: where a layer's weights and optimizer state live between uses, one class per tier.

A trainer holds each layer's weights and optimizer state in one *tier* between the programs that use them:

* `Residency` (``"device"``): device memory (the default; on a CPU that is host RAM);
* `HostResidency` (``"host"``): host memory (``ReversibleTrainer.offload = True``; ZeRO-Offload, Ren et al.
  2021, keeps the same state in CPU memory), a `revtrain.streaming.HostStore`'s (memory kind
  ``unpinned_host``, pageable, where the backend has it, else ``pinned_host``: a GPU's only host kind, in XLA's
  pinned pool, `revtrain.pinned`);
* `DiskResidency` (``"disk"``): files, one per layer (``ReversibleTrainer.offload = 'disk'``;
  `revtrain.disk_tier`, whose `DiskTier` is its ``store``).

Both offloaded tiers are streamed: the engine (`revtrain.streaming`) moves each layer to the device ahead of
its program and the update back behind it, so the programs always compute on device arrays. Each tier is
replicated on every device (pmap semantics) or, with ``shard_state``, has each large leaf split over the
``"data"`` devices (`placement.shard_spec`; ZeRO-3).

The trainer, checkpoint restore templates, generation and the memory plan ask this object instead of
reading flags: where a new layer goes (`put_layer`) and its shape-only restore template (`layer_template`),
how a layer's weights come to the device whole (`fetch`), where a kept activation waits for the backward
(`keep`, `bring`), whether a step lets go of each layer's old state as it writes the new one (`releases`)
and how a plan names it (`label`, `describe`).

A state is placed *one layer at a time*: the initial values of a lazy model (`revtrain.layers.Layer.lazy`)
are made per layer, put where they live, and dropped, so a whole model never exists twice in host memory
(docs/memory.md). A run of stacked identical layers (the device tier's scanned executor) is filled into one
host buffer per leaf and placed leaf by leaf, each buffer released as soon as it is placed.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain import metrics as metrics_lib
from revtrain import pinned
from revtrain.disk_tier import DiskLayer, DiskTier, read_tree
from revtrain.placement import (DEVICE_MEMORY, HOST_MEMORY, PAGEABLE_MEMORY, host_memory_supported, placer,
                                replicated, shard_spec)
from revtrain.streaming import HostStore

TIERS = ("device", "host", "disk")


class Residency:
    """The device tier, and the interface every tier has (see the module note).

    Args:
      mesh: the data mesh.
      sharded: split each large leaf over the ``"data"`` axis (``shard_state``) instead of replicating it.
    """

    tier = "device"
    label = ""  # what a trainer's label adds for this tier
    releases = False  # a step lets go of each layer's old state once its new one is written

    def __init__(self, mesh: Mesh, sharded: bool = False):
        self.mesh, self.sharded = mesh, sharded
        self.store = None  # the streaming engine's store (`revtrain.streaming.Store`) of an offloaded tier
        self._kind = None

    @property
    def disk(self):
        """The disk tier's `revtrain.disk_tier.DiskTier` (None for the other tiers)."""
        return None

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

    def refusal(self) -> str | None:
        """Why this tier cannot run here, in one line, or None."""
        return None

    # -- a layer's state --
    def put_layer(self, index: int, params, opt_state, pspec=None, ospec=None) -> tuple:
        """Layer ``index``'s initial ``params`` and ``opt_state`` (numpy trees) placed where they live, with
        specs ``pspec`` / ``ospec`` (trees of ``PartitionSpec``, default `specs`): ``(params, opt_state)`` as
        a state holds them."""
        opt_state = self.place_tree(opt_state, ospec)
        return self.place_tree(params, pspec), opt_state

    def end_init(self) -> None:
        """Every layer is placed (`put_layer`)."""

    def layer_template(self, index: int, shapes, opt_shapes, pspec=None, ospec=None) -> tuple:
        """Layer ``index``'s ``(params, opt_state)`` restore template from their shapes (`abstract`)."""
        return self.abstract(shapes, pspec), self.abstract(opt_shapes, ospec)

    def fetch(self, tree):
        """One layer's params (as a state holds them) on the device, whole: gathered from the devices' pieces
        when sharded."""
        if not self.sharded:
            return tree
        return jax.device_put(tree, replicated(self.mesh, DEVICE_MEMORY))

    def keep(self, x):
        """An activation kept for the backward (a standard layer's input), where it waits."""
        return x

    def bring(self, x):
        """A kept activation back on the device (`keep`'s inverse)."""
        return x

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
        `specs`)."""
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
        """A few words for logs and the memory plan, e.g. ``"host memory (unpinned_host), replicated"``."""
        return f"{self._where()}, {'split over the devices' if self.sharded else 'replicated'}"

    def _where(self) -> str:
        return "device memory"


class HostResidency(Residency):
    """The host tier (``offload = True``): the state in host memory, pageable where every device has that
    space (else pinned: a GPU's only host kind, `revtrain.pinned`), in a `revtrain.streaming.HostStore` that
    the engine streams; kept activations in host memory. It logs one line naming the memory the state lives in
    (`memory_line`; on a GPU with the pinned pool's size) when it first places or restores a state.

    Args:
      mesh, sharded: see `Residency`.
      pageable: False makes the pageable kind unavailable (the test switch; None: `pinned.NO_PAGEABLE_ENV`).
    """

    tier = "host"
    label = " + offload"
    releases = True

    def __init__(self, mesh: Mesh, sharded: bool = False, pageable: bool | None = None):
        super().__init__(mesh, sharded)
        # Pageable where every device has it: only the engine's copies touch it, never a program. A GPU has
        # none: the state is pinned there, in XLA's pinned pool (`revtrain.pinned`). ``pageable=False`` (or
        # REVTRAIN_NO_PAGEABLE_HOST=1) makes the pageable kind unavailable, as on a GPU: the test switch.
        switched = pageable is False or (pageable is None and pinned.pageable_switched_off())
        self._kind = pinned.state_kind(self._platform(), host_memory_supported(mesh, PAGEABLE_MEMORY),
                                       pageable=not switched)
        self.store = HostStore(self._kind, DEVICE_MEMORY)
        self.memory_line = pinned.describe(self._kind, self._platform(), switched=switched)
        self._said = False

    def _platform(self) -> str:
        return next(iter(self.mesh.devices.flat)).platform

    def _say(self) -> None:
        # Once, when the state is first placed or restored (after the memory plan's check: a refusal stays the
        # only line).
        if not self._said:
            self._said = True
            metrics_lib.log(self.memory_line)

    def put_layer(self, index: int, params, opt_state, pspec=None, ospec=None) -> tuple:
        self._say()
        return super().put_layer(index, params, opt_state, pspec, ospec)

    def place_stacked(self, stack: "HostStack", specs) -> object:
        self._say()
        return super().place_stacked(stack, specs)

    def layer_template(self, index: int, shapes, opt_shapes, pspec=None, ospec=None) -> tuple:
        self._say()
        return super().layer_template(index, shapes, opt_shapes, pspec, ospec)

    def refusal(self) -> str | None:
        if not host_memory_supported(self.mesh):
            return "offload needs a backend with a pinned_host memory space"
        return None

    def fetch(self, tree):
        return jax.device_put(tree, replicated(self.mesh, DEVICE_MEMORY))

    def keep(self, x):
        return jax.device_put(x, jax.tree.map(lambda a: a.sharding.with_memory_kind(HOST_MEMORY), x))

    def bring(self, x):
        return jax.device_put(x, jax.tree.map(lambda a: a.sharding.with_memory_kind(DEVICE_MEMORY), x))

    def _where(self) -> str:
        return f"host memory ({self._kind})"


class DiskResidency(Residency):
    """The disk tier (``offload = 'disk'``): one file per layer (`revtrain.disk_tier`), its `DiskTier` the
    store the engine streams. A state's params and optimizer state are the same `DiskLayer` per layer.

    Args:
      mesh, sharded: see `Residency`.
      store: the `DiskTier` (its directory: ``ReversibleTrainer.offload_dir``).
    """

    tier = "disk"
    label = " + offload='disk'"

    def __init__(self, mesh: Mesh, sharded: bool = False, store: DiskTier | None = None):
        super().__init__(mesh, sharded)
        self.store = store if store is not None else DiskTier()

    @property
    def disk(self) -> DiskTier:
        return self.store

    def refusal(self) -> str | None:
        if jax.process_count() > 1:
            return "ReversibleTrainer.offload = 'disk' runs in one process only (yet)"
        return None

    def put_layer(self, index: int, params, opt_state, pspec=None, ospec=None) -> tuple:
        """Writes layer ``index``'s initial state as step 0's file (synchronously): its `DiskLayer`, twice."""
        params, opt_state = jax.tree.map(np.asarray, (params, opt_state))
        layout = self.store.layout(("layer", index), params, opt_state)
        ref = self.store.write_initial(0, index, layout, params, opt_state)
        return ref, ref

    def end_init(self) -> None:
        self.store.seal(0)

    def layer_template(self, index: int, shapes, opt_shapes, pspec=None, ospec=None) -> tuple:
        """A `DiskLayer` with no file: what `revtrain.checkpoint` restores a disk state into."""
        ref = DiskLayer(self.store.layout(("layer", index), shapes, opt_shapes))
        return ref, ref

    def fetch(self, tree):
        if isinstance(tree, DiskLayer):  # the weights read from the layer's file
            return read_tree(tree.path, tree.layout, "params", placer(self.mesh))
        return super().fetch(tree)

    def _where(self) -> str:
        return f"layer files in {self.store.directory or 'the offload directory'}"


def for_offload(mesh: Mesh, offload, sharded: bool = False, directory: str | None = None) -> Residency:
    """The tier of ``ReversibleTrainer.offload``: False the device, True host memory, ``'disk'`` layer files in
    ``directory`` (None: set later by the train command, `DiskTier.attach`; given with another tier, a note
    says it is not used).

    Raises:
      ValueError: ``offload`` is none of those.
    """
    if directory is not None and offload in (False, True):
        metrics_lib.log(f"ReversibleTrainer.offload_dir = {directory!r} is not used: it is the directory of "
                        "offload = 'disk'")
    if offload is False:
        return Residency(mesh, sharded)
    if offload is True:
        return HostResidency(mesh, sharded)
    if offload == "disk":
        return DiskResidency(mesh, sharded, DiskTier(directory))
    raise ValueError(f"ReversibleTrainer.offload must be False, True or 'disk', got {offload!r}")


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
