"""A schedule-free run (``optax.contrib.schedule_free_adamw``) is evaluated, sampled and exported on its evaluation
weights (``optax.contrib.schedule_free_eval_params``, `revtrain.schedule_free`) by the commands that read its
checkpoint, as the training loop evaluates and samples it: ``revtrain eval`` scores what training scored,
``revtrain sample`` generates from the evaluation weights and ``revtrain export`` writes them (issue 60). A tiny
Llama run of 2 steps per tier (StandardTrainer in device memory; ReversibleTrainer with ``offload = True``, its
state in host memory: in make test-all), every command in this process (`helpers.revtrain_here`). The disk
tier's weights are files: evaluated as trained (docs/recipe.md)."""

import json
import os

import jax
import numpy as np
import pytest

from helpers import REPO, records, revtrain_here

LLAMA = str(REPO / "configs" / "llama_small.gin")
TINY = ["--gin", "LlamaModel.d_model = 32", "--gin", "LlamaModel.d_ff = 64", "--gin", "LlamaModel.num_layers = 2",
        "--gin", "LlamaModel.num_heads = 2", "--gin", "LlamaModel.num_kv_heads = 1", "--gin", "WARMUP = 1",
        "--gin", "STEPS = 2", "--gin", "train.batch_size = 2", "--gin", "train.log_every = 1",
        "--gin", "evaluate.max_batches = 1", "--gin", "train.sample_every = 2", "--gin", "train.sample_length = 8",
        "--gin", "train.checkpoint_every = 0", "--gin", "train.optimizer = @optax.contrib.schedule_free_adamw",
        "--gin", "train.learning_rate = 0.05"]
TIERS = {"standard": ["--gin", "train.trainer = @StandardTrainer"],
         "host": ["--gin", "train.trainer = @ReversibleTrainer", "--gin", "ReversibleTrainer.offload = True"]}


def _bits(tree) -> list:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _states(workdir):
    """The run's last checkpoint restored whole (weights and optimizer state): ``(weights as trained, evaluation
    weights)``, each a list of per-layer trees of numpy arrays."""
    import gin

    from revtrain import checkpoint as ckpt_lib
    from revtrain import cli, loop
    from revtrain.schedule_free import evaluation_state
    cli._parse_gin([str(workdir / "config.gin")], [], workdir=str(workdir))
    try:
        run = loop.build(workdir=str(workdir))
        checkpointer = ckpt_lib.Checkpointer(str(workdir), read_only=True)
        ts = checkpointer.restore(run.trainer.abstract_state())
        checkpointer.close()
        evaluated = evaluation_state(run.trainer, ts)
        return jax.tree.map(np.asarray, ts.params), jax.tree.map(np.asarray, evaluated.params)
    finally:
        gin.clear_config()


@pytest.mark.slow  # make test: test_optimizer_catalogue's schedule-free evaluation on both trainers
@pytest.mark.parametrize("tier", [pytest.param(t, marks=pytest.mark.slow) if t == "host" else t for t in TIERS])
def test_eval_sample_and_export_use_the_evaluation_weights(tier, tmp_path, capsys, monkeypatch):
    from revtrain import sample
    workdir = tmp_path / "run"
    result = revtrain_here(capsys, "train", "--config", LLAMA, *TINY, *TIERS[tier], "--workdir", workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    trained, evaluation = _states(workdir)
    assert _bits(trained) != _bits(evaluation)  # (the two sequences of weights differ after 2 steps)

    # eval: the score training wrote (on the evaluation weights) to the last digit
    result = revtrain_here(capsys, "eval", "--workdir", workdir, "--name", "again")
    assert result.returncode == 0, result.stderr[-2000:]
    own, again = records(workdir, "eval")[-1], records(workdir, "eval_again")[-1]
    assert own["step"] == 2 and again == own

    # sample: generated from the evaluation weights (greedy: the sample training wrote)
    seen = []

    def generate(trainer, ts, *args, **kwargs):
        seen.append(jax.tree.map(np.asarray, ts.per_layer().params))
        return real(trainer, ts, *args, **kwargs)

    real = sample.generate
    monkeypatch.setattr(sample, "generate", generate)
    trained_sample = json.loads((workdir / "metrics" / "samples.jsonl").read_text().splitlines()[-1])
    result = revtrain_here(capsys, "sample", "--workdir", workdir, "--prompt", trained_sample["prompt"],
                           "--length", "8", "--temperature", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(seen) == 1 and _bits(seen[0]) == _bits(evaluation)
    assert result.stdout.rstrip("\n") == trained_sample["prompt"] + trained_sample["text"]

    # export: the evaluation weights, tensor for tensor
    from safetensors.numpy import load_file
    out = tmp_path / "hf"
    result = revtrain_here(capsys, "export", "--workdir", workdir, "--to", out)
    assert result.returncode == 0, result.stderr[-2000:]
    tensors = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(out / name)))
    exported = sorted(x.tobytes() for x in tensors.values())
    from revtrain.models.llama import iter_model_tensors
    import gin

    from revtrain import cli, loop
    cli._parse_gin([str(workdir / "config.gin")], [], workdir=str(workdir))
    try:
        model = loop.build(workdir=str(workdir)).model
        want = sorted(np.asarray(x, np.float32).tobytes() for _, x in iter_model_tensors(model, evaluation))
        unwanted = sorted(np.asarray(x, np.float32).tobytes() for _, x in iter_model_tensors(model, trained))
    finally:
        gin.clear_config()
    assert exported == want and exported != unwanted
