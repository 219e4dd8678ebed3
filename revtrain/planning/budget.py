"""The memory budget: each block backpropagated, rematerialised or rebuilt, the fastest step within a budget.

``ReversibleTrainer.memory_budget`` (bytes, ``'2GiB'``, or ``'auto'`` on an accelerator) makes the trainer
choose each block's backward mode (`revtrain.trainers.modes`) so that the step's peak device memory stays
within the budget with the fastest step (``budget_objective``: measured seconds, or FLOPs):

* **backprop**: the block runs inside the head's program, its vjp residuals held there (no recompute);
* **checkpoint**: the block runs inside the head's program under ``jax.checkpoint`` (its input held there,
  recomputed within the vjp: remat without a program of its own);
* **remat**: its input is kept (in host memory with offload) and it is recomputed under its vjp;
* **rebuild**: nothing is kept; its input is rebuilt from its output (the trainer's ``rebuild`` flavour).

Every mode gives the same gradients (the depth-12 bitwise test against `StandardTrainer` mixes all three),
so the budget trades only speed against memory.

**Costs.** The trainer's own programs are compiled on shapes and read: ``memory_analysis()`` for the bytes a call
adds to what is live (temporaries, results not aliased to donated arguments, and with offload the weights and
optimizer state it moves in, as `revtrain.memory.MemoryMeter` counts them) and ``cost_analysis()`` for its FLOPs.
The table of every plan compiles few programs (`head_points`; issue 59, "planning in seconds"): the head's
program alone, with one backprop block and with one checkpoint block; each distinct block's per-layer forward and
backward of each mode, or, with the scanned executor, each scanning mode's scans at the length its run has in the
plans most often compiled (`StepCosts.table_length`: a rebuilt run under one block in the head's program, a remat
run whole; a block alone and a run of another length are estimated from them). k backprop and h checkpoint blocks
are extrapolated linearly (the residuals of k identical blocks; a stacked run of checkpoint blocks adds its input
per block; both together optimistically, see `_head_cost`); a scan's bytes grow with its length by what its
results grow (traced, `StepCosts.run_growth`). A plan that may be chosen, or be the least, is then compiled as it
runs (`Candidates.measure`: the run's own programs), and its head becomes one more point the others are estimated
from. With ``objective='time'`` each program read is also run on zeros and timed (`time_call`; scans' seconds per
block stand for a run of any length), once the budget is above the table's least: FLOPs rank the modes wrongly
where a program's speed is not its FLOPs' (a block inside the head's program, or one per-layer call, runs slower
per FLOP than a scan's body on XLA:CPU; see docs/budget.md).

**The plan.** Blocks in the head's program must be the ones directly under the head, so a plan is
``(k, h, r)``: the top k reversible blocks backprop'd, the h under them checkpointed, the lowest r of the
other reversible blocks rematerialised, the rest rebuilt. Blocks of one kind are interchangeable, so for
a stack of identical blocks this enumeration is the whole knapsack (which r blocks are kept does not change what is held when
the head runs, where the step peaks). The peak of each ``(k, h, r)`` is simulated call by call over the walk
(live arrays before each call plus what the call adds, the meter's own rule); the plan is the one with
the fewest seconds (or FLOPs) whose peak is within the budget (ties: the lower peak). Below the least peak of any plan
the trainer refuses, naming that least budget (exit 2 from the CLI).

A scanned run's peak is its scans' (compiled at `StepCosts.table_length` blocks, their extra bytes grown to the
run's length: a scan's buffers grow with it), counted where each scan starts. The plan chosen is then compiled as
it runs (`Candidates.measure`: the head's program with its blocks, each run at its own length), and so is the
least plan where a budget is refused or no compiled plan fits it, so the peak a budget is checked against, and
the least a refusal names, are never estimates (a budget that a compiled plan fits leaves the least the table's
estimate, at most the chosen plan's peak); the search for the fastest compiles at most `MEASURED_CHOICES` plans,
then takes the fastest of those compiled; with ``'time'`` it takes a plan whose programs are compiled already
(`Candidates.ready`) within `READY_TOLERANCE` of the fastest estimate, else stops at a compiled plan within
`TIME_TOLERANCE` of every plan's seconds. A budget below every plan's base (`Candidates.refuses`) is refused from
programs compiled for their bytes alone (`StepCosts.reading_bytes`).

Tiers and ties (`_program_state`): the host tier's stacks are planned in host memory; the disk tier's layers
as the device arrays its programs compute on, its state out of the base and each call adding its layers,
one being written and one read ahead; a tied parameter's user (the head) with its tied leaves in its tree.

Limits: measured seconds vary from start to start by a few percent, so two plans that close may swap (their
gradients are the same); a deferred update (microbatches, coupled optimizers, ties) is planned from its own
accumulating programs (`revtrain.trainers.deferred.DeferredUpdate`: the run's backward and head, a rebuilt run's
scan) plus its gradient buffers and a margin of its largest layer's weights for its update passes, which are not
compiled here (planned from the fused update's programs instead, the tied default model at depth 2 stepped 15,943
bytes over the least its refusal named: the accumulating scan holds more); tied parameters keep backprop off (the
tie's owner would need the head's program); a stack of different blocks is planned with the same (k, h, r) rule,
k + h limited to the blocks under the head that equal the top one.

Lineage: checkpointing planners choose what to save under a budget (Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost"; Jain et al. 2020, "Checkmate"); MaxText's per-tensor remat policies; here the
third option (a rebuild) keeps nothing at all.
"""

