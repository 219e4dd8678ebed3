"""The tier's declared interface (`Tier`), and the placement every tier shares.

A *tier* says where a layer's weights and optimizer state live between the programs that use them, and
answers every question the rest of revtrain asks about that place. The questions come in five groups:

* **Name and words**: `Tier.name` (``"device"``, ``"host"``, ``"disk"``, or a registered tier's), the value of
  ``ReversibleTrainer.offload`` that selects it (`Tier.gin_value`), `Tier.describe`, `Tier.trainer_label`.
* **Placement**: where a new layer goes (`Tier.put_layer`, `Tier.end_init`, `Tier.place_stacked`), its
  shape-only restore template (`Tier.layer_template`), how a layer's weights come to the device whole
  (`Tier.fetch`) and where a kept activation waits for the backward (`Tier.keep`, `Tier.bring`).
* **Its store and the engine's hooks**: `Tier.store` (a `revtrain.streaming.Store`, None for a tier the
  streaming engine does not move), `Tier.streamed`, `Tier.releases` (a step lets go of each layer's old state
  as it writes the new one) and the run's hooks
  (`Tier.attach`, `Tier.check_run`, `Tier.own_directory`).
* **Plan terms**, methods the planners call: the device copies of a layer the engine holds at once
  (`Tier.layers_in_flight`), the bytes one step moves between the store and the device (`Tier.io_per_step`),
  the space the store may use and needs (`Tier.capacity`, `Tier.space_need`), its bandwidth
  (`Tier.bandwidth`), why the tier cannot run here (`Tier.refusal`), where the state waits between uses
  (`Tier.state_memory`, `Tier.keeps_on_host`), the parts of its own store (`Tier.store_parts`) and a step's
  I/O against the store's bandwidth (`Tier.step_io`). The memory plan and the budget planner are handed the
  tier object (`revtrain.planning.Setup.tier`, the trainer's ``residency``) and ask these; a plan that
  compares tiers makes the others on the same mesh (`Tier.peer`).
* **Checkpoint, sampling and export forms**: how a checkpoint holds the state (`Tier.checkpoint_form`:
  ``"orbax"`` for arrays, ``"links"`` for the disk tier's hard links; a tier with a form of its own names its
  Orbax item, `Tier.checkpoint_item`, and answers `Tier.checkpoint_handler`, `Tier.checkpoint_save`,
  `Tier.checkpoint_restore` and `Tier.restored`, `Tier.array_template`; a tier without one whose states hold
  refs of its store, `Tier.holds_refs`, gets Orbax's arrays by default: `Tier.checkpoint_arrays` reads them
  through the store for a save, `Tier.restore_template` and `Tier.restored_arrays` put a restored state back
  into it), whether a state is this tier's (`Tier.holds_state`), how generation reads the layers (the bytes
  holding them would add, `Tier.outside_bytes`; one at a time, `Tier.sample_layers`; the words of the choice,
  `Tier.sample_words`) and how an export reads each layer's weights as numpy (`Tier.layer_weights`).
  `revtrain.checkpoint`, `revtrain.generate` and `revtrain.export` ask these and never name a tier.

`Tier` implements placement for a state held as JAX arrays (the device tier's, shared by the host tier); a
tier overrides what differs. A new tier is one module with one subclass and one `revtrain.tiers.register`
line (tests/test_tiers_plugin.py adds one without touching any other file).

A state is placed *one layer at a time*: the initial values of a lazy model (`revtrain.layers.Layer.lazy`)
are made per layer, put where they live, and dropped, so a whole model never exists twice in host memory
(docs/memory.md). A run of stacked identical layers (the device tier's scanned executor) is filled into one
host buffer per leaf (`HostStack`) and placed leaf by leaf, each buffer released as soon as it is placed.
"""

from __future__ import annotations

import abc

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.errors import RunFailure
from revtrain.placement import DEVICE_MEMORY, placer, replicated, shard_spec


class StoreError(RunFailure, OSError):
    """A tier's store cannot read or write a layer (one line: what and the OS's reason); a run stops with its
    checkpoints kept, as for a failed checkpoint write."""


