"""The LLM's microbatch, from the collated CPU batch to the end of its backward pass, never makes
the host wait for the GPU: its index work runs on the CPU, its inputs reach the device through
`to_device`, and its losses stay on the device until the step reads their sums. A host sync there
would let the GPU run dry while the host prepares and launches (docs/performance.md)."""

from __future__ import annotations

import pytest
import torch

from dyad import config as config_lib
from dyad.data import FixedTokens, make_dataset
from dyad.data.batch import collate
from dyad.kernels.host_to_device import to_device
from dyad.llm_service.sharding import shard_microbatch
from dyad.llm_service.step import microbatch_loss
from dyad.service import build_model, compute_context

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: host syncs exist only against a GPU's queue",
)


def test_to_device_keeps_values_and_leaves_none_alone():
    t = torch.arange(6).view(2, 3)
    assert to_device(t, None) is t
    moved = to_device(t, "cpu")
    assert moved.device.type == "cpu" and torch.equal(moved, t)


def _config_and_batch(device: str):
    overrides = [
        f"train.device={device}", "train.dtype=bfloat16", "data.multi_image_fraction=0.3",
        "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.num_experts=8", "llm.moe.top_k=2",
        "llm.moe.expert_dim=32", "llm.dense_ffn_dim=64",
    ]
    config = config_lib.load(None, overrides)
    dataset = make_dataset(config.data)
    config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    samples = [dataset.sample(s) for s in dataset.train_ids[:4]]
    batch = collate(dataset.tokenizer, samples, FixedTokens(config.encoder.tokens_per_image))
    assert batch.image_ids, "the check needs image rows to splice"
    return config, dataset, batch


@needs_cuda
@pytest.mark.parametrize("cp, cp_rank", [(1, 0), (2, 1)])
def test_a_shard_moved_to_the_device_equals_one_made_there(cp, cp_rank):
    _, dataset, batch = _config_and_batch("cuda")
    kwargs = dict(pad_id=dataset.tokenizer.pad_id, cp=cp, cp_rank=cp_rank, tp=1)
    moved = shard_microbatch(batch, **kwargs).to("cuda")
    direct = shard_microbatch(batch.to("cuda"), **kwargs)
    for name in moved.__dataclass_fields__:
        assert getattr(moved, name).is_cuda, name
        assert torch.equal(getattr(moved, name), getattr(direct, name)), name


@needs_cuda
def test_an_llm_microbatch_runs_forward_and_backward_without_a_host_sync():
    config, dataset, batch = _config_and_batch("cuda")
    model = build_model(config, "llm", device="cuda")
    rows = torch.randn(batch.image_positions.numel(), config.llm.dim, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):  # the detector works: a blocking copy syncs
            batch.input_ids.to("cuda")
        local = shard_microbatch(batch, pad_id=dataset.tokenizer.pad_id, cp=1, cp_rank=0, tp=1)
        rows_NlD = rows[to_device(local.image_rows_Nl, "cuda")].requires_grad_(True)
        local = local.to("cuda")
        with compute_context(config):
            loss = microbatch_loss(
                model, local, rows_NlD, global_target_tokens=batch.n_targets, global_microbatches=1
            )
        loss.total.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(loss.lm) > 0 and rows_NlD.grad is not None
