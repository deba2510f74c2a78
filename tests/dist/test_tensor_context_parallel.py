"""Tensor-parallel layers and context-parallel attention against their single-device originals
(gloo, spawned ranks, float32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dyad.llm_service.context_parallel import ContextParallelAttention, zigzag_positions
from dyad.llm_service.model import PredictedTargets
from dyad.llm_service.tensor_parallel import (
    VocabParallelEmbedding,
    VocabParallelPredictedTargets,
    vocab_parallel_cross_entropy_sum,
)
from dyad.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from dyad.sequence_shards import sequence_shard
from tests.helpers.distributed import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _world_group():
    return dist.new_group(list(range(dist.get_world_size())))


def _mlp_matches(rank, world_size):
    torch.manual_seed(0)
    up, down = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(5, 8, requires_grad=True)
    expected = down(F.gelu(up(x)))
    expected.square().sum().backward()

    group = _world_group()
    p_up, p_down = ColumnParallelLinear(up, group), RowParallelLinear(down, group)
    x_p = x.detach().clone().requires_grad_(True)
    y = p_down(F.gelu(p_up(x_p)))
    y.square().sum().backward()
    torch.testing.assert_close(y, expected, **TOL)
    torch.testing.assert_close(x_p.grad, x.grad, **TOL)
    rows = up.weight.grad.chunk(world_size, dim=0)[rank]
    torch.testing.assert_close(p_up.weight.grad, rows, **TOL)
    torch.testing.assert_close(p_up.bias.grad, up.bias.grad.chunk(world_size)[rank], **TOL)
    torch.testing.assert_close(p_down.weight.grad, down.weight.grad.chunk(world_size, dim=1)[rank], **TOL)
    torch.testing.assert_close(p_down.bias.grad, down.bias.grad, **TOL)


def _vocab_parallel_matches(rank, world_size):
    torch.manual_seed(1)
    vocab, dim = 10, 6  # 10 rows do not divide over 4 ranks: the last slice is padded
    embedding, output = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
    ids = torch.randint(0, vocab, (3, 7))
    targets = torch.randint(0, vocab, (3, 7))
    targets[0, :3] = -100
    logits = output(embedding(ids))
    expected = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum")
    expected.backward()

    group = _world_group()
    p_embedding, p_output = VocabParallelEmbedding(embedding, group), ColumnParallelLinear(output, group)
    local_logits = p_output(p_embedding(ids))
    loss = vocab_parallel_cross_entropy_sum(
        local_logits, targets, group, vocab_start=p_embedding.vocab_start, vocab_size=vocab
    )
    loss.backward()
    torch.testing.assert_close(loss, expected, **TOL)
    per_rank = p_embedding.weight.shape[0]
    start = rank * per_rank
    real = max(0, min(per_rank, vocab - start))
    torch.testing.assert_close(p_embedding.weight.grad[:real], embedding.weight.grad[start : start + real], **TOL)
    torch.testing.assert_close(p_output.weight.grad[:real], output.weight.grad[start : start + real], **TOL)
    assert torch.count_nonzero(p_output.weight.grad[real:]) == 0  # padding rows learn nothing

    # The argmax over the split vocabulary is torch.argmax's, the first of equal maxima
    # included: logits of a few distinct values tie across slices; padding never wins.
    tied = torch.randint(-2, 1, (3, 7, vocab)).float()
    tied[1] = -5.0  # a row of all-equal logits: index 0, whatever the padding holds
    padded = torch.cat([tied, torch.zeros(3, 7, per_rank * world_size - vocab)], dim=-1)
    argmax_targets = tied.argmax(dim=-1)
    argmax_targets[2, ::2] = (argmax_targets[2, ::2] + 1) % vocab  # some targets are not the argmax
    predicted = VocabParallelPredictedTargets(p_output, vocab)(padded[..., start : start + per_rank], argmax_targets)
    assert torch.equal(predicted, PredictedTargets()(tied, argmax_targets))
    assert predicted.sum() == 3 * 7 - 4


def _cp_attention_matches(rank, world_size, heads, kv_heads):
    torch.manual_seed(2)
    B, S, Dh = 2, sequence_shard(13, cp=world_size, tp=1, cp_rank=rank).padded_len, 4
    q = torch.randn(B, heads, S, Dh, requires_grad=True)
    k = torch.randn(B, kv_heads, S, Dh, requires_grad=True)
    v = torch.randn(B, kv_heads, S, Dh, requires_grad=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()

    positions = zigzag_positions(S, world_size, rank)
    local = [t.detach()[:, :, positions].clone().requires_grad_(True) for t in (q, k, v)]
    out = ContextParallelAttention(_world_group())(*local, positions)
    (out * upstream[:, :, positions]).sum().backward()
    torch.testing.assert_close(out, expected[:, :, positions], **TOL)
    for local_t, full_t in zip(local, (q, k, v)):
        torch.testing.assert_close(local_t.grad, full_t.grad[:, :, positions], **TOL)


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_then_row_parallel_mlp_matches_single_device(world_size):
    run_distributed(_mlp_matches, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy_match(world_size):
    run_distributed(_vocab_parallel_matches, world_size)


@pytest.mark.parametrize("world_size, heads, kv_heads", [(2, 4, 2), (4, 2, 2)])
def test_context_parallel_attention_is_exact(world_size, heads, kv_heads):
    run_distributed(_cp_attention_matches, world_size, heads, kv_heads)


def test_zigzag_shards_partition_the_sequence_and_balance_causal_work():
    S, cp = 24, 3
    shards = [zigzag_positions(S, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(S))
    work = [int((s + 1).sum()) for s in shards]  # keys each query attends to
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        zigzag_positions(10, 3, 0)
