"""What a run's models hold and need on each rank, from their configs, layouts and a step's plan,
without torch (`dyad train --dry-run` prints it): parameters (total, per token, per rank) and an
estimate of each rank's memory.

Parameters are counted part by part from the same shapes `VisionEncoder`, `Qwen3VLVision` and
`MoELM` build (a test checks the counts against the models and against transformers'), and each part is held
whole or cut over the ranks that split it: tensor parallelism (tp) the attention's and dense
FFNs' linears, the vocabulary and the projector; expert parallelism (ep x etp) the experts; data
parallelism replicates everything. The optimizer's state is counted whole on every rank, as
`train.shard_optimizer: false` keeps it; sharded (the default) a rank keeps a 1/N of it for
parameters with N replicas, which this estimate does not count yet.

Memory per rank, in bytes, an estimate:
- weights: 4 per parameter (float32 master weights; train.dtype bfloat16 autocasts the compute),
  plus 2 with train.working_weights (bf16 copies of the matrices, counted over every parameter);
- gradients 4 and AdamW's two moments 8 per trained parameter (none for a frozen part);
- activations: what the blocks keep for the backward pass of the largest microbatch a rank holds
  at once (the LLM one at a time; the encoder `boundary.prefetch_depth` rounds, whose gradients
  come back later), at train.dtype's element size, counted per token and layer as the tensors
  below; the output's logits in float32. Not counted: the CUDA context, allocator fragmentation,
  communication buffers, transient tensors inside a block, float8 codes.

Legend: V vocabulary, D LLM dim, L layers, H query heads, G kv heads, Dh head dim, E experts,
k top_k, F expert hidden, Fd dense FFN hidden, Fs shared expert hidden; encoder: d dim, n blocks,
m MLP hidden, X patch (channels * patch_size**2), P positions, Q merged dim, O out_dim (= D);
a native tower's (`encoder.native`): the same, and G learned positions, s spatial merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig
from dyad.layout import EncoderLayout, LLMLayout
from dyad.llm_service.config import LLMConfig
from dyad.router.boundary import BoundaryPlan

FLOAT32 = 4
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2}
WORKING_COPY = 2  # bf16 working weights (train.working_weights)
ADAMW_STATES = 2  # exp_avg, exp_avg_sq: float32 like the master weights


@dataclass(frozen=True)
class Part:
    """Parameters of one kind: `count` in the single-device model, cut over `split` ranks
    (each holds count / split); `per_token` of them compute on each token."""

    name: str
    count: int
    split: int = 1
    per_token: int | None = None  # None: all of them

    @property
    def per_rank(self) -> int:
        assert self.count % self.split == 0, (self.name, self.count, self.split)
        return self.count // self.split


def total(parts: Sequence[Part]) -> int:
    return sum(part.count for part in parts)


def per_token(parts: Sequence[Part]) -> int:
    return sum(part.count if part.per_token is None else part.per_token for part in parts)


def per_rank(parts: Sequence[Part]) -> int:
    return sum(part.per_rank for part in parts)


# ---- parameters -----------------------------------------------------------------------------


def llm_parts(llm: LLMConfig, layout: LLMLayout) -> list[Part]:
    """The parts of `MoELM` (a resolved `llm`: vocab_size set) on one rank of `layout`."""
    D, L, H, G, Dh, V, tp = llm.dim, llm.n_layers, llm.n_heads, llm.n_kv_heads, llm.head_dim, llm.vocab_size, layout.tp
    moe, dense = llm.moe, len(llm.dense_layers)
    sparse = L - dense
    E, F = moe.num_experts, moe.expert_dim
    projections = D * (H + 2 * G) * Dh + H * Dh * D + ((H + 2 * G) * Dh if llm.attention_bias else 0)
    experts = sparse * E * 3 * D * F
    parts = [
        Part("embedding", V * D, tp),
        Part("attention", L * projections, tp),
        Part("norms", (2 * L + 1) * D),
        Part("expert router", sparse * (D * E + (D if moe.shared_expert_gate else 0))),
        Part("experts", experts, layout.ep * layout.etp, per_token=experts * moe.top_k // E),
        Part("shared experts", sparse * 3 * D * moe.shared_expert_dim),
        Part("dense FFN", dense * 3 * D * llm.dense_ffn_dim, tp),
        Part("output", D * V, tp),
    ]
    if llm.qk_norm == "head":  # one weight of Dh per projection, shared by its heads
        parts.append(Part("q/k norms", L * 2 * Dh))
    elif llm.qk_norm == "projection":  # over all heads, which tp splits
        parts.append(Part("q/k norms", L * (H + G) * Dh, tp))
    return [part for part in parts if part.count]


def encoder_tower_parts(encoder: EncoderConfig, layout: EncoderLayout) -> list[Part]:
    """The vision tower of `VisionEncoder` (a resolved `encoder`), or of `Qwen3VLVision` (its
    `native`), on one rank of `layout`."""
    if encoder.native is not None:
        return _native_tower_parts(encoder.native, layout)
    d, n, m, tp = encoder.dim, encoder.depth, encoder.mlp_dim, layout.tp
    X = encoder.channels * encoder.patch_size**2
    # qkv (weight, bias), proj's weight, fc1 (weight, bias), fc2's weight: cut over tp; the row-
    # parallel biases (proj, fc2) and the LayerNorms whole on every rank
    cut = 3 * d * d + (3 * d if encoder.qkv_bias else 0) + d * d + d * m + m + m * d
    whole = 2 * 2 * d + d + d
    parts = [
        Part("patch embedding", X * d + (d if encoder.patch_bias else 0)),
        Part("positions", encoder.positions * d + (d if encoder.cls_token else 0)),
        Part("blocks (tp)", n * cut, tp),
        Part("blocks (whole)", n * whole),
        Part("norms", 2 * d * (int(encoder.pre_norm) + int(encoder.final_norm))),
    ]
    return [part for part in parts if part.count]


def projector_parts(encoder: EncoderConfig, layout: EncoderLayout) -> list[Part]:
    """proj_in (column-parallel) and proj_out (row-parallel: its bias whole); a native tower's
    patch merger."""
    if encoder.native is not None:
        return _merger_parts("merger", encoder.native, layout, norm=encoder.native.dim)
    Q, O = encoder.merged_dim, encoder.out_dim
    return [Part("projector (tp)", Q * O + O + O * O, layout.tp), Part("projector (whole)", O)]


def held_parts(encoder: EncoderConfig, layout: EncoderLayout) -> list[Part]:
    """What the encoder holds untrained whatever train.freeze says: a native tower's DeepStack
    mergers, whose features do not cross the boundary yet."""
    if encoder.native is None:
        return []
    native, levels = encoder.native, len(encoder.native.deepstack_layers)
    merger = _merger_parts("DeepStack mergers", native, layout, norm=native.merged_dim)
    return [Part(part.name, levels * part.count, part.split) for part in merger if levels]


def _native_tower_parts(native: Qwen3VLVisionConfig, layout: EncoderLayout) -> list[Part]:
    """`Qwen3VLVision`'s patch embedding, positions and blocks (the blocks as a ViT's, every
    projection with a bias)."""
    d, m, tp = native.dim, native.mlp_hidden, layout.tp
    cut = 3 * d * d + 3 * d + d * d + d * m + m + m * d
    whole = 2 * 2 * d + d + d
    return [
        Part("patch embedding", native.patch_numel * d + d),
        Part("positions", native.position_grid**2 * d),
        Part("blocks (tp)", native.depth * cut, tp),
        Part("blocks (whole)", native.depth * whole),
    ]


def _merger_parts(name: str, native: Qwen3VLVisionConfig, layout: EncoderLayout, *, norm: int) -> list[Part]:
    """A patch merger: its LayerNorm (of `norm` values) and fc2's bias whole, fc1 (column-parallel)
    and fc2's weight (row-parallel) cut over tp."""
    Q, O = native.merged_dim, native.out_dim
    return [Part(f"{name} (tp)", Q * Q + Q + O * Q, layout.tp), Part(f"{name} (whole)", 2 * norm + O)]


