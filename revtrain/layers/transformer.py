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

Incremental decoding (``init_cache`` / ``decode``, the layer protocol's optional interface used by
`revtrain.sample`): the embedding reads the position embedding at the given positions, the attention keeps
a key/value cache ``[B, max_len, heads, D / heads]`` per layer, and the feed-forward and the head act on
each position on their own. Each runs the same LayerNorms and projections as ``__call__``, so cached
next-byte logits equal a full forward's (tested to 1e-5 relative in float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from revtrain.layers.attention import blockwise_causal_attention
from revtrain.layers.base import (PositionWise, ReversibleCoupling, cross_entropy_sums, dropout,  # noqa: F401 (ReversibleCoupling re-exported)
                                  snap_to_grid)
from revtrain.layers.chunked import check_chunk, map_chunks, sum_chunks


def depth_scaled_init(num_layers: int | None):
    """Initialiser of the output projections of F and G: normal with std ``0.02 / sqrt(2 * num_layers)``
    (GPT-2, Radford et al. 2019, section 2.3), so each of ``num_layers`` blocks starts near the identity,
    which keeps deep stacks stable and the inverse well conditioned; std 0.02 when ``num_layers`` is None."""
    return nnx.initializers.normal(0.02 / (2 * num_layers) ** 0.5 if num_layers else 0.02)


