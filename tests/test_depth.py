"""Deep stacks: the stacked layout, the scanned executors and the memory meter's running total.

The scanned and per-layer executors' exactness on the Transformer LM is in test_exactness.py (1 device,
with offload) and test_parallel.py (4 devices); resuming across the switch in test_checkpoint.py.
"""

import jax
import numpy as np
import optax
import pytest

from revtrain.memory import MemoryMeter, _bytes_on, _distinct_buffers
from revtrain.models import ReversibleTransformerLM
from revtrain.models.revnet import RevNet
from revtrain.placement import HOST_MEMORY, global_batch, make_mesh, put_replicated
from revtrain.trainers import ReversibleTrainer, StandardTrainer
from revtrain.trainers.layerwise import guarded_update
from revtrain.trainers.stacking import Stacked, find_runs, groups_of


def _mesh():
    return make_mesh(jax.devices()[:1])


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


class _Kind:
    """A layer as `find_runs` sees it: reversible or not, equal to layers of the same structure."""

    def __init__(self, structure, reversible=True):
        self.structure, self.reversible = structure, reversible

    def __eq__(self, other):
        return self.structure == other.structure


def test_runs_and_groups():
    """Runs are maximal stretches of identical reversible layers; the head and standard layers are alone."""
    # A RevNet's shape: stem, 3 blocks, downsample, 1 block, downsample, 2 blocks, head.
    layers = [_Kind("stem", False), *[_Kind("a")] * 3, _Kind("down", False), _Kind("b"), _Kind("down", False),
              *[_Kind("c")] * 2, _Kind("head", False)]
    runs = find_runs(layers)
    assert runs == [(1, 3), (7, 2)]
    assert groups_of(len(layers), runs) == ((0, 1), (1, 3), (4, 1), (5, 1), (6, 1), (7, 2), (9, 1))
    assert find_runs([*[_Kind("a")] * 3, _Kind("a")]) == [(0, 3)]  # the last layer (the head) never is
    assert find_runs(layers, eligible=lambda layer: True) == [(1, 3), (7, 2)]
    lm = ReversibleTransformerLM(16, num_layers=3, d_model=16, num_heads=2)  # real layers compare by structure
    assert find_runs(lm.layers) == [(1, 3)]


def test_stacked_round_trip_keeps_values_and_memory_kinds():
    """per-layer -> stacked -> per-layer gives the same values, shapes and memory kinds (host stays host)."""
    mesh = _mesh()
    rng = np.random.default_rng(0)
    layers = [{"w": rng.normal(size=(3, 2)).astype(np.float32), "n": np.int32(i)} for i in range(4)]
    states = [{} for _ in range(4)]
    for kind in (None, HOST_MEMORY):
        params = [put_replicated(p, mesh, kind) for p in layers]
        opt = [put_replicated(p, mesh, kind) for p in layers]
        grouped = Stacked.from_per_layer(((0, 1), (1, 3)), params, opt, states)
        assert grouped.params[0] is params[0]  # single layers are not copied
        assert grouped.params[1]["w"].shape == (3, 3, 2) and grouped.params[1]["n"].shape == (3,)
        assert grouped.params[1]["w"].sharding.memory_kind == params[0]["w"].sharding.memory_kind
        back, _, back_states = grouped.per_layer()
        assert back_states == states and _leaves_equal(back, layers)
        assert all(x.sharding.memory_kind == params[0]["w"].sharding.memory_kind for x in jax.tree.leaves(back))
        shapes, _, _ = grouped.per_layer_shapes()
        assert [jax.tree.map(lambda s: s.shape, t) for t in shapes] == [{"w": (3, 2), "n": ()}] * 4
        consumed = Stacked.from_per_layer(((0, 2), (2, 2)), params, opt, states, consume=True)
        assert all(x.is_deleted() for x in jax.tree.leaves(params[2:]))
        assert _leaves_equal(consumed.per_layer()[0][2:], layers[2:])


class _WalkingMeter(MemoryMeter):
    """Also walks every live array before each call (the old meter's O(live arrays) sum) and keeps both."""

    def observe(self, fn, args):
        if self.active:
            # (each buffer once, as the meter counts: an array and the cached single-device view of it share one)
            walked = sum(_bytes_on(a, self.device) for a in _distinct_buffers(jax.live_arrays()[::-1], self.device))
            super().observe(fn, args)
            self.pairs.append((walked, self._total))


@pytest.mark.parametrize("kwargs", [pytest.param({"scan_layers": False, "offload": True}, marks=pytest.mark.slow),
                                    pytest.param({"scan_layers": True}, marks=pytest.mark.slow)])
