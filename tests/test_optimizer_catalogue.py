"""optax's whole catalogue (revtrain/registry.py's `OPTAX_CATALOGUE`, found by introspection) through both
trainers and every tier (issue 60): each optimizer and wrapper with its default hyperparameters (a learning rate
where one is required; wrappers around AdamW; a transformation without a learning rate scaled by -1e-3), 3 steps
of StandardTrainer and of ReversibleTrainer in device memory, in host memory (``offload=True``) and on disk
(``offload='disk'``): the losses and every parameter leaf bit for bit, or ReversibleTrainer's one-line refusal
(an `InputError`: `CoupledUpdateError` and the like). A handful of representative optimizers run in make test,
the whole catalogue in make test-all (``slow``)."""

import functools
import inspect
import warnings

import gin
import jax
import numpy as np
import optax
import pytest

from revtrain import registry
from revtrain.errors import InputError
from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh
from revtrain.trainers.reversible import ReversibleTrainer
from revtrain.trainers.standard import StandardTrainer

T, STEPS, LR = 128, 3, 1e-3

# Values for required arguments other than the learning rate and an inner optimizer (the catalogue's
# wrappers' counts); any other required argument means the name is not an optimizer with defaults.
REQUIRED = {"max_consecutive_errors": 2, "every_k_schedule": 2, "k": 2}

# The representative optimizer run in make test (through four trainers, so one): an update that reads the step's
# loss (``value``: the Polyak step size divides it by the gradient's squared norm, a global round on every tier).
# A global predicate over per-layer arithmetic: test_layerwise (apply_if_finite, MultiSteps); a typed PRNG key in
# the state: test_a_key_in_the_state_is_checkpointed_and_resumed; a state that holds the parameters' own arrays
# (copied at init, never donated twice: ``optax.contrib.mechanize``, ``prodigy``, ...) and the rest in make test-all.
REPRESENTATIVE = ("optax.polyak_sgd",)

# The documented refusals (docs/recipe.md, "Refused"): name -> reason. A refusal of any other
# name fails its case.
REFUSED: dict = {
    "optax.lbfgs": ("its zoom line search needs the keyword arguments value, grad and value_fn: the whole model's "
                    "loss evaluated at other parameters, several times a step (both trainers refuse it)"),
    "optax.contrib.scale_by_muon": ("optax's own update fails on a list of layers with its default "
                                    "weight_dimension_numbers (None): a pytree structure error in both trainers, "
                                    "refused in one line (optax.contrib.muon, which brings its own, trains)"),
}

# Cases known not to train bit for bit, name -> what happens, each xfail(strict=True) (a fixed one fails as XPASS,
# so the list cannot outlive its fixes). Empty since the whole catalogue's run of 2026-12-06 (JAX 0.10.2, optax
# 0.2.8: every name bit for bit on every tier, or refused; docs/recipe.md).
KNOWN_FAILURES: dict = {}


def _cases(names):
    return [pytest.param(q, marks=pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[q]))
            if q in KNOWN_FAILURES else q for q in names]


def _inner():
    return optax.adamw(LR)


def build(qualified: str):
    """The optimizer ``qualified`` names (its gin configurable called with its defaults), or None when the name
    is not an optimizer that default hyperparameters make (a loss, a schedule, a transformation with a required
    setting). Returns ``(optimizer, kind)``, kind ``"optimizer"``, ``"wrapper"`` or ``"transformation"``."""
    fn = gin.get_configurable(qualified)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kwargs, kind, has_lr = {}, "optimizer", False
    for p in params:
        has_lr |= p.name == "learning_rate"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.name == "learning_rate":
            kwargs[p.name] = LR
        elif "GradientTransformation" in str(p.annotation):
            kwargs[p.name], kind = _inner(), "wrapper"
        elif p.name in REQUIRED:
            kwargs[p.name] = REQUIRED[p.name]
        else:
            return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tx = fn(**kwargs)
    except Exception:  # noqa: BLE001  (not constructible from defaults: not a catalogue case)
        return None
    if not isinstance(tx, optax.GradientTransformation):
        return None
    if kind == "optimizer" and not has_lr:
        kind = "transformation"
        tx = optax.chain(tx, optax.scale(-LR))  # a direction alone: scaled as a learning rate would
    return tx, kind


