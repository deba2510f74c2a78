"""The dry run's parameter counts and memory estimate (dyad/router/estimate.py) on small cases
counted by hand, and its parameter counts against dyad's own models built on the meta device."""

from __future__ import annotations

import dataclasses

import pytest

from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig
from dyad.layout import EncoderLayout, LLMLayout
from dyad.llm_service.config import LLMConfig, MoEConfig
from dyad.parallel.buckets import BUCKET_BYTES
from dyad.router import estimate
from dyad.router.boundary import BoundaryPlan, EncodedImage, EncoderWork, LocalRows, Segment, Transfer

LLM = LLMConfig(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, dense_ffn_dim=12,
                dense_layers=(0,), moe=MoEConfig(num_experts=4, top_k=2, expert_dim=6))
LLM_LAYOUT = LLMLayout(tp=2, dp=2, ep=2)
ENCODER = EncoderConfig(image_size=8, patch_size=4, channels=1, dim=8, depth=2, heads=2, mlp_hidden=16, out_dim=12,
                        qkv_bias=True)
ENCODER_LAYOUT = EncoderLayout(dp=1, tp=2)


def test_the_llm_parameters_by_hand():
    parts = estimate.llm_parts(LLM, LLM_LAYOUT)
    # embedding and output 100*8 each; attention 2 layers * (wq 8*8 + wk 8*4 + wv 8*4 + wo 8*8);
    # norms 5*8; the MoE layer's router 8*4 and experts 4*3*8*6; the dense layer's FFN 3*8*12
    assert estimate.total(parts) == 800 + 800 + 384 + 40 + 32 + 576 + 288 == 2920
    assert estimate.per_token(parts) == 2920 - 576 + 576 * 2 // 4
    # tp halves the embedding, output, attention and dense FFN; ep 2 the experts
    assert estimate.per_rank(parts) == 400 + 400 + 192 + 40 + 32 + 288 + 144 == 1496
    # a vocabulary tp does not divide: 13 of its 25 rows a rank, the last rank's padded
    odd = estimate.llm_parts(dataclasses.replace(LLM, vocab_size=25), LLM_LAYOUT)
    assert [part.per_rank for part in odd if part.name in ("embedding", "output")] == [13 * 8, 13 * 8]


def test_the_encoder_parameters_by_hand():
    tower = estimate.encoder_tower_parts(ENCODER, ENCODER_LAYOUT)
    projector = estimate.projector_parts(ENCODER, ENCODER_LAYOUT)
    # patch 16*8+8, positions 4*8; per block qkv 8*24+24, proj 8*8 (+8 whole), fc1 8*16+16, fc2 16*8
    # (+8 whole), two norms 2*16; the final norm 16
    assert estimate.total(tower) == 136 + 32 + 2 * 552 + 2 * 48 + 16
    assert estimate.per_rank(tower) == 136 + 32 + 552 + 2 * 48 + 16
    assert (estimate.total(projector), estimate.per_rank(projector)) == (8 * 12 + 12 + 12 * 12 + 12, 126 + 12)


def test_the_counts_are_the_models_own():
    """Every part's parameters, its matrices (what `WorkingWeights` casts) and its largest tensor."""
    torch = pytest.importorskip("torch")
    from dyad.encoder_service.model import VisionEncoder
    from dyad.encoder_service.qwen3_vl import Qwen3VLVision
    from dyad.llm_service.model import MoELM
    from dyad.working_weights import WorkingWeights

    def check(parts, model):
        assert estimate.total(parts) == sum(p.numel() for p in model.parameters())
        assert max(part.largest for part in parts) == max(p.numel() for p in model.parameters())
        matrices = sum(master.numel() for master in WorkingWeights(model).masters())
        assert sum(part.matrices for part in parts) == matrices

    qwen_like = LLMConfig(vocab_size=50, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm="head",
                          dense_layers=(1,), moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8, shared_expert_dim=12,
                                                           shared_expert_gate=True))
    olmoe_like = LLMConfig(vocab_size=50, dim=16, n_heads=4, n_kv_heads=4, qk_norm="projection", attention_bias=True,
                           dense_layers=())
    clip_like = EncoderConfig(image_size=8, patch_size=4, channels=3, dim=8, heads=2, cls_token=True, pre_norm=True,
                              patch_bias=False, final_norm=False, spatial_merge=2, out_dim=16)
    with torch.device("meta"):
        for llm in (LLM, qwen_like, olmoe_like):
            check(estimate.llm_parts(llm, LLMLayout()), MoELM(llm))
        for encoder in (ENCODER, clip_like):
            parts = estimate.encoder_tower_parts(encoder, EncoderLayout()) + estimate.projector_parts(encoder, EncoderLayout())
            check(parts, VisionEncoder(encoder))
        native = EncoderConfig(native=Qwen3VLVisionConfig(dim=16, depth=3, heads=2, mlp_hidden=24, out_dim=20,
                                                          deepstack_layers=(0, 2)))
        model = Qwen3VLVision(native.native)
        trained = estimate.encoder_tower_parts(native, EncoderLayout()) + estimate.projector_parts(native, EncoderLayout())
        held = estimate.deepstack_parts(native, EncoderLayout())
        assert estimate.total(held) == sum(p.numel() for p in model.deepstack_mergers.parameters())
        check(trained + held, model)


