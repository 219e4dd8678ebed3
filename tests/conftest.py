"""Shared fixtures: the prepared byte-level dataset used by the trainer tests."""

import numpy as np
import pytest

SEQUENCE_LENGTH = 128


@pytest.fixture(scope="session")
def byte_lm_data_dir():
    """The data dir holding the prepared ``gensim_enwiki`` byte-LM dataset (sequence length 128).

    Prepares it on first use, as ``scripts/prepare_data.py`` does (downloads the gensim wheel with pip
    when it is not cached), so a fresh CI machine needs no separate step.
    """
    from revtrain.data import byte_lm

    data_dir = byte_lm.default_data_dir()
    try:
        byte_lm.ensure_gensim_wheel(data_dir)
        byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, SEQUENCE_LENGTH, data_dir)
    except byte_lm.DataError as e:
        pytest.fail(f"cannot prepare the byte-LM dataset: {e}")
    return data_dir


@pytest.fixture(scope="session")
def text_batches(byte_lm_data_dir):
    """A function ``(batch_size, count, seed=0) -> list`` of ``count`` training batches of real text.

    Each batch is ``{'inputs', 'targets'}``, int32 numpy ``[batch_size, 128]``.
    """
    from revtrain.data import byte_lm, pipeline

    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, SEQUENCE_LENGTH, byte_lm_data_dir)

    def load(batch_size: int, count: int, seed: int = 0) -> list:
        it = iter(pipeline.train_dataset(builder, batch_size=batch_size, seed=seed))
        return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(count)]

    return load
