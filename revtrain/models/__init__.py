"""Model builders: each returns a `Model`, an ordered list of layers ending in a head.

`ComposedModel` (`revtrain.models.compose`) builds any model from gin-configured parts; the families
`ReversibleTransformerLM` and `RevNet` are compositions of revtrain's own parts.
"""

from revtrain.models.base import Model
from revtrain.models.compose import ComposedModel
from revtrain.models.transformer_lm import ReversibleTransformerLM

__all__ = ["ComposedModel", "Model", "ReversibleTransformerLM"]
