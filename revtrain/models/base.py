"""The model container shared by every model family."""

from __future__ import annotations

import dataclasses

from revtrain.layers.base import HeadLayer, Layer


@dataclasses.dataclass
class Model:
    """An ordered list of layers whose last one is a `HeadLayer` (it computes the loss).

    Attributes:
      layers: the layers in forward order; standard and reversible layers may alternate freely.
      input_key: the key of the batch dict fed to the first layer (e.g. ``"inputs"``).
      tokens_per_example: units counted by ``tokens_per_sec`` for one example (sequence length for a
        language model, 1 for an image classifier).
      bits_per_byte: True for a byte-level language model (evaluation then reports bits per byte).

    Raises:
      ValueError: when the list is empty, the last layer is not a head, or a head appears earlier.
    """

    layers: list[Layer]
    input_key: str = "inputs"
    tokens_per_example: int = 1
    bits_per_byte: bool = False

    def __post_init__(self):
        if not self.layers or not self.layers[-1].is_head:
            raise ValueError("a model must end with a HeadLayer")
        if any(layer.is_head for layer in self.layers[:-1]):
            raise ValueError("only the last layer of a model may be a HeadLayer")

    @property
    def head(self) -> HeadLayer:
        return self.layers[-1]

    def init(self):
        """Returns ``(params, state)``: two lists with one plain-dict pytree per layer."""
        return [l.init_params for l in self.layers], [l.init_state for l in self.layers]

    def num_params(self) -> int:
        """Total number of trainable scalars."""
        import jax
        return sum(x.size for l in self.layers for x in jax.tree.leaves(l.init_params))
