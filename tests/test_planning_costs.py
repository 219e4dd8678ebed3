"""revtrain/planning/costs.py: the planners compile the trainer's own programs once, and the run calls those."""

import jax
import numpy as np
import optax
import pytest

from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh
from revtrain.planning import costs
from revtrain.planning.setups import Setup, setup_of
from revtrain.trainers import ReversibleTrainer

B, T = 4, 16
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # JAX's event: one program lowered


class _Lowerings:
    """Counts the programs JAX lowers (each compile starts with one; a program found compiled has none)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._seen)

    def _seen(self, event, seconds, **kwargs):
        self.count += event == LOWERED

    def during(self, fn) -> int:
        before = self.count
        fn()
        return self.count - before


def _trainer(tx=None):
    model = ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=2, dropout_rate=0.0)
    return ReversibleTrainer(model, tx or optax.adam(1e-3), make_mesh(jax.devices()[:1]), seed=0)


def _spec():
    shape = jax.ShapeDtypeStruct((B, T), np.int32)
    return {"inputs": shape, "targets": shape}


def _first_step(trainer):
    batch = global_batch({k: np.zeros(v.shape, v.dtype) for k, v in _spec().items()}, trainer.mesh)
    jax.block_until_ready(trainer.train_step(trainer.init(), batch)[1])


# (deferred: make test-all; make test has the deferred update's case with more reasons for it, sharded, in
# tests/test_deferred.py::test_a_sharded_deferred_trainers_plan_compiles_the_programs_its_step_runs)
@pytest.mark.parametrize("deferred", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_plan_compiles_the_programs_the_step_runs_and_the_step_compiles_them_no_more(deferred):
    """`step_temporaries` of the scanned layout (embedding alone, the two blocks one run, the head) compiles
    five programs (each group's forward and backward, the head's): a trainer planned that way lowers exactly
    five programs fewer in its first step than an unplanned one (their executables are found compiled). With
    the deferred update (a global-norm clip) the backward and head programs are its accumulating ones, the
    run's own (the update passes are not planned from programs)."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)) if deferred else None
    lowered = _Lowerings()
    _first_step(_trainer(tx))  # (the small programs every step shares, compiled once)
    unplanned = lowered.during(lambda: _first_step(_trainer(tx)))
    trainer = _trainer(tx)
    assert trainer.deferred == deferred
    assert trainer.groups == ((0, 1), (1, 2), (3, 1))
    temps = []
    planned = lowered.during(lambda: temps.extend(costs.step_temporaries(trainer, _spec())))
    assert planned == 5 and len(temps) == 5 and sum(t > 0 for t in temps) >= 4, temps  # (an embedding's forward
    # can need none)
    assert lowered.during(lambda: _first_step(trainer)) == unplanned - 5
    if deferred:
        assert any(k[:2] == ("bwd_run", "reverse_run_acc") for k in costs.step_costs(trainer, _spec()).cache)
    assert lowered.during(lambda: costs.step_temporaries(trainer, _spec())) == 0  # (kept with the programs)
    assert trainer.programs.readings and "_budget_candidates" not in vars(trainer)


def test_the_memory_plan_asks_the_trainer_only_for_its_own_choice():
    trainer = _trainer()
    own = setup_of(trainer, B)
    programs = costs.PlanPrograms(trainer, own)
    assert programs.is_own(own) and not programs.is_own(Setup("reversible", trainer.tx, B // 2))
    assert not costs.PlanPrograms().is_own(own)
    other = programs.layer_programs(trainer.model, trainer.tx, "fused")
    assert other is not trainer.programs and other.rebuild_mode.name == "fused"
    assert programs.layer_programs(trainer.model, trainer.tx, "fused") is other  # (made once)


def _first_eval(trainer):
    batch = {k: np.zeros(v.shape, v.dtype) for k, v in _spec().items()}
    batch["weights"] = np.ones((B, T), np.float32)
    jax.block_until_ready(trainer.eval_step(trainer.init(), global_batch(batch, trainer.mesh)))


def test_a_plan_compiles_the_evaluation_programs_the_run_calls_and_they_compile_no_more():
    """`eval_temporaries` compiles the trainer's own evaluation programs (the embedding's, the two blocks'
    scan, the head's) on the evaluation batch's shapes: the first evaluation of a planned trainer lowers
    three programs fewer than an unplanned one's, and the plan's figures are those programs' (one pair per
    program: temporaries, activations per device)."""
    lowered = _Lowerings()
    spec = {**_spec(), "weights": jax.ShapeDtypeStruct((B, T), np.float32)}
    _first_eval(_trainer())  # (the small programs every evaluation shares, compiled once)
    unplanned = lowered.during(lambda: _first_eval(_trainer()))
    trainer = _trainer()
    found = []
    assert lowered.during(lambda: found.extend(costs.eval_temporaries(trainer, spec))) == 3
    assert len(found) == 3 and all(t >= 0 for t, _ in found), found
    acts = [a for _, a in found]
    assert acts == [B * T * 4 + 2 * B * T * 32 * 4, 2 * 2 * B * T * 32 * 4, 2 * B * T * 32 * 4], acts  # (token ids
    # in, both residual streams out; the streams through the run; the head reads both)
    assert lowered.during(lambda: _first_eval(trainer)) == unplanned - 3
    assert costs.eval_temporaries(trainer, spec) == found  # (kept with the programs)
