"""Byte-level language modelling data (enwik8 tradition) as a TFDS builder.

The corpus is one byte string, cut into contiguous splits: train = first 90% of the bytes,
validation = next 5%, test = last 5%. Each split is cut into non-overlapping windows: record ``k``
of a split is ``split_bytes[k*L : k*L + L + 1]`` (uint8, length ``L + 1``), so consecutive records
share one byte and every byte after the first is a target exactly once; the trailing partial window
is dropped. ``inputs = record[:-1]``, ``targets = record[1:]``.

Sources (read by `revtrain.data.corpus.read_bytes`, the readers the token task shares):
  * ``'gensim_enwiki'`` (default): an English-Wikipedia XML dump excerpt shipped in the gensim 4.4.0
    wheel (6,089,746 bytes decompressed). ``ensure_gensim_wheel`` (or ``make data``) fetches the
    wheel into ``<data_dir>/downloads/``; gensim is never installed.
  * a file path: raw bytes (e.g. ``enwik8``), a ``.zip`` (the member ``enwik8``, or its only
    member), or a ``.bz2`` (decompressed).
  * a directory path: all text files (``.txt``, ``.md``, ``.xml``, ``.text`` or no suffix; hidden
    files skipped) found recursively, concatenated in sorted path order.

The prepared dataset is cached under ``<data_dir>/byte_lm/<config name>/<version>/`` and read back
with ``builder.as_data_source(split=...)``. The cache is keyed by the source's path, so for a path source
the prepared dataset also records the source's fingerprint (``source_fingerprint.json``: size,
modification and status-change times, and the SHA-256 of its bytes); a source whose bytes changed is prepared again (see
``load_byte_lm``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import shutil
import sys
import time

import numpy as np
import tensorflow_datasets as tfds
from absl import logging as absl_logging

# The corpus readers live in revtrain.data.corpus (shared with the token task); their names stay importable
# from here.
from revtrain.data.corpus import (  # noqa: F401
    GENSIM_MEMBER,
    GENSIM_NUM_BYTES,
    GENSIM_SOURCE,
    GENSIM_VERSION,
    SPLITS,
    TEXT_SUFFIXES,
    DataError,
    default_data_dir,
    ensure_gensim_wheel,
    split_bounds,
    text_files,
    zip_text_member,
)
from revtrain.data.corpus import read_bytes as read_source

def num_records(num_bytes: int, sequence_length: int) -> int:
    """Number of length-``L+1`` windows with stride ``L`` that fit in ``num_bytes`` bytes."""
    return max(num_bytes - 1, 0) // sequence_length


def config_name(source: str, sequence_length: int) -> str:
    """Deterministic config (cache directory) name for a source and sequence length."""
    if source == GENSIM_SOURCE:
        return f"{GENSIM_SOURCE}_seq{sequence_length}"
    path = os.path.abspath(os.path.expanduser(source))
    return f"path_{hashlib.sha1(path.encode()).hexdigest()[:12]}_seq{sequence_length}"


@dataclasses.dataclass(eq=False)
class ByteLMConfig(tfds.core.BuilderConfig):
    """Builder config: ``source`` ('gensim_enwiki' or a path) and ``sequence_length`` (L)."""

    source: str = GENSIM_SOURCE
    sequence_length: int = 128

    @classmethod
    def make(cls, source: str, sequence_length: int) -> ByteLMConfig:
        """Config whose name is derived from ``source`` and ``sequence_length``."""
        if sequence_length < 1:
            raise DataError(f"sequence length must be >= 1, got {sequence_length}")
        return cls(
            name=config_name(source, sequence_length),
            source=source,
            sequence_length=sequence_length,
            description=f"bytes of {source!r} in windows of {sequence_length}+1",
        )


def _check_splits(num_bytes: int, length: int) -> dict[str, tuple[int, int]]:
    """`split_bounds` of a corpus of ``num_bytes``; raises DataError when a split holds no record."""
    bounds = split_bounds(num_bytes)
    for split, (start, end) in bounds.items():
        if num_records(end - start, length) == 0:
            raise DataError(
                f"sequence length {length} is too large: the {split} split has only "
                f"{end - start} bytes ({num_bytes} in total) and needs at least "
                f"{length + 1}; use a shorter sequence length or a larger corpus"
            )
    return bounds


class ByteLM(tfds.core.GeneratorBasedBuilder):
    """Byte-level LM dataset; records ``{'bytes': uint8 [sequence_length + 1]}``.

    Construct with ``ByteLM(config=ByteLMConfig.make(source, L), data_dir=...)``. Splits 'train',
    'validation', 'test'; ``info.metadata['split_bytes']`` holds each split's byte count and
    ``info.metadata['total_bytes']`` the corpus size.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        length = self.builder_config.sequence_length
        return tfds.core.DatasetInfo(
            builder=self,
            description="Byte-level language modelling windows (enwik8 style).",
            features=tfds.features.FeaturesDict(
                {"bytes": tfds.features.Tensor(shape=(length + 1,), dtype=np.uint8)}
            ),
            metadata=tfds.core.MetadataDict(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Sources are local; the gensim wheel is fetched by `ensure_gensim_wheel`.
        config = self.builder_config
        length = config.sequence_length
        if length < 1:
            raise DataError(f"sequence length must be >= 1, got {length}")
        data = getattr(self, "_source_bytes", None)
        if data is None:
            stat = source_stat(config.source)
            data = read_source(config.source, pathlib.Path(self.data_dir_root) / "downloads")
        else:
            stat, self._source_bytes = self._source_stat, None
        if config.source != GENSIM_SOURCE:
            self._fingerprint = {"stat": stat, "sha256": hashlib.sha256(data).hexdigest()}
        bounds = _check_splits(len(data), length)
        self.info.metadata["total_bytes"] = len(data)
        self.info.metadata["split_bytes"] = {s: e - b for s, (b, e) in bounds.items()}
        view = memoryview(data)
        return {s: self._generate_examples(view[b:e], length) for s, (b, e) in bounds.items()}

    def _generate_examples(self, data, length):
        for k in range(num_records(len(data), length)):
            yield k, {"bytes": np.frombuffer(data[k * length : k * length + length + 1], np.uint8)}


FINGERPRINT_FILE = "source_fingerprint.json"


def source_stat(source: str) -> dict | None:
    """What identifies a path source cheaply, without reading it: ``{"size", "mtime_ns", "ctime_ns"}`` of a
    file; for a directory, the total size, the newest modification time, the file count and a digest of
    every text file's relative path, size, modification and status-change times. None for 'gensim_enwiki'
    (a pinned wheel, checked by size when read) or a path that does not exist.

    The status-change time (ctime) changes with every write and cannot be set back (unlike the
    modification time, which ``cp -p``, ``rsync -t`` or ``touch -r`` copy), so other bytes under the same
    size and modification time are caught too; a ``chmod`` or ``mv`` also changes it, which costs one hash
    of the source and no re-preparation."""
    if source == GENSIM_SOURCE:
        return None
    path = pathlib.Path(source).expanduser()
    try:
        if path.is_dir():
            listing = [(str(p.relative_to(path)), p.stat()) for p in text_files(path)]
            digest = hashlib.sha256("".join(f"{name}\t{st.st_size}\t{st.st_mtime_ns}\t{st.st_ctime_ns}\n"
                                            for name, st in listing).encode()).hexdigest()
            return {"size": sum(st.st_size for _, st in listing), "files": len(listing),
                    "mtime_ns": max((st.st_mtime_ns for _, st in listing), default=0), "listing": digest}
        st = path.stat()
    except OSError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _read_fingerprint(builder) -> dict | None:
    try:
        with open(os.path.join(builder.data_dir, FINGERPRINT_FILE)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) and "sha256" in record else None
    except (OSError, ValueError):
        return None


def _write_fingerprint(builder, record: dict) -> None:
    """Writes the fingerprint next to the prepared dataset (atomically; a failure only costs a re-check)."""
    path = os.path.join(builder.data_dir, FINGERPRINT_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _describe_change(old: dict, new: dict) -> str:
    parts = []
    if old.get("size") != new.get("size"):
        parts.append(f"size {old.get('size')} -> {new.get('size')} bytes")
    if old.get("files") != new.get("files") and "files" in new:
        parts.append(f"{old.get('files')} -> {new.get('files')} files")
    parts.append("content differs")
    return ", ".join(parts)


def _source_change(builder, source: str) -> str | None:
    """Why the prepared dataset of a path source no longer matches the source (None when it does).

    The cheap check first: the source's `source_stat` against the one recorded at preparation. Only when
    they differ is the source read and hashed (SHA-256 of its bytes); the same hash (a file touched or
    copied over with the same bytes) only updates the recorded stat. When the source is gone, the prepared
    dataset is used as it is. The bytes read are kept on the builder for the re-preparation.
    """
    stat = source_stat(source)
    record = _read_fingerprint(builder)
    if stat is None:
        return None  # the source was removed: its prepared dataset is all there is
    if record is None:
        return "has no recorded fingerprint (prepared by an older revtrain)"
    if record.get("stat") == stat:
        return None
    data = read_source(source, pathlib.Path(builder.data_dir_root) / "downloads")
    if hashlib.sha256(data).hexdigest() == record["sha256"]:
        _write_fingerprint(builder, {**record, "stat": stat})
        return None
    builder._source_bytes, builder._source_stat = data, stat  # noqa: SLF001 (read once, used to prepare)
    return f"changed since it was prepared ({_describe_change(record.get('stat') or {}, stat)})"


class _DropCustomConfigWarning:
    """Logging filter for TFDS's 'Using custom data configuration' warning (configs are dynamic)."""

    def filter(self, record) -> bool:
        return not record.getMessage().startswith("Using custom data configuration")


def load_byte_lm(source: str, sequence_length: int, data_dir: str) -> tfds.core.DatasetBuilder:
    """Prepares (once; cached afterwards) and returns the byte-LM builder.

    A path source's prepared dataset is checked against the source first (`_source_change`: a stat, and a
    hash only when the stat changed); a changed source is prepared again, replacing the old dataset, with
    one line on stderr saying so. The 'gensim_enwiki' source is a pinned file and is never re-checked.

    ``builder.data_status`` is one line saying what was prepared, how much and how long, or that the data was
    found in the cache (`describe`); ``builder.data_prepared`` whether it was prepared by this call. (The
    caller says it: `revtrain.run.build` once the run is built, so that a later configuration error is
    still the only line; ``scripts/prepare_data.py`` always.)

    Read records with ``builder.as_data_source(split)``: each is ``{'bytes': uint8 [L + 1]}``.
    Record counts: ``builder.info.splits[split].num_examples``.

    Args:
      source: 'gensim_enwiki', a file (raw, ``.zip``, ``.bz2``) or a directory of text files.
      sequence_length: L, targets per record (>= 1).
      data_dir: cache root; the gensim wheel is expected in ``<data_dir>/downloads/``.

    Raises:
      DataError: bad sequence length, or missing / empty / corrupt source, or a split too small for
        one record. A failed preparation leaves no dataset that looks complete (TFDS writes into
        an ``incomplete.*`` directory and renames it when done).

    Multi-process runs should prepare first (``scripts/prepare_data.py``): concurrent first-time
    preparation of the same dataset is not coordinated.
    """
    config = ByteLMConfig.make(source, sequence_length)

    def make_builder():
        quiet = _DropCustomConfigWarning()
        absl_logging.get_absl_logger().addFilter(quiet)
        try:
            return ByteLM(config=config, data_dir=os.path.expanduser(data_dir))
        finally:
            absl_logging.get_absl_logger().removeFilter(quiet)

    builder = make_builder()
    prepare = not builder.is_prepared()
    if not prepare and source != GENSIM_SOURCE:
        change = _source_change(builder, source)
        if change:
            print(f"data source {source} {change}; preparing it again", file=sys.stderr, flush=True)
            # The stale dataset goes (readers that have its files open keep reading them); a fresh builder
            # prepares from the bytes the check already read.
            stale = builder
            shutil.rmtree(stale.data_dir)
            builder = make_builder()
            builder._source_bytes = getattr(stale, "_source_bytes", None)  # noqa: SLF001
            builder._source_stat = getattr(stale, "_source_stat", None)  # noqa: SLF001
            prepare = True
    if not prepare:
        builder.data_status, builder.data_prepared = describe(builder, source), False
        return builder
    started = time.perf_counter()
    if getattr(builder, "_source_bytes", None) is None:
        # Read and check the source before TFDS announces the preparation or creates any directory: a
        # missing, empty or too small source is one line and leaves nothing in the cache.
        if sequence_length < 1:
            raise DataError(f"sequence length must be >= 1, got {sequence_length}")
        stat = source_stat(source)
        data = read_source(source, pathlib.Path(builder.data_dir_root) / "downloads")
        _check_splits(len(data), sequence_length)
        builder._source_bytes, builder._source_stat = data, stat  # noqa: SLF001
    # TFDS prints "Downloading and preparing dataset Unknown size ..." and "Dataset byte_lm downloaded and
    # prepared to ..." on stdout (and a progress bar on a terminal): revtrain says it in one line instead.
    with contextlib.redirect_stdout(io.StringIO()), _no_tfds_progress_bar():
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(try_download_gcs=False),
        )
    fingerprint = getattr(builder, "_fingerprint", None)
    builder = make_builder()  # reads the new dataset's info
    if fingerprint is not None:
        _write_fingerprint(builder, fingerprint)
    builder.data_status, builder.data_prepared = describe(builder, source, time.perf_counter() - started), True
    return builder


@contextlib.contextmanager
def _no_tfds_progress_bar():
    from tensorflow_datasets.core.utils import tqdm_utils
    enabled = tqdm_utils._active  # noqa: SLF001 (TFDS keeps the switch there; no public getter)
    tfds.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            tfds.enable_progress_bar()


def describe(builder, source: str, seconds: float | None = None) -> str:
    """One line saying what the prepared byte data of ``source`` holds and whether it was prepared now (in
    ``seconds``) or found in the cache (``seconds`` None)."""
    splits = builder.info.splits
    counts = " / ".join(f"{splits[s].num_examples:,}" for s in SPLITS)
    length = builder.builder_config.sequence_length
    what = (f"{builder.info.metadata['total_bytes']:,} bytes, {counts} sequences of {length} bytes "
            "(train / validation / test)")
    if seconds is None:
        return f"byte data of {source} found in the cache: {what}, in {builder.data_dir}"
    return f"prepared the byte data of {source}: {what} in {seconds:.1f} s, cached in {builder.data_dir}"
