"""Tokenized language-modelling data: documents from a corpus, tokenized once, packed into windows.

Design (the nanoGPT way of preparing once into a flat file of token ids, with seqio's packing of documents
separated by an end-of-text token):

* Corpora (`revtrain.data.corpus.documents`, the readers the byte task shares): a text file (raw, ``.zip`` or
  ``.bz2``; one document), a directory of text files (each file one document, sorted by path),
  ``'gensim_enwiki'`` (one document), a JSONL file (``.jsonl`` / ``.json``: one JSON object a line, the
  document in a named text field), a Parquet file (``.parquet``: one document a row, the named column; read
  with pyarrow in record batches), or a Hugging Face dataset saved with ``save_to_disk`` (a directory holding
  ``dataset_info.json`` / ``dataset_dict.json``; read with ``datasets.load_from_disk``, memory-mapped). Text
  files are read as UTF-8 (an invalid sequence becomes U+FFFD).
* Splits: a dataset saved with its own splits (a ``DatasetDict``) keeps them (``train`` and ``validation``
  are required, ``test`` is used when present); every other corpus is cut as the byte task cuts it
  (`corpus_lib.split_bounds`): train = the first 90% of its UTF-8 bytes (the documents in order), validation =
  the next 5%, test = the last 5%, a cut falling inside a document moved forward to a character boundary.
  So a one-document corpus (``gensim_enwiki``) has the byte task's splits, and bits per byte compare on
  the same text.
* Preparation (`prepare`) streams: a first pass reads the corpus and checks it (bad JSON, a missing field or
  column, a missing split: one line, nothing written) and counts its bytes; for ``'bpe'``, a second pass
  trains the tokenizer on the training split (`revtrain.data.tokenizer.train_bpe`); the last pass tokenizes
  in batches of about 512 KiB of text (a long document in pieces of at most 64 Ki characters, each ending at a
  newline when there is one) and appends the ids to one file per split, the end-of-text id after each
  document. Memory stays bounded by the batch, whatever the corpus size. A progress bar (tqdm, on a
  terminal, after 3 s) shows the bytes read.
* Cache: ``<data_dir>/token_lm/<key>/`` with ``train.bin``, ``validation.bin``, ``test.bin`` (uint16 ids when
  the vocabulary fits, else uint32), the tokenizer file and ``meta.json``. The key hashes the corpus's
  content (SHA-256 of its files; a memo of each file's size and times avoids hashing unchanged files
  again), the text field and the tokenizer's SHA-256, so a changed corpus or tokenizer is prepared again
  and the same ones are found under any path. The trained BPE is cached under
  ``<data_dir>/token_lm/bpe/<key of corpus, field and vocabulary size>/tokenizer.json``. Everything is
  written under a temporary name and renamed when complete; a failure removes it.
* Windows (`TokenWindows`): as the byte task's records, window ``k`` of a split is ids ``[k*L, k*L + L + 1)``
  of its stream (consecutive windows share one id; the trailing partial window is dropped), so the
  sequence length is not part of the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import shutil
import sys

import numpy as np

from revtrain.data import corpus as corpus_lib
from revtrain.data import tokenizer as tokenizer_lib
# The corpus readers (revtrain.data.corpus, shared with the byte task); their names stay importable from here.
from revtrain.data.corpus import DataError, corpus_kind, dataset_splits, documents  # noqa: F401

FORMAT = "token_lm-2"
SPLITS = corpus_lib.SPLITS
CHUNK_CHARS = 1 << 16  # a document is tokenized in pieces of at most this many characters
# (the `tokenizers` library holds about 100 bytes per character of a batch while it encodes: 3 MiB batches of
# 1 Mi-character pieces peaked at 645 MiB resident on a 60 MB corpus, 64 Ki / 512 KiB at 256 MiB, same speed)
BATCH_BYTES = 1 << 19  # text per encode_batch call


# -- the corpus's fingerprint ------------------------------------------------------------------------
def fingerprint(source: str, memo_path: str | None = None) -> tuple[str, dict | None]:
    """SHA-256 (hex) of a corpus's content: its files' relative paths and bytes, in order.

    ``memo_path``: a JSON file remembering each file's hash with its size and modification / status-change
    times, so that unchanged files are not read again (a changed time costs one hash).

    Returns:
      ``(digest, memo)``: ``memo`` is the updated memo to keep with `save_memo` once the corpus is prepared
      (None when nothing changed), so that a corpus refused as bad leaves nothing behind.
    """
    if corpus_kind(source) == "gensim":
        return f"{corpus_lib.GENSIM_SOURCE}-{corpus_lib.GENSIM_VERSION}-{corpus_lib.GENSIM_NUM_BYTES}", None
    root = pathlib.Path(source).expanduser().resolve()
    memo: dict = {}
    if memo_path:
        try:
            with open(memo_path) as f:
                memo = json.load(f)
        except (OSError, ValueError):
            memo = {}
    digest, changed = hashlib.sha256(), False
    for file in corpus_lib.corpus_files(source):
        file = file.resolve()
        st = file.stat()
        stat = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        entry = memo.get(str(file))
        if not entry or entry.get("stat") != stat:
            try:
                entry = {"stat": stat, "sha256": tokenizer_lib.file_sha256(str(file))}
            except OSError as e:
                raise DataError(f"cannot read {file}: {e.strerror or e}") from None
            memo[str(file)], changed = entry, True
        rel = str(file.relative_to(root)) if file != root else file.name
        digest.update(f"{rel}\t{entry['sha256']}\n".encode())
    return digest.hexdigest(), (memo if memo_path and changed else None)


def save_memo(memo_path: str, memo: dict | None) -> None:
    """Writes the hash memo of `fingerprint` (atomically; a failure only costs a hash next time)."""
    if memo is None:
        return
    try:
        os.makedirs(os.path.dirname(memo_path), exist_ok=True)
        with open(memo_path + f".tmp{os.getpid()}", "w") as f:
            json.dump(memo, f)
        os.replace(memo_path + f".tmp{os.getpid()}", memo_path)
    except OSError:
        pass


# -- splitting and chunking --------------------------------------------------------------------------
def _cut(docs, bounds):
    """Cuts a document stream at byte offsets: yields ``(split, text, document_ends)``."""
    order = list(bounds)
    pos, index = 0, 0
    for doc in docs:
        last = None
        for piece in doc:
            data = piece.encode("utf-8")
            while data:
                while index < len(order) - 1 and pos >= bounds[order[index]][1]:
                    index += 1
                room = bounds[order[index]][1] - pos if index < len(order) - 1 else len(data)
                cut = min(len(data), max(room, 0))
                while cut < len(data) and (data[cut] & 0xC0) == 0x80:  # inside a character: move forward
                    cut += 1
                if cut == 0:  # at the boundary exactly: the next split
                    index += 1
                    continue
                last = order[index]
                yield last, data[:cut].decode("utf-8"), False
                pos += cut
                data = data[cut:]
        yield (last or order[index]), "", True


def _chunks(pieces):
    """Joins ``(split, text, ends)`` pieces into tokenizer inputs: ``(split, text, ends)`` with ``text`` at
    most `CHUNK_CHARS` characters, cut after the last newline within that many when there is one; the cut
    positions depend on a document's text only, not on how it was read."""
    buffer, split = "", None
    for s, text, ends in pieces:
        if s != split and buffer:
            yield split, buffer, False
            buffer = ""
        split = s
        buffer += text
        while len(buffer) >= CHUNK_CHARS:
            cut = buffer.rfind("\n", 0, CHUNK_CHARS) + 1 or CHUNK_CHARS
            yield split, buffer[:cut], False
            buffer = buffer[cut:]
        if ends:
            yield split, buffer, True
            buffer = ""
    if buffer:
        yield split, buffer, False


