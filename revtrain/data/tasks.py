"""Tasks: what data a run reads and how its model is sized from it (gin-configurable).

A task gives the loop three things: ``model_kwargs()`` (passed to the model builder), ``train_iterator``
(a checkpointable Grain iterator of this process's share of each global batch) and ``eval_batches``.
"""

from __future__ import annotations

import gin

from revtrain.data import byte_lm, pipeline


@gin.configurable
class ByteLMTask:
    """Byte-level language modelling (vocab 256) on a TFDS ``ByteLM`` dataset.

    Args:
      source: ``"gensim_enwiki"`` (the English-Wikipedia XML excerpt from the gensim 4.4.0 wheel, prepared
        by ``scripts/prepare_data.py``), a path to ``enwik8`` / ``enwik8.zip`` / any file, or a directory
        of text files.
      sequence_length: tokens (bytes) per example, T.
      data_dir: dataset cache (default ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``).

    Raises:
      byte_lm.DataError: missing, empty or corrupt source, or a sequence length longer than a split.
    """

    bits_per_byte = True

    def __init__(self, source: str = byte_lm.GENSIM_SOURCE, sequence_length: int = 128,
                 data_dir: str | None = None):
        if sequence_length < 1:
            raise byte_lm.DataError(f"ByteLMTask.sequence_length must be positive, got {sequence_length}")
        self.source = source
        self.sequence_length = sequence_length
        self.data_dir = data_dir or byte_lm.default_data_dir()
        self.builder = byte_lm.load_byte_lm(source, sequence_length, self.data_dir)

    def model_kwargs(self) -> dict:
        return {"sequence_length": self.sequence_length}

    def input_spec(self, batch_size: int) -> dict:
        """Shapes of a batch of ``batch_size`` examples: ``{'inputs', 'targets'}`` int32 ``[batch_size, T]``."""
        import jax
        import numpy as np
        shape = jax.ShapeDtypeStruct((batch_size, self.sequence_length), np.int32)
        return {"inputs": shape, "targets": shape}

    def check_batch_size(self, batch_size: int) -> None:
        """Raises ``byte_lm.DataError`` when the train split holds fewer sequences than one global batch of
        ``batch_size`` (every batch would repeat sequences; at long lengths a corpus has few of them: the
        default source holds 83 training sequences of 65,536 bytes)."""
        count = self.builder.info.splits["train"].num_examples
        if count < batch_size:
            raise byte_lm.DataError(
                f"the train split of {self.source} has {count} sequence{'s' if count != 1 else ''} of "
                f"ByteLMTask.sequence_length = {self.sequence_length} bytes, fewer than one global batch "
                f"(train.batch_size = {batch_size}); lower train.batch_size or the sequence length, or use a "
                "larger corpus")

    def train_iterator(self, batch_size: int, seed: int, shard_index: int, shard_count: int):
        """Checkpointable iterator of ``{'inputs','targets'}`` int32 ``[batch_size, T]`` (this process's share)."""
        ds = pipeline.train_dataset(self.builder, batch_size=batch_size, seed=seed, shard_index=shard_index,
                                    shard_count=shard_count)
        return iter(ds)

    def eval_batches(self, split: str, batch_size: int, max_batches: int | None, shard_index: int,
                     shard_count: int):
        """Ordered batches covering ``split`` once, padded with weight-0 rows."""
        return pipeline.eval_batches(self.builder, split=split, batch_size=batch_size, max_batches=max_batches,
                                     shard_index=shard_index, shard_count=shard_count)
