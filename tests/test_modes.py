"""The backward modes (`revtrain.trainers.modes`): what each declares (its plan name, programs, memory terms,
check note), how a name finds its mode, that each rebuild flavour calls its own piece of the layer, and that a
mode of each kind trains bit for bit like the StandardTrainer where it is exact.

Float32 with ``jax_default_matmul_precision="highest"``, real text, dropout on, Adam (as tests/test_exactness.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from revtrain import check
from revtrain.models import ReversibleTransformerLM
from revtrain.placement import make_mesh
from revtrain.trainers import ReversibleTrainer, StandardTrainer
from revtrain.planning import budget as budget_lib
from revtrain.planning.costs import StepCosts
from revtrain.trainers import modes
from revtrain.trainers.programs import LayerPrograms

from helpers import train_model, train_params, worst_leaf

SEQ, BATCH, STEPS, DEPTH = 128, 4, 3, 4
ALL = (modes.BACKPROP, modes.CHECKPOINT, modes.REMAT, *modes.REBUILDS.values())


def test_each_mode_declares_its_plan_name_programs_and_kind():
    """Every mode has a plan name of `BUDGET_MODES` (a rebuild flavour counts as ``rebuild``); a mode with
    programs of its own names the trainer's per-layer programs; one in the head's program has none."""
    assert modes.BUDGET_MODES == ("backprop", "checkpoint", "remat", "rebuild")
    assert [m.plan_name for m in ALL] == ["backprop", "checkpoint", "remat", "rebuild", "rebuild", "rebuild"]
    assert list(modes.REBUILDS) == list(ReversibleTrainer.REBUILD_MODES) == ["exact", "fused", "fenced"]
    for m in ALL:
        if m.kind is modes.StepKind.TOP:
            assert m.program_kinds == (None, None, None) and not m.keeps_input and not m.rebuilds, m
        else:
            forward, backward, _ = m.program_kinds
            assert forward in LayerPrograms._PER_LAYER and backward in LayerPrograms._PER_LAYER, m
    assert [m.kind for m in ALL] == [modes.StepKind.TOP] * 2 + [modes.StepKind.STD] + [modes.StepKind.REV] * 3
    assert [m.exact for m in ALL] == [True, True, True, True, True, False]  # fenced: its forward rounds apart


def test_each_mode_declares_its_memory_terms():
    """The planner's terms (`forward_bytes`, `backward_bytes`) for a block of 100 input and 30 output bytes:
    a kept input stays on the device (unless offloaded: then it comes back before the backward); a rebuilt
    block holds nothing but its output, and its backward holds both cotangents and both activations."""
    remat, exact = modes.REMAT, modes.REBUILDS["exact"]
    assert remat.forward_bytes(100, 30, offload=False) == 30
    assert remat.forward_bytes(100, 30, offload=True) == -70
    assert remat.backward_bytes(100, 30, offload=False) == (0, 40)
    assert remat.backward_bytes(100, 30, offload=True) == (100, 40)
    for rebuild in modes.REBUILDS.values():
        for offload in (False, True):
            assert rebuild.forward_bytes(100, 30, offload) == -70
            assert rebuild.backward_bytes(100, 30, offload) == (0, 140)
    # Over a whole walk, forward then backward, every mode ends where it began plus dx in place of x's (100).
    for m in (remat, exact):
        for offload in (False, True):
            before, after = m.backward_bytes(100, 30, offload)
            assert m.forward_bytes(100, 30, offload) + 30 + before + after == 100, (m, offload)


def test_mode_named_finds_each_mode_by_its_name():
    assert modes.mode_named("backprop") is modes.BACKPROP
    assert modes.mode_named("checkpoint") is modes.CHECKPOINT
    assert modes.mode_named("remat") is modes.REMAT
    assert modes.mode_named("rebuild") is modes.REBUILDS["exact"]
    assert modes.mode_named("rebuild", "fenced") is modes.REBUILDS["fenced"]
    assert modes.mode_named("fused") is modes.REBUILDS["fused"]
    with pytest.raises(KeyError):
        modes.mode_named("inverse")


def test_the_blocks_in_the_heads_program_and_their_runs():
    """`count_in_head` counts the backprop and checkpoint blocks at the top (none below a rebuilt or remat
    block); `head_runs` makes one run of consecutive identical single checkpoint blocks, and a run of its own of
    a backprop block, a stacked run or a checkpoint block of another layer."""
    exact, cp, bp = modes.REBUILDS["exact"], modes.CHECKPOINT, modes.BACKPROP
    assert modes.count_in_head([modes.REMAT, exact, cp, cp, bp]) == 3
    assert modes.count_in_head([cp, exact, bp]) == 1 and modes.count_in_head([exact, modes.REMAT]) == 0
    assert modes.head_runs(["a", "a", "a", "a"], [cp, cp, cp, bp]) == [(0, 3), (3, 4)]
    assert modes.head_runs(["a", "b", "b"], [cp, cp, cp]) == [(0, 1), (1, 3)]
    assert modes.head_runs(["a", "a"], [cp, cp], counts=[2, 1]) == [(0, 1), (1, 2)]  # a stacked run alone


def test_a_plans_counts_line_and_record_come_from_the_modes():
    """`BudgetPlan` counts each reversible block under its mode's plan name (a standard layer not at all)."""
    fused = modes.REBUILDS["fused"]
    plan = budget_lib.BudgetPlan([modes.REMAT, modes.REMAT, fused, fused, modes.CHECKPOINT, modes.BACKPROP],
                                 budget=2**30, peak=2**29, least=2**28, most=2**30, flops=3e9, rebuild_flops=4e9,
                                 rebuild="fused", reversible=[False, True, True, True, True, True])
    assert plan.counts() == {"backprop": 1, "checkpoint": 1, "remat": 1, "rebuild": 2}
    assert plan.names() == ["remat", "remat", "rebuild", "rebuild", "checkpoint", "backprop"]
    assert "blocks 1 backprop, 1 checkpoint, 1 remat, 2 rebuild (fused); expected peak 512.0 MiB" in plan.line()
    assert plan.record() == {"budget_bytes": 2**30, "budget_peak_bytes": 2**29, "budget_least_bytes": 2**28,
                             "budget_backprop": 1, "budget_checkpoint": 1, "budget_remat": 1, "budget_rebuild": 2}


