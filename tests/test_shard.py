"""Sharded state (``ReversibleTrainer.shard_state``): each of N devices holds 1/N of the large leaves of the
weights and optimizer state, and the run follows the replicated one bit for bit.

The measurements on 4 and 8 CPU devices run in subprocesses (``XLA_FLAGS`` must be set before JAX is
imported): this file is also the worker (``python tests/test_shard.py OUT.json``). Resuming across layouts
goes through the CLI: 4 steps sharded on 4 devices (checkpoints at 2 and 4), then a copy of that run resumed
from step 2 replicated on 2 devices, against the straight run. The two-process run (2 processes x 2 devices
over gloo) is in the slow tier.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, env, records_by_step, revtrain, run_worker

NUM_DEVICES = 4
DEPTH, D_MODEL, BATCH, STEPS = 3, 32, 8, 3


# ------------------------------------------------------------------------------------------------
# The worker (a fresh interpreter with NUM_DEVICES, or 8, CPU devices).
# ------------------------------------------------------------------------------------------------
def _worker(out_path: str, executors: str = "scan") -> None:
    """``executors``: the sharded runs to compare with the replicated one (comma-separated: ``scan``,
    ``per_layer``); make test runs ``scan``, the slow tier ``per_layer`` (and the two-block run, the default
    model's host bytes) in a second process; on another device count only the host bytes."""
    import jax
    import optax

    from revtrain.data import byte_lm, pipeline
    from revtrain.memory import host_state_bytes
    from revtrain.models import ReversibleTransformerLM
    from revtrain.placement import global_batch, make_mesh
    from revtrain.trainers import ReversibleTrainer

    ndev = len(jax.devices())
    mesh = make_mesh()
    out = {"devices": ndev}

    # host_state_bytes of the default model (configs/enwik_small.gin: 6 layers, d_model 128, AdamW), offload,
    # right after init (no program is compiled).
    def default_bytes(shard: bool) -> tuple[int, dict]:
        model = ReversibleTransformerLM(256, num_layers=6, d_model=128, num_heads=4)
        trainer = ReversibleTrainer(model, optax.adamw(1e-3, weight_decay=0.01), mesh, offload=True,
                                    shard_state=shard)
        ts = trainer.init()
        # The embedding matrix [256, 128] of the first layer: the piece each device holds.
        emb = [x for x in jax.tree.leaves(ts.params[0]) if x.ndim == 2][0]
        pieces = {"shape": list(emb.shape), "piece": list(emb.addressable_shards[0].data.shape),
                  "distinct": len({tuple((s.start, s.stop) for s in sh.index) for sh in emb.addressable_shards})}
        return host_state_bytes(ts), pieces

    if ndev != NUM_DEVICES or "per_layer" in executors.split(","):  # (the slow tier's: two inits of 6 layers)
        out["bytes_replicated"], _ = default_bytes(False)
        out["bytes_sharded"], out["embedding"] = default_bytes(True)
    if ndev != NUM_DEVICES:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
        return

    jax.config.update("jax_default_matmul_precision", "highest")
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=BATCH, seed=0))
    batches = [next(it) for _ in range(STEPS)]

    def train(**kwargs):
        model = ReversibleTransformerLM(128, num_layers=DEPTH, d_model=D_MODEL, dropout_rate=0.1)
        trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh, seed=0, offload=True, **kwargs)
        ts = trainer.init()
        losses = []
        for batch in batches:
            ts, metrics = trainer.train_step(ts, global_batch(batch, mesh))
            losses.append(metrics["loss"])
        evaluated = trainer.eval_step(ts, global_batch(batches[0], mesh))
        ts = ts.per_layer()
        leaves = [np.asarray(x) for x in jax.tree.leaves((ts.params, ts.opt_state))]
        return [float(x) for x in losses], leaves, float(evaluated["loss_sum"])

    # A stacked run of exactly two blocks, 2 examples per device: a stacked (2, 128, 32) weight has a local
    # activation's shape, and the offloaded programs must not alias the two (`TrainerBase._compiled`: this
    # once failed with "Memory kind mismatch").
    if "per_layer" in executors.split(","):  # the slow tier's process
        model = ReversibleTransformerLM(128, num_layers=2, d_model=D_MODEL, dropout_rate=0.1)
        trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh, seed=0, offload=True)
        ts, metrics = trainer.train_step(trainer.init(), global_batch(batches[0], mesh))
        out["two_block_run"] = {"groups": [list(g) for g in trainer.groups], "loss": float(metrics["loss"])}

        # The default run's model (a single-leaf token embedding layer, `layerwise.fence`), sharded state
        # against StandardTrainer, both on 4 devices, 8 steps (the clipped chain once differed from step 4):
        # AdamW (the fused update) and a clipped chain (the deferred update, its global norm built from each
        # sharded leaf's sum of squares).
        from test_exactness import _clip_adamw, _default_model

        from revtrain.trainers import StandardTrainer
        model, longer = _default_model(), batches + [next(it) for _ in range(5)]
        for case, make_tx in [("adamw", lambda: optax.adamw(1e-3, weight_decay=0.01)), ("clip", _clip_adamw)]:
            runs = {}
            for name, cls, kwargs in [("standard", StandardTrainer, {}),
                                      ("sharded", ReversibleTrainer, {"shard_state": True})]:
                trainer = cls(model, make_tx(), mesh, seed=0, **kwargs)
                ts, losses = trainer.init(), []
                for batch in longer:
                    ts, metrics = trainer.train_step(ts, global_batch(batch, mesh))
                    losses.append(float(metrics["loss"]))
                runs[name] = (losses, [np.asarray(x) for x in jax.tree.leaves(ts.per_layer().params)])
            (std_losses, std), (losses, leaves) = runs["standard"], runs["sharded"]
            out[f"default_model_{case}"] = {"losses": losses, "reference_losses": std_losses,
                                            "differing": sum(int((a != b).sum()) for a, b in zip(std, leaves))}

    reference = train()
    out["runs"] = {}
    for name, kwargs in {"scan": {}, "per_layer": {"scan_layers": False}}.items():
        if name not in executors.split(","):
            continue
        losses, leaves, evaluated = train(shard_state=True, **kwargs)
        out["runs"][name] = {
            "losses": losses, "reference_losses": reference[0],
            "bitwise": len(leaves) == len(reference[1]) and all(np.array_equal(a, b) for a, b in
                                                                  zip(leaves, reference[1])),
            "max_abs": max(float(np.max(np.abs(a - b))) for a, b in zip(leaves, reference[1])),
            "eval_equal": evaluated == reference[2]}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


