"""The reversible trainer computes what ordinary backprop computes (docs/design.md sections 2 and 7).

Float32 with ``jax_default_matmul_precision="highest"``, real text, dropout on, Adam. Parameters are compared
leaf by leaf: max |difference| / max |value| of the leaf.

Why 1e-5 holds under Adam: the couplings of ``ReversibleTransformerLM`` add F and G outputs rounded to a
fixed ``2**-20`` grid (``revtrain.layers.snap_to_grid``), so every rebuild is exact to the bit, and the
embedding hands the two streams distinct arrays, so the per-layer backward sums cotangents in the same
order as the whole-model gradient. On XLA:CPU the two trainers then agree bit for bit. Without the grid,
a third or more of the rebuilt elements differ in the last bits, and Adam, which divides each element by
its own gradient scale (``g / (|g| + 1e-8)`` on the first step), turns that into 3e-5..6e-4 differences in
the worst leaf; StandardTrainer on 1 vs 2 devices (a different summation order) differs by 8e-6..2e-4.
"""

import jax
import numpy as np
import optax
import pytest
from jax.tree_util import keystr, tree_flatten_with_path

from revtrain.layers.base import split_keys
from revtrain.memory import MemoryMeter
from revtrain.models import ReversibleTransformerLM
from revtrain.placement import DEVICE_MEMORY, PAGEABLE_MEMORY, global_batch, make_mesh
from revtrain.trainers import LayerwiseUpdate, ReversibleTrainer, StandardTrainer
from revtrain.trainers.programs import LayerPrograms

from helpers import worst_leaf

SEQ, BATCH, STEPS = 128, 8, 5


def _mesh():
    return make_mesh(jax.devices()[:1])


def _block_keys(seed, step, index, batch):
    """The per-example keys the trainers give layer ``index`` (``common.example_keys`` on one device)."""
    layer_key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), step), index)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(layer_key, np.arange(batch))


class _RebuildProbe:
    """Records, inside a ReversibleTrainer step, each block's forward input and its rebuilt input."""

    def __init__(self, trainer):
        self.forward, self.rebuilt = [], []
        self._fn = trainer.programs.per_layer
        trainer.programs.per_layer = self

    def __call__(self, kind, layer):
        fn = self._fn(kind, layer)
        if kind == "forward_rev":
            def forward(params, state, x, *rest):
                self.forward.append([np.array(v) for v in x])  # copied: the call donates x
                return fn(params, state, x, *rest)
            return forward
        if kind == "reverse":
            def reverse(*args):
                out = fn(*args)
                self.rebuilt.insert(0, [np.array(v) for v in out[0]])
                return out
            return reverse
        return fn


class _Depth12Runs(dict):
    """Runs of `depth12`, each trained the first time a test asks for it (the fused and fuse_top runs only
    in the slow tier)."""

    RUNS = {"standard": (StandardTrainer, {}),
            "reversible": (ReversibleTrainer, {"scan_layers": True, "rebuild": "exact"}),
            "per_layer": (ReversibleTrainer, {"scan_layers": False, "rebuild": "exact"}),
            "fused": (ReversibleTrainer, {"scan_layers": True, "rebuild": "fused"}),
            "fused_per_layer": (ReversibleTrainer, {"scan_layers": False, "rebuild": "fused"}),
            "top_fused": (ReversibleTrainer, {"scan_layers": True, "rebuild": "exact", "fuse_top": True})}

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __missing__(self, name):
        cls, kwargs = self.RUNS[name]
        mesh = _mesh()
        with jax.default_matmul_precision("highest"):
            model = ReversibleTransformerLM(SEQ, num_layers=12, d_model=64, num_heads=4, dropout_rate=0.1)
            trainer = cls(model, optax.adam(1e-3), mesh, seed=0, **kwargs)
            probe = _RebuildProbe(trainer) if name in ("per_layer", "fused_per_layer") else None
            ts, losses, rebuilds = trainer.init(), [], []
            for batch in self.batches:
                ts, metrics = trainer.train_step(ts, global_batch(batch, mesh))
                losses.append(float(metrics["loss"]))
                if probe:
                    rebuilds.append((probe.forward[:], probe.rebuilt[:]))
                    probe.forward.clear(), probe.rebuilt.clear()
            ts = ts.per_layer()
        self[name] = {"params": jax.tree.map(np.asarray, ts.params), "losses": losses, "rebuilds": rebuilds,
                      "opt_state": jax.tree.map(np.asarray, ts.opt_state)}
        return self[name]


