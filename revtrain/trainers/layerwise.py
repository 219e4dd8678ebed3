"""A whole-model optax update, evaluated one layer at a time: exact global-norm clipping under per-layer updates.

The reversible trainer holds each layer's weights and optimizer state on their own (host memory with
offload, a 1/N piece with sharded state) and never has the whole model on the device. An optax
transformation, though, is defined on the whole parameter tree: ``optax.clip_by_global_norm`` scales every
leaf by a factor that depends on every other leaf, ``optax.apply_if_finite`` skips the step on any
non-finite leaf, and even Adam's step count is one scalar for the whole tree. Applying ``tx.update`` to one
layer's tree at a time changes the meaning of the first two (Trax's ``ReversibleSerialTrainer`` clips each
layer by its own norm; LOMO runs the backward twice to learn the norm; AdaLomo drops global clipping).

This module makes the whole-model update itself run layer by layer, exactly. It traces ``tx.update`` once,
abstractly, on the whole model (the list of every layer's params, the optimizer state ``tx.init`` gives that
list) and labels every value of the resulting jaxpr by what it depends on:

* **layer i**: computed from layer i's gradients, params and optimizer state (and from global values),
  e.g. Adam's moments of layer i, or the sum of squares of one leaf;
* **global**: combines small values of several layers (the sum of the per-leaf squared norms, the norm,
  the clipping trigger), or depends on no layer at all (the step count, the bias corrections). Global
  values are scalars or small; the ones that depend on no layer (round -1) are recomputed wherever needed.

Each layer value gets a *round*: the number of global reductions it waits for. The update of
``chain(clip_by_global_norm(c), adamw(...))`` has one: round 0 computes each leaf's sum of squares (an
*export* of its layer), the global step sums them in the whole tree's leaf order and takes the norm, round
1 clips and runs AdamW. So the trainer runs ``rounds`` passes over the layers that compute exports (the
first one also yields the gradient norm and the finite flags), one tiny global program per round, and a
final pass that produces each layer's update and new state from its own values and the globals. Every
equation is the one optax would have run on the whole tree, in the same order, on the same inputs: the
result equals ``tx.update`` on the whole model up to the rounding of the sums (each leaf's reduction is
compiled in another program). An optimizer with no cross-layer equation (Adam, AdamW, Lion, SGD, LAMB,
Adafactor: ``rounds == 0``) is *separable*: the trainer keeps its fused per-layer update, which needs no
pass of its own. An update that combines large values of several layers (not reductions) cannot be split
without holding several layers at once and is refused.

Nested programs. An update may run part of its work in nested programs: a ``jax.jit`` that stays one
equation in ``make_jaxpr`` (optax 0.2.8's ``tree_bias_correction``, a ``jit(..., inline=True)`` of the whole
moment tree, is one from JAX 0.11 on; any ``inline=False`` jit on any JAX), a custom derivative, a
``cond`` over the whole tree. Labelled as one equation, such a program would take every layer's tensors and
be refused. So the traced update is first flattened (`flatten`): every call-like equation (``jit``/``pjit``,
``closed_call``/``core_call``, ``custom_jvp_call``, ``custom_vjp_call``/``custom_vjp_call_jaxpr``,
``remat``/``checkpoint``: `_CALLS`) is replaced by the equations of its program, recursively (the program
is found among the params by type, ``ClosedJaxpr`` or ``Jaxpr``, not by a parameter name, which differs
between JAX versions; a custom derivative's rule does not matter since the update is never
differentiated); each ``cond`` is split into independent parts (`_cond_parts`: groups of outputs that
share no operand other than a scalar in any branch), one ``cond`` per part on the same branch index, so a
``cond`` on the step count over the whole tree becomes one per leaf, each labelled by its own operands
(each part gets the shared scalars it reads: Adam's step count inside ``apply_if_finite`` or
``MultiSteps``). A ``cond`` whose leaves meet only through reductions inside a branch (a clip by the
global norm inside ``MultiSteps``) cannot be split so: it is evaluated as a selection (`_select_cond`:
both branches' equations, then one ``select_n`` per output on the index), and its reductions become
global rounds like those outside a branch. A ``scan`` of at most `MAX_UNROLL` iterations whose body
reduces to scalars (``optax.scale_by_lbfgs``' two-loop recursion: an inner product of the whole update tree
per iteration) is unrolled (`_unroll_scan`): each iteration's per-leaf inner products are layer exports and
its step of the carry is each layer's element-wise work, one global round per iteration; in each unrolled
iteration the reductions, the products of scalars and the equations that compute the carry are *boxed*
(`_boxed`: a conditional of two identical branches, a program of its own), so XLA computes them on operands
held in memory in the whole model's program and in a layer's alike (unboxed, what it fused into a reduction
or into a multiply-add depended on the program, an ulp apart). Any other ``while`` or ``scan`` is labelled
as one equation by all of its operands: one layer's (muon's Newton-Schulz iterations of one leaf) is that
layer's; one that reads small values of several layers is global; one that carries large tensors of several
layers is refused. The flattened program runs exactly the equations the original
ran, on the same values: XLA inlines nested calls anyway, and a part of a ``cond`` computes its outputs as
the whole ``cond`` did. Every program that applies an update evaluates it through the same flattening
(`evaluate`, `_bind`), the whole-model update of StandardTrainer too, so the per-layer updates still equal
the whole model's bit for bit (`fence`).

Segments. ``optax.flatten`` concatenates every layer's raveled leaves into one vector and keeps its inner
optimizer's state on that vector. Such a vector is labelled as segments (`_SEG`, `LayerwiseUpdate._segment_tags`):
layer i's elements are one contiguous piece, element-wise equations keep the pieces apart, and the ``split``
back gives each layer its own. An update whose segmented values are only made, transformed element-wise and
split is separable (each layer's own update computes its segment); any other use is refused.

Per-layer optimizer state: each layer keeps ``tx.init(layer params)``, as the fused update always did. A
leaf of the whole state that belongs to no layer (the step count) exists in every layer's state, and every
copy is updated alike; the whole state's leaves are matched to the layers' by path (the whole state's path
has the layer's index where the layer's own state has none).

The guarded update (`guarded_update`, every trainer's per-layer and whole-model update alike) runs the
fenced update under a ``cond`` on "every gradient is finite" (one form everywhere: the form decides what
XLA materialises, see there); it lives here, beside the
evaluation it wraps, so the trainers' shared module (`revtrain.trainers.common`) stays below the update.

Lineage: ZeRO-Offload / ZeRO-Infinity (Ren et al. 2021, Rajbhandari et al. 2021) compute the global norm
from per-partition pieces before their streamed optimizer step; here the split is derived from optax's own
program, so any chain the user writes keeps its meaning.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jcore
from jax.tree_util import SequenceKey

from revtrain import optstate
from revtrain.errors import InputError

# An export (a layer value read by a global equation) may hold at most this many elements: the global
# program gathers every layer's exports at once, so they must be reductions, not tensors.
MAX_EXPORT_SIZE = 4096

_PRE = -1  # the round of a global value that depends on no layer (computed anywhere, e.g. the step count)

# The "layer" of a segmented vector: every layer's leaves raveled and concatenated in the whole tree's order
# (``optax.flatten``), layer i's elements one contiguous segment. See `LayerwiseUpdate` ("Segments").
_SEG = "segments"

# Primitives that compute each element of their result from the same element of each operand (a scalar
# operand: the same scalar for every element): on a segmented vector, each segment's results are those of
# the same equation on that segment alone.
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "div", "eq",
    "erf", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "sign", "sin", "sqrt", "square", "sub", "tanh", "xor"})


class CoupledUpdateError(InputError, ValueError):
    """The optimizer combines large values of several layers: it cannot be applied one layer at a time."""


def _size(v) -> int:
    return int(np.prod(v.aval.shape, dtype=np.int64)) if hasattr(v.aval, "shape") else 1


def _size_of(x) -> int:
    """Elements of an array or ``jax.ShapeDtypeStruct``."""
    return int(np.prod(x.shape, dtype=np.int64))


# Call-like primitives: an equation that runs one nested program on its operands, as if inlined. JAX names
# them differently across versions (``pjit`` became ``jit``; ``remat2`` is ``jax.checkpoint``'s); each is
# found by name and its program by type (`_sub_jaxprs`), never by a version's parameter name.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                    "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"})


def _sub_jaxprs(params: dict) -> list:
    """Every nested program among an equation's params, as ``(jaxpr, consts)``: a ``ClosedJaxpr`` or an
    open ``Jaxpr`` (no consts), alone or in a tuple (a ``cond``'s branches)."""
    found = []
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, jcore.ClosedJaxpr):
                found.append((x.jaxpr, x.consts))
            elif isinstance(x, jcore.Jaxpr):
                found.append((x, ()))
    return found


