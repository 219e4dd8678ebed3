"""``revtrain check``'s optimizer part: each layer's optimizer step against the whole model's, bit for bit.

The gradient comparison of `revtrain.check` shows that the reversible trainer's gradients are backprop's; it
cannot see an optimizer whose per-layer step rounds apart from its whole-model step (a run then drifts from
StandardTrainer's by an ulp a few steps in, while every gradient of the first step agrees). So the check also
runs the optimizer itself, both ways, from the same parameters and the same gradients:

* **whole model**, as `revtrain.trainers.standard.StandardTrainer` applies it: one ``tx.update`` of every
  layer's tree at once (`layerwise.guarded_update`, the conditional form, with the trainer's traced ``ok``
  flag), the optimizer state ``tx.init`` of the whole list;
* **per layer**, as `revtrain.trainers.reversible.ReversibleTrainer` applies it: each layer's own state
  (``tx.init`` of its tree) and one program per layer: the fused update (`layerwise.guarded_update` of the
  layer's tree, the conditional form as the whole model's) for a separable optimizer, else the deferred
  one (the statistics passes, the global programs and the final pass of `layerwise.LayerwiseUpdate`, each
  fenced as the trainer's are, `layerwise.fence`).

Each of `STEPS` steps feeds both the same seeded gradients (normal, 1e-2 times the magnitude of the
parameter leaf, so every leaf moves; an optimizer's exactness does not depend on where its gradients come
from) and, to an optimizer whose update reads the step's loss (``value``: ``optax.polyak_sgd``,
``optax.contrib.momo``, ``reduce_on_plateau``), the same seeded loss (`seeded_value`), to one that reads
Hessian-vector products (``optax.contrib.sophia``) the same seeded products (`seeded_grads` of another stream),
and compares, for every layer, the new parameters (the applied update) and every leaf of the new
optimizer state bit for bit. The first step, layer and leaf that differ are reported with their largest
difference; the check then fails (exit 1). Where the update cannot run one layer at a time at all
(`layerwise.CoupledUpdateError`: the reversible trainer refuses it), nothing is compared and the line says so.

Limits: the whole model's parameters, the seeded gradients and both optimizer states are held on the device
at once (as StandardTrainer holds them: ``check_optimizer.steps = 0`` leaves the comparison out for a model
too large for that); the per-layer programs are unstacked (a scanned run's layers are updated one at a time
here, in a scan by the trainer), on whole leaves (no ``shard_state`` pieces), and take the gradient as it is
(no microbatch divisor).
"""

from __future__ import annotations

import dataclasses

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import SequenceKey, keystr, tree_flatten_with_path

from revtrain.errors import ConfigError

from revtrain.trainers.layerwise import (CoupledUpdateError, LayerwiseUpdate, all_finite, deferred_layer_update,
                                         fence, guarded_update)
from revtrain.trainers.specs import leaf_squares

STEPS = 3  # optimizer steps compared (a step count's bias correction and a state's second use show by then)


@dataclasses.dataclass
class Difference:
    """The first leaf whose per-layer result differs from the whole model's.

    Attributes:
      step: 1-based optimizer step.
      layer: the layer's index; ``name`` its name.
      what: ``"params"`` (the new parameters: the update applied) or ``"state"`` (the new optimizer state).
      leaf: the leaf's path in the layer's tree (``jax.tree_util.keystr``).
      max_abs: largest absolute difference (float64; ``nan`` where the dtypes or shapes differ).
    """

    step: int
    layer: int
    name: str
    what: str
    leaf: str
    max_abs: float


@dataclasses.dataclass
class Result:
    """What `compare` found: ``difference`` (None: every layer bit for bit), ``steps``, ``form`` (how the
    per-layer step was run), ``refused`` (the reason no comparison was possible, else None) and ``seeded`` (what
    else both forms were given, as the verdict line says it: the step's loss, Hessian-vector products)."""

    steps: int
    form: str
    difference: Difference | None = None
    refused: str | None = None
    seeded: str = ""

    @property
    def ok(self) -> bool:
        return self.difference is None

    def line(self) -> str:
        """The verdict line ``revtrain check`` prints (``PASS: optimizer step ...`` or ``FAIL: ...``)."""
        if self.refused:
            return f"optimizer step: not compared ({self.refused})"
        what = (f"optimizer step, {self.steps} steps of seeded gradients{self.seeded}, per layer ({self.form}) "
                "against the whole model")
        d = self.difference
        if d is None:
            return f"PASS: {what}: every layer's new parameters and optimizer state bit for bit"
        return (f"FAIL: {what}: step {d.step}, layer {d.name} (index {d.layer}), {d.what} leaf {d.leaf} differs "
                f"(max |difference| {d.max_abs:.1e})")


