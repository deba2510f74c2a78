"""Every LLM layout reproduces single-device training: losses, the boundary gradient, gradients
gathered back to full shapes, the gradient norm and the updated parameters (float32, 1e-5, max
norm, every step).

The LLM is fed image embeddings directly (no encoder, no boundary), so these tests isolate the
LLM pool's parallelism. Each rank also runs the single-device model on the whole global batch.
The models step with plain SGD: the optimizer is elementwise and the same in every layout, and
AdamW would amplify rounding noise in near-zero gradient entries (see tests/helpers/parity.py), which
would blur what these tests measure: the layout's math. The sharded optimizer's tests step AdamW
over each parameter's replicas against the reference's (`tests/helpers/sharding.py`): losses and
norms every step, the first step's gradients, the parameters after the steps in the 2-norm.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from dyad import config as config_lib
from dyad.clipping import clip_scale
from dyad.compile import compile_blocks
from dyad.data import FixedTokens, make_dataset
from dyad.data.batch import collate
from dyad.layout import LLMLayout, validate_llm_layout
from dyad.llm_service.moe import update_expert_biases
from dyad.llm_service.parallelize import parallelize_llm
from dyad.llm_service.sharding import shard_microbatch
from dyad.llm_service.step import microbatch_loss, whole_microbatch
from dyad.parallel.groups import ProcessGroups
from dyad.router.sampler import EpochSampler, split_microbatches
from dyad.service import build_model
from tests.helpers.distributed import run_distributed, run_each
from tests.helpers.parity import assert_close, assert_tensors_close
from tests.helpers.sharding import Stepper

STEPS = 3
MICROBATCHES_PER_DP_RANK = 2
GLOBAL_BATCH = 8
TEST_BUCKET_BYTES = 16 * 2**10  # many buckets a group, so their order is exercised

# Router options exercised under a layout (defaults elsewhere).
OPTIONS = {
    "defaults": [],
    "router-options": [
        "llm.moe.score_func=sigmoid", "llm.moe.aux_loss=seq", "llm.moe.z_loss_coef=0.001",
        "llm.moe.expert_bias=true", "llm.moe.n_groups=2", "llm.moe.topk_groups=2",
        "llm.moe.dispatcher=allgather",
    ],
    # Qwen3-MoE's attention: per-head query/key norms, a head_dim apart from dim / n_heads.
    "qk-norm": ["llm.qk_norm=head", "llm.head_dim=12"],
    # OLMoE's: query/key norms over the whole projection, which tp splits by heads; a padding
    # token whose embedding row learns nothing (the digits' <pad> is id 0).
    "projection-qk-norm": ["llm.qk_norm=projection", "llm.pad_token_id=0"],
    # Qwen2-MoE's: q/k/v biases, the shared expert behind a sigmoid gate.
    "qwen2-moe": ["llm.attention_bias=true", "llm.moe.shared_expert_gate=true"],
    # DeepSeek-V3's: latent attention (a query latent, values of their own head dim), YaRN
    # with both mscales, sigmoid routing over groups scored by their top 2 with a correction bias,
    # the routed output scaled, a shared expert, the first layer dense (the default).
    "deepseek-v3": [
        "llm.attention=mla", "llm.n_kv_heads=4", "llm.mla.q_lora_rank=24", "llm.mla.kv_lora_rank=16",
        "llm.mla.qk_nope_head_dim=8", "llm.mla.qk_rope_head_dim=4", "llm.mla.v_head_dim=6",
        "llm.rope_type=yarn", "llm.yarn.factor=4.0", "llm.yarn.original_max_seq_len=16", "llm.yarn.mscale=1.0",
        "llm.yarn.mscale_all_dim=0.8",
        "llm.moe.score_func=sigmoid", "llm.moe.expert_bias=true", "llm.moe.n_groups=4", "llm.moe.topk_groups=2",
        "llm.moe.group_score_experts=2", "llm.moe.routed_scaling_factor=2.5",
    ],
}

LAYOUTS = {
    "single-device": {},
    "tp2-ep2": dict(tp=2, ep=2),
    "cp2": dict(cp=2),
    "etp2-ep2": dict(etp=2, ep=2, dp=4),
    "cp2-ep2": dict(cp=2, ep=2),
    "dp2-cp2-ep4": dict(dp=2, cp=2, ep=4),
    "dp4-ep4": dict(dp=4, ep=4),
    "tp2-cp2-ep4": dict(tp=2, cp=2, ep=4),
    "tp2-dp2-etp2-ep2": dict(tp=2, dp=2, etp=2, ep=2),
    "tp2-cp2-dp2-etp2-ep4": dict(tp=2, cp=2, dp=2, etp=2, ep=4),
    "tp2-sp-ep2": dict(tp=2, ep=2, sp=True),
    "tp2-cp2-sp-etp2-ep2": dict(tp=2, cp=2, etp=2, ep=2, sp=True),
}


def _config(options=()):
    overrides = [
        "data.multi_image_fraction=0.3", "data.text_only_fraction=0.2",
        "llm.n_heads=4", "llm.n_kv_heads=2", "llm.moe.num_experts=8", "llm.moe.top_k=2",
        "llm.moe.shared_expert_dim=32", "llm.moe.expert_dim=32", "llm.dense_ffn_dim=64",
        "train.grad_clip=0.5", *options,  # last: an option may change these
    ]
    config = config_lib.load(None, overrides)
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset




def _sum_over(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t)


def _layout(kwargs) -> tuple[LLMLayout, bool]:
    degrees = {k: v for k, v in kwargs.items() if k != "sp"}
    return LLMLayout(**degrees), kwargs.get("sp", False)


def _layout_body(rank, world_size, layout_kwargs, options, compile_backend=None, shard=False):
    torch.manual_seed(0)
    layout, sequence_parallel = _layout(layout_kwargs)
    config, dataset = _config(options)
    validate_llm_layout(layout, config.llm)
    groups = ProcessGroups.build(layout)
    reference = build_model(config, "llm")
    model = copy.deepcopy(reference)
    plan = parallelize_llm(model, groups, sequence_parallel=sequence_parallel)
    stepper = Stepper(reference, model, plan, groups, config.train, shard, TEST_BUCKET_BYTES)
    if compile_backend:
        compile_blocks(model, backend=compile_backend)
    sampler = EpochSampler(dataset.train_ids, seed=0)
    image_tokens, D = FixedTokens(config.encoder.tokens_per_image), config.llm.dim
    dp_rank, tp_rank, cp_rank = groups.index("dp"), groups.index("tp"), groups.index("cp")
    total_microbatches = layout.dp * MICROBATCHES_PER_DP_RANK

    for step in range(STEPS):
        samples = sampler.next_batch(GLOBAL_BATCH)
        microbatches = split_microbatches(samples, total_microbatches)
        batches = [collate(dataset.tokenizer, [dataset.sample(s) for s in mb], image_tokens)
                   for mb in microbatches]
        targets = sum(b.n_targets for b in batches)
        last_of_mine = max(i for i in range(len(batches)) if i // MICROBATCHES_PER_DP_RANK == dp_rank)
        ref_lm = ref_aux = lm = aux = 0.0
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
            local = shard_microbatch(batch, pad_id=dataset.tokenizer.pad_id, cp=layout.cp,
                                     cp_rank=cp_rank, tp=layout.tp)
            my_rows = rows.clone().requires_grad_(True)
            loss = microbatch_loss(model, local, my_rows[local.image_rows_Nl] if rows.numel() else None,
                                   global_target_tokens=targets, global_microbatches=total_microbatches)
            if index == last_of_mine:
                stepper.reduction.arm()  # as the LLM worker does: buckets go during the last backward
            loss.total.backward()
            lm += float(loss.lm) if tp_rank == 0 else 0.0
            aux += float(loss.aux)
            if rows.numel():  # the boundary gradient: CP shards add up, TP replicas agree
                boundary = my_rows.grad.clone()
                dist.all_reduce(boundary, group=groups.group("cp"))
                assert_tensors_close({"rows": boundary}, {"rows": ref_rows.grad}, f"step {step} mb {index}")

        assert_close(_sum_over(lm, groups.group("world")), ref_lm, f"step {step} lm loss")
        assert_close(_sum_over(aux, groups.group("world")), ref_aux, f"step {step} aux loss")
        stepper.reduction.finish()  # as the LLM worker does: before the biases' all-reduce over "world"
        update_expert_biases(reference)
        update_expert_biases(model, group=groups.group("world"))
        stepper.check_gradients(step)
        ref_sq, sq = stepper.grad_sq_norms()
        assert_close(math.sqrt(sq), math.sqrt(ref_sq), f"step {step} grad norm")
        stepper.update(clip_scale(ref_sq, config.train.grad_clip), clip_scale(sq, config.train.grad_clip))

    stepper.check_parameters()
    for (name, buffer), ref_buffer in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(buffer, ref_buffer), f"{name} differs from the reference"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_llm_layout_matches_single_device(name):
    layout, _ = _layout(LAYOUTS[name])
    run_distributed(_layout_body, layout.world_size, LAYOUTS[name], OPTIONS["defaults"])


@pytest.mark.parametrize("name", ["tp2-cp2-ep4", "dp4-ep4", "tp2-cp2-sp-etp2-ep2"])
def test_router_options_under_a_layout_match_single_device(name):
    layout, _ = _layout(LAYOUTS[name])
    run_distributed(_layout_body, layout.world_size, LAYOUTS[name], OPTIONS["router-options"])


# The parts of pretrained families (dyad/llm_service/hf_config.py), each under the layouts that cut
# them: Qwen3-MoE's per-head q/k norm, OLMoE's projection-wide one, Qwen2-MoE's biases and gate,
# DeepSeek-V3's latent attention (heads split, latents whole), YaRN and routing.
FAMILY_PARTS = [
    ("qk-norm", "tp2-cp2-ep4"), ("qk-norm", "tp2-sp-ep2"),
    ("projection-qk-norm", "tp2-cp2-ep4"), ("projection-qk-norm", "tp2-sp-ep2"),
    ("qwen2-moe", "tp2-cp2-ep4"), ("qwen2-moe", "tp2-dp2-etp2-ep2"),
    ("deepseek-v3", "single-device"), ("deepseek-v3", "tp2-ep2"), ("deepseek-v3", "cp2"), ("deepseek-v3", "etp2-ep2"), ("deepseek-v3", "tp2-sp-ep2"),
    ("deepseek-v3", "tp2-cp2-sp-etp2-ep2"),
]


@pytest.mark.parametrize("options, name", FAMILY_PARTS)
def test_pretrained_families_parts_under_a_layout_match_single_device(options, name):
    layout, _ = _layout(LAYOUTS[name])
    run_distributed(_layout_body, layout.world_size, LAYOUTS[name], OPTIONS[options])


# aot_eager: dynamo traces the parallelized blocks and AOT autograd builds their backward, with
# eager kernels (the exact math of the eager model); inductor's fused kernels are checked on GPUs
# (tests/integration/test_compile.py).
def test_compiled_blocks_under_a_layout_match_single_device():
    kwargs = LAYOUTS["tp2-cp2-sp-etp2-ep2"]
    run_distributed(_layout_body, _layout(kwargs)[0].world_size, kwargs, OPTIONS["defaults"], "aot_eager")


# The optimizer sharded over each parameter's replicas: dense parameters over dp (dp×cp), expert
# weights over edp (2 in dp2 and in cp2-dp2-ep2, all 4 ranks in tp2-dp2), the tensor-parallel
# pieces over dp. One run of the ranks for the layouts of one world size.
SHARDED_LAYOUTS = {2: {"dp2": dict(dp=2)}, 4: {"cp2-dp2-ep2": dict(cp=2, dp=2, ep=2), "tp2-dp2": dict(tp=2, dp=2)}}


@pytest.mark.parametrize("world_size", sorted(SHARDED_LAYOUTS))
def test_sharded_optimizer_under_layouts_matches_single_device_adamw(world_size):
    layouts = SHARDED_LAYOUTS[world_size].values()
    run_each([(_layout_body, (kwargs, OPTIONS["defaults"], None, True)) for kwargs in layouts], world_size)
