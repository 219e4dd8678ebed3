"""The layer protocol: Flax NNX modules seen as pure functions of (params, state).

A model is a list of layers (docs/design.md section 2). Every layer wraps one Flax NNX module and exposes it as
pure functions of plain-dict pytrees, which is what the trainers need to place, donate, checkpoint and
update each layer on its own:

* ``Layer.apply(params, state, x, keys, train) -> (y, new_state)``: a standard layer.
* ``ReversibleLayer`` adds ``inverse(params, state, y, keys) -> x``: the exact inverse of ``apply`` in
  training mode for the same ``keys`` (same dropout masks). It never returns state.
* ``HeadLayer`` adds ``loss(params, state, x, batch, keys, train) -> (loss_sum, stats, new_state)``.

``params`` and ``state`` are nested dicts of arrays (``nnx.to_pure_dict`` form): ``params`` holds the
module's ``nnx.Param`` variables, ``state`` every other variable (e.g. batch-norm running statistics).

Optional incremental decoding (autoregressive sampling with a key/value cache; `revtrain.sample`): a
layer whose module implements ``init_cache(batch_size, max_len)`` and ``decode(x, cache, pos)`` (see
`supports_decoding`) offers

* ``Layer.init_cache(batch_size, max_len) -> cache``: the layer's empty cache (a pytree of arrays; ``{}``
  for a layer that acts on each position on its own);
* ``Layer.decode(params, state, x, cache, pos) -> (y, new_cache)``: the evaluation-mode forward of ``S``
  consecutive positions ``pos .. pos + S - 1`` of a sequence whose positions ``0 .. pos - 1`` are already
  in ``cache``. It computes what ``apply(..., train=False)`` computes at those positions of the whole
  sequence (same LayerNorms, same ``snap_to_grid`` rounding, same position embedding); for the head,
  ``y`` is the logits.

``keys`` is a uint32 array of shape ``[B, 2]``: one raw PRNG key per example of the (local) batch, derived
by the trainer from ``(seed, step, layer index, global example index)``. Dropout masks therefore depend only
on the example, not on how the batch is split over devices, so 1 device and N devices give the same
trajectory. ``keys`` is ``None`` when ``train`` is False.

Layers compare equal (and hash equal) when their modules have the same structure, so the trainers'
``jax.jit`` caches compile one executable per distinct layer and identical blocks share it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

PyTree = Any


def split_keys(keys: jax.Array | None, index: int) -> jax.Array | None:
    """Derives an independent per-example key array for sub-module ``index``.

    Args:
      keys: uint32 ``[B, 2]`` per-example keys, or None (evaluation).
      index: small integer naming the consumer (e.g. 0 for F, 1 for G of a coupling).

    Returns:
      uint32 ``[B, 2]`` keys (``jax.random.fold_in`` of each row), or None when ``keys`` is None.
    """
    if keys is None:
        return None
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, index)


def dropout(x: jax.Array, rate: float, keys: jax.Array | None, train: bool) -> jax.Array:
    """Inverted dropout with one PRNG key per example.

    Args:
      x: array ``[B, ...]`` (any float dtype).
      rate: probability of zeroing an element, in ``[0, 1)``.
      keys: uint32 ``[B, 2]`` per-example keys; the mask of example ``b`` depends only on ``keys[b]``.
      train: when False (or ``rate == 0``) returns ``x`` unchanged.

    Returns:
      Array like ``x``: kept elements scaled by ``1 / (1 - rate)``.
    """
    if not train or rate == 0.0:
        return x
    if keys is None:
        raise ValueError("dropout in training mode needs per-example keys")
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def snap_to_grid(x: jax.Array, bits: int | None) -> jax.Array:
    """Rounds ``x`` to the nearest multiple of ``2**-bits`` (identity when ``bits`` is None).

    This makes the additive couplings of a reversible stream exact in floating point (fixed-point
    arithmetic in a float container, as in MacKay et al., "Reversible Recurrent Neural Networks", NeurIPS
    2018): when the stream and every increment added to it are multiples of ``2**-bits`` and the stream
    stays below ``2**(mantissa_bits + 1 - bits)`` in magnitude (16 for float32 and ``bits=20``), ``y = x + d``
    is computed without rounding, so ``y - d`` gives back ``x`` bit for bit. Plain float addition is not
    invertible: in the Transformer LM, ``(x + d) - d`` misses ``x`` in the last bits for 20-60% of the
    elements, and a chain of rebuilt layers compounds those errors. Beyond that range the additions round
    as usual (the rebuild is then only approximately exact). The rounding error, at most
    ``2**-(bits + 1)``, is far below bfloat16 resolution (measured: the same training loss to 4 decimals
    over 300 steps with and without it).

    The derivative is the identity (straight-through): gradients are those of the unrounded model at the
    rounded points, for every trainer alike.

    Args:
      x: floating array.
      bits: grid resolution ``2**-bits``, or None for no rounding.

    Returns:
      Array like ``x``.
    """
    if bits is None:
        return x
    scale = 2.0 ** bits  # scaling by a power of two is exact
    return jnp.round(x * scale) / scale


@snap_to_grid.defjvp
def _snap_to_grid_jvp(bits, primals, tangents):
    return snap_to_grid(primals[0], bits), tangents[0]


def cross_entropy_sums(logits: jax.Array, batch: dict):
    """Softmax cross-entropy summed over the local batch, for a head's ``loss``.

    Args:
      logits: float32 ``[..., C]`` (``[B, C]`` for a classifier, ``[B, T, C]`` for a language model).
      batch: ``targets`` int32 ``logits.shape[:-1]``; optional ``weights`` float32 of the same shape
        (0 for padding).

    Returns:
      ``(loss_sum, {"weight": sum of weights, "correct": weighted count of argmax hits})``, float32
      scalars; the loss is in nats.
    """
    targets = batch["targets"]
    weights = batch.get("weights")
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(loss * weights), {"weight": jnp.sum(weights), "correct": jnp.sum(correct * weights)}


class ReversibleCoupling(nnx.Module):
    """Additive reversible coupling of two streams (RevNet, Gomez et al. 2017; Reformer, Kitaev et al. 2020).

    Shared by every model family: F and G are any NNX modules with ``__call__(x, *, keys, train)`` (for the
    Transformer LM: attention and feed-forward on ``[B, T, D]``; for the RevNet: small conv stacks on
    ``[B, H, W, C/2]``).

    ``(x1, x2) -> (y1, y2)`` with ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)``; all arrays ``[B, T, D]``.
    F gets the per-example keys folded with 0, G with 1, so ``inverse`` reproduces the same dropout masks.
    With ``grid_bits`` set, F and G outputs are rounded to multiples of ``2**-grid_bits`` (``snap_to_grid``)
    so that, for streams on that grid, ``inverse`` is exact to the bit.
    """

    def __init__(self, f: nnx.Module, g: nnx.Module, grid_bits: int | None = None):
        self.f = f
        self.g = g
        self.grid_bits = grid_bits

    def _f(self, x, keys, train):
        return snap_to_grid(self.f(x, keys=split_keys(keys, 0), train=train), self.grid_bits)

    def _g(self, x, keys, train):
        return snap_to_grid(self.g(x, keys=split_keys(keys, 1), train=train), self.grid_bits)

    def __call__(self, x, *, keys, train):
        x1, x2 = x
        y1 = x1 + self._f(x2, keys, train)
        y2 = x2 + self._g(y1, keys, train)
        return (y1, y2)

    def half_residuals(self, *, keys):
        """The coupling as additive half-residual steps, in forward order (the fused rebuild's recipe; see
        `ReversibleLayer.fused_reverse_vjp`): ``[(0, 1, F), (1, 0, G)]``, i.e. ``stream[0] += F(stream[1])``, then
        ``stream[1] += G(stream[0])``, each function rounded to the grid and with its own keys exactly as in
        ``__call__`` (training mode)."""
        return [(0, 1, lambda x: self._f(x, keys, True)), (1, 0, lambda x: self._g(x, keys, True))]

    def inverse(self, y, *, keys):
        y1, y2 = y
        x2 = y2 - self._g(y1, keys, True)
        x1 = y1 - self._f(x2, keys, True)
        return (x1, x2)

    # -- incremental decoding (when F and G support it: `supports_decoding`) --
    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """The caches of F and G: ``{"f": ..., "g": ...}``."""
        return {"f": self.f.init_cache(batch_size, max_len), "g": self.g.init_cache(batch_size, max_len)}

    def decode(self, x, cache, pos):
        """The evaluation-mode coupling at positions ``pos .. pos + S - 1`` (streams ``[B, S, D]``), F and
        G run incrementally with their caches and rounded to the grid exactly as in ``__call__``.
        Returns ``((y1, y2), new_cache)``."""
        x1, x2 = x
        f, cache_f = self.f.decode(x2, cache["f"], pos)
        y1 = x1 + snap_to_grid(f, self.grid_bits)
        g, cache_g = self.g.decode(y1, cache["g"], pos)
        y2 = x2 + snap_to_grid(g, self.grid_bits)
        return (y1, y2), {"f": cache_f, "g": cache_g}


class PositionWise:
    """Mixin: the decode interface of a module that acts on every position on its own (no cache).

    ``decode(x, cache, pos)`` is ``__call__(x, keys=None, train=False)`` on the given positions, so it is
    the training forward's own code.
    """

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """No cache: ``{}``."""
        del batch_size, max_len
        return {}

    def decode(self, x, cache, pos):
        """``(self(x, keys=None, train=False), cache)``."""
        del pos
        return self(x, keys=None, train=False), cache


def supports_decoding(module) -> bool:
    """Whether an NNX module implements incremental decoding (``init_cache`` and ``decode``).

    A `ReversibleCoupling` does when both its F and G do (the Transformer LM's attention and feed-forward;
    the RevNet's convolutions do not).
    """
    if isinstance(module, ReversibleCoupling):
        return supports_decoding(module.f) and supports_decoding(module.g)
    return callable(getattr(module, "init_cache", None)) and callable(getattr(module, "decode", None))


def _host_copy(state) -> dict:
    """``nnx.to_pure_dict(state)`` with every value copied to a host numpy array.

    Copies (``np.array``), not views: a view of a CPU jax array keeps that buffer as an external reference, so
    an array placed from it could never be donated (measured: every weight copied in the first step). Written
    out rather than ``nnx.to_pure_dict``: Flax's flattening (``traversals.flatten_to_sequence``, a recursive
    closure) leaves every variable it visits in a reference cycle, so the module's device arrays would outlive
    the call until Python's cycle collector runs, and a model made layer by layer would hold several layers on
    the device at once (measured: 4 of 6 blocks alive while the fifth was made). Empty sub-dicts are left out,
    as ``to_pure_dict`` leaves them out."""
    out = {}
    for key, value in state.items():
        if isinstance(value, nnx.Variable):
            out[key] = np.array(value.get_value())
        else:
            sub = _host_copy(value)
            if sub:
                out[key] = sub
    return out


class Layer:
    """A standard (non-reversible) layer: any function of params, state, input and keys.

    The wrapped module must implement ``__call__(x, *, keys, train)`` returning the output pytree.
    Its input is saved by the reversible trainer (it cannot be rebuilt) and the layer is recomputed under
    ``jax.vjp`` in the backward pass.
    """

    reversible = False
    is_head = False

    def __init__(self, module: nnx.Module, name: str, factory: Callable[[], nnx.Module] | None = None):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        self.name = name
        self.graphdef = graphdef
        self._params_def = jax.tree.structure(params)
        self._state_def = jax.tree.structure(rest)
        shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)  # noqa: E731
        self._param_shapes = jax.tree.map(shape, nnx.to_pure_dict(params))
        self._state_shapes = jax.tree.map(shape, nnx.to_pure_dict(rest))
        self._factory = factory
        if factory is None:
            # Initial values are kept as host numpy arrays: a model must not pin a copy of its weights in
            # device memory (the trainers place them, in host memory when offloading).
            self._values = (_host_copy(params), _host_copy(rest))
        if len(jax.tree.leaves(self._param_shapes)) != self._params_def.num_leaves:
            raise ValueError(f"layer {name}: params do not flatten to plain arrays")
        shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves((self._param_shapes, self._state_shapes)))
        self.can_decode = supports_decoding(module)  # incremental decoding (`init_cache` / `decode`)
        self._identity = (type(self), self.graphdef, self._params_def, self._state_def, shapes)

    @classmethod
    def lazy(cls, factory: Callable[[], nnx.Module], name: str, **kwargs) -> "Layer":
        """A layer whose initial values are made only when asked for (`initial_values`), one layer at a time.

        ``factory()`` builds the module with its initial values (the same values every call: its random
        streams come from a fixed key, e.g. ``fold_in(seed, i)``). Construction traces it once under
        ``nnx.eval_shape`` (shapes only, nothing allocated), so a model of any size costs no host memory
        until a trainer places it layer by layer; the whole model's weights never exist twice.
        """
        return cls(nnx.eval_shape(factory), name, factory=factory, **kwargs)

    def initial_values(self) -> tuple[dict, dict]:
        """``(params, state)``: this layer's initial values as host numpy arrays (plain dicts).

        A lazy layer (`lazy`) builds them anew on every call and keeps nothing; a layer built from a
        concrete module returns the copies it keeps."""
        if self._factory is None:
            return self._values
        # Made eagerly even when asked for inside a traced function (as a kept value would be: a constant).
        with jax.ensure_compile_time_eval():
            _, params, rest = nnx.split(self._factory(), nnx.Param, ...)
            return _host_copy(params), _host_copy(rest)

    @property
    def init_params(self) -> dict:
        """The initial parameters (numpy; see `initial_values`: a lazy layer makes them on each access)."""
        return self.initial_values()[0]

    @property
    def init_state(self) -> dict:
        """The initial layer state (numpy; see `initial_values`)."""
        return self.initial_values()[1]

    @property
    def param_shapes(self) -> dict:
        """The layer's parameters as ``jax.ShapeDtypeStruct`` leaves (the tree of ``init_params``): what the
        memory plan, checkpoint templates and shape checks read without materialising any weight."""
        return self._param_shapes

    @property
    def state_shapes(self) -> dict:
        """The layer's state (``init_state``) as ``jax.ShapeDtypeStruct`` leaves."""
        return self._state_shapes

    def abstract_module(self) -> nnx.Module:
        """The module with shape-only variables (for inspecting its type and parts; nothing allocated)."""
        return self.merge(self._param_shapes, self._state_shapes)

    # Identity: the jit caches of the trainers key on the layer, so structurally identical layers
    # (same module graph, same parameter shapes) must compare equal.
    def __eq__(self, other):
        return isinstance(other, Layer) and self._identity == other._identity

    def __hash__(self):
        return hash(self._identity)

    def __repr__(self):
        return f"{type(self).__name__}({self.name})"

    def merge(self, params: dict, state: dict) -> nnx.Module:
        """Rebuilds the NNX module from plain-dict ``params`` and ``state`` (no copies are made)."""
        p = jax.tree.unflatten(self._params_def, jax.tree.leaves(params))
        s = jax.tree.unflatten(self._state_def, jax.tree.leaves(state))
        return nnx.merge(self.graphdef, p, s)

    def _state_of(self, module: nnx.Module) -> dict:
        _, _, rest = nnx.split(module, nnx.Param, ...)
        return nnx.to_pure_dict(rest)

    def apply(self, params: dict, state: dict, x: PyTree, keys: jax.Array | None, train: bool):
        """Runs the layer. Returns ``(y, new_state)``; ``new_state`` has the structure of ``state``."""
        module = self.merge(params, state)
        y = module(x, keys=keys, train=train)
        return y, self._state_of(module)

    def init_cache(self, batch_size: int, max_len: int) -> PyTree:
        """The layer's empty decoding cache for ``batch_size`` sequences of up to ``max_len`` positions
        (zeros; ``{}`` for a position-wise layer). Traceable (may be called inside ``jit``).

        Raises:
          TypeError: the layer does not support decoding (``can_decode`` is False).
        """
        if not self.can_decode:
            raise TypeError(f"layer {self.name} does not support incremental decoding")
        return self.abstract_module().init_cache(batch_size, max_len)

    def decode(self, params: dict, state: dict, x: PyTree, cache: PyTree, pos):
        """Evaluation-mode forward of positions ``pos .. pos + S - 1`` given the cache of positions
        ``0 .. pos - 1``.

        Args:
          params, state: as for ``apply``.
          x: the layer's input at ``S`` consecutive positions (int32 ``[B, S]`` token ids for the
            embedding, a pair of float32 ``[B, S, D]`` streams for a coupling or the head).
          cache: this layer's cache (from ``init_cache`` or a previous ``decode``).
          pos: int32 scalar (may be traced), the position of ``x[:, 0]``; ``pos + S <= max_len``.

        Returns:
          ``(y, new_cache)``: ``y`` equals ``apply(params, state, whole_sequence, None, False)[0]`` at those
          positions (up to float rounding); for the head, float32 logits ``[B, S, vocab]``.
        """
        return self.merge(params, state).decode(x, cache, pos)


