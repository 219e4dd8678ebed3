"""The task interface (`Task`): what a task offers the loop, sampling, export and the check, with defaults.

The tasks themselves: `revtrain.data.tasks` (``ByteLMTask``, ``TokenLMTask``) and
`revtrain.data.fashion_mnist` (``FashionMNISTTask``). ``train.task`` must be a subclass of `Task`.
"""

from __future__ import annotations


class Task:
    """The task interface, with its defaults (subclass it for a task of your own).

    Class attributes:
      bits_per_byte: the task models text: evaluation reports bits per byte, and ``revtrain sample`` generates.
      tokenized: the targets are a tokenizer's ids (``--length`` of ``sample`` counts tokens, and bits per byte
        count the bytes the ids stand for, `target_bytes`); False: each target is one byte (or a class).

    Attributes (instances):
      sequence_length: positions per example (None: not a sequence task).
      tokenizer: the run's `revtrain.data.tokenizer.Tokenizer` (None: no tokenizer; byte values are the ids).
      bytes_per_token: mean UTF-8 bytes per target of the training split (1.0 for bytes).
      data_status: one line saying what preparing the data did: prepared now (how much, how long) or found
        in the cache (None: the task does not say).
      data_prepared: whether this task prepared its data (then `revtrain.run.build` prints ``data_status``
        once the run is built; ``scripts/prepare_data.py``, ``make data``, prints it either way).
    """

    bits_per_byte = False
    tokenized = False
    sequence_length: int | None = None
    tokenizer = None
    bytes_per_token = 1.0
    data_status: str | None = None
    data_prepared = False

    @classmethod
    def tokenizer_arguments(cls, kept: str | None, checkpoint: str | None) -> dict:
        """Constructor arguments that give a task of this class the run's tokenizer (default: none).

        Args:
          kept: the tokenizer file the run keeps in its workdir (`revtrain.data.tokenizer.file_in`), or None.
          checkpoint: the checkpoint directory the model imports (``LlamaModel.path``), or None.

        Raises:
          byte_lm.DataError: the tokenizer cannot be decided without guessing (one line saying what to set).
        """
        del kept, checkpoint
        return {}

    @classmethod
    def config_model_kwargs(cls) -> dict | None:
        """What `model_kwargs` of a task of this class will be, from the parsed gin config alone: no data is read
        or prepared (``revtrain configs`` counts a config's parameters with it). None (the default): they
        depend on the data."""
        return None

    def model_kwargs(self) -> dict:
        """Keyword arguments of the model builder that the data decides (``sequence_length``, ``vocab_size``,
        ``num_classes``)."""
        return {}

    def input_spec(self, batch_size: int) -> dict | None:
        """Shapes of a batch of ``batch_size`` examples (``jax.ShapeDtypeStruct`` leaves), checked against the
        model before anything compiles; None: not checked."""
        del batch_size
        return None

    def check_batch_size(self, batch_size: int) -> None:
        """Raises ``byte_lm.DataError`` when the train split cannot fill one global batch (default: no check)."""
        del batch_size

    def train_iterator(self, batch_size: int, seed: int, shard_index: int, shard_count: int):
        """Checkpointable iterator of this process's share of each global training batch."""
        raise NotImplementedError(f"{type(self).__name__} does not define train_iterator")

    def eval_batches(self, split: str, batch_size: int, max_batches: int | None, shard_index: int,
                     shard_count: int):
        """Ordered batches covering ``split`` once, padded with weight-0 rows (``'weights'``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define eval_batches")

    def target_bytes(self, batch: dict) -> float:
        """UTF-8 bytes of the text a batch's weighted targets stand for (default: one byte per target)."""
        import numpy as np
        return float(np.sum(batch["weights"], dtype=np.float64))

    def encode(self, text: bytes):
        """A prompt's bytes as what the model reads: the bytes themselves (byte values are the ids); a
        tokenizing task returns int32 ids."""
        return bytes(text)

    def decode(self, ids) -> bytes:
        """Generated ids (or bytes) back to bytes."""
        return bytes(ids)

    def save_tokenizer(self, workdir: str) -> str | None:
        """Keeps a copy of the run's tokenizer in ``workdir`` (so every later command reads the same ids);
        returns its path, None when there is nothing to keep."""
        del workdir
        return None
