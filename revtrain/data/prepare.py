"""Preparing a run's data before it trains: ``revtrain prepare --config FILE`` (`prepare_config`), which
``make data`` and ``scripts/prepare_data.py`` run too.

The data of a config is its ``train.task`` built as ``revtrain train`` builds it (`revtrain.run.build_task`):
for the byte task the corpus cut into sequences, for the token task the corpus tokenized (its BPE trained
first when it is not cached). The default source (``gensim_enwiki``) is read from the gensim 4.4.0 wheel,
fetched into ``<data_dir>/downloads/`` with pip when missing (`revtrain.data.corpus.ensure_gensim_wheel`).
What it did is one line (`Task.data_status`): the data prepared (how much, how long) or found in the cache.
``revtrain train``, ``eval`` and ``sample`` prepare missing data themselves (`revtrain.data.corpus.fetching`).
"""

from __future__ import annotations

import inspect

from revtrain.data import corpus


def task_argument(task_class, name: str, default=None):
    """The value ``task_class`` will be constructed with for ``name`` under the parsed gin config: its gin
    binding, else the constructor's default, else ``default``."""
    import gin
    try:
        return gin.query_parameter(f"{task_class.__name__}.{name}")
    except ValueError:
        pass
    try:
        value = inspect.signature(task_class.__init__).parameters[name].default
    except (KeyError, TypeError, ValueError):
        return default
    return default if value is inspect.Parameter.empty else value


def prepare_config(configs: list[str], bindings: list[str], data_dir: str | None = None) -> str | None:
    """Prepares the data of the run that ``configs`` and ``bindings`` describe; returns the task's one line
    (`Task.data_status`; None for a task that says nothing).

    Args:
      configs: gin files (found as ``revtrain train --config`` finds them; later ones win).
      bindings: gin bindings ``'NAME = VALUE'`` (win over the files).
      data_dir: the cache root to prepare into (default: the task's ``data_dir``, else
        ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``).

    Raises:
      UsageError: a config file that cannot be found or parsed.
      ConfigError: a configuration that cannot run (``train.task`` not a task, a bad bound call).
      DataError: the data cannot be prepared (a missing source, a failed download: one line).
    """
    import gin

    from revtrain import registry, run
    registry.parse_gin(configs, bindings)
    try:
        cfg = run.TrainConfig()
    except (ValueError, TypeError) as e:
        from revtrain import ginconfig
        raise run.ConfigError(ginconfig.call_error_line(e)) from e
    if isinstance(cfg.task, type) and task_argument(cfg.task, "source") == corpus.GENSIM_SOURCE:
        corpus.ensure_gensim_wheel(data_dir or task_argument(cfg.task, "data_dir") or corpus.default_data_dir())
    if data_dir and isinstance(cfg.task, type):
        gin.bind_parameter(f"{cfg.task.__name__}.data_dir", data_dir)
    with corpus.fetching():
        task = run.build_task(cfg)
    return task.data_status