def test_the_check_asks_the_mode_for_its_note():
    """``revtrain check``'s hint for an inexact rebuild is the flavour's own `check_note`: the fused one has
    one, said only when the other flavour checked rebuilt exactly."""
    inexact, exact = [("block", True, 1e-7, 0.0)], [("block", True, None, 0.0)]
    assert check._fused_hint("fused", inexact, ("exact", exact)) == modes.REBUILDS["fused"].check_note
    assert check._fused_hint("fused", inexact, ("exact", inexact)) is None
    assert check._fused_hint("fused", exact, ("exact", exact)) is None
    assert check._fused_hint("exact", inexact, ("fused", exact)) is None
    assert check._fused_hint("fenced", inexact, ("exact", exact)) is None


def test_each_rebuild_flavour_is_its_layers_own_piece():
    """Each flavour's `reverse` is the layer's rebuild of that name, bit for bit, and only the fenced one's
    forward outputs residuals (`outputs_residuals`); on the grid all three rebuild the input exactly."""
    layer = ReversibleTransformerLM(16, num_layers=1, d_model=32, num_heads=2, dropout_rate=0.1).layers[1]
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    r = np.random.default_rng(0)
    x, dy = (tuple(jnp.asarray(np.round(r.normal(size=(4, 16, 32)) * 2 ** 20) / 2 ** 20, jnp.float32)
                   for _ in range(2)) for _ in range(2))
    params, state = layer.init_params, layer.init_state
    y = jax.jit(lambda p, x: layer.apply(p, state, x, keys, True)[0])(params, x)
    pieces = {"exact": layer.exact_reverse_vjp, "fused": layer.fused_reverse_vjp, "fenced": layer.fenced_reverse_vjp}
    for name, mode in modes.REBUILDS.items():
        got = jax.jit(lambda p, y, dy, mode=mode: mode.reverse(layer, p, state, y, dy, keys))(params, y, dy)
        want = jax.jit(lambda p, y, dy, name=name: pieces[name](p, state, y, dy, keys))(params, y, dy)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got[0], x)), name
        assert mode.outputs_residuals(layer) == (name == "fenced")
    assert not any(m.outputs_residuals(layer) for m in (modes.BACKPROP, modes.CHECKPOINT, modes.REMAT))


def _model():
    return ReversibleTransformerLM(SEQ, num_layers=DEPTH, d_model=32, num_heads=2, dropout_rate=0.1)


@pytest.fixture(scope="module")
def standard_run(text_batches):
    batches = text_batches(BATCH, STEPS)
    with jax.default_matmul_precision("highest"):
        params, losses = train_model(StandardTrainer, _model(), optax.adam(1e-3), batches)
    return batches, params, losses


def _block_modes(mode, rebuild_mode, n: int) -> list:
    """One mode per layer but the head: the embedding recomputed; ``mode`` for every block when it runs below
    the head, else for the top two (the rest rebuilt)."""
    if mode.kind is modes.StepKind.TOP:
        return [modes.REMAT] + [rebuild_mode] * (n - 3) + [mode] * 2
    return [modes.REMAT] + [mode] * (n - 1)


# (make test-all: all four at depth 12 in test_exactness; make test: backprop here, a budget's plan of modes on
# every tier in test_budget, the exact rebuild everywhere)
@pytest.mark.parametrize("name", ["backprop", *(pytest.param(n, marks=pytest.mark.slow) for n in
                                               ("exact", "fused", "remat", "checkpoint"))])
