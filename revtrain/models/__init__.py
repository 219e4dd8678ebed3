"""Model builders: each returns a `Model`, an ordered list of layers ending in a head."""

from revtrain.models.base import Model
from revtrain.models.transformer_lm import ReversibleTransformerLM

__all__ = ["Model", "ReversibleTransformerLM"]
