"""Llama checkpoints in and out (revtrain/models/llama.py, revtrain/export.py): import against `transformers`'
own logits (skips without torch / transformers), refusals as one line, export round trips, the CLI."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from revtrain.export import ExportError, write_checkpoint
from revtrain.models.llama import LlamaFormatError, LlamaModel, forward_logits, model_tensors, read_spec

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=64)


def _tokens(vocab, shape=(2, 24), seed=0):
    return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


def _logits(model, tokens):
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(lambda p, s, t: forward_logits(model, p, s, t))(*model.init(), jnp.asarray(tokens)))


def _revtrain_logits(path, tokens, **kwargs):
    model = LlamaModel(path, sequence_length=tokens.shape[1], **kwargs)
    return model, _logits(model, tokens)


def _hf_model(tie, dtype="float32", seed=0, **overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**SIZES, **overrides}, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than the default init (std 0.02), so the blocks change the stream visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    return model.to(getattr(torch, dtype))


def _hf_logits(model, tokens):
    import torch
    with torch.no_grad():
        return model.float()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_matches_transformers(tmp_path, tie):
    """A checkpoint written by transformers (GQA 4 query / 2 key-value heads, rope_theta 5000): revtrain's
    logits within 1e-5 of transformers' own (float32), the tied head held once by the embedding."""
    hf = _hf_model(tie)
    hf.save_pretrained(tmp_path)
    tokens = _tokens(300)
    ref = _hf_logits(hf, tokens)
    model, got = _revtrain_logits(str(tmp_path), tokens)
    assert np.abs(got - ref).max() <= 1e-5, np.abs(got - ref).max()
    assert np.abs(ref).max() > 1.0  # logits of a size where 1e-5 means something
    assert len(model.ties) == int(tie)
    assert ("lm_head" in model.init()[0][-1]) == (not tie)


def test_import_sharded_and_bfloat16(tmp_path):
    """Sharded (model.safetensors.index.json) bfloat16 checkpoint: the float32 logits of the same bfloat16
    weights within 1e-5."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    hf = _hf_model(False)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # weights on the bfloat16 grid, the model still float32
    tokens = _tokens(300)
    ref = _hf_logits(hf, tokens)  # the bfloat16 weights, computed in float32
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert read_spec(str(tmp_path)).torch_dtype == "bfloat16"
    _, got = _revtrain_logits(str(tmp_path), tokens)
    assert np.abs(got - ref).max() <= 1e-5, np.abs(got - ref).max()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_round_trip_loads_in_transformers(tmp_path, tie):
    """import -> export (write_checkpoint of the model's tensors) -> transformers: logits within 1e-5 of
    revtrain's, and transformers generates from it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    hf = _hf_model(tie)
    hf.save_pretrained(tmp_path / "in")
    tokens = _tokens(300)
    model, ours = _revtrain_logits(str(tmp_path / "in"), tokens)
    write_checkpoint(str(tmp_path / "out"), model.llama_spec, model_tensors(model, model.init()[0]))
    import transformers
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert np.abs(_hf_logits(back, tokens) - ours).max() <= 1e-5
    with torch.no_grad():
        out = back.generate(torch.tensor(tokens[:1, :5], dtype=torch.long), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)
    with pytest.raises(ExportError, match="exists and is not an empty directory"):
        write_checkpoint(str(tmp_path / "out"), model.llama_spec, {})


def _write_small(path, tie=False, **config_changes):
    """A from-scratch LlamaModel written as a checkpoint (no torch needed), its config then edited."""
    model = LlamaModel(None, sequence_length=8, vocab_size=40, d_model=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, d_ff=48, tie_embeddings=tie)
    write_checkpoint(str(path), model.llama_spec, model_tensors(model, model.init()[0]))
    if config_changes:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config_changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return model


def test_special_token_ids_are_kept_on_export(tmp_path):
    """A source config.json's bos / eos / pad ids (1, [2, 3], 0) are read, written back to the exported
    config.json and to a generation_config.json; a new model's are null and its generation config has none;
    a non-integer id is one line naming it."""
    _write_small(tmp_path / "src", bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    spec = read_spec(str(tmp_path / "src"))
    assert (spec.bos_token_id, spec.eos_token_id, spec.pad_token_id) == (1, [2, 3], 0)
    model = LlamaModel(str(tmp_path / "src"), sequence_length=8)
    write_checkpoint(str(tmp_path / "out"), model.llama_spec, model_tensors(model, model.init()[0]))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, [2, 3], 0)
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == {
        "_from_model_config": True, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0}
    _write_small(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "config.json").read_text())["bos_token_id"] is None
    assert json.loads((tmp_path / "new" / "generation_config.json").read_text()) == {"_from_model_config": True}
    _write_small(tmp_path / "bad", eos_token_id="</s>")
    with pytest.raises(LlamaFormatError, match="eos_token_id must be an integer, a list of integers or null"):
        read_spec(str(tmp_path / "bad"))


