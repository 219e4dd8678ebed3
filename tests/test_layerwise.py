"""The optimizer analysis (`revtrain.trainers.layerwise`) sees through nested programs.

An optax update may run part of its work in nested programs: a ``jax.jit`` that stays one equation in
``make_jaxpr`` (optax 0.2.8's ``tree_bias_correction`` under JAX 0.11; ``inline=False`` on any JAX), a
custom derivative, a ``cond`` over the whole tree. The analysis inlines the calls and splits the ``cond``
into its independent parts before it labels the equations, so such an update is accepted when it is
element-wise, still refused in one line when it truly combines whole tensors of several layers, and trains
bit for bit like StandardTrainer.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore
from jax.tree_util import keystr, tree_flatten_with_path

from helpers import CONFIG, numpy_params, revtrain_here, train_steps
from revtrain.models import ReversibleTransformerLM
from revtrain.placement import make_mesh
from revtrain.trainers import LayerwiseUpdate, ReversibleTrainer, StandardTrainer, TrainerError
from revtrain.trainers.layerwise import MAX_EXPORT_SIZE, flatten


@jax.custom_jvp
def _bounded(x):
    """``clip(x, -1, 1)`` behind a custom derivative (a ``custom_jvp_call`` in the jaxpr)."""
    return jnp.clip(x, -1.0, 1.0)


_bounded.defjvp(lambda primals, tangents: (_bounded(primals[0]), tangents[0]))


def jitted_adamw(lr: float = 1e-3) -> optax.GradientTransformation:
    """AdamW whose update ends in nested programs over the whole update tree, every one element-wise: a
    ``jax.jit(..., inline=False)`` that scales every leaf by a scalar argument (broadcast inside the nested
    program) through a custom-derivative clip, and a ``cond`` on the step count over the whole tree (a
    tenth of the update for the first two steps)."""
    inner = optax.adamw(lr, weight_decay=0.01)
    helper = jax.jit(lambda tree, s: jax.tree.map(lambda x: _bounded(x * s), tree), inline=False)

    def init(params):
        return inner.init(params), jnp.zeros([], jnp.int32)

    def update(grads, state, params=None):
        updates, inner_state = inner.update(grads, state[0], params)
        updates = helper(updates, jnp.float32(0.5))
        updates = jax.lax.cond(state[1] < 2, lambda t: jax.tree.map(lambda x: x * 0.1, t), lambda t: t, updates)
        return updates, (inner_state, state[1] + 1)

    return optax.GradientTransformation(init, update)


def jitted_norm_scaled_sgd(lr: float = 1e-2) -> optax.GradientTransformation:
    """SGD whose jitted helper divides every leaf by ``1 + the whole tree's norm``: it couples layers, but
    through a scalar (a reduction of each layer, like ``optax.clip_by_global_norm``)."""
    helper = jax.jit(lambda t: jax.tree.map(lambda x: x / (1.0 + optax.global_norm(t)), t), inline=False)
    return optax.chain(optax.sgd(lr), optax.GradientTransformation(lambda p: optax.EmptyState(),
                                                                  lambda u, s, p=None: (helper(u), s)))


def mixing_sgd(lr: float = 1e-2) -> optax.GradientTransformation:
    """SGD whose jitted helper replaces every leaf by the mean of the whole tree's leaves of its shape: it
    combines whole tensors of several layers, so no layer's update exists without the others."""
    def mix(tree):
        leaves, treedef = jax.tree.flatten(tree)
        mean = {s: sum(x for x in leaves if x.shape == s) / sum(x.shape == s for x in leaves)
                for s in {x.shape for x in leaves}}
        return jax.tree.unflatten(treedef, [mean[x.shape] for x in leaves])

    helper = jax.jit(mix, inline=False)
    return optax.chain(optax.sgd(lr), optax.GradientTransformation(lambda p: optax.EmptyState(),
                                                                  lambda u, s, p=None: (helper(u), s)))