def _run_worker(devices: int, data_dir: str, out: pathlib.Path, executors: str = "scan") -> dict:
    return run_worker(__file__, devices, out, executors, data_dir=data_dir)


@pytest.fixture(scope="module")
def results(byte_lm_data_dir, tmp_path_factory):
    return _run_worker(NUM_DEVICES, byte_lm_data_dir, tmp_path_factory.mktemp("shard") / "results.json")


@pytest.fixture(scope="module")
def per_layer_results(byte_lm_data_dir, tmp_path_factory):
    """The per-layer executor's sharded run against the replicated one (a second 4-device process)."""
    return _run_worker(NUM_DEVICES, byte_lm_data_dir, tmp_path_factory.mktemp("shard") / "per_layer.json",
                       "per_layer")


# ------------------------------------------------------------------------------------------------
# The tests.
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # in the per-layer executor's process
def test_offloaded_run_of_two_blocks_on_four_devices(per_layer_results):
    """Offload under the default ``scan_layers`` on a model of exactly two identical blocks, 4 devices: the
    streamed host tier runs them per layer (no stacked run, whose in-program moves once failed with "Memory
    kind mismatch"; that executor no longer offloads) and trains (finite loss)."""
    run = per_layer_results["two_block_run"]
    assert run["groups"] == [[0, 1], [1, 1], [2, 1], [3, 1]], run
    assert 5.0 < run["loss"] < 6.5, run  # near ln(256) = 5.55 at the start


@pytest.mark.slow  # in the per-layer executor's process
@pytest.mark.parametrize("case", ["adamw", "clip"])
def test_default_model_sharded_equals_backprop_bit_for_bit(per_layer_results, case):
    """The default run's model with sharded state on 4 devices, 8 steps of AdamW, and of a clipped chain:
    losses and every parameter equal StandardTrainer's bit for bit (the fenced update inside
    ``shard_map``; the clip's sums of squares over each whole leaf)."""
    run = per_layer_results[f"default_model_{case}"]
    assert run["losses"] == run["reference_losses"], run
    assert run["differing"] == 0, run