from __future__ import annotations

import dataclasses

from revtrain.optstate import tree_nbytes
from revtrain.planning.costs import Cost, StepCosts, device_bytes, step_costs
from revtrain.trainers.common import TrainerError
from revtrain.trainers.modes import BACKPROP, BUDGET_MODES, CHECKPOINT, REMAT, count_in_head, default_modes

# Beyond the state, batch and activations a step holds small arrays (metrics, finite flags, squares, keys):
# planned as this much (the meter saw 258 bytes over a plan without it at depth 6).
SLACK_BYTES = 1 << 16
# The plans `choose` compiles as they run looking for the fastest that fits (each compile of a head with many
# blocks in it takes seconds): past these, the fastest of those compiled.
MEASURED_CHOICES = 8
# ``objective='time'``: a compiled plan within this fraction of every other plan's seconds is chosen without
# compiling those (timings vary from start to start by a few percent: closer plans are a tie the clock decides).
TIME_TOLERANCE = 0.05
# ``objective='time'``: a plan whose programs are compiled already (`Candidates.ready`) is taken over a faster
# estimate unless that estimate is more than this fraction faster: plans not compiled are estimated from one
# timing of each program, which varies by 5-10% from start to start on this machine, and the heads with blocks
# in them are extrapolated (docs/budget.md: such an estimate 5-10% ahead cost 3 compiles and lost when measured).
READY_TOLERANCE = 0.10


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@dataclasses.dataclass
class BudgetPlan:
    """The chosen backward mode of every block and what the step is expected to need.

    Attributes:
      modes: one `modes.BackwardMode` per layer but the head.
      budget: the budget, bytes.
      peak: the expected peak device bytes of a step (the meter's estimate rule).
      least: the least peak of any plan (bytes): the smallest budget that trains. Compiled as it runs where a
        budget is refused or no other plan fits; else the table's estimate, at most ``peak``
        (``least_measured``).
      most: the peak of the fastest plan (every block it can backprop'd): compiled, or its estimate where the
        search did not compile it (``most_measured``).
      flops: expected FLOPs of a step; ``rebuild_flops``: of the plan rebuilding every block.
      rebuild: the trainer's rebuild flavour (``"exact"``, ...).
    """

    modes: list
    budget: int
    peak: int
    least: int
    most: int
    flops: float
    rebuild_flops: float
    rebuild: str
    reversible: list  # per layer but the head: whether it is a reversible block (the counts' blocks)
    objective: str = "flops"  # what the plan minimised (`OBJECTIVES`)
    seconds: float = 0.0  # ``objective='time'``: the step's expected seconds (its programs measured)
    rebuild_seconds: float = 0.0  # ... of the plan rebuilding every block
    most_measured: bool = True  # whether ``most`` is the fastest plan's compiled peak (else its estimate)
    least_measured: bool = True  # whether ``least`` is the least plan's compiled peak (else its estimate)

    def counts(self) -> dict:
        """Reversible blocks per mode's plan name (`modes.BUDGET_MODES`, in that order): ``{"backprop": k,
        "checkpoint": h, "remat": r, "rebuild": n}``."""
        out = dict.fromkeys(BUDGET_MODES, 0)
        for m, rev in zip(self.modes, self.reversible):
            if rev:
                out[m.plan_name] = out.get(m.plan_name, 0) + 1
        return out

    def names(self) -> list:
        """Each block's mode as a plan's name (`modes.BackwardMode.plan_name`: ``"backprop"``,
        ``"checkpoint"``, ``"remat"``, ``"rebuild"``)."""
        return [m.plan_name for m in self.modes]

    def line(self) -> str:
        """One log line: the blocks of each mode, the expected peak against the budget, FLOPs."""
        c = self.counts()
        ratio = self.flops / self.rebuild_flops if self.rebuild_flops else 1.0
        cost = f"{self.flops:.3g} FLOPs a step, {ratio:.2f}x of rebuilding every block"
        if self.objective == "time":
            ratio = self.seconds / self.rebuild_seconds if self.rebuild_seconds else 1.0
            cost = (f"expected {self.seconds:.3g} s a step (its programs timed here), {ratio:.2f}x of rebuilding "
                    f"every block; {self.flops:.3g} FLOPs")
        blocks = ", ".join(f"{count} {name}" for name, count in c.items())  # (the rebuild last: its flavour next)
        return (f"memory budget {gib(self.budget)}: blocks {blocks} ({self.rebuild}); expected peak "
                f"{gib(self.peak)} (least {gib(self.least)}{'' if self.least_measured else ' estimated'}, "
                f"fastest plan {gib(self.most)}"
                f"{'' if self.most_measured else ' estimated'}); {cost}")

    def record(self) -> dict:
        """A flat dict for a run's records: ``budget_bytes``, ``budget_peak_bytes``, counts."""
        c = self.counts()
        return {"budget_bytes": self.budget, "budget_peak_bytes": self.peak, "budget_least_bytes": self.least,
                **{f"budget_{name}": count for name, count in c.items()}}


