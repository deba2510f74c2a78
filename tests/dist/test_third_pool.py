"""A third pool type, registered by a test (tests/helpers/audio_pool.py) the way a service package
declares one: the run config gets its section and layout, the CLI and the router's checkpoint
catalog list it, and the shared worker runtime builds, parallelizes, steps, saves and restores it
without a line of shared code naming it."""

from __future__ import annotations

import pickle

import pytest
import torch

from dyad import config as config_lib
from dyad.app.cli import _parser
from dyad.optim import apply_update, build_optimizer
from dyad.pools import pool_names, pool_on_wire, pool_type, register, unregister
from dyad.router.checkpoints import checkpoint_dir, commit
from dyad.router.sampler import Cursor
from dyad.service import build_model
from dyad.wire import pb
from tests.helpers.audio_pool import AUDIO, WIRE_ID, AudioConfig, AudioService, clip_loss, clips
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_tensors_close


@pytest.fixture
def audio_pool():
    register(AUDIO)
    yield AUDIO
    unregister(AUDIO.name)


def _config(*overrides: str):
    return config_lib.resolve(config_lib.load(None, ["train.global_batch=8", *overrides]), vocab_size=32)


def test_the_run_config_gets_the_pools_section_and_layout(audio_pool):
    config = _config("audio.frames=6", "parallel.audio.dp=2", "train.recompute=[audio]")
    assert pool_names() == ("encoder", "llm", "audio")
    assert isinstance(config.audio, AudioConfig) and config.audio.frames == 6
    assert config.audio.out_dim == config.llm.dim  # derived by its own resolve
    assert config.parallel.audio.world_size == 2 and config.parallel.audio_devices == ()
    assert config_lib.from_yaml(config_lib.to_yaml(config)) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert config_lib.scaled(config, "audio", 3).parallel.audio.dp == 3
    with pytest.raises(ValueError, match=r"audio\.frames \(0\) must be >= 1"):
        _config("audio.frames=0")
    with pytest.raises(ValueError, match="parallel.audio.dp must be a positive integer"):
        _config("parallel.audio.dp=0")


def test_without_its_registration_the_section_is_unknown():
    assert "audio" not in pool_names()
    with pytest.raises(ValueError, match="unknown config field 'audio'"):
        _config("audio.frames=6")
    with pytest.raises(ValueError, match="unknown pool 'audio'"):
        pool_type("audio")


def test_the_wire_the_cli_and_the_checkpoint_catalog_know_it(audio_pool, tmp_path):
    assert pool_on_wire(WIRE_ID) is AUDIO
    assert pb.WorkerId(pool=WIRE_ID, rank=1).pool == WIRE_ID  # an open enum carries it
    assert _parser().parse_args(["worker", "--pool", "audio"]).pool == "audio"
    assert _parser().parse_args(["scale", "audio", "2"]).pool == "audio"
    step = checkpoint_dir(tmp_path, 3)
    for pool in ("encoder", "llm"):
        (step / pool).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="no checkpoint from pool.s. audio"):  # its part is missing
        commit(step, run_id="run", step=3, cursor=Cursor(epoch=0, offset=0), layouts={})


def _two_ranks(rank, world_size, path):
    register(AUDIO)
    config = _config("parallel.audio.dp=2")
    service = pool_type("audio").service_class()(config, None, rank, "run")
    assert isinstance(service, AudioService)
    result = service.step(pb.StepCommand(step=1, lr=1e-2))
    service.apply(pb.ApplyCommand(step=1, grad_scale=0.5))

    # The same step in one process on the whole batch, from the same initial weights.
    reference = build_model(config, "audio")
    optimizer = build_optimizer(reference, config.train)
    clip_loss(reference, clips(config, 1), config.train.global_batch).backward()
    expected_sq_norm = sum(float(p.grad.double().square().sum()) for p in reference.parameters())
    apply_update(optimizer, lr=1e-2, grad_scale=0.5)
    if rank == 0:
        assert result.grad_sq_norm == pytest.approx(expected_sq_norm, rel=1e-5)
    assert_tensors_close(dict(service.model.named_parameters()), dict(reference.named_parameters()), "parameters")

    service.save(pb.SaveCommand(path=path, step=1, sync_files=False))
    restored = pool_type("audio").service_class()(config, None, rank, "run", initialize=False)
    assert restored.restore(path) == 1
    for (name, param), (_, saved) in zip(restored.model.named_parameters(), service.model.named_parameters()):
        assert torch.equal(param, saved), name


def test_the_shared_runtime_steps_saves_and_restores_it_on_two_ranks(tmp_path):
    run_distributed(_two_ranks, 2, str(tmp_path / "step_1"))
