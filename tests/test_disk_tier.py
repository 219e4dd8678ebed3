"""The disk tier (revtrain/tiers/disk*.py, ``ReversibleTrainer.offload = 'disk'``): bit for bit the host and device
tiers' numbers, its refusals, checkpoints as hard links, an exact resume after ``kill -9`` in a step, the plan's
disk check, and a model larger than its memory cgroup."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from revtrain import checkpoint as ckpt_lib
from revtrain.tiers import disk_format
from revtrain.tiers import disk_links
from revtrain.tiers import disk_probes
from revtrain.tiers.disk import DiskTier
from revtrain.placement import global_batch, make_mesh
from revtrain.errors import ConfigError
from revtrain.trainers.common import TrainerError
from revtrain.trainers.reversible import ReversibleTrainer

from helpers import REPO, env, in_cgroup, make_memory_cgroup, revtrain, revtrain_here, run_worker
from helpers import losses as logged_losses
from helpers import records_by_step, tiny_model, train_steps

LLAMA = str(REPO / "configs" / "llama_small.gin")
T = 16


def _model(layers=4):
    return tiny_model(layers, sequence_length=T)


def _batches(steps):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (4, T)).astype(np.int32) for _ in range(steps)]


def _train(offload, directory=None, steps=3, fuse_top=False):
    trainer = ReversibleTrainer(_model(), optax.adamw(1e-3), make_mesh(), seed=0, offload=offload, scan_layers=False,
                                fuse_top=fuse_top, offload_dir=directory)
    batches = [{"inputs": x, "targets": x} for x in _batches(steps)]
    ts, history = train_steps(trainer, batches)
    losses = [h["loss"] for h in history]
    scores = {k: float(v) for k, v in trainer.eval_step(ts, global_batch(batches[-1], trainer.mesh)).items()}
    params = [jax.tree.map(np.asarray, trainer.layer_params(ts, i)) for i in range(len(trainer.model.layers))]
    return trainer, ts, losses, params, scores


def _same(a, b):
    return all(np.array_equal(u, v) for p, q in zip(a, b) for u, v in zip(jax.tree.leaves(p), jax.tree.leaves(q)))


@pytest.mark.slow  # make test: test_recipe_on_every_tier_bit_for_bit, test_streaming's ten steps on every tier
@pytest.mark.parametrize("fuse_top", [False, True])
def test_bit_equal_to_the_device_tier(tmp_path, fuse_top):
    """The disk tier's losses, weights and evaluation are the device tier's, bit for bit (the host tier's too:
    tests/test_streaming.py, every tier over ten steps), and it reads and writes each layer once a step."""
    _, _, dev_losses, dev_params, dev_scores = _train(False, fuse_top=fuse_top)
    trainer, ts, losses, params, scores = _train("disk", str(tmp_path / "tier"), fuse_top=fuse_top)
    assert losses == dev_losses
    assert _same(params, dev_params)
    assert scores == dev_scores
    # Only the newest step's files are left; the state holds no arrays, only the layer files.
    assert sorted(os.listdir(tmp_path / "tier")) == ["step_00000003"]
    assert all(isinstance(r, disk_format.DiskLayer) for r in ts.params)
    assert trainer.store_stats["disk_write_bytes"] == sum(r.layout.nbytes() for r in ts.params)
    # Each layer read once in the forward (weights; not the head, nor with fuse_top the layer under it) and once in
    # the backward (weights and optimizer state): the read-ahead never reads a layer twice.
    forward = ts.params[:-2] if fuse_top else ts.params[:-1]
    assert trainer.store_stats["disk_read_bytes"] == (sum(r.layout.nbytes("params") for r in forward)
                                                     + trainer.store_stats["disk_write_bytes"])


@pytest.mark.slow  # make test: a budget on every tier (test_budget), the recipe on every tier
@pytest.mark.parametrize("deferred", [False, True])
def test_bit_equal_under_a_plan_mixing_all_three_modes(tmp_path, deferred):
    """The disk tier's read-ahead follows a budget's plan: 1 block rematerialised, 1 rebuilt, 2 backprop'd
    inside the head's program give the device tier's losses and weights bit for bit (also with the deferred
    update: clip_by_global_norm and 2 microbatches, the buffers of the head's program's blocks in files)."""
    from revtrain.trainers.modes import BACKPROP, REBUILDS, REMAT
    runs = []
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3)) if deferred else optax.adamw(1e-3)
    for offload, directory in ((False, None), ("disk", str(tmp_path / "tier"))):
        trainer = ReversibleTrainer(_model(), tx, make_mesh(), seed=0, offload=offload, scan_layers=False,
                                    offload_dir=directory, microbatches=2 if deferred else 1)
        assert trainer.deferred == deferred
        trainer.set_block_modes([REMAT, REMAT, REBUILDS["exact"], BACKPROP, BACKPROP])
        ts, losses = trainer.init(), []
        for x in _batches(3):
            ts, m = trainer.train_step(ts, global_batch({"inputs": x, "targets": x}, trainer.mesh))
            losses.append(float(m["loss"]))
        runs.append((losses, [jax.tree.map(np.asarray, trainer.layer_params(ts, i))
                              for i in range(len(trainer.model.layers))]))
    assert runs[0][0] == runs[1][0]
    assert _same(runs[0][1], runs[1][1])


# The standard language-model recipe: a tied embedding/head, global-norm clipping, 2 microbatches (the deferred
# update, its gradient buffer in files).
RECIPE_GIN = ["RMSNormLanguageModelHead.tie_embedding = True", "NUM_LAYERS = 2", "D_MODEL = 32"]


def _recipe_train(offload, directory, batches, trainer_cls=ReversibleTrainer, mesh=None, **more):
    """The recipe's steps (one per batch) on the modern tied model (enwik_modern.gin at d_model 32) on
    ``mesh`` (default: one device): losses, grad norms, every layer's params (numpy, the tied table in the
    head's too), an evaluation's scores, the trainer and the state. ``more``: other trainer arguments."""
    import gin

    import revtrain.registry  # noqa: F401  (the gin names of the modern parts)
    from revtrain.models.compose import ComposedModel
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO / "configs"))
    gin.parse_config_files_and_bindings([str(REPO / "configs" / "enwik_modern.gin")], RECIPE_GIN)
    try:
        mesh = mesh or make_mesh(jax.devices()[:1])
        tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3))
        with jax.default_matmul_precision("highest"):
            model = ComposedModel(seed=0, d_model=32, input_key="inputs", sequence_length=128)
            kwargs = {} if trainer_cls is not ReversibleTrainer else {
                "offload": offload, "offload_dir": directory, **more}
            trainer = trainer_cls(model, tx, mesh, seed=0, microbatches=2, **kwargs)
            ts, losses, norms = trainer.init(), [], []
            for b in batches:
                ts, m = trainer.train_step(ts, global_batch(b, mesh))
                losses.append(float(m["loss"]))
                norms.append(float(m["grad_norm"]))
            scores = {k: float(v) for k, v in trainer.eval_step(ts, global_batch(batches[0], mesh)).items()}
            params = [jax.tree.map(np.asarray, trainer.layer_params(ts, i)) for i in range(len(model.layers))]
    finally:
        gin.clear_config()
    return losses, norms, params, scores, trainer, ts


def test_recipe_on_every_tier_bit_for_bit(tmp_path, text_batches):
    """clip_by_global_norm(0.5) + AdamW, 2 microbatches and a tied embedding/head over 10 steps of real text,
    the default ``scan_layers``: the host tier (its gradient buffer in the host store) and the disk tier (in
    files), both streamed per layer, give the device tier's losses, gradient norms, every parameter leaf and
    evaluation bit for bit; both move exactly `disk_probes.deferred_io`'s bytes (the same schedule); the disk
    tier leaves only the newest step's layer files; the table is held once (in the embedding's file)."""
    batches = text_batches(8, 10)
    device = _recipe_train(False, None, batches)
    host = _recipe_train(True, None, batches)
    disk = _recipe_train("disk", str(tmp_path / "tier"), batches)
    assert disk[4].deferred and disk[4].layerwise.rounds == 1 and disk[4].model.ties
    assert any(count > 1 for _, count in device[4].groups)  # (the device tier's scanned run; the others per layer)
    assert all(count == 1 for _, count in host[4].groups + disk[4].groups)
    assert sum(n > 0.5 for n in host[1]) >= 5, host[1]  # the clip is active
    for tier in (host, disk):
        assert tier[0] == device[0] and tier[1] == device[1] and tier[3] == device[3]
        assert _same(tier[2], device[2])
    assert host[0][-1] < host[0][0] - 0.5  # it trains
    refs = disk[5].params
    assert sorted(os.listdir(tmp_path / "tier")) == ["step_00000010"]
    assert sorted(os.listdir(tmp_path / "tier" / "step_00000010")) == [f"layer_{g:05d}.bin" for g in range(4)]
    assert "embedding" not in str(refs[-1].layout.params_def) and "embedding" in str(refs[0].layout.params_def)
    weights, opt = (sum(r.layout.nbytes(p) for r in refs) for p in ("params", "opt"))
    held = refs[0].layout.nbytes("params") if disk[4].residency.store.depth >= 1 else 0  # (the first buffer kept)
    read, write = disk_probes.deferred_io(weights, opt, refs[-1].layout.nbytes("params"), refs[0].layout.nbytes("params"),
                                        2, 2, held)
    assert (disk[4].store_stats["disk_read_bytes"], disk[4].store_stats["disk_write_bytes"]) == (read, write)
    assert (host[4].store_stats["host_read_bytes"], host[4].store_stats["host_write_bytes"]) == (read, write)


def test_refusals(tmp_path):
    mesh, tx = make_mesh(), optax.adamw(1e-3)
    with pytest.raises(TrainerError, match="False, True or 'disk'"):
        ReversibleTrainer(_model(), tx, mesh, offload="nvme")
    trainer = ReversibleTrainer(_model(), tx, mesh, offload="disk", scan_layers=False)
    with pytest.raises(ConfigError, match="offload_dir"):
        trainer.init()


def test_checkpoint_is_hard_links_and_restores(tmp_path):
    trainer, ts, _, params, _ = _train("disk", str(tmp_path / "tier"), steps=2)
    checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "run"))
    assert checkpointer.save(ts, None, {"x": 1})
    checkpointer.wait()
    item = tmp_path / "run" / "checkpoints" / "2" / "disk_state"
    for g, ref in enumerate(ts.params):
        linked = os.stat(item / f"layer_{g:05d}.bin")
        assert linked.st_ino == os.stat(ref.path).st_ino and linked.st_nlink == 2  # no byte copied
    restored = checkpointer.restore(trainer.abstract_state())
    assert restored.step == 2 and all(isinstance(r, disk_format.DiskLayer) for r in restored.params)
    assert _same([trainer.layer_params(restored, i) for i in range(len(params))], params)
    weights = checkpointer.restore(trainer.abstract_state(), optimizer_state=False)
    assert _same(weights.params, params) and weights.opt_state == [None] * len(params)
    # A damaged file (a truncated layer) is one line naming the step.
    os.truncate(item / "layer_00001.bin", 100)
    with pytest.raises(ckpt_lib.DamagedCheckpoint, match="at step 2"):
        checkpointer.restore(trainer.abstract_state())
    checkpointer.close()


def test_an_orbax_checkpoint_gives_a_disk_tier_its_weights_and_refuses_its_resume(tmp_path):
    """A checkpoint of a memory tier (Orbax's arrays) read for a disk-tier trainer: its weights alone, into memory,
    bit for bit (the template's files become the weights' shapes, `Tier.array_template`); a resume (the optimizer
    state too) is refused in one line naming the array tiers' values (from the registry)."""
    _, ts, _, params, _ = _train(False, steps=1)
    checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "run"))
    assert checkpointer.save(ts, None, {"x": 1})
    checkpointer.wait()
    disk = ReversibleTrainer(_model(), optax.adamw(1e-3), make_mesh(), seed=0, offload="disk", scan_layers=False,
                             offload_dir=str(tmp_path / "tier"))
    weights = checkpointer.restore(disk.abstract_state(), optimizer_state=False)
    assert weights.step == 1 and _same(weights.params, params) and weights.opt_state == [None] * len(params)
    with pytest.raises(ckpt_lib.CheckpointError,
                       match=r"resume it with ReversibleTrainer.offload = False or True \(the disk tier resumes its own"):
        checkpointer.restore(disk.abstract_state())
    checkpointer.close()


