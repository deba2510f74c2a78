"""What a config or a dataset file may cost to refuse: aliases, nesting and size are bounded
before anything walks the values, every number is checked against its range, and a message
quotes a short form of the value it refuses."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from PIL import Image

from dyad import config as config_lib
from dyad.data import DataConfig, DatasetError, make_dataset

SHORT = 400  # characters: any refusal here names the field and a short form of the value


def alias_bomb(levels: int = 9) -> str:
    """~400 bytes that expand to 9**levels strings wherever the value is walked."""
    anchors = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels):
        anchors.append(f"&a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    return "seed: [" + ", ".join(anchors) + "]\n"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_an_alias_bomb_is_refused_before_it_expands():
    text = alias_bomb()
    assert len(text) < 500
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as raised:
            config_lib.from_yaml(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(raised.value)
    assert "alias" in message and len(message) < SHORT
    assert peak < 10 * 2**20


def test_an_alias_is_refused_even_where_it_would_be_harmless():
    with pytest.raises(ValueError, match="alias"):
        config_lib.from_yaml("train: &t {steps: 3}\ncheckpoint: *t\n")


def test_nesting_deeper_than_the_limit_is_a_value_error():
    with pytest.raises(ValueError, match="nest") as raised:
        config_lib.from_yaml(f"train: {{lr: {nested(10_000)}}}\n")
    assert len(str(raised.value)) < SHORT


def test_text_over_the_size_limit_is_refused_before_parsing():
    text = "[" * (config_lib.MAX_CONFIG_CHARS + 1)  # as YAML: unclosed, and far too deep
    with pytest.raises(ValueError, match="characters") as raised:
        config_lib.from_yaml(text)
    assert "YAML" not in str(raised.value)


@pytest.mark.parametrize(
    "assignment, match",
    [
        ("seed=" + alias_bomb().removeprefix("seed: ").strip(), "alias"),
        ("train.lr=" + nested(10_000), "nest"),
        ("train.lr=" + "1" * (config_lib.MAX_CONFIG_CHARS + 1), "characters"),
        ("train.lr=[1, 2", "train.lr"),
    ],
    ids=["alias bomb", "deep nesting", "oversize", "bad YAML"],
)
def test_overrides_go_through_the_same_loader(assignment, match):
    with pytest.raises(ValueError, match=match) as raised:
        config_lib.parse_override(assignment)
    assert len(str(raised.value)) < SHORT


@pytest.mark.parametrize(
    "assignment, field",
    [
        ("train.lr=.inf", "train.lr"),
        ("train.lr=1e999", "train.lr"),
        ("train.beta1=.nan", "train.beta1"),
        ("train.beta1=1", "train.beta1"),
        ("train.beta2=5", "train.beta2"),
        ("train.beta2=-0.1", "train.beta2"),
        ("train.weight_decay=.nan", "train.weight_decay"),
        ("train.weight_decay=-0.01", "train.weight_decay"),
        ("train.eps=-1", "train.eps"),
        ("train.eps=0", "train.eps"),
        ("train.grad_clip=.inf", "train.grad_clip"),
        ("seed=1180591620717411303424", "seed"),  # 2**70
        ("seed=-1", "seed"),
        ("llm.max_seq_len=9223372036854775808", "llm.max_seq_len"),  # 2**63
        ("llm.moe.capacity_factor=.inf", "llm.moe.capacity_factor"),
        pytest.param("llm.rope_theta=1" + "0" * 400, "llm.rope_theta", id="llm.rope_theta=10**400"),
        ("parallel.llm_devices=[9223372036854775808]", "parallel.llm_devices"),
        ("router.heartbeat_interval_s=.inf", "router.heartbeat_interval_s"),
        ("router.step_timeout_s=.nan", "router.step_timeout_s"),
        ("data.image_size=100000", "data.image_size"),
    ],
)
def test_nonsense_values_are_refused_naming_the_field(assignment, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as raised:
        config_lib.resolve(config_lib.load(None, [assignment]), vocab_size=30)
    assert len(str(raised.value)) < SHORT


@pytest.mark.parametrize(
    "assignment, field",
    [
        ("train.lr=" + "x" * 20_000, "train.lr"),
        ("out_dir=[" + "1, " * 10_000 + "1]", "out_dir"),
        ("train." + "y" * 20_000 + "=1", "train.yyy"),
    ],
    ids=["long string", "long list", "long key"],
)
def test_a_huge_value_is_quoted_short(assignment, field):
    with pytest.raises(ValueError, match=field) as raised:
        config_lib.load(None, [assignment])
    assert len(str(raised.value)) < SHORT


# --- a dataset file's bad lines -------------------------------------------------------------------


def _jsonl(tmp_path, bad_line: bytes) -> str:
    Image.new("L", (4, 4), 0).save(tmp_path / "a.png")
    good = json.dumps({"images": ["a.png"], "caption": "a black square"}).encode()
    path = tmp_path / "data.jsonl"
    path.write_bytes(good + b"\n" + bad_line + b"\n" + good + b"\n")
    return str(path)


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        (b'{"images": ["a.png"], "caption": "caf\xe9 au lait"}', "not UTF-8"),
        (b"[" * 100_000, "JSON nested too deeply"),
    ],
    ids=["latin-1 caption", "deep JSON"],
)
def test_a_bad_line_of_a_jsonl_dataset_is_named_by_file_and_line(tmp_path, bad_line, problem):
    path = _jsonl(tmp_path, bad_line)
    with pytest.raises(DatasetError) as raised:
        make_dataset(DataConfig(name="jsonl", path=path))
    assert f"{path}:2: {problem}" in str(raised.value)
    assert f"{path}:1:" not in str(raised.value) and f"{path}:3:" not in str(raised.value)
