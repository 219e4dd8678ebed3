"""Checkpoints never lose work: exact resume after SIGTERM and kill -9, keep-N, eval of any checkpoint."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import CONFIG, env, losses, records, revtrain

TINY = ["--gin", "ReversibleTransformerLM.num_layers = 2", "--gin", "ReversibleTransformerLM.d_model = 32",
        "--gin", "ReversibleTransformerLM.dropout_rate = 0.1", "--gin", "train.batch_size = 8",
        "--gin", "evaluate.max_batches = 2", "--gin", "train.log_every = 1", "--gin", "STEPS = 20", "--gin", "WARMUP = 2",
        "--gin", "train.sample_every = 0"]  # the default config's end-of-run sample: tests/test_sample.py


def train_cmd(workdir, *extra):
    return [sys.executable, "-m", "revtrain", "train", "--config", CONFIG, *TINY, *extra, "--workdir", str(workdir)]


def run_train(workdir, *extra, devices=None):
    result = subprocess.run(train_cmd(workdir, *extra), capture_output=True, text=True, env=env(devices),
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def final_params(workdir, step):
    """The saved parameter arrays of ``step``, read back with Orbax (leaf path -> numpy array)."""
    import orbax.checkpoint as ocp
    path = pathlib.Path(workdir).resolve() / "checkpoints" / str(step) / "state"
    tree = ocp.StandardCheckpointer().restore(path)
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree["params"])[0]}


def checkpoint_steps(workdir):
    return sorted(int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 uninterrupted steps."""
    workdir = tmp_path_factory.mktemp("ref") / "run"
    run_train(workdir)
    return workdir


def _start_and_signal(workdir, after_step, sig, extra=()):
    """Starts a run, sends ``sig`` once the progress line of ``after_step`` appears; returns the process."""
    proc = subprocess.Popen(train_cmd(workdir, *extra), stderr=subprocess.PIPE, text=True, env=env())
    for line in proc.stderr:
        if line.startswith(f"step {after_step}/"):
            proc.send_signal(sig)
            break
    proc.stderr.read()
    proc.wait(timeout=120)
    return proc


@pytest.mark.slow  # make test-all (make test: test_reliability's signals, test_depth's exact resume)
def test_sigterm_then_resume_matches_uninterrupted_run(reference, tmp_path):
    workdir = tmp_path / "run"
    proc = _start_and_signal(workdir, 10, signal.SIGTERM)
    assert proc.returncode == 0
    stopped_at = checkpoint_steps(workdir)[-1]
    assert 10 <= stopped_at < 20
    second = run_train(workdir)
    assert f"resumed from checkpoint at step {stopped_at}" in [l for l in second.stderr.splitlines() if not l.startswith("memory plan")][0]
    ref, got = losses(reference), losses(workdir)
    assert sorted(got) == list(range(1, 21))
    for step in range(11, 21):
        assert got[step] == ref[step], step
    a, b = final_params(reference, 20), final_params(workdir, 20)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow  # make test-all: several full training processes
def test_kill_9_during_a_save_resumes_from_the_previous_checkpoint(reference, tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(workdir, "--gin", "train.checkpoint_every = 5"), stderr=subprocess.DEVNULL,
                            env=env())
    ckdir = workdir / "checkpoints"
    deadline = time.time() + 120
    killed_during_save = False
    while proc.poll() is None and time.time() < deadline:  # kill as soon as the second save is in flight
        names = os.listdir(ckdir) if ckdir.exists() else []
        if "5" in names and any("tmp" in n for n in names):
            proc.kill()
            killed_during_save = True
            break
        time.sleep(0.0005)
    proc.wait(timeout=60)
    # Whether or not the kill landed inside the write, leave the state a kill mid-save leaves: a partial
    # temporary directory of a newer step next to the complete ones.
    complete = checkpoint_steps(workdir)
    assert complete, "no complete checkpoint before the kill"
    partial = ckdir / f"{complete[-1] + 5}.orbax-checkpoint-tmp-1234"
    if not killed_during_save or not any("tmp" in n for n in os.listdir(ckdir)):
        shutil.copytree(ckdir / str(complete[-1]), partial)
        for f in partial.rglob("*"):
            if f.is_file():
                f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    second = run_train(workdir, "--gin", "train.checkpoint_every = 5")
    assert f"resumed from checkpoint at step {complete[-1]}" in [l for l in second.stderr.splitlines() if not l.startswith("memory plan")][0]
    ref, got = losses(reference), losses(workdir)
    for step in range(complete[-1] + 1, 21):
        assert got[step] == ref[step], step
    a, b = final_params(reference, 20), final_params(workdir, 20)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow  # make test-all: several full training processes
