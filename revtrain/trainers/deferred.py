"""The reversible trainer's deferred update: gradient accumulation, a whole-model optimizer, tied parameters.

The fused per-layer update (`reversible`) applies layer i's optimizer step inside layer i's backward
program, before layer i-1's gradient exists. That is free, and exact for an optimizer whose update of one
layer needs nothing from the others. Three things need the whole step's gradient first:

* **Microbatches** (``microbatches = M > 1``, gradient accumulation): the step's gradient is the sum over
  M forward/backward passes of one microbatch each.
* **A coupled optimizer**: ``optax.clip_by_global_norm`` (the global norm), ``optax.apply_if_finite``, any
  optax chain whose whole-model program combines layers (`layerwise.LayerwiseUpdate`); and, with
  ``shard_state``, one whose update of a leaf needs the whole leaf (LAMB's trust ratio, Adafactor's
  factored moments).
* **Tied parameters** (`Model.ties`): a leaf used by two layers gets its gradient from both, and the user
  (the head) runs its backward long before the owner (the embedding).

Then the backward programs *accumulate* each layer's gradient (summed over devices, or reduce-scattered
to the local piece with ``shard_state``) into a buffer that lives where that layer's weights live: host
memory with offload, files with the disk tier (`streaming.DeferredStream`), a 1/N
piece with ``shard_state``, the device otherwise (the one figure that grows with
depth there: the gradients of every layer). The gradient of a tied leaf's other use waits beside its
owner's. When the last microbatch is done, two streamed passes run over the layers (per layer, or one
``lax.scan`` per stacked run, moving each layer's weights, optimizer state and gradient to the device and
back as the backward does):

1. **statistics** (``rounds`` passes; at least one): each layer's exports for the optimizer's global
   reductions (the per-leaf sums of squares for global-norm clipping), its per-leaf sums of squares (the
   logged ``grad_norm``) and whether it is finite; a tiny global program per round combines the exports;
2. **update**: each layer's optimizer step from its own gradient, weights, optimizer state and the globals
   (``tx.update`` on the layer for a separable optimizer; the layer's slice of the whole-model program
   otherwise; an update that reads the step's loss, optax's ``value``, gets the loss as logged in both
   passes and in the global programs), skipped everywhere when any gradient or the loss is not finite; the gradient buffer is
   zeroed for the next step in the same program.

Both passes are plain ``jax.jit`` programs on the global arrays (no ``shard_map``): with ``shard_state``,
XLA's SPMD partitioner assembles whatever an update needs of the whole leaf across devices and keeps the
results split as the inputs were; with replicated state every device computes the same update (pmap
semantics). The loss is normalised as one step on the whole batch: with M > 1 the head pulls back the
summed loss and the accumulated gradient is divided by the whole batch's weight (``stats["weight"]``, the
target count) before the statistics. Dropout keys follow each example's row in the whole batch, so M
microbatches draw the masks one step on the whole batch draws.

Of the options (a streamed pass after the backward; applying layer i's update when the next step's forward
brings layer i in; computing the update where the state lives) this is the first: it keeps each step
self-contained (a checkpoint, an evaluation or a sample never sees a pending update; resume stays
bit-exact), and its cost is one extra read of the weights and optimizer state per layer (measured in
docs/recipe.md). Checkpoints hold whole steps only: accumulation happens inside one ``train_step``.

`DeferredUpdate` is an object the trainer owns (``ReversibleTrainer.deferred_update``), made from the inputs
its constructor declares (the model, the optimizer and its split, the layers' specs, the trainer's per-layer
programs, the tier, the mesh, the microbatches, a dispatch function); it reads nothing else of the trainer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, put_replicated, put_sharded
from revtrain.trainers.common import (batch_size_of, example_keys, grad_norm, microbatch_where, per_device,
                                      reduce_grads, take_microbatch)
from revtrain.trainers.layerwise import all_finite, deferred_layer_update, fence
from revtrain.trainers.specs import leaf_squares
from revtrain.trainers.modes import REMAT, ProgramSpec, forward_in_head
from revtrain.trainers.walk import walk
from revtrain.trainers.stacking import kept_loop_index
from revtrain.trainers.stacking import slice_of as _slice

_R, _D = P(), P(DATA_AXIS)


def _add(acc, grads):
    return jax.tree.map(jnp.add, acc, grads)


class DeferredUpdate:
    """The deferred update of a `ReversibleTrainer` (see the module note): its accumulating backward programs,
    its gradient buffers and its statistics and update passes. The trainer owns one when its update is
    deferred (``ReversibleTrainer.deferred_update``; made again with its programs when the tier changes) and
    keeps what is not the update's: the layout of the state (``Stacked`` groups), the step's plan of
    compiled calls (`walk.Plan`, whose backward and head programs it takes from `per_layer`, `run` and
    `top_head`), a streamed tier's stream and the `TrainState`.

    Args:
      model: the `revtrain.models.Model` (its layers, ``ties``, ``input_key``).
      tx: the optax ``GradientTransformation`` as the trainer keeps its state (`revtrain.optstate.keep_states`).
      layerwise: ``tx``'s split over the layers (`layerwise.LayerwiseUpdate`): its global ``rounds``,
        exports, combine programs and per-layer update.
      specs: each layer's split over the ``"data"`` devices (`specs.StateSpecs`).
      programs: the trainer's per-layer programs (`programs.LayerPrograms`): its ``compile`` and ``compiled``
        (``jit(shard_map(...))`` over the mesh, cached by the trainer), ``block_grads`` and ``rebuild_mode``.
      tier: where the weights and optimizer state live (a `revtrain.tiers` tier: ``streamed`` and what
        `walk.walk` asks of it).
      mesh: the 1-D ``"data"`` mesh.
      microbatches: M, the microbatches of a step (int >= 1).
      shard_state: whether large leaves are split over the devices (the statistics gather them whole).
      dispatch: ``dispatch(jitted) -> callable``, how the update's plain ``jax.jit`` programs are called (the
        trainer's dispatch limiter and memory meter, `common._Dispatch`).
    """

    def __init__(self, model, tx, layerwise, specs, programs, tier, mesh, microbatches: int, shard_state: bool,
                 dispatch):
        self.model, self.tx, self.layerwise, self.specs, self.programs = model, tx, layerwise, specs, programs
        self.tier, self.mesh, self.microbatches, self.shard_state = tier, mesh, microbatches, shard_state
        self.dispatch = dispatch
        self._cache: dict = {}  # the update passes, global programs and microbatch helpers, by key
        # The device tier's gradient buffers (`_buffers`): per group, the tied leaves' other uses, the layout
        # they were made for, and whether they are zero.
        self._acc, self._tie_acc, self._acc_key, self._acc_clean = None, None, None, False

    @property
    def buffers(self) -> list | None:
        """The device tier's gradient buffers (one tree per group, shaped and placed like its weights: float
        like the parameters), None before the first step or with a streamed tier (its store holds them)."""
        return self._acc

    @property
    def passes(self) -> int:
        """Streamed passes over the layers after the backward: the statistics rounds (at least one) and the
        update."""
        return max(self.layerwise.rounds, 1) + 1

    def owners(self, groups) -> dict:
        """The tied leaves' owners in the layout ``groups`` (``((start, count), ...)``; each owner a group of
        its own): ``{group index: layer index}``."""
        return {k: s for k, (s, c) in enumerate(groups) if c == 1 and any(t.owner == s for t in self.model.ties)}

    # -- the accumulating backward programs (inside shard_map over "data") --------------------------
    def _head_acc(self, layer, params, acc, state, x, batch, ctx, index, borrowed, tie_acc):
        """The head's loss and vjp, its gradient added to ``acc`` (and its tied leaves' to ``tie_acc``).
        Returns ``(dx, acc, new_state, (loss sum, correct, weight) over all devices, tie_acc)``; with one
        microbatch the loss is the mean (its gradient already normalised)."""
        keys = example_keys(ctx, index, batch_size_of(x))
        user, normalize = len(self.model.layers) - 1, self.microbatches == 1

        def objective(p, tied, x):
            full = self.model.merge_tied_leaves(user, p, tied) if tied else p
            loss_sum, stats, new_state = layer.loss(full, state, x, batch, keys, True)
            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
            return (loss_sum / total if normalize else loss_sum), (stats, new_state, total)

        obj, vjp_fn, (stats, new_state, total) = jax.vjp(
            objective, per_device(self.specs.whole(layer, params)), per_device(borrowed), x, has_aux=True)
        grads, tied, dx = vjp_fn(jnp.ones_like(obj))
        acc = _add(acc, reduce_grads(grads, self.specs.grads(layer)))
        tie_acc = _add(tie_acc, lax.psum(tied, DATA_AXIS))
        sums = (lax.psum(obj, DATA_AXIS), lax.psum(stats["correct"], DATA_AXIS), total)
        return dx, acc, new_state, sums, tie_acc

    def _top_head_acc(self, layers, top_params, top_acc, top_states, head_params, head_acc, head_state, x, batch,
                      ctx, top_index, head_index):
        """`_head_acc` through the blocks under the head in its program (tuples ``top_*``, bottom first, each
        run in its mode: ``layers = (tops, head, top modes)``): one vjp from the lowest one's input, every
        gradient added to its buffer. Returns ``(dx, top_acc, new top states, head_acc, new head state,
        sums)``."""
        tops, head, modes = layers
        n = batch_size_of(x)
        normalize = self.microbatches == 1

        def objective(tps, hp, x):
            x, new_states = forward_in_head(tops, modes, (1,) * len(tops), tps, top_states, x,
                                            [example_keys(ctx, i, n) for i in top_index])
            loss_sum, stats, new_head_state = head.loss(hp, head_state, x, batch, example_keys(ctx, head_index, n), True)
            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
            return (loss_sum / total if normalize else loss_sum), (stats, new_states, new_head_state, total)

        obj, vjp_fn, (stats, new_top_states, new_head_state, total) = jax.vjp(
            objective, tuple(per_device(self.specs.whole(t, p)) for t, p in zip(tops, top_params)),
            per_device(self.specs.whole(head, head_params)), x, has_aux=True)
        top_grads, head_grads, dx = vjp_fn(jnp.ones_like(obj))
        top_acc = tuple(_add(a, reduce_grads(g, self.specs.grads(t))) for t, a, g in zip(tops, top_acc, top_grads))
        head_acc = _add(head_acc, reduce_grads(head_grads, self.specs.grads(head)))
        sums = (lax.psum(obj, DATA_AXIS), lax.psum(stats["correct"], DATA_AXIS), total)
        return dx, top_acc, new_top_states, head_acc, new_head_state, sums

    def top_head(self, tops, head, modes):
        """The compiled accumulating program of the head through the blocks ``tops`` (a tuple of layers,
        bottom first, one block each, run in ``modes``) in its program (`_top_head_acc`): ``(top params,
        top buffers, top states, head params, head buffer, head state, x, batch, ctx, top indices, head
        index) -> (dx, top buffers, new top states, head buffer, new head state, (loss, correct, weight))``;
        the buffers are donated."""
        tspec, hspec = tuple(self.specs.layer(t)[0] for t in tops), self.specs.layer(head)[0]
        in_specs = (tspec, tspec, _R, hspec, hspec, _R, _D, _D, _R, _R, _R)
        out_specs = (_D, tspec, _R, hspec, _R, _R)
        return self.programs.compiled("top_head_acc", (tops, head, tuple(modes)), self._top_head_acc, in_specs,
                                        out_specs, (1, 4))

    def _reverse_acc(self, layer, params, acc, state, y, dy, ctx, index):
        keys = example_keys(ctx, index, batch_size_of(y))
        x, dx, grads = self.programs.block_grads(self.programs.rebuild_mode, layer, params, state, y, dy, keys)
        return x, dx, _add(acc, grads)

    def _recompute_acc(self, layer, params, acc, state, x, dy, ctx, index):
        keys = example_keys(ctx, index, batch_size_of(x))
        _, dx, grads = self.programs.block_grads(REMAT, layer, params, state, x, dy, keys)
        return dx, _add(acc, grads)

    def _reverse_run_acc(self, layer, params, acc, states, y, dy, ctx, start):
        """``_reverse_acc`` of every layer of a stacked run, last first: one reverse ``lax.scan`` that reads
        each slice of the weights and adds to the gradient stack in place. As in ``_reverse_run``, the gradient slice a step adds to is read (and carried) only after
        the previous step's write, so XLA keeps one copy of the stack."""
        count = jax.tree.leaves(params)[0].shape[0]

        def body(carry, slices):
            accs, y, dy, a = carry
            s, j = slices
            x, dx, a = self._reverse_acc(layer, _slice(params, j), a, s, y, dy, ctx, start + j)
            accs = jax.tree.map(lambda st, v: lax.dynamic_update_index_in_dim(st, v, j, 0), accs, a)
            return (accs, x, dx, _slice(accs, jnp.maximum(j - 1, 0))), None

        carry = (acc, y, dy, _slice(acc, count - 1))
        (acc, x, dx, _), _ = lax.scan(body, carry, (states, jnp.arange(count, dtype=jnp.int32)), reverse=True)
        return x, dx, acc

    # Per-layer programs of the accumulating backward (`modes.ProgramSpec`). "A" marks the layer's
    # params/gradient specs (the gradient buffer is split like the params with shard_state).
    _ACC = {
        "head_acc": ProgramSpec("_head_acc", ("A", "A", _R, _D, _D, _R, _R, _R, _R), (_D, "A", _R, _R, _R), (1, 8),
                                (0, 1, 7, 8), (1, 4)),
        "reverse_acc": ProgramSpec("_reverse_acc", ("A", "A", _R, _D, _D, _R, _R), (_D, _D, "A"), (1, 3, 4), (0, 1),
                                   (2,)),
        "recompute_acc": ProgramSpec("_recompute_acc", ("A", "A", _R, _D, _D, _R, _R), (_D, "A"), (1, 4), (0, 1),
                                     (1,)),
    }

    def per_layer(self, kind: str, layer):
        """The compiled accumulating program ``kind`` (``"head_acc"``, ``"reverse_acc"``, ``"recompute_acc"``:
        `_head_acc`, `_reverse_acc`, `_recompute_acc`) of ``layer``, its weights and gradient buffer split
        as the layer's state (``specs``), the buffer donated and returned with the gradient added."""
        name, in_specs, out_specs, donate = self._ACC[kind][:4]
        pspec = self.specs.layer(layer)[0]
        fill = lambda specs: tuple(pspec if s == "A" else s for s in specs)  # noqa: E731
        return self.programs.compiled(kind, layer, getattr(self, name), fill(in_specs), fill(out_specs), donate)

    def run(self, layer, count: int):
        """The compiled `_reverse_run_acc` of a stacked run of ``count`` layers like ``layer`` (rebuilt):
        ``(params, buffers, states, y, dy, ctx, start) -> (x, dx, buffers)``, the buffer stack donated."""
        pspec = self.specs.group(layer, count)[0]
        return self.programs.compile("reverse_run_acc", layer, self._reverse_run_acc,
                                     (pspec, pspec, _R, _D, _D, _R, _R), (_D, _D, pspec), donate=(1, 3, 4),
                                     key=("reverse_run_acc", layer, count))

    # -- the gradient buffers ------------------------------------------------------------------------
    def _buffers(self, groups, params: list):
        """The zeroed gradient buffers of every group of ``groups`` (shaped like its ``params`` and placed where
        they live: the device) and of the tied leaves' other uses (beside their owners), made once per layout
        and zeroed again by each update pass."""
        key = groups
        if self._acc_key != key or not self._acc_clean:
            kind = None  # (device memory: a streamed tier's buffers are its store's, `DeferredStream`)
            acc = []
            for g, (start, count) in enumerate(groups):
                zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params[g])
                if self.shard_state:
                    acc.append(put_sharded(zeros, self.mesh, self.specs.group(self.model.layers[start], count)[0], kind))
                else:
                    acc.append(put_replicated(zeros, self.mesh, kind))
            user = len(self.model.layers) - 1
            owners = {s: params[k] for k, (s, c) in enumerate(groups) if c == 1}
            tied = self.model.tied_leaves(user, owners)
            self._acc = acc
            self._tie_acc = put_replicated(tuple(np.zeros(x.shape, x.dtype) for x in tied), self.mesh, kind)
            self._acc_key, self._acc_clean = key, True
        return self._acc, self._tie_acc

    # -- the update passes (plain jit over the global arrays) --------------------------------------
    def _shardings(self, layer, count: int):
        """(params, optimizer state) shardings of a group on the device (where every program computes)."""
        return tuple(jax.tree.map(lambda p: NamedSharding(self.mesh, p), s) for s in self.specs.group(layer, count))

    def _grads_of(self, index: int, acc, tie_in, scale, scalars: list):
        """A layer's step gradient from its buffer: plus its tied leaves' other uses, over the whole
        batch's weight with microbatches (that weight appended to ``scalars``: StandardTrainer divides
        every leaf by it in one program, see `layerwise.fence`)."""
        g = self.model.add_tied(index, acc, tie_in) if tie_in else acc
        if scale is None:
            return g
        scalars.append(scale)
        # The quotient passes a barrier: StandardTrainer divides before its update's ``cond``, so the update
        # sees each quotient as a value; here XLA would otherwise fold a later division (the clip's
        # ``g / norm``) into ``acc * (1 / (scale * norm))``, a few ulps away.
        return fence([scale], jax.tree.map(lambda v: v / scale, g))

    def _layer_stats(self, k, index, params, opt, acc, tie_in, scale, globals_, value, hvp=None):
        scalars: list = []
        g = self._grads_of(index, acc, tie_in, scale, scalars)
        if self.shard_state:
            # The reductions (a leaf's sum of squares for global-norm clipping and grad_norm) run on the
            # whole leaf, gathered: summed from the devices' pieces they would add in another order than
            # StandardTrainer's sum over the replicated leaf (up to 4.8e-7 in the loss after 10 steps).
            # One layer's gradient is whole on each device for this program, as its weights are in the
            # forward.
            g = jax.lax.with_sharding_constraint(g, NamedSharding(self.mesh, _R))
        exports = (self.layerwise.exports(k, index, g, opt, params, globals_, scalars, value=value, hvp=hvp)
                   if k < self.layerwise.rounds else ())
        return fence(scalars, exports if k else (exports, leaf_squares(g), all_finite(g)))

    def _layer_update(self, index, params, opt, acc, tie_in, scale, globals_, ok, value, hvp=None):
        g = self._grads_of(index, acc, tie_in, scale, [])  # (the quotient is fenced there)

        new_params, new_opt = deferred_layer_update(self.tx, self.layerwise, index, g, opt, params, globals_, ok,
                                                    value, hvp)
        zeros = jax.tree.map(jnp.zeros_like, acc)
        return new_params, new_opt, zeros, jax.tree.map(jnp.zeros_like, tie_in)

    def _pass_fn(self, what: str, g: int, groups, k: int = 0):
        """The compiled statistics (``what="stats"``, round ``k``) or update program of group ``g``, looked
        up by position (the layer's hash walks its module graph: done once per layout)."""
        fast = (what, g, groups, k)
        if fast not in self._cache:
            self._cache[fast] = self._build_pass_fn(what, g, groups, k)
        return self._cache[fast]

    def _build_pass_fn(self, what: str, g: int, groups, k: int):
        start, count = groups[g]
        layer = self.model.layers[start]
        # Layers with equal update programs share one (a coupled update's layer programs differ by the
        # exports and globals they read: `LayerwiseUpdate.signature`).
        key = (what, layer, count, k, start if self.model.ties else None, self.layerwise.signature(start)
               if not self.layerwise.separable else None)
        if key in self._cache:
            return self._cache[key]
        if what == "stats":
            def one(params, opt, acc, tie_in, scale, globals_, value, hvp):
                return self._layer_stats(k, start, params, opt, acc, tie_in, scale, globals_, value, hvp)

            if count == 1:
                fn = one
            else:
                def fn(params, opt, acc, tie_in, scale, globals_, value, hvp):
                    def body(_, j):
                        slices = _slice((params, opt, acc), j)
                        h = _slice(hvp, j) if hvp is not None else None
                        return None, self._layer_stats(k, start, *slices, tie_in, scale, globals_, value, h)
                    return lax.scan(body, None, jnp.arange(count, dtype=jnp.int32))[1]
            jitted = jax.jit(fn)
        else:
            def one(params, opt, acc, tie_in, scale, globals_, ok, value, hvp):
                return self._layer_update(start, params, opt, acc, tie_in, scale, globals_, ok, value, hvp)

            if count == 1:
                fn = one
            else:
                def fn(params, opt, acc, tie_in, scale, globals_, ok, value, hvp):
                    # Each slice is read (and carried) after the previous slice's write: one copy of the stacks.
                    def body(carry, j):
                        stacks, (p, o, a) = carry
                        j = kept_loop_index(j)  # run fusion by fusion, as the whole-model program (`kept_loop_index`)
                        h = _slice(hvp, j) if hvp is not None else None
                        new = self._layer_update(start, p, o, a, tie_in, scale, globals_, ok, value, h)[:3]
                        stacks = jax.tree.map(lambda st, v: lax.dynamic_update_index_in_dim(st, v, j, 0), stacks, new)
                        return (stacks, _slice(stacks, jnp.minimum(j + 1, count - 1))), None
                    stacks = (params, opt, acc)
                    (stacks, _), _ = lax.scan(body, (stacks, _slice(stacks, 0)),
                                              jnp.arange(count, dtype=jnp.int32))
                    return (*stacks, tie_in)
            pshard, oshard = self._shardings(layer, count)
            shardings = (pshard, oshard, pshard, NamedSharding(self.mesh, _R))
            jitted = jax.jit(fn, donate_argnums=(0, 1, 2, 3), out_shardings=shardings)
        self._cache[key] = self.dispatch(jitted)
        return self._cache[key]

    def _zeros(self, groups, g: int):
        """Zeros shaped and placed like group ``g``'s weights on the device (one program per group)."""
        key = ("zeros", g, groups)
        if key not in self._cache:
            start, count = groups[g]
            shapes = self.model.param_shapes()[start]
            if count > 1:
                shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((count,) + x.shape, x.dtype), shapes)
            self._cache[key] = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
                                       out_shardings=self._shardings(self.model.layers[start], count)[0])
        return self._cache[key]()

    def _combine_fn(self, k: int, groups):
        key = ("combine", k, groups)
        if key not in self._cache:
            def fn(exports, global_leaves, globals_, value):
                per_layer = []  # exports[r][i] per layer: a stacked run's are unstacked here
                for ex in exports:
                    layers = []
                    for (start, count), e in zip(groups, ex):
                        layers.extend([e] if count == 1 else [tuple(v[j] for v in e) for j in range(count)])
                    per_layer.append(layers)
                leaves = global_leaves  # the first layer's (of a run: its first slice)
                if groups[0][1] > 1:
                    leaves = tuple(x[0] for x in leaves)
                return self.layerwise.combine(k, per_layer, leaves, globals_, value)
            self._cache[key] = self.dispatch(jax.jit(fn))
        return self._cache[key]

    # -- one step ------------------------------------------------------------------------------------
    def step(self, plan, groups, params: list, opt_state: list, states: list, acc, batch: dict, skey, hvp=None):
        """One step with the deferred update (see the module note): every microbatch's forward and
        accumulating backward, then the statistics and update passes. The gradient buffers live where the
        weights do: on the device (made once and zeroed by each update pass, `_buffers`), or with a streamed
        tier in its store beside each layer (``acc``: `streaming.DeferredStream`'s views, read ahead and
        written behind as the weights are; memory holds the layers in flight and the tied leaves' other-use
        buffer).

        Args:
          plan: the step's compiled calls (`walk.Plan`, its accumulating programs from this object).
          groups: the layout ``((start, count), ...)`` of ``params``, ``opt_state`` and ``states``.
          params, opt_state: one entry per group (a stacked run's with a leading layer axis), as the tier
            hands them: the device arrays (given up: the update donates them), or a stream's views.
          states: the layers' states (one per group), as the step starts.
          acc: a streamed tier's gradient buffer views (one per group), or None: the device buffers.
          batch: the global batch (``{input key, targets[, weights]}``, split over ``"data"``).
          skey: the step's key (uint32 ``[2]``, `common.step_key`).
          hvp: one Hessian-vector product per group (a stacked run's stacked) where the tier keeps activations,
            for an update that reads one (`layerwise.LayerwiseUpdate.takes_hvp`: optax's Hutchinson estimator;
            `revtrain.trainers.hessian`; each None on a step whose update does not read them: zeros are given);
            None for every other optimizer.

        Returns:
          ``(params, opt_state, new states, metrics, finite)``: the lists updated in place (no layer updated
          when any gradient or the loss is not finite), the layers' new states, ``{"loss", "accuracy",
          "grad_norm"}`` (replicated float32 scalars; the loss the mean over the global batch, nats) and one
          finite flag (bool array) per group for `common.check_finite`.
        """
        user = len(self.model.layers) - 1
        owners = self.owners(groups)  # the tied leaves' owners (each a group of its own): group -> layer
        streamed = acc is not None
        if streamed:
            shapes = self.model.param_shapes()
            tied = self.model.tied_leaves(user, {s: shapes[s] for s in owners.values()})
            tie_acc = put_replicated(tuple(np.zeros(x.shape, x.dtype) for x in tied), self.mesh, None)
        else:
            acc, tie_acc = self._buffers(groups, params)
            acc = list(acc)
            self._acc_clean = False  # until the update pass has zeroed them again
        held = {"tie": tie_acc}
        del tie_acc
        current, (loss_sum, correct, total) = self._accumulate(plan, params, acc, states, batch, skey, owners, held)
        tie_acc = held.pop("tie")
        if self.microbatches == 1:  # the head's loss is the mean already, its gradient normalised
            loss, scale = loss_sum, None
        else:
            loss, scale = _over(loss_sum, total), total
        metrics = {"loss": loss, "accuracy": _over(correct, total)}

        def tie_in(g):
            return tie_acc if g in owners else ()

        # The step's loss, as logged, for an optimizer whose update reads it (``value``: polyak_sgd, momo,
        # reduce_on_plateau); None (no input at all) for every other optimizer, whose programs are unchanged.
        value = loss if self.layerwise.takes_value else None
        def hvp_of(g):  # (None: no products this step; zeros, which the update's untaken branch never reads)
            if hvp is None:
                return None
            return self.tier.bring(hvp[g]) if hvp[g] is not None else self._zeros(groups, g)

        globals_, sq, finite = self._statistics(groups, params, opt_state, acc, tie_in, scale, value, hvp_of)
        ok = _all_ok(finite, loss)
        for g in range(len(groups)):
            new_params, new_opt, zeroed, zeroed_tie = self._pass_fn("update", g, groups)(
                params[g], opt_state[g], acc[g], tie_in(g), scale, globals_, ok, value, hvp_of(g))
            params[g], opt_state[g] = new_params, new_opt  # (a streamed layer written back; its buffer dropped)
            del new_params, new_opt
            if hvp is not None:  # (its last use)
                hvp[g] = None
            if not streamed:  # the zeroed buffer is the next step's
                acc[g] = zeroed
            if tie_in(g):
                tie_acc = zeroed_tie
            del zeroed, zeroed_tie
        if not streamed:
            self._acc, self._tie_acc, self._acc_clean = acc, tie_acc, True
        metrics["grad_norm"] = grad_norm(sq)
        return params, opt_state, current, metrics, finite

    def _accumulate(self, plan, params, acc, states, batch: dict, skey, owners: dict, held: dict):
        """Every microbatch's forward and accumulating backward (`walk`), each layer's gradient added to its
        buffer in ``acc`` (``held["tie"]``: the tied leaves' other-use buffer). Returns ``(the new layer states,
        (loss sum, correct, weight))`` summed over the microbatches."""
        index, last, top = plan.index, len(plan.blocks) - 1, plan.top
        m_count = self.microbatches
        local = batch_size_of(batch) // self.mesh.size
        current, sums = list(states), None
        for m in range(m_count):
            mb = batch if m_count == 1 else self._microbatch(batch, m)
            ctx = skey if m_count == 1 else (skey, self._where(m, local))
            new_states = list(current)

            def head(x, mb=mb, ctx=ctx, new_states=new_states, current=current):
                if top:  # the backprop blocks under the head run inside its program
                    t = slice(last - top, last)
                    dy, acc[t], new_states[t], acc[last], new_states[last], s = plan.head(
                        tuple(params[t]), tuple(acc[t]), tuple(current[t]), params[last], acc[last], current[last],
                        x, mb, ctx, tuple(index[t]), index[last])
                else:
                    dy, acc[last], new_states[last], s, held["tie"] = plan.head(
                        params[last], acc[last], current[last], x, mb, ctx, index[last], self._borrowed(params, owners),
                        held["tie"])
                held["sums"] = s
                return dy

            def store(g, rest):
                acc[g], = rest

            walk(plan, self.tier, params, acc, current, new_states, mb[self.model.input_key], ctx, head, store)
            sums = held.pop("sums") if sums is None else _add_sums(sums, held.pop("sums"))
            current = new_states
        return current, sums

    def _statistics(self, groups, params, opt_state, acc, tie_in, scale, value=None, hvp_of=lambda g: None):
        """The statistics passes (`layerwise.LayerwiseUpdate.rounds`, at least one): each layer's exports for
        the optimizer's global reductions, combined into the globals; the first pass also gives each layer's
        squares and finite flag. ``value``: the step's loss for an optimizer that reads it, else None;
        ``hvp_of(g)``: group ``g``'s Hessian-vector product on the device for one that reads it, else None.
        Returns ``(globals, squares, finite)``."""
        rounds = self.layerwise.rounds
        exports, globals_, sq, finite = [], (), [None] * len(groups), [None] * len(groups)
        shared = None  # the first layer's leaves every layer has (the step count), kept from its first read
        for k in range(max(rounds, 1)):
            ex = []
            for g in range(len(groups)):
                p, opt = params[g], opt_state[g]  # (read in a streamed schedule's order: weights, state, buffer)
                if shared is None:
                    shared = self.layerwise.global_leaves(0, opt)
                out = self._pass_fn("stats", g, groups, k)(p, opt, acc[g], tie_in(g), scale, globals_, value,
                                                            hvp_of(g))
                del p, opt
                if k == 0:
                    out, sq[g], finite[g] = out
                ex.append(out)
            exports.append(ex)
            if k < rounds:
                globals_ = self._combine_fn(k, groups)(exports, shared, globals_, value)
        return globals_, sq, finite

    def _borrowed(self, params, owners: dict):
        """The head's tied leaves from their owners' weights (``owners``: group -> layer), whole on every
        device (an owner's are split with ``shard_state``)."""
        borrowed = self.model.tied_leaves(len(self.model.layers) - 1, {s: params[k] for k, s in owners.items()})
        if self.shard_state and borrowed:
            borrowed = jax.device_put(borrowed, NamedSharding(self.mesh, _R))
        return borrowed

    # -- small helpers of the step -----------------------------------------------------------------
    def _microbatch(self, batch: dict, m: int) -> dict:
        key = "microbatch"
        if key not in self._cache:
            mapped = jax.shard_map(lambda b, m: take_microbatch(b, m, self.microbatches), mesh=self.mesh,
                                   in_specs=(_D, _R), out_specs=_D)
            self._cache[key] = jax.jit(mapped)
        return self._cache[key](batch, np.int32(m))

    def _where(self, m: int, local: int):
        key = ("where", m, local)
        if key not in self._cache:
            self._cache[key] = put_replicated(microbatch_where(m, self.microbatches, local), self.mesh)
        return self._cache[key]


@jax.jit
def _add_sums(a, b):
    return jax.tree.map(jnp.add, a, b)


@jax.jit
def _over(a, b):
    return a / b


@jax.jit
def _all_ok(finite, loss):
    flags = [jnp.all(f) for f in finite] + [jnp.isfinite(loss)]
    return jnp.all(jnp.stack(flags))

