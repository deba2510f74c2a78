"""Packed rows (several samples in one row, each attending only to itself, its rotary positions
restarting at 0) compute what the same samples compute one to a row, right-padded: each sample's
logits, the summed loss, the aux loss and every parameter gradient (float32, 1e-5 relative in the
max norm: the rows differ in padding, so sums run over other orders; the router computes in
float32 whatever the model's dtype)."""

from __future__ import annotations

import pytest
import torch

from dyad.kernels import varlen_attention as varlen
from dyad.llm_service.config import LLMConfig, MLAConfig, MoEConfig
from dyad.llm_service.model import MoELM
from tests.helpers.parity import relative_error

VOCAB = 50
LENGTHS = (5, 9, 7)
ROWS = ((0, 2), (1,))  # packed: samples 0 and 2 in row 0, sample 1 alone in row 1
CONFIGS = {
    "gqa": dict(n_heads=4, n_kv_heads=2, qk_norm="head", head_dim=8),
    "mla": dict(n_heads=4, n_kv_heads=4, attention="mla", mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8,
                                                                        qk_rope_head_dim=4, v_head_dim=8)),
}


def _model(kind: str, aux_loss: str) -> MoELM:
    torch.manual_seed(0)
    cfg = LLMConfig(vocab_size=VOCAB, dim=32, n_layers=2, dense_layers=(0,), dense_ffn_dim=48, max_seq_len=32,
                    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=24, aux_loss=aux_loss, aux_loss_coef=0.1),
                    **CONFIGS[kind])
    return MoELM(cfg)


def _samples():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]


def _rows(samples, rows):
    """(input_ids, targets, valid, documents, sample positions) of samples laid out in `rows`,
    right-padded to the longest row."""
    S = max(sum(len(samples[i]) for i in row) for row in rows)
    shape = (len(rows), S)
    ids, targets = torch.zeros(shape, dtype=torch.long), torch.full(shape, -100)
    documents, positions = torch.full(shape, -1), torch.zeros(shape, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(samples[i])
            ids[b, at : at + n] = samples[i]
            targets[b, at : at + n - 1] = samples[i][1:]
            documents[b, at : at + n], positions[b, at : at + n] = i, torch.arange(n)
            at += n
    return ids, targets, documents >= 0, documents, positions


def _run(model, samples, rows, packed: bool):
    model.zero_grad(set_to_none=True)
    ids, targets, valid, documents, positions = _rows(samples, rows)
    extra = dict(documents_BS=documents, sample_positions_BS=positions) if packed else {}
    logits, aux = model(ids, valid_BS=valid, **extra)
    loss = model.loss_sum(logits, targets) / int((targets != -100).sum()) + aux
    loss.backward()
    per_sample = {i: logits[b, (documents[b] == i)] for b, row in enumerate(rows) for i in row}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), aux.detach(), per_sample, grads


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize("aux_loss", ["micro_batch", "seq"])
def test_packed_rows_give_what_one_sample_a_row_gives(kind, aux_loss):
    model, samples = _model(kind, aux_loss), _samples()
    one_a_row = _run(model, samples, tuple((i,) for i in range(len(samples))), packed=False)
    packed = _run(model, samples, ROWS, packed=True)
    assert packed[1] > 0
    for what, a, b in (("loss", packed[0], one_a_row[0]), ("aux", packed[1], one_a_row[1])):
        assert relative_error(a, b, "max") <= 1e-5, what
    for i in range(len(samples)):
        assert relative_error(packed[2][i].detach(), one_a_row[2][i].detach(), "max") <= 1e-5, f"logits of sample {i}"
    for name, grad in one_a_row[3].items():
        assert relative_error(packed[3][name], grad, "max") <= 1e-5, name


def test_without_the_document_mask_packing_is_not_the_same():
    """The check above can fail: rows packed without documents let samples see each other."""
    model, samples = _model("gqa", "micro_batch"), _samples()
    one_a_row = _run(model, samples, tuple((i,) for i in range(len(samples))), packed=False)
    model.zero_grad(set_to_none=True)
    ids, targets, valid, documents, positions = _rows(samples, ROWS)
    logits, _ = model(ids, valid_BS=valid, sample_positions_BS=positions)
    later = logits[0, documents[0] == 2].detach()  # sample 2 follows sample 0 in row 0
    assert relative_error(later, one_a_row[2][2].detach(), "max") > 1e-3


def test_misshapen_packing_inputs_are_refused():
    model = _model("gqa", "micro_batch")
    ids = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="documents must have shape"):
        model(ids, documents_BS=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="sample_positions must have shape"):
        model(ids, sample_positions_BS=torch.zeros(6, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available() or varlen.varlen_attn is None,
                    reason="no CUDA device (or a torch without varlen_attn) here: the flash path is not exercised")
def test_packed_rows_flash_attention_matches_the_reference():
    """Packed rows on CUDA in bf16: flash attention's variable-length kernel, causal within each
    segment and grouped-query (8 query heads over 2 key heads), as the per-segment reference."""
    lengths = [100, 37, 200, 11, 164]
    q = torch.randn(sum(lengths), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    upstream = torch.randn_like(q)
    bounds = varlen.segment_bounds(lengths, "cuda")
    results = []
    for attend in (lambda q, k, v: varlen.varlen_attention(q, k, v, *bounds, causal=True),
                   lambda q, k, v: varlen.varlen_attention_reference(q, k, v, lengths, causal=True)):
        out = attend(q, k, v)
        results.append((out, *torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