def test_meter_running_total_equals_a_walk_over_live_arrays(text_batches, kwargs):
    """Before every call of a logged step, the meter's running total of live device bytes is what walking
    every live array gives (as activations come and go, buffers are donated and, with offload, saved inputs
    move to host memory)."""
    mesh = _mesh()
    model = ReversibleTransformerLM(32, num_layers=3, d_model=16, num_heads=2, dropout_rate=0.1)
    trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh, seed=0, **kwargs)
    batches = [global_batch({k: v[:4, :32] for k, v in b.items()}, mesh) for b in text_batches(4, 2)]
    ts, _ = trainer.train_step(trainer.init(), batches[0])
    meter = trainer.meter = _WalkingMeter()
    meter.pairs = []
    meter.start()
    ts, metrics = trainer.train_step(ts, batches[1])
    peak = meter.stop()
    calls = 5 if kwargs["scan_layers"] else 9  # scan: embedding, run, head, run, embedding
    assert len(meter.pairs) == calls
    assert all(walked == total > 0 for walked, total in meter.pairs), meter.pairs
    assert peak > max(total for _, total in meter.pairs)  # plus the calls' temporaries


@pytest.mark.slow  # RevNet batch-norm state through both executors (test_revnet checks the state against backprop)
def test_revnet_batch_norm_state_scanned_matches_per_layer():
    """A stacked run with layer state (batch-norm statistics, updated by the forward scan) follows the
    per-layer executor: parameters, optimizer state and statistics within 1e-5, evaluation within 1e-6.

    Not bit for bit, unlike the Transformer LM: XLA:CPU fuses the batch-norm arithmetic differently inside
    the loop body (measured: one running variance off by one ulp, and parameters 1.3e-6 apart after two
    Adam steps at learning rate 1e-2, Adam magnifying last-bit differences of small gradients); the
    per-layer executor itself differs from StandardTrainer by 1.6e-8 on this model."""
    mesh = _mesh()
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(8, 4, 4, 1)).astype(np.float32),
                "targets": rng.integers(0, 10, 8).astype(np.int32)} for _ in range(2)]
    out = {}
    for scan in (False, True):
        model = RevNet(10, seed=0, widths=(4,), blocks=(2,), momentum=0.8)  # stem, 2 blocks, head
        trainer = ReversibleTrainer(model, optax.adam(1e-2), mesh, seed=0, scan_layers=scan)
        ts = trainer.init()
        assert (ts.stacked is not None) == scan
        for b in batches:
            ts, _ = trainer.train_step(ts, global_batch(b, mesh))
        evaluation = trainer.eval_step(ts, global_batch(batches[0], mesh))
        ts = ts.per_layer()
        out[scan] = (jax.tree.map(np.asarray, (ts.params, ts.opt_state, ts.layer_state)),
                     {k: float(v) for k, v in evaluation.items()})
    (a, eval_a), (b, eval_b) = out[False], out[True]
    for k in eval_a:
        assert abs(eval_a[k] - eval_b[k]) <= 1e-6 * abs(eval_a[k]), k
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.abs(x - y).max() <= 1e-5 * max(np.abs(x).max(), 1e-30)
    stats = [np.asarray(x) for x in jax.tree.leaves(a[2][1])]  # the first stacked block's statistics
    assert stats and any(np.abs(x).sum() > 0 for x in stats)


@pytest.mark.slow  # two whole-model backprop compiles
def test_standard_trainer_scan_matches_unrolled(text_batches):
    """StandardTrainer with its identical blocks in one scan (under remat) follows the unrolled program: losses within 1e-6, parameters within 1e-5 after 3 Adam steps (a scan is a different
    program, so XLA rounds a few elements differently; measured 2.5e-6 in the worst leaf, Adam magnifying
    last-bit gradient differences)."""
    mesh = _mesh()
    batches = [global_batch({k: v[:4, :32] for k, v in b.items()}, mesh) for b in text_batches(4, 3)]
    out = {}
    with jax.default_matmul_precision("highest"):
        for kwargs in ({}, {"scan_layers": True, "remat_layers": True}):
            model = ReversibleTransformerLM(32, num_layers=3, d_model=32, num_heads=2, dropout_rate=0.1)
            trainer = StandardTrainer(model, optax.adam(1e-3), mesh, seed=0, **kwargs)
            ts, losses = trainer.init(), []
            for b in batches:
                ts, metrics = trainer.train_step(ts, b)
                losses.append(float(metrics["loss"]))
            out[tuple(kwargs)] = (jax.tree.map(np.asarray, ts.params), losses)
    ref, ref_losses = out[()]
    for key, (params, losses) in out.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, err_msg=str(key))
        for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(params)):
            assert np.abs(x - y).max() <= 1e-5 * np.abs(x).max(), key


