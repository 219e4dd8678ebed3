"""revtrain/planning/budget.py: the head's cost extrapolated from the measured points, and a plan's modes (no
program compiled)."""

import types

from revtrain.planning import budget
from revtrain.planning.costs import Cost
from revtrain.trainers.modes import BACKPROP, CHECKPOINT, REBUILDS, REMAT


def _measured():
    """The head's measured points (`budget.head_points`): alone, one backprop block, one checkpoint block."""
    return {(0, 0): Cost(100, 10.0, 1.0), (1, 0): Cost(150, 20.0, 1.5), (0, 1): Cost(120, 14.0, 1.2)}


def test_the_table_compiles_three_heads():
    assert budget.head_points(6) == budget.head_points(1) == [(0, 0), (1, 0), (0, 1)]
    assert budget.head_points(0) == [(0, 0)]


def test_backprop_blocks_past_the_measured_add_what_the_last_measured_added():
    head = budget._head_cost(_measured(), 4, 0)
    assert (head.extra, head.flops, round(head.seconds, 6)) == (100 + 4 * 50, 10.0 + 4 * 10.0, 3.0)
    later = {**_measured(), (6, 0): Cost(430, 70.0, 4.0)}  # (a plan's head compiled since: interpolated)
    head = budget._head_cost(later, 4, 0)
    assert (head.extra, head.flops, round(head.seconds, 6)) == (150 + 3 * 56, 20.0 + 3 * 10.0, 3.0)


def test_checkpoint_blocks_grow_by_their_input_when_stacked_and_count_their_flops_each():
    """Five checkpoint blocks: each past the measured one adds ``held`` bytes (a stacked run keeps its input)
    or, not stacked, what the measured one added; seconds as the measured one added; FLOPs five times one
    block's (a scan's body is counted once by cost_analysis)."""
    head = budget._head_cost(_measured(), 0, 5, held=4)
    assert (head.extra, round(head.seconds, 6), head.flops) == (120 + 4 * 4, round(1.2 + 4 * 0.2, 6), 10.0 + 5 * 4.0)
    assert budget._head_cost(_measured(), 0, 5).extra == 120 + 4 * 20


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
