"""`revtrain.run`: the optimizer built from ``train.*`` (a factory with a learning rate or a schedule, a ready
optimizer, global-norm clipping in front) and its refusals, the positive-size checks, and the task check; all
on `TrainConfig` objects made here (no gin file)."""

import numpy as np
import optax
import pytest

from revtrain import run as run_lib
from revtrain.errors import ConfigError
from revtrain.run import TrainConfig


def test_a_factory_gets_the_learning_rate_and_a_schedule_passes_through():
    tx, schedule = run_lib.build_optimizer(TrainConfig(optimizer=optax.sgd, learning_rate=0.5))
    assert schedule(0) == schedule(1000) == 0.5
    updates, _ = tx.update({"w": 2.0}, tx.init({"w": 0.0}))
    assert updates == {"w": -1.0}  # plain SGD: -lr * g
    warmup = optax.linear_schedule(0.0, 1.0, 10)
    _, schedule = run_lib.build_optimizer(TrainConfig(optimizer=optax.adamw, learning_rate=warmup))
    assert schedule is warmup


def test_a_ready_optimizer_has_no_schedule_and_clipping_goes_in_front():
    ready = optax.sgd(1.0)
    tx, schedule = run_lib.build_optimizer(TrainConfig(optimizer=ready, learning_rate=None))
    assert tx is ready and schedule is None
    tx, _ = run_lib.build_optimizer(TrainConfig(optimizer=optax.sgd, learning_rate=1.0, clip_global_norm=1.0))
    grads = {"a": np.float32(3.0), "b": np.float32(4.0)}
    updates, _ = tx.update(grads, tx.init(grads))  # norm 5 clipped to 1
    assert (float(updates["a"]), float(updates["b"])) == pytest.approx((-0.6, -0.8))


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": optax.sgd, "learning_rate": None}, "train.learning_rate is None but train.optimizer is a factory"),
    ({"optimizer": "adamw"}, "train.optimizer must be an optax optimizer, got 'adamw'"),
    ({"clip_global_norm": -1.0}, "train.clip_global_norm must be a positive number (None or 0: off), got -1.0"),
    ({"clip_global_norm": True}, "train.clip_global_norm must be a positive number (None or 0: off), got True"),
], ids=["no_learning_rate", "not_an_optimizer", "negative_clip", "bool_clip"])
def test_a_bad_optimizer_setting_is_one_line(kwargs, message):
    with pytest.raises(ConfigError) as e:
        run_lib.build_optimizer(TrainConfig(**kwargs))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "train.steps must be a positive integer, got 0"),
    ({"batch_size": "8"}, "train.batch_size must be a positive integer, got '8'"),
    ({"checkpoint_every": -1}, "train.checkpoint_every must be a non-negative integer, got -1"),
], ids=["steps", "batch_size", "checkpoint_every"])
def test_sizes_are_checked(kwargs, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        run_lib._check_positive(TrainConfig(**kwargs))
    run_lib._check_positive(TrainConfig())


def test_the_task_must_be_a_task_class():
    with pytest.raises(ConfigError, match="train.task must be a task class"):
        run_lib.build_task(TrainConfig(task=dict))
