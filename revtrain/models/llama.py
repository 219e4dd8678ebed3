"""Llama-architecture language models of standard blocks: imported from a Hugging Face checkpoint directory,
or built from scratch, run as standard layers or as exactly reversible BDIA blocks.

Design. A Llama model (Touvron et al. 2023) is a token embedding, ``L`` pre-norm decoder blocks and a final
RMSNorm with an output projection. Each decoder block is two residual steps::

    a = Attention(RMSNorm_1(x))          (grouped-query, rotary positions with the config's rope_theta)
    x = x + a
    x = x + SwiGLU(RMSNorm_2(x))

revtrain builds it from its modern parts (`revtrain.layers.modern`: `GroupedQueryAttention` and `SwiGLU`, both
pre-norm with `RMSNorm`, compute the same functions as the Hugging Face ``LlamaAttention`` / ``LlamaMLP``), as
a `revtrain.models.Model` of *standard* layers: the embedding (`LlamaEmbedding`), one layer per decoder
block (`LlamaBlock`), and the head (`LlamaHead`: final norm, output projection, cross-entropy). With
``form = "exact"`` every block is wrapped in `revtrain.layers.exact_residual.ExactResidual` (a reversible
layer: the BDIA update, bit-exact rebuild, ``g = 0`` at evaluation) and the embedding emits the two streams
and the side-bits stack.

Checkpoint layout read (the Hugging Face ``save_pretrained`` layout): ``config.json`` (``model_type``
"llama") and either ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(``weight_map``), read with the ``safetensors`` package, float32 or bfloat16 (held as float32 parameters).
Tensor names and shapes (``[out, in]`` for projections, as PyTorch's ``nn.Linear`` stores them)::

    model.embed_tokens.weight                      [V, D]
    model.layers.{i}.input_layernorm.weight        [D]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight                              [D]
    lm_head.weight                                 [V, D]   (absent when tie_word_embeddings)

A tied output projection is the embedding matrix itself: the head's ``lm_head`` leaf is declared a
`revtrain.models.base.Tie` of the embedding's (held once, by the embedding layer).

Anything revtrain does not compute (another ``model_type``, rope scaling, attention or MLP biases, another
activation, a ``head_dim`` other than ``D / heads``, missing tensors or wrong shapes) is refused with
`LlamaFormatError`: one line naming it (exit status 2).

Vocabulary: token ids. A checkpoint's own tokenizer (``tokenizer.json``, or a SentencePiece
``tokenizer.model``; `tokenizer_of`) is what `revtrain.data.tasks.TokenLMTask` tokenizes with when its
``tokenizer`` is left unbound (`revtrain.run.build` passes it), and `revtrain export` writes the run's
tokenizer back beside the weights. The byte task (`revtrain.data.tasks.ByteLMTask`) feeds byte values
(0..255) as ids, so a byte-level model imports, fine-tunes and exports without a tokenizer file. A task whose
vocabulary does not fit the checkpoint's embedding rows is refused (ids past the table would read nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from revtrain.errors import InputError
from revtrain.layers.base import HeadLayer, Layer, ReversibleLayer, cross_entropy_sums, snap_to_grid, split_keys
from revtrain.layers.chunked import check_chunk, sum_chunks
from revtrain.layers.exact_residual import GAMMAS, ExactResidual, empty_bits, gamma_low_bits
from revtrain.layers.modern import GroupedQueryAttention, PositionWise, RMSNorm, SwiGLU, compute_dtype_of
from revtrain.models.base import Model, Tie

FORMS = ("standard", "exact")
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class LlamaFormatError(InputError, ValueError):
    """A checkpoint directory revtrain cannot represent, or a bad LlamaModel setting (one line, exit 2)."""


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
    """The sizes of a Llama model (the subset of a Hugging Face ``LlamaConfig`` revtrain computes).

    Attributes:
      vocab_size: V. hidden_size: D. intermediate_size: SwiGLU hidden width.
      num_layers: decoder blocks. num_heads, num_kv_heads: query and key/value heads.
      rms_norm_eps: RMSNorm epsilon. rope_theta: rotary wavelength base.
      tie_word_embeddings: the output projection is the embedding matrix.
      max_position_embeddings: recorded for export (rotary positions do not limit the length).
      torch_dtype: "float32" or "bfloat16", the dtype the checkpoint's tensors are written in.
      bos_token_id, eos_token_id, pad_token_id: the special token ids of the source checkpoint's
        ``config.json`` (an int, a list of ints for ``eos_token_id``, or None), written back on export.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    torch_dtype: str = "float32"
    bos_token_id: Any = None
    eos_token_id: Any = None
    pad_token_id: Any = None

    def check(self) -> None:
        """Raises LlamaFormatError for sizes that do not fit together."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LlamaFormatError(f"Llama {name} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise LlamaFormatError(f"Llama hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                                   f"{self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise LlamaFormatError(f"Llama num_attention_heads {self.num_heads} is not divisible by "
                                   f"num_key_value_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise LlamaFormatError("Llama head width hidden_size / num_attention_heads must be even (rotary)")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise LlamaFormatError("Llama rms_norm_eps and rope_theta must be positive")
        if self.torch_dtype not in ("float32", "bfloat16"):
            raise LlamaFormatError(f"Llama dtype must be float32 or bfloat16, got {self.torch_dtype!r}")

    def hf_config(self) -> dict:
        """The ``config.json`` dict of this model (``LlamaForCausalLM``)."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.hidden_size // self.num_heads,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }


def _token_id(value, file: str, name: str):
    """A special token id of ``config.json``: None, an int, or (``eos_token_id``) a list of ints."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [int(v) for v in value]
    raise LlamaFormatError(f"{file}: {name} must be an integer, a list of integers or null, got {value!r}")


def read_spec(path: str) -> LlamaSpec:
    """Reads and checks ``path/config.json``.

    Raises:
      LlamaFormatError: no such directory or file, bad JSON, another architecture, or a setting revtrain
        does not compute (one line naming it).
    """
    if not os.path.isdir(path):
        raise LlamaFormatError(f"LlamaModel.path {path!r} is not a directory (a run's config.gin keeps the path it "
                               "was trained from: if the checkpoint moved, add --gin \"LlamaModel.path = 'NEW'\")")
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LlamaFormatError(f"no {CONFIG} in {path}: not a Hugging Face checkpoint directory") from None
    except (OSError, ValueError) as e:
        raise LlamaFormatError(f"cannot read {file}: {e}") from None
    if not isinstance(cfg, dict):
        raise LlamaFormatError(f"{file} is not a JSON object")
    model_type = cfg.get("model_type")
    if model_type != "llama":
        raise LlamaFormatError(f"{file}: model_type {model_type!r} is not supported (revtrain imports 'llama')")
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if any(a != "LlamaForCausalLM" for a in archs):
        raise LlamaFormatError(f"{file}: architectures {archs} not supported (revtrain imports LlamaForCausalLM)")
    # Rotary settings: transformers 4 writes rope_theta and rope_scaling at the top level, transformers 5 one
    # rope_parameters object ({"rope_theta": ..., "rope_type": ...}); either is read.
    rope_parameters = cfg.get("rope_parameters") or {}
    if not isinstance(rope_parameters, dict):
        raise LlamaFormatError(f"{file}: rope_parameters is not a JSON object")
    for key, rope in (("rope_scaling", cfg.get("rope_scaling")), ("rope_parameters", rope_parameters)):
        if rope and (rope.get("rope_type") or rope.get("type")) not in (None, "default"):
            raise LlamaFormatError(f"{file}: {key} {rope.get('rope_type') or rope.get('type')!r} is not "
                                   "implemented (revtrain computes plain rotary positions)")
    rope_theta = cfg.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise LlamaFormatError(f"{file}: {flag} = true is not supported (revtrain's Llama has no biases)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise LlamaFormatError(f"{file}: hidden_act {act!r} is not supported (SwiGLU uses silu)")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        spec = LlamaSpec(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            **{name: _token_id(cfg.get(name), file, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")})
    except KeyError as e:
        raise LlamaFormatError(f"{file}: missing {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise LlamaFormatError(f"{file}: {e}") from None
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) != hidden // heads:
        raise LlamaFormatError(f"{file}: head_dim {head_dim} differs from hidden_size / num_attention_heads = "
                               f"{hidden // heads} (not supported)")
    spec.check()
    return spec


def tokenizer_of(path: str) -> str | None:
    """The tokenizer file of the checkpoint directory ``path``: its ``tokenizer.json``, else its SentencePiece
    ``tokenizer.model``, else None (a byte-level checkpoint: byte values are the token ids)."""
    from revtrain.data import tokenizer as tokenizer_lib
    return tokenizer_lib.file_in(os.path.expanduser(path))


def expected_shapes(spec: LlamaSpec) -> dict:
    """``{tensor name: shape}`` of every tensor a checkpoint of ``spec`` holds."""
    d, f, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    hd = d // spec.num_heads
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (spec.num_heads * hd, d),
            p + "self_attn.k_proj.weight": (spec.num_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": (spec.num_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": (d, spec.num_heads * hd),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)})
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def read_weights(path: str, spec: LlamaSpec) -> dict:
    """Reads every tensor of ``spec`` from ``path`` (``model.safetensors``, or the shards named by
    ``model.safetensors.index.json``) as float32 numpy arrays.

    Raises:
      LlamaFormatError: no weights file, a missing shard or tensor, a shape other than `expected_shapes`,
        or a dtype other than float32 / bfloat16 / float16.
    """
    from safetensors import SafetensorError, safe_open

    index = os.path.join(path, INDEX)
    single = os.path.join(path, WEIGHTS)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LlamaFormatError(f"cannot read {index}: {e}") from None
    elif os.path.isfile(single):
        weight_map = None
    else:
        raise LlamaFormatError(f"no {WEIGHTS} or {INDEX} in {path}")
    shapes = expected_shapes(spec)
    by_file: dict = {}
    for name in shapes:
        file = WEIGHTS if weight_map is None else weight_map.get(name)
        if file is None:
            raise LlamaFormatError(f"{path}: tensor {name} is missing from {INDEX}")
        by_file.setdefault(file, []).append(name)
    out = {}
    for file, names in by_file.items():
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise LlamaFormatError(f"{path}: shard {file} is missing")
        try:
            with safe_open(full, framework="flax") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise LlamaFormatError(f"{full}: tensor {name} is missing")
                    t = f.get_tensor(name)
                    if t.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
                        raise LlamaFormatError(f"{full}: tensor {name} has dtype {t.dtype} (float32 or bfloat16 "
                                               "expected)")
                    if tuple(t.shape) != shapes[name]:
                        raise LlamaFormatError(f"{full}: tensor {name} has shape {tuple(t.shape)}, expected "
                                               f"{shapes[name]} from {CONFIG}")
                    out[name] = np.asarray(t.astype(jnp.float32))
        except SafetensorError as e:
            raise LlamaFormatError(f"cannot read {full}: {e}") from None
    return out


# -- parts ---------------------------------------------------------------------------------------------------

class LlamaEmbedding(PositionWise, nnx.Module):
    """Token embedding (no positions: rotary attention carries them).

    Input int32 ``[B, T]`` ids in ``[0, vocab_size)``. Output: the float32 stream ``[B, T, D]``; with
    ``exact_blocks = n > 0`` (the exact form) the triple ``(x, x, bits)`` that `ExactResidual` blocks take:
    two copies of the stream (rounded to the ``2**-grid_bits`` grid in training, unrounded in evaluation)
    and the empty side-bits stack ``[B, n, T, low_bits * ceil(D / 8)]`` uint8 (``low_bits`` per element and
    block: ``-log2 |g|``, `revtrain.layers.exact_residual.gamma_low_bits`).
    """

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs, exact_blocks: int = 0,
                 grid_bits: int = 18, low_bits: int = 1):
        self.tokens = nnx.Embed(vocab_size, d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.exact_blocks, self.grid_bits, self.low_bits = exact_blocks, grid_bits, low_bits

    def __call__(self, x, *, keys, train):
        del keys
        h = self.tokens(x)
        if not self.exact_blocks:
            return h
        if train:
            h = snap_to_grid(h, self.grid_bits)
        return (h, jnp.copy(h), empty_bits(self.exact_blocks, *h.shape, self.low_bits))


class LlamaBlock(nnx.Module):
    """One Llama decoder block: ``x + a``, ``a = Attention(RMSNorm(x))``, then ``+ SwiGLU(RMSNorm(.))``.

    ``[B, T, D] -> [B, T, D]`` float32 (matmuls in ``compute_dtype``). The attention is revtrain's
    `GroupedQueryAttention` (causal, rotary base ``rope_theta``, ``num_kv_heads`` key/value heads), the MLP
    its `SwiGLU` (gate, up, down), each with its RMSNorm of epsilon ``eps``. ``increment(x)`` is the block's
    residual ``h(x) = a + SwiGLU(RMSNorm(x + a))`` (the BDIA update's ``h``). Decodes with a key/value cache.
    """

    def __init__(self, d_model: int, *, rngs: nnx.Rngs, num_layers: int, num_heads: int, num_kv_heads: int,
                 d_ff: int, eps: float, rope_theta: float, compute_dtype: str = "float32"):
        self.attention = GroupedQueryAttention(
            d_model, rngs=rngs, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, rotary=True,
            rotary_base=rope_theta, norm="rms", dropout_rate=0.0, compute_dtype=compute_dtype, attention_block=None,
            window=None)
        self.mlp = SwiGLU(d_model, rngs=rngs, num_layers=num_layers, d_ff=d_ff, norm="rms", dropout_rate=0.0,
                          compute_dtype=compute_dtype, chunk=None)
        self.attention.norm.eps = float(eps)
        self.mlp.norm.eps = float(eps)

    def increment(self, x, *, keys, train):
        a = self.attention(x, keys=split_keys(keys, 0), train=train)
        return a + self.mlp(x + a, keys=split_keys(keys, 1), train=train)

    def __call__(self, x, *, keys, train):
        x = x + self.attention(x, keys=split_keys(keys, 0), train=train)
        return x + self.mlp(x, keys=split_keys(keys, 1), train=train)

    def init_cache(self, batch_size: int, max_len: int):
        """The attention's key/value cache."""
        return self.attention.init_cache(batch_size, max_len)

    def decode(self, x, cache, pos):
        """The evaluation forward of positions ``pos ..`` with the cache; ``(y, new_cache)``."""
        a, cache = self.attention.decode(x, cache, pos)
        x = x + a
        return x + self.mlp(x, keys=None, train=False), cache


class LlamaHead(PositionWise, nnx.Module):
    """Final RMSNorm, output projection ``logits = h @ lm_head.T`` (``lm_head`` float32 ``[V, D]``, the
    embedding matrix itself when tied), softmax cross-entropy.

    Input: the stream ``[B, T, D]``, or a triple from `ExactResidual` blocks (its second stream is read).
    ``__call__`` returns float32 logits ``[B, T, V]``; ``loss`` the weighted sum of token losses (nats) and
    stats. ``chunk``: logits and loss that many positions at a time.
    """

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs, eps: float, compute_dtype: str = "float32",
                 chunk: int | None = None):
        check_chunk("LlamaModel.chunk", chunk)
        self.norm = RMSNorm(d_model, rngs=rngs, eps=float(eps), grid_bits=None)
        self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (vocab_size, d_model), jnp.float32))
        self.compute_dtype = compute_dtype_of(compute_dtype, "LlamaModel")
        self.chunk = chunk

    def __call__(self, x, *, keys, train):
        del keys, train
        if isinstance(x, (tuple, list)):
            x = x[1]
        h = self.norm(x).astype(self.compute_dtype)
        return jnp.einsum("btd,vd->btv", h, self.lm_head[...].astype(self.compute_dtype),
                          preferred_element_type=jnp.float32)

    def loss(self, x, batch, *, keys, train):
        targets = batch["targets"]
        weights = batch.get("weights")
        if weights is None:
            weights = jnp.ones(targets.shape, jnp.float32)
        if isinstance(x, (tuple, list)):
            x = x[1]
        if self.chunk is None:
            return cross_entropy_sums(self(x, keys=keys, train=train), {"targets": targets, "weights": weights})

        def chunk_sums(part):
            h, t, w = part
            return cross_entropy_sums(self(h, keys=keys, train=train), {"targets": t, "weights": w})

        return sum_chunks(chunk_sums, (x, targets, weights), self.chunk)