def test_each_exact_mode_trains_bitwise_like_the_standard_trainer(standard_run, name):
    """Depth 4, every block in one exact mode (backprop and checkpoint: the top two, in the head's program):
    losses and every parameter after 3 Adam steps identical to StandardTrainer's bits (per-layer executor;
    the scanned one and the modes mixed: tests/test_exactness.py at depth 12)."""
    batches, std_params, std_losses = standard_run
    mode = modes.mode_named(name)
    assert mode.exact
    model = _model()
    with jax.default_matmul_precision("highest"):
        mesh = make_mesh(jax.devices()[:1])
        trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh, seed=0, scan_layers=False,
                                    rebuild=name if mode.rebuilds else "exact")
        trainer.set_block_modes(_block_modes(mode, trainer.rebuild_mode, len(model.layers) - 1))
        assert sum(m is mode for m in trainer.block_modes) >= 2
        params, losses = train_params(trainer, batches, mesh)
    assert losses == std_losses
    assert worst_leaf(std_params, params)[0] == 0.0, worst_leaf(std_params, params)


@pytest.mark.slow  # make test: the planner's head terms above
def test_the_planner_measures_a_top_mode_by_its_own_forward():
    """The budget planner's head program with ``k`` blocks inside is compiled in the mode asked for
    (`costs.StepCosts.head`, ``top``): two blocks asked in checkpoint mode are the very program of two
    checkpoint blocks (same bytes and FLOPs), and hold less than two backprop blocks."""
    model = ReversibleTransformerLM(SEQ, num_layers=2, d_model=32, num_heads=2, dropout_rate=0.1)
    trainer = ReversibleTrainer(model, optax.adam(1e-3), make_mesh(jax.devices()[:1]), seed=0, scan_layers=False)
    spec = {k: jax.ShapeDtypeStruct((BATCH, SEQ), np.int32) for k in ("inputs", "targets")}
    an = StepCosts(trainer, spec)
    assert an.head(2, top=modes.CHECKPOINT) == an.head(0, 2)
    assert an.head(2, top=modes.BACKPROP) == an.head(2)
    assert an.head(2, top=modes.CHECKPOINT).extra < an.head(2).extra  # (one block's residuals at a time)


@pytest.mark.slow  # make test-all, with the mode's training test below (an opt-in mode)
def test_backprop_bf16_holds_less_than_backprop_in_the_head_program():
    """`modes.Bf16Backprop`'s memory term, from the class alone: the planner's head program (`costs.StepCosts.head`)
    with one and with two blocks in that mode holds fewer bytes than with backprop's, and each block it adds
    adds fewer (d_model 64, a batch of 8: where activations weigh)."""
    model = ReversibleTransformerLM(SEQ, num_layers=2, d_model=64, num_heads=2, dropout_rate=0.1)
    trainer = ReversibleTrainer(model, optax.adam(1e-3), make_mesh(jax.devices()[:1]), seed=0, scan_layers=False)
    an = StepCosts(trainer, {k: jax.ShapeDtypeStruct((8, SEQ), np.int32) for k in ("inputs", "targets")})
    full = [an.head(k).extra for k in (1, 2)]
    low = [an.head(k, top=modes.BACKPROP_BF16).extra for k in (1, 2)]
    assert low[0] < full[0] and low[1] < full[1], (low, full)
    assert low[1] - low[0] < full[1] - full[0], (low, full)


@pytest.mark.slow  # an opt-in mode, in make test-all
def test_backprop_bf16_trains_like_backprop_on_real_text(text_batches):
    """Depth 4, the top two blocks in `modes.Bf16Backprop` (set by `set_block_modes`, the rest rebuilt): the
    loss falls over 8 Adam steps on real text, each step's loss within 1e-3 of backprop's (same blocks in
    `modes.Backprop`), and the parameters are not backprop's bits (its gradients are rounded)."""
    batches = text_batches(BATCH, 8)
    mesh = make_mesh(jax.devices()[:1])
    runs = {}
    for mode in (modes.BACKPROP, modes.BACKPROP_BF16):
        model = _model()
        with jax.default_matmul_precision("highest"):
            trainer = ReversibleTrainer(model, optax.adam(3e-3), mesh, seed=0, scan_layers=False)
            trainer.set_block_modes(_block_modes(mode, trainer.rebuild_mode, len(model.layers) - 1))
            runs[mode.name] = train_params(trainer, batches, mesh)
    params, losses = runs["backprop_bf16"]
    want_params, want = runs["backprop"]
    assert not modes.BACKPROP_BF16.exact
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(losses, want)), (losses, want)
    assert worst_leaf(want_params, params)[0] > 0.0
