"""RevNet on Fashion-MNIST: the IDX/TFDS builder, the task, batch-norm state, and trainer exactness.

Builder and task tests run on small IDX files written here. Model tests use the real Fashion-MNIST images
of the Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``) and are skipped
when it is not installed. The 4-device checks run in one subprocess (``XLA_FLAGS`` must be set before JAX
is imported); this file is also that worker (``python tests/test_revnet.py OUT.json``).

Comparisons of parameters and statistics use, per leaf, max |difference| / max |value| (as
``tests/test_exactness.py``). Float32 with ``jax_default_matmul_precision="highest"``.
"""

import gzip
import json
import os
import pathlib
import sys

import numpy as np
import pytest

from helpers import REPO, revtrain, run_worker, train_steps, worst_leaf

CONFIG = str(REPO / "configs" / "revnet_fashion_mnist.gin")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
NUM_DEVICES = 4
BATCH, STEPS = 16, 3
TINY = dict(widths=(8, 16), blocks=(2, 1), depth=1, momentum=0.8)  # stem, 2 blocks, downsample, 1 block, head


# ------------------------------------------------------------------------------------------------
# Helpers shared by the tests and the 4-device worker.
# ------------------------------------------------------------------------------------------------
def _real_batches(count, batch_size=BATCH, seed=0):
    from revtrain.data.fashion_mnist import FashionMNISTTask
    it = FashionMNISTTask(DEBIAN_DIR).train_iterator(batch_size, seed, 0, 1)
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(count)]


def _train(trainer_cls, optimizer, batches, devices, offload=None, rebuild=None, **kwargs):
    """Runs ``len(batches)`` steps of the tiny RevNet (``kwargs`` to the trainer); returns (state, losses)."""
    import jax

    from revtrain.models.revnet import RevNet
    from revtrain.placement import make_mesh
    mesh = make_mesh(jax.devices()[:devices])
    if offload is not None:
        kwargs["offload"] = offload
    if rebuild is not None:
        kwargs["rebuild"] = rebuild
    trainer = trainer_cls(RevNet(10, seed=0, **TINY), optimizer, mesh, seed=0, **kwargs)
    ts, history = train_steps(trainer, batches, mesh)
    return ts, [h["loss"] for h in history]


# ------------------------------------------------------------------------------------------------
# The 4-device worker (a fresh interpreter with 4 CPU devices).
# ------------------------------------------------------------------------------------------------
def _worker(out_path: str) -> None:
    import jax
    import optax

    from revtrain.trainers import ReversibleTrainer, StandardTrainer

    jax.config.update("jax_default_matmul_precision", "highest")
    assert len(jax.devices()) == NUM_DEVICES, jax.devices()
    batches = _real_batches(STEPS)
    sgd = lambda: optax.sgd(0.05, momentum=0.9)  # noqa: E731
    runs = {
        "standard/1": _train(StandardTrainer, sgd(), batches, 1),
        "standard/4": _train(StandardTrainer, sgd(), batches, NUM_DEVICES),
        "reversible/4": _train(ReversibleTrainer, sgd(), batches, NUM_DEVICES),
        # The host tier streams one layer at a time: its device-memory twin is the per-layer executor.
        "reversible_layers/4": _train(ReversibleTrainer, sgd(), batches, NUM_DEVICES, scan_layers=False),
        "reversible_offload/4": _train(ReversibleTrainer, sgd(), batches, NUM_DEVICES, offload=True),
    }
    out = {"losses": {k: v[1] for k, v in runs.items()}, "compare": {}, "replicas_identical": {}}
    # (RevNet's scanned executor and per-layer one differ in the last bits: within the 1e-5 below.)
    for a, b in [("standard/1", "reversible/4"), ("standard/4", "reversible/4"), ("standard/1", "standard/4"),
                 ("reversible/4", "reversible_layers/4")]:
        for what in ("params", "layer_state"):
            out["compare"][f"{a}~{b}/{what}"] = worst_leaf(getattr(runs[a][0], what), getattr(runs[b][0], what))
    a, b = runs["reversible_layers/4"][0], runs["reversible_offload/4"][0]
    out["offload_bitwise"] = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                                 zip(jax.tree.leaves((a.params, a.opt_state, a.layer_state)),
                                     jax.tree.leaves((b.params, b.opt_state, b.layer_state))))
    for name in ("reversible/4", "reversible_offload/4"):
        ts = runs[name][0]
        # The arrays the trainer holds (a stacked run as it is: its per-layer view would be a fresh copy).
        params, _, layer_state = ts.held()
        held = (params, layer_state)
        out["replicas_identical"][name] = all(
            all(np.array_equal(np.asarray(s.data), np.asarray(leaf.addressable_shards[0].data))
                for s in leaf.addressable_shards)
            for leaf in jax.tree.leaves(held))
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


