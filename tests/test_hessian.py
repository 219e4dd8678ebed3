"""revtrain/trainers/hessian.py and the stand-in objective (revtrain/optstate.py `given_products`), in process:
the tangent the trainers draw is the one optax's Hutchinson estimator draws, and the update given the stand-in
objective computes the estimator's ``H z * z`` from the given product, bit for bit. The trainers' products
against each other: tests/test_optimizer_catalogue.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from revtrain import optstate
from revtrain.trainers.hessian import Tangents, lowest_dtype

PARAMS = [{"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)},
          {"w": np.ones((4, 2), np.float32)}]


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_tangents_are_the_estimators_draw():
    """`Tangents` draws each layer's Rademacher signs from the state's key as ``optax.tree.random_like`` does on the
    whole tree (the key split, one key per leaf in the whole tree's order), in the tree's lowest dtype."""
    key = jax.random.PRNGKey(7)
    want = optax.tree.random_like(jax.random.split(key)[1], PARAMS, jax.random.rademacher, dtype=jnp.float32)
    tangents = Tangents(PARAMS)
    got = tangents.whole(key)
    assert _bits(got) == _bits(want)
    assert set(np.unique(np.concatenate([np.ravel(x) for x in jax.tree.leaves(got)]))) == {-1.0, 1.0}
    assert _bits(tangents.layer(1, tangents.keys(key))) == _bits(want[1])
    mixed = [{"w": jax.ShapeDtypeStruct((2,), jnp.bfloat16)}, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}]
    assert lowest_dtype(mixed) == jnp.bfloat16
    # the key as the trainers find it in a state: the estimator's, inside Sophia's chain
    state = optstate.keep_states(optax.contrib.sophia(1e-3)).init(PARAMS)
    assert _bits(Tangents.key(state)) == _bits(jax.random.PRNGKey(0))


def test_the_stand_in_objective_gives_its_product():
    """``jax.jvp(jax.grad(obj_fn))`` of `optstate.given_products` is the given tree exactly, at any parameters and
    tangent; the estimator's update then returns ``hvp * z`` for its own ``z``, and Sophia traces with it."""
    hvp = jax.tree.map(lambda x: np.random.default_rng(x.size).standard_normal(x.shape).astype(np.float32), PARAMS)
    obj = optstate.given_products(hvp)
    z = jax.tree.map(lambda x: -np.ones_like(x), PARAMS)
    assert _bits(jax.jvp(jax.grad(obj), (PARAMS,), (z,))[1]) == _bits(hvp)
    estimator = optax.contrib.hutchinson_estimator_diag_hessian()
    state = estimator.init(PARAMS)
    diag, _ = jax.jit(lambda s, h: estimator.update(PARAMS, s, PARAMS, obj_fn=optstate.given_products(h)))(state, hvp)
    signs = Tangents(PARAMS).whole(state.key)
    assert _bits(diag) == _bits(jax.tree.map(lambda h, s: h * s, hvp, signs))
    sophia = optstate.keep_states(optax.contrib.sophia(1e-3))
    assert optstate.takes_hvp(sophia, PARAMS) and not optstate.takes_value(sophia, PARAMS)
    assert optstate.update_refusal(sophia, PARAMS) is None
    assert not optstate.takes_hvp(optstate.keep_states(optax.adamw(1e-3)), PARAMS)


def test_the_products_are_needed_on_the_steps_that_read_them():
    """`LayerwiseUpdate.products_needed`: Sophia reads its products where its step count is a multiple of
    ``update_interval`` (a ``cond`` on a value of no layer), the bare estimator on every step (None: always)."""
    from revtrain.trainers.layerwise import LayerwiseUpdate
    sophia = optstate.keep_states(optax.contrib.sophia(1e-3, update_interval=3))
    split = LayerwiseUpdate(sophia, PARAMS)
    needed = jax.jit(lambda s: split.products_needed(split.global_leaves(0, s)))
    state = sophia.init(PARAMS[0])
    flags = []
    for count in range(5):
        state = jax.tree.map(lambda x: np.int32(count) if np.ndim(x) == 0 and x.dtype == np.int32 else x, state)
        flags.append(bool(needed(state)))
    assert flags == [True, False, False, True, False]
    bare = optstate.keep_states(optax.contrib.hutchinson_estimator_diag_hessian())
    assert LayerwiseUpdate(bare, PARAMS).products_needed(()) is None