# ---- memory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank (an estimate: see the module docstring)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def state_memory(held: int, trained: int, *, working_weights: bool, activations: int) -> Memory:
    """`held` parameters on the rank, `trained` of them trained."""
    return Memory(
        weights=held * (FLOAT32 + (WORKING_COPY if working_weights else 0)),
        gradients=trained * FLOAT32,
        optimizer=trained * FLOAT32 * ADAMW_STATES,
        activations=activations,
    )


def llm_activations(llm: LLMConfig, layout: LLMLayout, tokens: int, *, element_size: int, recompute: bool) -> int:
    """Bytes one LLM rank keeps for the backward pass of `tokens` (its share of a microbatch).

    Per token and layer: the two norms' inputs and outputs (4D), q, k, v and the attention's
    output ((2H + 2G)·Dh / tp); an MoE layer's routed copies, in and out (2kD), and its experts'
    gate, up and activated hidden (3kF / etp), assuming balanced routing, its tokens split over
    tp; a dense layer's 3Fd / tp. With recompute only each block's input (D) stays, and one
    block's tensors while it is recomputed. Plus the float32 logits (V / tp)."""
    D, Dh, tp, moe = llm.dim, llm.head_dim, layout.tp, llm.moe
    attention = 4 * D + (2 * llm.n_heads + 2 * llm.n_kv_heads) * Dh // tp
    routed = moe.top_k * (2 * D + 3 * moe.expert_dim // layout.etp) // tp
    dense_ffn = 3 * llm.dense_ffn_dim // tp
    dense = len(llm.dense_layers)
    sparse = llm.n_layers - dense
    layers = [attention + routed] * sparse + [attention + dense_ffn] * dense
    kept = D * llm.n_layers + max(layers) if recompute else sum(layers)
    return tokens * (kept * element_size + llm.vocab_size // tp * FLOAT32)


def encoder_activations(encoder: EncoderConfig, layout: EncoderLayout, images: int, *, element_size: int,
                        recompute: bool) -> int:
    """Bytes one encoder rank keeps for the backward pass of `images` in flight.

    Per position and block: the two norms' inputs and outputs (4d), q, k, v and the attention's
    output (4d / tp), the MLP's hidden before and after its activation (2m / tp); with recompute
    each block's input (d) and one block's tensors. Per image token sent: the projector's input
    and its hidden before and after the GELU (Q + 2·O / tp)."""
    kept = _kept_per_position(encoder.dim, encoder.mlp_dim, encoder.depth, layout.tp, recompute)
    projector = encoder.tokens_per_image * (encoder.merged_dim + 2 * encoder.out_dim // layout.tp)
    return images * (encoder.positions * kept + projector) * element_size


def native_activations(native: Qwen3VLVisionConfig, layout: EncoderLayout, tokens: int, *, element_size: int,
                       recompute: bool) -> int:
    """Bytes one encoder rank of a native tower keeps for the backward pass of `tokens` merged
    image tokens in flight, s² patches each: per patch and block as `encoder_activations` counts
    a position; per token the merger's normalized input and its hidden before and after the GELU
    (Q + 2·Q / tp)."""
    kept = _kept_per_position(native.dim, native.mlp_hidden, native.depth, layout.tp, recompute)
    merger = native.merged_dim + 2 * native.merged_dim // layout.tp
    return tokens * (native.spatial_merge**2 * kept + merger) * element_size


def _kept_per_position(d: int, mlp: int, depth: int, tp: int, recompute: bool) -> int:
    block = 4 * d + (4 * d + 2 * mlp) // tp
    return d * depth + block if recompute else block * depth


# ---- what the step's plan puts on a rank -------------------------------------------------------


def llm_tokens_per_rank(microbatch_shapes: Sequence[tuple[int, int]], layout: LLMLayout) -> int:
    """The most tokens one LLM rank holds at once: a microbatch of `(samples, longest sequence)`
    right-padded to its longest, its sequence cut over cp."""
    return max((samples * -(-longest // layout.cp) for samples, longest in microbatch_shapes), default=0)


def encoder_images_in_flight(plan: BoundaryPlan, rounds: Sequence[int], depth: int) -> int:
    """The most images one encoder rank holds activations for: the work of `depth` consecutive
    rounds (`rounds[microbatch]`: its index in its LLM data-parallel lane), which the encoder
    encodes before the oldest one's gradient returns."""
    return _in_flight(plan, rounds, depth, lambda work: len(work.images))


def encoder_tokens_in_flight(plan: BoundaryPlan, rounds: Sequence[int], depth: int) -> int:
    """The most image tokens (their rows) one encoder rank holds activations for, as
    `encoder_images_in_flight` counts images: what sizes a native tower's work."""
    return _in_flight(plan, rounds, depth, lambda work: work.rows)


def _in_flight(plan: BoundaryPlan, rounds: Sequence[int], depth: int, size) -> int:
    per_rank_round: dict[tuple[int, int], int] = {}
    for work in plan.encoder_work:
        key = (work.encoder_dp_rank, rounds[work.microbatch])
        per_rank_round[key] = per_rank_round.get(key, 0) + size(work)
    return max(
        (sum(per_rank_round.get((rank, first + r), 0) for r in range(depth)) for rank, first in per_rank_round),
        default=0,
    )
