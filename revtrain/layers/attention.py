"""Exact (causal or bidirectional) self-attention in blocks: memory linear in the sequence length.

Dense attention holds ``[B, H, T, T]`` scores and probabilities (and, under ``jax.vjp``, their gradients):
quadratic in T. ``blockwise_causal_attention`` computes the same softmax attention one
``[B, H, block, block]`` tile at a time with an online softmax (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; Rabe & Staats 2021, "Self-attention does not need O(n^2) memory";
Dao et al. 2022, "FlashAttention"):

* forward: for query block ``i`` a loop over key blocks ``0..i`` keeps each row's running maximum ``m``,
  normaliser ``l`` and unnormalised output ``acc``; the result is ``acc / l``, and the row's log-sum-exp
  ``m + log l`` is kept for the backward;
* backward (a ``jax.custom_vjp``; Dao 2023, "FlashAttention-2", algorithm 2): for key block ``j`` a loop
  over query blocks ``j..nb-1`` recomputes each tile's probabilities from the saved log-sum-exp
  (``p = exp(s - lse)``) and accumulates ``dK_j``, ``dV_j`` and ``dQ_i``.

No array of either pass is larger than O(B * H * T * d_head) or O(B * H * block^2), and (causal attention)
tiles above the diagonal are never visited: ``nb (nb + 1) / 2`` tiles of ``nb^2`` (about half of the dense path's
score FLOPs at long T). The result equals dense attention up to float rounding (the softmax is the same
function, summed in another order); it is pure JAX (``lax.scan`` / ``lax.fori_loop``), so it runs on every
backend in float32 and bfloat16. ``blockwise_attention(..., causal=False)`` is the bidirectional variant
(an encoder's, e.g. a vision Transformer's): every query visits every key tile, and keys padded at the end
(T not a multiple of the block) are masked out.

The primal function and the custom VJP's forward are one code path (``_forward``), so a program that
evaluates attention without differentiating it (the reversible trainer's forward and rebuild) computes
bit for bit what a program that differentiates it computes (``StandardTrainer``, the vjp of the
reversible trainer's backward), which the exactness of the reversible trainer relies on.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def _to_blocks(x: jax.Array, block: int) -> jax.Array:
    """``[B, T, H, D] -> [T / block, B, H, block, D]`` (T a multiple of ``block``)."""
    b, t, h, d = x.shape
    return x.reshape(b, t // block, block, h, d).transpose(1, 0, 3, 2, 4)


def _from_blocks(x: jax.Array) -> jax.Array:
    """``[nb, B, H, block, D] -> [B, nb * block, H, D]``."""
    nb, b, h, block, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, nb * block, h, d)


def _scores(a, b, i, j, scale, keys_first=False, causal=True, length=None):
    """Scaled float32 scores of one tile: ``a . b`` over the last axis, ``[B, H, block, block]``.

    ``keys_first`` False: ``a`` is query block ``i``, ``b`` key block ``j``, scores ``[.., query, key]``;
    True: ``a`` is key block ``j``, ``b`` query block ``i``, scores transposed ``[.., key, query]``.
    ``causal``: scores of keys after their query (only in the diagonal tile, ``i == j``) are ``-inf``.
    Otherwise, with ``length`` given, scores of keys at positions ``>= length`` (end padding) are ``-inf``.
    """
    s = jnp.einsum("bhxd,bhyd->bhxy", a, b, preferred_element_type=_F32) * jnp.asarray(scale, _F32)
    pos = jnp.arange(s.shape[-1])
    q_pos, k_pos = (pos[None, :], pos[:, None]) if keys_first else (pos[:, None], pos[None, :])
    if causal:
        return jnp.where((i > j) | (q_pos >= k_pos), s, -jnp.inf)
    if length is None:
        return s
    return jnp.where(j * s.shape[-1] + k_pos < length, s, -jnp.inf)


def _forward(q, k, v, scale, causal=True, length=None):
    """Blocked inputs ``[nb, B, H, block, D]`` -> (output like ``q``, float32 log-sum-exp ``[nb, B, H, block]``).

    Causal: query block ``i`` visits key blocks ``0..i``; bidirectional: all of them (``length``: the
    number of real, unpadded positions)."""
    nb = q.shape[0]

    def query_block(_, inputs):
        i, q_i = inputs

        def key_block(j, carry):
            m, l, acc = carry
            s = _scores(q_i, k[j], i, j, scale, causal=causal, length=length)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # finite: key 0 is visible to every query
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            l = l * rescale + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v[j], preferred_element_type=_F32)
            return m_new, l, acc * rescale[..., None] + pv

        # ``*_like`` keeps the inputs' sharding type (varying over the data axis inside ``shard_map``).
        init = (jnp.full_like(q_i[..., 0], -jnp.inf, _F32), jnp.zeros_like(q_i[..., 0], _F32),
                jnp.zeros_like(q_i, _F32))
        m, l, acc = lax.fori_loop(0, i + 1 if causal else nb, key_block, init)
        return None, ((acc / l[..., None]).astype(q.dtype), m + jnp.log(l))

    _, (out, lse) = lax.scan(query_block, None, (jnp.arange(nb), q))
    return out, lse


def _backward(q, k, v, out, lse, dout, scale, causal=True, length=None):
    """Blocked ``(dq, dk, dv)`` for blocked inputs, output, log-sum-exp and output cotangent.

    Causal: key block ``j`` visits query blocks ``j..nb-1``; bidirectional: all of them.

    Tiles are computed transposed (``[.., key, query]``) and ``dq`` is accumulated transposed
    (``[.., D, query]``), so that every tile product contracts the last axis of its left operand: XLA:CPU
    runs a product whose left operand is contracted along its first axis about 3x slower (measured on
    512 x 512 tiles).
    """
    nb = q.shape[0]
    # delta_i = rowsum(dO_i * O_i) = sum_k P_ik dP_ik: the softmax Jacobian's correction term.
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1)
    scale32 = jnp.asarray(scale, _F32)
    k_t = jnp.swapaxes(k, -1, -2)  # [nb, B, H, D, block]

    def key_block(dq_t, inputs):
        j, k_j, v_j, k_t_j = inputs

        def query_block(i, carry):
            dq_t, dk_j, dv_j = carry
            q_i, do_i = q[i], dout[i]
            p_t = jnp.exp(_scores(k_j, q_i, i, j, scale, keys_first=True, causal=causal, length=length)
                          - lse[i][..., None, :])
            dv_j = dv_j + jnp.einsum("bhkq,bhqd->bhkd", p_t.astype(dout.dtype), do_i, preferred_element_type=_F32)
            dp_t = jnp.einsum("bhkd,bhqd->bhkq", v_j, do_i, preferred_element_type=_F32)
            ds_t = p_t * (dp_t - delta[i][..., None, :]) * scale32  # the gradient of the unscaled scores
            dk_j = dk_j + jnp.einsum("bhkq,bhqd->bhkd", ds_t.astype(q.dtype), q_i, preferred_element_type=_F32)
            dq_t_i = jnp.einsum("bhdk,bhkq->bhdq", k_t_j, ds_t.astype(k.dtype), preferred_element_type=_F32)
            return dq_t.at[i].add(dq_t_i), dk_j, dv_j

        zeros = jnp.zeros_like(k_j, _F32)
        dq_t, dk_j, dv_j = lax.fori_loop(j if causal else 0, nb, query_block, (dq_t, zeros, zeros))
        return dq_t, (dk_j.astype(k.dtype), dv_j.astype(v.dtype))

    dq_t, (dk, dv) = lax.scan(key_block, jnp.zeros_like(k_t, _F32), (jnp.arange(nb), k, v, k_t))
    return jnp.swapaxes(dq_t, -1, -2).astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, block, causal=True, length=None):
    return _attention_fwd(q, k, v, block, causal, length)[0]


def _attention_fwd(q, k, v, block, causal=True, length=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = _forward(_to_blocks(q, block), _to_blocks(k, block), _to_blocks(v, block), scale, causal, length)
    out = _from_blocks(out)
    return out, (q, k, v, out, lse)


def _attention_bwd(block, causal, length, residuals, dout):
    q, k, v, out, lse = residuals
    scale = 1.0 / math.sqrt(q.shape[-1])
    grads = _backward(*(_to_blocks(x, block) for x in (q, k, v, out)), lse, _to_blocks(dout, block), scale,
                      causal, length)
    return tuple(_from_blocks(g) for g in grads)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """Exact causal softmax attention computed ``block`` x ``block`` positions at a time.

    Equals ``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` (scores scaled by ``1 / sqrt(D)``,
    softmax in float32) up to float rounding, with memory O(B * H * (T * D + block^2)) instead of
    O(B * H * T^2) in the forward and in the gradient (a ``jax.custom_vjp`` that recomputes each tile's
    scores from the saved per-row log-sum-exp). See the module docstring for the method and sources.

    Args:
      q, k, v: ``[B, T, H, D]`` arrays of one float dtype (float32 or bfloat16); scores, softmax
        statistics and accumulators are float32 whatever the dtype.
      block: positive tile size along T. ``block >= T`` is one tile (the dense computation, without
        keeping probabilities for the backward). When T is not a multiple of ``block`` the inputs are
        padded at the end: causality already hides the padded keys from every real query, and the padded
        queries' outputs are dropped, so the result is unchanged (only the last tile's work is partly
        wasted).

    Returns:
      ``[B, T, H, D]`` in the dtype of ``q``.

    Raises:
      ValueError: ``block`` is not a positive integer, or the shapes or dtypes of q, k, v differ.
    """
    return _checked_and_padded(q, k, v, block, True)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int, causal: bool = True) -> jax.Array:
    """Exact softmax attention, causal or bidirectional, ``block`` x ``block`` positions at a time.

    ``causal=True`` is `blockwise_causal_attention`. ``causal=False`` equals
    ``jax.nn.dot_product_attention(q, k, v)`` (every query attends to every key) up to float rounding, with
    the same O(B * H * (T * D + block^2)) memory in the forward and the gradient; every query block visits
    every key block, and when T is not a multiple of ``block`` the padded keys are masked out.

    Args:
      q, k, v: ``[B, T, H, D]`` arrays of one float dtype (grouped-query attention: repeat the key/value
        heads first, e.g. ``jnp.repeat(k, groups, axis=2)``).
      block: positive tile size along T (``block >= T``: one tile).
      causal: mask keys after their query.

    Returns:
      ``[B, T, H, D]`` in the dtype of ``q``.

    Raises:
      ValueError: as `blockwise_causal_attention`.
    """
    return _checked_and_padded(q, k, v, block, causal)


def _checked_and_padded(q, k, v, block, causal: bool) -> jax.Array:
    """Checks the arguments of the blockwise entry points, pads T up to a multiple of ``block`` and runs
    `_attention` (bidirectional attention masks the padded keys; causal attention needs no mask: a padded
    key comes after every real query)."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"attention block must be a positive integer, got {block!r}")
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must be [B, T, H, D] of one shape and dtype, got "
                         f"{q.shape} {q.dtype}, {k.shape} {k.dtype}, {v.shape} {v.dtype}")
    t = q.shape[1]
    block = min(block, t)
    padded = -(-t // block) * block
    if padded == t:
        return _attention(q, k, v, block, causal, None)
    pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
    return _attention(*(jnp.pad(x, pad) for x in (q, k, v)), block, causal, None if causal else t)[:, :t]
