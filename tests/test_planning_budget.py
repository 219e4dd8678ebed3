"""revtrain/planning/budget.py: the head's cost extrapolated from the measured points, and a plan's modes (no
program compiled)."""

import types

from revtrain.planning import budget
from revtrain.planning.costs import Cost
from revtrain.trainers.modes import BACKPROP, CHECKPOINT, REBUILDS, REMAT


def _measured():
    """The head's measured points: k backprop blocks (0..2) and h checkpoint blocks (1..3)."""
    return {(0, 0): Cost(100, 10.0, 1.0), (1, 0): Cost(150, 20.0, 1.5), (2, 0): Cost(210, 31.0, 2.1),
            (0, 1): Cost(120, 14.0, 1.2), (0, 2): Cost(130, 18.0, 1.4), (0, 3): Cost(145, 19.0, 1.5)}


def test_backprop_blocks_past_the_measured_add_what_the_second_added():
    head = budget._head_cost(_measured(), 4, 0)
    assert (head.extra, head.flops, round(head.seconds, 6)) == (210 + 2 * 60, 31.0 + 2 * 11.0, 3.3)


def test_checkpoint_blocks_past_three_grow_from_two_to_three_and_count_their_flops_each():
    """Bytes and seconds grow as from h = 2 to 3; FLOPs are h times one checkpoint block's (a scan's body is
    counted once by cost_analysis)."""
    head = budget._head_cost(_measured(), 0, 5)
    assert head.extra == 145 + 2 * 15 and round(head.seconds, 6) == round(1.5 + 2 * 0.1, 6)
    assert head.flops == 10.0 + 5 * 4.0


def test_backprop_and_checkpoint_together_are_the_optimistic_estimate():
    """Both kinds: the larger bytes of the two programs, their seconds and FLOPs added over the bare head."""
    head = budget._head_cost(_measured(), 1, 1)
    assert head == Cost(150, 20.0 + 14.0 - 10.0, 1.5 + 1.2 - 1.0)


def test_a_plans_modes_put_backprop_on_top_checkpoint_under_it_and_remat_lowest():
    """Plan (k, h, r) = (1, 1, 1) of an embedding and four reversible blocks: the embedding is rematerialised
    (its input cannot be rebuilt), the lowest other reversible block remat, the top one backprop, the one
    under it checkpoint, the rest rebuilt."""
    layers = [types.SimpleNamespace(reversible=r) for r in (False, True, True, True, True, True)]
    fake = types.SimpleNamespace(n=5, reversible=[1, 2, 3, 4], trainer=types.SimpleNamespace(
        model=types.SimpleNamespace(layers=layers), rebuild_mode=REBUILDS["fused"]))
    modes = budget.Candidates.modes(fake, 1, 1, 1)
    assert modes == [REMAT, REMAT, REBUILDS["fused"], CHECKPOINT, BACKPROP]