def test_checksums_find_a_flipped_byte_on_read(tmp_path, capfd):
    """Each leaf's checksum is made as the file is written and checked on every read: a flipped byte is one line
    naming the file, from a step's read, the export's `layer_weights` and a checkpoint's restore; a checkpoint
    without checksums (written before them) restores unverified with a note."""
    trainer, ts, _, _, _ = _train("disk", str(tmp_path / "tier"), steps=2)
    ref = ts.params[1]
    assert ref.sums is not None and len(ref.sums) == len(ref.layout.shapes)
    checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "run"))
    assert checkpointer.save(ts, None, {"x": 1})
    checkpointer.wait()
    item = tmp_path / "run" / "checkpoints" / "2" / "disk_state"
    index = json.loads((item / disk_links.INDEX).read_text())
    assert index["layers"][1][disk_format.CHECKSUM] == [f"{x:016x}" for x in ref.sums]
    # One byte of the second weight leaf flipped (the checkpoint's file is the live file: one inode).
    with open(item / "layer_00001.bin", "r+b") as f:
        f.seek(ref.layout.offsets[1] + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    why = f"{ref.path}: weight leaf 1 does not match its xxh3_64 checksum"
    with pytest.raises(disk_format.DamagedFile, match=why):
        disk_format.read_leaves(ref.path, ref.layout, "params", sums=ref.sums)
    with pytest.raises(disk_format.DamagedFile, match=why):
        trainer.residency.layer_weights(ts.params)[1]
    with pytest.raises(disk_format.DamagedFile, match=why):
        trainer.train_step(ts, global_batch({"inputs": _batches(1)[0], "targets": _batches(1)[0]}, trainer.mesh))
    damaged = r"at step 2 cannot be restored: DamagedFile: .*layer_00001.bin: weight leaf 1 "
    with pytest.raises(ckpt_lib.DamagedCheckpoint, match=damaged):
        checkpointer.restore(trainer.abstract_state())
    disk_format.read_leaves(ref.path, ref.layout, "opt", sums=ref.sums)  # the other leaves are intact
    # A checkpoint of before checksums: read unverified, with a note.
    for entry in index["layers"]:
        entry.pop(disk_format.CHECKSUM)
    (item / disk_links.INDEX).write_text(json.dumps(index))
    capfd.readouterr()
    restored = checkpointer.restore(trainer.abstract_state())
    assert restored.step == 2 and all(r.sums is None for r in restored.params)
    n = len(ts.params)
    assert (f"has no checksums for {n} of its {n} layer files (written before they existed): those are read "
            "unverified") in capfd.readouterr().err
    checkpointer.close()


def _revtrain(*args, script=None, prefix=(), timeout=300):
    if script is None:
        return revtrain(*args, prefix=prefix, timeout=timeout)
    return subprocess.run([*prefix, sys.executable, script, *args], capture_output=True, text=True, env=env(),
                          timeout=timeout)


DISK = ["--gin", "train.trainer = @ReversibleTrainer", "--gin", "ReversibleTrainer.offload = 'disk'",
        "--gin", "ReversibleTrainer.scan_layers = False", "--gin", "LlamaModel.form = 'exact'",
        "--gin", "WARMUP = 1", "--gin", "train.batch_size = 2", "--gin", "train.log_every = 1",
        "--gin", "evaluate.max_batches = 1", "--gin", "train.sample_every = 0", "--gin", "train.checkpoint_every = 1",
        "--gin", "train.keep_checkpoints = 2", "--gin", "LlamaModel.d_model = 64", "--gin", "LlamaModel.d_ff = 128"]


def _final_params(workdir, step):
    item = workdir / "checkpoints" / str(step) / "disk_state"
    return {name: (item / name).read_bytes() for name in sorted(os.listdir(item)) if name.endswith(".bin")}


@pytest.mark.slow
def test_kill_9_in_a_step_resumes_bit_exact(tmp_path):
    """A run killed (SIGKILL) while step 3 writes its layers (one file half written) resumes from the step-2
    checkpoint and ends with the uninterrupted run's losses and layer files, byte for byte."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    steps = ["--gin", "STEPS = 4"]
    result = _revtrain("train", "--config", LLAMA, *DISK, *steps, "--workdir", str(whole))
    assert result.returncode == 0, result.stderr[-2000:]
    layers = len([n for n in os.listdir(whole / "offload" / "step_00000004")])
    killed = _revtrain(str(3 * layers + layers // 2), "--", "train", "--config", LLAMA, *DISK, *steps, "--workdir",
                       str(broken), script=str(REPO / "tests" / "_kill_inside.py"))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(os.listdir(broken / "checkpoints")) == ["1", "2"]
    assert os.path.isdir(broken / "offload" / "step_00000003")  # the killed step's partial files
    resumed = _revtrain("train", "--config", LLAMA, *DISK, *steps, "--workdir", str(broken))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from checkpoint at step 2" in resumed.stderr
    assert logged_losses(broken) == logged_losses(whole)
    assert _final_params(broken, 4) == _final_params(whole, 4)
    assert sorted(os.listdir(broken / "offload")) == ["step_00000004"]  # the leftovers removed


# The recipe from the command line: the modern tied model (4 layers), clip 0.5, 2 microbatches, a checkpoint every 2.
RECIPE = ["--config", str(REPO / "configs" / "enwik_modern.gin"), *sum((["--gin", g] for g in RECIPE_GIN), []),
          "--gin", "train.clip_global_norm = 0.5", "--gin", "train.microbatches = 2", "--gin", "train.batch_size = 8",
          "--gin", "STEPS = 4", "--gin", "WARMUP = 1", "--gin", "train.log_every = 1",
          "--gin", "train.checkpoint_every = 2", "--gin", "train.sample_every = 0", "--gin", "evaluate.max_batches = 1",
          "--gin", "ReversibleTrainer.offload = 'disk'", "--gin", "ReversibleTrainer.scan_layers = False"]


@pytest.mark.slow
def test_recipe_killed_in_a_step_resumes_bit_exact(tmp_path, monkeypatch, capsys):
    """The recipe on the disk tier killed (SIGKILL) in step 3, after the step-2 checkpoint: once while a
    gradient buffer file of its second microbatch is half written, once while a layer file of its update
    is; each rerun resumes from the step-2 checkpoint and ends with the uninterrupted run's losses and
    gradient norms and its final layer files byte for byte, the killed step's files (buffers included)
    removed. A streamed sample of the tied model is its held sample."""
    from revtrain import cli, generate_weights
    whole = tmp_path / "whole"
    result = _revtrain("train", *RECIPE, "--workdir", str(whole), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    layers = len(os.listdir(whole / "offload" / "step_00000004"))
    per_step = 2 * layers + layers  # each microbatch's buffer files, then the layer files
    before = layers + 2 * per_step  # the initial files and steps 1-2
    for name, write in (("grad", before + layers + 2), ("layer", before + 2 * layers + 2)):
        broken = tmp_path / name
        killed = _revtrain(str(write), "--", "train", *RECIPE, "--workdir", str(broken),
                           script=str(REPO / "tests" / "_kill_inside.py"), timeout=600)
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert sorted(os.listdir(broken / "checkpoints")) == ["2"]
        grads = broken / "offload" / "step_00000003" / "grads"
        assert os.path.isdir(grads) and os.listdir(grads)  # the killed step's buffer files
        resumed = _revtrain("train", *RECIPE, "--workdir", str(broken), timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "resumed from checkpoint at step 2" in resumed.stderr
        assert logged_losses(broken) == logged_losses(whole)
        assert records_by_step(broken)[4]["grad_norm"] == records_by_step(whole)[4]["grad_norm"]
        assert _final_params(broken, 4) == _final_params(whole, 4)
        assert sorted(os.listdir(broken / "offload")) == ["step_00000004"]
    samples = []
    for stream in (False, True):
        if stream:
            monkeypatch.setattr(generate_weights, "host_limit", lambda: (1, "a test limit"))
        out = tmp_path / f"sample_{stream}.txt"
        assert cli.main(["sample", "--workdir", str(whole), "--temperature", "0", "--length", "12", "--prompt", "The ",
                         "--output", str(out)]) == 0
        samples.append(out.read_bytes())
    assert "sampling streams the disk tier's weights layer by layer" in capsys.readouterr().err
    assert samples[0] == samples[1] and len(samples[0]) > 4


@pytest.mark.slow  # make test: checksums find a flipped byte; a damaged newest checkpoint is skipped (test_reliability)
def test_a_flipped_byte_sets_the_checkpoint_aside_and_the_run_resumes_from_the_one_before(tmp_path, capfd):
    """One byte flipped in a weight leaf of the newest checkpoint's layer file: the rerun says so in one line
    naming the file, sets that checkpoint aside, resumes from the one before and ends with the uninterrupted
    run's losses and layer files, byte for byte."""
    workdir = tmp_path / "run"
    args = ["train", "--config", LLAMA, *DISK, "--gin", "STEPS = 3", "--workdir", str(workdir)]
    result = revtrain_here(capfd, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    whole, files = logged_losses(workdir), _final_params(workdir, 3)
    item = workdir / "checkpoints" / "3" / "disk_state"
    entry = json.loads((item / disk_links.INDEX).read_text())["layers"][2]
    with open(item / entry["file"], "r+b") as f:  # the middle of its first weight leaf
        (shape, dtype, offset) = entry["leaves"][0]
        f.seek(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    result = revtrain_here(capfd, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "damaged" in line]
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("skipping the damaged checkpoint at step 3 (DamagedFile: ")
    assert f"{item / entry['file']}: weight leaf 0 does not match its xxh3_64 checksum" in lines[0]
    assert f"moved it to {workdir / 'damaged_checkpoints' / '3'}" in lines[0]
    assert "resumed from checkpoint at step 2" in result.stderr
    assert logged_losses(workdir) == whole
    assert _final_params(workdir, 3) == files


# A 126 M-parameter Llama of 20 exact reversible blocks: 1.41 GiB of weights and AdamW state.
BIG = ["--gin", "LlamaModel.d_model = 768", "--gin", "LlamaModel.num_layers = 20", "--gin", "LlamaModel.d_ff = 2048",
       "--gin", "LlamaModel.num_heads = 12", "--gin", "LlamaModel.num_kv_heads = 4", "--gin", "train.keep_checkpoints = 1"]


@pytest.mark.slow
def test_state_larger_than_its_memory_cgroup(tmp_path):
    """Inside a 1.25 GiB memory cgroup, a model with 1.41 GiB of weights and optimizer state trains with the disk
    tier (peak resident well below the limit), is killed (SIGKILL) in its second step and resumes exactly; the host tier there is refused by the plan
    (exit 2, one line naming the disk tier), never killed."""
    group = make_memory_cgroup(1280 * 2**20)
    wrapper = in_cgroup(group)
    try:
        def train(workdir, *extra, script=None):
            args = ("train", "--config", LLAMA, *DISK, *BIG, "--gin", "STEPS = 2", *extra, "--workdir", str(workdir))
            return _revtrain(*((str(22 + 22 + 11), "--") if script else ()), *args, script=script, prefix=wrapper,
                             timeout=600)
        whole = train(tmp_path / "whole")
        assert whole.returncode == 0, whole.stderr[-2000:]
        killed = train(tmp_path / "split", script=str(REPO / "tests" / "_kill_inside.py"))  # in step 2
        assert killed.returncode in (-9, 137), killed.stderr[-2000:]
        second = train(tmp_path / "split")
        assert second.returncode == 0, second.stderr[-2000:]
        host = train(tmp_path / "host", "--gin", "ReversibleTrainer.offload = True",
                     "--gin", "ReversibleTrainer.scan_layers = True")
        failcnt = int((group / "memory.failcnt").read_text())
    finally:
        group.rmdir()
    assert "resumed from checkpoint at step 1" in second.stderr
    assert logged_losses(tmp_path / "split") == logged_losses(tmp_path / "whole")
    assert _final_params(tmp_path / "split", 2) == _final_params(tmp_path / "whole", 2)
    with open(tmp_path / "whole" / "metrics" / "train.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert records[0]["plan_disk_bytes"] > 1280 * 2**20 > max(r["host_peak_bytes"] for r in records)
    assert records[-1]["disk_write_bytes"] == records[0]["plan_io_write_bytes"]
    assert records[-1]["disk_read_bytes"] == records[0]["plan_io_read_bytes"]
    assert failcnt == 0  # the kernel never had to reclaim to keep the group under its limit
    assert host.returncode == 2, host.stderr[-2000:]
    lines = host.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("revtrain: error: the memory plan does not fit"), host.stderr
    assert "ReversibleTrainer.offload = 'disk'" in lines[0]
    assert not (tmp_path / "host").exists()


def test_plan_parts_of_the_disk_tier(tmp_path):
    from revtrain import planning
    model, tx = _model(), optax.adamw(1e-3)
    spec = {k: jax.ShapeDtypeStruct((4, T), np.int32) for k in ("inputs", "targets")}
    limits = {"host": (2**50, "test")}
    disk = {"keep": 2, "every": 5}
    tier = DiskTier(make_mesh(jax.devices()[:1]), directory=str(tmp_path / "offload"))  # (the plan asks it)
    plan = planning.plan(model, planning.Setup("reversible", tx, 4, tier=tier, label="d"), spec, 1,
                            limits=limits, platform="cpu", store=disk)
    layers = [disk_format.Layout.of(layer.param_shapes, jax.eval_shape(tx.init, layer.param_shapes)) for layer in model.layers]
    weights = sum(lay.nbytes("params") for lay in layers)
    opt = sum(lay.nbytes("opt") for lay in layers)
    host = plan.tiers["host"]
    # In memory: three layers in flight (computing, read ahead, written), never the model.
    assert host["weights"] == 3 * max(lay.nbytes("params") for lay in layers)
    assert host["optimizer_state"] == 3 * (max(lay.nbytes() for lay in layers) - max(lay.nbytes("params") for lay in layers))
    assert host["checkpoint"] == 0  # a checkpoint is hard links
    # On disk: two steps' files, and two kept checkpoints the tier has moved past.
    assert plan.tiers["disk"] == {"weights": 2 * weights, "optimizer_state": 2 * opt, "checkpoint": 2 * (weights + opt)}
    # The floor (shapes alone, nothing compiled) holds the disk tier whole: a disk too small is refused from it.
    low = planning.floor(model, plan.setup, spec, 1, limits=limits, platform="cpu", store=disk)
    assert low.tiers["disk"] == plan.tiers["disk"]
    assert plan.io["read_bytes"] == 2 * weights + opt - layers[-1].nbytes("params")
    assert plan.io["write_bytes"] == weights + opt
    assert plan.limits["disk"] > 0 and "disk I/O a step" in plan.line()
    every_step = planning.plan(model, planning.Setup("reversible", tx, 4, tier=tier, label="d"), spec, 1,
                                  limits=limits, platform="cpu", store=dict(disk, every=1))
    assert every_step.tiers["disk"]["checkpoint"] == weights + opt  # the newest shares the live files
    short = planning.plan(model, planning.Setup("reversible", tx, 4, tier=tier, label="d"), spec, 1,
                             limits=dict(limits, disk=(1000, "test")), platform="cpu", store=disk)
    assert not short.fits and "keep_checkpoints" in planning.refusal(short, [])


def test_the_bandwidth_is_not_probed_on_a_nearly_full_disk(tmp_path, monkeypatch):
    """With less than twice the probe's bytes free, nothing is written to measure the disk; the plan line says
    the bandwidth was not measured, and gives no I/O time."""
    import shutil

    from revtrain import planning
    real = shutil.disk_usage
    monkeypatch.setattr(disk_probes.shutil, "disk_usage", lambda p: real(p)._replace(free=disk_probes.BANDWIDTH_BYTES))
    measured = disk_probes.bandwidth(str(tmp_path), cache=None)
    assert measured == {"read": None, "write": None, "source": "not measured: too little free space"}
    assert list(tmp_path.iterdir()) == []
    spec = {k: jax.ShapeDtypeStruct((4, T), np.int32) for k in ("inputs", "targets")}
    tier = DiskTier(make_mesh(jax.devices()[:1]), directory=str(tmp_path / "offload"))
    tier.bandwidth = lambda: measured  # (the directory's figure: its cached one is another disk's)
    plan = planning.plan(_model(), planning.Setup("reversible", optax.adamw(1e-3), 4, tier=tier, label="d"),
                            spec, 1, limits={"host": (2**50, "test"), "disk": (2**40, "test")}, platform="cpu")
    assert "(bandwidth not measured: too little free space)" in plan.line() and " s a step" not in plan.line()


def _on_small_tmpfs(tmp_path, *argvs):
    """Each ``revtrain train`` argv run with its workdir on an 8 MiB tmpfs (skips where none can be mounted)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        return small, [_revtrain("train", "--config", LLAMA, *DISK, *argv, "--workdir", str(small / "run"))
                       for argv in argvs]
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_disk_too_small_is_refused_at_start_up(tmp_path):
    """A workdir on an 8 MiB file system, a model whose two steps' layer files and kept checkpoint need more: one
    line, exit 2, before anything is written, from shapes alone (the floor holds the disk tier whole: no program
    is compiled, no other trainer choice planned)."""
    small, (result,) = _on_small_tmpfs(tmp_path, ["--gin", "STEPS = 2"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("revtrain: error: the memory plan does not fit: ReversibleTrainer + offload='disk' "
                               "disk needs at least"), lines[0]
    assert "checkpoint" in lines[0], lines[0]
    assert f"free on {small}" in lines[0]


@pytest.mark.slow
def test_a_full_disk_without_the_plan_stops_in_one_line(tmp_path):
    """Without the plan the disk fills while the layers are written: one line, exit 1, nothing half-kept."""
    _, (unplanned,) = _on_small_tmpfs(tmp_path, ["--gin", "STEPS = 5", "--gin", "train.memory_plan = False"])
    assert unplanned.returncode == 1, unplanned.stderr[-2000:]
    last = unplanned.stderr.strip().splitlines()[-1]
    assert "No space left on device" in last and "training stopped" in last, unplanned.stderr[-2000:]


# -- the readers of a disk-tier checkpoint: streamed from its files, read-only --------------------------------

def _files_state(directory):
    """(name, inode, size, mtime_ns, bytes) of every file under ``directory``: what a reader must not change."""
    out = []
    for root, _, names in sorted(os.walk(directory)):
        for name in sorted(names):
            path = os.path.join(root, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                out.append((os.path.relpath(path, directory), st.st_ino, st.st_size, st.st_mtime_ns, f.read()))
    return out


@pytest.mark.slow  # make test: the hard-linked checkpoint's restore
def test_readers_restore_the_checkpoint_files_read_only(tmp_path):
    """``files=True``: the weights as the checkpoint's own files, nothing of them read; the streamed evaluation
    and the held / streamed samples equal those of the weights read into memory (today's readers) bit for bit,
    and no file of the checkpoint or of the tier changes."""
    from revtrain import generate, generate_weights
    trainer, ts, _, params, _ = _train("disk", str(tmp_path / "tier"), steps=2)
    checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "run"))
    assert checkpointer.save(ts, None, {"x": 1})
    checkpointer.wait()
    before = _files_state(tmp_path / "run"), _files_state(tmp_path / "tier")
    weights = checkpointer.restore(trainer.abstract_state(), optimizer_state=False)  # in memory (numpy)
    files = checkpointer.restore(trainer.abstract_state(), optimizer_state=False, files=True)
    item = str(tmp_path / "run" / "checkpoints" / "2" / "disk_state")
    assert [os.path.dirname(r.path) for r in files.params] == [item] * len(params)
    assert files.opt_state == [None] * len(params)
    x = _batches(1)[0]
    batch = global_batch({"inputs": x, "targets": x}, trainer.mesh)
    streamed = {k: float(v) for k, v in trainer.eval_step(files, batch).items()}
    assert streamed == {k: float(v) for k, v in trainer.eval_step(weights, batch).items()}
    # Greedy and seeded samples, past the context (T = 16: re-encoded windows): held and streamed are the same.
    opts = generate.Options(length=24, temperature=0.0)
    seeded = generate.Options(length=24, temperature=1.0, top_k=20, num_samples=2, seed=3)
    device = ReversibleTrainer(_model(), optax.adamw(1e-3), make_mesh(), offload=False)
    in_memory = type(ts)(2, [trainer.replicate(p) for p in params], [None] * len(params), files.layer_state)
    for o in (opts, seeded):
        held = generate.generate(trainer, files, b"hello", T, o, weights=generate_weights.HOLD).samples
        assert generate.generate(trainer, files, b"hello", T, o, weights=generate_weights.STREAM).samples == held
        assert generate.generate(device, in_memory, b"hello", T, o).samples == held
    # The checkpoint's and the tier's files are as they were; the layer files still have their two links.
    assert (_files_state(tmp_path / "run"), _files_state(tmp_path / "tier")) == before
    assert all(os.stat(r.path).st_nlink == 2 for r in files.params)
    checkpointer.close()


def test_layer_cycle_reads_each_layer_per_pass_and_one_ahead(tmp_path):
    trainer, ts, _, params, _ = _train("disk", str(tmp_path / "tier"), steps=1)
    from revtrain.tiers.cycle import LayerCycle
    cycle = LayerCycle(trainer.residency.store, ts.params, None)
    order = [0, 1, 2, 3, 4, 5, 0, 1, 3, 4]  # (3 out of order: read on demand, the read ahead dropped)
    got = [cycle.get(i) for i in order]
    cycle.close()
    assert all(_same([g], [params[i]]) for g, i in zip(got, order))
    per_layer = [r.layout.nbytes("params") for r in ts.params]
    # Every layer handed over was read once (read ahead or on demand); at most one read ahead beyond them.
    handed = sum(per_layer[i] for i in order)
    assert handed <= cycle.read_bytes <= handed + per_layer[2] + per_layer[0]


def test_the_plan_decides_to_hold_or_stream(tmp_path):
    from revtrain import generate_weights
    trainer, ts, _, _, _ = _train("disk", str(tmp_path / "tier"), steps=1)
    weights = generate_weights.weight_bytes(ts.params, trainer.residency)
    assert weights == sum(int(np.prod(x.shape)) * 4 for layer in trainer.model.layers
                          for x in jax.tree.leaves(layer.param_shapes))  # float32 weights
    caches = generate_weights.cache_bytes(trainer.model, 2, T)
    assert caches > 0

    def choose(**kw):  # (a sample of 2 rows from the disk tier's files)
        return generate_weights.choose(ts.params, trainer.model, 2, T, trainer.residency, **kw)

    roomy = choose(limits={"host": (2**40, "test")})
    assert roomy.mode == generate_weights.HOLD
    assert "holds the disk tier's weights in device memory (host RAM on the CPU backend)" in roomy.line
    tight = choose(limits={"host": (roomy.need - 1, "a test limit")})
    assert tight.mode == generate_weights.STREAM and tight.need == roomy.need
    assert "streams the disk tier's weights layer by layer" in tight.line and "a test limit" in tight.line
    # Beside a training run: its planned peak is the base; an accelerator's device limit is the one that counts.
    class Plan:
        tiers = {"host": {}}
        def total(self, tier):
            return 10 * 2**30
    planned = choose(plan=Plan(), limits={"host": (11 * 2**30, "t")})
    assert planned.need == 10 * 2**30 + weights + caches + max(r.layout.nbytes("params") for r in ts.params)
    assert planned.mode == generate_weights.HOLD and "the run's planned peak 10.00 GiB" in planned.line
    device = choose(limits={"host": (2**40, "t"), "device": (1, "gpu")})
    assert device.mode == generate_weights.STREAM and "device" in device.line
    forced = choose(limits={"host": (2**40, "t")}, mode="stream")
    assert forced.mode == generate_weights.STREAM and "as asked" in forced.line


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    """A small disk-tier Llama run of 2 steps, its final step checkpointed, sampled (greedy) during training."""
    workdir = tmp_path_factory.mktemp("disk_run") / "run"
    result = _revtrain("train", "--config", LLAMA, *DISK, "--gin", "STEPS = 2", "--gin", "train.sample_every = 2",
                       "--gin", "train.sample_length = 12", "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sampling holds the disk tier's weights in device memory (host RAM on the CPU backend)" in result.stderr
    return workdir


@pytest.mark.slow  # make test: the plan's hold-or-stream choice, the plugin tier's sample and export
def test_eval_export_and_sample_of_a_disk_tier_run_stream_its_files(disk_run, tmp_path, monkeypatch, capsys):
    """``revtrain eval``, ``export`` and ``sample`` of a disk-tier checkpoint read its files (read-only), after the
    run's offload directory is gone: the evaluation equals the run's own to the last digit, the export is byte
    for byte what the weights read into memory give, and a streamed sample is the held sample of training."""
    import shutil

    from revtrain import cli, export, generate_weights, loop
    from revtrain.models.llama import iter_model_tensors
    shutil.rmtree(disk_run / "offload")  # no training runs; the checkpoint's hard links keep the bytes
    before = _files_state(disk_run / "checkpoints")
    result = revtrain_here(capsys, "eval", "--workdir", str(disk_run), "--name", "again")
    assert result.returncode == 0, result.stderr[-2000:]
    own = json.loads((disk_run / "metrics" / "eval.jsonl").read_text().splitlines()[-1])
    again = json.loads((disk_run / "metrics" / "eval_again.jsonl").read_text().splitlines()[-1])
    assert again == own and own["step"] == 2
    out = tmp_path / "hf"
    result = revtrain_here(capsys, "export", "--workdir", str(disk_run), "--to", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    # Today's export: every layer's weights read into memory as numpy, then written.
    cli._parse_gin([str(disk_run / "config.gin")], [], workdir=str(disk_run))
    try:
        run = loop.build(workdir=str(disk_run))
        checkpointer = ckpt_lib.Checkpointer(str(disk_run), read_only=True)
        ts = checkpointer.restore(run.trainer.abstract_state(), optimizer_state=False)
        checkpointer.close()
        assert all(isinstance(p, dict) for p in ts.params)
        export.write_checkpoint(str(tmp_path / "old"), run.model.llama_spec, iter_model_tensors(run.model, ts.params),
                                tokenizer=run.task.tokenizer)
    finally:
        import gin
        gin.clear_config()
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "old"))
    for name in os.listdir(out):
        assert (out / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
    # A sample that streams (the plan's host limit made too small to hold the weights): the training's sample.
    trained = json.loads((disk_run / "metrics" / "samples.jsonl").read_text().splitlines()[-1])
    monkeypatch.setattr(generate_weights, "host_limit", lambda: (1, "a test limit"))
    code = cli.main(["sample", "--workdir", str(disk_run), "--temperature", "0", "--length", "12",
                     "--prompt", trained["prompt"], "--output", str(tmp_path / "sample.txt")])
    assert code == 0
    assert "sampling streams the disk tier's weights layer by layer" in capsys.readouterr().err
    assert (tmp_path / "sample.txt").read_bytes().decode("utf-8", "replace") == trained["prompt"] + trained["text"]
    assert _files_state(disk_run / "checkpoints") == before
    assert not (disk_run / "offload").exists()  # the readers made no offload directory


def test_an_unused_disk_state_in_the_workdir_is_named(tmp_path):
    """A run of another tier in a workdir whose ``offload/`` holds an earlier disk-tier state (a resume after
    switching tiers) is told in one line what it holds and that removing it loses nothing; nothing otherwise."""
    from revtrain import tiers
    device = tiers.from_gin(False, make_mesh())  # (the run's own tier: the notes are every other tier's)
    assert tiers.leftovers(str(tmp_path), device) == []
    (tmp_path / "offload" / "step_00000008").mkdir(parents=True)
    (tmp_path / "offload" / "step_00000008" / "layer_00000.bin").write_bytes(b"x" * 2**21)
    [line] = tiers.leftovers(str(tmp_path), device)
    assert f"{tmp_path / 'offload'} holds 1 step(s) of an earlier disk-tier state (2 MiB)" in line
    assert "loses nothing" in line


def test_an_offload_dir_in_use_by_another_run_is_refused(tmp_path, capfd):
    """Two runs writing layer files into one ``offload_dir`` would overwrite each other's: the second is refused
    in one line naming the directory and its holder, exit 2, and its new workdir is not left behind."""
    from revtrain.lifecycle import workdir as workdir_lib
    shared = tmp_path / "shared"
    shared.mkdir()
    holder = workdir_lib.WorkdirLock(str(shared), "train")  # (another open file: flock refuses this process too)
    try:
        result = revtrain_here(capfd, "train", "--config", LLAMA, *DISK, "--gin", "STEPS = 2", "--gin",
                               f"ReversibleTrainer.offload_dir = '{shared}'", "--workdir", str(tmp_path / "run"))
    finally:
        holder.release()
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"revtrain: error: ReversibleTrainer.offload_dir {shared} is in use by revtrain "
                               f"train, PID {os.getpid()}"), lines
    assert "set another ReversibleTrainer.offload_dir" in lines[0]
    assert not (tmp_path / "run").exists() and os.listdir(shared) == [".lock"]


def test_offload_dir_without_its_parent_is_refused(tmp_path, capfd):
    """An ``offload_dir`` whose parent does not exist: one line, exit 2, nothing made (not even the workdir);
    one that is a file: refused too."""
    missing = tmp_path / "no" / "such"
    result = revtrain_here(capfd, "train", "--config", LLAMA, *DISK, "--gin", "STEPS = 2", "--gin",
                           f"ReversibleTrainer.offload_dir = '{missing}/offload'", "--workdir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "ReversibleTrainer.offload_dir" in lines[0] and f"{missing} does not exist" in lines[0]
    assert not (tmp_path / "no").exists() and not (tmp_path / "run").exists()
    trainer = ReversibleTrainer(_model(), optax.adamw(1e-3), make_mesh(), offload="disk", scan_layers=False,
                                offload_dir=str(missing / "offload"))
    with pytest.raises(ConfigError, match="parent directory"):
        trainer.init()
    (tmp_path / "a_file").write_text("")  # an offload_dir that is a file: one line too
    trainer = ReversibleTrainer(_model(), optax.adamw(1e-3), make_mesh(), offload="disk",
                                offload_dir=str(tmp_path / "a_file"))
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        trainer.init()
    trainer = ReversibleTrainer(_model(), optax.adamw(1e-3), make_mesh(), offload="disk",
                                offload_dir=str(tmp_path / "a_file" / "offload"))  # under a file: named so
    with pytest.raises(ConfigError, match="its parent .*a_file is a file, not a directory"):
        trainer.init()


@pytest.fixture(scope="module")
def two_devices(byte_lm_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("disk_recipe") / "results.json"
    return run_worker(__file__, 2, out, data_dir=byte_lm_data_dir, timeout=1500)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["host_shard", "device_shard", "disk_shard"])
def test_recipe_with_shard_state_on_two_devices(two_devices, name):
    """The recipe (tied embedding/head, clip 0.5, 2 microbatches; 10 steps, 2 devices) with ``shard_state``:
    on the host and device tiers (ties with shard_state) and on the disk tier, the host tier's losses, every
    parameter leaf and evaluation without shard_state, bit for bit, and the gradient norms of the same executor
    without shard_state (the device tier's scanned one logs norms a few ulps from the per-layer one's on 2
    devices, found since the host tier runs per layer); the table and most of the state split."""
    run = two_devices[name]
    assert two_devices["devices"] == 2 and run["shard_state"], run
    assert run["losses"] and run["norms"] and run["params"] and run["scores"], run
    assert "split over 2 devices" in run["split"] and two_devices["losses"][-1] < two_devices["losses"][0] - 0.5


@pytest.mark.slow
def test_recipe_on_the_disk_tier_against_the_standard_trainer(two_devices):
    """The disk tier + shard_state run against StandardTrainer's whole-model step (2 devices): losses and
    every parameter leaf within 1e-6, as `tests/test_recipe.py` holds the tied recipe to."""
    run = two_devices["standard"]
    assert run["loss_rel"] <= 1e-6 and run["param_rel"] <= 1e-6, run


# ------------------------------------------------------------------------------------------------
# Two devices (a worker process: ``python tests/test_disk_tier.py OUT.json``).
# ------------------------------------------------------------------------------------------------
def _worker(out_path: str) -> None:
    import tempfile

    from revtrain.data import byte_lm, pipeline
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm.default_data_dir())
    it = iter(pipeline.train_dataset(builder, batch_size=8, seed=0))
    batches = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(int(os.environ.get("STEPS", 10)))]
    mesh = make_mesh()
    runs = {"host": _recipe_train(True, None, batches, mesh=mesh),
            "host_shard": _recipe_train(True, None, batches, mesh=mesh, shard_state=True),
            "device_shard": _recipe_train(False, None, batches, mesh=mesh, shard_state=True)}
    device = _recipe_train(False, None, batches, mesh=mesh)  # the device tier's scanned executor, replicated
    runs["disk_shard"] = _recipe_train("disk", tempfile.mkdtemp(), batches, mesh=mesh, shard_state=True)
    from revtrain.trainers import StandardTrainer
    std = _recipe_train(None, None, batches, trainer_cls=StandardTrainer, mesh=mesh)
    ref = runs["host"]
    out = {"devices": len(jax.devices()), "losses": ref[0],
           "standard": {"loss_rel": max(abs(a - b) / abs(a) for a, b in zip(std[0], runs["disk_shard"][0])),
                        "param_rel": max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in
                                         zip(jax.tree.leaves(std[2]), jax.tree.leaves(runs["disk_shard"][2])))}}
    for name, run in runs.items():
        # (gradient norms against the same executor's: the scanned one's last bits differ from the per-layer one's)
        norms = device[1] if name == "device_shard" else ref[1]
        out[name] = {"losses": run[0] == ref[0], "norms": run[1] == norms, "params": _same(run[2], ref[2]),
                     "scores": run[3] == ref[3], "shard_state": bool(run[4].shard_state),
                     "split": run[4].specs.summary()}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker(sys.argv[1])