@pytest.mark.slow  # compiles whole-model backprop at two depths
def test_standard_program_grows_linearly_with_depth():
    """Whole-model backprop's compiled step grows linearly with depth, not with its square: 4x the blocks
    give at most 4x the optimised HLO (measured 3.0x). The non-finite guard once fused the AND of every
    leaf's flag into each leaf's update (7.2x here; 96,549 lines and a 13 s compile at depth 8 of the
    benchmark's tiny blocks, 165 s at depth 32)."""
    mesh = _mesh()
    tokens = np.zeros((2, 16), np.int32)
    batch = global_batch({"inputs": tokens, "targets": tokens}, mesh)
    lines = {}
    for depth in (2, 8):
        model = ReversibleTransformerLM(16, num_layers=depth, d_model=16, num_heads=2, dropout_rate=0.0)
        trainer = StandardTrainer(model, optax.adam(1e-3), mesh, seed=0)
        ts = trainer.init()
        trainer.train_step(ts, batch)  # builds the step program
        ts = trainer.init()
        lowered = trainer._cache["step"].lower(ts.params, ts.opt_state[0], ts.layer_state, batch,
                                               jax.random.PRNGKey(0))
        lines[depth] = len(lowered.compile().as_text().splitlines())
    assert lines[8] <= 4 * lines[2], lines


def test_guarded_update_skips_non_finite_gradients():
    """The guarded update (a ``lax.cond`` on the flag) applies the optax update when every gradient is
    finite, and leaves parameters and optimizer state as they were otherwise."""
    tx = optax.adam(1e-2)
    params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    state = tx.init(params)
    good = {"a": np.full((2, 3), 0.5, np.float32), "b": np.linspace(-1, 1, 4, dtype=np.float32)}
    bad = dict(good, b=np.array([0, np.nan, 0, 0], np.float32))
    updates, _ = tx.update(good, state, params)
    want = optax.apply_updates(params, updates)
    fn = jax.jit(lambda g, o, p: guarded_update(tx, g, o, p))
    new_params, new_state, finite = fn(good, state, params)
    assert bool(finite)
    for x, y in zip(jax.tree.leaves(new_params), jax.tree.leaves(want)):
        np.testing.assert_allclose(x, y, rtol=1e-6)
    assert not _leaves_equal(new_state, state)
    new_params, new_state, finite = fn(bad, state, params)
    assert not bool(finite)
    assert _leaves_equal(new_params, params) and _leaves_equal(new_state, state)


@pytest.mark.slow  # three training runs
def test_checkpoints_resume_across_the_executor_switch(text_batches, tmp_path):
    """A checkpoint holds the per-layer layout whichever executor wrote it: a scanned run's checkpoint
    resumes with the per-layer executor and back, and both continue the uninterrupted run bit for bit."""
    from revtrain.checkpoint import Checkpointer

    mesh = _mesh()
    batches = [global_batch({k: v[:4, :32] for k, v in b.items()}, mesh) for b in text_batches(4, 4)]

    def trainer(scan):
        model = ReversibleTransformerLM(32, num_layers=2, d_model=16, num_heads=2, dropout_rate=0.1)
        return ReversibleTrainer(model, optax.adamw(1e-3), mesh, seed=0, scan_layers=scan)

    scanned, per_layer = trainer(True), trainer(False)
    reference, ts = [], scanned.init()
    checkpointer = Checkpointer(str(tmp_path), keep=None)
    for k, b in enumerate(batches):
        ts, _ = scanned.train_step(ts, b)
        reference.append(jax.tree.map(np.asarray, ts.per_layer().params))
        if k == 1:
            checkpointer.save(ts, None, {})  # step 2, written from the stacked layout
            checkpointer.wait()
    restored = checkpointer.restore(per_layer.init(), 2)
    assert restored.stacked is None and restored.step == 2
    ts, _ = per_layer.train_step(restored, batches[2])
    assert _leaves_equal(ts.params, reference[2])
    checkpointer.save(ts, None, {})  # step 3, written from the per-layer layout
    checkpointer.wait()
    ts, _ = scanned.train_step(checkpointer.restore(scanned.init(), 3), batches[3])
    assert ts.stacked is not None and _leaves_equal(ts.per_layer().params, reference[3])
    checkpointer.close()
