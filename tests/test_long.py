"""Long sequences: exact blockwise attention, the chunked feed-forward and head loss, memory linear in T,
and the data checks at long lengths.

Tiles of 64 positions keep these tests small; tiles of 32 positions are exact too but take XLA:CPU about
ten times longer to compile (LLVM unrolls the tiny tile loops).
"""

import pathlib

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from revtrain import cli
from revtrain.layers.attention import blockwise_causal_attention
from revtrain.models import ReversibleTransformerLM
from revtrain.placement import DATA_AXIS, make_mesh
from revtrain.trainers import ReversibleTrainer, StandardTrainer
from revtrain.trainers.programs import LayerPrograms

from helpers import rel_error, tiny_model, train_steps

CONFIG = str(pathlib.Path(__file__).resolve().parent.parent / "configs" / "enwik_small.gin")
TINY = ["--gin", "ReversibleTransformerLM.num_layers = 2", "--gin", "ReversibleTransformerLM.d_model = 32",
        "--gin", "ReversibleTransformerLM.dropout_rate = 0.1", "--gin", "train.batch_size = 8"]
LONG = {"attention_block": 64, "ff_chunk": 48, "head_chunk": 48}  # T = 128: 2 tiles; 3 chunks, the last padded
STEPS = 3


def test_blockwise_attention_equals_dense_with_gradients():
    """Outputs and the gradients of q, k and v within 1e-6 of dense causal attention (float32); T = 200 is
    4 tiles of 64, the last one padded."""
    t, block = 200, 64
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.normal(size=(2, t, 2, 16)), jnp.float32) for _ in range(4))

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def blockwise(q, k, v):
        return blockwise_causal_attention(q, k, v, block)

    with jax.default_matmul_precision("highest"):
        results = {}
        for name, f in (("dense", dense), ("blockwise", blockwise)):
            out, vjp = jax.vjp(jax.jit(f), q, k, v)
            results[name] = (out, *vjp(w))
    for name, a, b in zip(("output", "dq", "dk", "dv"), results["blockwise"], results["dense"]):
        assert rel_error(a, b) <= 1e-6, f"{name}: {rel_error(a, b):.1e}"
    # bfloat16 inputs (float32 scores and statistics): within bfloat16's resolution of dense attention.
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert rel_error(jax.jit(blockwise)(q16, k16, v16), dense(q16, k16, v16)) <= 2e-2


def test_blockwise_attention_rejects_a_bad_block():
    x = jnp.zeros((1, 8, 1, 4))
    with pytest.raises(ValueError, match="positive integer"):
        blockwise_causal_attention(x, x, x, 0)


@pytest.fixture(scope="module")
def runs(text_batches):
    """3 steps (dropout 0.1, Adam, float32 'highest') of: StandardTrainer and ReversibleTrainer on the model
    with blockwise attention and chunked feed-forward and head, and StandardTrainer on the dense model."""
    batches = text_batches(4, STEPS)
    mesh = make_mesh(jax.devices()[:1])
    out = {}
    with jax.default_matmul_precision("highest"):
        for name, cls, kw in (("standard", StandardTrainer, LONG), ("reversible", ReversibleTrainer, LONG),
                              ("dense", StandardTrainer, {})):
            ts, history = train_steps(cls(tiny_model(**kw), optax.adam(1e-3), mesh, seed=0), batches)
            out[name] = ([h["loss"] for h in history], jax.tree.map(np.asarray, ts.params))
    return out


@pytest.mark.slow  # three trainings (make test: blockwise attention equals dense with gradients)
def test_reversible_is_bitwise_backprop_with_blockwise_attention(runs):
    """The reversible trainer (forward, rebuild, vjp: one blockwise code path) equals ordinary backprop on
    the same long-sequence model bit for bit, losses and every parameter."""
    (std_losses, std), (rev_losses, rev) = runs["standard"], runs["reversible"]
    assert rev_losses == std_losses
    assert std_losses[-1] < std_losses[0]
    for a, b in zip(jax.tree.leaves(std), jax.tree.leaves(rev)):
        assert np.array_equal(a, b)


@pytest.mark.slow  # three trainings (make test: blockwise attention equals dense with gradients)
def test_blockwise_and_chunks_train_like_dense(runs):
    """Blockwise attention + chunked feed-forward and head follow the dense model: losses within 1e-6
    relative over the steps, every parameter within 1e-4 of its leaf's scale."""
    (losses, params), (dense_losses, dense) = runs["reversible"], runs["dense"]
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-6)
    worst = max(rel_error(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(dense)))
    assert worst <= 1e-4, worst


