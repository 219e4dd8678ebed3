"""The memory-efficient reversible trainer (DESIGN.md section 2).

Forward: layer by layer, keeping only the current activation; a standard layer's input is saved (it cannot
be rebuilt), a reversible layer's output replaces its input. Head: one fused call computes the loss, its
``vjp`` with respect to (head params, head input), the gradient sum over devices and the head's optimizer
update. Backward, in reverse order, one fused call per layer ("reverse and update"): rebuild the inputs
from the outputs with the same per-example dropout keys as the forward, ``vjp`` of the forward at the
rebuilt inputs with the old weights, sum the parameter gradients over devices, apply this layer's optax
update, and hand the input cotangent to the layer below. A standard layer is recomputed from its saved
input (rematerialisation) and the walk continues from that saved input, which also resets reconstruction
drift at every block boundary. At most one layer's gradients exist at a time.

With ``offload=True`` every layer's weights and optimizer state live in host memory (memory kind
``pinned_host``, replicated) between uses; the trainer copies the next layer to the device while the
current one computes (JAX dispatch is asynchronous) and writes updated weights and state back to host
memory without blocking. Saved standard-layer inputs go to host memory too. At most two layers' weights +
optimizer state are on the device at any time.

Reference: Trax ``ReversibleSerialTrainer`` (trax/optimizers/trainer.py); Gomez et al., "The Reversible
Residual Network", NeurIPS 2017; Kitaev et al., "Reformer", ICLR 2020.
"""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, DEVICE_MEMORY, HOST_MEMORY, host_memory_supported, replicated
from revtrain.trainers.common import (TrainerBase, TrainerError, TrainState, apply_updates, batch_size_of,
                                      check_per_layer_optimizer, example_keys, step_key)

_R, _D = P(), P(DATA_AXIS)


def _is_float_tree(tree) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(tree))