@pytest.fixture(scope="module")
def depth12(text_batches):
    """Both trainers at depth 12, dropout 0.1, Adam, 5 steps of real text, one device; the reversible
    trainer with both executors (``reversible``: the 12 blocks in one scan per pass; ``per_layer``: one
    call per block and pass, which also records every block's forward input and rebuilt input) with the
    ``exact`` rebuild, and both executors with the ``fused`` one (``fused``, ``fused_per_layer``: recorded
    too); ``top_fused``: the top block inside the head's program (``fuse_top=True``). Each run is trained
    when a test first asks for it."""
    return _Depth12Runs(text_batches(BATCH, STEPS))


# (the scanned executor's bitwise run is in the slow tier: test_recipe, test_modern and test_budget keep it fast)
@pytest.mark.slow  # make test: depth 2 in test_smoke/test_reversible, the default and Llama models below
@pytest.mark.parametrize("executor", ["reversible", "per_layer"])
def test_reversible_equals_backprop_depth12_adam(depth12, executor):
    """Every parameter leaf within 1e-5 (max |difference| / max |value|) after 5 Adam steps."""
    std, rev = depth12["standard"], depth12[executor]
    np.testing.assert_allclose(rev["losses"], std["losses"], rtol=1e-6)
    assert std["losses"][-1] < std["losses"][0]  # it trains
    rel, leaf = worst_leaf(std["params"], rev["params"])
    assert rel <= 1e-5, f"leaf {leaf}: reversible and standard differ by {rel:.2e} after {STEPS} Adam steps"


# Depth 12 is the slow tier's (the depth-12 StandardTrainer reference alone is about 30 s of CPU): make test keeps
# both executors bit for bit against StandardTrainer at depth 2 (test_smoke: device and host memory) and on the
# default model over 10 steps (test_default_and_llama_models_are_bitwise_backprop: scanned and per-layer).
@pytest.mark.parametrize("executor", [pytest.param("reversible", marks=pytest.mark.slow),
                                      pytest.param("per_layer", marks=pytest.mark.slow),
                                      *(pytest.param(e, marks=pytest.mark.slow) for e in
                                        ("fused", "fused_per_layer", "top_fused"))])
def test_reversible_is_bitwise_backprop_on_cpu(depth12, executor):
    """Stronger than the 1e-5 rule, and what XLA:CPU gives today: identical bits. The rebuild is exact
    (coupling grid), the per-layer programs compute the same float operations in the same order as the
    whole-model gradient (the embedding emits two distinct arrays), so nothing is left to differ. The
    scanned executor's loop body is the same computation as one per-layer call, and XLA:CPU compiles it to
    the same bits. The fused rebuild too, here (near initialisation): the primal outputs of its per-half
    vjps round like the forward's F and G (on trained weights they may not: docs/rebuild.md), and each
    half's pullback accumulates its source stream's cotangent in the whole layer's order
    (`ReversibleLayer.reverse_vjp`). The top block inside the head's program (``top_fused``): the same bits."""
    std, rev = depth12["standard"], depth12[executor]
    assert rev["losses"] == std["losses"]
    for (path, a), b in zip(tree_flatten_with_path(std["params"])[0], jax.tree.leaves(rev["params"])):
        assert np.array_equal(a, b), (f"{keystr(path)}: {np.mean(a != b):.2%} of the elements differ "
                                      f"(max rel {np.abs(a - b).max() / np.abs(a).max():.1e})")


@pytest.mark.slow  # the scanned depth-12 run (see above); make test: each executor bit for bit like backprop
def test_scan_and_per_layer_executors_are_bitwise_identical(depth12):
    """Parameters and Adam state (moments and step counts) of the two executors: identical bits."""
    a, b = depth12["reversible"], depth12["per_layer"]
    assert jax.tree.structure(a["opt_state"]) == jax.tree.structure(b["opt_state"])
    for (path, x), y in zip(tree_flatten_with_path((a["params"], a["opt_state"]))[0],
                            jax.tree.leaves((b["params"], b["opt_state"]))):
        assert np.array_equal(x, y), keystr(path)


