"""What both trainers share: train state, PRNG key derivation, the optimizer check, evaluation.

Key derivation (both trainers, so they follow the same trajectory): the step key is
``fold_in(PRNGKey(seed), step)``; layer ``i`` uses ``fold_in(step_key, i)``; example ``e`` of the global
batch uses ``fold_in(layer_key, e)``. Masks therefore do not depend on the number of devices.
"""

from __future__ import annotations

import collections
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain import optstate
from revtrain.errors import InputError, RunFailure
from revtrain.placement import DATA_AXIS, DispatchLimiter, batch_divisibility_error, put_replicated
from revtrain.placement import gather_params, per_device, reduce_grads  # noqa: F401  (common.per_device, ...)
from revtrain.trainers.stacking import Stacked

# XLA options of every trainer program (and of `revtrain check`'s). ``xla_allow_excess_precision`` (on by
# default) lets XLA skip a rounding to bfloat16 that the program asks for when it finds it cheaper, and
# whether it does depends on the rest of the program. Then F computed by the forward program and F computed
# by the rebuild program differ in the last bits of bfloat16, and every rebuilt layer carries the error into
# the next one (measured on a trained default model in bfloat16: rebuild error 1e-3 at the top block,
# 1.1e-2 at the bottom one). Off, every bfloat16 rounding happens as written, in every program alike, and
# the rebuild is exact (0.0 on the same checkpoint). No effect on float32 programs.
XLA_OPTIONS = {"xla_allow_excess_precision": False}


class TrainerError(InputError, ValueError):
    """A configuration the trainer refuses (e.g. an optimizer that couples leaves)."""


