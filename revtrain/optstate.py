"""Optimizer states as optax makes them, kept where revtrain keeps states: device memory, host memory, files
and checkpoints.

Two things in an optax state do not survive revtrain's boundaries as they are:

* **Typed PRNG keys** (``optax.noisy_sgd``'s ``AddNoiseState.rng_key``, dtype ``key<fry>``): numpy cannot
  hold them (``np.asarray`` of one fails), so neither can the host store's numpy copies, the disk tier's
  files or an Orbax checkpoint. `keep_states` gives the trainers an optimizer whose state holds each key's
  ``jax.random.key_data`` (``uint32``, shape ``key shape + (2,)`` for threefry) and which wraps it back
  (``jax.random.wrap_key_data`` with the key's own implementation) inside ``update``, so the optimizer
  itself sees the keys optax made and draws the same numbers.
* **The parameters' own arrays** (``prodigy``, ``dog``, ``cocob``, ``madgrad``, ``mechanize`` keep the
  initial parameters in the state: ``init`` returns the very arrays it was given; ``cocob`` also puts one
  array in two of its fields). A step that donates the parameters and the state would donate those buffers
  twice (XLA: "Attempt to donate the same buffer twice"). `keep_states`' ``init`` copies exactly those
  leaves (an identical object, or the same traced value under ``jit``), so every other optimizer keeps its
  state as it was and its donation as before.

Integer counters and empty states (``EmptyState()``, ``()``) pass through unchanged.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax


def is_key(x) -> bool:
    """Whether ``x`` (an array, a tracer or a ``jax.ShapeDtypeStruct``) is a typed PRNG key array."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def has_keys(tree) -> bool:
    """Whether any leaf of ``tree`` is a typed PRNG key array."""
    return any(is_key(x) for x in jax.tree.leaves(tree))


def key_data(tree):
    """``tree`` with every typed PRNG key leaf replaced by its ``jax.random.key_data`` (``uint32``); other
    leaves as they are (abstract leaves give abstract results)."""
    def data(x):
        if not is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            out = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=getattr(x, "sharding", None))
        return jax.random.key_data(x)
    return jax.tree.map(data, tree)


def nbytes(x) -> int:
    """Bytes of one array or ``jax.ShapeDtypeStruct`` leaf, typed PRNG keys included (their key data's
    bytes: 8 per threefry key); 0 for a ``float0`` leaf."""
    size = 1
    for d in getattr(x, "shape", ()):
        size *= int(d)
    return size * int(x.dtype.itemsize)


def tree_nbytes(tree) -> int:
    """Bytes of every leaf of a tree of arrays or ``jax.ShapeDtypeStruct`` (`nbytes` of each: typed PRNG keys
    by their key data, 0 for a ``float0`` leaf)."""
    return sum(nbytes(x) for x in jax.tree.leaves(tree))


def _copy_aliases(state, params):
    """``state`` with each leaf that is one of ``params``' leaves, or a leaf met earlier in ``state`` itself
    (the same object: the same array, or the same tracer under ``jit``; ``cocob`` puts one array in two
    fields), replaced by a copy, so a program can donate both trees, every buffer once."""
    seen = {id(x) for x in jax.tree.leaves(params)}
    leaves, treedef = jax.tree.flatten(state)
    out, copied = [], False
    for x in leaves:
        if id(x) in seen and hasattr(x, "dtype"):
            out.append(jnp.copy(x))
            copied = True
        else:
            out.append(x)
            seen.add(id(x))
    return jax.tree.unflatten(treedef, out) if copied else state


