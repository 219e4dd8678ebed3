"""The memory-efficient reversible trainer (docs/design.md section 2).

Forward: layer by layer, keeping only the current activation; a standard layer's input is saved (it cannot
be rebuilt), a reversible layer's output replaces its input. Head: one fused call computes the loss, its
``vjp`` with respect to (head params, head input), the gradient sum over devices and the head's optimizer
update; when the layer under the head is reversible (``fuse_top``) that call starts from that layer's
input instead and takes the vjp through both layers (backprop for the top layer: no forward of its own,
no rebuild), updating both. Backward, in reverse order, one fused call per layer ("reverse and update"):
rebuild the inputs from the outputs with the same per-example dropout keys as the forward, ``vjp`` of the
forward at the rebuilt inputs with the old weights, sum the parameter gradients over devices, apply this
layer's optax update, and hand the input cotangent to the layer below. A standard layer is recomputed from its saved
input (rematerialisation) and the walk continues from that saved input, which also resets reconstruction
drift at every block boundary. At most one layer's gradients exist at a time.

With ``offload=True`` every layer's weights and optimizer state live in host memory between uses, with
``offload='disk'`` in one file per layer (`revtrain.residency`). The streaming engine (`revtrain.streaming`)
follows the step's access schedule: it fetches each layer to the device on a reader thread ahead of the
program that needs it and writes each update back on a writer thread while the next layer computes, with a
bounded number of layers in flight. The programs are the device tier's own (they compute on device arrays),
so every tier trains bit for bit like ``offload=False``. Saved standard-layer inputs go to host memory too.

Two executors (docs/design.md section 9). Per layer: one compiled call per layer and pass, as above. Scanned
(``scan_layers=True``): each maximal run of consecutive, structurally identical reversible layers is held
stacked (weights, optimizer state and layer state with a leading layer axis, `stacking.Stacked`) and each
pass over it is one compiled program: the forward a ``lax.scan``, the backward a reverse ``lax.scan`` whose
body does exactly what one "reverse and update" call does (same keys from the global layer index, same
rebuild barrier, same gradient sum, the optax update of that layer's slice). The backward carries the
stacks and updates each slice in place, reading the next slice only after writing the current one, so XLA
needs no copy of the stack. Other layers keep the per-layer path. Both executors compute the same numbers;
checkpoints hold the per-layer layout either way. The host and disk tiers run the per-layer executor (the
engine moves one layer at a time).

Sharded state (``shard_state=True``, ZeRO-3 / ZeRO-Infinity over the ``"data"`` axis): every large leaf
of every layer's weights and optimizer state is split along one axis over the devices
(`placement.shard_spec`) wherever it lives (host memory with offload, device memory otherwise), so N
devices hold one copy between them instead of N. Each program takes the local pieces, all-gathers the weights over ``"data"`` (`placement.gather_params`: whole and the same
on every device during the forward, rebuild and vjp, pmap semantics), reduce-scatters the gradients
(``lax.psum_scatter``, `placement.reduce_grads`) instead of summing them everywhere, and runs the optax
update on the local piece; the updated piece goes back where it lives. An update that needs the whole leaf
(`common.is_elementwise` says no: LAMB, Adafactor) runs in the deferred update pass instead.

Deferred updates (`revtrain.trainers.deferred`): with microbatches (gradient accumulation), an optimizer
whose whole-model update combines layers (``optax.clip_by_global_norm``: `layerwise.LayerwiseUpdate`) or
tied parameters, the backward accumulates each layer's gradient where its weights live and streamed passes
after the backward apply the optimizer exactly as on the whole model. Every step also reports the global
gradient norm (``grad_norm``) from per-layer sums of squares.

Reference: Trax ``ReversibleSerialTrainer`` (trax/optimizers/trainer.py); Gomez et al., "The Reversible
Residual Network", NeurIPS 2017; Kitaev et al., "Reformer", ICLR 2020.
"""

from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain import disk_tier
from revtrain import metrics as metrics_lib
from revtrain.placement import (DATA_AXIS, DEVICE_MEMORY, HOST_MEMORY, host_memory_supported, placer,
                                replicated, shard_spec, spec_axis)
from revtrain.residency import HostStack, Residency
from revtrain.streaming import train_schedule
from revtrain.trainers.common import (TrainerBase, TrainerError, TrainState, batch_size_of, check_batch, check_finite,
                                      check_flags, example_keys, gather_params, grad_norm, guarded_update,
                                      is_elementwise, leaf_squares, per_device, reduce_grads, step_key)
from revtrain.trainers.deferred import DeferredUpdates, split_leaf_squares
from revtrain.trainers.layerwise import CoupledUpdateError, LayerwiseUpdate
from revtrain.trainers.modes import (BACKPROP, CHECKPOINT, REBUILDS, REMAT, ProgramSpec, StepKind,
                                     count_in_head, forward_in_head)
from revtrain.trainers.stacking import Stacked, find_runs, groups_of

_R, _D = P(), P(DATA_AXIS)
_SD = P(None, DATA_AXIS)  # a stack of activations (a leading layer axis)


