"""The corpora revtrain reads: one home for the readers of the byte task (`revtrain.data.byte_lm`) and the token
task (`revtrain.data.token_lm`), so that a format is added once.

Sources (`corpus_kind`):
  * ``'gensim_enwiki'``: an English-Wikipedia XML dump excerpt shipped in the gensim 4.4.0 wheel (6,089,746
    bytes decompressed). `ensure_gensim_wheel` (``revtrain prepare``, ``make data``) fetches the wheel into
    ``<data_dir>/downloads/`` with pip; gensim is never installed. Inside `fetching` (the ``revtrain``
    commands), reading a missing wheel fetches it there first, saying so in one line (a failed fetch is one
    `DataError` naming the run's ``revtrain prepare``); elsewhere it is one `DataError` naming that command.
  * a file: raw bytes (e.g. ``enwik8``), a ``.zip`` (the member ``enwik8``, or its only member) or a ``.bz2``
    (decompressed) (`open_file`).
  * a directory: its text files (``.txt``, ``.md``, ``.xml``, ``.text`` or no suffix; hidden files skipped),
    found recursively, in sorted path order (`text_files`).
  * for the token task also: a JSONL file (``.jsonl`` / ``.json``: one JSON object a line, the document in a
    named text field), a Parquet file (``.parquet``: one document a row, the named column; read with pyarrow
    in record batches), or a Hugging Face dataset saved with ``save_to_disk`` (a directory holding
    ``dataset_info.json`` / ``dataset_dict.json``; read with ``datasets.load_from_disk``, memory-mapped).

Two views of a source: `read_bytes` (the byte task: the whole corpus as one byte string; a file is its bytes
whatever its suffix, a directory its text files concatenated) and `documents` (the token task: an iterator
of documents, each an iterator of text pieces, read as UTF-8 with invalid sequences as U+FFFD). Both read a
file through `open_file` and list a directory with `text_files`. Every problem is a `DataError`, one line.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import os
import pathlib
import subprocess
import sys
import zipfile
import zlib

from revtrain.errors import DataError  # noqa: F401  (corpus.DataError: every data problem)

GENSIM_SOURCE = "gensim_enwiki"
GENSIM_VERSION = "4.4.0"
GENSIM_MEMBER = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
GENSIM_NUM_BYTES = 6_089_746
TEXT_SUFFIXES = frozenset({"", ".txt", ".md", ".xml", ".text"})
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
DATASET_FILES = ("dataset_dict.json", "dataset_info.json", "state.json")
BLOCK = 1 << 20  # bytes read at a time from a text file
# What reading a file, a zip member or a bz2 stream raises on a corrupt or truncated source.
_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


SPLITS = ("train", "validation", "test")


def split_bounds(num_bytes: int) -> dict[str, tuple[int, int]]:
    """Returns ``{split: (start, end)}`` byte offsets: contiguous 90% / 5% / 5% of ``num_bytes`` (both tasks
    split a corpus so)."""
    train_end, valid_end = num_bytes * 90 // 100, num_bytes * 95 // 100
    return {
        "train": (0, train_end),
        "validation": (train_end, valid_end),
        "test": (valid_end, num_bytes),
    }


def default_data_dir() -> str:
    """Returns ``$REVTRAIN_DATA_DIR`` or ``~/.cache/revtrain/data``, user-expanded."""
    return os.path.expanduser(os.environ.get("REVTRAIN_DATA_DIR", "~/.cache/revtrain/data"))


def corpus_kind(source: str) -> str:
    """``'gensim'``, ``'datasets'``, ``'text_dir'``, ``'jsonl'``, ``'parquet'`` or ``'text_file'``.

    Raises:
      DataError: the source does not exist.
    """
    if source == GENSIM_SOURCE:
        return "gensim"
    path = pathlib.Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data source {source} does not exist; pass an existing file or directory "
                        f"or '{GENSIM_SOURCE}'")
    if path.is_dir():
        if any((path / name).is_file() for name in DATASET_FILES):
            return "datasets"
        return "text_dir"
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text_file"


# -- the gensim wheel ---------------------------------------------------------------------------------
def find_gensim_wheel(download_dir: pathlib.Path) -> pathlib.Path | None:
    wheels = sorted(pathlib.Path(download_dir).glob(f"gensim-{GENSIM_VERSION}-*.whl"))
    return wheels[0] if wheels else None


PREPARE_COMMAND = "revtrain prepare --config FILE"  # the command that prepares a run's data (FILE: its config)
_FETCHING: list[str] = []  # inside `fetching`: the command to name when a fetch fails


@contextlib.contextmanager
def fetching(prepare_command: str = PREPARE_COMMAND):
    """Within this context a missing gensim wheel is fetched when the corpus is read (`read_gensim`: pip,
    then one line on stderr saying what was fetched), as ``revtrain train``, ``eval`` and ``sample`` do; a
    failed fetch is one `DataError` naming ``prepare_command`` (the run's own ``revtrain prepare``)."""
    _FETCHING.append(prepare_command)
    try:
        yield
    finally:
        _FETCHING.pop()


def read_gensim(download_dir: str | os.PathLike) -> bytes:
    """The bytes of the ``'gensim_enwiki'`` excerpt, from the wheel in ``download_dir``; inside `fetching`, a
    missing wheel is fetched there first (`ensure_gensim_wheel`).

    Raises:
      DataError: no wheel (outside `fetching`: the line names ``revtrain prepare``; inside: the fetch failed),
        or a corrupt or incomplete one.
    """
    download_dir = pathlib.Path(download_dir)
    wheel = find_gensim_wheel(download_dir)
    if wheel is None and _FETCHING:
        import time
        started = time.perf_counter()
        wheel = _fetch_gensim_wheel(download_dir, _FETCHING[-1])
        print(f"fetched the gensim {GENSIM_VERSION} wheel that holds the {GENSIM_SOURCE} corpus with pip "
              f"({wheel.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s) into {download_dir}",
              file=sys.stderr, flush=True)
    if wheel is None:
        raise DataError(
            f"gensim {GENSIM_VERSION} wheel not found in {download_dir} (read only to prepare data that is not "
            f"prepared yet, e.g. another sequence length); run `{PREPARE_COMMAND}` (FILE: the run's config), "
            "which fetches it with pip"
        )
    try:
        with zipfile.ZipFile(wheel) as zf:
            packed = zf.read(GENSIM_MEMBER)
    except (OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise DataError(
            f"{wheel} is corrupt or incomplete ({e}); delete it and run `{PREPARE_COMMAND}`"
        ) from None
    try:
        data = bz2.decompress(packed)
    except (OSError, EOFError, ValueError) as e:
        raise DataError(f"{wheel}:{GENSIM_MEMBER} is not a valid bz2 file ({e}); re-download or replace it") from None
    if len(data) != GENSIM_NUM_BYTES:
        raise DataError(
            f"{wheel} holds {len(data)} corpus bytes, expected {GENSIM_NUM_BYTES}; "
            f"delete it and run `{PREPARE_COMMAND}`"
        )
    return data


def ensure_gensim_wheel(data_dir: str) -> pathlib.Path:
    """Returns the gensim 4.4.0 wheel in ``<data_dir>/downloads/``; downloads it with pip if absent.

    Raises:
      DataError: pip failed (e.g. no network) or produced no wheel.
    """
    download_dir = pathlib.Path(data_dir).expanduser() / "downloads"
    return find_gensim_wheel(download_dir) or _fetch_gensim_wheel(download_dir)


def _fetch_gensim_wheel(download_dir: pathlib.Path, prepare_command: str | None = None) -> pathlib.Path:
    """Downloads the gensim wheel into ``download_dir`` with ``pip download`` (pip's own index settings and
    environment apply: ``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, ...). pip writes into a fresh directory beside
    it and the wheel is renamed into place, so a reader never sees half a file and processes fetching at
    once each rename a whole one.

    Raises:
      DataError: pip failed (e.g. no network) or produced no wheel; the line names ``prepare_command``.
    """
    import shutil
    import tempfile
    download_dir.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".fetch-", dir=download_dir))
    # Pin one wheel (the data file is the same in all of them) so any host fetches the same file.
    pin = "--platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp --abi cp311"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           *pin.split(), f"gensim=={GENSIM_VERSION}", "-d", str(staging)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        fetched = find_gensim_wheel(staging)
        if proc.returncode == 0 and fetched is not None:
            os.replace(fetched, download_dir / fetched.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    wheel = find_gensim_wheel(download_dir)
    if wheel is None:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        reason = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        then = (f"run `{prepare_command}` where pip can reach a package index" if prepare_command else
                "check network access")
        raise DataError(
            f"could not download gensim=={GENSIM_VERSION} with pip into {download_dir} "
            f"({reason}); {then}, or copy the wheel there by hand"
        )
    return wheel


# -- files and directories ----------------------------------------------------------------------------
def zip_text_member(zf: zipfile.ZipFile, path) -> zipfile.ZipInfo:
    """The member of a ``.zip`` source that holds its text: ``enwik8``, or its only file.

    Raises:
      DataError: neither (the message names the file and the member count).
    """
    members = [m for m in zf.infolist() if not m.is_dir()]
    named = [m for m in members if pathlib.PurePosixPath(m.filename).name == "enwik8"]
    if len(named) != 1 and len(members) != 1:
        raise DataError(f"{path} must contain a member `enwik8` or exactly one file; found {len(members)} files")
    return (named or members)[0]


@contextlib.contextmanager
def open_file(path: str | os.PathLike):
    """A file source opened for reading its bytes: a ``.zip``'s text member (`zip_text_member`), a ``.bz2``
    decompressed, any other file as it is. The one place a file format is added.

    Raises:
      DataError: the file cannot be read, or is corrupt or truncated (also while it is read in the block).
    """
    path = pathlib.Path(path)
    try:
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as zf, zf.open(zip_text_member(zf, path)) as f:
                yield f
        else:
            with (bz2.open if path.suffix == ".bz2" else open)(path, "rb") as f:
                yield f
    except _READ_ERRORS as e:
        raise DataError(f"cannot read {path}: corrupt or truncated ({e})") from None


def read_file(path: str | os.PathLike) -> bytes:
    """The whole content of a file source (`open_file`)."""
    with open_file(path) as f:
        return f.read()


def file_blocks(path: str | os.PathLike):
    """The content of a file source (`open_file`) in blocks of at most `BLOCK` bytes."""
    with open_file(path) as f:
        yield from iter(lambda: f.read(BLOCK), b"")


def decode_blocks(blocks):
    """UTF-8 text of an iterator of byte blocks, block by block (a character split across blocks kept whole;
    invalid sequences as U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for block in blocks:
        text = decoder.decode(block)
        if text:
            yield text
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def text_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The files a directory source is made of, in the order they are read."""
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in TEXT_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def corpus_files(source: str) -> list[pathlib.Path]:
    """The files whose content makes ``source`` (none for ``'gensim_enwiki'``, a pinned file)."""
    kind = corpus_kind(source)
    path = pathlib.Path(source).expanduser()
    if kind == "gensim":
        return []
    if kind == "text_dir":
        return text_files(path)
    if kind == "datasets":
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


# -- records: JSONL, Parquet, saved datasets ----------------------------------------------------------
def _jsonl_texts(path: pathlib.Path, field: str):
    import json
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError: its message and the column; UnicodeDecodeError: itself
                where = f": column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
                raise DataError(f"{path} line {number} is not JSON ({getattr(e, 'msg', e)}{where})") from None
            if not isinstance(record, dict) or field not in record:
                raise DataError(f"{path} line {number} has no field {field!r} (TokenLMTask.text_field)")
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"{path} line {number}: field {field!r} is {type(text).__name__}, not a string")
            yield text


