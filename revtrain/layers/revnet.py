"""Layers of the RevNet image classifier (Gomez, Ren, Urtasun, Grosse, "The Reversible Residual Network:
Backpropagation Without Storing Activations", NeurIPS 2017).

Activations are NHWC float32 ``[B, H, W, C]``. Between the stem and the head the network carries two
streams of ``C / 2`` channels each (the channels split in two, as in RevNet):

* ``Stem`` (standard): 3x3 convolution of the image, split into the two streams.
* ``RevNetCoupling`` (reversible): ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``, with F and G small pre-activation
  residual functions ``ResidualFn`` (batch norm, ReLU, 3x3 convolution; optionally twice).
* ``Downsample`` (standard): joins the streams, batch norm, ReLU, strided 3x3 convolution to the next
  stage's width, split again. It is not invertible (it halves the resolution), so the reversible trainer
  saves its input.
* ``ClassifierHead``: joins the streams, batch norm, ReLU, global average pooling, dense logits, softmax
  cross-entropy.

Batch normalisation. Every ``nnx.BatchNorm`` uses ``axis_name="data"``: inside the trainers' ``shard_map``
its batch statistics are averaged over all devices, so N devices normalise exactly like one device with the
whole batch. In training mode (``train=True``) it normalises with the batch statistics and updates its
running statistics (``running = momentum * running + (1 - momentum) * batch``, biased batch variance);
``Layer.apply`` returns them as the layer's new state, which the trainers commit once per step. In evaluation
(``train=False``) it uses the running statistics and changes nothing. The coupling's inverse runs F and G in
training mode on the same tensors the forward gave them (``G(y1)`` directly, ``F(x2)`` on the rebuilt ``x2``),
so they see the same batch statistics and produce the same outputs; the statistics it computes are thrown
away (``ReversibleLayer.inverse`` never returns state).

Exact reconstruction: the stem's and the downsampling layers' outputs and every F / G output are rounded to
multiples of ``2**-grid_bits`` (``snap_to_grid``) so each coupling addition is exact in float32 and the
inverse rebuilds its inputs bit for bit while the streams stay below ``2**(24 - grid_bits)`` in magnitude.

No convolution has a bias: every consumer of a stream starts with batch norm, which removes any per-channel
constant, so such a bias would only get a (mathematically) zero gradient, i.e. rounding noise that Adam
would amplify.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from revtrain.layers.base import ReversibleCoupling, cross_entropy_sums, snap_to_grid

DATA_AXIS = "data"  # the trainers' mesh axis (revtrain.placement.DATA_AXIS); batch statistics average over it


def batch_norm(channels: int, momentum: float, *, rngs: nnx.Rngs) -> nnx.BatchNorm:
    """``nnx.BatchNorm`` over the last axis, statistics averaged over the ``"data"`` devices."""
    return nnx.BatchNorm(channels, momentum=momentum, epsilon=1e-5, use_fast_variance=False,
                         axis_name=DATA_AXIS, rngs=rngs)


def conv3x3(in_channels: int, out_channels: int, *, rngs: nnx.Rngs, strides: int = 1) -> nnx.Conv:
    """Bias-free 3x3 convolution, ``SAME`` padding, He-normal initialisation."""
    return nnx.Conv(in_channels, out_channels, (3, 3), strides=strides, padding="SAME", use_bias=False,
                    kernel_init=nnx.initializers.he_normal(), rngs=rngs)


def _split(h: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    c = h.shape[-1] // 2
    return (h[..., :c], h[..., c:])


class Stem(nnx.Module):
    """Standard layer: image ``[B, H, W, in_channels]`` -> two streams ``[B, H, W, channels / 2]``.

    One bias-free 3x3 convolution; the output is rounded to the coupling grid and its channels split in two.
    """

    def __init__(self, in_channels: int, channels: int, *, rngs: nnx.Rngs, grid_bits: int | None = None):
        if channels % 2:
            raise ValueError(f"the stem width must be even (two streams), got {channels}")
        self.conv = conv3x3(in_channels, channels, rngs=rngs)
        self.grid_bits = grid_bits

    def __call__(self, x, *, keys, train):
        return _split(snap_to_grid(self.conv(x), self.grid_bits))


class ResidualFn(nnx.Module):
    """F or G of a coupling: ``depth`` times (batch norm, ReLU, 3x3 convolution), ``[B, H, W, C] -> same``.

    ``norms[i]`` and ``convs[i]`` are the i-th unit's batch norm and convolution.
    """

    def __init__(self, channels: int, depth: int, momentum: float, *, rngs: nnx.Rngs):
        if depth < 1:
            raise ValueError(f"a residual function needs at least one convolution, got {depth}")
        self.norms = nnx.List([batch_norm(channels, momentum, rngs=rngs) for _ in range(depth)])
        self.convs = nnx.List([conv3x3(channels, channels, rngs=rngs) for _ in range(depth)])

    def __call__(self, x, *, keys, train):
        del keys  # no randomness
        for norm, conv in zip(self.norms, self.convs):
            x = conv(nnx.relu(norm(x, use_running_average=not train)))
        return x


# The RevNet's reversible blocks are the shared additive coupling (``revtrain.layers.base``).
RevNetCoupling = ReversibleCoupling


class Downsample(nnx.Module):
    """Standard layer between stages: two streams ``[B, H, W, C/2]`` -> two streams ``[B, H/s, W/s, C'/2]``.

    Joins the streams, batch norm, ReLU, bias-free 3x3 convolution with stride ``strides`` to ``out_channels``;
    the output is rounded to the coupling grid and split in two.
    """

    def __init__(self, in_channels: int, out_channels: int, momentum: float, *, rngs: nnx.Rngs,
                 strides: int = 2, grid_bits: int | None = None):
        if out_channels % 2:
            raise ValueError(f"stage widths must be even (two streams), got {out_channels}")
        self.norm = batch_norm(in_channels, momentum, rngs=rngs)
        self.conv = conv3x3(in_channels, out_channels, rngs=rngs, strides=strides)
        self.grid_bits = grid_bits

    def __call__(self, x, *, keys, train):
        h = nnx.relu(self.norm(jnp.concatenate(x, axis=-1), use_running_average=not train))
        return _split(snap_to_grid(self.conv(h), self.grid_bits))


class ClassifierHead(nnx.Module):
    """Joins the streams, batch norm, ReLU, global average pooling, dense logits, softmax cross-entropy.

    Input: two float32 ``[B, H, W, C/2]``. ``batch['targets']``: int32 ``[B]``; optional ``batch['weights']``:
    float32 ``[B]`` (0 for padding rows). ``__call__`` returns float32 logits ``[B, num_classes]``; ``loss``
    returns (sum over the local batch of weighted per-example losses in nats, ``{'weight', 'correct'}`` sums).
    """

    def __init__(self, channels: int, num_classes: int, momentum: float, *, rngs: nnx.Rngs):
        self.norm = batch_norm(channels, momentum, rngs=rngs)
        self.logits = nnx.Linear(channels, num_classes, rngs=rngs)

    def __call__(self, x, *, keys, train):
        h = nnx.relu(self.norm(jnp.concatenate(x, axis=-1), use_running_average=not train))
        return self.logits(jnp.mean(h, axis=(1, 2))).astype(jnp.float32)

    def loss(self, x, batch, *, keys, train):
        return cross_entropy_sums(self(x, keys=keys, train=train), batch)
