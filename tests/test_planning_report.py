"""revtrain/planning/report.py: the refusal line and the table, on plans made by hand (nothing compiled)."""

import optax

from revtrain.planning import memory, report
from revtrain.planning.setups import Setup

GIB = 2**30


def _plan(label, settings, host, limit, floor=False):
    parts = dict.fromkeys(memory.PARTS, 0)
    parts.update(weights=host // 2, optimizer_state=host - host // 2)
    return memory.MemoryPlan(Setup("reversible", optax.sgd(0.1), 8, label=label, settings=settings),
                             {"host": parts}, {"host": limit}, {"host": "test limit"}, "compiled", 10, floor=floor)


def test_the_refusal_names_the_least_settings_that_fit():
    """Of the choices that fit, one whose settings add to another's is not named; the line gives the short
    tier, by how much, its parts, and ends with how to skip the check."""
    own = _plan("R", (), 3 * GIB, 2 * GIB)
    offload = _plan("R + offload", ("ReversibleTrainer.offload = True",), GIB, 2 * GIB)
    more = _plan("R + offload + Adafactor", ("ReversibleTrainer.offload = True", "train.optimizer = @optax.adafactor"),
                 GIB // 2, 2 * GIB)
    too_big = _plan("R, batch 4", ("train.batch_size = 4",), 3 * GIB, 2 * GIB)
    line = report.refusal(own, [offload, more, too_big])
    assert line == ("the memory plan does not fit: R host needs 3.00 GiB of 2.00 GiB (test limit) (weights 1.50 GiB, "
                    "optimizer state 1.50 GiB); these settings would fit: ReversibleTrainer.offload = True "
                    "(1.00 GiB); train.memory_plan = False skips this check")
    assert report.short_tier(own) == "host"


def test_the_table_has_a_row_per_choice_and_marks_floors():
    own = _plan("R", (), 3 * GIB, 2 * GIB)
    low = _plan("R + offload", ("ReversibleTrainer.offload = True",), GIB, 2 * GIB, floor=True)
    lines = report.table([own, low]).splitlines()
    assert lines[0].split() == ["choice", "host:weights", "host:optimizer_state", "host:total", "fits"]
    assert lines[1].split() == ["R", "1.500", "1.500", "3.000", "no"]
    assert lines[2].split()[-1] == "yes" and lines[2].startswith("R + offload")
    assert lines[3] == (f"(GiB; host limit 2.00 GiB (test limit); temporaries: compiled; R + offload: "
                        f"{memory.FLOOR_METHOD} (a lower bound))")
