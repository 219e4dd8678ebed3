"""`revtrain.trainers.specs.StateSpecs`: which leaves of each layer's weights and optimizer state are split
over the devices with ``shard_state`` (from the shapes alone), a stacked run's specs, the summary line, and the
gradient squares the logged norm is made of."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, make_mesh
from revtrain.trainers.specs import StateSpecs, leaf_squares, split_leaf_squares

from helpers import tiny_model

_D = DATA_AXIS


def test_replicated_specs_are_one_prefix_and_change_nothing():
    model = tiny_model(sequence_length=16)
    specs = StateSpecs(model, optax.adam(1e-3), 1, sharded=False)
    for layer in model.layers:
        assert specs.layer(layer) == (P(), P()) and specs.group(layer, 3) == (P(), P())
        assert specs.grads(layer) is None
    params = {"w": jnp.ones(3)}
    assert specs.whole(model.layers[1], params) is params and specs.across is None


def test_sharded_specs_split_the_large_leaves_of_weights_and_moments_alike():
    """Two devices, d_model 32: the token embedding (256 x 32) splits its rows, the feed-forward's up (32 x 128)
    its columns and down (128 x 32) its rows; attention's 32 x 96 and 32 x 32 kernels, biases, norms and the
    16 x 32 positions are under 4,096 elements and stay whole. Adam's moments have the weights' specs, its
    step count none."""
    model = tiny_model(sequence_length=16)
    specs = StateSpecs(model, optax.adam(1e-3), 2, sharded=True)
    embedding, block = model.layers[0], model.layers[1]
    params, opt = specs.layer(embedding)
    assert params == {"positions": P(), "tokens": {"embedding": P(_D, None)}}
    assert opt[0].mu == params and opt[0].nu == params and opt[0].count == P()
    params, _ = specs.layer(block)
    assert params["g"]["up"]["kernel"] == P(None, _D) and params["g"]["down"]["kernel"] == P(_D, None)
    assert params["f"]["qkv"]["kernel"] == P() and params["g"]["up"]["bias"] == P()
    stacked, _ = specs.group(block, 2)  # a run's leading layer axis is never split
    assert stacked["g"]["up"]["kernel"] == P(None, None, _D) and stacked["f"]["qkv"]["kernel"] == P()
    assert specs.grads(block) == params and specs.across == DATA_AXIS
    assert specs.layer(model.layers[2]) == specs.layer(block)  # identical blocks, identical specs


def test_the_summary_line_counts_split_leaves_and_their_share():
    model = tiny_model(sequence_length=16)
    assert StateSpecs(model, optax.adam(1e-3), 2, sharded=True).summary() == (
        "shard_state: 18 leaves of weights and optimizer state split over 2 devices (80.8% of 0.6 MiB), 70 "
        "replicated (too small or no axis divisible by 2: bias, kernel, positions, scale)")
    assert StateSpecs(model, optax.adam(1e-3), 1, sharded=True).summary() == (
        "shard_state: one device, nothing to split (0.6 MiB of weights and optimizer state held whole)")


def test_leaf_squares_are_each_floating_leafs_sum_of_squares_in_tree_order():
    grads = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[3.0]]), "n": jnp.array([5], jnp.int32)}
    assert np.array_equal(np.asarray(leaf_squares(grads)), np.array([5.0, 9.0], np.float32))
    assert leaf_squares({}).shape == (0,)


def test_split_leaf_squares_sum_a_split_leafs_pieces_over_the_devices():
    mesh = make_mesh(jax.devices()[:1])
    specs = {"a": P(_D), "b": P()}
    fn = jax.shard_map(lambda g: split_leaf_squares(specs, g), mesh=mesh, in_specs=({"a": P(_D), "b": P()},),
                       out_specs=P())
    out = jax.jit(fn)({"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])})
    assert np.array_equal(np.asarray(out), np.array([5.0, 9.0], np.float32))