@pytest.mark.slow  # make test: shard_state's training and placement tests in this file
def test_host_state_bytes_four_devices(per_layer_results):
    """Default model, offload, 4 devices: each device holds at most 0.3x the replicated bytes."""
    results = per_layer_results
    ratio = results["bytes_sharded"] / results["bytes_replicated"]
    assert results["bytes_replicated"] > 2 * 2**20, results  # weights + AdamW moments of ~0.9M parameters
    assert ratio <= 0.3, f"sharded / replicated host bytes {ratio:.3f}"
    assert ratio >= 0.25, f"{ratio:.3f}: below 1/4, so something is missing from the count"
    # The embedding [256, 128] is split along its 256 rows: four distinct pieces of 64 rows.
    assert results["embedding"] == {"shape": [256, 128], "piece": [64, 128], "distinct": 4}


@pytest.mark.slow  # an 8-device process (make test keeps the 4-device one)
def test_host_state_bytes_eight_devices(byte_lm_data_dir, tmp_path):
    out = _run_worker(8, byte_lm_data_dir, tmp_path / "eight.json")
    ratio = out["bytes_sharded"] / out["bytes_replicated"]
    assert 0.125 <= ratio <= 0.16, f"sharded / replicated host bytes on 8 devices {ratio:.3f}"
    assert out["embedding"] == {"shape": [256, 128], "piece": [32, 128], "distinct": 8}


@pytest.mark.parametrize("executor", ["scan", pytest.param("per_layer", marks=pytest.mark.slow)])
def test_sharded_equals_replicated_bit_for_bit(request, executor):
    """4 devices, offload, Adam, dropout: losses, parameters, optimizer state and an evaluation equal the
    replicated run's bit for bit (the reduce-scatter adds the devices' gradients in the all-reduce's order
    on XLA:CPU)."""
    results = request.getfixturevalue("results" if executor == "scan" else "per_layer_results")
    run = results["runs"][executor]
    assert run["losses"] == run["reference_losses"], run
    assert run["bitwise"], f"largest difference {run['max_abs']:.3g}"
    assert run["eval_equal"]
    assert run["losses"][-1] < run["losses"][0]


@pytest.mark.parametrize("name", ["adafactor", "lamb", "clip_by_block_rms"])
def test_optimizers_that_need_the_whole_leaf_run_deferred(name):
    """With sharded state, an update that needs the whole leaf is not elementwise: the trainer runs it in
    the deferred update on whole leaves (tests/test_recipe.py compares LAMB and Adafactor with backprop)."""
    import jax
    import optax

    from revtrain.models import ReversibleTransformerLM
    from revtrain.placement import make_mesh
    from revtrain.trainers import ReversibleTrainer
    from revtrain.trainers.common import is_elementwise

    tx = {"adafactor": lambda: optax.adafactor(1e-3), "lamb": lambda: optax.lamb(1e-3),
          "clip_by_block_rms": lambda: optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-3))}[name]()
    assert not is_elementwise(tx)
    model = ReversibleTransformerLM(128, num_layers=2, d_model=32)
    assert ReversibleTrainer(model, tx, make_mesh(jax.devices()[:1]), shard_state=True).deferred


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum", "lion", "clip"])
def test_elementwise_optimizers_keep_the_fused_update(name):
    import optax

    from revtrain.trainers.common import is_elementwise

    tx = {"adam": lambda: optax.adam(1e-3), "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
          "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9), "lion": lambda: optax.lion(1e-4),
          "clip": lambda: optax.chain(optax.clip(0.1), optax.adam(1e-3))}[name]()
    assert is_elementwise(tx)


TINY = ["--config", str(REPO / "configs" / "enwik_small.gin"),
        "--gin", "ReversibleTransformerLM.num_layers = 2", "--gin", "ReversibleTransformerLM.d_model = 32",
        "--gin", "ReversibleTransformerLM.dropout_rate = 0.1", "--gin", "ReversibleTrainer.offload = True",
        "--gin", "train.batch_size = 8", "--gin", "train.log_every = 1", "--gin", "STEPS = 4", "--gin", "WARMUP = 2",
        "--gin", "train.sample_every = 0", "--gin", "train.checkpoint_every = 2"]
