"""`revtrain.trainers.programs`: the gradient halves of the reversible trainer's per-layer programs, one
block of the tiny model at a time (inside ``shard_map`` on one device): the exact rebuild gives back the
forward's input bit for bit and its gradients are the recompute's bits; the head's loss and gradients are
those of ``jax.value_and_grad`` of its loss; every program the trainer compiles is declared."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, make_mesh
from revtrain.trainers.common import example_keys, step_key
from revtrain.trainers.modes import ProgramSpec
from revtrain.trainers.programs import LayerPrograms

from helpers import tiny_model

_R, _D = P(), P(DATA_AXIS)
B, T = 2, 16


def _setup():
    jax.config.update("jax_default_matmul_precision", "highest")
    model = tiny_model(num_layers=1, d_model=16, sequence_length=T)
    values = [model.init_layer(i) for i in range(len(model.layers))]
    tokens = np.random.default_rng(0).integers(0, 256, (B, T)).astype(np.int32)
    return model, [v[0] for v in values], [v[1] for v in values], {"inputs": tokens, "targets": tokens}


def _mapped(fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=make_mesh(jax.devices()[:1]), in_specs=in_specs, out_specs=out_specs))


def _apply(layer, i, skey):
    """Layer ``i``'s training forward as its own program (as in the trainer)."""
    return _mapped(lambda p, s, x: layer.apply(p, s, x, example_keys(skey, i, B), True)[0], (_R, _R, _D), _D)


def test_the_exact_rebuild_returns_the_input_and_the_recomputes_gradients():
    model, params, states, batch = _setup()
    embedding, block = model.layers[0], model.layers[1]
    skey = step_key(0, 0)

    x = _apply(embedding, 0, skey)(params[0], states[0], batch["inputs"])
    y = _apply(block, 1, skey)(params[1], states[1], x)
    dy = jax.tree.map(lambda a: jnp.full_like(a, 0.01), y)

    def both(p, s, x, y, dy):
        keys = example_keys(skey, 1, B)
        rebuilt, dx_rev, g_rev = LayerPrograms.reverse_grads(block, p, s, y, dy, keys)
        dx_rec, g_rec = LayerPrograms.recompute_grads(block, p, s, x, dy, keys)
        return rebuilt, dx_rev, g_rev, dx_rec, g_rec

    rebuilt, dx_rev, g_rev, dx_rec, g_rec = _mapped(both, (_R, _R, _D, _D, _D), (_D, _D, _R, _D, _R))(
        params[1], states[1], x, y, dy)
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(rebuilt)):
        assert a.shape == (B, T, 16) and np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves((dx_rev, g_rev)), jax.tree.leaves((dx_rec, g_rec))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(g_rev) == jax.tree.structure(params[1])


def test_the_heads_loss_and_gradients_are_value_and_grad_of_its_loss():
    model, params, states, batch = _setup()
    head = model.layers[-1]
    skey = step_key(0, 0)
    x = _apply(model.layers[0], 0, skey)(params[0], states[0], batch["inputs"])
    x = _apply(model.layers[1], 1, skey)(params[1], states[1], x)  # the head's input: the block's two streams

    def program(p, s, x, b):
        keys = example_keys(skey, 2, B)
        obj, grads, dx, stats, _, total = LayerPrograms.head_grads(head, p, s, x, b, keys)

        def loss(p):
            loss_sum, stats, _ = head.loss(p, s, x, b, keys, True)
            return loss_sum / stats["weight"]

        value, reference = jax.value_and_grad(loss)(p)  # (p is replicated: its gradient comes summed)
        return lax.psum(obj, DATA_AXIS), grads, dx, total, lax.psum(value, DATA_AXIS), reference

    obj, grads, dx, total, value, reference = _mapped(program, (_R, _R, _D, _D), (_R, _R, _D, _R, _R, _R))(
        params[-1], states[-1], x, batch)
    assert float(total) == B * T and np.isfinite(float(obj))
    assert [a.shape for a in jax.tree.leaves(dx)] == [a.shape for a in jax.tree.leaves(x)]
    np.testing.assert_allclose(float(obj), float(value), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_every_per_layer_program_is_declared_with_its_calling_convention():
    """Each mode's programs are declared in ``LayerPrograms._PER_LAYER`` as a `ProgramSpec` naming a method of the programs object
    whose donated and state positions are within its arguments."""
    assert LayerPrograms._PER_LAYER
    for name, spec in LayerPrograms._PER_LAYER.items():
        assert isinstance(spec, ProgramSpec) and callable(getattr(LayerPrograms, spec.method)), name
        assert all(0 <= k < len(spec.in_specs) for k in (*spec.donate, *spec.state_in)), name
        assert all(0 <= k < len(spec.out_specs) for k in spec.state_out), name
