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

The trainer is four modules, each one job: this one holds the configuration, the state and the step; the
per-layer programs are `revtrain.trainers.programs` (what each compiled call computes); the order of calls
is `revtrain.trainers.walk`; where the state lives is the tier (`revtrain.tiers`: device, or host memory
and layer files streamed by `revtrain.streaming`, bit for bit the device tier's numbers) and how it is
split over the devices `revtrain.trainers.specs` (``shard_state``, ZeRO-3). The deferred update
(microbatches, a whole-model optimizer such as ``optax.clip_by_global_norm``, tied parameters) is an object
the trainer owns, ``deferred_update`` (`revtrain.trainers.deferred.DeferredUpdate`), made from what it declares:
the trainer keeps the layout, the plan, the tier's stream and the state, the object the accumulating programs,
the gradient buffers and the update passes. Every step reports the global gradient norm (``grad_norm``) from per-layer
sums of squares.

Two executors (docs/design.md section 9). Per layer: one compiled call per layer and pass, as above. Scanned
(``scan_layers=True``, the device tier): each maximal run of consecutive, structurally identical reversible
layers is held stacked (weights, optimizer state and layer state with a leading layer axis,
`stacking.Stacked`) and each pass over it is one ``lax.scan`` whose body does exactly what one per-layer call
does. Both executors compute the same numbers; checkpoints hold the per-layer layout either way.

Reference: Trax ``ReversibleSerialTrainer`` (trax/optimizers/trainer.py); Gomez et al., "The Reversible
Residual Network", NeurIPS 2017; Kitaev et al., "Reformer", ICLR 2020.
"""

from __future__ import annotations

import functools
import re

import gin
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from revtrain import metrics as metrics_lib
from revtrain import optstate
from revtrain.placement import placer, replicated
from revtrain.tiers import HostStack, from_gin
from revtrain.streaming import StepStream, train_programs
from revtrain.trainers.common import (TrainerBase, TrainerError, TrainState, _Dispatch, check_batch, check_finite,
                                      check_flags, grad_norm, is_elementwise, step_key)
from revtrain.trainers.deferred import DeferredUpdate
from revtrain.trainers.hessian import LayerProducts, Tangents
from revtrain.trainers.layerwise import CoupledUpdateError, LayerwiseUpdate
from revtrain.trainers.modes import BACKPROP, CHECKPOINT, REBUILDS, REMAT, count_in_head, default_modes
from revtrain.trainers.programs import LayerPrograms
from revtrain.trainers.specs import StateSpecs
from revtrain.trainers.stacking import Stacked, find_runs, groups_of, slice_of, stack
from revtrain.trainers.walk import Block, Plan, StepKind, walk



# -- the memory budget's settings (its planner: `revtrain.planning.budget`) ---------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}
AUTO_MARGIN = 0.10  # 'auto': the device's bytes_limit less this share (the runtime's own, fragmentation)
OBJECTIVES = ("time", "flops")  # what a memory budget's plan minimises (`revtrain.planning.budget`)


def parse_budget(value, mesh=None) -> int:
    """Bytes of a memory budget: an int (bytes), a string with a unit (``'2GiB'``, ``'500MB'``, ``'1.5 GiB'``)
    or ``'auto'`` (an accelerator's ``bytes_limit`` less `AUTO_MARGIN`).

    Raises:
      TrainerError: not a positive size, or ``'auto'`` on a backend without a device memory limit (CPU).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            device = (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0])
            try:
                limit = (device.memory_stats() or {}).get("bytes_limit")
            except Exception:  # noqa: BLE001 (CPU: no memory stats)
                limit = None
            if not limit:
                raise TrainerError(f"ReversibleTrainer.memory_budget='auto' needs a device with a bytes_limit "
                                   f"({device.platform} has none); give the budget in bytes, e.g. '4GiB'")
            return int(limit * (1 - AUTO_MARGIN))
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+]?[0-9]+)?)\s*([kmgt]?i?b?)", text)
        if m and m.group(2) in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    raise TrainerError(f"ReversibleTrainer.memory_budget must be a positive number of bytes, a size such as '2GiB', "
                       f"or 'auto'; got {value!r}")


