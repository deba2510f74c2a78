"""A pool service built without initial weights (`PoolService(initialize=False)`, for a worker the
router told that its generation restores a checkpoint) must restore one before it trains."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dyad.encoder_service.worker import EncoderWorker
from dyad.wire import pb


def _service_awaiting_a_restore(restored: list) -> EncoderWorker:
    service = object.__new__(EncoderWorker)  # only its setup is under test
    service.run_secret, service.awaits_restore = b"s", True
    service.transport = SimpleNamespace(authorize=lambda secret, addresses: None)
    service.restore = lambda path: restored.append(path) or 6
    return service


def test_a_service_built_without_initial_weights_refuses_a_setup_that_restores_nothing():
    restored = []
    service = _service_awaiting_a_restore(restored)
    with pytest.raises(RuntimeError, match="built without initial weights .* the setup names none"):
        service.setup(pb.SetupCommand(generation=2))
    assert service.setup(pb.SetupCommand(generation=2, restore_path="ckpt")).restored_step == 6
    assert restored == ["ckpt"] and not service.awaits_restore
    assert service.setup(pb.SetupCommand(generation=3)).restored_step == -1  # later generations may not
