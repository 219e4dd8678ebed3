"""The deferred update (`revtrain.trainers.deferred`): when the reversible trainer defers its optimizer step
(a coupled optimizer, microbatches), that the deferred step trains bit for bit like the StandardTrainer
(global-norm clipping, gradient accumulation over microbatches, both executors, the gradient buffer in host
memory, the logged ``grad_norm``), that a non-finite step updates no layer, and `split_leaf_squares`.

Float32 with ``jax_default_matmul_precision="highest"``, real text, dropout on (as tests/test_exactness.py).
The 10-step and 4-device comparisons are in tests/test_exactness.py and tests/test_recipe.py.
"""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from revtrain.models import ReversibleTransformerLM
from revtrain.placement import DATA_AXIS, global_batch, make_mesh
from revtrain.trainers import NonFiniteError, ReversibleTrainer, StandardTrainer
from revtrain.trainers.specs import split_leaf_squares

from helpers import REPO, numpy_params, run_worker, tiny_model, train_model, train_steps, worst_leaf

SEQ, BATCH, STEPS = 128, 4, 3
CLIP = 0.3  # below the gradient norm of these steps (asserted): the clip scales every step


def _model():
    return tiny_model(sequence_length=SEQ)


def _clip_adamw():
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(3e-3, weight_decay=0.01))


def test_the_update_is_deferred_only_when_it_must_be():
    """Adam alone keeps the fused per-layer update; a global-norm clip (one statistics round) or microbatches
    defer it; the trainer says which in its update line."""
    mesh = make_mesh(jax.devices()[:1])
    fused = ReversibleTrainer(_model(), optax.adam(1e-3), mesh)
    clipped = ReversibleTrainer(_model(), _clip_adamw(), mesh)
    accumulated = ReversibleTrainer(_model(), optax.adam(1e-3), mesh, microbatches=2)
    assert not fused.deferred
    assert clipped.deferred and clipped.layerwise.rounds == 1
    assert accumulated.deferred and accumulated.layerwise.rounds == 0
    assert accumulated.update_text() == "deferred (2 microbatches)"


@pytest.fixture(scope="module")
def standard_runs(text_batches):
    """StandardTrainer's parameters, losses and grad norms for clip + AdamW with M microbatches (``runs[M]``,
    each trained when a test first asks for it)."""
    batches, mesh = text_batches(BATCH, STEPS), make_mesh(jax.devices()[:1])

    class Runs(dict):
        def __missing__(self, m):
            with jax.default_matmul_precision("highest"):
                trainer = StandardTrainer(_model(), _clip_adamw(), mesh, seed=0, microbatches=m)
                state, history = train_steps(trainer, batches, mesh)
            self[m] = (numpy_params(state), [h["loss"] for h in history], [h["grad_norm"] for h in history])
            return self[m]

    return batches, Runs()


@pytest.mark.parametrize("microbatches,kwargs", [  # (make test: test_combinations' microbatches cells, test_exactness')
    pytest.param(m, kw, marks=pytest.mark.slow) for m, kw in [(2, {}), (1, {}), (2, {"scan_layers": False}),
                                                              (2, {"offload": True})]
])
def test_the_deferred_step_is_the_standard_trainers_bits(standard_runs, microbatches, kwargs):
    """Clip + AdamW, 3 steps, the clip active on each: the deferred step's losses and every parameter are the
    StandardTrainer's bits, with 2 microbatches (and in the slow tier: 1, the per-layer executor, the gradient
    buffer in host memory with ``offload``); the logged grad norm within 1e-6 (its squares are summed layer
    by layer, the StandardTrainer's over the whole tree: another order of float32 additions)."""
    batches, runs = standard_runs
    want_params, want_losses, want_norms = runs[microbatches]
    assert all(n > CLIP for n in want_norms), want_norms
    mesh = make_mesh(jax.devices()[:1])
    with jax.default_matmul_precision("highest"):
        trainer = ReversibleTrainer(_model(), _clip_adamw(), mesh, seed=0, microbatches=microbatches, **kwargs)
        assert trainer.deferred
        state, history = train_steps(trainer, batches, mesh)
    assert [h["loss"] for h in history] == want_losses
    assert all(abs(h["grad_norm"] - n) <= 1e-6 * n for h, n in zip(history, want_norms)), (history, want_norms)
    assert worst_leaf(want_params, numpy_params(state))[0] == 0.0, worst_leaf(want_params, numpy_params(state))


@pytest.mark.slow  # two reversible runs (tests/test_recipe.py: 4 microbatches against 1, also slow)
def test_microbatches_train_like_one_batch(text_batches):
    """Accumulation is one step on the whole batch: 2 microbatches of Adam (the deferred update) against the
    fused update on the whole batch, 3 steps: losses within 1e-6 relative (the sums differ in order only)
    and the same dropout masks (a different mask would move the loss far more)."""
    batches = text_batches(BATCH, STEPS)
    with jax.default_matmul_precision("highest"):
        _, whole = train_model(ReversibleTrainer, _model(), optax.adam(1e-3), batches)
        _, accumulated = train_model(ReversibleTrainer, _model(), optax.adam(1e-3), batches, microbatches=2)
    assert whole[-1] < whole[0]
    assert all(abs(a - b) <= 1e-6 * a for a, b in zip(whole, accumulated)), (whole, accumulated)


