"""Tokenizers and document corpora of the token LM task (revtrain.data.tokenizer, revtrain.data.token_lm,
TokenLMTask): the same tokens from every corpus format, user-brought tokenizers that train, evaluate and
sample, bits per byte, and bad input (one line, exit 2, nothing left behind)."""

import dataclasses
import json
import os
import pathlib
import shutil
import string
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from revtrain import cli
from revtrain.data import token_lm
from revtrain.data import tokenizer as tokenizer_lib
from revtrain.data.tasks import TokenLMTask

from helpers import REPO, env, revtrain

CONFIG = str(REPO / "configs" / "enwik_bpe.gin")
TINY = ["--gin", "STEPS = 3", "--gin", "WARMUP = 1", "--gin", "NUM_LAYERS = 1", "--gin", "D_MODEL = 32",
        "--gin", "NUM_HEADS = 2", "--gin", "NUM_KV_HEADS = 1", "--gin", "D_FF = 64", "--gin", "train.batch_size = 4",
        "--gin", "evaluate.max_batches = 2", "--gin", "train.sample_every = 0", "--gin", "train.log_every = 1",
        "--gin", "TokenLMTask.sequence_length = 16"]


def _documents():
    """About 60 KB of real text in 40 documents of different lengths (stdlib source files, cut up)."""
    text = "".join(pathlib.Path(m.__file__).read_text() for m in (textwrap, string, json.decoder, json.encoder))
    docs, start = [], 0
    for i in range(40):
        size = 800 + 97 * (i % 13)
        docs.append(text[start:start + size] + "é∑ ok\n")  # some multi-byte characters in every document
        start += size
    return docs


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """The same documents as a directory of text files, JSONL, Parquet and a saved dataset."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path_factory.mktemp("corpora")
    docs = _documents()
    (root / "dir").mkdir()
    for i, doc in enumerate(docs):
        (root / "dir" / f"doc{i:03d}.txt").write_text(doc)
    with open(root / "docs.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, "body": doc}) + "\n")
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), root / "docs.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(root / "saved"))
    return root, docs


@pytest.fixture(scope="module")
def user_tokenizer(tmp_path_factory, corpora):
    """A tokenizer.json trained outside revtrain (the tokenizers library directly): byte-level BPE, 400 ids,
    its own end-of-text token '</s>' at id 1."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    _, docs = corpora
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs[:30], trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory, corpora):
    """A SentencePiece BPE model (600 pieces, byte fallback, no normalization) trained on the documents."""
    import sentencepiece as spm
    _, docs = corpora
    folder = tmp_path_factory.mktemp("sp")
    (folder / "input.txt").write_text("".join(docs[:30]))
    spm.SentencePieceTrainer.train(input=str(folder / "input.txt"), model_prefix=str(folder / "sp"), vocab_size=600,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    return folder / "sp.model"


def _split_ids(task, split):
    meta = task.prepared.meta
    return np.fromfile(task.prepared.split_file(split), np.dtype(meta["dtype"]))


def test_every_corpus_format_gives_the_same_tokens(corpora, user_tokenizer, tmp_path):
    root, docs = corpora
    data_dir = str(tmp_path / "data")
    tasks = {name: TokenLMTask(source=str(root / name), sequence_length=16, tokenizer=str(user_tokenizer),
                               text_field="body", data_dir=data_dir)
             for name in ("dir", "docs.jsonl", "docs.parquet", "saved")}
    reference = tasks["dir"]
    tok = reference.tokenizer
    assert tok.eot_id == 1 and tok.vocab_size == 400
    for name, task in tasks.items():
        for split in token_lm.SPLITS:
            assert np.array_equal(_split_ids(task, split), _split_ids(reference, split)), (name, split)
    # The layout: the splits' ids decode to the documents in order, one end-of-text id after each document;
    # the train split ends at 90% of the bytes (moved forward to a character boundary).
    ids = {s: _split_ids(reference, s) for s in token_lm.SPLITS}
    joined = b"".join(tok.decode(ids[s]) for s in token_lm.SPLITS)
    assert joined == "".join(docs).encode()
    assert sum(int(np.sum(ids[s] == tok.eot_id)) for s in token_lm.SPLITS) == len(docs)
    total = len(joined)
    assert 0 <= len(tok.decode(ids["train"])) - total * 9 // 10 < 4
    meta = reference.prepared.meta["splits"]
    assert [meta[s]["tokens"] for s in token_lm.SPLITS] == [len(ids[s]) for s in token_lm.SPLITS]
    assert sum(meta[s]["bytes"] for s in token_lm.SPLITS) == total
    # Windows of L + 1 ids with stride L, sharing one id.
    windows = reference.windows("validation")
    assert len(windows) == (len(ids["validation"]) - 1) // 16
    assert np.array_equal(windows[1]["tokens"], ids["validation"][16:33])
    # A cache hit the second time: the same directory, nothing prepared again.
    again = TokenLMTask(source=str(root / "docs.jsonl"), sequence_length=16, tokenizer=str(user_tokenizer),
                        text_field="body", data_dir=data_dir)
    assert again.prepared.directory == tasks["docs.jsonl"].prepared.directory
    assert not [p for p in os.listdir(os.path.join(data_dir, "token_lm")) if ".tmp" in p]


def test_bpe_is_trained_on_the_train_split_and_cached(corpora, tmp_path):
    root, docs = corpora
    data_dir = str(tmp_path / "data")
    task = TokenLMTask(source=str(root / "docs.jsonl"), sequence_length=16, tokenizer="bpe", vocab_size=300,
                       text_field="body", data_dir=data_dir)
    tok = task.tokenizer
    assert tok.kind == "huggingface" and tok.vocab_size == 300 and tok.eot_id == 0
    assert task.model_kwargs() == {"sequence_length": 16, "vocab_size": 300}
    # Exact bytes per token for a byte-level BPE: the bytes of each split, through the table.
    for split in token_lm.SPLITS:
        ids = _split_ids(task, split)
        assert int(tok.token_bytes[ids].sum()) == task.prepared.meta["splits"][split]["bytes"]
    # Subwords: fewer ids than bytes.
    assert 1.5 < task.bytes_per_token < 4
    bpe_dirs = os.listdir(os.path.join(data_dir, "token_lm", "bpe"))
    again = TokenLMTask(source=str(root / "docs.jsonl"), sequence_length=16, tokenizer="bpe", vocab_size=300,
                        text_field="body", data_dir=data_dir)
    assert again.tokenizer.sha256 == tok.sha256 and os.listdir(os.path.join(data_dir, "token_lm", "bpe")) == bpe_dirs


@pytest.mark.parametrize("which", ["json", "sentencepiece"])
def test_validation_documents_round_trip(corpora, user_tokenizer, sentencepiece_model, which):
    _, docs = corpora
    tok = tokenizer_lib.load(str(user_tokenizer if which == "json" else sentencepiece_model))
    sizes = np.cumsum([len(d.encode()) for d in docs])
    validation = [d for d, end in zip(docs, sizes) if end > sizes[-1] * 9 // 10]  # validation and test splits
    assert len(validation) >= 3
    for doc in validation:
        assert tok.decode(tok.encode(doc)) == doc.encode()
    if which == "sentencepiece":
        assert tok.kind == "sentencepiece" and tok.vocab_size == 600 and tok.eot_id == 2
        assert tok.token_bytes[tok.eot_id] == 0 and tok.token_bytes.max() > 1


@pytest.mark.slow  # three revtrain processes each (train, eval, sample): about a minute on a quiet machine
@pytest.mark.parametrize("which", ["json", "sentencepiece"])
def test_a_brought_tokenizer_trains_evaluates_and_samples(corpora, user_tokenizer, sentencepiece_model, tmp_path,
                                                         which):
    root, _ = corpora
    brought = tmp_path / ("tokenizer.json" if which == "json" else "sp.model")
    shutil.copyfile(user_tokenizer if which == "json" else sentencepiece_model, brought)
    workdir = tmp_path / "run"
    data = ["--gin", f"TokenLMTask.source = '{root / 'docs.parquet'}'", "--gin", "TokenLMTask.text_field = 'body'",
            "--gin", f"TokenLMTask.tokenizer = '{brought}'", "--gin", f"TokenLMTask.data_dir = '{tmp_path / 'data'}'"]
    result = revtrain("train", "--config", CONFIG, *TINY, *data, "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr
    assert "nats/token" in result.stderr and "bytes/token" in result.stderr
    kept = workdir / ("tokenizer.json" if which == "json" else "tokenizer.model")
    assert kept.read_bytes() == brought.read_bytes()
    record = json.loads((workdir / "metrics" / "eval.jsonl").read_text().splitlines()[-1])
    # bits per byte = nats over the scored tokens' bytes / ln 2 = loss per token / ln 2 / bytes per token.
    assert record["bits_per_byte"] == pytest.approx(record["loss"] / np.log(2) / record["bytes_per_token"], rel=1e-9)
    assert 1.0 < record["bytes_per_token"] < 5.0
    train = json.loads((workdir / "metrics" / "train.jsonl").read_text().splitlines()[-1])
    assert train["bytes_per_token"] > 1.0
    brought.unlink()  # the run's own copy serves eval and sample from now on
    result = revtrain("eval", "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr
    again = json.loads((workdir / "metrics" / "eval.jsonl").read_text().splitlines()[-1])
    assert again["bits_per_byte"] == pytest.approx(record["bits_per_byte"], rel=1e-6)
    out = tmp_path / "sample.txt"
    result = revtrain("sample", "--workdir", str(workdir), "--prompt", "def wrap(", "--length", "12",
                      "--temperature", "0", "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert "12 tokens" in result.stderr
    text = out.read_bytes()
    assert text.startswith(b"def wrap(") and len(text) > len(b"def wrap(")


# -- bad input: one line, exit 2, nothing left behind -------------------------------------------------
def _fails(capsys, tmp_path, bindings, contains, prepared=False):
    workdir = tmp_path / "run"
    data_dir = tmp_path / "data"
    args = ["train", "--config", CONFIG, *TINY, "--gin", f"TokenLMTask.data_dir = '{data_dir}'"]
    for b in bindings:
        args += ["--gin", b]
    capsys.readouterr()
    code = cli.main(args + ["--workdir", str(workdir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("revtrain: error: "), err
    assert contains in err[0], err[0]
    assert not workdir.exists()
    left = [str(p.relative_to(data_dir)) for p in data_dir.rglob("*")] if data_dir.exists() else []
    if not prepared:  # (a good corpus refused for another reason keeps its prepared tokens: a cache)
        assert left in ([], ["token_lm"]), left
    return err[0]


def test_a_tokenizer_file_that_does_not_parse(capsys, tmp_path, corpora):
    root, _ = corpora
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": 42}')
    _fails(capsys, tmp_path, [f"TokenLMTask.source = '{root / 'dir'}'", f"TokenLMTask.tokenizer = '{bad}'"],
           f"tokenizer file {bad} does not parse")
    sp = tmp_path / "broken.model"
    sp.write_bytes(b"not a model")
    _fails(capsys, tmp_path, [f"TokenLMTask.source = '{root / 'dir'}'", f"TokenLMTask.tokenizer = '{sp}'"],
           f"tokenizer file {sp} is not a SentencePiece model")
    _fails(capsys, tmp_path, [f"TokenLMTask.source = '{root / 'dir'}'", "TokenLMTask.tokenizer = 'nothere.json'"],
           "nothere.json does not exist")


def test_jsonl_lines_that_are_not_json_or_lack_the_field(capsys, tmp_path, corpora):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "cut\n')
    _fails(capsys, tmp_path, [f"TokenLMTask.source = '{bad}'"], f"{bad} line 2 is not JSON")
    bad.write_text('{"text": "fine"}\n\n{"body": "other"}\n')
    _fails(capsys, tmp_path, [f"TokenLMTask.source = '{bad}'"], f"{bad} line 3 has no field 'text'")


def test_parquet_without_the_column_and_a_saved_dataset_without_the_split(capsys, tmp_path, corpora):
    import datasets
    root, docs = corpora
    _fails(capsys, tmp_path, [f"TokenLMTask.source = '{root / 'docs.parquet'}'", "TokenLMTask.text_field = 'txt'"],
           f"the Parquet file {root / 'docs.parquet'} has no column 'txt'")
    saved = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs[:30]}),
                          "test": datasets.Dataset.from_dict({"body": docs[30:]})}).save_to_disk(str(saved))
    _fails(capsys, tmp_path, [f"TokenLMTask.source = '{saved}'", "TokenLMTask.text_field = 'body'"],
           f"the saved dataset {saved} has no validation split")


def test_a_vocabulary_larger_than_the_embedding(capsys, tmp_path, corpora, user_tokenizer):
    root, _ = corpora
    line = _fails(capsys, tmp_path, [f"TokenLMTask.source = '{root / 'dir'}'",
                                     f"TokenLMTask.tokenizer = '{user_tokenizer}'", "ComposedModel.vocab_size = 256"],
                  "ComposedModel.vocab_size = 256 is smaller than the vocabulary", prepared=True)
    assert "400 ids" in line


@pytest.mark.parametrize("binding, contains", [
    ("TokenLMTask.vocab_size = 100", "TokenLMTask.vocab_size must be an integer >= 258"),
    ("TokenLMTask.sequence_length = 0", "TokenLMTask.sequence_length must be a positive integer"),
    ("TokenLMTask.text_field = ''", "TokenLMTask.text_field must be a non-empty string"),
    ("TokenLMTask.tokenizer = ''", "TokenLMTask.tokenizer must be 'bpe', 'bytes' or a tokenizer file"),
    ("TokenLMTask.sequence_length = 100000", "TokenLMTask.sequence_length 100000 is too large"),
])
def test_bad_knob_values(capsys, tmp_path, corpora, binding, contains):
    root, _ = corpora
    bindings = [f"TokenLMTask.source = '{root / 'dir'}'", "TokenLMTask.tokenizer = 'bytes'", binding]
    if "vocab_size" in binding:
        bindings[1] = "TokenLMTask.tokenizer = 'bpe'"
    workdir = tmp_path / "run"
    capsys.readouterr()
    args = ["train", "--config", CONFIG, *TINY, "--gin", f"TokenLMTask.data_dir = '{tmp_path / 'data'}'"]
    for b in bindings:
        args += ["--gin", b]
    code = cli.main(args + ["--workdir", str(workdir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and contains in err[0], err
    assert not workdir.exists()


def test_bytes_through_the_token_task(corpora, tmp_path):
    root, docs = corpora
    task = TokenLMTask(source=str(root / "docs.jsonl"), sequence_length=16, tokenizer="bytes", text_field="body",
                       data_dir=str(tmp_path / "data"))
    ids = np.concatenate([_split_ids(task, s) for s in token_lm.SPLITS])
    assert task.tokenizer.vocab_size == 257 and task.bytes_per_token == pytest.approx(
        task.prepared.meta["splits"]["train"]["bytes"] / task.prepared.meta["splits"]["train"]["tokens"])
    assert ids.tobytes() != b"" and bytes(ids[ids != 256].astype(np.uint8)) == "".join(docs).encode()
    assert int(np.sum(ids == 256)) == len(docs)


@pytest.mark.slow
def test_preparing_a_large_corpus_stays_under_one_gib(tmp_path, user_tokenizer):
    """A corpus of 200 MB (repeated real text) is prepared in a process whose peak resident memory stays
    below 1 GiB: the corpus is streamed and written in pieces."""
    if shutil.disk_usage(tmp_path).free < 1 << 30:
        pytest.skip("needs 1 GiB of free disk")
    if not os.path.exists("/proc/self/status"):
        pytest.skip("measures the peak resident set with Linux's /proc/self/status")
    text = "".join(pathlib.Path(m.__file__).read_text() for m in (textwrap, string, json.decoder, json.encoder))
    corpus = tmp_path / "big.txt"
    with open(corpus, "w") as f:
        written, i = 0, 0
        while written < 200_000_000:
            block = f"== part {i} ==\n" + text
            f.write(block)
            written += len(block.encode())
            i += 1
    # The peak is VmHWM of the process's own memory map: getrusage's ru_maxrss would also count the parent's
    # resident set, which Linux carries over into the child's maximum at exec (a test worker of 1.4 GB read
    # as a 1.4 GB preparation).
    script = ("import re; from revtrain.data.tasks import TokenLMTask;"
              f"t = TokenLMTask(source={str(corpus)!r}, sequence_length=64, tokenizer={str(user_tokenizer)!r},"
              f" data_dir={str(tmp_path / 'data')!r});"
              "hwm = re.search(r'VmHWM:\\s*(\\d+) kB', open('/proc/self/status').read()).group(1);"
              "print(t.prepared.meta['splits']['train']['tokens'], hwm)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=3600,
                            env=env())
    assert result.returncode == 0, result.stderr
    tokens, peak_kib = (int(x) for x in result.stdout.split())
    assert tokens > 30_000_000
    assert peak_kib * 1024 < 1 << 30, f"peak RSS {peak_kib / 1024:.0f} MiB"


# -- an imported checkpoint's own tokenizer (revtrain.models.llama, revtrain.export) --------------------
def _pretrained(path, tok, vocab_size=None):
    """A from-scratch Llama model (tied head) written as a Hugging Face checkpoint with ``tok`` beside it."""
    from revtrain.export import write_checkpoint
    from revtrain.models.llama import LlamaModel, model_tensors
    model = LlamaModel(None, sequence_length=16, vocab_size=vocab_size or tok.vocab_size, d_model=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, d_ff=64, tie_embeddings=True)
    write_checkpoint(str(path), model.llama_spec, model_tensors(model, model.init()[0]), tokenizer=tok)
    return path


def _llama_config(tmp_path):
    config = tmp_path / "finetune.gin"
    config.write_text(f"include '{REPO / 'configs' / 'enwik_small.gin'}'\n" + "\n".join([
        "train.model = @LlamaModel", "train.task = @TokenLMTask", "TokenLMTask.sequence_length = 16",
        "STEPS = 2", "WARMUP = 1", "train.batch_size = 4", "train.log_every = 1", "train.sample_every = 0",
        "train.checkpoint_every = 2", "evaluate.max_batches = 1"]) + "\n")
    return str(config)


@pytest.mark.slow  # make test: test_llama's import and export
def test_an_imported_checkpoint_tokenizes_with_its_own_tokenizer_and_exports_it(capsys, tmp_path, corpora,
                                                                                user_tokenizer):
    """LlamaModel.path at a checkpoint holding a tokenizer.json, TokenLMTask.tokenizer unset: the run
    tokenizes with the checkpoint's tokenizer (kept in the workdir), and `revtrain export` writes it back
    beside the weights with a tokenizer_config.json naming its end-of-text token."""
    root, _ = corpora
    tok = tokenizer_lib.load(str(user_tokenizer))
    pretrained = _pretrained(tmp_path / "pretrained", tok)
    assert (pretrained / "tokenizer.json").read_bytes() == user_tokenizer.read_bytes()
    assert tokenizer_lib.load(str(pretrained)).sha256 == tok.sha256  # a directory stands for its tokenizer
    workdir, out = tmp_path / "run", tmp_path / "exported"
    data = ["--gin", f"TokenLMTask.source = '{root / 'dir'}'", "--gin", f"TokenLMTask.data_dir = '{tmp_path / 'data'}'",
            "--gin", f"LlamaModel.path = '{pretrained}'"]
    assert cli.main(["train", "--config", _llama_config(tmp_path), *data, "--workdir", str(workdir)]) == 0
    assert (workdir / "tokenizer.json").read_bytes() == user_tokenizer.read_bytes()
    record = json.loads((workdir / "metrics" / "train.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and 1.0 < record["bytes_per_token"] < 5.0  # BPE ids, not bytes (1.0 per token)
    assert cli.main(["export", "--workdir", str(workdir), "--to", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == user_tokenizer.read_bytes()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == "</s>"
    exported = json.loads((out / "config.json").read_text())
    assert exported["vocab_size"] == 400 and exported["eos_token_id"] == tok.eot_id == 1
    # revtrain.logits on the fine-tuned run: built with the workdir's kept tokenizer (it raised DataError once).
    from revtrain import logits
    loaded = logits.load(str(workdir))
    ids = tok.encode(corpora[1][0])[:12]
    log_probs = loaded.log_probs(ids)
    assert loaded.vocab_size == 400 and log_probs.shape == (1, len(ids) - 1)
    assert np.all(np.isfinite(log_probs)) and np.all(log_probs < 0)


def test_a_checkpoint_smaller_than_the_tokenizer_is_refused(capsys, tmp_path, corpora, user_tokenizer):
    """A checkpoint of 300 ids fed a tokenizer of 400: one line, exit 2, no workdir (ids past the table)."""
    root, _ = corpora
    pretrained = _pretrained(tmp_path / "pretrained", None, vocab_size=300)
    capsys.readouterr()
    code = cli.main(["train", "--config", _llama_config(tmp_path), "--gin", f"TokenLMTask.source = '{root / 'dir'}'",
                     "--gin", f"TokenLMTask.data_dir = '{tmp_path / 'data'}'", "--gin", f"LlamaModel.path = '{pretrained}'",
                     "--gin", f"TokenLMTask.tokenizer = '{user_tokenizer}'", "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("revtrain: error: "), err
    assert "vocabulary (400 ids) is larger than the checkpoint's" in err[0] and "at most 300 ids" in err[0], err[0]
    assert not (tmp_path / "run").exists()


def test_an_exported_tokenizer_loads_in_transformers(tmp_path, user_tokenizer, corpora):
    """transformers' AutoTokenizer on an exported directory encodes and decodes as the tokenizer file does
    (no tokens added). Skips without transformers."""
    transformers = pytest.importorskip("transformers")
    tok = tokenizer_lib.load(str(user_tokenizer))
    out = _pretrained(tmp_path / "out", tok)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    text = corpora[1][35]
    assert hf.encode(text) == tok.encode(text).tolist()
    assert hf.eos_token_id == tok.eot_id
    assert hf.decode(hf.encode(text)).encode("utf-8") == tok.decode(tok.encode(text))


def test_exported_tokenizer_config_names_the_checkpoint_special_tokens(tmp_path, corpora):
    """A Llama-style tokenizer ('<unk>' 0, '<s>' 1, '</s>' 2; BPE with unk_token) and a source config.json
    with bos 1 / eos 2 / pad 0: the exported tokenizer_config.json names '<s>', '</s>', '<unk>' and the pad
    token, as the config's ids (the source's bos and unk tokens were dropped before issue 40)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    from revtrain.export import write_checkpoint
    from revtrain.models.llama import LlamaModel, model_tensors
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpora[1][:10], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    (tmp_path / "src").mkdir()
    tok.save(str(tmp_path / "src" / "tokenizer.json"))
    loaded = tokenizer_lib.load(str(tmp_path / "src"))
    model = LlamaModel(None, sequence_length=8, vocab_size=loaded.vocab_size, d_model=16, num_layers=1,
                       num_heads=2, num_kv_heads=1, d_ff=32)
    spec = dataclasses.replace(model.llama_spec, bos_token_id=1, eos_token_id=[2], pad_token_id=0)
    write_checkpoint(str(tmp_path / "out"), spec, model_tensors(model, model.init()[0]), tokenizer=loaded)
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]) == (
        "<s>", "</s>", "<unk>", "<unk>"), config
    try:
        import transformers
    except ImportError:
        return
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (1, 2, 0)