SHARD = ["--gin", "ReversibleTrainer.shard_state = True"]


def _cli(args: list, devices: int, data_dir: str, cwd) -> subprocess.CompletedProcess:
    return revtrain(*args, cwd=cwd, child_env=env(devices, data_dir, isolated=True))


@pytest.mark.slow  # two training processes on 4 and 2 devices
def test_resume_sharded_four_devices_on_two_replicated(byte_lm_data_dir, tmp_path):
    """4 steps sharded on 4 devices; a copy of the run resumed from its step-2 checkpoint replicated on 2
    devices: the losses of steps 3-4 equal the straight run's within 1e-5; host_state_bytes is reported."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = _cli(["train", *TINY, *SHARD, "--workdir", str(straight)], 4, byte_lm_data_dir, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shard_lines = [line for line in proc.stderr.splitlines() if line.startswith("shard_state: ")]
    assert len(shard_lines) == 1 and "split over 4 devices" in shard_lines[0], proc.stderr[-3000:]
    assert sorted(p.name for p in (straight / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    proc = _cli(["train", *TINY, "--workdir", str(resumed)], 2, byte_lm_data_dir, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from checkpoint at step 2" in proc.stderr
    assert not any(line.startswith("shard_state: ") for line in proc.stderr.splitlines())  # replicated
    a, b = records_by_step(straight), records_by_step(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    np.testing.assert_allclose([b[s]["loss"] for s in (3, 4)], [a[s]["loss"] for s in (3, 4)], rtol=1e-5)
    assert a[4]["host_state_bytes"] > 0 and a[4]["devices"] == 4
    assert b[4]["devices"] == 2 and b[4]["host_state_bytes"] > a[4]["host_state_bytes"]  # replicated again


@pytest.mark.slow
def test_two_processes_sharded_equal_one_process_replicated(byte_lm_data_dir, tmp_path):
    """2 processes x 2 devices (gloo), sharded with offload, each process holding its devices' pieces: the
    losses equal 1 process x 4 devices replicated within 1e-6 relative; then the two-process run's step-2
    checkpoint resumes in one process (4 devices, sharded) within 1e-5 of the straight run."""
    from test_multihost import _Procs

    from helpers import free_port

    reference, multi, single = tmp_path / "reference", tmp_path / "multi", tmp_path / "single"
    # Three blocks: with offload, a stacked run of exactly two blocks fails on 4 replicated CPU devices
    # ("Memory kind mismatch", also without shard_state).
    tiny = [*TINY, "--gin", "ReversibleTransformerLM.num_layers = 3"]
    proc = _cli(["train", *tiny, "--workdir", str(reference)], 4, byte_lm_data_dir, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    procs, port = _Procs(tmp_path), free_port()
    for i in range(2):
        procs.start(f"multi.p{i}", ["train", *tiny, *SHARD, "--workdir", str(multi), "--coordinator_address",
                                    f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)],
                    env(2, byte_lm_data_dir, isolated=True))
    results = procs.wait(600)
    for i, (code, log) in enumerate(results):
        assert code == 0, f"process {i} exited {code}:\n{log[-4000:]}"
    a, b = records_by_step(reference), records_by_step(multi)
    np.testing.assert_allclose([b[s]["loss"] for s in range(1, 5)], [a[s]["loss"] for s in range(1, 5)], rtol=1e-6)
    assert b[4]["processes"] == 2 and 0 < b[4]["host_state_bytes"] < a[4]["host_state_bytes"]
    shutil.copytree(multi, single)
    shutil.rmtree(single / "checkpoints" / "4")
    proc = _cli(["train", *tiny, *SHARD, "--workdir", str(single)], 4, byte_lm_data_dir, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    c = records_by_step(single)
    assert c[4]["processes"] == 1
    np.testing.assert_allclose([c[s]["loss"] for s in (3, 4)], [b[s]["loss"] for s in (3, 4)], rtol=1e-5)


if __name__ == "__main__":
    _worker(*sys.argv[1:])
