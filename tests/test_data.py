"""Tests for the byte-LM TFDS builder and the Grain pipeline (small local corpora, no network)."""

import bz2
import collections
import pathlib
import string
import textwrap
import zipfile

import numpy as np
import pytest

from revtrain.data import byte_lm, pipeline
from revtrain.data.byte_lm import DataError

L = 16


def _text(n):
    """Real-ish text: n bytes of stdlib source code."""
    data = pathlib.Path(textwrap.__file__).read_bytes() + pathlib.Path(string.__file__).read_bytes()
    return (data * (n // len(data) + 1))[:n]


def _records(builder, split):
    source = builder.as_data_source(split=split)
    return np.stack([source[i]["bytes"] for i in range(len(source))])


def _check_layout(builder, corpus):
    """Splits are 90/5/5 contiguous chunks of corpus, cut into L+1 windows with stride L."""
    meta = builder.info.metadata
    assert meta["total_bytes"] == len(corpus)
    bounds = byte_lm.split_bounds(len(corpus))
    assert [e - b for b, e in bounds.values()] == [meta["split_bytes"][s] for s in byte_lm.SPLITS]
    assert bounds["train"][0] == 0 and bounds["test"][1] == len(corpus)
    assert (
        bounds["train"][1] == bounds["validation"][0]
        and bounds["validation"][1] == bounds["test"][0]
    )
    assert bounds["train"][1] == len(corpus) * 9 // 10
    for split, (start, end) in bounds.items():
        records = _records(builder, split)
        assert records.dtype == np.uint8 and records.shape == ((end - start - 1) // L, L + 1)
        assert np.array_equal(records[1:, 0], records[:-1, -1])  # windows share one byte
        joined = np.concatenate([records[0], records[1:, 1:].ravel()]).tobytes()
        assert joined == corpus[start : start + len(joined)]
        assert end - start - len(joined) < L  # only a partial window is dropped


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    parts = {"a.txt": _text(9000), "c": _text(5000)[::-1], "sub/b.md": _text(7000)[3:]}
    for name, data in parts.items():
        (root / name).write_bytes(data)
    (root / "skip.bin").write_bytes(b"\0" * 999)
    (root / ".hidden.txt").write_bytes(b"hidden" * 99)
    return root, parts["a.txt"] + parts["c"] + parts["sub/b.md"]


@pytest.fixture(scope="module")
def builder(corpus_dir, tmp_path_factory):
    return byte_lm.load_byte_lm(str(corpus_dir[0]), L, str(tmp_path_factory.mktemp("data")))


def test_directory_source_layout(builder, corpus_dir):
    _check_layout(builder, corpus_dir[1])
    assert builder.builder_config.name == byte_lm.config_name(str(corpus_dir[0]), L)


@pytest.mark.parametrize("kind", ["raw", "zip", "bz2"])
def test_file_sources(tmp_path, kind):
    corpus = _text(12345)
    if kind == "raw":
        path = tmp_path / "enwik8"
        path.write_bytes(corpus)
    elif kind == "zip":
        path = tmp_path / "enwik8.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("enwik8", corpus)
    else:
        path = tmp_path / "corpus.txt.bz2"
        path.write_bytes(bz2.compress(corpus))
    _check_layout(byte_lm.load_byte_lm(str(path), L, str(tmp_path / "data")), corpus)


def test_cached_load_does_not_rebuild(builder, corpus_dir, monkeypatch):
    files = sorted(pathlib.Path(builder.data_dir).glob("*.array_record*"))
    mtimes = [f.stat().st_mtime_ns for f in files]

    def fail(*args, **kwargs):
        raise AssertionError("dataset rebuilt")

    monkeypatch.setattr(byte_lm.ByteLM, "_split_generators", fail)
    again = byte_lm.load_byte_lm(str(corpus_dir[0]), L, str(builder.data_dir_root))
    assert again.data_dir == builder.data_dir
    assert [f.stat().st_mtime_ns for f in files] == mtimes


def test_train_batches(builder):
    records = _records(builder, "train")
    it = iter(pipeline.train_dataset(builder, batch_size=8, seed=3))
    batches = [next(it) for _ in range(len(records) // 8)]  # one epoch, less the remainder
    for batch in batches:
        assert batch["inputs"].dtype == np.int32 and batch["inputs"].shape == (8, L)
        assert np.array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    rows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1) for b in batches])
    available = collections.Counter(r.tobytes() for r in records.astype(np.int32))
    available.subtract(r.tobytes() for r in rows)
    assert min(available.values()) >= 0  # rows are distinct records of the epoch ...
    assert not np.array_equal(rows, records[: len(rows)])  # ... in shuffled order


def test_train_shards_are_disjoint(builder):
    n = len(builder.as_data_source(split="train"))
    seen = []
    for shard in range(2):
        ds = pipeline.train_dataset(builder, batch_size=1, seed=0, shard_index=shard, shard_count=2)
        it = iter(ds)
        seen += [next(it)["inputs"][0].tobytes() for _ in range((n - shard + 1) // 2)]
    records = _records(builder, "train")[:, :-1].astype(np.int32)
    assert sorted(seen) == sorted(r.tobytes() for r in records)


def test_iterator_state_restores_exact_position(builder):
    ds = pipeline.train_dataset(builder, batch_size=4, seed=7)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    fresh = iter(ds)
    fresh.set_state(state)
    for want, got in zip(expected, [next(fresh) for _ in range(3)], strict=True):
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(want[key], got[key])


def test_eval_batches_score_every_byte_once(builder):
    records = _records(builder, "validation").astype(np.int32)
    batches = list(pipeline.eval_batches(builder, split="validation", batch_size=5))
    assert len(batches) == -(-len(records) // 5)
    weights = np.concatenate([b["weights"] for b in batches])
    assert weights.dtype == np.float32 and weights.sum() == len(records) * L
    rows = weights[:, 0] > 0
    np.testing.assert_array_equal(
        np.concatenate([b["inputs"] for b in batches])[rows], records[:, :-1]
    )
    np.testing.assert_array_equal(
        np.concatenate([b["targets"] for b in batches])[rows], records[:, 1:]
    )
    sharded = [
        list(
            pipeline.eval_batches(
                builder, split="validation", batch_size=5, shard_index=i, shard_count=3
            )
        )
        for i in range(3)
    ]
    assert len({len(s) for s in sharded}) == 1  # processes stay in lockstep
    assert sum(b["weights"].sum() for s in sharded for b in s) == len(records) * L
    assert len(list(pipeline.eval_batches(builder, split="test", batch_size=5, max_batches=2))) == 2


def _assert_data_error(tmp_path, source, match, sequence_length=L):
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match=match) as info:
        byte_lm.load_byte_lm(str(source), sequence_length, str(data_dir))
    assert "\n" not in str(info.value)
    # Nothing that looks like a (complete or half-written) dataset is left behind.
    assert not list(data_dir.glob("byte_lm/*/*"))


def test_errors(tmp_path):
    _assert_data_error(tmp_path, tmp_path / "nope", "does not exist")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"not text")
    _assert_data_error(tmp_path, tmp_path / "empty", "is empty")
    (tmp_path / "empty.txt").write_bytes(b"")
    _assert_data_error(tmp_path, tmp_path / "empty.txt", "is empty")
    (tmp_path / "bad.bz2").write_bytes(bz2.compress(_text(5000))[:-100])
    _assert_data_error(tmp_path, tmp_path / "bad.bz2", "bad.bz2")
    (tmp_path / "bad.zip").write_bytes(b"PK\x03\x04 this is not a zip file")
    _assert_data_error(tmp_path, tmp_path / "bad.zip", "bad.zip")
    with zipfile.ZipFile(tmp_path / "flipped.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("enwik8", _text(20_000))
    data = bytearray((tmp_path / "flipped.zip").read_bytes())
    data[60:400] = bytes(b ^ 0x5A for b in data[60:400])  # corrupt the compressed member
    (tmp_path / "flipped.zip").write_bytes(bytes(data))
    _assert_data_error(tmp_path, tmp_path / "flipped.zip", "flipped.zip")
    (tmp_path / "small.txt").write_bytes(_text(10_000))
    _assert_data_error(
        tmp_path,
        tmp_path / "small.txt",
        "too large.*validation split has only 500 ",
        sequence_length=500,
    )
    _assert_data_error(tmp_path, tmp_path / "small.txt", ">= 1", sequence_length=0)


def test_missing_gensim_wheel(tmp_path):
    _assert_data_error(tmp_path, byte_lm.GENSIM_SOURCE, "run `revtrain prepare --config FILE`")


def test_gensim_source():
    data_dir = byte_lm.default_data_dir()
    if not list((pathlib.Path(data_dir) / "downloads").glob("gensim-4.4.0-*.whl")):
        pytest.skip(f"gensim wheel not in {data_dir}/downloads; run scripts/prepare_data.py")
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, data_dir)
    assert builder.info.metadata["total_bytes"] == byte_lm.GENSIM_NUM_BYTES == 6_089_746
    assert [builder.info.splits[s].num_examples for s in byte_lm.SPLITS] == [42818, 2378, 2378]
    first = builder.as_data_source(split="train")[0]["bytes"]
    assert first.shape == (129,) and first.tobytes().startswith(b"<mediawiki")


@pytest.mark.parametrize("kind", ["raw", "zip", "bz2", "directory"])
def test_the_byte_and_token_tasks_read_a_source_through_one_reader(tmp_path, kind):
    """revtrain.data.corpus is the one home of the readers: for every file and directory format the byte task's
    bytes (`read_bytes`) are the token task's documents (`documents`) encoded back, and a corrupt or truncated
    file is the same one-line DataError for both (the token task's reader once let zlib's error through)."""
    from revtrain.data import corpus
    text = _text(30_000)
    if kind == "directory":
        source = tmp_path / "texts"
        (source / "sub").mkdir(parents=True)
        (source / "a.txt").write_bytes(text[:10_000])
        (source / "sub" / "b.md").write_bytes(text[10_000:])
        (source / ".hidden.txt").write_bytes(b"not read")
        (source / "skip.bin").write_bytes(b"not read")
    elif kind == "zip":
        source = tmp_path / "enwik8.zip"
        with zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("enwik8", text)
    else:
        source = tmp_path / ("corpus.txt.bz2" if kind == "bz2" else "enwik8")
        source.write_bytes(bz2.compress(text) if kind == "bz2" else text)
    data = corpus.read_bytes(str(source), tmp_path)
    assert data == text
    assert "".join("".join(doc) for doc in corpus.documents(str(source))).encode() == text
    if kind in ("zip", "bz2"):  # a corrupt compressed member (zlib's error), a truncated bz2 stream
        packed = bytearray(source.read_bytes())
        if kind == "zip":
            packed[60:400] = bytes(b ^ 0x5A for b in packed[60:400])
        source.write_bytes(bytes(packed) if kind == "zip" else bytes(packed[:-100]))
        for read in (lambda: corpus.read_bytes(str(source), tmp_path),
                     lambda: [list(doc) for doc in corpus.documents(str(source))]):
            with pytest.raises(DataError, match=f"cannot read {source}: corrupt or truncated") as info:
                read()
            assert "\n" not in str(info.value)
