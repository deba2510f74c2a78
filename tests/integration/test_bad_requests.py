"""A bad StartRun is answered INVALID_ARGUMENT with a short message naming the field (or the
dataset's file and line), whatever it costs to read it, and starts no run."""

from __future__ import annotations

import json

import grpc
import pytest
from PIL import Image

from dyad.router.errors import MAX_DETAILS_BYTES
from tests.helpers.launchers import NoWorkers
from tests.helpers.resilience import in_process_router
from tests.unit.test_config_limits import alias_bomb, nested


@pytest.fixture
def router():
    with in_process_router(launcher_factory=NoWorkers) as (client, state):
        yield client, state


def _jsonl_with_a_latin1_caption(tmp_path) -> str:
    Image.new("L", (4, 4), 0).save(tmp_path / "a.png")
    good = json.dumps({"images": ["a.png"], "caption": "a black square"}).encode()
    bad = b'{"images": ["a.png"], "caption": "caf\xe9 au lait"}'
    path = tmp_path / "data.jsonl"
    path.write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
    return f"data: {{name: jsonl, path: {path}}}\n"


@pytest.mark.parametrize(
    "config_yaml, named",
    [
        ("train: {dtype: " + "x" * 20_000 + "}\n", "train.dtype"),  # echoed whole by its check
        ("train: {lr: " + "x" * 20_000 + "}\n", "train.lr"),
        ("train: {lr: " + nested(10_000) + "}\n", "nest more than"),
        (alias_bomb(), "alias"),
        ("train: {lr: .inf}\n", "train.lr"),
        ("seed: 1180591620717411303424\n", "seed"),
        ("data: {image_size: 100000}\n", "data.image_size"),
        (_jsonl_with_a_latin1_caption, "data.jsonl:2: not UTF-8"),
    ],
    ids=["long echoed value", "long value", "deep nesting", "alias bomb", "infinite lr", "huge seed",
         "huge image", "non-UTF-8 caption"],
)
def test_a_bad_config_is_an_invalid_argument_naming_the_field(router, tmp_path, config_yaml, named):
    client, state = router
    if callable(config_yaml):
        config_yaml = config_yaml(tmp_path)
    with pytest.raises(grpc.RpcError) as raised:
        client.start_run(f"out_dir: {tmp_path / 'run'}\n{config_yaml}")
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert named in error.details()
    assert len(error.details().encode()) <= MAX_DETAILS_BYTES
    assert state.active_run_ids() == [] and client.active_run_id() == ""
