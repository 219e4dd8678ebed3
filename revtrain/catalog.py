"""The configs shipped with revtrain, one line each: ``revtrain configs``.

A line names the config as ``--config`` and ``include`` take it (`revtrain.ginconfig.shipped_configs`), its
model (``train.model`` and its layer count), its parameter count and what it is for (the file's ``# For:``
line). The count is the model's own (`revtrain.models.base.Model.num_params`, from parameter shapes only):
the model is built as ``revtrain train`` builds it, with the arguments its task gives
(`revtrain.data.task.Task.config_model_kwargs`, from the gin bindings alone), so nothing is allocated,
compiled or read from data. A count that only the data can decide (a tokenizer file's vocabulary) is ``?``.
"""

from __future__ import annotations

import dataclasses
import re

PURPOSE = re.compile(r"^#\s*For:\s*(.+?)\s*$")


@dataclasses.dataclass
class ConfigEntry:
    """One shipped config: ``name`` (as ``--config`` takes it), ``path``, ``model`` (``'ComposedModel (8
    layers)'``), ``parameters`` (trainable scalars; None: only the data decides) and ``purpose``."""

    name: str
    path: str
    model: str
    parameters: int | None
    purpose: str

    def line(self, name_width: int = 0, model_width: int = 0) -> str:
        """``NAME  MODEL  N parameters  PURPOSE``, the first two padded to the given widths."""
        count = "?" if self.parameters is None else f"{self.parameters:,}"
        return (f"{self.name:<{name_width}}  {self.model:<{model_width}}  {count:>13} parameters  "
                f"{self.purpose}").rstrip()


def purpose(path: str) -> str:
    """What a config is for: its ``# For: ...`` comment line, else the first line of its leading comment."""
    first = ""
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            m = PURPOSE.match(line)
            if m:
                return m.group(1)
            first = first or line.lstrip("#").strip()
    return first


def describe(name: str, path: str) -> ConfigEntry:
    """The `ConfigEntry` of one config file (parsed alone, as ``revtrain train --config path`` parses it).

    Raises:
      UsageError: the file cannot be parsed; ConfigError: its ``train`` bindings cannot be evaluated.
    """
    import gin

    from revtrain import ginconfig, registry, run
    registry.parse_gin([path], [])
    try:
        try:
            cfg = run.TrainConfig()
        except (ValueError, TypeError) as e:
            raise run.ConfigError(ginconfig.call_error_line(e)) from e
        kwargs = cfg.task.config_model_kwargs() if isinstance(cfg.task, type) else None
        model_name = getattr(cfg.model, "__name__", type(cfg.model).__name__)
        if kwargs is None:
            return ConfigEntry(name, path, model_name, None, purpose(path))
        kwargs = dict(kwargs)
        if "vocab_size" in kwargs:  # a vocabulary bound for the model wins (as `revtrain.run.build` decides)
            try:
                if gin.query_parameter(f"{model_name}.vocab_size") is not None:
                    del kwargs["vocab_size"]
            except ValueError:
                pass
        model = cfg.model(seed=cfg.seed, **kwargs)
        return ConfigEntry(name, path, f"{model_name} ({len(model.layers)} layers)", int(model.num_params()),
                           purpose(path))
    finally:
        gin.clear_config()


def entries() -> list[ConfigEntry]:
    """The `ConfigEntry` of every shipped config, in name order.

    Raises:
      UsageError, ConfigError: a shipped config that cannot be parsed or built (named in the line).
    """
    from revtrain import ginconfig
    from revtrain.errors import InputError
    shipped = ginconfig.shipped_configs()
    out = {}
    # The examples last: their own modules (`import my_blocks`) stay registered with gin once imported, and a
    # configurable of the same short name (SwiGLU) would then be ambiguous in a config described after them.
    for name in sorted(shipped, key=lambda n: ("/" in n, n)):
        try:
            out[name] = describe(name, shipped[name])
        except InputError as e:  # the same error, its line naming the config
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise type(e)(f"shipped config {name}: {first}") from e
    return [out[name] for name in shipped]


def lines() -> list[str]:
    """One line per shipped config (`ConfigEntry.line`), columns aligned."""
    found = entries()
    name_width = max((len(e.name) for e in found), default=0)
    model_width = max((len(e.model) for e in found), default=0)
    return [e.line(name_width, model_width) for e in found]