def _model():
    # d_model 64: a block's weights (64 x 256) are larger than an export may be (MAX_EXPORT_SIZE), so an
    # update that combines them across layers is refused rather than gathered.
    return ReversibleTransformerLM(128, num_layers=2, d_model=64, num_heads=4, dropout_rate=0.1)


def _has_call_over_layers(tx, params) -> bool:
    """The traced update holds a nested ``jit`` whose operands include large tensors of several layers (what
    the analysis refused before it inlined calls)."""
    closed = jax.make_jaxpr(tx.update)(params, tx.init(params), params)
    return any(e.primitive.name in ("jit", "pjit") and sum(
        np.prod(v.aval.shape) > MAX_EXPORT_SIZE for v in e.invars) > 1 for e in closed.jaxpr.eqns)


def test_flatten_inlines_calls_and_splits_a_cond_per_leaf():
    """`flatten` leaves no call-like equation and one ``cond`` per leaf, with the values of the original."""
    tx = jitted_adamw()
    rng = np.random.default_rng(0)
    params = [{"w": rng.normal(size=(3, 4)).astype(np.float32)}, {"w": rng.normal(size=(4, 2)).astype(np.float32),
                                                                   "b": rng.normal(size=2).astype(np.float32)}]
    state = tx.init(params)
    closed = jax.make_jaxpr(tx.update)(params, state, params)
    flat = flatten(closed)
    names = [e.primitive.name for e in flat.jaxpr.eqns]
    assert "jit" in [e.primitive.name for e in closed.jaxpr.eqns] and "custom_jvp_call" not in names
    assert not {"jit", "pjit", "custom_jvp_call"} & set(names)
    assert names.count("cond") == 3  # one per leaf (the whole tree's cond, split)
    args = jax.tree.leaves((params, state, params))  # compiled, as the trainers run them
    for a, b in zip(jax.jit(jcore.jaxpr_as_fun(closed))(*args), jax.jit(jcore.jaxpr_as_fun(flat))(*args)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _clipped_jitted_adamw():
    return optax.chain(optax.clip_by_global_norm(0.3), jitted_adamw())


@pytest.fixture(scope="module")
def runs(text_batches):
    """4 steps of `jitted_adamw` (or behind ``clip_by_global_norm``: "clipped") for StandardTrainer and
    ReversibleTrainer with and without offload (each run trained when a test first asks for it):
    ``(losses, per-layer params)``."""
    mesh, batches = make_mesh(jax.devices()[:1]), text_batches(8, 4)
    kinds = {"standard": (StandardTrainer, jitted_adamw, {}), "reversible": (ReversibleTrainer, jitted_adamw, {}),
             "offload": (ReversibleTrainer, jitted_adamw, {"offload": True}),
             "standard_clipped": (StandardTrainer, _clipped_jitted_adamw, {}),
             "clipped": (ReversibleTrainer, _clipped_jitted_adamw, {})}

    class Runs(dict):
        def __missing__(self, name):
            cls, make_tx, kwargs = kinds[name]
            with jax.default_matmul_precision("highest"):
                trainer = cls(_model(), make_tx(), mesh, seed=0, **kwargs)
                if cls is ReversibleTrainer:  # separable: the fused per-layer update; clipped: one global round
                    clipped = make_tx is _clipped_jitted_adamw
                    assert trainer.layerwise.rounds == clipped and trainer.deferred == clipped
                ts, history = train_steps(trainer, batches, mesh)
            self[name] = ([h["loss"] for h in history], numpy_params(ts))
            return self[name]

    return Runs()


# (clipped: make test-all; make test clips a whole-model chain in test_exactness's default_clip_microbatches)
@pytest.mark.parametrize("name", ["reversible", pytest.param("offload", marks=pytest.mark.slow), pytest.param("clipped", marks=pytest.mark.slow)])
def test_an_optimizer_with_nested_programs_trains_bit_for_bit(runs, name):
    """`jitted_adamw` (a non-inlined jit, a custom derivative and a cond, all over the whole tree) is accepted
    by ReversibleTrainer as a separable optimizer (the fused update), and with and without offload its losses
    and every parameter leaf equal StandardTrainer's bit for bit; behind ``clip_by_global_norm`` it is one
    global round (the deferred update), bit for bit too."""
    assert _has_call_over_layers(jitted_adamw(), _model().param_shapes())
    (std_losses, std), (losses, params) = runs["standard_clipped" if name == "clipped" else "standard"], runs[name]
    assert std_losses[-1] < std_losses[0]  # it trains
    assert losses == std_losses
    for (path, a), b in zip(tree_flatten_with_path(std)[0], jax.tree.leaves(params)):
        assert np.array_equal(a, b), f"{keystr(path)}: {int((a != b).sum())} of {a.size} elements differ"


def test_a_jitted_whole_tree_norm_is_a_global_round():
    """A jitted helper that scales every leaf by the whole tree's norm combines layers only through their
    sums of squares: one global round (the deferred update, as for ``clip_by_global_norm``), and its per-layer
    passes give what ``tx.update`` gives on the whole tree."""
    tx = jitted_norm_scaled_sgd()
    rng = np.random.default_rng(0)
    params = [{"w": rng.normal(size=(96, 64)).astype(np.float32)}, {"w": rng.normal(size=(96, 64)).astype(np.float32)}]
    assert _has_call_over_layers(tx, params)
    lw = LayerwiseUpdate(tx, params)
    assert lw.rounds == 1
    grads = [{"w": (rng.normal(size=(96, 64)) * 10.0 ** k).astype(np.float32)} for k in (-2, 1)]
    whole, _ = tx.update(grads, tx.init(params), params)
    per = [tx.init(p) for p in params]
    exports = [[lw.exports(0, i, grads[i], per[i], params[i], ()) for i in range(2)]]
    globals_ = lw.combine(0, exports, lw.global_leaves(0, per[0]), ())
    for i in range(2):
        got = lw.update(i, grads[i], per[i], params[i], globals_)[0]["w"]
        np.testing.assert_allclose(np.asarray(got), np.asarray(whole[i]["w"]), rtol=1e-6)


def test_a_jitted_helper_that_combines_layers_is_refused():
    """`mixing_sgd` adds whole tensors of several layers inside its jitted helper: refused, naming them."""
    assert _has_call_over_layers(mixing_sgd(), _model().param_shapes())
    with pytest.raises(TrainerError, match=r"combines whole tensors of several layers \(add of float32\["):
        ReversibleTrainer(_model(), mixing_sgd(), make_mesh(jax.devices()[:1]))


def test_a_concatenation_of_every_layer_is_split_into_segments():
    """``optax.flatten`` concatenates every layer's raveled leaves into one vector (and keeps its moments as such
    vectors): with an element-wise inner optimizer each layer's segment is computed as its own concatenation
    would be, so the update is separable (each layer's own ``tx.update``, the fused update); with a reduction
    over the vector (LAMB's trust ratio, a global-norm clip inside) it is refused, naming the vector."""
    params = _model().param_shapes()
    for inner in (optax.adamw(1e-3), optax.sgd(1e-3, momentum=0.9)):
        lw = LayerwiseUpdate(optax.flatten(inner), params)
        assert lw.rounds == 0 and lw.separable
    mesh = make_mesh(jax.devices()[:1])
    assert not ReversibleTrainer(_model(), optax.flatten(optax.adamw(1e-3)), mesh).deferred
    for inner in (optax.lamb(1e-3), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))):
        with pytest.raises(TrainerError, match=r"combines whole tensors of several layers \(\w+ of a vector of every "
                                               r"layer's elements\)"):
            ReversibleTrainer(_model(), optax.flatten(inner), mesh)