def test_deferred_step_with_a_nonfinite_gradient_updates_no_layer(text_batches):
    """A learning rate of 1e30 under clipping + SGD: the second step's loss is not finite; the error names
    it and its state is the first step's (no layer updated). (Moved here from tests/test_recipe.py.)"""
    mesh, batches = make_mesh(jax.devices()[:1]), text_batches(8, 3)
    model = ReversibleTransformerLM(SEQ, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.1)
    trainer = ReversibleTrainer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e30)), mesh)
    ts, _ = trainer.train_step(trainer.init(), global_batch(batches[0], mesh))
    before = jax.tree.map(np.asarray, ts.per_layer().params)
    with pytest.raises(NonFiniteError) as e:
        for batch in batches[1:]:
            ts, _ = trainer.train_step(ts, global_batch(batch, mesh))
            before = jax.tree.map(np.asarray, ts.per_layer().params)
    after = jax.tree.map(np.asarray, e.value.state.per_layer().params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_split_leaf_squares_sums_a_split_leafs_pieces_over_the_devices():
    """Inside ``shard_map`` over one device: a split leaf's sum of squares is its whole sum (the ``psum`` over
    ``"data"``), a replicated leaf's its own, in tree order, float32."""
    mesh = make_mesh(jax.devices()[:1])
    grads = {"a": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(2, 3), "b": jnp.full((4,), 0.5, jnp.float32)}
    specs = {"a": P(DATA_AXIS), "b": P()}
    fn = jax.shard_map(lambda g: split_leaf_squares(specs, g), mesh=mesh, in_specs=(P(),), out_specs=P(),
                       check_vma=False)
    got = np.asarray(jax.jit(fn)(grads))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array([55.0, 1.0], np.float32))


# ------------------------------------------------------------------------------------------------
# The memory plan of a sharded deferred trainer (2 devices: a worker, ``python tests/test_deferred.py OUT``).
# ------------------------------------------------------------------------------------------------
def test_a_sharded_deferred_trainers_plan_compiles_the_programs_its_step_runs(tmp_path):
    """``shard_state`` on 2 devices, the tied modern model (2 blocks, d_model 32), clip + AdamW, 2 microbatches
    (the deferred update for three reasons): `step_temporaries` compiles the five programs of its layout (the
    embedding's forward and accumulating backward, the blocks' scans, the head's accumulating program), and
    the first step lowers exactly those five fewer than an unplanned trainer's (each found compiled: the
    forwards given the microbatch's key context and the head its tied leaves whole, as the step passes them),
    and trains. (The plan once compiled the fused update's programs in their place, which do not lower under
    ``shard_state``: ``revtrain train`` crashed in its memory plan with this optimizer or a tied head.)"""
    out = run_worker(__file__, 2, tmp_path / "plan.json")
    assert out["devices"] == 2 and out["groups"] == [[0, 1], [1, 2], [3, 1]], out
    assert out["planned"] == 5 and len(out["temps"]) == 5 and sum(t > 0 for t in out["temps"]) >= 4, out
    assert out["planned_step"] == out["unplanned_step"] - 5, out
    assert out["losses"][0] == out["losses"][1] and np.isfinite(out["losses"][0]), out  # (the same step twice)


def _plan_worker(out_path: str) -> None:
    """Writes to ``out_path`` (JSON) the programs lowered by an unplanned trainer's first step, by
    `step_temporaries` and by a planned trainer's first step (after one warm-up step), the layout, the
    temporaries and the two first steps' losses (on a batch of zeros)."""
    import gin

    import revtrain.registry  # noqa: F401  (the modern parts' gin names)
    from revtrain.models.compose import ComposedModel
    from revtrain.planning import costs
    from revtrain.placement import global_batch

    lowered = [0]

    def seen(event, seconds, **kwargs):  # (JAX's event: one program lowered, as tests/test_planning_costs.py counts)
        lowered[0] += event == "/jax/core/compile/jaxpr_to_mlir_module_duration"

    jax.monitoring.register_event_duration_secs_listener(seen)

    def during(fn) -> int:
        before = lowered[0]
        fn()
        return lowered[0] - before

    gin.add_config_file_search_path(str(REPO / "configs"))
    gin.parse_config_files_and_bindings([str(REPO / "configs" / "enwik_modern.gin")],
                                        ["RMSNormLanguageModelHead.tie_embedding = True", "NUM_LAYERS = 2",
                                         "D_MODEL = 32"])
    mesh, seq = make_mesh(jax.devices()[:2]), 16
    spec = {k: jax.ShapeDtypeStruct((4, seq), np.int32) for k in ("inputs", "targets")}
    batch = global_batch({k: np.zeros(v.shape, v.dtype) for k, v in spec.items()}, mesh)

    def trainer():
        model = ComposedModel(seed=0, d_model=32, input_key="inputs", sequence_length=seq)
        t = ReversibleTrainer(model, _clip_adamw(), mesh, seed=0, microbatches=2, shard_state=True)
        assert t.deferred and t.model.ties
        return t

    losses = []

    def first_step(t):
        losses.append(float(t.train_step(t.init(), batch)[1]["loss"]))

    first_step(trainer())  # (the small programs every step shares, compiled once)
    out = {"devices": len(jax.devices()), "unplanned_step": during(lambda: first_step(trainer()))}
    planned, temps = trainer(), []
    out["groups"] = [list(g) for g in planned.groups]
    micro = {k: jax.ShapeDtypeStruct((2, seq), v.dtype) for k, v in spec.items()}  # (the global microbatch's)
    out["planned"] = during(lambda: temps.extend(costs.step_temporaries(planned, micro)))
    out["temps"] = [int(t) for t in temps]
    out["planned_step"] = during(lambda: first_step(planned))
    out["losses"] = losses[1:]
    pathlib.Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    _plan_worker(sys.argv[1])
