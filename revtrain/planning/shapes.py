"""The shapes a plan is made from: each layer's weights (a tied leaf once) and optimizer state, one device's
(micro)batch, and their bytes (`revtrain.optstate.tree_nbytes`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from revtrain.optstate import tree_nbytes

# -- shapes ------------------------------------------------------------------------------------------------

def layer_param_shapes(model) -> list:
    """Every layer's ``param_shapes``, a tied leaf only in its owner's (as ``Model.init`` holds them)."""
    from revtrain.models.base import _without
    shapes = [layer.param_shapes for layer in model.layers]
    for t in model.ties:
        shapes[t.user] = _without(shapes[t.user], t.user_path)
    return shapes


def tied_bytes(model) -> int:
    """Bytes of the tied leaves' other-use gradients (the deferred update keeps them through a step)."""
    shapes = layer_param_shapes(model)
    users = {t.user for t in model.ties}
    return sum(tree_nbytes(model.tied_leaves(u, {t.owner: shapes[t.owner] for t in model.ties_of(u)})) for u in users)


def shard_bytes(tree, n: int) -> int:
    """Bytes one device holds of ``tree`` when its large leaves are split over ``n`` devices."""
    from revtrain.placement import shard_axis
    total = 0
    for x in jax.tree.leaves(tree):
        b = tree_nbytes(x)
        total += b // n if shard_axis(x.shape, n) is not None else b
    return total


def _spec(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def shape_key(tree) -> str:
    return str(jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree))


@functools.lru_cache(maxsize=1)
def mesh1() -> Mesh:
    return Mesh(np.asarray(jax.local_devices()[:1]), ("data",))


def local_batch(tree, b: int):
    """A batch tree's shapes with the leading axis set to ``b`` (one device's (micro)batch)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((b,) + tuple(x.shape[1:]), x.dtype), tree)


def is_float(tree) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(tree))


def state_bytes(setup, pshapes: list, oshapes: list, n: int) -> tuple[int, int, list, list]:
    """``(weights, optimizer state, each layer's weights, each layer's weights + optimizer state)`` in bytes:
    the first two one device's share (split over ``n`` devices with ``shard_state``), the lists whole."""
    if setup.shard_state:
        weights = sum(shard_bytes(p, n) for p in pshapes)
        opt = sum(shard_bytes(o, n) for o in oshapes)
    else:
        weights, opt = tree_nbytes(pshapes), tree_nbytes(oshapes)
    layer_bytes = [tree_nbytes(p) for p in pshapes]
    return weights, opt, layer_bytes, [lb + tree_nbytes(o) for lb, o in zip(layer_bytes, oshapes)]



@dataclasses.dataclass
class Shapes:
    """The shapes a plan is made from: one device's (micro)batch of ``b`` examples (``batch``, and its
    dropout ``keys``), each layer's weights (a tied leaf only in its owner, `layer_param_shapes`) and
    optimizer state."""

    b: int
    pshapes: list
    oshapes: list
    batch: dict
    keys: Any


def shapes_of(model, setup, batch_spec: dict, n: int, global_devices: int | None) -> Shapes:
    b = max(setup.batch_size // max(global_devices or n, 1) // setup.microbatches, 1)
    pshapes = layer_param_shapes(model)
    return Shapes(b, pshapes, [jax.eval_shape(setup.optimizer.init, p) for p in pshapes], local_batch(batch_spec, b),
                   jax.ShapeDtypeStruct((b, 2), jnp.uint32))