def test_the_cli_refuses_a_coupling_optimizer_in_one_line(tmp_path, byte_lm_data_dir, capfd):
    """``revtrain train`` with a gin-bound optimizer of the user's module that combines layers inside a
    jitted helper: exit status 2, one error line, nothing trained."""
    (tmp_path / "mixing_optim.py").write_text(textwrap.dedent("""\
        import gin
        import test_layerwise

        @gin.configurable
        def mixing_sgd(learning_rate):
            return test_layerwise.mixing_sgd()
        """))
    (tmp_path / "train.gin").write_text(f"include '{CONFIG}'\nimport mixing_optim\n"
                                        "train.optimizer = @mixing_optim.mixing_sgd\n")
    result = revtrain_here(capfd, "train", "--config", tmp_path / "train.gin", "--workdir", tmp_path / "run",
                           "--gin", "ReversibleTransformerLM.num_layers = 2",
                           "--gin", "ReversibleTransformerLM.d_model = 64",
                           "--gin", "train.batch_size = 2", "--gin", "STEPS = 2", "--gin", "WARMUP = 1")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("revtrain: error: the optimizer combines whole tensors of "
                                                   "several layers"), lines
    assert not (tmp_path / "run" / "metrics" / "train.jsonl").exists()


# --------------------------------------------------------------------------------------------------
# issue 60: global predicates over per-layer arithmetic (apply_if_finite, MultiSteps of any inner optimizer)
# --------------------------------------------------------------------------------------------------
def nan_at(step: int) -> optax.GradientTransformation:
    """Multiplies the first leaf of the update by NaN at ``step`` (counted from 0): a non-finite update of one
    layer, which ``apply_if_finite`` behind it must turn into a skipped step of every layer."""
    def update(updates, count, params=None):
        leaves, tree = jax.tree.flatten(updates)
        leaves[0] = leaves[0] * jnp.where(count == step, jnp.nan, 1.0).astype(leaves[0].dtype)
        return jax.tree.unflatten(tree, leaves), count + 1

    return optax.GradientTransformation(lambda p: jnp.zeros([], jnp.int32), update)