@pytest.mark.slow  # make test: the exact rebuild's input in tests/test_programs.py, and every bit-for-bit test
def test_trainer_rebuilds_every_block_input_exactly(depth12):
    """Inside the reversible trainer, the rebuilt inputs of every block equal the forward's inputs."""
    rebuilds = depth12["per_layer"]["rebuilds"]
    assert len(rebuilds) == STEPS
    for step, (forward, rebuilt) in enumerate(rebuilds):
        assert len(forward) == len(rebuilt) == 12
        for i, (x, r) in enumerate(zip(forward, rebuilt)):
            for s in range(2):
                rel = np.abs(x[s] - r[s]).max() / np.abs(x[s]).max()
                assert rel <= 1e-5, f"step {step}, block {i}, stream {s}: rebuild off by {rel:.1e}"
                assert np.array_equal(x[s], r[s]), f"step {step}, block {i}, stream {s}: rebuild not bitwise"


@pytest.mark.slow  # make test: a plan of all four modes in test_disk_tier/test_budget
@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_plan_mixing_all_four_modes_is_bitwise_backprop_depth12(depth12, scan_layers):
    """Depth 12, the budget planner's plan (1, 2, 3) (`budget.Candidates.modes`): the top block backprop'd, the 2
    under it checkpointed in the head's program, the lowest 3 recomputed, 6 rebuilt. Losses and every parameter
    after 5 Adam steps identical to StandardTrainer's bits (both executors: the scanned one scans the 3
    rematerialised blocks and the 6 rebuilt ones). (A budget's plan for identical blocks seldom mixes them all;
    the plan is set here so that all four meet in one step. The modes are written out here; the slow tier also
    has the planner derive them, which compiles its candidate programs: about 20 s on 2 cores.)"""
    from revtrain.planning import budget as budget_lib
    from revtrain.trainers.modes import BACKPROP, CHECKPOINT, REMAT

    from helpers import train_params
    std = depth12["standard"]
    mesh = _mesh()
    with jax.default_matmul_precision("highest"):
        model = ReversibleTransformerLM(SEQ, num_layers=12, d_model=64, num_heads=4, dropout_rate=0.1)
        trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh, seed=0, scan_layers=scan_layers)
        # (the embedding and the lowest 3 blocks recomputed, 6 rebuilt, 2 checkpointed, the top one backprop'd)
        modes = [REMAT] * 4 + [trainer.rebuild_mode] * 6 + [CHECKPOINT] * 2 + [BACKPROP]
        if scan_layers:
            spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in depth12.batches[0].items()}
            assert budget_lib.Candidates(trainer, spec).modes(1, 2, 3) == modes
        trainer.set_block_modes(modes)
        assert [m.name for m in modes] == ["remat"] * 4 + ["exact"] * 6 + ["checkpoint"] * 2 + ["backprop"]
        if scan_layers:
            assert (1, 3) in trainer.groups and (4, 6) in trainer.groups  # a remat scan, a rebuild scan
        params, losses = train_params(trainer, depth12.batches, mesh)
    assert losses == std["losses"]
    for (path, a), b in zip(tree_flatten_with_path(std["params"])[0], jax.tree.leaves(params)):
        assert np.array_equal(a, b), (f"{keystr(path)}: {np.mean(a != b):.2%} of the elements differ")


@pytest.mark.slow  # the opt-in fused rebuild (make test keeps the default exact one)
@pytest.mark.parametrize("executor", ["fused", "fused_per_layer"])
def test_fused_rebuild_follows_backprop_depth12_adam(depth12, executor):
    """The fused rebuild (one vjp per half-residual): losses within 1e-7 relative of backprop over 5 Adam
    steps (the A-exact rule) and every parameter leaf within 1e-5."""
    std, rev = depth12["standard"], depth12[executor]
    np.testing.assert_allclose(rev["losses"], std["losses"], rtol=1e-7)
    rel, leaf = worst_leaf(std["params"], rev["params"])
    assert rel <= 1e-5, f"leaf {leaf}: fused reversible and standard differ by {rel:.2e} after {STEPS} Adam steps"