# -- preparation ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """What the first pass learned about a corpus (its own splits, bytes per split); `pieces` reads it again
    as ``(split, text, document_ends)`` in split order (train, validation, test)."""

    source: str
    text_field: str
    own: dict | None  # a saved dataset's own splits, else None
    split_bytes: dict  # bytes per split
    total_bytes: int

    def pieces(self, progress=None):
        """Every piece of every split, in split order: ``(split, text, ends)``."""
        if self.own is None:
            bounds = corpus_lib.split_bounds(self.total_bytes)
            stream = _cut(documents(self.source, self.text_field), bounds)
        else:
            stream = (item for s, ds in self.own.items()
                      for item in _cut(documents(self.source, self.text_field, ds), {s: (0, self.split_bytes[s])}))
        for item in stream:
            if progress is not None and item[1]:
                progress.update(len(item[1].encode("utf-8")))
            yield item


def _progress(total: int, what: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, delay=3, disable=None, file=sys.stderr,
                leave=False)


def plan(source: str, text_field: str) -> Plan:
    """The first pass: reads (and so checks) the whole corpus, counting UTF-8 bytes per split.

    Raises:
      DataError: bad corpus (see `documents`, `dataset_splits`), or a corpus with no text.
    """
    own = dataset_splits(source) if corpus_kind(source) == "datasets" else None
    if own is None:
        total = 0
        with _progress(0, f"reading {source}") as bar:
            for doc in documents(source, text_field):
                for piece in doc:
                    n = len(piece.encode("utf-8"))
                    total += n
                    bar.update(n)
        if total == 0:
            raise DataError(f"data source {source} is empty (it holds no text)")
        bounds = corpus_lib.split_bounds(total)
        split_bytes = {s: e - b for s, (b, e) in bounds.items()}
    else:
        split_bytes = {}
        for s, ds in own.items():
            split_bytes[s] = sum(len(p.encode("utf-8")) for doc in documents(source, text_field, ds) for p in doc)
        total = sum(split_bytes.values())
        if split_bytes["train"] == 0:
            raise DataError(f"the train split of the saved dataset {source} holds no text")
    return Plan(source, text_field, own, split_bytes, total)


def _key(*parts) -> str:
    return hashlib.sha256("\n".join(str(p) for p in parts).encode()).hexdigest()[:20]


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def bpe_tokenizer(source: str, text_field: str, vocab_size: int, root: str, corpus: str,
                  plan_fn) -> tokenizer_lib.Tokenizer:
    """The byte-level BPE of ``vocab_size`` ids trained on the train split of ``source``, cached under
    ``<root>/bpe/<key of corpus, field and vocab_size>/tokenizer.json``.

    Args:
      corpus: the corpus fingerprint (`fingerprint`).
      plan_fn: returns the corpus's `Plan` (its first pass), called only when the BPE must be trained.

    Raises:
      DataError: ``vocab_size`` below 258, or a bad corpus (from the first pass, before anything is written).
    """
    if not isinstance(vocab_size, int) or vocab_size < 258:
        raise DataError(f"TokenLMTask.vocab_size must be an integer >= 258 for a BPE (257 ids are the "
                        f"end-of-text token and the 256 bytes), got {vocab_size!r}")
    folder = os.path.join(root, "bpe", _key(FORMAT, corpus, text_field, vocab_size))
    path = os.path.join(folder, tokenizer_lib.HF_FILE)
    if os.path.isfile(path):
        return tokenizer_lib.load(path)
    p = plan_fn()
    tmp = f"{folder}.tmp{os.getpid()}"
    _remove(tmp)
    try:
        os.makedirs(tmp)
        with _progress(p.split_bytes["train"], "training the BPE") as bar:
            # The pieces come in split order: reading stops at the end of the train split.
            train = itertools.takewhile(lambda item: item[0] == "train", _chunks(p.pieces(bar)))
            tokenizer_lib.train_bpe((text for _, text, _ in train if text), vocab_size,
                                    os.path.join(tmp, tokenizer_lib.HF_FILE))
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process made it first
            _remove(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return tokenizer_lib.load(path)


@dataclasses.dataclass
class Prepared:
    """A prepared token dataset (read with `TokenWindows`)."""

    directory: str
    meta: dict
    tokenizer: tokenizer_lib.Tokenizer
    fresh: bool = False  # prepared by this call (False: found in the cache)

    def split_file(self, split: str) -> str:
        """The file of a split's ids (``dtype`` of ``meta``, in stream order)."""
        return os.path.join(self.directory, f"{split}.bin")


