"""What each step does: its samples, microbatches, learning rate, target count and boundary plan.

The single-process reference walks the same `StepPlanner`, so both see identical batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from dyad.config import RunConfig
from dyad.router.planner import BoundaryPlan, plan_boundary
from dyad.router.sampler import Cursor, EpochSampler, split_microbatches
from dyad.router.schedule import lr_at
from dyad.wire import pb


@dataclass(frozen=True)
class StepSpec:
    step: int
    microbatches: tuple[tuple[int, ...], ...]
    llm_dp_ranks: tuple[int, ...]  # the LLM data-parallel rank of each microbatch
    lr: float
    target_tokens: int  # caption tokens of the whole global batch: the loss normaliser
    tokens: int  # sequence tokens (text + image) of the global batch


class StepPlanner:
    def __init__(self, config: RunConfig, dataset, cursor: Cursor = Cursor()):
        self._config = config
        self._dataset = dataset
        self._tokens_per_image = config.encoder.tokens_per_image
        self._sampler = EpochSampler(dataset.train_ids, config.seed, cursor)

    @property
    def cursor(self) -> Cursor:
        return self._sampler.cursor

    def next(self, step: int) -> StepSpec:
        train = self._config.train
        dp = self._config.parallel.llm.dp
        sample_ids = self._sampler.next_batch(train.global_batch)
        shapes = [self._dataset.shape(s, self._tokens_per_image) for s in sample_ids]
        target_tokens = sum(shape.n_targets for shape in shapes)
        if target_tokens == 0:
            raise ValueError(f"step {step}: the global batch has no caption tokens to learn from")
        return StepSpec(
            step=step,
            microbatches=tuple(
                tuple(mb) for mb in split_microbatches(sample_ids, train.microbatches * dp)
            ),
            llm_dp_ranks=tuple(i // train.microbatches for i in range(train.microbatches * dp)),
            lr=lr_at(
                step,
                lr=train.lr,
                warmup_steps=train.warmup_steps,
                total_steps=train.steps,
                min_lr_ratio=train.min_lr_ratio,
            ),
            target_tokens=target_tokens,
            tokens=sum(shape.seq_len for shape in shapes),
        )

    def boundary_plan(self, spec: StepSpec) -> BoundaryPlan:
        images_of = {
            s: self._dataset.sample(s).image_ids for mb in spec.microbatches for s in mb
        }
        return plan_boundary(
            spec.microbatches,
            spec.llm_dp_ranks,
            images_of,
            tokens_per_image=self._tokens_per_image,
            hidden=self._config.llm.dim,
            encoder=self._config.parallel.encoder,
            llm=self._config.parallel.llm,
        )


def step_command(spec: StepSpec, plan: BoundaryPlan) -> pb.StepCommand:
    return pb.StepCommand(
        step=spec.step,
        microbatches=[
            pb.Microbatch(index=i, sample_ids=list(mb), llm_dp_rank=dp_rank)
            for i, (mb, dp_rank) in enumerate(zip(spec.microbatches, spec.llm_dp_ranks))
        ],
        plan=pb.BoundaryPlan(
            tokens_per_image=plan.tokens_per_image,
            hidden=plan.hidden,
            transfers=[
                pb.Transfer(
                    src_rank=t.src_rank,
                    dst_rank=t.dst_rank,
                    microbatch=t.microbatch,
                    image_ids=list(t.image_ids),
                    rows=t.rows,
                    returns_gradient=t.returns_gradient,
                )
                for t in plan.transfers
            ],
        ),
        global_target_tokens=spec.target_tokens,
        global_microbatches=len(spec.microbatches),
        lr=spec.lr,
    )
