"""Hugging Face conventions (revtrain/optim.py, issue 40): weight decay off for biases and norm scales with
``optax.adamw.mask = @decay_mask``, and a ready optimizer's learning rate in the progress line and
``train.jsonl`` (``optax.inject_hyperparams``)."""

import json
import pathlib

import jax
import numpy as np
import optax
import pytest

from revtrain.optim import decay_mask, injected_learning_rate

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "enwik_small.gin")
TINY = ["--config", CONFIG, "--gin", "ReversibleTransformerLM.num_layers = 1",
        "--gin", "ReversibleTransformerLM.d_model = 16", "--gin", "ReversibleTransformerLM.num_heads = 1",
        "--gin", "train.batch_size = 2", "--gin", "evaluate.max_batches = 1", "--gin", "train.log_every = 1",
        "--gin", "STEPS = 3", "--gin", "WARMUP = 1", "--gin", "train.sample_every = 0",
        "--gin", "train.checkpoint_every = 0"]


def test_decay_mask_decays_matrices_only():
    """With a zero gradient AdamW's step is the decay alone: the matrix shrinks by lr * wd * w, the bias
    and the norm scale stay as they were (optax.adamw without the mask decays them too)."""
    params = {"w": np.full((3, 4), 2.0, np.float32), "b": np.full(4, 2.0, np.float32),
              "norm": {"scale": np.ones(4, np.float32)}}
    assert decay_mask(params) == {"w": True, "b": False, "norm": {"scale": False}}
    grads = jax.tree.map(np.zeros_like, params)
    for mask, decayed in [(decay_mask, {"w"}), (None, {"w", "b", "norm"})]:
        tx = optax.adamw(0.1, weight_decay=0.5, mask=mask)
        updates, _ = tx.update(grads, tx.init(params), params)
        for name in params:
            want = -0.1 * 0.5 * np.asarray(jax.tree.leaves(params[name])[0]) if name in decayed else 0.0
            np.testing.assert_allclose(jax.tree.leaves(updates[name])[0], want, rtol=1e-6)


@pytest.mark.slow  # make test: the mask's binding below, masked optimizers in the catalogue's representatives
def test_masked_adamw_per_layer_equals_backprop(text_batches):
    """The mask applies per layer in the reversible trainer as on the whole model in StandardTrainer: the
    same parameters bit for bit after 3 steps (ReversibleTransformerLM, float32, highest precision), and
    the norm biases differ from an unmasked run's."""
    from revtrain.models import ReversibleTransformerLM
    from revtrain.placement import global_batch, make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer
    mesh, batches, out = make_mesh(jax.devices()[:1]), text_batches(8, 3), {}
    model = ReversibleTransformerLM(128, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0)
    with jax.default_matmul_precision("highest"):
        for name, cls, mask in [("standard", StandardTrainer, decay_mask), ("reversible", ReversibleTrainer, decay_mask),
                                ("unmasked", ReversibleTrainer, None)]:
            trainer = cls(model, optax.adamw(3e-3, weight_decay=0.5, mask=mask), mesh)
            ts = trainer.init()
            for batch in batches:
                ts, _ = trainer.train_step(ts, global_batch(batch, mesh))
            ts = ts.per_layer() if hasattr(ts, "per_layer") else ts
            out[name] = [np.asarray(x) for x in jax.tree.leaves(ts.params)]
    assert all(np.array_equal(a, b) for a, b in zip(out["standard"], out["reversible"]))
    assert any(a.ndim == 1 and not np.array_equal(a, b) for a, b in zip(out["reversible"], out["unmasked"]))


def test_injected_learning_rate_reads_the_state():
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1.0, 0.0, 10))
    params = {"w": np.ones(3, np.float32)}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update(params, state, params)
    assert injected_learning_rate([state, state]) == pytest.approx(0.8)  # the third update's: step 2 of 10
    assert injected_learning_rate([optax.adamw(1e-3).init(params)]) is None


def test_a_ready_optimizer_logs_its_learning_rate(tmp_path, byte_lm_data_dir, capfd):
    """``train.optimizer = @optax.inject_hyperparams()`` with a schedule and the decay mask, through gin: the
    learning rate of each step in train.jsonl (the schedule's value) and in the progress line; a factory
    run with ``optax.adamw.mask = @decay_mask`` records the mask in its config.gin."""
    from revtrain import cli
    workdir = tmp_path / "run"
    args = ["train", *TINY, "--workdir", str(workdir), "--gin", "train.optimizer = @optax.inject_hyperparams()",
            "--gin", "train.learning_rate = None", "--gin", "optax.inject_hyperparams.optimizer = @optax.adamw",
            "--gin", "optax.inject_hyperparams.hyperparams = {'learning_rate': @optax.linear_schedule(), "
                     "'weight_decay': 0.01}",
            "--gin", "optax.linear_schedule.init_value = 0.004", "--gin", "optax.linear_schedule.end_value = 0.001",
            "--gin", "optax.linear_schedule.transition_steps = 3", "--gin", "optax.inject_hyperparams.static = {'mask': @decay_mask}"]
    assert cli.main(args) == 0
    err = capfd.readouterr().err
    records = [json.loads(line) for line in (workdir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["learning_rate"] for r in records] == pytest.approx([0.004, 0.003, 0.002])
    assert "| lr 0.004 |" in err and "| lr 0.002 |" in err, err
    assert "inject_hyperparams.static = {'mask': @decay_mask}" in (workdir / "config.gin").read_text()


def test_the_mask_binding_of_a_factory_reaches_adamw(tmp_path, byte_lm_data_dir, capfd):
    from revtrain import cli
    workdir = tmp_path / "run"
    assert cli.main(["train", *TINY, "--workdir", str(workdir), "--gin", "optax.adamw.mask = @decay_mask"]) == 0
    assert "adamw.mask = @decay_mask" in (workdir / "config.gin").read_text()
    records = [json.loads(line) for line in (workdir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["learning_rate"]) for r in records)
