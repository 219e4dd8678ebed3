"""The planners: what a run will need, decided before anything large is allocated.

* the **memory plan** (`memory`: each memory tier's peak by part, from shapes and compiled programs; `floor`:
  from shapes alone; `setups`: the trainer choices it compares; `report`: its refusal and table; `runs`: the
  plans of a built run and the check ``revtrain train`` runs before placing the state; `choose_tier`: the
  tier ``ReversibleTrainer.offload = 'auto'`` picks), docs/memory.md;
* the **memory budget** (`budget`: each block's backward mode, the fastest step within a device budget),
  docs/budget.md.

Both compile the trainer's own per-layer programs (`revtrain.trainers.programs.LayerPrograms`) through
`costs`, so a run compiles them once.
"""

from revtrain.limits import gib
from revtrain.planning.setups import Setup, alternatives, optimizer_text, setup_of
from revtrain.planning.costs import PlanPrograms
from revtrain.planning.memory import (FLOOR_METHOD, PARTS, RUNTIME_BYTES, SAVE_EXTRA_MAX_BYTES,
                                      SAVE_STATE_FRACTION, STANDARD_EXTRA_FRACTION, MemoryPlan, MemoryPlanError,
                                      floor, plan)
from revtrain.planning.report import refusal, table
from revtrain.planning.runs import AUTO_ORDER, check_everywhere, choices, choose_tier, floor_run, plan_budget, plan_run
from revtrain.planning.shapes import layer_param_shapes

__all__ = ["AUTO_ORDER", "FLOOR_METHOD", "PARTS", "RUNTIME_BYTES", "SAVE_EXTRA_MAX_BYTES", "SAVE_STATE_FRACTION",
           "STANDARD_EXTRA_FRACTION", "MemoryPlan", "MemoryPlanError", "PlanPrograms", "Setup", "alternatives",
           "check_everywhere", "choices", "choose_tier", "floor", "floor_run", "gib", "layer_param_shapes", "optimizer_text", "plan",
           "plan_budget", "plan_run", "refusal", "setup_of", "table"]