def _state_of_layer(whole_state, layer_state, i: int, earlier: list = ()) -> list:
    """The leaves of ``whole_state`` (``tx.init`` of the list of every layer's params) that are layer ``i``'s
    state, in the order of ``layer_state``'s leaves: a leaf whose whole path is the layer's path with the
    list index ``i`` inserted, or (a leaf every layer's state has: the step count) the same path. A vector of
    every layer's elements at that path (``optax.flatten``'s moments: longer than the layer's own vector)
    gives layer ``i``'s segment, after the same leaves of the ``earlier`` layers' states (layers ``0 .. i-1``)."""
    by_path = {}
    for path, leaf in tree_flatten_with_path(whole_state)[0]:
        by_path.setdefault((None, tuple(path)), leaf)
        for pos, key in enumerate(path):
            if isinstance(key, SequenceKey):
                by_path.setdefault((key.idx, tuple(path[:pos] + path[pos + 1:])), leaf)
    out = []
    for path, mine in tree_flatten_with_path(layer_state)[0]:
        path = tuple(path)
        leaf = by_path[(i, path)] if (i, path) in by_path else by_path[(None, path)]
        if (i, path) not in by_path and np.ndim(mine) == 1 and np.ndim(leaf) == 1 and \
                np.shape(leaf)[0] > np.shape(mine)[0]:  # a segment of a vector of every layer's elements
            start = sum(np.shape(dict((tuple(p), x) for p, x in tree_flatten_with_path(e)[0])[path])[0]
                        for e in earlier)
            leaf = leaf[start:start + np.shape(mine)[0]]
        out.append(leaf)
    return out


def _first_difference(mine, theirs, paths) -> tuple[str, float] | None:
    for path, a, b in zip(paths, mine, theirs):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return keystr(path), float("nan")
        if not np.array_equal(a, b, equal_nan=bool(np.issubdtype(a.dtype, np.inexact))):
            return keystr(path), float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
    return None


def seeded_value(seed: int, step: int) -> np.float32:
    """A stand-in for the step's loss (the keyword argument ``value`` of an update that reads it): a float32
    scalar in [1, 5), from ``numpy.random.default_rng((seed, step))``; a different one each step, so that an
    optimizer that tracks the loss (``reduce_on_plateau``'s best value) sees it change."""
    return np.float32(1.0 + 4.0 * np.random.default_rng((seed, step)).random())


def seeded_grads(params: list, seed: int, step: int) -> list:
    """Per-layer gradient trees like ``params`` (numpy, each leaf's dtype): normal values times 1e-2 of the
    leaf's largest magnitude (1e-2 for a leaf of zeros), from ``numpy.random.default_rng((seed, step, layer))``."""
    out = []
    for i, tree in enumerate(params):
        rng = np.random.default_rng((seed, step, i))

        def one(p):
            p = np.asarray(p)
            scale = float(np.abs(p).max()) if p.size else 0.0
            return (rng.standard_normal(p.shape) * 1e-2 * (scale or 1.0)).astype(p.dtype)

        out.append(jax.tree.map(one, tree))
    return out


class _PerLayer:
    """The reversible trainer's per-layer optimizer step (see the module note), one program per layer."""

    def __init__(self, tx, layerwise: LayerwiseUpdate, deferred: bool):
        self.tx, self.layerwise, self.deferred = tx, layerwise, deferred
        self._programs: dict = {}

    @property
    def form(self) -> str:
        if not self.deferred:
            return "the fused update"
        if self.layerwise.separable:
            return "the deferred update"
        return f"the deferred update, {self.layerwise.rounds} global round(s)"

    def _jit(self, key, fn):
        if key not in self._programs:
            self._programs[key] = jax.jit(fn)
        return self._programs[key]

    def step(self, grads: list, states: list, params: list, value=None, hvp=None) -> tuple[list, list]:
        """``(new params, new states)``, one per layer (``value``: the step's loss for an optimizer that reads
        it, else None; ``hvp``: one Hessian-vector product per layer for one that reads them, else None)."""
        hvp = hvp if hvp is not None else [None] * len(params)
        ok = jnp.asarray(True)
        n = len(params)
        if not self.deferred:
            fused = self._jit("fused", lambda g, s, p: guarded_update(self.tx, g, s, p)[:2])
            out = [fused(grads[i], states[i], params[i]) for i in range(n)]
            return [p for p, _ in out], [s for _, s in out]
        lw, globals_, history = self.layerwise, (), []
        for k in range(lw.rounds):
            stats = [self._jit(("stats", k, lw.signature(i)),
                               lambda g, s, p, gl, v, h, k=k, i=i: self._stats(k, i, g, s, p, gl, v, h))(
                grads[i], states[i], params[i], globals_, value, hvp[i]) for i in range(n)]
            history.append([s[0] if k == 0 else s for s in stats])  # (round 0's also hold squares and flags)
            combine = self._jit(("combine", k), lambda ex, leaves, gl, v, k=k: lw.combine(k, ex, leaves, gl, v))
            globals_ = combine(history, lw.global_leaves(0, states[0]), globals_, value)
        out = [self._jit(("update", lw.signature(i)),
                         lambda g, s, p, gl, ok, v, h, i=i: self._update(i, g, s, p, gl, ok, v, h))(
            grads[i], states[i], params[i], globals_, ok, value, hvp[i]) for i in range(n)]
        return [p for p, _ in out], [s for _, s in out]

    def _stats(self, k, i, g, s, p, globals_, value, hvp=None):
        scalars: list = []
        exports = self.layerwise.exports(k, i, g, s, p, globals_, scalars, value=value, hvp=hvp)
        return fence(scalars, exports if k else (exports, leaf_squares(g), all_finite(g)))

    def _update(self, i, g, s, p, globals_, ok, value, hvp=None):
        return deferred_layer_update(self.tx, self.layerwise, i, g, s, p, globals_, ok, value, hvp)


