"""Tokenizers of the language-model task: bytes, a byte-level BPE trained on the training split, or the
user's own ``tokenizer.json`` (Hugging Face ``tokenizers``) or SentencePiece ``.model``.

Design. Tokenization is not written here: a `Tokenizer` is a thin wrapper over one of three
back-ends, giving the rest of revtrain one interface (``encode_batch``, ``decode``, ``vocab_size``,
``eot_id``, ``token_bytes``, ``sha256``):

* ``bytes``: the UTF-8 bytes of the text are the ids (0..255) and id 256 is the end-of-text token
  (vocabulary 257). It serves the document corpora (JSONL, Parquet, saved datasets) at the byte level; the
  plain byte task of today (`revtrain.data.tasks.ByteLMTask`, vocabulary 256, no separator) is unchanged.
* a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``): loaded with ``Tokenizer.from_file``. The
  BPE revtrain trains (`train_bpe`) is one: byte-level pre-tokenization and decoding (the GPT-2 scheme,
  Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"; BPE: Sennrich et al. 2016,
  "Neural Machine Translation of Rare Words with Subword Units"), so any text encodes without an unknown
  token, with the special token ``<|endoftext|>`` at id 0.
* a SentencePiece model (``*.model``; Kudo and Richardson 2018): loaded with
  ``sentencepiece.SentencePieceProcessor``.

The end-of-text id separates documents in the prepared token stream. It is the tokenizer's own when it has
one (``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>``, or SentencePiece's ``eos_id``); otherwise
one id is appended after the tokenizer's vocabulary (``vocab_size`` counts it).

Bytes per token. Bits per byte (`revtrain.loop.evaluate`) divides the nats of the scored tokens by the
UTF-8 bytes of the text they stand for: ``token_bytes[id]`` is that byte count per id. It is exact for
bytes and for byte-level BPE (each id maps to a fixed byte string); for SentencePiece (and Hugging Face
files of SentencePiece pieces) it is the piece's UTF-8 length with the word-boundary mark counted as one
space (byte-fallback pieces: 1), for other Hugging Face tokenizers the UTF-8 length of the id decoded
alone (a WordPiece continuation counts without its ``##``); special tokens
count 0 bytes (the end-of-text token stands for no text, so predicting it costs nats and adds no bytes).

Decoding. ``decode`` returns bytes: byte-level tokenizers join the ids' byte strings (a sample cut inside
a multi-byte character still decodes, as the byte model's does); other tokenizers decode to text and
encode it as UTF-8.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

from revtrain.errors import DataError

BYTES = "bytes"
BPE = "bpe"
EOT_TOKEN = "<|endoftext|>"
_EOT_NAMES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"


def file_sha256(path: str) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _byte_unicode() -> dict[str, int]:
    """The byte-level alphabet: the printable character standing for each byte value (the GPT-2 scheme:
    printable Latin-1 bytes stand for themselves, the other 68 bytes for code points 256, 257, ...)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _piece_bytes(backend, i: int) -> int:
    """UTF-8 bytes of id ``i`` of a Hugging Face tokenizer that is not byte-level: a byte-fallback piece
    (``<0xNN>``) is 1, a piece with the SentencePiece word-boundary mark counts the mark as one space, any
    other its decoded text."""
    piece = backend.id_to_token(i) or ""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return 1
    if "\u2581" in piece:
        return len(piece.replace("\u2581", " ").encode("utf-8"))
    return len(backend.decode([i]).encode("utf-8"))


