"""The language-model recipe under per-layer updates (docs/recipe.md): global-norm clipping and any optax
optimizer applied exactly as on the whole model, gradient accumulation, tied parameters, ``grad_norm``.

Every comparison is against ``StandardTrainer`` (whole-model backprop and one ``tx.update`` of the whole
tree) on the same model, seed and real text, in float32 with the highest matmul precision. The 4-device
measurements (offload, sharded state) run in a subprocess: this file is also the worker (``python
tests/test_recipe.py OUT.json``).
"""

import json
import shutil
import sys

import numpy as np
import pytest

from helpers import REPO, numpy_params, records_by_step, run_worker, train_steps
from helpers import revtrain as run_revtrain

CLIP = 0.3  # below the gradient norm of most of the first 20 steps of these small models (asserted)


def _clip_adamw(lr=3e-3):
    import optax
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(lr, weight_decay=0.01))


def _model(depth=3, d_model=32, dropout=0.1):
    from revtrain.models import ReversibleTransformerLM
    return ReversibleTransformerLM(128, num_layers=depth, d_model=d_model, num_heads=4, dropout_rate=dropout)


def _train(trainer, batches, mesh):
    """Losses, grad norms, per-layer params (numpy) and an evaluation's loss sum after ``batches``."""
    from revtrain.placement import global_batch
    ts, history = train_steps(trainer, batches, mesh)
    evaluated = float(trainer.eval_step(ts, global_batch(batches[0], mesh))["loss_sum"])
    return [h["loss"] for h in history], [h["grad_norm"] for h in history], numpy_params(ts), evaluated


def _worst(a, b) -> float:
    """max over leaves of max |a - b| / max |a|."""
    import jax
    return max(float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _rel(a, b) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------
# The whole-model update, one layer at a time.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["clip_adamw", "adamw", "lamb", "adafactor", "two_clips", "apply_if_finite"])
def test_layerwise_update_equals_optax_on_the_whole_tree(name):
    """`LayerwiseUpdate`'s passes give what ``tx.update`` gives on the whole tree (4 steps, leaves of very
    different gradient scales, a layer without params); the rounds say which optimizers couple layers."""
    import jax
    import jax.numpy as jnp
    import optax

    from revtrain.trainers import LayerwiseUpdate

    tx, rounds = {"clip_adamw": (optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), 1),
                  "adamw": (optax.adamw(1e-2), 0), "lamb": (optax.lamb(1e-2), 0),
                  "adafactor": (optax.adafactor(1e-2), 0),
                  "two_clips": (optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9),
                                            optax.clip_by_global_norm(0.01)), 2),
                  "apply_if_finite": (optax.apply_if_finite(optax.adam(1e-2), 3), 1)}[name]
    rng = np.random.default_rng(0)
    params = [{"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)},
              {"w": rng.normal(size=(4, 2)).astype(np.float32)}, {}, {"w": rng.normal(size=(4, 2)).astype(np.float32)}]
    lw = LayerwiseUpdate(tx, params)
    assert lw.rounds == rounds
    whole, per = tx.init(params), [tx.init(p) for p in params]
    p_whole, p_layers = params, list(params)
    for _ in range(4):
        grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 10.0 ** rng.integers(-3, 3),
                                                    jnp.float32), p) for p in params]
        updates, whole = tx.update(grads, whole, p_whole)
        p_whole = optax.apply_updates(p_whole, updates)
        globals_, exports = (), []
        for k in range(lw.rounds):
            exports.append([lw.exports(k, i, grads[i], per[i], p_layers[i], globals_) for i in range(4)])
            globals_ = lw.combine(k, exports, lw.global_leaves(0, per[0]), globals_)
        new = [lw.update(i, grads[i], per[i], p_layers[i], globals_) for i in range(4)]
        p_layers = [optax.apply_updates(p_layers[i], new[i][0]) for i in range(4)]
        per = [n[1] for n in new]
    assert _worst(p_whole, p_layers) <= 1e-6


