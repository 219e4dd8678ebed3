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


class _Table:
    """A stand-in for `budget.Candidates` in `budget._search`: a table of (peak, FLOPs, seconds), the plans
    compiled already (``ready``), and each `measure` replacing an estimate by its "compiled" entry."""

    def __init__(self, table, ready, compiled):
        self.table, self._ready, self.compiled, self.measured = dict(table), set(ready), compiled, set(ready)

    def ready(self, plan):
        return plan in self._ready

    def measure(self, plan):
        if plan in self.measured:
            return False
        self.measured.add(plan)
        self.table[plan] = self.compiled[plan]
        return True


def _time_cost(v):
    return (v[2], v[0])


def test_time_takes_a_compiled_plan_within_the_ready_tolerance_and_compiles_nothing():
    """'time': a head-heavy plan estimated 7% faster than the plan whose programs the table compiled (within
    `READY_TOLERANCE`, above `TIME_TOLERANCE`) is not compiled; one estimated 20% faster is, and is taken when
    its compiled seconds hold."""
    remat, heavy = (0, 0, 6), (5, 0, 1)
    assert budget.TIME_TOLERANCE < 0.07 < budget.READY_TOLERANCE < 0.2
    c = _Table({remat: (150, 1.0, 0.90), heavy: (420, 1.0, 0.90 / 1.07)}, ready=[remat],
               compiled={heavy: (420, 1.0, 0.95)})
    assert budget._search(c, 1 << 30, _time_cost, timed=True) == remat and c.measured == {remat}
    c = _Table({remat: (150, 1.0, 0.90), heavy: (420, 1.0, 0.90 / 1.2)}, ready=[remat],
               compiled={heavy: (420, 1.0, 0.76)})
    assert budget._search(c, 1 << 30, _time_cost, timed=True) == heavy and c.measured == {remat, heavy}


def test_time_measures_a_faster_estimate_and_keeps_looking_when_it_is_slower_compiled():
    """A plan estimated 20% faster but measured slower once compiled: the search goes on to the plan whose
    programs are compiled, which is then the fastest that fits."""
    remat, heavy = (0, 0, 6), (5, 0, 1)
    c = _Table({remat: (150, 1.0, 0.90), heavy: (420, 1.0, 0.72)}, ready=[remat], compiled={heavy: (420, 1.0, 1.1)})
    assert budget._search(c, 1 << 30, _time_cost, timed=True) == remat
    assert budget._search(c, 300, _time_cost, timed=True) == remat  # (a budget the heavy plan does not fit)