class ByteEmbedding(nnx.Module):
    """Token + learned position embedding, duplicated into the two residual streams.

    Input: int32 ``[B, T]`` token ids in ``[0, vocab_size)``. Output: a pair of float32 ``[B, T, D]``, on
    the ``2**-grid_bits`` grid of the reversible couplings (``grid_bits=None``: not rounded).
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int, dropout_rate: float = 0.0, *,
                 rngs: nnx.Rngs, grid_bits: int | None = None):
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

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """No cache (the embedding of a position depends only on its token): ``{}``."""
        del batch_size, max_len
        return {}

    def decode(self, x, cache, pos):
        """Embeds int32 tokens ``[B, S]`` standing at positions ``pos .. pos + S - 1`` (evaluation mode, as
        ``__call__`` with ``train=False`` at those positions). Returns ``((h, h), cache)``."""
        positions = jax.lax.dynamic_slice_in_dim(self.positions[...], pos, x.shape[1], axis=0)
        h = snap_to_grid(self.tokens(x) + positions[None], self.grid_bits)
        return (h, jnp.copy(h)), cache


class CausalSelfAttention(nnx.Module):
    """F of the coupling: pre-LayerNorm causal multi-head self-attention, then dropout.

    ``[B, T, D] -> [B, T, D]``. ``attention_block`` None: dense attention (``jax.nn.dot_product_attention``,
    ``[B, H, T, T]`` scores); an integer: exact blockwise attention in tiles of that many positions, memory
    linear in T (``revtrain.layers.attention.blockwise_causal_attention``). ``out_init``: the output
    projection's initialiser (default `depth_scaled_init` of ``num_layers``, the model's number of blocks).
    Raises ValueError at construction when D is not divisible by the heads or ``attention_block`` is not a
    positive integer or None.
    """

    # What lowers its memory, for the out-of-memory advice of a model composed of it (`Model.memory_knobs`).
    memory_knob = "attention blocking (CausalSelfAttention.attention_block)"

    def __init__(self, d_model: int, num_heads: int = 4, dropout_rate: float = 0.0, compute_dtype=jnp.float32,
                 out_init=None, *, rngs: nnx.Rngs, attention_block: int | None = None,
                 num_layers: int | None = None):
        check_chunk("CausalSelfAttention.attention_block", attention_block)
        out_init = out_init or depth_scaled_init(num_layers)
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

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Empty key/value cache: ``{"k", "v"}`` zeros ``[batch_size, heads, max_len, D / heads]`` in the
        compute dtype (heads before positions: the layout the two attention products read without a
        transpose, which would copy the whole cache at every byte)."""
        d = self.qkv.in_features
        shape = (batch_size, self.num_heads, max_len, d // self.num_heads)
        dtype = self.qkv.dtype or jnp.float32
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def decode(self, x, cache, pos):
        """Attention of ``S`` new positions ``pos .. pos + S - 1`` (``x``: ``[B, S, D]``) over the cached keys
        and values of positions ``0 .. pos - 1`` and their own (causally), in evaluation mode.

        The new keys and values are written into the cache at ``pos`` (``pos + S <= max_len``). Each query
        attends over all ``max_len`` cache slots with a mask that keeps positions ``<= its own``, so one
        step costs ``O(max_len)`` per layer whatever ``pos`` is, and one compiled program serves every
        position. The attention is ``jax.nn.dot_product_attention``'s own recipe (logits in at least
        float32, scaled by ``1/sqrt(D / heads)``, masked with a large negative number, softmax in float32,
        probabilities cast to the values' dtype), written for the cache's heads-first layout.
        Returns ``(y [B, S, D], new_cache)``.
        """
        b, s, d = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, s, 3, self.num_heads, d // self.num_heads)
        q, k, v = (jnp.swapaxes(qkv[:, :, i], 1, 2) for i in range(3))  # [B, heads, S, D / heads]
        keys = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, 0, pos, 0))
        values = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, 0, pos, 0))
        logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
        logits = jnp.einsum("bnqh,bnkh->bnqk", q, keys, preferred_element_type=logits_dtype)
        logits = logits * jnp.array((d // self.num_heads) ** -0.5, logits_dtype)
        visible = jnp.arange(keys.shape[2])[None, :] <= (pos + jnp.arange(s))[:, None]  # [S, max_len]
        logits = jnp.where(visible, logits, -0.7 * float(jnp.finfo(logits_dtype).max))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(keys.dtype)
        h = jnp.swapaxes(jnp.einsum("bnqk,bnkh->bnqh", probs, values), 1, 2).reshape(b, s, d)
        return self.out(h).astype(x.dtype), {"k": keys, "v": values}


class FeedForward(PositionWise, nnx.Module):
    """G of the coupling: pre-LayerNorm, Dense(d_ff), GELU, Dense(D), dropout. ``[B, T, D] -> [B, T, D]``.

    ``chunk``: compute the position-wise part ``chunk`` positions at a time, rematerialised in the backward
    (``revtrain.layers.chunked.map_chunks``), so ``[B, T, d_ff]`` never exists whole; None: all at once.
    Dropout is drawn for the whole ``[B, T, D]`` output, so its masks do not depend on ``chunk``.
    ``d_ff`` defaults to ``4 * d_model``; ``out_init`` to `depth_scaled_init` of ``num_layers``.
    """

    def __init__(self, d_model: int, d_ff: int | None = None, dropout_rate: float = 0.0, compute_dtype=jnp.float32,
                 out_init=None, *, rngs: nnx.Rngs, chunk: int | None = None, num_layers: int | None = None):
        check_chunk("FeedForward.chunk", chunk)
        d_ff = d_ff or 4 * d_model
        out_init = out_init or depth_scaled_init(num_layers)
        self.norm = nnx.LayerNorm(d_model, dtype=compute_dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, dtype=compute_dtype, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, kernel_init=out_init, dtype=compute_dtype, rngs=rngs)
        self.dropout_rate = dropout_rate
        self.chunk = chunk

    def __call__(self, x, *, keys, train):
        h = map_chunks(lambda x: self.down(jax.nn.gelu(self.up(self.norm(x)))), x, self.chunk)
        return dropout(h, self.dropout_rate, keys, train).astype(x.dtype)


class LanguageModelHead(PositionWise, nnx.Module):
    """Merges the two streams (concatenation), LayerNorm, logits over the vocabulary, softmax cross-entropy.

    Input: pair of float32 ``[B, T, D]``. ``batch['targets']``: int32 ``[B, T]``; optional
    ``batch['weights']``: float32 ``[B, T]`` (0 for padding). ``__call__`` returns float32 logits
    ``[B, T, vocab_size]``; ``loss`` returns (sum of weighted token losses in nats, stats sums).

    ``chunk``: ``loss`` computes logits and cross-entropy ``chunk`` positions at a time, rematerialised in
    the backward (``revtrain.layers.chunked.sum_chunks``), so ``[B, T, vocab_size]`` logits and their
    gradient never exist whole; None: all at once.
    """

    def __init__(self, d_model: int, vocab_size: int = 256, *, rngs: nnx.Rngs, chunk: int | None = None):
        check_chunk("LanguageModelHead.chunk", chunk)
        # Two-pass variance (mean of squared deviations): with the one-pass E[x^2] - E[x]^2 a whole-model
        # jvp(grad) (Sophia's H z) recomputes this norm's input-cotangent tangent inside the top block's
        # transposing copy, rounded otherwise (fused multiply-adds) than the head's own program, so the
        # layer-by-layer H z of the top block's G.down kernel missed it by an ulp (issue 60,
        # scripts/probe_hvp_exactness.py). Same function; the normalised values move by ulps (measured: 26% of
        # them, at most 7e-7 absolute, slightly nearer the float64 result).
        self.norm = nnx.LayerNorm(2 * d_model, use_fast_variance=False, rngs=rngs)
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
