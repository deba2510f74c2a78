"""Single-process training of the same model on the same batches: the ground truth that every
parallel layout must reproduce (`dyad verify`, the parity tests).
"""

from __future__ import annotations

import math

from dyad.clipping import clip_scale
from dyad.config import RunConfig
from dyad.data.batch import collate
from dyad.encoder_service.hf_config import image_processor
from dyad.encoder_service.step import encode_rows
from dyad.llm_service.moe import update_expert_biases
from dyad.llm_service.step import microbatch_loss, whole_microbatch
from dyad.optim import apply_update, build_optimizer, grad_sq_norm
from dyad.pools import pool_type
from dyad.router.steps import StepPlanner
from dyad.service import build_model, compute_context


class ReferenceTrainer:
    def __init__(self, config: RunConfig, dataset):
        self.config = config
        self.dataset = dataset
        self.encoder = build_model(config, "encoder")
        self.llm = build_model(config, "llm")
        for pool, model in (("encoder", self.encoder), ("llm", self.llm)):
            pool_type(pool).service_class().freeze(model, config)  # train.freeze, as the workers hold it
        self.optimizers = [build_optimizer(m, config.train) for m in (self.encoder, self.llm)]
        self.planner = StepPlanner(config, dataset)
        self.image_processor = image_processor(config.encoder)

    def step(self, step: int) -> dict[str, float]:
        spec = self.planner.next(step)
        lm = aux = 0.0
        for index, sample_ids in enumerate(spec.microbatches):
            samples = [self.dataset.sample(s) for s in sample_ids]
            rows = spec.row_sizes[index] if spec.row_sizes else ()
            batch = collate(self.dataset.tokenizer, samples, self.planner.image_tokens, rows)
            batch = batch.to(self.config.train.device)
            local = whole_microbatch(batch, self.dataset.tokenizer.pad_id, multimodal_rope=self.config.llm.multimodal_rope)
            with compute_context(self.config):
                rows_RD = None
                if batch.image_ids:
                    rows_RD = encode_rows(
                        self.encoder, self.dataset, batch.image_ids, self.config.train.device, self.image_processor,
                        deepstack=self.config.llm.reads_deepstack,
                    )[local.image_rows_Nl]
                loss = microbatch_loss(
                    self.llm,
                    local,
                    rows_RD,
                    global_target_tokens=spec.target_tokens,
                    global_microbatches=len(spec.microbatches),
                )
            if loss.total.requires_grad:  # not where nothing before it trains
                loss.total.backward()
            lm += float(loss.lm)
            aux += float(loss.aux)
        if "llm" not in self.config.train.freeze:
            update_expert_biases(self.llm)
        total_sq = grad_sq_norm(self.encoder.parameters()) + grad_sq_norm(self.llm.parameters())
        scale = clip_scale(total_sq, self.config.train.grad_clip)
        for optimizer in self.optimizers:
            apply_update(optimizer, lr=spec.lr, grad_scale=scale)
        return {"loss": lm + aux, "lm_loss": lm, "aux_loss": aux, "grad_norm": math.sqrt(total_sq)}
