"""A new tier is one file and one registration line: this file defines a tier that keeps each layer's weights and
optimizer state as a compressed file (``numpy.savez_compressed``), registers it, and trains it through
`ReversibleTrainer` bit for bit against the host tier. Nothing else in the repository knows about it: the
trainer builds it from ``offload = 'zip'`` (`revtrain.tiers.from_gin`), the streaming engine reads it ahead
and writes it behind through its store, as it does the built-in tiers', and a checkpoint saves and resumes it
through `Tier`'s defaults (Orbax's arrays, read from and put back into its store)."""

import os

import jax
import numpy as np
import optax
import pytest

from revtrain import checkpoint, streaming, tiers
from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh, placer
from revtrain.trainers.common import TrainState
from revtrain.trainers.common import TrainerError
from revtrain.trainers.reversible import ReversibleTrainer


class ZipLayer:
    """One layer in a compressed file: its path, the trees' structures, the number of weight leaves and the
    bytes of each part (uncompressed)."""

    def __init__(self, path, params_def, opt_def, num_params, sizes):
        self.path, self.params_def, self.opt_def, self.num_params, self.sizes = (path, params_def, opt_def,
                                                                                 num_params, sizes)


class ZipStore(streaming.Store):
    """The engine's store of the zip tier: each layer's file read on the reader thread, written on the writer
    thread (threaded, as the disk tier's)."""

    threaded = True
    prefix = "zip"

    def __init__(self, directory):
        super().__init__()
        self.directory = directory
        self.writes = 0

    def save(self, name: str, params, opt_state) -> ZipLayer:
        p_leaves, p_def = jax.tree.flatten(params)
        o_leaves, o_def = jax.tree.flatten(opt_state)
        leaves = [np.asarray(x) for x in p_leaves + o_leaves]
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, name + ".npz")
        np.savez_compressed(path, *leaves)
        self.writes += 1
        n = len(p_leaves)
        sizes = {"params": sum(x.nbytes for x in leaves[:n]), "opt": sum(x.nbytes for x in leaves[n:])}
        return ZipLayer(path, p_def, o_def, n, sizes)

    def holds(self, ref) -> bool:
        return isinstance(ref, ZipLayer)

    def refs(self, params, opt_state):
        return list(params)

    def state(self, refs):
        return list(refs), list(refs)

    def nbytes(self, ref, part=None) -> int:
        return sum(ref.sizes.values()) if part is None else ref.sizes[part]

    def load(self, ref, part):
        with np.load(ref.path) as z:
            leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
        return leaves[:ref.num_params] if part == "params" else leaves[ref.num_params:]

    def read(self, items, place, loaded=None):
        loaded = [self.load(r, p) for r, p in items] if loaded is None else loaded
        return [jax.tree.unflatten(r.params_def if p == "params" else r.opt_def, [place(x) for x in leaves])
                for (r, p), leaves in zip(items, loaded, strict=True)]

    def write(self, step, g, ref, update):
        params, opt_state = update
        update.clear()
        return self.save(f"step{step}_layer{g}", params, opt_state)


class ZipTier(tiers.Tier):
    """Each layer's weights and optimizer state in a compressed file in ``offload_dir``."""

    name = "zip"
    label = " + offload='zip'"
    uses_directory = True

    def __init__(self, mesh, sharded=False, directory=None):
        super().__init__(mesh, sharded)
        self.store = ZipStore(directory)

    def describe_place(self) -> str:
        return f"compressed layer files in {self.store.directory}"

    def put_layer(self, index, params, opt_state, pspec=None, ospec=None):
        ref = self.store.save(f"step0_layer{index}", params, opt_state)
        return ref, ref

    def fetch(self, tree):
        if isinstance(tree, ZipLayer):
            return self.store.read([(tree, "params")], placer(self.mesh))[0]
        return super().fetch(tree)

    @classmethod
    def holds_state(cls, ts) -> bool:
        params = ts.held()[0]
        return bool(params) and isinstance(params[0], ZipLayer)


tiers.register("zip", ZipTier)  # the registration line


T = 16


def _trainer(offload, directory=None):
    """A `ReversibleTrainer` of AdamW on a 2-block model with the tier ``offload`` (its files in ``directory``)."""
    model = ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=2, dropout_rate=0.1)
    return ReversibleTrainer(model, optax.adamw(1e-3), make_mesh(jax.devices()[:1]), seed=0, offload=offload,
                             scan_layers=False, offload_dir=directory)