def _inlined(eqn):
    """``(jaxpr, consts)`` of a call-like equation (`_CALLS`) whose program takes exactly its operands, or
    None: a custom derivative's rule does not matter here (an optimizer update is run, never
    differentiated), so its primal program is the equation."""
    if eqn.primitive.name not in _CALLS:
        return None
    subs = _sub_jaxprs(eqn.params)
    if len(subs) != 1:
        return None
    jaxpr, consts = subs[0]
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars) or \
            len(jaxpr.constvars) != len(consts):
        return None
    return jaxpr, consts


# A ``scan`` of at most this many iterations is unrolled (`_unroll_scan`); a longer one stays one equation.
MAX_UNROLL = 64


def _unrollable(eqn):
    """The body of a ``scan`` that `_unroll_scan` unrolls, flattened (`flatten`: its nested calls inlined), or
    None: a ``scan`` of at most `MAX_UNROLL` iterations (at least one) whose body has no effects and reduces
    something to scalars (`_scalar_reduction`: an inner product, a sum; each may be a global round). Any other
    ``scan`` (muon's Newton-Schulz iterations of one matrix) stays one equation, as before."""
    if eqn.primitive.name != "scan":
        return None
    subs = _sub_jaxprs(eqn.params)
    length = eqn.params.get("length")
    if len(subs) != 1 or isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= MAX_UNROLL:
        return None
    if _scan_counts(eqn) is None:
        return None
    jaxpr, consts = subs[0]
    if jaxpr.effects or len(jaxpr.constvars) != len(consts) or not _reduces(jaxpr):
        return None
    return flatten(jcore.ClosedJaxpr(jaxpr, consts))


def _scan_counts(eqn) -> tuple | None:
    """``(consts, carry)``: how many of a ``scan`` equation's operands are its constants and its carry (the rest
    are scanned), or None where this JAX's ``scan`` does not say. JAX 0.10 and 0.11 give ``num_consts`` and
    ``num_carry``; JAX 0.12 gives ``ft_in``, the three groups' flat trees (constants, carry, scanned operands)."""
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        return p["num_consts"], p["num_carry"]
    groups = getattr(p.get("ft_in"), "elts", None)
    try:
        consts, carry, xs = (len(g) for g in groups)
    except (TypeError, ValueError):
        return None
    return (consts, carry) if consts + carry + xs == len(eqn.invars) else None


def _reduces(jaxpr) -> bool:
    """Whether ``jaxpr`` (or a program nested in it) has a `_scalar_reduction`."""
    return any(_scalar_reduction(e) or any(_reduces(j) for j, _ in _sub_jaxprs(e.params)) for e in jaxpr.eqns)


# issue 60: ``optax.scale_by_lbfgs``' two-loop recursion is a ``scan`` whose carry is the whole update tree and
# whose every iteration takes an inner product of the whole tree. As one equation it holds every layer's tensors
# (refused); unrolled, each iteration's inner product is a sum of per-leaf ``dot_general``s (each leaf's, a layer
# export) and each iteration's ``vec - alpha * du`` is element-wise work of each layer: the labelling sees one
# global round per iteration, as it sees a global-norm clip.
def _unroll_scan(eqn, body, invals, scalars: list | None) -> list:
    """``eqn`` (a ``scan`` of ``length`` iterations, `_unrollable`) evaluated as its iterations, one after
    another: iteration ``t`` (from the last when ``reverse``) runs the body's equations (`_iteration`) on the
    consts, the carry and element ``t`` of each scanned operand (``lax.index_in_dim``); each per-iteration
    output is stacked on a new leading axis in iteration-index order (``jnp.stack``). Every value is the one
    the ``scan`` computes, by the same equations on the same operands: only the loop is gone.

    Returns the ``scan``'s results: the final carry, then the stacked outputs."""
    jaxpr, consts_ = body.jaxpr, body.consts
    p = eqn.params
    n, (nc, ncar) = p["length"], _scan_counts(eqn)
    consts, carry, xs = list(invals[:nc]), list(invals[nc:nc + ncar]), list(invals[nc + ncar:])
    ys: list = [None] * n
    with eqn.ctx.manager:
        for t in (range(n - 1, -1, -1) if p.get("reverse") else range(n)):
            out = _iteration(jaxpr, consts_, consts + carry + [lax.index_in_dim(x, t, 0, keepdims=False) for x in xs],
                             ncar, scalars)
            carry, ys[t] = out[:ncar], out[ncar:]
        stacked = [jnp.stack([jnp.asarray(y[j], o.aval.dtype) for y in ys])
                   for j, o in enumerate(eqn.outvars[ncar:])]
    return carry + stacked


