"""The reversible Transformer byte language model (Reformer style), as a composition of parts."""

from __future__ import annotations

import functools

import gin
import jax.numpy as jnp

from revtrain.layers.chunked import check_chunk
from revtrain.layers.transformer import (ByteEmbedding, CausalSelfAttention, FeedForward, LanguageModelHead,
                                         depth_scaled_init)
from revtrain.models.base import Model
from revtrain.models.compose import Coupling, Head, Repeat, Standard, compose

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@gin.configurable
def ReversibleTransformerLM(sequence_length: int, *, seed: int = 0, vocab_size: int = 256, num_layers: int = 6,
                            d_model: int = 128, num_heads: int = 4, d_ff: int | None = None,
                            dropout_rate: float = 0.1, compute_dtype: str = "float32",
                            grid_bits: int | None = 18, attention_block: int | None = None,
                            ff_chunk: int | None = None, head_chunk: int | None = None) -> Model:
    """Builds the reversible Transformer LM as a layer list.

    Layers: ``ByteEmbedding`` (standard; int32 ``[B, T]`` -> two float32 ``[B, T, d_model]`` streams),
    ``num_layers`` reversible couplings (F = causal self-attention, G = feed-forward), and the head
    (stream concatenation, LayerNorm, ``vocab_size`` logits, softmax cross-entropy). It is the composition
    ``[embedding/Standard(ByteEmbedding), block/Repeat(Coupling(CausalSelfAttention, FeedForward)),
    head/Head(LanguageModelHead)]`` (`revtrain.models.compose`; ``configs/enwik_small.gin`` writes the same
    model in gin), kept under this name for the runs whose ``config.gin`` names it.

    Args:
      sequence_length: T, the longest input the position embedding accepts.
      seed: initialisation seed; layer ``i`` is initialised from ``fold_in(seed, i)`` so a layer's initial
        weights do not depend on the depth of the model.
      vocab_size: 256 for bytes.
      num_layers: number of reversible blocks.
      d_model: width of each residual stream.
      num_heads: attention heads (must divide ``d_model``).
      d_ff: feed-forward width (default ``4 * d_model``).
      dropout_rate: dropout on the embedding and on the outputs of F and G.
      compute_dtype: "float32" or "bfloat16" for F, G and the embedding matmuls; weights, optimizer state and
        residual streams stay float32.
      grid_bits: the embedding output and every F / G output are rounded to multiples of ``2**-grid_bits``
        so that the couplings are exactly invertible in float32 while the streams stay below
        ``2**(24 - grid_bits)`` in magnitude (64 for the default 18: the default model's streams reach
        20 after training, beyond the 16 of grid_bits 20); None turns the rounding off (the rebuild is then
        exact only up to float rounding). ``revtrain check`` reports streams beyond the range. See
        ``revtrain.layers.snap_to_grid``.
      attention_block: None: dense causal attention (``[B, H, T, T]`` scores, quadratic memory); an
        integer: exact blockwise attention in tiles of that many positions (online softmax with a
        recomputing backward; memory linear in T, tiles above the diagonal skipped). T need not be a
        multiple of it (the last tile is padded). See ``revtrain.layers.attention``.
      ff_chunk: run each feed-forward ``ff_chunk`` positions at a time (None: all at once), so the
        ``[B, T, d_ff]`` activations never exist whole. See ``revtrain.layers.chunked``.
      head_chunk: compute the head's logits and cross-entropy (``LanguageModelHead.loss``) ``head_chunk``
        positions at a time (None: all at once), so ``[B, T, vocab_size]`` logits never exist whole.

    The three length knobs change how, not what, is computed: the same model and parameters (a checkpoint
    trained with one setting loads with any other), equal results up to float rounding.

    Raises:
      ValueError: for non-positive sizes, an unknown dtype, ``grid_bits`` outside [1, 60], ``d_model``
        not divisible by ``num_heads``, or an ``attention_block`` / ``ff_chunk`` / ``head_chunk`` that is
        not a positive integer or None.
    """
    for name, value in (("num_layers", num_layers), ("d_model", d_model), ("num_heads", num_heads),
                        ("sequence_length", sequence_length)):
        if value < 1:
            raise ValueError(f"ReversibleTransformerLM.{name} must be positive, got {value}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"ReversibleTransformerLM.dropout_rate must be in [0, 1), got {dropout_rate}")
    if compute_dtype not in _DTYPES:
        raise ValueError(f"ReversibleTransformerLM.compute_dtype must be one of {sorted(_DTYPES)}, got {compute_dtype!r}")
    if grid_bits is not None and not (isinstance(grid_bits, int) and 1 <= grid_bits <= 60):
        raise ValueError(f"ReversibleTransformerLM.grid_bits must be an integer in [1, 60] or None, got {grid_bits!r}")
    for name, value in (("attention_block", attention_block), ("ff_chunk", ff_chunk), ("head_chunk", head_chunk)):
        check_chunk(f"ReversibleTransformerLM.{name}", value)
    if d_model % num_heads:
        raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
    dtype = _DTYPES[compute_dtype]
    d_ff = d_ff or 4 * d_model
    # Output projections start small (GPT-2 style, std 0.02 / sqrt(2 * depth)): each block starts near the
    # identity, which keeps deep stacks stable and the inverse well conditioned.
    out_init = depth_scaled_init(num_layers)
    specs = [
        Standard(functools.partial(ByteEmbedding, vocab_size, d_model, sequence_length, dropout_rate,
                                   grid_bits=grid_bits), name="embedding"),
        Repeat(Coupling(functools.partial(CausalSelfAttention, d_model, num_heads, dropout_rate, dtype, out_init,
                                          attention_block=attention_block),
                        functools.partial(FeedForward, d_model, d_ff, dropout_rate, dtype, out_init, chunk=ff_chunk),
                        name="block"), num_layers),
        Head(functools.partial(LanguageModelHead, d_model, vocab_size, chunk=head_chunk), name="head"),
    ]
    return compose(specs, seed=seed, grid_bits=grid_bits, input_key="inputs", tokens_per_example=sequence_length,
                   bits_per_byte=True, memory_knobs=("attention blocking (ReversibleTransformerLM.attention_block)",))