def test_exported_special_ids_load_in_transformers(tmp_path):
    """A transformers checkpoint with bos 1 / eos 2: the export's config and generation config load in
    transformers with the same ids (they were null before issue 40)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _hf_model(True, bos_token_id=1, eos_token_id=2)
    hf.save_pretrained(tmp_path / "in")
    model = LlamaModel(str(tmp_path / "in"), sequence_length=8)
    write_checkpoint(str(tmp_path / "out"), model.llama_spec, model_tensors(model, model.init()[0]))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)


def test_revtrain_checkpoint_imports_to_the_same_model(tmp_path):
    """A revtrain-written checkpoint (tied head) imports back to the same logits bit for bit."""
    tokens = _tokens(40, (2, 8))
    for tie in (True,):
        model = _write_small(tmp_path / f"t{tie}", tie=tie)
        want = _logits(model, tokens)
        _, got = _revtrain_logits(str(tmp_path / f"t{tie}"), tokens)
        np.testing.assert_array_equal(got, want)


def test_export_writes_shards_past_the_shard_size(tmp_path):
    """Past ``max_shard_bytes`` the export is shards listed in model.safetensors.index.json (each file within
    the bound, every tensor in exactly one), streamed from `iter_model_tensors`; it imports back to the same
    logits bit for bit, and bfloat16 halves the bytes."""
    from revtrain.models.llama import iter_model_tensors
    model = LlamaModel(None, sequence_length=8, vocab_size=40, d_model=32, num_layers=3, num_heads=4,
                       num_kv_heads=2, d_ff=48)
    params = model.init()[0]
    tensors = model_tensors(model, params)
    limit = 12_000  # bytes: the embedding (40 x 32 float32, 5,120 B) and a block's 9 tensors need several
    write_checkpoint(str(tmp_path / "out"), model.llama_spec, iter_model_tensors(model, params),
                     max_shard_bytes=limit)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and sorted(index["weight_map"]) == sorted(tensors)
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    from safetensors.numpy import load_file
    for f in files:
        shard = load_file(tmp_path / "out" / f)
        assert sum(v.nbytes for v in shard.values()) <= limit
        for name, value in shard.items():
            np.testing.assert_array_equal(value, tensors[name])
    tokens = _tokens(40, (2, 8))
    _, got = _revtrain_logits(str(tmp_path / "out"), tokens)
    np.testing.assert_array_equal(got, _logits(model, tokens))
    write_checkpoint(str(tmp_path / "bf16"), model.llama_spec, tensors, dtype="bfloat16", max_shard_bytes=limit)
    half = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert half * 2 == index["metadata"]["total_size"]


def test_rope_parameters_of_transformers_5(tmp_path):
    """transformers 5 writes the rotary base inside ``rope_parameters`` (no top-level ``rope_theta``): the
    import reads it there (the same logits as the top-level form)."""
    _write_small(tmp_path / "v4", rope_theta=5000.0)
    _write_small(tmp_path / "v5")
    cfg = json.loads((tmp_path / "v4" / "config.json").read_text())
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
    (tmp_path / "v5" / "config.json").write_text(json.dumps(cfg))
    import shutil
    shutil.copyfile(tmp_path / "v4" / "model.safetensors", tmp_path / "v5" / "model.safetensors")
    assert read_spec(str(tmp_path / "v5")).rope_theta == 5000.0
    tokens = _tokens(40, (2, 8))
    np.testing.assert_array_equal(_revtrain_logits(str(tmp_path / "v5"), tokens)[1],
                                  _revtrain_logits(str(tmp_path / "v4"), tokens)[1])


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling 'linear' is not implemented"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "rope_parameters 'yarn' is not implemented"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"head_dim": 16}, "head_dim 16"),
    ({"intermediate_size": 64}, r"gate_proj.weight has shape \(48, 32\), expected \(64, 32\)"),
    ({"tie_word_embeddings": False, "num_hidden_layers": 3}, "missing"),
])
def test_unrepresentable_checkpoints_are_refused(tmp_path, change, message):
    """Another architecture, rope scaling, biases, another activation or head width, a shape mismatch or a
    missing tensor: LlamaFormatError naming it."""
    _write_small(tmp_path, **change)
    with pytest.raises(LlamaFormatError, match=message):
        LlamaModel(str(tmp_path), sequence_length=8)


def test_missing_files_and_bad_settings(tmp_path):
    """No directory, no config.json, no weights, a missing tensor; bad LlamaModel knob values."""
    with pytest.raises(LlamaFormatError, match="is not a directory .*if the checkpoint moved, add --gin"):
        LlamaModel(str(tmp_path / "nope"))
    with pytest.raises(LlamaFormatError, match="no config.json"):
        LlamaModel(str(tmp_path))
    _write_small(tmp_path / "c")
    os.remove(tmp_path / "c" / "model.safetensors")
    with pytest.raises(LlamaFormatError, match="no model.safetensors"):
        LlamaModel(str(tmp_path / "c"))
    model = _write_small(tmp_path / "d")
    tensors = model_tensors(model, model.init()[0])
    del tensors["model.layers.1.mlp.up_proj.weight"]
    from safetensors.numpy import save_file
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(LlamaFormatError, match="model.layers.1.mlp.up_proj.weight is missing"):
        LlamaModel(str(tmp_path / "d"))
    for knob, value, message in (("form", "bdia", "LlamaModel.form"), ("compute_dtype", "float16", "compute_dtype"),
                                 ("grid_bits", 0, "grid_bits"), ("gamma", 0.3, "LlamaModel.gamma must be 2..-j"),
                                 ("gamma", 1.0, "gamma"), ("gamma", True, "gamma"), ("num_layers", 0, "num_layers"),
                                 ("d_model", 30, "not divisible"), ("num_kv_heads", 3, "not divisible"),
                                 ("chunk", 0, "chunk"), ("path", 3, "LlamaModel.path")):
        with pytest.raises(LlamaFormatError if knob != "chunk" else ValueError, match=message):
            LlamaModel(**{knob: value, "sequence_length": 8})


def test_byte_task_refuses_a_checkpoint_of_fewer_than_256_ids(tmp_path):
    """`revtrain train` of a 40-id checkpoint on the byte-level task: one line, exit 2, before anything is
    written (not a non-finite loss at step 1)."""
    _write_small(tmp_path / "ckpt")
    r = subprocess.run([sys.executable, "-m", "revtrain", "train", "--config", "configs/finetune_python.gin",
                        "--gin", f"LlamaModel.path = '{tmp_path / 'ckpt'}'", "--workdir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "the model has 40 ids but ByteLMTask feeds byte values 0-255" in r.stderr
    assert not os.path.exists(tmp_path / "run")


def test_cli_export_errors_are_one_line(tmp_path):
    """`revtrain export` on a directory that is no workdir, and without --to: exit 2, one line."""
    for args, message in ((["--workdir", str(tmp_path), "--to", str(tmp_path / "o")], "no config.gin"),
                          (["--workdir", str(tmp_path)], "--to")):
        r = subprocess.run([sys.executable, "-m", "revtrain", "export", *args], capture_output=True, text=True)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and message in r.stderr and r.stderr.startswith("revtrain: error:")
    assert not os.path.exists(tmp_path / "o")
