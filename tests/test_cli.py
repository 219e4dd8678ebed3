"""End-to-end tests of the `revtrain` command line on the real English-Wikipedia excerpt.

The module's training run is a real ``revtrain`` process; the commands on its workdir (eval, sample) run in this
process (`helpers.revtrain_here`: `cli.main`, as the console script calls it), which saves each an interpreter
and JAX's start-up."""

import json
import shutil
import subprocess

import pytest

from helpers import CONFIG, REPO, records, revtrain, revtrain_here

TINY = ["--gin", "ReversibleTransformerLM.num_layers = 2", "--gin", "ReversibleTransformerLM.d_model = 32",
        "--gin", "train.batch_size = 8", "--gin", "evaluate.max_batches = 4", "--gin", "train.log_every = 5",
        "--gin", "WARMUP = 5", "--gin", "train.sample_every = 0"]  # end-of-run samples: tests/test_sample.py


def assert_one_line_error(result, code=2, contains=""):
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("revtrain: error: ")
    assert "Traceback" not in result.stderr
    assert contains in lines[0], lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short real run from the CLI: 40 steps of the reversible trainer, relative --workdir."""
    base = tmp_path_factory.mktemp("cli")
    result = revtrain("train", "--config", CONFIG, *TINY, "--gin", "STEPS = 40", "--gin.train.checkpoint_every=20",
                      "--workdir", "run", cwd=base)
    assert result.returncode == 0, result.stderr
    return base / "run", result


def test_train_writes_every_output_and_loss_falls(trained):
    workdir, result = trained
    assert (workdir / "config.gin").read_text().count("ReversibleTransformerLM.num_layers = 2") == 1
    train = records(workdir)
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30, 35, 40]
    for r in train:
        for key in ("loss", "learning_rate", "steps_per_sec", "tokens_per_sec"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r)
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["20", "40"]
    evals = records(workdir, "eval")
    assert evals[-1]["step"] == 40 and 0 < evals[-1]["bits_per_byte"] < 8.0
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert lines[-1].startswith("step 40/40") and all("bpb" in line for line in lines), lines
    # (no ETA on the first line: its interval holds the compile; every later line has one)
    assert ["ETA" in line for line in lines] == [False] + [True] * (len(lines) - 1), lines


def test_eval_scores_latest_checkpoint(trained, capfd):
    workdir, _ = trained
    result = revtrain_here(capfd, "eval", "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr
    last = records(workdir, "eval")[-1]
    assert last["step"] == 40 and set(last) >= {"loss", "bits_per_byte", "accuracy"}
    assert abs(last["bits_per_byte"] * 0.6931471805599453 - last["loss"]) < 1e-9


def test_eval_name_keeps_the_runs_own_records(trained, capfd):
    """`eval --name other` with other data settings writes metrics/eval_other.jsonl (eval_other_test.jsonl with
    --split test) and leaves eval.jsonl as it was; a name with a path separator or one that would share a
    split's file is one line, exit 2."""
    workdir, _ = trained
    before = (workdir / "metrics" / "eval.jsonl").read_text()
    result = revtrain_here(capfd, "eval", "--workdir", str(workdir), "--name", "other",
                           "--gin", "evaluate.max_batches = 1")
    assert result.returncode == 0, result.stderr
    assert (workdir / "metrics" / "eval.jsonl").read_text() == before
    record = json.loads((workdir / "metrics" / "eval_other.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 40 and 0 < record["bits_per_byte"] < 8.0
    assert "(validation, metrics/eval_other.jsonl)" in result.stdout  # (the scores: the command's result)
    result = revtrain_here(capfd, "eval", "--workdir", str(workdir), "--name", "other", "--split", "test",
                           "--gin", "evaluate.max_batches = 1")
    assert result.returncode == 0, result.stderr
    assert (workdir / "metrics" / "eval_other_test.jsonl").is_file()
    assert len((workdir / "metrics" / "eval_other.jsonl").read_text().splitlines()) == 1
    for name, says in (("a/b", "--name must be"), ("x_test", "share a split")):
        assert_one_line_error(revtrain_here(capfd, "eval", "--workdir", str(workdir), "--name", name), 2, says)


def test_eval_and_sample_read_a_config_file_after_the_runs_own(trained, capfd, tmp_path):
    """`eval` and `sample` take --config: a gin file of settings read after the run's config.gin (here the
    scored batches and the sampling length's default), with --gin bindings after it."""
    workdir, _ = trained
    extra = tmp_path / "score.gin"
    extra.write_text("evaluate.max_batches = 1\n")
    result = revtrain_here(capfd, "eval", "--workdir", str(workdir), "--config", str(extra), "--name", "cfg")
    assert result.returncode == 0, result.stderr
    assert json.loads((workdir / "metrics" / "eval_cfg.jsonl").read_text().splitlines()[-1])["step"] == 40
    result = revtrain_here(capfd, "sample", "--workdir", str(workdir), "--config", str(extra), "--prompt", "The ",
                           "--length", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The ")
    missing = str(tmp_path / "none.gin")
    assert_one_line_error(revtrain_here(capfd, "eval", "--workdir", str(workdir), "--config", missing), 2,
                          "none.gin")


def test_synopses_show_config_and_the_exit_tables_agree():
    """README, docs/cli.md and `revtrain --help` show --config for eval, sample, check --workdir and export;
    README's exit-status table is docs/cli.md's (links aside)."""
    from revtrain import cli
    readme, reference = (REPO / "README.md").read_text(), (REPO / "docs" / "cli.md").read_text()
    parser = cli._parser()  # noqa: SLF001
    for text in (readme, reference, parser.format_help()):
        for command in ("revtrain eval", "revtrain sample", "revtrain check --workdir", "revtrain export"):
            lines = [line for line in text.splitlines()  # synopses (DIR), not examples (--workdir run)
                     if line.strip().startswith(command) and "--workdir DIR" in line]
            assert lines and all("[--config FILE ...]" in line for line in lines), (command, lines)
    sub = parser._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse keeps its subparsers there)
    for name in ("eval", "sample", "export", "check"):
        assert "--config" in sub[name].format_help(), name

    def table(text):
        rows = [line for line in text.splitlines() if line.startswith(("| 0 |", "| 1 |", "| 2 |", "| 128 + N |"))]
        return [row.replace("docs/", "") for row in rows]
    assert len(table(readme)) == 4 and table(readme) == table(reference)


@pytest.mark.parametrize("args, contains", [
    (["train", "--config", "missing.gin", "--workdir", "w"], "config file not found: missing.gin"),
    (["train", "--config", CONFIG, "--gin", "train.stepz = 3", "--workdir", "w"], "did you mean 'train.steps'"),
    (["train", "--config", CONFIG, "--gin", "Nope.x = 3", "--workdir", "w"], "No configurable matching 'Nope'"),
    (["train", "--config", CONFIG, "--gin", "train.steps = 0", "--workdir", "w"], "train.steps must be a positive"),
    (["train", "--config", CONFIG, "--gin", "train.batch_size = -4", "--workdir", "w"], "train.batch_size"),
    (["train", "--config", CONFIG, "--gin", "ByteLMTask.source = '/nonexistent/enwik8'", "--workdir", "w"],
     "/nonexistent/enwik8"),
    (["train", "--config", CONFIG, "--gin", "train.optimizer = @optax.chain()",
      "--gin", "optax.chain.transforms = [@optax.clip_by_global_norm(), @optax.adam()]",
      "--gin", "optax.clip_by_global_norm.max_norm = 1.0", "--gin", "optax.adam.learning_rate = 1e-3",
      "--workdir", "w"], "train.learning_rate is bound but train.optimizer is a ready optimizer"),
    (["train", "--config", CONFIG, "--gin", "train.microbatches = 0", "--workdir", "w"],
     "train.microbatches must be a positive integer, got 0"),
    (["train", "--config", CONFIG, "--gin", "train.microbatches = 3", "--workdir", "w"],
     "does not split into train.microbatches = 3 equal microbatches"),
    (["train", "--config", CONFIG, "--gin", "train.clip_global_norm = -1.0", "--workdir", "w"],
     "train.clip_global_norm must be a positive number"),
    (["train", "--config", CONFIG, "--gin", "train.clip_global_norm = 'yes'", "--workdir", "w"],
     "train.clip_global_norm must be a positive number"),
    (["train", "--config", str(REPO / "configs" / "enwik_modern.gin"), "--gin",
      "RMSNormLanguageModelHead.tie_embedding = 'yes'", "--workdir", "w"],
     "RMSNormLanguageModelHead.tie_embedding must be True or False, got 'yes'"),
    (["train", "--workdir", "w", "--bogus"], "unrecognized argument"),
    (["train", "--config", CONFIG, "--gin", "STEP = 5", "--workdir", "w"],
     "macro STEP is set but no binding uses %STEP (did you mean 'STEPS'?)"),
    (["train", "--workdir", "w"], "train needs --config FILE"),
    (["train", "--config", CONFIG, "--gin", "STEPS = 5", "--workdir", "w"], "raise STEPS or lower WARMUP"),
    (["train", "--config", str(REPO / "configs" / "enwik_composed.gin"), "--gin", "CausalSelfAttention.num_headz = 2",
      "--workdir", "w"], "did you mean 'CausalSelfAttention.num_heads'?"),
    (["train", "--config", str(REPO / "configs" / "enwik_composed.gin"), "--gin", "Coupling.g = @FeedForward()",
      "--workdir", "w"], "written without parentheses (@Name, not @Name())"),
    (["train", "--config", CONFIG, "--gin", "train.model = @ComposedModel",
      "--gin", "ComposedModel.layers = [@CausalSelfAtention]", "--workdir", "w"],
     "No configurable matching reference '@CausalSelfAtention'. (did you mean 'CausalSelfAttention'?)"),
    (["eval", "--workdir", "nowhere"], "no config.gin in nowhere: nowhere does not exist"),
    ([], "expected a command"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys, args, contains):
    """Config errors in this process (`cli.main`, as the console script calls it; a revtrain process per
    case would add its start-up to each); argument errors, a missing file and no command in a real process."""
    if args[:1] == ["train"] and "--config" in args and "missing.gin" not in args and "--bogus" not in args:
        from revtrain import cli
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        code = cli.main(list(args))
        err = capsys.readouterr().err
        result = subprocess.CompletedProcess(args, code, "", err)
    else:
        result = revtrain(*args, cwd=tmp_path)
    assert_one_line_error(result, 2, contains)
    assert not (tmp_path / "w").exists()


def test_every_error_class_has_one_of_the_two_exit_statuses():
    """Each exception class revtrain defines derives from `InputError` (exit 2) or `RunFailure` (exit 1), and
    the CLI's status comes from that base: a new error class cannot fall through to the generic message."""
    import importlib
    import inspect
    import pkgutil

    import revtrain
    from revtrain import cli
    from revtrain.errors import InputError, RunFailure

    classes = set()
    for info in pkgutil.walk_packages(revtrain.__path__, "revtrain."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        classes |= {c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, BaseException)
                    and c.__module__ == module.__name__ and c not in (InputError, RunFailure)}
    assert len(classes) >= 20
    for c in classes:
        assert issubclass(c, InputError) != issubclass(c, RunFailure), c
        try:
            error = c("first line\nsecond line")
        except TypeError:  # a class whose constructor takes other arguments
            continue
        assert cli._classify(error) == (2 if issubclass(c, InputError) else 1, "first line"), c
    assert cli._classify(KeyError("k"))[0] == 1 and "--verbose" in cli._classify(KeyError("k"))[1]


def test_readers_refuse_a_model_changed_on_top_of_the_run_in_one_line(trained, capfd):
    """A --gin that changes the model over the run's config.gin (here its width) is named as such by eval
    (exit 2), not reported as a damaged checkpoint."""
    workdir, _ = trained
    wider = ("--gin", "ReversibleTransformerLM.d_model = 48")
    result = revtrain_here(capfd, "eval", "--workdir", str(workdir), *wider)
    assert_one_line_error(result, 2, "was made by a different model")
    assert "damaged" not in result.stderr


@pytest.mark.slow  # make test-all (its eval sibling above in make test)
def test_check_refuses_a_model_changed_on_top_of_the_run_in_one_line(trained):
    """`revtrain check --workdir` with a --gin that changes the model: exit 2, one line, not 'damaged'."""
    workdir, _ = trained
    result = revtrain("check", "--workdir", str(workdir), "--gin", "ReversibleTransformerLM.d_model = 48")
    assert_one_line_error(result, 2, "was made by a different model")
    assert "damaged" not in result.stderr


def test_eval_of_missing_step_exits_2(trained, capfd):
    workdir, _ = trained
    result = revtrain_here(capfd, "eval", "--workdir", str(workdir), "--step", "7")
    assert_one_line_error(result, 2, "no checkpoint for step 7")


@pytest.mark.slow  # one more training process (after the module's run)
def test_resuming_on_another_device_count_says_so(trained, tmp_path):
    """A run saved on 1 device and resumed on 2 prints the device change beside the changed bindings."""
    workdir, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    result = revtrain("train", "--config", CONFIG, *TINY, "--gin", "STEPS = 41", "--workdir", copy, devices=2)
    assert result.returncode == 0, result.stderr
    assert ("devices changed since the checkpoint at step 40: 1 device(s) in 1 process(es) -> 2 device(s) in 1 "
            "process(es)") in result.stderr


@pytest.mark.parametrize("command", [["eval"], ["sample", "--prompt", "a"], ["export", "--to", "out"], ["check"]])
def test_a_macro_no_binding_uses_is_refused_by_every_workdir_command(tmp_path, monkeypatch, capsys, command):
    """``--gin 'STEP = 5'`` on a workdir's eval / sample / export / check: one line, exit 2, as for train
    (they accepted it silently before), and nothing is read or written."""
    from revtrain import cli
    workdir = tmp_path / "run"
    workdir.mkdir()
    shutil.copy(CONFIG, workdir / "config.gin")  # (a run's config.gin is a gin file of the same bindings)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = cli.main([command[0], "--workdir", str(workdir), *command[1:], "--gin", "STEP = 5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "macro STEP is set but no binding uses %STEP (did you mean 'STEPS'?)" in err[0], err
    assert sorted(p.name for p in workdir.iterdir()) == ["config.gin"] and not (tmp_path / "out").exists()
