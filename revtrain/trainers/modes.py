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
* **remat** (`Remat`): the forward keeps the block's input (in host memory with offload) and the backward
  recomputes the block under its ``vjp`` from it (rematerialisation; Chen et al. 2016). 3.75 forwards; one
  activation kept. A standard layer always runs this way (its input cannot be rebuilt).
* **rebuild** (`ExactRebuild`, `FusedRebuild`, `FencedRebuild`): nothing is kept; the backward rebuilds the
  block's input from its output (`ReversibleLayer.reverse_vjp`; Gomez et al. 2017). 4.75 (exact) or 4.0
  (fused, fenced) forwards. ``ReversibleTrainer.rebuild`` names the one a trainer uses.

Each mode owns its forward (`BackwardMode.forward`: the traced function on one device's examples) and its
reverse-and-grad (`BackwardMode.grads`); the trainer's compiled programs and `revtrain check` both call
those, so a new mode is one new class here. ``program_kinds`` name the trainer's per-layer programs
(`ProgramSpec` in ``ReversibleTrainer._PER_LAYER``); `StepKind` says how the trainer's walk treats a block.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from revtrain.trainers.common import per_device, reduce_grads


class StepKind(str, enum.Enum):
    """How the trainer's walk runs a group of its plan (a ``str``: ``StepKind.STD == "std"``)."""

    RUN = "run"    # a stacked run of rebuilt blocks: one scan per pass
    REV = "rev"    # one block rebuilt from its output
    STD = "std"    # one block (or standard layer) recomputed from its kept input
    TOP = "top"    # one block inside the head's program (backprop)
    HEAD = "head"  # the head


class ProgramSpec(NamedTuple):
    """A per-layer program of the reversible trainer: the method it compiles and its calling convention.

    ``in_specs`` / ``out_specs``: ``PartitionSpec`` per argument / result (the weights' and optimizer
    state's entries are replaced by the layer's own specs); ``donate``: donated argument positions;
    ``moved_in``: arguments (weights, optimizer state) the program moves from host memory to the device itself
    with offload; ``moved_out``: results (the updated ones) it moves back to host memory.
    """

    method: str
    in_specs: tuple
    out_specs: tuple
    donate: tuple
    moved_in: tuple
    moved_out: tuple


def _is_float_tree(tree) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(tree))


class BackwardMode:
    """One way of getting a block's gradients (see the module note).

    Attributes:
      name: the mode's name in plans and logs (``"backprop"``, ``"remat"``, ``"exact"``, ...).
      kind: the walk's `StepKind` for one block of this mode.
      keeps_input: the forward keeps the block's input for the backward (the walk holds it).
      rebuilds: the backward rebuilds the block's input from its output.
      program_kinds: ``(forward, backward, accumulating backward)`` per-layer program names (None: the
        block has no program of its own).
    """

    name = ""
    kind = StepKind.REV
    keeps_input = False
    rebuilds = False
    program_kinds: tuple = (None, None, None)

    def forward(self, layer, params, state, x, keys):
        """The block's training forward on one device's examples: ``(y, new_state)``."""
        return layer.apply(params, state, x, keys, True)

    def grads(self, layer, params, state, start, dy, keys, specs=None):
        """The block's reverse-and-grad: ``(x or None, dx, grads)`` from ``start`` (the output for a
        rebuild, the kept input otherwise) and the output cotangent ``dy``; gradients summed over devices
        (reduce-scattered to the pieces of ``specs``). ``x`` is the rebuilt input (None when not rebuilt);
        ``dx`` None for integer inputs."""
        raise NotImplementedError

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


class Remat(BackwardMode):
    """Keep the input, recompute the block under its ``vjp`` (a standard layer's only mode)."""

    name = "remat"
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
    """Keep nothing, rebuild the input from the output (`ReversibleLayer.reverse_vjp`)."""

    kind = StepKind.REV
    rebuilds = True
    fused = fenced = False
    program_kinds = ("forward_rev", "reverse", "reverse_acc")

    def grads(self, layer, params, state, start, dy, keys, specs=None):
        x, dx, grads = layer.reverse_vjp(per_device(params), state, start, dy, keys, fused=self.fused,
                                         fenced=self.fenced)
        return x, dx, reduce_grads(grads, specs)


class ExactRebuild(Rebuild):
    """The inverse behind an optimization barrier, then the vjp of the whole block (4.75 forwards)."""

    name = "exact"


class FusedRebuild(Rebuild):
    """One vjp per half-residual, whose primal output rebuilds that half's input (4.0 forwards)."""

    name = "fused"
    fused = True


class FencedRebuild(Rebuild):
    """The fused rebuild with a forward computing each half-residual as the rebuild does
    (`ReversibleLayer.apply_fenced`): the forward returns ``(y, new_state, residuals)``, and the program
    outputs the residuals so that XLA keeps them (the trainer drops them)."""

    name = "fenced"
    fused = fenced = True

    def forward(self, layer, params, state, x, keys):
        if not layer.has_half_residuals:
            return layer.apply(params, state, x, keys, True)
        y, new_state, residuals = layer.apply_fenced(params, state, x, keys)
        return y, new_state, per_device(residuals)  # each device's own (a scan carry's type)

    def outputs_residuals(self, layer) -> bool:
        """Whether ``layer``'s forward returns residuals too."""
        return layer.reversible and layer.has_half_residuals


class Backprop(BackwardMode):
    """The block inside the head's program: one ``vjp`` of the loss through it (no forward of its own, no
    recompute, no rebuild). Only blocks directly under the head (or under other blocks in its program) can
    run so; their forward (`forward`, traced inside the vjp) is compiled there."""

    name = "backprop"
    kind = StepKind.TOP


class Checkpoint(Backprop):
    """The block inside the head's program (as `Backprop`) under ``jax.checkpoint``: the vjp keeps its input
    and recomputes its forward (Chen et al. 2016), inside the head's program. Such blocks sit directly
    under the backprop blocks (or the head)."""

    name = "checkpoint"

    def forward(self, layer, params, state, x, keys):
        return jax.checkpoint(lambda p, s, x, k: layer.apply(p, s, x, k, True))(params, state, x, keys)


REBUILDS = {m.name: m for m in (ExactRebuild(), FusedRebuild(), FencedRebuild())}
BACKPROP, CHECKPOINT, REMAT = Backprop(), Checkpoint(), Remat()
# What a memory budget chooses between (`revtrain.trainers.budget`), cheapest in FLOPs first.
BUDGET_MODES = ("backprop", "checkpoint", "remat", "rebuild")


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
    """The mode object of a plan's name (``"rebuild"`` is the trainer's ``rebuild`` flavour)."""
    if name == "backprop":
        return BACKPROP
    if name == "checkpoint":
        return CHECKPOINT
    if name == "remat":
        return REMAT
    return REBUILDS[rebuild if name == "rebuild" else name]