def _steps(trainer, ts, first, last):
    """Steps ``first + 1`` to ``last`` of ``ts`` (at step ``first``), each on its own batch (the same batch for a
    step in every run): (losses, the state)."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (4, T)).astype(np.int32) for _ in range(last)]
    losses = []
    for x in batches[first:]:
        ts, metrics = trainer.train_step(ts, global_batch({"inputs": x, "targets": x}, trainer.mesh))
        losses.append(float(metrics["loss"]))
    return losses, ts


def _numpy(trainer, ts):
    """Each layer's (params, optimizer state) of ``ts`` as numpy: a zip layer read through the tier's store."""
    if trainer.residency.name == "zip":
        store = trainer.residency.store
        state = [tuple(store.read([(r, "params"), (r, "opt")], np.asarray)) for r in ts.params]
    else:
        state = list(zip(ts.params, ts.opt_state))
    return jax.tree.map(np.asarray, state)


def _train(offload, directory=None, steps=2):
    """``steps`` steps of AdamW on a 2-block model: (losses, each layer's params and optimizer state as numpy,
    the trainer, the state)."""
    trainer = _trainer(offload, directory)
    losses, ts = _steps(trainer, trainer.init(), 0, steps)
    return losses, _numpy(trainer, ts), trainer, ts


def _equal(a, b) -> bool:
    """Whether two trees have the same structure and every leaf the same bits."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_registered_tier_trains_bit_for_bit_like_the_host_tier(tmp_path):
    """The zip tier, known only to this file: the same losses, weights and optimizer state as the host tier,
    every bit, with every layer's state in its compressed files (the initial ones and one per step)."""
    host_losses, host_state, _, _ = _train(True)
    losses, state, trainer, ts = _train("zip", str(tmp_path / "zip"))
    assert losses == host_losses
    assert jax.tree.structure(state) == jax.tree.structure(host_state)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(host_state)))
    tier = trainer.residency
    assert type(tier) is ZipTier and tier.streamed and tier.offloaded and tier.name == "zip"
    assert tier.store.writes == len(trainer.model.layers) * 3  # step 0's files, then one per layer per step
    assert all(isinstance(r, ZipLayer) and r.path.startswith(str(tmp_path / "zip")) for r in ts.params)
    assert ZipTier.holds_state(ts) and tiers.holder_of(ts) is ZipTier
    assert trainer.memory_setup()["label"] == "ReversibleTrainer + offload='zip'"
    assert tier.describe() == f"compressed layer files in {tmp_path / 'zip'}, replicated"
    # The trainer reads a layer's weights through the tier (`Tier.fetch`): the same as the host tier's.
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trainer.layer_params(ts, 0)),
                                                    jax.tree.leaves(host_state[0][0])))


@pytest.mark.slow  # make test: the registered tier trains bit for bit
def test_a_registered_tier_samples_and_exports_through_the_interfaces_defaults(tmp_path):
    """Sampling and export ask the tier, and the zip tier answers with `Tier`'s defaults through its store: a
    streamed greedy sample (each layer read on the store's reader thread, the next ahead) and a held one are the
    host tier's, and the export's view of each layer is its weights, bit for bit."""
    from revtrain import generate
    _, host_state, host, host_ts = _train(True)
    _, _, trainer, ts = _train("zip", str(tmp_path / "zip"))
    opts = generate.Options(length=6, temperature=0.0)
    expected = generate.generate(host, host_ts, b"hello", T, opts, weights="stream").samples
    for weights in ("stream", "hold"):
        assert generate.generate(trainer, ts, b"hello", T, opts, weights=weights).samples == expected
    view = trainer.residency.layer_weights(ts.params)
    assert len(view) == len(host_state)
    for g, (params, _) in enumerate(host_state):
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(view[g]), jax.tree.leaves(params)))


def test_the_registry_names_a_registered_tier():
    """`tiers.names` lists the zip tier after the built-in three; an unknown value's error names it; a name
    cannot be taken twice."""
    assert tiers.names()[:3] == ("device", "host", "disk") and "zip" in tiers.names()
    assert tiers.lookup("zip") is ZipTier
    with pytest.raises(TrainerError, match=r"must be False, True or 'disk', got 'ssd' \(or a registered tier: .*'zip'"):
        ReversibleTrainer(ReversibleTransformerLM(T, num_layers=2, d_model=16, num_heads=2), optax.sgd(0.1),
                          make_mesh(jax.devices()[:1]), offload="ssd")
    with pytest.raises(ValueError, match="taken"):
        tiers.register("zip", tiers.HostTier)


def test_a_registered_tier_checkpoints_and_resumes_bit_for_bit(tmp_path):
    """The zip tier has no checkpoint code: `Tier`'s default saves its state as Orbax's arrays, read through its
    store one layer at a time (`Tier.checkpoint_arrays`), and puts a restored state back into its store layer by
    layer (`Tier.restored_arrays`). A run checkpointed after step 2 and resumed by a new trainer (files in a
    directory of its own) to step 4: the losses and every weight and optimizer-state leaf of an uninterrupted
    4-step zip run, every bit; the host tier resumes the same checkpoint to the same bits. A checkpointer without
    the tier refuses the state's refs in one line."""
    first = _trainer("zip", str(tmp_path / "first"))
    losses, ts = _steps(first, first.init(), 0, 2)
    saved = _numpy(first, ts)
    with pytest.raises(checkpoint.CheckpointError, match="the zip tier's refs is saved through its tier"):
        checkpoint.Checkpointer(str(tmp_path / "run")).save(ts, None, {})
    saver = checkpoint.Checkpointer(str(tmp_path / "run"), tier=first.residency)
    assert saver.save(ts, None, {}) and saver.form(ts) == "orbax"
    saver.close()
    assert (tmp_path / "run" / "checkpoints" / "2" / "state").is_dir()  # Orbax's arrays: no item of the tier's
    more, ts = _steps(first, ts, 2, 4)  # the uninterrupted run (the save read its files, changed nothing)
    losses, state = losses + more, _numpy(first, ts)
    second = _trainer("zip", str(tmp_path / "second"))
    reader = checkpoint.Checkpointer(str(tmp_path / "run"), tier=second.residency)
    restored = reader.restore(second.abstract_state())
    reader.close()
    assert restored.step == 2 and all(isinstance(r, ZipLayer) and r.path.startswith(str(tmp_path / "second"))
                                      for r in restored.params + restored.opt_state)
    assert _equal(_numpy(second, restored), saved)  # the step-2 state, put back into the new trainer's store
    tail, ts = _steps(second, restored, 2, 4)
    assert losses[2:] == tail
    assert _equal(_numpy(second, ts), state)
    # The checkpoint is Orbax's arrays, so the host tier resumes it too: the same steps 3 and 4.
    host = _trainer(True)
    reader = checkpoint.Checkpointer(str(tmp_path / "run"), tier=host.residency)
    tail, ts = _steps(host, reader.restore(host.abstract_state()), 2, 4)
    reader.close()
    assert losses[2:] == tail and _equal(_numpy(host, ts), state)
