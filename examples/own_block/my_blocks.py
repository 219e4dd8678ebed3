"""A block written outside revtrain: a SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve
Transformer") to use as G of the reversible couplings. See train.gin and docs/models.md.

What makes it a part (the contract, docs/models.md):
* a Flax NNX module class, made gin-configurable;
* the constructor takes ``rngs`` (only to initialise weights) and any of the values revtrain passes when
  the signature names them (here ``d_model``, ``num_layers`` and ``compute_dtype``); every other argument
  comes from gin (``my_blocks.SwiGLU.d_ff = 512``) or its default;
* ``__call__(x, *, keys, train)`` maps ``[B, T, D] -> [B, T, D]`` with ``x``'s dtype, and draws dropout
  from ``keys`` (``revtrain.layers.base.dropout``), never from a random stream of its own;
* ``PositionWise`` gives it the decoding interface (``revtrain sample``), since it acts on each
  position on its own.
"""

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from revtrain.layers.base import PositionWise, dropout


@gin.configurable
class SwiGLU(PositionWise, nnx.Module):
    """Pre-LayerNorm SwiGLU: ``down(silu(gate(h)) * up(h))`` with ``h = LayerNorm(x)``, then dropout."""

    def __init__(self, d_model: int, d_ff: int | None = None, dropout_rate: float = 0.0, *, rngs: nnx.Rngs,
                 num_layers: int = 1, compute_dtype=jnp.float32):
        # Two thirds of 4 * d_model keeps the parameter count of a GELU feed-forward of width 4 * d_model.
        d_ff = d_ff or int(8 * d_model / 3)
        self.norm = nnx.LayerNorm(d_model, dtype=compute_dtype, rngs=rngs)
        self.gate = nnx.Linear(d_model, d_ff, use_bias=False, dtype=compute_dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, dtype=compute_dtype, rngs=rngs)
        # The output projection starts small (std 0.02 / sqrt(2 * depth)): each block starts near identity.
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, dtype=compute_dtype, rngs=rngs,
                               kernel_init=nnx.initializers.normal(0.02 / (2 * num_layers) ** 0.5))
        self.dropout_rate = dropout_rate

    def __call__(self, x, *, keys, train):
        h = self.norm(x)
        h = self.down(jax.nn.silu(self.gate(h)) * self.up(h))
        return dropout(h, self.dropout_rate, keys, train).astype(x.dtype)
