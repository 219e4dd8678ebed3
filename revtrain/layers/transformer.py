"""Layers of the reversible Transformer language model (Reformer style).

Kitaev, Kaiser, Levskaya, "Reformer: The Efficient Transformer", ICLR 2020, section 3: a reversible
residual block (Gomez et al. 2017, "The Reversible Residual Network") with F = attention and G = feed-forward:

    y1 = x1 + F(x2)        x2 = y2 - G(y1)
    y2 = x2 + G(y1)        x1 = y1 - F(x2)

Shapes: B = batch, T = sequence length, D = ``d_model``. Residual streams are float32 ``[B, T, D]``;
F and G may compute in ``compute_dtype`` (e.g. bfloat16) and are cast back to the stream dtype before the
additions, so reconstruction stays in float32.

Exact reconstruction: the embedding output and every F / G output are rounded to multiples of
``2**-grid_bits`` (``snap_to_grid``) before they enter the streams, so each coupling addition is exact in
float32 and the inverse rebuilds the inputs bit for bit (while the streams stay below
``2**(24 - grid_bits)`` in magnitude). The rebuild then adds no error at all, and the reversible trainer
follows ordinary backprop as closely as two compilations of the same model can.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from revtrain.layers.attention import blockwise_causal_attention
from revtrain.layers.base import ReversibleCoupling, cross_entropy_sums, dropout, snap_to_grid  # noqa: F401 (ReversibleCoupling re-exported)
from revtrain.layers.chunked import map_chunks, sum_chunks


class ByteEmbedding(nnx.Module):
    """Token + learned position embedding, duplicated into the two residual streams.

    Input: int32 ``[B, T]`` token ids in ``[0, vocab_size)``. Output: a pair of float32 ``[B, T, D]``, on
    the ``2**-grid_bits`` grid of the reversible couplings (``grid_bits=None``: not rounded).
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int, dropout_rate: float, *, rngs: nnx.Rngs,
                 grid_bits: int | None = None):
        # Unit-scale token embeddings keep the residual streams O(1): the couplings' 2**-grid_bits grid is
        # then ~1e-6 of the streams' scale, and F and G outputs (~0.03 at initialisation) are small next to
        # the streams, so even a plain float rebuild loses little to cancellation. (Measured: 0.02-scale
        # embeddings train no faster here, and their rebuild is ~10x less exact.)
        self.tokens = nnx.Embed(vocab_size, d_model, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.positions = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (max_len, d_model), jnp.float32))
        self.dropout_rate = dropout_rate
        self.grid_bits = grid_bits

    def __call__(self, x, *, keys, train):
        length = x.shape[1]
        if length > self.positions.shape[0]:
            raise ValueError(f"sequence length {length} exceeds the model's max_len {self.positions.shape[0]}")
        h = self.tokens(x) + self.positions[...][None, :length]
        h = snap_to_grid(dropout(h, self.dropout_rate, keys, train), self.grid_bits)
        # Two distinct arrays, not one used twice: the gradient of ``h`` is then ``d1 + (dF + dy2)`` in a
        # whole-model ``grad`` exactly as in the layer-by-layer backward (the second stream's two uses are
        # summed first), instead of the three terms being summed in another order.
        return (h, jnp.copy(h))


