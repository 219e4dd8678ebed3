"""The generation core: autoregressive byte sampling from the byte-level language model, with per-layer key/value caches.

``revtrain sample`` (`revtrain.sample`) and the training loop's samples (``train.sample_every``) call `generate`, which runs
the layers' incremental-decoding interface (``Layer.init_cache`` / ``Layer.decode``, see
`revtrain.layers.base`): the prompt is encoded in one ``decode`` of many positions, then every new byte
costs one position's work per layer (its attention reads the cached keys and values of the earlier
positions) instead of a forward over the whole prefix.

How a sample is made (context ``T`` = the model's sequence length, window ``W = T // 2``):

1. The prompt is cut to its last ``T`` bytes. Its first ``min(P, W)`` bytes are encoded at once at
   positions ``0 ..``; any further prompt bytes are fed one at a time (they are known, not drawn).
2. Each new byte is drawn from the head's logits at the last position (`next_tokens`: greedy at temperature
   0, else temperature, top-k and nucleus top-p filtering, then a categorical draw with the sample's own key
   ``fold_in(fold_in(PRNGKey(seed), sample index), byte index)``) and fed at the next position.
3. A model with learned absolute positions knows positions ``0 .. T - 1`` only. When the cache is full
   (``T`` positions), the last ``W`` bytes are re-encoded at positions ``0 .. W - 1`` into a fresh cache and
   generation goes on from position ``W``: every byte is predicted from at least the ``W`` bytes before it,
   at positions the model was trained on, and the re-encoding costs ``W`` positions once every ``T - W``
   bytes.
4. A model whose every layer is free of absolute positions (`slides`: rotary or no positions, e.g.
   `revtrain.layers.modern.GroupedQueryAttention`; position-wise layers) instead slides the cache window:
   each attention cache is a ring of ``T`` slots, generation goes on at positions ``T, T + 1, ..`` and each
   byte attends to the last ``T`` positions, with no re-encoding (every step costs the same). With two or
   more attention layers this computes a forward with banded attention over the whole text, not a forward
   over its last ``T`` bytes (see `revtrain.layers.modern` and ``docs/modern.md``).

Without offload, the whole generation is one compiled program per (model, prompt length, length, number of
samples); the sampling settings are runtime values. An offloaded state (``ReversibleTrainer.offload``: host
memory or layer files) is brought into device memory once and run the same way when its weights fit beside the
run, else streamed: every byte runs layer by layer, each layer's weights brought from its tier's store per use
(`revtrain.generate_weights`; the tier's own reader, `revtrain.tiers.Tier.sample_layers`). Samples are split
over the ``"data"`` mesh (all devices of all processes); their count is padded up to a multiple of the device
count (the extra rows are dropped), and a sample's bytes depend only on its index, so 1 and N devices give the
same text.

References: key/value caching for autoregressive Transformer decoding as in Vaswani et al. 2017 (tensor2tensor
fast decoding) and the Reformer's fast inference mode (Kitaev et al. 2020); nucleus sampling: Holtzman et
al., "The Curious Case of Neural Text Degeneration", ICLR 2020; top-k sampling: Fan et al., "Hierarchical
Neural Story Generation", ACL 2018.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from revtrain import metrics as metrics_lib
from revtrain.errors import ConfigError
from revtrain.placement import DATA_AXIS, HOST_MEMORY, DispatchLimiter, global_batch, move_inside, placer
from revtrain.trainers.common import XLA_OPTIONS, per_device

_D = P(DATA_AXIS)


class SampleError(ConfigError):
    """Bad sampling options or a model that cannot generate (one line, exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Options:
    """Sampling settings.

    Attributes:
      length: bytes to generate after the prompt (> 0).
      temperature: softmax temperature (>= 0); 0 is greedy (argmax).
      top_k: keep only the ``top_k`` most likely bytes before drawing (0: off).
      top_p: nucleus sampling: keep the most likely bytes whose probabilities sum to at least ``top_p``
        (in (0, 1]; 1: off).
      num_samples: independent samples from the same prompt (> 0).
      seed: the samples' PRNG seed; sample ``i`` draws with ``fold_in(PRNGKey(seed), i)``.
    """

    length: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_samples: int = 1
    seed: int = 0

    def check(self) -> None:
        """Raises `SampleError` (one line naming the flag) for an out-of-range setting."""
        if not isinstance(self.length, int) or self.length <= 0:
            raise SampleError(f"--length must be a positive integer, got {self.length!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0 and math.isfinite(self.temperature)):
            raise SampleError(f"--temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SampleError(f"--top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise SampleError(f"--top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise SampleError(f"--num_samples must be a positive integer, got {self.num_samples!r}")
        if not isinstance(self.seed, int):
            raise SampleError(f"--seed must be an integer, got {self.seed!r}")


def check_decodable(model, training: bool = False) -> None:
    """Raises `SampleError` unless every layer of ``model`` supports incremental decoding.

    The reversible Transformer LM does; the RevNet (convolutions, batch norm) does not. ``training``: the
    check of ``train.sample_every`` (the line then says how to turn the training samples off).
    """
    missing = [layer.name for layer in model.layers if not layer.can_decode]
    if missing and training:
        raise SampleError(f"train.sample_every is set but this model cannot generate text: its layer {missing[0]} "
                          "has no incremental decoding (init_cache / decode); set train.sample_every = 0 to train "
                          "it without samples")
    if missing:
        raise SampleError(f"this model cannot generate text: its layer {missing[0]} has no incremental decoding "
                          "(init_cache / decode); sampling needs a language model whose every layer decodes, such "
                          "as ReversibleTransformerLM")


# -- choosing the next byte ------------------------------------------------------------------------
def slides(model) -> bool:
    """Whether sampling from ``model`` may slide the cache window past the context (schedule, item 4).

    True when every layer's module (F and G of a coupling) either acts on each position on its own (a
    `revtrain.layers.base.PositionWise`) or declares ``sliding_cache = True`` (its ``decode`` keeps a ring
    cache and takes any position, e.g. rotary attention). Learned absolute positions (``ByteEmbedding``)
    and the dense cache of ``CausalSelfAttention`` do not.
    """
    from revtrain.layers.base import PositionWise

    def ok(module) -> bool:
        if isinstance(module, PositionWise) or getattr(module, "sliding_cache", False):
            return True
        f, g = getattr(module, "f", None), getattr(module, "g", None)
        return f is not None and g is not None and ok(f) and ok(g)

    return all(layer.can_decode and ok(layer.abstract_module()) for layer in model.layers)


def next_tokens(logits: jax.Array, keys: jax.Array, temperature, top_k=0, top_p=1.0) -> jax.Array:
    """Draws one token per row of ``logits``.

    The settings may be traced values (one compiled program serves every setting).

    Args:
      logits: float32 ``[B, V]``.
      keys: uint32 ``[B, 2]``, one PRNG key per row (unused when greedy).
      temperature: 0 for greedy (argmax), else the logits are divided by it.
      top_k: keep the ``top_k`` largest logits of each row (0 or >= V: all).
      top_p: keep the smallest set of largest logits whose probabilities (after temperature and top-k) sum
        to at least ``top_p`` (1: all). Ties at a cut-off are all kept.

    Returns:
      int32 ``[B]``.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    ordered = jnp.where(jnp.arange(vocab) < k, ordered, -jnp.inf)  # top-k, in sorted order
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    kept = jnp.where(top_p < 1.0, jnp.sum(before < top_p, axis=-1), k)  # >= 1: the first has 0 before it
    cutoff = jnp.take_along_axis(ordered, jnp.minimum(kept, k)[:, None] - 1, axis=-1)
    filtered = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def sample_keys(seed: int, num_samples: int) -> np.ndarray:
    """uint32 ``[num_samples, 2]``: key ``i`` is ``fold_in(PRNGKey(seed), i)``."""
    base = jax.random.PRNGKey(seed)
    return np.asarray(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, jnp.arange(num_samples)))


def _step_keys(keys, t):
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)


def _window(context: int) -> int:
    """Bytes kept (re-encoded at positions 0..W-1) when the cache is full: half the context."""
    return max(1, context // 2)


# -- the fused program (weights on the device) ----------------------------------------------------------
#
# Both drivers follow one schedule over the text ``[B, P + length]`` (prompt, then the new bytes). Byte ``n``
# is chosen from the model state that holds bytes ``< n`` (it is the prompt's own byte while ``n < P``,
# else drawn from the logits). Starting at ``n = min(P, W)``, a *segment* is:
#   * refill: encode the last ``<= W`` bytes before ``n`` into a fresh cache at positions ``0 ..`` (one
#     ``decode`` of a ``W``-byte chunk; positions after the real bytes hold padding, which no query ever
#     sees under the causal mask), and choose byte ``n``;
#   * steps: feed the byte just chosen at the next position and choose the following one, until the cache
#     holds ``T`` positions (or the text is complete); the next segment starts with a refill.
# A compiled program holds the model twice (chunk and one-byte step) whatever P is, and no per-byte branch
# (a ``lax.cond`` around the model would copy every cache in and out at each byte on XLA:CPU: measured 2x
# slower at the default model).
def _run_layers(layers, params, states, tokens, caches, pos):
    """Decodes ``tokens`` ``[b, S]`` at positions ``pos..``: returns (logits ``[b, S, V]``, new caches)."""
    x, new = tokens, []
    for i, layer in enumerate(layers):
        x, cache = layer.decode(params[i], states[i], x, caches[i], pos)
        new.append(cache)
    return x, new


def _choose(logits, keys, settings, text, n, prompt_len):
    """``text`` with byte ``n`` set: the prompt's below ``prompt_len``, else drawn from ``logits [b, V]``
    (`next_tokens`; the greedy case skips the draw)."""
    temperature = settings[0]
    drawn = lax.cond(temperature > 0,
                     lambda: next_tokens(logits, _step_keys(keys, jnp.maximum(n - prompt_len, 0)), *settings),
                     lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))
    given = lax.dynamic_index_in_dim(text, n, axis=1, keepdims=False)
    return lax.dynamic_update_slice(text, jnp.where(n < prompt_len, given, drawn)[:, None], (0, n))


@functools.lru_cache(maxsize=32)
def _fused_program(layers: tuple, mesh, context: int, prompt_len: int, length: int, sliding: bool = False):
    """One jitted ``shard_map`` program: ``(params, states, prompt [B, P], keys [B, 2], settings) -> bytes
    [B, length]``, ``settings`` = (temperature, top_k, top_p) scalars. ``sliding``: one segment whose steps
    go on past ``context`` (ring caches; `slides`)."""
    window = _window(context)
    total = prompt_len + length

    def generate(params, states, prompt, keys, settings):
        b = prompt.shape[0]
        fresh = per_device([layer.init_cache(b, context) for layer in layers])  # each device's own samples
        text = jnp.zeros((b, max(total, window)), jnp.int32).at[:, :prompt_len].set(prompt)

        def segment(carry):
            text, n = carry
            start = jnp.maximum(n - window, 0)
            chunk = lax.dynamic_slice(text, (0, start), (b, window))
            logits, caches = _run_layers(layers, params, states, chunk, fresh, 0)
            text = _choose(lax.dynamic_index_in_dim(logits, n - start - 1, axis=1, keepdims=False), keys,
                           settings, text, n, prompt_len)
            pos = n - start  # positions in the cache; steps fill it up to ``context`` (or slide on)
            count = total - 1 - n if sliding else jnp.minimum(context - pos, total - 1 - n)

            def step(k, carry):  # feed byte n + k - 1 at position pos + k - 1, choose byte n + k
                caches, text = carry
                last = lax.dynamic_slice(text, (0, n + k - 1), (b, 1))
                logits, caches = _run_layers(layers, params, states, last, caches, pos + k - 1)
                return caches, _choose(logits[:, 0], keys, settings, text, n + k, prompt_len)

            _, text = lax.fori_loop(1, count + 1, step, (caches, text))
            return text, n + count + 1

        text, _ = lax.while_loop(lambda carry: carry[1] < total, segment, (text, jnp.int32(min(prompt_len, window))))
        return text[:, prompt_len:total]

    mapped = jax.shard_map(generate, mesh=mesh, in_specs=(P(), P(), _D, _D, P()), out_specs=_D)
    return jax.jit(mapped, compiler_options=XLA_OPTIONS)


_EXECUTABLES: dict = {}  # compiled fused programs, by program and argument shapes / placements


def _compiled(program, args):
    """``(executable, seconds spent compiling it now)``: ``program.lower(*args).compile()``, once per
    program and argument signature (``lower`` bypasses jit's own cache, and is what lets the compile time
    be reported apart from the generation time)."""
    leaves, tree = jax.tree.flatten(args)
    key = (program, tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    start = time.perf_counter()
    _EXECUTABLES[key] = program.lower(*args).compile()
    return _EXECUTABLES[key], time.perf_counter() - start


# -- the layer-by-layer driver (weights offloaded to host memory) -------------------------------------
@functools.lru_cache(maxsize=64)
def _layer_program(layer, mesh):
    """``(params, state, x, cache, pos) -> (y, new_cache)`` for one layer, batch split over ``"data"``.
    ``params`` may be in host memory: the program moves them to the device itself (as the trainer's
    offloaded programs do), so the caller neither copies weights nor waits between layers."""
    def decode(params, state, x, cache, pos):
        return layer.decode(move_inside(params, jax.memory.Space.Device), state, x, cache, pos)

    mapped = jax.shard_map(decode, mesh=mesh, in_specs=(P(), P(), _D, _D, P()), out_specs=(_D, _D))
    return jax.jit(mapped, donate_argnums=(3,), compiler_options=XLA_OPTIONS)


def _empty_cache(layer, mesh, batch_size: int, context: int):
    """``layer.init_cache`` as global arrays split over ``"data"`` (zeros placed directly, no program)."""
    shapes = jax.eval_shape(lambda: layer.init_cache(batch_size, context))
    sharding = NamedSharding(mesh, _D)
    return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), sharding), shapes)


@functools.lru_cache(maxsize=16)
def _choose_program(mesh):
    """``(logits [B, S, V], index, keys, t, text, n, settings) -> text`` with byte ``n`` drawn from
    ``logits[:, index]``."""
    def choose(logits, index, keys, t, text, n, settings):
        row = lax.dynamic_index_in_dim(logits, index, axis=1, keepdims=False)
        token = next_tokens(row, _step_keys(keys, t), *settings)[:, None]
        return lax.dynamic_update_slice(text, token, (0, n))
    mapped = jax.shard_map(choose, mesh=mesh, in_specs=(_D, P(), _D, P(), _D, P(), P()), out_specs=_D)
    return jax.jit(mapped, donate_argnums=(4,))


@functools.lru_cache(maxsize=16)
def _slice_program(mesh, width: int):
    """``(text [B, N], start) -> text[:, start:start + width]``."""
    mapped = jax.shard_map(lambda text, start: lax.dynamic_slice_in_dim(text, start, width, axis=1), mesh=mesh,
                           in_specs=(_D, P()), out_specs=_D)
    return jax.jit(mapped)


@functools.lru_cache(maxsize=16)
def _text_program(mesh, size: int):
    """``prompt [B, P] -> text [B, size]``: the prompt followed by zeros."""
    def text(prompt):
        return jnp.zeros((prompt.shape[0], size), jnp.int32).at[:, :prompt.shape[1]].set(prompt)
    return jax.jit(jax.shard_map(text, mesh=mesh, in_specs=_D, out_specs=_D))


def _settings(opts: Options):
    """The traced sampling settings: float32 temperature, int32 top_k, float32 top_p."""
    return (np.float32(opts.temperature), np.int32(opts.top_k), np.float32(opts.top_p))


def _generate_layerwise(trainer, ts, prompt, keys, context: int, opts: Options, fetch=None, limit=None):
    """The schedule of `_fused_program`, one compiled call per layer and step (for offload). ``fetch(i)``: layer
    ``i``'s params at each call (default: the state's own, in host memory); ``limit``: the dispatch bound
    (default: a `DispatchLimiter`)."""
    layers, mesh = trainer.model.layers, trainer.mesh
    batch, prompt_len = prompt.shape
    window = _window(context)
    sliding = slides(trainer.model)
    first = min(prompt_len, window)

    # In host memory: each layer's program moves its own weights to the device. A tied layer (the head of
    # a tied embedding/head) gets its tied leaves from their owner's params (`Model.merge_tied`), also in
    # host memory: the layer's program moves them with its own.
    model = trainer.model
    if fetch is None:
        params = [model.merge_tied(i, p, ts.params) if model.ties_of(i) else p for i, p in enumerate(ts.params)]
        fetch = params.__getitem__
    limit = limit or DispatchLimiter(mesh)  # bounded asynchronous dispatch on a multi-device CPU (placement.py)

    def run(tokens, caches, pos):
        x = tokens
        for i, layer in enumerate(layers):
            x, caches[i] = limit(_layer_program(layer, mesh)(fetch(i), trainer.layer_state(ts, i), x, caches[i],
                                                             np.int32(pos)))
        return x, caches

    text = _text_program(mesh, max(prompt_len + opts.length, window))(prompt)
    choose = _choose_program(mesh)
    caches, pos = None, 0
    for n in range(first, prompt_len + opts.length):
        if n == first or (pos == context and not sliding):
            start = max(n - window, 0)
            fresh = [_empty_cache(layer, mesh, batch, context) for layer in layers]
            logits, caches = run(_slice_program(mesh, window)(text, np.int32(start)), fresh, 0)
            index, pos = n - start - 1, n - start
        else:
            logits, caches = run(_slice_program(mesh, 1)(text, np.int32(n - 1)), caches, pos)
            index, pos = 0, pos + 1
        if n >= prompt_len:
            text = choose(logits, np.int32(index), keys, np.int32(n - prompt_len), text, np.int32(n),
                          _settings(opts))
    return _slice_program(mesh, opts.length)(text, np.int32(prompt_len))


# -- the public entry points ------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    """What `generate` made.

    Attributes:
      samples: ``num_samples`` byte strings of ``length`` generated bytes each (the prompt not included);
        for a prompt of token ids, int32 arrays of ``length`` generated ids each.
      prompt: the prompt the model saw (the last ``context`` bytes or ids of the given prompt).
      seconds: wall time of the generation (after compilation, for the fused program).
      compile_seconds: time spent compiling the fused program (0 when it was cached, or layer by layer).
      devices: devices the samples were split over.
    """

    samples: list
    prompt: bytes
    seconds: float
    compile_seconds: float
    devices: int

    @property
    def bytes_per_second(self) -> float:
        return sum(len(s) for s in self.samples) / max(self.seconds, 1e-9)


def generate(trainer, ts, prompt: bytes, context: int, opts: Options, *, plan=None, weights: str | None = None) -> Result:
    """Samples ``opts.num_samples`` continuations of ``prompt`` from the model of ``trainer`` at ``ts``.

    Every process of a multi-process run must call it (the samples are split over all devices); every
    process gets all samples.

    Args:
      trainer: a trainer whose model's layers all support decoding (`check_decodable`); with
        ``offload`` its weights are held in device memory when they fit, else streamed layer by layer
        (`revtrain.generate_weights.choose`).
      ts: the `TrainState` (restored checkpoint, or the training loop's current state).
      prompt: at least one byte (bytes: a byte-level model), or at least one token id (an int sequence: a
        model of a tokenizer's ids); only its last ``context`` bytes / ids are used. ``opts.length`` counts
        the same units.
      context: the model's sequence length (its learned positions).
      opts: sampling settings (checked here).
      plan: the training run's `revtrain.planning.MemoryPlan` (an offloaded state: the weights are held only
        when they fit beside it; `revtrain.generate_weights.choose`).
      weights: an offloaded state: ``"hold"`` or ``"stream"`` its weights whatever the plan says (None: the
        plan decides; one line says which and why).

    Returns:
      a `Result`.

    Raises:
      SampleError: bad options, an empty prompt, or a model that cannot decode.
    """
    opts.check()
    check_decodable(trainer.model)
    if len(prompt) == 0:
        raise SampleError("the prompt is empty: give at least one byte (--prompt or --prompt_file)")
    tokens = not isinstance(prompt, (bytes, bytearray))  # token ids of a tokenizer, not bytes
    prompt = np.asarray(prompt, np.int32)[-context:] if tokens else bytes(prompt[-context:])
    mesh = trainer.mesh
    devices, processes = mesh.size, jax.process_count()
    batch = -(-opts.num_samples // devices) * devices
    local = batch // processes
    first = jax.process_index() * local
    rows = np.tile(prompt if tokens else np.frombuffer(prompt, np.uint8).astype(np.int32), (local, 1))
    keys = sample_keys(opts.seed, batch)[first:first + local]
    inputs = global_batch({"prompt": rows, "keys": keys}, mesh)
    compile_seconds = 0.0
    stream = fetch = limit = None
    layerwise = False
    tier = trainer.residency
    if tier.offloaded:  # hold the weights (below) when they fit, else stream them layer by layer
        from revtrain import generate_weights, streaming
        choice = generate_weights.choose(ts.params, trainer.model, batch, context, tier, plan=plan, mode=weights)
        metrics_lib.log(choice.line)
        layerwise = choice.mode == generate_weights.STREAM
        stream = tier.sample_layers(ts.params, placer(mesh)) if layerwise else None
        if stream is not None:  # the tier's own reader (e.g. each layer read from its file, the next ahead)
            fetch = generate_weights.tied_fetch(trainer.model, stream.get)
            limit = streaming.Bounded(DispatchLimiter(mesh))  # the layers in flight, bounded
        elif layerwise and tier.memory_kind != HOST_MEMORY:
            # A pageable host store: each layer's weights copied to the device as it is used (a program moves
            # only pinned memory itself), as the training step's engine does.
            fetch = lambda i: trainer.layer_params(ts, i)  # noqa: E731
    if layerwise:
        start = time.perf_counter()
        try:
            out = _generate_layerwise(trainer, ts, inputs["prompt"], inputs["keys"], context, opts, fetch, limit)
            out = _gather(out)
        finally:
            if stream is not None:
                stream.close()
    else:
        params = [trainer.layer_params(ts, i) for i in range(len(trainer.model.layers))]
        states = [trainer.layer_state(ts, i) for i in range(len(trainer.model.layers))]
        program = _fused_program(tuple(trainer.model.layers), mesh, context, len(prompt), opts.length,
                                 slides(trainer.model))
        args = (params, states, inputs["prompt"], inputs["keys"], _settings(opts))
        compiled, compile_seconds = _compiled(program, args)
        start = time.perf_counter()
        out = _gather(compiled(*args))
    seconds = time.perf_counter() - start
    samples = [row.astype(np.int32) if tokens else bytes(row.astype(np.uint8)) for row in out[:opts.num_samples]]
    return Result(samples, prompt, seconds, compile_seconds, devices)


def _gather(x: jax.Array) -> np.ndarray:
    """A global array as one numpy array on every process."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def show(data: bytes) -> str:
    """Bytes as text for a terminal or a JSON string: UTF-8, invalid sequences as U+FFFD."""
    return data.decode("utf-8", errors="replace")


def printable(text: str) -> str:
    """``text`` safe to write to a terminal: every control character but newline and tab (C0, DEL, C1) as a
    ``\\xNN`` escape, so a sample's bytes cannot move the cursor, clear the screen or reset the terminal (an
    untrained model emits ESC as readily as a letter). The exact text stays in ``samples.jsonl`` and
    ``--output`` files."""
    return "".join(c if c in "\n\t" or not (ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0) else f"\\x{ord(c):02x}"
                   for c in text)



# -- samples during training -----------------------------------------------------------------------
def check_training_sample(run) -> None:
    """Refuses ``train.sample_every`` for a model that cannot generate (before the run writes anything).

    Raises:
      SampleError: the model's layers cannot decode, or ``train.sample_length`` is not positive.
    """
    check_decodable(run.model, training=True)
    length, prompt = run.cfg.sample_length, run.cfg.sample_prompt
    if not isinstance(length, int) or length <= 0:
        raise SampleError(f"train.sample_length must be a positive integer, got {length!r}")
    if not isinstance(prompt, str) or not prompt:
        raise SampleError(f"train.sample_prompt must be a non-empty string, got {prompt!r}")


def training_sample(run, ts, writer: metrics_lib.MetricWriter) -> dict:
    """Greedily continues ``train.sample_prompt`` by ``train.sample_length`` bytes from the current state,
    appends ``{step, prompt, text}`` to ``metrics/samples.jsonl``, adds it to TensorBoard as text
    (``samples``) and logs it. Every process must call it (the computation spans all devices); process 0
    writes. Returns the record."""
    prompt = run.cfg.sample_prompt.encode("utf-8")
    tokenized = run.task.tokenized  # a tokenizer's ids: the prompt encoded, the sample decoded (bytes: as they are)
    result = generate(run.trainer, ts, run.task.encode(prompt), run.task.sequence_length,
                      Options(length=run.cfg.sample_length, temperature=0.0), plan=run.plan)
    text = show(run.task.decode(result.samples[0]))
    record = {"prompt": run.cfg.sample_prompt, "text": text}
    writer.write("samples", ts.step, record)
    # TensorBoard's text plugin renders Markdown: indent every line to show the bytes as a code block.
    writer.add_text("samples", "\n".join("    " + line for line in (run.cfg.sample_prompt + text).split("\n")),
                    ts.step)
    metrics_lib.log(f"sample at step {ts.step} (greedy, {result.bytes_per_second:,.0f} "
                    f"{'tokens' if tokenized else 'bytes'}/s):\n"
                    f"{printable(run.cfg.sample_prompt + text)}")
    return {"step": ts.step, **record}