_PREDICATED = {  # name -> (tx, the global rounds its update waits for)
    "apply_if_finite_adam": (lambda: optax.apply_if_finite(optax.adam(1e-2), 3), 1),
    "apply_if_finite_adamw_nan": (lambda: optax.chain(nan_at(1), optax.apply_if_finite(optax.adamw(1e-2), 3)), 1),
    "multisteps_adamw": (lambda: optax.MultiSteps(optax.adamw(1e-2), 2), 0),
    "multisteps_clip_adam": (lambda: optax.MultiSteps(optax.chain(optax.clip_by_global_norm(0.1),
                                                                 optax.adam(1e-2)), 2), 1),
}


def _passes(tx, lw):
    """Jitted programs of the reversible trainer's deferred update for `LayerwiseUpdate` ``lw``: ``step(grads,
    states, params) -> (params, states)``, each layer's statistics and update its own program (fenced as
    `revtrain.trainers.deferred` fences them), the global rounds between."""
    from revtrain.trainers.layerwise import deferred_layer_update, fence
    n = lw.num_layers

    def stats(k, i):
        def run(g, o, p, globals_):
            scalars: list = []
            return fence(scalars, lw.exports(k, i, g, o, p, globals_, scalars))
        return jax.jit(run)

    def update(i):  # the trainer's own per-layer step (``ok`` an argument: a constant would fold)
        return jax.jit(lambda g, o, p, globals_, ok: deferred_layer_update(tx, lw, i, g, o, p, globals_, ok))

    S = [[stats(k, i) for i in range(n)] for k in range(lw.rounds)]
    C = [jax.jit(lambda e, leaves, g, k=k: lw.combine(k, e, leaves, g)) for k in range(lw.rounds)]
    U = [update(i) for i in range(n)]

    def step(grads, states, params):
        globals_, exports = (), []
        for k in range(lw.rounds):
            exports.append([S[k][i](grads[i], states[i], params[i], globals_) for i in range(n)])
            globals_ = C[k](exports, lw.global_leaves(0, states[0]), globals_)
        new = [U[i](grads[i], states[i], params[i], globals_, True) for i in range(n)]
        return [x[0] for x in new], [x[1] for x in new]

    return step


# make test: the NaN skip and the clipped MultiSteps (a selected cond); the other two in make test-all
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("apply_if_finite_adam", "multisteps_adamw")
                                  else n for n in _PREDICATED])