@functools.cache
def catalogue() -> dict:
    """Every catalogue name `build` makes an optimizer of: ``{qualified name: kind}``."""
    out = {}
    for qualified in registry.OPTAX_CATALOGUE:
        made = build(qualified)
        if made is not None:
            out[qualified] = made[1]
    return out


def _bits(tree):
    """Every leaf's bytes (NaN payloads and signed zeros included: bit for bit)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _run(qualified, batches, trainer_cls, tx=None, hook=None, **kwargs):
    """A step of ``trainer_cls`` with the optimizer ``qualified`` names (or ``tx``) per batch (the tiny model of
    tests/test_optim.py; ``hook(trainer)`` called once it is made): ``(each loss's bytes, each layer's parameter
    bytes)``."""
    tx = tx if tx is not None else build(qualified)[0]
    mesh = make_mesh(jax.devices()[:1])
    model = ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0)
    with jax.default_matmul_precision("highest"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model, tx, mesh, seed=0, **kwargs)
        if hook is not None:
            hook(trainer)
        ts, losses = trainer.init(), []
        for batch in batches:
            ts, m = trainer.train_step(ts, global_batch(batch, mesh))
            losses.append(np.asarray(m["loss"]).tobytes())
        params = [_bits(trainer.layer_params(ts, i)) for i in range(len(model.layers))]
    return losses, params


def _line(e: Exception) -> str:
    """The one line an `InputError` says (gin adds "  In call to configurable ..." lines to an error raised inside
    a configurable's call; the CLI prints the first line); fails unless it is exactly one line."""
    lines = [x for x in str(e).splitlines() if not x.startswith("  In call to configurable")]
    assert len(lines) == 1 and lines[0], f"not a one-line refusal: {str(e)!r}"
    return lines[0]


def check(qualified, batches, tmp_path) -> str:
    """Runs ``qualified`` through both trainers on every tier; asserts each reversible run equals
    StandardTrainer bit for bit, or that ReversibleTrainer refuses it in one line and it is one of `REFUSED`.
    Returns ``"exact"`` or ``"refused: <line>"``."""
    try:
        want = _run(qualified, batches, StandardTrainer)
    except InputError as e:  # (an optimizer neither trainer can run: ReversibleTrainer must refuse it alike)
        with pytest.raises(InputError) as refused:
            _run(qualified, batches, ReversibleTrainer)
        line = _line(e)
        assert _line(refused.value) == line, (line, _line(refused.value))
        assert qualified in REFUSED, f"{qualified} is refused by StandardTrainer, and not in REFUSED: {line}"
        return f"refused: {line}"
    tiers = {"device": {}, "host": {"offload": True},
             "disk": {"offload": "disk", "offload_dir": str(tmp_path / "tier")}}
    for tier, kwargs in tiers.items():
        try:
            got = _run(qualified, batches, ReversibleTrainer, **kwargs)
        except InputError as e:
            line = _line(e)
            assert qualified in REFUSED, f"{qualified} ({tier}) is refused, and not in REFUSED: {line}"
            return f"refused: {line}"
        assert got[0] == want[0], f"{qualified} ({tier}): losses differ from StandardTrainer's"
        for i, (a, b) in enumerate(zip(got[1], want[1])):
            assert a == b, f"{qualified} ({tier}): layer {i}'s parameters differ from StandardTrainer's"
    assert qualified not in REFUSED, f"{qualified} trains bit for bit on every tier: REFUSED must not list it"
    return "exact"


def test_catalogue_is_optax_itself():
    """The registered catalogue is optax's public names (introspected, not a list): the optimizers the issue
    names are there, each wrapper builds around AdamW, and the representative ones are in it."""
    names = catalogue()
    for q in ("optax.adamw", "optax.noisy_sgd", "optax.radam", "optax.adan", "optax.lars", "optax.novograd",
              "optax.sign_sgd", "optax.contrib.muon", "optax.contrib.prodigy", "optax.contrib.schedule_free_adamw"):
        assert names.get(q) == "optimizer", q
    for q in ("optax.apply_if_finite", "optax.MultiSteps", "optax.contrib.mechanize"):
        assert names.get(q) == "wrapper", q
    assert set(REPRESENTATIVE) <= set(names)
    assert "optax.chain" in registry.OPTAX_CATALOGUE and "optax.ScaleByAdamState" not in registry.OPTAX_CATALOGUE


def test_gin_builds_what_optax_builds():
    """Bindings written as optax's Python: ``MultiSteps`` gives its gradient transformation (a MultiStepsState
    around AdamW's), ``named_chain`` and ``chain`` take their transformations as one list, a contrib optimizer
    and a wrapper by their own names; an unknown optax name is one line saying so, with a close optax name
    only; a class of settings (``MuonDimensionNumbers``) is nameable."""
    from revtrain.errors import UsageError
    params = {"w": np.ones((4, 4), np.float32)}
    try:
        registry.parse_gin([], [
            "optax.MultiSteps.opt = @optax.adamw()", "optax.MultiSteps.every_k_schedule = 2",
            "optax.adamw.learning_rate = 0.1", "optax.contrib.muon.learning_rate = 0.1",
            "optax.named_chain.transforms = [('clip', @optax.clip_by_global_norm()), ('muon', @optax.contrib.muon())]",
            "optax.clip_by_global_norm.max_norm = 1.0", "optax.apply_if_finite.inner = @optax.sgd()",
            "optax.apply_if_finite.max_consecutive_errors = 3", "optax.sgd.learning_rate = 0.1",
            "optax.chain.transforms = [@optax.apply_if_finite(), @optax.noisy_sgd()]", "optax.noisy_sgd.learning_rate = 0.1",
            "optax.contrib.MuonDimensionNumbers.reduction_axis = 1"])
        multi = gin.get_configurable("optax.MultiSteps")()
        assert isinstance(multi, optax.GradientTransformation)
        assert type(multi.init(params)).__name__ == "MultiStepsState"
        named = gin.get_configurable("optax.named_chain")().init(params)
        assert list(named) == ["clip", "muon"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            chained = gin.get_configurable("optax.chain")().init(params)
        assert type(chained[0]).__name__ == "ApplyIfFiniteState" and type(chained[1][0]).__name__ == "AddNoiseState"
        assert gin.get_configurable("optax.contrib.MuonDimensionNumbers")().reduction_axis == 1
    finally:
        gin.clear_config()
    for binding, line in [
            ("train.optimizer = @optax.contrib.prodigi()", "'optax.contrib.prodigi' is not an optax name (of optax "
             f"{optax.__version__}) (did you mean 'optax.contrib.prodigy'?)"),
            ("train.optimizer = @optax.contrib.nothing_like_it", f"'optax.contrib.nothing_like_it' is not an optax name "
             f"(of optax {optax.__version__})")]:
        with pytest.raises(UsageError) as e:
            registry.parse_gin([], [binding])
        assert str(e.value) == f"bad gin configuration: {line}"
    gin.clear_config()


@pytest.mark.parametrize("qualified", _cases(REPRESENTATIVE))
def test_representative_optimizers(qualified, text_batches, tmp_path):
    check(qualified, text_batches(8, STEPS), tmp_path)


def test_sophia_layer_by_layer_is_the_whole_models(text_batches):
    """``optax.contrib.sophia`` reading its Hessian-vector product every second step (``update_interval=2``): the
    products ReversibleTrainer computes layer by layer (revtrain/trainers/hessian.py: the jvp of each layer's vjp)
    give StandardTrainer's losses and parameters (the whole model's ``jvp(grad)``) bit for bit, and are computed
    on the steps that read them only (2 of 3); StandardTrainer's zeros between them are placed as its products
    (one step program, not two). The device tier here; the whole catalogue runs ``sophia`` and the
    bare estimator on every tier."""
    batches = text_batches(8, 3)
    tx = optax.contrib.sophia(LR, update_interval=2)
    passes, placed = [], []

    def count(trainer):
        products = trainer.products.products
        trainer.products.products = lambda *a, **k: (passes.append(1), products(*a, **k))[1]

    def placement(trainer):
        hessian = trainer._hessian
        trainer._hessian = lambda *a: (placed.append(jax.tree.map(lambda x: x.sharding, h := hessian(*a))), h)[1]

    want = _run(None, batches, StandardTrainer, tx=tx, hook=placement)
    assert _run(None, batches, ReversibleTrainer, tx=tx, hook=count) == want
    assert len(passes) == 2
    # StandardTrainer's step reads the products and the zeros between them placed alike: one program, not two
    assert len(placed) == 3 and placed[1] == placed[0] == placed[2]
    assert len(set(want[0])) == 3  # (the loss moved)


def _whole():
    try:
        return [q for q in catalogue() if q not in REPRESENTATIVE]
    except Exception:  # noqa: BLE001  (collection must not fail; the catalogue test above reports it)
        return []


@pytest.mark.slow
@pytest.mark.parametrize("qualified", _cases(_whole()))
def test_whole_catalogue(qualified, text_batches, tmp_path):
    check(qualified, text_batches(8, STEPS), tmp_path)


@pytest.mark.slow  # make test-all (make test: the changed-config line of a resume, test_reliability)
def test_resume_with_another_optimizer(tmp_path, byte_lm_data_dir, capfd):
    """A finished AdamW run resumed with NAdamW (the same state's structure) continues, and the changed-config
    line says that it matters: NAdamW trains on with its own weight decay (its default 0.0001, not AdamW's 0.01); resumed with
    SGD (another state) it is refused in one line naming both optimizers; an unknown optax name is one line
    saying so."""
    from helpers import revtrain_here
    from test_optim import TINY
    workdir = tmp_path / "run"
    assert revtrain_here(capfd, "train", *TINY, "--gin", "STEPS = 2", "--workdir", workdir).returncode == 0
    got = revtrain_here(capfd, "train", *TINY, "--gin", "STEPS = 3", "--workdir", workdir,
                        "--gin", "train.optimizer = @optax.nadamw")
    assert got.returncode == 0, got.stderr
    line = next(x for x in got.stderr.splitlines() if "changed since the saved config.gin" in x)
    assert "train.optimizer @optax.adamw -> @optax.nadamw" in line
    assert line.endswith("-- it matters: the optimizer changed (@optax.adamw -> @optax.nadamw) and trains on with "
                         "its own values of @optax.adamw's settings: nesterov False -> True, weight_decay 0.01 -> "
                         "0.0001"), line
    got = revtrain_here(capfd, "train", *TINY, "--gin", "STEPS = 4", "--workdir", workdir,
                        "--gin", "train.optimizer = @optax.sgd")
    assert got.returncode == 2
    assert ("was made with a different optimizer (@optax.nadamw; this run's is @optax.sgd); resume with the same "
            "config or start a new --workdir") in got.stderr, got.stderr
    got = revtrain_here(capfd, "train", *TINY, "--workdir", tmp_path / "other",
                        "--gin", "train.optimizer = @optax.contrib.prodigi()")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines()[-1].endswith(
        "'optax.contrib.prodigi' is not an optax name (of optax " + optax.__version__
        + ") (did you mean 'optax.contrib.prodigy'?)"), got.stderr


@pytest.mark.slow  # noisy_sgd and dog also run in the whole catalogue
def test_values_of_the_whole_tree_are_the_whole_models(text_batches):
    """Two optimizers whose layers must see values of the whole tree: ``optax.noisy_sgd`` splits its key over every
    leaf of the model (a layer's own update would split it over its own), so its layers run their slices of the
    whole update (not separable: the deferred update) and a step equals StandardTrainer's bit for bit;
    ``optax.contrib.dog`` starts ``max_dist`` from the norm of every parameter, so each layer's initial state is its
    part of the whole model's init (`optstate.LayerInit`), bit for bit StandardTrainer's (its steps: KNOWN_FAILURES).
    AdamW keeps the fused per-layer update and each layer's own init."""
    from revtrain.optstate import LayerInit
    mesh = make_mesh(jax.devices()[:1])
    model = ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        noisy = ReversibleTrainer(model, optax.noisy_sgd(1e-2), mesh, seed=0)
        assert not noisy.layerwise.separable and noisy.layerwise.rounds == 0 and noisy.deferred
        assert _run("optax.noisy_sgd", text_batches(8, 1), ReversibleTrainer) == \
            _run("optax.noisy_sgd", text_batches(8, 1), StandardTrainer)
    dog = optax.contrib.dog()
    whole = StandardTrainer(model, dog, mesh, seed=0).init().per_layer().opt_state[0]
    per = ReversibleTrainer(model, dog, mesh, seed=0).init().per_layer().opt_state
    scalars = [np.asarray(x).tobytes() for x in jax.tree.leaves(whole) if np.ndim(x) == 0]
    own = [np.asarray(x).tobytes() for x in jax.tree.leaves(dog.init(model.init()[0][0])) if np.ndim(x) == 0]
    assert own[1] != scalars[1]  # (max_dist: a layer's own init takes its own norm)
    for state in per:
        assert [np.asarray(x).tobytes() for x in jax.tree.leaves(state) if np.ndim(x) == 0] == scalars
    trainer = ReversibleTrainer(model, optax.adamw(1e-3), mesh, seed=0)
    assert trainer.layerwise.separable and not trainer.deferred
    assert not LayerInit(trainer.tx, model.param_shapes()).needed


def test_an_update_that_needs_more_than_the_loss_is_refused_in_one_line(tmp_path, capsys):
    """An optimizer whose update needs more than the gradients, the step's loss and the Hessian-vector products of
    one Hutchinson estimator (``optax.lbfgs``' line search: ``value``, ``grad``, ``value_fn``; ``obj_fn`` read by
    two estimators) is refused when a trainer is made, by both trainers alike, in one line naming what it needs
    (the Python API: a `TrainerError`, an `InputError`); the CLI prints that line and exits 2 before anything is
    trained. One that needs only the loss (``value``: ``optax.contrib.momo``) or one estimator's products
    (``obj_fn``: ``optax.contrib.sophia``) is not refused."""
    from helpers import revtrain_here
    from test_optim import TINY
    from revtrain.trainers.common import TrainerError
    mesh = make_mesh(jax.devices()[:1])
    model = ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0)
    given = ("and revtrain's trainers give an update the gradients, the step's loss (value) and the Hessian-vector "
             "products of optax's Hutchinson estimator (obj_fn) only; choose an optimizer that needs no more "
             "(docs/recipe.md, \"Refused\")")
    two = optax.chain(optax.contrib.hutchinson_estimator_diag_hessian(),
                      optax.contrib.hutchinson_estimator_diag_hessian())
    for tx, line in [(optax.lbfgs(), "the optimizer cannot train in revtrain: its update (optax's "
                      "scale_by_zoom_linesearch) needs the keyword arguments value (the loss at the current "
                      "parameters), grad (its gradient), value_fn (a function that evaluates the loss at other "
                      f"parameters), {given}"),
                     (two, "the optimizer cannot train in revtrain: its update calls obj_fn (the loss as a function "
                      "of the parameters) from a transformation other than one "
                      "optax.contrib.hutchinson_estimator_diag_hessian, whose Hessian-vector products the trainers "
                      "compute on the tangents it draws (docs/recipe.md, \"Refused\")")]:
        lines = set()
        for cls in (StandardTrainer, ReversibleTrainer):
            with pytest.raises(TrainerError) as e:
                cls(model, tx, mesh, seed=0)
            lines.add(_line(e.value))
        assert lines == {line}, lines
    for cls in (StandardTrainer, ReversibleTrainer):
        assert cls(model, optax.contrib.momo(), mesh, seed=0).takes_value
        assert cls(model, optax.contrib.sophia(1e-3), mesh, seed=0).takes_hvp
    for trainer in ("StandardTrainer", "ReversibleTrainer"):
        got = revtrain_here(capsys, "train", *TINY, "--workdir", tmp_path / trainer, "--gin",
                            "train.optimizer = @optax.lbfgs", "--gin", f"train.trainer = @{trainer}")
        assert got.returncode == 2, got.stderr
        last = got.stderr.strip().splitlines()[-1]
        assert last.endswith("its update (optax's scale_by_zoom_linesearch) needs the keyword arguments value (the "
                             "loss at the current parameters), grad (its gradient), value_fn (a function that "
                             f"evaluates the loss at other parameters), {given}"), got.stderr
        assert "Traceback" not in got.stderr and not (tmp_path / trainer / "checkpoints").exists()


@pytest.mark.slow  # make test-all
def test_plan_names_the_optimizer(capsys):
    """``revtrain plan`` names the run's optimizer in its first line, and an Adafactor run is offered no
    "+ Adafactor" row (the choice it already is)."""
    from helpers import revtrain_here
    from test_optim import TINY
    result = revtrain_here(capsys, "plan", *TINY, "--gin", "train.optimizer = @optax.adafactor")
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()
    assert out[0].startswith("memory plan (ReversibleTrainer, optimizer @optax.adafactor, "), out[0]
    rows = [line.split("  ")[0] for line in out[2:]]
    assert "ReversibleTrainer + offload" in rows and not any("Adafactor" in r for r in rows), rows


@pytest.mark.parametrize("trainer_cls", [pytest.param(StandardTrainer, marks=pytest.mark.slow), ReversibleTrainer])
def test_schedule_free_evaluates_on_its_evaluation_weights(trainer_cls, text_batches):
    """A schedule-free run is evaluated (and sampled) on ``optax.contrib.schedule_free_eval_params``:
    `revtrain.schedule_free.evaluation_state` gives (y - (1 - b1) z) / b1 of every layer, from the whole-model
    state (StandardTrainer) or each layer's (ReversibleTrainer), and the evaluation differs from the training
    iterate's; an AdamW state is evaluated as it is."""
    from revtrain.schedule_free import evaluation_state
    mesh = make_mesh(jax.devices()[:1])
    model = ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0)
    batches = text_batches(8, 2)
    trainer = trainer_cls(model, optax.contrib.schedule_free_adamw(1e-2), mesh, seed=0)
    ts = trainer.init()
    for batch in batches:
        ts, _ = trainer.train_step(ts, global_batch(batch, mesh))
    ev = evaluation_state(trainer, ts)
    assert ev is not ts and ev.step == ts.step
    per = ts.per_layer()
    whole = trainer_cls is StandardTrainer  # (one ScheduleFreeState for the list of layers, else one a layer)
    for i, (p, e) in enumerate(zip(per.params, ev.params)):
        s = per.opt_state[0] if whole else per.opt_state[i]
        z, b1 = (s.z[i] if whole else s.z), float(np.asarray(s.b1))
        for y, zz, got in zip(jax.tree.leaves(p), jax.tree.leaves(z), jax.tree.leaves(e)):
            y, zz = np.asarray(y), np.asarray(zz)
            np.testing.assert_allclose(np.asarray(got), (y - (1.0 - b1) * zz) / b1, rtol=1e-5, atol=1e-7)
    batch = global_batch(batches[0], mesh)
    assert float(trainer.eval_step(ev, batch)["loss_sum"]) != float(trainer.eval_step(ts, batch)["loss_sum"])
    plain = StandardTrainer(model, optax.adamw(1e-3), mesh, seed=0)
    state = plain.init()
    assert evaluation_state(plain, state) is state


