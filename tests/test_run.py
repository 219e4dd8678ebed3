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


def test_a_ready_optimizer_names_the_schedule_it_leaves_unused(capfd):
    """configs/enwik_small.gin binds its warmup schedule for ``train.learning_rate``; with a ready optimizer
    and ``train.learning_rate = None`` the optimizer is built without it, and one line names the schedule and
    its values (``WARMUP`` resolved); once a call uses the schedule (as ``optax.inject_hyperparams`` with
    ``@optax.warmup_cosine_decay_schedule()`` would), it is not named."""
    import gin

    from revtrain import registry
    registry.parse_gin(["configs/enwik_small.gin"], ["train.learning_rate = None", "WARMUP = 7"])
    try:
        tx, schedule = run_lib.build_optimizer(TrainConfig(optimizer=optax.sgd(0.1), learning_rate=None))
        assert schedule is None
        err = capfd.readouterr().err
        assert err.count("so the schedule bound in the config is unused: warmup_cosine_decay_schedule (decay_steps "
                         "= 700, end_value = 0.0001, init_value = 0.0, peak_value = 0.003, warmup_steps = 7)") == 1, err
        warmup = gin.get_configurable("optax.warmup_cosine_decay_schedule")()
        assert warmup(7) == pytest.approx(0.003) and run_lib.unused_schedules() == []
        run_lib.build_optimizer(TrainConfig(optimizer=optax.sgd(0.1), learning_rate=None))
        assert "unused" not in capfd.readouterr().err
    finally:
        gin.clear_config()