_FIELDS = ("extra", "flops", "seconds")


def head_points(max_top: int) -> list:
    """The head's programs the table of plans compiles, as ``(k, h)``: the head alone, with one backprop block
    and with one checkpoint block. Every other head is extrapolated from these (`_head_cost`), and the one a
    plan chosen runs is then compiled as it runs."""
    return [(0, 0)] if max_top == 0 else [(0, 0), (1, 0), (0, 1)]


def _head_cost(costs: dict, k: int, h: int, held: int | None = None) -> Cost:
    """The head's cost with k backprop and h checkpoint blocks, from the measured ones in ``costs`` (keys
    ``(k, h)``: `head_points`, ``(0, 0)``, ``(1, 0)``, ``(0, 1)``, and those of plans compiled since, with
    k = 0 or h = 0).

    Backprop blocks alone, and checkpoint blocks alone: linear between the measured points of their kind and
    the bare head, past the last one each block adding what the last segment added per block (`_along`: k
    identical blocks' residuals, h blocks' inputs), except that ``held`` (bytes), when given, is what each
    checkpoint block past the last adds: the input a stacked run of them keeps (one scan, recomputing one
    block at a time; a block alone holds its recompute's temporaries too). FLOPs: h times one checkpoint
    block's (`_checkpoint_flops`). Both: an optimistic estimate (the larger of the two programs' bytes, their
    seconds and FLOPs added), which `choose` replaces by the compiled program's before choosing such a plan
    (one program holds one of their peaks at a time, and where they meet is the compiler's)."""
    if (k, h) in costs:
        return _checkpoint_flops(costs, k, h, costs[(k, h)])
    back = _backprop_head(costs, k)
    if h == 0:
        return back
    ck = _checkpoint_flops(costs, 0, h, _along({m: c for (kk, m), c in costs.items() if kk == 0}, h, held))
    if k == 0:
        return ck
    none = costs[(0, 0)]
    return Cost(max(back.extra, ck.extra), back.flops + ck.flops - none.flops, back.seconds + ck.seconds - none.seconds)