def check_flags(owner: str, **flags) -> None:
    """Raises `TrainerError` naming ``owner.name`` unless every flag is a bool (gin would otherwise take
    the string ``'False'`` as true)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TrainerError(f"{owner}.{name} must be True or False, got {value!r}")


class NonFiniteError(RunFailure, FloatingPointError):
    """A non-finite loss or gradient.

    Attributes:
      step: the 1-based step.
      layer: the layer whose gradient was non-finite (the first one met by backprop), or None for the loss.
      state: the `TrainState` after that step with every non-finite update skipped and the layer state
        (e.g. batch-norm statistics) left as it was before the step; a run that skips the step goes on
        from it. In the reversible trainer, layers *above* ``layer`` (met earlier by the backward pass)
        were already updated when a layer's own gradient turned non-finite; with a non-finite loss no
        layer is updated.
    """

    def __init__(self, step: int, layer: str | None, what: str, state: "TrainState | None" = None):
        where = f" in layer {layer}" if layer else ""
        super().__init__(f"non-finite {what}{where} at step {step}")
        self.step, self.layer, self.state = step, layer, state


class TrainState:
    """Everything a training step depends on.

    Attributes:
      step: number of completed steps (int).
      params: one plain-dict pytree of float32 arrays per layer.
      opt_state: one optax state per layer (the reversible trainer) or one for the whole list (the
        standard trainer stores it as a one-element list).
      layer_state: one plain-dict pytree per layer (e.g. batch-norm statistics; often empty).
      stacked: None, or the same state in the grouped layout (`revtrain.trainers.stacking.Stacked`) that the
        reversible trainer's scanned executor works on (runs of identical layers with a leading layer
        axis). It is then the truth: ``params``, ``opt_state`` and ``layer_state`` are built from it on
        first access (copies of the stacked slices, kept on this object) and assigning one of them turns
        the state back into the per-layer layout.

    Construct with ``TrainState(step, params, opt_state, layer_state)`` or ``TrainState(step,
    stacked=...)``.
    """

    def __init__(self, step: int, params: list | None = None, opt_state: list | None = None,
                 layer_state: list | None = None, *, stacked=None):
        if stacked is None and (params is None or opt_state is None or layer_state is None):
            raise TypeError("TrainState needs params, opt_state and layer_state, or stacked")
        self.step = step
        self.stacked = stacked
        self._lists = None if stacked is not None else [params, opt_state, layer_state]

    def _layers(self) -> list:
        if self._lists is None:
            self._lists = list(self.stacked.per_layer())
        return self._lists

    def _assign(self, k: int, value) -> None:
        lists = self._layers()
        lists[k] = value
        self.stacked = None

    params = property(lambda self: self._layers()[0], lambda self, v: self._assign(0, v))
    opt_state = property(lambda self: self._layers()[1], lambda self, v: self._assign(1, v))
    layer_state = property(lambda self: self._layers()[2], lambda self, v: self._assign(2, v))

    def held(self) -> tuple:
        """``(params, opt_state, layer_state)`` as the trainer holds them, without a copy: the stacked
        groups' lists when the state is stacked (whose ``params`` etc. would copy every slice out), else the
        per-layer lists. For waiting on a step (``jax.block_until_ready``) or reading placements."""
        if self.stacked is not None:
            return self.stacked.params, self.stacked.opt_state, self.stacked.layer_state
        return tuple(self._lists)

    def per_layer(self) -> "TrainState":
        """This state in the per-layer layout (itself when it already is; otherwise a new state with
        copies of the stacked slices, not kept on this one): what checkpoints hold."""
        if self.stacked is None:
            return self
        if self._lists is not None:
            return TrainState(self.step, *self._lists)
        return TrainState(self.step, *self.stacked.per_layer())

    def per_layer_shapes(self) -> "TrainState":
        """The per-layer layout as ``jax.ShapeDtypeStruct`` leaves with shardings (nothing is copied): the
        template a checkpoint is restored into."""
        if self.stacked is not None:
            return TrainState(self.step, *self.stacked.per_layer_shapes())
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)),
                              self._lists)
        return TrainState(self.step, *shapes)

    def __repr__(self) -> str:
        layout = f"stacked groups {self.stacked.groups}" if self.stacked is not None else "per layer"
        return f"TrainState(step={self.step}, {layout})"


def step_key(seed: int, step: int) -> jax.Array:
    """uint32 ``[2]`` key of the 0-based ``step``: ``fold_in(PRNGKey(seed), step)``."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def example_keys(skey, layer_index, local_batch_size: int) -> jax.Array:
    """Per-example keys ``[B_local, 2]`` for one layer, inside ``shard_map`` over ``"data"``.

    Example ``e`` (global index over the whole batch) gets ``fold_in(fold_in(skey, layer_index), e)``.

    Args:
      skey: the step key (uint32 ``[2]``), or ``(step key, where)`` for a microbatch (`microbatch_where`):
        ``where`` is int32 ``[2]``, (the microbatch's first row in each device's share, that share's
        size), so that an example gets the keys of its row in the whole batch and M microbatches draw the
        masks one step on the whole batch draws.
      layer_index: the layer's index (int or int32 scalar).
      local_batch_size: rows of this device's (micro)batch.
    """
    if isinstance(skey, tuple):
        skey, where = skey
        first = lax.axis_index(DATA_AXIS) * where[1] + where[0]
    else:
        first = lax.axis_index(DATA_AXIS) * local_batch_size
    layer_key = jax.random.fold_in(skey, layer_index)
    ids = first + jnp.arange(local_batch_size)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(layer_key, ids)


