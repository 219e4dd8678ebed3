"""Optimizer states as optax makes them, kept where revtrain keeps states: device memory, host memory, files
and checkpoints.

Two things in an optax state do not survive revtrain's boundaries as they are:

* **Typed PRNG keys** (``optax.noisy_sgd``'s ``AddNoiseState.rng_key``, dtype ``key<fry>``): numpy cannot
  hold them (``np.asarray`` of one fails), so neither can the host store's numpy copies, the disk tier's
  files or an Orbax checkpoint. `keep_states` gives the trainers an optimizer whose state holds each key's
  ``jax.random.key_data`` (``uint32``, shape ``key shape + (2,)`` for threefry) and which wraps it back
  (``jax.random.wrap_key_data`` with the key's own implementation) inside ``update``, so the optimizer
  itself sees the keys optax made and draws the same numbers.
* **The parameters' own arrays** (``prodigy``, ``dog``, ``cocob``, ``madgrad``, ``mechanize`` keep the
  initial parameters in the state: ``init`` returns the very arrays it was given; ``cocob`` also puts one
  array in two of its fields). A step that donates the parameters and the state would donate those buffers
  twice (XLA: "Attempt to donate the same buffer twice"). `keep_states`' ``init`` copies exactly those
  leaves (an identical object, or the same traced value under ``jit``), so every other optimizer keeps its
  state as it was and its donation as before.

Integer counters and empty states (``EmptyState()``, ``()``) pass through unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def is_key(x) -> bool:
    """Whether ``x`` (an array, a tracer or a ``jax.ShapeDtypeStruct``) is a typed PRNG key array."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def has_keys(tree) -> bool:
    """Whether any leaf of ``tree`` is a typed PRNG key array."""
    return any(is_key(x) for x in jax.tree.leaves(tree))


def key_data(tree):
    """``tree`` with every typed PRNG key leaf replaced by its ``jax.random.key_data`` (``uint32``); other
    leaves as they are (abstract leaves give abstract results)."""
    def data(x):
        if not is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            out = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=getattr(x, "sharding", None))
        return jax.random.key_data(x)
    return jax.tree.map(data, tree)


def nbytes(x) -> int:
    """Bytes of one array or ``jax.ShapeDtypeStruct`` leaf, typed PRNG keys included (their key data's
    bytes: 8 per threefry key); 0 for a ``float0`` leaf."""
    size = 1
    for d in getattr(x, "shape", ()):
        size *= int(d)
    return size * int(x.dtype.itemsize)


def tree_nbytes(tree) -> int:
    """Bytes of every leaf of a tree of arrays or ``jax.ShapeDtypeStruct`` (`nbytes` of each: typed PRNG keys
    by their key data, 0 for a ``float0`` leaf)."""
    return sum(nbytes(x) for x in jax.tree.leaves(tree))


def _copy_aliases(state, params):
    """``state`` with each leaf that is one of ``params``' leaves, or a leaf met earlier in ``state`` itself
    (the same object: the same array, or the same tracer under ``jit``; ``cocob`` puts one array in two
    fields), replaced by a copy, so a program can donate both trees, every buffer once."""
    seen = {id(x) for x in jax.tree.leaves(params)}
    leaves, treedef = jax.tree.flatten(state)
    out, copied = [], False
    for x in leaves:
        if id(x) in seen and hasattr(x, "dtype"):
            out.append(jnp.copy(x))
            copied = True
        else:
            out.append(x)
            seen.add(id(x))
    return jax.tree.unflatten(treedef, out) if copied else state


def keep_states(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with a state revtrain can place, copy, write and donate (the module's docstring): typed keys held
    as their key data, and no state leaf that is one of the parameters' arrays. For an optimizer without either,
    ``init`` and ``update`` trace to the same programs as ``tx``'s (nothing is converted or copied).

    The state's tree structure is optax's; only the key leaves' dtype and shape differ (``uint32`` key data).
    ``update`` finds the key leaves and their implementation from ``tx.init``'s abstract state on the
    parameters it is given (``jax.eval_shape``, traced only); an optimizer whose update takes no parameters
    uses the implementations seen by ``init``.
    """
    if getattr(tx, "_revtrain_keeps_states", False):
        return tx
    seen: dict = {}  # leaf index -> key implementation, from the last init traced

    def impls_of(params):
        found = {}

        def probe(p):
            state = tx.init(p)
            for i, x in enumerate(jax.tree.leaves(state)):
                if is_key(x):
                    found[i] = jax.random.key_impl(x)
            return state
        jax.eval_shape(probe, params)
        return found

    def init(params):
        state = tx.init(params)
        leaves = jax.tree.leaves(state)
        for i, x in enumerate(leaves):
            if is_key(x):
                seen[i] = jax.random.key_impl(x)
        return _copy_aliases(key_data(state), params)

    def update(updates, state, params=None, **extra):
        impls = impls_of(params) if params is not None else dict(seen)
        if impls:
            leaves, treedef = jax.tree.flatten(state)
            leaves = [jax.random.wrap_key_data(x, impl=impls[i]) if i in impls and not is_key(x) else x
                      for i, x in enumerate(leaves)]
            state = jax.tree.unflatten(treedef, leaves)
        new_updates, new_state = tx.update(updates, state, params, **extra)
        return new_updates, key_data(new_state)

    return _Kept(init, update, tx)


class _Kept(optax.GradientTransformationExtraArgs):
    """`keep_states`' optimizer: ``init`` and ``update`` as described there; ``inner``: the optimizer given."""

    def __new__(cls, init, update, inner):
        return super().__new__(cls, init, update)

    def __init__(self, init, update, inner):
        self.inner = inner
        self._revtrain_keeps_states = True
