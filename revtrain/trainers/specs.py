"""How each layer's weights and optimizer state are split over the devices, as one object per trainer.

Replicated (pmap semantics), every leaf's spec is ``P()`` and every program sees whole leaves. With
``shard_state`` (ZeRO-3 / ZeRO-Infinity over the ``"data"`` axis) every large leaf of a layer's weights and
optimizer state is split along one axis (`placement.shard_spec`, a function of the leaf's shape alone), so N
devices hold one copy between them. A program then takes the local pieces, gathers the weights whole for the
forward, rebuild and vjp (`whole`: `placement.gather_params`), reduce-scatters the gradients back to pieces
(`grads`, `placement.reduce_grads`) and runs the optax update on its piece (`across`: the axis a guarded
update agrees its finite flag over). A tied leaf lives in its owner and is split there; the head that uses
it takes it whole in an evaluation (`merged`).

`StateSpecs` answers these questions from the shapes alone, cached per layer, for every program of the
reversible trainer (`revtrain.trainers.reversible`, `revtrain.trainers.deferred`) and its evaluation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, gather_params, shard_spec, spec_axis

_R = P()


class StateSpecs:
    """The ``PartitionSpec`` trees of every layer's weights and optimizer state (see the module note).

    Args:
      model: the `revtrain.models.Model` (its layers, shapes and tied parameters).
      tx: the optax ``GradientTransformation`` (its state's shapes, from ``jax.eval_shape``).
      num_devices: the ``"data"`` axis' size.
      sharded: ``shard_state``: split the large leaves; False: every spec is ``P()`` (a prefix).
    """

    def __init__(self, model, tx, num_devices: int, sharded: bool):
        self.model, self.tx, self.num_devices, self.sharded = model, tx, num_devices, sharded
        self._cache: dict = {}

    def layer(self, layer):
        """``(params specs, optimizer state specs)`` of one layer: trees of ``PartitionSpec`` matching its
        params (as this trainer holds them, `own_shapes`) and its optax state (``P()`` for a replicated leaf).
        Not sharded: both ``P()`` (a prefix: everything replicated)."""
        if not self.sharded:
            return _R, _R
        key = id(layer)
        if key not in self._cache:
            shapes = self.own_shapes(layer)  # (a tied leaf is its owner's: split there)
            spec = lambda x: shard_spec(x.shape, self.num_devices)  # noqa: E731
            self._cache[key] = (jax.tree.map(spec, shapes), jax.tree.map(spec, jax.eval_shape(self.tx.init, shapes)))
        return self._cache[key]

    def group(self, layer, count: int = 1):
        """`layer` of a group: a stacked run's specs have the leading layer axis unsplit."""
        specs = self.layer(layer)
        if count == 1 or not self.sharded:
            return specs
        return tuple(jax.tree.map(lambda p: P(None, *p) if spec_axis(p) is not None else _R, t) for t in specs)

    def own_shapes(self, layer):
        """A layer's params' shapes as the trainer holds them: a tied user's (the head's) without its tied
        leaves (`Model.param_shapes`), every other layer's own."""
        last = len(self.model.layers) - 1
        if layer is self.model.layers[last] and self.model.ties_of(last):
            return self.model.param_shapes()[last]
        return layer.param_shapes

    def merged(self, layer):
        """The specs of a tied user's params with its tied leaves put back (`Model.merge_tied`: an
        evaluation's head): each leaf split as its owner's is (the same shape, the same spec)."""
        key = ("merged", id(layer))
        if key not in self._cache:
            self._cache[key] = jax.tree.map(lambda x: shard_spec(x.shape, self.num_devices), layer.param_shapes)
        return self._cache[key]

    def params(self, layer, leading: int = 0):
        """``in_specs`` of a layer's params in an evaluation program (``leading``: stacked layer axes)."""
        last = len(self.model.layers) - 1
        if self.sharded and not leading and layer is self.model.layers[last] and self.model.ties_of(last):
            return self.merged(layer)  # (the evaluation's head takes its tied leaves put back)
        return self.group(layer, 1 + leading)[0]

    def whole(self, layer, params):
        """Inside a program: a layer's params as whole leaves (gathered over ``"data"`` when sharded)."""
        if not self.sharded:
            return params
        tied_user = (bool(self.model.ties) and layer is self.model.layers[-1]
                     and jax.tree.structure(params) != jax.tree.structure(self.own_shapes(layer)))
        return gather_params(params, self.merged(layer) if tied_user else self.layer(layer)[0])

    def grads(self, layer):
        """Where a layer's gradient sum goes (`placement.reduce_grads`): None (every device) or its specs."""
        return self.layer(layer)[0] if self.sharded else None

    @property
    def across(self):
        """The axis a guarded update's finite flag is agreed over (`layerwise.guarded_update`), or None."""
        return DATA_AXIS if self.sharded else None

    def squares(self, layer, grads):
        """Inside a program: each leaf's sum of squares of a layer's summed gradient (the pieces of the
        logged ``grad_norm``), over the whole leaf when it is split."""
        if self.sharded:
            return split_leaf_squares(self.layer(layer)[0], grads)
        return leaf_squares(grads)

    def summary(self) -> str:
        """One line: how many leaves of the weights and optimizer state are split over the devices, their
        share of the bytes, and which leaves stay replicated (too small or no divisible axis)."""
        split = kept = split_bytes = total = 0
        small = set()
        for layer in self.model.layers:
            shapes = self.own_shapes(layer)
            trees = (shapes, jax.eval_shape(self.tx.init, shapes))
            for tree, specs in zip(trees, self.layer(layer)):
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


def leaf_squares(grads) -> jax.Array:
    """float32 ``[leaves]``: each floating leaf's sum of squares, in tree order (the pieces of
    ``optax.global_norm``; `grad_norm` adds them up)."""
    sq = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)
          if jnp.issubdtype(g.dtype, jnp.inexact)]
    return jnp.stack(sq) if sq else jnp.zeros((0,), jnp.float32)


def split_leaf_squares(layer_specs, grads):
    """Inside ``shard_map`` with sharded state: each leaf's sum of squares over the whole leaf (a split
    leaf's pieces summed over ``"data"``)."""
    sq = []
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(layer_specs, is_leaf=lambda s: isinstance(s, P))):
        s = jnp.sum(jnp.square(g.astype(jnp.float32)))
        sq.append(lax.psum(s, DATA_AXIS) if spec_axis(spec) is not None else s)
    return jnp.stack(sq) if sq else jnp.zeros((0,), jnp.float32)