# ------------------------------------------------------------------------------------------------
# Small IDX files for the builder tests.
# ------------------------------------------------------------------------------------------------
def _idx_bytes(array: np.ndarray, magic: int) -> bytes:
    return np.array([magic, *array.shape], ">u4").tobytes() + array.astype(np.uint8).tobytes()


def _write_idx_dir(directory, counts, compress=True):
    """Writes the four Fashion-MNIST files with ``counts = {split: n}`` random images; returns the arrays."""
    from revtrain.data import fashion_mnist as fm
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, (images_name, labels_name, _) in fm.FILES.items():
        n = counts[split]
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        for name, array, magic in ((images_name, images, 2051), (labels_name, labels, 2049)):
            data = _idx_bytes(array, magic)
            if compress:
                (directory / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (directory / name).write_bytes(data)
        arrays[split] = (images, labels)
    return arrays


@pytest.fixture
def small_counts(monkeypatch):
    """Shrinks the expected split sizes to 40 train / 10 test images."""
    from revtrain.data import fashion_mnist as fm
    counts = {"train": 40, "test": 10}
    monkeypatch.setattr(fm, "FILES", {s: (*fm.FILES[s][:2], counts[s]) for s in fm.FILES})
    return counts


@pytest.mark.parametrize("compress", [True, False])
def test_builder_writes_array_record_in_file_order(tmp_path, small_counts, compress):
    from revtrain.data import fashion_mnist as fm
    arrays = _write_idx_dir(tmp_path / "src", small_counts, compress)
    builder = fm.load_fashion_mnist(str(tmp_path / "src"), str(tmp_path / "cache"))
    assert sorted(builder.info.splits) == ["test", "train"]
    assert list(pathlib.Path(builder.data_dir).glob("*.array_record*"))
    for split, (images, labels) in arrays.items():
        source = builder.as_data_source(split=split)
        assert len(source) == small_counts[split]
        records = [source[i] for i in range(len(source))]
        got_images = np.stack([r["image"] for r in records])
        assert got_images.dtype == np.uint8 and got_images.shape == (len(labels), 28, 28, 1)
        np.testing.assert_array_equal(got_images[..., 0], images)
        np.testing.assert_array_equal([r["label"] for r in records], labels)
    # Prepared once: a second load reads the cache (the source may even be gone).
    for f in (tmp_path / "src").iterdir():
        f.unlink()
    assert fm.load_fashion_mnist(str(tmp_path / "src"), str(tmp_path / "cache")).is_prepared()


def test_missing_source_is_a_one_line_data_error(tmp_path, small_counts):
    from revtrain.data import fashion_mnist as fm
    from revtrain.data.byte_lm import DataError
    with pytest.raises(DataError, match="does not exist") as e:
        fm.FashionMNISTTask(str(tmp_path / "nowhere"), data_dir=str(tmp_path / "cache"))
    assert "train-images-idx3-ubyte.gz" in str(e.value).splitlines()[0]  # (gin appends a line of its own)
    assert "apt-get install dataset-fashion-mnist" in fm.how_to_get(fm.DEBIAN_DIR)
    _write_idx_dir(tmp_path / "partial", small_counts)
    (tmp_path / "partial" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="lacks t10k-labels-idx1-ubyte"):
        fm.load_fashion_mnist(str(tmp_path / "partial"), str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").rglob("dataset_info.json"))  # nothing that looks prepared


def test_malformed_idx_files_are_data_errors(tmp_path):
    from revtrain.data import fashion_mnist as fm
    from revtrain.data.byte_lm import DataError
    good = _idx_bytes(np.zeros((3, 28, 28), np.uint8), 2051)
    cases = {"magic": _idx_bytes(np.zeros((3, 28, 28), np.uint8), 2049), "truncated": good[:-5],
             "count": _idx_bytes(np.zeros((4, 28, 28), np.uint8), 2051), "header": good[:6]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError):
            fm.read_idx(tmp_path / name, 3, 3)
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="corrupt"):
        fm.read_idx(tmp_path / "bad.gz", 3, 3)
    (tmp_path / "good").write_bytes(good)
    assert fm.read_idx(tmp_path / "good", 3, 3).shape == (3, 28, 28)


def test_task_batches_shards_eval_padding_and_resume(tmp_path, small_counts):
    from revtrain.data import fashion_mnist as fm
    arrays = _write_idx_dir(tmp_path / "src", small_counts)
    task = fm.FashionMNISTTask(str(tmp_path / "src"), data_dir=str(tmp_path / "cache"))
    assert task.model_kwargs() == {"num_classes": 10}
    it = task.train_iterator(8, 0, 0, 1)
    first = [next(it) for _ in range(5)]  # one epoch of 40
    assert first[0]["image"].shape == (8, 28, 28, 1) and first[0]["image"].dtype == np.float32
    assert first[0]["targets"].shape == (8,) and first[0]["targets"].dtype == np.int32
    images, labels = arrays["train"]
    expected = (images.astype(np.float32) / 255 - fm.PIXEL_MEAN) / fm.PIXEL_STD
    seen = np.concatenate([b["image"][..., 0] for b in first])
    order = [int(np.argmin(np.abs(expected - s).reshape(len(expected), -1).max(1))) for s in seen]
    assert sorted(order) == list(range(40))  # a permutation of the whole split per epoch
    np.testing.assert_allclose(seen, expected[order], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.concatenate([b["targets"] for b in first]), labels[order])
    # Checkpointable: restoring the state replays the same batches.
    state = it.get_state()
    after = [next(it)["targets"] for _ in range(3)]
    it2 = task.train_iterator(8, 0, 0, 1)
    it2.set_state(state)
    for a in after:
        np.testing.assert_array_equal(next(it2)["targets"], a)
    # Two processes see disjoint halves.
    shards = [next(task.train_iterator(4, 0, i, 2))["image"] for i in range(2)]
    assert not any(np.array_equal(a, b) for a in shards[0] for b in shards[1])
    # Evaluation: every test image once, in order, padded with weight-0 rows.
    batches = list(task.eval_batches("test", 4, None, 0, 1))
    assert len(batches) == 3
    weights = np.concatenate([b["weights"] for b in batches])
    np.testing.assert_array_equal(weights, [1] * 10 + [0] * 2)
    np.testing.assert_array_equal(np.concatenate([b["targets"] for b in batches])[:10], arrays["test"][1])
    assert len(list(task.eval_batches("test", 4, 1, 0, 1))) == 1
    counts = [len(list(task.eval_batches("test", 2, None, i, 3))) for i in range(3)]
    assert counts == [2, 2, 2]  # same number of batches on every process
    with pytest.raises(ValueError, match="unknown split"):
        task.eval_batches("validation", 4, None, 0, 1)


def test_augmentation_is_deterministic_and_label_preserving(tmp_path, small_counts):
    from revtrain.data import fashion_mnist as fm
    _write_idx_dir(tmp_path / "src", small_counts)
    plain = fm.FashionMNISTTask(str(tmp_path / "src"), data_dir=str(tmp_path / "cache"))
    aug = fm.FashionMNISTTask(str(tmp_path / "src"), augment=True, data_dir=str(tmp_path / "cache"))
    a, b, p = (next(t.train_iterator(8, 3, 0, 1)) for t in (aug, aug, plain))
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["targets"], p["targets"])
    assert not np.array_equal(a["image"], p["image"])
    image = np.arange(28 * 28, dtype=np.uint8).reshape(28, 28, 1)
    out = fm.augment_example({"image": image, "label": 3}, np.random.default_rng(0), max_shift=2)
    assert out["image"].shape == (28, 28, 1) and out["label"] == 3