def _along(points: dict, x: int, growth: int | None = None) -> Cost:
    """The `Cost` at ``x`` from the measured ``points`` (``{x_i: Cost}``, 0 among them): linear between the
    two measured around it; past the last, the last segment's growth per block (each field at least 0), its
    bytes ``growth`` per block instead when given."""
    if x in points:
        return points[x]
    xs = sorted(points)
    above = [p for p in xs if p > x]
    if above:
        a, b = max(p for p in xs if p < x), above[0]
        t = (x - a) / (b - a)
        vals = [getattr(points[a], f) + t * (getattr(points[b], f) - getattr(points[a], f)) for f in _FIELDS]
    else:
        a, b = xs[-2], xs[-1]
        vals = [getattr(points[b], f) + (x - b) * max(0, getattr(points[b], f) - getattr(points[a], f)) / (b - a)
                for f in _FIELDS]
        if growth is not None:
            vals[0] = points[b].extra + (x - b) * growth
    return Cost(int(vals[0]), *vals[1:])


def _backprop_head(costs: dict, k: int) -> Cost:
    """The head with ``k`` backprop blocks (`_along` the measured ``(k, 0)``)."""
    return _along({kk: c for (kk, m), c in costs.items() if m == 0}, k)


def _checkpoint_flops(costs: dict, k: int, h: int, cost: Cost) -> Cost:
    """``cost`` of the head with ``k`` backprop and ``h`` checkpoint blocks with the FLOPs of the ``h``
    counted h times (two or more are one stacked run, whose body ``cost_analysis`` counts once): one block's
    from the measured ``(0, 1)`` less the bare head."""
    if h < 2:
        return cost
    one = costs[(0, 1)].flops - costs[(0, 0)].flops
    return dataclasses.replace(cost, flops=_backprop_head(costs, k).flops + h * one)


