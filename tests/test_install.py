"""revtrain as an installed command (issue 62), in this process: shipped configs found by name from any directory
(also by ``include`` and as the installed package lays them out), ``revtrain configs`` listing every one of them
with its model's true parameter count, and a run's missing data fetched or refused in one line.

The built wheel itself (installed into a fresh venv, trained from an empty directory with an empty data cache) is
checked by ``.ci/run``."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import gin
import pytest

from helpers import REPO, revtrain
from revtrain import cli, ginconfig, registry
from revtrain.data import byte_lm, corpus

SHIPPED = sorted([p.name for p in (REPO / "configs").glob("*.gin")]
                 + [f"{d.name}/{p.name}" for d in (REPO / "examples").iterdir() if d.is_dir() for p in d.glob("*.gin")])
CACHED_WHEELS = pathlib.Path(byte_lm.default_data_dir()) / "downloads"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A current directory that is not the checkout and has no configs/."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_shipped_configs_are_every_file_of_configs_and_examples():
    assert SHIPPED and "enwik_modern.gin" in SHIPPED and "own_block/train.gin" in SHIPPED
    assert list(ginconfig.shipped_configs()) == SHIPPED
    assert ginconfig.shipped_configs()["own_block/train.gin"] == str(REPO / "examples" / "own_block" / "train.gin")


def test_config_by_name_from_another_directory(elsewhere):
    assert ginconfig.find_config("enwik_modern.gin") == str(REPO / "configs" / "enwik_modern.gin")
    registry.parse_gin(["enwik_modern.gin"], ["NUM_LAYERS = 3"])
    try:
        assert gin.query_parameter("block/Repeat.count").scoped_selector == "NUM_LAYERS/gin.macro"
        assert gin.query_parameter("%NUM_LAYERS") == 3 and gin.query_parameter("%STEPS") == 400
        assert gin.query_parameter("ByteLMTask.source") == "gensim_enwiki"  # from the included enwik_small.gin
    finally:
        gin.clear_config()
    # The current directory and its configs/ come first: a file of the same name there wins.
    (elsewhere / "enwik_modern.gin").write_text("STEPS = 1\n")
    assert ginconfig.find_config("enwik_modern.gin") == str(elsewhere / "enwik_modern.gin")
    with pytest.raises(ginconfig.IncludeNotFound, match=r"config file not found: nope\.gin \(searched .*"
                                                        + str(REPO / "configs")):
        ginconfig.find_config("nope.gin")


def test_include_of_a_shipped_config(elsewhere, tmp_path):
    mine = tmp_path / "mine" / "short.gin"
    mine.parent.mkdir()
    mine.write_text("include 'enwik_small.gin'\nSTEPS = 7\n")
    registry.parse_gin([str(mine)], [])
    try:
        assert gin.query_parameter("%STEPS") == 7 and gin.query_parameter("ReversibleTransformerLM.d_model") == 128
    finally:
        gin.clear_config()


def test_installed_layout(elsewhere, tmp_path, monkeypatch):
    """As setup.py lays them out in the wheel (revtrain/configs/*.gin, revtrain/configs/own_block/): names,
    includes and the example's own module resolve there, and the checkout's directories are not read. (The
    module is not imported here: gin keeps what it registers for the rest of the process.)"""
    package = tmp_path / "site" / "revtrain" / "configs"
    shutil.copytree(REPO / "configs", package)
    shutil.copytree(REPO / "examples" / "own_block", package / "own_block")
    monkeypatch.setattr(ginconfig, "PACKAGE_CONFIGS", str(package))
    monkeypatch.setattr(ginconfig, "PROJECT_CONFIGS", str(tmp_path / "no_checkout" / "configs"))
    assert ginconfig.shipped_config_dirs() == [str(package)]
    assert list(ginconfig.shipped_configs()) == SHIPPED
    assert ginconfig.find_config("enwik_small.gin") == str(package / "enwik_small.gin")
    example = ginconfig.find_config("own_block/train.gin")
    assert example == str(package / "own_block" / "train.gin")
    # own_block/train.gin includes enwik_composed.gin (the directory above its own) and imports my_blocks.
    assert ginconfig.find_config("enwik_composed.gin", example) == str(package / "enwik_composed.gin")
    monkeypatch.setattr(sys, "path", list(sys.path))
    ginconfig.resolve_import("my_blocks", example)
    assert sys.path[0] == str(package / "own_block")


def test_configs_command_lists_every_shipped_config(tmp_path):
    """One line per shipped config: name, model, parameters, purpose (its ``# For:`` line). The counts agree
    with the figures measured on real runs (docs/modern.md, docs/memory.md)."""
    result = revtrain("configs", cwd=tmp_path)  # a process of its own: the example's module registers with gin
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == SHIPPED, result.stdout
    assert result.stderr == ""
    by_name = {line.split()[0]: line for line in lines}
    known = {"enwik_modern.gin": "1,280,000", "enwik_small.gin": "1,302,784", "revvit_fashion_mnist.gin": "241,610",
             "llama_1b.gin": "1,444,022,272"}
    for name, count in known.items():
        assert f" {count} parameters  " in by_name[name], by_name[name]
    assert "ComposedModel (8 layers)" in by_name["enwik_modern.gin"]
    for name, line in by_name.items():
        assert " ? parameters" not in line, line
        path = ginconfig.shipped_configs()[name]
        first = pathlib.Path(path).read_text().splitlines()[0]
        assert first.startswith("# For: ") and line.endswith(first[len("# For: "):]), (name, first)


def test_missing_data_is_fetched_or_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """With an empty data cache: outside the commands, one line naming ``revtrain prepare``; a command whose
    fetch fails (no package index here: PIP_NO_INDEX), one line naming the run's own ``revtrain prepare`` and
    nothing written; a fetch that works (pip's own download, from the cached wheel as its only index), one
    line saying what it fetched, then the data prepared."""
    monkeypatch.setenv("REVTRAIN_DATA_DIR", str(tmp_path / "data"))
    index = tmp_path / "index"  # pip's only place to look (the machine's pip config files are not read)
    index.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    with pytest.raises(corpus.DataError, match=r"wheel not found in .*; run `revtrain prepare --config FILE`"):
        byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 4096, str(tmp_path / "data"))

    run = tmp_path / "run"
    assert cli.main(["train", "--config", "enwik_modern.gin", "--workdir", str(run), "--gin", "STEPS = 2",
                     "--gin", "WARMUP = 1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("revtrain: error: could not download gensim==4.4.0 with pip into "
                             f"{tmp_path / 'data' / 'downloads'} ("), err
    assert "run `revtrain prepare --config enwik_modern.gin` where pip can reach a package index" in err[0], err
    assert not run.exists() and not list((tmp_path / "data" / "downloads").iterdir())

    wheels = sorted(CACHED_WHEELS.glob(f"gensim-{corpus.GENSIM_VERSION}-*.whl"))
    if not wheels:
        pytest.skip(f"no cached gensim wheel in {CACHED_WHEELS} to fetch from")
    shutil.copy(wheels[0], index)
    with corpus.fetching("revtrain prepare --config x.gin"):  # as every command runs (cli._run)
        builder = byte_lm.load_byte_lm(byte_lm.GENSIM_SOURCE, 4096, str(tmp_path / "data"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fetched the gensim {corpus.GENSIM_VERSION} wheel that holds the "
                                               "gensim_enwiki corpus with pip (27.8 MB in "), err
    assert err[0].endswith(f" s) into {tmp_path / 'data' / 'downloads'}"), err
    assert builder.data_prepared and builder.data_status.startswith(
        "prepared the byte data of gensim_enwiki: 6,089,746 bytes, 1,338 / 74 / 74 sequences of 4096 bytes")
    assert [p.name for p in (tmp_path / "data" / "downloads").iterdir() if p.suffix == ".whl"] == [wheels[0].name]