def _iteration(jaxpr, consts, args, num_carry: int, scalars: list | None) -> list:
    """One iteration of an unrolled ``scan`` (`_unroll_scan`): the body's equations on ``args``, as `evaluate`
    runs them (`_bind`, fenced with ``scalars``), except that those `_boxable` with the carry's arrays (the
    first ``num_carry`` results that are arrays: the next iteration's ``vec``) are `_boxed`."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    carried = {v for v in jaxpr.outvars[:num_carry] if isinstance(v, jcore.Var) and _size(v) > 1}

    def read(v):
        return env[v] if isinstance(v, jcore.Var) else v.val

    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        if _boxable(eqn, carried):
            out = _boxed(eqn, vals)
        else:
            out = _bind(eqn, vals, scalars)
        env.update(zip(eqn.outvars, out))
    return [read(v) for v in jaxpr.outvars]


def _boxable(eqn, carried: set) -> bool:
    """Whether an equation of an unrolled iteration is `_boxed`: a reduction to scalars (`_scalar_reduction`: an
    inner product, a sum), a floating product or quotient of scalars (``rho * dot``, whose sum ``alpha - beta`` XLA
    may contract into a fused multiply-add in one program and not in another), or an equation that computes an
    array of the carry (in ``carried``: the next iteration's ``vec``). Never a call or control flow."""
    if eqn.primitive.name in _CALLS or _sub_jaxprs(eqn.params) or eqn.effects:
        return False
    if carried.intersection(eqn.outvars) or _scalar_reduction(eqn):
        return True
    return eqn.primitive.name in ("mul", "div") and all(_is_scalar(o) for o in eqn.outvars) and any(
        isinstance(x, jcore.Var) for x in eqn.invars)


def _scalar_reduction(eqn) -> bool:
    """``eqn`` reduces an array to scalars: every result a scalar, some operand larger (``dot_general`` of two
    vectors, ``reduce_sum``, ``reduce_max``, ...); not a call or control flow (those are evaluated inside)."""
    if eqn.primitive.name in _CALLS or _sub_jaxprs(eqn.params):
        return False
    sizes = [_size(v) for v in eqn.invars]
    return bool(sizes) and all(getattr(o.aval, "shape", None) == () for o in eqn.outvars) and max(sizes) > 1


# issue 60: an unrolled iteration's equations, boxed. Unrolled, ``scale_by_lbfgs``' iteration k takes
# ``dot(dw_k, vec_k)`` with ``vec_k = vec_{k-1} - alpha * du`` computed in the same program. How XLA:CPU evaluates
# that reduction depends on what it fuses into it: in the whole model's update ``vec_k`` has another user (the next
# iteration's step) and is held in memory, in a layer's statistics pass (round k) the inner product is its only
# user and XLA fused ``vec_{k-1} - alpha * du`` into the reduction (a YNNPACK fusion): the product then came out
# one ulp apart (``optax.scale_by_lbfgs``, memory 3, step 4, a 128x32 kernel; ``lax.optimization_barrier`` does not
# stop that fusion: XLA:CPU removes the barrier first). Likewise the left loop's ``alpha - rho * dot`` (contracted
# into a fused multiply-add or not, by the program it was fused into) and the carry's ``vec + c * dw``. A
# conditional's branches are programs of their own, whose operands XLA holds in memory: boxed, each such equation
# reads the same buffers in every program (the whole model's, a layer's statistics and update passes, a global one).
def _boxed(eqn, vals: list) -> list:
    """``eqn`` (`_boxable`) evaluated inside a ``lax.switch`` of two identical branches, on an index
    read from its first non-empty operand (``x != x`` of its first element: 0, or 1 for a NaN; either branch
    computes the same), so that XLA computes it on its operands as they are in memory, in a program of its own,
    whatever the program around it fuses (see above). Literal operands stay constants of the branches."""
    pos = [k for k, v in enumerate(eqn.invars) if isinstance(v, jcore.Var)]
    probe = next((vals[k] for k in pos if _size(eqn.invars[k]) > 0
                  and not jax.dtypes.issubdtype(eqn.invars[k].aval.dtype, jax.dtypes.extended)), None)
    if probe is None:
        return _bind(eqn, vals)
    first = jnp.ravel(probe)[0]
    index = (first != first).astype(jnp.int32)

    def branch(*ops):
        full = list(vals)
        for k, x in zip(pos, ops):
            full[k] = x
        out = eqn.primitive.bind(*full, **eqn.primitive.get_bind_params(eqn.params))
        return list(out) if eqn.primitive.multiple_results else [out]

    with eqn.ctx.manager:
        return lax.switch(index, [branch, branch], *(vals[k] for k in pos))


def _bind(eqn, invals, scalars: list | None = None):
    """One equation, as ``jax.core.eval_jaxpr`` runs it, except that a call-like equation (a nested
    ``jit``, a closed call, a custom derivative's primal, a remat: `_CALLS`) is evaluated equation by
    equation, as XLA inlines it anyway, that a ``scan`` that reduces to scalars is unrolled (`_unroll_scan`),
    and that a ``cond`` whose branches compute independent parts is
    split into one ``cond`` per part (`_split_cond`), or, when its parts meet only through reductions,
    evaluated as a selection between its branches' equations (`_select_cond`).

    With ``scalars`` (a list), the equation is also *fenced* (see `fence`): the floating scalars it
    broadcasts over a larger result are appended to the list and each branch of a ``cond`` fences its own
    scalars; the scalars inside other nested programs (a ``scan`` that is not unrolled, a ``while``) are not
    reached."""
    call = _inlined(eqn)
    if call is not None:
        return evaluate(call[0], call[1], invals, scalars)
    body = _unrollable(eqn)
    if body is not None:
        return _unroll_scan(eqn, body, invals, scalars)
    params = eqn.params
    if eqn.primitive.name == "cond":
        parts = _cond_parts(eqn)
        if parts is None:  # its leaves meet only through reductions: the branches' equations, selected
            return _select_cond(eqn, invals, scalars)
        if len(parts) > 1:
            return _split_cond(eqn, invals, parts, scalars)
    if scalars is not None:
        scalars.extend(v for v, x in zip(invals, eqn.invars) if _broadcast_scalar(x, eqn))
        if eqn.primitive.name == "cond":
            params = dict(params, branches=tuple(_fenced_jaxpr(b) for b in params["branches"]))
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    out = out if eqn.primitive.multiple_results else [out]
    if scalars is not None and eqn.primitive.name == "pvary":
        # Inside shard_map a replicated scalar meets a split leaf through a ``pvary`` (a cast that lowers
        # to nothing): the scalar XLA sees is its operand, a constant when the operand is a literal.
        scalars.extend(_Cast(o, v if isinstance(x, jcore.Var) else None)
                       for v, x, o in zip(invals, eqn.invars, out) if _is_scalar(x))
    return out


def _dependencies(jaxpr, through_reductions: bool = True) -> list[int]:
    """For each output of ``jaxpr``: the inputs it depends on, as a bit mask over ``jaxpr.invars`` (an
    equation's outputs depend on all of its operands; call-like ones are inlined first by `flatten`).
    ``through_reductions=False``: a value smaller than an operand of its equation (a reduction: a sum of
    squares, an "all finite") depends on nothing, so the masks follow only full-size data."""
    deps = {v: 1 << k for k, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        mask = 0
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                mask |= deps.get(v, 0)
        if not through_reductions and any(_size(o) < max((_size(v) for v in eqn.invars), default=0)
                                          for o in eqn.outvars):
            mask = 0
        for o in eqn.outvars:
            deps[o] = mask
    return [deps.get(v, 0) if isinstance(v, jcore.Var) else 0 for v in jaxpr.outvars]


# issue 60 (60b): a ``cond`` over the whole tree is split, or selected, like the program outside a branch.
# ``apply_if_finite(adam)`` and ``MultiSteps(adamw)`` run Adam inside a ``cond`` whose every leaf reads the
# step count (the bias correction): joined through that shared scalar, the whole tree was one part, one
# equation over every layer's tensors, refused. Now a scalar operand joins no parts (each part that reads
# it gets it), so each leaf is its own ``cond``, labelled by its layer. A ``cond`` whose leaves still meet,
# but only through reductions (``MultiSteps(chain(clip_by_global_norm, adam))``: the norm inside the
# branch), has no per-leaf split: it is evaluated as a selection (`_select_cond`), so that the labelling
# sees its reductions as the global rounds they are.
def _cond_parts(eqn) -> list[tuple[list[int], list[int]]] | None:
    """A ``cond`` split into independent parts: ``[(operand positions, output positions)]``, the operands
    counted after the branch index. Two outputs are in one part when, in some branch, they depend on a
    common operand that is not a scalar (a scalar, e.g. a step count, is given to every part that reads
    it); an output that depends on no such operand is a part of its own. One part (the whole ``cond``)
    when a branch has effects. None when a part's outputs meet only through reductions (they fall apart
    when dependencies stop at reductions, `_dependencies`): the ``cond`` is to be selected
    (`_select_cond`), not split."""
    branches = [flatten(b) for b in eqn.params["branches"]]
    n_ops, n_outs = len(eqn.invars) - 1, len(eqn.outvars)
    if any(b.jaxpr.effects for b in branches) or n_outs <= 1:
        return [(list(range(n_ops)), list(range(n_outs)))]
    joins = [k for k, v in enumerate(eqn.invars[1:]) if _size(v) > 1]  # the operands that join outputs

    def groups(through_reductions: bool) -> tuple[list[int], list[int]]:
        """(each output's group root, each output's operand mask over every branch)."""
        parent = list(range(n_ops + n_outs))  # union-find: operands 0..n_ops-1, then outputs

        def root(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        masks = [0] * n_outs
        for b in branches:
            for j, mask in enumerate(_dependencies(b.jaxpr, through_reductions)):
                masks[j] |= mask
                for k in joins:
                    if mask >> k & 1:
                        parent[root(n_ops + j)] = root(k)
        return [root(n_ops + j) for j in range(n_outs)], masks

    roots, masks = groups(True)
    data_roots, _ = groups(False)
    parts: dict[int, tuple[list, list]] = {}
    for j in range(n_outs):
        parts.setdefault(roots[j], ([], []))[1].append(j)
    for op_pos, out_pos in parts.values():
        if len({data_roots[j] for j in out_pos}) > 1 and all(
                _selectable(b) for b in branches) and _selectable_outputs(eqn):
            return None
        mask = 0
        for j in out_pos:
            mask |= masks[j]
        op_pos.extend(k for k in range(n_ops) if mask >> k & 1)  # an operand no output reads is dropped
    return list(parts.values())


def _selectable(closed) -> bool:
    """A ``cond`` branch (a ``ClosedJaxpr``) that `_select_cond` may run unconditionally: no effects."""
    return not closed.jaxpr.effects


def _selectable_outputs(eqn) -> bool:
    """Every output of ``eqn`` is a plain numeric array (``select_n`` takes no token or typed PRNG key)."""
    return all(hasattr(getattr(o, "aval", None), "shape") and hasattr(o.aval, "dtype")
               and not jax.dtypes.issubdtype(o.aval.dtype, jax.dtypes.extended) for o in eqn.outvars)


def _select_cond(eqn, invals, scalars: list | None) -> list:
    """``eqn`` (a ``cond``) evaluated as ``select_n(index, *the branches' results)``, output by output:
    every branch runs (`evaluate`, so its nested calls are flattened, and each branch's broadcast scalars
    are fenced against its own results, as inside the ``cond``) and the index picks each output, so the
    result is the taken branch's, equation for equation; the labelling sees the branches' reductions as
    global values, their element-wise work in its layers.

    The index passes through ``lax.optimization_barrier`` first: XLA would otherwise fuse its computation
    (a reduction over the whole tree in ``apply_if_finite``) into the select of every leaf (a program of N
    leaves growing as N**2, as `guarded_update` notes). The untaken branch's values are computed and
    discarded (non-finite values there never reach a result); the cost is both branches' arithmetic."""
    index, ops = lax.optimization_barrier(invals[0]), invals[1:]
    results = []
    for b in eqn.params["branches"]:
        own = [] if scalars is not None else None
        out = evaluate(b.jaxpr, b.consts, ops, own)
        results.append(fence(own, out) if own else out)
    if len(results) == 1:
        return results[0]
    with eqn.ctx.manager:
        return [lax.select_n(index, *(jnp.asarray(c, o.aval.dtype) for c in cases))
                for o, cases in zip(eqn.outvars, zip(*results))]


def _split_cond(eqn, invals, parts, scalars: list | None):
    """``eqn`` (a ``cond``) as one ``cond`` per part (`_cond_parts`), each on the same branch index: every
    output is computed by the same equations from the same operands, so the values are the ``cond``'s. With
    ``scalars``, each part's branches fence their own scalars (`_fenced_jaxpr`)."""
    index, ops = invals[0], invals[1:]
    out = [None] * len(eqn.outvars)
    for op_pos, out_pos in parts:
        branches = tuple(_part_jaxpr(b, op_pos, out_pos, scalars is not None) for b in eqn.params["branches"])
        with eqn.ctx.manager:
            res = eqn.primitive.bind(index, *(ops[k] for k in op_pos),
                                     **eqn.primitive.get_bind_params(dict(eqn.params, branches=branches)))
        for j, r in zip(out_pos, res):
            out[j] = r
    return out


def _part_jaxpr(closed, op_pos: list[int], out_pos: list[int], fenced: bool):
    """The program of a ``cond`` branch that computes only outputs ``out_pos`` from operands ``op_pos``
    (the equations those outputs need, `evaluate`'s ``outputs``); ``fenced``: against its own results."""
    avals = closed.in_avals
    # The flattened branch, as `_cond_parts` read its dependencies: in the original a nested call (optax's
    # ``tree_bias_correction``, one ``jit`` equation over the whole tree from JAX 0.11 on) would be needed whole
    # for one output and read operands this part does not have.
    flat = flatten(closed)

    def run(*args):
        full = [None] * len(avals)
        for k, a in zip(op_pos, args):
            full[k] = a
        scalars = [] if fenced else None
        out = evaluate(flat.jaxpr, flat.consts, full, scalars, outputs=out_pos)
        return fence(scalars, out) if fenced else out

    return jax.make_jaxpr(run)(*(avals[k] for k in op_pos))


def flatten(closed):
    """``closed`` (a ``ClosedJaxpr``) with every call-like equation inlined, recursively, and every
    ``cond`` split into its independent parts (`_bind`): the program `LayerwiseUpdate` labels. Same
    inputs and outputs, same values: each equation left is one the original ran."""
    return jax.make_jaxpr(lambda *args: evaluate(closed.jaxpr, closed.consts, args))(*closed.in_avals)


def _is_scalar(var) -> bool:
    """``var`` is a floating scalar (a jaxpr variable or literal)."""
    aval = getattr(var, "aval", None)
    return getattr(aval, "shape", None) == () and jnp.issubdtype(aval.dtype, jnp.inexact)


def _broadcast_scalar(var, eqn) -> bool:
    """``var`` is a floating scalar that ``eqn`` broadcasts over a larger result (``div m v``: Adam's moment
    ``m`` over its bias correction ``v``)."""
    return (isinstance(var, jcore.Var) and _is_scalar(var)
            and any(getattr(o.aval, "shape", ()) != () for o in eqn.outvars))


@dataclasses.dataclass(frozen=True, eq=False)
class _Cast:
    """A record in a list of scalars to `fence`: ``cast`` is ``pvary(source)`` (``source`` None: of a
    constant). `fence` fences the source in the cast's place."""
    cast: object
    source: object


def _vma(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    mat = getattr(jax.typeof(x), "mat", None)  # a ShapedArray's; none for a token
    return mat.varying if mat is not None else frozenset()


def _fenced_jaxpr(closed):
    """A ``cond`` branch evaluated with its scalars fenced (`fence`) against its own results."""
    def run(*args):
        scalars: list = []
        return fence(scalars, evaluate(closed.jaxpr, closed.consts, args, scalars))

    return jax.make_jaxpr(run)(*closed.in_avals)


def evaluate(jaxpr, consts, args, scalars: list | None = None, outputs: list[int] | None = None) -> list:
    """``jaxpr``'s results from ``args``, equation by equation (`_bind`; fenced with ``scalars``). With
    ``outputs`` (positions in ``jaxpr.outvars``): only those results, and only the equations they need run
    (an input they do not need may be None)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return env[v] if isinstance(v, jcore.Var) else v.val

    wanted = jaxpr.outvars if outputs is None else [jaxpr.outvars[j] for j in outputs]
    eqns = jaxpr.eqns
    if outputs is not None:  # the equations the wanted results need, found backwards
        need = {v for v in wanted if isinstance(v, jcore.Var)}
        keep = []
        for eqn in reversed(eqns):
            if any(o in need for o in eqn.outvars):
                keep.append(eqn)
                need.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        eqns = keep[::-1]
    for eqn in eqns:
        env.update(zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars], scalars)))
    return [read(v) for v in wanted]


def fence(scalars: list, value):
    """``value`` passed through ``lax.optimization_barrier`` together with ``scalars``: each scalar gets
    a use that XLA can neither remove nor look through.

    Why: XLA's algebraic simplifier rewrites ``A / broadcast(s)`` as ``A * broadcast(1 / s)`` when the
    scalar ``s`` has no other use (today on CPU only). In the whole-model update a scalar that every leaf
    divides by (Adam's bias corrections, a global norm) has one use per leaf, so the leaves divide; in one
    layer's update of a layer with a single leaf (a token embedding) it has one use, so that leaf was
    multiplied by a reciprocal instead, a few ulps away. With every such scalar fenced, in every program
    that updates (both trainers, fused or deferred), no rewrite depends on how many leaves share a scalar,
    and the per-layer updates equal the whole model's bit for bit. The cost: one barrier of a few scalars
    that ``value`` (a flag, or the update's results) waits for.

    Inside ``shard_map`` (sharded state: a layer's split leaves vary over ``"data"``, its small leaves and
    the flag are replicated) a barrier's results vary over every axis any of its operands varies over, so
    one barrier would turn replicated results into varying ones, which ``shard_map`` refuses for a ``P()``
    output. So: a scalar reached through a ``pvary`` (`_Cast`) is fenced as its replicated operand, which
    is the value XLA sees (a ``pvary`` of a constant is dropped: the replicated program broadcasts the
    constant itself); ``value``'s leaves go through one barrier per set of varying axes (every leaf through
    one, as outside ``shard_map``); each scalar joins the barrier of the least varying leaves that vary
    over all its axes (cast up with ``pvary``, which lowers to nothing). A scalar that varies over an axis
    no leaf of ``value`` varies over would have no barrier to join and is left unfenced (no trainer program
    has one: their broadcast scalars are replicated). Outside ``shard_map`` this is one barrier of every
    scalar and leaf.

    Args:
      scalars: traced floating scalars (and `_Cast` records), as `_bind` collects them; duplicates are
        fenced once.
      value: a pytree of traced arrays, returned with the same structure, shapes and dtypes.
    """
    casts = {id(c.cast): c.source for c in scalars if isinstance(c, _Cast)}

    def source(s):
        while s is not None and id(s) in casts:
            s = casts[id(s)]
        return s

    resolved = (source(s) for s in scalars if not isinstance(s, _Cast))
    unique = list({id(s): s for s in resolved if s is not None}.values())
    if not unique:
        return value
    leaves, tree = jax.tree.flatten(value)
    groups: dict[frozenset, list] = {}  # varying axes -> [indices of value's leaves, fenced scalars]
    for i, leaf in enumerate(leaves):
        groups.setdefault(_vma(leaf), [[], []])[0].append(i)
    for s in unique:
        axes = _vma(s)
        fits = [g for g in groups if axes <= g]
        if fits:
            g = min(fits, key=len)
            groups[g][1].append(jax.lax.pcast(s, tuple(sorted(g - axes)), to="varying") if g - axes else s)
    out = list(leaves)
    for indices, fenced in groups.values():  # every leaf passes a barrier, as outside shard_map
        passed = jax.lax.optimization_barrier((tuple(fenced), tuple(leaves[i] for i in indices)))[1]
        for i, x in zip(indices, passed):
            out[i] = x
    return jax.tree.unflatten(tree, out)


def deferred_layer_update(tx, layerwise: "LayerwiseUpdate", index: int, grads, opt_state, params, globals_, ok,
                          value=None, hvp=None):
    """One layer's update of the deferred update's last pass: ``(new params, new optimizer state)``, the old ones
    where ``ok`` (a bool scalar: every gradient and the loss finite) is False. Under a `lax.cond` on ``ok``, the
    form of `guarded_update` (the whole-model update's: the same fusions, so the same rounding), the update
    evaluated equation by equation (`fenced_update` for a separable optimizer, else ``layerwise.update`` of
    layer ``index`` with the rounds' ``globals_``) and its scalars fenced. ``value``: the step's loss (a float32
    scalar), given to an optimizer that reads it (`LayerwiseUpdate.takes_value`), else None; ``hvp``: the layer's
    Hessian-vector product for one that reads it (`LayerwiseUpdate.takes_hvp`), else None.

    Used by the reversible trainer's deferred update (`revtrain.trainers.deferred`) and by ``revtrain check``'s
    per-layer optimizer step (`revtrain.check_optimizer`)."""
    def update():
        scalars: list = []
        if layerwise.separable:
            updates, new_opt, more = fenced_update(tx, grads, opt_state, params)
            scalars.extend(more)
        else:
            updates, new_opt = layerwise.update(index, grads, opt_state, params, globals_, scalars, value=value,
                                                hvp=hvp)
        new_params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)  # optax.apply_updates
        return fence(scalars, (new_params, new_opt))

    return lax.cond(ok, update, lambda: (params, opt_state))


def fenced_update(tx, grads, opt_state, params, value=None, hvp=None):
    """``tx.update(grads, opt_state, params)`` evaluated equation by equation: ``(updates, new state,
    scalars)``, the scalars to `fence` (what the update broadcasts over its leaves). ``value`` (not None: a
    float32 scalar, the step's loss): passed as ``tx.update``'s keyword argument ``value``
    (`revtrain.optstate.takes_value`); ``hvp`` (not None: a tree like ``params``, the Hessian-vector product
    of optax's Hutchinson estimator): passed as its ``obj_fn`` (`revtrain.optstate.given_products`); None
    traces the update as before, without them."""
    if value is None and hvp is None:
        closed, shapes = jax.make_jaxpr(tx.update, return_shape=True)(grads, opt_state, params)
        args = jax.tree.leaves((grads, opt_state, params))
    else:
        closed, shapes = jax.make_jaxpr(lambda g, s, p, v, h: tx.update(g, s, p, **optstate.update_keywords(v, h)),
                                        return_shape=True)(grads, opt_state, params, value, hvp)
        args = jax.tree.leaves((grads, opt_state, params, value, hvp))
    scalars: list = []
    out = evaluate(closed.jaxpr, closed.consts, args, scalars)
    updates, new_state = jax.tree.unflatten(jax.tree.structure(shapes), out)
    return updates, new_state, scalars


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


@dataclasses.dataclass
class _Tag:
    layer: int | None  # None: global
    round: int


class LayerwiseUpdate:
    """``tx.update`` of the whole model, split into per-layer programs and small global ones.

    Args:
      tx: any optax ``GradientTransformation``.
      layer_params: one params tree per layer (arrays or ``jax.ShapeDtypeStruct``), as the trainer holds
        them (a tied leaf only in its owner's).

    Attributes:
      rounds: global reductions the update waits for (0: separable, each layer's update is ``tx.update`` of
        its own tree).
      num_layers: the number of layers.
      takes_value: the update reads the keyword argument ``value``, the step's loss
        (`revtrain.optstate.takes_value`: ``optax.polyak_sgd``, ``optax.contrib.momo``, ``reduce_on_plateau``,
        ...). The loss is one more input of the traced update, a scalar that depends on no layer: like a
        leaf every layer's state has (the step count), every layer program and every global program reads
        it (`exports`, `combine` and `update` take it as ``value``). Such an update is never `separable`: it
        runs as the deferred update, whose passes come after the step's loss is known.
      takes_hvp: the update reads ``obj_fn`` for optax's Hutchinson estimator (`revtrain.optstate.takes_hvp`:
        ``optax.contrib.sophia``). It is traced with the stand-in objective of a given Hessian-vector product
        (`revtrain.optstate.given_products`), one more input per leaf, labelled by its layer as a gradient
        is (`exports` and `update` take layer i's as ``hvp``); never `separable` (the deferred update's passes
        run after the trainer's pass that computes the products, `revtrain.trainers.hessian`).

    Raises:
      CoupledUpdateError: the update combines large values of several layers, or the whole optimizer
        state cannot be matched to the layers' states.
    """

    def __init__(self, tx, layer_params: list, _own: bool = False):
        self.tx = tx
        shapes = [_shapes(p) for p in layer_params]
        self._layer_shapes_in = shapes
        n = self.num_layers = len(shapes)
        self._layer_state = [jax.eval_shape(tx.init, p) for p in shapes]
        whole_state = jax.eval_shape(tx.init, shapes)
        self._state_def = [jax.tree.structure(s) for s in self._layer_state]
        self._update_def = [jax.tree.structure(p) for p in shapes]
        self.takes_value = optstate.takes_value(tx, shapes)
        self.takes_hvp = optstate.takes_hvp(tx, shapes)
        # (the loss, then the Hessian-vector products: more inputs, after the parameters)
        closed = flatten(jax.make_jaxpr(lambda g, s, p, v, h: tx.update(g, s, p, **optstate.update_keywords(v, h)))(
            shapes, whole_state, shapes, optstate.VALUE_SHAPE if self.takes_value else None,
            shapes if self.takes_hvp else None))
        self._jaxpr, self._consts = closed.jaxpr, closed.consts

        # Inputs: (grads, whole state, params), flattened. Map each to a layer leaf (kind, layer, index).
        grad_leaves = [(i, q) for i in range(n) for q in range(len(jax.tree.leaves(shapes[i])))]
        whole_paths = jax.tree_util.tree_flatten_with_path(whole_state)[0]
        # whole state leaf -> (layer, index in its state), or (None, path) for a leaf every layer's state has
        state_map = self._match_state(whole_paths)
        invars = self._jaxpr.invars
        ng, ns = len(grad_leaves), len(whole_paths)
        if len(invars) != 2 * ng + ns + self.takes_value + ng * self.takes_hvp:
            raise CoupledUpdateError("the optimizer's update does not take one value per leaf")
        # var -> ("g" | "p" | "s" | "h", layer, leaf index), ("s", None, path) or ("v", None, None)
        self._inputs = {}
        tags: dict = {}
        if self.takes_value:  # the step's loss: a global input that depends on no layer, read anywhere
            self._inputs[invars[2 * ng + ns]] = ("v", None, None)
            tags[invars[2 * ng + ns]] = _Tag(None, _PRE)
        for k, (i, q) in enumerate(grad_leaves):
            self._inputs[invars[k]] = ("g", i, q)
            self._inputs[invars[ng + ns + k]] = ("p", i, q)
            tags[invars[k]] = tags[invars[ng + ns + k]] = _Tag(i, 0)
            if self.takes_hvp:  # layer i's Hessian-vector product, an input of its own like its gradient
                h = invars[2 * ng + ns + self.takes_value + k]
                self._inputs[h], tags[h] = ("h", i, q), _Tag(i, 0)
        self._global_paths = [q for layer, q in state_map if layer is None]
        # Segments: a vector of every layer's elements, segment i layer i's (its sizes in ``self._segments``).
        sizes = tuple(sum(_size_of(x) for x in jax.tree.leaves(p)) for p in shapes)
        self._segments, segmented = sizes, set()
        for k, (layer, q) in enumerate(state_map):
            self._inputs[invars[ng + k]] = ("s", layer, q)
            tags[invars[ng + k]] = _Tag(layer, 0) if layer is not None else _Tag(None, _PRE)
            if layer == _SEG:
                segmented.add(invars[ng + k])
        for v in self._jaxpr.constvars:
            tags[v] = _Tag(None, _PRE)

        # Label every equation (see the module note).
        self._eqn_tag: list[_Tag] = []
        exports: list[dict] = [dict() for _ in range(n)]  # layer -> {var: round}
        producer = {}
        for eqn in self._jaxpr.eqns:
            seg = self._segment_tags(eqn, tags, segmented, producer)
            for o in eqn.outvars:
                producer[o] = eqn
            if seg is not None:
                tag, out_tags = seg
                self._eqn_tag.append(tag)
                for o, t in zip(eqn.outvars, out_tags):
                    tags[o] = t
                    if t.layer == _SEG:
                        segmented.add(o)
                continue
            ins = [tags[v] for v in eqn.invars if isinstance(v, jcore.Var)]
            layers = {t.layer for t in ins if t.layer is not None}
            late = [t.round for t in ins if t.layer is None and t.round > _PRE]
            layer_vars = [v for v in eqn.invars if isinstance(v, jcore.Var) and tags[v].layer is not None]
            scalar_out = all(_size(o) <= 1 for o in eqn.outvars)
            if not layers:
                tag = _Tag(None, max(late, default=_PRE))
            elif len(layers) == 1 and not late:
                tag = _Tag(layers.pop(), max((t.round for t in ins if t.layer is not None), default=0))
            elif (len(layers) > 1 or scalar_out) and all(_size(v) <= MAX_EXPORT_SIZE for v in layer_vars) and \
                    all(_size(o) <= MAX_EXPORT_SIZE for o in eqn.outvars):
                for v in layer_vars:
                    exports[tags[v].layer][v] = tags[v].round
                tag = _Tag(None, max([tags[v].round for v in layer_vars] + late))
            elif len(layers) == 1:
                tag = _Tag(layers.pop(), max(max((t.round for t in ins if t.layer is not None), default=0),
                                             max(late) + 1))
            else:
                raise CoupledUpdateError(
                    f"the optimizer combines whole tensors of several layers ({eqn.primitive.name} of "
                    f"{', '.join(str(v.aval) for v in layer_vars[:3])}), so no layer's update can be computed "
                    "without the others on the device; train it with StandardTrainer")
            self._eqn_tag.append(tag)
            for o in eqn.outvars:
                tags[o] = tag
        self._tags = tags

        # Outputs: updates (per layer, like params), then the new whole state.
        outs = self._jaxpr.outvars
        self._out_updates = [[] for _ in range(n)]
        for k, (i, q) in enumerate(grad_leaves):
            self._out_updates[i].append(outs[k])
        self._out_state = [[None] * len(jax.tree.leaves(s)) for s in self._layer_state]
        for k, (layer, q) in enumerate(state_map):
            for i in ([layer] if layer not in (None, _SEG) else range(n)):
                self._out_state[i][q if layer not in (None, _SEG) else self._index[i][q]] = outs[ng + k]
        for i in range(n):
            if any(v is None for v in self._out_state[i]):
                raise CoupledUpdateError(f"the optimizer state of layer {i} does not match the whole model's")

        def need(v):  # the pass an output or export waits for
            if not isinstance(v, jcore.Var):
                return 0
            t = tags[v]
            return t.round if t.layer is not None else t.round + 1

        final = [need(v) for vs in self._out_updates + self._out_state for v in vs]
        self.rounds = max(final + [r + 1 for e in exports for r in e.values()], default=0)
        # The exports of each pass, per layer, in a fixed order (the global program reads them by position).
        self._exports = [[[v for v, r in e.items() if r == k] for e in exports] for k in range(self.rounds)]
        # The global values the layers read (an operand of a layer's equation, or an output: a global state
        # leaf such as DoWG's weighted sum), in round order (stable: program order within a round), so that
        # the globals of rounds < k are a prefix of this list. Only these leave the global programs: a global
        # that only other globals read stays inside the program that computes it, as in the whole-model
        # program, where XLA fuses it with its users (DoWG's ``estim * squares + weighted`` is one fused
        # multiply-add there: with the product a result of the global program too, it was rounded twice).
        read = {v for e, t in zip(self._jaxpr.eqns, self._eqn_tag) if t.layer is not None
                for v in e.invars if isinstance(v, jcore.Var)}
        read.update(v for vs in self._out_updates + self._out_state for v in vs if isinstance(v, jcore.Var))
        self._globals = sorted((v for v, t in tags.items() if t.layer is None and t.round > _PRE and v in read),
                               key=lambda v: tags[v].round)
        self._names = {v: k for k, v in enumerate(tags)}
        self._producer = {o: e for e in self._jaxpr.eqns for o in e.outvars}
        self._signatures: dict = {}
        self._layer_shapes, self._separable = shapes, None  # (`separable` is computed on first use)
        self._hvp_conds = self._products_read_under() if self.takes_hvp else None
        if segmented and not _own and not self.separable:
            # A segmented vector is evaluated only as each layer's own update (the separable form): a layer's
            # slice of the whole program would need each equation re-shaped to its segment.
            raise CoupledUpdateError(
                "the optimizer concatenates every layer's tensors into one vector and its update of that vector is "
                "not each layer's own (a reduction over it, or values its layers' own updates compute otherwise), "
                "so no layer's update can be computed without the others on the device; train it with "
                "StandardTrainer")

    @property
    def separable(self) -> bool:
        """True when no equation combines layers and each layer's update is ``tx.update`` of its own tree: the
        values every layer computes alike (round -1: the step count, the bias corrections) are the ones its
        own update computes. Not so for ``optax.noisy_sgd``: it splits its key into one key per leaf of the
        whole tree, so a layer's own update would split it over its own leaves and draw other noise; its
        layers run their slices of the whole program (the deferred update, issue 60). Never for an update that
        reads the step's loss (`takes_value`): the fused per-layer update, inside each layer's backward
        program, is not given the loss; the deferred update's passes run after it is known."""
        if self._separable is None:
            self._separable = (self.rounds == 0 and not self.takes_value and not self.takes_hvp
                               and all(self._own_alike(i) for i in range(self.num_layers)))
        return self._separable

    def _needed_pre(self, i: int) -> list:
        """The round -1 equations layer ``i``'s outputs need, as comparable records (primitive, params,
        operand and result types), sorted."""
        seen, stack = set(), [v for v in self._out_updates[i] + self._out_state[i] if isinstance(v, jcore.Var)]
        while stack:
            e = self._producer.get(stack.pop())
            if e is not None and id(e) not in seen:
                seen.add(id(e))
                stack.extend(x for x in e.invars if isinstance(x, jcore.Var))
        return sorted((e.primitive.name, str(e.params), tuple(str(v.aval) for v in e.invars),
                       tuple(str(v.aval) for v in e.outvars))
                      for e, t in zip(self._jaxpr.eqns, self._eqn_tag)
                      if id(e) in seen and t.layer is None and t.round == _PRE)

    def _own_alike(self, i: int) -> bool:
        """Whether ``tx.update`` of layer ``i``'s own tree computes the round -1 values that layer ``i`` reads
        in the whole model's update (traced once per distinct layer structure)."""
        shapes = self._layer_shapes[i]
        key = ("own", jax.tree.structure(shapes), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(shapes)))
        if key not in self._signatures:
            try:
                self._signatures[key] = LayerwiseUpdate(self.tx, [shapes], _own=True)._needed_pre(0)
            except CoupledUpdateError:
                self._signatures[key] = None
        return self._signatures[key] == self._needed_pre(i)

    def _products_read_under(self) -> list | None:
        """Under which predicates the update reads its Hessian-vector products (`takes_hvp`): ``[(predicate var,
        number of cases, the cases that read them), ...]`` when every value computed from them reaches the
        update's results only through a ``cond`` (its branches) or a ``select_n`` (its cases: a ``cond``
        evaluated as a selection, `_select_cond`) on a value that depends on no layer (round -1: Sophia's
        ``count % update_interval == 0``); None when one reaches a result unconditionally (the bare estimator)."""
        derived = {v for v, (kind, _, _) in self._inputs.items() if kind == "h"}
        out = []
        for e in self._jaxpr.eqns:
            reads = [k for k, x in enumerate(e.invars) if isinstance(x, jcore.Var) and x in derived]
            if not reads:
                continue
            index = e.invars[0]
            on_global = (isinstance(index, jcore.Var) and index not in derived and self._tags[index].layer is None
                         and self._tags[index].round == _PRE)
            if on_global and e.primitive.name == "select_n":
                out.append((index, len(e.invars) - 1, tuple(k - 1 for k in reads)))
                continue
            if on_global and e.primitive.name == "cond":
                used = []
                for b, branch in enumerate(e.params["branches"]):
                    jaxpr = branch.jaxpr
                    read = {x for q in jaxpr.eqns for x in q.invars if isinstance(x, jcore.Var)}
                    read.update(x for x in jaxpr.outvars if isinstance(x, jcore.Var))
                    if any(jaxpr.invars[k - 1] in read for k in reads):
                        used.append(b)
                out.append((index, len(e.params["branches"]), tuple(used)))
                continue
            derived.update(e.outvars)
        if any(v in derived for vs in self._out_updates + self._out_state for v in vs):
            return None
        return out

    def products_needed(self, global_leaves: tuple):
        """Whether this step's update reads its Hessian-vector products (`takes_hvp`), from the leaves every
        layer's state has (`global_leaves`, as the step starts): a bool scalar, or None when it always does.
        Sophia reads them every ``update_interval`` steps (a ``cond`` on its step count); on the other steps a
        trainer skips computing them and gives zeros, which the update never reads (the untaken branch)."""
        if self._hvp_conds is None:
            return None
        env = dict(zip(self._jaxpr.constvars, self._consts))
        for v, (kind, layer, q) in self._inputs.items():
            if kind == "s" and layer is None:
                env[v] = global_leaves[self._global_paths.index(q)]
        self._run(env, [index for index, _, _ in self._hvp_conds], None, _PRE)
        flags = [jnp.any(jnp.isin(jnp.clip(jnp.asarray(env[index]).astype(jnp.int32), 0, count - 1),
                                  jnp.asarray(used, jnp.int32)))
                 for index, count, used in self._hvp_conds]
        return jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)

    def whole_global_leaves(self, whole_state) -> tuple:
        """`global_leaves` of the whole model's optimizer state (StandardTrainer's)."""
        found = {tuple(p): x for p, x in jax.tree_util.tree_flatten_with_path(whole_state)[0]}
        return tuple(found[tuple(path)] for path in self._global_paths)

    # -- the whole optimizer state, matched to the layers' states ----------------------------------
    def _match_state(self, whole_paths) -> list:
        """For each leaf of the whole state: ``(layer, index in that layer's state)``, or ``(None, path)``
        for a leaf every layer's state has (the step count; ``self._index[i][path]`` is its index in
        layer ``i``'s state)."""
        per_layer = [{tuple(p): q for q, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(s)[0])}
                     for s in self._layer_state]
        self._index = per_layer
        out = []
        for path, leaf in whole_paths:
            path = tuple(path)
            found = None
            for pos, key in enumerate(path):
                if isinstance(key, SequenceKey) and key.idx < self.num_layers:
                    q = per_layer[key.idx].get(path[:pos] + path[pos + 1:])
                    if q is not None and jax.tree.leaves(self._layer_state[key.idx])[q].shape == leaf.shape:
                        found = (key.idx, q)
                        break
            if found is None and all(path in p for p in per_layer) and self._segmented_leaf(path, leaf):
                found = (_SEG, path)  # (``optax.flatten``: one state vector of every layer's elements)
            elif found is None and all(path in p for p in per_layer):
                found = (None, path)
            if found is None:
                raise CoupledUpdateError(f"cannot match the optimizer state leaf {jax.tree_util.keystr(path)} "
                                         "to a layer")
            out.append(found)
        return out

    # -- segments: a vector of every layer's elements (``optax.flatten``) --------------------------------
    def _segmented_leaf(self, path, leaf) -> bool:
        """Whether the whole state's leaf at ``path`` is a segmented vector: a vector with one element per
        parameter element of the whole model, each layer's state having a vector of its own parameters'
        size at the same path (``optax.flatten(adam)``'s moments)."""
        sizes = [sum(_size_of(x) for x in jax.tree.leaves(p)) for p in self._layer_shapes_in]
        if len(leaf.shape) != 1 or leaf.shape[0] != sum(sizes):
            return False
        for i, own in enumerate(self._layer_state):
            mine = dict((tuple(p), x) for p, x in jax.tree_util.tree_flatten_with_path(own)[0]).get(path)
            if mine is None or tuple(mine.shape) != (sizes[i],):
                return False
        return True

    def _segment_tags(self, eqn, tags: dict, segmented: set, producer: dict):
        """The tags of an equation that makes, transforms or splits a segmented vector: ``(equation's tag,
        [each output's tag])``, or None for any other equation (labelled as usual).

        * ``concatenate`` (axis 0) of the raveled leaves of one kind of input (the gradients, or the
          parameters), every leaf of every layer in the whole tree's order: a segmented vector, each layer's
          segment what its own update concatenates.
        * an element-wise equation (`_ELEMENTWISE`) of segmented vectors and scalars that depend on no layer
          (round -1: the step count, the bias corrections): a segmented vector.
        * ``split`` (axis 0) of a segmented vector, each piece inside one layer's segment: that layer's value.

        Raises:
          CoupledUpdateError: any other equation reads a segmented vector (a reduction over it: one value of
            several layers' elements, computed in another order per layer).
        """
        reads = [v for v in eqn.invars if isinstance(v, jcore.Var) and v in segmented]
        name = eqn.primitive.name
        if not reads:
            if name == "concatenate" and self._layer_concatenation(eqn, producer):
                return _Tag(_SEG, 0), [_Tag(_SEG, 0)]
            return None
        total = sum(self._segments)
        others = [v for v in eqn.invars if isinstance(v, jcore.Var) and v not in segmented]
        if name in _ELEMENTWISE and all(getattr(o.aval, "shape", None) == (total,) for o in eqn.outvars) and all(
                _size(v) <= 1 and tags[v].layer is None and tags[v].round == _PRE for v in others) and all(
                _size(v) <= 1 for v in eqn.invars if not isinstance(v, jcore.Var)):
            return _Tag(_SEG, 0), [_Tag(_SEG, 0)] * len(eqn.outvars)
        if name == "split" and eqn.params.get("axis", 0) == 0:
            starts, ends = np.cumsum((0,) + self._segments[:-1]), np.cumsum(self._segments)
            out, at = [], 0
            for o in eqn.outvars:
                size = _size(o)
                layer = [i for i in range(self.num_layers) if starts[i] <= at and at + size <= ends[i]]
                if not layer:
                    break
                out.append(_Tag(layer[0], 0))
                at += size
            else:
                return _Tag(_SEG, 0), out
        raise CoupledUpdateError(
            f"the optimizer combines whole tensors of several layers ({name} of a vector of every layer's "
            "elements), so no layer's update can be computed without the others on the device; train it with "
            "StandardTrainer")

    def _layer_concatenation(self, eqn, producer: dict) -> bool:
        """Whether ``eqn`` (a ``concatenate``) is ``optax.flatten``'s: on axis 0, of the raveled (``reshape``d to
        a vector) input leaves of one kind, every leaf of every layer in the whole tree's order."""
        if eqn.params.get("dimension", 0) != 0:
            return False
        kinds, order = set(), []
        for v in eqn.invars:
            if not isinstance(v, jcore.Var) or len(v.aval.shape) != 1:
                return False
            e = producer.get(v)
            src = v if v in self._inputs else e.invars[0] if e is not None and e.primitive.name == "reshape" else None
            if not isinstance(src, jcore.Var) or src not in self._inputs:  # (a vector leaf: itself)
                return False
            kind, layer, q = self._inputs[src]
            if kind not in ("g", "p") or not isinstance(layer, int):
                return False
            kinds.add(kind)
            order.append((layer, q))
        every = [(i, q) for i in range(self.num_layers) for q in range(len(jax.tree.leaves(self._layer_shapes_in[i])))]
        return len(kinds) == 1 and order == every

    # -- evaluation --------------------------------------------------------------------------------
    def _value(self, value):
        """The step's loss as the traced update's input (a float32 scalar; the loss as logged is one)."""
        if value is None:
            raise ValueError("this optimizer's update reads the step's loss: pass it as value")
        return jnp.asarray(value, jnp.float32)

    def _layer_env(self, i: int, grads, opt_state, params, globals_: tuple, value=None, hvp=None) -> dict:
        g, s, p = jax.tree.leaves(grads), jax.tree.leaves(opt_state), jax.tree.leaves(params)
        if self.takes_hvp and hvp is None:
            raise ValueError("this optimizer's update reads the Hessian-vector product: pass it as hvp")
        h = jax.tree.leaves(hvp) if hvp is not None else ()
        env = dict(zip(self._jaxpr.constvars, self._consts))
        for v, (kind, layer, q) in self._inputs.items():
            if kind == "v":
                env[v] = self._value(value)
            elif kind == "s" and layer is None:
                env[v] = s[self._index[i][q]]  # this layer's own copy of a global leaf
            elif layer == i:
                env[v] = {"g": g, "p": p, "s": s, "h": h}[kind][q]
        env.update(zip(self._globals[:len(globals_)], globals_))
        return env

    def _run(self, env: dict, wanted, layer: int | None, upto: int, scalars: list | None = None) -> None:
        """Evaluates, in program order, the equations ``wanted`` needs: this layer's of round <= ``upto``
        and the global ones of round -1 (a global of a later round must already be in ``env``); fenced
        with ``scalars`` (`_bind`)."""
        needed, stack = set(), [v for v in wanted if isinstance(v, jcore.Var) and v not in env]
        while stack:
            v = stack.pop()
            e = self._producer.get(v)
            if e is None or id(e) in needed:
                continue
            needed.add(id(e))
            stack.extend(x for x in e.invars if isinstance(x, jcore.Var) and x not in env)
        for e, tag in zip(self._jaxpr.eqns, self._eqn_tag):
            if id(e) not in needed or all(o in env for o in e.outvars):
                continue
            if tag.layer is None and tag.round > _PRE and layer is not None:
                raise AssertionError("a global value was not provided")  # the passes are ordered so it is
            vals = _bind(e, [env[x] if isinstance(x, jcore.Var) else x.val for x in e.invars], scalars)
            env.update(zip(e.outvars, vals))

    def exports(self, k: int, i: int, grads, opt_state, params, globals_: tuple, scalars: list | None = None,
                value=None, hvp=None) -> tuple:
        """Pass ``k`` (``k < rounds``) of layer ``i``: the layer's values the ``k``-th global program reads.

        Args:
          grads, opt_state, params: layer ``i``'s (its gradient summed over devices and microbatches).
          globals_: the outputs of the global programs of rounds ``< k`` (``()`` for ``k == 0``).
          scalars: a list: the scalars to `fence` are appended to it.
          value: the step's loss (a float32 scalar) when the update reads it (`takes_value`), else None.
          hvp: layer ``i``'s Hessian-vector product (a tree like its params) when the update reads one
            (`takes_hvp`), else None.

        Returns:
          a tuple of small arrays (shapes fixed per layer).
        """
        env = self._layer_env(i, grads, opt_state, params, globals_, value, hvp)
        wanted = self._exports[k][i]
        self._run(env, wanted, i, k, scalars)
        return tuple(env[v] for v in wanted)

    def global_leaves(self, i: int, opt_state) -> tuple:
        """The leaves of layer ``i``'s optimizer state that every layer has (the step count), for `combine`."""
        s = jax.tree.leaves(opt_state)
        return tuple(s[self._index[i][path]] for path in self._global_paths)

    def combine(self, k: int, exports: list, global_leaves: tuple, globals_: tuple, value=None) -> tuple:
        """The ``k``-th global program: every global value of round ``<= k`` that a layer reads (the
        previous ones passed through; the others are computed inside, recomputed by a later round that needs
        them), from each layer's exports of round ``k`` and earlier (``exports[r][i]``), the
        `global_leaves` of any layer's optimizer state, ``globals_`` (rounds ``< k``) and ``value`` (the step's
        loss when the update reads it, `takes_value`; else None)."""
        env = dict(zip(self._jaxpr.constvars, self._consts))
        for v, (kind, layer, q) in self._inputs.items():
            if kind == "v":
                env[v] = self._value(value)
            elif kind == "s" and layer is None:
                env[v] = global_leaves[self._global_paths.index(q)]
        env.update(zip(self._globals[:len(globals_)], globals_))
        for r in range(k + 1):
            for i in range(self.num_layers):
                env.update(zip(self._exports[r][i], exports[r][i]))
        wanted = [v for v in self._globals if self._tags[v].round <= k]
        self._run(env, wanted, None, k)
        return tuple(env[v] for v in wanted)

    def update(self, i: int, grads, opt_state, params, globals_: tuple, scalars: list | None = None, value=None,
               hvp=None):
        """The final pass of layer ``i``: ``(updates, new optimizer state)``, what ``tx.update`` on the
        whole model gives for this layer (``optax.apply_updates`` adds the updates to the params). With
        ``scalars`` (a list), the scalars to `fence` are appended to it; ``value``: the step's loss when the
        update reads it (`takes_value`), else None; ``hvp``: the layer's Hessian-vector product when it reads
        one (`takes_hvp`), else None."""
        env = self._layer_env(i, grads, opt_state, params, globals_, value, hvp)
        wanted = self._out_updates[i] + self._out_state[i]
        self._run(env, wanted, i, self.rounds, scalars)

        def val(v):
            return env[v] if isinstance(v, jcore.Var) else jnp.asarray(v.val)

        updates = jax.tree.unflatten(self._update_def[i], [val(v) for v in self._out_updates[i]])
        new_state = jax.tree.unflatten(self._state_def[i], [val(v) for v in self._out_state[i]])
        return updates, new_state

    def signature(self, i: int) -> tuple:
        """What layer ``i``'s programs compute (equations, shapes, exports): layers with equal signatures
        run one compiled program (a scanned run of identical layers uses its first layer's)."""
        if i not in self._signatures:
            self._signatures[i] = self._signature(i)
        return self._signatures[i]

    def _signature(self, i: int) -> tuple:
        idx = {}

        def name(v):
            if not isinstance(v, jcore.Var):
                return ("lit", str(v.val))
            if v in self._inputs:
                kind, layer, q = self._inputs[v]
                return ("in", kind, q if layer is not None else str(q), str(v.aval))
            if self._tags[v].layer == i:
                return idx.setdefault(v, len(idx))
            e = self._producer.get(v)
            if self._tags[v].round == _PRE and e is not None:  # a constant of this layer's: by what it is
                return ("pre", e.primitive.name, str(e.params), tuple(name(x) for x in e.invars),
                        e.outvars.index(v))
            return ("g", self._names[v])

        sig = []
        for e, tag in zip(self._jaxpr.eqns, self._eqn_tag):
            if tag.layer == i:
                sig.append((e.primitive.name, str(e.params), tuple(name(v) for v in e.invars),
                            tuple(name(v) for v in e.outvars)))
        outs = tuple(name(v) for v in self._out_updates[i] + self._out_state[i])
        ex = tuple(tuple(name(v) for v in self._exports[k][i]) for k in range(self.rounds))
        return tuple(sig), outs, ex


def apply_updates(tx: optax.GradientTransformation, grads, opt_state, params, value=None, hvp=None):
    """One optax update: returns ``(new_params, new_opt_state, scalars)``, ``tx.update`` evaluated by
    `fenced_update` (``scalars``: what to `fence`; ``value``: the step's loss for an optimizer that reads it,
    else None; ``hvp``: the Hessian-vector product for one that reads it, else None)."""
    updates, new_opt_state, scalars = fenced_update(tx, grads, opt_state, params, value, hvp)
    return optax.apply_updates(params, updates), new_opt_state, scalars


def guarded_update(tx: optax.GradientTransformation, grads, opt_state, params, ok=None, across: str | None = None,
                   value=None, hvp=None):
    """An optax update that is skipped (params and optimizer state unchanged) unless every gradient is
    finite (and ``ok``). Returns ``(new_params, new_opt_state, finite)``, ``finite`` a bool scalar.

    The update runs under ``lax.cond`` on the flag, in every program that updates (StandardTrainer's whole
    model, each layer's fused update, a stacked run's, the disk tier's), inside the branch its scalars
    fenced against its results (`fence`). One form everywhere, because the form decides what XLA
    materialises. Inside the branch a new optimizer state leaf (Adam's moment ``b1 * mu + (1 - b1) * g``)
    is a branch result, so the update's other users (the parameter's step) read it from memory; with a
    ``select`` per leaf instead (``jnp.where(finite, new, old)``, the per-layer form until issue 60) every
    user of the moment is fusible and XLA:CPU duplicated the moment's expression into the parameter's
    fusion, where LLVM contracts another product of it into a fused multiply-add: NAdam(W), AdaBelief, Adan,
    the optimistic Adams, SM3, Adafactor, MADGRAD and Muon moved a parameter by an ulp from the whole-model
    update (which must be a ``cond``: a select per leaf there fuses the flag's reduction over every leaf
    into each leaf's select, a program growing as N**2 in its N leaves: measured 241,271 optimised HLO
    lines and a 94 s compile against 17,746 and 17 s, 32 layers of 6 leaves, XLA:CPU, JAX 0.10.2). The
    conditional's cost: on a GPU the runtime reads the flag before it runs a branch, once per program that
    updates; the disk tier ran it from the start (its temporaries are smaller than the select form's).

    ``across``: a mesh axis over which the leaves are split (sharded state: each device holds a piece of
    the gradients); the flag is then true only when every device's pieces are finite, so all devices keep
    or skip the update together.

    ``value``: the step's loss (a float32 scalar, as the trainer logs it) for an optimizer whose update reads
    it (`revtrain.optstate.takes_value`: ``optax.polyak_sgd``, ``optax.contrib.momo``, ``reduce_on_plateau``);
    None for every other optimizer, whose program is then the one it always was. ``hvp``: likewise the
    Hessian-vector product (a tree like ``params``) for optax's Hutchinson estimator
    (`revtrain.optstate.takes_hvp`), else None.
    """
    finite = all_finite(grads)
    if ok is not None:
        finite = jnp.logical_and(finite, ok)
    if across is not None:
        finite = lax.pmin(finite.astype(jnp.int32), across).astype(bool)

    def update():
        new_params, new_opt, scalars = apply_updates(tx, grads, opt_state, params, value, hvp)
        return fence(scalars, (new_params, new_opt))

    new_params, new_opt = lax.cond(finite, update, lambda: (params, opt_state))
    return new_params, new_opt, finite


def all_finite(tree) -> jax.Array:
    """bool scalar: every element of every floating leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