def _simulate(c: "Candidates", modes: list, head: Cost, exact: bool = False) -> tuple[int, float, float]:
    """(peak device bytes, FLOPs, seconds) of one step with ``modes`` (per layer but the head) for the
    `Candidates` ``c``, call by call. A block in a scanned run of the layout these modes give is costed from
    the run's scans (its seconds per block, its bytes at the run's call), and so, estimating, is a block alone
    that a run of its mode would scan (`Candidates.scanned`); other blocks from their own programs.
    ``exact``: a run's bytes and seconds from its scans compiled at its own length, a block alone from its own
    programs (else from the scans at `StepCosts.table_length` blocks: seconds per block, bytes grown to the run's
    length, `StepCosts.run_extra`)."""
    an = c.an
    n = len(modes)
    below = n - count_in_head(modes)
    act = lambda i: tree_nbytes(an.inputs[i])  # noqa: E731  (layer i's input; i = n: the head's)
    live, peak, flops, seconds = c.base, c.base, head.flops, head.seconds
    runs = {}  # block -> (its run's start, count): blocks in a scanned run of the layout these modes give
    if c.scanned:
        runs = {j: (start, count) for start, count in an.trainer.layout(modes) if count > 1
                for j in range(start, start + count)}
    costs = []
    for i in range(below):
        mode = modes[i]
        fk, bk, _ = mode.program_kinds
        alone = i not in runs and (exact or (i, bk) not in c.scanned)
        if alone:
            f, b = an.forward(i, fk), an.backward(i, bk)
        else:  # a run's call at its first block (the forward scan starts at the lowest, the backward at the top)
            start, count = runs.get(i, (i, 1))
            if exact:
                fr, br = an.run_costs(i, bk, count)
                fe, be = fr.extra, br.extra
            else:
                fr, br = an.run_costs(i, bk, an.table_length(i, bk))
                fe, be = an.run_extra(i, bk, count)
            f = Cost(fe if i == start else 0, fr.flops, fr.seconds)  # (FLOPs: a scan's body is counted once)
            b = Cost(be if i == start + count - 1 else 0, br.flops, br.seconds)
        seconds += f.seconds + b.seconds
        costs.append((f, b))
        flops += f.flops + b.flops
        peak = max(peak, live + f.extra)
        live += mode.forward_bytes(act(i), act(i + 1), an.keeps_on_host)  # the output; the input kept or not
    peak = max(peak, live + head.extra)
    live += act(below)  # the head's input cotangent beside the input (y)
    for i in range(below - 1, -1, -1):
        mode, (_, b) = modes[i], costs[i]
        before, after = mode.backward_bytes(act(i), act(i + 1), an.keeps_on_host)  # (the mode's own terms)
        live += before
        peak = max(peak, live + b.extra)
        live += after
    return peak, flops, seconds


