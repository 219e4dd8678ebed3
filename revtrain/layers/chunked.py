"""Position-wise computations in chunks along the sequence, so their intermediates stay O(chunk).

Reformer (Kitaev et al. 2020, section 3, "Chunking"): a position-wise layer (the feed-forward, the logits and
loss of the head) can run on ``chunk`` positions at a time. Each chunk runs under ``jax.checkpoint`` inside a
``lax.map``, so differentiating it keeps only each chunk's input and recomputes the chunk's intermediates
(``[B, chunk, d_ff]`` activations, ``[B, chunk, vocab]`` logits) in the backward, one chunk at a time: the
full ``[B, T, d_ff]`` or ``[B, T, vocab]`` arrays and their gradients never exist.

T need not be a multiple of ``chunk``: inputs are padded with zeros at the end, and padded positions are
dropped (``map_chunks``) or must contribute zero (``sum_chunks``: e.g. a loss weighted by a zero-padded
weight).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any


def check_chunk(name: str, chunk: int | None) -> None:
    """Raises ValueError unless ``chunk`` is None or a positive integer (``name`` is the gin name)."""
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {chunk!r}")


def _split(tree: PyTree, chunk: int) -> tuple[PyTree, int]:
    """``[B, T, ...]`` leaves -> ``[n, B, chunk, ...]`` (zero-padded to ``n * chunk`` positions); returns
    ``(chunks, T)``."""
    t = jax.tree.leaves(tree)[0].shape[1]
    n = -(-t // chunk)

    def split(x):
        if x.shape[1] != t:
            raise ValueError(f"every input must have T = {t} positions along axis 1, got shape {x.shape}")
        x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 0, 1)

    return jax.tree.map(split, tree), t


def map_chunks(fn: Callable[[jax.Array], jax.Array], x: jax.Array, chunk: int | None) -> jax.Array:
    """``fn(x)`` computed ``chunk`` positions at a time along axis 1, each chunk rematerialised.

    Args:
      fn: a position-wise function ``[B, c, ...] -> [B, c, ...]`` (its output at a position depends only
        on its input at that position; it may close over parameters).
      x: ``[B, T, ...]``.
      chunk: positions per chunk; None (or ``chunk >= T``) calls ``fn(x)`` once.

    Returns:
      ``fn(x)``, ``[B, T, ...]``: the same function, the same value up to float rounding.
    """
    if chunk is None or chunk >= x.shape[1]:
        return fn(x)
    parts, t = _split(x, chunk)
    ys = lax.map(jax.checkpoint(fn), parts)  # [n, B, chunk, ...]
    ys = jnp.swapaxes(ys, 0, 1)
    return ys.reshape(ys.shape[0], -1, *ys.shape[3:])[:, :t]


def sum_chunks(fn: Callable[[PyTree], PyTree], xs: PyTree, chunk: int | None) -> PyTree:
    """The sum over chunks along axis 1 of ``fn(chunk of xs)``, each chunk rematerialised.

    Args:
      fn: maps a pytree of ``[B, c, ...]`` arrays to a pytree of float scalars (e.g. summed losses). Zero
        padding must contribute zero to it (multiply by a weight that is padded with zeros).
      xs: pytree of ``[B, T, ...]`` arrays.
      chunk: positions per chunk; None (or ``chunk >= T``) calls ``fn(xs)`` once.

    Returns:
      The pytree of ``fn``'s outputs, each summed over the chunks.
    """
    if chunk is None or chunk >= jax.tree.leaves(xs)[0].shape[1]:
        return fn(xs)
    parts, _ = _split(xs, chunk)
    sums = lax.map(jax.checkpoint(fn), parts)  # leaves [n]
    return jax.tree.map(lambda s: jnp.sum(s, axis=0), sums)
