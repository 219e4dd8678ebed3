"""Models composed in gin from parts: same weights and losses as the hand-written builders, today's
checkpoints load, the user's own modules (found next to the config, remembered by the run) and the
contract guards (one line, exit status 2)."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import gin
import jax
import numpy as np
import pytest

from revtrain import cli, ginconfig, loop, registry  # noqa: F401  (registry: the configurables)

REPO = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_71d4b77"
TINY = ["STEPS = 5", "WARMUP = 1", "train.batch_size = 4", "train.log_every = 1", "train.sample_every = 0",
        "train.checkpoint_every = 0", "evaluate.max_batches = 1", "evaluate.batch_size = 8"]
TINY_LM = ["ReversibleTransformerLM.num_layers = 2", "ReversibleTransformerLM.d_model = 16",
           "ReversibleTransformerLM.num_heads = 2"]
TINY_COMPOSED = ["NUM_LAYERS = 2", "D_MODEL = 16", "NUM_HEADS = 2"]


def parse(files, bindings=()):
    gin.clear_config()
    with ginconfig.include_search_path():
        gin.parse_config_files_and_bindings([ginconfig.find_config(f) for f in files], list(bindings))


def losses(workdir):
    return [json.loads(line)["loss"] for line in (workdir / "metrics" / "train.jsonl").read_text().splitlines()]


def test_composed_default_gives_the_builders_weights(byte_lm_data_dir):
    parse([str(REPO / "configs" / "enwik_small.gin")])
    builder = loop.build().model
    parse([str(REPO / "configs" / "enwik_composed.gin")])
    composed = loop.build().model
    gin.clear_config()
    assert [layer.name for layer in composed.layers] == [layer.name for layer in builder.layers] == [
        "embedding"] + [f"block_{i}" for i in range(6)] + ["head"]
    assert all(a == b for a, b in zip(builder.layers, composed.layers))  # same module graphs and shapes
    a, b = jax.tree.leaves(builder.init()), jax.tree.leaves(composed.init())
    assert len(a) == len(b) == 72 and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow  # make test keeps the composed LM's equality with its builder
@pytest.mark.skipif(not os.path.isdir("/usr/share/datasets/fashion-mnist"), reason="no Fashion-MNIST")
def test_composed_revnet_gives_the_builders_weights():
    parse([str(REPO / "configs" / "revnet_fashion_mnist.gin")])
    builder = loop.build().model
    parse([str(REPO / "configs" / "revnet_composed.gin")])
    composed = loop.build().model
    gin.clear_config()
    assert [layer.name for layer in composed.layers] == [layer.name for layer in builder.layers]
    a, b = jax.tree.leaves(builder.init()), jax.tree.leaves(composed.init())
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ReversibleTrainer", "StandardTrainer"])
def test_composed_default_trains_like_the_builder_to_the_last_digit(tmp_path, byte_lm_data_dir, trainer):
    runs = {}
    for name, config, sizes in (("builder", "configs/enwik_small.gin", TINY_LM),
                                ("composed", "configs/enwik_composed.gin", TINY_COMPOSED)):
        args = ["train", "--config", str(REPO / config), "--workdir", str(tmp_path / name),
                "--gin", f"train.trainer = @{trainer}"]
        for binding in TINY + sizes:
            args += ["--gin", binding]
        assert cli.main(args) == 0
        runs[name] = losses(tmp_path / name)
    assert len(runs["builder"]) == 5 and runs["builder"][-1] < runs["builder"][0]
    assert runs["composed"] == runs["builder"]  # float equality: the same computation


def test_checkpoint_written_by_the_previous_release_loads(tmp_path, byte_lm_data_dir):
    """tests/fixtures/checkpoint_71d4b77: 4 steps of a 2-block ReversibleTransformerLM written by revtrain
    at commit 71d4b77 (before models were composed); digest.json is the SHA-256 of its restored
    parameters and optimizer state, computed by that code."""
    workdir = tmp_path / "run"
    shutil.copytree(FIXTURE, workdir)
    expected = json.loads((FIXTURE / "digest.json").read_text())
    recorded = json.loads((FIXTURE / "metrics" / "eval.jsonl").read_text().splitlines()[-1])
    parse([str(workdir / "config.gin")])
    run = loop.build()
    from revtrain import checkpoint as ckpt_lib
    checkpointer = ckpt_lib.Checkpointer(str(workdir), read_only=True)
    ts, step = checkpointer.restore_newest(run.trainer.init())
    checkpointer.close()
    digest = hashlib.sha256()
    leaves = jax.tree.leaves((ts.params, ts.opt_state))
    for x in leaves:
        digest.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    gin.clear_config()
    assert (step, len(leaves), digest.hexdigest()) == (expected["step"], expected["leaves"], expected["sha256"])
    assert cli.main(["eval", "--workdir", str(workdir)]) == 0
    scored = json.loads((workdir / "metrics" / "eval.jsonl").read_text().splitlines()[-1])
    assert scored["step"] == 4 and scored["loss"] == pytest.approx(recorded["loss"], rel=1e-6)


# -- the user's own modules ----------------------------------------------------------------------------
GOOD_G = '''
import gin
import jax
import jax.numpy as jnp
from flax import nnx
from revtrain.layers.base import PositionWise, dropout

@gin.configurable
class {name}(PositionWise, nnx.Module):
    def __init__(self, d_model, *, rngs, num_layers=1):
        self.up = nnx.Linear(d_model, 2 * d_model, rngs=rngs)
        self.down = nnx.Linear(2 * d_model, d_model, rngs=rngs)
        {extra_init}
    def __call__(self, x, *, keys, train):
        {extra_call}
        return dropout(self.down(jnp.tanh(self.up(x))), 0.1, keys, train){ret}
'''


def user_config(tmp_path, module, name, extra_init="pass", extra_call="pass", ret="", run="train.steps = 2"):
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / f"{module}.py").write_text(GOOD_G.format(name=name, extra_init=extra_init, extra_call=extra_call,
                                                       ret=ret))
    (folder / "train.gin").write_text(textwrap.dedent(f"""\
        import {module}
        include 'enwik_composed.gin'
        Coupling.g = @{module}.{name}
        {run}
        """))
    return folder / "train.gin"


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("revtrain: error: "), err
    return err[0]


@pytest.mark.parametrize("extra_init, extra_call, ret, says", [
    ("self.drop = nnx.Dropout(0.1, rngs=rngs)", "pass", "", "asks its rngs for a random stream of its own"),
    ("self.noise = nnx.Param(jax.random.normal(rngs.noise(), (2,)))", "pass", "", "draw initial weights with "
                                                                                   "rngs.params()"),
    ("self.drop = nnx.Dropout(0.1)", "pass", "", "uses nnx.Dropout at 'drop'"),
    ("self.rngs = rngs", "pass", "", "keeps its own random stream at 'rngs"),
    ("pass", "pass", ".repeat(2, axis=-1)", "must return their input's shape and dtype"),
    ("pass", "self.sow(nnx.Intermediate, 'h', x)", "", "changes the structure of its state"),
])
def test_a_user_module_breaking_the_contract_is_one_line_exit_2(tmp_path, byte_lm_data_dir, capsys, extra_init,
                                                                 extra_call, ret, says):
    module = f"contract_{abs(hash(says)) % 10**6}"
    config = user_config(tmp_path, module, "BadG", extra_init, extra_call, ret)
    assert cli.main(["train", "--config", str(config), "--workdir", str(tmp_path / "w")]) == 2
    line = one_error_line(capsys)
    assert "BadG" in line or "block_0" in line, line
    assert says in line, line
    assert not (tmp_path / "w").exists()  # nothing written


def test_f_and_g_sharing_a_module_is_refused():
    from flax import nnx

    from revtrain.models import compose
    from revtrain.models.contract import ContractError
    from revtrain.layers.transformer import ByteEmbedding, FeedForward, LanguageModelHead
    shared = FeedForward(8, rngs=nnx.Rngs(params=0))
    specs = [compose.Standard(lambda rngs: ByteEmbedding(256, 8, 16, rngs=rngs)),
             compose.Coupling(lambda rngs: shared, lambda rngs: shared),
             compose.Head(lambda rngs: LanguageModelHead(8, rngs=rngs))]
    with pytest.raises(ContractError, match="share the variable"):
        compose.compose(specs)


def test_a_missing_user_module_is_one_line_naming_where_it_looked(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "train.gin").write_text("import no_such_blocks\ninclude 'enwik_small.gin'\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", str(folder / "train.gin"), "--workdir", str(tmp_path / "w")]) == 2
    line = one_error_line(capsys)
    assert "imports no_such_blocks: found neither no_such_blocks.py nor no_such_blocks/" in line
    assert f"in {folder}, {tmp_path}, nor on the Python path" in line


def test_run_config_names_python_values_and_the_user_modules_they_come_from(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "user_parts.py").write_text("import gin\n\n@gin.configurable\ndef Builder(sequence_length, *, seed=0):\n"
                                          "    raise NotImplementedError\n")
    sys.path.insert(0, str(folder))
    try:
        import user_parts
        gin.clear_config()
        text, modules, unnamed = ginconfig.run_config({"train.model": user_parts.Builder, "train.steps": 7,
                                                       "train.optimizer": object()})
    finally:
        sys.path.remove(str(folder))
    assert text.startswith("import user_parts\n")
    assert "train.model = @Builder" in text and "train.steps = 7" in text
    assert modules == {"user_parts": str(folder)} and unnamed == ["train.optimizer"]
    gin.clear_config()
    with ginconfig.include_search_path(modules):  # how eval / sample / check parse a workdir's config.gin
        gin.parse_config(text)
    assert gin.query_parameter("train.model").selector.endswith("Builder")
    gin.clear_config()


@pytest.mark.slow
def test_a_run_remembers_its_modules_and_a_python_run_writes_a_usable_config(tmp_path, byte_lm_data_dir):
    """A builder of the user's own, imported in Python and handed to loop.train as a TrainConfig value:
    config.gin names it and its import, modules.json where it came from, and `revtrain eval` works on
    the workdir from another directory, without PYTHONPATH."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_models.py").write_text(textwrap.dedent("""\
        import gin
        from revtrain.models.transformer_lm import ReversibleTransformerLM

        @gin.configurable
        def TinyLM(sequence_length, *, seed=0, width=16):
            return ReversibleTransformerLM(sequence_length, seed=seed, num_layers=2, d_model=width, num_heads=2)
        """))
    sys.path.insert(0, str(folder))
    try:
        import my_models
        parse([str(REPO / "configs" / "enwik_small.gin")], ["evaluate.max_batches = 1", "evaluate.batch_size = 8"])
        cfg = loop.TrainConfig(model=my_models.TinyLM, steps=2, batch_size=4, log_every=1, sample_every=0)
        loop.train(str(tmp_path / "run"), cfg)
    finally:
        sys.path.remove(str(folder))
        gin.clear_config()
    text = (tmp_path / "run" / "config.gin").read_text()
    assert text.startswith("import my_models\n") and "train.model = @TinyLM" in text, text
    assert json.loads((tmp_path / "run" / "modules.json").read_text()) == {"my_models": str(folder)}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    result = subprocess.run([sys.executable, "-m", "revtrain", "eval", "--workdir", str(tmp_path / "run")],
                            capture_output=True, text=True, cwd="/", env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run" / "metrics" / "eval.jsonl").read_text().splitlines()[-1])["step"] == 2


@pytest.mark.slow
def test_own_block_example_runs_from_a_copy_outside_the_checkout(tmp_path, byte_lm_data_dir):
    """examples/own_block copied elsewhere: train, eval, sample and check on its workdir, from / and
    without PYTHONPATH; check passes with every rebuild error 0.0."""
    copy = tmp_path / "own_block"
    shutil.copytree(REPO / "examples" / "own_block", copy)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}

    def revtrain(*args):
        return subprocess.run([sys.executable, "-m", "revtrain", *args], capture_output=True, text=True, cwd="/",
                              env=env, timeout=600)

    small = [a for b in ("STEPS = 4", "WARMUP = 1", "NUM_LAYERS = 2", "D_MODEL = 32", "train.batch_size = 4",
                         "evaluate.max_batches = 1", "train.sample_length = 8") for a in ("--gin", b)]
    result = revtrain("train", "--config", str(copy / "train.gin"), "--workdir", str(copy / "run"), *small)
    assert result.returncode == 0, result.stderr
    assert "my_blocks" in (copy / "run" / "config.gin").read_text()
    for args in (("eval",), ("sample", "--length", "8"), ("check",)):
        result = revtrain(*args, "--workdir", str(copy / "run"))
        assert result.returncode == 0, (args, result.stderr)
    rebuilds = [line.split()[2] for line in result.stdout.splitlines() if " reversible " in line]
    assert rebuilds == ["0.0e+00", "0.0e+00"], result.stdout
