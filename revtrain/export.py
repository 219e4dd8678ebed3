"""``revtrain export``: a run's checkpoint written as a Hugging Face checkpoint directory.

Design: the run's gin config (``DIR/config.gin``) rebuilds the model, the chosen checkpoint step is restored
as `revtrain sample` restores it, and the model's per-layer parameters are mapped back to the tensor names of
`revtrain.models.llama` (the inverse of the import, ``[out, in]`` projections) and written with the
``safetensors`` package as ``OUT/model.safetensors`` beside ``OUT/config.json`` (``LlamaForCausalLM``), so
that ``transformers`` (``LlamaForCausalLM.from_pretrained(OUT)``) loads it and generates, and `LlamaModel`
imports it again. Either form of a run exports the same standard model (the exact form's ``g = 0`` model).
A run that tokenizes (`revtrain.data.tasks.TokenLMTask` with a tokenizer file) gets its tokenizer written
beside the weights: ``tokenizer.json`` with a ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``
(so ``AutoTokenizer`` encodes exactly as the file does, with no tokens added), or a SentencePiece
``tokenizer.model``; a byte-level run writes none (its ids are byte values).

The directory is written beside its final name and renamed into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from revtrain.errors import InputError

DTYPES = ("float32", "bfloat16")
# The largest safetensors file an export writes; a larger model is written as shards listed in
# ``model.safetensors.index.json`` (the layout of Hugging Face's ``save_pretrained``), so export holds one
# shard's converted tensors at a time beside the weights.
MAX_SHARD_BYTES = 2 * 2**30


class ExportError(InputError, ValueError):
    """Export cannot proceed (a run of another model, an output that exists); one line, exit status 2."""


def _first(token_id):
    """An id of ``config.json`` (an int, a list of ints: several end ids, or None) -> its first int or None."""
    if isinstance(token_id, (list, tuple)):
        return int(token_id[0]) if token_id else None
    return None if token_id is None else int(token_id)


def _write_tokenizer(directory: str, tokenizer, model_config: dict | None = None) -> None:
    """Copies ``tokenizer`` (a `revtrain.data.tokenizer.Tokenizer`) into ``directory`` with its
    ``tokenizer_config.json`` (Hugging Face files); nothing for bytes.

    The special tokens named there (what ``AutoTokenizer`` reports as ``bos_token``, ``eos_token``,
    ``unk_token``, ``pad_token``) are the strings of ``model_config``'s ``bos_token_id`` / ``eos_token_id``
    (the first of a list) / ``pad_token_id`` (the exported ``config.json``, so the two files agree), the
    end-of-text token when the config names no end, and the tokenizer model's own unknown token."""
    if tokenizer is None or tokenizer.save(directory) is None or tokenizer.kind != "huggingface":
        return
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    ids = {k: _first((model_config or {}).get(f"{k}_id")) for k in ("bos_token", "eos_token", "pad_token")}
    if ids["eos_token"] is None:
        ids["eos_token"] = tokenizer.eot_id
    for name, i in ids.items():
        token = tokenizer.token_string(i) if i is not None and 0 <= i < tokenizer.vocab_size else None
        if token is not None:
            config[name] = token
    unk = tokenizer.unknown_token()
    if unk is not None:
        config["unk_token"] = unk
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def generation_config(config: dict) -> dict:
    """The ``generation_config.json`` of an exported ``config.json`` dict: its special token ids (those that
    are set), as ``transformers`` derives one from a model config (``_from_model_config``), so ``generate``
    starts and stops where the source checkpoint's did."""
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return {"_from_model_config": True, **ids}


