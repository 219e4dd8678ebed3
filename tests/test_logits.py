"""`revtrain.logits` (issue 40): a trained run's logits from Python, with and without offload, tied or not,
equal to the run's own evaluation; bad ids are one line."""

import json
import math
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
MODERN = str(REPO / "configs" / "enwik_modern.gin")
GIN = ["NUM_LAYERS = 2", "D_MODEL = 32", "train.batch_size = 8", "train.log_every = 2", "evaluate.max_batches = 1",
       "evaluate.batch_size = 8", "STEPS = 3", "WARMUP = 1", "train.sample_every = 0", "train.checkpoint_every = 0"]


def _train(workdir, extra):
    from revtrain import cli
    args = ["train", "--config", MODERN, "--workdir", str(workdir)]
    for binding in GIN + extra:
        args += ["--gin", binding]
    assert cli.main(args) == 0


@pytest.mark.slow  # make test: the smoke test's evaluation of a trained run
@pytest.mark.parametrize("tie, offload", [(False, False), (True, True)])
def test_logits_of_a_trained_run_match_its_evaluation(tie, offload, tmp_path, byte_lm_data_dir, capsys, caplog):
    """The tied + offloaded run (host-memory weights: they failed under jit before) and a plain one (loaded
    with ``shard_state``, which once printed its summary line): the
    mean negative log-probability of the first evaluation batch equals ``eval.jsonl``'s loss within 1e-5,
    and the logits are those of the model's forward (greedy next bytes of a prefix agree position by
    position with the logits of the whole sequence)."""
    from revtrain import logits
    from revtrain.data import byte_lm
    workdir = tmp_path / "run"
    _train(workdir, [f"RMSNormLanguageModelHead.tie_embedding = {tie}", f"ReversibleTrainer.offload = {offload}"])
    import logging
    capsys.readouterr()
    for name in ("absl", "orbax"):  # as in a fresh Python session (the CLI run above silenced them for good)
        logging.getLogger(name).setLevel(logging.NOTSET)
    # Untied: loaded with sharded state too, silently (a library call prints no shard_state summary line and
    # no warnings of Orbax's read-only checkpoint manager, which reach stderr through absl).
    with caplog.at_level(logging.INFO):
        run = logits.load(str(workdir), bindings=[] if tie else ["ReversibleTrainer.shard_state = True"])
    assert capsys.readouterr().err == ""
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert logging.getLogger("absl").level == logging.NOTSET  # the level is restored
    assert run.step == 3 and run.vocab_size == 256 and run.sequence_length == 128
    builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 128, byte_lm_data_dir)
    from revtrain.data import pipeline
    batch = next(iter(pipeline.eval_batches(builder, split="validation", batch_size=8, max_batches=1)))
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # targets: the inputs shifted by one
    out = run.logits(inputs)
    assert out.shape == (8, 128, 256) and out.dtype == np.float32
    recorded = json.loads((workdir / "metrics" / "eval.jsonl").read_text().splitlines()[-1])["loss"]
    z = out.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    loss = -np.take_along_axis(logp, targets[..., None], -1).mean()
    assert abs(loss - recorded) <= 1e-5 * recorded, (loss, recorded)
    np.testing.assert_allclose(run.logits(inputs[:1, :40])[0], out[0, :40], rtol=0, atol=1e-5)
    lp = run.log_probs(inputs[:2, :10])
    np.testing.assert_allclose(lp, np.take_along_axis(logp[:2, :9], inputs[:2, 1:10, None], -1)[..., 0], atol=1e-5)
    assert math.isfinite(float(lp.sum()))


def test_bad_input_is_one_line(tmp_path):
    from revtrain import logits
    from revtrain.errors import ConfigError
    with pytest.raises(ConfigError, match="no config.gin in"):
        logits.load(str(tmp_path))
    run = logits.LoadedRun(str(tmp_path), 0, None, [], [], sequence_length=4, vocab_size=10)
    for tokens, message in [(np.zeros((1, 5), int), "more than the model's sequence length 4"),
                            (np.array([[3, 10]]), r"must be in \[0, 10\)"),
                            (np.zeros((1, 2), np.float32), "non-empty integer array"),
                            (np.zeros(2, np.float32), r"got dtype float32 shape \(2,\)")]:
        with pytest.raises(logits.LogitsError, match=message):
            run.logits(tokens)
    with pytest.raises(logits.LogitsError, match="at least two tokens"):
        run.log_probs([3])
