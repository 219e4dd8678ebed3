"""Grain input pipeline over a prepared byte-LM builder (see ``revtrain.data.byte_lm``).

Records are ``{'bytes': uint8 [L + 1]}``; batches are ``{'inputs': int32 [B, L],
'targets': int32 [B, L]}`` with ``targets[:, t] == inputs[:, t + 1]``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np
import tensorflow_datasets as tfds

from revtrain.errors import DataError

# Ordered thread prefetch: deterministic, and the iterator state is the index of the next batch.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)


def _check_shard(shard_index: int, shard_count: int) -> None:
    if not 0 <= shard_index < shard_count:
        raise ValueError(
            f"need 0 <= shard_index < shard_count, got {shard_index} and {shard_count}"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _split_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    records = (batch["tokens"] if "tokens" in batch else batch["bytes"]).astype(np.int32)
    return {"inputs": records[:, :-1], "targets": records[:, 1:]}


def _source(data, split: str):
    """``(records, key, sequence_length)`` of a split: a TFDS byte-LM builder's ``as_data_source`` (records
    ``{'bytes'}``), or the windows of a token task (``data.windows(split)``, `revtrain.data.token_lm.TokenWindows`,
    records ``{'tokens'}``).

    Raises:
      ValueError: a builder without that split.
    """
    if isinstance(data, tfds.core.DatasetBuilder):
        if split not in data.info.splits:
            raise ValueError(f"unknown split {split!r}; have {sorted(data.info.splits)}")
        return data.as_data_source(split=split), "bytes", data.info.features["bytes"].shape[0] - 1
    windows = data.windows(split)
    return windows, "tokens", windows.sequence_length


def train_dataset(
    builder: tfds.core.DatasetBuilder,
    *,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.IterDataset:
    """Endless, shuffled training batches for this process.

    Every process walks the same global order: the 'train' split shuffled with ``seed`` (reshuffled
    every epoch), cut into global batches of ``batch_size * shard_count`` records. Process
    ``shard_index`` yields rows ``[shard_index * B, (shard_index + 1) * B)`` of each global batch and
    reads only those records. So the global batch at every step is the same examples in the same
    order whatever the number of processes (``jax.make_array_from_process_local_data`` puts process
    ``p``'s rows at global rows ``p*B ...``), and a run on 2 processes follows the 1-process one.
    Batches may straddle an epoch boundary, so no record is dropped.

    Args:
      builder: a prepared byte-LM builder (``load_byte_lm``), or a `revtrain.data.tasks.TokenLMTask`
        (anything with ``windows(split)``).
      batch_size: per-process batch size B (the global batch divided by ``shard_count``).
      seed: shuffle seed, in [0, 2**32).
      shard_index: this process's index (``jax.process_index()``).
      shard_count: number of processes (``jax.process_count()``).

    Returns:
      A ``grain.IterDataset`` of ``{'inputs': int32 [B, L], 'targets': int32 [B, L]}``. Its
      iterators are checkpointable: ``it.get_state()`` / ``it.set_state(state)`` restore the exact
      position (the number of batches read, the same on every process).

    Raises:
      ValueError: bad batch size or shard arguments.
      DataError: the train split has no records.
    """
    _check_shard(shard_index, shard_count)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ds = grain.MapDataset.source(_source(builder, "train")[0])
    if len(ds) == 0:
        raise DataError("the train split has no records; use a larger corpus")
    # Local batch j of this process is local-sized batch j * shard_count + shard_index of the global
    # stream, i.e. its slice of global batch j; slicing a MapDataset is lazy, so only these records
    # are read.
    ds = ds.shuffle(seed=seed).repeat().batch(batch_size, drop_remainder=True)
    ds = ds[shard_index::shard_count].map(_split_batch)
    return ds.to_iter_dataset(_READ_OPTIONS)


def eval_batches(
    builder: tfds.core.DatasetBuilder,
    *,
    split: str,
    batch_size: int,
    max_batches: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
) -> Iterator[dict[str, np.ndarray]]:
    """Yields one in-order pass over this process's share of ``split``, every target once.

    The split is cut in order into global batches of ``batch_size * shard_count`` records; process
    ``shard_index`` reads rows ``[shard_index * B, (shard_index + 1) * B)`` of each, so the global
    batches (and the records ``max_batches`` selects) are the same whatever the number of processes.
    Every process yields the same number of batches, ``ceil(N / (batch_size * shard_count))`` for N
    records (at most ``max_batches``), so collective eval steps stay in lockstep; rows past the end
    of the data are zeros with weight 0.

    Args:
      builder: a prepared byte-LM builder (``load_byte_lm``), or anything with ``windows(split)``.
      split: 'train', 'validation' or 'test'.
      batch_size: per-process batch size B.
      max_batches: stop after this many batches (None: the whole split).
      shard_index: this process's index (``jax.process_index()``).
      shard_count: number of processes (``jax.process_count()``).

    Returns:
      An iterator of ``{'inputs': int32 [B, L], 'targets': int32 [B, L],
      'weights': float32 [B, L]}``.

    Raises:
      ValueError: bad batch size, max_batches, shard arguments or split name (raised on call).
    """
    _check_shard(shard_index, shard_count)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be >= 0, got {max_batches}")
    source, key, length = _source(builder, split)
    global_batch = batch_size * shard_count
    num_batches = _ceil_div(len(source), global_batch)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)

    def batches():
        for b in range(num_batches):
            start = b * global_batch + shard_index * batch_size
            rows = range(min(start, len(source)), min(start + batch_size, len(source)))
            records = np.zeros((batch_size, length + 1), np.int32)
            weights = np.zeros((batch_size, length), np.float32)
            if len(rows):
                records[: len(rows)] = np.stack(
                    [r[key] for r in source.__getitems__(list(rows))]
                )
                weights[: len(rows)] = 1.0
            yield {"inputs": records[:, :-1], "targets": records[:, 1:], "weights": weights}

    return batches()