# -- loading weights into the parts -------------------------------------------------------------------------

def _set(param: nnx.Param, value: np.ndarray) -> None:
    if tuple(param[...].shape) != tuple(value.shape):
        raise LlamaFormatError(f"internal shape mismatch {param[...].shape} vs {value.shape}")
    param[...] = jnp.asarray(value, jnp.float32)


def load_block(block: LlamaBlock, w: dict, i: int) -> None:
    """Copies decoder block ``i``'s tensors from ``w`` (name -> ``[out, in]`` arrays) into ``block``."""
    p = f"model.layers.{i}."
    att, mlp = block.attention, block.mlp
    _set(att.norm.scale, w[p + "input_layernorm.weight"])
    _set(att.query.kernel, w[p + "self_attn.q_proj.weight"].T)
    _set(att.key_value.kernel, np.concatenate([w[p + "self_attn.k_proj.weight"].T,
                                               w[p + "self_attn.v_proj.weight"].T], axis=1))
    _set(att.out.kernel, w[p + "self_attn.o_proj.weight"].T)
    _set(mlp.norm.scale, w[p + "post_attention_layernorm.weight"])
    _set(mlp.gate.kernel, w[p + "mlp.gate_proj.weight"].T)
    _set(mlp.up.kernel, w[p + "mlp.up_proj.weight"].T)
    _set(mlp.down.kernel, w[p + "mlp.down_proj.weight"].T)