def keep_states(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with a state revtrain can place, copy, write and donate (the module's docstring): typed keys held
    as their key data, and no state leaf that is one of the parameters' arrays. For an optimizer without either,
    ``init`` and ``update`` trace to the same programs as ``tx``'s (nothing is converted or copied).

    The state's tree structure is optax's; only the key leaves' dtype and shape differ (``uint32`` key data).
    ``update`` finds the key leaves and their implementation from ``tx.init``'s abstract state on the
    parameters it is given (``jax.eval_shape``, traced only); an optimizer whose update takes no parameters
    uses the implementations seen by ``init``.
    """
    if getattr(tx, "_revtrain_keeps_states", False):
        return tx
    seen: dict = {}  # leaf index -> key implementation, from the last init traced

    def impls_of(params):
        found = {}

        def probe(p):
            state = tx.init(p)
            for i, x in enumerate(jax.tree.leaves(state)):
                if is_key(x):
                    found[i] = jax.random.key_impl(x)
            return state
        jax.eval_shape(probe, params)
        return found

    def init(params):
        state = tx.init(params)
        leaves = jax.tree.leaves(state)
        for i, x in enumerate(leaves):
            if is_key(x):
                seen[i] = jax.random.key_impl(x)
        return _copy_aliases(key_data(state), params)

    def update(updates, state, params=None, **extra):
        impls = impls_of(params) if params is not None else dict(seen)
        if impls:
            leaves, treedef = jax.tree.flatten(state)
            leaves = [jax.random.wrap_key_data(x, impl=impls[i]) if i in impls and not is_key(x) else x
                      for i, x in enumerate(leaves)]
            state = jax.tree.unflatten(treedef, leaves)
        new_updates, new_state = tx.update(updates, state, params, **extra)
        return new_updates, key_data(new_state)

    return _Kept(init, update, tx)


class _Kept(optax.GradientTransformationExtraArgs):
    """`keep_states`' optimizer: ``init`` and ``update`` as described there; ``inner``: the optimizer given."""

    def __new__(cls, init, update, inner):
        return super().__new__(cls, init, update)

    def __init__(self, init, update, inner):
        self.inner = inner
        self._revtrain_keeps_states = True
        self._revtrain_needs: dict = {}  # `_analysed`'s results, by the parameters' shapes


# optax's update functions that need more than the gradients: what each keyword argument is, for the refusal
_EXTRA_ARGUMENTS = {"value": "the loss at the current parameters", "grad": "its gradient",
                    "value_fn": "a function that evaluates the loss at other parameters",
                    "obj_fn": "the loss as a function of the parameters, for a Hessian-vector product"}


# The step's loss as an update's ``value`` is traced as this (the loss every trainer logs: a float32 scalar).
VALUE_SHAPE = jax.ShapeDtypeStruct((), jnp.float32)


def given_products(hvp):
    """A stand-in for an update's ``obj_fn`` (the loss as a function of the parameters) whose forward-over-reverse
    product is ``hvp``: ``jax.jvp(jax.grad(obj_fn), (params,), (z,))[1]`` is ``hvp`` exactly, whatever ``params``
    and ``z`` (a tree like ``params``, its leaves' dtypes). Its value and gradient are zeros (optax's Hutchinson
    estimator reads neither).

    The trainers compute the Hessian-vector product themselves, on the tangent the estimator draws
    (`revtrain.trainers.hessian`), and hand the update this objective: optax's own equations then run on the
    product (``H z * z``, Sophia's moment and its ``cond`` on the interval), and a per-layer split of the update
    sees ``hvp`` as one more per-layer input, like the gradient (`revtrain.trainers.layerwise`). Built from two
    ``jax.custom_jvp`` functions: the objective's derivative is ``sum(gradient(p) * t)`` and the stand-in
    gradient's derivative returns ``hvp`` itself (it is never transposed, so need not be linear)."""

    @jax.custom_jvp
    def gradient(p, h):
        return jax.tree.map(jnp.zeros_like, p)

    @gradient.defjvp
    def _gradient_jvp(primals, tangents):
        p, h = primals
        return gradient(p, h), h

    @jax.custom_jvp
    def objective(p):
        return jnp.zeros((), jnp.float32)

    @objective.defjvp
    def _objective_jvp(primals, tangents):
        (p,), (t,) = primals, tangents
        g = gradient(p, hvp)
        dots = [jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(t))]
        return objective(p), sum(dots, jnp.zeros((), jnp.float32))

    return objective


def update_keywords(value=None, hvp=None) -> dict:
    """The keyword arguments a trainer gives ``tx.update`` beyond the gradients, state and parameters: the
    step's loss as ``value`` (`takes_value`) and the stand-in ``obj_fn`` of the Hessian-vector product ``hvp``
    (`takes_hvp`, `given_products`); none for an optimizer that reads neither."""
    out = {}
    if value is not None:
        out["value"] = value
    if hvp is not None:
        out["obj_fn"] = given_products(hvp)
    return out


def _traced_update_error(tx: optax.GradientTransformation, shapes, value: bool, hvp: bool = False) -> Exception | None:
    """The exception ``tx.update`` raises when traced on ``shapes`` (``jax.eval_shape``: nothing computed),
    given the keyword argument ``value`` (a float32 scalar) or not, and ``obj_fn`` (`given_products`) or not;
    None when it traces."""
    def run(p, v, h):
        return tx.update(p, tx.init(p), p, **update_keywords(v, h))
    try:
        jax.eval_shape(run, shapes, VALUE_SHAPE if value else None, shapes if hvp else None)
    except Exception as e:  # noqa: BLE001  (any failure of the traced update: the caller reads it)
        return e
    return None


def _missing_keywords(e: Exception) -> tuple[str, list[str]] | None:
    """``(owner, names)`` when ``e`` says an update lacks required keyword arguments (Python's ``TypeError``
    "missing required keyword-only argument", or optax's ``ValueError`` "obj_fn must be provided"), else None."""
    text = str(e).strip()
    missing = re.match(r"^(\w+) must be provided", text)
    if isinstance(e, TypeError) and "required keyword-only argument" in text:
        owner = text.split("(", 1)[0].split(".<locals>", 1)[0].strip()
        return owner, re.findall(r"'(\w+)'", text.split("argument", 1)[-1])
    if isinstance(e, ValueError) and missing and missing.group(1) in _EXTRA_ARGUMENTS:
        return text.split(" update function", 1)[0].rsplit(" ", 1)[-1], [missing.group(1)]
    return None


def _shapes(params):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


# The keyword arguments the trainers can give an update (`update_keywords`); any other one is refused.
_GIVEN = ("value", "obj_fn")


def hutchinson_states(state) -> list:
    """The ``optax.contrib.HutchinsonState`` nodes of an optimizer state (or its ``jax.eval_shape``), in leaf
    order: where optax's Hutchinson estimator keeps the key it draws its Rademacher tangents from."""
    kind = optax.contrib.HutchinsonState
    return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(x, kind)]