class CausalSelfAttention(nnx.Module):
    """F of the coupling: pre-LayerNorm causal multi-head self-attention, then dropout.

    ``[B, T, D] -> [B, T, D]``. ``attention_block`` None: dense attention (``jax.nn.dot_product_attention``,
    ``[B, H, T, T]`` scores); an integer: exact blockwise attention in tiles of that many positions, memory
    linear in T (``revtrain.layers.attention.blockwise_causal_attention``). Raises ValueError at
    construction when D is not divisible by the heads.
    """

    def __init__(self, d_model: int, num_heads: int, dropout_rate: float, compute_dtype, out_init, *,
                 rngs: nnx.Rngs, attention_block: int | None = None):
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.norm = nnx.LayerNorm(d_model, dtype=compute_dtype, rngs=rngs)
        # No q/k/v bias: the key bias has an identically zero gradient (softmax is shift-invariant), so
        # Adam would only amplify rounding noise into it.
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=compute_dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, kernel_init=out_init, dtype=compute_dtype, rngs=rngs)
        self.dropout_rate = dropout_rate
        self.attention_block = attention_block

    def __call__(self, x, *, keys, train):
        b, t, d = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, t, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.attention_block is None:
            h = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            h = blockwise_causal_attention(q, k, v, self.attention_block)
        h = h.reshape(b, t, d)
        return dropout(self.out(h), self.dropout_rate, keys, train).astype(x.dtype)


class FeedForward(nnx.Module):
    """G of the coupling: pre-LayerNorm, Dense(d_ff), GELU, Dense(D), dropout. ``[B, T, D] -> [B, T, D]``.

    ``chunk``: compute the position-wise part ``chunk`` positions at a time, rematerialised in the backward
    (``revtrain.layers.chunked.map_chunks``), so ``[B, T, d_ff]`` never exists whole; None: all at once.
    Dropout is drawn for the whole ``[B, T, D]`` output, so its masks do not depend on ``chunk``.
    """

    def __init__(self, d_model: int, d_ff: int, dropout_rate: float, compute_dtype, out_init, *, rngs: nnx.Rngs,
                 chunk: int | None = None):
        self.norm = nnx.LayerNorm(d_model, dtype=compute_dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, dtype=compute_dtype, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, kernel_init=out_init, dtype=compute_dtype, rngs=rngs)
        self.dropout_rate = dropout_rate
        self.chunk = chunk

    def __call__(self, x, *, keys, train):
        h = map_chunks(lambda x: self.down(jax.nn.gelu(self.up(self.norm(x)))), x, self.chunk)
        return dropout(h, self.dropout_rate, keys, train).astype(x.dtype)


class LanguageModelHead(nnx.Module):
    """Merges the two streams (concatenation), LayerNorm, logits over the vocabulary, softmax cross-entropy.

    Input: pair of float32 ``[B, T, D]``. ``batch['targets']``: int32 ``[B, T]``; optional
    ``batch['weights']``: float32 ``[B, T]`` (0 for padding). ``__call__`` returns float32 logits
    ``[B, T, vocab_size]``; ``loss`` returns (sum of weighted token losses in nats, stats sums).

    ``chunk``: ``loss`` computes logits and cross-entropy ``chunk`` positions at a time, rematerialised in
    the backward (``revtrain.layers.chunked.sum_chunks``), so ``[B, T, vocab_size]`` logits and their
    gradient never exist whole; None: all at once.
    """

    def __init__(self, d_model: int, vocab_size: int, *, rngs: nnx.Rngs, chunk: int | None = None):
        self.norm = nnx.LayerNorm(2 * d_model, rngs=rngs)
        self.logits = nnx.Linear(2 * d_model, vocab_size, rngs=rngs)
        self.chunk = chunk

    def __call__(self, x, *, keys, train):
        return self.logits(self.norm(jnp.concatenate(x, axis=-1))).astype(jnp.float32)

    def loss(self, x, batch, *, keys, train):
        if self.chunk is None:
            return cross_entropy_sums(self(x, keys=keys, train=train), batch)
        targets = batch["targets"]
        weights = batch.get("weights")
        if weights is None:
            weights = jnp.ones(targets.shape, jnp.float32)

        def chunk_sums(part):  # padded positions have weight 0
            x1, x2, targets, weights = part
            logits = self((x1, x2), keys=keys, train=train)
            return cross_entropy_sums(logits, {"targets": targets, "weights": weights})

        return sum_chunks(chunk_sums, (x[0], x[1], targets, weights), self.chunk)