class Candidates:
    """Every ``(k, h, r)`` plan of a trainer on a batch shape (see the module note) with its expected peak,
    FLOPs and seconds: ``table[(k, h, r)] = (peak bytes, FLOPs, seconds)`` (seconds 0.0 unless ``timed``:
    the trainer's programs are then run on zeros and timed); `modes` gives a plan's modes."""

    def __init__(self, trainer, batch_spec: dict, budget: int | None = None):
        self.trainer, self.an = trainer, step_costs(trainer, batch_spec)  # (the trainer's programs, compiled once)
        layers = trainer.model.layers
        self.n = n = len(layers) - 1
        self.reversible = [i for i in range(n) if layers[i].reversible]
        # In the head's program: the blocks directly under it, equal to the top one (one extrapolation), no ties.
        self.max_top = 0
        if not trainer.model.ties:
            while (self.max_top < n and layers[n - 1 - self.max_top].reversible
                   and layers[n - 1 - self.max_top] == layers[n - 1]):
                self.max_top += 1
        self.measured: set = set()  # plans whose table entry is from their compiled programs (`measure`)
        held = self.an.state
        self.base = tree_nbytes(self.an.batch) + tree_nbytes(held.layer_state) + SLACK_BYTES
        where = trainer.residency.state_memory
        if where is not None:  # (a store's own weights and optimizer state: in flight, counted per call)
            self.base += device_bytes((held.params, held.opt_state))
        if trainer.deferred and where == "device":
            self.base += device_bytes(held.params)  # the gradient buffers, beside the weights
        for user in {tie.user for tie in trainer.model.ties}:  # a tied leaf's other use's gradient (`deferred`)
            self.base += tree_nbytes(trainer.model.tied_leaves(user, self.an.abstract.params))
        if trainer.deferred:  # a margin for the update passes, whose programs are not compiled here (see there)
            self.base += max(tree_nbytes(p) for p in self.an.abstract.params)
        # (block, per-layer backward kind) where a run of blocks in that kind's mode scans (every reversible
        # block in it): estimating, such a block alone is costed from its mode's scans.
        # The table compiles and times such a run's scans at the length the run has in the plans most often
        # compiled as they run (`StepCosts.table_length`): a rebuilt run with the top block in the head's program
        # (the least plan, a checkpoint block on top, or one backprop'd), a rematerialised run whole (every block
        # remat): those plans then compile no scan of their own, and other lengths are estimated from these.
        self.scanned: set = set()
        if trainer.scan_layers:  # (the deferred update scans rebuilt runs only: `layout` says so)
            for mode in (trainer.rebuild_mode, REMAT):
                modes = [mode if i in self.reversible else m for i, m in enumerate(self.modes(0, 0, 0))]
                kind = mode.program_kinds[1]
                for start, count in trainer.layout(modes):
                    if count < 2:
                        continue
                    top = mode is not REMAT and self.max_top >= 1 and start + count == n  # (its top under the head)
                    length = max(StepCosts.RUN_LENGTH, count - 1 if top else count)
                    for j in range(start, start + count):
                        self.scanned.add((j, kind))
                        self.an.lengths[(j, kind)] = length
        self.heads = {}
        # What each checkpoint block past the measured adds to the head's program where they are one stacked
        # run (`_head_cost`): its input. None: each is a group of its own (growing as measured).
        self.held = None
        if self.max_top >= 2 and any(count > 1 for start, count in trainer.layout(self.modes(0, 2, 0))
                                     if start >= n - 2):
            self.held = tree_nbytes(self.an.inputs[n - 1])
        with self.an.reading_bytes(self.refuses(budget)):  # (a budget below every plan: their bytes alone)
            self.an.prepare(self._set_heads, self._evaluate_all)  # (every program the table reads, compiled at once)
            self._set_heads()
            self.table = self._evaluate_all()

    def refuses(self, budget: int | None) -> bool:
        """Whether ``budget`` (bytes, or None: not known) is below what every plan needs before any program is
        compiled: the base every plan's peak starts from (`_simulate`: the batch, layer states, slack, and the
        state, buffers and margins its tier and update keep). Such a budget is refused; its programs never run,
        so they are compiled for their bytes alone (`StepCosts.reading_bytes`), the least named the same."""
        return budget is not None and budget < self.base

    def _set_heads(self) -> None:
        self.heads = self._heads()

    def _evaluate_all(self) -> dict:
        """Every plan ``(k, h, r)``'s estimate (`evaluate`)."""
        n = self.n
        return {(k, h, r): self.evaluate(k, h, r) for k in range(self.max_top + 1)
                for h in range(self.max_top - k + 1)
                for r in range(len([j for j in self.reversible if j < n - k - h]) + 1)}

    def _heads(self) -> dict:
        """The head's measured programs, ``{(k, h): Cost}`` (`head_points`; see `_head_cost`)."""
        return {kh: self.an.head(*kh) for kh in head_points(self.max_top)}

    def time(self) -> None:
        """Times the programs (``timed`` from now on) and re-evaluates the table with their seconds: a
        budget below the least is refused from the untimed table, before any program runs."""
        if not self.an.timed:
            self.an.timed = True  # (the memory plan reads the same programs: timed ones cost it nothing)
            self.an.blocks.clear()  # (looked up again: each program is timed on its first look-up)
            self.heads = self._heads()
            self.heads.update({(k, h): self.an.head(k, h) for k, h, _ in self.measured if k == 0 or h == 0})
            self.table = {plan: self.evaluate(*plan, measured=plan in self.measured) for plan in self.table}

    def modes(self, k: int, h: int, r: int) -> list:
        """The top ``k`` blocks backprop, the ``h`` under them checkpoint, the lowest ``r`` other reversible
        blocks remat, the rest rebuilt."""
        layers, t = self.trainer.model.layers, self.trainer
        modes = default_modes(layers[:self.n], t.rebuild_mode)
        for i in range(self.n - k - h, self.n):
            modes[i] = BACKPROP if i >= self.n - k else CHECKPOINT
        for i in [j for j in self.reversible if j < self.n - k - h][:r]:
            modes[i] = REMAT
        return modes

    def measure(self, plan: tuple) -> bool:
        """Replaces ``plan``'s estimate in `table` by its compiled programs' (`evaluate` ``measured``); False
        when it was measured already (nothing changed)."""
        if plan in self.measured:
            return False
        self.measured.add(plan)
        self.an.prepare(lambda: self.evaluate(*plan, measured=True))  # (its programs compiled at once)
        self.table[plan] = self.evaluate(*plan, measured=True)
        k, h, _ = plan
        if (k == 0 or h == 0) and (k, h) not in self.heads:  # its head: one more point the others are estimated from
            self.heads[(k, h)] = self.an.head(k, h)
            self.table = {p: self.table[p] if p in self.measured else self.evaluate(*p) for p in self.table}
        return True

    def ready(self, plan: tuple) -> bool:
        """Whether ``plan``'s own programs are compiled already (`measure` would compile nothing): its head's
        program (a measured point, `heads`), each of its scanned runs' scans at the run's length and each other
        block's own programs."""
        k, h, r = plan
        if (k, h) not in self.heads:
            return False
        modes, n = self.modes(k, h, r), self.n
        below = n - count_in_head(modes)
        return all(self.an.has_run(start, modes[start].program_kinds[1], count) if count > 1 else
                   self.an.has_block(start, *modes[start].program_kinds[:2])
                   for start, count in self.trainer.layout(modes) if start < below)

    def evaluate(self, k: int, h: int, r: int, measured: bool = False) -> tuple:
        """(expected peak, FLOPs, seconds) of plan ``(k, h, r)``; ``measured``: every program of the plan
        compiled as it runs (the head's with those blocks, each scanned run at its length), none extrapolated."""
        head = (_checkpoint_flops(self.heads, k, h, self.an.head(k, h)) if measured
                else _head_cost(self.heads, k, h, self.held))
        return _simulate(self, self.modes(k, h, r), head, exact=measured)