def _analysed(tx: optax.GradientTransformation, params) -> tuple[str | None, bool, bool]:
    """``(update_refusal, takes_value, takes_hvp)`` of ``tx`` on the shapes of ``params`` (see each), from at most
    three traces of ``tx.update``; kept on an optimizer made by `keep_states` (each trainer and its per-layer
    split ask for the same shapes: traced once)."""
    shapes = _shapes(params)
    key = (jax.tree.structure(shapes), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(shapes)))
    cache = getattr(tx, "_revtrain_needs", None)
    if cache is not None and key in cache:
        return cache[key]
    given: set = set()
    while True:  # (each keyword the update lacks and a trainer can give, given: does it run then?)
        e = _traced_update_error(tx, shapes, "value" in given, "obj_fn" in given)
        missing = _missing_keywords(e) if e is not None else None
        if missing is None or not set(missing[1]) <= set(_GIVEN) or set(missing[1]) & given:
            break
        given |= set(missing[1])
    if e is None:
        why = None
        if "obj_fn" in given and len(hutchinson_states(jax.eval_shape(tx.init, shapes))) != 1:
            why = ("the optimizer cannot train in revtrain: its update calls obj_fn (the loss as a function of the "
                   "parameters) from a transformation other than one optax.contrib.hutchinson_estimator_diag_hessian, "
                   "whose Hessian-vector products the trainers compute on the tangents it draws (docs/recipe.md, "
                   "\"Refused\")")
    elif missing is None:
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        why = f"the optimizer cannot update this model's parameters: {type(e).__name__}: {first}"
    else:
        owner, names = missing
        what = ", ".join(f"{n} ({_EXTRA_ARGUMENTS[n]})" if n in _EXTRA_ARGUMENTS else n for n in names)
        why = (f"the optimizer cannot train in revtrain: its update (optax's {owner}) needs the keyword "
               f"argument{'s' if len(names) > 1 else ''} {what}, and revtrain's trainers give an update the "
               "gradients, the step's loss (value) and the Hessian-vector products of optax's Hutchinson "
               "estimator (obj_fn) only; choose an optimizer that needs no more (docs/recipe.md, \"Refused\")")
    out = (why, why is None and "value" in given, why is None and "obj_fn" in given)
    if cache is not None:
        cache[key] = out
    return out


def takes_hvp(tx: optax.GradientTransformation, params) -> bool:
    """Whether ``tx.update`` needs the keyword argument ``obj_fn`` for optax's Hutchinson estimator
    (``optax.contrib.hutchinson_estimator_diag_hessian``, ``optax.contrib.sophia``, or a chain or wrapper holding
    one): traced on the shapes of ``params`` it fails for the missing ``obj_fn`` (optax's ``ValueError``
    "obj_fn must be provided") and traces with a stand-in (`given_products`), and its state holds one
    ``HutchinsonState``. Both trainers then compute the Hessian-vector product on the tangent the estimator
    draws (`revtrain.trainers.hessian`) and pass it as ``obj_fn``; no other optimizer gets one."""
    return _analysed(tx, params)[2]


def takes_value(tx: optax.GradientTransformation, params) -> bool:
    """Whether ``tx.update`` needs the keyword argument ``value``, the loss at the current parameters, and
    runs with it and the gradients alone (``optax.contrib.momo``, ``momo_adam``, ``optax.polyak_sgd``,
    ``optax.scale_by_polyak``, ``optax.contrib.reduce_on_plateau``, or any chain holding one): traced on the
    shapes of ``params`` without ``value`` it fails for the missing keyword ``value`` only, and with ``value``
    (a float32 scalar) it traces. Both trainers then pass the step's loss, exactly as they log it, as
    ``value``; an optimizer that does not need it gets none, so its programs are unchanged."""
    return _analysed(tx, params)[1]


