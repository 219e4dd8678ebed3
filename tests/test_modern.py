"""Modern parts (`revtrain.layers.modern`, `revtrain.layers.vision`): RMSNorm, rotary positions, SwiGLU,
grouped-query attention, the sliding cache window, and the reversible ViT's parts.

Models are built by hand from `Layer` / `ReversibleLayer` / `HeadLayer`, each layer from ``fold_in(seed, i)``.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

from revtrain.layers.attention import blockwise_attention
from revtrain.layers.base import HeadLayer, Layer, ReversibleCoupling, ReversibleLayer
from revtrain.layers.modern import (BidirectionalAttention, GroupedQueryAttention, RMSNorm,
                                    RMSNormLanguageModelHead, SwiGLU, TokenEmbedding, rotary, swiglu_width)
from revtrain.layers.vision import MLP, MeanPoolClassifierHead, PatchEmbedding
from revtrain.models.base import Model
from revtrain.placement import make_mesh
from revtrain.trainers import ReversibleTrainer, StandardTrainer

from helpers import rel_error, train_model, worst_leaf

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"


def _rngs(seed, i):
    return nnx.Rngs(params=jax.random.fold_in(jax.random.PRNGKey(seed), i))


def _lm(context, *, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, window=None, dropout_rate=0.0,
        attention_block=None, seed=0):
    """A modern byte LM: TokenEmbedding, couplings (F = GQA with rotary positions, G = SwiGLU), RMSNorm head."""
    layers = [Layer(TokenEmbedding(d_model, rngs=_rngs(seed, 0), dropout_rate=dropout_rate), "embedding")]
    for i in range(num_layers):
        r = _rngs(seed, i + 1)
        f = GroupedQueryAttention(d_model, rngs=r, num_layers=num_layers, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, window=window, dropout_rate=dropout_rate,
                                  attention_block=attention_block)
        g = SwiGLU(d_model, rngs=r, num_layers=num_layers, dropout_rate=dropout_rate)
        layers.append(ReversibleLayer(ReversibleCoupling(f, g, grid_bits=18), f"block_{i}"))
    layers.append(HeadLayer(RMSNormLanguageModelHead(d_model, rngs=_rngs(seed, num_layers + 1)), "head"))
    return Model(layers, input_key="inputs", tokens_per_example=context, bits_per_byte=True)


def _vit(*, num_layers=2, d_model=16, patch_size=7, dropout_rate=0.0, attention_block=None, seed=0):
    """A reversible ViT: PatchEmbedding, couplings (F = bidirectional attention, G = MLP), mean-pool head."""
    layers = [Layer(PatchEmbedding(d_model, rngs=_rngs(seed, 0), patch_size=patch_size), "patches")]
    for i in range(num_layers):
        r = _rngs(seed, i + 1)
        f = BidirectionalAttention(d_model, rngs=r, num_layers=num_layers, num_heads=2, dropout_rate=dropout_rate,
                                   attention_block=attention_block)
        g = MLP(d_model, rngs=r, num_layers=num_layers, dropout_rate=dropout_rate)
        layers.append(ReversibleLayer(ReversibleCoupling(f, g, grid_bits=18), f"block_{i}"))
    layers.append(HeadLayer(MeanPoolClassifierHead(d_model, rngs=_rngs(seed, num_layers + 1)), "head"))
    return Model(layers, input_key="image", tokens_per_example=1)


def _forward(model, params, states, x):
    for i, layer in enumerate(model.layers):
        x = layer.apply(params[i], states[i], x, None, False)[0]
    return x


# ------------------------------------------------------------------------------------------------
# The parts on their own.
# ------------------------------------------------------------------------------------------------
def test_rmsnorm_values_and_streams_on_the_grid():
    """``x / sqrt(mean(x^2) + eps) * scale``; a pair of streams is normalised stream by stream and rounded
    to the grid (a standard layer between couplings)."""
    x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype(np.float32) * 3
    norm = RMSNorm(8, rngs=_rngs(0, 0), grid_bits=10)
    norm.scale[...] = jnp.arange(1.0, 9.0)
    expected = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-6) * np.arange(1.0, 9.0)
    plain = RMSNorm(8, rngs=_rngs(0, 0))
    plain.scale[...] = jnp.arange(1.0, 9.0)
    np.testing.assert_allclose(plain(x), expected, rtol=1e-5)
    a, b = norm((x, 2 * x))
    np.testing.assert_allclose(a, expected, atol=2 ** -11)
    np.testing.assert_array_equal(a * 2 ** 10, np.round(a * 2 ** 10))  # on the 2**-10 grid
    np.testing.assert_allclose(b, a, atol=2 ** -10)  # scale-free
    with pytest.raises(ValueError, match="RMSNorm.eps"):
        RMSNorm(8, rngs=_rngs(0, 0), eps=0.0)


def test_rotary_scores_depend_only_on_distance():
    """RoFormer's property: shifting every position by the same offset leaves ``q . k`` unchanged, while
    rotating keys by other positions changes it; position 0 is the identity."""
    rng = np.random.default_rng(1)
    q, k = (rng.normal(size=(1, 6, 2, 8)).astype(np.float32) for _ in range(2))
    positions = jnp.arange(6, dtype=jnp.int32)

    def scores(pq, pk):
        return np.einsum("bqhd,bkhd->bhqk", rotary(q, pq), rotary(k, pk))

    base = scores(positions, positions)
    np.testing.assert_allclose(scores(positions + 1000, positions + 1000), base, rtol=2e-4, atol=2e-4)
    assert np.abs(scores(positions, positions[::-1]) - base).max() > 0.1
    np.testing.assert_array_equal(rotary(q, jnp.zeros(6, jnp.int32)), q)
    np.testing.assert_allclose(np.linalg.norm(rotary(q, positions + 7), axis=-1), np.linalg.norm(q, axis=-1),
                               rtol=1e-5)  # a rotation


def _naive_gqa(q, k, v, causal):
    """Reference attention in numpy: query head ``n`` reads key/value head ``n // (H / K)``."""
    b, t, h, d = q.shape
    groups = h // k.shape[2]
    out = np.zeros_like(q)
    for n in range(h):
        s = np.einsum("bqd,bkd->bqk", q[:, :, n], k[:, :, n // groups]) / np.sqrt(d)
        if causal:
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, n] = np.einsum("bqk,bkd->bqd", p / p.sum(-1, keepdims=True), v[:, :, n // groups])
    return out


@pytest.mark.parametrize("cls", [GroupedQueryAttention, pytest.param(BidirectionalAttention, marks=pytest.mark.slow)])
def test_grouped_query_attention_dense_and_blockwise(cls):
    """4 query heads over 2 key/value heads: the dense and the blockwise path (T = 20 in tiles of 8: the
    last tile padded) equal a numpy reference of grouped attention, and their gradients agree."""
    d_model, t = 32, 20
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, t, d_model)), jnp.float32)
    dense = cls(d_model, rngs=_rngs(0, 1), num_heads=4, num_kv_heads=2, rotary=True)
    blocked = cls(d_model, rngs=_rngs(0, 1), num_heads=4, num_kv_heads=2, rotary=True, attention_block=8)
    assert dense.key_value.kernel.shape == (d_model, 2 * 2 * 8)  # 2 key/value heads of width 8
    with jax.default_matmul_precision("highest"):
        q, k, v = (np.asarray(a) for a in jax.jit(lambda x: dense._project(x, jnp.arange(t)))(x))
        reference = np.asarray(jax.jit(dense.out)(_naive_gqa(q, k, v, cls.causal).reshape(2, t, d_model)))
        for module in (dense, blocked):
            out = jax.jit(lambda x: module(x, keys=None, train=False))(x)
            np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-6)

        def grad(module):
            return jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(module(x, keys=None, train=False)))))(x)

        assert rel_error(grad(blocked), grad(dense)) <= 1e-5