def block_tensors(params: dict, spec: LlamaSpec, i: int) -> dict:
    """The inverse of `load_block`: a `LlamaBlock`'s plain-dict params -> block ``i``'s named tensors."""
    p = f"model.layers.{i}."
    att, mlp = params["attention"], params["mlp"]
    kv = np.asarray(att["key_value"]["kernel"])
    width = spec.num_kv_heads * (spec.hidden_size // spec.num_heads)
    return {
        p + "input_layernorm.weight": att["norm"]["scale"],
        p + "self_attn.q_proj.weight": np.asarray(att["query"]["kernel"]).T,
        p + "self_attn.k_proj.weight": kv[:, :width].T,
        p + "self_attn.v_proj.weight": kv[:, width:].T,
        p + "self_attn.o_proj.weight": np.asarray(att["out"]["kernel"]).T,
        p + "post_attention_layernorm.weight": mlp["norm"]["scale"],
        p + "mlp.gate_proj.weight": np.asarray(mlp["gate"]["kernel"]).T,
        p + "mlp.up_proj.weight": np.asarray(mlp["up"]["kernel"]).T,
        p + "mlp.down_proj.weight": np.asarray(mlp["down"]["kernel"]).T,
    }


EMBEDDING_PATH = ("tokens", "embedding")
HEAD_PATH = ("lm_head",)


def iter_model_tensors(model: Model, params: list):
    """A `LlamaModel`'s per-layer params (``Model.init`` form: a tied ``lm_head`` only in the embedding's) ->
    the checkpoint's ``(name, float32 C-contiguous numpy array)`` pairs (`expected_shapes`), in checkpoint
    order, each block's made only when it is reached: a writer that drops each after writing it holds one
    block's transposed copies at a time, not the whole model's."""
    spec, form = model.llama_spec, model.llama_form

    def f32(v):
        return np.ascontiguousarray(np.asarray(v, np.float32))

    yield "model.embed_tokens.weight", f32(params[0]["tokens"]["embedding"])
    for i in range(spec.num_layers):
        p = params[1 + i]
        for name, value in block_tensors(p["block"] if form == "exact" else p, spec, i).items():
            yield name, f32(value)
    head = params[-1]
    yield "model.norm.weight", f32(head["norm"]["scale"])
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", f32(head["lm_head"])


def model_tensors(model: Model, params: list) -> dict:
    """`iter_model_tensors` as one ``{name: float32 numpy array}`` dict (the whole model's tensors at once)."""
    return dict(iter_model_tensors(model, params))


# -- the model ------------------------------------------------------------------------------------------------

def _check_int(name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise LlamaFormatError(f"LlamaModel.{name} must be an integer >= {minimum}, got {value!r}")


@gin.configurable
def LlamaModel(path: str | None = None, *, seed: int = 0, sequence_length: int | None = None,
               form: str = "standard", compute_dtype: str = "float32", grid_bits: int = 18, gamma: float = 0.125,
               chunk: int | None = None, vocab_size: int | None = None, d_model: int = 128, num_layers: int = 4,
               num_heads: int = 4, num_kv_heads: int = 2, d_ff: int | None = None, rms_norm_eps: float = 1e-5,
               rope_theta: float = 10000.0, tie_embeddings: bool = False, load_weights: bool = True) -> Model:
    """A Llama-architecture language model of standard blocks (``train.model = @LlamaModel``).

    Args:
      path: a Hugging Face checkpoint directory (``config.json`` + safetensors weights): the sizes and
        weights are read from it and the size arguments below must be left unset. None: a new model of the
        given sizes, initialised from ``seed`` (layer ``i`` from ``fold_in(PRNGKey(seed), i)``).
      seed: initialisation seed of a new model (``train.seed``, passed by the loop).
      sequence_length: the task's sequence length (passed by the loop; tokens per example).
      form: "standard": every decoder block a standard layer (the reversible trainer saves each block's
        input); "exact": every block an `ExactResidual` reversible layer (BDIA update, bit-exact rebuild,
        ``g = 0`` at evaluation: the same standard model).
      compute_dtype: "float32" or "bfloat16" for the matmuls (parameters stay float32).
      grid_bits: the exact form's fixed-point grid ``2**-grid_bits`` (streams exact below
        ``2**(24 - grid_bits)`` in float32).
      gamma: the exact form's ``|g|`` (training draws ``g = +-gamma`` per example and block): ``2**-j``, ``j``
        in 1 .. 8 (0.5, 0.25, 0.125, ...); ``j`` side bits per element per block (``j / 32`` of a float32
        stream). Smaller trains closer to the standard model it evaluates; 1/8, 3 bits, is the measured
        choice (within 0.4% of backprop's quality on the Python fine-tune, 1/2 3.7-5.3%: docs/exact_residual.md).
      chunk: the head's logits and loss this many positions at a time (None: all).
      vocab_size: the task's vocabulary (passed by the loop): a new model's (default 256, bytes); with a
        checkpoint, it must not exceed the checkpoint's ``vocab_size``.
      d_model, num_layers, num_heads, num_kv_heads, d_ff (default ``swiglu`` width 8D/3 rounded to 8),
        rms_norm_eps, rope_theta, tie_embeddings: the sizes of a new model (unused with a ``path``: the
        run's ``config.gin`` then leaves them out).
      load_weights: with a ``path``, read its weights (False: only its ``config.json``, the parameters
        initialised from ``seed``; what ``eval``, ``sample``, ``export`` and ``check`` of a run use, whose
        weights come from the run's own checkpoints: `workdir_bindings`).

    Returns:
      A `Model` (``bits_per_byte`` True: the byte tasks feed byte ids). ``model.llama_spec`` and
      ``model.llama_form`` record the architecture for `revtrain export`; a tied head is a `Tie`. With a
      ``path``, ``model.keep_files`` names its ``config.json``, which a run copies into its workdir
      (`KEPT_CONFIG`), so the workdir needs the checkpoint directory no more.

    Raises:
      LlamaFormatError: a checkpoint revtrain cannot represent, or a bad setting (one line).
    """
    if form not in FORMS:
        raise LlamaFormatError(f"LlamaModel.form must be one of {list(FORMS)}, got {form!r}")
    if compute_dtype not in ("float32", "bfloat16"):
        raise LlamaFormatError(f"LlamaModel.compute_dtype must be 'float32' or 'bfloat16', got {compute_dtype!r}")
    if not (isinstance(grid_bits, int) and not isinstance(grid_bits, bool) and 1 <= grid_bits <= 60):
        raise LlamaFormatError(f"LlamaModel.grid_bits must be an integer in [1, 60], got {grid_bits!r}")
    try:
        low_bits = gamma_low_bits(gamma)
    except ValueError:
        raise LlamaFormatError(f"LlamaModel.gamma must be 2**-j with j in 1..8 (0.5, 0.25, 0.125, ..., "
                               f"{GAMMAS[-1]}), got {gamma!r}") from None
    if path is not None:
        if not isinstance(path, str):
            raise LlamaFormatError(f"LlamaModel.path must be a directory name, got {path!r}")
        spec = read_spec(os.path.expanduser(path))
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size > spec.vocab_size):
            raise LlamaFormatError(
                f"the task's vocabulary ({vocab_size!r} ids) is larger than the checkpoint's in {path} "
                f"({spec.vocab_size}): ids past its embedding table have no row; tokenize with at most "
                f"{spec.vocab_size} ids (TokenLMTask.tokenizer: the tokenizer the checkpoint was trained with; "
                "left unset, the checkpoint's own tokenizer.json / tokenizer.model; for a byte-level checkpoint of "
                "256 ids, train.task = @ByteLMTask)")
        if not isinstance(load_weights, bool):
            raise LlamaFormatError(f"LlamaModel.load_weights must be True or False, got {load_weights!r}")
        weights = read_weights(os.path.expanduser(path), spec) if load_weights else None
    else:
        vocab_size = 256 if vocab_size is None else vocab_size
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("num_layers", num_layers),
                            ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            _check_int(name, value)
        if d_ff is not None:
            _check_int("d_ff", d_ff)
        spec = LlamaSpec(vocab_size=vocab_size, hidden_size=d_model,
                         intermediate_size=d_ff or -(-(8 * d_model) // 24) * 8, num_layers=num_layers,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, rms_norm_eps=float(rms_norm_eps),
                         rope_theta=float(rope_theta), tie_word_embeddings=bool(tie_embeddings),
                         max_position_embeddings=sequence_length or 2048)
        spec.check()
        weights = None
    exact = form == "exact"
    base = jax.random.PRNGKey(seed)

    def rngs(i):
        return nnx.Rngs(params=jax.random.fold_in(base, i))

    # Each layer is lazy (`Layer.lazy`): its initial values are made (or read from the checkpoint) only when a
    # trainer places that layer, so the whole model never exists as numpy beside its placed copy.
    def embedding():
        embed = LlamaEmbedding(spec.vocab_size, spec.hidden_size, rngs=rngs(0),
                               exact_blocks=spec.num_layers if exact else 0, grid_bits=grid_bits,
                               low_bits=low_bits)
        if weights is not None:
            _set(embed.tokens.embedding, weights["model.embed_tokens.weight"])
        return embed

    def block(i, wrap=False):
        b = LlamaBlock(spec.hidden_size, rngs=rngs(1 + i), num_layers=spec.num_layers, num_heads=spec.num_heads,
                       num_kv_heads=spec.num_kv_heads, d_ff=spec.intermediate_size, eps=spec.rms_norm_eps,
                       rope_theta=spec.rope_theta, compute_dtype=compute_dtype)
        if weights is not None:
            load_block(b, weights, i)
        return ExactResidual(b, slot=i, grid_bits=grid_bits, gamma=gamma) if wrap else b

    def head():
        h = LlamaHead(spec.vocab_size, spec.hidden_size, rngs=rngs(1 + spec.num_layers), eps=spec.rms_norm_eps,
                      compute_dtype=compute_dtype, chunk=chunk)
        if weights is not None:
            _set(h.norm.scale, weights["model.norm.weight"])
            if not spec.tie_word_embeddings:
                _set(h.lm_head, weights["lm_head.weight"])
        # A tied head's projection is the embedding's (`Tie`): its own initial value is never used.
        return h

    layers: list[Layer] = [Layer.lazy(embedding, "embedding")]
    for i in range(spec.num_layers):
        if exact:
            layers.append(ReversibleLayer.lazy(functools.partial(block, i, True), f"block_{i}"))
        else:
            layers.append(Layer.lazy(functools.partial(block, i), f"block_{i}"))
    layers.append(HeadLayer.lazy(head, "head"))
    ties = (Tie(0, EMBEDDING_PATH, len(layers) - 1, HEAD_PATH),) if spec.tie_word_embeddings else ()
    kept, unused = {}, ()
    if path is not None:
        kept = {KEPT_CONFIG: os.path.join(os.path.abspath(os.path.expanduser(path)), CONFIG)}
        unused = tuple(f"LlamaModel.{name}" for name in SIZE_KNOBS)
    return Model(layers, input_key="inputs", tokens_per_example=sequence_length or 1, bits_per_byte=True, ties=ties,
                 keep_files=kept, unused_bindings=unused, llama_spec=spec, llama_form=form)


# The sizes of a new model: a checkpoint's config.json overrides them (and config.gin leaves them out).
SIZE_KNOBS = ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "rms_norm_eps", "rope_theta",
              "tie_embeddings")
KEPT_DIR = "pretrained"  # inside a workdir: what a run keeps of the checkpoint it imported
KEPT_CONFIG = os.path.join(KEPT_DIR, CONFIG)


def workdir_bindings(workdir: str) -> list[str]:
    """The gin bindings that rebuild a run's imported model from its workdir alone: ``LlamaModel.path`` at the
    architecture the run kept (``workdir/pretrained/config.json``) and ``LlamaModel.load_weights = False`` (the
    weights come from the run's checkpoints). Empty for a run that imported no checkpoint (or one made before
    runs kept it, which still reads ``LlamaModel.path``)."""
    folder = os.path.join(os.path.abspath(workdir), KEPT_DIR)
    if not os.path.isfile(os.path.join(folder, CONFIG)):
        return []
    return [f"LlamaModel.path = {folder!r}", "LlamaModel.load_weights = False"]


def checkpoint_dir(model_fn) -> str | None:
    """The checkpoint directory a model builder (``train.model``) imports: ``LlamaModel.path`` when the builder
    is `LlamaModel` and the path is bound to an existing directory, else None (a missing one is reported by
    `LlamaModel` itself)."""
    if model_fn is not LlamaModel:
        return None
    try:
        path = gin.query_parameter("LlamaModel.path")
    except ValueError:  # not bound
        return None
    if isinstance(path, gin.config.ConfigurableReference):  # a macro (CHECKPOINT = '...')
        path = path.scoped_configurable_fn()
    if not isinstance(path, str) or not os.path.isdir(os.path.expanduser(path)):
        return None
    return os.path.expanduser(path)


def forward_logits(model: Model, params: list, states: list, tokens) -> jax.Array:
    """Evaluation-mode logits of a model (tied leaves merged back, `Model.merge_tied`): float32 ``[B, T, V]``
    for int32 ``tokens [B, T]``. ``params`` in ``Model.init`` form. For tests and export checks."""
    owners = dict(enumerate(params))
    x = tokens
    for i, layer in enumerate(model.layers):
        p = model.merge_tied(i, params[i], owners)
        if layer.is_head:
            return layer.merge(p, states[i])(x, keys=None, train=False)
        x, _ = layer.apply(p, states[i], x, None, False)
    raise AssertionError("unreachable")