@gin.configurable
class ReversibleTrainer(DeferredUpdates, TrainerBase):
    """Reversible backprop with fused per-layer optimizer updates and optional per-layer host offload.

    Args:
      model, optimizer, mesh, seed: see ``TrainerBase``.
      offload: where weights and optimizer state live between uses (`revtrain.residency`): False, device
        memory; True, host memory (with the saved standard-layer inputs); ``'disk'``, one file per layer in
        ``offload_dir`` (`revtrain.disk_tier`). Either is read ahead of each program and written back after
        each update by the streaming engine (`revtrain.streaming`), one layer at a time: the per-layer
        executor, whatever ``scan_layers`` says.
      offload_dir: the disk tier's directory (default: ``<workdir>/offload``, set by the train command).
      scan_layers: with the state in device memory, run each run of consecutive identical reversible layers
        as one ``lax.scan`` per pass (the scanned executor; see the module note). Same results as the
        per-layer executor.
      shard_state: split every large leaf of the weights and optimizer state over the ``"data"`` devices
        (see the module note): each device holds 1/N of it. One log line at construction says how many
        leaves (and bytes) are split and which stay replicated.
      fuse_top: when the layer under the head is reversible, run it inside the head's program: one ``vjp``
        of the head's loss through that layer from the layer's input, both layers' optimizer updates in
        the same call (see ``top_head_grads``). That layer is then neither run forward on its own nor
        rebuilt: its forward is the vjp's, its gradient backprop's (2.75 forwards of a Transformer block
        per step instead of 1.0 + 3.75 with the exact rebuild, 1.0 + 3.0 fused), its input the only extra
        activation, held while the head runs (with that block's vjp residuals). Its forward is compiled
        inside the vjp, so losses may differ from ``fuse_top=False`` in the last bits. Off by default: at
        the default model's size on XLA:CPU it measured 0.97-0.98x the step speed with a higher peak (the
        head's program then holds a block's residuals too); 1.04x with the fused rebuild at d_model 256
        (docs/rebuild.md).
      rebuild: how the backward rebuilds a reversible layer's input and takes its vjp: a flavour of
        `modes.REBUILDS` (``REBUILD_MODES``, its names; each a `modes.Rebuild` class saying what it does and
        how exact it is: `modes.ExactRebuild`, the default, `modes.FusedRebuild`, `modes.FencedRebuild`).
        Layers without ``half_residuals`` rebuild the exact way in every flavour. See docs/rebuild.md.

      microbatches: gradient accumulation (``TrainerBase``): M forward/backward passes per step, then the
        deferred update (`revtrain.trainers.deferred`).
      memory_budget: device bytes a step may peak at (an int, a size such as ``'2GiB'``, or ``'auto'``: an
        accelerator's ``bytes_limit`` less 10%); None (default): every reversible block rebuilt. With a budget
        the trainer chooses each block's backward mode (`revtrain.trainers.modes`: backprop inside the head's
        program, remat from its kept input, or rebuild) for the fastest step (``budget_objective``) whose
        planned peak fits (`revtrain.trainers.budget`; ``plan_budget``, before the state is placed by
        ``revtrain train``, else at the first step), logs the plan in one line and refuses a budget below the least plan's peak
        (`TrainerError` naming it). Overrides ``fuse_top``. Every plan's gradients equal backprop's as the
        rebuild's do (docs/budget.md).
      budget_objective: what a budget's plan minimises: ``"time"`` (default), the step's seconds from the
        trainer's own programs timed once on this machine at start-up (a few calls each on zeros; a scanned
        run's per block), or ``"flops"``, their compiled FLOPs (the same plan on every machine).

    Any optax optimizer: a separable one (each layer's update needs only that layer: Adam, AdamW, Lion,
    SGD, LAMB, Adafactor) keeps the fused per-layer update; one whose whole-model update combines layers
    (``optax.clip_by_global_norm`` in a chain, ``optax.apply_if_finite``) runs deferred, exactly as on the
    whole model (`layerwise.LayerwiseUpdate`). So do microbatches, tied parameters (`Model.ties`) and, with
    ``shard_state``, an update that needs whole leaves.

    Raises:
      TrainerError: the optimizer's update combines whole tensors of several layers (it cannot run one layer
        at a time), offload was asked for on a backend without a ``pinned_host`` memory space, ``rebuild``
        is not a known mode, ``memory_budget`` is not a size, ``microbatches`` is not a positive integer, or
        tied parameters that cannot be shared exactly (the user is not the head, the owner is a reversible
        layer, or with ``fuse_top``).

    The ``TrainState`` passed to ``train_step`` is consumed (its device buffers are donated). With
    ``scan_layers`` the states it returns hold the stacked layout (``TrainState.stacked``); their per-layer
    views are copies made on first access.
    """

    name = "reversible"
    REBUILD_MODES = tuple(REBUILDS)  # the rebuild flavours' names (`modes.REBUILDS`), the default first

    def __init__(self, model, optimizer, mesh, seed: int = 0, offload: bool | str = False, scan_layers: bool = True,
                 shard_state: bool = False, rebuild: str = "exact", fuse_top: bool = False, microbatches: int = 1,
                 offload_dir: str | None = None, memory_budget=None, budget_objective: str = "time"):
        if not (offload is True or offload is False or offload == "disk"):
            raise TrainerError(f"ReversibleTrainer.offload must be False, True or 'disk', got {offload!r}")
        check_flags("ReversibleTrainer", scan_layers=scan_layers, shard_state=shard_state, fuse_top=fuse_top)
        if rebuild not in self.REBUILD_MODES:
            raise TrainerError(f"ReversibleTrainer.rebuild must be one of {', '.join(map(repr, self.REBUILD_MODES))}, "
                               f"got {rebuild!r}")
        self.rebuild = rebuild
        self.rebuild_mode = REBUILDS[rebuild]  # the strategy object of the rebuilt blocks (`modes`)
        super().__init__(model, optimizer, mesh, seed, microbatches)
        try:
            self.layerwise = LayerwiseUpdate(optimizer, model.param_shapes())
        except CoupledUpdateError as e:
            raise TrainerError(str(e)) from None
        self.shard_state = shard_state
        self._check_ties(model, shard_state, fuse_top)
        # The fused per-layer update when it is exact; else the deferred one (`revtrain.trainers.deferred`).
        self.deferred = (not self.layerwise.separable or microbatches > 1 or bool(model.ties)
                         or (shard_state and not is_elementwise(optimizer)))
        self._acc_key, self._acc_clean = None, False
        self._specs: dict = {}  # id(layer) -> (params specs, optimizer state specs), per layer
        if offload is True and not host_memory_supported(mesh):
            raise TrainerError("offload needs a backend with a pinned_host memory space")
        self.scan_layers = scan_layers
        self._stream, self.disk_stats = None, {}  # a streamed tier's step in progress; its last step's I/O
        if offload == "disk":
            self.residency = Residency(mesh, "disk", shard_state, store=disk_tier.DiskTier(offload_dir))
            why = disk_tier.refusal(self)
            if why:
                raise TrainerError(why)
        else:  # host memory: a store the streaming engine moves each layer in and out of
            self.residency = Residency(mesh, "host" if offload else "device", shard_state)
        if self.residency.streamed:
            self._limit = self.residency.store.bounded(self._limit)  # the layers in flight, bounded
        # The reversible layer under the head runs inside the head's program (``fuse_top``): alone, out of
        # any run it ends.
        num_layers = len(model.layers)
        self.fuse_top = fuse_top and num_layers >= 2 and model.layers[-2].reversible
        # Each block's backward mode (`modes`): a standard layer's is remat, a reversible block's the rebuild;
        # with fuse_top the block under the head is backprop'd; a memory budget chooses per block.
        self.block_modes = [self.rebuild_mode if layer.reversible else REMAT for layer in model.layers[:-1]]
        if self.fuse_top:
            self.block_modes[-1] = BACKPROP
        self._plans: dict = {}
        self.memory_budget, self.budget_plan = None, None
        import revtrain.trainers.budget as budget_lib
        if budget_objective not in budget_lib.OBJECTIVES:
            raise TrainerError(f"ReversibleTrainer.budget_objective must be one of "
                               f"{', '.join(map(repr, budget_lib.OBJECTIVES))}, got {budget_objective!r}")
        self.budget_objective = budget_objective
        if memory_budget is not None:
            self.memory_budget = budget_lib.parse_budget(memory_budget, mesh)
        self.groups = self._layout()
        if shard_state:
            metrics_lib.log(self.shard_summary())

    @property
    def num_top(self) -> int:
        """How many blocks under the head run inside the head's program (backprop or checkpoint;
        ``fuse_top``: one)."""
        return count_in_head(self.block_modes)

    def _layout(self) -> tuple:
        return self.layout(self.block_modes)

    def layout(self, modes: list) -> tuple:
        """The groups ``((start, count), ...)`` of the working layout under block ``modes`` (one
        `modes.BackwardMode` per layer but the head): with ``scan_layers`` and the state in device memory each
        maximal run of identical reversible blocks of one mode that scans (`_scans`) is stacked, every other
        layer alone (a streamed tier runs every layer alone: the engine moves one layer at a time)."""
        runs = find_runs(self.model.layers) if self.scan_layers and not self.residency.streamed else []
        split = []
        for start, count in runs:  # sub-runs by mode: consecutive blocks of one mode that scans
            j = start
            while j < start + count:
                mode, k = modes[j], j
                while k < start + count and modes[k] is mode:
                    k += 1
                if k - j >= 2 and self._scans(mode):
                    split.append((j, k - j))
                j = k
        runs = split
        if self.deferred and not self.layerwise.separable:  # a run's layers must share one update program
            runs = [(start, count) for start, count in runs
                    if len({self.layerwise.signature(start + j) for j in range(count)}) == 1]
        return groups_of(len(self.model.layers), runs)

    def _scans(self, mode) -> bool:
        """Whether a run of identical blocks in ``mode`` is one ``lax.scan`` per pass: rebuilt runs always;
        rematerialised runs with the fused update (the deferred update's accumulating programs are per
        layer); backprop blocks run inside the head's program."""
        return mode.rebuilds or (mode in (REMAT, CHECKPOINT) and not self.deferred
                                 and not (mode is CHECKPOINT and self.shard_state))

    def set_block_modes(self, modes: list) -> None:
        """Sets each block's backward mode (`modes`: one strategy object per layer but the head) and the
        working layout it implies. Blocks run inside the head's program (backprop, checkpoint) must be the ones
        directly under the head."""
        modes = list(modes)
        k = count_in_head(modes)
        if any(m.kind is StepKind.TOP for m in modes[:len(modes) - k]):
            raise TrainerError("backprop and checkpoint blocks must be the blocks directly under the head")
        if any(m is not REMAT and not self.model.layers[i].reversible for i, m in enumerate(modes)):
            raise TrainerError("a standard layer can only be recomputed (remat)")
        self.block_modes = modes
        self.groups = self._layout()

    @property
    def offload(self) -> bool:
        """Whether weights and optimizer state live in host memory between uses (``self.residency``; every
        tier's programs compute on device arrays)."""
        return self.residency.tier == "host"

    @property
    def on_disk(self) -> bool:
        """Whether weights and optimizer state live in layer files (``offload = 'disk'``)."""
        return self.residency.tier == "disk"

    @property
    def _branch(self) -> bool:
        """The per-layer backward programs' update form (`common.guarded_update`): the conditional with the
        disk tier, whose peak is the layers in flight plus one program's temporaries (the select form's
        update holds a copy of the weights' size: on a d 3200 Llama block 1.21 GiB of temporaries against
        0.83); the select form elsewhere (a conditional makes an accelerator wait for its flag)."""
        return self.on_disk

    @staticmethod
    def _check_ties(model, shard_state: bool, fuse_top: bool) -> None:
        """Raises `TrainerError` for tied parameters this trainer cannot share exactly."""
        last = len(model.layers) - 1
        for t in model.ties:
            where = f"layers {model.layers[t.owner].name} and {model.layers[t.user].name}"
            if t.user != last:
                raise TrainerError(f"a parameter shared by {where}: the reversible trainer shares a parameter "
                                   "only between a standard layer and the head (a tied embedding and output "
                                   "projection)")
            if model.layers[t.owner].reversible:
                raise TrainerError(f"a parameter shared by {where}: its owner must be a standard layer, not a "
                                   "reversible one")
            if fuse_top:
                raise TrainerError(f"a parameter shared by {where} cannot be combined with "
                                   "ReversibleTrainer.fuse_top yet; set it to False")

    def _sq(self, layer, grads):
        """Each leaf's sum of squares of a layer's summed gradient (the pieces of ``grad_norm``)."""
        if self.shard_state:
            return split_leaf_squares(self.layer_specs(layer)[0], grads)
        return leaf_squares(grads)

    # -- sharded state: one PartitionSpec per leaf (placement.shard_spec), per layer -------------------
    def layer_specs(self, layer):
        """``(params specs, optimizer state specs)`` of one layer: trees of ``PartitionSpec`` matching its
        params and its optax state (``P()`` for a replicated leaf), from the shapes alone. Without
        ``shard_state`` both are ``P()`` (a prefix: everything replicated)."""
        if not self.shard_state:
            return _R, _R
        key = id(layer)
        if key not in self._specs:
            n = self.num_devices
            shapes = self._own_shapes(layer)  # (a tied leaf is its owner's: split there)
            opt = jax.eval_shape(self.tx.init, shapes)
            spec = lambda x: shard_spec(x.shape, n)  # noqa: E731
            self._specs[key] = (jax.tree.map(spec, shapes), jax.tree.map(spec, opt))
        return self._specs[key]

    def _group_specs(self, layer, count: int = 1):
        """`layer_specs` of a group: a stacked run's specs have the leading layer axis unsplit."""
        specs = self.layer_specs(layer)
        if count == 1 or not self.shard_state:
            return specs
        return tuple(jax.tree.map(lambda p: P(None, *p) if spec_axis(p) is not None else _R, t) for t in specs)

    def _own_shapes(self, layer):
        """A layer's params' shapes as this trainer holds them: a tied user's (the head's) without its tied
        leaves (`Model.param_shapes`), every other layer's own."""
        last = len(self.model.layers) - 1
        if layer is self.model.layers[last] and self.model.ties_of(last):
            return self.model.param_shapes()[last]
        return layer.param_shapes

    def _merged_specs(self, layer):
        """The specs of a tied user's params with its tied leaves put back (`Model.merge_tied`: an
        evaluation's head): each leaf split as its owner's is (the same shape, the same spec)."""
        key = ("merged", id(layer))
        if key not in self._specs:
            n = self.num_devices
            self._specs[key] = jax.tree.map(lambda x: shard_spec(x.shape, n), layer.param_shapes)
        return self._specs[key]

    def _tied_user(self, layer, params) -> bool:
        """Whether ``params`` are a tied user's with its tied leaves put back (with ``shard_state``)."""
        return (self.shard_state and bool(self.model.ties) and layer is self.model.layers[-1]
                and jax.tree.structure(params) != jax.tree.structure(self._own_shapes(layer)))

    def _param_specs(self, layer, leading: int = 0):
        last = len(self.model.layers) - 1
        if self.shard_state and not leading and layer is self.model.layers[last] and self.model.ties_of(last):
            return self._merged_specs(layer)  # (the evaluation's head takes its tied leaves put back)
        return self._group_specs(layer, 1 + leading)[0]

    def _whole(self, layer, params):
        if not self.shard_state:
            return params
        specs = self._merged_specs(layer) if self._tied_user(layer, params) else self.layer_specs(layer)[0]
        return gather_params(params, specs)

    def _grad_specs(self, layer):
        """Where the gradients' sum goes (``reduce_grads``): None (every device) or this layer's specs."""
        return self.layer_specs(layer)[0] if self.shard_state else None

    @property
    def _across(self):
        return DATA_AXIS if self.shard_state else None

    def shard_summary(self) -> str:
        """One line: how many leaves of the weights and optimizer state are split over the devices, their
        share of the bytes, and which leaves stay replicated (too small or no divisible axis)."""
        split = kept = split_bytes = total = 0
        small = set()
        for layer in self.model.layers:
            shapes = self._own_shapes(layer)
            trees = (shapes, jax.eval_shape(self.tx.init, shapes))
            for tree, specs in zip(trees, self.layer_specs(layer)):
                for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(specs)):
                    nbytes = int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
                    total += nbytes
                    if spec_axis(spec) is None:
                        kept += 1
                        if x.shape:
                            small.add(jax.tree_util.keystr(path[-1:]).strip("[]'"))
                    else:
                        split += 1
                        split_bytes += nbytes
        names = ", ".join(sorted(small)[:6]) + (", ..." if len(small) > 6 else "")
        n = self.num_devices
        if n == 1:
            return (f"shard_state: one device, nothing to split ({total / 2**20:.1f} MiB of weights and optimizer "
                    "state held whole)")
        return (f"shard_state: {split} leaves of weights and optimizer state split over {n} devices "
                f"({100 * split_bytes / max(total, 1):.1f}% of {total / 2**20:.1f} MiB), {kept} replicated "
                f"(too small or no axis divisible by {n}{': ' + names if names else ''})")

    # -- placement -------------------------------------------------------------------------------
    # Outside a program: one ``jax.device_put`` per tree (JAX moves every leaf in one batched call).
    def _act_to_host(self, tree):
        if not self.offload:
            return tree
        return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind(HOST_MEMORY), tree))

    def _act_to_device(self, tree):
        if not self.offload:
            return tree
        return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind(DEVICE_MEMORY), tree))

    def _fetch(self, tree):
        """A single layer's params on the device, whole (a copy from host memory with offload; gathered
        from the devices' pieces with ``shard_state``)."""
        if isinstance(tree, disk_tier.DiskLayer):  # the disk tier: the weights read from the layer's file
            return disk_tier.read_tree(tree.path, tree.layout, "params", placer(self.mesh))
        if not self.offload and not self.shard_state:
            return tree
        return jax.device_put(tree, replicated(self.mesh, DEVICE_MEMORY))

    def _streamed(self, grouped: Stacked, plan, ts: TrainState, deferred: tuple | None = None):
        """The step's ``(params, opt_state)`` lists: the groups' own, or with a streamed tier the views of a
        `streaming.StepStream` that fetches each layer ahead and writes each update back. The host store lets
        go of each layer's old state (``ts`` is consumed, as donation consumes the device tier's) once its new
        one is written: the state is replaced layer by layer, never held twice. ``deferred = (passes, the tied
        leaves' owners' groups)``: a deferred-update step's `streaming.DeferredStream`, whose gradient buffers
        are the third view returned."""
        if not self.residency.streamed:
            return list(grouped.params), list(grouped.opt_state)
        store = self.residency.store
        held = [grouped.params, grouped.opt_state] + list(ts.held()[:2])

        def release(g):
            for entries in held:
                entries[g] = None

        refs, place = store.refs(grouped.params, grouped.opt_state), placer(self.mesh, self.shard_state)
        release = None if self.on_disk else release
        if deferred is None:
            self._stream = store.stream(refs, ts.step + 1, train_schedule(plan.kinds), place, release=release)
            return self._stream.params, self._stream.opt_state
        passes, owners = deferred
        shapes = self.model.param_shapes()
        self._stream = store.deferred_stream(refs, ts.step + 1, place, plan.kinds, self.microbatches, passes, owners,
                                             shapes, release=release)
        return self._stream.params, self._stream.opt_state, self._stream.grads

    def _stored(self, params, opt_state):
        """The step's updated ``(params, opt_state)`` lists: as they are, or with a streamed tier the new refs
        of each group once every write is done (the disk tier's `disk_tier.DiskLayer`, the host tier's trees)."""
        if not self.residency.streamed:
            return params, opt_state
        stream, self._stream = self._stream, None
        refs = stream.finish()
        self._limit.clear()
        self.disk_stats = stream.stats()
        return self.residency.store.state(refs)

    def _eval_grouped(self, grouped: Stacked) -> Stacked:
        if not self.residency.streamed:
            return grouped
        store = self.residency.store
        reader = store.reader(store.refs(grouped.params, grouped.opt_state), placer(self.mesh, self.shard_state))
        return Stacked(grouped.groups, reader.params, grouped.opt_state, grouped.layer_state)

    def tied_params(self, grouped: Stacked, g: int):
        """`TrainerBase.tied_params`; with the disk tier only the tied leaves' owners' weights are read
        (every layer a group of its own), not every layer's."""
        start = grouped.groups[g][0]
        if not self.on_disk or not self.model.ties_of(start):
            return super().tied_params(grouped, g)
        owners = {t.owner: grouped.params[t.owner] for t in self.model.ties_of(start)}
        return self.model.merge_tied(start, grouped.params[g], owners)

    def layer_params(self, ts: TrainState, i: int):
        """`TrainerBase.layer_params`; with the disk tier a tied leaf is read from its owner's file."""
        if not self.on_disk or not self.model.ties_of(i):
            return super().layer_params(ts, i)
        owners = {t.owner: self._fetch(ts.params[t.owner]) for t in self.model.ties_of(i)}
        return self.model.merge_tied(i, self._fetch(ts.params[i]), owners)

    def init(self) -> TrainState:
        """Initial state, replicated or split over the devices (``shard_state``), in host memory when
        offloading, in this trainer's layout: per layer, or with runs of identical layers stacked
        (``scan_layers``).

        Built one layer at a time (`Residency.place_tree`, `Residency.place_stacked`): each layer's initial values are made (a lazy
        model makes them on demand), its optimizer state initialised on them, both placed where they live and
        the numpy copies dropped, so host memory holds one copy of the state plus one layer's (or one stacked
        leaf's) values."""
        residency = self.residency
        if self.on_disk:  # each layer written to its file as it is made (`disk_tier.init_layers`)
            refs, states = disk_tier.init_layers(self)
            return TrainState(0, refs, list(refs), states)
        params, opt_state, layer_state = [], [], []
        for start, count in self.groups:
            pspec, ospec = self._group_specs(self.model.layers[start], count)
            pspec, ospec = (None if isinstance(spec, P) else spec for spec in (pspec, ospec))
            if count == 1:
                p, s = self.model.init_layer(start)
                opt_state.append(residency.place_tree(jax.tree.map(np.array, self.tx.init(p)), ospec))
                params.append(residency.place_tree(p, pspec))
                layer_state.append(self.replicate(s))
                del p, s
                continue
            ps, opts, states = HostStack(count), HostStack(count), []
            for j in range(count):
                p, s = self.model.init_layer(start + j)
                opts.put(j, self.tx.init(p))
                ps.put(j, p)
                states.append(s)
                del p
            params.append(residency.place_stacked(ps, pspec))
            opt_state.append(residency.place_stacked(opts, ospec))
            layer_state.append(self.replicate(jax.tree.map(lambda *v: np.stack(v), *states)))
        return self._state(0, Stacked(self.groups, params, opt_state, layer_state))

    def abstract_state(self) -> TrainState:
        """The per-layer state as ``jax.ShapeDtypeStruct`` leaves with the shardings (and memory kind) `init`
        gives them: a checkpoint is restored straight into place from it, without building a state first."""
        residency, params, opt_state = self.residency, [], []
        shapes = self.model.param_shapes()
        if self.on_disk:  # templates of the layer files (`revtrain.checkpoint` restores a disk state into them)
            params = disk_tier.template_layers(self)
            opt_state = list(params)
        for i, layer in enumerate(self.model.layers if not self.on_disk else ()):
            pspec, ospec = self.layer_specs(layer)
            opt = jax.eval_shape(self.tx.init, shapes[i])
            params.append(residency.abstract(shapes[i], None if isinstance(pspec, P) else pspec))
            opt_state.append(residency.abstract(opt, None if isinstance(ospec, P) else ospec))
        rep = replicated(self.mesh)
        states = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), s)
                  for s in self.model.state_shapes()]
        return TrainState(0, params, opt_state, states)

    def _state(self, step: int, grouped: Stacked) -> TrainState:
        """A `TrainState` of ``grouped``: per layer when nothing is stacked, else the stacked layout."""
        if all(count == 1 for _, count in grouped.groups):
            return TrainState(step, grouped.params, grouped.opt_state, grouped.layer_state)
        return TrainState(step, stacked=grouped)

    def _working(self, ts: TrainState) -> Stacked:
        """``ts`` in this trainer's layout. A state in another layout (a restored checkpoint, a state of the
        other executor) is regrouped once; its arrays are given up as they are copied."""
        if ts.stacked is not None and ts.stacked.groups == self.groups:
            return ts.stacked
        lists = ts.stacked.per_layer() if ts.stacked is not None else (ts.params, ts.opt_state, ts.layer_state)
        return Stacked.from_per_layer(self.groups, *lists, consume=True)

    # -- the per-layer fused functions (run inside shard_map over "data") ---------------------------
    # With shard_state each takes the local pieces of its layer's weights and optimizer state: the weights
    # are gathered whole at entry (`_whole`), the gradients reduce-scattered back to pieces (``specs``), and
    # the update runs on the pieces.
    def _forward(self, layer, params, state, x, skey, index):
        """The forward of a rebuilt block (the rebuild mode's: `_fenced` ones also return residuals)."""
        keys = example_keys(skey, index, batch_size_of(x))
        return self.rebuild_mode.forward(layer, self._whole(layer, params), state, x, keys)

    def _forward_kept(self, layer, params, state, x, skey, index):
        """The forward of a block whose input is kept (a standard layer, a remat block)."""
        keys = example_keys(skey, index, batch_size_of(x))
        return REMAT.forward(layer, self._whole(layer, params), state, x, keys)

    def _fenced(self, layer) -> bool:
        """Whether ``layer``'s forward is `ReversibleLayer.apply_fenced` (the fused rebuild's forward): its
        programs output the residuals too, and the trainer drops them (`_dropping`)."""
        return self.rebuild_mode.outputs_residuals(layer)

    @staticmethod
    def _dropping(program):
        return _Dropping(program)

    # The gradient halves, shared with `revtrain check`: gradients are summed over devices ("data"), or
    # reduce-scattered to the pieces of ``specs`` (`reduce_grads`).
    @staticmethod
    def head_grads(layer, params, state, x, batch, keys, specs=None):
        """Loss and ``vjp`` of the head: returns ``(mean loss, grads, dx, stats, new_state, total weight)``."""
        def objective(p, x):
            loss_sum, stats, new_state = layer.loss(p, state, x, batch, keys, True)
            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
            return loss_sum / total, (stats, new_state, total)

        obj, vjp_fn, (stats, new_state, total) = jax.vjp(objective, per_device(params), x, has_aux=True)
        grads, dx = vjp_fn(jnp.ones_like(obj))
        return obj, reduce_grads(grads, specs), dx, stats, new_state, total

    @staticmethod
    def top_head_grads(tops, head, top_params, top_states, head_params, head_state, x, batch, top_keys, head_keys,
                       top_specs=None, head_specs=None, top_modes=None, top_counts=None):
        """`head_grads` through the blocks ``tops`` under the head (bottom first) run in its program, from the
        lowest one's input ``x``: one ``vjp`` of the head's loss of their output with respect to (every top
        block's params, the head's params, ``x``), each block's forward its mode's (``top_modes``:
        `modes.Backprop` or `modes.Checkpoint` per block; None: all backprop). ``top_params``,
        ``top_states``, ``top_keys``, ``top_specs`` (None or one per block) are sequences like ``tops``.
        ``top_counts`` (None: all 1): an entry ``c > 1`` makes that entry a stacked run of ``c`` identical
        checkpoint blocks (its params, states and keys with a leading layer axis), run as one ``lax.scan``.
        Returns ``(mean loss, top grads (a tuple), head grads, dx, stats, new top states (a tuple), new head
        state, total weight)``, gradients summed over devices (reduce-scattered with the specs)."""
        top_modes = top_modes or (BACKPROP,) * len(tops)
        top_counts = top_counts or (1,) * len(tops)

        def objective(tps, hp, x):
            x, new_states = forward_in_head(tops, top_modes, top_counts, tps, top_states, x, top_keys)
            loss_sum, stats, new_head_state = head.loss(hp, head_state, x, batch, head_keys, True)
            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
            return loss_sum / total, (stats, new_states, new_head_state, total)

        obj, vjp_fn, (stats, new_top_states, new_head_state, total) = jax.vjp(
            objective, tuple(per_device(p) for p in top_params), per_device(head_params), x, has_aux=True)
        top_grads, head_grads, dx = vjp_fn(jnp.ones_like(obj))
        top_specs = top_specs or (None,) * len(tops)
        return (obj, tuple(reduce_grads(g, sp) for g, sp in zip(top_grads, top_specs)),
                reduce_grads(head_grads, head_specs), dx, stats, new_top_states, new_head_state, total)

    @staticmethod
    def reverse_grads(layer, params, state, y, dy, keys, specs=None, rebuild: str = "exact"):
        """Rebuilds a reversible layer's input from its output ``y`` and takes the ``vjp`` there with the
        given weights (the rebuild mode's `modes.Rebuild.grads`): returns
        ``(x, dx, grads)``, gradients summed over devices (reduce-scattered to the local pieces with
        ``specs``, see ``reduce_grads``). ``rebuild``: a name of ``REBUILD_MODES``."""
        return REBUILDS[rebuild].grads(layer, params, state, y, dy, keys, specs)

    @staticmethod
    def recompute_grads(layer, params, state, x, dy, keys, specs=None):
        """Recomputes a layer from its kept input under ``vjp`` (`modes.Remat.grads`): returns ``(dx,
        grads)``; ``dx`` is None for integer inputs (token ids have no cotangent)."""
        return REMAT.grads(layer, params, state, x, dy, keys, specs)[1:]

    def _block_grads(self, mode, layer, params, state, start, dy, keys):
        return mode.grads(layer, self._whole(layer, params), state, start, dy, keys, self._grad_specs(layer))

    def _head(self, layer, params, opt_state, state, x, batch, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        obj, grads, dx, stats, new_state, total = self.head_grads(layer, self._whole(layer, params), state, x, batch,
                                                                  keys, self._grad_specs(layer))
        loss = lax.psum(obj, DATA_AXIS)  # the global mean (identical on every device)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params, ok=jnp.isfinite(loss),
                                                     across=self._across)
        metrics = {"loss": loss, "accuracy": lax.psum(stats["correct"], DATA_AXIS) / total}
        return dx, new_params, new_opt, new_state, metrics, finite, self._sq(layer, grads)

    def _top_grads(self, layers, top_params, top_states, head_params, head_state, x, batch, ctx, top_index,
                   head_index):
        """`top_head_grads` of the trainer's layers (``layers = (tops, head, top modes)``), its weights gathered
        whole."""
        tops, head, modes, counts = layers
        n = batch_size_of(x)
        keys = [example_keys(ctx, i, n) if c == 1 else jnp.stack([example_keys(ctx, i + j, n) for j in range(c)])
                for i, c in zip(top_index, counts)]
        return self.top_head_grads(
            tops, head, [self._whole(t, p) for t, p in zip(tops, top_params)], top_states,
            self._whole(head, head_params), head_state, x, batch, keys, example_keys(ctx, head_index, n),
            [self._grad_specs(t) for t in tops], self._grad_specs(head), modes, counts)

    def _top_head(self, layers, top_params, top_opt, top_states, head_params, head_opt, head_state, x, batch, skey,
                  top_index, head_index):
        """`_head` through the blocks under it in its program (tuples ``top_*``, bottom first): loss, one vjp,
        every block's update."""
        tops, head, _, counts = layers
        obj, top_grads, head_grads, dx, stats, new_top_states, new_head_state, total = self._top_grads(
            layers, top_params, top_states, head_params, head_state, x, batch, skey, top_index, head_index)
        loss = lax.psum(obj, DATA_AXIS)
        new_head, new_head_opt, head_finite = guarded_update(self.tx, head_grads, head_opt, head_params,
                                                             ok=jnp.isfinite(loss), across=self._across)
        new_top, new_top_opt, top_finite, top_sq = [], [], [], []
        for t, g, o, p, c in zip(tops, top_grads, top_opt, top_params, counts):
            if c > 1:
                new_p, new_o, fin, sq = self._stacked_update(t, g, o, p)
            else:
                (new_p, new_o, fin), sq = guarded_update(self.tx, g, o, p, across=self._across), self._sq(t, g)
            new_top.append(new_p), new_top_opt.append(new_o), top_finite.append(fin), top_sq.append(sq)
        metrics = {"loss": loss, "accuracy": lax.psum(stats["correct"], DATA_AXIS) / total}
        return (dx, tuple(new_top), tuple(new_top_opt), new_top_states, new_head, new_head_opt, new_head_state,
                metrics, tuple(top_finite), head_finite, tuple(top_sq), self._sq(head, head_grads))

    def _stacked_update(self, layer, grads, opt_state, params):
        """The update of a stacked run of layers (the checkpoint blocks of the head's program) from its
        stacked gradients. Returns ``(params, optimizer state, finite [count], squares [count])``.

        Each layer's optimizer state holds the same scalars (a step count) as long as every layer of the
        run was updated every step; then one optax update of the whole stacked tree, each stacked scalar
        given once, is each layer's update bit for bit (the scanned standard trainer's form; an update that
        slices each layer out of the stacks rounded differently on XLA:CPU, where a leaf's fused loops
        follow the producers around it). Taking a stacked scalar's first value is exact because the program
        checks that all its values are equal (a scalar parameter's moments included). The whole run is then
        kept or skipped together (one ``finite`` flag). Where they differ (a layer skipped alone in another
        layout), each layer is updated on its own, one after another (a ``lax.scan`` writing each slice in
        place).
        """
        count = jax.tree.leaves(params)[0].shape[0]
        scalar = lambda a: a.ndim == 1  # noqa: E731  (one value per layer)
        squares = jax.vmap(lambda g: self._sq(layer, g))(grads)

        def whole():
            first = jax.tree.map(lambda a: a[0] if scalar(a) else a, opt_state)
            new_p, new_o, finite = guarded_update(self.tx, grads, first, params, across=self._across)
            new_o = jax.tree.map(lambda a, b: jnp.broadcast_to(b, a.shape) if scalar(a) else b, opt_state, new_o)
            return new_p, new_o, jnp.broadcast_to(finite, (count,))

        def each():
            def body(stacks, j):
                p, o, g = jax.tree.map(lambda a: a[j], (*stacks, grads))
                new_p, new_o, finite = guarded_update(self.tx, g, o, p, across=self._across)
                stacks = jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, j, 0), stacks,
                                      (new_p, new_o))
                return stacks, finite

            (new_p, new_o), finite = lax.scan(body, (params, opt_state), jnp.arange(count, dtype=jnp.int32))
            return new_p, new_o, finite

        same = jnp.all(jnp.array([jnp.all(a == a[0]) for a in jax.tree.leaves(opt_state) if scalar(a)] or [True]))
        return (*lax.cond(same, whole, each), squares)

    def _reverse_and_update(self, layer, params, opt_state, state, y, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(y))
        x, dx, grads = self._block_grads(self.rebuild_mode, layer, params, state, y, dy, keys)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params, branch=self._branch,
                                                     across=self._across)
        return x, dx, new_params, new_opt, finite, self._sq(layer, grads)

    def _recompute_and_update(self, layer, params, opt_state, state, x, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        _, dx, grads = self._block_grads(REMAT, layer, params, state, x, dy, keys)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params, branch=self._branch,
                                                     across=self._across)
        return dx, new_params, new_opt, finite, self._sq(layer, grads)

    # -- the scanned runs (inside shard_map over "data"; stacked trees have a leading layer axis) -----
    def _forward_run(self, layer, params, states, x, skey, start):
        """The forward of ``count`` identical layers: one ``lax.scan``; returns ``(x, new states)``."""
        count = jax.tree.leaves(params)[0].shape[0]
        steps = jnp.arange(count, dtype=jnp.int32)
        if self._fenced(layer):  # the residuals of the last layer are carried out (see `_fenced`)
            return self._fenced_run(layer, params, states, x, skey, start, steps)

        def body(x, slices):
            p, s, j = slices
            return self._forward(layer, p, s, x, skey, start + j)

        return lax.scan(body, x, (params, states, steps))

    def _fenced_run(self, layer, params, states, x, skey, start, steps):
        """`_forward_run` with fenced forwards (`_fenced`): each iteration writes its layer's residuals into
        the carry, and the last layer's are the program's third result, so XLA keeps their computation."""
        first = jax.tree.map(lambda a: a[0], (params, states))
        shapes = jax.eval_shape(lambda p, s, x: self._forward(layer, p, s, x, skey, start)[2], *first, x)
        res = per_device(jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), shapes))

        def body(carry, slices):
            p, s, j = slices
            x, new_state, res = self._forward(layer, p, s, carry[0], skey, start + j)
            return (x, res), new_state

        (x, res), new_states = lax.scan(body, (x, res), (params, states, steps))
        return x, new_states, res

    def _reverse_run(self, layer, params, opt_state, states, y, dy, skey, start):
        """``_reverse_and_update`` of every layer of a stacked run, last first: one reverse ``lax.scan``.

        The stacks are carried and each slice is written back in place (``dynamic_update_slice``); the next
        slice is read from the updated stack after the write, so no read of the stack is left unordered with
        a write and XLA keeps one copy of it (it would copy the whole stack every iteration otherwise).
        Returns ``(x, dx, new params, new optimizer state, finite [count])``.
        """
        count = jax.tree.leaves(params)[0].shape[0]

        def body(carry, slices):
            stacks, y, dy, (p, o) = carry
            s, j = slices
            x, dx, p, o, finite, sq = self._reverse_and_update(layer, p, o, s, y, dy, skey, start + j)
            stacks = jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, j, 0), stacks, (p, o))
            return (stacks, x, dx, _slice(stacks, jnp.maximum(j - 1, 0))), (finite, sq)

        stacks = (params, opt_state)
        carry = (stacks, y, dy, _slice(stacks, count - 1))
        (stacks, x, dx, _), (finite, sq) = lax.scan(body, carry, (states, jnp.arange(count, dtype=jnp.int32)),
                                                    reverse=True)
        return x, dx, stacks[0], stacks[1], finite, sq

    def _remat_forward_run(self, layer, params, states, x, skey, start):
        """The forward of a rematerialised run of identical blocks: one ``lax.scan`` that keeps each block's
        input. Returns ``(x, new states, inputs)``, ``inputs`` stacked along a leading layer axis."""
        count = jax.tree.leaves(params)[0].shape[0]

        def body(x, slices):
            p, s, j = slices
            y, new_state = self._forward_kept(layer, p, s, x, skey, start + j)
            return y, (new_state, x)

        x, (new_states, inputs) = lax.scan(body, x, (params, states, jnp.arange(count, dtype=jnp.int32)))
        return x, new_states, inputs

    def _remat_backward_run(self, layer, params, opt_state, states, inputs, dy, skey, start):
        """``_recompute_and_update`` of every block of a rematerialised run from its kept input (``inputs``,
        stacked), last first: one reverse ``lax.scan`` writing each slice of the stacks back in place (as
        `_reverse_run`). Returns ``(dx, the run's first input, new params, new optimizer state, finite
        [count], squares [count])``: the first input is the output the block below rebuilds from."""
        count = jax.tree.leaves(params)[0].shape[0]

        def body(carry, slices):
            stacks, dy = carry
            s, x, j = slices
            p, o = jax.tree.map(lambda a: a[j], stacks)
            dx, p, o, finite, sq = self._recompute_and_update(layer, p, o, s, x, dy, skey, start + j)
            stacks = jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, j, 0), stacks, (p, o))
            return (stacks, dx), (finite, sq)

        first = jax.tree.map(lambda a: a[0], inputs)
        ((params, opt_state), dx), (finite, sq) = lax.scan(
            body, ((params, opt_state), dy), (states, inputs, jnp.arange(count, dtype=jnp.int32)), reverse=True)
        return dx, first, params, opt_state, finite, sq

    # Per-layer programs, by name (`modes.ProgramSpec`; each mode's ``program_kinds`` name its own).
    _PER_LAYER = {
        "forward_rev": ProgramSpec("_forward", (_R, _R, _D, _R, _R), (_D, _R), (2,), (0,), ()),
        "forward_std": ProgramSpec("_forward_kept", (_R, _R, _D, _R, _R), (_D, _R), (), (0,), ()),
        "head": ProgramSpec("_head", (_R, _R, _R, _D, _D, _R, _R), (_D, _R, _R, _R, _R, _R, _R), (0, 1), (0, 1),
                            (1, 2)),
        "reverse": ProgramSpec("_reverse_and_update", (_R, _R, _R, _D, _D, _R, _R), (_D, _D, _R, _R, _R, _R),
                               (0, 1, 3, 4), (0, 1), (2, 3)),
        "recompute": ProgramSpec("_recompute_and_update", (_R, _R, _R, _D, _D, _R, _R), (_D, _R, _R, _R, _R),
                                 (0, 1, 4), (0, 1), (1, 2)),
    }

    def _with_specs(self, specs: tuple, positions: tuple, state_specs: tuple) -> tuple:
        """``specs`` with the entries at ``positions`` (params, then optimizer state) set to ``state_specs``."""
        specs = list(specs)
        for i, spec in zip(positions, state_specs):
            specs[i] = spec
        return tuple(specs)

    def _fn(self, kind, layer):
        """The compiled per-layer program ``kind`` (a name of ``_PER_LAYER``) of ``layer``."""
        name, in_specs, out_specs, donate, inputs, outputs = self._PER_LAYER[kind]
        fn = getattr(self, name)
        state_specs = self.layer_specs(layer)
        in_specs = self._with_specs(in_specs, inputs, state_specs)
        out_specs = self._with_specs(out_specs, outputs, state_specs)
        if kind == "forward_rev" and self._fenced(layer):
            return self._dropping(self._per_layer_compiled(kind, layer, fn, in_specs, out_specs + (_D,), donate))
        return self._per_layer_compiled(kind, layer, fn, in_specs, out_specs, donate)

    def _per_layer_compiled(self, kind, layer, fn, in_specs, out_specs, donate):
        """``fn`` compiled. Activations (split over "data") are donated only where a result reuses them: a
        recomputed layer of token ids has no input cotangent for its output cotangent to become
        (`common._UsedDonation`)."""
        donate, maybe = (tuple(i for i in donate if in_specs[i] != _D or kind not in self._MAYBE_DONATED),
                         tuple(i for i in donate if in_specs[i] == _D and kind in self._MAYBE_DONATED))
        return self._compiled(kind, layer, fn, in_specs, out_specs, donate=donate, donate_if_used=maybe)

    _MAYBE_DONATED = ("recompute", "recompute_acc")  # programs of a layer whose input may be token ids

    def _top_specs(self, tops, head, counts=None):
        """(top params specs, top optimizer state specs) as tuples over ``tops``, and the head's."""
        top_specs = tuple(self._group_specs(t, c) for t, c in zip(tops, counts or (1,) * len(tops)))
        return (tuple(p for p, _ in top_specs), tuple(o for _, o in top_specs)), self.layer_specs(head)

    def _top_head_fn(self, tops, head, modes=None, counts=None):
        """The compiled `_top_head` of the groups ``tops`` (a tuple of layers, bottom first) in the head's
        program, each run in its mode of ``modes`` (None: backprop), ``counts`` blocks each (None: one; more:
        a stacked run of checkpoint blocks), and ``head``."""
        modes = tuple(modes or (BACKPROP,) * len(tops))
        counts = tuple(counts or (1,) * len(tops))
        in_specs = (_R, _R, _R, _R, _R, _R, _D, _D, _R, _R, _R)
        out_specs = (_D, _R, _R, _R, _R, _R, _R, _R, _R, _R, _R, _R)
        top_specs, head_specs = self._top_specs(tops, head, counts)
        in_specs = self._with_specs(self._with_specs(in_specs, (0, 1), top_specs), (3, 4), head_specs)
        out_specs = self._with_specs(self._with_specs(out_specs, (1, 2), top_specs), (4, 5), head_specs)
        # x is not donated: it is the output the layer below rebuilds its input from.
        return self._per_layer_compiled("top_head", (tops, head, modes, counts), self._top_head, in_specs,
                                        out_specs, (0, 1, 3, 4))

    def _run_fn(self, kind, layer, count):
        """The compiled scan over a run of ``count`` layers like ``layer`` (runs of equal length share it)."""
        key = (kind, layer, count)
        pspec, ospec = self._group_specs(layer, count)
        if kind == "forward_run":
            if self._fenced(layer):
                return self._dropping(self._compiled(kind, layer, self._forward_run, (pspec, _R, _D, _R, _R),
                                                     (_D, _R, _D), donate=(2,), key=key))
            return self._compiled(kind, layer, self._forward_run, (pspec, _R, _D, _R, _R), (_D, _R), donate=(2,),
                                  key=key)
        if kind == "reverse_run":
            return self._compiled(kind, layer, self._reverse_run, (pspec, ospec, _R, _D, _D, _R, _R),
                                  (_D, _D, pspec, ospec, _R, _R), donate=(0, 1, 3, 4), key=key)
        if kind == "remat_forward_run":
            return self._compiled(kind, layer, self._remat_forward_run, (pspec, _R, _D, _R, _R), (_D, _R, _SD),
                                  key=key)  # (x is copied into the stack: nothing to donate)
        if kind == "remat_backward_run":
            return self._compiled(kind, layer, self._remat_backward_run, (pspec, ospec, _R, _SD, _D, _R, _R),
                                  (_D, _D, pspec, ospec, _R, _R), donate=(0, 1, 4), key=key)
        raise KeyError(kind)

    def _plan(self, groups) -> "_Plan":
        """The compiled functions of every group, looked up once per layout and block modes (not per call)."""
        key = (groups, tuple(self.block_modes))
        plan = self._plans.get(key)
        if plan is None:
            layers, acc, blocks = self.model.layers, self.deferred, []
            top = 0  # the groups in the head's program (singles, or stacked runs of checkpoint blocks)
            while top < len(groups) - 1 and self.block_modes[groups[-2 - top][0]].kind is StepKind.TOP:
                top += 1
            below = len(groups) - 1 - top  # the groups with programs of their own
            for start, count in groups[:below]:
                layer, mode = layers[start], self.block_modes[start]
                forward_kind, backward_kind, acc_kind = mode.program_kinds
                if count > 1 and mode.keeps_input:  # (`_scans`: the fused update only)
                    blocks.append(_Block(StepKind.RUN, mode, self._run_fn("remat_forward_run", layer, count),
                                         self._run_fn("remat_backward_run", layer, count), np.int32(start)))
                elif count > 1:
                    blocks.append(_Block(StepKind.RUN, mode, self._run_fn("forward_run", layer, count),
                                         self._acc_run_fn(layer, count) if acc else
                                         self._run_fn("reverse_run", layer, count), np.int32(start)))
                else:
                    blocks.append(_Block(mode.kind, mode, self._fn(forward_kind, layer),
                                         self._acc_fn(acc_kind, layer) if acc else self._fn(backward_kind, layer),
                                         np.int32(start)))
            for start, _ in groups[below:-1]:
                blocks.append(_Block(StepKind.TOP, self.block_modes[start], None, None, np.int32(start)))
            if top:
                tops = tuple(layers[s] for s, _ in groups[below:-1])
                modes = tuple(self.block_modes[s] for s, _ in groups[below:-1])
                counts = tuple(c for _, c in groups[below:-1])
                head = (self._top_head_acc_fn(tops, layers[-1], modes) if acc else
                        self._top_head_fn(tops, layers[-1], modes, counts))
            else:
                head = self._acc_fn("head_acc", layers[-1]) if acc else self._fn("head", layers[-1])
            blocks.append(_Block(StepKind.HEAD, None, head, None, np.int32(groups[-1][0])))
            plan = self._plans[key] = _Plan(blocks)
        return plan

    # -- the walk: one forward and one backward over the plan's blocks ---------------------------------
    def _walk(self, plan: "_Plan", params: list, slot: list, states, new_states: list, x, ctx, head, store) -> None:
        """One forward and backward pass over the plan (the fused step and the deferred one alike).

        Forward: each group below the head's program runs its forward program (keeping its input when its
        mode does: `modes.BackwardMode.keeps_input`, in host memory with offload). ``head(x)`` runs the
        head's program (with the backprop blocks) and returns the cotangent of its input. Backward, newest
        first: each group's backward program takes ``(params, slot, state, start, dy, ctx, index)``, ``slot``
        being the optimizer state (fused update) or the gradient buffer (deferred), ``start`` the output a
        rebuild starts from or the kept input; ``store(g, results)`` takes the program's results after the
        activations (updated params and state, finite flags and squares; or the buffer)."""
        blocks, kept = plan.blocks, {}
        below = len(blocks) - 1 - plan.top
        for g in range(below):
            block = blocks[g]
            if block.kind is StepKind.RUN and block.mode.keeps_input:  # the run's scan keeps its inputs
                x, new_states[g], kept[g] = block.forward(params[g], states[g], x, ctx, block.index)
                continue
            if block.mode.keeps_input:
                kept[g] = self._act_to_host(x)
            x, new_states[g] = block.forward(params[g], states[g], x, ctx, block.index)
        dy = head(x)
        y = x
        for g in range(below - 1, -1, -1):
            block = blocks[g]
            if block.kind is StepKind.RUN and block.mode.keeps_input:  # (its first input comes back as y)
                dy, y, *rest = block.backward(params[g], slot[g], states[g], kept.pop(g), dy, ctx, block.index)
            elif block.mode.keeps_input:  # recomputed from its kept input; the walk goes on from that input
                xs = self._act_to_device(kept.pop(g))
                out = block.backward(params[g], slot[g], states[g], xs, dy, ctx, block.index)
                dy, rest, y = out[0], out[1:], xs
            else:
                y, dy, *rest = block.backward(params[g], slot[g], states[g], y, dy, ctx, block.index)
            store(g, rest)

    # -- one step --------------------------------------------------------------------------------
    def train_step(self, ts: TrainState, batch: dict):
        """One reversible training step.

        Args:
          ts: the state (consumed: its device buffers are donated), in either layout.
          batch: dict of global arrays split over ``"data"`` (input key, ``targets``, optional ``weights``).

        Returns:
          ``(new_state, metrics)``; metrics are replicated float32 scalars ``loss`` (mean over the global
          batch, nats) and ``accuracy``.

        Raises:
          TrainerError: the batch size is not divisible by the number of devices (and each device's share by
            the number of microbatches); a ``memory_budget`` below the least this step needs.
          NonFiniteError: a non-finite loss or gradient (its ``state`` skips the non-finite updates; with
            deferred updates no layer is updated).
        """
        check_batch(batch, self.num_devices, self.microbatches)
        if self.memory_budget is not None and self.budget_plan is None:
            self.plan_budget(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch))
        if self.deferred:
            return self._deferred_step(ts, batch)
        grouped = self._working(ts)
        plan = self._plan(grouped.groups)
        index, last, top = plan.index, len(plan.blocks) - 1, plan.top
        skey = step_key(self.seed, ts.step)
        params, opt_state = self._streamed(grouped, plan, ts)  # (a streamed tier: fetched ahead, written back)
        states = grouped.layer_state
        new_states = list(states)
        finite, sq = [None] * (last + 1), [None] * (last + 1)
        out = {}

        # With a streamed tier each access of ``params[g]`` / ``opt_state[g]`` takes the layer the engine
        # fetched ahead, and each store hands the update to its writer; the dispatch limiter keeps at most
        # `streaming.IN_FLIGHT` programs ahead of the device. Otherwise the loop never waits: the step's one
        # host sync is the final check of non-finite values.
        def head(x):
            # Loss, vjp and update in one call (through the backprop blocks under the head).
            if top:
                t = slice(last - top, last)
                (dy, tp, to, ts_, params[last], opt_state[last], new_states[last], out["metrics"], tf, finite[last],
                 tsq, sq[last]) = plan.head(
                    tuple(params[t]), tuple(opt_state[t]), tuple(states[t]), params[last], opt_state[last],
                    states[last], x, batch, skey, tuple(index[t]), index[last])
                params[t], opt_state[t], new_states[t], finite[t], sq[t] = tp, to, ts_, tf, tsq
            else:
                dy, params[last], opt_state[last], new_states[last], out["metrics"], finite[last], sq[last] = \
                    plan.head(params[last], opt_state[last], states[last], x, batch, skey, index[last])
            return dy

        def store(g, rest):
            params[g], opt_state[g], finite[g], sq[g] = rest

        self._walk(plan, params, opt_state, states, new_states, batch[self.model.input_key], skey, head, store)
        metrics = dict(out["metrics"], grad_norm=grad_norm(sq))
        params, opt_state = self._stored(params, opt_state)
        groups = grouped.groups
        new_ts = self._state(ts.step + 1, Stacked(groups, params, opt_state, new_states))
        check_finite(self._state(ts.step + 1, Stacked(groups, params, opt_state, list(states))), metrics, finite,
                     self.model.layers)
        return new_ts, metrics

    # -- the memory budget (`revtrain.trainers.budget`) ---------------------------------------------
    def plan_budget(self, batch_spec: dict):
        """Chooses each block's backward mode within ``memory_budget`` for batches shaped like
        ``batch_spec`` (``{key: jax.ShapeDtypeStruct}``, the global batch), sets them (`set_block_modes`),
        logs the plan's line and returns the `budget.BudgetPlan`. Called by ``revtrain train`` before the
        state is placed, else by the first ``train_step``.

        Raises:
          TrainerError: the budget is below the least any plan needs (the message names that least budget).
        """
        import revtrain.trainers.budget as budget_lib
        self.budget_plan = budget_lib.plan_budget(self, batch_spec, self.memory_budget, self.budget_objective)
        self.set_block_modes(self.budget_plan.modes)
        metrics_lib.log(self.budget_plan.line())
        return self.budget_plan

    # -- how the trainer describes itself (`TrainerBase`'s declared interface) ------------------------
    def memory_setup(self) -> dict:
        label = ("ReversibleTrainer" + (" + offload" if self.offload else "")
                 + (" + shard_state" if self.shard_state else "") + (" + offload='disk'" if self.on_disk else ""))
        return {"trainer": "reversible", "label": label, "offload": self.offload, "disk": self.on_disk,
                "shard_state": self.shard_state,
                "deferred": self.deferred, "rebuild": self.rebuild,
                "budget_peak": self.budget_plan.peak if self.budget_plan is not None else 0}

    def update_text(self) -> str:
        if not self.deferred:
            return "fused per layer"
        why = [f"{self.microbatches} microbatches"] if self.microbatches > 1 else []
        if not self.layerwise.separable:
            why.append(f"the optimizer combines layers ({self.layerwise.rounds} global round(s))")
        if self.model.ties:
            why.append(f"{len(self.model.ties)} tied parameter(s)")
        if self.shard_state and not why:
            why.append("whole-leaf optimizer with shard_state")
        return "deferred (" + ", ".join(why) + ")"

    def memory_knobs(self, evaluation: bool = False) -> list[str]:
        return [] if evaluation or self.residency.offloaded else ["ReversibleTrainer.offload = True"]


