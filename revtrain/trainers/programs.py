"""The reversible trainer's per-layer programs: what each compiled call of a step computes.

Each function here runs inside ``shard_map`` over ``"data"``, one layer (or a stacked run of identical
layers) at a time, and fuses what the step needs of that layer: the forward of a rebuilt or a kept block
(`modes.BackwardMode.forward`); the head's loss, ``vjp``, gradient sum and optax update in one call, through
the blocks run inside its program (backprop, checkpoint: `top_head_grads`); and the backward's "reverse and
update" (rebuild the input from the output, ``vjp`` there, sum the gradients, the layer's optax update) or
"recompute and update" (a standard layer or remat block from its kept input). A stacked run's forward and
backward are one ``lax.scan`` each, whose body is the per-layer function. With ``shard_state`` each takes the
local pieces of its layer's weights and optimizer state: the weights are gathered whole at entry, the
gradients reduce-scattered back to pieces and the update runs on the pieces (`revtrain.trainers.specs`).

`LayerPrograms` is an object the trainer owns (``ReversibleTrainer.programs``), made from what it declares:
the optimizer, the layers' split (`StateSpecs`), the rebuild flavour and a compile function
(the trainer's: ``jit(shard_map(...))`` over its mesh, each call through its dispatch limiter). Its public
methods give the programs a step runs (`per_layer`, `top_head`, `run`): the trainer's step, the memory plan and
the budget planner (`revtrain.planning`) take them from here, so a program compiled for a plan is the one the
run calls. `on_mesh` makes one for a trainer choice that has no trainer (the memory plan's alternatives, ``revtrain
check``). The gradient-only programs (``head_grads``, ``rebuild_grads``, ``recompute_grads``,
`top_head_grads_program`) are the per-layer programs without the update: ``revtrain check`` compares their
gradients with backprop's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS
from revtrain.trainers.common import XLA_OPTIONS, batch_size_of, example_keys, per_device, reduce_grads
from revtrain.trainers.layerwise import guarded_update
from revtrain.trainers.modes import BACKPROP, REBUILDS, REMAT, ProgramSpec, forward_in_head
from revtrain.trainers.stacking import slice_of as _slice

_R, _D = P(), P(DATA_AXIS)
_SD = P(None, DATA_AXIS)  # a stack of activations (a leading layer axis)


class LayerPrograms:
    """The per-layer and scanned programs of the reversible trainer (see the module note).

    Args:
      tx: the optax ``GradientTransformation`` of each layer's update.
      specs: the layers' split over ``"data"`` (`revtrain.trainers.specs.StateSpecs`).
      rebuild_mode: the rebuilt blocks' mode (a `modes.REBUILDS` value).
      compile: ``compile(kind, layer, fn, in_specs, out_specs, donate=(), key=None, donate_if_used=())`` ->
        the jitted ``shard_map`` of ``partial(fn, layer)``, cached under ``key`` (default ``(kind, layer)``):
        `TrainerBase._compiled`, or `compile_on` a mesh.
    """

    def __init__(self, tx, specs, rebuild_mode, compile):
        self.tx, self.specs, self.rebuild_mode = tx, specs, rebuild_mode
        self.compile = compile
        # What the planners read of these programs compiled on a batch shape (`revtrain.planning.costs`), kept
        # with them: a later plan of the same trainer compiles nothing again.
        self.readings: dict = {}

    @classmethod
    def on_mesh(cls, model, tx, mesh, rebuild: str = "exact") -> "LayerPrograms":
        """The programs of a trainer choice without a trainer: ``model``'s layers unsplit on ``mesh`` (the memory
        plan's alternatives, on one device), compiled by `compile_on` (no dispatch limiter)."""
        from revtrain.trainers.specs import StateSpecs
        return cls(tx, StateSpecs(model, tx, mesh.size, False), REBUILDS[rebuild], compile_on(mesh))

    # -- the per-layer fused functions (run inside shard_map over "data") ---------------------------
    # With shard_state each takes the local pieces of its layer's weights and optimizer state: the weights
    # are gathered whole at entry (`_whole`), the gradients reduce-scattered back to pieces (``specs``), and
    # the update runs on the pieces.
    def _forward(self, layer, params, state, x, skey, index):
        """The forward of a rebuilt block (the rebuild mode's: `_fenced` ones also return residuals)."""
        keys = example_keys(skey, index, batch_size_of(x))
        return self.rebuild_mode.forward(layer, self.specs.whole(layer, params), state, x, keys)

    def _forward_kept(self, layer, params, state, x, skey, index):
        """The forward of a block whose input is kept (a standard layer, a remat block)."""
        keys = example_keys(skey, index, batch_size_of(x))
        return REMAT.forward(layer, self.specs.whole(layer, params), state, x, keys)

    def fenced(self, layer) -> bool:
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

    def block_grads(self, mode, layer, params, state, start, dy, keys):
        return mode.grads(layer, self.specs.whole(layer, params), state, start, dy, keys, self.specs.grads(layer))

    def _head(self, layer, params, opt_state, state, x, batch, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        obj, grads, dx, stats, new_state, total = self.head_grads(layer, self.specs.whole(layer, params), state, x, batch,
                                                                  keys, self.specs.grads(layer))
        loss = lax.psum(obj, DATA_AXIS)  # the global mean (identical on every device)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params, ok=jnp.isfinite(loss),
                                                     across=self.specs.across)
        metrics = {"loss": loss, "accuracy": lax.psum(stats["correct"], DATA_AXIS) / total}
        return dx, new_params, new_opt, new_state, metrics, finite, self.specs.squares(layer, grads)

    def _top_grads(self, layers, top_params, top_states, head_params, head_state, x, batch, ctx, top_index,
                   head_index):
        """`top_head_grads` of the trainer's layers (``layers = (tops, head, top modes)``), its weights gathered
        whole."""
        tops, head, modes, counts = layers
        n = batch_size_of(x)
        keys = [example_keys(ctx, i, n) if c == 1 else jnp.stack([example_keys(ctx, i + j, n) for j in range(c)])
                for i, c in zip(top_index, counts)]
        return self.top_head_grads(
            tops, head, [self.specs.whole(t, p) for t, p in zip(tops, top_params)], top_states,
            self.specs.whole(head, head_params), head_state, x, batch, keys, example_keys(ctx, head_index, n),
            [self.specs.grads(t) for t in tops], self.specs.grads(head), modes, counts)

    def _top_head(self, layers, top_params, top_opt, top_states, head_params, head_opt, head_state, x, batch, skey,
                  top_index, head_index):
        """`_head` through the blocks under it in its program (tuples ``top_*``, bottom first): loss, one vjp,
        every block's update."""
        tops, head, _, counts = layers
        obj, top_grads, head_grads, dx, stats, new_top_states, new_head_state, total = self._top_grads(
            layers, top_params, top_states, head_params, head_state, x, batch, skey, top_index, head_index)
        loss = lax.psum(obj, DATA_AXIS)
        new_head, new_head_opt, head_finite = guarded_update(self.tx, head_grads, head_opt, head_params,
                                                             ok=jnp.isfinite(loss), across=self.specs.across)
        new_top, new_top_opt, top_finite, top_sq = [], [], [], []
        for t, g, o, p, c in zip(tops, top_grads, top_opt, top_params, counts):
            if c > 1:
                new_p, new_o, fin, sq = self._stacked_update(t, g, o, p)
            else:
                (new_p, new_o, fin), sq = guarded_update(self.tx, g, o, p, across=self.specs.across), self.specs.squares(t, g)
            new_top.append(new_p), new_top_opt.append(new_o), top_finite.append(fin), top_sq.append(sq)
        metrics = {"loss": loss, "accuracy": lax.psum(stats["correct"], DATA_AXIS) / total}
        return (dx, tuple(new_top), tuple(new_top_opt), new_top_states, new_head, new_head_opt, new_head_state,
                metrics, tuple(top_finite), head_finite, tuple(top_sq), self.specs.squares(head, head_grads))

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
        squares = jax.vmap(lambda g: self.specs.squares(layer, g))(grads)

        def whole():
            first = jax.tree.map(lambda a: a[0] if scalar(a) else a, opt_state)
            new_p, new_o, finite = guarded_update(self.tx, grads, first, params, across=self.specs.across)
            new_o = jax.tree.map(lambda a, b: jnp.broadcast_to(b, a.shape) if scalar(a) else b, opt_state, new_o)
            return new_p, new_o, jnp.broadcast_to(finite, (count,))

        def each():
            def body(stacks, j):
                p, o, g = jax.tree.map(lambda a: a[j], (*stacks, grads))
                new_p, new_o, finite = guarded_update(self.tx, g, o, p, across=self.specs.across)
                stacks = jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, j, 0), stacks,
                                      (new_p, new_o))
                return stacks, finite

            (new_p, new_o), finite = lax.scan(body, (params, opt_state), jnp.arange(count, dtype=jnp.int32))
            return new_p, new_o, finite

        same = jnp.all(jnp.array([jnp.all(a == a[0]) for a in jax.tree.leaves(opt_state) if scalar(a)] or [True]))
        return (*lax.cond(same, whole, each), squares)

    def _reverse_and_update(self, layer, params, opt_state, state, y, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(y))
        x, dx, grads = self.block_grads(self.rebuild_mode, layer, params, state, y, dy, keys)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params, across=self.specs.across)
        return x, dx, new_params, new_opt, finite, self.specs.squares(layer, grads)

    def _recompute_and_update(self, layer, params, opt_state, state, x, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        _, dx, grads = self.block_grads(REMAT, layer, params, state, x, dy, keys)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params, across=self.specs.across)
        return dx, new_params, new_opt, finite, self.specs.squares(layer, grads)

    # -- gradient-only programs (``revtrain check``: a pass's gradients, no update) ---------------------
    def _head_grads_only(self, layer, params, state, x, batch, skey, index):
        """The head's gradients and input cotangent ``(grads, dx)`` (`head_grads`), without the update."""
        keys = example_keys(skey, index, batch_size_of(x))
        _, grads, dx, *_ = self.head_grads(layer, self.specs.whole(layer, params), state, x, batch, keys,
                                           self.specs.grads(layer))
        return grads, dx

    def _rebuild_grads_only(self, layer, params, state, y, dy, skey, index):
        """``(x, dx, grads)`` of a rebuilt block from its output ``y`` (`block_grads` in the rebuild mode),
        without the update."""
        return self.block_grads(self.rebuild_mode, layer, params, state, y, dy, example_keys(skey, index,
                                                                                         batch_size_of(y)))

    def _recompute_grads_only(self, layer, params, state, x, dy, skey, index):
        """``(x, dx, grads)`` of a block recomputed from its kept input ``x`` (`block_grads` rematerialised),
        without the update; ``dx`` is None for token ids."""
        return self.block_grads(REMAT, layer, params, state, x, dy, example_keys(skey, index, batch_size_of(x)))

    def _top_head_grads_only(self, layers, top_params, top_states, head_params, head_state, x, batch, skey,
                             top_index, head_index):
        """`_top_grads` without the updates: ``(top grads (a tuple), head grads, dx)``."""
        return self._top_grads(layers, top_params, top_states, head_params, head_state, x, batch, skey, top_index,
                               head_index)[1:4]

    def top_head_grads_program(self, tops, head, modes=None):
        """The compiled `_top_head_grads_only` of the blocks ``tops`` (a tuple of layers, bottom first, one
        block each) in the head's program, each in its mode of ``modes`` (None: backprop), and ``head``:
        ``(top params, top states, head params, head state, x, batch, skey, top indices, head index) ->
        (top grads, head grads, dx)``."""
        modes = tuple(modes or (BACKPROP,) * len(tops))
        counts = (1,) * len(tops)
        top_specs, head_specs = self._top_specs(tops, head, counts)
        in_specs = (top_specs[0], _R, head_specs[0], _R, _D, _D, _R, _R, _R)
        return self.compile("top_head_grads", (tops, head, modes, counts), self._top_head_grads_only, in_specs,
                            (top_specs[0], head_specs[0], _D), key=("top_head_grads", tops, head, modes))

    # -- the scanned runs (inside shard_map over "data"; stacked trees have a leading layer axis) -----
    def _forward_run(self, layer, params, states, x, skey, start):
        """The forward of ``count`` identical layers: one ``lax.scan``; returns ``(x, new states)``."""
        count = jax.tree.leaves(params)[0].shape[0]
        steps = jnp.arange(count, dtype=jnp.int32)
        if self.fenced(layer):  # the residuals of the last layer are carried out (see `_fenced`)
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
        # gradients only (``revtrain check``): ``(params, state, start, [dy | batch], skey, index)``
        "head_grads": ProgramSpec("_head_grads_only", (_R, _R, _D, _D, _R, _R), (_R, _D), (), (0,), (0,)),
        "rebuild_grads": ProgramSpec("_rebuild_grads_only", (_R, _R, _D, _D, _R, _R), (_D, _D, _R), (), (0,), (2,)),
        "recompute_grads": ProgramSpec("_recompute_grads_only", (_R, _R, _D, _D, _R, _R), (_D, _D, _R), (), (0,),
                                       (2,)),
    }

    def _with_specs(self, specs: tuple, positions: tuple, state_specs: tuple) -> tuple:
        """``specs`` with the entries at ``positions`` (params, then optimizer state) set to ``state_specs``."""
        specs = list(specs)
        for i, spec in zip(positions, state_specs):
            specs[i] = spec
        return tuple(specs)

    def per_layer(self, kind, layer):
        """The compiled per-layer program ``kind`` (a name of ``_PER_LAYER``) of ``layer``."""
        name, in_specs, out_specs, donate, inputs, outputs = self._PER_LAYER[kind]
        fn = getattr(self, name)
        state_specs = self.specs.layer(layer)
        in_specs = self._with_specs(in_specs, inputs, state_specs)
        out_specs = self._with_specs(out_specs, outputs, state_specs)
        if kind == "forward_rev" and self.fenced(layer):
            return self._dropping(self.compiled(kind, layer, fn, in_specs, out_specs + (_D,), donate))
        return self.compiled(kind, layer, fn, in_specs, out_specs, donate)

    def compiled(self, kind, layer, fn, in_specs, out_specs, donate):
        """``fn`` compiled. Activations (split over "data") are donated only where a result reuses them: a
        recomputed layer of token ids has no input cotangent for its output cotangent to become
        (`common._UsedDonation`)."""
        donate, maybe = (tuple(i for i in donate if in_specs[i] != _D or kind not in self._MAYBE_DONATED),
                         tuple(i for i in donate if in_specs[i] == _D and kind in self._MAYBE_DONATED))
        return self.compile(kind, layer, fn, in_specs, out_specs, donate=donate, donate_if_used=maybe)

    _MAYBE_DONATED = ("recompute", "recompute_acc")  # programs of a layer whose input may be token ids

    def _top_specs(self, tops, head, counts=None):
        """(top params specs, top optimizer state specs) as tuples over ``tops``, and the head's."""
        top_specs = tuple(self.specs.group(t, c) for t, c in zip(tops, counts or (1,) * len(tops)))
        return (tuple(p for p, _ in top_specs), tuple(o for _, o in top_specs)), self.specs.layer(head)

    def top_head(self, tops, head, modes=None, counts=None):
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
        return self.compiled("top_head", (tops, head, modes, counts), self._top_head, in_specs, out_specs,
                             (0, 1, 3, 4))

    def run(self, kind, layer, count):
        """The compiled scan over a run of ``count`` layers like ``layer`` (runs of equal length share it)."""
        key = (kind, layer, count)
        pspec, ospec = self.specs.group(layer, count)
        if kind == "forward_run":
            if self.fenced(layer):
                return self._dropping(self.compile(kind, layer, self._forward_run, (pspec, _R, _D, _R, _R),
                                                   (_D, _R, _D), donate=(2,), key=key))
            return self.compile(kind, layer, self._forward_run, (pspec, _R, _D, _R, _R), (_D, _R), donate=(2,),
                                key=key)
        if kind == "reverse_run":
            return self.compile(kind, layer, self._reverse_run, (pspec, ospec, _R, _D, _D, _R, _R),
                                (_D, _D, pspec, ospec, _R, _R), donate=(0, 1, 3, 4), key=key)
        if kind == "remat_forward_run":
            return self.compile(kind, layer, self._remat_forward_run, (pspec, _R, _D, _R, _R), (_D, _R, _SD),
                                key=key)  # (x is copied into the stack: nothing to donate)
        if kind == "remat_backward_run":
            return self.compile(kind, layer, self._remat_backward_run, (pspec, ospec, _R, _SD, _D, _R, _R),
                                (_D, _D, pspec, ospec, _R, _R), donate=(0, 1, 4), key=key)
        raise KeyError(kind)


def compile_on(mesh):
    """A compile function for `LayerPrograms` (its ``compile``) over ``mesh`` without a trainer: each program
    ``jit(shard_map(partial(fn, layer)))`` with the trainers' compiler options, cached per key, every donated
    position donated (the memory plan reads compiled programs' sizes and never calls them)."""
    cache: dict = {}

    def compile(kind, layer, fn, in_specs, out_specs, donate=(), key=None, donate_if_used=()):
        key = (kind, layer) if key is None else key
        if key not in cache:
            mapped = jax.shard_map(functools.partial(fn, layer), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
            cache[key] = jax.jit(mapped, donate_argnums=tuple(sorted(set(donate) | set(donate_if_used))),
                                 compiler_options=XLA_OPTIONS)
        return cache[key]
    return compile


class _Dropping:
    """A fenced forward program (`LayerPrograms.fenced`) called as an ordinary one: returns ``(y, new
    state)`` and drops the residuals; other attributes (``lower``, ...) are the program's."""

    def __init__(self, program):
        self.program = program

    def __call__(self, *args):
        return self.program(*args)[:2]

    def __getattr__(self, name):
        return getattr(self.program, name)

