"""The single-process reference that every layout is checked against (`dyad verify`, the parity
tests) is ordinary training: here it is checked against a step written with plain PyTorch and
none of dyad's training helpers — the whole global batch in one forward pass, mean cross-entropy
over caption tokens, `clip_grad_norm_` over both models, stock AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dyad import config as config_lib
from dyad.app.reference import ReferenceTrainer
from dyad.app.verify import relative_error, tensor_relative_error
from dyad.data import FixedTokens, make_dataset
from dyad.data.batch import collate
from dyad.router.steps import StepPlanner
from dyad.service import build_model

TOLERANCE = 1e-5
STEPS = 3

CASES = {
    # Three microbatches accumulated against one full batch. The balance loss is a function of
    # each microbatch's routing statistics (it is averaged over microbatches by design), so it
    # is off here; the caption loss must be normalised by the global batch's caption tokens.
    "three-microbatches": ["train.microbatches=3", "llm.moe.aux_loss_coef=0"],
    # One microbatch with the balance loss on; a clipping norm that binds every step.
    "aux-loss-and-clipping": ["train.microbatches=1", "train.grad_clip=0.05"],
}


def _stock_adamw(model, train) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
    )


def _plain_step(encoder, llm, optimizers, dataset, config, sample_ids, lr) -> float:
    samples = [dataset.sample(s) for s in sample_ids]
    batch = collate(dataset.tokenizer, samples, FixedTokens(config.encoder.tokens_per_image))
    rows, positions = None, None
    if batch.image_ids:
        rows = encoder(dataset.images(list(batch.image_ids), device="cpu")).flatten(0, 1)
        positions = batch.image_positions
    S = batch.input_ids.shape[1]
    real_BS = torch.arange(S)[None, :] < batch.lengths[:, None]  # padding stays out of the routing statistics
    logits, aux = llm(batch.input_ids, rows, positions, valid_BS=real_BS)
    caption = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100)
    loss = caption + aux
    loss.backward()
    params = [*encoder.parameters(), *llm.parameters()]
    torch.nn.utils.clip_grad_norm_(params, config.train.grad_clip)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_is_ordinary_training(case):
    config = config_lib.load(None, ["train.global_batch=9", "train.warmup_steps=2", "train.device=cpu",
                                    "data.multi_image_fraction=0.3", "data.text_only_fraction=0.2",
                                    *CASES[case]])
    dataset = make_dataset(config.data)
    config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
    reference = ReferenceTrainer(config, dataset)
    encoder, llm = build_model(config, "encoder"), build_model(config, "llm")
    optimizers = [_stock_adamw(m, config.train) for m in (encoder, llm)]
    planner = StepPlanner(config, dataset)
    for step in range(STEPS):
        spec = planner.next(step)
        sample_ids = [s for microbatch in spec.microbatches for s in microbatch]
        assert len(spec.microbatches) == config.train.microbatches
        plain = _plain_step(encoder, llm, optimizers, dataset, config, sample_ids, spec.lr)
        expected = reference.step(step)["loss"]
        assert relative_error(expected, plain) <= TOLERANCE, (step, expected, plain)
    initial = {"encoder": build_model(config, "encoder"), "llm": build_model(config, "llm")}
    for pool, model, ref_model in (("encoder", encoder, reference.encoder), ("llm", llm, reference.llm)):
        ref_params = dict(ref_model.named_parameters())
        for name, param in model.named_parameters():
            assert not torch.equal(param, initial[pool].get_parameter(name)), f"{pool}.{name} never moved"
            assert tensor_relative_error(ref_params[name].detach(), param.detach()) <= TOLERANCE, f"{pool}.{name}"