def test_the_gradient_groups_follow_the_layout():
    """As `parallelize_llm` plans them: experts over edp, routers and shared experts over the
    stage (the pool without pp), per-head q/k norms over the stage under tp (each rank normalizes
    its own heads), and with sequence parallelism the norms too; the rest over dp x cp."""
    qwen_like = LLMConfig(vocab_size=50, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm="head",
                          dense_layers=(), moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8, shared_expert_dim=12))
    groups = {part.name: part.group for part in estimate.llm_parts(qwen_like, LLMLayout(dp=2))}
    assert groups == {"embedding": "dp_cp", "attention": "dp_cp", "norms": "dp_cp", "expert router": "stage",
                      "experts": "edp", "shared experts": "stage", "output": "dp_cp", "q/k norms": "dp_cp"}
    tp = {part.name: part.group for part in estimate.llm_parts(qwen_like, LLMLayout(tp=2), sequence_parallel=True)}
    assert (tp["q/k norms"], tp["norms"]) == ("stage", "stage")
    layout = LLMLayout(tp=2, cp=2, dp=3, ep=4)
    assert [estimate.group_size(layout, group) for group in ("dp_cp", "stage", "edp")] == [6, 12, 3]
    assert [estimate.group_size(LLMLayout(dp=3, pp=2), group) for group in ("dp_cp", "stage", "world")] == [3, 3, 6]


