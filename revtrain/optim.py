"""Optimizer conventions users bring from Hugging Face: weight decay only on weight matrices, and the
learning rate of a ready optimizer read back from its state.

* `decay_mask`: the ``mask`` of ``optax.adamw`` (or ``optax.add_decayed_weights``) that decays leaves of two
  or more dimensions (weight matrices, embeddings, convolution kernels) and leaves biases and norm scales
  alone, as the Hugging Face ``Trainer`` does by default (it excludes ``bias`` and normalisation weights by
  name; in revtrain's layers those are exactly the one-dimensional leaves). In gin:
  ``optax.adamw.mask = @decay_mask``. Each layer's update calls it on that layer's parameters, the
  whole-model update on the whole list: the same leaves either way.
* `injected_learning_rate`: the learning rate an ``optax.inject_hyperparams`` optimizer used for its last
  update, found in its state (``InjectHyperparamsState.hyperparams["learning_rate"]``); the training loop
  logs it when ``train.optimizer`` is a ready optimizer (no schedule of its own to evaluate).
"""

from __future__ import annotations

import gin
import jax
import numpy as np


@gin.configurable
def decay_mask(params):
    """The weight-decay mask of ``params``: True for leaves of two or more dimensions, False for biases,
    norm scales and other one-dimensional (or scalar) leaves.

    Args:
      params: any pytree of arrays (a layer's params, or the list of every layer's).

    Returns:
      a pytree of bools with the structure of ``params``.
    """
    return jax.tree.map(lambda x: np.ndim(x) >= 2, params)


def injected_learning_rate(opt_state) -> float | None:
    """The learning rate of the first ``optax.inject_hyperparams`` state in ``opt_state`` (any pytree of
    optax states; a stacked run's leading layer axis is read at its first layer), or None when there is no
    such state or it has no ``learning_rate``."""
    found = []

    def visit(node):
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict) and "learning_rate" in hyper:
            found.append(hyper["learning_rate"])
            return True
        return False

    jax.tree.leaves(opt_state, is_leaf=visit)
    if not found:
        return None
    value = np.asarray(jax.device_get(found[0]), np.float64).reshape(-1)
    return float(value[0]) if value.size else None


@gin.configurable("inject_hyperparams", module="optax")
def inject_hyperparams(optimizer=gin.REQUIRED, hyperparams=None, static=None):
    """``optax.inject_hyperparams(optimizer, static_args=static)(**hyperparams, **static)`` for gin: a ready
    optimizer whose hyperparameters (numbers or schedules) live in its state, so the loop can log its
    learning rate.

    ``static``: arguments that are not hyperparameters (a callable there would be taken for a schedule),
    such as the decay mask. ``optax.inject_hyperparams`` passes every argument of ``optimizer`` itself, so
    bindings of the inner factory (``optax.adamw.mask = ...``) do not reach it: give them here.

    Example: ``train.optimizer = @optax.inject_hyperparams()``, ``optax.inject_hyperparams.optimizer =
    @optax.adamw``, ``optax.inject_hyperparams.hyperparams = {'learning_rate': 1e-3, 'weight_decay': 0.01}``,
    ``optax.inject_hyperparams.static = {'mask': @decay_mask}`` and ``train.learning_rate = None``.
    """
    import optax
    static = dict(static or {})
    return optax.inject_hyperparams(optimizer, static_args=tuple(static))(**(hyperparams or {}), **static)
