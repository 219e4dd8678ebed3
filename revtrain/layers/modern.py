"""Modern Transformer parts: RMSNorm, rotary positions, SwiGLU, grouped-query attention (LLaMA-style blocks).

Each class is a gin-configurable Flax NNX module that keeps the part contract of composed models: the
constructor takes ``rngs`` (an ``nnx.Rngs`` with a ``params`` stream) and context keywords (``d_model``,
``num_layers``, ``max_len``, ``vocab_size``) by name, everything else from gin or its default; the call is
``__call__(x, *, keys, train)`` and all randomness (dropout) is drawn from the per-example ``keys``
(`revtrain.layers.base.dropout`). An F or G maps ``[B, T, D] -> [B, T, D]`` (shape and dtype of its input).

* `RMSNorm` (Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019): ``x / rms(x) * scale``,
  no centring, no bias. A pre-norm inside the other parts (``norm="rms"``), or a part of its own: as a
  standard layer it normalises each residual stream of a pair (rounded to the couplings' grid with
  ``grid_bits``).
* `rotary` (RoFormer, Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding"): rotates
  each pair of query/key features by an angle proportional to the absolute position, so that the score of
  a query and a key depends on their positions only through their distance. It has no parameters; it is an
  option of the attention parts (``rotary=True``), where it acts on queries and keys only.
* `SwiGLU` feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): ``W2 (silu(W1 x) * W3 x)``.
* `GroupedQueryAttention` (Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from
  Multi-Head Checkpoints"): ``num_heads`` query heads share ``num_kv_heads`` key/value heads (``num_heads /
  num_kv_heads`` queries per group; 1 key/value head is multi-query attention, Shazeer 2019). Causal; its
  key/value cache holds ``num_kv_heads`` heads. `BidirectionalAttention` is the encoder's (non-causal)
  variant (a vision Transformer's F); it has no decoding.
* `TokenEmbedding`: token embedding without learned positions (positions come from the rotary attention),
  duplicated into the two residual streams; `RMSNormLanguageModelHead`: the two streams concatenated,
  RMSNorm, logits, softmax cross-entropy.

Sliding the cache window. With rotary positions (or none) nothing of the model is tied to absolute
positions ``0 .. T - 1``, so decoding need not stop at the trained context ``T``: the attention's cache is a
ring buffer of ``T`` slots (position ``p`` in slot ``p mod T``) and a query at position ``p`` attends to the
positions ``p - T + 1 .. p`` (keys keep the rotation of their own position, so every query-key distance is
one the model was trained on; nothing is re-encoded). A model of one attention layer then computes, at
every position, exactly a forward over the last ``T`` bytes. With two or more layers it does not: the key of
position ``p'`` in layer 2 was computed from layer 1's output at ``p'``, which saw ``p' - T + 1 .. p'``, so
the receptive field grows with depth. What sliding decoding computes is the full forward over the whole
sequence with *banded* attention (each position sees the last ``T`` positions: ``window=T``, the sliding-
window attention of Longformer, Beltagy et al. 2020, and Mistral 7B), tested to 1e-5 relative. Within the
first ``T`` positions that is the ordinary causal forward.

Compute dtype: matmuls run in ``compute_dtype`` ("float32" or "bfloat16"); norms, softmax and the rotary
angles in float32; outputs are cast back to the input's dtype.
"""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from revtrain.layers.attention import blockwise_attention
from revtrain.layers.base import PositionWise, cross_entropy_sums, dropout, snap_to_grid
from revtrain.layers.chunked import check_chunk, map_chunks, sum_chunks

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_NORMS = ("rms", "layer")


def compute_dtype_of(name, part: str):
    """The jnp dtype for ``name``: "float32" / "bfloat16", or such a dtype itself (a composed model passes
    its ``compute_dtype`` as a dtype). Raises ValueError naming ``part`` for anything else."""
    if isinstance(name, str) and name in _DTYPES:
        return _DTYPES[name]
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or isinstance(name, str) or dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"{part}.compute_dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return dtype.type


def check_positive(part: str, **values) -> None:
    """Raises ValueError (``part.name must be a positive integer``) for a value that is not an int >= 1."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{part}.{name} must be a positive integer, got {value!r}")


def check_rate(part: str, rate: float) -> None:
    """Raises ValueError unless ``0 <= rate < 1``."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{part}.dropout_rate must be in [0, 1), got {rate!r}")