def write_checkpoint(out: str, spec, tensors, dtype: str = "float32", tokenizer=None,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Writes ``out/config.json``, ``out/generation_config.json`` and the weights (and the tokenizer's files,
    when given): ``out/model.safetensors``, or, past ``max_shard_bytes``, shards
    ``model-0000K-of-0000N.safetensors`` listed in ``model.safetensors.index.json`` (``weight_map``), as
    ``transformers``' ``save_pretrained`` writes them. The special token ids are the source checkpoint's
    (``spec``), else the tokenizer's end-of-text id as ``eos_token_id``.

    Args:
      out: the directory to create (must not exist, or be empty).
      spec: the model's `revtrain.models.llama.LlamaSpec`.
      tensors: ``{name: float32 numpy array}`` (`revtrain.models.llama.model_tensors`) or an iterable of
        ``(name, array)`` pairs (`revtrain.models.llama.iter_model_tensors`: each converted and dropped as its
        shard is written).
      dtype: "float32" or "bfloat16", the dtype written (``torch_dtype`` in the config).
      tokenizer: the run's `revtrain.data.tokenizer.Tokenizer`, or None (a byte-level model).
      max_shard_bytes: the largest file written (bytes, in ``dtype``; a single larger tensor is a shard alone).

    Raises:
      ExportError: a bad dtype, or ``out`` exists and is not an empty directory.
    """
    import dataclasses

    import jax.numpy as jnp
    from safetensors.flax import save_file

    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    out = os.path.abspath(out)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ExportError(f"--to {out} exists and is not an empty directory")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ExportError(f"--to {out}: the directory {parent} does not exist")
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        config = dataclasses.replace(spec, torch_dtype=dtype).hf_config()
        if config["eos_token_id"] is None and tokenizer is not None and tokenizer.eot_id is not None:
            config["eos_token_id"] = int(tokenizer.eot_id)  # generate stops at the end-of-text id
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(generation_config(config), f, indent=2)
        target = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        shards, shard, shard_bytes, total = [], {}, 0, 0

        def write_shard():
            path = os.path.join(tmp, f".shard-{len(shards)}")
            save_file(shard, path, metadata={"format": "pt"})
            shards.append((path, list(shard)))
            shard.clear()

        for name, value in (tensors.items() if isinstance(tensors, dict) else tensors):
            array = jnp.asarray(value, jnp.float32).astype(target)
            nbytes = array.size * array.dtype.itemsize
            if shard and shard_bytes + nbytes > max_shard_bytes:
                write_shard()
                shard_bytes = 0
            shard[name] = array
            shard_bytes, total = shard_bytes + nbytes, total + nbytes
        if shard or not shards:
            write_shard()
        if len(shards) == 1:
            os.rename(shards[0][0], os.path.join(tmp, "model.safetensors"))
        else:
            weight_map = {}
            for k, (path, names) in enumerate(shards, 1):
                file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                os.rename(path, os.path.join(tmp, file))
                weight_map.update(dict.fromkeys(names, file))
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        _write_tokenizer(tmp, tokenizer, config)
        # The permissions of an ordinary directory and files (mkdtemp made the directory 0700; the umask
        # applies), so a shared upload or another user can read the checkpoint.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_workdir(workdir: str, out: str, step: int | None = None, dtype: str = "float32") -> int:
    """Exports a checkpoint of the run in ``workdir`` (its gin config already parsed) to ``out``.

    Returns:
      The exported step.

    Raises:
      ExportError: the run's model is not a `LlamaModel`, a bad dtype, or ``out`` exists.
      revtrain.checkpoint.CheckpointError: no checkpoints, or no such step.
      revtrain.errors.ConfigError: the run's config cannot be built.
    """
    from revtrain import checkpoint as ckpt_lib
    from revtrain import run as run_lib
    from revtrain.models.llama import iter_model_tensors
    from revtrain.schedule_free import evaluation_state, restores_optimizer_state

    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    out = os.path.abspath(out)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise ExportError(f"--to {out} exists and is not an empty directory")
    workdir = os.path.abspath(workdir)
    try:
        cfg = run_lib.TrainConfig()
    except (ValueError, TypeError) as e:
        raise run_lib.ConfigError(str(e).splitlines()[0]) from e
    if getattr(cfg.model, "__name__", "") != "LlamaModel":
        raise ExportError(f"the run in {workdir} trains {getattr(cfg.model, '__name__', cfg.model)}; export writes "
                          "Llama checkpoints (train.model = @LlamaModel)")
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
    try:
        checkpointer.chosen_step(step)
        run = run_lib.build(cfg, workdir)
        ts, chosen = checkpointer.restore_newest(run.trainer.abstract_state(), step,
                                                 optimizer_state=restores_optimizer_state(run.trainer),
                                                 files=True,  # a tier's own refs (e.g. layer files), unread
                                                 accept=run_lib.same_model(run, workdir))
    finally:
        checkpointer.close()
    ts = evaluation_state(run.trainer, ts)  # a schedule-free run exports its evaluation weights
    # Each layer's weights as numpy when its tensors are reached (as its tier reads them: `Tier.layer_weights`),
    # dropped once converted: the export holds one shard's tensors and one layer, not the model beside them.
    weights = run.trainer.residency.layer_weights(ts.params)
    write_checkpoint(out, run.model.llama_spec, iter_model_tensors(run.model, weights), dtype,
                     tokenizer=run.task.tokenizer)
    return chosen