def test_an_update_that_combines_whole_layers_is_refused():
    """An update that adds one layer's gradient tensor to another's cannot run one layer at a time."""
    import jax
    import optax

    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer, TrainerError

    def update(grads, state, params=None):  # every block's leaf of that shape plus the first block's
        first = jax.tree.leaves(grads[1])[-1]
        leaves, tree = jax.tree.flatten(grads)
        return jax.tree.unflatten(tree, [x + first if x.shape == first.shape else x for x in leaves]), state

    tx = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    with pytest.raises(TrainerError, match="combines whole tensors of several layers"):
        ReversibleTrainer(_model(d_model=64), tx, make_mesh(jax.devices()[:1]))


# ------------------------------------------------------------------------------------------------
# One device: the recipe against whole-model backprop.
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_device(text_batches):
    """20 steps of clip_by_global_norm + AdamW (depth 2, dropout 0.1, batch 8) for StandardTrainer and the
    reversible trainer's two executors and ``fuse_top`` (deferred update); each run trained when a test
    first asks for it."""
    import jax

    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer

    mesh, batches = make_mesh(jax.devices()[:1]), text_batches(8, 20)
    runs = {"standard": (StandardTrainer, {}), "scan": (ReversibleTrainer, {}),
            "per_layer": (ReversibleTrainer, {"scan_layers": False}), "fuse_top": (ReversibleTrainer, {"fuse_top": True})}

    class Runs(dict):
        def __missing__(self, name):
            cls, kwargs = runs[name]
            with jax.default_matmul_precision("highest"):
                trainer = cls(_model(depth=2), _clip_adamw(), mesh, seed=0, **kwargs)
                if cls is ReversibleTrainer:
                    assert trainer.deferred and trainer.layerwise.rounds == 1
                self[name] = _train(trainer, batches, mesh)
            return self[name]

    return Runs()


# (make test-all; make test: test_exactness's default_clip_microbatches, clipping bit for bit under the scan)
@pytest.mark.parametrize("executor", [pytest.param(e, marks=pytest.mark.slow) for e in ("scan", "per_layer", "fuse_top")])
def test_global_clipping_equals_backprop(one_device, executor):
    """Clipping active on most steps; losses, grad norms and every parameter leaf within 1e-6."""
    std, rev = one_device["standard"], one_device[executor]
    assert sum(n > CLIP for n in std[1]) >= 15, std[1]  # the clip is active on most steps
    assert _rel(std[0], rev[0]) <= 1e-6, (std[0], rev[0])
    assert _rel(std[1], rev[1]) <= 1e-6, (std[1], rev[1])
    assert _worst(std[2], rev[2]) <= 1e-6
    assert std[0][-1] < std[0][0] - 0.5  # it trains


@pytest.mark.slow  # three trainers x 10 steps; make test keeps the CLI run with 2 microbatches
def test_microbatches_equal_one_batch(text_batches):
    """M = 4 at batch 16 against M = 1 at batch 16 (10 steps, both trainers): the same losses within 1e-6,
    the same dropout masks (dropout 0.1); the reversible trainer's M = 4 run against StandardTrainer's
    M = 4 run within 1e-6 (parameters too). (Batch 32 over 20 steps: `test_microbatches_at_batch_32`.)"""
    import jax

    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer

    mesh, batches, runs = make_mesh(jax.devices()[:1]), text_batches(16, 10), {}
    with jax.default_matmul_precision("highest"):
        for name, cls, m in [("standard", StandardTrainer, 1), ("standard_m4", StandardTrainer, 4),
                             ("reversible_m4", ReversibleTrainer, 4)]:
            import optax
            trainer = cls(_model(depth=2), optax.adamw(3e-3, weight_decay=0.01), mesh, seed=0, microbatches=m)
            runs[name] = _train(trainer, batches, mesh)
    for a, b in [("standard", "standard_m4"), ("standard", "reversible_m4")]:
        assert _rel(runs[a][0], runs[b][0]) <= 1e-6, (a, b, runs[a][0], runs[b][0])
        assert _rel(runs[a][1], runs[b][1]) <= 1e-5, (a, b)
    assert _worst(runs["standard_m4"][2], runs["reversible_m4"][2]) <= 1e-6