class ReversibleLayer(Layer):
    """A reversible layer: ``apply`` in training mode has an exact inverse for the same keys.

    The wrapped module implements ``__call__(x, *, keys, train)`` and ``inverse(y, *, keys)``. An additive
    coupling may also implement ``half_residuals(*, keys) -> [(target, source, fn), ...]``: its training
    forward as a sequence of steps ``stream[target] = stream[target] + fn(stream[source])`` on a tuple of
    streams (``ReversibleCoupling``: ``[(0, 1, F), (1, 0, G)]``). Such a layer gets the fused rebuilds
    (`fused_reverse_vjp`, `fenced_reverse_vjp`); any other reversible layer gets the generic one in their place
    (`exact_reverse_vjp`: ``inverse``, then the ``vjp`` of ``apply``). The rebuilds are the pieces a backward
    mode (`revtrain.trainers.modes`) picks from; a layer takes no mode flags.
    """

    reversible = True

    def __init__(self, module: nnx.Module, name: str, factory: Callable[[], nnx.Module] | None = None):
        super().__init__(module, name, factory)
        # Whether the module describes itself as additive half-residual steps (the fused rebuild).
        self.has_half_residuals = callable(getattr(module, "half_residuals", None))

    def exact_reverse_vjp(self, params: dict, state: dict, y: PyTree, dy: PyTree, keys: jax.Array | None):
        """Rebuilds the layer's input from its output and pulls the output cotangent back through it, the
        generic way: ``inverse`` behind an ``optimization_barrier``, then the ``vjp`` of ``apply`` at the
        rebuilt input (F and G run twice, the rebuild compiled like the forward: bit-exact on the grid).

        Args:
          params, state: the weights and layer state the forward used (``state`` is read, never written;
            batch norm runs on the same tensors, so it sees the same batch statistics).
          y: the layer's output (a tuple of streams for a coupling).
          dy: the cotangent of ``y`` (same structure).
          keys: the forward's per-example keys (same dropout masks).

        Returns:
          ``(x, dx, grads)``: the rebuilt input, its cotangent, and the gradient with respect to ``params``
          (of this device's examples: the caller sums over devices).
        """
        x = lax.optimization_barrier(lax.stop_gradient(self.inverse(params, state, y, keys)))
        _, vjp_fn = jax.vjp(lambda p, x: self.apply(p, state, x, keys, True)[0], params, x)
        grads, dx = vjp_fn(dy)
        return x, dx, grads

    def fused_reverse_vjp(self, params: dict, state: dict, y: PyTree, dy: PyTree, keys: jax.Array | None):
        """`exact_reverse_vjp` by the half-residual recipe when the module has ``half_residuals`` (Gomez et
        al. 2017, algorithm 1; Trax ``ReversibleHalfResidual.reverse_and_grad``; minREV): for each step,
        last first, one ``jax.vjp`` of ``fn`` at its source stream gives both ``fn``'s output, which rebuilds
        the target stream (``x_t = y_t - fn(x_s)``), and ``fn``'s pullback, so every function runs forward
        once (3.0 forwards of a Transformer block in all instead of 3.75). A module without
        ``half_residuals`` gets `exact_reverse_vjp`. The fused rebuild is exact only where the primal
        outputs inside the vjp round like the forward's F and G (XLA fuses them with the backward); given an
        exact rebuild, its gradients are the exact recipe's bit for bit, because each source stream's
        cotangent is accumulated in the whole layer's order (`_plain_step`). Arguments and result as
        `exact_reverse_vjp`'s."""
        if not self.has_half_residuals:
            return self.exact_reverse_vjp(params, state, y, dy, keys)
        return self._reverse_steps(params, state, y, dy, keys, self._plain_step)

    def fenced_reverse_vjp(self, params: dict, state: dict, y: PyTree, dy: PyTree, keys: jax.Array | None):
        """`fused_reverse_vjp` with each step computed as `apply_fenced` computes it (`_fenced_step`: the
        vjp behind optimization barriers), for a forward that ran `apply_fenced`. A module without
        ``half_residuals`` gets `exact_reverse_vjp`. Arguments and result as `exact_reverse_vjp`'s."""
        if not self.has_half_residuals:
            return self.exact_reverse_vjp(params, state, y, dy, keys)
        return self._reverse_steps(params, state, y, dy, keys,
                                   lambda p, s, keys, k, src: self._fenced_step(p, s, keys, k, src)[:2])

    def _reverse_steps(self, params, state, y, dy, keys, step):
        """The half-residual rebuild's walk, last step first: ``step(params, state, keys, k, source)`` gives
        step ``k``'s increment and pullback (of ``(cot[target], cot[source])``); returns ``(x, dx, grads)``."""
        container = type(y)
        streams, cots = list(y), list(dy)
        grads = None
        steps = self.merge(params, state).half_residuals(keys=keys)
        for k in range(len(steps) - 1, -1, -1):
            target, source, _ = steps[k]
            increment, vjp_fn = step(params, state, keys, k, lax.stop_gradient(streams[source]))
            streams[target] = streams[target] - increment  # this step's input
            g, cots[source] = vjp_fn((cots[target], cots[source]))
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        return container(streams), container(cots), grads

    def _plain_step(self, params, state, keys, k, src):
        """Half-residual step ``k`` at source stream ``src`` under one ``jax.vjp``: ``(increment, pullback)``.

        The step passes its source stream through as a second output, so the pullback starts the source's
        cotangent from that stream's own cotangent and adds fn's contributions to it one by one, in the
        order the vjp of the whole layer adds them (the same float sums, bit for bit)."""
        def step(p, src):
            return self.merge(p, state).half_residuals(keys=keys)[k][2](src), src

        (increment, _), vjp_fn = jax.vjp(step, params, src)
        return increment, vjp_fn

    def _fenced_step(self, params, state, keys, k, src):
        """Half-residual step ``k`` at source stream ``src``, computed as the forward (`apply_fenced`) and
        the fenced rebuild (`fenced_reverse_vjp`) both compute it: ``src`` behind an ``optimization_barrier``, one
        ``jax.vjp`` of the step, then its primal output, the module's new state and the vjp's residuals (the
        leaves of the pullback) behind a second barrier. Returns ``(increment, pullback, new_state,
        residuals)``; the pullback takes ``(cot[target], cot[source])``, ``residuals`` are its leaves.

        The step passes its source stream through as a second output, so the pullback starts the source's
        cotangent from that stream's own cotangent and adds fn's contributions to it one by one, in the
        order the vjp of the whole layer adds them (the same float sums, bit for bit)."""
        def step(p, src):
            module = self.merge(p, state)
            out = module.half_residuals(keys=keys)[k][2](src)
            return (out, src), self._state_of(module)

        src = lax.optimization_barrier(src)
        (increment, _), vjp_fn, new_state = jax.vjp(step, params, src, has_aux=True)
        leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
        given = {id(a) for a in jax.tree.leaves((params, state, keys, src))}
        computed = [isinstance(a, jax.core.Tracer) and id(a) not in given for a in leaves]
        increment, new_state, leaves = lax.optimization_barrier((increment, new_state, leaves))
        return (increment, jax.tree_util.tree_unflatten(treedef, leaves), new_state,
                [a for a, c in zip(leaves, computed) if c])

    def apply_fenced(self, params: dict, state: dict, x: PyTree, keys: jax.Array | None):
        """The training forward computed step by step exactly as the fused rebuild computes it, so that the
        rebuild gives back ``x`` bit for bit (`fenced_reverse_vjp`).

        Each half-residual step is one ``jax.vjp`` whose primal output and residuals pass an
        ``optimization_barrier`` (`_fenced_step`), and the residuals are returned: a program must output
        them (the caller drops them), or XLA removes their computation and compiles F and G differently
        from the rebuild's vjp, where the backward consumes them (measured: rebuild errors of 1e-7 to 1e-5
        in float32 otherwise). The cost is writing one layer's residuals per forward (memory traffic, no
        extra FLOPs).

        Args:
          params, state, keys: as for ``apply`` (training mode).
          x: the layer's input (a tuple of streams for a coupling).

        Returns:
          ``(y, new_state, residuals)``: ``y`` and ``new_state`` as ``apply(..., train=True)`` computes them
          (up to float rounding), ``residuals`` a tuple of 1-D arrays (each residual of each step's vjp that
          is computed in the layer, flattened; ``()`` for a layer without ``half_residuals``, which runs
          ``apply``).
        """
        if not self.has_half_residuals:
            y, new_state = self.apply(params, state, x, keys, True)
            return y, new_state, ()
        container, streams, residuals = type(x), list(x), []
        steps = self.merge(params, state).half_residuals(keys=keys)
        for k, (target, source, _) in enumerate(steps):
            increment, _, state, leaves = self._fenced_step(params, state, keys, k, streams[source])
            residuals += [a.reshape(-1) for a in leaves]
            streams[target] = streams[target] + increment
        return container(streams), state, tuple(residuals)

    def inverse(self, params: dict, state: dict, y: PyTree, keys: jax.Array | None) -> PyTree:
        """Rebuilds the layer's input from its output ``y`` (training mode, same ``keys`` as forward).

        State is read (the state the forward used) and never written.
        """
        module = self.merge(params, state)
        return module.inverse(y, keys=keys)


class HeadLayer(Layer):
    """The trailing standard layer that also computes the loss.

    The wrapped module implements ``loss(x, batch, *, keys, train) -> (loss_sum, stats)`` where
    ``loss_sum`` is a float32 scalar: the sum over the local batch of per-example (or per-token) losses
    times their weights, and ``stats`` a dict of float32 scalar sums (at least ``weight`` and
    ``correct``). The trainers divide by the global weight.
    """

    is_head = True

    def loss(self, params: dict, state: dict, x: PyTree, batch: dict, keys: jax.Array | None, train: bool):
        """Returns ``(loss_sum, stats, new_state)`` for the local batch."""
        module = self.merge(params, state)
        loss_sum, stats = module.loss(x, batch, keys=keys, train=train)
        return loss_sum, stats, self._state_of(module)
