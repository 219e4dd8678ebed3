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
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from revtrain.placement import (DATA_AXIS, DEVICE_MEMORY, HOST_MEMORY, host_memory_supported, put_replicated,
                                replicated)
from revtrain.trainers.common import (TrainerBase, TrainerError, TrainState, batch_size_of, check_finite, guarded_update,
                                      check_batch, check_per_layer_optimizer, example_keys, per_device, step_key)

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

    def _wait(self, tree) -> None:
        """With offload, blocks until ``tree`` is computed (bounds the layers resident on the device)."""
        if self.offload and tree is not None:
            jax.block_until_ready(tree)

    def layer_params(self, ts: TrainState, i: int):
        return self._to_device(ts.params[i])

    def init(self) -> TrainState:
        """Initial state: per-layer params and optax states, replicated (in host memory when offloading)."""
        params, state = self.model.init()
        kind = HOST_MEMORY if self.offload else None
        # Layer by layer, so that at most one layer's weights and optimizer state pass through the device.
        new_params, opt_state = [], []
        for p in params:
            opt = jax.tree.map(np.array, self.tx.init(p))  # a host copy (np.asarray may alias on CPU)
            new_params.append(put_replicated(p, self.mesh, kind))
            opt_state.append(put_replicated(opt, self.mesh, kind))
        return TrainState(0, new_params, opt_state, self.replicate(state))

    # -- the per-layer fused functions (run inside shard_map over "data") ---------------------------
    @staticmethod
    def _forward(layer, params, state, x, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        return layer.apply(params, state, x, keys, True)

    # The gradient halves, shared with `revtrain check`: gradients are summed over devices ("data").
    @staticmethod
    def head_grads(layer, params, state, x, batch, keys):
        """Loss and ``vjp`` of the head: returns ``(mean loss, grads, dx, stats, new_state, total weight)``."""
        def objective(p, x):
            loss_sum, stats, new_state = layer.loss(p, state, x, batch, keys, True)
            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
            return loss_sum / total, (stats, new_state, total)

        obj, vjp_fn, (stats, new_state, total) = jax.vjp(objective, per_device(params), x, has_aux=True)
        grads, dx = vjp_fn(jnp.ones_like(obj))
        return obj, lax.psum(grads, DATA_AXIS), dx, stats, new_state, total

    @staticmethod
    def reverse_grads(layer, params, state, y, dy, keys):
        """Rebuilds a reversible layer's input from its output ``y`` and takes the ``vjp`` there with the
        given weights: returns ``(x, dx, grads)``."""
        # The barrier keeps XLA from merging the rebuild's F and G with the vjp's recomputation of them:
        # merged, F's intermediates also feed the backward, XLA fuses and lays them out differently, and
        # F (rebuild) no longer equals F (forward) to the bit; the error then grows layer by layer down
        # the network (measured on the trained default model: 5.1e-6 relative at the bottom block; with
        # the barrier the rebuild is exact wherever the streams stay on the fixed-point grid). Cost: F is
        # evaluated once more per layer (about 1% of a step at d_model 256, sequence 512, on CPU).
        x = lax.optimization_barrier(lax.stop_gradient(layer.inverse(params, state, y, keys)))
        _, vjp_fn = jax.vjp(lambda p, x: layer.apply(p, state, x, keys, True)[0], per_device(params), x)
        grads, dx = vjp_fn(dy)
        return x, dx, lax.psum(grads, DATA_AXIS)

    @staticmethod
    def recompute_grads(layer, params, state, x, dy, keys):
        """Recomputes a standard layer from its saved input under ``vjp``: returns ``(dx, grads)``; ``dx``
        is None for integer inputs (token ids have no cotangent)."""
        if _is_float_tree(x):
            _, vjp_fn = jax.vjp(lambda p, x: layer.apply(p, state, x, keys, True)[0], per_device(params), x)
            grads, dx = vjp_fn(dy)
        else:
            _, vjp_fn = jax.vjp(lambda p: layer.apply(p, state, x, keys, True)[0], per_device(params))
            (grads,), dx = vjp_fn(dy), None
        return dx, lax.psum(grads, DATA_AXIS)

    def _head(self, layer, params, opt_state, state, x, batch, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        obj, grads, dx, stats, new_state, total = self.head_grads(layer, params, state, x, batch, keys)
        loss = lax.psum(obj, DATA_AXIS)  # the global mean (identical on every device)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params, ok=jnp.isfinite(loss))
        metrics = {"loss": loss, "accuracy": lax.psum(stats["correct"], DATA_AXIS) / total}
        return dx, new_params, new_opt, new_state, metrics, finite

    def _reverse_and_update(self, layer, params, opt_state, state, y, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(y))
        x, dx, grads = self.reverse_grads(layer, params, state, y, dy, keys)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params)
        return x, dx, new_params, new_opt, finite

    def _recompute_and_update(self, layer, params, opt_state, state, x, dy, skey, index):
        keys = example_keys(skey, index, batch_size_of(x))
        dx, grads = self.recompute_grads(layer, params, state, x, dy, keys)
        new_params, new_opt, finite = guarded_update(self.tx, grads, opt_state, params)
        return dx, new_params, new_opt, finite

    def _fn(self, kind, layer):
        if kind == "forward_rev":
            return self._compiled(kind, layer, self._forward, (_R, _R, _D, _R, _R), (_D, _R), donate=(2,))
        if kind == "forward_std":
            return self._compiled(kind, layer, self._forward, (_R, _R, _D, _R, _R), (_D, _R))
        if kind == "head":
            return self._compiled(kind, layer, self._head, (_R, _R, _R, _D, _D, _R, _R),
                                  (_D, _R, _R, _R, _R, _R), donate=(0, 1))
        if kind == "reverse":
            return self._compiled(kind, layer, self._reverse_and_update, (_R, _R, _R, _D, _D, _R, _R),
                                  (_D, _D, _R, _R, _R), donate=(0, 1, 3, 4))
        if kind == "recompute":
            return self._compiled(kind, layer, self._recompute_and_update, (_R, _R, _R, _D, _D, _R, _R),
                                  (_D, _R, _R, _R), donate=(0, 1, 4))
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

        Raises:
          TrainerError: the batch size is not divisible by the number of devices.
        """
        check_batch(batch, self.num_devices)
        layers = self.model.layers
        n = len(layers)
        skey = step_key(self.seed, ts.step)
        index = [np.int32(i) for i in range(n)]  # host scalars: nothing per layer stays on the device
        params, opt_state = list(ts.params), list(ts.opt_state)
        new_state = list(ts.layer_state)
        saved = {}

        # With offload, at most two layers' weights (+ optimizer state) are on the device at any time:
        # the one computing and the one in flight (prefetched, or being written back). JAX dispatch is
        # asynchronous, so the loop waits (`_wait`) for the previous layer before it moves another one:
        # the device is never idle for more than one dispatch, and the Python loop cannot run ahead and
        # fill device memory with every layer's weights.

        # Forward: keep only the current activation (+ the inputs of standard layers).
        x = batch[self.model.input_key]
        cur = self._to_device(params[0])
        head_opt = None
        for i, layer in enumerate(layers[:-1]):
            self._wait(x)  # layer i-1 has finished: its weights have left the device
            if layer.reversible:
                x, new_state[i] = self._fn("forward_rev", layer)(cur, ts.layer_state[i], x, skey, index[i])
            else:
                saved[i] = self._act_to_host(x)
                x, new_state[i] = self._fn("forward_std", layer)(cur, ts.layer_state[i], x, skey, index[i])
            cur = self._to_device(params[i + 1])  # prefetch the next layer while this one runs
            if i + 1 == n - 1:
                head_opt = self._to_device(opt_state[n - 1])

        # Head: loss, vjp and update in one call.
        self._wait(x)
        if head_opt is None:  # a model that is only a head
            head_opt = self._to_device(opt_state[n - 1])
        finite = [None] * n
        dy, hp, ho, new_state[n - 1], metrics, finite[n - 1] = self._fn("head", layers[-1])(
            cur, head_opt, ts.layer_state[n - 1], x, batch, skey, index[n - 1])
        del cur, head_opt
        nxt = (self._to_device(params[n - 2]), self._to_device(opt_state[n - 2])) if n > 1 else None
        params[n - 1], opt_state[n - 1] = written = (self._to_host(hp), self._to_host(ho))
        del hp, ho

        # Backward: reverse-and-update each layer, newest first.
        y = x
        for i in range(n - 2, -1, -1):
            layer = layers[i]
            self._wait((y, dy))  # layer i+1 has finished computing
            (p, o), nxt = nxt, None
            if layer.reversible:
                y, dy, p, o, finite[i] = self._fn("reverse", layer)(p, o, ts.layer_state[i], y, dy, skey, index[i])
            else:
                xs = self._act_to_device(saved.pop(i))
                dy, p, o, finite[i] = self._fn("recompute", layer)(p, o, ts.layer_state[i], xs, dy, skey, index[i])
                y = xs
            self._wait(written)  # layer i+1's updated weights are back in host memory
            if i:
                nxt = (self._to_device(params[i - 1]), self._to_device(opt_state[i - 1]))
            params[i], opt_state[i] = written = (self._to_host(p), self._to_host(o))
            del p, o
        self._wait(written)
        new_ts = TrainState(ts.step + 1, params, opt_state, new_state)
        check_finite(new_ts, ts.layer_state, metrics, finite, layers)
        return new_ts, metrics
