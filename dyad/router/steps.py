"""What each step does: its samples, microbatches, learning rate, target count and boundary plan;
and what an evaluation does: the held-out split in batches planned like steps.

The single-process reference walks the same `StepPlanner`, so both see identical batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property, lru_cache

from dyad.config import RunConfig
from dyad.data import ImageTokens, build_sequence
from dyad.encoder_service.hf_config import image_tokens
from dyad.router.boundary import BoundaryPlan, ImageSlot, PlannedMicrobatch, PlannedSample, plan_boundary
from dyad.router.encoder_cost import image_cost
from dyad.router.packing import pack_rows
from dyad.router.sampler import Cursor, EpochSampler, split_microbatches
from dyad.router.schedule import lr_at
from dyad.wire import pb


@dataclass(frozen=True)
class StepSpec:
    step: int
    microbatches: tuple[tuple[int, ...], ...]
    llm_dp_ranks: tuple[int, ...]  # the LLM data-parallel rank of each microbatch
    lr: float
    target_tokens: int  # target tokens of the whole global batch: the loss normaliser
    tokens: int  # sequence tokens (text + image) of the global batch
    # Packed (train.seq_len): per microbatch, how many of its samples (in order) each row holds;
    # (): one sample a row.
    row_sizes: tuple[tuple[int, ...], ...] = ()


class StepPlanner:
    def __init__(self, config: RunConfig, dataset, cursor: Cursor = Cursor()):
        self._config = config
        self._dataset = dataset
        self.image_tokens: ImageTokens = image_tokens(config.encoder, dataset)
        self._sampler = EpochSampler(dataset.train_ids, config.seed, cursor)
        self._planned_sample = lru_cache(maxsize=None)(self._plan_sample)

    @property
    def cursor(self) -> Cursor:
        return self._sampler.cursor

    def next(self, step: int) -> StepSpec:
        train = self._config.train
        dp = self._config.parallel.llm.dp
        sample_ids = self._sampler.next_batch(train.global_batch)
        shapes = [self._dataset.shape(s, self.image_tokens) for s in sample_ids]
        target_tokens = sum(shape.n_targets for shape in shapes)
        if target_tokens == 0:
            raise ValueError(f"step {step}: the global batch has no target tokens to learn from")
        microbatches, row_sizes = self._rows(split_microbatches(sample_ids, train.microbatches * dp))
        return StepSpec(
            step=step,
            microbatches=microbatches,
            row_sizes=row_sizes,
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

    @cached_property
    def heldout_batches(self) -> tuple[tuple[StepSpec, BoundaryPlan], ...]:
        """The held-out split (its first `eval.max_samples`, 0: all) in order, in batches of
        train.global_batch, each split into train.microbatches per LLM data-parallel lane like a
        step's; a last batch too small for that takes fewer per lane, or joins the batch before
        it where it has fewer samples than lanes. Every batch's `target_tokens` is the whole
        split's, so the batches' caption losses add up to the split's. `step` numbers the batch."""
        train, dp = self._config.train, self._config.parallel.llm.dp
        ids = list(self._dataset.heldout_ids)[: self._config.eval.max_samples or None]
        if len(ids) < dp:
            raise ValueError(
                f"the held-out split has {len(ids)} samples to evaluate, fewer than the LLM's {dp} "
                "data-parallel lanes (parallel.llm.dp): raise data.heldout_fraction or eval.max_samples"
            )
        chunks = [ids[start : start + train.global_batch] for start in range(0, len(ids), train.global_batch)]
        if len(chunks) > 1 and len(chunks[-1]) < dp:
            chunks[-2:] = [chunks[-2] + chunks[-1]]
        target_tokens = sum(self._dataset.shape(s, self.image_tokens).n_targets for s in ids)
        if target_tokens == 0:
            raise ValueError("the held-out split has no target tokens to evaluate")
        batches = []
        for index, chunk in enumerate(chunks):
            per_lane = min(train.microbatches, len(chunk) // dp)
            spec = StepSpec(
                step=index,
                microbatches=tuple(tuple(mb) for mb in split_microbatches(chunk, per_lane * dp)),
                llm_dp_ranks=tuple(i // per_lane for i in range(per_lane * dp)),
                lr=0.0,
                target_tokens=target_tokens,
                tokens=sum(self._dataset.shape(s, self.image_tokens).seq_len for s in chunk),
            )
            batches.append((spec, self.boundary_plan(spec)))
        return tuple(batches)

    def _rows(self, microbatches: list[list[int]]) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """(the microbatches, their row sizes: `StepSpec.row_sizes`); packed into rows of
        train.seq_len tokens (`pack_rows`: each microbatch's samples reordered row by row)."""
        seq_len = self._config.train.seq_len
        if not seq_len:
            return tuple(tuple(mb) for mb in microbatches), ()
        packed, sizes = [], []
        for mb in microbatches:
            rows = pack_rows([self._planned_sample(s).seq_len for s in mb], seq_len)
            packed.append(tuple(mb[i] for row in rows for i in row))
            sizes.append(tuple(len(row) for row in rows))
        return tuple(packed), tuple(sizes)

    def boundary_plan(self, spec: StepSpec) -> BoundaryPlan:
        microbatches = [
            PlannedMicrobatch(index, dp_rank, self._planned_rows(sample_ids, spec.row_sizes[index] if spec.row_sizes else ()))
            for index, (sample_ids, dp_rank) in enumerate(zip(spec.microbatches, spec.llm_dp_ranks))
        ]
        return plan_boundary(
            microbatches,
            encoder=self._config.parallel.encoder,
            llm=self._config.parallel.llm,
            hidden=self._config.llm.boundary_width,
            element_size=4 if self._config.train.dtype == "float32" else 2,
            image_cost=image_cost(self._config.encoder),
        )

    def _planned_rows(self, sample_ids: tuple[int, ...], row_sizes: tuple[int, ...]) -> tuple[PlannedSample, ...]:
        """The microbatch's rows as the boundary plans them: each sample, or (`row_sizes`) each
        packed row as one sequence of its samples one after another, images where they land."""
        samples = [self._planned_sample(s) for s in sample_ids]
        if not row_sizes:
            return tuple(samples)
        rows, start = [], 0
        for size in row_sizes:
            row, at, images = samples[start : start + size], 0, []
            for sample in row:
                images += [dataclasses.replace(image, position=image.position + at) for image in sample.images]
                at += sample.seq_len
            rows.append(PlannedSample(row[0].sample_id, at, tuple(images)))
            start += size
        return tuple(rows)

    def _plan_sample(self, sample_id: int) -> PlannedSample:
        """The sample's sequence length and where each image's tokens sit in it."""
        sample = self._dataset.sample(sample_id)
        ids, _, positions = build_sequence(self._dataset.tokenizer, sample, self.image_tokens)
        slots, first = [], 0  # `first`: the image's first token among the sample's image tokens
        for image_id in sample.image_ids:
            tokens = self.image_tokens(image_id)
            slots.append(ImageSlot(image_id, tokens, positions[first], self.image_tokens.token_grid(image_id)))
            first += tokens
        return PlannedSample(sample_id, len(ids), tuple(slots))


def step_command(spec: StepSpec, plan: BoundaryPlan) -> pb.StepCommand:
    return pb.StepCommand(
        step=spec.step,
        microbatches=[
            pb.Microbatch(index=i, sample_ids=list(mb), llm_dp_rank=dp_rank,
                          row_sizes=spec.row_sizes[i] if spec.row_sizes else ())
            for i, (mb, dp_rank) in enumerate(zip(spec.microbatches, spec.llm_dp_ranks))
        ],
        plan=plan_message(plan),
        global_target_tokens=spec.target_tokens,
        global_microbatches=len(spec.microbatches),
        lr=spec.lr,
    )


def plan_message(plan: BoundaryPlan) -> pb.BoundaryPlan:
    return pb.BoundaryPlan(
        hidden=plan.hidden,
        transfers=[
            pb.Transfer(
                src_rank=t.src_rank,
                dst_rank=t.dst_rank,
                microbatch=t.microbatch,
                rows=sum(segment.length for segment in t.segments),
                returns_gradient=True,  # every transfer does; the workers do not read it
                segments=[pb.RowSegment(src_row=a, dst_row=b, length=n) for a, b, n in t.segments],
            )
            for t in plan.transfers
        ],
        encoder_work=[
            pb.EncoderWork(
                encoder_dp_rank=w.encoder_dp_rank,
                microbatch=w.microbatch,
                image_ids=[image.image_id for image in w.images],
                image_tokens=[image.tokens for image in w.images],
                image_grids=[n for image in w.images if image.grid for n in image.grid],
                rows=w.rows,
            )
            for w in plan.encoder_work
        ],
        local_rows=[
            pb.LocalRows(llm_rank=r.llm_rank, microbatch=r.microbatch, rows=r.rows) for r in plan.local_rows
        ],
        tp_broadcast=True,  # tp rank 0 always broadcasts; the workers do not read it
        encoder_imbalance=plan.encoder_imbalance,
    )
