"""A run's configuration (gin's ``train`` and ``evaluate``) and its building: task, model, optimizer and
trainer from the parsed gin config (`build`), and what a checkpoint must agree on (`run_signature`,
`same_model`).

Below the commands that use a built run as siblings: the training loop (`revtrain.loop`), the memory plan's
command, and the checkpoint readers (``eval``, ``sample``, ``export``, ``check``, `revtrain.logits`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

import gin
import jax
import optax

from revtrain import ginconfig
from revtrain import metrics as metrics_lib
from revtrain.data import tokenizer as tokenizer_lib
from revtrain.data.tasks import ByteLMTask, Task
from revtrain.errors import ConfigError
from revtrain.models import contract
from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import make_mesh
from revtrain.trainers.common import TrainerBase, microbatch_error
from revtrain.trainers.reversible import ReversibleTrainer

@gin.configurable("train")
@dataclasses.dataclass
class TrainConfig:
    """Everything ``revtrain train`` reads from gin under the name ``train``.

    Attributes:
      steps: total optimizer steps of the run (a resumed run continues up to this number).
      batch_size: global batch size in examples (sequences), split over all devices.
      seed: seed of initialisation, data order and dropout.
      log_every: steps between progress lines / ``train.jsonl`` records.
      checkpoint_every: steps between checkpoints (0: only at the end).
      eval_every: steps between evaluations during training (0: only at the end).
      keep_checkpoints: newest checkpoints kept.
      keep_checkpoint_period: also keep every checkpoint whose step is a multiple of this (None: off).
      trainer: trainer class (``@ReversibleTrainer`` or ``@StandardTrainer``).
      model: model builder (``@ReversibleTransformerLM``).
      task: task class (``@ByteLMTask``).
      optimizer: an optax optimizer factory taking ``learning_rate`` (``@optax.adamw``), or a ready
        ``GradientTransformation`` (``@optax.adamw()``, ``@optax.chain()``), which then brings its own
        learning rate.
      learning_rate: a float or an optax schedule (``@optax.warmup_cosine_decay_schedule()``) for a factory
        ``optimizer``; with a ready one it must be None (bound to anything else it is refused: it would be
        unused).
      clip_global_norm: clip the gradient to this global norm before the optimizer
        (``optax.chain(optax.clip_by_global_norm(c), optimizer)``, as MaxText's gradient_clipping_threshold);
        None or 0: off. Exact in both trainers (docs/recipe.md).
      microbatches: gradient accumulation: each step runs the global batch as this many microbatches, one
        after another, and applies the optimizer once to their summed gradient (each device's share is
        split; activation memory is one microbatch's).
      skip_nonfinite_steps: a step whose loss or gradient is not finite stops the run (the newest good
        checkpoint is kept); with N > 0 up to N such steps are skipped instead (their updates are not
        applied, each one logged) before the run stops.
      sample_every: every this many steps and at the last step, greedily continue ``sample_prompt`` by
        ``sample_length`` bytes (tokens, for a `TokenLMTask`) and write it to ``metrics/samples.jsonl`` and
        TensorBoard (0: off; language models whose layers decode; see ``revtrain.sample``).
      sample_prompt: the prompt of those samples (text, encoded as UTF-8).
      sample_length: bytes (tokens, for a `TokenLMTask`) generated per sample.
      memory_plan: estimate each memory tier's peak before the state is placed (`revtrain.planning`), log
        it, put it in the first ``train.jsonl`` record, and refuse (exit status 2) a run that does not fit;
        False skips it.
    """

    steps: int = 1000
    batch_size: int = 32
    seed: int = 0
    log_every: int = 50
    checkpoint_every: int = 0
    eval_every: int = 0
    keep_checkpoints: int = 3
    keep_checkpoint_period: int | None = None
    trainer: Callable = ReversibleTrainer
    model: Callable = ReversibleTransformerLM
    task: Callable = ByteLMTask
    optimizer: Any = optax.adamw
    learning_rate: Any = 1e-3
    clip_global_norm: float | None = None
    microbatches: int = 1
    skip_nonfinite_steps: int = 0
    sample_every: int = 0
    sample_prompt: str = "[[Category:"
    sample_length: int = 300
    memory_plan: bool = True


@gin.configurable("evaluate")
@dataclasses.dataclass
class EvalConfig:
    """Evaluation settings (gin name ``evaluate``).

    Attributes:
      split: dataset split scored by ``revtrain eval`` and periodic evaluation.
      batch_size: global evaluation batch size.
      max_batches: score at most this many batches (None: the whole split).
    """

    split: str = "validation"
    batch_size: int = 64
    max_batches: int | None = None


def _check_positive(cfg: TrainConfig) -> None:
    for name in ("steps", "batch_size", "log_every"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
    for name in ("checkpoint_every", "eval_every", "sample_every"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"train.{name} must be a non-negative integer, got {value!r}")


def _divisible(batch_size: int, mesh, what: str) -> None:
    if batch_size % mesh.size:
        raise ConfigError(f"{what} {batch_size} is not divisible by the {mesh.size} devices")


def _bound(name: str) -> bool:
    """Whether gin has a binding for ``name`` (in a config file, an include or on the command line)."""
    try:
        gin.query_parameter(name)
    except ValueError:
        return False
    return True


def unused_schedules() -> list[str]:
    """The learning-rate schedules bound in the parsed gin config that no call used, each as ``'NAME
    (parameter = value, ...)'`` (macros resolved), sorted by name: what a config such as
    configs/enwik_small.gin binds for ``train.learning_rate`` (``optax.warmup_cosine_decay_schedule``, its
    ``WARMUP``) and a ready optimizer with ``train.learning_rate = None`` leaves unused. A schedule is a
    configurable whose name ends in ``schedule`` (optax's ``*_schedule`` functions, named as gin names them);
    one a ready optimizer calls (``optax.inject_hyperparams`` with ``@optax.linear_schedule()``) is used and
    not listed."""
    def schedules(text: str) -> dict:
        found: dict = {}
        for selector, value in ginconfig.operative_values(text).items():
            name, _, parameter = selector.rpartition(".")
            if name.endswith("schedule"):
                found.setdefault(name, []).append(f"{parameter} = {value}")
        return found
    bound, used = schedules(gin.config_str()), schedules(gin.operative_config_str())
    return [f"{name} ({', '.join(values)})" for name, values in sorted(bound.items()) if name not in used]


def build_optimizer(cfg: TrainConfig):
    """Returns ``(tx, schedule)``: the optax transformation (behind global-norm clipping with
    ``clip_global_norm``) and a step -> learning-rate function (or None for a ready optimizer).

    Raises:
      ConfigError: ``optimizer`` is neither a factory nor a ready optimizer, a learning rate is bound beside
        a ready optimizer (it would be unused), or ``clip_global_norm`` is not a non-negative number.
    """
    clip = cfg.clip_global_norm
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0
                             or not math.isfinite(clip)):
        raise ConfigError(f"train.clip_global_norm must be a positive number (None or 0: off), got {clip!r}")
    if isinstance(cfg.optimizer, optax.GradientTransformation):
        if cfg.learning_rate is not None and _bound("train.learning_rate"):
            raise ConfigError(
                "train.learning_rate is bound but train.optimizer is a ready optimizer (written with "
                "parentheses) that brings its own learning rate, so it would be unused: bind the factory "
                "(train.optimizer = @optax.adamw, no parentheses) to use train.learning_rate, or set "
                "train.learning_rate = None")
        tx, schedule = cfg.optimizer, None
        unused = unused_schedules()
        if unused:
            metrics_lib.log(f"note: train.learning_rate = None and train.optimizer brings its own learning rate, so "
                            f"the schedule bound in the config is unused: {'; '.join(unused)}")
    elif callable(cfg.optimizer):
        lr = cfg.learning_rate
        if lr is None:
            raise ConfigError("train.learning_rate is None but train.optimizer is a factory that needs one (bind a "
                              "number or a schedule, or a ready optimizer such as @optax.adamw())")
        schedule = lr if callable(lr) else (lambda step: lr)
        tx = cfg.optimizer(learning_rate=lr)
    else:
        raise ConfigError(f"train.optimizer must be an optax optimizer, got {cfg.optimizer!r}")
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(float(clip)), tx)
    return tx, schedule


@dataclasses.dataclass
class Run:
    """The objects a run is made of (built once from gin)."""

    cfg: TrainConfig
    ecfg: "EvalConfig"
    task: Any
    model: Any
    trainer: TrainerBase
    schedule: Callable | None
    mesh: Any
    plan: Any = None  # the `planning.MemoryPlan` made by `train` (None: not planned)


def build(cfg: TrainConfig | None = None, workdir: str | None = None, say_data: bool = True,
          limits: dict | None = None) -> Run:
    """Builds task, model, optimizer and trainer from the parsed gin config.

    Args:
      workdir: the run's workdir (``train``, ``eval``, ``sample``, ``export``, ``check --workdir``): the task
        gets the tokenizer kept there (`build_task`).
      say_data: print the data-preparation line here (``train`` prints it after its own checks).
      limits: with ``ReversibleTrainer.offload = 'auto'``, the memory limits its tier is chosen against
        (``{tier: (bytes or None, source)}``; default the process's own, `revtrain.limits`).

    With ``ReversibleTrainer.offload = 'auto'`` the tier is chosen here, before anything is placed: the fastest
    whose memory plan fits (`revtrain.planning.choose_tier`, one logged line).

    Raises:
      ConfigError: invalid sizes or a batch not divisible by the device count; ``offload = 'auto'`` and no
        tier fits (`revtrain.planning.MemoryPlanError`, one line).
      byte_lm.DataError: the data source is missing or unusable.
    """
    if cfg is None:
        try:
            cfg = TrainConfig()
        except (ValueError, TypeError) as e:  # gin evaluates bound calls (schedules, optimizers) here
            raise ConfigError(ginconfig.call_error_line(e)) from e
    _check_positive(cfg)
    mesh = make_mesh()
    _divisible(cfg.batch_size, mesh, "train.batch_size")
    task = build_task(cfg, workdir)
    task.check_batch_size(cfg.batch_size)  # a split smaller than one batch: before anything is written
    try:
        model = cfg.model(seed=cfg.seed, **_model_kwargs(cfg, task))
        spec = task.input_spec(mesh.size)
        if spec is not None:  # the composition contract, on shapes only (nothing compiles)
            contract.check_shapes(model, spec, mesh)
    except ValueError as e:
        raise ConfigError(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from e
    except TypeError as e:  # a call gin made for a binding, e.g. a part written as @Name() (called without args)
        if "In call to configurable" not in str(e):
            raise
        hint = ("; a part of a composed model is written without parentheses (@Name, not @Name()): revtrain "
                "constructs it" if "required" in str(e) and "argument" in str(e) else "")
        raise ConfigError(ginconfig.call_error_line(e) + hint) from e
    spec = model.llama_spec  # an imported checkpoint under a byte-level task (ids 0 .. 255)
    if spec is not None and "vocab_size" not in task.model_kwargs() and spec.vocab_size < 256:
        raise ConfigError(f"the model has {spec.vocab_size} ids but {type(task).__name__} feeds byte values 0-255; "
                          "use a checkpoint of at least 256 ids, or the task of its tokenizer (TokenLMTask)")
    try:
        tx, schedule = build_optimizer(cfg)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"cannot build the optimizer: {ginconfig.call_error_line(e)}") from e
    m = cfg.microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"train.microbatches must be a positive integer, got {m!r}")
    if (cfg.batch_size // mesh.size) % m:
        raise ConfigError(microbatch_error(cfg.batch_size, mesh.size, m))
    trainer = cfg.trainer(model, tx, mesh, seed=cfg.seed, microbatches=m)
    if workdir:  # (the disk tier's files: <workdir>/offload by default)
        trainer.residency.attach(workdir)
    try:
        ecfg = EvalConfig()  # built here so that config.gin records the evaluate.* bindings too
    except (ValueError, TypeError) as e:
        raise ConfigError(ginconfig.call_error_line(e)) from e
    if say_data and task.data_prepared:  # said once the run is built: a configuration error stays the only line
        metrics_lib.log(task.data_status)
    run = Run(cfg, ecfg, task, model, trainer, schedule, mesh)
    if trainer.auto_tier:
        from revtrain.planning.runs import choose_tier
        metrics_lib.log(choose_tier(run, limits))
    return run


def build_task(cfg: TrainConfig, workdir: str | None = None) -> Task:
    """The run's task (``train.task``), given the run's tokenizer explicitly: the copy kept in ``workdir``
    (``tokenizer.json`` / ``tokenizer.model``, written by `train`), or the own tokenizer of the checkpoint the
    model imports (`revtrain.models.llama.checkpoint_dir`), as the task class decides
    (`revtrain.data.task.Task.tokenizer_arguments`).

    Raises:
      ConfigError: ``train.task`` is not a `Task`.
      byte_lm.DataError: the data or tokenizer is unusable, or cannot be decided without guessing.
    """
    from revtrain.models import llama
    if not (isinstance(cfg.task, type) and issubclass(cfg.task, Task)):
        raise ConfigError(f"train.task must be a task class (a subclass of revtrain.data.task.Task, e.g. "
                          f"@ByteLMTask or @TokenLMTask), got {cfg.task!r}")
    kept = tokenizer_lib.file_in(os.path.abspath(workdir)) if workdir else None
    return cfg.task(**cfg.task.tokenizer_arguments(kept, llama.checkpoint_dir(cfg.model)))


def _model_kwargs(cfg: TrainConfig, task) -> dict:
    """The task's model arguments; a ``vocab_size`` bound in gin for the model wins over the tokenizer's, and
    must hold every id of the tokenizer.

    Raises:
      ConfigError: the bound vocabulary is smaller than the tokenizer's.
    """
    kwargs = dict(task.model_kwargs())
    if "vocab_size" not in kwargs:
        return kwargs
    name = getattr(cfg.model, "__name__", None)
    try:
        bound = gin.query_parameter(f"{name}.vocab_size") if name else None
    except ValueError:  # not bound
        bound = None
    if bound is not None:
        if not isinstance(bound, int) or bound < kwargs["vocab_size"]:
            tok = task.tokenizer.describe() if task.tokenizer is not None else "the tokenizer"
            raise ConfigError(f"{name}.vocab_size = {bound!r} is smaller than the vocabulary of {tok} "
                              f"({kwargs['vocab_size']} ids, end-of-text included); leave {name}.vocab_size "
                              "unset (it follows the tokenizer) or raise it")
        del kwargs["vocab_size"]
    return kwargs


def run_signature(run: Run) -> dict:
    """What a checkpoint must agree on to be resumed: everything that changes shapes or meaning.

    Steps, learning rate, logging and the number of devices may change between runs; the model's layers
    and parameter shapes, the trainer, the optimizer state's structure, the data, the global batch and the
    seed may not.
    """
    def shapes(tree):
        return [[jax.tree_util.keystr(p), list(x.shape), str(x.dtype)]
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    template = jax.eval_shape(lambda shapes: [run.trainer.tx.init(p) for p in shapes], run.model.param_shapes())
    return {
        "trainer": run.trainer.name,
        "layers": [[layer.name, type(layer).__name__, shapes(layer.param_shapes), shapes(layer.state_shapes)]
                   for layer in run.model.layers],
        "optimizer_state": [shapes(t) for t in template],
        "data": {k: v for k, v in vars(run.task).items() if isinstance(v, (str, int, float, bool))
                 and k not in ("data_dir", "data_status", "data_prepared")},
        "batch_size": run.cfg.batch_size,
        "seed": run.cfg.seed,
    }


def same_model(run: Run, workdir: str):
    """The ``accept`` of a checkpoint reader (eval, sample, export, check, `revtrain.logits`): refuses a
    checkpoint whose saved model (layers and parameter shapes, `run_signature`) is not the one ``run`` built,
    e.g. when a ``--config`` or ``--gin`` on top of the run's ``config.gin`` changed the model, in one line
    naming the cause, instead of a restore that fails as if the checkpoint were damaged.

    Raises (when called):
      ConfigError: the models differ (exit 2).
    """
    layers = json.loads(json.dumps(run_signature(run)["layers"]))  # (as saved: tuples become lists)

    def accept(step: int, saved: dict) -> None:
        theirs = (saved.get("signature") or {}).get("layers")
        if theirs is not None and theirs != layers:
            raise ConfigError(f"the checkpoint at step {step} in {workdir} was made by a different model (layers or "
                              "parameter shapes) than the one configured now: a --config or --gin given here "
                              "changed it (the run's own config.gin is read first; give only what differs)")
    return accept