@pytest.mark.slow
def test_microbatches_at_batch_32(text_batches):
    """The issue's figure: M = 4 at global batch 32 against M = 1 at batch 32 over 20 steps, both trainers:
    losses within 1e-6 relative."""
    import jax
    import optax

    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer

    mesh, batches, losses = make_mesh(jax.devices()[:1]), text_batches(32, 20), {}
    with jax.default_matmul_precision("highest"):
        for name, cls, m in [("standard", StandardTrainer, 1), ("standard_m4", StandardTrainer, 4),
                             ("reversible", ReversibleTrainer, 1), ("reversible_m4", ReversibleTrainer, 4)]:
            trainer = cls(_model(depth=2), optax.adamw(3e-3, weight_decay=0.01), mesh, seed=0, microbatches=m)
            losses[name] = _train(trainer, batches, mesh)[0]
    for a, b in [("standard", "standard_m4"), ("reversible", "reversible_m4"), ("standard", "reversible_m4")]:
        assert _rel(losses[a], losses[b]) <= 1e-6, (a, b, losses[a], losses[b])


@pytest.mark.slow  # two trainers x 20 steps; make test keeps the tied head in the CLI recipe run
def test_tied_embedding_and_head(text_batches):
    """A tied embedding/head (the modern parts, ``tie_embedding``): one copy of the table (the head's params
    have none; the parameter count counts it once), the reversible trainer equal to StandardTrainer over 20
    steps within 1e-6, and the head evaluates with the embedding's current table."""
    import gin
    import jax
    import optax

    import revtrain.registry  # noqa: F401  (every gin name: train, ComposedModel, the modern parts)
    from revtrain.models.compose import ComposedModel
    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer

    gin.clear_config()
    gin.add_config_file_search_path(str(REPO / "configs"))
    gin.parse_config_files_and_bindings([str(REPO / "configs" / "enwik_modern.gin")],
                                        ["RMSNormLanguageModelHead.tie_embedding = True", "NUM_LAYERS = 2",
                                         "D_MODEL = 32"])
    try:
        mesh, batches, runs = make_mesh(jax.devices()[:1]), text_batches(8, 20), {}
        with jax.default_matmul_precision("highest"):
            for name, cls in [("standard", StandardTrainer), ("reversible", ReversibleTrainer)]:
                model = ComposedModel(seed=0, d_model=32, input_key="inputs", sequence_length=128)
                trainer = cls(model, optax.adamw(1e-3), mesh, seed=0)
                runs[name] = _train(trainer, batches, mesh)
    finally:
        gin.clear_config()
    (tie,) = model.ties
    assert (tie.owner, tie.owner_path, tie.user, tie.user_path) == (0, ("tokens", "embedding"), 3, ("embedding",))
    assert "embedding" not in runs["reversible"][2][3] and runs["reversible"][2][0]["tokens"]["embedding"].shape == (256, 32)
    unique = sum(x.size for x in jax.tree.leaves(model.init()[0]))
    assert model.num_params() == unique == sum(x.size for l in model.layers for x in jax.tree.leaves(l.init_params)) - 256 * 32
    std, rev = runs["standard"], runs["reversible"]
    assert _rel(std[0], rev[0]) <= 1e-6 and _worst(std[2], rev[2]) <= 1e-6 and std[3] == pytest.approx(rev[3], rel=1e-6)
    assert std[0][-1] < std[0][0]


def test_ties_the_reversible_trainer_cannot_share_are_refused():
    """A tie with fuse_top: one line naming it (never a silent copy). (With shard_state a tie trains:
    tests/test_disk_tier.py, `test_recipe_with_shard_state_on_two_devices`.)"""
    import jax
    import optax

    from revtrain.models.base import Model, Tie
    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer, TrainerError

    base = _model(depth=2)  # positions [128, 32] and the head's norm bias [64] stand in for a tie's two uses
    tied = Model(base.layers, ties=(Tie(0, ("tokens", "embedding"), len(base.layers) - 1, ("logits", "bias")),),
                 tokens_per_example=128)
    with pytest.raises(TrainerError, match="cannot be combined with ReversibleTrainer.fuse_top"):
        ReversibleTrainer(tied, optax.adam(1e-3), make_mesh(jax.devices()[:1]), fuse_top=True)