def _read_meta(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None
    except (OSError, ValueError):
        return None


def prepare(source: str, tok: tokenizer_lib.Tokenizer, text_field: str, root: str, corpus: str,
            p: Plan | None = None) -> Prepared:
    """Tokenizes ``source`` with ``tok`` into ``<root>/<key>/`` (once; afterwards the cached files).

    Raises:
      DataError: a bad corpus (found by the first pass, before anything is written).
    """
    directory = os.path.join(root, _key(FORMAT, corpus, text_field, tok.sha256))
    meta = _read_meta(directory)
    if meta is not None:
        return Prepared(directory, meta, tok)
    p = p or plan(source, text_field)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    tmp = f"{directory}.tmp{os.getpid()}"
    _remove(tmp)
    counts = {s: 0 for s in p.split_bytes}
    try:
        os.makedirs(tmp)
        files = {s: open(os.path.join(tmp, f"{s}.bin"), "wb") for s in p.split_bytes}
        try:
            batch: list = []
            size = 0

            def flush():
                ids = tok.encode_batch([text for _, text, _ in batch])
                for (split, _, ends), row in zip(batch, ids):
                    if ends:
                        row = np.append(row, tok.eot_id)
                    files[split].write(row.astype(dtype).tobytes())
                    counts[split] += len(row)
                batch.clear()

            with _progress(p.total_bytes, f"tokenizing {source}") as bar:
                for item in _chunks(p.pieces(bar)):
                    batch.append(item)
                    size += len(item[1])
                    if size >= BATCH_BYTES:
                        flush()
                        size = 0
                if batch:
                    flush()
        finally:
            for f in files.values():
                f.close()
        tok.save(tmp)
        meta = {"format": FORMAT, "source": source, "text_field": text_field, "tokenizer": tok.describe(),
                "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
                "dtype": np.dtype(dtype).name, "splits": {s: {"tokens": counts[s], "bytes": p.split_bytes[s]}
                                                          for s in p.split_bytes}}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        try:
            os.rename(tmp, directory)
        except OSError:  # another process made it first
            _remove(tmp)
            meta = _read_meta(directory) or meta
    except BaseException:
        _remove(tmp)
        raise
    return Prepared(directory, meta, tok, fresh=True)


def describe(prepared: Prepared, source: str, seconds: float | None = None, bpe_trained: bool = False) -> str:
    """One line saying what the prepared token data of ``source`` holds and whether it was prepared now (in
    ``seconds``; ``bpe_trained``: the BPE was trained too) or found in the cache (``seconds`` None)."""
    meta = prepared.meta
    splits = meta["splits"]
    present = [s for s in SPLITS if s in splits]
    what = (f"{sum(splits[s]['bytes'] for s in present):,} bytes as "
            f"{' / '.join(format(splits[s]['tokens'], ',') for s in present)} tokens ({' / '.join(present)}) of "
            f"{prepared.tokenizer.describe()} ({meta['vocab_size']:,} ids)")
    if seconds is None:
        return f"token data of {source} found in the cache: {what}, in {prepared.directory}"
    bpe = ", the BPE trained too" if bpe_trained else ""
    return f"prepared the token data of {source}: {what} in {seconds:.1f} s{bpe}, cached in {prepared.directory}"


class TokenWindows:
    """A split's windows as a random-access source (Grain ``MapDataset.source``): record ``k`` is
    ``{'tokens': int32 [L + 1]}``, ids ``[k*L, k*L + L + 1)`` of the split's stream (memory-mapped)."""

    def __init__(self, path: str, dtype: str, num_tokens: int, sequence_length: int):
        self._ids = (np.memmap(path, np.dtype(dtype), "r", shape=(num_tokens,)) if num_tokens
                     else np.zeros(0, np.dtype(dtype)))
        self.sequence_length = sequence_length
        self._len = max(num_tokens - 1, 0) // sequence_length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, k: int) -> dict:
        if not 0 <= k < self._len:
            raise IndexError(k)
        L = self.sequence_length
        return {"tokens": np.asarray(self._ids[k * L:k * L + L + 1], np.int32)}

    def __getitems__(self, ks) -> list[dict]:
        return [self[k] for k in ks]

    def __repr__(self) -> str:
        return f"TokenWindows({self._len} x {self.sequence_length + 1})"


__all__ = ["Plan", "Prepared", "TokenWindows", "corpus_kind", "dataset_splits", "documents", "fingerprint",
           "plan", "prepare", "bpe_tokenizer", "save_memo"]