class Tier(abc.ABC):
    """Where weights and optimizer state live between uses, and everything that follows from it (see the
    module note). Subclasses set `name`, `gin_value` and implement `describe_place`; the rest has defaults:
    a state of JAX arrays, not streamed, checkpointed by Orbax (a state of a store's refs too: read into arrays
    through the store, `checkpoint_arrays`).

    Args:
      mesh: the data mesh.
      sharded: split each large leaf over the ``"data"`` axis (``shard_state``) instead of replicating it.
    """

    name: str = ""  # the tier's name (the registry's key)
    gin_value: object = None  # the ``ReversibleTrainer.offload`` value that selects it
    label = ""  # what a trainer's label adds for this tier
    releases = False  # a step lets go of each layer's old state once its new one is written
    checkpoint_form = "orbax"  # how a checkpoint holds the state: "orbax" (arrays) or "links" (the files)
    # The Orbax item a checkpoint holds this tier's state in, when it has a form of its own (`checkpoint_handler`);
    # None: Orbax's arrays in the ``state`` item (every array tier's).
    checkpoint_item: str | None = None
    uses_directory = False  # whether ``ReversibleTrainer.offload_dir`` names this tier's directory
    host_pool = False  # whether the state lives in host memory a GPU's runtime pins (`revtrain.pinned`'s pool)
    memory_line = None  # a line naming the memory the state lives in (the host tier's), or None
    # Plan terms: the memory the weights and optimizer state wait in between uses: "device", "host", or None
    # (the tier's own store: only the layers in flight are in memory, `store_parts` counts the store).
    state_memory: str | None = "device"
    keeps_on_host = False  # whether a kept activation (`keep`) waits in host memory

    def __init__(self, mesh: Mesh, sharded: bool = False):
        self.mesh, self.sharded = mesh, sharded
        self.store = None  # the streaming engine's store (`revtrain.streaming.Store`) of a streamed tier
        self.workdir = None  # the run's workdir, once `attach` names it
        self._kind = None

    # -- name and words --------------------------------------------------------------------------
    @property
    def tier(self) -> str:
        """The tier's `name` (the older spelling)."""
        return self.name

    @abc.abstractmethod
    def describe_place(self) -> str:
        """Where the state lives, in a few words (``"device memory"``)."""

    def describe(self) -> str:
        """A few words for logs and the memory plan, e.g. ``"host memory (unpinned_host), replicated"``."""
        return f"{self.describe_place()}, {'split over the devices' if self.sharded else 'replicated'}"

    def trainer_label(self, name: str, sharding: str = "") -> str:
        """A trainer's label with this tier's words: ``name`` then ``sharding`` (e.g. ``" + shard_state"``)
        then `label` (a tier that changes the step's placement puts its words before the sharding's)."""
        return name + sharding + self.label

    @property
    def memory_kind(self) -> str | None:
        """The JAX memory kind of the state (None: the device's default)."""
        return self._kind

    @property
    def streamed(self) -> bool:
        """True when the streaming engine moves the state (`revtrain.streaming`): the tier has a store."""
        return self.store is not None

    @property
    def offloaded(self) -> bool:
        """True when the state lives outside device memory (the engine moves it in and out)."""
        return self.streamed

    # -- a layer's state ---------------------------------------------------------------------------
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
        """One layer's params (as a state holds them) on the device, whole: a ref of the tier's store read
        through it (`revtrain.streaming.Store.read`), arrays gathered from the devices' pieces when sharded."""
        if self.store is not None and self.store.holds(tree):
            [tree] = self.store.read([(tree, "params")], placer(self.mesh))
            return tree
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
        """The sharding of a leaf with ``spec`` in this tier's memory kind."""
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
        """``shapes`` as ``jax.ShapeDtypeStruct`` leaves with this tier's shardings: a restore template that
        allocates nothing."""
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

    # -- the run's hooks -------------------------------------------------------------------------------
    def attach(self, workdir: str) -> None:
        """The run's workdir is ``workdir`` (kept as `workdir`; the disk tier names its default directory
        there)."""
        self.workdir = workdir

    def check_run(self) -> None:
        """Checks the tier's configuration before the run makes anything (raises
        `revtrain.errors.ConfigError` with one line); nothing to check by default."""

    def own_directory(self) -> str | None:
        """A directory outside the run's workdir that this tier writes into (the run locks it), or None."""
        return None

    @classmethod
    def leftovers(cls, workdir: str) -> str | None:
        """One line when ``workdir`` holds this tier's files left by an earlier run that a run of another tier
        will not use, else None."""
        return None

    # -- plan terms ------------------------------------------------------------------------------------
    def refusal(self) -> str | None:
        """Why this tier cannot run here, in one line, or None."""
        return None

    def layers_in_flight(self) -> int:
        """How many copies of a layer's weights and optimizer state the engine holds on the device at once
        for a streamed tier (the one computing, those put ahead, the one being written back); 0 when the
        whole state lives on the device (it is counted whole instead)."""
        return 0

    def io_per_step(self, weights: int, opt: int, head_weights: int) -> tuple[int, int]:
        """``(bytes read, bytes written)`` between the store and the device in one fused-update step of a
        state of ``weights`` and ``opt`` bytes (``head_weights``: the head layer's, read once): every layer's
        weights in the forward but the head's, every layer's weights and optimizer state in the backward,
        each layer's new state written once. (0, 0) when the state stays on the device."""
        if not self.streamed:
            return 0, 0
        return 2 * weights + opt - head_weights, weights + opt

    def capacity(self, held=()) -> tuple[int, str] | None:
        """``(bytes, description)`` the tier's own store may occupy beyond host and device memory (the disk
        tier's free space; ``held``: directories the run holds there already), or None: no store of its own."""
        return None

    def space_need(self, state_bytes: int, keep: int | None, every: int) -> tuple[int, int]:
        """``(live bytes, checkpoint bytes)`` the tier's own store needs for a state of ``state_bytes`` with
        ``keep`` checkpoints written every ``every`` steps: (0, 0) for a tier without one."""
        return 0, 0

    def bandwidth(self) -> dict | None:
        """The store's sequential bandwidth (``{"read": B/s, "write": B/s, "source"}``), or None where it is
        not a planned term (memory tiers: the device's copies)."""
        return None

    def store_parts(self, weights: int, opt: int, keep: int | None, every: int, deferred: bool) -> dict | None:
        """The bytes the tier's own store holds at a step's peak, by part (``{"weights", "optimizer_state",
        "checkpoint", "gradients"}``), for a state of ``weights`` and ``opt`` bytes (whole layers), ``keep``
        checkpoints written every ``every`` steps, and ``deferred``: the deferred update's gradient buffers in
        the store too. None for a tier without a store of its own (its state is counted in memory)."""
        return None

    def store_advice(self) -> tuple[str, str]:
        """What a refusal says when the tier's own store is too small (`revtrain.planning.refusal`): what the
        store holds, and what would make room (a tier with a store of its own overrides it)."""
        return f"the {self.name} tier's store", f"give the {self.name} tier's store more room"

    def step_io(self, weights: int, opt: int, head_weights: int, deferred: tuple | None = None) -> dict | None:
        """A step's I/O between the tier's own store and memory: ``{"read_bytes", "write_bytes",
        "read_bandwidth", "write_bandwidth" (B/s or None), "seconds" (I/O alone, or None unmeasured),
        "bandwidth_source"}``; ``deferred``: ``(owned_bytes, microbatches, passes)`` of a deferred update (its
        tied owners' bytes, microbatches, statistics passes + 1), else the fused update's `io_per_step`. None
        for a tier without a store of its own (memory tiers: the device's copies are not a planned term)."""
        return None

    def peer(self, name: str) -> "Tier":
        """The registered tier ``name`` on this tier's mesh and sharding, its files (if any) where the run
        names them later: what a plan that compares tiers asks (`revtrain.planning.alternatives`,
        ``offload = 'auto'``).

        Raises:
          ValueError: no tier is registered as ``name``.
        """
        from revtrain.tiers.registry import lookup
        peer = lookup(name)(self.mesh, self.sharded)
        if self.workdir is not None:
            peer.attach(self.workdir)
        return peer

    # -- checkpoint and sampling forms -------------------------------------------------------------------
    @classmethod
    def holds_state(cls, ts) -> bool:
        """Whether the `TrainState` ``ts`` (or a restore template) holds its layers in this tier's own refs
        (a state of arrays is any array tier's: False)."""
        return False

    @classmethod
    def checkpoint_handler(cls):
        """The Orbax ``CheckpointHandler`` of `checkpoint_item` (a tier with a checkpoint form of its own), or
        None. `revtrain.checkpoint.Checkpointer` registers every registered tier's."""
        return None

    @classmethod
    def checkpoint_save(cls, ts):
        """The Orbax save arguments of `checkpoint_item` for the `TrainState` ``ts`` (a state this tier holds,
        `holds_state`); a tier with a form of its own implements it. The save is waited for at once (the tier
        may release what it links after the next step)."""
        raise NotImplementedError(f"the {cls.name} tier's checkpoints are Orbax's arrays")

    @classmethod
    def checkpoint_restore(cls):
        """The Orbax restore arguments of `checkpoint_item` (see `checkpoint_save`)."""
        raise NotImplementedError(f"the {cls.name} tier's checkpoints are Orbax's arrays")

    @classmethod
    def restored(cls, item, template, optimizer_state: bool = True, files: bool = False):
        """The `TrainState` of the restored `checkpoint_item` ``item`` (what `checkpoint_restore` gave) in the
        shapes and placements of ``template``: this tier's own refs where the template holds them (with
        ``optimizer_state=False`` the weights' refs alone when ``files``, else the weights read), else read into
        the template's arrays. The result's ``step`` is the template's (the caller sets the checkpoint's).

        Raises:
          ValueError: the item does not match the template (another model), or a file is missing or short.
        """
        raise NotImplementedError(f"the {cls.name} tier's checkpoints are Orbax's arrays")

    @property
    def holds_refs(self) -> bool:
        """Whether a state of this tier holds its layers as refs of its store (`store`: the disk tier's files, a
        registered tier's own objects) rather than as arrays: a streamed tier whose state has no memory kind of
        its own. (A streamed state of arrays lives outside device memory, in a host memory kind: the host
        tier's; without one it would be in device memory, which a streamed tier keeps it out of.) A tier may
        override it."""
        return self.streamed and self.memory_kind is None

    def checkpoint_arrays(self, ts):
        """The `TrainState` ``ts`` as Orbax's arrays form saves it (a tier without a form of its own,
        `checkpoint_item` None): for a tier whose states hold refs of its store (`holds_refs`), each layer's
        weights and optimizer state read through the store one layer at a time (`revtrain.streaming.Store.load`
        for a threaded store, then `Store.read` with ``numpy.asarray`` as the placement) into host numpy, in
        the per-layer layout, the layer state as it is; any other state as it is (Orbax writes arrays from where
        they live).

        Host memory: the whole state's weights and optimizer state once as numpy (nothing of it on the device),
        held until the save has written it (`revtrain.checkpoint.Checkpointer.save` writes it synchronously when
        it is larger than its ``async_max_bytes``); a state larger than host memory needs a form of its own (the
        disk tier's hard links). A layer is read as the store reads it for a step (a file's checksums checked).

        Raises:
          OSError: the store cannot read a layer (e.g. `StoreError`).
        """
        if not self.holds_refs:
            return ts
        ts = ts.per_layer()
        params, opt_state = [], []
        for p, o in zip(ts.params, ts.opt_state, strict=True):
            layer = [(p, "params"), (o, "opt")]
            items = [(x, part) for x, part in layer if self.store.holds(x)]  # (one read of the layer's refs)
            loaded = [self.store.load(x, part) for x, part in items] if self.store.threaded else None
            read = dict(zip((part for _, part in items), self.store.read(items, np.asarray, loaded), strict=True))
            p, o = (jax.tree.map(np.asarray, read.get(part, x)) for x, part in layer)
            params.append(p), opt_state.append(o)
        return type(ts)(ts.step, params, opt_state, ts.layer_state)

    def restore_template(self, abstract: dict) -> dict:
        """The Orbax restore template of a state of this tier saved in Orbax's arrays form: ``abstract``
        (``{"params", "opt_state", "layer_state"}``, per-layer lists of ``jax.ShapeDtypeStruct`` from the tier's
        `layer_template`) as it is, so each leaf is read straight into its placement; for a tier whose states
        hold refs (`holds_refs`) the weights and optimizer state as host numpy buffers (``numpy.empty``: no page
        touched until Orbax fills it, nothing on the device), which `restored_arrays` puts into the store."""
        if not self.holds_refs:
            return abstract
        def buffer(x):
            return np.empty(x.shape, x.dtype)
        return {**abstract, "params": jax.tree.map(buffer, abstract["params"]),
                "opt_state": jax.tree.map(buffer, abstract["opt_state"])}

    def restored_arrays(self, ts):
        """The `TrainState` ``ts`` restored from Orbax's arrays form (into `restore_template`) where this tier
        keeps it: for a tier whose states hold refs (`holds_refs`), each layer put into the store as the
        trainer's ``init`` puts it (`put_layer`, then `end_init`), one layer at a time, its numpy let go once
        stored; else ``ts`` as it is (Orbax placed it). A resumed run then continues from the store's refs bit
        for bit. ``ts``'s weights and optimizer state are consumed (set to None).

        Host memory: the restore's peak is the whole state once as numpy (Orbax reads it whole), less each layer
        as it is stored.

        Raises:
          OSError: the store cannot write a layer (e.g. `StoreError`).
        """
        if not self.holds_refs:
            return ts
        params, opt_state = list(ts.params), list(ts.opt_state)
        ts.params = ts.opt_state = None  # (the lists above hold the numpy now: each layer let go once stored)
        for g in range(len(params)):
            params[g], opt_state[g] = self.put_layer(g, params[g], opt_state[g])
        self.end_init()
        return type(ts)(ts.step, params, opt_state, ts.layer_state)

    @classmethod
    def array_template(cls, template):
        """``template`` (a `TrainState` restore template) with this tier's own refs replaced by the shapes of
        the weights they hold (optimizer state: None): what an Orbax checkpoint's weights are read into for a
        template of this tier. A template of arrays as it is."""
        return template

    def outside_bytes(self, ref) -> int:
        """Bytes of one layer's weights ``ref`` (as a state holds them) kept outside device memory: what
        holding them on the device adds. A ref of the tier's store: its weights' bytes there
        (`revtrain.streaming.Store.nbytes`); arrays: the leaves not in device memory (a host store's, numpy)."""
        if self.store is not None and self.store.holds(ref):
            return self.store.nbytes(ref, "params")
        return sum(int(x.nbytes) for x in jax.tree.leaves(ref)
                   if not isinstance(x, jax.Array) or x.sharding.memory_kind != DEVICE_MEMORY)

    def sample_layers(self, refs: list, place):
        """A reader of a state's layers ``refs`` for layer-by-layer generation (``get(i)``, ``close()``,
        ``read_bytes``; ``place``: numpy leaf -> placed array), or None when the layers are fetched as the
        trainer fetches them (`fetch`). A tier whose store reads on its own thread (files; `Store.threaded`)
        gets `revtrain.tiers.cycle.LayerCycle`: each layer read as generation reaches it, the next ahead."""
        if self.store is None or not self.store.threaded:
            return None
        from revtrain.tiers.cycle import LayerCycle
        return LayerCycle(self.store, refs, place)

    def sample_words(self) -> tuple[str, str]:
        """The words of a sample that streams this tier's weights (`revtrain.generate_weights.choose`): where
        they come from, and what each token does with ``{}`` their size (``("from host memory", "copies {} to
        the device")``)."""
        return f"from the {self.name} tier's store", "moves {} to the device"

    def layer_weights(self, refs: list) -> "LayerWeights":
        """A list-like view of a state's layers ``refs`` (its ``params``) whose ``[i]`` is layer ``i``'s weights
        as numpy arrays, made when asked and never kept (``revtrain export`` visits the layers in turn): read
        through the tier's store where it holds the ref (`LayerWeights`)."""
        return LayerWeights(refs, self.store)