def microbatch_where(m: int, microbatches: int, local_batch_size: int) -> np.ndarray:
    """int32 ``[2]``: microbatch ``m``'s first row in each device's share of ``local_batch_size`` rows, and
    that share's size (the ``where`` of `example_keys`)."""
    return np.array([m * (local_batch_size // microbatches), local_batch_size], np.int32)


def take_microbatch(batch: dict, m, microbatches: int) -> dict:
    """Inside ``shard_map``: rows ``m * b / M .. (m + 1) * b / M - 1`` of this device's share of every leaf
    (``m`` may be traced). Each device's share is split into the M microbatches, so no row moves between
    devices."""
    def take(x):
        size = x.shape[0] // microbatches
        return lax.dynamic_slice_in_dim(x, m * size, size, axis=0)
    return jax.tree.map(take, batch)


@jax.jit
def grad_norm(pieces: list) -> jax.Array:
    """The global gradient norm (float32 scalar) from per-layer `specs.leaf_squares` (any leading axes: a stacked
    run's ``[count, leaves]``), in layer order."""
    flat = [p.reshape(-1) for p in pieces]
    if not flat:
        return jnp.float32(0.0)
    squares = jnp.concatenate(flat)
    # Added one at a time, left to right (as optax.global_norm's sum over the leaves): XLA may rewrite the
    # sum of a concatenation as a sum of each piece's sum, so the grouping of the pieces (one stacked run's
    # [count, leaves] on the device tier, one per layer on a streamed tier) changed the last bit of the sum
    # (JAX 0.12.0.1: the device and host tiers' first grad_norm of tests/test_disk_tier.py).
    total = lax.fori_loop(0, squares.shape[0], lambda i, t: t + squares[i], jnp.zeros((), squares.dtype))
    return jnp.sqrt(total)


def batch_size_of(tree) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


def check_batch(batch: dict, num_devices: int, microbatches: int = 1) -> None:
    """Raises TrainerError when the global batch cannot be split evenly over ``num_devices``, and each
    device's share into ``microbatches`` equal microbatches."""
    size = batch_size_of(batch)
    message = batch_divisibility_error(size, num_devices)
    if message:
        raise TrainerError(message)
    if (size // num_devices) % microbatches:
        raise TrainerError(microbatch_error(size, num_devices, microbatches))


def microbatch_error(batch_size: int, num_devices: int, microbatches: int) -> str:
    return (f"train.batch_size {batch_size} on {num_devices} device(s) is {batch_size / num_devices:g} per device, "
            f"which does not split into train.microbatches = {microbatches} equal microbatches")


def check_finite(error_state: "TrainState", metrics: dict, finite: list, layers) -> None:
    """Raises `NonFiniteError` when the step's loss or any layer's gradient was non-finite.

    One host sync per step (the flags of every layer are gathered first).

    Args:
      error_state: the state to hand on with the error: after the step (non-finite updates already
        skipped), with the layer state from before it.
      metrics: the step's metrics (``loss``).
      finite: bool device arrays in layer order: a scalar per single layer, ``[count]`` per stacked run.
      layers: the model's layers (for the name).
    """
    parts, scalars = [], []
    for f in finite:  # consecutive scalars are stacked in one dispatch
        if np.ndim(f) == 0:
            scalars.append(f)
            continue
        if scalars:
            parts.append(jnp.stack(scalars))
            scalars = []
        parts.append(f)
    if scalars:
        parts.append(jnp.stack(scalars))
    flags = np.concatenate([np.asarray(p).reshape(-1) for p in parts])
    if flags.all():
        return
    loss = float(np.asarray(metrics["loss"]))
    failed = [i for i in range(len(flags)) if not flags[i]]
    if not math.isfinite(loss):
        raise NonFiniteError(error_state.step, None, "loss", error_state)
    raise NonFiniteError(error_state.step, layers[max(failed)].name, "gradient", error_state)


def is_elementwise(tx: optax.GradientTransformation, pieces: int = 2, steps: int = 2) -> bool:
    """Whether ``tx``'s update of a piece of a leaf equals the whole leaf's update there.

    With ``ReversibleTrainer.shard_state`` each device holds a piece of every large leaf. An elementwise
    update (Adam, AdamW, SGD with momentum, Lion, RMSProp, ``optax.clip``) runs on the pieces inside the
    fused per-layer update; one that needs the whole leaf (adafactor's factored second moments: row and
    column means; lamb's trust ratio: norms of the whole leaf; ``optax.clip_by_block_rms``: the leaf's RMS)
    runs in the deferred update pass instead, on whole leaves assembled across devices. The test runs
    ``tx`` for a few steps on a 256 x 256 leaf (large enough for adafactor to factor it, and each piece
    too) and on its ``pieces`` row blocks and column blocks separately, with gradients of very different
    scales in different blocks, and compares the updates. An optimizer that cannot run on a piece at all
    is not elementwise.
    """
    rng = np.random.default_rng(1)
    shape = (256, 256)
    param = rng.normal(size=shape).astype(np.float32)
    scales = np.geomspace(1e-3, 1e3, pieces * pieces).reshape(pieces, pieces)
    scale = np.kron(scales, np.ones((shape[0] // pieces, shape[1] // pieces)))
    grads = [(rng.normal(size=shape) * scale).astype(np.float32) for _ in range(steps)]

    @jax.jit
    def steps_of(p, gs):  # one program per shape (eager optax ops would dispatch one by one)
        p = {"w": p}
        state = tx.init(p)
        for g in gs:
            u, state = tx.update({"w": g}, state, p)
            p = optax.apply_updates(p, u)
        return p["w"]

    def run(p, gs):
        return np.asarray(steps_of(jnp.asarray(p), [jnp.asarray(g) for g in gs]))

    try:
        whole = run(param, grads)
        for axis in (0, 1):
            parts = [run(pp, [np.array_split(g, pieces, axis)[k] for g in grads])
                     for k, pp in enumerate(np.array_split(param, pieces, axis))]
            if not np.allclose(np.concatenate(parts, axis), whole, rtol=1e-5, atol=1e-7):
                return False
    except Exception:  # an optimizer that cannot run on a piece at all
        return False
    return True


class _Dispatch:
    """A jitted function whose every call goes through the trainer's ``DispatchLimiter`` and, while a
    measurement is running, the trainer's memory meter (``revtrain.memory.MemoryMeter``: ``observe``
    before the call, ``record`` of the outputs after it; both cost O(arguments), not O(live arrays)).

    Other attributes (``lower``, ``trace``, ...) are those of the jitted function.
    """

    def __init__(self, fn, trainer: "TrainerBase"):
        self.fn, self._trainer = fn, trainer

    def __call__(self, *args):
        meter = self._trainer.meter
        if meter is not None and meter.active:
            meter.observe(self.fn, args)
            out = self._trainer._limit(self.fn(*args))
            meter.record(out)
            return out
        return self._trainer._limit(self.fn(*args))

    def __getattr__(self, name):
        return getattr(self.fn, name)


class _UsedDonation(_Dispatch):
    """A `_Dispatch` that donates the arguments at ``maybe`` only where XLA can use them: when each of
    their leaves has a result of its shape and dtype left over by the always-donated arguments (decided
    from the shapes at the first call or ``lower`` of each input signature; one jitted function per
    decision). Why: a program built for every layer donates its activation arguments, and one layer
    cannot use them: the recomputed embedding takes token ids, which have no cotangent, so the cotangent
    of its output (both residual streams) can become no result; donated, JAX warned "Some donated buffers
    were not usable" at every step and freed nothing earlier."""

    def __init__(self, make, donate: tuple, maybe: tuple, trainer: "TrainerBase"):
        super().__init__(make(tuple(sorted(set(donate) | set(maybe)))), trainer)
        self._make, self._donate, self._maybe = make, tuple(donate), tuple(maybe)
        self._jitted: dict = {}  # donated positions -> jitted function
        self._decided: dict = {}  # input signature -> donated positions

    def _pick(self, args) -> None:
        sig = tuple((jax.tree.structure(args[i]), tuple((np.shape(x), np.dtype(x.dtype))
                                                        for x in jax.tree.leaves(args[i]))) for i in self._maybe)
        if sig not in self._decided:
            plain = self._jitted.setdefault(self._donate, self._make(self._donate))
            results = jax.tree.leaves(jax.eval_shape(plain, *args))
            left = collections.Counter((o.shape, np.dtype(o.dtype)) for o in results)
            for i in self._donate:
                left.subtract((np.shape(x), np.dtype(x.dtype)) for x in jax.tree.leaves(args[i]))
            used = []
            for i, (_, leaves) in zip(self._maybe, sig):
                need = collections.Counter(leaves)
                if need and all(left[k] >= n for k, n in need.items()):
                    used.append(i)
                    left.subtract(need)
            self._decided[sig] = tuple(sorted(set(self._donate) | set(used)))
        donate = self._decided[sig]
        self.fn = self._jitted.setdefault(donate, self._make(donate))

    def __call__(self, *args):
        self._pick(args)
        return super().__call__(*args)

    def lower(self, *args, **kwargs):
        self._pick(args)
        return self.fn.lower(*args, **kwargs)


class TrainerBase:
    """Shared construction and the forward-only, layer-by-layer evaluation pass.

    Args:
      model: the layer list (a `revtrain.models.base.Model`).
      optimizer: an optax ``GradientTransformation``.
      mesh: the 1-D data mesh (``placement.make_mesh()``).
      seed: the seed of the dropout keys.
      microbatches: M: each step runs the global batch as M microbatches one after another (each device's
        share split into M), sums their gradients with the weighting of one step on the whole batch and
        applies the optimizer once (gradient accumulation). Activation memory is one microbatch's.

    Raises:
      TrainerError: ``microbatches`` is not a positive integer.

    What the loop, the memory plan, ``revtrain check`` and the CLI ask of any trainer is declared here, with
    the answer of a trainer that has none of these features; a trainer that has one overrides it:

    Attributes:
      name: the trainer's name in checkpoints' signatures and log lines (``"standard"``, ``"reversible"``).
      memory_budget: the device bytes a step may peak at (int), or None: no budget (every block's backward
        mode is fixed by the configuration, nothing is planned).
      budget_plan: the `revtrain.planning.budget.BudgetPlan` made by `plan_budget` (None until then, or
        without a budget): its ``peak`` and ``budget`` bound what a background checkpoint save may add.
      rebuild: the rebuild mode of the reversible blocks (a name of `revtrain.trainers.modes.REBUILDS`), or None
        for a trainer that rebuilds nothing.
      store_stats: the last step's I/O of a streamed tier's store (``host_read_bytes``, ``disk_read_bytes``, ...;
        `revtrain.streaming.StepStream.stats`) for the step's ``train.jsonl`` record; ``{}`` without one.
      residency: where weights and optimizer state live between uses (a tier object, `revtrain.tiers`), set
        by each trainer.
      specs: how each layer's state is split over the devices (`revtrain.trainers.specs.StateSpecs`), set by
        each trainer.
    """

    name: str = ""
    residency = None  # where weights and optimizer state live between uses: each trainer sets its tier
    auto_tier = False  # True until the memory plan chooses the tier (``ReversibleTrainer.offload = 'auto'``)
    specs = None  # how each layer's state is split over the devices (`revtrain.trainers.specs.StateSpecs`)
    # The per-layer optimizer step (a per-layer trainer's; None for a whole-model one): its split of the update
    # (`layerwise.LayerwiseUpdate`) and whether it runs as the deferred update (`revtrain.check_optimizer`).
    layerwise = None
    deferred = None
    memory_budget: int | None = None
    budget_plan = None
    rebuild: str | None = None

    def __init__(self, model, optimizer: optax.GradientTransformation, mesh: Mesh, seed: int = 0,
                 microbatches: int = 1):
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise TrainerError(f"train.microbatches must be a positive integer, got {microbatches!r}")
        self.model = model
        # optax's state as revtrain can keep it: typed PRNG keys as key data, no leaf that is a parameter's own
        # array (revtrain/optstate.py); ``optimizer``'s programs are otherwise unchanged
        self.tx = optstate.keep_states(optimizer)
        why = optstate.update_refusal(self.tx, model.param_shapes())  # (lbfgs, sophia: more than the loss)
        if why:
            raise TrainerError(why)
        # The update reads the step's loss (keyword argument ``value``: polyak_sgd, momo, reduce_on_plateau):
        # each trainer passes it the loss as it logs it (every other optimizer's programs are unchanged).
        self.takes_value = optstate.takes_value(self.tx, model.param_shapes())
        # The update reads ``obj_fn`` for optax's Hutchinson estimator (sophia): each trainer computes the
        # Hessian-vector product on the estimator's tangent and passes it (`revtrain.trainers.hessian`).
        self.takes_hvp = optstate.takes_hvp(self.tx, model.param_shapes())
        self.mesh = mesh
        self.seed = seed
        self.microbatches = microbatches
        self._cache: dict = {}
        self._limit = DispatchLimiter(mesh)  # bounds in-flight programs on a multi-device CPU (placement.py)
        self.meter = None  # a revtrain.memory.MemoryMeter, set by whoever wants peak device bytes
        self.store_stats: dict = {}  # a streamed tier's last step's store I/O (set each step by such a trainer)

    # -- the declared interface: what the loop, the memory plan, check and the CLI ask ----------------
    def plan_budget(self, batch_spec: dict):
        """Plans each block's backward mode within `memory_budget` for batches shaped like ``batch_spec``
        (``{key: jax.ShapeDtypeStruct}``, the global batch) and returns the plan; called only when
        `memory_budget` is not None (`revtrain.loop.train` before the state is placed, `revtrain.planning`,
        ``revtrain check``). A trainer without a budget has nothing to plan: None."""
        return None

    def memory_setup(self) -> dict:
        """How the memory plan describes this trainer: keyword arguments of `revtrain.planning.Setup` beyond
        the optimizer, batch and microbatches (``trainer``, ``label``, ``tier``: its tier object, and those of
        its features: ``shard_state``, ``deferred``, ``remat``, ``rebuild``, ``budget_peak``); each trainer says its
        own (a plain dict, so the trainers need not import the plan)."""
        raise NotImplementedError(f"{type(self).__name__} does not describe itself to the memory plan")

    def update_text(self) -> str:
        """How the trainer applies the optimizer, in a few words for ``revtrain check``'s header: one update of
        the whole model (this default), or a reversible trainer's fused per-layer or deferred update."""
        return "whole model"

    def memory_knobs(self, evaluation: bool = False) -> list[str]:
        """The trainer's gin settings that would lower a step's memory (``evaluation``: an evaluation's), most
        effective first, for the one-line out-of-memory advice (`revtrain.lifecycle.oom.in_one_line`); none by
        default."""
        return []

    # -- compiled-function cache: one jit(shard_map(...)) per key; equal layers share it --------------
    # Looking a function up hashes the layer (its whole module graph): the trainers do it once per layer
    # index when they build their plan, never per call.
    def _compiled(self, kind: str, layer, fn, in_specs, out_specs, donate=(), key=None, donate_if_used=()):
        """The compiled ``fn`` of ``layer`` (cached under ``key``): ``jit(shard_map(fn))`` over the data mesh;
        ``donate_if_used``: positions donated only where a result can reuse them (`_UsedDonation`)."""
        key = (kind, layer) if key is None else key
        if key not in self._cache:
            mapped = jax.shard_map(functools.partial(fn, layer), mesh=self.mesh, in_specs=in_specs,
                                   out_specs=out_specs)
            def make(donate):
                return jax.jit(mapped, donate_argnums=donate, compiler_options=XLA_OPTIONS)

            self._cache[key] = (_UsedDonation(make, donate, donate_if_used, self) if donate_if_used
                                else _Dispatch(make(donate), self))
        return self._cache[key]

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    def replicate(self, tree):
        return put_replicated(tree, self.mesh)

    # -- layouts --------------------------------------------------------------------------------
    def grouped(self, ts: TrainState) -> Stacked:
        """``ts`` in the grouped layout (`stacking.Stacked`): its own when it has one, else every layer
        alone, sharing ``ts``'s lists (nothing is copied). The standard trainer's one optimizer state
        stays a one-element list."""
        if ts.stacked is not None:
            return ts.stacked
        groups = tuple((i, 1) for i in range(len(self.model.layers)))
        return Stacked(groups, ts.params, ts.opt_state, ts.layer_state)

    # -- evaluation ------------------------------------------------------------------------------
    @staticmethod
    def eval_forward(layer, params, state, x):
        """A layer's evaluation on its whole ``params``: its output at ``x`` in evaluation mode (no dropout,
        running statistics). The trainers' evaluation programs and the memory plan's compile this."""
        return layer.apply(params, state, x, None, False)[0]

    @staticmethod
    def eval_loss(layer, params, state, x, batch) -> tuple:
        """The head's evaluation on its whole ``params``: ``(loss_sum, stats)`` of this device's share of
        ``batch`` (float32 scalars, nats; ``stats``: ``weight``, ``correct``), as `eval_forward`."""
        loss_sum, stats, _ = layer.loss(params, state, x, batch, None, False)
        return loss_sum, stats

    def _eval_layer(self, layer, params, state, x):
        return self.eval_forward(layer, self.specs.whole(layer, params), state, x)

    def _eval_run(self, layer, params, states, x):
        """``_eval_layer`` over a stacked run: one ``lax.scan``, one layer's weights on the device at a time."""
        def body(x, slices):
            p, s = slices
            return self._eval_layer(layer, p, s, x), None
        return lax.scan(body, x, (params, states))[0]

    def _eval_head(self, layer, params, state, x, batch):
        loss_sum, stats = self.eval_loss(layer, self.specs.whole(layer, params), state, x, batch)
        out = {"loss_sum": loss_sum, **stats}
        return jax.tree.map(lambda v: lax.psum(v, DATA_AXIS), out)

    def _eval_grouped(self, grouped: Stacked) -> Stacked:
        """``grouped`` as the evaluation reads it (a trainer whose state lives in files streams it)."""
        return grouped

    def layer_params(self, ts: TrainState, i: int):
        """Layer ``i``'s params as device arrays, whole (`Residency.fetch`), tied leaves included from their
        owners (`Model.merge_tied`; only the owners are fetched)."""
        params, fetch = ts.params, self.residency.fetch
        ties = self.model.ties_of(i)
        own = fetch(params[i])
        return self.model.merge_tied(i, own, {t.owner: fetch(params[t.owner]) for t in ties}) if ties else own

    def tied_params(self, grouped: Stacked, g: int):
        """Group ``g``'s params with the tied leaves of its (single) layer put back from their owners' groups
        (a tie's owner is always a group of its own; only the owners are read: a streamed tier's views fetch
        what is read)."""
        start, count = grouped.groups[g]
        ties = self.model.ties_of(start)
        if count > 1 or not ties:
            return grouped.params[g]
        where = {s: k for k, (s, c) in enumerate(grouped.groups) if c == 1}
        return self.model.merge_tied(start, grouped.params[g], {t.owner: grouped.params[where[t.owner]] for t in ties})

    def layer_state(self, ts: TrainState, i: int):
        return ts.layer_state[i]

    def eval_programs(self, groups) -> tuple[list, object]:
        """The compiled programs `eval_step` calls on a state in the layout ``groups`` (``((start, count),
        ...)``, the head's group last): one per group but the head's (a layer's `eval_forward`, or a stacked
        run's scan of it; ``(params, layer state, x) -> y``, ``x`` and ``y`` split over ``"data"``), and the
        head's (``(params with its tied leaves, layer state, x, batch) -> {"loss_sum", "weight",
        "correct"}`` summed over devices). The memory plan compiles these on shapes
        (`revtrain.planning.costs.eval_temporaries`), so that the run's first evaluation finds them compiled."""
        last = self.model.layers[-1]
        head = self._compiled("eval_head", last, self._eval_head,
                              (self.specs.params(last), P(), P(DATA_AXIS), P(DATA_AXIS)), P())
        return self._eval_fns(groups), head

    def _eval_fns(self, groups) -> list:
        """The compiled evaluation function of each group but the head (built once per layout)."""
        key = ("eval_plan", groups)
        if key not in self._cache:
            layers, fns = self.model.layers, []
            for start, count in groups[:-1]:
                layer = layers[start]
                if count == 1:
                    fns.append(self._compiled("eval", layer, self._eval_layer,
                                              (self.specs.params(layer), P(), P(DATA_AXIS)), P(DATA_AXIS)))
                else:
                    fns.append(self._compiled("eval_run", layer, self._eval_run,
                                              (self.specs.params(layer, 1), P(), P(DATA_AXIS)), P(DATA_AXIS),
                                              key=("eval_run", layer, count)))
            self._cache[key] = fns
        return self._cache[key]

    def eval_step(self, ts: TrainState, batch: dict) -> dict:
        """Forward-only pass, layer by layer (a stacked run in one scan), in evaluation mode (no dropout,
        running statistics).

        Args:
          ts: the train state (either layout; not consumed).
          batch: dict of global arrays split over ``"data"``: the model's input key, ``targets`` and
            optionally ``weights`` (0 for padding).

        Returns:
          dict of float32 scalars summed over the global batch: ``loss_sum`` (nats), ``weight``,
          ``correct``.
        """
        check_batch(batch, self.num_devices)
        grouped = self._eval_grouped(self.grouped(ts))
        x = batch[self.model.input_key]
        fns, head = self.eval_programs(grouped.groups)
        for g, fn in enumerate(fns):  # with offload each program moves its weights
            x = fn(grouped.params[g], grouped.layer_state[g], x)
        return head(self.tied_params(grouped, len(grouped.groups) - 1), grouped.layer_state[-1], x, batch)
