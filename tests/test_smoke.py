"""The smoke test: what a newcomer runs first (``make smoke``, well under a minute), and what shows that a
change did not break training before the whole suite runs.

Two steps of a 2-block reversible transformer through StandardTrainer and ReversibleTrainer (in device
memory and with host offload), every parameter leaf bit for bit; then ``revtrain train``, ``eval`` and
``sample`` of a tiny run through the command line in this process (`helpers.revtrain_here`).
"""

import jax
import numpy as np
import optax

from revtrain.trainers import ReversibleTrainer, StandardTrainer

from helpers import CONFIG, records, revtrain_here, train_model

_TINY = ["--gin", "ReversibleTransformerLM.num_layers = 2", "--gin", "ReversibleTransformerLM.d_model = 32",
         "--gin", "train.batch_size = 4", "--gin", "evaluate.max_batches = 1", "--gin", "STEPS = 3",
         "--gin", "WARMUP = 1", "--gin", "train.log_every = 1", "--gin", "train.sample_every = 0"]


def test_two_steps_of_both_trainers_are_bit_for_bit(text_batches, tiny_model):
    """ReversibleTrainer (device memory, host offload) and StandardTrainer: the same losses and the same bits in
    every parameter leaf after two AdamW steps on real text."""
    batches = text_batches(4, 2)
    with jax.default_matmul_precision("highest"):
        reference, reference_losses = train_model(StandardTrainer, tiny_model(), optax.adamw(1e-3), batches)
        for offload in (False, True):
            params, losses = train_model(ReversibleTrainer, tiny_model(), optax.adamw(1e-3), batches, offload=offload)
            assert losses == reference_losses, offload
            for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(params)):
                assert np.array_equal(a, b), offload
    assert reference_losses[1] < reference_losses[0] + 1.0 and np.isfinite(reference_losses).all()


def test_train_eval_and_sample_from_the_command_line(tmp_path, capfd, byte_lm_data_dir):
    """``revtrain train`` (3 steps), ``eval`` and ``sample`` on its workdir: each exits 0 and writes what it
    promises (a loss per step, an evaluation record with bits per byte, the sampled bytes)."""
    workdir = tmp_path / "run"
    result = revtrain_here(capfd, "train", "--config", CONFIG, "--workdir", workdir, *_TINY)
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in records(workdir) if "loss" in r] == [1, 2, 3]
    result = revtrain_here(capfd, "eval", "--workdir", workdir)
    assert result.returncode == 0, result.stderr
    evaluation = [r for r in records(workdir, "eval") if "bits_per_byte" in r]
    assert evaluation and np.isfinite(evaluation[-1]["bits_per_byte"]) and evaluation[-1]["bits_per_byte"] > 0
    out = tmp_path / "sample.bin"
    result = revtrain_here(capfd, "sample", "--workdir", workdir, "--prompt", "The ", "--length", "8",
                           "--output", out)
    assert result.returncode == 0, result.stderr
    assert len(out.read_bytes()) >= 8
