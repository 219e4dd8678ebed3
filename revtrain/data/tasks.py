"""Tasks: what data a run reads, how its model is sized from it, and how text goes in and out (gin-configurable).

Every task is a `Task`: the interface the loop, sampling, export and the check use, declared once with its
defaults, so that they ask a task what it offers instead of probing for attributes. A task gives
``model_kwargs()`` (passed to the model builder), ``train_iterator`` (a checkpointable Grain iterator of this
process's share of each global batch) and ``eval_batches``; a language-model task also ``encode`` /
``decode`` and, when it tokenizes, its ``tokenizer`` (kept in the workdir by ``save_tokenizer``) and
``bytes_per_token``.

The run's tokenizer is passed in explicitly: `revtrain.run.build_task` asks the task class
(`Task.tokenizer_arguments`) which constructor arguments give it the tokenizer the run keeps in its workdir,
or the one of the checkpoint it imports.
"""

from __future__ import annotations

import os
import time

import gin

from revtrain.data import byte_lm, pipeline, token_lm
from revtrain.data import tokenizer as tokenizer_lib
from revtrain.data.task import Task  # noqa: F401  (revtrain.data.tasks.Task: the interface, declared there)


def _lm_input_spec(batch_size: int, sequence_length: int) -> dict:
    import jax
    import numpy as np
    shape = jax.ShapeDtypeStruct((batch_size, sequence_length), np.int32)
    return {"inputs": shape, "targets": shape}


@gin.configurable
class ByteLMTask(Task):
    """Byte-level language modelling (vocab 256) on a TFDS ``ByteLM`` dataset.

    Args:
      source: ``"gensim_enwiki"`` (the English-Wikipedia XML excerpt from the gensim 4.4.0 wheel, prepared
        by ``revtrain prepare`` or on first use), a path to ``enwik8`` / ``enwik8.zip`` / any file, or a directory
        of text files.
      sequence_length: tokens (bytes) per example, T.
      data_dir: dataset cache (default ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``).

    Raises:
      byte_lm.DataError: missing, empty or corrupt source, or a sequence length longer than a split.
    """

    bits_per_byte = True

    @classmethod
    def tokenizer_arguments(cls, kept: str | None, checkpoint: str | None) -> dict:
        """None (byte values are the ids); beside a checkpoint that has its own tokenizer, a note saying so."""
        file = tokenizer_lib.file_in(checkpoint) if checkpoint else None
        if file is not None:
            from revtrain import metrics as metrics_lib
            metrics_lib.log(f"note: {checkpoint} has its own tokenizer ({os.path.basename(file)}), and ByteLMTask "
                            "feeds byte values as ids; train.task = @TokenLMTask tokenizes with it")
        return {}

    def __init__(self, source: str = byte_lm.GENSIM_SOURCE, sequence_length: int = 128,
                 data_dir: str | None = None):
        if sequence_length < 1:
            raise byte_lm.DataError(f"ByteLMTask.sequence_length must be positive, got {sequence_length}")
        self.source = source
        self.sequence_length = sequence_length
        self.data_dir = data_dir or byte_lm.default_data_dir()
        self.builder = byte_lm.load_byte_lm(source, sequence_length, self.data_dir)
        self.data_status, self.data_prepared = self.builder.data_status, self.builder.data_prepared

    @classmethod
    def config_model_kwargs(cls) -> dict:
        """``{'sequence_length': ByteLMTask.sequence_length}`` as bound (the vocabulary is the 256 byte values)."""
        from revtrain.data.prepare import task_argument
        return {"sequence_length": task_argument(cls, "sequence_length")}

    def model_kwargs(self) -> dict:
        return {"sequence_length": self.sequence_length}

    def input_spec(self, batch_size: int) -> dict:
        """Shapes of a batch of ``batch_size`` examples: ``{'inputs', 'targets'}`` int32 ``[batch_size, T]``."""
        return _lm_input_spec(batch_size, self.sequence_length)

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


