"""Config values as users write them: `--set train.lr=1e-3` and `lr: 3e-4` in a YAML file are
floats, although YAML 1.1 (PyYAML) reads an exponent without a dot as a string."""

from __future__ import annotations

import pytest

from dyad import config as config_lib


@pytest.mark.parametrize(
    "text,value", [("1e-3", 1e-3), ("3E-4", 3e-4), ("+2e2", 200.0), ("2.5e-4", 2.5e-4), ("1.", 1.0)]
)
def test_exponents_are_floats(text, value):
    assert config_lib.load(None, [f"train.lr={text}"]).train.lr == value


def test_exponents_in_a_config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 3e-4\n  steps: 7\n")
    config = config_lib.load(str(path), [])
    assert config.train.lr == 3e-4 and config.train.steps == 7


@pytest.mark.parametrize(
    "override,message", [("train.lr=abc", "train.lr must be float"), ("train.steps=1e3", "train.steps must be int")]
)
def test_what_is_not_a_number_still_names_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        config_lib.load(None, [override])


def test_relative_paths_are_made_absolute_against_a_base_and_others_kept():
    config = config_lib.load(None, ["data.name=jsonl", "data.path=data/x.jsonl", "out_dir=out",
                                    "checkpoint.resume_from=/runs/a"])
    absolute = config_lib.with_absolute_paths(config, "/home/user")
    assert (absolute.out_dir, absolute.data.path, absolute.data.tokenizer, absolute.checkpoint.resume_from) == (
        "/home/user/out", "/home/user/data/x.jsonl", None, "/runs/a")
    assert absolute.train == config.train
