"""Tasks: what data a run reads and how its model is sized from it (gin-configurable).

A task gives the loop three things: ``model_kwargs()`` (passed to the model builder), ``train_iterator``
(a checkpointable Grain iterator of this process's share of each global batch) and ``eval_batches``.
"""

from __future__ import annotations

import contextlib
import os

import gin

from revtrain.data import byte_lm, pipeline, token_lm
from revtrain.data import tokenizer as tokenizer_lib


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


_RUN_WORKDIR: list[str] = []  # the workdir of the command being run (`run_workdir`)


@contextlib.contextmanager
def run_workdir(workdir: str | None):
    """Within it, a `TokenLMTask` uses the tokenizer kept in ``workdir`` (``tokenizer.json`` /
    ``tokenizer.model``) when there is one: ``train`` (resuming), ``eval``, ``sample`` and ``check`` of a run
    then need nothing but the workdir and the corpus."""
    _RUN_WORKDIR.append(os.path.abspath(workdir) if workdir else "")
    try:
        yield
    finally:
        _RUN_WORKDIR.pop()


def _kept_tokenizer() -> str | None:
    workdir = _RUN_WORKDIR[-1] if _RUN_WORKDIR else ""
    return tokenizer_lib.file_in(workdir) if workdir else None


@gin.configurable
class TokenLMTask:
    """Language modelling on tokens: a corpus (text file, directory, ``enwik8.zip``, JSONL, Parquet or a
    saved Hugging Face dataset) through a tokenizer, documents separated by an end-of-text token and packed
    into windows of ``sequence_length`` tokens (`revtrain.data.token_lm`, `revtrain.data.tokenizer`;
    ``docs/tokenizers.md``).

    Args:
      source: ``"gensim_enwiki"``, a file (text, ``.zip``, ``.bz2``, ``.jsonl`` / ``.json``, ``.parquet``) or a
        directory (of text files, or a dataset saved with ``datasets``' ``save_to_disk``).
      sequence_length: tokens per example, T.
      tokenizer: ``"bpe"`` (a byte-level BPE trained on the training split; the default), ``"bytes"`` (UTF-8
        bytes and an end-of-text id: vocabulary 257), the path of a ``tokenizer.json`` (Hugging Face
        ``tokenizers``) or a SentencePiece ``.model``, or a checkpoint directory holding one. Left unbound
        beside an imported checkpoint (``LlamaModel.path``) that has a tokenizer, the checkpoint's is used
        (`revtrain.loop.build`). A run keeps a copy in its workdir and uses that copy
        from then on.
      vocab_size: ids of the BPE trained by ``"bpe"`` (>= 258; the end-of-text id included); unused otherwise.
      text_field: the JSONL field / Parquet column / dataset column holding each document's text.
      data_dir: cache (default ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``).

    The model's vocabulary follows the tokenizer (``model_kwargs`` passes ``vocab_size``) unless the model's
    ``vocab_size`` is bound in gin; a bound one smaller than the tokenizer's is refused (`revtrain.loop.build`).

    Raises:
      byte_lm.DataError: a bad corpus or tokenizer file, a bad ``vocab_size`` or ``sequence_length``, or a split
        too small for one sequence (one line naming the file or field).
    """

    bits_per_byte = True

    def __init__(self, source: str = byte_lm.GENSIM_SOURCE, sequence_length: int = 64, tokenizer: str = "bpe",
                 vocab_size: int = 4096, text_field: str = "text", data_dir: str | None = None):
        if not isinstance(sequence_length, int) or sequence_length < 1:
            raise byte_lm.DataError(f"TokenLMTask.sequence_length must be a positive integer, got {sequence_length!r}")
        if not isinstance(tokenizer, str) or not tokenizer:
            raise byte_lm.DataError(f"TokenLMTask.tokenizer must be 'bpe', 'bytes' or a tokenizer file, got {tokenizer!r}")
        if not isinstance(text_field, str) or not text_field:
            raise byte_lm.DataError(f"TokenLMTask.text_field must be a non-empty string, got {text_field!r}")
        if tokenizer == tokenizer_lib.BPE and (not isinstance(vocab_size, int) or vocab_size < 258):
            raise byte_lm.DataError(f"TokenLMTask.vocab_size must be an integer >= 258 for a BPE (257 ids are the "
                                    f"end-of-text token and the 256 bytes), got {vocab_size!r}")
        self.source, self.sequence_length, self.tokenizer_name = source, sequence_length, tokenizer
        self.vocab_size, self.text_field = vocab_size, text_field
        self.data_dir = data_dir or byte_lm.default_data_dir()
        root = os.path.join(os.path.expanduser(self.data_dir), "token_lm")
        token_lm.corpus_kind(source)  # a missing source: one line, before anything else
        memo_path = os.path.join(root, "fingerprints.json")
        corpus, memo = token_lm.fingerprint(source, memo_path)
        planned: list = []

        def plan():
            if not planned:
                planned.append(token_lm.plan(source, text_field))
            return planned[0]

        kept = _kept_tokenizer() if tokenizer != tokenizer_lib.BYTES else None
        if kept is not None:
            tok = tokenizer_lib.load(kept)
        elif tokenizer == tokenizer_lib.BYTES:
            tok = tokenizer_lib.Tokenizer(tokenizer_lib.BYTES)
        elif tokenizer == tokenizer_lib.BPE:
            tok = token_lm.bpe_tokenizer(source, text_field, vocab_size, root, corpus, plan)
        else:
            tok = tokenizer_lib.load(tokenizer)
        self.tokenizer = tok
        self.prepared = token_lm.prepare(source, tok, text_field, root, corpus, planned[0] if planned else None)
        token_lm.save_memo(memo_path, memo)
        splits = self.prepared.meta["splits"]
        for split in ("train", "validation"):
            if max(splits[split]["tokens"] - 1, 0) // sequence_length == 0:
                raise byte_lm.DataError(
                    f"TokenLMTask.sequence_length {sequence_length} is too large: the {split} split of {source} "
                    f"has {splits[split]['tokens']} tokens and needs at least {sequence_length + 1}; use a shorter "
                    "sequence length or a larger corpus")
        train = splits["train"]
        self.bytes_per_token = train["bytes"] / max(train["tokens"], 1)

    # -- the task interface (see ByteLMTask) ----------------------------------------------------------
    def model_kwargs(self) -> dict:
        return {"sequence_length": self.sequence_length, "vocab_size": self.tokenizer.vocab_size}

    def input_spec(self, batch_size: int) -> dict:
        """Shapes of a batch of ``batch_size`` examples: ``{'inputs', 'targets'}`` int32 ``[batch_size, T]``."""
        import jax
        import numpy as np
        shape = jax.ShapeDtypeStruct((batch_size, self.sequence_length), np.int32)
        return {"inputs": shape, "targets": shape}

    def windows(self, split: str) -> token_lm.TokenWindows:
        """The split's windows (`token_lm.TokenWindows`).

        Raises:
          byte_lm.DataError: the corpus has no such split (a saved dataset without ``test``).
        """
        splits = self.prepared.meta["splits"]
        if split not in splits:
            raise byte_lm.DataError(f"the data source {self.source} has no {split} split (it has: "
                                    f"{', '.join(splits)})")
        return token_lm.TokenWindows(self.prepared.split_file(split), self.prepared.meta["dtype"],
                                     splits[split]["tokens"], self.sequence_length)

    def check_batch_size(self, batch_size: int) -> None:
        """Raises ``byte_lm.DataError`` when the train split holds fewer sequences than one global batch."""
        count = len(self.windows("train"))
        if count < batch_size:
            raise byte_lm.DataError(
                f"the train split of {self.source} has {count} sequence{'s' if count != 1 else ''} of "
                f"TokenLMTask.sequence_length = {self.sequence_length} tokens, fewer than one global batch "
                f"(train.batch_size = {batch_size}); lower train.batch_size or the sequence length, or use a "
                "larger corpus")

    def train_iterator(self, batch_size: int, seed: int, shard_index: int, shard_count: int):
        """Checkpointable iterator of ``{'inputs','targets'}`` int32 ``[batch_size, T]`` (this process's share)."""
        return iter(pipeline.train_dataset(self, batch_size=batch_size, seed=seed, shard_index=shard_index,
                                           shard_count=shard_count))

    def eval_batches(self, split: str, batch_size: int, max_batches: int | None, shard_index: int,
                     shard_count: int):
        """Ordered batches covering ``split`` once, padded with weight-0 rows."""
        self.windows(split)  # a missing split: one line
        return pipeline.eval_batches(self, split=split, batch_size=batch_size, max_batches=max_batches,
                                     shard_index=shard_index, shard_count=shard_count)

    # -- text in and out ----------------------------------------------------------------------------
    def target_bytes(self, batch: dict) -> float:
        """UTF-8 bytes of the text a batch's weighted targets stand for (`tokenizer.Tokenizer.token_bytes`)."""
        import numpy as np
        return float(np.sum(self.tokenizer.token_bytes[batch["targets"]] * batch["weights"], dtype=np.float64))

    def encode(self, text: bytes):
        """Prompt bytes -> int32 ids (decoded as UTF-8, invalid sequences as U+FFFD)."""
        import numpy as np
        return self.tokenizer.encode(bytes(text).decode("utf-8", errors="replace")).astype(np.int32)

    def decode(self, ids) -> bytes:
        """Ids -> bytes."""
        return self.tokenizer.decode(ids)

    def save_tokenizer(self, workdir: str) -> str | None:
        """Keeps a copy of the tokenizer in ``workdir`` (None for bytes)."""
        return self.tokenizer.save(workdir)
