"""Where a config's paths point (loom/config_paths.py): the file's input paths from its own folder, so it runs
from any directory; the same keys given on the command line from the current directory."""

from __future__ import annotations

import os

from conftest import tiny_chat_tokenizer, write_user_data

from loom.config_paths import with_config_relative_paths
from loom.config import read_config
from loom.job import load_config

FILE_PATHS = """
[model]
tokenizer = "tok"
[model.language]
hf = "models/llm"
[model.vision]
hf = "models/vision"
[model.audio]
hf = "/abs/audio"
[data]
heldout = "data/held.jsonl"
[[data.sources]]
path = "data/a.jsonl"
[[data.sources]]
path = "../elsewhere/b.jsonl"
[run]
out_dir = "runs/x"
"""


def test_the_file_s_paths_are_relative_to_its_folder_and_overrides_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "recipes").mkdir()
    config = tmp_path / "recipes" / "job.toml"
    config.write_text(FILE_PATHS)
    monkeypatch.chdir(tmp_path)
    overrides = ["--model.vision.hf=mine/vision", "--data.heldout=mine/held.jsonl"]
    cfg = with_config_relative_paths(read_config("recipes/job.toml", overrides), "recipes/job.toml", overrides)
    here, there = str(tmp_path), str(tmp_path / "recipes")
    assert cfg.model.tokenizer == os.path.join(there, "tok")
    assert cfg.model.language.hf == os.path.join(there, "models", "llm")
    assert cfg.model.audio.hf == "/abs/audio"  # absolute: as written
    assert [s.path for s in cfg.data.sources] == [os.path.join(there, "data", "a.jsonl"),
                                                  os.path.join(here, "elsewhere", "b.jsonl")]
    assert cfg.model.vision.hf == "mine/vision" and cfg.data.heldout == "mine/held.jsonl"  # the command line's
    assert cfg.run.out_dir == "runs/x"  # outputs: where the caller runs


def test_a_config_beside_its_data_loads_from_any_directory(tmp_path, monkeypatch):
    write_user_data(tmp_path / "job" / "data")
    (tmp_path / "job" / "tok").mkdir()
    tiny_chat_tokenizer(tmp_path / "job" / "tok")
    (tmp_path / "job" / "job.toml").write_text(
        '[model]\ntokenizer = "tok"\n[[data.sources]]\npath = "data/data.jsonl"\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_config("../job/job.toml", ["--train.global_batch_size=4", "--data.heldout_size=4"])
    assert os.path.samefile(cfg.data.sources[0].path, tmp_path / "job" / "data" / "data.jsonl")
    assert os.path.samefile(cfg.model.tokenizer, tmp_path / "job" / "tok")