def _reverse_temp_bytes(seq: int, **kw) -> int:
    """Compiled temporary bytes of one block's rebuild + vjp (the reverse-and-update call without its
    optimizer update, whose temporaries do not depend on T), batch 1, d_model 32."""
    model = ReversibleTransformerLM(seq, num_layers=1, d_model=32, num_heads=2, dropout_rate=0.1, **kw)
    layer = model.layers[1]
    mesh = make_mesh(jax.devices()[:1])
    d = P(DATA_AXIS)
    fn = jax.jit(jax.shard_map(lambda p, s, y, dy, k: LayerPrograms.reverse_grads(layer, p, s, y, dy, k),
                               mesh=mesh, in_specs=(P(), P(), d, d, d), out_specs=(d, d, P())))
    y = (jax.ShapeDtypeStruct((1, seq, 32), jnp.float32),) * 2
    keys = jax.ShapeDtypeStruct((1, 2), jnp.uint32)
    return fn.lower(layer.init_params, layer.init_state, y, y, keys).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # compiles the backward at several lengths
def test_reverse_temp_memory_is_linear_in_length():
    """4x the length: at most 4.5x the temporaries (measured 3.8x; dense attention's [T, T] scores and
    their gradients grow them 13.7x), and at least 2x (the measure sees the length)."""
    kw = {"attention_block": 64, "ff_chunk": 64, "head_chunk": 64}
    short, long = _reverse_temp_bytes(256, **kw), _reverse_temp_bytes(1024, **kw)
    assert 2 * short <= long <= 4.5 * short, (short, long)


@gin.configurable
def LongTinyLM(sequence_length, *, seed=0):
    """One block with blockwise attention and chunked feed-forward and head. No ``compute_dtype`` argument,
    so `revtrain check` checks float32 only (bfloat16 would double the test's compilations)."""
    return ReversibleTransformerLM(sequence_length, seed=seed, num_layers=1, d_model=32, num_heads=2,
                                   dropout_rate=0.1, **LONG)


@pytest.mark.slow  # check compiles its reference and rebuild programs (the trainer test above checks exactness)
def test_check_passes_with_blockwise_attention(capsys):
    assert cli.main(["check", "--config", CONFIG, *TINY, "--gin", "train.model = @LongTinyLM"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "block_0" in out and "rebuild float32" in out


@pytest.mark.parametrize("binding, contains", [
    ("train.batch_size = 32", "has 21 sequences of ByteLMTask.sequence_length = 512 bytes, fewer than one global "
                              "batch (train.batch_size = 32)"),
    ("ReversibleTransformerLM.attention_block = 0", "ReversibleTransformerLM.attention_block must be a positive"),
    ("ReversibleTransformerLM.ff_chunk = 0", "ReversibleTransformerLM.ff_chunk must be a positive"),
    ("ReversibleTransformerLM.head_chunk = -4", "ReversibleTransformerLM.head_chunk must be a positive"),
    # The other knobs of this round, refused the same way (one line, exit 2, no workdir).
    ("ReversibleTrainer.scan_layers = 'no'", "ReversibleTrainer.scan_layers must be True or False, got 'no'"),
    ("train.trainer = @StandardTrainer\nStandardTrainer.remat_layers = 1", "StandardTrainer.remat_layers must be True or False"),
    ("ReversibleTrainer.shard_state = 'yes'", "ReversibleTrainer.shard_state must be True or False, got 'yes'"),
    ("ReversibleTrainer.fuse_top = 'yes'", "ReversibleTrainer.fuse_top must be True or False, got 'yes'"),
    ("ReversibleTrainer.rebuild = 'inverse'", "ReversibleTrainer.rebuild must be one of 'exact', 'fused', 'fenced', got 'inverse'"),
    ("ReversibleTrainer.budget_objective = 'speed'", "ReversibleTrainer.budget_objective must be one of 'time', 'flops', got 'speed'"),
    ("train.sample_every = -1", "train.sample_every"),
    ("train.sample_length = 0", "train.sample_length must be a positive integer"),
])
def test_long_length_config_errors_exit_2_before_writing(tmp_path, capsys, binding, contains):
    """A train split with fewer sequences than one batch (a 12 kB file at T = 512: 21 training sequences),
    or a bad block size: one error line, exit 2, no workdir."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(np.random.default_rng(0).integers(32, 127, 12_000, dtype=np.uint8)))
    workdir = tmp_path / "run"
    code = cli.main(["train", "--config", CONFIG, "--gin", f"ByteLMTask.source = '{corpus}'",
                     "--gin", f"ByteLMTask.data_dir = '{tmp_path / 'data'}'",
                     "--gin", "ByteLMTask.sequence_length = 512", "--gin", "train.batch_size = 8",
                     "--gin", binding, "--workdir", str(workdir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("revtrain: error: ") and contains in err[0], err
    assert not workdir.exists()