def check_grid_bits(part: str, grid_bits) -> None:
    """Raises ValueError unless ``grid_bits`` is None or an integer in [1, 60]."""
    if grid_bits is not None and not (isinstance(grid_bits, int) and 1 <= grid_bits <= 60):
        raise ValueError(f"{part}.grid_bits must be an integer in [1, 60] or None, got {grid_bits!r}")


def output_init(num_layers: int):
    """Initialiser of a block's output projection: normal, std ``0.02 / sqrt(2 * num_layers)`` (GPT-2), so
    each reversible block starts near the identity."""
    return nnx.initializers.normal(0.02 / (2 * max(1, num_layers)) ** 0.5)


@gin.configurable
class RMSNorm(PositionWise, nnx.Module):
    """Root-mean-square layer normalisation (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * scale``.

    ``[..., D] -> [..., D]``, computed in float32 and returned in the input's dtype; ``scale`` is a learned
    float32 ``[D]`` vector starting at ones. Given a tuple of arrays (the two residual streams, as a standard
    layer between reversible blocks) it normalises each with the same ``scale`` and, with ``grid_bits`` set,
    rounds the result to the couplings' ``2**-grid_bits`` grid so that the next coupling stays exactly
    invertible. Raises ValueError for a non-positive ``d_model`` or ``eps``.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, eps: float = 1e-6, grid_bits: int | None = None):
        del rngs  # no random initialisation
        check_positive("RMSNorm", d_model=d_model)
        if not eps > 0:
            raise ValueError(f"RMSNorm.eps must be positive, got {eps!r}")
        check_grid_bits("RMSNorm", grid_bits)
        self.scale = nnx.Param(jnp.ones((d_model,), jnp.float32))
        self.eps = float(eps)
        self.grid_bits = grid_bits

    def normalize(self, x: jax.Array) -> jax.Array:
        """RMS-normalises one array along its last axis (no rounding)."""
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)

    def __call__(self, x, *, keys=None, train=False):
        del keys, train
        if isinstance(x, (tuple, list)):
            return tuple(snap_to_grid(self.normalize(s), self.grid_bits) for s in x)
        return snap_to_grid(self.normalize(x), self.grid_bits)


def _norm(kind: str, d_model: int, part: str, rngs: nnx.Rngs):
    if kind == "rms":
        return RMSNorm(d_model, rngs=rngs)
    if kind == "layer":
        return nnx.LayerNorm(d_model, rngs=rngs)
    raise ValueError(f"{part}.norm must be one of {list(_NORMS)}, got {kind!r}")


def rotary(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (RoFormer, Su et al. 2021) of queries or keys.

    Feature ``i`` of the first half of each head is paired with feature ``i + d/2`` (the "rotate half"
    arrangement of GPT-NeoX and LLaMA; RoFormer pairs neighbours, a fixed permutation of the same map), and
    each pair is rotated by ``position * base**(-2 i / d)`` radians. Angles, sines and cosines are float32.

    Args:
      x: ``[B, T, H, d]`` (``d`` even), any float dtype.
      positions: int32 ``[T]`` absolute positions (may be traced, may exceed any training length).
      base: the wavelength base (10,000 in RoFormer).

    Returns:
      Array like ``x``.

    Raises:
      ValueError: ``d`` is odd.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary positions need an even head width, got {d}")
    half = d // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    # The tables behind a barrier: computed by a fusion of their own in every program. Inside a stacked run's
    # `lax.scan` XLA hoists them out of the loop into fusions of their own, while a program of one block or the
    # whole model fuses them into the rotation, and XLA:CPU (JAX 0.12.1) gave the two rotations an ulp apart in
    # some elements: the two trainers then differed from the first step (docs/recipe.md, "JAX versions checked").
    cos, sin = jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class _SelfAttention(nnx.Module):
    """Pre-norm multi-head self-attention with grouped key/value heads and optional rotary positions."""

    causal = True
    _name = "GroupedQueryAttention"

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, num_layers: int = 1, num_heads: int = 4,
                 num_kv_heads: int | None = None, rotary: bool = True, rotary_base: float = 10000.0,
                 norm: str = "rms", dropout_rate: float = 0.0, compute_dtype: str = "float32",
                 attention_block: int | None = None, window: int | None = None):
        part = self._name
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive(part, d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if d_model % num_heads:
            raise ValueError(f"{part}: d_model {d_model} is not divisible by num_heads {num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{part}: num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
        head_dim = d_model // num_heads
        if rotary and head_dim % 2:
            raise ValueError(f"{part}: rotary positions need an even head width, got d_model / num_heads = "
                             f"{head_dim}")
        check_rate(part, dropout_rate)
        check_chunk(f"{part}.attention_block", attention_block)
        if window is not None:
            check_positive(part, window=window)
            if not self.causal:
                raise ValueError(f"{part}.window is for causal attention only")
            if attention_block is not None:
                raise ValueError(f"{part}: window (banded attention) runs dense; set attention_block = None")
        dtype = compute_dtype_of(compute_dtype, part)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary, self.rotary_base = bool(rotary), float(rotary_base)
        self.dropout_rate, self.attention_block, self.window = dropout_rate, attention_block, window
        self.norm = _norm(norm, d_model, part, rngs)
        # No biases (LLaMA): the key bias has an identically zero gradient (softmax is shift-invariant).
        self.query = nnx.Linear(d_model, num_heads * head_dim, use_bias=False, dtype=dtype, rngs=rngs)
        self.key_value = nnx.Linear(d_model, 2 * num_kv_heads * head_dim, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(num_heads * head_dim, d_model, use_bias=False, kernel_init=output_init(num_layers),
                              dtype=dtype, rngs=rngs)

    def _project(self, x, positions):
        """``x [B, S, D]`` -> q ``[B, S, H, d]``, k, v ``[B, S, K, d]`` (rotated when ``rotary``)."""
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.query(h).reshape(b, s, self.num_heads, self.head_dim)
        kv = self.key_value(h).reshape(b, s, 2, self.num_kv_heads, self.head_dim)
        k, v = kv[:, :, 0], kv[:, :, 1]
        if self.rotary:
            q, k = rotary(q, positions, self.rotary_base), rotary(k, positions, self.rotary_base)
        return q, k, v

    def __call__(self, x, *, keys, train):
        b, t, d = x.shape
        q, k, v = self._project(x, jnp.arange(t, dtype=jnp.int32))
        if self.attention_block is None:
            window = None if self.window is None else (self.window - 1, 0)
            h = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal, local_window_size=window)
        else:
            groups = self.num_heads // self.num_kv_heads  # query head n reads key/value head n // groups
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
            h = blockwise_attention(q, k, v, self.attention_block, causal=self.causal)
        h = self.out(h.reshape(b, t, self.num_heads * self.head_dim))
        return dropout(h, self.dropout_rate, keys, train).astype(x.dtype)


@gin.configurable
class GroupedQueryAttention(_SelfAttention):
    """F of a language-model coupling: pre-norm causal grouped-query self-attention, rotary positions, dropout.

    ``[B, T, D] -> [B, T, D]``. ``num_heads`` query heads of width ``d = D / num_heads`` share
    ``num_kv_heads`` key/value heads (None: as many as query heads, i.e. multi-head attention); query head
    ``n`` reads key/value head ``n // (num_heads / num_kv_heads)``, as ``jax.nn.dot_product_attention`` groups
    them. Projections have no bias; the output projection starts at std ``0.02 / sqrt(2 * num_layers)``.

    Args:
      d_model: D (context value).
      rngs: parameter initialisation.
      num_layers: reversible blocks in the model (context value; scales the output initialisation).
      num_heads, num_kv_heads: query and key/value heads (``num_kv_heads`` divides ``num_heads``).
      rotary: rotary positions on queries and keys (`rotary`); False: no positions at all in attention.
      rotary_base: the rotary wavelength base.
      norm: the pre-norm, "rms" (`RMSNorm`) or "layer" (LayerNorm).
      dropout_rate: dropout on the output (keys from ``keys``).
      compute_dtype: "float32" or "bfloat16" for the projections and attention products.
      attention_block: None: dense attention (``jax.nn.dot_product_attention``); an integer: exact blockwise
        attention in tiles of that many positions (`revtrain.layers.attention`), memory linear in T.
      window: None: full causal attention; an integer ``w``: banded (sliding-window) attention, each
        position sees the last ``w`` positions including its own (dense only).

    Decoding: ``init_cache(B, L)`` holds keys and values of ``num_kv_heads`` heads for ``L`` positions; with
    rotary positions (or none) the cache is a ring and decoding slides past ``L`` (module docstring).

    Raises:
      ValueError: sizes that do not divide, an odd rotary head width, a bad rate, dtype, block or window.
    """

    causal = True
    _name = "GroupedQueryAttention"

    # Decoding may go on past the cache length by sliding the window (``decode``): positions are rotary
    # or absent, never absolute. `revtrain.sample` reads this flag.
    sliding_cache = True

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Empty ring cache: ``{"k", "v"}`` zeros ``[batch_size, num_kv_heads, max_len, d]`` in the compute
        dtype (heads before positions, as the attention products read them)."""
        shape = (batch_size, self.num_kv_heads, max_len, self.head_dim)
        dtype = self.query.dtype or jnp.float32
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def _attend(self, q, keys, values, visible):
        """``q [B, K, G, S, d]`` over ``keys, values [B, K, N, d]`` with boolean ``visible [S, N]``, the
        recipe of ``jax.nn.dot_product_attention`` (logits in at least float32, scaled by ``1/sqrt(d)``,
        masked with a large negative number, softmax in float32, probabilities in the values' dtype).
        Returns ``[B, K, G, S, d]``."""
        logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
        logits = jnp.einsum("bkgqh,bknh->bkgqn", q, keys, preferred_element_type=logits_dtype)
        logits = logits * jnp.array(self.head_dim ** -0.5, logits_dtype)
        logits = jnp.where(visible, logits, -0.7 * float(jnp.finfo(logits_dtype).max))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(values.dtype)
        return jnp.einsum("bkgqn,bknh->bkgqh", probs, values)

    def decode(self, x, cache, pos):
        """Attention of ``S`` new positions ``pos .. pos + S - 1`` (``x``: ``[B, S, D]``, evaluation mode)
        over the ring cache of the earlier positions and their own, causally.

        The cache has ``L`` slots (``init_cache``'s ``max_len``, the context); position ``p`` lives in slot
        ``p mod L``. A query at position ``p`` sees the positions ``p - w + 1 .. p`` with ``w = min(window or
        L, L)``, so while ``pos + S <= L`` this is the causal forward of ``__call__``, and past ``L`` it is
        banded attention (the module docstring). One new position (``S == 1``) is written into its slot
        first and read back with the ring's mask: one step costs ``O(L)`` whatever ``pos`` is, and one
        compiled program serves every position. ``S > 1`` (encoding a prompt) attends over the cache and the
        new positions side by side, then writes the new ones (the last ``L`` of them when ``S > L``).
        Returns ``(y [B, S, D], new_cache)``.
        """
        b, s, d = x.shape
        length = cache["k"].shape[2]
        w = length if self.window is None else min(self.window, length)
        groups = self.num_heads // self.num_kv_heads
        pos = jnp.asarray(pos, jnp.int32)
        positions = pos + jnp.arange(s, dtype=jnp.int32)
        q, k, v = self._project(x, positions)
        q = q.reshape(b, s, self.num_kv_heads, groups, self.head_dim).transpose(0, 2, 3, 1, 4)  # [B,K,G,S,d]
        k, v = (jnp.swapaxes(a, 1, 2).astype(cache["k"].dtype) for a in (k, v))  # [B, K, S, d]
        slots = jnp.arange(length, dtype=jnp.int32)
        if s == 1:
            keys = jax.lax.dynamic_update_slice(cache["k"], k, (0, 0, pos % length, 0))
            values = jax.lax.dynamic_update_slice(cache["v"], v, (0, 0, pos % length, 0))
            held = pos - (pos - slots) % length  # the position each slot holds now (negative: none yet)
            visible = ((held >= 0) & (pos - held < w))[None, :]
            h = self._attend(q, keys, values, visible)
        else:
            held = pos - 1 - (pos - 1 - slots) % length  # positions held before this call
            old = (held[None, :] >= 0) & (positions[:, None] - held[None, :] < w)  # [S, L]
            new = (positions[None, :] <= positions[:, None]) & (positions[:, None] - positions[None, :] < w)
            h = self._attend(q, jnp.concatenate([cache["k"], k], axis=2), jnp.concatenate([cache["v"], v], axis=2),
                             jnp.concatenate([old, new], axis=1))
            keep = min(s, length)
            where = positions[s - keep:] % length
            keys = cache["k"].at[:, :, where].set(k[:, :, s - keep:])
            values = cache["v"].at[:, :, where].set(v[:, :, s - keep:])
        h = h.transpose(0, 3, 1, 2, 4).reshape(b, s, self.num_heads * self.head_dim)
        return self.out(h).astype(x.dtype), {"k": keys, "v": values}


