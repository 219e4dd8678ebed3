"""Ordinary backprop over the whole model: the exactness reference and the benchmark baseline."""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from revtrain.placement import DATA_AXIS, DEVICE_MEMORY, HOST_MEMORY, host_memory_supported, replicated
from revtrain.trainers.common import (XLA_OPTIONS, TrainerBase, TrainerError, TrainState, _Dispatch, batch_size_of,
                                      check_batch, check_finite, check_flags, example_keys, per_device, step_key,
                                      take_microbatch)
from revtrain.trainers.hessian import Tangents, whole_products
from revtrain.trainers.layerwise import LayerwiseUpdate, all_finite, guarded_update
from revtrain.tiers.device import DeviceTier
from revtrain.trainers.specs import StateSpecs
from revtrain.trainers.stacking import find_runs, groups_of


@gin.configurable
class StandardTrainer(TrainerBase):
    """One ``jax.jit`` of ``value_and_grad`` over every layer's parameters, then one optax update.

    Keeps every activation, every gradient and the whole optimizer state on the device: device memory
    grows linearly with depth. Same dropout keys and loss normalisation as ``ReversibleTrainer``, so both
    follow the same trajectory (up to float rounding). Data parallel: weights replicated, the batch split
    over ``"data"``, gradients summed over devices (the loss is the mean over the *global* batch, so the
    sum of per-device gradients is exactly pmap's averaged gradient).

    Args:
      model, optimizer, mesh, seed: see ``TrainerBase``.
      scan_layers: compute each run of consecutive identical layers (the head excepted) as one
        ``lax.scan`` over their stacked weights inside the program, instead of unrolling every layer: the
        program's size, and so its compile time, stop growing with depth (at depth 256 the unrolled
        program does not finish compiling in 15 minutes of CPU). The state keeps one entry per layer; the
        weights are stacked and the gradients unstacked inside the program.
      remat_layers: with ``scan_layers``, wrap the scan body in ``jax.checkpoint`` (keep only each layer's
        input; recompute the rest in the backward pass). XLA:CPU does not honour it for memory (docs/design.md
        section 8).
      remat_offload: with ``remat_layers``, the saved input of each scanned layer goes to host memory
        (memory kind ``pinned_host``) and comes back for the backward pass: the layer's input is named
        (``checkpoint_name``, `REMAT_NAME`) and the checkpoint policy
        ``save_and_offload_only_these_names`` offloads it (MaxText's ``offload`` remat policies), so the
        device holds no saved activations at all between the passes (one activation per layer crosses
        to the host and back instead). Needs a backend with a ``pinned_host`` memory space.
      microbatches: see ``TrainerBase``: a ``lax.scan`` over the M microbatches inside the step's program
        sums their gradients (of the summed loss, divided by the whole batch's weight at the end), then one
        optax update of the whole model.

    Tied parameters (``Model.ties``) are one leaf, held by the owner layer and put into the user layer's
    params inside the program, so backprop sums both uses' gradients. The metrics add ``grad_norm``, the
    global norm of the gradient (before any clipping the optimizer does).

    Raises:
      TrainerError: ``remat_offload`` without ``remat_layers`` and ``scan_layers``, or on a backend
        without a ``pinned_host`` memory space.
    """

    # The name of a scanned layer's input under ``remat_offload`` (the value the checkpoint policy offloads).
    REMAT_NAME = "layer_input"

    name = "standard"

    def __init__(self, model, optimizer, mesh, seed: int = 0, scan_layers: bool = False,
                 remat_layers: bool = False, remat_offload: bool = False, microbatches: int = 1):
        check_flags("StandardTrainer", scan_layers=scan_layers, remat_layers=remat_layers,
                    remat_offload=remat_offload)
        if remat_offload and not (scan_layers and remat_layers):
            raise TrainerError("StandardTrainer.remat_offload needs scan_layers = True and remat_layers = True")
        if remat_offload and not host_memory_supported(mesh):
            raise TrainerError("StandardTrainer.remat_offload needs a backend with a pinned_host memory space")
        super().__init__(model, optimizer, mesh, seed, microbatches)
        self.residency = DeviceTier(mesh)  # (device memory, replicated)
        self.specs = StateSpecs(model, optimizer, mesh.size, sharded=False)
        self.scan_layers, self.remat_layers, self.remat_offload = scan_layers, remat_layers, remat_offload
        runs = find_runs(model.layers, eligible=lambda layer: True) if scan_layers else []
        self.groups = groups_of(len(model.layers), runs)

    def memory_setup(self) -> dict:
        """The memory plan's description (`TrainerBase.memory_setup`): only each layer's input is kept with
        ``scan_layers`` and ``remat_layers``."""
        remat = self.scan_layers and self.remat_layers
        return {"trainer": "standard", "remat": remat, "tier": self.residency, "label": "StandardTrainer" + (" (scan + remat)" if remat else "")}

    def memory_knobs(self, evaluation: bool = False) -> list[str]:
        """A training step's memory is lower with the reversible trainer (`TrainerBase.memory_knobs`)."""
        return [] if evaluation else ["train.trainer = @ReversibleTrainer"]

    def init(self) -> TrainState:
        """Initial state: replicated params, layer state and one optax state for the whole list. Placed one
        layer at a time (each layer's numpy values dropped once placed), so host memory never holds the whole
        model twice."""
        params, states = [], []
        for i in range(len(self.model.layers)):
            p, s = self.model.init_layer(i)
            params.append(self.replicate(p))
            states.append(self.replicate(s))
            del p, s
        return TrainState(0, params, [self.replicate(self.tx.init(params))], states)

    def abstract_state(self) -> TrainState:
        """The state as ``jax.ShapeDtypeStruct`` leaves with `init`'s shardings: a checkpoint is restored
        into place from it without building a state first."""
        rep = replicated(self.mesh)
        spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)  # noqa: E731
        shapes = self.model.param_shapes()
        return TrainState(0, spec(shapes), [spec(jax.eval_shape(self.tx.init, shapes))],
                          spec(self.model.state_shapes()))

    def grads(self, params, states, batch, skey, normalize: bool = True):
        """Whole-model backprop inside ``shard_map``: ``(mean loss, grads summed over devices, stats,
        new layer states, total weight)``. Shared with `revtrain check`. ``normalize=False``: the loss and
        gradient of the summed loss (not divided by the total weight; a microbatch's part)."""
        objective = self.objective(states, batch, skey, normalize)
        (obj, (stats, new_states, total)), grads = jax.value_and_grad(objective, has_aux=True)(per_device(params))
        return obj, lax.psum(grads, DATA_AXIS), stats, new_states, total

    def objective(self, states, batch, skey, normalize: bool = True):
        """Inside ``shard_map``: the loss of this device's examples as a function of every layer's params,
        ``params -> (loss, (stats, new layer states, total weight))``, the loss normalised by the global batch's
        weight (``normalize=False``: the summed loss)."""
        layers, model = self.model.layers, self.model
        b = batch_size_of(batch)

        def run(start, count, params, states, x):
            """Layers ``start .. start + count - 1`` (identical) as one scan over their stacked trees."""
            layer = layers[start]

            def body(x, slices):
                p, s, j = slices
                if self.remat_offload:  # every use of the input goes through the offloaded name
                    x = checkpoint_name(x, self.REMAT_NAME)
                return layer.apply(p, s, x, example_keys(skey, start + j, b), True)

            if self.remat_offload:
                body = jax.checkpoint(body, policy=jax.checkpoint_policies.save_and_offload_only_these_names(
                    names_which_can_be_saved=[], names_which_can_be_offloaded=[self.REMAT_NAME],
                    offload_src=DEVICE_MEMORY, offload_dst=HOST_MEMORY))
            elif self.remat_layers:
                body = jax.checkpoint(body)
            stacked = [jax.tree.map(lambda *v: jnp.stack(v), *trees) for trees in (params, states)]
            x, new = lax.scan(body, x, (*stacked, jnp.arange(count, dtype=jnp.int32)))
            return x, [jax.tree.map(lambda v, k=k: v[k], new) for k in range(count)]

        def objective(params):
            params = [model.merge_tied(i, p, params) if model.ties_of(i) else p for i, p in enumerate(params)]
            x = batch[self.model.input_key]
            new_states = []
            for start, count in self.groups[:-1]:
                if count > 1:
                    x, ns = run(start, count, params[start:start + count], states[start:start + count], x)
                    new_states.extend(ns)
                    continue
                x, ns = layers[start].apply(params[start], states[start], x, example_keys(skey, start, b), True)
                new_states.append(ns)
            loss_sum, stats, ns = layers[-1].loss(params[-1], states[-1], x, batch,
                                                  example_keys(skey, len(layers) - 1, b), True)
            new_states.append(ns)
            total = lax.psum(lax.stop_gradient(stats["weight"]), DATA_AXIS)
            return (loss_sum / total if normalize else loss_sum), (stats, new_states, total)

        return objective

    def _accumulated(self, params, states, batch, skey):
        """``grads`` of M microbatches (`take_microbatch`), one ``lax.scan``: the summed loss's gradient and
        statistics of each, the layer states carried from one to the next, all divided by the whole
        batch's weight at the end."""
        m_count, b = self.microbatches, batch_size_of(batch)

        def body(carry, m):
            states, acc = carry
            where = jnp.stack([m * (b // m_count), b]).astype(jnp.int32)
            obj, grads, stats, new_states, total = self.grads(params, states, take_microbatch(batch, m, m_count),
                                                              (skey, where), normalize=False)
            sums = (lax.psum(obj, DATA_AXIS), lax.psum(stats["correct"], DATA_AXIS), total)
            acc = jax.tree.map(jnp.add, acc, (grads, sums)) if acc is not None else (grads, sums)
            return (new_states, acc), None

        # The first microbatch outside the scan gives the accumulator its structure (and no zeros are added).
        (states, acc), _ = body((states, None), jnp.int32(0))
        (states, (grads, (loss_sum, correct, total))), _ = lax.scan(body, (states, acc),
                                                                    jnp.arange(1, m_count, dtype=jnp.int32))
        grads = jax.tree.map(lambda g: g / total, grads)
        return loss_sum / total, grads, {"correct": correct}, states, total

    def _products(self, params, states, batch, skey, z):
        """The whole model's Hessian-vector product ``H z`` for optax's Hutchinson estimator (`hessian`)."""
        objective = self.objective(states, batch, skey)
        return whole_products(lambda p: objective(p)[0], params, z)

    def _step(self, params, opt_state, states, batch, skey, hvp=None):
        if self.microbatches == 1:
            obj, grads, stats, new_states, total = self.grads(params, states, batch, skey)
            loss = lax.psum(obj, DATA_AXIS)  # the global mean (identical on every device)
            correct = lax.psum(stats["correct"], DATA_AXIS)
        else:
            loss, grads, stats, new_states, total = self._accumulated(params, states, batch, skey)
            correct = stats["correct"]
        finite = jnp.stack([all_finite(g) for g in grads])
        # An optimizer that reads the step's loss (``value``) gets the loss as logged: the mean over the
        # microbatches and devices.
        new_params, new_opt, _ = guarded_update(self.tx, grads, opt_state, params,
                                                ok=jnp.logical_and(jnp.isfinite(loss), jnp.all(finite)),
                                                value=loss.astype(jnp.float32) if self.takes_value else None,
                                                hvp=hvp)
        metrics = {"loss": loss, "accuracy": correct / total, "grad_norm": optax.global_norm(grads)}
        return new_params, new_opt, new_states, metrics, finite

    def step_program(self):
        """The whole step as one program, ``(params, optimizer state, layer states, batch, step key) -> (params,
        optimizer state, layer states, metrics, finite flags)``: ``jit(shard_map(...))`` over the mesh, the
        weights and optimizer state donated; `train_step` calls it, the memory plan compiles it for its
        temporaries (`revtrain.planning.costs`)."""
        if "step" not in self._cache:
            # (an optimizer with optax's Hutchinson estimator takes the step's Hessian-vector product too)
            mapped = jax.shard_map(self._step, mesh=self.mesh,
                                   in_specs=(P(), P(), P(), P(DATA_AXIS), P()) + ((P(),) if self.takes_hvp else ()),
                                   out_specs=(P(), P(), P(), P(), P()))
            self._cache["step"] = _Dispatch(jax.jit(mapped, donate_argnums=(0, 1), compiler_options=XLA_OPTIONS),
                                            self)
        return self._cache["step"]

    def _hessian(self, ts: TrainState, batch: dict, skey):
        """``H z`` of the whole model for the step (`hessian.whole_products`), on the tangent optax's Hutchinson
        estimator draws from the state's key (`hessian.Tangents`); zeros on a step whose update does not read it
        (Sophia between its ``update_interval`` steps: `layerwise.LayerwiseUpdate.products_needed`)."""
        if "products" not in self._cache:
            mapped = jax.shard_map(self._products, mesh=self.mesh, in_specs=(P(), P(), P(DATA_AXIS), P(), P()),
                                   out_specs=P())
            split = LayerwiseUpdate(self.tx, self.model.param_shapes())
            needed = jax.jit(lambda opt: split.products_needed(split.whole_global_leaves(opt)))
            # (placed as the products program places its result: the step's arguments keep one sharding, so
            # the step compiles once for both kinds of step)
            zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=replicated(self.mesh))
            self._cache["products"] = (Tangents(self.model.param_shapes()),
                                       jax.jit(mapped, compiler_options=XLA_OPTIONS), needed, zeros)
        tangents, program, needed, zeros = self._cache["products"]
        flag = needed(ts.opt_state[0])
        if flag is not None and not bool(flag):
            return zeros(ts.params)
        z = tangents.whole(Tangents.key(ts.opt_state[0]))
        return program(ts.params, ts.layer_state, batch, skey, z)

    def train_step(self, ts: TrainState, batch: dict):
        """One step of ordinary backprop. Returns ``(new_state, metrics)`` (``loss``, ``accuracy``).

        Raises:
          TrainerError: the batch size is not divisible by the number of devices.
        """
        check_batch(batch, self.num_devices, self.microbatches)
        skey = step_key(self.seed, ts.step)
        # optax's Hutchinson estimator: H z on the tangent it draws, its own program (`hessian`), before the step
        more = (self._hessian(ts, batch, skey),) if self.takes_hvp else ()
        params, opt, states, metrics, finite = self.step_program()(ts.params, ts.opt_state[0], ts.layer_state,
                                                                   batch, skey, *more)
        new_ts = TrainState(ts.step + 1, params, [opt], states)
        check_finite(TrainState(ts.step + 1, params, [opt], ts.layer_state), metrics, [finite], self.model.layers)
        return new_ts, metrics