def test_a_global_predicate_over_per_layer_arithmetic_is_a_global_round(name):
    """``apply_if_finite`` and ``MultiSteps`` of Adam(W) (and of a clipped Adam) on leaves larger than an export
    may be: accepted (they were refused: Adam's bias correction reads the step count in every leaf's branch of
    the ``cond``), with the rounds of their global predicate, and the per-layer programs of the deferred update
    give StandardTrainer's whole-model update (`guarded_update`, one program) bit for bit over four steps,
    the parameters and every optimizer state leaf; the NaN of one layer's update at step 1 skips that step in
    every layer."""
    from revtrain.trainers.layerwise import guarded_update
    make_tx, rounds = _PREDICATED[name]
    tx, rng = make_tx(), np.random.default_rng(0)
    params = [{"w": rng.normal(size=(96, 64)).astype(np.float32), "b": rng.normal(size=64).astype(np.float32)},
              {"w": rng.normal(size=(64, 96)).astype(np.float32)}]
    lw = LayerwiseUpdate(tx, params)
    assert lw.rounds == rounds
    whole = jax.jit(lambda g, o, p: guarded_update(tx, g, o, p)[:2])
    step = _passes(tx, lw)
    p_whole, o_whole, p_layers, o_layers = params, tx.init(params), list(params), [tx.init(p) for p in params]
    for k in range(4):
        grads = [jax.tree.map(lambda x: (rng.normal(size=x.shape) * 10.0 ** (k - 2)).astype(np.float32), p)
                 for p in params]
        before = p_whole
        p_whole, o_whole = whole(grads, o_whole, p_whole)
        p_layers, o_layers = step(grads, o_layers, p_layers)
        for i in range(2):
            for (path, a), b in zip(tree_flatten_with_path(p_whole[i])[0], jax.tree.leaves(p_layers[i])):
                assert np.array_equal(np.asarray(a), np.asarray(b)), f"step {k}, layer {i}{keystr(path)}"
        whole_state = [tx.init(p) for p in params]  # the whole state's leaves, matched to the layers'
        for i in range(2):
            assert jax.tree.structure(o_layers[i]) == jax.tree.structure(whole_state[i])
        skipped = name.endswith("_nan") and k == 1
        changed = [not np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(p_whole))]
        assert not any(changed) if skipped else all(changed) or name.startswith("multisteps"), (k, changed)
    if name.endswith("_nan"):  # apply_if_finite counted the skipped step, in every layer's state alike
        assert [int(o[1].total_notfinite) for o in o_layers] == [1, 1] and int(o_whole[1].total_notfinite) == 1


