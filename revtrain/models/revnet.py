"""The RevNet image classifier: reversible stages joined by standard downsampling layers, as a composition
of parts (`revtrain.models.compose`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import gin

from revtrain.layers.revnet import ClassifierHead, Downsample, ResidualFn, Stem
from revtrain.models.base import Model
from revtrain.models.compose import Coupling, Head, Repeat, Standard, compose


@gin.configurable
def RevNet(num_classes: int = 10, *, seed: int = 0, image_channels: int = 1,
           widths: Sequence[int] = (32, 64, 128), blocks: Sequence[int] = (1, 1, 1), depth: int = 1,
           momentum: float = 0.9, grid_bits: int | None = 16) -> Model:
    """Builds a RevNet classifier as a layer list.

    Layers, for ``S = len(widths)`` stages: ``Stem`` (standard; image ``[B, H, W, image_channels]`` -> two
    streams of ``widths[0] / 2`` channels), then for each stage ``s`` (after a standard ``Downsample`` to
    ``widths[s]`` channels at half the resolution, for ``s > 0``) ``blocks[s]`` reversible couplings whose F
    and G are ``depth`` x (batch norm, ReLU, 3x3 convolution) on ``widths[s] / 2`` channels, and the head
    (batch norm, ReLU, global average pooling, dense ``num_classes`` logits, softmax cross-entropy).

    Args:
      num_classes: output classes (the task's ``model_kwargs`` gives it).
      seed: initialisation seed; layer ``i`` is initialised from ``fold_in(seed, i)``.
      image_channels: channels of the input image (1 for greyscale).
      widths: channels of each stage (both streams together; even).
      blocks: reversible couplings per stage (same length as ``widths``; 0 allowed).
      depth: convolutions in each F and G.
      momentum: batch-norm running-statistics decay (``running = momentum * running + (1 - momentum) *
        batch``).
      grid_bits: stream values and F / G outputs are rounded to multiples of ``2**-grid_bits`` so the
        couplings are exactly invertible in float32 while the streams stay below ``2**(24 - grid_bits)`` in
        magnitude (256 for the default 16); None turns the rounding off (the rebuild is then exact only up to
        float rounding). See ``revtrain.layers.snap_to_grid``.

    Raises:
      ValueError: empty or mismatched ``widths`` / ``blocks``, odd or non-positive widths, negative block
        counts, ``depth < 1``, ``momentum`` outside [0, 1), or ``grid_bits`` outside [1, 23].
    """
    widths, blocks = tuple(widths), tuple(blocks)
    if not widths or len(widths) != len(blocks):
        raise ValueError(f"RevNet.widths and RevNet.blocks must be non-empty and of equal length, got {widths} "
                         f"and {blocks}")
    if any(w < 2 or w % 2 for w in widths):
        raise ValueError(f"RevNet.widths must be even and positive (two streams), got {widths}")
    if any(b < 0 for b in blocks):
        raise ValueError(f"RevNet.blocks must be non-negative, got {blocks}")
    for name, value in (("num_classes", num_classes), ("depth", depth), ("image_channels", image_channels)):
        if value < 1:
            raise ValueError(f"RevNet.{name} must be positive, got {value}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"RevNet.momentum must be in [0, 1), got {momentum}")
    if grid_bits is not None and not (isinstance(grid_bits, int) and 1 <= grid_bits <= 23):
        raise ValueError(f"RevNet.grid_bits must be an integer in [1, 23] or None, got {grid_bits!r}")
    specs: list = [Standard(functools.partial(Stem, image_channels, widths[0], grid_bits=grid_bits), name="stem")]
    for s, (width, count) in enumerate(zip(widths, blocks)):
        if s:
            specs.append(Standard(functools.partial(Downsample, widths[s - 1], width, momentum, grid_bits=grid_bits),
                                  name=f"downsample_{s}"))
        fn = functools.partial(ResidualFn, width // 2, depth, momentum)
        specs.append(Repeat(Coupling(fn, fn, name=f"stage_{s}_block"), count))
    specs.append(Head(functools.partial(ClassifierHead, widths[-1], num_classes, momentum), name="head"))
    return compose(specs, seed=seed, grid_bits=grid_bits, input_key="image", tokens_per_example=1,
                   bits_per_byte=False)