@gin.configurable
class ReversibleTrainer(TrainerBase):
    """Reversible backprop with fused per-layer optimizer updates and optional per-layer host offload.

    Args:
      model, optimizer, mesh, seed: see ``TrainerBase``.
      offload: keep weights, optimizer state and saved standard-layer inputs in host memory between uses.

    Raises:
      TrainerError: the optimizer couples leaves (see ``check_per_layer_optimizer``), or offload was asked
        for on a backend without a ``pinned_host`` memory space.

    The ``TrainState`` passed to ``train_step`` is consumed (its device buffers are donated).
    """

    name = "reversible"

    def __init__(self, model, optimizer, mesh, seed: int = 0, offload: bool = False):
        super().__init__(model, optimizer, mesh, seed)
        check_per_layer_optimizer(optimizer)
        if offload and not host_memory_supported(mesh):
            raise TrainerError("offload needs a backend with a pinned_host memory space")
        self.offload = offload
        self._host = replicated(mesh, HOST_MEMORY) if offload else None
        self._device = replicated(mesh, DEVICE_MEMORY) if offload else None

    # -- placement -------------------------------------------------------------------------------
    def _to_device(self, tree):
        if not self.offload:
            return tree
        return jax.tree.map(lambda x: jax.device_put(x, self._device), tree)

    def _to_host(self, tree):
        if not self.offload:
            return tree
        return jax.tree.map(lambda x: jax.device_put(x, self._host), tree)

    def _act_to_host(self, tree):
        if not self.offload:
            return tree
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY)), tree)

    def _act_to_device(self, tree):
        if not self.offload:
            return tree
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(DEVICE_MEMORY)), tree)

    def layer_params(self, ts: TrainState, i: int):
        return self._to_device(ts.params[i])

    def init(self) -> TrainState:
        """Initial state: per-layer params and optax states, replicated (in host memory when offloading)."""
        params, state = self.model.init()
        params = self.replicate(params)
        opt_state = [self.tx.init(p) for p in params]
        opt_state = self.replicate(opt_state)
        return TrainState(0, self._to_host(params), self._to_host(opt_state), self.replicate(state))

    # -- the per-layer fused functions (run inside shard_map over "data") ---------------------------
    @staticmethod
    def _forward(layer, params, state, x, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        return layer.apply(params, state, x, keys, True)

    def _head(self, layer, params, opt_state, state, x, batch, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))

        def objective(p, x):
            loss_sum, stats, new_state = layer.loss(p, state, x, batch, keys, True)
            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
            return loss_sum / total, (stats, new_state, total)

        obj, vjp_fn, (stats, new_state, total) = jax.vjp(objective, params, x, has_aux=True)
        grads, dx = vjp_fn(jnp.ones_like(obj))
        grads = lax.psum(grads, DATA_AXIS)
        new_params, new_opt = apply_updates(self.tx, grads, opt_state, params)
        metrics = {"loss": lax.psum(obj, DATA_AXIS), "accuracy": lax.psum(stats["correct"], DATA_AXIS) / total}
        return dx, new_params, new_opt, new_state, metrics

    def _reverse_and_update(self, layer, params, opt_state, state, y, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(y))
        x = lax.stop_gradient(layer.inverse(params, state, y, keys))
        _, vjp_fn = jax.vjp(lambda p, x: layer.apply(p, state, x, keys, True)[0], params, x)
        grads, dx = vjp_fn(dy)
        grads = lax.psum(grads, DATA_AXIS)
        new_params, new_opt = apply_updates(self.tx, grads, opt_state, params)
        return x, dx, new_params, new_opt

    def _recompute_and_update(self, layer, params, opt_state, state, x, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        if _is_float_tree(x):
            _, vjp_fn = jax.vjp(lambda p, x: layer.apply(p, state, x, keys, True)[0], params, x)
            grads, dx = vjp_fn(dy)
        else:  # integer inputs (token ids) have no cotangent
            _, vjp_fn = jax.vjp(lambda p: layer.apply(p, state, x, keys, True)[0], params)
            (grads,), dx = vjp_fn(dy), None
        grads = lax.psum(grads, DATA_AXIS)
        new_params, new_opt = apply_updates(self.tx, grads, opt_state, params)
        return dx, new_params, new_opt

    def _fn(self, kind, layer):
        if kind == "forward_rev":
            return self._compiled(kind, layer, self._forward, (_R, _R, _D, _R, _R), (_D, _R), donate=(2,))
        if kind == "forward_std":
            return self._compiled(kind, layer, self._forward, (_R, _R, _D, _R, _R), (_D, _R))
        if kind == "head":
            return self._compiled(kind, layer, self._head, (_R, _R, _R, _D, _D, _R, _R), (_D, _R, _R, _R, _R),
                                  donate=(0, 1))
        if kind == "reverse":
            return self._compiled(kind, layer, self._reverse_and_update, (_R, _R, _R, _D, _D, _R, _R),
                                  (_D, _D, _R, _R), donate=(0, 1, 3, 4))
        if kind == "recompute":
            return self._compiled(kind, layer, self._recompute_and_update, (_R, _R, _R, _D, _D, _R, _R),
                                  (_D, _R, _R), donate=(0, 1, 4))
        raise KeyError(kind)

    # -- one step --------------------------------------------------------------------------------
    def train_step(self, ts: TrainState, batch: dict):
        """One reversible training step.

        Args:
          ts: the state (consumed: its device buffers are donated).
          batch: dict of global arrays split over ``"data"`` (input key, ``targets``, optional ``weights``).

        Returns:
          ``(new_state, metrics)``; metrics are replicated float32 scalars ``loss`` (mean over the global
          batch, nats) and ``accuracy``.
        """
        layers = self.model.layers
        n = len(layers)
        skey = step_key(self.seed, ts.step)
        index = [jnp.int32(i) for i in range(n)]
        params, opt_state = list(ts.params), list(ts.opt_state)
        new_state = list(ts.layer_state)
        saved = {}

        # Forward: keep only the current activation (+ the inputs of standard layers).
        x = batch[self.model.input_key]
        nxt = self._to_device(params[0])
        for i, layer in enumerate(layers[:-1]):
            p, nxt = nxt, self._to_device(params[i + 1])  # prefetch the next layer while this one runs
            if layer.reversible:
                x, new_state[i] = self._fn("forward_rev", layer)(p, ts.layer_state[i], x, skey, index[i])
            else:
                saved[i] = self._act_to_host(x)
                x, new_state[i] = self._fn("forward_std", layer)(p, ts.layer_state[i], x, skey, index[i])
            del p

        # Head: loss, vjp and update in one call.
        hp, ho = nxt, self._to_device(opt_state[n - 1])
        nxt = (self._to_device(params[n - 2]), self._to_device(opt_state[n - 2])) if n > 1 else None
        dy, hp, ho, new_state[n - 1], metrics = self._fn("head", layers[-1])(
            hp, ho, ts.layer_state[n - 1], x, batch, skey, index[n - 1])
        params[n - 1], opt_state[n - 1] = self._to_host(hp), self._to_host(ho)
        del hp, ho

        # Backward: reverse-and-update each layer, newest first.
        y = x
        for i in range(n - 2, -1, -1):
            layer = layers[i]
            (p, o), nxt = nxt, ((self._to_device(params[i - 1]), self._to_device(opt_state[i - 1])) if i else None)
            if layer.reversible:
                y, dy, p, o = self._fn("reverse", layer)(p, o, ts.layer_state[i], y, dy, skey, index[i])
            else:
                xs = self._act_to_device(saved.pop(i))
                dy, p, o = self._fn("recompute", layer)(p, o, ts.layer_state[i], xs, dy, skey, index[i])
                y = xs
            params[i], opt_state[i] = self._to_host(p), self._to_host(o)
            del p, o
        return TrainState(ts.step + 1, params, opt_state, new_state), metrics
