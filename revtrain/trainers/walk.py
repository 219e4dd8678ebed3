"""The reversible step's walk: the order of its compiled calls over a layout's blocks.

A step's layout is a `Plan`: one `Block` per group of layers (a layer alone, or a stacked run of identical
blocks), the head last, each with its backward mode (`revtrain.trainers.modes`) and its compiled forward and
backward programs (`revtrain.trainers.programs`). `walk` runs one forward and one backward pass over it, the
same for the fused update and the deferred one (`revtrain.trainers.deferred`): forward, oldest first,
keeping a block's input where its mode needs it (in the tier's memory for kept activations, `Residency.keep`);
the head's program (with the blocks run inside it); then backward, newest first, each block rebuilt from its
output or recomputed from its kept input, its results handed to the caller's ``store``. `StepKind` names how
the walk treats a group (each mode declares its own kind).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


class StepKind(str, enum.Enum):
    """How the trainer's walk runs a group of its plan (a ``str``: ``StepKind.STD == "std"``)."""

    RUN = "run"    # a stacked run of rebuilt blocks: one scan per pass
    REV = "rev"    # one block rebuilt from its output
    STD = "std"    # one block (or standard layer) recomputed from its kept input
    TOP = "top"    # one block inside the head's program (backprop)
    HEAD = "head"  # the head


def walk(plan: "Plan", residency, params: list, slot: list, states, new_states: list, x, ctx, head, store) -> None:
    """One forward and backward pass over ``plan`` (the fused step and the deferred one alike).

    Forward: each group below the head's program runs its forward program (keeping its input when its
    mode does: `modes.BackwardMode.keeps_input`, in host memory with offload; with a streamed tier in its
    step's stream, which brings it back ahead of the backward). ``head(x)`` runs the
    head's program (with the backprop blocks) and returns the cotangent of its input. Backward, newest
    first: each group's backward program takes ``(params, slot, state, start, dy, ctx, index)``, ``slot``
    being the optimizer state (fused update) or the gradient buffer (deferred), ``start`` the output a
    rebuild starts from or the kept input; ``store(g, results)`` takes the program's results after the
    activations (updated params and state, finite flags and squares; or the buffer)."""
    blocks, kept = plan.blocks, {}
    # A streamed tier's step (`streaming.StepStream`, behind the views): a kept input waits in the stream,
    # whose puts bring it back to the device ahead of its backward, as they do the layer's state.
    stream = getattr(params, "stream", None)
    below = len(blocks) - 1 - plan.top
    for g in range(below):
        block = blocks[g]
        if block.kind is StepKind.RUN and block.mode.keeps_input:  # the run's scan keeps its inputs
            x, new_states[g], kept[g] = block.forward(params[g], states[g], x, ctx, block.index)
            continue
        if block.mode.keeps_input:
            if stream is None:
                kept[g] = residency.keep(x)
            else:
                stream.keep(g, residency.keep(x))
        x, new_states[g] = block.forward(params[g], states[g], x, ctx, block.index)
    dy = head(x)
    y = x
    for g in range(below - 1, -1, -1):
        block = blocks[g]
        if block.kind is StepKind.RUN and block.mode.keeps_input:  # (its first input comes back as y)
            dy, y, *rest = block.backward(params[g], slot[g], states[g], kept.pop(g), dy, ctx, block.index)
        elif block.mode.keeps_input:  # recomputed from its kept input; the walk goes on from that input
            xs = residency.bring(kept.pop(g) if stream is None else stream.bring(g))
            out = block.backward(params[g], slot[g], states[g], xs, dy, ctx, block.index)
            dy, rest, y = out[0], out[1:], xs
        else:
            y, dy, *rest = block.backward(params[g], slot[g], states[g], y, dy, ctx, block.index)
        store(g, rest)
        # The program's results are the store's now: no name here keeps the updated layer alive while the
        # next program's layer is put (on the CPU both would be RAM at once).
        rest = out = None


@dataclasses.dataclass
class Block:
    """One group of a plan: its walk kind, backward mode, compiled programs and first layer index."""

    kind: StepKind
    mode: object  # a `modes.BackwardMode` (None for the head)
    forward: object
    backward: object
    index: np.int32  # a host scalar: nothing per layer stays on the device


@dataclasses.dataclass
class Plan:
    """A layout's blocks (`Block`, one per group, the head last) and the views the step reads."""

    blocks: list

    @property
    def top(self) -> int:
        """The backprop blocks inside the head's program."""
        return sum(b.kind is StepKind.TOP for b in self.blocks)

    @property
    def kinds(self) -> list:
        return [b.kind for b in self.blocks]

    @property
    def forward(self) -> list:
        return [b.forward for b in self.blocks[:-1]]

    @property
    def backward(self) -> list:
        return [b.backward for b in self.blocks[:-1]]

    @property
    def head(self):
        return self.blocks[-1].forward

    @property
    def index(self) -> list:
        return [b.index for b in self.blocks]
