"""Hessian-vector products for optax's Hutchinson estimator: the whole model's, and layer by layer.

``optax.contrib.hutchinson_estimator_diag_hessian`` (and ``optax.contrib.sophia``, built on it) asks its update for
``obj_fn``, the loss as a function of the parameters, and computes ``H z`` as
``jax.jvp(jax.grad(obj_fn), (params,), (z,))[1]`` (forward-over-reverse; Pearlmutter 1994) on a Rademacher
tangent ``z`` drawn from the key in its state (Hutchinson 1989; Liu et al. 2023, "Sophia"). A reversible trainer
never holds the whole model, so it cannot give optax a loss of every parameter. Both trainers instead compute
``H z`` themselves before the update, on the very ``z`` the estimator draws (`Tangents`: its key found in the
optimizer state and split as optax splits it), and give the update a stand-in objective whose
forward-over-reverse product is that ``H z`` (`revtrain.optstate.given_products`). optax's own equations then
run on it (``H z * z``, Sophia's moment, its ``cond`` on the interval), split over the layers as any update is
(`revtrain.trainers.layerwise`: layer i's ``H z`` one more input of its own, like its gradient).

* StandardTrainer: one program of the whole model's ``jvp(grad(loss))`` (`whole_products`).
* ReversibleTrainer (`LayerProducts`): a pass over the layers before the step's own, one program per layer.
  Forward: the first layer's output tangent by a ``jax.jvp`` in its parameters (its input is data); every
  other layer's output and output tangent through the jvp of the layer's vjp, the parameters' part an output
  and the cotangent a zero given at run time: the program then computes the tangent as the whole model's
  ``jvp(grad)`` program does (a plain ``jvp`` program lets XLA fuse the attention softmax's tangent reduction
  otherwise, an ulp apart: scripts/probe_hvp_exactness.py). Each layer's input and input tangent are kept.
  Head: the ``jvp`` of its gradient in its parameters and input, the cotangent and its tangent going down.
  Backward, top first: the ``jvp`` of each layer's vjp at its kept input, its ``H z`` an output. Each product
  is reduced over the devices as its gradient is (`placement.reduce_grads`).

Both are bit for bit the same products (the probe, and tests/test_optimizer_catalogue.py through both trainers
on every tier; docs/recipe.md). They are computed only on the steps whose update reads them (Sophia's ``cond`` on
``count % update_interval``, found in the update's program: `revtrain.trainers.layerwise.LayerwiseUpdate.
products_needed`). Such a step costs about a backward's work more per layer in the forward and two backwards' in
the backward, keeps every layer's input and its tangent for the backward (two activations per layer, where the
tier keeps activations), and holds the products themselves, a model's size, until the update pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain import optstate
from revtrain.placement import DATA_AXIS, per_device, reduce_grads
from revtrain.trainers.common import batch_size_of, example_keys

_R, _D = P(), P(DATA_AXIS)


def lowest_dtype(shapes):
    """The lowest floating dtype of a tree of arrays or ``jax.ShapeDtypeStruct`` (optax's
    ``optax.tree.dtype(params, "lowest")``, which the estimator casts its tangent to)."""
    return optax.tree.dtype(jax.tree.map(lambda x: np.zeros((), x.dtype), shapes), "lowest")


class Tangents:
    """The Rademacher tangent ``z`` optax's Hutchinson estimator draws this step, as a trainer computes it.

    The estimator splits its state's key (``key, subkey = jax.random.split(key)``), splits ``subkey`` into one key
    per leaf of the whole parameter tree (``optax.tree.split_key_like``), draws float32 signs per leaf
    (``jax.random.rademacher``) and casts them to the tree's lowest dtype (``optax.tree.random_like``). Each
    layer's part is drawn from its own leaves' keys, so no program holds the whole model's tangent. The draw is
    integer arithmetic: the same bits in any program.

    Args:
      layer_shapes: one params tree per layer (``jax.ShapeDtypeStruct`` leaves), the whole tree the update sees.
    """

    def __init__(self, layer_shapes: list):
        self.layer_shapes = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p) for p in layer_shapes]
        self.dtype = lowest_dtype(self.layer_shapes)
        self._keys = jax.jit(self._split)
        self._signs: dict = {}

    @staticmethod
    def key(opt_state):
        """The estimator's key (uint32 key data, as `revtrain.optstate.keep_states` keeps it) from an optimizer
        state: the whole model's, or any layer's (every layer's state holds the same copy)."""
        return optstate.hutchinson_states(opt_state)[0].key

    def _split(self, key):
        subkey = jax.random.split(key)[1]
        return optax.tree.split_key_like(subkey, self.layer_shapes)

    def keys(self, key) -> list:
        """One tree of keys per layer (a key per leaf) from the estimator's ``key``: one small program."""
        return self._keys(key)

    def layer(self, i: int, keys: list):
        """Layer ``i``'s tangent (a tree like its params, the lowest dtype) from ``keys`` (`keys`), one program
        per distinct layer structure."""
        shapes = self.layer_shapes[i]
        sig = (jax.tree.structure(shapes), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(shapes)))
        if sig not in self._signs:
            def draw(ks, shapes=shapes):
                return jax.tree.map(lambda k, x: jax.random.rademacher(k, x.shape, jnp.float32).astype(self.dtype),
                                    ks, shapes)
            self._signs[sig] = jax.jit(draw)
        return self._signs[sig](keys[i])

    def whole(self, key) -> list:
        """Every layer's tangent (the whole tree), for StandardTrainer."""
        keys = self.keys(key)
        return [self.layer(i, keys) for i in range(len(self.layer_shapes))]