@pytest.mark.slow  # make test-all (a typed key in the state on every tier: noisy_sgd in the whole catalogue)
@pytest.mark.parametrize("trainer_cls, offload", [(StandardTrainer, None),
                                                   pytest.param(ReversibleTrainer, "disk", marks=pytest.mark.slow)])
def test_a_key_in_the_state_is_checkpointed_and_resumed(trainer_cls, offload, text_batches, tmp_path):
    """``optax.noisy_sgd`` keeps a typed PRNG key in its state: the trainers hold its key data, an Orbax
    checkpoint (and the disk tier's files) keep it, and a resumed step draws the same noise: 2 steps, a
    save, a restore into a new trainer, a third step: the third step's loss and every parameter as an
    uninterrupted run's, bit for bit."""
    from revtrain import checkpoint as ckpt_lib
    mesh = make_mesh(jax.devices()[:1])
    batches = text_batches(8, 3)

    def make(name):
        kwargs = {} if offload is None else {"offload": offload, "offload_dir": str(tmp_path / name)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (optax warns that noisy_sgd's default key will be required)
            return trainer_cls(ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0),
                               optax.noisy_sgd(1e-2), mesh, seed=0, **kwargs)

    def steps(trainer, ts, part):
        losses = []
        for batch in part:
            ts, m = trainer.train_step(ts, global_batch(batch, mesh))
            losses.append(float(m["loss"]))
        return ts, losses

    whole = make("whole")
    ts, want = steps(whole, whole.init(), batches)
    want_params = [_bits(whole.layer_params(ts, i)) for i in range(len(whole.model.layers))]
    first = make("first")
    ts, _ = steps(first, first.init(), batches[:2])
    if offload == "disk":  # (each layer's file holds its state: the key's data is a uint32 leaf of shape (2,))
        leaves = [(s, d) for ref in ts.per_layer().params for s, d in zip(ref.layout.shapes, ref.layout.dtypes)]
    else:
        leaves = [(np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves(ts.per_layer().opt_state)]
    assert ((2,), np.dtype(np.uint32)) in leaves, leaves  # (the key's data: threefry's 2 words)
    checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "run"))
    assert checkpointer.save(ts, None, {"x": 1})
    checkpointer.wait()
    again = make("again")
    restored = checkpointer.restore(again.abstract_state())
    checkpointer.close()
    ts, got = steps(again, restored, batches[2:])
    assert got == want[2:]
    assert [_bits(again.layer_params(ts, i)) for i in range(len(whole.model.layers))] == want_params