def test_bidirectional_blockwise_attention_masks_padding():
    """Bidirectional blockwise attention with T = 13 in tiles of 4 (3 padded keys, masked) equals dense
    non-causal attention, forward and gradient."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 13, 3, 8)), jnp.float32) for _ in range(3))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.cos(blockwise_attention(*a, 4, causal=False))),
                                 argnums=(0, 1, 2)))(q, k, v)
        ref = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.cos(jax.nn.dot_product_attention(*a))),
                                 argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        assert rel_error(a, b) <= 1e-5


def test_swiglu_values_width_and_chunking():
    """``W2 (silu(W1 h) * W3 h)`` on the RMS-normalised input, default width 8D/3 rounded up to 8 (three
    matrices with the parameters of a 4D GELU feed-forward's two); chunking changes nothing."""
    assert swiglu_width(128) == 344 and swiglu_width(48) == 128
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 10, 16)), jnp.float32)
    ff = SwiGLU(16, rngs=_rngs(0, 0), d_ff=24)
    chunked = SwiGLU(16, rngs=_rngs(0, 0), d_ff=24, chunk=3)
    with jax.default_matmul_precision("highest"):
        h = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6)
        a, b = h @ np.asarray(ff.gate.kernel[...]), h @ np.asarray(ff.up.kernel[...])
        expected = (a / (1 + np.exp(-a)) * b) @ np.asarray(ff.down.kernel[...])
        np.testing.assert_allclose(ff(x, keys=None, train=False), expected, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(chunked(x, keys=None, train=False), expected, rtol=1e-5, atol=1e-7)


def test_bad_part_settings_are_one_line_errors():
    r = _rngs(0, 0)
    cases = [(lambda: GroupedQueryAttention(32, rngs=r, num_heads=4, num_kv_heads=3), "num_kv_heads 3"),
             (lambda: GroupedQueryAttention(30, rngs=r, num_heads=4), "not divisible by num_heads"),
             (lambda: GroupedQueryAttention(24, rngs=r, num_heads=8), "even head width"),
             (lambda: GroupedQueryAttention(32, rngs=r, window=8, attention_block=16), "window"),
             (lambda: SwiGLU(32, rngs=r, norm="batch"), "SwiGLU.norm"),
             (lambda: SwiGLU(32, rngs=r, compute_dtype="float16"), "SwiGLU.compute_dtype"),
             (lambda: PatchEmbedding(32, rngs=r, patch_size=5), "does not divide image_size 28"),
             (lambda: TokenEmbedding(32, rngs=r, grid_bits=0), "TokenEmbedding.grid_bits")]
    for make, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            make()
        assert message in str(info.value).splitlines()[0]  # gin adds a second line naming the call


# ------------------------------------------------------------------------------------------------
# Decoding: the cache, and sliding it past the context.
# ------------------------------------------------------------------------------------------------
CONTEXT = 16


@pytest.fixture(scope="module")
def lm():
    """A 3-block modern LM (GQA 4/2 heads, rotary, SwiGLU), context 16, random weights, with its banded
    twin (same parameters, ``window = 16``): ``(model, banded, params, states)``. The output projections are
    scaled up 30x from their near-identity initialisation, so that every block changes the streams as a
    trained one does (and positions far back matter)."""
    model = _lm(CONTEXT, num_layers=3)
    banded = _lm(CONTEXT, num_layers=3, window=CONTEXT)
    params, states = model.init()
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 30 if any(getattr(k, "key", None) in ("out", "down") for k in path) else x, params)
    return model, banded, params, states


