"""Logits of a trained run from Python: load a workdir, get logits or log-probabilities for token ids.

The supported way to compare a revtrain model with another implementation (``transformers``, PyTorch) or to
use it in your own code::

    from revtrain import logits
    run = logits.load("runs/enwik_modern")             # the newest checkpoint (step=N: that one)
    out = run.logits(np.array([[91, 91, 67]]))           # float32 [B, T, V]
    lp = run.log_probs(np.array([[91, 91, 67, 97]]))     # float32 [B, T - 1]: log p(token t | tokens < t)

It restores the checkpoint with the run's own config (``workdir/config.gin``, the Python modules the run
imported), builds its model and computes the evaluation-mode forward (no dropout, BDIA ``g = 0``) layer by
layer in one compiled program, with tied leaves merged back. Weights that the run kept in host memory
(``ReversibleTrainer.offload``) are moved to the device first, so the program never computes on host
arrays. The gin configuration is cleared again once the run is loaded.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from revtrain.errors import ConfigError, UsageError


class LogitsError(ConfigError):
    """Bad token ids for the run's model (a one-line message)."""


class LoadedRun:
    """A run's model and restored weights (`load` makes one).

    Attributes:
      workdir: the run's directory (absolute). step: the restored checkpoint's step.
      model: the run's `revtrain.models.base.Model`. params, states: per-layer params (device arrays, tied
        leaves merged) and layer states. sequence_length: the longest input the model was trained on
        (``vocab_size``: the number of logits per position).
    """

    def __init__(self, workdir, step, model, params, states, sequence_length, vocab_size):
        self.workdir, self.step, self.model = workdir, step, model
        self.params, self.states = params, states
        self.sequence_length, self.vocab_size = sequence_length, vocab_size
        self._forward = jax.jit(self._logits)

    def _logits(self, params, states, tokens):
        x = tokens
        for i, layer in enumerate(self.model.layers):
            x = layer.apply(params[i], states[i], x, None, False)[0]
        return x

    def _check(self, tokens) -> np.ndarray:
        given = np.asarray(tokens)
        tokens = given[None] if given.ndim == 1 else given
        if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise LogitsError(f"token ids must be a non-empty integer array [B, T] (or [T]), got dtype {given.dtype} "
                              f"shape {given.shape}")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise LogitsError(f"token ids must be in [0, {self.vocab_size}), got {tokens.min()}..{tokens.max()}")
        if tokens.shape[1] > self.sequence_length:
            raise LogitsError(f"{tokens.shape[1]} tokens are more than the model's sequence length "
                              f"{self.sequence_length}")
        return tokens.astype(np.int32)

    def logits(self, tokens) -> np.ndarray:
        """float32 ``[B, T, V]`` next-token logits for int ``tokens [B, T]`` (or ``[T]``: ``B = 1``),
        ``T <= sequence_length``; position ``t`` scores the token after ``tokens[:, t]``.

        Raises:
          LogitsError: not a 1-D or 2-D integer array, ids outside the vocabulary, or too long.
        """
        tokens = self._check(tokens)
        padded = np.zeros((tokens.shape[0], self.sequence_length), np.int32)  # one compiled shape; causal:
        padded[:, :tokens.shape[1]] = tokens  # the padding after the last token changes nothing before it
        out = self._forward(self.params, self.states, padded)
        return np.asarray(out[:, :tokens.shape[1]], np.float32)

    def log_probs(self, tokens) -> np.ndarray:
        """float32 ``[B, T - 1]``: ``log p(tokens[:, t] | tokens[:, :t])`` for ``t >= 1`` (natural log;
        their negative mean is the loss ``revtrain eval`` reports on such a batch).

        Raises:
          LogitsError: as `logits`, or fewer than two tokens.
        """
        tokens = self._check(tokens)
        if tokens.shape[1] < 2:
            raise LogitsError("log_probs needs at least two tokens (the first one is only context)")
        z = self.logits(tokens)[:, :-1].astype(np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        return np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0].astype(np.float32)


def load(workdir: str, step: int | None = None, bindings: list[str] | tuple = ()) -> LoadedRun:
    """Restores checkpoint ``step`` (None: the newest one that restores) of the run in ``workdir``.

    Args:
      workdir: a directory ``revtrain train`` wrote (``config.gin`` and ``checkpoints/``).
      step: the checkpoint's step, or None.
      bindings: extra gin bindings (``'NAME = VALUE'``) applied after the run's config, e.g. a moved
        ``LlamaModel.path``.

    Returns:
      a `LoadedRun`.

    Raises:
      ConfigError: no ``config.gin`` (not a workdir) or a config that cannot be built.
      revtrain.checkpoint.CheckpointError: no checkpoints, no such step, or every checkpoint damaged.
    """
    import gin

    from revtrain import checkpoint as ckpt_lib
    from revtrain import ginconfig, registry
    from revtrain import run as run_lib
    from revtrain import metrics as metrics_lib
    workdir = os.path.abspath(workdir)
    config = ginconfig.workdir_config(workdir, ConfigError)
    try:
        try:
            registry.parse_gin([config], list(bindings), workdir=workdir)
        except UsageError as e:
            raise ConfigError(str(e)) from None
        try:
            cfg = run_lib.TrainConfig()
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e).splitlines()[0]) from e
        # A library call: no progress lines (the shard_state summary), no Orbax warnings of a read-only restore.
        with metrics_lib.silenced():
            checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
            try:
                checkpointer.chosen_step(step)
                run = run_lib.build(cfg, workdir, say_data=False)  # the workdir: its kept tokenizer and architecture
                ts, chosen = checkpointer.restore_newest(run.trainer.abstract_state(), step, optimizer_state=False,
                                                         accept=run_lib.same_model(run, workdir))
            finally:
                checkpointer.close()
    finally:
        gin.clear_config()
    trainer, layers, device = run.trainer, run.model.layers, jax.local_devices()[0]
    # Tied leaves merged; host-memory (offloaded) or sharded weights gathered, then placed on one device.
    params = [jax.device_put(jax.device_get(trainer.layer_params(ts, i)), device) for i in range(len(layers))]
    states = [jax.device_put(jax.device_get(trainer.layer_state(ts, i)), device) for i in range(len(layers))]
    length = run.task.sequence_length
    loaded = LoadedRun(workdir, chosen, run.model, params, states, length, vocab_size=0)
    shape = jax.eval_shape(loaded._logits, params, states, jax.ShapeDtypeStruct((1, length), np.int32)).shape
    loaded.vocab_size = shape[-1]
    return loaded
