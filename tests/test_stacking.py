"""`revtrain.trainers.stacking`: runs of identical layers, groups, stacking and unstacking (values, shapes,
placements) and the grouped train state's round trip."""

import jax
import numpy as np
import pytest

from revtrain.placement import HOST_MEMORY, make_mesh, put_replicated
from revtrain.trainers.stacking import Stacked, find_runs, groups_of, stack, unstack, unstack_shapes

from helpers import tiny_model


def test_runs_of_identical_blocks_and_the_groups_covering_every_layer():
    model = tiny_model(num_layers=4, sequence_length=16)  # embedding, 4 blocks, head
    assert find_runs(model.layers) == [(1, 4)]  # the embedding is not reversible; the head never runs
    assert find_runs(model.layers, eligible=lambda layer: True) == [(1, 4)]  # embedding and head differ
    assert find_runs(model.layers, min_count=5) == []
    assert groups_of(6, [(1, 4)]) == ((0, 1), (1, 4), (5, 1))
    assert groups_of(4, []) == ((0, 1), (1, 1), (2, 1), (3, 1))
    wider = tiny_model(num_layers=1, d_model=16, sequence_length=16).layers[1]
    layers = list(model.layers)
    layers[3] = wider  # a different block breaks the run in two, the lone block is no run
    assert wider != model.layers[1]
    assert find_runs(layers) == [(1, 2)]


def test_stack_and_unstack_are_inverse_and_keep_the_memory_kind():
    mesh = make_mesh(jax.devices()[:1])
    trees = [{"w": np.full((2, 3), i, np.float32), "b": np.arange(3, dtype=np.int32) + i} for i in range(3)]
    placed = [put_replicated(t, mesh, HOST_MEMORY) for t in trees]
    stacked = stack(placed)
    assert stacked["w"].shape == (3, 2, 3) and stacked["b"].shape == (3, 3)
    assert stacked["w"].sharding.memory_kind == HOST_MEMORY
    assert np.array_equal(np.asarray(stacked["w"])[2], trees[2]["w"])
    back = unstack(stacked, 3)
    for a, b in zip(trees, back):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert np.array_equal(x, np.asarray(y)) and y.sharding.memory_kind == HOST_MEMORY
    shapes = unstack_shapes(stacked, 3)
    assert shapes["w"].shape == (2, 3) and shapes["b"].dtype == np.int32
    with pytest.raises(ValueError, match="expected a leading axis of 4"):
        unstack(stacked, 4)


def test_stack_consume_deletes_the_per_layer_arrays():
    mesh = make_mesh(jax.devices()[:1])
    placed = [put_replicated({"w": np.ones(2, np.float32) * i}, mesh) for i in range(2)]
    stacked = stack(placed, consume=True)
    assert all(t["w"].is_deleted() for t in placed)
    assert np.array_equal(np.asarray(stacked["w"]), [[0, 0], [1, 1]])


def test_a_grouped_state_round_trips_through_the_per_layer_layout():
    params = [{"p": np.full(2, i, np.float32)} for i in range(4)]
    opt = [{"m": np.full(2, 10 + i, np.float32)} for i in range(4)]
    state = [{} for _ in range(4)]
    grouped = Stacked.from_per_layer(((0, 1), (1, 2), (3, 1)), params, opt, state)
    assert grouped.params[1]["p"].shape == (2, 2) and grouped.params[0] is params[0]
    p, o, s = grouped.per_layer()
    assert [float(np.asarray(x["p"])[0]) for x in p] == [0, 1, 2, 3]
    assert [float(np.asarray(x["m"])[0]) for x in o] == [10, 11, 12, 13]
    shapes = grouped.per_layer_shapes()[0]
    assert [x["p"].shape for x in shapes] == [(2,)] * 4
