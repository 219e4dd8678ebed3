"""The reversible trainer's backward modes: how each block's gradient is had, as strategy objects.

A block of a `ReversibleTrainer` step is run forward once and, in the backward walk (top block first),
gives its input's cotangent and its parameters' gradient. How it does that is its **mode**:

* **backprop** (`Backprop`): nothing is recomputed. The block runs inside the head's program (with the
  blocks between it and the head), and one ``jax.vjp`` of the head's loss through them gives every
  gradient: its forward is the vjp's, its residuals live in that one program. The cheapest in FLOPs
  (2.75 forwards of a Transformer block per step) and the dearest in memory (its vjp residuals).
* **checkpoint** (`Checkpoint`): the block runs inside the head's program as backprop does, its forward under
  ``jax.checkpoint``: the program keeps the block's input and recomputes the block within its vjp. The
  FLOPs of remat (3.75 forwards) and its memory (one activation kept, one block's residuals at a time:
  a run of them is one ``lax.scan``, `checkpoint_scan`, since XLA holds every unrolled one's) in one
  program with the head's: a stack of such blocks is the rematerialised standard trainer's step (scan +
  ``jax.checkpoint``), without a program call per block.
* **backprop_bf16** (`Bf16Backprop`): backprop with the block's vjp residuals stored in bfloat16: less
  memory, approximate gradients (not offered by the memory budget).
* **remat** (`Remat`): the forward keeps the block's input (in host memory with offload) and the backward
  recomputes the block under its ``vjp`` from it (rematerialisation; Chen et al. 2016). 3.75 forwards; one
  activation kept. A standard layer always runs this way (its input cannot be rebuilt).
* **rebuild** (`ExactRebuild`, `FusedRebuild`, `FencedRebuild`): nothing is kept; the backward rebuilds the
  block's input from its output (the layer's rebuilds: `ReversibleLayer.exact_reverse_vjp`,
  ``fused_reverse_vjp``, ``fenced_reverse_vjp``; Gomez et al. 2017). 4.75 (exact) or 4.0 (fused, fenced)
  forwards. ``ReversibleTrainer.rebuild`` names the one a trainer uses (a key of `REBUILDS`).

Each mode owns its forward (`BackwardMode.forward`: the traced function on one device's examples), its
reverse-and-grad (`BackwardMode.grads`), the names of its programs (``program_kinds``: the trainer's
per-layer programs, `ProgramSpec` in ``ReversibleTrainer._PER_LAYER``), its memory terms for the budget
planner (`BackwardMode.forward_bytes`, `BackwardMode.backward_bytes`), its name in a plan (``plan_name``)
and what ``revtrain check`` must know of it (`BackwardMode.outputs_residuals`, ``check_note``). The
trainer's compiled programs, the planner, the memory plan and `revtrain check` ask the mode object; none
compares a mode's name, so a new mode is one new class here. Layers expose the pieces (``apply``,
``inverse``, ``half_residuals`` and the rebuilds), never a mode flag. Each mode's ``kind`` (a
`revtrain.trainers.walk.StepKind`) says how the trainer's walk treats its block.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.placement import per_device, reduce_grads
from revtrain.trainers.walk import StepKind


class ProgramSpec(NamedTuple):
    """A per-layer program of the reversible trainer: the method it compiles and its calling convention.

    ``in_specs`` / ``out_specs``: ``PartitionSpec`` per argument / result; ``donate``: donated argument
    positions; ``state_in`` / ``state_out``: the positions of the layer's weights and optimizer state (or
    gradient buffer) among the arguments / results, whose entries are replaced by the layer's own specs.
    """

    method: str
    in_specs: tuple
    out_specs: tuple
    donate: tuple
    state_in: tuple
    state_out: tuple


def _is_float_tree(tree) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(tree))


_NAMED: dict = {}  # every mode by its name (`mode_named`)


class BackwardMode:
    """One way of getting a block's gradients (see the module note): the class says everything the trainer,
    the budget planner, the memory plan and `revtrain check` need to know about it, so a new mode is one new
    class here.

    Attributes:
      name: the mode's name in plans and logs (``"backprop"``, ``"remat"``, ``"exact"``, ...).
      plan_name: its name in a budget plan's counts (`BUDGET_MODES`; every rebuild flavour counts as
        ``"rebuild"``).
      kind: the walk's `StepKind` for one block of this mode.
      keeps_input: the forward keeps the block's input for the backward (the walk holds it).
      rebuilds: the backward rebuilds the block's input from its output.
      exact: its gradients are the standard trainer's bit for bit (where the layer's rebuild is exact: on the
        fixed-point grid); False: an approximation that trains (the tests check it trains, not its bits).
      program_kinds: ``(forward, backward, accumulating backward)`` per-layer program names (None: the
        block has no program of its own; its forward is compiled into the head's program).
      check_note: what ``revtrain check`` says when this rebuild flavour rebuilds inexactly where the exact
        one does not (None: nothing).
    """

    name = ""
    plan_name = ""
    kind = StepKind.REV
    keeps_input = False
    rebuilds = False
    exact = True
    program_kinds: tuple = (None, None, None)
    check_note: str | None = None

    def __init__(self):
        _NAMED.setdefault(self.name, self)  # (the first instance of each mode, found by its name: `mode_named`)

    def forward(self, layer, params, state, x, keys):
        """The block's training forward on one device's examples: ``(y, new_state)`` (with
        `outputs_residuals`: ``(y, new_state, residuals)``)."""
        return layer.apply(params, state, x, keys, True)

    def outputs_residuals(self, layer) -> bool:
        """Whether ``layer``'s forward in this mode returns residuals too (its program outputs them so that
        XLA keeps them; the trainer and ``revtrain check`` drop them)."""
        return False

    def grads(self, layer, params, state, start, dy, keys, specs=None):
        """The block's reverse-and-grad: ``(x or None, dx, grads)`` from ``start`` (the output for a
        rebuild, the kept input otherwise) and the output cotangent ``dy``; gradients summed over devices
        (reduce-scattered to the pieces of ``specs``). ``x`` is the rebuilt input (None when not rebuilt);
        ``dx`` None for integer inputs."""
        raise NotImplementedError

    # The budget planner's memory terms (`revtrain.planning.budget._simulate`): how the live device bytes of
    # a step change around one block run below the head, given its input's and output's bytes.
    def forward_bytes(self, x_bytes: int, y_bytes: int, offload: bool) -> int:
        """The change of the live device bytes across the block's forward call: its output comes, its
        input goes unless the mode keeps it on the device (with ``offload`` a kept input is in host memory)."""
        kept = self.keeps_input and not offload
        return y_bytes - (0 if kept else x_bytes)

    def backward_bytes(self, x_bytes: int, y_bytes: int, offload: bool) -> tuple[int, int]:
        """``(before, after)``: the change of the live device bytes just before the block's backward call
        (a kept input back from host memory) and across it (``dx`` replaces ``dy``; ``x`` replaces ``y``:
        rebuilt, or the kept input the walk goes on from)."""
        if self.keeps_input:
            return (x_bytes if offload else 0), x_bytes - 2 * y_bytes
        return 0, 2 * x_bytes - 2 * y_bytes

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


class Remat(BackwardMode):
    """Keep the input, recompute the block under its ``vjp`` (a standard layer's only mode)."""

    name = plan_name = "remat"
    kind = StepKind.STD
    keeps_input = True
    program_kinds = ("forward_std", "recompute", "recompute_acc")

    def grads(self, layer, params, state, start, dy, keys, specs=None):
        x = start
        if _is_float_tree(x):
            _, vjp_fn = jax.vjp(lambda p, x: layer.apply(p, state, x, keys, True)[0], per_device(params), x)
            grads, dx = vjp_fn(dy)
        else:
            _, vjp_fn = jax.vjp(lambda p: layer.apply(p, state, x, keys, True)[0], per_device(params))
            (grads,), dx = vjp_fn(dy), None
        return None, dx, reduce_grads(grads, specs)


class Rebuild(BackwardMode):
    """Keep nothing, rebuild the input from the output (one of the layer's rebuilds, `reverse`). A layer
    without ``half_residuals`` rebuilds the exact way in every flavour (its own fallback)."""

    plan_name = "rebuild"
    kind = StepKind.REV
    rebuilds = True
    program_kinds = ("forward_rev", "reverse", "reverse_acc")

    def reverse(self, layer, params, state, y, dy, keys):
        """The layer's rebuild of this flavour on one device's examples: ``(x, dx, grads)``, the gradients
        this device's own (`ReversibleLayer.exact_reverse_vjp` and its siblings)."""
        raise NotImplementedError

    def grads(self, layer, params, state, start, dy, keys, specs=None):
        x, dx, grads = self.reverse(layer, per_device(params), state, start, dy, keys)
        return x, dx, reduce_grads(grads, specs)


class ExactRebuild(Rebuild):
    """The inverse behind an optimization barrier, then the vjp of the whole block (4.75 forwards; F and G
    run twice, the rebuild compiled like the forward: bit-exact wherever the streams stay on the
    fixed-point grid). The trainer's default flavour."""

    name = "exact"

    def reverse(self, layer, params, state, y, dy, keys):
        return layer.exact_reverse_vjp(params, state, y, dy, keys)


class FusedRebuild(Rebuild):
    """One vjp per half-residual, whose primal output rebuilds that half's input (4.0 forwards): F and G each
    run forward once in the backward. They are compiled inside the vjp and may round differently from the
    forward's (rebuild error 5.4e-6 in float32, 1.5e-2 in bfloat16 on a step-200 ``enwik_small``
    checkpoint; bit-exact near initialisation). See docs/rebuild.md."""

    name = "fused"
    check_note = ("note: the fused rebuild's F and G (computed inside their vjp) round differently from the "
                  "forward's, while ReversibleTrainer.rebuild = 'exact' rebuilds every input bit for bit")

    def reverse(self, layer, params, state, y, dy, keys):
        return layer.fused_reverse_vjp(params, state, y, dy, keys)


class FencedRebuild(Rebuild):
    """The fused rebuild with a forward computing each half-residual as the rebuild does
    (`ReversibleLayer.apply_fenced`: the same vjp behind the same barriers): the forward returns ``(y,
    new_state, residuals)``, and the program outputs the residuals so that XLA keeps them (the trainer drops
    them). 0.0 rebuild error on the step-200 checkpoint (float32 and bfloat16, both executors, with and
    without offload), but not guaranteed (XLA:CPU removes the barriers before fusing; a block with grown
    random weights rebuilds inexactly), and its forward no longer rounds like backprop's (parameters 4.4e-7
    relative apart from the standard trainer's after 5 steps at depth 12): not `exact`."""

    name = "fenced"
    exact = False

    def forward(self, layer, params, state, x, keys):
        if not self.outputs_residuals(layer):
            return layer.apply(params, state, x, keys, True)
        y, new_state, residuals = layer.apply_fenced(params, state, x, keys)
        return y, new_state, per_device(residuals)  # each device's own (a scan carry's type)

    def outputs_residuals(self, layer) -> bool:
        return layer.reversible and layer.has_half_residuals

    def reverse(self, layer, params, state, y, dy, keys):
        return layer.fenced_reverse_vjp(params, state, y, dy, keys)


class Backprop(BackwardMode):
    """The block inside the head's program: one ``vjp`` of the loss through it (no forward of its own, no
    recompute, no rebuild). Only blocks directly under the head (or under other blocks in its program) can
    run so; their forward (`forward`, traced inside the vjp) is compiled there."""

    name = plan_name = "backprop"
    kind = StepKind.TOP


class Checkpoint(Backprop):
    """The block inside the head's program (as `Backprop`) under ``jax.checkpoint``: the vjp keeps its input
    and recomputes its forward (Chen et al. 2016), inside the head's program. Such blocks sit directly
    under the backprop blocks (or the head)."""

    name = plan_name = "checkpoint"

    def forward(self, layer, params, state, x, keys):
        return jax.checkpoint(lambda p, s, x, k: layer.apply(p, s, x, k, True))(params, state, x, keys)


# The trainer's rebuild flavours (``ReversibleTrainer.rebuild``), the default first.
REBUILDS = {m.name: m for m in (ExactRebuild(), FusedRebuild(), FencedRebuild())}
BACKPROP, CHECKPOINT, REMAT = Backprop(), Checkpoint(), Remat()
# What a memory budget chooses between (`revtrain.planning.budget`; a plan's counts), cheapest in FLOPs first.
BUDGET_MODES = (BACKPROP.plan_name, CHECKPOINT.plan_name, REMAT.plan_name, Rebuild.plan_name)


def default_mode(layer, rebuild_mode: BackwardMode) -> BackwardMode:
    """A layer's backward mode when nothing chose another (no ``fuse_top``, no memory budget): a reversible
    block is rebuilt (``rebuild_mode``: the trainer's flavour, a `REBUILDS` value), any other layer
    rematerialised from its kept input (`REMAT`: its input cannot be rebuilt). The one statement of that rule
    (the trainer, both planners and ``revtrain check`` ask it)."""
    return rebuild_mode if layer.reversible else REMAT


def default_modes(layers, rebuild_mode: BackwardMode) -> list:
    """`default_mode` of each of ``layers`` (every layer but the head, bottom first)."""
    return [default_mode(layer, rebuild_mode) for layer in layers]


def count_in_head(modes) -> int:
    """How many of ``modes`` (one per layer but the head, bottom first) at the top run inside the head's
    program (`StepKind.TOP`: backprop, checkpoint)."""
    k = 0
    while k < len(modes) and modes[-1 - k].kind is StepKind.TOP:
        k += 1
    return k


def checkpoint_scan(layer, params, states, x, keys):
    """Identical blocks like ``layer`` (``params``, ``states``, ``keys`` stacked on a leading layer axis) as
    one ``lax.scan`` of ``jax.checkpoint``-ed bodies: under a vjp each block's input is kept and its forward
    recomputed (Chen et al. 2016), and XLA holds one block's residuals at a time (unrolled checkpointed
    blocks it holds all at once). Returns ``(output, new states stacked)``."""
    body = jax.checkpoint(lambda x, sl: layer.apply(sl[0], sl[1], x, sl[2], True))
    return lax.scan(body, x, (params, states, keys))


def forward_in_head(tops, modes, counts, params, states, x, keys):
    """The forward of the groups ``tops`` (bottom first) inside the head's program, each in its mode
    (``modes``, `modes.Backprop` or `modes.Checkpoint`), ``counts`` blocks each (more than one: a stacked
    run of checkpoint blocks); ``params``, ``states``, ``keys`` one per group. Returns ``(output, new
    states: a tuple, one per group)``."""
    new_states = []
    for a, b in head_runs(tops, modes, counts):
        if counts[a] > 1:  # a stacked run: its trees have the layer axis already
            x, stacked = checkpoint_scan(tops[a], params[a], states[a], x, keys[a])
            new_states.append(stacked)
        elif b - a == 1:
            x, new_state = modes[a].forward(tops[a], params[a], states[a], x, keys[a])
            new_states.append(new_state)
        else:  # single blocks of one run: stacked here (their gradients come back unstacked)
            stack = lambda *trees: jax.tree.map(lambda *v: jnp.stack(v), *trees)  # noqa: E731
            x, stacked = checkpoint_scan(tops[a], stack(*params[a:b]), stack(*states[a:b]), x, stack(*keys[a:b]))
            new_states.extend(jax.tree.map(lambda v: v[i], stacked) for i in range(b - a))
    return x, tuple(new_states)


def head_runs(tops, modes, counts=None) -> list:
    """The runs ``(start, stop)`` of the groups in the head's program (bottom first): consecutive single
    identical checkpoint blocks form one run (one `checkpoint_scan`), every other group (a stacked run of
    ``counts[i] > 1`` blocks, a backprop block) a run of its own."""
    counts = counts or (1,) * len(tops)
    runs, a = [], 0
    while a < len(tops):
        b = a + 1
        if modes[a] is CHECKPOINT and counts[a] == 1:
            while b < len(tops) and modes[b] is CHECKPOINT and counts[b] == 1 and tops[b] == tops[a]:
                b += 1
        runs.append((a, b))
        a = b
    return runs


def mode_named(name: str, rebuild: str = "exact") -> BackwardMode:
    """The mode object of a plan's name (`BUDGET_MODES`; ``"rebuild"`` is the trainer's ``rebuild`` flavour)
    or of a rebuild flavour (`REBUILDS`).

    Raises:
      KeyError: no mode has that name.
    """
    return REBUILDS[rebuild] if name == Rebuild.plan_name else _NAMED[name]


def _lowered_residuals(fn, params, x, state, keys, dtype):
    """``fn(params, x, state, keys) -> (y, new_state)`` whose vjp keeps its residuals in ``dtype``: the forward is
    ``fn``'s, but every wider float residual of its ``jax.vjp`` that it computes (not an argument: those are
    live anyway; found by identity, as `ReversibleLayer._fenced_step` finds them) is stored rounded to
    ``dtype`` (a ``jax.custom_vjp``) and widened back for the backward, so the pullback runs on rounded
    activations (an approximation). ``state`` and ``keys`` get no cotangent."""
    @jax.custom_vjp
    def run(p, x, s, k):
        return fn(p, x, s, k)

    def fwd(p, x, s, k):
        y, pullback, new_state = jax.vjp(lambda p, x: fn(p, x, s, k), p, x, has_aux=True)
        leaves, treedef = jax.tree.flatten(pullback)
        given = {id(a) for a in jax.tree.leaves((p, x, s, k))}
        stored, where, slots = [], {}, []  # each residual stored once (a pullback names some several times)
        for a in leaves:
            if id(a) not in where:
                low = (id(a) not in given and jnp.issubdtype(a.dtype, jnp.floating)
                       and a.dtype.itemsize > jnp.dtype(dtype).itemsize)
                where[id(a)] = len(stored)
                stored.append(a.astype(dtype) if low else a)
            slots.append(where[id(a)])
        restore = functools.partial(_widened, treedef, tuple(a.dtype for a in leaves), tuple(slots))
        return (y, new_state), jax.tree_util.Partial(restore, *stored)

    def bwd(res, cot):
        dy, _ = cot
        dp, dx = res()(dy)
        return dp, dx, None, None

    run.defvjp(fwd, bwd)
    return run(params, x, state, keys)


def _widened(treedef, dtypes, slots, *stored):
    """The pullback of `_lowered_residuals` rebuilt from its stored residuals (``slots``: each leaf's), each
    back in its own dtype."""
    return jax.tree.unflatten(treedef, [stored[i].astype(d) for i, d in zip(slots, dtypes)])


class Bf16Backprop(Backprop):
    """`Backprop` with the block's vjp residuals (its saved activations) kept in bfloat16 (`_lowered_residuals`):
    each stored residual half its float32 bytes in the head's program, the forward as backprop's, the backward
    on activations rounded to 8 significant bits. Activation-compressed training (Chen et al. 2021, "ActNN")
    at its mildest. Not `exact`: it trains like backprop (tests/test_modes.py) without its bits, so the memory
    budget (whose plans all give backprop's gradients) does not offer it; set it with
    ``ReversibleTrainer.set_block_modes`` for blocks directly under the head. XLA keeps fewer residuals of
    plain backprop than its jaxpr names (it fuses and recomputes cheap ones), so the saving is less than half
    a block's held bytes (tests/test_modes.py measures it with the planner's own program)."""

    name = plan_name = "backprop_bf16"
    exact = False
    residual_dtype = jnp.bfloat16

    def forward(self, layer, params, state, x, keys):
        return _lowered_residuals(lambda p, x, s, k: layer.apply(p, s, x, k, True), params, x, state, keys,
                                  self.residual_dtype)


BACKPROP_BF16 = Bf16Backprop()