def test_a_ready_optimizer_without_its_learning_rate_says_how_to_bind_it():
    """``@optax.contrib.muon()`` (parentheses: a ready optimizer) with no learning rate of its own: the error line
    names both ways to give it one."""
    from revtrain import ginconfig
    try:
        gin.get_configurable("optax.contrib.muon")()
    except TypeError as e:
        line = ginconfig.call_error_line(e)
    assert "missing 1 required positional argument: 'learning_rate'" in line
    assert "muon.learning_rate = 1e-3) and train.learning_rate = None" in line
    assert "without parentheses" in line and "\n" not in line


_VALUE_RUN = """
import sys, warnings
sys.path.insert(0, {tests!r})
import jax, numpy as np, optax
from jax.tree_util import keystr, tree_flatten_with_path
from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh
from revtrain.trainers.reversible import ReversibleTrainer
from revtrain.trainers.standard import StandardTrainer
assert len(jax.devices()) == 2
mesh = make_mesh(jax.devices())
rng = np.random.RandomState(0)
batches = [{{k: rng.randint(0, 256, (8, {T})).astype(np.int32) for k in ("inputs", "targets")}} for _ in range(2)]
runs = {{}}
for name, cls, kwargs in [("standard", StandardTrainer, {{}}), ("device", ReversibleTrainer, {{}}),
                          ("host", ReversibleTrainer, {{"offload": True}})]:
    model = ReversibleTransformerLM({T}, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0)
    tx = optax.chain(optax.adamw(1e-3), optax.contrib.reduce_on_plateau())
    with jax.default_matmul_precision("highest"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model, tx, mesh, seed=0, microbatches=2, **kwargs)
        assert trainer.takes_value
        ts, losses, best = trainer.init(), [], []
        for batch in batches:
            ts, m = trainer.train_step(ts, global_batch(batch, mesh))
            losses.append(np.asarray(m["loss"]).tobytes())
            states = [trainer.residency.fetch(s) for s in ts.per_layer().opt_state]
            best.append({{np.asarray(x).tobytes() for p, x in tree_flatten_with_path(states)[0]
                         if "best_value" in keystr(p)}})
        params = [[np.asarray(x).tobytes() for x in jax.tree.leaves(trainer.layer_params(ts, i))] for i in range(2)]
    # the first step's loss, as logged, is the best value reduce_on_plateau has seen (in every layer's state)
    assert best[0] == {{losses[0]}}, (name, best[0], losses[0])
    assert len(best[1]) == 1 and best[1] <= {{losses[0], losses[1]}}, name
    runs[name] = (losses, params)
assert runs["device"] == runs["standard"] and runs["host"] == runs["standard"]
print("ok")
"""


