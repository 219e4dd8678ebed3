"""Standard residual blocks trained exactly reversibly: the BDIA update on revtrain's fixed-point grid.

Design (derivation and numbers: ``docs/exact_residual.md``). A standard pre-norm block is an Euler step
``x_{k+1} = x_k + h_k(x_k)``. Its input cannot be rebuilt from its output, so the reversible trainer has to
save it. The BDIA idea (Zhang, Lewis & Kleijn, "On Exact Bit-level Reversible Transformers Without Changing
Architectures", ICML 2025) trains the same blocks with a two-step update instead::

    x_{k+1} = g_k x_{k-1} + (1 - g_k) x_k + (1 + g_k) h_k(x_k),     g_k in {+gamma, -gamma}

drawn per example and block, ``gamma = |g| = 2**-j`` (``j`` in 1 .. 8; the paper's 1/2 is ``j = 1``); its
mean over ``g_k`` is the Euler step, and ``g_k = 0`` (evaluation, sampling) *is* the standard block. The
smaller ``gamma``, the closer training is to that standard block, and the more bits the rebuild needs.
Everything but ``g_k x_{k-1}`` is a function of ``x_k`` alone. On a grid of unit ``u = 2**-grid_bits``, with
both streams multiples of ``u``:

* ``R_k(x_k) = snap((1 - g_k) x_k + (1 + g_k) h_k(x_k))`` is one rounded term, recomputed bit for bit in
  the rebuild (same inputs, same keys, same program text);
* ``x_{k-1} = (2**j m + s) u`` with ``m = floor(x_{k-1} / (2**j u))`` and ``s`` in ``[0, 2**j)`` its ``j``
  lowest grid bits; the scaled term is ``sign(g_k) m u``, exact, and the lost bits ``s`` are stored (``j``
  bits per element per block);
* ``x_{k+1} = sign(g_k) m u + R_k(x_k)``: a sum of two grid values, exact while the stream stays below
  ``2**(24 - grid_bits)`` in float32.

The rebuild reads ``(x_k, x_{k+1})`` and the bits: ``m u = sign(g_k) (x_{k+1} - R_k(x_k))`` (exact: it is
the difference the forward added), ``x_{k-1} = 2**j m u + s u``. Nothing is approximate, so a run of any
depth rebuilds bit for bit.

Layout: the layer maps the activation triple ``(x_{k-1}, x_k, bits) -> (x_k, x_{k+1}, bits')``, where
``bits`` is a uint8 stack ``[B, num_blocks, T, j * ceil(D / 8)]`` (``j`` bit-planes, each ``jnp.packbits``
along the features) with one slot per block of the run, created empty by the embedding; block ``k`` writes
slot ``k`` and its rebuild clears it again (so the rebuilt triple equals the forward's input bit for bit).
The slot index is layer *state* (an int32 scalar), not a static attribute, so every block of a run has the
same structure and the trainers compile one program for all of them (and stack them in the scanned
executor). The bits ride in the activation pytree: no trainer change is needed; they are ``j/32`` of a
float32 stream per block (1/32 at ``gamma = 1/2``, 3/32 at 1/8).

The ``g_k`` draws come from the per-example keys the trainer derives from ``(seed, step, layer index,
example)`` (``split_keys(keys, 2)``): the forward, the rebuild and ``revtrain check`` replay them. The
derivative of the scaling is the exact ``2**-j`` (straight-through for the rounding, like `snap_to_grid`),
so backprop of this layer is the gradient of the BDIA update at the rounded points.

The first block of a run (slot 0) sees ``x_{-1} = x_0`` (the embedding duplicates its output) and runs with
``g_0 = 0``, as in the paper: ``x_1 = snap(x_0 + h_0(x_0))``, the standard block on the grid; its rebuild
sets ``x_{-1} = x_0``, the first stream of its own output, so it needs neither ``g`` nor the bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from revtrain.layers.base import snap_to_grid, split_keys

# Name of the layer-state variable holding a block's slot in the bits stack.
SLOT = "slot"


class Slot(nnx.Variable):
    """An int32 scalar naming the block's slot in the side-bits stack (layer state, never trained)."""


GAMMAS = tuple(2.0 ** -j for j in range(1, 9))  # |g| = 2**-j, j = 1 .. 8 low grid bits stored


def gamma_low_bits(gamma) -> int:
    """``j`` for ``|g| = gamma = 2**-j``: the low grid bits stored per element per block.

    Raises:
      ValueError: ``gamma`` is not one of `GAMMAS` (1/2, 1/4, ..., 1/256).
    """
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or float(gamma) not in GAMMAS:
        raise ValueError(f"gamma must be a power of two 2**-j with j in 1..8 (0.5, 0.25, 0.125, ...), got {gamma!r}")
    return GAMMAS.index(float(gamma)) + 1