def _parquet_texts(path: pathlib.Path, field: str):
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 (pyarrow raises ArrowInvalid and friends)
        raise DataError(f"cannot read the Parquet file {path}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise DataError(f"the Parquet file {path} has no column {field!r} (TokenLMTask.text_field); "
                        f"its columns: {', '.join(names)}")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise DataError(f"the Parquet file {path} row {row}: column {field!r} is "
                                f"{type(text).__name__}, not a string")
            yield text


def _load_saved_dataset(path: pathlib.Path):
    import datasets
    datasets.disable_progress_bars()
    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 (datasets raises FileNotFoundError, ValueError, ...)
        raise DataError(f"cannot load the saved dataset {path}: "
                        f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None


def _dataset_texts(dataset, path: pathlib.Path, field: str, split: str | None):
    where = f"the saved dataset {path}" + (f" (split {split})" if split else "")
    if field not in dataset.column_names:
        raise DataError(f"{where} has no column {field!r} (TokenLMTask.text_field); its columns: "
                        f"{', '.join(dataset.column_names)}")
    row = 0
    for batch in dataset.iter(batch_size=1024):
        for text in batch[field]:
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{where} row {row}: column {field!r} is {type(text).__name__}, not a string")
            yield text


def dataset_splits(source: str):
    """A saved dataset's own splits: ``{split: Dataset}`` for a ``DatasetDict`` (None for one ``Dataset``).

    Raises:
      DataError: it cannot be loaded, or a ``DatasetDict`` without a ``train`` or ``validation`` split.
    """
    path = pathlib.Path(source).expanduser()
    loaded = _load_saved_dataset(path)
    if not hasattr(loaded, "keys"):
        return None
    have = sorted(loaded.keys())
    for split in ("train", "validation"):
        if split not in loaded:
            raise DataError(f"the saved dataset {path} has no {split} split (it has: {', '.join(have)}); "
                            "save it with train and validation splits, or as one Dataset (cut 90/5/5)")
    return {s: loaded[s] for s in ("train", "validation", "test") if s in loaded}


# -- the two views ------------------------------------------------------------------------------------
def read_bytes(source: str, download_dir: str | os.PathLike) -> bytes:
    """The whole corpus of ``source`` as bytes (the byte task): the gensim excerpt, a file's content
    (`open_file`; any suffix), or a directory's text files concatenated (`text_files`).

    Args:
      source: 'gensim_enwiki' (wheel looked up in ``download_dir``), a file or a directory path.
      download_dir: where `ensure_gensim_wheel` put the gensim wheel.

    Raises:
      DataError: missing, empty, corrupt or truncated source.
    """
    kind = corpus_kind(source)
    if kind == "gensim":
        return read_gensim(download_dir)
    path = pathlib.Path(source).expanduser()
    data = b"".join(read_file(p) for p in text_files(path)) if path.is_dir() else read_file(path)
    if not data:
        what = "directory has no non-empty text files" if path.is_dir() else "file is empty"
        raise DataError(f"data source {source} is empty ({what})")
    return data


def documents(source: str, text_field: str = "text", dataset=None, download_dir: str | os.PathLike | None = None):
    """The documents of ``source``, in order (the token task): an iterator of documents, each an iterator of
    text pieces. A text file or the gensim excerpt is one document, a directory one per text file, a JSONL
    line, Parquet row or dataset row one each.

    Args:
      source: a corpus (module docstring).
      text_field: the JSON field / Parquet column / dataset column holding a document's text.
      dataset: for a saved dataset, the (split's) ``Dataset`` to read (default: the whole saved one).
      download_dir: where the gensim wheel is (default ``<default_data_dir()>/downloads``).

    Raises:
      DataError: a missing or unreadable source, a JSONL line that is not JSON or lacks the field, a
        Parquet file or dataset without the column (one line naming the file and field).
    """
    kind = corpus_kind(source)
    path = pathlib.Path(source).expanduser()
    if kind == "gensim":
        data = read_gensim(download_dir or pathlib.Path(default_data_dir()) / "downloads")
        yield iter([data.decode("utf-8", errors="replace")])
    elif kind == "text_file":
        yield decode_blocks(file_blocks(path))
    elif kind == "text_dir":
        for file in text_files(path):
            yield decode_blocks(file_blocks(file))
    elif kind == "jsonl":
        for text in _jsonl_texts(path, text_field):
            yield iter([text])
    elif kind == "parquet":
        for text in _parquet_texts(path, text_field):
            yield iter([text])
    else:
        if dataset is None:
            dataset = _load_saved_dataset(path)
            if hasattr(dataset, "keys"):
                raise ValueError("a DatasetDict is read split by split (dataset_splits)")
        for text in _dataset_texts(dataset, path, text_field, None):
            yield iter([text])
