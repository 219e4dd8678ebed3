"""A new tier is one file and one registration line: this file defines a tier that keeps each layer's weights and
optimizer state as a compressed file (``numpy.savez_compressed``), registers it, and trains it through
`ReversibleTrainer` bit for bit against the host tier. Nothing else in the repository knows about it: the
trainer builds it from ``offload = 'zip'`` (`revtrain.tiers.from_gin`) and the streaming engine reads it ahead
and writes it behind through its store, as it does the built-in tiers'."""

import os

import jax
import numpy as np
import optax
import pytest

from revtrain import streaming, tiers
from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh, placer
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


def _train(offload, directory=None, steps=2):
    """``steps`` steps of AdamW on a 2-block model: (losses, each layer's params and optimizer state as numpy,
    the trainer, the state)."""
    mesh = make_mesh(jax.devices()[:1])
    model = ReversibleTransformerLM(T, num_layers=2, d_model=32, num_heads=2, dropout_rate=0.1)
    trainer = ReversibleTrainer(model, optax.adamw(1e-3), mesh, seed=0, offload=offload, scan_layers=False,
                                offload_dir=directory)
    rng = np.random.default_rng(0)
    ts, losses = trainer.init(), []
    for _ in range(steps):
        x = rng.integers(0, 256, (4, T)).astype(np.int32)
        ts, metrics = trainer.train_step(ts, global_batch({"inputs": x, "targets": x}, mesh))
        losses.append(float(metrics["loss"]))
    if offload == "zip":
        store = trainer.residency.store
        state = [tuple(store.read([(r, "params"), (r, "opt")], np.asarray)) for r in ts.params]
    else:
        state = list(zip(ts.params, ts.opt_state))
    return losses, jax.tree.map(np.asarray, state), trainer, ts


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