class Tokenizer:
    """One tokenizer: ids for text and bytes for ids.

    Attributes:
      kind: ``"bytes"``, ``"huggingface"`` or ``"sentencepiece"``.
      path: the tokenizer file (None for bytes).
      vocab_size: ids in ``[0, vocab_size)`` (the end-of-text id included).
      eot_id: the end-of-text id (separates documents).
      sha256: identifies the tokenizer (its file's SHA-256; a constant for bytes).
      token_bytes: int32 ``[vocab_size]``, UTF-8 bytes each id stands for (module docstring).

    Use `load` or `train_bpe` to make one.
    """

    def __init__(self, kind: str, path: str | None = None, backend=None, file_hash: str | None = None):
        self.kind, self.path, self._backend = kind, path, backend
        self._byte_strings: list[bytes] | None = None
        if kind == BYTES:
            self.sha256 = "bytes"
            self.eot_id, self.vocab_size = 256, 257
            self._byte_strings = [bytes([b]) for b in range(256)] + [b""]
        elif kind == "huggingface":
            self.sha256 = file_hash or file_sha256(path)
            base = backend.get_vocab_size(with_added_tokens=True)
            eot = next((i for i in (backend.token_to_id(n) for n in _EOT_NAMES) if i is not None), None)
            self.eot_id, self.vocab_size = (eot, base) if eot is not None else (base, base + 1)
            model = json.loads(backend.to_str())
            decoder = model.get("decoder") or {}
            specials = {t["id"] for t in model.get("added_tokens", []) if t.get("special")}
            if decoder.get("type") == "ByteLevel":
                table = _byte_unicode()
                strings = []
                for i in range(self.vocab_size):
                    piece = backend.id_to_token(i) if i < base else None
                    if piece is None or i in specials:
                        strings.append(b"")
                    else:
                        strings.append(bytes(table[c] for c in piece if c in table))
                self._byte_strings = strings
                lengths = [len(s) for s in strings]
            else:
                lengths = [0 if (i >= base or i in specials) else _piece_bytes(backend, i)
                           for i in range(self.vocab_size)]
            self.token_bytes = np.asarray(lengths, np.int32)
        elif kind == "sentencepiece":
            self.sha256 = file_hash or file_sha256(path)
            base = backend.get_piece_size()
            eot = backend.eos_id()
            self.eot_id, self.vocab_size = (eot, base) if eot >= 0 else (base, base + 1)
            lengths = []
            for i in range(self.vocab_size):
                if i >= base or backend.is_control(i) or backend.is_unknown(i):
                    lengths.append(0)
                elif backend.is_byte(i):
                    lengths.append(1)
                else:
                    lengths.append(len(backend.id_to_piece(i).replace("\u2581", " ").encode("utf-8")))
            self.token_bytes = np.asarray(lengths, np.int32)
        else:
            raise ValueError(f"unknown tokenizer kind {kind!r}")
        if self._byte_strings is not None and kind == BYTES:
            self.token_bytes = np.asarray([len(s) for s in self._byte_strings], np.int32)

    def describe(self) -> str:
        """A short name for messages: ``bytes``, or the kind and file."""
        return BYTES if self.kind == BYTES else f"{self.kind} tokenizer {self.path}"

    def token_string(self, i: int) -> str | None:
        """The string of id ``i`` in a Hugging Face tokenizer's vocabulary (``"</s>"``), else None (bytes,
        SentencePiece, or an id appended after the vocabulary)."""
        return self._backend.id_to_token(int(i)) if self.kind == "huggingface" else None

    def unknown_token(self) -> str | None:
        """A Hugging Face tokenizer model's unknown token (``"<unk>"``: the ``unk_token`` of a BPE or
        WordPiece model, the ``unk_id`` piece of a Unigram one), else None."""
        if self.kind != "huggingface":
            return None
        model = json.loads(self._backend.to_str()).get("model") or {}
        if model.get("unk_token"):
            return str(model["unk_token"])
        if model.get("unk_id") is not None:
            return self._backend.id_to_token(int(model["unk_id"]))
        return None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text (no end-of-text token added): a list of int64 arrays."""
        if self.kind == BYTES:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64) for t in texts]
        if self.kind == "huggingface":
            # (the fast variant keeps no character offsets: less memory per token)
            return [np.asarray(e.ids, np.int64)
                    for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [np.asarray(ids, np.int64) for ids in self._backend.encode(texts)]

    def encode(self, text: str) -> np.ndarray:
        """The ids of one text (int64 ``[n]``)."""
        return self.encode_batch([text])[0]

    def decode(self, ids) -> bytes:
        """The UTF-8 bytes of ``ids`` (an int sequence); the end-of-text id and ids outside the tokenizer's
        own vocabulary decode to nothing."""
        ids = [int(i) for i in ids]
        if self._byte_strings is not None:
            return b"".join(self._byte_strings[i] for i in ids if 0 <= i < len(self._byte_strings))
        own = [i for i in ids if i != self.eot_id and 0 <= i < self.vocab_size]
        if self.kind == "huggingface":
            base = self._backend.get_vocab_size(with_added_tokens=True)
            return self._backend.decode([i for i in own if i < base]).encode("utf-8")
        base = self._backend.get_piece_size()
        return self._backend.decode([i for i in own if i < base]).encode("utf-8")

    def save(self, directory: str) -> str:
        """Copies the tokenizer file into ``directory`` (as ``tokenizer.json`` or ``tokenizer.model``, written
        under a temporary name and renamed) and returns its path; None for bytes (nothing to keep)."""
        if self.kind == BYTES:
            return None
        target = os.path.join(directory, HF_FILE if self.kind == "huggingface" else SP_FILE)
        if os.path.abspath(target) != os.path.abspath(self.path):
            shutil.copyfile(self.path, target + ".tmp")
            os.replace(target + ".tmp", target)
        return target


def file_in(directory: str) -> str | None:
    """The tokenizer file of a checkpoint directory (Hugging Face layout): its ``tokenizer.json``, else its
    SentencePiece ``tokenizer.model``, else None."""
    for name in (HF_FILE, SP_FILE):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def load(path: str) -> Tokenizer:
    """Loads a tokenizer file: a SentencePiece model (``*.model``) or a Hugging Face ``tokenizer.json``
    (any other name); a directory (a checkpoint in the Hugging Face layout) stands for its `file_in`.

    Raises:
      DataError: the file is missing (or the directory holds neither file), or does not parse as a tokenizer
        (one line naming it).
    """
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        found = file_in(path)
        if found is None:
            raise DataError(f"the directory {path} holds no tokenizer ({HF_FILE} or {SP_FILE})")
        path = found
    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {path} does not exist; pass a tokenizer.json, a SentencePiece .model, "
                        "'bpe' (trained on the training split) or 'bytes'")
    if path.endswith(".model"):
        import sentencepiece
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(path)
        except (OSError, RuntimeError, ValueError) as e:
            raise DataError(f"tokenizer file {path} is not a SentencePiece model: "
                            f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
        return Tokenizer("sentencepiece", path, processor)
    import tokenizers
    try:
        backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception for a file that does not parse)
        raise DataError(f"tokenizer file {path} does not parse as a Hugging Face tokenizer.json: "
                        f"{(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    return Tokenizer("huggingface", path, backend)


def train_bpe(texts, vocab_size: int, path: str, length: int | None = None) -> Tokenizer:
    """Trains a byte-level BPE on ``texts`` (an iterator of strings) with Hugging Face ``tokenizers`` and
    writes it to ``path`` (a ``tokenizer.json``).

    The vocabulary: ``<|endoftext|>`` (id 0), the 256 byte symbols, then merges up to ``vocab_size`` ids.

    Raises:
      DataError: ``vocab_size`` below 258 (the end-of-text token and the 256 bytes need 257 ids, and a BPE
        needs at least one merge).
    """
    if not isinstance(vocab_size, int) or vocab_size < 258:
        raise DataError(f"TokenLMTask.vocab_size must be an integer >= 258 for a BPE (257 ids are the "
                        f"end-of-text token and the 256 bytes), got {vocab_size!r}")
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.save(path + ".tmp")
    os.replace(path + ".tmp", path)
    return Tokenizer("huggingface", path, tok)