# ------------------------------------------------------------------------------------------------
# Four devices: offload and sharded state (a worker process).
# ------------------------------------------------------------------------------------------------
def _worker(out_path: str) -> None:
    import jax
    import optax

    from revtrain.data import byte_lm, pipeline
    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer

    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = make_mesh()
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm.default_data_dir())

    def batches(size, count):
        it = iter(pipeline.train_dataset(builder, batch_size=size, seed=0))
        return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(count)]

    def compare(reference, run):
        return {"loss_rel": _rel(reference[0], run[0]), "norm_rel": _rel(reference[1], run[1]),
                "param_rel": _worst(reference[2], run[2]), "clipped": sum(n > CLIP for n in reference[1]),
                "trains": reference[0][-1] < reference[0][0]}

    out = {"devices": len(jax.devices())}
    small = batches(8, 10)
    std = _train(StandardTrainer(_model(), _clip_adamw(), mesh, seed=0), small, mesh)
    for name, kwargs in {"clip_offload": {"offload": True},
                         "clip_shard": {"offload": True, "shard_state": True}}.items():
        out[name] = compare(std, _train(ReversibleTrainer(_model(), _clip_adamw(), mesh, seed=0, **kwargs),
                                        small, mesh))
    big = batches(32, 6)
    one = _train(StandardTrainer(_model(depth=2), optax.adamw(3e-3), mesh, seed=0), big, mesh)
    for name, kwargs in {"m4_offload": {"offload": True}, "m4_shard": {"offload": True, "shard_state": True}}.items():
        out[name] = compare(one, _train(ReversibleTrainer(_model(depth=2), optax.adamw(3e-3), mesh, seed=0,
                                                          microbatches=4, **kwargs), big, mesh))
    for name, make in {"lamb": lambda: optax.lamb(1e-3), "adafactor": lambda: optax.adafactor(1e-2)}.items():
        ref = _train(StandardTrainer(_model(), make(), mesh, seed=0), small, mesh)
        trainer = ReversibleTrainer(_model(), make(), mesh, seed=0, shard_state=True)
        out[name + "_shard"] = dict(compare(ref, _train(trainer, small, mesh)), deferred=trainer.deferred)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


@pytest.fixture(scope="module")
def four_devices(byte_lm_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "results.json"
    return run_worker(__file__, 4, out, data_dir=byte_lm_data_dir, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["clip_offload", "clip_shard"])
def test_global_clipping_on_four_devices(four_devices, name):
    """clip_by_global_norm + AdamW, 4 devices, offload (and sharded state): within 1e-6 of backprop."""
    run = four_devices[name]
    assert run["clipped"] >= 7 and run["trains"], run
    assert run["loss_rel"] <= 1e-6 and run["norm_rel"] <= 1e-6 and run["param_rel"] <= 1e-6, run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["m4_offload", "m4_shard"])
def test_microbatches_on_four_devices(four_devices, name):
    """M = 4 (each device's 8 rows in 4 microbatches of 2), offload (and sharded state), against one step
    on the whole batch of 32 by StandardTrainer: losses within 1e-6."""
    run = four_devices[name]
    assert run["loss_rel"] <= 1e-6 and run["norm_rel"] <= 1e-5 and run["trains"], run


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lamb_shard", "adafactor_shard"])
def test_whole_leaf_optimizers_with_sharded_state(four_devices, name):
    """LAMB and Adafactor with sharded state (their whole-leaf statistics assembled across devices in the
    deferred update): StandardTrainer's losses within 1e-6 over 10 steps."""
    run = four_devices[name]
    assert run["deferred"] and run["loss_rel"] <= 1e-6 and run["trains"], run