@gin.configurable
class ReversibleTrainer(TrainerBase):
    """Reversible backprop with fused per-layer optimizer updates and optional per-layer host offload.

    Args:
      model, optimizer, mesh, seed: see ``TrainerBase``.
      offload: where weights and optimizer state live between uses (the tier, `revtrain.tiers.from_gin`):
        False, device memory; True, host memory (with the saved standard-layer inputs); ``'disk'``, one file
        per layer in ``offload_dir`` (`revtrain.tiers.disk`); ``'auto'``, the fastest tier whose memory plan
        fits this machine (device, then host, then disk), chosen when the run is built
        (`revtrain.planning.choose_tier`; until then the device tier, `auto_tier` True); or a registered tier's
        name. A streamed tier is
        read ahead of each program and written back after each update by the streaming engine (`revtrain.streaming`), one layer at a time: the per-layer
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
        planned peak fits (`revtrain.planning.budget`; ``plan_budget``, before the state is placed by
        ``revtrain train``, else at the first step), logs the plan in one line and refuses a budget below the least plan's peak
        (`TrainerError` naming it). Overrides ``fuse_top``. Every plan's gradients equal backprop's as the
        rebuild's do (docs/budget.md).
      budget_objective: what a budget's plan minimises: ``"time"`` (default), the step's seconds from the
        trainer's own programs timed once on this machine at start-up (a few calls each on zeros; a scanned
        run's per block), or ``"flops"``, their compiled FLOPs (the same plan on every machine).

    Any optax optimizer: a separable one (each layer's update needs only that layer: Adam, AdamW, Lion,
    SGD, LAMB, Adafactor) keeps the fused per-layer update; one whose whole-model update combines layers
    (``optax.clip_by_global_norm`` in a chain, ``optax.apply_if_finite``) runs deferred, exactly as on the
    whole model (`layerwise.LayerwiseUpdate`). So do microbatches, tied parameters (`Model.ties`), an update
    that reads the step's loss (optax's keyword argument ``value``: ``polyak_sgd``, ``momo``,
    ``reduce_on_plateau``; given the loss as logged) and, with ``shard_state``, an update that needs whole leaves.

    Raises:
      TrainerError: the optimizer's update combines whole tensors of several layers (it cannot run one layer
        at a time), offload was asked for on a backend without a ``pinned_host`` memory space, ``rebuild``
        is not a known mode, ``memory_budget`` is not a size, ``microbatches`` is not a positive integer, or
        tied parameters that cannot be shared exactly (the user is not the head, the owner is a reversible
        layer, or with ``fuse_top``).

    Attributes:
      deferred: whether the update is deferred (the reasons above; `update_text` names them).
      deferred_update: the deferred update (`revtrain.trainers.deferred.DeferredUpdate`), None with the fused
        per-layer one.

    The ``TrainState`` passed to ``train_step`` is consumed (its device buffers are donated). With
    ``scan_layers`` the states it returns hold the stacked layout (``TrainState.stacked``); their per-layer
    views are copies made on first access.
    """

    name = "reversible"
    REBUILD_MODES = tuple(REBUILDS)  # the rebuild flavours' names (`modes.REBUILDS`), the default first

    AUTO = "auto"  # the ``offload`` value that lets the memory plan choose the tier (`use_tier`)

    def __init__(self, model, optimizer, mesh, seed: int = 0, offload: bool | str = False, scan_layers: bool = True,
                 shard_state: bool = False, rebuild: str = "exact", fuse_top: bool = False, microbatches: int = 1,
                 offload_dir: str | None = None, memory_budget=None, budget_objective: str = "time"):
        check_flags("ReversibleTrainer", scan_layers=scan_layers, shard_state=shard_state, fuse_top=fuse_top)
        if rebuild not in self.REBUILD_MODES:
            raise TrainerError(f"ReversibleTrainer.rebuild must be one of {', '.join(map(repr, self.REBUILD_MODES))}, "
                               f"got {rebuild!r}")
        self.rebuild = rebuild
        self.rebuild_mode = REBUILDS[rebuild]  # the strategy object of the rebuilt blocks (`modes`)
        super().__init__(model, optimizer, mesh, seed, microbatches)
        try:
            self.layerwise = LayerwiseUpdate(self.tx, model.param_shapes())  # (the state as kept: keys as data)
        except CoupledUpdateError as e:
            raise TrainerError(str(e)) from None
        self.shard_state = shard_state
        self._check_ties(model, shard_state, fuse_top)
        if self.takes_hvp and (microbatches > 1 or model.ties):
            what, fix = (("microbatches > 1", "use train.microbatches = 1") if microbatches > 1 else
                         ("tied parameters", "untie them (for example tie_embedding = False)"))
            raise TrainerError(f"optax's Hutchinson estimator (sophia) cannot train with ReversibleTrainer and {what} "
                               "yet: its layer-by-layer Hessian-vector products are one pass over the whole batch "
                               f"and untied layers; {fix}, or train.trainer = @StandardTrainer")
        # The fused per-layer update when it is exact; else the deferred one (`revtrain.trainers.deferred`).
        self.deferred = (not self.layerwise.separable or microbatches > 1 or bool(model.ties)
                         or (shard_state and not is_elementwise(optimizer)))
        self.specs = StateSpecs(model, optimizer, mesh.size, shard_state)  # each layer's split over the devices
        self.scan_layers = scan_layers
        self._stream, self.store_stats = None, {}  # a streamed tier's step in progress; its last step's I/O
        # ``offload = 'auto'``: the device tier until the plan chooses (`use_tier`, `revtrain.planning.choose_tier`).
        self.auto_tier = isinstance(offload, str) and offload == self.AUTO
        self.offload_dir = offload_dir
        try:
            tier = from_gin(False if self.auto_tier else offload, mesh, shard_state,
                            None if self.auto_tier else offload_dir)
        except ValueError as e:
            raise TrainerError(f"{e} (or 'auto': the memory plan chooses)") from None
        self._unbounded, self._programs_tx = self._limit, optimizer  # (what `use_tier` builds on)
        self.use_tier(tier)
        # The reversible layer under the head runs inside the head's program (``fuse_top``): alone, out of
        # any run it ends.
        num_layers = len(model.layers)
        self.fuse_top = fuse_top and num_layers >= 2 and model.layers[-2].reversible
        # Each block's backward mode (`modes`): a standard layer's is remat, a reversible block's the rebuild;
        # with fuse_top the block under the head is backprop'd; a memory budget chooses per block.
        self.block_modes = default_modes(model.layers[:-1], self.rebuild_mode)
        if self.fuse_top:
            self.block_modes[-1] = BACKPROP
        self._plans: dict = {}
        self.memory_budget, self.budget_plan = None, None
        if budget_objective not in OBJECTIVES:
            raise TrainerError(f"ReversibleTrainer.budget_objective must be one of "
                               f"{', '.join(map(repr, OBJECTIVES))}, got {budget_objective!r}")
        self.budget_objective = budget_objective
        if memory_budget is not None:
            self.memory_budget = parse_budget(memory_budget, mesh)
        self.groups = self._layout()
        if shard_state:
            metrics_lib.log(self.specs.summary())

    def use_tier(self, tier) -> None:
        """Makes ``tier`` (a `revtrain.tiers.Tier` on this trainer's mesh) where the weights and optimizer state
        live: the constructor's, or the one ``offload = 'auto'`` chose (`revtrain.planning.choose_tier`, before
        the state is placed; `auto_tier` is then False). The programs compiled so far are dropped (a tier may
        change the layout), and the tier's directory is ``offload_dir`` where it keeps
        files.

        Raises:
          TrainerError: the tier cannot run here (`Tier.refusal`, one line).
        """
        why = tier.refusal()
        if why:
            raise TrainerError(why)
        if self.auto_tier and tier.uses_directory and self.offload_dir is not None:
            tier = type(tier)(self.mesh, self.shard_state, directory=self.offload_dir)
        self.residency = tier
        # the layers in flight, bounded for a streamed tier
        self._limit = tier.store.bounded(self._unbounded) if tier.streamed else self._unbounded
        # The per-layer programs (`programs.LayerPrograms`): the step, the planners and check compile them here.
        self._cache.clear()
        self.programs = LayerPrograms(self._programs_tx, self.specs, self.rebuild_mode, self._compiled)
        # The deferred update (`revtrain.trainers.deferred`), built on these programs, its calls through this
        # trainer's dispatch limiter; None with the fused per-layer update.
        self.deferred_update = (DeferredUpdate(self.model, self.tx, self.layerwise, self.specs, self.programs, tier,
                                               self.mesh, self.microbatches, self.shard_state,
                                               functools.partial(_Dispatch, trainer=self))
                                if self.deferred else None)
        # The pass of Hessian-vector products for optax's Hutchinson estimator (`revtrain.trainers.hessian`),
        # None for any other optimizer.
        self.products = (LayerProducts(self.model, self.specs, self._compiled, Tangents(self.model.param_shapes()))
                         if self.takes_hvp else None)
        if hasattr(self, "block_modes"):  # (a later choice: the layout follows the tier)
            self._plans = {}
            self.groups = self._layout()

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

    def _streamed(self, grouped: Stacked, plan, ts: TrainState, deferred: tuple | None = None):
        """The step's ``(params, opt_state)`` lists: the groups' own, or with a streamed tier the views of a
        `streaming.StepStream` that puts each layer on the device ahead of its program and each update back.
        The stream lets go of each layer's old state (``ts`` is consumed, as donation consumes the device
        tier's) once its new one is issued: the state is replaced layer by layer, never held twice.
        ``deferred = (passes, the tied leaves' owners' groups)``: a deferred-update step's
        `streaming.DeferredStream`, whose gradient buffers are the third view returned."""
        if not self.residency.streamed:
            return list(grouped.params), list(grouped.opt_state)
        store = self.residency.store
        held = [grouped.params, grouped.opt_state] + list(ts.held()[:2])

        def release(g):
            for entries in held:
                entries[g] = None

        refs, place = store.refs(grouped.params, grouped.opt_state), placer(self.mesh, self.shard_state)
        release = release if self.residency.releases else None
        if deferred is None:
            self._stream = store.stream(refs, ts.step + 1, train_programs(plan.kinds), place, release=release)
            return self._stream.params, self._stream.opt_state
        passes, owners = deferred
        shapes = self.model.param_shapes()
        self._stream = store.deferred_stream(refs, ts.step + 1, place, plan.kinds, self.microbatches, passes, owners,
                                             shapes, release=release)
        return self._stream.params, self._stream.opt_state, self._stream.grads

    def _stored(self, params, opt_state):
        """The step's updated ``(params, opt_state)`` lists: as they are, or with a streamed tier the new refs
        of each group once every write is done (the disk tier's `revtrain.tiers.disk_format.DiskLayer`, the host
        tier's trees)."""
        if not self.residency.streamed:
            return params, opt_state
        stream, self._stream = self._stream, None
        refs = stream.finish()
        self._limit.clear()
        self.store_stats = stream.stats()
        return self.residency.store.state(refs)

    def _eval_grouped(self, grouped: Stacked) -> Stacked:
        if not self.residency.streamed:
            return grouped
        store = self.residency.store
        reader = store.reader(store.refs(grouped.params, grouped.opt_state), placer(self.mesh, self.shard_state))
        return Stacked(grouped.groups, reader.params, grouped.opt_state, grouped.layer_state)

    def init(self) -> TrainState:
        """Initial state, replicated or split over the devices (``shard_state``), where the tier keeps it
        (`Residency.put_layer`: device or host memory, or step 0's layer files), in this trainer's layout: per
        layer, or with runs of identical layers stacked (``scan_layers`` on the device).

        Built one layer at a time: each layer's initial values are made (a lazy model makes them on demand),
        its optimizer state initialised on them, both placed where they live and the numpy copies dropped,
        so host memory holds one copy of the state plus one layer's (or one stacked leaf's) values."""
        residency = self.residency
        params, opt_state, layer_state = [], [], []
        # each layer's part of the whole model's tx.init (a pass over the layers first when a layer's own init
        # differs: optax.contrib.dog's scale from the norm of every parameter; `optstate.LayerInit`)
        layer_init = optstate.LayerInit(self.tx, self.model.param_shapes())
        layer_init.prepare(lambda i: self.model.init_layer(i)[0])
        for start, count in self.groups:
            pspec, ospec = self.specs.group(self.model.layers[start], count)
            pspec, ospec = (None if isinstance(spec, P) else spec for spec in (pspec, ospec))
            if count == 1:
                p, s = self.model.init_layer(start)
                p, o = residency.put_layer(start, p, jax.tree.map(np.array, layer_init.state(start, p)), pspec, ospec)
                params.append(p), opt_state.append(o), layer_state.append(self.replicate(s))
                del p, o, s
                continue
            ps, opts, states = HostStack(count), HostStack(count), []
            for j in range(count):
                p, s = self.model.init_layer(start + j)
                opts.put(j, layer_init.state(start + j, p))
                ps.put(j, p)
                states.append(s)
                del p
            params.append(residency.place_stacked(ps, pspec))
            opt_state.append(residency.place_stacked(opts, ospec))
            layer_state.append(self.replicate(jax.tree.map(lambda *v: np.stack(v), *states)))
        residency.end_init()
        return self._state(0, Stacked(self.groups, params, opt_state, layer_state))

    def abstract_state(self) -> TrainState:
        """The per-layer state as ``jax.ShapeDtypeStruct`` leaves with the shardings (and memory kind) `init`
        gives them, or the disk tier's file templates (`Residency.layer_template`): a checkpoint is restored
        straight into place from it, without building a state first."""
        params, opt_state = [], []
        for i, (layer, shapes) in enumerate(zip(self.model.layers, self.model.param_shapes())):
            pspec, ospec = self.specs.layer(layer)
            p, o = self.residency.layer_template(i, shapes, jax.eval_shape(self.tx.init, shapes),
                                                 None if isinstance(pspec, P) else pspec,
                                                 None if isinstance(ospec, P) else ospec)
            params.append(p), opt_state.append(o)
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

    def _plan(self, groups) -> Plan:
        """The compiled functions of every group, looked up once per layout and block modes (not per call)."""
        key = (groups, tuple(self.block_modes))
        plan = self._plans.get(key)
        if plan is None:
            layers, acc, blocks = self.model.layers, self.deferred_update, []  # (acc: None, or the deferred update)
            # the groups in the head's program (singles, or stacked runs of checkpoint blocks)
            top = count_in_head([self.block_modes[start] for start, _ in groups[:-1]])
            below = len(groups) - 1 - top  # the groups with programs of their own
            for start, count in groups[:below]:
                layer, mode = layers[start], self.block_modes[start]
                forward_kind, backward_kind, acc_kind = mode.program_kinds
                if count > 1 and mode.keeps_input:  # (`_scans`: the fused update only)
                    blocks.append(Block(StepKind.RUN, mode, self.programs.run("remat_forward_run", layer, count),
                                         self.programs.run("remat_backward_run", layer, count), np.int32(start)))
                elif count > 1:
                    blocks.append(Block(StepKind.RUN, mode, self.programs.run("forward_run", layer, count),
                                         acc.run(layer, count) if acc else
                                         self.programs.run("reverse_run", layer, count), np.int32(start)))
                else:
                    blocks.append(Block(mode.kind, mode, self.programs.per_layer(forward_kind, layer),
                                         acc.per_layer(acc_kind, layer) if acc else
                                         self.programs.per_layer(backward_kind, layer),
                                         np.int32(start)))
            for start, _ in groups[below:-1]:
                blocks.append(Block(StepKind.TOP, self.block_modes[start], None, None, np.int32(start)))
            if top:
                tops = tuple(layers[s] for s, _ in groups[below:-1])
                modes = tuple(self.block_modes[s] for s, _ in groups[below:-1])
                counts = tuple(c for _, c in groups[below:-1])
                head = (acc.top_head(tops, layers[-1], modes) if acc else
                        self.programs.top_head(tops, layers[-1], modes, counts))
            else:
                head = acc.per_layer("head_acc", layers[-1]) if acc else self.programs.per_layer("head", layers[-1])
            blocks.append(Block(StepKind.HEAD, None, head, None, np.int32(groups[-1][0])))
            plan = self._plans[key] = Plan(blocks)
        return plan

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

        # With a streamed tier each access of ``params[g]`` / ``opt_state[g]`` takes the layer the engine put
        # on the device ahead, and each store issues the update's put back; the engine waits for the program
        # `Store.depth` before each one (the dispatch limiter tells it of each program). Otherwise the loop
        # never waits: the step's one host sync is the final check of non-finite values.
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

        walk(plan, self.residency, params, opt_state, states, new_states, batch[self.model.input_key], skey, head, store)
        metrics = dict(out["metrics"], grad_norm=grad_norm(sq))
        params, opt_state = self._stored(params, opt_state)
        groups = grouped.groups
        new_ts = self._state(ts.step + 1, Stacked(groups, params, opt_state, new_states))
        check_finite(self._state(ts.step + 1, Stacked(groups, params, opt_state, list(states))), metrics, finite,
                     self.model.layers)
        return new_ts, metrics

    def _deferred_step(self, ts: TrainState, batch: dict):
        """`train_step` with the deferred update (`deferred_update`, `revtrain.trainers.deferred`): the state in
        this trainer's layout, with a streamed tier a `streaming.DeferredStream` (whose views hold the gradient
        buffers too), the update's step, then the state written back and checked as the fused step's."""
        grouped = self._working(ts)
        plan = self._plan(grouped.groups)
        groups = grouped.groups
        update = self.deferred_update
        acc = None
        params, opt_state = list(grouped.params), list(grouped.opt_state)
        states = grouped.layer_state
        skey = step_key(self.seed, ts.step)
        hvp = self._products(grouped, batch, skey) if self.products is not None else None
        if self.residency.streamed:
            params, opt_state, acc = self._streamed(grouped, plan, ts,
                                                    deferred=(update.passes, sorted(update.owners(groups))))
        params, opt_state, current, metrics, finite = update.step(plan, groups, params, opt_state, states, acc, batch,
                                                                  skey, hvp)
        del acc
        params, opt_state = self._stored(params, opt_state)
        new_ts = self._state(ts.step + 1, Stacked(groups, params, opt_state, current))
        check_finite(self._state(ts.step + 1, Stacked(groups, params, opt_state, list(states))), metrics, finite,
                     self.model.layers)
        return new_ts, metrics

    def _products(self, grouped: Stacked, batch: dict, skey) -> list:
        """optax's Hutchinson estimator's Hessian-vector products for the step (`hessian.LayerProducts`), one tree
        per group (a stacked run's stacked), where the tier keeps activations (`Tier.keep`: host memory on the
        host tier) until the update pass; None per group on a step whose update does not read them (Sophia
        between its ``update_interval`` steps: `layerwise.LayerwiseUpdate.products_needed`), which the update
        pass gives zeros. A streamed tier's weights come through a read-only stream (every group up, then every
        group down); the estimator's key and step count from the first group's optimizer state."""
        groups, tier = grouped.groups, self.residency
        where = [(g, j) for g, (_, count) in enumerate(groups) for j in range(count)]
        place = placer(self.mesh, self.shard_state)
        if tier.streamed:
            store = tier.store
            refs = store.refs(grouped.params, grouped.opt_state)
            opt0 = store.listen(StepStream(store, refs, None, [[(0, "opt")]], place)).opt_state[0]
        else:
            opt0 = grouped.opt_state[0]
        if groups[0][1] > 1:  # (a stacked first group: its first layer's state)
            opt0 = _take(opt0, np.int32(0))
        needed = self._cache.get("products_needed")
        if needed is None:
            needed = self._cache["products_needed"] = jax.jit(
                lambda opt: self.layerwise.products_needed(self.layerwise.global_leaves(0, opt)))
        flag = needed(opt0)
        key = Tangents.key(opt0)
        del opt0
        if flag is not None and not bool(flag):
            return [None] * len(groups)
        if tier.streamed:
            n = len(groups)
            programs = [[(g, "params")] for g in range(n)] + [[(g, "params")] for g in range(n - 2, -1, -1)]
            weights = store.listen(StepStream(store, refs, None, programs, place)).params
        else:
            weights = grouped.params
        held: dict = {}

        def params_of(i, when):
            g, j = where[i]
            if (g, when) not in held:
                held.clear()
                held[(g, when)] = weights[g]
            p = held[(g, when)]
            return p if groups[g][1] == 1 else _take(p, np.int32(j))

        states = [grouped.layer_state[g] if groups[g][1] == 1 else _take(grouped.layer_state[g], np.int32(j))
                  for g, j in where]
        out = self.products.products(params_of, states, batch, skey, key, keep=tier.keep, bring=tier.bring)
        held.clear()
        return [tier.keep(out[start] if count == 1 else stack(out[start:start + count], consume=True))
                for start, count in groups]

    # -- the memory budget (`revtrain.planning.budget`) ---------------------------------------------
    def plan_budget(self, batch_spec: dict):
        """Chooses each block's backward mode within ``memory_budget`` for batches shaped like
        ``batch_spec`` (``{key: jax.ShapeDtypeStruct}``, the global batch), sets them (`set_block_modes`),
        logs the plan's line and returns the `budget.BudgetPlan`. Called by ``revtrain train`` before the
        state is placed, else by the first ``train_step``.

        Raises:
          TrainerError: the budget is below the least any plan needs (the message names that least budget).
        """
        from revtrain.planning import budget as budget_planner
        self.budget_plan = budget_planner.choose(self, batch_spec, self.memory_budget, self.budget_objective)
        self.set_block_modes(self.budget_plan.modes)
        metrics_lib.log(self.budget_plan.line())
        return self.budget_plan

    # -- how the trainer describes itself (`TrainerBase`'s declared interface) ------------------------
    def memory_setup(self) -> dict:
        label = self.residency.trainer_label("ReversibleTrainer", " + shard_state" if self.shard_state else "")
        return {"trainer": "reversible", "label": label, "tier": self.residency,
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


_take = jax.jit(slice_of)  # slice j of a stacked tree (a leading layer axis), as its own small program
