"""`revtrain.placement` in this process (one CPU device): the mesh, the shardings and memory kinds of placed
arrays, the split rule of sharded state, the batch's placement and its refusal, and the dispatch limiter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from revtrain import placement
from revtrain.placement import DATA_AXIS, DEVICE_MEMORY, HOST_MEMORY


def test_the_mesh_is_one_data_axis_over_the_devices():
    mesh = placement.make_mesh()
    assert mesh.axis_names == (DATA_AXIS,) and mesh.size == len(jax.devices())
    assert list(mesh.devices.flat) == jax.devices()
    assert placement.make_mesh(jax.devices()[:1]).size == 1


def test_replicated_and_batch_shardings():
    mesh = placement.make_mesh(jax.devices()[:1])
    assert placement.replicated(mesh).spec == P() and placement.replicated(mesh).memory_kind in (None, DEVICE_MEMORY)
    assert placement.replicated(mesh, HOST_MEMORY).memory_kind == HOST_MEMORY
    assert placement.batch_sharding(mesh).spec == P(DATA_AXIS)


def test_placed_arrays_live_in_the_memory_kind_asked_for():
    """put_replicated places each leaf whole on every device, in device memory or (CPU backend) in
    ``pinned_host``; its values are the host values."""
    mesh = placement.make_mesh(jax.devices()[:1])
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    on_device = placement.put_replicated(tree, mesh)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_device)} == {DEVICE_MEMORY}
    assert placement.host_memory_supported(mesh)  # the CPU backend has both host kinds
    assert placement.host_memory_supported(mesh, placement.PAGEABLE_MEMORY)
    assert not placement.host_memory_supported(mesh, "no_such_kind")
    on_host = placement.put_replicated(tree, mesh, HOST_MEMORY)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_host)} == {HOST_MEMORY}
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(on_host)):
        assert np.array_equal(a, np.asarray(b))
    assert all(x.sharding.spec == P() for x in jax.tree.leaves(on_host))


def test_the_split_axis_is_the_largest_divisible_one_of_a_large_leaf():
    assert placement.shard_axis((64, 128), 4) == 1  # both divisible: the larger
    assert placement.shard_axis((128, 64), 4) == 0
    assert placement.shard_axis((64, 64), 4) == 0  # equal: the first
    assert placement.shard_axis((66, 130), 4) is None  # none divisible
    assert placement.shard_axis((8, 8), 4) is None  # 64 elements < MIN_SHARD_ELEMENTS
    assert placement.shard_axis((64, 128), 1) is None  # one device
    assert placement.shard_axis((8, 8), 4, min_elements=64) == 0
    assert placement.shard_spec((64, 128), 4) == P(None, DATA_AXIS)
    assert placement.shard_spec((6, 64, 128), 4, leading=1) == P(None, None, DATA_AXIS)
    assert placement.shard_spec((66, 130), 4) == P()
    assert placement.spec_axis(P(None, DATA_AXIS)) == 1 and placement.spec_axis(P()) is None


def test_global_batch_splits_the_batch_and_refuses_an_indivisible_one():
    mesh = placement.make_mesh(jax.devices()[:1])
    local = {"inputs": np.arange(8, dtype=np.int32).reshape(4, 2), "targets": np.zeros((4, 2), np.int32)}
    batch = placement.global_batch(local, mesh)
    assert set(batch) == {"inputs", "targets"} and batch["inputs"].shape == (4, 2)
    assert batch["inputs"].sharding.spec == P(DATA_AXIS)
    assert np.array_equal(np.asarray(batch["inputs"]), local["inputs"])
    assert placement.batch_divisibility_error(6, 4) == "batch size 6 is not divisible by the 4 devices"
    assert placement.batch_divisibility_error(8, 4) is None


def test_placer_puts_a_host_leaf_replicated_on_one_device():
    mesh = placement.make_mesh(jax.devices()[:1])
    x = placement.placer(mesh, split=True)(np.ones((64, 128), np.float32))  # one device: nothing to split
    assert x.sharding.spec == P() and x.shape == (64, 128)


def test_the_dispatch_limiter_is_off_on_one_device_and_refuses_a_bad_window():
    mesh = placement.make_mesh(jax.devices()[:1])
    limiter = placement.DispatchLimiter(mesh)
    assert not limiter.enabled and not placement.needs_dispatch_limit(mesh)
    value = jnp.ones(3)
    assert limiter(value) is value
    with pytest.raises(ValueError, match="window must be positive"):
        placement.DispatchLimiter(mesh, window=0)


def test_per_device_gather_and_reduce_inside_shard_map():
    """One device: `reduce_grads` is a sum over the one device (the value itself), `gather_params` of a
    leaf split over the axis gives it whole (typed varying over the axis, as `per_device` marks a replicated
    value), so the result is put out per device."""
    mesh = placement.make_mesh(jax.devices()[:1])

    def fn(w):
        g = placement.reduce_grads({"w": placement.per_device(w)})["w"]
        return g + placement.gather_params({"w": w}, {"w": P(DATA_AXIS)})["w"]

    w = jnp.arange(4.0)
    out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(DATA_AXIS)))(w)
    assert np.array_equal(np.asarray(out), 2 * np.arange(4.0, dtype=np.float32))
