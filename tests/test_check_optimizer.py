"""`revtrain.check_optimizer`: ``revtrain check`` compares each layer's optimizer step (new parameters and new
optimizer state, as ReversibleTrainer computes them) with the whole model's (StandardTrainer's), bit for bit.

A deterministic failing case without a real optimizer (real ones are being made exact by other work): a test-only
optax transformation that divides the update by the number of leaves of the tree it is given, so one layer's
tree (fewer leaves) moves further than the same layer inside the whole model's tree, by construction.
"""

import io

import gin
import jax
import numpy as np
import optax
import pytest

from revtrain import check_optimizer
from revtrain.errors import ConfigError
from revtrain.models import ReversibleTransformerLM
from revtrain.placement import make_mesh
from revtrain.trainers import ReversibleTrainer

from helpers import CONFIG, revtrain_here


@gin.configurable
def leaf_count_sgd(learning_rate: float = 0.1) -> optax.GradientTransformation:
    """SGD whose step is divided by the number of leaves of the tree it updates (test only)."""
    def update(updates, state, params=None):
        n = len(jax.tree.leaves(updates))
        return jax.tree.map(lambda u: -learning_rate * u / n, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _compare(tx, steps: int = 2):
    model = ReversibleTransformerLM(128, num_layers=2, d_model=16, num_heads=2)
    trainer = ReversibleTrainer(model, tx, make_mesh(jax.devices()[:1]))
    params = [jax.tree.map(np.asarray, model.init_layer(i)[0]) for i in range(len(model.layers))]
    return check_optimizer.compare(trainer, model, params, steps=steps)


def test_adamw_per_layer_equals_the_whole_model_bit_for_bit():
    result = _compare(optax.adamw(1e-3))
    assert result.ok and result.form == "the fused update", result.line()
    assert result.line().startswith("PASS: optimizer step, 2 steps") and "bit for bit" in result.line()


def test_a_global_norm_clip_runs_the_deferred_rounds_and_matches():
    result = _compare(optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-3)))
    assert result.ok and result.form == "the deferred update, 1 global round(s)", result.line()


def test_an_optimizer_that_reads_the_loss_gets_a_seeded_value_both_ways():
    """``optax.contrib.momo`` reads the step's loss (``value``): both ways get `check_optimizer.seeded_value`, one
    float32 a step, and its per-layer step (deferred: the loss and the inner products are global values) equals
    the whole model's bit for bit."""
    assert check_optimizer.seeded_value(0, 1) != check_optimizer.seeded_value(0, 2)
    assert 1.0 <= check_optimizer.seeded_value(0, 1) < 5.0
    result = _compare(optax.contrib.momo())
    assert result.ok and result.form.startswith("the deferred update, "), result.line()


def test_a_flattened_elementwise_optimizer_is_each_layers_own_and_matches_its_segment():
    """``optax.flatten(adamw)`` keeps one moment vector of every layer's elements: each layer's own update (its
    own concatenation) is its segment of the whole one, so it runs the fused update and every layer's new
    parameters and moments equal the whole model's (its segment of each moment vector) bit for bit."""
    result = _compare(optax.flatten(optax.adamw(1e-3)))
    assert result.ok and result.form == "the fused update", result.line()


@pytest.mark.slow  # (about 35 CPU s; make test: test_layerwise's lbfgs case)
def test_the_lbfgs_recursion_runs_a_global_round_per_iteration_and_matches():
    """``optax.scale_by_lbfgs`` (memory 2): its two-loop recursion unrolled, one global round per iteration (four);
    over three steps (the history holds one difference at step 2, two at step 3) every layer's new parameters and
    state (its differences, the step count, the weights) equal the whole model's bit for bit."""
    result = _compare(optax.chain(optax.scale_by_lbfgs(memory_size=2), optax.scale(-1e-3)), steps=3)
    assert result.ok and result.form == "the deferred update, 4 global round(s)", result.line()
    assert result.line().startswith("PASS: optimizer step, 3 steps")


def test_an_optimizer_whose_layer_step_differs_is_named_by_step_layer_and_leaf():
    result = _compare(leaf_count_sgd())
    d = result.difference
    # The embedding (layer 0, 2 leaves) moves by 1/2 of the step where the whole tree (every layer's leaves)
    # moves it by 1/N: its first leaf differs at the first step.
    assert (d.step, d.layer, d.name, d.what, d.leaf) == (1, 0, "embedding", "params", "['positions']"), d
    assert d.max_abs > 0
    assert result.line().startswith("FAIL: optimizer step") and "layer embedding (index 0)" in result.line()


def test_state_of_layer_matches_the_whole_state_by_path():
    """Adam's whole state (one ``mu`` tree of the list of layers) gives each layer its own moments, and the step
    count every layer's state has."""
    params = [{"w": np.ones(2, np.float32)}, {"w": np.zeros(3, np.float32), "b": np.ones(1, np.float32)}]
    tx = optax.adam(1e-3)
    whole = tx.init(params)
    whole = jax.tree.map(lambda x: x + 7 if x.ndim == 0 else x, whole)  # the count: 7
    layer = tx.init(params[1])
    leaves = check_optimizer._state_of_layer(whole, layer, 1)
    shapes = [(), (1,), (3,), (1,), (3,)]  # the count, then mu and nu of b and w
    assert [np.shape(x) for x in leaves] == [np.shape(x) for x in jax.tree.leaves(layer)] == shapes
    assert int(leaves[0]) == 7


@pytest.mark.slow  # make test: the FAIL line's step, layer and leaf below
def test_revtrain_check_fails_on_an_optimizer_whose_layer_step_differs(capfd):
    """The command: the gradients pass (the model is exact), the optimizer step fails, exit 1, naming the
    layer (the test-only optimizer above, bound in gin)."""
    precision = jax.config.jax_default_matmul_precision  # (check sets 'highest' for the process: put back)
    try:
        result = revtrain_here(capfd, "check", "--config", CONFIG, "--gin", "ReversibleTransformerLM.num_layers = 2",
                               "--gin", "ReversibleTransformerLM.d_model = 16", "--gin", "train.batch_size = 2",
                               "--gin", "train.optimizer = @leaf_count_sgd()", "--gin", "train.learning_rate = None")
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("PASS: compute dtype float32") for line in lines), result.stdout
    assert lines[-1].startswith("FAIL: optimizer step") and "layer embedding (index 0)" in lines[-1], lines[-1]


def test_steps_zero_leaves_the_comparison_out_and_a_bad_value_is_refused():
    out = io.StringIO()
    assert check_optimizer.verdict(None, [], 1, out, steps=0) == 1  # the gradient check's status stands
    assert out.getvalue() == "optimizer step: not compared (check_optimizer.steps = 0)\n"
    with pytest.raises(ConfigError, match="check_optimizer.steps must be a non-negative integer, got -1"):
        check_optimizer.verdict(None, [], 0, out, steps=-1)
