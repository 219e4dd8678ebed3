"""Evaluation weights of a schedule-free optimizer (``optax.contrib.schedule_free``, ``schedule_free_adamw``,
``schedule_free_sgd``; Defazio et al., "The Road Less Scheduled", 2024).

A schedule-free optimizer trains on one sequence of weights (y, the parameters the step updates) and is
meant to be evaluated on another (x, the running average), which optax computes from the state:
``optax.contrib.schedule_free_eval_params(state, params)`` = ``(y - (1 - b1) z) / b1`` leaf by leaf. The
training loop's evaluations and samples use `evaluation_state` of the state; a run with any other optimizer
evaluates its parameters as they are.
"""

from __future__ import annotations

import jax
import optax.contrib

from revtrain.trainers.common import TrainState


def _schedule_free_state(tree):
    """The first ``optax.contrib.ScheduleFreeState`` in an optax state (alone, in a chain or a wrapper), or
    None."""
    found = []

    def visit(node):
        if isinstance(node, optax.contrib.ScheduleFreeState):
            found.append(node)
            return True
        return False
    jax.tree.leaves(tree, is_leaf=visit)
    return found[0] if found else None


def evaluation_state(trainer, ts: TrainState) -> TrainState:
    """``ts`` with each layer's parameters replaced by the schedule-free evaluation weights
    (``optax.contrib.schedule_free_eval_params``) when the optimizer's state is schedule-free and the state
    is held as arrays (device memory: StandardTrainer, ReversibleTrainer without offload); ``ts`` itself
    otherwise. StandardTrainer's one whole-model state gives every layer's weights at once, the reversible
    trainer's per-layer states each its layer's (the same elementwise equation on the same values: the same
    bits). The state returned shares the optimizer state and layer state with ``ts`` and is not trained on.
    """
    if _schedule_free_state(ts.held()[1]) is None:
        return ts
    per = ts.per_layer()
    leaves = jax.tree.leaves(per.params)
    if not leaves or not all(isinstance(x, jax.Array) for x in leaves):
        return ts  # (weights in files or the host store: evaluated as trained, see docs/recipe.md)
    if len(per.opt_state) == 1 and len(per.params) > 1:  # StandardTrainer: one state for the whole list
        weights = optax.contrib.schedule_free_eval_params(_schedule_free_state(per.opt_state[0]), per.params)
    else:
        weights = [optax.contrib.schedule_free_eval_params(_schedule_free_state(o), p)
                   for o, p in zip(per.opt_state, per.params)]
    return TrainState(per.step, list(weights), per.opt_state, per.layer_state)