def _within_noise(c: Candidates, plan: tuple, budget: int) -> bool:
    """Whether the compiled ``plan`` fits ``budget`` and its measured seconds are within `TIME_TOLERANCE` of
    every plan's that fits (estimates included): the search for the fastest stops there."""
    peak, _, seconds = c.table[plan]
    fastest = min(v[2] for v in c.table.values() if v[0] <= budget)
    return peak <= budget and seconds <= (1 + TIME_TOLERANCE) * fastest


def candidates(trainer, batch_spec: dict, budget: int | None = None) -> Candidates:
    """The `Candidates` of ``trainer`` on batches shaped like ``batch_spec``, made once and kept with the
    trainer's programs (``trainer.programs.readings``, beside the `StepCosts` they are read from): a second
    budget on the same trainer compiles and times nothing again. ``budget`` (bytes): the one planned first
    (`Candidates.refuses`)."""
    key = ("budget",) + tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch_spec.items()))
    readings = trainer.programs.readings
    if key not in readings:
        readings[key] = Candidates(trainer, batch_spec, budget)
    return readings[key]


def choose(trainer, batch_spec: dict, budget: int, objective: str = "flops") -> BudgetPlan:
    """The fastest plan within ``budget`` bytes for ``trainer`` (a `ReversibleTrainer`) on batches shaped
    like ``batch_spec`` (the global batch, ``{key: ShapeDtypeStruct}``). See the module note.
    ``objective``: ``'flops'`` minimises the compiled programs' FLOPs (the same plan on every machine),
    ``'time'`` their seconds measured here (each distinct program run on zeros; a scanned run timed at
    `StepCosts.table_length` blocks).

    Raises:
      TrainerError: ``budget`` is below the least peak of any plan (the message names it).
    """
    timed = objective == "time"
    c = candidates(trainer, batch_spec, budget)
    cost = (lambda v: (v[2], v[0])) if timed else (lambda v: (v[1], v[0]))  # noqa: E731  (ties: the lower peak)
    # The least: over plans whose peak is not the optimistic estimate of backprop and checkpoint blocks
    # together. A budget is refused only against the least compiled as it runs (`Candidates.measure`), a bound;
    # a budget that a compiled plan fits never needs it (its figure then stays the table's estimate).
    sure = lambda plan: plan[0] == 0 or plan[1] == 0 or plan[:2] in c.heads  # noqa: E731
    lowest = lambda: min((p for p in c.table if sure(p)), key=lambda p: c.table[p][0])  # noqa: E731
    refused = c.refuses(budget)  # (below every plan's base: refused whatever the least, no program of it runs)
    plan = None
    if not refused and budget >= c.table[lowest()][0]:
        if timed:
            c.time()
        plan = _search(c, budget, cost, timed)
    if plan is None:
        with c.an.reading_bytes(refused):
            while c.measure(lowest()):
                pass
        least = c.table[lowest()][0]
        if budget < least:
            k, h, r = lowest()
            how = ("every block rebuilt" if k == h == r == 0 else
                   f"{k} blocks backprop, {h} checkpoint, {r} remat, the rest rebuilt")
            raise TrainerError(f"ReversibleTrainer.memory_budget {gib(budget)} is below the least this step needs: "
                               f"{gib(least)} ({budget:,} < {least:,} bytes, {how}); raise it to at least "
                               f"{least:,} bytes or shrink the batch")
        if timed:
            c.time()
        plan = _search(c, budget, cost, timed) or lowest()  # (the least fits: the search finds a plan)
    table = c.table
    # The fastest plan's peak from the table as the search left it (each plan compiled since replaced its
    # estimate); an estimate still where that plan was not compiled (`BudgetPlan.most_measured`).
    fastest = min(table, key=lambda p: cost(table[p]))
    most = table[fastest][0]
    peak, flops, seconds = table[plan]
    # (an estimated least is at most the chosen plan's compiled peak: that plan trains within it)
    least, least_measured = min(table[lowest()][0], peak), lowest() in c.measured
    layers, none = trainer.model.layers, (0, 0, 0)
    return BudgetPlan(c.modes(*plan), budget, int(peak), int(least), int(most), flops, table[none][1],
                      trainer.rebuild, [layer.reversible for layer in layers[:-1]], objective, seconds,
                      table[none][2], fastest in c.measured, least_measured)


