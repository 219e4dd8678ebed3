"""`revtrain check`, the NaN/Inf guard and bad-input handling."""

import json
import re

import gin
import jax.numpy as jnp
import pytest

from revtrain import cli
from revtrain.layers.base import ReversibleLayer
from revtrain.layers.transformer import ReversibleCoupling
from revtrain.models.base import Model
from revtrain.models.transformer_lm import ReversibleTransformerLM

from helpers import CONFIG, revtrain, revtrain_here

TINY = ["--gin", "ReversibleTransformerLM.num_layers = 3", "--gin", "ReversibleTransformerLM.d_model = 32",
        "--gin", "ReversibleTransformerLM.dropout_rate = 0.1", "--gin", "train.batch_size = 8",
        "--gin", "train.sample_every = 0"]  # the default config's end-of-run sample: tests/test_sample.py


class _WrongInverse(ReversibleCoupling):
    """A coupling whose inverse is off by 0.1% in one stream: what `revtrain check` must catch."""

    def inverse(self, y, *, keys):
        x1, x2 = super().inverse(y, keys=keys)
        return (x1 * jnp.float32(1.001), x2)


@gin.configurable
def BrokenInverseLM(sequence_length, *, seed=0, broken_block=1):
    """The tiny reversible LM with block ``broken_block``'s inverse replaced by a wrong one."""
    model = ReversibleTransformerLM(sequence_length, seed=seed, num_layers=3, d_model=32, dropout_rate=0.1)
    layers = list(model.layers)
    good = layers[1 + broken_block]
    module = good.merge(good.init_params, good.init_state)
    layers[1 + broken_block] = ReversibleLayer(_WrongInverse(module.f, module.g, module.grid_bits), good.name)
    return Model(layers, input_key=model.input_key, tokens_per_example=model.tokens_per_example,
                 bits_per_byte=True)


