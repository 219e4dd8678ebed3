"""Sampling (`revtrain.sample`, `revtrain sample`): cached decoding equals the full forward, determinism,
the window slide, offload, several devices, the command line and samples during training.

This file is also the worker of the several-devices test (``python tests/test_sample.py OUT.json`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``).
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
import optax
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs" / "enwik_small.gin")


def _model(context, num_layers=2, d_model=32):
    from revtrain.models import ReversibleTransformerLM
    return ReversibleTransformerLM(context, num_layers=num_layers, d_model=d_model, num_heads=4, dropout_rate=0.1)


def _trainer(model, devices=1, offload=False, scan_layers=True):
    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer
    return ReversibleTrainer(model, optax.adam(1e-3), make_mesh(jax.devices()[:devices]), offload=offload,
                             scan_layers=scan_layers)


def _full_logits(model, params, states):
    """jitted ``tokens [B, T] -> logits [B, T, V]``: the training forward in evaluation mode."""
    def full(tokens):
        x = tokens
        for i, layer in enumerate(model.layers):
            x = layer.apply(params[i], states[i], x, None, False)[0]
        return x
    return jax.jit(full)


# ------------------------------------------------------------------------------------------------
# One random-init model for the in-process tests: 2 blocks, d_model 32, a 128-byte context (the shapes of the
# trained run below, so that its eager initialisation compiles nothing new).
# ------------------------------------------------------------------------------------------------
CONTEXT, PROMPT, LENGTH = 128, b"[[Category:", 260  # from an 11-byte prompt: the window slides 3 times
OPTIONS = dict(length=LENGTH, num_samples=3)  # one compiled program serves every in-process test


@pytest.fixture(scope="module")
def lm():
    """``(model, trainer, state, full)``: ``full`` is the jitted training forward (evaluation mode),
    int32 ``[1, CONTEXT]`` -> logits ``[1, CONTEXT, 256]``."""
    model = _model(CONTEXT)
    trainer = _trainer(model)
    ts = trainer.init()
    return model, trainer, ts, _full_logits(model, list(ts.params), list(ts.layer_state))


def test_cached_logits_equal_full_forward(lm):
    """A 64-byte prompt encoded at once, then a 64-byte continuation one byte at a time with the per-layer
    caches: every position's next-byte logits equal the full forward's within 1e-5 relative (max
    |difference| / max |logit|), float32, depth 2."""
    from jax import lax
    model, _, ts, full = lm
    params, states = list(ts.params), list(ts.layer_state)
    prompt_len = 64
    tokens = np.random.default_rng(0).integers(0, 256, (1, CONTEXT)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        reference = np.asarray(full(tokens))

        @jax.jit
        def cached(tokens):
            caches = [layer.init_cache(1, CONTEXT) for layer in model.layers]
            x = tokens[:, :prompt_len]
            for i, layer in enumerate(model.layers):
                x, caches[i] = layer.decode(params[i], states[i], x, caches[i], 0)

            def step(caches, t):
                y = lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
                new = []
                for i, layer in enumerate(model.layers):
                    y, cache = layer.decode(params[i], states[i], y, caches[i], t)
                    new.append(cache)
                return new, y[:, 0]

            _, steps = lax.scan(step, caches, np.arange(prompt_len, CONTEXT))
            return x, steps.swapaxes(0, 1)

        prefix, steps = (np.asarray(a) for a in cached(tokens))
    scale = np.abs(reference).max()
    prompt_error = np.abs(prefix - reference[:, :prompt_len]).max() / scale
    step_error = np.abs(steps - reference[:, prompt_len:]).max(axis=(0, 2)) / scale
    assert steps.shape == (1, CONTEXT - prompt_len, 256) and CONTEXT - prompt_len == 64
    assert prompt_error <= 1e-5, prompt_error
    assert step_error.max() <= 1e-5, (int(step_error.argmax()), float(step_error.max()))


def _reference_greedy(full, prompt: bytes, length: int) -> bytes:
    """Greedy bytes from full forwards under the documented window policy: when the cache would hold
    ``CONTEXT`` positions, the last ``CONTEXT // 2`` bytes are re-encoded at positions 0.. and decoding
    goes on from there."""
    window = CONTEXT // 2
    text = list(prompt[-CONTEXT:])
    start, pos = 0, len(text)
    for _ in range(length):
        seen = text[start:]
        padded = np.zeros((1, CONTEXT), np.int32)
        padded[0, :len(seen)] = seen  # causal: the padding after the last byte changes nothing
        text.append(int(np.argmax(np.asarray(full(padded))[0, len(seen) - 1])))
        if pos == CONTEXT:
            start, pos = len(text) - window, window
        else:
            pos += 1
    return bytes(text[-length:])


def test_greedy_sample_follows_full_forward_past_the_context(lm):
    """260 greedy bytes from an 11-byte prompt with a 128-byte context (the window slides 3 times) are
    exactly the argmax bytes of full forwards under the same window policy; every sample is the same."""
    from revtrain import sample
    _, trainer, ts, full = lm
    result = sample.generate(trainer, ts, PROMPT, CONTEXT, sample.Options(temperature=0.0, **OPTIONS))
    assert result.samples == [_reference_greedy(full, PROMPT, LENGTH)] * 3
    again = sample.generate(trainer, ts, PROMPT, CONTEXT, sample.Options(temperature=0.0, **OPTIONS))
    assert again.samples == result.samples  # greedy is deterministic


@pytest.fixture(scope="module")
def seeded(lm):
    """Samples at temperature 1 with top-k 40 and top-p 0.95, seed 3: fused program and a repeat."""
    from revtrain import sample
    _, trainer, ts, _ = lm
    opts = sample.Options(temperature=1.0, top_k=40, top_p=0.95, seed=3, **OPTIONS)
    return opts, [sample.generate(trainer, ts, PROMPT, CONTEXT, opts).samples for _ in range(2)]


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(lm, seeded):
    from revtrain import sample
    _, trainer, ts, _ = lm
    opts, (first, repeat) = seeded
    other = sample.generate(trainer, ts, PROMPT, CONTEXT, dataclasses.replace(opts, seed=4)).samples
    assert repeat == first
    assert len(first) == 3 and all(len(s) == LENGTH for s in first)
    assert len(set(first)) == 3  # each sample draws with its own key
    assert all(a != b for a, b in zip(first, other))


def test_next_tokens_filters():
    """top_k 1 and a tiny top_p are greedy; top_k keeps only the k largest; temperature 0 is argmax."""
    from revtrain import sample
    next_tokens = jax.jit(sample.next_tokens)  # settings traced: one compiled program for every call
    logits = np.log(np.array([[0.1, 0.5, 0.15, 0.25]] * 4000, np.float32))
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)
    assert set(np.asarray(next_tokens(logits, keys, 1.0, 1, 1.0)).tolist()) == {1}
    assert set(np.asarray(next_tokens(logits, keys, 1.0, 0, 0.3)).tolist()) == {1}
    assert set(np.asarray(next_tokens(logits, keys, 0.0, 0, 1.0)).tolist()) == {1}
    two = np.asarray(next_tokens(logits, keys, 1.0, 2, 1.0))
    assert set(two.tolist()) == {1, 3}
    assert abs(np.mean(two == 1) - 0.5 / 0.75) < 0.03
    nucleus = np.asarray(next_tokens(logits, keys, 1.0, 0, 0.8))  # 0.5 + 0.25 < 0.8: 0.15 joins
    assert set(nucleus.tolist()) == {1, 2, 3}
    both = np.asarray(next_tokens(logits, keys, 1.0, 2, 0.6))  # top-2 renormalised: 0.67 >= 0.6
    assert set(both.tolist()) == {1}
    free = np.bincount(np.asarray(next_tokens(logits, keys, 1.0, 0, 1.0)), minlength=4) / 4000
    np.testing.assert_allclose(free, [0.1, 0.5, 0.15, 0.25], atol=0.03)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_offload_streams_layers_and_gives_the_same_samples(lm, seeded, scan_layers):
    """With ReversibleTrainer.offload the weights stay in host memory (pageable, the streaming engine's store,
    whatever ``scan_layers`` says) and each step runs layer by layer, each layer copied in before its program:
    the samples are those of the fused program, past the context too."""
    from revtrain import sample
    from revtrain.placement import PAGEABLE_MEMORY
    model, _, _, _ = lm
    opts, (first, _) = seeded
    offload = _trainer(model, offload=True, scan_layers=scan_layers)
    ots = offload.init()
    kind = PAGEABLE_MEMORY
    assert all(x.sharding.memory_kind == kind for x in jax.tree.leaves(ots.params))
    assert sample.generate(offload, ots, PROMPT, CONTEXT, opts).samples == first
    assert all(x.sharding.memory_kind == kind for x in jax.tree.leaves(ots.params))


def test_model_without_decoding_is_refused():
    """A layer whose module has no ``decode`` (here a coupling of two dense layers, as the RevNet's
    couplings of convolutions) is named."""
    from flax import nnx

    from revtrain import sample
    from revtrain.layers.base import Layer, ReversibleCoupling, ReversibleLayer
    rngs = nnx.Rngs(0)
    layers = [ReversibleLayer(ReversibleCoupling(nnx.Linear(2, 2, rngs=rngs), nnx.Linear(2, 2, rngs=rngs)), "block_0"),
              Layer(nnx.Linear(2, 2, rngs=rngs), "head")]
    assert not layers[0].can_decode
    with pytest.raises(sample.SampleError, match="cannot generate text: its layer block_0 has no incremental"):
        sample.check_decodable(types.SimpleNamespace(layers=layers))


# ------------------------------------------------------------------------------------------------
# Several devices (a subprocess: the device count is fixed when JAX starts).
# ------------------------------------------------------------------------------------------------
def _worker(out_path: str) -> None:
    from revtrain import sample
    assert len(jax.devices()) == 2, jax.devices()
    from revtrain.placement import make_mesh
    from revtrain.trainers import StandardTrainer
    # StandardTrainer: sampling reads any trainer's state (and it skips the per-layer optimizer check).
    trainer = StandardTrainer(_model(CONTEXT), optax.adam(1e-3), make_mesh(jax.devices()))
    opts = sample.Options(temperature=1.0, top_k=40, top_p=0.95, seed=3, **OPTIONS)
    result = sample.generate(trainer, trainer.init(), PROMPT, CONTEXT, opts)
    with open(out_path, "w") as f:
        json.dump({"samples": [s.hex() for s in result.samples], "devices": result.devices}, f)


@pytest.mark.slow  # a 2-device process
def test_samples_split_over_two_devices_equal_one_device(tmp_path, seeded):
    """3 samples on 2 devices (padded to 4 rows, the extra one dropped) are the 1-device samples."""
    out = tmp_path / "two.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["devices"] == 2
    assert [bytes.fromhex(s) for s in result["samples"]] == seeded[1][0]


# ------------------------------------------------------------------------------------------------
# The command line, samples during training, eval --split.
# ------------------------------------------------------------------------------------------------
TRAINED_GIN = ["ReversibleTransformerLM.num_layers = 2", "ReversibleTransformerLM.d_model = 32",
               "train.batch_size = 8", "train.log_every = 5", "train.checkpoint_every = 0",
               "evaluate.max_batches = 2", "STEPS = 10", "WARMUP = 2", "train.sample_every = 5",
               "train.sample_length = 64"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, byte_lm_data_dir):
    """A tiny byte LM trained for 10 steps by ``revtrain train`` in this process, sampling during training
    (``train.sample_every = 5``)."""
    from revtrain import cli
    workdir = tmp_path_factory.mktemp("sample") / "run"
    args = ["train", "--config", CONFIG, "--workdir", str(workdir)]
    for binding in TRAINED_GIN:
        args += ["--gin", binding]
    assert cli.main(args) == 0
    return workdir


def test_training_writes_samples(trained):
    records = [json.loads(line) for line in (trained / "metrics" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10]
    assert all(r["prompt"] == "[[Category:" and len(r["text"]) == 64 for r in records)  # ASCII here
    events = list((trained / "tensorboard").glob("events.out.tfevents.*"))
    assert events and any(b"samples/text_summary" in e.read_bytes() for e in events)


def test_sample_command_writes_and_prints_reproducible_samples(trained, tmp_path, capsys):
    from revtrain import cli
    base = ["sample", "--workdir", str(trained), "--prompt", "[[Category:", "--length", "64", "--top_k", "50",
            "--num_samples", "2", "--seed", "1"]
    assert cli.main(base + ["--output", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "sampled 2 x 64 bytes from step 10 of" in err and "bytes/s" in err
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["a.0", "a.1"]
    texts = [(tmp_path / name).read_bytes() for name in files]
    assert all(t.startswith(b"[[Category:") and len(t) == 11 + 64 for t in texts) and texts[0] != texts[1]
    # The same seed prints the same bytes, as text (invalid UTF-8 as U+FFFD), each under a header.
    assert cli.main(base) == 0
    shown = "".join(f"--- sample {i + 1}/2 ---\n{t.decode('utf-8', 'replace')}\n" for i, t in enumerate(texts))
    assert capsys.readouterr().out == shown


def test_on_a_terminal_control_characters_are_shown_escaped(trained, capsys, monkeypatch):
    from revtrain import cli
    from revtrain.generate import printable
    assert printable("a\x1b[2Jb\r\n\tc\x07\x7f\x9b\u00e9\ufffd") == "a\\x1b[2Jb\\x0d\n\tc\\x07\\x7f\\x9b\u00e9\ufffd"
    args = ["sample", "--workdir", str(trained), "--prompt", "\x1b[2J[[Category:", "--length", "16"]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("\\x1b[2J[[Category:") and all(c == "\n" or ord(c) >= 0x20 for c in out), out
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)  # a pipe gets the text as generated
    assert cli.main(args) == 0
    assert capsys.readouterr().out.startswith("\x1b[2J[[Category:")


def test_eval_split_test(trained):
    from revtrain import cli
    assert cli.main(["eval", "--workdir", str(trained), "--split", "test"]) == 0
    assert cli.main(["eval", "--workdir", str(trained), "--split", "test"]) == 0  # scored again: replaced
    test = [json.loads(line) for line in (trained / "metrics" / "eval_test.jsonl").read_text().splitlines()]
    validation = [json.loads(line) for line in (trained / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in test] == [10] and [r["step"] for r in validation] == [10]
    assert 0 < test[0]["bits_per_byte"] < 8 and test[0]["bits_per_byte"] != validation[0]["bits_per_byte"]


@pytest.mark.skipif(not os.environ.get("REVTRAIN_SAMPLE_WORKDIR"),
                    reason="needs a trained run of configs/enwik_small.gin: `make check-sample`")
def test_trained_model_closes_category_links(capsys):
    """A real signal that the model learned the data: on a trained run of ``configs/enwik_small.gin`` (700
    steps; its workdir in ``REVTRAIN_SAMPLE_WORKDIR``; ``make check-sample`` trains it), the greedy
    continuation of ``[[Category:`` closes the link with ``]]`` within 200 bytes. Not part of ``make
    test``: no model small enough to train within a test does it (measured: that model does not at 200
    steps, nor a run of 400 steps; see docs/sampling.md)."""
    from revtrain import cli
    workdir = os.environ["REVTRAIN_SAMPLE_WORKDIR"]
    assert cli.main(["sample", "--workdir", workdir, "--prompt", "[[Category:", "--temperature", "0",
                     "--length", "200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[[Category:") and "]]" in out[len("[[Category:"):], out


# ------------------------------------------------------------------------------------------------
# Tied embedding/head x offload x executor (issue 40: a tied model with offload could not be sampled).
# ------------------------------------------------------------------------------------------------
MODERN = str(REPO / "configs" / "enwik_modern.gin")
MODERN_GIN = ["NUM_LAYERS = 2", "D_MODEL = 32", "train.batch_size = 8", "train.log_every = 2",
              "evaluate.max_batches = 1", "STEPS = 4", "WARMUP = 1", "train.sample_length = 24"]
COMBINATIONS = [(tie, offload, scan) for tie in (False, True) for offload in (False, True) for scan in (False, True)]


def _modern_model(tie: bool):
    """The default run's model (enwik_modern.gin) at depth 2, d_model 32, tied or not."""
    import gin

    import revtrain.registry  # noqa: F401
    from revtrain.models.compose import ComposedModel
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO / "configs"))
    gin.parse_config_files_and_bindings([MODERN], ["NUM_LAYERS = 2", "D_MODEL = 32",
                                                   f"RMSNormLanguageModelHead.tie_embedding = {tie}"])
    try:
        return ComposedModel(seed=0, d_model=32, input_key="inputs", sequence_length=CONTEXT)
    finally:
        gin.clear_config()