@pytest.mark.slow
def test_the_step_loss_is_the_value_the_optimizer_reads():
    """An optimizer that reads the step's loss (``reduce_on_plateau`` after AdamW: it keeps the best loss in its
    state) gets the loss exactly as the trainer logs it, the mean over 2 microbatches and 2 devices: after the
    first step every layer's ``best_value`` is that step's logged loss, bit for bit, in StandardTrainer and in
    ReversibleTrainer (its deferred update) in device and host memory; the losses and parameters of both
    trainers are equal bit for bit."""
    import pathlib
    import subprocess
    import sys
    from helpers import env
    tests = str(pathlib.Path(__file__).resolve().parent)
    r = subprocess.run([sys.executable, "-c", _VALUE_RUN.format(tests=tests, T=T)], capture_output=True, text=True,
                       env=env(devices=2), timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


_SOPHIA_RUN = """
import sys, warnings
sys.path.insert(0, {tests!r})
import jax, numpy as np, optax
from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh
from revtrain.trainers.reversible import ReversibleTrainer
from revtrain.trainers.standard import StandardTrainer
assert len(jax.devices()) == 2
mesh = make_mesh(jax.devices())
rng = np.random.RandomState(0)
batches = [{{k: rng.randint(0, 256, (8, {T})).astype(np.int32) for k in ("inputs", "targets")}} for _ in range(3)]
runs = {{}}
for name, cls, kwargs in [("standard", StandardTrainer, {{}}), ("device", ReversibleTrainer, {{}}),
                          ("sharded", ReversibleTrainer, {{"shard_state": True}}),
                          ("host sharded", ReversibleTrainer, {{"offload": True, "shard_state": True}})]:
    model = ReversibleTransformerLM({T}, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.1)
    with jax.default_matmul_precision("highest"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model, optax.contrib.sophia(1e-3, update_interval=2), mesh, seed=0, **kwargs)
        ts, losses = trainer.init(), []
        for batch in batches:
            ts, m = trainer.train_step(ts, global_batch(batch, mesh))
            losses.append(np.asarray(m["loss"]).tobytes())
        params = [[np.asarray(x).tobytes() for x in jax.tree.leaves(trainer.layer_params(ts, i))] for i in range(4)]
    runs[name] = (losses, params)
assert all(run == runs["standard"] for run in runs.values()), [n for n, r in runs.items() if r != runs["standard"]]
print("ok")
"""


@pytest.mark.slow
def test_sophia_on_two_devices():
    """Sophia's Hessian-vector products on 2 devices with dropout (the masks of the step's own pass): each device's
    product summed as its gradient is, or reduce-scattered to its piece with ``shard_state`` (also in host
    memory); StandardTrainer's and ReversibleTrainer's losses and parameters bit for bit."""
    import pathlib
    import subprocess
    import sys
    from helpers import env
    tests = str(pathlib.Path(__file__).resolve().parent)
    r = subprocess.run([sys.executable, "-c", _SOPHIA_RUN.format(tests=tests, T=T)], capture_output=True, text=True,
                       env=env(devices=2), timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