def _decode_all(model, params, states, tokens, first):
    """Logits ``[B, T, V]`` of decoding ``tokens`` with the caches: ``first`` positions at once, then one
    position at a time (past the cache length: the window slides)."""
    @jax.jit
    def run(tokens):
        caches = [layer.init_cache(tokens.shape[0], CONTEXT) for layer in model.layers]
        x = tokens[:, :first]
        for i, layer in enumerate(model.layers):
            x, caches[i] = layer.decode(params[i], states[i], x, caches[i], 0)

        def step(caches, t):
            y = lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
            new = []
            for i, layer in enumerate(model.layers):
                y, cache = layer.decode(params[i], states[i], y, caches[i], t)
                new.append(cache)
            return new, y[:, 0]

        _, steps = lax.scan(step, caches, jnp.arange(first, tokens.shape[1]))
        return jnp.concatenate([x, steps.swapaxes(0, 1)], axis=1)

    return np.asarray(run(tokens))


def test_cache_holds_num_kv_heads_and_decoding_equals_the_forward(lm):
    """The key/value cache is ``[B, num_kv_heads, L, d]``; within the context, cached logits (5 positions
    at once, then one at a time) equal the causal forward's to 1e-5 relative."""
    model, _, params, states = lm
    cache = model.layers[1].init_cache(3, CONTEXT)
    assert cache["f"]["k"].shape == (3, 2, CONTEXT, 8) and cache["g"] == {}
    tokens = np.random.default_rng(5).integers(0, 256, (2, CONTEXT)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        reference = np.asarray(jax.jit(lambda t: _forward(model, params, states, t))(tokens))
        cached = _decode_all(model, params, states, tokens, 5)
    assert rel_error(cached, reference) <= 1e-5


def test_sliding_cache_equals_banded_forward_not_last_window(lm):
    """Decoding 3 x 16 positions with a 16-slot ring cache (keys keep their rotations, nothing re-encoded):
    every position's logits equal the full forward with banded attention (each position sees the last 16)
    to 1e-5 relative. With 3 attention layers that is NOT a forward over the last 16 bytes alone: the
    receptive field grows with depth (that forward differs by far more than rounding)."""
    model, banded, params, states = lm
    n = 3 * CONTEXT
    tokens = np.random.default_rng(6).integers(0, 256, (2, n)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        reference = np.asarray(jax.jit(lambda t: _forward(banded, params, states, t))(tokens))
        cached = _decode_all(model, params, states, tokens, 7)
        # A prompt longer than the ring (S > L): encoded at once, then sliding on.
        chunked = _decode_all(banded, params, states, tokens, CONTEXT + 9)
        last = jax.jit(lambda t: _forward(model, params, states, t))
        windows = np.stack([np.asarray(last(tokens[:, p - CONTEXT + 1:p + 1]))[:, -1]
                            for p in range(CONTEXT, n)], axis=1)
        causal = np.asarray(last(tokens[:, :CONTEXT]))
    assert rel_error(cached, reference) <= 1e-5
    assert rel_error(chunked, reference) <= 1e-5
    assert rel_error(cached[:, :CONTEXT], causal) <= 1e-5  # within the context: the ordinary causal forward
    assert rel_error(windows, reference[:, CONTEXT:]) > 1e-3


@pytest.mark.slow  # make test keeps the sliding cache against the banded forward
def test_generate_slides_without_reencoding(lm):
    """`revtrain.sample` slides the window of a rotary model: 40 greedy bytes past a 16-byte context are the
    argmax bytes of the banded forward over the whole text (fused program and the offload driver alike),
    while the learned-position LM keeps re-encoding."""
    from revtrain import sample
    from revtrain.models import ReversibleTransformerLM
    model, banded, _, _ = lm
    params, states = model.init()  # what the trainers start from
    assert sample.slides(model) and not sample.slides(ReversibleTransformerLM(CONTEXT, num_layers=1, d_model=16))
    prompt, length = b"[[Category:", 40
    mesh = make_mesh(jax.devices()[:1])
    trainer = ReversibleTrainer(model, optax.adam(1e-3), mesh)
    ts = trainer.init()
    out = sample.generate(trainer, ts, prompt, CONTEXT, sample.Options(length=length, temperature=0.0))
    offloaded = ReversibleTrainer(model, optax.adam(1e-3), mesh, offload=True)
    again = sample.generate(offloaded, offloaded.init(), prompt, CONTEXT,
                            sample.Options(length=length, temperature=0.0))
    assert again.samples == out.samples
    text = np.frombuffer(prompt + out.samples[0], np.uint8).astype(np.int32)[None]
    logits = np.asarray(jax.jit(lambda t: _forward(banded, params, states, t))(text))[0]
    chosen = text[0, len(prompt):]
    best = logits[len(prompt) - 1:-1].max(axis=-1)
    got = logits[np.arange(len(prompt) - 1, text.shape[1] - 1), chosen]
    np.testing.assert_allclose(got, best, rtol=0, atol=1e-4 * np.abs(logits).max())  # argmax up to ties


# ------------------------------------------------------------------------------------------------
# Training: reversible equals backprop with the modern parts.
# ------------------------------------------------------------------------------------------------
def _lm_model():
    return _lm(128, num_layers=3, dropout_rate=0.1, attention_block=32)


@pytest.fixture(scope="module")
def lm_backprop(text_batches):
    """4 batches of real text and StandardTrainer's parameters and losses after 4 Adam steps on them."""
    batches = text_batches(4, 4)
    with jax.default_matmul_precision("highest"):
        return batches, train_model(StandardTrainer, _lm_model(), optax.adam(1e-3), batches)


@pytest.mark.slow  # make test: the Llama (GQA, rotary, SwiGLU) bit for bit in test_exactness
@pytest.mark.parametrize("kwargs", [{"scan_layers": True},
                                    pytest.param({"scan_layers": False}, marks=pytest.mark.slow),
                                    pytest.param({"offload": True}, marks=pytest.mark.slow)],
                         ids=["scanned", "per_layer", "offload"])
def test_modern_lm_reversible_equals_backprop(lm_backprop, kwargs):
    """Modern LM (GQA, rotary, SwiGLU, dropout 0.1, blockwise attention), 4 Adam steps on real text: the
    reversible trainer ends with the parameters of ordinary backprop (1e-5 relative per leaf, the same
    losses) and the loss falls."""
    batches, (std, std_losses) = lm_backprop
    with jax.default_matmul_precision("highest"):
        rev, losses = train_model(ReversibleTrainer, _lm_model(), optax.adam(1e-3), batches, **kwargs)
    np.testing.assert_allclose(losses, std_losses, rtol=1e-6)
    rel, leaf = worst_leaf(std, rev)
    assert rel <= 1e-5, (leaf, rel)
    assert std_losses[-1] < std_losses[0]


def _vit_model():
    return _vit(dropout_rate=0.1, attention_block=8)


@pytest.fixture(scope="module")
def vit_backprop():
    """6 batches of real Fashion-MNIST training images (32 each) and StandardTrainer's parameters and
    losses after 6 Adam steps on them (skips when the Debian package is not installed)."""
    if not os.path.isdir(DEBIAN_DIR):
        pytest.skip(f"{DEBIAN_DIR} missing: apt-get install dataset-fashion-mnist")
    from revtrain.data.fashion_mnist import FashionMNISTTask
    it = FashionMNISTTask(DEBIAN_DIR).train_iterator(32, 0, 0, 1)
    batches = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(6)]
    with jax.default_matmul_precision("highest"):
        return batches, train_model(StandardTrainer, _vit_model(), optax.adam(1e-3), batches)


@pytest.mark.slow  # a RevViT trained by both trainers (test_revnet keeps Fashion-MNIST in make test)
@pytest.mark.parametrize("kwargs", [{"scan_layers": True}, {"offload": True}], ids=["scanned", "offload"])
def test_revvit_reversible_equals_backprop_on_fashion_mnist(vit_backprop, kwargs):
    """Tiny RevViT (patch 7: 16 tokens, 2 couplings, dropout 0.1, blockwise bidirectional attention in
    tiles of 8), 6 Adam steps on real Fashion-MNIST images: reversible equals backprop to 1e-5 per leaf
    (the same losses), and the loss falls."""
    batches, (std, std_losses) = vit_backprop
    with jax.default_matmul_precision("highest"):
        rev, losses = train_model(ReversibleTrainer, _vit_model(), optax.adam(1e-3), batches, **kwargs)
    np.testing.assert_allclose(losses, std_losses, rtol=1e-6)
    rel, leaf = worst_leaf(std, rev)
    assert rel <= 1e-5, (leaf, rel)
    assert std_losses[-1] < std_losses[0]


@pytest.mark.slow  # a RevViT block (test_revnet keeps the RevNet's in make test)
def test_revvit_block_inverse_is_exact_and_does_not_decode():
    """A RevViT coupling in training mode (dropout 0.1) rebuilds its inputs bit for bit from its outputs
    with the same keys; a bidirectional model offers no incremental decoding."""
    m = _vit_model()
    params, states = m.init()
    images = jnp.asarray(np.random.default_rng(7).normal(size=(4, 28, 28, 1)), jnp.float32)
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(1), 4))
    with jax.default_matmul_precision("highest"):
        x = m.layers[0].apply(params[0], states[0], images, None, False)[0]
        y = jax.jit(lambda x: m.layers[1].apply(params[1], states[1], x, keys, True)[0])(x)
        rebuilt = jax.jit(lambda y: m.layers[1].inverse(params[1], states[1], y, keys))(y)
    assert float(jnp.abs(y[0] - x[0]).max()) > 0  # the block does something
    for a, b in zip(rebuilt, x):
        np.testing.assert_array_equal(a, b)
    assert not m.layers[1].can_decode