class LayerWeights:
    """A list-like view of a state's layers whose ``[i]`` is layer ``i``'s weights as numpy arrays, made at that
    moment and never cached: a ref of ``store`` read through it (`revtrain.streaming.Store.read`, e.g. the disk
    tier's file, its checksums checked), a layer held in memory copied as numpy. A reader that visits the layers
    in turn and drops each (``revtrain export``'s shards) holds one layer, not the model.

    Args:
      refs: one entry per layer, a ref of ``store`` or a tree of arrays.
      store: the tier's `revtrain.streaming.Store`, or None.

    Raises (on ``[i]``):
      OSError: the store cannot read the layer (e.g. `revtrain.tiers.disk_format.DiskTierError`).
    """

    def __init__(self, refs: list, store=None):
        self.refs, self.store = list(refs), store

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int):
        ref = self.refs[i]
        if self.store is not None and self.store.holds(ref):
            [ref] = self.store.read([(ref, "params")], np.asarray)
        return jax.tree.map(np.asarray, ref)


class HostStack:
    """Host buffers for ``count`` layers' trees of one structure, stacked on a new leading axis and filled one
    layer at a time (`put`), so the layers' own copies can be dropped as they come (see `Tier.place_stacked`)."""

    def __init__(self, count: int):
        self.count, self.buffers, self.treedef = count, None, None

    def put(self, j: int, tree) -> None:
        """Copies layer ``j``'s tree (numpy or jax leaves) into slice ``j``.

        Raises:
          ValueError: the tree's structure differs from the first layer's.
        """
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