# ------------------------------------------------------------------------------------------------
# Model tests on the real images.
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def fashion_mnist():
    """The prepared real Fashion-MNIST builder (skips when the Debian package is not installed)."""
    if not os.path.isdir(DEBIAN_DIR):
        pytest.skip(f"{DEBIAN_DIR} missing: apt-get install dataset-fashion-mnist")
    from revtrain.data import fashion_mnist as fm
    return fm.load_fashion_mnist(DEBIAN_DIR)


@pytest.fixture
def highest_precision():
    import jax
    with jax.default_matmul_precision("highest"):
        yield


def test_real_dataset_is_fashion_mnist(fashion_mnist):
    """60,000 / 10,000 images, every class exactly 6,000 / 1,000 times (the published balance)."""
    for split, n in (("train", 60_000), ("test", 10_000)):
        source = fashion_mnist.as_data_source(split=split)
        assert len(source) == n
        labels = np.array([r["label"] for r in source.__getitems__(list(range(n)))])
        np.testing.assert_array_equal(np.bincount(labels, minlength=10), [n // 10] * 10)
    image = fashion_mnist.as_data_source(split="test")[0]["image"]
    assert image.dtype == np.uint8 and image.shape == (28, 28, 1) and image.max() > 200


def test_model_layout_and_config_errors():
    from revtrain.models.revnet import RevNet
    model = RevNet(10, seed=0, **TINY)
    kinds = [(layer.name, "rev" if layer.reversible else "head" if layer.is_head else "std") for layer in model.layers]
    assert kinds == [("stem", "std"), ("stage_0_block_0", "rev"), ("stage_0_block_1", "rev"),
                     ("downsample_1", "std"), ("stage_1_block_0", "rev"), ("head", "head")]
    assert model.layers[1] == model.layers[2] and hash(model.layers[1]) == hash(model.layers[2])  # one executable
    assert model.input_key == "image" and model.tokens_per_example == 1 and not model.bits_per_byte
    assert set(model.layers[1].init_state["f"]["norms"][0]) == {"mean", "var"}
    for bad in (dict(widths=(8, 15), blocks=(1, 1)), dict(widths=(8,), blocks=(1, 1)), dict(depth=0),
                dict(momentum=1.0), dict(grid_bits=30)):
        with pytest.raises(ValueError):
            RevNet(10, **bad)


def _shard_map_one_device(fn, in_specs, out_specs):
    import jax

    from revtrain.placement import make_mesh
    return jax.jit(jax.shard_map(fn, mesh=make_mesh(jax.devices()[:1]), in_specs=in_specs, out_specs=out_specs))


@pytest.mark.slow  # make test-all
def test_coupling_inverse_rebuilds_inputs_bitwise(fashion_mnist, highest_precision):
    """Forward and rebuild in two separate programs (as in the trainer): the inputs come back bit for bit."""
    import jax
    from jax.sharding import PartitionSpec as P

    from revtrain.layers.base import split_keys
    from revtrain.models.revnet import RevNet
    batch = _real_batches(1)[0]
    model = RevNet(10, seed=0, **TINY)
    stem, block = model.layers[0], model.layers[1]
    keys = jax.random.split(jax.random.PRNGKey(1), BATCH)
    x, _ = _shard_map_one_device(lambda p, s, x: stem.apply(p, s, x, None, True), (P(), P(), P("data")),
                                 (P("data"), P()))(stem.init_params, stem.init_state, batch["image"])
    forward = _shard_map_one_device(lambda p, s, x, k: block.apply(p, s, x, k, True),
                                    (P(), P(), P("data"), P("data")), (P("data"), P()))
    inverse = _shard_map_one_device(lambda p, s, y, k: block.inverse(p, s, y, k),
                                    (P(), P(), P("data"), P("data")), P("data"))
    y, _ = forward(block.init_params, block.init_state, x, keys)
    rebuilt = inverse(block.init_params, block.init_state, y, keys)
    f_out = _shard_map_one_device(
        lambda p, s, x, k: block.merge(p, s).f(x, keys=split_keys(k, 0), train=True),
        (P(), P(), P("data"), P("data")), P("data"))(block.init_params, block.init_state, x[1], keys)
    assert np.abs(np.asarray(f_out)).mean() > 0.3 * np.abs(np.asarray(x[0])).mean()  # F is not negligible
    for s in range(2):
        a, b = np.asarray(x[s]), np.asarray(rebuilt[s])
        assert np.array_equal(a, b), f"stream {s}: {np.mean(a != b):.1%} of the elements are not exact"


@pytest.mark.slow  # make test: the reversible LM's exactness (test_smoke, test_exactness); RevNet's layout and batch stats below
@pytest.mark.parametrize("rebuild", ["exact", "fused"])
def test_reversible_equals_standard_params_and_batch_stats(fashion_mnist, highest_precision, rebuild):
    """Adam, 3 steps, real images: every parameter and every running statistic within 1e-5, in both rebuild
    modes (the fused one runs F and G's batch norms once, on the same tensors as the forward)."""
    import optax

    from revtrain.trainers import ReversibleTrainer, StandardTrainer
    batches = _real_batches(STEPS)
    std, std_losses = _train(StandardTrainer, optax.adam(1e-3), batches, 1)
    rev, rev_losses = _train(ReversibleTrainer, optax.adam(1e-3), batches, 1, rebuild=rebuild)
    np.testing.assert_allclose(rev_losses, std_losses, rtol=1e-6)
    rel, leaf = worst_leaf(std.params, rev.params)
    assert rel <= 1e-5, f"parameter {leaf} differs by {rel:.2e}"
    rel, leaf = worst_leaf(std.layer_state, rev.layer_state)
    assert rel <= 1e-5, f"statistic {leaf} differs by {rel:.2e}"


# A by-hand forward pass (numpy; float64 statistics) of the RevNet layer list, following
# revtrain/layers/revnet.py: it returns the logits and the running statistics one forward pass should leave.
def _snap(x, bits):
    return x if bits is None else np.round(x * 2.0 ** bits) / 2.0 ** bits


def _conv(x, kernel, stride=1):
    import jax
    from jax import lax
    with jax.default_matmul_precision("highest"):
        out = lax.conv_general_dilated(np.float32(x), np.asarray(kernel), (stride, stride), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return np.asarray(out, np.float64)


def _bn(x, params, state, momentum, train):
    """Batch norm over N, H, W; returns (output, new state)."""
    if train:
        mean = x.mean(axis=(0, 1, 2))
        var = ((x - mean) ** 2).mean(axis=(0, 1, 2))  # biased, as flax
        new = {"mean": momentum * np.asarray(state["mean"], np.float64) + (1 - momentum) * mean,
               "var": momentum * np.asarray(state["var"], np.float64) + (1 - momentum) * var}
    else:
        mean, var, new = np.asarray(state["mean"], np.float64), np.asarray(state["var"], np.float64), state
    y = (x - mean) / np.sqrt(var + 1e-5) * np.asarray(params["scale"]) + np.asarray(params["bias"])
    return y, new


def _by_hand(model, params, state, image, train, momentum, bits):
    relu = lambda v: np.maximum(v, 0.0)  # noqa: E731
    new_state = []
    x = np.asarray(image, np.float64)
    for layer, p, s in zip(model.layers, params, state):
        kind = layer.name.split("_")[0]
        if kind == "stem":
            h = _snap(_conv(x, p["conv"]["kernel"]), bits)
            c = h.shape[-1] // 2
            x, ns = (h[..., :c], h[..., c:]), {}
        elif kind == "stage":
            ns = {"f": {"norms": {}}, "g": {"norms": {}}}

            def fn(name, v):
                for i in range(len(p[name]["convs"])):
                    v, ns[name]["norms"][i] = _bn(v, p[name]["norms"][i], s[name]["norms"][i], momentum, train)
                    v = _conv(relu(v), p[name]["convs"][i]["kernel"])
                return _snap(v, bits)
            y1 = x[0] + fn("f", x[1])
            x = (y1, x[1] + fn("g", y1))
        elif kind == "downsample":
            h, norm = _bn(np.concatenate(x, -1), p["norm"], s["norm"], momentum, train)
            h = _snap(_conv(relu(h), p["conv"]["kernel"], stride=2), bits)
            c = h.shape[-1] // 2
            x, ns = (h[..., :c], h[..., c:]), {"norm": norm}
        else:  # head
            h, norm = _bn(np.concatenate(x, -1), p["norm"], s["norm"], momentum, train)
            pooled = relu(h).mean(axis=(1, 2))
            x = pooled @ np.asarray(p["logits"]["kernel"], np.float64) + np.asarray(p["logits"]["bias"])
            ns = {"norm": norm}
        new_state.append(ns)
    return x, new_state


@pytest.mark.parametrize("trainer", ["reversible", pytest.param("reversible_offload", marks=pytest.mark.slow), "standard"])
def test_batch_stats_change_exactly_as_one_forward_pass(fashion_mnist, highest_precision, trainer):
    """After each of 2 steps, every running mean / variance equals momentum * old + (1 - momentum) * the
    batch statistic of that layer's input in the step's forward pass (computed by hand from the batch):
    updated once, by the forward, not again by the rebuild."""
    import jax
    import optax

    from revtrain.models.revnet import RevNet
    from revtrain.placement import global_batch, make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer
    batches = _real_batches(2)
    mesh = make_mesh(jax.devices()[:1])
    model = RevNet(10, seed=0, **TINY)
    cls = StandardTrainer if trainer == "standard" else ReversibleTrainer
    kwargs = {"offload": True} if trainer == "reversible_offload" else {}
    tr = cls(model, optax.adam(1e-3), mesh, seed=0, **kwargs)
    ts = tr.init()
    for batch in batches:
        params = jax.tree.map(np.asarray, [tr.layer_params(ts, i) for i in range(len(model.layers))])
        old_state = jax.tree.map(np.asarray, ts.layer_state)
        _, expected = _by_hand(model, params, old_state, batch["image"], True, TINY["momentum"], 16)
        ts, _ = tr.train_step(ts, global_batch(batch, mesh))
        got = jax.tree.map(np.asarray, ts.layer_state)
        rel, leaf = worst_leaf(expected, got)
        assert rel <= 1e-5, f"step {ts.step}: statistic {leaf} is off by {rel:.2e} from one forward's update"
        # A second update (by a rebuild) would be far away: check the test could tell.
        _, twice = _by_hand(model, params, expected, batch["image"], True, TINY["momentum"], 16)
        assert worst_leaf(twice, got)[0] > 1e-3


@pytest.mark.slow  # make test-all
def test_eval_uses_running_statistics(fashion_mnist, highest_precision):
    """eval_step scores with the running statistics (by-hand forward) and leaves the state unchanged."""
    import jax
    import optax

    from revtrain.models.revnet import RevNet
    from revtrain.placement import global_batch, make_mesh
    from revtrain.trainers import ReversibleTrainer
    train_batches = _real_batches(2)
    mesh = make_mesh(jax.devices()[:1])
    model = RevNet(10, seed=0, **TINY)
    tr = ReversibleTrainer(model, optax.adam(1e-2), mesh, seed=0)
    ts = tr.init()
    for batch in train_batches:
        ts, _ = tr.train_step(ts, global_batch(batch, mesh))
    from revtrain.data.fashion_mnist import FashionMNISTTask
    batch = next(FashionMNISTTask(DEBIAN_DIR).eval_batches("test", BATCH, 1, 0, 1))
    batch["weights"][-3:] = 0.0  # padding rows do not count
    before = jax.tree.map(np.array, ts.layer_state)
    sums = {k: float(v) for k, v in tr.eval_step(ts, global_batch(batch, mesh)).items()}
    params = jax.tree.map(np.asarray, ts.params)
    logits, _ = _by_hand(model, params, before, batch["image"], False, TINY["momentum"], 16)
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    losses = logz - logits[np.arange(BATCH), batch["targets"]]
    w = batch["weights"]
    assert sums["weight"] == BATCH - 3
    np.testing.assert_allclose(sums["loss_sum"], (losses * w).sum(), rtol=1e-4)
    assert sums["correct"] == ((logits.argmax(1) == batch["targets"]) * w).sum()
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(ts.layer_state)):
        np.testing.assert_array_equal(x, np.asarray(y))


@pytest.fixture(scope="module")
def four_devices(fashion_mnist, tmp_path_factory):
    out = tmp_path_factory.mktemp("revnet4") / "results.json"
    return run_worker(__file__, NUM_DEVICES, out, timeout=300)


@pytest.mark.slow  # make test-all
def test_four_devices_equal_one_device(four_devices):
    """Batch statistics averaged over 4 devices: the 4-device reversible trainer equals 1-device backprop."""
    for key, (rel, leaf) in four_devices["compare"].items():
        assert rel <= 1e-5, f"{key}: {leaf} differs by {rel:.2e}"
    losses = four_devices["losses"]
    for name in losses:
        np.testing.assert_allclose(losses[name], losses["standard/1"], rtol=1e-5)


@pytest.mark.slow  # make test-all
def test_four_devices_offload_and_replicas(four_devices):
    assert four_devices["offload_bitwise"]
    assert all(four_devices["replicas_identical"].values()), four_devices["replicas_identical"]


# ------------------------------------------------------------------------------------------------
# The command line.
# ------------------------------------------------------------------------------------------------
def _revtrain(*args, env=None):
    return revtrain(*args, cwd=REPO, **(env or {}))


def test_cli_missing_data_exits_2_with_one_line(tmp_path):
    result = _revtrain("train", "--config", CONFIG, "--gin", f"FashionMNISTTask.source = '{tmp_path}/none'",
                       "--workdir", str(tmp_path / "run"), env={"REVTRAIN_DATA_DIR": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("revtrain: error: Fashion-MNIST not found"), result.stderr


@pytest.fixture(scope="module")
def cli_run(fashion_mnist, tmp_path_factory):
    """A tiny run of the default config from the command line: 6 steps, checkpoints at 3 and 6."""
    tiny = ["--gin", "RevNet.widths = (8, 16)", "--gin", "RevNet.blocks = (1, 1)", "--gin", "STEPS = 6",
            "--gin", "WARMUP = 2", "--gin", "train.batch_size = 16", "--gin", "train.log_every = 3",
            "--gin", "train.checkpoint_every = 3", "--gin", "evaluate.max_batches = 2",
            "--gin", "evaluate.batch_size = 50"]
    workdir = tmp_path_factory.mktemp("revnet_cli") / "run"
    result = _revtrain("train", "--config", CONFIG, *tiny, "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.mark.slow  # make test-all
def test_cli_trains_and_evaluates_on_test_split(cli_run):
    # (The explicit split works around config.gin lacking the evaluate.* bindings; see the next test.)
    result = _revtrain("eval", "--workdir", str(cli_run), "--step", "3", "--gin", "evaluate.split = 'test'")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (cli_run / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [6, 3]
    for r in records:
        assert set(r) >= {"step", "loss", "accuracy"} and "bits_per_byte" not in r
        assert 0.0 <= r["accuracy"] <= 1.0 and np.isfinite(r["loss"])


@pytest.mark.slow  # make test-all
def test_cli_config_gin_keeps_the_eval_split(cli_run):
    assert "evaluate.split = 'test'" in (cli_run / "config.gin").read_text()


if __name__ == "__main__":
    _worker(sys.argv[1])