def whole_products(objective, params, z):
    """Inside ``shard_map`` over ``"data"``: the whole model's ``H z``, ``jax.jvp(jax.grad(objective))`` at
    ``params`` (replicated) in the direction ``z``, each device's summed over the devices (pmap semantics: the
    product of the mean loss when ``objective`` is each device's part of it, normalised by the global weight)."""
    return lax.psum(jax.jvp(jax.grad(objective), (per_device(params),), (per_device(z),))[1], DATA_AXIS)


class LayerProducts:
    """ReversibleTrainer's pass of Hessian-vector products, one program per layer (see the module note).

    Args:
      model: the `revtrain.models.Model` (its layers; the last is the head, with ``loss``).
      specs: each layer's split over the devices (`revtrain.trainers.specs.StateSpecs`).
      compile: ``compile(kind, layer, fn, in_specs, out_specs, donate=(), key=None)`` (the trainer's per-layer
        programs' `revtrain.trainers.programs.LayerPrograms.compile`: ``jit(shard_map(partial(fn, layer)))``).
      tangents: the estimator's draw (`Tangents`).
    """

    def __init__(self, model, specs, compile, tangents: Tangents):
        self.model, self.specs, self.compile, self.tangents = model, specs, compile, tangents

    # -- the programs (inside shard_map over "data") --
    def _params(self, layer, params):
        return per_device(self.specs.whole(layer, params))

    def _first(self, layer, params, state, x, z, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        return jax.jvp(lambda q: layer.apply(q, state, x, keys, True)[0], (self._params(layer, params),),
                       (per_device(z),))

    def _forward(self, layer, params, state, x, dx, z, zero, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))

        def pulled(q, y, c):
            out, pull = jax.vjp(lambda r, s: layer.apply(r, state, s, keys, True)[0], q, y)
            return out, pull(c)[0]

        (y, _), (dy, h) = jax.jvp(pulled, (self._params(layer, params), x, zero), (per_device(z), dx, zero))
        return (y, dy), reduce_grads(h, self.specs.grads(layer))

    def _head(self, layer, params, state, x, dx, z, batch, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))

        def loss(q, y):
            loss_sum, stats, _ = layer.loss(q, state, y, batch, keys, True)
            return loss_sum / lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)

        (_, gx), (h, dgx) = jax.jvp(lambda q, y: jax.grad(loss, argnums=(0, 1))(q, y),
                                    (self._params(layer, params), x), (per_device(z), dx))
        return reduce_grads(h, self.specs.grads(layer)), gx, dgx

    def _backward(self, layer, params, state, x, dx, z, gy, dgy, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))

        def pull(q, y, c):
            return jax.vjp(lambda r, s: layer.apply(r, state, s, keys, True)[0], q, y)[1](c)

        (_, gx), (h, dgx) = jax.jvp(pull, (self._params(layer, params), x, gy), (per_device(z), dx, dgy))
        return reduce_grads(h, self.specs.grads(layer)), gx, dgx

    def _backward_first(self, layer, params, state, x, z, gy, dgy, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))

        def pull(q, c):
            return jax.vjp(lambda r: layer.apply(r, state, x, keys, True)[0], q)[1](c)[0]

        _, h = jax.jvp(pull, (self._params(layer, params), gy), (per_device(z), dgy))
        return reduce_grads(h, self.specs.grads(layer))

    def _program(self, kind: str, layer):
        pspec = self.specs.layer(layer)[0]
        table = {  # kind: (method, in_specs, out_specs)
            "hvp_first": (self._first, (pspec, _R, _D, _R, _R, _R), (_D, _D)),
            "hvp_forward": (self._forward, (pspec, _R, _D, _D, _R, _D, _R, _R), ((_D, _D), pspec)),
            "hvp_head": (self._head, (pspec, _R, _D, _D, _R, _D, _R, _R), (pspec, _D, _D)),
            "hvp_backward": (self._backward, (pspec, _R, _D, _D, _R, _D, _D, _R, _R), (pspec, _D, _D)),
            "hvp_backward_first": (self._backward_first, (pspec, _R, _D, _R, _D, _D, _R, _R), pspec),
        }
        fn, in_specs, out_specs = table[kind]
        return self.compile(kind, layer, fn, in_specs, out_specs)

    # -- the pass --
    def products(self, params_of, states: list, batch: dict, skey, key, keep=None, bring=None) -> list:
        """Every layer's ``H z`` (a tree like its params, split over the devices as its gradient is).

        Args:
          params_of: ``params_of(i, when)`` gives layer ``i``'s weights on the device (``when``: ``"forward"`` or
            ``"backward"``, the order a streamed tier reads them in: every layer up, then every layer down).
          states: each layer's state (as the step starts).
          batch: the global batch (``{input key, targets[, weights]}``, split over ``"data"``).
          skey: the step's key (`common.step_key`): the same dropout masks as the step's own pass.
          key: the estimator's key (`Tangents.key` of the optimizer state before the update).
          keep, bring: where each layer's input and input tangent wait for the backward and how they come back
            (the tier's `revtrain.tiers.Tier.keep` and ``bring``; None: on the device).
        """
        keep = keep or (lambda v: v)
        bring = bring or (lambda v: v)
        layers = self.model.layers
        n = len(layers)
        keys = self.tangents.keys(key)
        kept, x, dx = [], batch[self.model.input_key], None
        for i in range(n - 1):
            p, z = params_of(i, "forward"), self.tangents.layer(i, keys)
            kept.append(keep((x, dx)))
            index = np.int32(i)
            if dx is None:
                x, dx = self._program("hvp_first", layers[i])(p, states[i], x, z, skey, index)
            else:
                zero = jax.tree.map(jnp.zeros_like, x)
                (x, dx), _ = self._program("hvp_forward", layers[i])(p, states[i], x, dx, z, zero, skey, index)
            del p, z
        out = [None] * n
        p, z = params_of(n - 1, "forward"), self.tangents.layer(n - 1, keys)
        out[-1], gx, dgx = self._program("hvp_head", layers[-1])(p, states[-1], x, dx, z, batch, skey, np.int32(n - 1))
        del p, z, x, dx
        for i in range(n - 2, -1, -1):
            (x, dx), p, z = bring(kept.pop()), params_of(i, "backward"), self.tangents.layer(i, keys)
            if dx is None:
                out[i] = self._program("hvp_backward_first", layers[i])(p, states[i], x, z, gx, dgx, skey, np.int32(i))
            else:
                out[i], gx, dgx = self._program("hvp_backward", layers[i])(p, states[i], x, dx, z, gx, dgx, skey,
                                                                           np.int32(i))
            del p, z, x, dx
        return out