@pytest.mark.slow  # make test-all (make test: test_long's check with blockwise attention passes)
def test_check_passes_on_an_exact_model(capsys):
    assert cli.main(["check", "--config", CONFIG, *TINY]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "block_2" in out and "rebuild bfloat16" in out
    assert out.splitlines()[-1].startswith("PASS: optimizer step"), out  # (revtrain/check_optimizer.py)


@pytest.mark.slow  # make test-all
def test_check_names_the_layer_with_a_wrong_inverse(capsys):
    code = cli.main(["check", "--config", CONFIG, *TINY, "--gin", "train.model = @BrokenInverseLM"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL" in out and "worst layer block_1" in out


def _train(tmp_path, *extra):
    return revtrain("train", "--config", CONFIG, *TINY, "--gin", "STEPS = 6", "--gin", "WARMUP = 1",
                    "--gin", "train.log_every = 1", "--gin", "evaluate.max_batches = 1", *extra,
                    "--workdir", tmp_path / "run")


@pytest.mark.slow  # make test-all
def test_nonfinite_loss_stops_the_run_and_keeps_the_newest_checkpoint(tmp_path):
    # Step 1 is finite; its huge SGD step makes step 2's loss overflow.
    result = _train(tmp_path, "--gin", "train.checkpoint_every = 1", "--gin", "train.optimizer = @optax.sgd",
                    "--gin", "train.learning_rate = 1e30")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("revtrain: error: non-finite loss at step 2") and "step 1" in last, last
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]


@pytest.mark.slow  # make test keeps test_recipe's non-finite deferred step
def test_skip_nonfinite_steps_skips_and_logs_each(tmp_path):
    result = _train(tmp_path, "--gin", "train.optimizer = @optax.sgd", "--gin", "train.learning_rate = 1e30",
                    "--gin", "train.skip_nonfinite_steps = 2")
    assert result.returncode == 1
    assert "non-finite loss at step 2: skipped" in result.stderr
    assert "non-finite loss at step 3: skipped" in result.stderr
    assert "revtrain: error: non-finite loss at step 4" in result.stderr
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "skipped_nonfinite" in r] == [2, 3]


@pytest.mark.parametrize("setup, args, contains", [
    ("syntax", ["--config", "{bad}"], "bad gin configuration"),
    (None, ["--config", CONFIG, "--gin", "train.steps = 'many'"], "train.steps must be a positive integer"),
    (None, ["--config", CONFIG, "--gin", "train.batch_size = 0"], "train.batch_size must be a positive"),
    (None, ["--config", CONFIG, "--gin", "ByteLMTask.sequence_length = 10000000"], "sequence length"),
    # A bound call that raises (the schedule, with fewer steps than its warmup): its bindings and macro values.
    (None, ["--config", CONFIG, "--gin", "STEPS = 30"], "decay_steps = %STEPS = 30, end_value = 0.0001, "
     "init_value = 0.0, peak_value = 0.003, warmup_steps = %WARMUP = 50)"),
    ("file", ["--config", CONFIG, "--workdir", "{file}"], "cannot write"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capfd, setup, args, contains):
    """Bad configurations of ``revtrain train`` (in this process: `cli.main`, as the console script calls it):
    one line, exit 2, nothing written."""
    bad = tmp_path / "bad.gin"
    bad.write_text("train.steps = = 3\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    args = [a.replace("{bad}", str(bad)).replace("{file}", str(blocker / "run")) for a in args]
    if "--workdir" not in args:
        args += ["--workdir", str(tmp_path / "w")]
    result = revtrain_here(capfd, "train", *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("revtrain: error: ") and contains in lines[0], lines
    assert blocker.read_text() == "not a directory"
    assert not (tmp_path / "w").exists()  # found before anything was written


@pytest.mark.slow  # make test-all: trains a model, then checks it in subprocesses
def test_check_a_trained_checkpoint_on_two_devices(tmp_path):
    assert _train(tmp_path).returncode == 0
    result = revtrain("check", "--workdir", tmp_path / "run", devices=2)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"checkpoint at step 6 of {tmp_path / 'run'}" in out and "on 2 device(s)" in out, out
    rows = [l.split() for l in out.splitlines() if l.startswith("block_")]
    assert len(rows) == 3
    for row in rows:  # float32 columns: within 1e-5 and measured (not '-')
        assert all(float(v) <= 1e-5 for v in row[2:4]), row
    assert "PASS: compute dtype float32" in out

    missing = revtrain("check", "--workdir", tmp_path / "run", "--step", "3", devices=2)
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    assert "no checkpoint for step 3" in lines[0] and "(have 6)" in lines[0], lines


def test_check_needs_a_config_or_a_workdir(capsys):
    assert cli.main(["check"]) == 2
    assert "check needs --config FILE" in capsys.readouterr().err


@pytest.mark.slow  # make test-all: trains a model, then checks it in subprocesses
def test_check_a_hot_trained_bfloat16_model_and_the_grid_range_note(tmp_path, capsys):
    """After 40 steps at a high learning rate the streams reach ~45: inside the default grid's exact range
    (64, grid_bits 18) the bfloat16 rebuild is exact and the gradients equal layer-at-a-time backprop bit
    for bit; with grid_bits 20 (range 16) the rebuild rounds and check fails, saying which grid fits."""
    result = _train(tmp_path, "--gin", "ReversibleTransformerLM.num_layers = 4", "--gin",
                    "ReversibleTransformerLM.d_model = 64", "--gin", "STEPS = 40", "--gin",
                    "train.learning_rate = 1e-2", "--gin", "ReversibleTransformerLM.compute_dtype = 'bfloat16'")
    assert result.returncode == 0, result.stderr
    workdir = str(tmp_path / "run")

    assert cli.main(["check", "--workdir", workdir, "--gin", "check.layers_per_chunk = 1"]) == 0
    out = capsys.readouterr().out
    rows = [l.split() for l in out.splitlines() if l.startswith("block_")]
    assert len(rows) == 4 and all(r[2] == "0.0e+00" and r[4] == "0.0e+00" for r in rows), out
    assert "PASS: compute dtype bfloat16" in out and "every layer bit-identical to backprop" in out, out

    assert cli.main(["check", "--workdir", workdir, "--gin", "ReversibleTransformerLM.grid_bits = 20"]) == 1
    out = capsys.readouterr().out
    m = re.search(r"note: the residual streams reach ([\d.]+) in magnitude, beyond the exact range 16 .*"
                  r"grid_bits <= (\d+) \(range (\d+)\)", out)
    assert m and float(m.group(1)) > 16 and int(m.group(3)) == 2 ** (24 - int(m.group(2))) > float(m.group(1)), out
    assert "FAIL: compute dtype bfloat16" in out
