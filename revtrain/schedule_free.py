"""Evaluation weights of a schedule-free optimizer (``optax.contrib.schedule_free``, ``schedule_free_adamw``,
``schedule_free_sgd``; Defazio et al., "The Road Less Scheduled", 2024).

A schedule-free optimizer trains on one sequence of weights (y, the parameters the step updates) and is
meant to be evaluated on another (x, the running average), which optax computes from the state:
``optax.contrib.schedule_free_eval_params(state, params)`` = ``(y - (1 - b1) z) / b1`` leaf by leaf. The
training loop's evaluations and samples use `evaluation_state` of the state, and so do ``revtrain eval``,
``revtrain sample`` and ``revtrain export`` of a checkpoint (they restore its optimizer state too when
`is_schedule_free`); a run with any other optimizer evaluates its parameters as they are.
"""

from __future__ import annotations

import jax
import numpy as np
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


def is_schedule_free(trainer) -> bool:
    """Whether ``trainer``'s optimizer state is schedule-free (traced from shapes: nothing is computed), so that
    its evaluation weights need the optimizer state: a command that evaluates, samples or exports a checkpoint
    restores it too (three times the weights' bytes) and passes the state through `evaluation_state`."""
    shapes = trainer.model.param_shapes()
    return _schedule_free_state(jax.eval_shape(trainer.tx.init, shapes[0] if shapes else {})) is not None


def restores_optimizer_state(trainer) -> bool:
    """Whether a command that evaluates, samples or exports a checkpoint of ``trainer``'s run restores its
    optimizer state too: a schedule-free one (`is_schedule_free`) whose state lives in memory (device or host
    tier: `evaluation_state` computes its evaluation weights); a disk-tier state's weights are its files,
    evaluated as trained."""
    tier = trainer.residency  # (a state in memory: the tier's ``state_memory`` names it)
    return (tier is None or tier.state_memory is not None) and is_schedule_free(trainer)


def _evaluation_weights(state, params):
    """``optax.contrib.schedule_free_eval_params(state, params)`` of one layer (or of the whole list of layers),
    computed on the default device and placed where ``params``' leaves are (device or host memory, the same
    sharding), so a state of any memory tier keeps its placement."""
    def on_device(x):
        return jax.device_put(np.asarray(x)) if isinstance(x, jax.Array) and _on_host(x) else x

    state = jax.tree.map(on_device, state)
    weights = optax.contrib.schedule_free_eval_params(state, jax.tree.map(on_device, params))
    return jax.tree.map(lambda w, p: jax.device_put(w, p.sharding) if isinstance(p, jax.Array) else np.asarray(w),
                        weights, params)


def _on_host(x: jax.Array) -> bool:
    return getattr(x.sharding, "memory_kind", None) not in (None, "device")


def evaluation_state(trainer, ts: TrainState) -> TrainState:
    """``ts`` with each layer's parameters replaced by the schedule-free evaluation weights
    (``optax.contrib.schedule_free_eval_params``) when the optimizer's state is schedule-free and held as arrays
    (device memory: StandardTrainer, ReversibleTrainer without offload; host memory: ``offload = True``); ``ts``
    itself otherwise (a disk-tier state's weights are files: evaluated as trained, see docs/recipe.md).
    StandardTrainer's one whole-model state gives every layer's weights at once, the reversible trainer's
    per-layer states each its layer's (the same elementwise equation on the same values: the same bits); host
    memory's are computed one layer at a time on the device and put back beside the others. The state
    returned shares the optimizer state and layer state with ``ts`` and is not trained on.
    """
    if _schedule_free_state(ts.held()[1]) is None:
        return ts
    per = ts.per_layer()
    leaves = jax.tree.leaves(per.params) + jax.tree.leaves(per.opt_state)
    if not leaves or not all(isinstance(x, jax.Array) for x in leaves):
        return ts  # (weights in files or the host store: evaluated as trained, see docs/recipe.md)
    if len(per.opt_state) == 1 and len(per.params) > 1:  # StandardTrainer: one state for the whole list
        state = _schedule_free_state(per.opt_state[0])
        if any(_on_host(x) for x in leaves):  # (one layer at a time on the device)
            weights = [_evaluation_weights(state._replace(z=z), p) for z, p in zip(state.z, per.params)]
        else:
            weights = optax.contrib.schedule_free_eval_params(state, per.params)
    else:
        weights = [_evaluation_weights(_schedule_free_state(o), p) for o, p in zip(per.opt_state, per.params)]
    return TrainState(per.step, list(weights), per.opt_state, per.layer_state)