@gin.configurable
class BidirectionalAttention(_SelfAttention):
    """F of an encoder coupling (e.g. a vision Transformer): pre-norm non-causal grouped-query
    self-attention, then dropout. ``[B, T, D] -> [B, T, D]``; every position attends to every position.

    Arguments as `GroupedQueryAttention` (``window`` excepted), but ``rotary`` defaults to False (a vision
    Transformer's positions are learned in its patch embedding) and ``norm`` to "layer". With
    ``attention_block`` the blockwise path visits all key tiles and masks the end padding. No incremental
    decoding (a bidirectional layer's output at a position depends on later positions).
    """

    causal = False
    _name = "BidirectionalAttention"

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, num_layers: int = 1, num_heads: int = 4,
                 num_kv_heads: int | None = None, rotary: bool = False, rotary_base: float = 10000.0,
                 norm: str = "layer", dropout_rate: float = 0.0, compute_dtype: str = "float32",
                 attention_block: int | None = None):
        super().__init__(d_model, rngs=rngs, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, rotary=rotary, rotary_base=rotary_base, norm=norm,
                         dropout_rate=dropout_rate, compute_dtype=compute_dtype, attention_block=attention_block)


def swiglu_width(d_model: int) -> int:
    """The default SwiGLU hidden width: ``8 d / 3`` (three matrices with the parameters of a ``4 d`` GELU
    feed-forward's two), rounded up to a multiple of 8."""
    return -(-(8 * d_model) // 24) * 8


@gin.configurable
class SwiGLU(PositionWise, nnx.Module):
    """G of a coupling: pre-norm SwiGLU feed-forward (Shazeer 2020), then dropout. ``[B, T, D] -> [B, T, D]``.

    ``y = W2 (silu(W1 x) * W3 x)`` on the normalised input, no biases, hidden width ``d_ff`` (default
    `swiglu_width`: about ``8 D / 3``); ``W2`` starts at std ``0.02 / sqrt(2 * num_layers)``.

    Args:
      d_model: D (context value). rngs: parameter initialisation. num_layers: context value.
      d_ff: hidden width (None: `swiglu_width`).
      norm: "rms" or "layer". dropout_rate: on the output. compute_dtype: "float32" or "bfloat16".
      chunk: compute ``chunk`` positions at a time, rematerialised in the backward
        (`revtrain.layers.chunked.map_chunks`); None: all at once. Dropout masks do not depend on it.

    Raises:
      ValueError: non-positive sizes, a bad norm, rate, dtype or chunk.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, num_layers: int = 1, d_ff: int | None = None,
                 norm: str = "rms", dropout_rate: float = 0.0, compute_dtype: str = "float32",
                 chunk: int | None = None):
        d_ff = swiglu_width(d_model) if d_ff is None else d_ff
        check_positive("SwiGLU", d_model=d_model, d_ff=d_ff)
        check_rate("SwiGLU", dropout_rate)
        check_chunk("SwiGLU.chunk", chunk)
        dtype = compute_dtype_of(compute_dtype, "SwiGLU")
        self.norm = _norm(norm, d_model, "SwiGLU", rngs)
        self.gate = nnx.Linear(d_model, d_ff, use_bias=False, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, kernel_init=output_init(num_layers), dtype=dtype,
                               rngs=rngs)
        self.dropout_rate, self.chunk = dropout_rate, chunk

    def _mlp(self, x):
        h = self.norm(x)
        return self.down(jax.nn.silu(self.gate(h)) * self.up(h))

    def __call__(self, x, *, keys, train):
        h = map_chunks(self._mlp, x, self.chunk)
        return dropout(h, self.dropout_rate, keys, train).astype(x.dtype)


@gin.configurable
class TokenEmbedding(PositionWise, nnx.Module):
    """Token embedding without positions (for rotary attention), duplicated into the two residual streams.

    Input: int32 ``[B, T]`` ids in ``[0, vocab_size)``. Output: a pair of float32 ``[B, T, D]`` (unit-scale
    embeddings, dropout, then rounded to the couplings' ``2**-grid_bits`` grid; ``grid_bits`` None: not
    rounded). Position-free, so it decodes at any position and does not limit the length.

    Raises:
      ValueError: non-positive sizes, a bad rate or ``grid_bits``.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, vocab_size: int = 256, dropout_rate: float = 0.0,
                 grid_bits: int | None = 18):
        check_positive("TokenEmbedding", d_model=d_model, vocab_size=vocab_size)
        check_rate("TokenEmbedding", dropout_rate)
        check_grid_bits("TokenEmbedding", grid_bits)
        self.tokens = nnx.Embed(vocab_size, d_model, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.dropout_rate, self.grid_bits = dropout_rate, grid_bits

    def __call__(self, x, *, keys, train):
        h = snap_to_grid(dropout(self.tokens(x), self.dropout_rate, keys, train), self.grid_bits)
        return (h, jnp.copy(h))  # two arrays: see ByteEmbedding


@gin.configurable
class RMSNormLanguageModelHead(PositionWise, nnx.Module):
    """The two streams concatenated, RMSNorm, logits over the vocabulary, softmax cross-entropy.

    Input: a pair of float32 ``[B, T, D]``; ``__call__`` returns float32 logits ``[B, T, vocab_size]``;
    ``loss(x, batch)`` the sum of weighted token losses in nats and the stats sums (``batch['targets']``
    int32 ``[B, T]``, optional ``batch['weights']``). ``chunk``: logits and loss ``chunk`` positions at a
    time (`revtrain.layers.chunked.sum_chunks`), so ``[B, T, vocab_size]`` never exists whole.

    ``tie_embedding``: the output projection is the input embedding itself (weight tying, Press and Wolf
    2017; Inan et al. 2017), the ``[vocab_size, d_model]`` table of the model's first layer (a
    `TokenEmbedding` or any module with an ``nnx.Embed`` named ``tokens``): logits are ``(h1 + h2) @ E.T /
    sqrt(2 D) + bias`` for the normalised streams ``h1, h2``. The model holds ``E`` once (`revtrain.models.Tie`); both
    uses add to its gradient.

    Raises:
      ValueError: non-positive sizes, a bad chunk, or ``tie_embedding`` without a first layer that has
        ``tokens`` of the same size.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, vocab_size: int = 256, chunk: int | None = None,
                 tie_embedding: bool = False, embedding: nnx.Module | None = None):
        check_positive("RMSNormLanguageModelHead", d_model=d_model, vocab_size=vocab_size)
        check_chunk("RMSNormLanguageModelHead.chunk", chunk)
        if not isinstance(tie_embedding, bool):
            raise ValueError(f"RMSNormLanguageModelHead.tie_embedding must be True or False, got {tie_embedding!r}")
        self.norm = RMSNorm(2 * d_model, rngs=rngs)
        self.chunk = chunk
        if tie_embedding:
            table = getattr(getattr(embedding, "tokens", None), "embedding", None)
            if not isinstance(table, nnx.Param) or table.value.shape != (vocab_size, d_model):
                raise ValueError("RMSNormLanguageModelHead.tie_embedding needs a first layer with a token embedding "
                                 f"'tokens' of [{vocab_size}, {d_model}] (TokenEmbedding)")
            self.embedding = table  # the same nnx.Param: one parameter of the model (compose.find_ties)
            self.bias = nnx.Param(jnp.zeros((vocab_size,), jnp.float32))
            self.logits = None
        else:
            self.logits = nnx.Linear(2 * d_model, vocab_size, rngs=rngs)

    def __call__(self, x, *, keys, train):
        h = self.norm(jnp.concatenate(x, axis=-1))
        if self.logits is None:
            d = h.shape[-1] // 2
            # Scaled by (2 D)**-0.5, as T5 scales its tied projection. The streams carry the input's own
            # unit-scale embedding, so the current byte starts with a logit of about sqrt(2 D) (first loss
            # 15 nats at D = 128); 1 / (2 D) starts at ln(vocab) but learned slower (docs/recipe.md).
            scaled = (h[..., :d] + h[..., d:]) * (2 * d) ** -0.5
            return (scaled @ self.embedding.value.T + self.bias.value).astype(jnp.float32)
        return self.logits(h).astype(jnp.float32)

    def loss(self, x, batch, *, keys, train):
        targets = batch["targets"]
        weights = batch.get("weights")
        if weights is None:
            weights = jnp.ones(targets.shape, jnp.float32)
        if self.chunk is None:
            return cross_entropy_sums(self(x, keys=keys, train=train), {"targets": targets, "weights": weights})

        def chunk_sums(part):
            x1, x2, t, w = part
            return cross_entropy_sums(self((x1, x2), keys=keys, train=train), {"targets": t, "weights": w})

        return sum_chunks(chunk_sums, (x[0], x[1], targets, weights), self.chunk)