@gin.configurable
class TokenLMTask(Task):
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
        beside an imported checkpoint (``LlamaModel.path``) that has a tokenizer, the checkpoint's is used;
        beside one that has none, the run is refused (name its tokenizer, or ``'bytes'``, or ``'bpe'``): a new
        BPE would give its ids other meanings (`tokenizer_arguments`). A run keeps a copy in its workdir and
        uses that copy from then on (`revtrain.run.build_task` passes it here).
      vocab_size: ids of the BPE trained by ``"bpe"`` (>= 258; the end-of-text id included); unused otherwise.
      text_field: the JSONL field / Parquet column / dataset column holding each document's text.
      data_dir: cache (default ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``).

    The model's vocabulary follows the tokenizer (``model_kwargs`` passes ``vocab_size``) unless the model's
    ``vocab_size`` is bound in gin; a bound one smaller than the tokenizer's is refused (`revtrain.run.build`).

    Raises:
      byte_lm.DataError: a bad corpus or tokenizer file, a bad ``vocab_size`` or ``sequence_length``, or a split
        too small for one sequence (one line naming the file or field).
    """

    bits_per_byte = True
    tokenized = True

    @classmethod
    def tokenizer_arguments(cls, kept: str | None, checkpoint: str | None) -> dict:
        """``{"tokenizer": file}``: the run's kept copy (unless the run tokenizes as ``'bytes'``), else, with
        ``TokenLMTask.tokenizer`` unbound, the imported checkpoint's own tokenizer.

        Raises:
          byte_lm.DataError: ``TokenLMTask.tokenizer`` is unbound and the imported checkpoint has no tokenizer
            (training a new BPE for it would be a guess).
        """
        try:
            bound = gin.query_parameter("TokenLMTask.tokenizer")
        except ValueError:  # not bound: the default
            bound = None
        if bound == tokenizer_lib.BYTES:
            return {}
        if kept is not None:
            return {"tokenizer": kept}
        if checkpoint is None or bound is not None:
            return {}
        file = tokenizer_lib.file_in(checkpoint)
        if file is None:
            raise byte_lm.DataError(
                f"the checkpoint {checkpoint} has no tokenizer ({tokenizer_lib.HF_FILE} or {tokenizer_lib.SP_FILE}) "
                "and TokenLMTask.tokenizer is unset: set TokenLMTask.tokenizer to the tokenizer it was trained "
                "with (a file, or a directory holding one), to 'bytes' for byte ids (257 with the end-of-text id; "
                "a 256-id byte-level checkpoint trains with train.task = @ByteLMTask instead), or to 'bpe' to train "
                "a new one on the corpus")
        return {"tokenizer": file}

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
        started = time.perf_counter()
        token_lm.corpus_kind(source)  # a missing source: one line, before anything else
        memo_path = os.path.join(root, "fingerprints.json")
        corpus, memo = token_lm.fingerprint(source, memo_path)
        planned: list = []

        def plan():
            if not planned:
                planned.append(token_lm.plan(source, text_field))
            return planned[0]

        if tokenizer == tokenizer_lib.BYTES:
            tok = tokenizer_lib.Tokenizer(tokenizer_lib.BYTES)
        elif tokenizer == tokenizer_lib.BPE:
            tok = token_lm.bpe_tokenizer(source, text_field, vocab_size, root, corpus, plan)
        else:
            tok = tokenizer_lib.load(tokenizer)
        self.tokenizer = tok
        bpe_trained = bool(planned)  # (the first pass runs before a BPE is trained, and only then)
        self.prepared = token_lm.prepare(source, tok, text_field, root, corpus, planned[0] if planned else None)
        token_lm.save_memo(memo_path, memo)
        self.data_prepared = self.prepared.fresh or bpe_trained
        self.data_status = token_lm.describe(
            self.prepared, source, time.perf_counter() - started if self.data_prepared else None, bpe_trained)
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
    @classmethod
    def config_model_kwargs(cls) -> dict | None:
        """The bound sequence length and the vocabulary: ``vocab_size`` ids for the BPE revtrain trains (its
        trainer stops at that size, the end-of-text id included), 257 for ``'bytes'``; None for a tokenizer
        file, whose size only the file says."""
        from revtrain.data.prepare import task_argument
        tokenizer = task_argument(cls, "tokenizer")
        vocab = {tokenizer_lib.BPE: task_argument(cls, "vocab_size"), tokenizer_lib.BYTES: 257}.get(tokenizer)
        return None if vocab is None else {"sequence_length": task_argument(cls, "sequence_length"),
                                           "vocab_size": vocab}

    def model_kwargs(self) -> dict:
        return {"sequence_length": self.sequence_length, "vocab_size": self.tokenizer.vocab_size}

    def input_spec(self, batch_size: int) -> dict:
        """Shapes of a batch of ``batch_size`` examples: ``{'inputs', 'targets'}`` int32 ``[batch_size, T]``."""
        return _lm_input_spec(batch_size, self.sequence_length)

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
        """Keeps a copy of the tokenizer in ``workdir`` (None for bytes: nothing to keep)."""
        return self.tokenizer.save(workdir)