@pytest.mark.slow  # make test: test_greedy_sample_follows_full_forward_past_the_context, the smoke test's sample
@pytest.mark.parametrize("tie", [False, True])  # (tied: issue 40's crash)
def test_every_tie_offload_executor_combination_samples_the_full_forward(tie, text_batches):
    """After two training steps (the tied table then differs from its initial value), greedy samples of the
    default model are the same bytes with and without offload (its weights held in device memory or streamed
    layer by layer), per-layer and scanned executors and in StandardTrainer, and equal greedy decoding by full
    forwards with the merged (tied) params."""
    from revtrain import sample
    from revtrain.placement import global_batch, make_mesh
    from revtrain.trainers import ReversibleTrainer, StandardTrainer
    model = _modern_model(tie)
    assert len(model.ties) == (1 if tie else 0)
    mesh, batches = make_mesh(jax.devices()[:1]), text_batches(8, 2)
    opts = sample.Options(length=24, temperature=0.0)
    samples, states = {}, {}
    trainers = {"standard": StandardTrainer(model, optax.adamw(1e-2), mesh)}
    for offload in (False, True):
        for scan in (False, True):
            trainers[(offload, scan)] = ReversibleTrainer(model, optax.adamw(1e-2), mesh, offload=offload,
                                                          scan_layers=scan)
    for name, trainer in trainers.items():
        ts = trainer.init()
        for batch in batches:
            ts, _ = trainer.train_step(ts, global_batch(batch, mesh))
        samples[name] = sample.generate(trainer, ts, PROMPT, CONTEXT, opts).samples[0]
        if trainer.residency.offloaded:  # (held in device memory above: they fit) and streamed layer by layer
            samples[(*name, "stream")] = sample.generate(trainer, ts, PROMPT, CONTEXT, opts, weights="stream").samples[0]
        states[name] = ts.per_layer() if hasattr(ts, "per_layer") else ts
    assert len(set(samples.values())) == 1, samples
    ts = states[(False, False)]
    params = [model.merge_tied(i, p, ts.params) if model.ties_of(i) else p for i, p in enumerate(ts.params)]
    if tie:  # the head reads the embedding's trained table
        np.testing.assert_array_equal(params[-1]["embedding"], ts.params[0]["tokens"]["embedding"])
    full = _full_logits(model, params, list(ts.layer_state))
    text = list(PROMPT)
    for _ in range(24):
        padded = np.zeros((1, CONTEXT), np.int32)
        padded[0, :len(text)] = text
        text.append(int(np.argmax(np.asarray(full(padded))[0, len(text) - 1])))
    assert bytes(text[len(PROMPT):]) == samples["standard"]