@dataclasses.dataclass
class _Block:
    """One group of a plan: its walk kind, backward mode, compiled programs and first layer index."""

    kind: StepKind
    mode: object  # a `modes.BackwardMode` (None for the head)
    forward: object
    backward: object
    index: np.int32  # a host scalar: nothing per layer stays on the device


@dataclasses.dataclass
class _Plan:
    """A layout's blocks (`_Block`, one per group, the head last) and the views the step reads."""

    blocks: list

    @property
    def top(self) -> int:
        """The backprop blocks inside the head's program."""
        return sum(b.kind is StepKind.TOP for b in self.blocks)

    @property
    def kinds(self) -> list:
        return [b.kind for b in self.blocks]

    @property
    def forward(self) -> list:
        return [b.forward for b in self.blocks[:-1]]

    @property
    def backward(self) -> list:
        return [b.backward for b in self.blocks[:-1]]

    @property
    def head(self):
        return self.blocks[-1].forward

    @property
    def index(self) -> list:
        return [b.index for b in self.blocks]


class _Dropping:
    """A fenced forward program (`ReversibleTrainer._fenced`) called as an ordinary one: returns ``(y, new
    state)`` and drops the residuals; other attributes (``lower``, ...) are the program's."""

    def __init__(self, program):
        self.program = program

    def __call__(self, *args):
        return self.program(*args)[:2]

    def __getattr__(self, name):
        return getattr(self.program, name)


def _slice(stacks, j):
    """Inside a scan: slice ``j`` of stacked trees."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, keepdims=False), stacks)
