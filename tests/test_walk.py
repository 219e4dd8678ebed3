"""`revtrain.trainers.walk`: the order of a reversible step's compiled calls over a plan, with recording
stand-ins for the programs (no compile): forward oldest first, the head, backward newest first; what each
mode keeps, rebuilds or brings back; and the plan's views."""

import numpy as np

from revtrain.trainers import modes
from revtrain.trainers.walk import Block, Plan, StepKind, walk


class _Residency:
    """Records keep and bring (a kept input's round trip through the tier)."""

    def __init__(self, log):
        self.log = log

    def keep(self, x):
        self.log.append(("keep", x))
        return ("kept", x)

    def bring(self, kept):
        self.log.append(("bring", kept))
        return kept[1]


def _block(g, mode, log, kind=None):
    """A group ``g`` whose forward adds 1 to x and whose backward gives (dy + 10 * (g + 1)) and its results."""
    def forward(params, state, x, ctx, index):
        log.append(("forward", g, x))
        if kind is StepKind.RUN and mode.keeps_input:
            return x + 1, f"state{g}", ("run_kept", x)
        return x + 1, f"state{g}"

    def backward(params, slot, state, start, dy, ctx, index):
        log.append(("backward", g, start, dy))
        if kind is StepKind.RUN and mode.keeps_input:
            return dy + 10 * (g + 1), start[1], f"update{g}"
        if mode.keeps_input:
            return dy + 10 * (g + 1), f"update{g}"
        return start - 1, dy + 10 * (g + 1), f"update{g}"  # rebuilt input, its cotangent, results

    return Block(kind or mode.kind, mode, forward, backward, np.int32(g))


def _head(log):
    return Block(StepKind.HEAD, None, "head program", None, np.int32(9))


def test_the_walk_runs_forward_then_head_then_backward_newest_first():
    """A remat block (input kept in the tier, brought back), then two rebuilt blocks (nothing kept; the
    backward rebuilds each input from its output), then the head: the calls in order, each backward given
    the input it starts from and the cotangent of the block above it."""
    log = []
    exact = modes.REBUILDS["exact"]
    plan = Plan([_block(0, modes.REMAT, log), _block(1, exact, log), _block(2, exact, log), _head(log)])
    stored, new_states = {}, [None] * 4

    def head(x):
        log.append(("head", x))
        return 100

    walk(plan, _Residency(log), [None] * 4, [None] * 4, [None] * 4, new_states, 0, "ctx", head,
         lambda g, rest: stored.__setitem__(g, rest))
    assert log == [("keep", 0), ("forward", 0, 0), ("forward", 1, 1), ("forward", 2, 2), ("head", 3),
                   ("backward", 2, 3, 100), ("backward", 1, 2, 130), ("bring", ("kept", 0)),
                   ("backward", 0, 0, 150)]
    assert stored == {2: ["update2"], 1: ["update1"], 0: ("update0",)}
    assert new_states == ["state0", "state1", "state2", None]


def test_blocks_in_the_heads_program_have_no_calls_of_their_own():
    """Two backprop blocks under the head (`StepKind.TOP`) run inside ``head``: the walk calls only the
    group below them, forward and backward."""
    log = []
    plan = Plan([_block(0, modes.REBUILDS["exact"], log), _block(1, modes.BACKPROP, log),
                 _block(2, modes.BACKPROP, log), _head(log)])
    assert plan.top == 2
    walk(plan, _Residency(log), [None] * 4, [None] * 4, [None] * 4, [None] * 4, 0, None, lambda x: 7,
         lambda g, rest: None)
    assert log == [("forward", 0, 0), ("backward", 0, 1, 7)]


def test_a_stacked_run_keeps_its_inputs_in_its_scan():
    """A remat run (`StepKind.RUN` with a kept input): its forward returns what it keeps, no keep through the
    tier, and its backward starts from that and hands its first input on."""
    log = []
    plan = Plan([_block(0, modes.REMAT, log, kind=StepKind.RUN), _head(log)])
    walk(plan, _Residency(log), [None] * 2, [None] * 2, [None] * 2, [None] * 2, 5, None, lambda x: 1,
         lambda g, rest: log.append(("store", g, rest)))
    assert log == [("forward", 0, 5), ("backward", 0, ("run_kept", 5), 1), ("store", 0, ["update0"])]


def test_the_plans_views():
    log = []
    blocks = [_block(0, modes.REMAT, log), _block(1, modes.CHECKPOINT, log), _head(log)]
    plan = Plan(blocks)
    assert plan.kinds == [StepKind.STD, StepKind.TOP, StepKind.HEAD] and plan.top == 1
    assert plan.forward == [blocks[0].forward, blocks[1].forward] and plan.head == "head program"
    assert plan.backward == [blocks[0].backward, blocks[1].backward]
    assert [int(i) for i in plan.index] == [0, 1, 9]
    assert StepKind.STD == "std" and StepKind("rev") is StepKind.REV