def test_the_lbfgs_recursion_is_unrolled_into_global_rounds():
    """``optax.scale_by_lbfgs``' two-loop recursion (two ``scan``s whose carry is the whole update tree, an inner
    product of the whole tree per iteration) is unrolled: one global round per iteration (2 x memory size), no
    ``scan`` left, and the per-layer programs of the deferred update give StandardTrainer's whole-model update
    (`guarded_update`) bit for bit over four steps (memory 2: the history is full from step 3 on), the parameters
    and every optimizer state leaf; the unrolled update is optax's own up to rounding."""
    from revtrain.trainers.layerwise import guarded_update
    memory = 2
    tx, rng = optax.chain(optax.scale_by_lbfgs(memory_size=memory), optax.scale(-1e-2)), np.random.default_rng(0)
    params = [{"w": rng.normal(size=(96, 64)).astype(np.float32), "b": rng.normal(size=64).astype(np.float32)},
              {"w": rng.normal(size=(64, 96)).astype(np.float32)}]  # (leaves larger than an export may be)
    assert "scan" in [e.primitive.name for e in jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr.eqns]
    lw = LayerwiseUpdate(tx, params)
    assert lw.rounds == 2 * memory and not lw.separable
    assert "scan" not in [e.primitive.name for e in lw._jaxpr.eqns]
    whole = jax.jit(lambda g, o, p: guarded_update(tx, g, o, p)[:2])
    step = _passes(tx, lw)
    p_whole, o_whole, p_layers, o_layers = params, tx.init(params), list(params), [tx.init(p) for p in params]
    p_optax, o_optax = params, tx.init(params)
    for k in range(4):
        grads = [jax.tree.map(lambda x: (x * 0.5 + rng.normal(size=x.shape) * 0.1).astype(np.float32), p)
                 for p in p_whole]  # (a quadratic's gradient and noise: positive curvature, the history is used)
        p_whole, o_whole = whole(grads, o_whole, p_whole)
        p_layers, o_layers = step(grads, o_layers, p_layers)
        updates, o_optax = jax.jit(tx.update)(grads, o_optax, p_optax)
        p_optax = optax.apply_updates(p_optax, updates)
        for i in range(2):
            for (path, a), b in zip(tree_flatten_with_path((p_whole[i], _layer_state(o_whole, i)))[0],
                                    jax.tree.leaves((p_layers[i], o_layers[i]))):
                assert np.array_equal(np.asarray(a), np.asarray(b)), f"step {k}, layer {i}{keystr(path)}"
        for a, b in zip(jax.tree.leaves(p_whole), jax.tree.leaves(p_optax)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert int(o_layers[0][0].count) == 4 and float(np.abs(np.asarray(o_layers[1][0].weights_memory)).min()) > 0


def _layer_state(whole_state, i: int):
    """Layer ``i``'s part of ``chain(scale_by_lbfgs, scale)``'s whole state (its trees indexed by layer; the step
    count and the weights every layer's state has), shaped as the layer's own state."""
    lb = whole_state[0]
    return (lb._replace(params=lb.params[i], updates=lb.updates[i], diff_params_memory=lb.diff_params_memory[i],
                        diff_updates_memory=lb.diff_updates_memory[i]), whole_state[1])


@pytest.fixture(scope="module")
def predicated_runs(text_batches, tmp_path_factory):
    """5 steps of each `_PREDICATED` optimizer for StandardTrainer and ReversibleTrainer on every tier (each
    run trained when a test first asks for it): ``(losses, per-layer params)``."""
    mesh, batches = make_mesh(jax.devices()[:1]), text_batches(8, 5)

    class Runs(dict):
        def __missing__(self, key):
            name, tier = key
            kwargs = {"device": {}, "host": {"offload": True},
                      "disk": {"offload": "disk", "offload_dir": str(tmp_path_factory.mktemp(name))}}.get(tier)
            with jax.default_matmul_precision("highest"):
                if tier == "standard":
                    trainer = StandardTrainer(_model(), _PREDICATED[name][0](), mesh, seed=0)
                    ts, history = train_steps(trainer, batches, mesh)
                    params = numpy_params(ts)
                else:
                    trainer = ReversibleTrainer(_model(), _PREDICATED[name][0](), mesh, seed=0, **kwargs)
                    ts, history = train_steps(trainer, batches, mesh)
                    params = [jax.tree.map(np.asarray, trainer.layer_params(ts, i))
                              for i in range(len(trainer.model.layers))]
            self[key] = ([h["loss"] for h in history], params)
            return self[key]

    return Runs()


@pytest.mark.slow
@pytest.mark.parametrize("name,tier", [(n, t) for n in _PREDICATED for t in ("device", "host", "disk")])
def test_a_global_predicate_trains_bit_for_bit_on_every_tier(predicated_runs, name, tier):
    """`_PREDICATED` through ReversibleTrainer on the device, host and disk tiers: losses and every parameter
    leaf equal StandardTrainer's bit for bit over five steps (a model whose block weights are larger than an
    export may be); the NaN step of ``apply_if_finite_adamw_nan`` is skipped alike."""
    (std_losses, std), (losses, params) = predicated_runs[name, "standard"], predicated_runs[name, tier]
    assert std_losses[-1] < std_losses[0]  # it trains
    assert losses == std_losses
    for (path, a), b in zip(tree_flatten_with_path(std)[0], jax.tree.leaves(params)):
        assert np.array_equal(a, b), f"{keystr(path)}: {int((a != b).sum())} of {a.size} elements differ"