def _search(c: Candidates, budget: int, cost, timed: bool):
    """The fastest plan within ``budget`` (by ``cost`` of its table entry), its estimate checked against its
    compiled programs (each compiled plan replaces its estimate in ``c.table``, for the next budget too, and
    may refine the others'): at most `MEASURED_CHOICES` plans compiled, then the fastest of those compiled
    that fits; with ``timed`` a plan whose programs are compiled already (`Candidates.ready`) within
    `READY_TOLERANCE` of the fastest estimate (the fastest of those), else the first compiled plan within
    `TIME_TOLERANCE` of every plan's seconds, trying first among the plans within it of the fastest the one with
    the fewest blocks in the head's program (whose compile grows with them). None when no compiled plan fits (no
    plan's estimate within ``budget``, or every one compiled over it)."""
    for _ in range(MEASURED_CHOICES):
        fits = [p for p, v in c.table.items() if v[0] <= budget]
        if not fits:
            return None
        plan = min(fits, key=lambda p: cost(c.table[p]))
        if timed:  # (plans within the clock's noise of the fastest are a tie: the one cheapest to compile)
            fastest = c.table[plan][2]
            ready = [p for p in fits if c.table[p][2] <= (1 + READY_TOLERANCE) * fastest and c.ready(p)]
            ties = [p for p in fits if c.table[p][2] <= (1 + TIME_TOLERANCE) * fastest]
            plan = (min(ready, key=lambda p: cost(c.table[p])) if ready
                    else min(ties, key=lambda p: (p[0] + p[1], cost(c.table[p]))))
        if not c.measure(plan) or (timed and _within_noise(c, plan, budget)):
            return plan  # (compiled before and within the budget, or compiled now within noise of the fastest)
    done = [p for p in c.measured if c.table[p][0] <= budget]
    return min(done, key=lambda p: cost(c.table[p])) if done else None