def compare(trainer, model, params: list, steps: int = STEPS, seed: int = 0) -> Result:
    """Runs `STEPS` optimizer steps both ways (see the module note) and compares them.

    Args:
      trainer: the run's trainer (its ``tx``; a `ReversibleTrainer`'s ``layerwise``, ``deferred`` when it
        is one, else those a reversible trainer of this model would have).
      model: the `revtrain.models.Model` (layer names; ``ties`` make the update deferred).
      params: one params tree per layer as the trainer holds them (a tied leaf only in its owner's); arrays
        on the device or numpy.
      steps: how many steps; seed: the gradients' seed (`seeded_grads`).

    Returns:
      a `Result`.
    """
    tx = trainer.tx
    layerwise = trainer.layerwise
    try:
        if layerwise is None:
            layerwise = LayerwiseUpdate(tx, [jax.tree.map(np.asarray, p) for p in params])
    except CoupledUpdateError as e:
        return Result(steps, "", refused=f"ReversibleTrainer cannot run this optimizer one layer at a time: {e}")
    deferred = trainer.deferred
    if deferred is None:
        deferred = not layerwise.separable or bool(model.ties)
    per_layer = _PerLayer(tx, layerwise, deferred)
    whole = jax.jit(lambda g, s, p, ok, v, h: guarded_update(tx, g, s, p, ok=ok, value=v, hvp=h)[:2])
    seeded = "".join([", losses" if layerwise.takes_value else "",
                      ", Hessian-vector products (optax's Hutchinson estimator)" if layerwise.takes_hvp else ""])
    whole_params, layer_params = list(params), list(params)
    init = jax.jit(tx.init)  # (one program per distinct tree, not one per leaf's zeros)
    whole_state = init(whole_params)
    layer_states = [init(p) for p in layer_params]
    names = [getattr(layer, "name", str(i)) for i, layer in enumerate(model.layers)]
    for step in range(1, steps + 1):
        grads = seeded_grads(layer_params, seed, step)
        value = seeded_value(seed, step) if layerwise.takes_value else None  # (the step's loss, for one that reads it)
        # (Hessian-vector products for optax's Hutchinson estimator: seeded as gradients are, another stream)
        hvp = seeded_grads(layer_params, seed + 1, step) if layerwise.takes_hvp else None
        whole_params, whole_state = whole(grads, whole_state, whole_params, jnp.asarray(True), value, hvp)
        layer_params, layer_states = per_layer.step(grads, layer_states, layer_params, value, hvp)
        for i in range(len(layer_params)):
            for what, mine, theirs, tree in (
                    ("params", jax.tree.leaves(layer_params[i]), jax.tree.leaves(whole_params[i]), layer_params[i]),
                    ("state", jax.tree.leaves(layer_states[i]), _state_of_layer(whole_state, layer_states[i], i,
                                                                                  layer_states[:i]),
                     layer_states[i])):
                paths = [p for p, _ in tree_flatten_with_path(tree)[0]]
                found = _first_difference(mine, theirs, paths)
                if found:
                    return Result(steps, per_layer.form, Difference(step, i, names[i], what, *found), seeded=seeded)
    return Result(steps, per_layer.form, seeded=seeded)


@gin.configurable("check_optimizer")
def verdict(run, params: list, code: int, out, progress=None, steps: int = STEPS) -> int:
    """``revtrain check``'s last step: `compare` on the run's trainer, model and parameters (``params`` as the
    trainer holds them), its `Result.line` printed to ``out`` after the gradient verdict, and the exit status:
    ``code`` (the gradient check's: 0 or 1), or 1 when an optimizer step differs. ``progress(text)`` is told
    when the comparison starts.

    ``steps`` (gin ``check_optimizer.steps``): how many optimizer steps to compare; 0 compares none (a model
    whose whole parameters, gradients and two optimizer states do not fit the device at once), said in the
    line.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"check_optimizer.steps must be a non-negative integer, got {steps!r}")
    if steps == 0:
        print("optimizer step: not compared (check_optimizer.steps = 0)", file=out)
        return code
    if progress is not None:
        progress(f"check optimizer step: {steps} steps per layer and of the whole model")
    result = compare(run.trainer, run.model, params, steps=steps, seed=run.cfg.seed)
    print(result.line(), file=out)
    return code if result.ok else 1