def test_the_state_by_hand():
    parts = estimate.llm_parts(LLM, LLM_LAYOUT)
    # per rank 1496 parameters, 1024 of them matrices: attention 192, experts 288, dense FFN 144, output 400
    assert estimate.matrices_per_rank(parts) == 192 + 288 + 144 + 400 == 1024
    whole = estimate.state_memory(parts, [], LLM_LAYOUT, working_weights=False, shard_optimizer=False)
    assert (whole.weights, whole.gradients, whole.optimizer) == (4 * 1496, 4 * 1496, 8 * 1496)
    working = estimate.state_memory(parts, [], LLM_LAYOUT, working_weights=True, shard_optimizer=False)
    assert working.weights == 4 * 1496 + 2 * 1024
    frozen = estimate.state_memory([], parts, LLM_LAYOUT, working_weights=False, shard_optimizer=True)
    assert (frozen.weights, frozen.gradients, frozen.optimizer, frozen.reduction) == (4 * 1496, 0, 0, 0)
    # tp 2 x dp 2, ep 2: dense parts over dp x cp (2 ranks), the router over the pool (4), experts over edp (2)
    dense = 400 + 192 + 40 + 144 + 400
    sharded = estimate.state_memory(parts, [], LLM_LAYOUT, working_weights=True, shard_optimizer=True)
    assert sharded.optimizer == 4 * (2 * (dense // 2 + 32 // 4 + 288 // 2) + (192 + 144 + 400) // 2 + 288 // 2)
    assert sharded.weights == 4 * 1496 + 2 * 1024 - 4 * 1024  # the masters' values are in their pieces
    assert sharded.gradients == 4 * 1496
    # the largest bucket, all dense gradients (far under BUCKET_BYTES): its copy, and the shards of three in flight
    assert sharded.reduction == 4 * dense + 3 * 4 * dense // 2
    assert estimate.state_memory(parts, [], LLMLayout(tp=2), working_weights=False, shard_optimizer=True).optimizer \
        == 4 * 2 * (1496 - 32 - 288 + 32 // 2 + 288 // 2)  # only the router and experts have replicas


def test_the_reduction_adds_copies_of_buckets_or_sharded_of_a_larger_tensor():
    big = LLMConfig(vocab_size=2**20, dim=128, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=64, dense_layers=(0,),
                    dense_ffn_dim=128)
    parts = estimate.llm_parts(big, LLMLayout(dp=2))
    vocabulary = 4 * 2**20 * 128  # the embedding's and the output's float32 gradients: 512 MiB each
    for shard, added in [(False, 3 * BUCKET_BYTES), (True, vocabulary + 3 * vocabulary // 2)]:
        state = estimate.state_memory(parts, [], LLMLayout(dp=2), working_weights=False, shard_optimizer=shard)
        assert state.reduction == added
    assert estimate.state_memory(parts, [], LLMLayout(), working_weights=False, shard_optimizer=True).reduction == 0


def test_the_activations_by_hand():
    # per token: attention 4*8 + (2*2 + 2*1)*4/2; the MoE layer 2*(2*8 + 3*6)/2, the dense one 3*12/2;
    # at 2 bytes, and float32 logits over 100/2 rows
    per_token = (2 * (32 + 12) + 34 + 18) * 2 + 50 * 4
    assert estimate.llm_activations(LLM, LLM_LAYOUT, 10, element_size=2, recompute=False) == 10 * per_token
    recomputed = (8 * 2 + 32 + 12 + 34) * 2 + 50 * 4  # block inputs, and the largest block once
    assert estimate.llm_activations(LLM, LLM_LAYOUT, 10, element_size=2, recompute=True) == 10 * recomputed
    # per position and block 4*8 + (4*8 + 2*16)/2, 4 positions, 2 blocks; per token sent 8 + 2*12/2
    per_image = (4 * 2 * 64 + 4 * 20) * 4
    assert estimate.encoder_activations(ENCODER, ENCODER_LAYOUT, 3, element_size=4, recompute=False) == 3 * per_image
    # a native tower's: per patch and block the same, 2*2 patches per token; per token the merger's 32 + 2*32/2
    native = Qwen3VLVisionConfig(dim=8, depth=2, heads=2, mlp_hidden=16, spatial_merge=2, out_dim=12)
    per_token = (4 * 2 * 64 + 64) * 4
    assert estimate.native_activations(native, ENCODER_LAYOUT, 3, element_size=4, recompute=False) == 3 * per_token
    with_levels = (4 * 2 * 64 + 3 * 64) * 4  # two DeepStack levels the LLM reads: their mergers' too
    assert estimate.native_activations(native, ENCODER_LAYOUT, 3, element_size=4, recompute=False,
                                       deepstack_levels=2) == 3 * with_levels


def test_what_the_plan_puts_on_a_rank():
    assert estimate.llm_tokens_per_rank([(2, 10), (3, 7)], LLMLayout(cp=2)) == 12  # 3 rows of ceil(7/2)
    work = [EncoderWork(rank, mb, tuple(EncodedImage(i, 4) for i in range(n)))
            for rank, mb, n in [(0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 0, 5)]]
    plan = BoundaryPlan(hidden=8, element_size=2, encoder_work=tuple(work), transfers=(), local_rows=(),
                        encoder_patches=(24, 20), encoder_imbalance=1.0)
    in_flight = estimate.encoder_images_in_flight
    assert [in_flight(plan, rounds=[0, 1, 2], depth=2, dp_rank=dp) for dp in (0, 1)] == [5, 5]  # rounds 1 + 2
    assert [in_flight(plan, rounds=[0, 1, 2], depth=1, dp_rank=dp) for dp in (0, 1)] == [3, 5]
    assert [in_flight(plan, rounds=[0, 0, 1], depth=1, dp_rank=dp) for dp in (0, 1)] == [3, 5]  # rounds 0: 1 + 2
    assert estimate.encoder_tokens_in_flight(plan, rounds=[0, 1, 2], depth=2, dp_rank=0) == 5 * 4  # their rows


def test_the_boundary_buffers_by_hand():
    """Two microbatches (one round each) from encoder ranks 0 and 2 (two dp groups of tp 2) to LLM
    ranks 0 and 1."""
    work = (EncoderWork(0, 0, (EncodedImage(0, 6),)), EncoderWork(1, 0, (EncodedImage(1, 4),)),
            EncoderWork(0, 1, (EncodedImage(2, 3),)))
    transfers = (Transfer(0, 0, 0, (Segment(0, 0, 6),)), Transfer(2, 0, 0, (Segment(0, 6, 4),)),
                 Transfer(0, 1, 1, (Segment(0, 0, 2),)), Transfer(0, 0, 1, (Segment(2, 0, 1),)))
    local = (LocalRows(0, 0, 10), LocalRows(1, 1, 2), LocalRows(0, 1, 1))
    plan = BoundaryPlan(hidden=8, element_size=2, encoder_work=work, transfers=transfers, local_rows=local,
                        encoder_patches=(9, 4), encoder_imbalance=1.0)
    row = 16
    # LLM rank 0: receives 6 + 4 + 1 rows, splices 10 at most, returns 10 for microbatch 0
    assert estimate.llm_boundary(plan, 0, gradients=True) == row * (11 + 2 * 10 + 10)
    assert estimate.llm_boundary(plan, 0, gradients=False) == row * (11 + 10)
    # encoder rank 0: rounds 0 and 1 in flight, its rows (6, 3), their copies to the LLM and
    # their gradients' buffers (6, 2 + 1); and one round's gradient (6)
    assert estimate.encoder_boundary(plan, [0, 1], 2, rank=0, dp_rank=0, frozen=False) == row * (
        6 + 3 + 2 * (6 + 3) + 6)
    assert estimate.encoder_boundary(plan, [0, 1], 1, rank=0, dp_rank=0, frozen=False) == row * (6 + 2 * 6 + 6)
    assert estimate.encoder_boundary(plan, [0, 1], 1, rank=1, dp_rank=0, frozen=False) == row * (6 + 6)  # tp 1: rows
    assert estimate.encoder_boundary(plan, [0, 1], 1, rank=0, dp_rank=0, frozen=True) == row * (6 + 3 + 6 + 3)


@pytest.mark.parametrize("layout", [LLMLayout(pp=2), LLMLayout(pp=2, pp_virtual=2, pp_layers=(1, 2, 2, 1)),
                                    LLMLayout(pp=3, pp_layers=(1, 3, 2)),
                                    LLMLayout(pp=2, tp=2, ep=2)], ids=["pp2", "pp2-interleaved", "pp3-uneven", "pp2-tp2-ep2"])
def test_a_pipeline_ranks_parts_are_its_stages_as_cut(layout):
    """Each pipeline rank's parts are what `cut_stages` leaves on its model (its layers; the
    embedding on the first stage's rank, the final norm and output on the last's), cut further by
    its other degrees; together the ranks hold the model once."""
    torch = pytest.importorskip("torch")
    from dyad.llm_service.model import MoELM
    from dyad.llm_service.pipeline import cut_stages

    llm = LLMConfig(vocab_size=50, dim=16, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=8, qk_norm="head",
                    dense_layers=(0, 3), moe=MoEConfig(num_experts=4, top_k=2, expert_dim=8))
    whole = LLMLayout(tp=layout.tp, ep=layout.ep)
    held = []
    for pp_rank in range(layout.pp):
        with torch.device("meta"):
            model = MoELM(llm)
        cut_stages(model, layout, pp_rank)
        parts = estimate.llm_parts(llm, layout, pp_rank=pp_rank)
        assert estimate.total(parts) == sum(p.numel() for p in model.parameters())
        held.append(estimate.per_rank(parts))
    assert sum(held) == estimate.per_rank(estimate.llm_parts(llm, whole))


def test_a_pipeline_ranks_activations_are_its_layers_times_its_live_passes():
    """1F1B on pp2 of four microbatches: the first stage keeps two passes of its layers, the
    last one and the logits; as many layers in all as one rank without pp keeps for one pass."""
    from dyad.pipeline_schedule import live_passes

    layout = LLMLayout(pp=2, tp=2, dp=2, ep=2)
    kept = [estimate.llm_activations(LLM, layout, 10, element_size=2, recompute=False, pp_rank=r,
                                     live=live_passes(2, r, 4)) for r in range(2)]
    dense_layer, moe_layer, logits = (32 + 12 + 18) * 2, (32 + 12 + 34) * 2, 50 * 4  # LLM: layer 0 dense, 1 MoE
    assert kept == [10 * 2 * dense_layer, 10 * (moe_layer + logits)]
    assert sum(kept) - 10 * dense_layer == estimate.llm_activations(LLM, LLM_LAYOUT, 10, element_size=2, recompute=False)


def test_each_forward_pass_keeps_its_own_casts():
    """What `casts_in_flight` counts: autocast casts a weight afresh in each pass (its cache lasts
    one autocast context) and the pass's graph keeps the cast for its backward, so two passes
    whose backward has not run hold two casts of every matrix."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    kept: list[torch.Tensor] = []

    def keep(tensor):
        kept.append(tensor)
        return tensor

    losses = []
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses.append(model(torch.randn(3, 8, requires_grad=True)).float().sum())
    matrices = [p for p in model.parameters() if p.dim() == 2]
    casts = {t.untyped_storage().data_ptr(): t for t in kept  # saved as the matmul takes it: transposed
             if t.dtype == torch.bfloat16 and any(sorted(t.shape) == sorted(p.shape) for p in matrices)}
    assert sum(t.nbytes for t in casts.values()) == 2 * estimate.BF16 * sum(p.numel() for p in matrices)
    assert estimate.casts_in_flight(100, passes=2) == 200


def test_a_rank_keeps_the_casts_of_its_live_passes():
    """A pipeline rank's live passes each keep one chunk's casts; with recompute none are kept,
    and all the matrices are counted once, as they are cast again in the backward."""
    assert estimate.casts_in_flight(100) == 100
    assert estimate.casts_in_flight(100, passes=5, chunks=2) == 250
    assert estimate.casts_in_flight(100, passes=5, chunks=2, recompute=True) == 100


def test_the_plan_counts_each_ranks_casts_by_its_passes():
    """pp2 under 1F1B: the first stage holds two passes, the last one; interleaved, five and
    three passes of half a rank's layers. The encoder holds `boundary.prefetch_depth` rounds."""
    from dyad import config as config_lib
    from dyad.app.dry_run import rank_memories
    from dyad.data import make_dataset
    from dyad.router.steps import StepPlanner

    def casts(overrides):
        config = config_lib.load(None, ["train.dtype=bfloat16", "train.global_batch=8", "llm.n_layers=4",
                                        *overrides])
        dataset = make_dataset(config.data)
        config = config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size)
        planner = StepPlanner(config, dataset)
        spec = planner.next(0)
        ranks = rank_memories(config, dataset, planner.image_tokens, spec, planner.boundary_plan(spec))
        layout = config.parallel.llm
        stages = [estimate.weight_casts(estimate.llm_parts(config.llm, layout, pp_rank=r)) for r in range(layout.pp)]
        return {(r.pool, r.rank): r.memory.casts for r in ranks}, stages

    pipeline = ["parallel.llm.pp=2", "train.microbatches=4", "boundary.prefetch_depth=4"]
    one, (first, last) = casts(pipeline)
    assert first > 0 and last > 0
    assert (one[("llm", 0)], one[("llm", 1)]) == (2 * first, last)
    interleaved, (first, last) = casts([*pipeline, "parallel.llm.pp_virtual=2"])
    assert (interleaved[("llm", 0)], interleaved[("llm", 1)]) == (5 * first // 2, 3 * last // 2)
    shallow, _ = casts(["train.microbatches=4", "boundary.prefetch_depth=1"])
    assert one[("encoder", 0)] == 4 * shallow[("encoder", 0)] > 0  # every microbatch has images
    recomputed, _ = casts([*pipeline, "train.recompute=[llm,encoder]"])
    assert (recomputed[("llm", 0)], recomputed[("llm", 1)], recomputed[("encoder", 0)]) == (
        first, last, shallow[("encoder", 0)])
