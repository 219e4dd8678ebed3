"""`revtrain.trainers.reversible.ReversibleTrainer` on the tiny model, in this process: its working layout
(groups, block modes, the blocks in the head's program), which update it runs for which optimizer, how it
describes itself, its refusals, and two steps bit for bit like StandardTrainer's (losses, every parameter and
Adam state leaf)."""

import jax
import numpy as np
import optax
import pytest

from revtrain.placement import make_mesh
from revtrain.trainers import ReversibleTrainer, StandardTrainer, TrainerError
from revtrain.trainers.modes import BACKPROP, CHECKPOINT, REBUILDS, REMAT

from helpers import numpy_params, tiny_model, train_steps

T = 16


def _trainer(tx=None, **kwargs):
    return ReversibleTrainer(tiny_model(num_layers=3, d_model=16, sequence_length=T), tx or optax.adamw(1e-3),
                             make_mesh(jax.devices()[:1]), **kwargs)


def test_the_layout_stacks_the_rebuilt_run_and_follows_the_block_modes():
    trainer = _trainer()
    assert trainer.groups == ((0, 1), (1, 3), (4, 1))  # embedding, the 3 blocks in one scan, head
    assert trainer.block_modes == [REMAT, REBUILDS["exact"], REBUILDS["exact"], REBUILDS["exact"]]
    assert trainer.num_top == 0 and trainer.rebuild == "exact"
    assert _trainer(scan_layers=False).groups == tuple((i, 1) for i in range(5))
    top = _trainer(fuse_top=True)  # the block under the head runs in the head's program
    assert top.block_modes[-1] is BACKPROP and top.num_top == 1 and top.groups == ((0, 1), (1, 2), (3, 1), (4, 1))
    trainer.set_block_modes([REMAT, REMAT, REBUILDS["exact"], CHECKPOINT])
    assert trainer.num_top == 1 and trainer.groups == tuple((i, 1) for i in range(5))
    with pytest.raises(TrainerError, match="directly under the head"):
        trainer.set_block_modes([REMAT, CHECKPOINT, REBUILDS["exact"], REBUILDS["exact"]])
    with pytest.raises(TrainerError, match="a standard layer can only be recomputed"):
        trainer.set_block_modes([REBUILDS["exact"]] * 4)


def test_the_update_follows_the_optimizer_and_says_why():
    adamw = _trainer()
    assert not adamw.deferred and adamw.layerwise.separable and adamw.update_text() == "fused per layer"
    clipped = _trainer(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    assert clipped.deferred and clipped.layerwise.rounds == 1
    assert clipped.update_text() == "deferred (the optimizer combines layers (1 global round(s)))"
    assert _trainer(microbatches=2).update_text() == "deferred (2 microbatches)"


def test_it_describes_itself_to_the_memory_plan():
    trainer = _trainer()
    setup = trainer.memory_setup()
    assert setup == {"trainer": "reversible", "label": "ReversibleTrainer", "tier": trainer.residency,
                     "shard_state": False, "deferred": False, "rebuild": "exact", "budget_peak": 0}
    assert setup["tier"].name == "device" and trainer.memory_knobs() == ["ReversibleTrainer.offload = True"]
    offloaded = _trainer(offload=True)
    assert offloaded.memory_knobs() == [] and offloaded.memory_setup()["tier"].state_memory == "host"


@pytest.mark.parametrize("kwargs, message", [
    ({"rebuild": "approximate"}, "ReversibleTrainer.rebuild must be one of 'exact', 'fused', 'fenced'"),
    ({"budget_objective": "speed"}, "ReversibleTrainer.budget_objective must be one of"),
    ({"scan_layers": "yes"}, "ReversibleTrainer.scan_layers must be True or False, got 'yes'"),
    ({"microbatches": 0}, "train.microbatches must be a positive integer, got 0"),
], ids=["rebuild", "budget_objective", "scan_layers", "microbatches"])
def test_bad_settings_are_refused_naming_the_setting(kwargs, message):
    with pytest.raises(TrainerError) as e:
        _trainer(**kwargs)
    assert str(e.value).splitlines()[0].startswith(message)  # (gin adds where it called the class below)


@pytest.mark.slow  # make test: test_smoke's two steps of both trainers
def test_two_steps_equal_the_standard_trainers_bit_for_bit(text_batches):
    """AdamW, dropout 0.1, two steps on real text (the smoke test's model, data and programs: its compiles are
    the session cache's): the scanned reversible trainer's losses, parameters and every layer's Adam moments
    are StandardTrainer's bits (the moments of layer i: the whole-model state's ``mu[i]``)."""
    batches = text_batches(4, 2)
    mesh = make_mesh(jax.devices()[:1])
    with jax.default_matmul_precision("highest"):
        ref, ref_history = train_steps(StandardTrainer(tiny_model(), optax.adamw(1e-3), mesh, seed=0), batches)
        rev, history = train_steps(ReversibleTrainer(tiny_model(), optax.adamw(1e-3), mesh, seed=0), batches)
    assert [h["loss"] for h in history] == [h["loss"] for h in ref_history]
    assert rev.step == ref.step == 2 and rev.stacked is not None  # (the 2 blocks held as one stacked run)
    for a, b in zip(jax.tree.leaves(numpy_params(ref)), jax.tree.leaves(numpy_params(rev))):
        assert np.array_equal(a, b)
    whole = ref.opt_state[0]  # optax.adamw's state of the whole list of layers: (ScaleByAdamState, ...)
    for i, layer in enumerate(rev.per_layer().opt_state):
        assert int(layer[0].count) == int(whole[0].count) == 2
        for a, b in zip(jax.tree.leaves((whole[0].mu[i], whole[0].nu[i])), jax.tree.leaves((layer[0].mu, layer[0].nu))):
            assert np.array_equal(np.asarray(a), np.asarray(b))
