"""`revtrain.trainers.common`: the train state's two layouts, the step's and examples' dropout keys,
microbatches, the gradient norm, the batch checks and flags, the non-finite check, and the elementwise test
that decides where a sharded optimizer runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, make_mesh
from revtrain.trainers import common
from revtrain.trainers.common import NonFiniteError, TrainerError, TrainState
from revtrain.trainers.stacking import Stacked


def test_a_stacked_state_gives_per_layer_copies_and_an_assignment_unstacks_it():
    params = [{"p": np.full(2, i, np.float32)} for i in range(3)]
    grouped = Stacked.from_per_layer(((0, 1), (1, 2)), params, [{}] * 3, [{}] * 3)
    ts = TrainState(4, stacked=grouped)
    assert repr(ts) == "TrainState(step=4, stacked groups ((0, 1), (1, 2)))"
    assert ts.held()[0] is grouped.params
    flat = ts.per_layer()
    assert flat.stacked is None and [float(np.asarray(x["p"])[0]) for x in flat.params] == [0, 1, 2]
    ts.params = flat.params  # an assignment: the per-layer layout is the truth from now on
    assert ts.stacked is None and repr(ts) == "TrainState(step=4, per layer)" and ts.per_layer() is ts
    assert [x.shape for x in jax.tree.leaves(ts.per_layer_shapes().params)] == [(2,)] * 3
    with pytest.raises(TypeError, match="needs params, opt_state and layer_state"):
        TrainState(0, params)


def test_step_and_example_keys():
    """A step's key is ``fold_in(PRNGKey(seed), step)``; example e of layer i gets ``fold_in(fold_in(skey, i),
    e)``, and a microbatch's rows get the keys of their rows in the whole batch."""
    skey = common.step_key(3, 5)
    assert np.array_equal(np.asarray(skey), np.asarray(jax.random.fold_in(jax.random.PRNGKey(3), 5)))
    mesh = make_mesh(jax.devices()[:1])

    def keys(where=None, rows=4):
        def fn(k):
            return common.example_keys(k if where is None else (k, where), 2, rows)
        return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(DATA_AXIS)))(skey))

    whole = keys()
    layer_key = jax.random.fold_in(skey, 2)
    assert whole.shape == (4, 2)
    assert all(np.array_equal(whole[e], np.asarray(jax.random.fold_in(layer_key, e))) for e in range(4))
    where = common.microbatch_where(1, 2, 4)
    assert where.tolist() == [2, 4]
    assert np.array_equal(keys(jnp.asarray(where), rows=2), whole[2:])  # rows 2 and 3 of the whole batch


def test_take_microbatch_takes_its_rows_of_each_devices_share():
    mesh = make_mesh(jax.devices()[:1])
    batch = {"inputs": jnp.arange(12).reshape(6, 2)}
    fn = jax.shard_map(lambda b: common.take_microbatch(b, 2, 3), mesh=mesh, in_specs=P(DATA_AXIS),
                       out_specs=P(DATA_AXIS))
    assert np.asarray(jax.jit(fn)(batch)["inputs"]).tolist() == [[8, 9], [10, 11]]


def test_grad_norm_is_the_global_norm_of_the_squares_in_layer_order():
    pieces = [jnp.array([1.0, 4.0]), jnp.array([[4.0, 16.0]])]  # any leading axes
    assert float(common.grad_norm(pieces)) == 5.0
    assert float(common.grad_norm([])) == 0.0


def test_batch_checks_and_flags_refuse_in_one_line():
    batch = {"inputs": np.zeros((6, 2), np.int32)}
    assert common.batch_size_of(batch) == 6
    common.check_batch(batch, 2, 3)
    with pytest.raises(TrainerError, match="batch size 6 is not divisible by the 4 devices"):
        common.check_batch(batch, 4)
    with pytest.raises(TrainerError) as e:
        common.check_batch(batch, 2, 2)
    assert str(e.value) == ("train.batch_size 6 on 2 device(s) is 3 per device, which does not split into "
                            "train.microbatches = 2 equal microbatches")
    common.check_flags("ReversibleTrainer", scan_layers=True)
    with pytest.raises(TrainerError, match=r"ReversibleTrainer.scan_layers must be True or False, got 'False'"):
        common.check_flags("ReversibleTrainer", scan_layers="False")


def test_check_finite_names_the_loss_or_the_lowest_failed_layer_met_by_backprop():
    class Layer:
        def __init__(self, name):
            self.name = name

    layers = [Layer("embedding"), Layer("block_0"), Layer("block_1"), Layer("head")]
    state = TrainState(7, [], [], [])
    ok = [jnp.array(True), jnp.array([True, True]), jnp.array(True)]
    common.check_finite(state, {"loss": jnp.float32(1.0)}, ok, layers)
    bad = [jnp.array(True), jnp.array([False, True]), jnp.array(False)]
    with pytest.raises(NonFiniteError) as e:
        common.check_finite(state, {"loss": jnp.float32(1.0)}, bad, layers)
    assert str(e.value) == "non-finite gradient in layer head at step 7" and e.value.state is state
    with pytest.raises(NonFiniteError, match="^non-finite loss at step 7$"):
        common.check_finite(state, {"loss": jnp.float32(np.nan)}, bad, layers)


@pytest.mark.parametrize("tx, elementwise", [(optax.adam(1e-3), True), (optax.sgd(0.1, momentum=0.9), True),
                                             (optax.adafactor(1e-3), False), (optax.lamb(1e-3), False)],
                         ids=["adam", "sgd_momentum", "adafactor", "lamb"])
def test_is_elementwise(tx, elementwise):
    """Adam and momentum SGD update a piece of a leaf as the whole leaf there; adafactor (row and column
    means) and LAMB (the leaf's trust ratio) need the whole leaf."""
    assert common.is_elementwise(tx) is elementwise
