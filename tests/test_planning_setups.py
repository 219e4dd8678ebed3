"""revtrain/planning/setups.py: the trainer choices a plan compares (shapes only, nothing compiled)."""

import jax
import optax

from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import make_mesh
from revtrain.planning import setups
from revtrain.trainers import ReversibleTrainer, StandardTrainer

T = 16


def _model():
    return ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=2, dropout_rate=0.0)


def test_a_standard_run_is_offered_the_reversible_trainer_and_its_leaner_forms():
    """From StandardTrainer with AdamW at batch 8 on one device: the reversible trainer, with offload, the disk
    tier, Adafactor, 2 microbatches and half the batch (each with the bindings that select it)."""
    setup = setups.Setup("standard", optax.adamw(1e-3), 8, label="StandardTrainer")
    got = setups.alternatives(setup, _model(), 1, host_offload=True)
    assert [s.label for s in got] == [
        "ReversibleTrainer", "ReversibleTrainer + offload", "ReversibleTrainer + offload='disk'",
        "ReversibleTrainer + offload + Adafactor", "ReversibleTrainer + offload + 2 microbatches",
        "StandardTrainer, batch 4", "ReversibleTrainer + offload, batch 4"]
    assert got[1].settings == ("train.trainer = @ReversibleTrainer", "ReversibleTrainer.offload = True")
    assert (got[1].tier.name, got[2].tier.name) == ("host", "disk")  # (each a tier object the plan asks)
    assert got[1].tier.state_memory == "host" and got[2].tier.state_memory is None
    assert got[4].deferred and got[4].microbatches == 2  # (microbatches: the deferred update)
    assert all(s.budget_peak == 0 for s in got)


def test_without_host_memory_no_offload_is_offered_and_adafactor_is_not_offered_twice():
    setup = setups.Setup("reversible", optax.adafactor(1e-3), 2, label="R", deferred=True)
    got = setups.alternatives(setup, _model(), 1, host_offload=False)
    labels = [s.label for s in got]
    assert "R + offload" not in labels and not any("Adafactor" in label for label in labels)
    assert "ReversibleTrainer + offload='disk'" in labels


def test_each_trainer_describes_its_own_choice():
    mesh, tx = make_mesh(jax.devices()[:1]), optax.adamw(1e-3)
    trainer = ReversibleTrainer(_model(), tx, mesh, scan_layers=False)
    rev = setups.setup_of(trainer, 8)
    std = setups.setup_of(StandardTrainer(_model(), tx, mesh), 8)
    assert (rev.trainer, rev.batch_size, rev.tier, rev.rebuild) == ("reversible", 8, trainer.residency, "exact")
    assert rev.tier.state_memory == "device"
    assert rev.optimizer is trainer.tx  # (the trainer's own optimizer: the plan's state shapes are its)
    assert (std.trainer, std.remat) == ("standard", False)
