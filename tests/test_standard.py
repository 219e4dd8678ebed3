"""`revtrain.trainers.standard.StandardTrainer` on the tiny model, in this process: the reference every
exactness test compares the reversible trainer with. Its layout and description, its refusal, its state's
template, and what one step does: each weight moved by the optimizer's update of the whole model's gradient, the
scanned program and the microbatched one on the unrolled one's trajectory."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, global_batch, make_mesh
from revtrain.trainers import StandardTrainer, TrainerError
from revtrain.trainers.common import step_key

from helpers import byte_batches, numpy_params, tiny_model, train_steps

T = 16


def _mesh():
    return make_mesh(jax.devices()[:1])


def _trainer(tx=None, num_layers=3, **kwargs):
    return StandardTrainer(tiny_model(num_layers=num_layers, d_model=16, sequence_length=T),
                           tx or optax.adam(1e-3), _mesh(), **kwargs)


def test_the_layout_and_how_it_describes_itself():
    assert _trainer().groups == tuple((i, 1) for i in range(5))  # embedding, 3 blocks, head: unrolled
    assert _trainer(scan_layers=True).groups == ((0, 1), (1, 3), (4, 1))  # the 3 identical blocks one scan
    trainer = _trainer()
    setup = trainer.memory_setup()
    assert setup == {"trainer": "standard", "remat": False, "tier": trainer.residency, "label": "StandardTrainer"}
    assert setup["tier"].name == "device" and trainer.memory_knobs() == ["train.trainer = @ReversibleTrainer"]
    assert trainer.memory_knobs(evaluation=True) == []
    remat = _trainer(scan_layers=True, remat_layers=True).memory_setup()
    assert remat["remat"] and remat["label"] == "StandardTrainer (scan + remat)"


def test_offloading_the_saved_inputs_needs_the_scanned_remat_program():
    with pytest.raises(TrainerError, match="remat_offload needs scan_layers = True and remat_layers = True"):
        _trainer(remat_offload=True)
    with pytest.raises(TrainerError, match="remat_offload needs scan_layers = True and remat_layers = True"):
        _trainer(scan_layers=True, remat_offload=True)


def test_the_abstract_state_is_inits_shapes_dtypes_and_shardings():
    trainer = _trainer()
    state, template = trainer.init(), trainer.abstract_state()
    for part in ("params", "opt_state", "layer_state"):
        real, abstract = getattr(state, part), getattr(template, part)
        assert jax.tree.structure(real) == jax.tree.structure(abstract), part
        for x, a in zip(jax.tree.leaves(real), jax.tree.leaves(abstract)):
            assert (x.shape, x.dtype, x.sharding) == (a.shape, a.dtype, a.sharding), part
    assert len(state.opt_state) == 1  # one optax state for the whole list of layers


def test_one_sgd_step_moves_every_weight_by_the_learning_rate_times_the_whole_models_gradient():
    lr = 0.5
    trainer, mesh = _trainer(optax.sgd(lr), num_layers=2), _mesh()
    batch = global_batch(byte_batches(1, T)[0], mesh)
    ts = trainer.init()
    before = numpy_params(ts)
    # The gradient as `grads` computes it (what `revtrain check` shares), in a program of its own.
    grads = jax.jit(jax.shard_map(lambda p, s, b, k: trainer.grads(p, s, b, k)[1], mesh=mesh,
                                  in_specs=(P(), P(), P(DATA_AXIS), P()), out_specs=P()))(
        ts.params, ts.layer_state, batch, step_key(trainer.seed, 0))
    grads = [jax.tree.map(np.asarray, g) for g in grads]
    new, metrics = trainer.train_step(ts, batch)
    assert new.step == 1 and np.isfinite(float(metrics["loss"]))
    after = numpy_params(new)
    moved = 0
    for p0, g, p1 in zip(before, grads, after):
        for a, d, b in zip(jax.tree.leaves(p0), jax.tree.leaves(g), jax.tree.leaves(p1)):
            np.testing.assert_allclose(b, a - lr * d, rtol=1e-6, atol=1e-7)
            moved += int(np.sum(b != a))
    assert moved > 0
    norm = np.sqrt(sum(float(np.sum(np.square(d))) for g in grads for d in jax.tree.leaves(g)))
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)


@pytest.mark.slow  # make test-all (each a whole-model program compiled twice, 10-15 s on 2 cores)
@pytest.mark.parametrize("kwargs", [{"scan_layers": True}, {"microbatches": 2}], ids=["scanned", "microbatches"])
def test_the_scanned_and_microbatched_programs_follow_the_unrolled_trajectory(kwargs):
    """Two steps (2 blocks, SGD with momentum, dropout): the same losses and weights as the unrolled whole-batch
    program, up to the rounding of another summation order (the same per-example dropout keys, the loss a mean
    over the global batch either way)."""
    batches = byte_batches(2, T)
    sgd = lambda: optax.sgd(0.3, momentum=0.9)  # noqa: E731
    reference, ref_history = train_steps(_trainer(sgd(), num_layers=2), batches)
    other, history = train_steps(_trainer(sgd(), num_layers=2, **kwargs), batches)
    np.testing.assert_allclose([h["loss"] for h in history], [h["loss"] for h in ref_history], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(numpy_params(reference)), jax.tree.leaves(numpy_params(other))):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