def test_keep_n_and_eval_all_scores_each_checkpoint_once(tmp_path):
    workdir = tmp_path / "run"
    run_train(workdir, "--gin", "train.checkpoint_every = 4", "--gin", "train.keep_checkpoints = 2",
              "--gin", "train.keep_checkpoint_period = 8")
    assert checkpoint_steps(workdir) == [8, 16, 20]  # newest two + every 8th kept forever
    for _ in range(2):
        result = revtrain("eval", "--workdir", workdir, "--all")
        assert result.returncode == 0, result.stderr
    evals = [r["step"] for r in records(workdir, "eval")]
    assert sorted(evals) == [8, 16, 20]  # 20 from the end of training, 8 and 16 from the first --all only


@pytest.mark.slow  # make test-all: several full training processes
def test_corrupt_checkpoint_is_one_clear_error_and_others_survive(tmp_path):
    workdir = tmp_path / "run"
    run_train(workdir, "--gin", "train.checkpoint_every = 10")
    victims = [f for f in (workdir / "checkpoints" / "10" / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert victims
    for f in victims:  # the array data files
        f.write_bytes(b"garbage")
    result = revtrain("eval", "--workdir", workdir, "--step", 10)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "step 10" in result.stderr
    assert checkpoint_steps(workdir) == [10, 20]
    result = revtrain("eval", "--workdir", workdir, "--step", 20)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow  # make test-all: several full training processes
def test_resume_with_a_different_model_is_refused(tmp_path):
    workdir = tmp_path / "run"
    run_train(workdir, "--gin", "STEPS = 5")
    before = sorted(p.name for p in workdir.rglob("*"))
    result = subprocess.run(train_cmd(workdir, "--gin", "ReversibleTransformerLM.d_model = 64"), capture_output=True,
                            text=True, env=env(), timeout=300)
    assert result.returncode == 2
    assert "different model" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in workdir.rglob("*")) == before


@pytest.mark.slow  # make test-all: several full training processes
def test_relative_workdir_and_resume_on_a_different_device_count(tmp_path):
    """Saved on 4 devices at step 10, resumed on 1: losses match the 4-device continuation within 1e-5."""
    four = tmp_path / "four"
    run_train(four, "--gin", "train.checkpoint_every = 10", devices=4)
    mixed = tmp_path / "mixed"
    shutil.copytree(four, mixed)
    shutil.rmtree(mixed / "checkpoints" / "20")
    result = subprocess.run(train_cmd("mixed"), capture_output=True, text=True, env=env(1), cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "resumed from checkpoint at step 10" in result.stderr
    ref, got = losses(four), losses(mixed)
    for step in range(11, 21):
        assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), step


def test_a_leaf_larger_than_the_staging_limits_is_saved_and_restored(tmp_path, monkeypatch):
    """Orbax refuses a read or write of at least its staging limit; a save and a restore (whole, and the weights
    alone) raise it to the largest leaf, so a model whose largest leaf passes the limit (a 1.44 B Llama's resume
    failed so) restores bit for bit instead of being called damaged. Limits lowered to 64 KiB, a 256 KiB leaf."""
    import jax.numpy as jnp
    import optax
    from revtrain import checkpoint
    from revtrain.trainers.common import TrainState
    monkeypatch.setattr(checkpoint, "SAVE_STAGING_BYTES", 1 << 16)
    monkeypatch.setattr(checkpoint, "STAGING_BYTES", 1 << 16)
    params = [{"w": jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024)}, {"b": jnp.ones((8,), jnp.float32)}]
    ts = TrainState(3, params, [optax.adam(1e-3).init(p) for p in params], [{}, {}])
    saver = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
    assert saver.save(ts, None, {})
    saver.wait()
    for whole in (True, False):
        out = checkpoint.Checkpointer(str(tmp_path / "checkpoints")).restore(ts, optimizer_state=whole)
        assert out.step == 3
        assert np.asarray(out.params[0]["w"]).tobytes() == np.asarray(params[0]["w"]).tobytes()
        if whole:
            assert np.array_equal(np.asarray(out.opt_state[0][0].mu["w"]), np.zeros((64, 1024), np.float32))