@pytest.mark.slow  # the opt-in fused rebuild (make test keeps the default exact one)
def test_fused_scan_and_per_layer_executors_are_bitwise_identical(depth12):
    """The fused rebuild: parameters and Adam state of the two executors, identical bits."""
    a, b = depth12["fused"], depth12["fused_per_layer"]
    for (path, x), y in zip(tree_flatten_with_path((a["params"], a["opt_state"]))[0],
                            jax.tree.leaves((b["params"], b["opt_state"]))):
        assert np.array_equal(x, y), keystr(path)


@pytest.mark.slow  # the opt-in fused rebuild (make test keeps the default exact one)
def test_fused_rebuild_rebuilds_every_block_input_exactly(depth12):
    """Near initialisation the fused rebuild's primal outputs F(x2), G(y1) equal the forward's to the bit,
    so every rebuilt block input equals the forward's input (12 blocks, dropout 0.1, 5 steps of training)."""
    rebuilds = depth12["fused_per_layer"]["rebuilds"]
    assert len(rebuilds) == STEPS
    for step, (forward, rebuilt) in enumerate(rebuilds):
        assert len(forward) == len(rebuilt) == 12
        for i, (x, r) in enumerate(zip(forward, rebuilt)):
            for s in range(2):
                assert np.array_equal(x[s], r[s]), (f"step {step}, block {i}, stream {s}: "
                                                    f"{np.mean(x[s] != r[s]):.2%} of the elements differ")


@pytest.mark.parametrize("grid_bits", [20, pytest.param(None, marks=pytest.mark.slow)])
def test_block_inverse_rebuilds_its_inputs(text_batches, grid_bits):
    """layer.apply then layer.inverse with the same per-example keys gives the inputs back (within 1e-5;
    exactly with the coupling grid), also when F and G outputs are a sizeable fraction of the streams."""
    batch = text_batches(BATCH, 1)[0]
    model = ReversibleTransformerLM(SEQ, num_layers=2, d_model=64, dropout_rate=0.1, grid_bits=grid_bits)
    embed, block = model.layers[0], model.layers[1]
    x, _ = embed.apply(embed.init_params, embed.init_state, batch["inputs"], _block_keys(0, 0, 0, BATCH), True)
    # Scale the output projections up 10x: F and G outputs become ~0.2 and ~0.8 (streams ~1), far more than
    # at initialisation (~0.02), which makes the plain float rebuild lose more bits.
    params = jax.tree.map(lambda p: p, block.init_params)
    params["f"]["out"]["kernel"] = params["f"]["out"]["kernel"] * 10
    params["g"]["down"]["kernel"] = params["g"]["down"]["kernel"] * 10
    keys = _block_keys(0, 0, 1, BATCH)
    with jax.default_matmul_precision("highest"):
        y, _ = jax.jit(lambda p, x, k: block.apply(p, block.init_state, x, k, True))(params, x, keys)
        rebuilt = jax.jit(lambda p, y, k: block.inverse(p, block.init_state, y, k))(params, y, keys)
        f_out = block.merge(params, block.init_state).f(x[1], keys=split_keys(keys, 0), train=True)
    assert np.abs(np.asarray(f_out)).mean() > 0.1 * np.abs(np.asarray(x[1])).mean()  # F is not negligible
    for s in range(2):
        a, b = np.asarray(x[s]), np.asarray(rebuilt[s])
        rel = np.abs(a - b).max() / np.abs(a).max()
        assert rel <= 1e-5, f"stream {s}: rebuilt inputs off by {rel:.1e}"
        if grid_bits is not None:
            assert np.array_equal(a, b), f"stream {s}: {np.mean(a != b):.1%} of the elements are not exact"


def _small_model():
    return ReversibleTransformerLM(SEQ, num_layers=3, d_model=32, num_heads=2, dropout_rate=0.1)