def update_refusal(tx: optax.GradientTransformation, params) -> str | None:
    """Why ``tx`` cannot train in revtrain, in one line, or None.

    Both trainers give an update the gradients, the state, the parameters and, to an optimizer that needs
    them, the step's loss as the keyword argument ``value`` (`takes_value`: ``optax.contrib.momo``,
    ``momo_adam``, ``optax.polyak_sgd``, ``scale_by_polyak``, ``optax.contrib.reduce_on_plateau``) and the
    Hessian-vector product of optax's Hutchinson estimator as ``obj_fn`` (`takes_hvp`: ``optax.contrib.sophia``).
    An update that requires any other keyword argument cannot run: ``optax.lbfgs``' zoom line search (``value``,
    ``grad`` and ``value_fn``) evaluates the whole model's loss again, at other parameters, several times
    within the step, which a layer-by-layer update cannot do; so is an ``obj_fn`` read by anything but one
    Hutchinson estimator. Found by tracing ``tx.update`` on the shapes of ``params`` (``jax.eval_shape``:
    nothing is computed), with each keyword a trainer can give that it lacks, and reading the ``TypeError``
    Python raises for a missing keyword-only argument (or optax's ``ValueError`` "obj_fn must be provided").
    Any other error of the traced update is refused with optax's own first line (an update that cannot run on
    this model's parameters at all).
    """
    return _analysed(tx, params)[0]


class LayerInit:
    """Each layer's initial optimizer state as its part of ``tx.init`` of the whole model, for an optimizer whose
    whole-model init is not each layer's own (``optax.contrib.dog``: its ``max_dist`` starts at
    ``r_epsilon * (1 + norm of every parameter)``, one scalar from the whole tree; a layer's own ``tx.init``
    would take its own norm).

    ``tx.init`` of the whole model (the list of every layer's params) is split as an update is
    (`revtrain.trainers.layerwise.LayerwiseUpdate` of a transformation whose ``update`` returns
    ``tx.init(params)``): its reductions over several layers (the norm) become global rounds over each
    layer's small exports (each leaf's sum of squares), every other value is computed from the layer's own
    params, so each layer's state equals its part of the whole init (the equations optax runs, each evaluated
    on its own as the whole model's eager init runs them). Reversible trainers hold one state per layer and
    never the whole model: `prepare` makes each layer's params once more (a pass over the layers before the
    one that places them) when, and only when, the init needs it.

    Args:
      tx: the optimizer (as the trainer keeps it: `keep_states`).
      layer_shapes: one params tree per layer (``jax.ShapeDtypeStruct`` leaves), as the trainer holds them.

    Attributes:
      needed: whether a layer's own ``tx.init`` differs from its part of the whole model's (``False``: use
        ``tx.init`` of the layer, no extra pass).
    """

    def __init__(self, tx: optax.GradientTransformation, layer_shapes: list):
        from revtrain.trainers.layerwise import CoupledUpdateError, LayerwiseUpdate
        self.tx = tx
        as_update = optax.GradientTransformation(tx.init, lambda updates, state, params=None: (updates,
                                                                                             tx.init(params)))
        try:
            self._split = LayerwiseUpdate(as_update, layer_shapes)
            self.needed = not self._split.separable
        except CoupledUpdateError:  # (an init that copies whole tensors across layers: none in optax)
            self._split, self.needed = None, False
        self._globals: tuple | None = None

    def prepare(self, params_of) -> None:
        """Runs the global rounds of the whole init: ``params_of(i)`` gives layer ``i``'s initial params (called
        once per layer and round; its arrays are dropped after use). A no-op unless `needed`."""
        if not self.needed:
            return
        split, globals_, exports = self._split, (), []
        for k in range(split.rounds):
            round_k, shared = [], ()
            for i in range(split.num_layers):
                p = params_of(i)
                own = self.tx.init(p)  # (the operands the split reads of a layer's state: none it uses)
                round_k.append(split.exports(k, i, p, own, p, globals_))
                shared = shared or split.global_leaves(i, own)
                del p, own
            exports.append(round_k)
            globals_ = split.combine(k, exports, shared, globals_)
        self._globals = globals_

    def state(self, i: int, params):
        """Layer ``i``'s initial optimizer state for its initial ``params`` (after `prepare` when `needed`)."""
        if not self.needed:
            return self.tx.init(params)
        if self._globals is None:
            raise RuntimeError("LayerInit.prepare must run before LayerInit.state")
        return self._split.update(i, params, self.tx.init(params), params, self._globals)[1]
