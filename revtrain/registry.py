"""Registers every gin configurable revtrain offers, including optax optimizers and schedules.

Importing this module is enough: ``ReversibleTrainer``, ``StandardTrainer``, ``ReversibleTransformerLM``,
``ComposedModel`` with its specs and revtrain's parts (`revtrain.layers.parts`, `revtrain.layers.modern`,
`revtrain.layers.vision`),
``ByteLMTask``, ``train``, ``evaluate`` and ``optax.<name>`` for the names in ``OPTAX_NAMES``. `parse_gin` parses
config files and bindings against them (the CLI's and `revtrain.logits`' one parse, errors as one line).
"""

import difflib
import inspect
import re

import gin
import optax

from revtrain import ginconfig
from revtrain.errors import UsageError
from revtrain import run  # noqa: F401  (train, evaluate)
from revtrain.data import fashion_mnist  # noqa: F401  (FashionMNISTTask)
from revtrain import optim  # noqa: F401  (decay_mask, optax.inject_hyperparams)
from revtrain.data import tasks  # noqa: F401
from revtrain.layers import parts  # noqa: F401  (ByteEmbedding, CausalSelfAttention, ... as parts)
from revtrain.layers import modern, vision  # noqa: F401  (RMSNorm, GroupedQueryAttention, SwiGLU, ... RevViT parts)
from revtrain.models import compose  # noqa: F401  (ComposedModel, Standard, Coupling, Repeat, Head)
from revtrain.models import llama  # noqa: F401  (LlamaModel)
from revtrain.models import revnet  # noqa: F401  (RevNet)
from revtrain.models import transformer_lm  # noqa: F401
from revtrain.trainers import reversible, standard  # noqa: F401

OPTAX_NAMES = (
    # optimizers
    "adam", "adamw", "adafactor", "adagrad", "adabelief", "lamb", "lion", "nadam", "nadamw", "rmsprop", "sgd",
    "sm3", "yogi",
    # schedules
    "constant_schedule", "cosine_decay_schedule", "exponential_decay", "join_schedules", "linear_schedule",
    "piecewise_constant_schedule", "polynomial_schedule", "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    # transformations (chain them with optax.chain)
    "clip", "clip_by_block_rms", "clip_by_global_norm", "adaptive_grad_clip", "add_decayed_weights",
    "scale_by_adam",
)

for _name in OPTAX_NAMES:
    if hasattr(optax, _name):
        gin.external_configurable(getattr(optax, _name), name=_name, module="optax")


@gin.configurable("chain", module="optax")
def chain(transforms=()):
    """``optax.chain(*transforms)`` for gin, which cannot bind ``*args``: ``optax.chain.transforms = [...]``."""
    return optax.chain(*transforms)


def parse_gin(configs: list[str], bindings: list[str], workdir: str | None = None) -> None:
    """Parses config files (and their includes, see `ginconfig.include_search_path`), then bindings; with
    ``workdir``, the Python modules its run imported are looked up where the run found them first, and a run
    that imported a checkpoint rebuilds its model from the architecture kept in the workdir
    (`revtrain.models.llama.workdir_bindings`, before ``bindings``, which win).

    Raises:
      UsageError: a missing file or include, or a bad binding or value (one line).
    """
    gin.clear_config()  # a fresh configuration per command (main() may run several times in one process)
    if workdir:
        from revtrain.models import llama
        bindings = llama.workdir_bindings(workdir) + list(bindings)
    try:
        remembered = ginconfig.remembered_modules(workdir) if workdir else None
        with ginconfig.include_search_path(remembered):
            gin.parse_config_files_and_bindings([ginconfig.find_config(c) for c in configs], bindings,
                                                finalize_config=False)
    except ginconfig.IncludeNotFound as e:
        raise UsageError(str(e).strip().splitlines()[0]) from e
    except (ValueError, SyntaxError, TypeError, KeyError, NameError) as e:
        raise UsageError(_gin_error_line(e)) from e


def _gin_names() -> list[str]:
    """Every configurable's short name and ``name.parameter`` (for 'did you mean' suggestions)."""
    names = []
    for selector, configurable in gin.config._REGISTRY.items():  # noqa: SLF001 (gin has no public listing)
        names.append(configurable.name)
        if isinstance(selector, str) and selector != configurable.name:
            names.append(selector)  # module.Name
        try:
            wrapped = configurable.wrapped  # a class: its __init__ (NNX modules' own signature is *args)
            params = inspect.signature(wrapped.__init__ if isinstance(wrapped, type) else wrapped).parameters
        except (TypeError, ValueError):
            continue
        for prefix in {configurable.name, selector if isinstance(selector, str) else configurable.name}:
            names.extend(f"{prefix}.{p}" for p in params if p not in ("self", "args", "kwargs"))
    return names


def _gin_error_line(e: Exception) -> str:
    """One line for a gin parse error, with the nearest configurable name when gin found none."""
    line = ginconfig.value_error_line(e) if isinstance(e, SyntaxError) else None
    if line:
        return line
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    m = re.search(r"No configurable matching (?:reference )?'@?([^']+)'", msg) or re.search(
        r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", msg)
    if m:
        wanted = m.group(1) if m.lastindex == 1 else f"{m.group(1)}.{m.group(2)}"
        close = difflib.get_close_matches(wanted, _gin_names(), n=1, cutoff=0.6)
        if close:
            msg += f" (did you mean '{close[0]}'?)"
    return f"bad gin configuration: {msg}"