@pytest.mark.slow  # make test-all (make test: test_parallel's executors, scanned with offload, on 4 devices)
def test_offload_and_executors_are_bitwise_identical(text_batches):
    """Per layer or scanned, with or without offload: the same bits (params and optimizer state), and the
    same evaluation; with offload the state stays in pageable host memory between steps and runs per layer
    whatever ``scan_layers`` says."""
    batches = text_batches(BATCH, 3)
    mesh = _mesh()
    results = {}
    for scan in (False, True):
        for offload in (False, True):
            trainer = ReversibleTrainer(_small_model(), optax.adam(1e-3), mesh, seed=0, offload=offload,
                                        scan_layers=scan)
            ts = trainer.init()
            for batch in batches:
                ts, metrics = trainer.train_step(ts, global_batch(batch, mesh))
            assert (ts.stacked is not None) == (scan and not offload)
            if offload:
                for x in jax.tree.leaves((ts.params, ts.opt_state)):
                    assert x.sharding.memory_kind == PAGEABLE_MEMORY
            evaluation = {k: float(v) for k, v in trainer.eval_step(ts, global_batch(batches[0], mesh)).items()}
            results[scan, offload] = (jax.tree.map(np.asarray, (ts.params, ts.opt_state)), float(metrics["loss"]),
                                      evaluation)
    a, loss_a, eval_a = results[False, False]
    for key, (b, loss_b, eval_b) in results.items():
        assert loss_a == loss_b and eval_a == eval_b, key
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert np.array_equal(x, y), key


@pytest.mark.slow  # make test: test_streaming's schedule (each put two programs ahead) and its layer-by-layer step
def test_offload_keeps_at_most_three_layers_on_device(text_batches):
    """The per-layer executor with offload streams (`revtrain.streaming`): every program gets its layer's
    weights and optimizer state on the device (fetched ahead by the engine) and between steps everything is
    in pageable host memory. The memory meter then finds at least one layer's weights + optimizer state on
    the device (the one a program computes with) and, against the same step without offload, all but at most
    three layers' of them gone (the one computing, the one fetched ahead, the one being written back)."""
    batches = [global_batch(b, _mesh()) for b in text_batches(BATCH, 3)]
    peaks, layers = {}, None
    for offload in (False, True):
        trainer = ReversibleTrainer(_small_model(), optax.adam(1e-3), _mesh(), seed=0, offload=offload,
                                    scan_layers=False)
        ts = trainer.init()
        layers = [sum(x.nbytes for x in jax.tree.leaves((p, o))) for p, o in zip(ts.params, ts.opt_state)]
        fn, calls = trainer.programs.per_layer, []

        def tracked_fn(kind, layer, fn=fn, offload=offload, calls=calls):
            compiled = fn(kind, layer)
            weights = LayerPrograms._PER_LAYER[kind][4]  # the positions of weights (+ optimizer state)

            def call(*args):
                kinds = {x.sharding.memory_kind for i in weights for x in jax.tree.leaves(args[i])}
                assert kinds == {DEVICE_MEMORY}, (kind, kinds)
                calls.append(kind)
                return compiled(*args)
            return call

        trainer.programs.per_layer = tracked_fn
        ts, _ = trainer.train_step(ts, batches[0])
        trainer.meter = MemoryMeter()
        trainer.meter.start()
        ts, _ = trainer.train_step(ts, batches[1])
        peaks[offload] = trainer.meter.stop()
        ts, _ = trainer.train_step(ts, batches[2])
        assert len(calls) == 3 * (2 * len(layers) - 1), calls  # each layer's forward and backward (the head: one)
        want = PAGEABLE_MEMORY if offload else DEVICE_MEMORY
        assert {x.sharding.memory_kind for x in jax.tree.leaves((ts.params, ts.opt_state))} == {want}
    largest = sorted(layers, reverse=True)
    assert peaks[True] >= largest[0], (peaks, largest[0])
    assert peaks[False] - peaks[True] >= sum(layers) - sum(largest[:3]), (peaks, layers)