def bits_width(d_model: int, low_bits: int = 1) -> int:
    """Bytes of packed side bits per position and block: ``low_bits * ceil(d_model / 8)`` (one packed
    bit-plane per stored bit)."""
    return low_bits * -(-d_model // 8)


def empty_bits(num_blocks: int, batch: int, length: int, d_model: int, low_bits: int = 1) -> jax.Array:
    """The empty side-bits stack: uint8 zeros ``[batch, num_blocks, length, low_bits * ceil(d_model / 8)]``
    (the batch first, like every activation the trainers split over devices)."""
    return jnp.zeros((batch, num_blocks, length, bits_width(d_model, low_bits)), jnp.uint8)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _scale_down(x: jax.Array, unit: float, low_bits: int) -> jax.Array:
    return jnp.floor(x / (2.0 ** low_bits * unit)) * unit  # powers of two: exact


@_scale_down.defjvp
def _scale_down_jvp(unit, low_bits, primals, tangents):
    return _scale_down(primals[0], unit, low_bits), tangents[0] * 2.0 ** -low_bits


def split_low_bits(x: jax.Array, grid_bits: int, low_bits: int = 1):
    """``x = 2**j m u + s u`` on the grid of unit ``u = 2**-grid_bits`` (``j = low_bits``).

    Args:
      x: float32 array of multiples of ``u``.
      grid_bits: the grid's resolution.
      low_bits: ``j``, the low grid bits split off (``|g| = 2**-j``), 1 .. 8.

    Returns:
      ``(scaled, s)``: ``scaled = m u`` (float32 like ``x``, exactly ``(x - s u) / 2**j``, ``m =
      floor(x / (2**j u))``; its derivative is the exact ``2**-j``) and ``s`` (uint8 like ``x``, the ``j``
      low grid bits of ``x``: an integer in ``[0, 2**j)``, for negative ``x`` too, as ``floor`` rounds down).
    """
    unit = 2.0 ** -grid_bits
    scaled = _scale_down(x, unit, low_bits)
    s = ((x - 2.0 ** low_bits * scaled) / unit).astype(jnp.uint8)  # exactly 0 .. 2**j - 1 grid units
    return scaled, s


def split_low_bit(x: jax.Array, grid_bits: int):
    """`split_low_bits` with ``j = 1`` (``|g| = 1/2``): ``(half, s)`` with ``s`` bool."""
    half, s = split_low_bits(x, grid_bits, 1)
    return half, s != 0


def pack(s: jax.Array, low_bits: int = 1) -> jax.Array:
    """``s`` ``[..., D]`` (bool, or integers in ``[0, 2**low_bits)``) -> uint8 ``[..., low_bits * ceil(D / 8)]``:
    bit-plane ``i`` (bit ``i`` of every element, ``jnp.packbits`` along the last axis) in bytes ``i *
    ceil(D / 8) ..``."""
    s = s.astype(jnp.uint8)
    return jnp.concatenate([jnp.packbits((s >> i) & 1, axis=-1) for i in range(low_bits)], axis=-1)


def unpack(packed: jax.Array, d_model: int, low_bits: int = 1) -> jax.Array:
    """uint8 ``[..., low_bits * ceil(D / 8)]`` -> ``[..., D]`` (the inverse of `pack`): bool for ``low_bits
    = 1``, else uint8 integers in ``[0, 2**low_bits)``."""
    if low_bits == 1:
        return jnp.unpackbits(packed, axis=-1, count=d_model).astype(bool)
    planes = jnp.split(packed, low_bits, axis=-1)
    out = jnp.zeros(packed.shape[:-1] + (d_model,), jnp.uint8)
    for i, plane in enumerate(planes):
        out = out | (jnp.unpackbits(plane, axis=-1, count=d_model) << i)
    return out


def gamma_signs(keys: jax.Array, batch: int) -> jax.Array:
    """``sign(g)`` per example, float32 ``[B, 1, 1]`` of +1 / -1, drawn from ``split_keys(keys, 2)``."""
    draw = jax.vmap(lambda k: jax.random.bernoulli(k))(split_keys(keys, 2))
    return jnp.where(draw, 1.0, -1.0).astype(jnp.float32).reshape(batch, 1, 1)


class ExactResidual(nnx.Module):
    """One standard residual block run as the exactly reversible BDIA update (module docstring).

    Wraps ``block``: an NNX module with ``__call__(x, *, keys, train)`` (the standard block, ``x + h(x)`` in
    its own float order, ``[B, T, D] -> [B, T, D]``) and ``increment(x, *, keys, train)`` (``h(x)``).

    Input / output: the triple ``(x_{k-1}, x_k, bits)``: float32 ``[B, T, D]`` twice and the uint8 side-bits
    stack ``[B, num_blocks, T, j * ceil(D / 8)]`` (``j`` low bits per element, ``|g| = gamma = 2**-j``).
    Training: ``(x_k, x_{k+1}, bits with slot k written)``. Evaluation (``train`` False: ``g = 0``): ``(x_k,
    block(x_k), bits)``, the standard block's own output, unrounded, so evaluation and sampling equal the
    standard model bit for bit.

    Args:
      block: the wrapped standard block.
      slot: this block's slot in the bits stack (0 .. num_blocks - 1).
      grid_bits: the grid ``2**-grid_bits`` of the training streams.
      gamma: ``|g|``, one of `GAMMAS` (1/2, 1/4, ..., 1/256): ``g = +-gamma`` in training, ``j =
        -log2(gamma)`` side bits per element per block.

    Raises:
      ValueError: a bad ``grid_bits``, ``slot`` or ``gamma``.
    """

    def __init__(self, block: nnx.Module, slot: int, grid_bits: int = 18, gamma: float = 0.125):
        if not (isinstance(grid_bits, int) and 1 <= grid_bits <= 60):
            raise ValueError(f"ExactResidual.grid_bits must be an integer in [1, 60], got {grid_bits!r}")
        if not isinstance(slot, int) or slot < 0:
            raise ValueError(f"ExactResidual slot must be a non-negative integer, got {slot!r}")
        self.low_bits = gamma_low_bits(gamma)
        self.block = block
        self.slot = Slot(jnp.int32(slot))
        self.grid_bits = grid_bits
        self.gamma = float(gamma)

    def _rest(self, b, sign, keys):
        """``R(x_k) = snap((1 - g) x_k + (1 + g) h(x_k))`` with ``g = sign * gamma``: the one rounded term."""
        h = self.block.increment(b, keys=split_keys(keys, 0), train=True).astype(jnp.float32)
        g = self.gamma * sign
        return snap_to_grid((1.0 - g) * b + (1.0 + g) * h, self.grid_bits)

    def _signs(self, keys, batch):
        """``sign(g)`` per example, ``[B, 1, 1]``: +-1 drawn from the keys, 0 for the run's first block (slot 0,
        the Euler step: its ``x_{-1}`` is ``x_0``, so nothing is lost and no ``g`` is needed to rebuild it)."""
        return jnp.where(self.slot[...] == 0, 0.0, gamma_signs(keys, batch))

    def __call__(self, x, *, keys, train):
        a, b, bits = x
        if not train:
            return (b, self.block(b, keys=None, train=False), bits)
        sign = self._signs(keys, b.shape[0])
        scaled, s = split_low_bits(a, self.grid_bits, self.low_bits)
        c = sign * scaled + self._rest(b, sign, keys)
        bits = jax.lax.dynamic_update_index_in_dim(bits, pack(s, self.low_bits), self.slot[...], 1)
        return (b, c, bits)

    def inverse(self, y, *, keys):
        b, c, bits = y
        sign = self._signs(keys, b.shape[0])
        scaled = sign * (c - self._rest(b, sign, keys))  # exactly m u
        s = unpack(jax.lax.dynamic_index_in_dim(bits, self.slot[...], 1, keepdims=False), b.shape[-1],
                   self.low_bits)
        a = 2.0 ** self.low_bits * scaled + s.astype(b.dtype) * 2.0 ** -self.grid_bits
        a = jnp.where(self.slot[...] == 0, b, a)  # the first block's x_{-1} is x_0 (the embedding's copy)
        cleared = jax.lax.dynamic_update_index_in_dim(
            bits, jnp.zeros(bits[:, 0].shape, bits.dtype), self.slot[...], 1)
        return (a, b, cleared)

    # -- incremental decoding: the standard block (g = 0) on the second stream --
    def init_cache(self, batch_size: int, max_len: int):
        """The wrapped block's cache."""
        return self.block.init_cache(batch_size, max_len)

    def decode(self, x, cache, pos):
        """``((x_k, block(x_k)), new_cache)`` at positions ``pos ..``: the standard block, incrementally."""
        a, b, bits = x
        del a
        y, cache = self.block.decode(b, cache, pos)
        return (b, y, bits), cache


def side_bits_line(model, batch_size: int, sequence_length: int) -> str | None:
    """The run log's line on the exact form's side bits, or None for a model without `ExactResidual` blocks:
    ``|g|``, the bits per element and block, and the bytes of the side-bits stack a step of ``batch_size``
    rows of ``sequence_length`` positions carries (``[B, blocks, T, low_bits * ceil(D / 8)]`` uint8), against
    one float32 stream ``[B, T, D]``."""
    blocks = [m for m in (layer.abstract_module() for layer in model.layers) if isinstance(m, ExactResidual)]
    spec = getattr(model, "llama_spec", None)
    if not blocks or spec is None:
        return None
    first, d_model = blocks[0], spec.hidden_size
    stack = batch_size * len(blocks) * sequence_length * bits_width(d_model, first.low_bits)
    stream = batch_size * sequence_length * d_model * 4
    return (f"exact form: |g| = {first.gamma:g}, {first.low_bits} side bit(s) per element per block "
            f"({first.low_bits}/32 of a float32 stream), {len(blocks)} blocks: {stack / 2**20:.2f} MiB of side bits "
            f"a step at batch {batch_size} ({stack / stream:.2f}x one {stream / 2**20:.2f} MiB stream)")

