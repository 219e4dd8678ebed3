"""Runs that stand on their own (issue 39): a fine-tuned workdir keeps the architecture and tokenizer of the
checkpoint it imported, so eval / sample / export / check work after that checkpoint is gone; a checkpoint
without a tokenizer beside an unset TokenLMTask.tokenizer is refused instead of guessed; data preparation
says what it did, also on a pipe."""

import json
import pathlib
import shutil
import string
import subprocess
import sys
import textwrap

import pytest

from revtrain import cli
from revtrain.data import tokenizer as tokenizer_lib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _corpus(folder: pathlib.Path) -> pathlib.Path:
    """About 60 KB of real text (stdlib sources) as a directory of 30 text files."""
    text = "".join(pathlib.Path(m.__file__).read_text() for m in (textwrap, string, json.decoder, json.encoder))
    folder.mkdir()
    size = len(text) // 30
    for i in range(30):
        (folder / f"doc{i:02d}.txt").write_text(text[i * size:(i + 1) * size])
    return folder


def _tokenizer(path: pathlib.Path, corpus: pathlib.Path) -> pathlib.Path:
    """A byte-level BPE of 300 ids trained outside revtrain, end-of-text '</s>' at id 1."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([p.read_text() for p in sorted(corpus.iterdir())], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _pretrained(path: pathlib.Path, tokenizer_file: pathlib.Path | None, vocab_size: int = 300) -> pathlib.Path:
    """A from-scratch Llama model (2 blocks, tied head) written as a Hugging Face checkpoint, with the tokenizer
    beside it when one is given."""
    from revtrain.export import write_checkpoint
    from revtrain.models.llama import LlamaModel, model_tensors
    model = LlamaModel(None, sequence_length=16, vocab_size=vocab_size, d_model=32, num_layers=2, num_heads=2,
                       num_kv_heads=1, d_ff=64, rope_theta=5000.0, tie_embeddings=True)
    tok = tokenizer_lib.load(str(tokenizer_file)) if tokenizer_file else None
    write_checkpoint(str(path), model.llama_spec, model_tensors(model, model.init()[0]), tokenizer=tok)
    return path


def _config(tmp_path: pathlib.Path) -> str:
    """Fine-tuning a LlamaModel on tokens, a tiny run; the include sets LlamaModel's size knobs (llama_small.gin),
    which the checkpoint overrides."""
    config = tmp_path / "finetune.gin"
    config.write_text(f"include '{REPO / 'configs' / 'llama_small.gin'}'\n" + "\n".join([
        "train.task = @TokenLMTask", "TokenLMTask.sequence_length = 16", "STEPS = 2", "WARMUP = 1",
        "train.batch_size = 4", "train.log_every = 1", "train.sample_every = 0", "train.checkpoint_every = 2",
        "evaluate.max_batches = 1", "train.trainer = @ReversibleTrainer"]) + "\n")
    return str(config)


@pytest.mark.slow  # make test: the standalone workdir's other tests in this file
def test_a_fine_tuned_workdir_works_after_its_checkpoint_is_gone(capsys, tmp_path):
    """Fine-tune a checkpoint (with its tokenizer) on tokens, delete the checkpoint directory: eval, sample,
    export and check on the workdir all succeed, from the architecture and tokenizer the workdir kept; the
    export equals the run's own architecture; config.gin records no LlamaModel size knob."""
    corpus = _corpus(tmp_path / "corpus")
    tok_file = _tokenizer(tmp_path / "tok" / "tokenizer.json", corpus)
    pretrained = _pretrained(tmp_path / "pretrained", tok_file)
    original_config = json.loads((pretrained / "config.json").read_text())
    workdir = tmp_path / "run"
    data = ["--gin", f"TokenLMTask.source = '{corpus}'", "--gin", f"TokenLMTask.data_dir = '{tmp_path / 'data'}'",
            "--gin", f"LlamaModel.path = '{pretrained}'"]
    capsys.readouterr()
    assert cli.main(["train", "--config", _config(tmp_path), *data, "--workdir", str(workdir)]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "token data of" in line]
    assert len(said) == 1 and said[0].startswith(f"prepared the token data of {corpus}: "), said
    assert json.loads((workdir / "pretrained" / "config.json").read_text()) == original_config
    assert (workdir / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    recorded = (workdir / "config.gin").read_text()
    assert "LlamaModel.path" in recorded
    for knob in ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "rope_theta", "tie_embeddings"):
        assert f"LlamaModel.{knob} =" not in recorded, knob
    shutil.rmtree(pretrained)
    shutil.rmtree(tok_file.parent)
    capsys.readouterr()

    assert cli.main(["eval", "--workdir", str(workdir), "--split", "test"]) == 0
    out = capsys.readouterr().out
    assert "eval at step 2 (test)" in out and "bits_per_byte" in out, out
    record = json.loads((workdir / "metrics" / "eval_test.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and 1.0 < record["bytes_per_token"] < 5.0  # the kept BPE's ids, not bytes

    assert cli.main(["sample", "--workdir", str(workdir), "--prompt", "def ", "--length", "8",
                     "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def ") and "sampled 1 x 8 tokens from step 2" in err, (out, err)

    exported = tmp_path / "exported"
    assert cli.main(["export", "--workdir", str(workdir), "--to", str(exported)]) == 0
    config = json.loads((exported / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rope_theta", "tie_word_embeddings", "max_position_embeddings"):
        assert config[key] == original_config[key], key
    assert (exported / "tokenizer.json").read_bytes() == (workdir / "tokenizer.json").read_bytes()

    capsys.readouterr()
    assert cli.main(["check", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "block_1" in out, out

    # The exported checkpoint is the fine-tuned model: importing it gives the run's trained weights.
    from revtrain.models.llama import LlamaModel, read_weights
    imported = read_weights(str(exported), LlamaModel(str(exported), sequence_length=16).llama_spec)
    assert imported["model.layers.1.mlp.up_proj.weight"].shape == (64, 32)


@pytest.mark.slow  # make test: the standalone workdir's other tests in this file
def test_a_checkpoint_without_a_tokenizer_is_not_given_a_new_bpe(capsys, tmp_path):
    """LlamaModel.path at a checkpoint with no tokenizer, TokenLMTask.tokenizer unset: one line asking for a
    tokenizer (or bytes), exit 2, no workdir; naming 'bytes' trains."""
    corpus = _corpus(tmp_path / "corpus")
    pretrained = _pretrained(tmp_path / "pretrained", None, vocab_size=300)
    data = ["--gin", f"TokenLMTask.source = '{corpus}'", "--gin", f"TokenLMTask.data_dir = '{tmp_path / 'data'}'",
            "--gin", f"LlamaModel.path = '{pretrained}'"]
    capsys.readouterr()
    code = cli.main(["train", "--config", _config(tmp_path), *data, "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"revtrain: error: the checkpoint {pretrained} has no tokenizer"), err[0]
    assert "TokenLMTask.tokenizer is unset" in err[0] and "'bytes'" in err[0], err[0]
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "data" / "token_lm" / "bpe").exists()  # no BPE was trained
    code = cli.main(["train", "--config", _config(tmp_path), *data, "--gin", "TokenLMTask.tokenizer = 'bytes'",
                     "--workdir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err


def test_data_preparation_says_what_it_did_on_a_pipe(tmp_path):
    """scripts/prepare_data.py with stdout and stderr on pipes: one line saying the data was prepared (bytes,
    sequences, seconds), then, run again, found in the cache; TFDS's own "Downloading and preparing dataset"
    lines reach neither stream. With --config of a token run, the token data of that config (its BPE)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((pathlib.Path(textwrap.__file__).read_bytes() * 10)[:150_000])
    script = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--data_dir", str(tmp_path / "data")]

    def run(*args):
        r = subprocess.run([*script, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "Downloading and preparing" not in r.stdout + r.stderr and "downloaded and prepared" not in r.stdout
        return r.stderr.strip().splitlines()

    first = run("--source", str(corpus), "--sequence_length", "64")
    assert len(first) == 1 and first[0].startswith(f"prepared the byte data of {corpus}: 150,000 bytes, 2,109 / "
                                                   "117 / 117 sequences of 64 bytes"), first
    assert " s, cached in " in first[0]
    again = run("--source", str(corpus), "--sequence_length", "64")
    assert len(again) == 1 and again[0].startswith(f"byte data of {corpus} found in the cache: 150,000 bytes"), again

    config = tmp_path / "tokens.gin"
    config.write_text(f"include '{REPO / 'configs' / 'enwik_bpe.gin'}'\nTokenLMTask.source = '{corpus}'\n")
    tokens = run("--config", str(config), "--gin.TokenLMTask.vocab_size=300")  # as make data GIN=... passes it
    assert len(tokens) == 1 and tokens[0].startswith(f"prepared the token data of {corpus}: 150,000 bytes as "), tokens
    assert "(300 ids)" in tokens[0] and "the BPE trained too" in tokens[0], tokens
    tokens = run("--config", str(config), "--gin", "TokenLMTask.vocab_size = 300")
    assert len(tokens) == 1 and tokens[0].startswith(f"token data of {corpus} found in the cache"), tokens
