"""Pipeline-parallel LLM layouts reproduce single-device training: losses, the boundary gradient,
gradients gathered back to full shapes, the gradient norm and the updated parameters (float32,
1e-5, every step), under the 1F1B and the interleaved schedules and with the other axes folded
inside each stage.

As in tests/dist/test_llm_layouts.py the LLM is fed image embeddings directly and every rank also
runs the single-device model on the whole global batch; the models step with plain SGD, or, with
the optimizer sharded, AdamW against the reference's. Each rank holds its stages' parameters
only, and the ranks of a pipeline hold every parameter of the reference exactly once.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from dyad.clipping import clip_scale
from dyad.data import FixedTokens
from dyad.data.batch import collate
from dyad.layout import LLMLayout, validate_llm_layout
from dyad.llm_service.moe import update_expert_biases
from dyad.llm_service.parallelize import parallelize_llm
from dyad.llm_service.pipeline import StageMicrobatch, StageSteps
from dyad.llm_service.sharding import shard_microbatch
from dyad.llm_service.step import microbatch_loss, whole_microbatch
from dyad.parallel.groups import ProcessGroups
from dyad.parallel.pipeline import Pipeline
from dyad.pipeline_schedule import schedule
from dyad.router.sampler import EpochSampler, split_microbatches
from dyad.service import build_model
from tests.dist.test_llm_layouts import _config, _sum_over
from tests.helpers.distributed import run_distributed, run_each
from tests.helpers.parity import assert_close, assert_tensors_close
from tests.helpers.sharding import Stepper

STEPS = 3
MICROBATCHES_PER_DP_RANK = 4  # more than pp2's stages: 1F1B reaches its steady state
GLOBAL_BATCH = 12
TEST_BUCKET_BYTES = 16 * 2**10
# Four layers, the first dense (its stage's aux loss has no gradient); an expert bias whose
# counts each stage sums over its own ranks.
MODEL = ["llm.n_layers=4", "llm.moe.expert_bias=true", "llm.moe.expert_bias_rate=0.05"]

LAYOUTS = {
    "pp2": {"pp": 2},
    "pp4": {"pp": 4},
    "pp2-interleaved": {"pp": 2, "pp_virtual": 2},
    "pp2-uneven": {"pp": 2, "pp_layers": (1, 3)},
    "pp2-tp2": {"pp": 2, "tp": 2},
    "pp2-tp2-sp": {"pp": 2, "tp": 2, "sp": True},
    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},
    "pp2-cp2": {"pp": 2, "cp": 2},
}


def _layout(kwargs) -> tuple[LLMLayout, bool]:
    return LLMLayout(**{k: v for k, v in kwargs.items() if k != "sp"}), kwargs.get("sp", False)


def _pipeline_body(rank, world_size, layout_kwargs, options, shard=False):
    torch.manual_seed(0)
    layout, sequence_parallel = _layout(layout_kwargs)
    config, dataset = _config([*MODEL, *options])
    validate_llm_layout(layout, config.llm)
    groups = ProcessGroups.build(layout)
    reference = build_model(config, "llm")
    model = copy.deepcopy(reference)
    plan = parallelize_llm(model, groups, sequence_parallel=sequence_parallel)
    held = _held_once_over_the_pipeline(model, reference, groups)
    stepper = Stepper(reference, model, plan, groups, config.train, shard, TEST_BUCKET_BYTES, held)
    pp_rank = groups.index("pp")
    pipeline = Pipeline(groups.ranks("pp"), groups.group("pp"), pp_rank, layout.pp_virtual)
    sampler = EpochSampler(dataset.train_ids, seed=0)
    image_tokens, D = FixedTokens(config.encoder.tokens_per_image), config.llm.dim
    dp_rank, tp_rank, cp_rank = groups.index("dp"), groups.index("tp"), groups.index("cp")
    total_microbatches = layout.dp * MICROBATCHES_PER_DP_RANK

    for step in range(STEPS):
        microbatches = split_microbatches(sampler.next_batch(GLOBAL_BATCH), total_microbatches)
        batches = [collate(dataset.tokenizer, [dataset.sample(s) for s in mb], image_tokens) for mb in microbatches]
        targets = sum(b.n_targets for b in batches)
        ref_lm = ref_aux = 0.0
        mine, rows_of = [], {}
        for index, batch in enumerate(batches):
            rows = torch.randn(batch.image_positions.numel(), D,
                               generator=torch.Generator().manual_seed(1000 * step + index))
            ref_rows = rows.clone().requires_grad_(True)
            whole = whole_microbatch(batch, dataset.tokenizer.pad_id)
            ref_loss = microbatch_loss(reference, whole, ref_rows[whole.image_rows_Nl] if rows.numel() else None,
                                       global_target_tokens=targets, global_microbatches=total_microbatches)
            ref_loss.total.backward()
            ref_lm, ref_aux = ref_lm + float(ref_loss.lm), ref_aux + float(ref_loss.aux)
            if index // MICROBATCHES_PER_DP_RANK != dp_rank:
                continue
            local = shard_microbatch(batch, pad_id=dataset.tokenizer.pad_id, cp=layout.cp, cp_rank=cp_rank, tp=layout.tp)
            my_rows = rows.clone().requires_grad_(True)
            spliced = pp_rank == 0 and rows.numel() > 0  # only the first stage sees image rows
            mine.append(StageMicrobatch(local, my_rows[local.image_rows_Nl] if spliced else None))
            rows_of[len(mine) - 1] = (my_rows, ref_rows)

        def boundary_gradient(m, rows_of=rows_of, step=step):  # after m's backward on the first stage
            my_rows, ref_rows = rows_of[m]
            if my_rows.numel():  # CP shards add up, TP replicas agree
                boundary = my_rows.grad.clone()
                dist.all_reduce(boundary, group=groups.group("cp"))
                assert_tensors_close({"rows": boundary}, {"rows": ref_rows.grad}, f"step {step} mb {m}")

        work = StageSteps(model, layout, pp_rank, mine, device=torch.device("cpu"), global_target_tokens=targets,
                          global_microbatches=total_microbatches, returned=boundary_gradient)
        actions = schedule(layout.pp, pp_rank, len(mine), layout.pp_virtual)
        pipeline.run(actions, work, len(mine), before_last_backward=stepper.reduction.arm)
        lm = float(work.lm) if tp_rank == 0 else 0.0  # 0 but on the last stage
        assert_close(_sum_over(lm, groups.group("world")), ref_lm, f"step {step} lm loss")
        assert_close(_sum_over(float(work.aux), groups.group("world")), ref_aux, f"step {step} aux loss")
        stepper.reduction.finish()
        update_expert_biases(reference)
        update_expert_biases(model, group=groups.group("stage"))
        stepper.check_gradients(step)
        ref_sq, sq = stepper.grad_sq_norms()
        assert_close(math.sqrt(sq), math.sqrt(ref_sq), f"step {step} grad norm")
        stepper.update(clip_scale(ref_sq, config.train.grad_clip), clip_scale(sq, config.train.grad_clip))

    stepper.check_parameters()
    ref_buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, ref_buffers[name]), f"{name} differs from the reference"


def _held_once_over_the_pipeline(model, reference, groups) -> set[str]:
    """The reference's parameter names this rank holds, asserting that the pipeline's ranks hold
    each exactly once."""
    held = [name for name, _ in model.named_parameters()]
    everyone = [None] * groups.size("pp")
    dist.all_gather_object(everyone, held, group=groups.group("pp"))
    together = [name for names in everyone for name in names]
    assert sorted(together) == sorted(name for name, _ in reference.named_parameters())
    return set(held)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_pipeline_layout_matches_single_device(name):
    layout, _ = _layout(LAYOUTS[name])
    run_distributed(_pipeline_body, layout.world_size, LAYOUTS[name], [])


def test_pp4_interleaved_matches_single_device():
    kwargs = {"pp": 4, "pp_virtual": 2}
    run_distributed(_pipeline_body, 4, kwargs, ["llm.n_layers=8", "llm.dense_layers=[0, 5]"])


# The optimizer sharded over each stage's replicas: dense parameters over dp, the expert weights
# over edp, whose group in pp2-dp2-ep2 is one rank.
def test_sharded_optimizer_under_pipeline_layouts_matches_single_device_adamw():
    layouts = [{"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "ep": 2}]
    run_each([(_pipeline_body, (kwargs, [], True)) for kwargs in layouts], 4)