def test_coupled_optimizer_runs_deferred():
    """clip_by_global_norm couples layers: the trainer accepts it and applies it after the backward
    (tests/test_recipe.py checks it against backprop)."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    trainer = ReversibleTrainer(_small_model(), tx, _mesh())
    assert trainer.deferred and trainer.layerwise.rounds == 1


@pytest.mark.parametrize("make", [optax.adam, optax.adamw, optax.sgd, optax.adafactor, optax.lamb])
def test_per_leaf_optimizers_keep_the_fused_update(make):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=2, decay_steps=10)
    assert LayerwiseUpdate(make(schedule), _small_model().init()[0]).separable
    assert not ReversibleTrainer(_small_model(), make(schedule), _mesh()).deferred


def _default_model():
    """The default run's model (configs/enwik_modern.gin) at depth 2, d_model 32: its token embedding is a
    layer with a single leaf."""
    import pathlib

    import gin

    import revtrain.registry  # noqa: F401
    from revtrain.models.compose import ComposedModel
    gin.clear_config()
    gin.add_config_file_search_path(str(pathlib.Path(__file__).resolve().parent.parent / "configs"))
    gin.parse_config_files_and_bindings(["enwik_modern.gin"], ["NUM_LAYERS = 2", "D_MODEL = 32"])
    try:
        return ComposedModel(seed=0, d_model=32, input_key="inputs", sequence_length=SEQ)
    finally:
        gin.clear_config()


def _llama_model():
    """`LlamaModel` (configs/llama_small.gin's model) from scratch at a tiny size: standard blocks, its
    token embedding a layer with a single leaf."""
    from revtrain.models.llama import LlamaModel
    return LlamaModel(None, sequence_length=SEQ, vocab_size=256, d_model=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, d_ff=48)


def _clip_adamw():
    return optax.chain(optax.clip_by_global_norm(0.3), optax.adamw(3e-3, weight_decay=0.01))


_BITWISE_CASES = {
    "default_adamw": (_default_model, lambda: optax.adamw(1e-3, weight_decay=0.01), {}),
    "default_clip": (_default_model, _clip_adamw, {}),
    "default_microbatches": (_default_model, lambda: optax.adamw(3e-3, weight_decay=0.01), {"microbatches": 2}),
    "default_clip_microbatches": (_default_model, _clip_adamw, {"microbatches": 2}),
    "default_per_layer": (_default_model, lambda: optax.adamw(1e-3, weight_decay=0.01), {"scan_layers": False}),
    "llama_adamw": (_llama_model, lambda: optax.adamw(1e-3, weight_decay=0.01), {}),
    "llama_clip": (_llama_model, _clip_adamw, {}),
}
# A case whose StandardTrainer run is another's (only the reversible trainer's executor differs): trained once.
_SAME_STANDARD = {"default_per_layer": "default_adamw"}


@pytest.fixture(scope="module")
def standard_runs():
    """``{case: (losses, params)}``: the StandardTrainer runs of `_BITWISE_CASES` trained so far in this module."""
    return {}


# default_clip_microbatches covers clip and microbatches together in make test, llama_adamw the Llama; each alone
# and the Llama clipped in the slow tier
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("default_clip", "default_microbatches",
                                                                                   "llama_clip")
                                  else c for c in _BITWISE_CASES])
def test_default_and_llama_models_are_bitwise_backprop(text_batches, standard_runs, case):
    """The default run's model and the Llama model, 10 steps: losses and every parameter leaf of
    ReversibleTrainer equal StandardTrainer's bit for bit, with AdamW, a clipped chain (the deferred update),
    2 microbatches, and both (the quotients by the batch's weight fenced before the clip divides them). Both token embeddings are layers with a single leaf, whose per-layer update once
    compiled to a reciprocal multiply where the whole-model update divides (`layerwise.fence`)."""
    make_model, make_tx, kwargs = _BITWISE_CASES[case]
    model, mesh, batches, runs = make_model(), _mesh(), text_batches(BATCH, 10), {}
    with jax.default_matmul_precision("highest"):
        for name, cls in [("standard", StandardTrainer), ("reversible", ReversibleTrainer)]:
            if cls is StandardTrainer and _SAME_STANDARD.get(case) in standard_runs:
                runs[name] = standard_runs[_SAME_STANDARD[case]]
                continue
            extra = kwargs if cls is ReversibleTrainer else {k: v for k, v in kwargs.items() if k == "microbatches"}
            trainer = cls(model, make_tx(), mesh, seed=0, **extra)
            ts, losses = trainer.init(), []
            for batch in batches:
                ts, metrics = trainer.train_step(ts, global_batch(batch, mesh))
                losses.append(float(metrics["loss"]))
            runs[name] = (losses, jax.tree.map(np.asarray, ts.per_layer().params))
    standard_runs.setdefault(case, runs["standard"])
    (std_losses, std), (rev_losses, rev) = runs["standard"], runs["reversible"]
    assert len(jax.tree.leaves(std[0])) == 1  # the single-leaf embedding layer
    assert std_losses[-1] < std_losses[0]  # it trains
    assert rev_losses == std_losses
    for (path, a), b in zip(tree_flatten_with_path(std)[0], jax.tree.leaves(rev)):
        assert np.array_equal(a, b), f"{keystr(path)}: {int((a != b).sum())} of {a.size} elements differ"


_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10)
_SINGLE_LEAF_TXS = {
    **{make.__name__: (lambda make=make: make(_SCHEDULE))
       for make in (optax.adam, optax.sgd, optax.adafactor, optax.lamb, optax.lion)},
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),  # the update inside a cond
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.01),
    "masked_adamw": lambda: optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
}


@pytest.mark.parametrize("name", list(_SINGLE_LEAF_TXS))
def test_single_leaf_layer_update_is_the_whole_models(name):
    """One layer's fused update of a single-leaf layer, compiled alone, equals that leaf's part of the
    whole-model update (other layers beside it) bit for bit: separable optimizers with a schedule, an
    update inside a ``cond``, injected hyperparameters, a weight-decay mask; four steps of gradients of
    varied scale."""
    from revtrain.trainers.layerwise import guarded_update
    tx = _SINGLE_LEAF_TXS[name]()
    rng = np.random.default_rng(0)
    params = [{"e": rng.normal(size=(64, 16)).astype(np.float32)},
              {"w": rng.normal(size=(16, 16)).astype(np.float32), "b": rng.normal(size=16).astype(np.float32)}]
    alone = jax.jit(lambda g, o, p: guarded_update(tx, g, o, p)[:2])
    whole = jax.jit(lambda g, o, p: guarded_update(tx, g, o, p)[:2])
    p_alone, o_alone, p_whole, o_whole = params[0], tx.init(params[0]), params, tx.init(params)
    for step in range(4):
        grads = [jax.tree.map(lambda x: (rng.normal(size=x.shape) * 10.0 ** (step - 2)).astype(np.float32), p)
                 for p in params]
        p_alone, o_alone = alone(grads[0], o_alone, p_alone)
        p_whole, o_whole = whole(grads, o_whole, p_whole)
        assert np.array_equal(np.asarray(p_alone["e"]), np.asarray(p_whole[0]["e"])), step


def test_fenced_update_inside_shard_map_keeps_replication():
    """The fenced update inside ``shard_map`` with a split leaf (``shard_state``'s layout: the embedding
    split over ``"data"``, a bias and Adam's count replicated): ``shard_map`` accepts the replicated
    outputs (the flag, the bias, the count: ``out_specs`` ``P()``), and the values equal the same update
    outside ``shard_map`` bit for bit (a one-device mesh types values as varying just as N devices do)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from revtrain.trainers.layerwise import guarded_update
    tx, mesh, rng = optax.adam(_SCHEDULE), _mesh(), np.random.default_rng(0)
    params = {"e": rng.normal(size=(64, 16)).astype(np.float32), "b": rng.normal(size=16).astype(np.float32)}
    spec = {"e": P("data"), "b": P()}
    opt_spec = (optax.ScaleByAdamState(P(), spec, spec), optax.ScaleByScheduleState(P()))
    put = lambda tree, specs: jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)  # noqa: E731
    step = lambda g, o, p: guarded_update(tx, g, o, p, across="data")  # noqa: E731
    mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, opt_spec, spec),
                                   out_specs=(spec, opt_spec, P())))
    alone = jax.jit(lambda g, o, p: guarded_update(tx, g, o, p))
    p_map, o_map = put(params, spec), put(tx.init(params), opt_spec)
    p_alone, o_alone = params, tx.init(params)
    for k in range(3):
        grads = jax.tree.map(lambda x: (rng.normal(size=x.shape) * 10.0 ** (k - 1)).astype(np.float32), params)
        p_map, o_map, finite = mapped(put(grads, spec), o_map, p_map)
        p_alone, o_alone, _ = alone(grads, o_alone, p_alone)
        assert bool(finite)
        for a, b in zip(jax.tree.leaves((p_map, o_map)), jax.tree.leaves((p_alone, o_alone))):
            assert np.array_equal(np.asarray(a), np.asarray(b)), k
