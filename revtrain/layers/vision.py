"""Parts of a reversible vision Transformer (RevViT; Mangalam et al., "Reversible Vision Transformers", CVPR 2022).

A RevViT is a ViT (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021) whose blocks are
additive reversible couplings: the patch embedding (a standard layer) duplicates the patch tokens into two
residual streams, each coupling has F = bidirectional self-attention
(`revtrain.layers.modern.BidirectionalAttention`) and G = an MLP (`MLP`), and the head pools the tokens.
The parts keep the contract of composed models (see `revtrain.layers.modern`): gin-configurable NNX
modules, constructed with ``rngs`` and context keywords (``d_model``, ``num_layers``, ``num_classes``),
called as ``(x, *, keys, train)`` with dropout drawn from ``keys`` only.

Shapes: images float32 ``[B, H, W, C]`` (Fashion-MNIST: ``[B, 28, 28, 1]``), ``N = (H / p) * (W / p)``
tokens of width ``D`` for patch size ``p``, streams float32 ``[B, N, D]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from revtrain.layers.base import PositionWise, cross_entropy_sums, dropout, snap_to_grid
from revtrain.layers.chunked import check_chunk, map_chunks
from revtrain.layers.modern import (_norm, check_grid_bits, check_positive, check_rate, compute_dtype_of,
                                    output_init)


@gin.configurable
class PatchEmbedding(nnx.Module):
    """Image -> patch tokens with learned positions, duplicated into the two residual streams (ViT).

    An optional convolutional stem (``stem_channels``: 3x3 stride-1 convolutions, each followed by GELU;
    "Early Convolutions Help Transformers See Better", Xiao et al., NeurIPS 2021), then a ``patch_size`` x
    ``patch_size`` convolution of stride ``patch_size`` (the ViT patchify: a linear map of each patch),
    plus a learned position embedding per patch (std 0.02), dropout, rounded to the couplings'
    ``2**-grid_bits`` grid.

    Input: float32 ``[B, image_size, image_size, image_channels]``. Output: a pair of float32 ``[B, N, D]``,
    ``N = (image_size / patch_size)**2``.

    Raises:
      ValueError: non-positive sizes, ``patch_size`` not dividing ``image_size``, a bad rate or
        ``grid_bits``; at call time, an image of another shape.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, patch_size: int = 4, image_size: int = 28,
                 image_channels: int = 1, stem_channels: Sequence[int] = (), dropout_rate: float = 0.0,
                 grid_bits: int | None = 18):
        check_positive("PatchEmbedding", d_model=d_model, patch_size=patch_size, image_size=image_size,
                       image_channels=image_channels)
        if image_size % patch_size:
            raise ValueError(f"PatchEmbedding.patch_size {patch_size} does not divide image_size {image_size}")
        stem_channels = tuple(stem_channels)
        for width in stem_channels:
            check_positive("PatchEmbedding", stem_channels=width)
        check_rate("PatchEmbedding", dropout_rate)
        check_grid_bits("PatchEmbedding", grid_bits)
        widths = (image_channels,) + stem_channels
        self.stem = nnx.List([nnx.Conv(a, b, (3, 3), padding="SAME", rngs=rngs)
                              for a, b in zip(widths[:-1], widths[1:])])
        self.patchify = nnx.Conv(widths[-1], d_model, (patch_size, patch_size), strides=(patch_size, patch_size),
                                 padding="VALID", rngs=rngs)
        num_patches = (image_size // patch_size) ** 2
        self.positions = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (num_patches, d_model), jnp.float32))
        self.image_shape = (image_size, image_size, image_channels)
        self.dropout_rate, self.grid_bits = dropout_rate, grid_bits

    def __call__(self, x, *, keys, train):
        if tuple(x.shape[1:]) != self.image_shape:
            raise ValueError(f"PatchEmbedding expects images [B, {', '.join(map(str, self.image_shape))}], "
                             f"got {list(x.shape)}")
        h = x
        for conv in self.stem:
            h = jax.nn.gelu(conv(h))
        h = self.patchify(h)
        b, gh, gw, d = h.shape
        h = h.reshape(b, gh * gw, d) + self.positions[...][None]
        h = snap_to_grid(dropout(h, self.dropout_rate, keys, train), self.grid_bits)
        return (h, jnp.copy(h))  # two arrays: see revtrain.layers.transformer.ByteEmbedding


@gin.configurable
class MLP(PositionWise, nnx.Module):
    """G of a ViT coupling: pre-norm, Dense(d_ff), GELU, Dense(D), dropout. ``[B, N, D] -> [B, N, D]``.

    ``d_ff`` defaults to ``4 * d_model``; the output projection starts at std ``0.02 / sqrt(2 *
    num_layers)``. ``norm``: "layer" (LayerNorm, ViT's) or "rms". ``chunk``: positions at a time
    (`revtrain.layers.chunked.map_chunks`). Raises ValueError for bad sizes, norm, rate, dtype or chunk.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, num_layers: int = 1, d_ff: int | None = None,
                 norm: str = "layer", dropout_rate: float = 0.0, compute_dtype: str = "float32",
                 chunk: int | None = None):
        d_ff = 4 * d_model if d_ff is None else d_ff
        check_positive("MLP", d_model=d_model, d_ff=d_ff)
        check_rate("MLP", dropout_rate)
        check_chunk("MLP.chunk", chunk)
        dtype = compute_dtype_of(compute_dtype, "MLP")
        self.norm = _norm(norm, d_model, "MLP", rngs)
        self.up = nnx.Linear(d_model, d_ff, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, kernel_init=output_init(num_layers), dtype=dtype, rngs=rngs)
        self.dropout_rate, self.chunk = dropout_rate, chunk

    def __call__(self, x, *, keys, train):
        h = map_chunks(lambda x: self.down(jax.nn.gelu(self.up(self.norm(x)))), x, self.chunk)
        return dropout(h, self.dropout_rate, keys, train).astype(x.dtype)


@gin.configurable
class MeanPoolClassifierHead(nnx.Module):
    """The two streams concatenated, normalised, averaged over the tokens, then ``num_classes`` logits.

    Input: a pair of float32 ``[B, N, D]``. ``__call__`` returns float32 logits ``[B, num_classes]``;
    ``loss(x, batch)`` the summed softmax cross-entropy (nats) and stats (``batch['targets']`` int32
    ``[B]``, optional ``batch['weights']``). ``norm``: "layer" or "rms". Raises ValueError for bad sizes.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, num_classes: int = 10, norm: str = "layer"):
        check_positive("MeanPoolClassifierHead", d_model=d_model, num_classes=num_classes)
        self.norm = _norm(norm, 2 * d_model, "MeanPoolClassifierHead", rngs)
        self.logits = nnx.Linear(2 * d_model, num_classes, rngs=rngs)

    def __call__(self, x, *, keys, train):
        h = self.norm(jnp.concatenate(x, axis=-1))
        return self.logits(jnp.mean(h, axis=1)).astype(jnp.float32)

    def loss(self, x, batch, *, keys, train):
        return cross_entropy_sums(self(x, keys=keys, train=train), batch)
