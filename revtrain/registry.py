"""Registers every gin configurable revtrain offers, including optax optimizers and schedules.

Importing this module is enough: ``ReversibleTrainer``, ``StandardTrainer``, ``ReversibleTransformerLM``,
``ComposedModel`` with its specs and revtrain's parts (`revtrain.layers.parts`, `revtrain.layers.modern`,
`revtrain.layers.vision`),
``ByteLMTask``, ``train``, ``evaluate`` and ``optax.<name>`` for the names in ``OPTAX_NAMES``.
"""

import gin
import optax

from revtrain import loop  # noqa: F401  (train, evaluate)
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