if __name__ == "__main__":
    _worker(sys.argv[1])


# ------------------------------------------------------------------------------------------------
# From the command line.
# ------------------------------------------------------------------------------------------------
RECIPE = ["--config", str(REPO / "configs" / "enwik_modern.gin"), "--gin", "NUM_LAYERS = 2", "--gin", "D_MODEL = 32",
          "--gin", "RMSNormLanguageModelHead.tie_embedding = True", "--gin", "train.clip_global_norm = 0.5",
          "--gin", "train.microbatches = 2", "--gin", "train.batch_size = 8", "--gin", "STEPS = 4",
          "--gin", "WARMUP = 1", "--gin", "train.log_every = 1", "--gin", "train.checkpoint_every = 2",
          "--gin", "train.sample_every = 0", "--gin", "evaluate.max_batches = 1"]


def _cli(*args, cwd):
    return run_revtrain(*args, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("recipe_cli")
    result = _cli("train", *RECIPE, "--workdir", "straight", cwd=base)
    assert result.returncode == 0, result.stderr
    return base


def test_recipe_from_the_command_line_resumes_bit_exactly(recipe_run):
    """Tied head + clip_global_norm + 2 microbatches from the CLI: grad_norm in every train.jsonl record
    and in the progress line; a copy of the run resumed from its step-2 checkpoint gives the straight run's
    steps 3 and 4 (loss and gradient norm) bit for bit (checkpoints hold whole steps)."""
    base = recipe_run
    shutil.copytree(base / "straight", base / "resumed")
    shutil.rmtree(base / "resumed" / "checkpoints" / "4")
    log = base / "resumed" / "metrics" / "train.jsonl"  # steps 3 and 4 must come from the resumed process
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if json.loads(line).get("step", 0) <= 2))
    result = _cli("train", *RECIPE, "--workdir", "resumed", cwd=base)
    assert result.returncode == 0, result.stderr
    assert "resumed from checkpoint at step 2" in result.stderr and "grad norm" in result.stderr
    assert "done: 2 steps (2 -> 4) in " in result.stderr  # the steps this process ran
    straight, resumed = records_by_step(base / "straight"), records_by_step(base / "resumed")
    assert sorted(straight) == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in straight.values())
    for step in (3, 4):
        assert (resumed[step]["loss"], resumed[step]["grad_norm"]) == (straight[step]["loss"],
                                                                         straight[step]["grad_norm"]), step


@pytest.mark.slow
def test_check_of_a_recipe_run(recipe_run):
    """``revtrain check`` on that run (microbatches, a coupled optimizer, a tied head): says how the update
    runs and finds every rebuild exact (exit 0)."""
    result = _cli("check", "--workdir", str(recipe_run / "straight"), cwd=recipe_run)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("update: deferred (2 microbatches, the optimizer combines layers (1 global round(s)), 1 tied "
            "parameter(s))") in result.stdout


@pytest.mark.slow  # one more training process (test_cli checks the refusal without train.learning_rate = None)
def test_learning_rate_beside_a_ready_optimizer(tmp_path):
    """A ready optimizer (a chain written with parentheses) trains once train.learning_rate = None says its
    own learning rate is meant; train.jsonl then has no learning rate to report (null)."""
    result = _cli("train", *RECIPE, "--gin", "train.optimizer = @optax.chain()", "--gin",
                  "optax.chain.transforms = [@optax.clip_by_global_norm(), @optax.adamw()]",
                  "--gin", "optax.clip_by_global_norm.max_norm = 0.5", "--gin", "optax.adamw.learning_rate = 1e-3",
                  "--gin", "train.learning_rate = None", "--gin", "train.clip_global_norm = None",
                  "--gin", "train.steps = 2", "--workdir", "w", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = records_by_step(tmp_path / "w")
    assert rows[2]["learning_rate"] is None or rows[2]["learning_rate"] != rows[2]["learning_rate"]
    assert rows[2]["grad_norm"] > 0