@pytest.mark.parametrize("tie, offload, scan", [
    pytest.param(*c, marks=pytest.mark.slow) for c in COMBINATIONS])  # (make test: test_training_writes_samples)
def test_sampling_during_training_and_after_for_every_combination(tie, offload, scan, tmp_path, byte_lm_data_dir,
                                                                  capsys):
    """``revtrain train`` with ``train.sample_every`` and no periodic checkpoint, then ``revtrain sample``, on
    the default model tied or not, with and without offload, per-layer or scanned: both sample (make test
    runs the tied + offload + scanned case, the one that crashed; the slow tier every combination)."""
    from revtrain import cli
    workdir = tmp_path / "run"
    args = ["train", "--config", MODERN, "--workdir", str(workdir)]
    for binding in MODERN_GIN + ["train.sample_every = 2", "train.checkpoint_every = 0",
                                 f"RMSNormLanguageModelHead.tie_embedding = {tie}",
                                 f"ReversibleTrainer.offload = {offload}", f"ReversibleTrainer.scan_layers = {scan}"]:
        args += ["--gin", binding]
    assert cli.main(args) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (workdir / "metrics" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4] and all(len(r["text"]) > 0 for r in records)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]
    capsys.readouterr()
    assert cli.main(["sample", "--workdir", str(workdir), "--prompt", "[[Category:", "--temperature", "0",
                     "--length", "24", "--output", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    data = (tmp_path / "out").read_bytes()
    assert data.startswith(b"[[Category:") and len(data) == 11 + 24
    # The training run's greedy sample at step 4 is the command's, from the same checkpoint.
    assert data[11:].decode("utf-8", "replace") == records[-1]["text"]


@pytest.fixture(scope="module")
def empty_runs(tmp_path_factory):
    """Workdirs with a config.gin but no checkpoint: a byte LM and a RevNet."""
    base = tmp_path_factory.mktemp("empty")
    (base / "lm").mkdir()
    (base / "lm" / "config.gin").write_text(pathlib.Path(CONFIG).read_text())
    (base / "revnet").mkdir()
    (base / "revnet" / "config.gin").write_text((REPO / "configs" / "revnet_fashion_mnist.gin").read_text())
    return base


@pytest.mark.parametrize("args,contains", [
    (["--workdir", "{lm}"], "no checkpoints in"),
    (["--workdir", "{revnet}"], "trains RevNet on FashionMNISTTask, which cannot generate text"),
    (["--workdir", "{lm}", "--length", "0"], "--length must be a positive integer"),
    (["--workdir", "{lm}", "--temperature", "-0.5"], "--temperature must be a finite number >= 0"),
    (["--workdir", "{lm}", "--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--workdir", "{lm}", "--top_p", "1.5"], "--top_p must be in (0, 1]"),
    (["--workdir", "{lm}", "--top_k", "-1"], "--top_k must be an integer >= 0"),
    (["--workdir", "{lm}", "--top_k", "many"], "argument --top_k: invalid int value"),
    (["--workdir", "{lm}", "--prompt_file", "{base}/missing.txt"], "cannot read the prompt file"),
    (["--workdir", "{lm}", "--prompt", ""], "the prompt is empty"),
    (["--workdir", "{base}/nowhere"], "no config.gin in"),
    (["--workdir", "{lm}", "--output", "{base}/no/such/dir/out"], "cannot write --output"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(empty_runs, capsys, args, contains):
    from revtrain import cli
    before = sorted(p.relative_to(empty_runs) for p in empty_runs.rglob("*"))
    args = [a.format(lm=empty_runs / "lm", revnet=empty_runs / "revnet", base=empty_runs) for a in args]
    assert cli.main(["sample", *args, "--output", str(empty_runs / "out.txt")] if "--output" not in args
                    else ["sample", *args]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("revtrain: error: ") and contains in lines[0], err
    assert out == ""
    assert sorted(p.relative_to(empty_runs) for p in empty_runs.rglob("*")) == before


if __name__ == "__main__":
    _worker(sys.argv[1])
