"""What a run's models hold and need on each rank, from their configs, layouts and a step's plan,
without torch (`dyad plan` and `dyad train --dry-run` print it): parameters (total, per token, per
rank) and an estimate of each rank's memory at the peak of a step.

Parameters are counted part by part from the same shapes `VisionEncoder`, `Qwen3VLVision` and
`MoELM` build (a test checks the counts against the models and against transformers'), and each part is held
whole or cut over the ranks that split it: tensor parallelism (tp) the attention's and dense
FFNs' linears, the vocabulary and the projector; expert parallelism (ep x etp) the experts; data
parallelism replicates everything. Each part's gradient is summed over one group of ranks, as
the pools' `parallelize` plans it (`GradientPlan.reduce_over`): the LLM's experts over edp, its
expert routers, shared experts (and with tp its per-head q/k norms, with sequence parallelism its
norms) over the pipeline stage (the whole pool without pp), the rest over dp x cp; the encoder's
over dp. With pipeline stages (`pp`) an LLM rank holds its stages' layers, the embedding on the
first stage's rank and the final norm and output on the last's (`llm_parts(pp_rank=)`).

Memory per rank, in bytes, an estimate of what lives at once late in a step's last backward
pass (each term a column of the plan's table):
- weights: 4 per parameter (float32), plus 2 per matrix with train.working_weights (the bf16
  copies of the linears' and experts' weights, `dyad/working_weights.py`), less the 4 of each
  trained matrix whose float32 master the sharded optimizer keeps in pieces instead;
- casts: with bfloat16 compute and no working weights, the bf16 copy autocast makes of each
  matrix the forward pass uses, kept for the backward pass (2 per matrix; with recompute the
  experts' are made again block by block, and counted all the same). Each forward pass makes its
  own (autocast's cache lasts one pass), so a rank keeps those of every pass it holds: a pipeline
  rank's live passes, each of one chunk's matrices, and an encoder rank's rounds in flight
  (`casts_in_flight`);
- gradients: 4 per trained parameter, at its shape (a working weight's bf16 gradient is added
  into its master's float32 one as it is made: `dyad/kernels/widen.py`); with the optimizer
  sharded too, until the reduction hands each bucket to this rank's pieces;
- optimizer: AdamW's two float32 moments per trained parameter; sharded (`train.shard_optimizer`,
  where some trained parameter has replicas: `dyad/parallel/sharded_optimizer.py`) those of this
  rank's piece of each, 1/N of a part summed over N ranks (rounded up; the padding of each
  tensor's last piece, under N values, is not counted), and the float32 pieces of the working
  weights' masters;
- activations: what the blocks keep for the backward pass of the largest microbatch a rank holds
  at once (the LLM one at a time, or a pipeline rank the passes its schedule has run forward and
  not yet backward: `dyad.pipeline_schedule.live_passes`; the encoder `boundary.prefetch_depth`
  rounds, whose gradients come back later), at train.dtype's element size, counted per token and
  layer as the tensors below; the output's logits in float32;
- boundary: the buffers of the boundary rows and their gradients (`llm_boundary`,
  `encoder_boundary`);
- reduction: what the gradient reduction's buckets (`dyad/parallel/buckets.py`) add at once: the
  copies of those in flight, or with the optimizer sharded (whose copies take their gradients'
  place) the copy being filled and the summed shards of those in flight.
Not counted: the CUDA context, the allocator's fragmentation and cache, transient tensors inside
a block, one parameter's gradient while autograd adds it into `.grad`, float8 codes, the biases'
casts.

Legend: V vocabulary, D LLM dim, L layers, H query heads, G kv heads, Dh head dim, E experts,
k top_k, F expert hidden, Fd dense FFN hidden, Fs shared expert hidden; encoder: d dim, n blocks,
m MLP hidden, X patch (channels * patch_size**2), P positions, Q merged dim, O out_dim (= D);
a native tower's (`encoder.native`): the same, and G learned positions, s spatial merge.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import astuple, dataclass

from dyad.encoder_service.config import EncoderConfig, Qwen3VLVisionConfig
from dyad.layout import EncoderLayout, LLMLayout
from dyad.llm_service.config import LLMConfig
from dyad.parallel.buckets import BUCKET_BYTES, COPIES_IN_FLIGHT
from dyad.router.boundary import BoundaryPlan

FLOAT32 = 4
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2}
BF16 = 2  # a working weight (train.working_weights) or autocast's cast of a matrix
ADAMW_STATES = 2  # exp_avg, exp_avg_sq: float32 like the master weights


@dataclass(frozen=True)
class Part:
    """Parameters of one kind: `count` in the single-device model, cut over `split` ranks
    (each holds count / split, or where the cut is by rows of `row` values, as the vocabulary's,
    ceil(rows / split) of them: the last rank's zero-padded); `per_token` of them compute on each
    token; `matrices` of them are weights of linears or experts (what working weights and
    autocast cast to bf16); `largest`, its largest tensor's values in the single-device model;
    `group`, the group its gradient is summed over."""

    name: str
    count: int
    split: int = 1
    per_token: int | None = None  # None: all of them
    matrices: int = 0
    largest: int = 0
    group: str = "dp"
    row: int = 1

    @property
    def per_rank(self) -> int:
        assert self.row > 1 or self.count % self.split == 0, (self.name, self.count, self.split)
        return self.cut(self.count)

    @property
    def matrices_per_rank(self) -> int:
        return self.cut(self.matrices)

    def cut(self, values: int) -> int:
        """One rank's share of `values` of the part's tensors."""
        rows = values // self.row
        return -(-rows // self.split) * self.row


def total(parts: Sequence[Part]) -> int:
    return sum(part.count for part in parts)


def per_token(parts: Sequence[Part]) -> int:
    return sum(part.count if part.per_token is None else part.per_token for part in parts)


def per_rank(parts: Sequence[Part]) -> int:
    return sum(part.per_rank for part in parts)


def matrices_per_rank(parts: Sequence[Part]) -> int:
    return sum(part.matrices_per_rank for part in parts)


# ---- parameters -----------------------------------------------------------------------------


def llm_parts(llm: LLMConfig, layout: LLMLayout, *, sequence_parallel: bool = False,
              pp_rank: int | None = None) -> list[Part]:
    """The parts of `MoELM` (a resolved `llm`: vocab_size set) on one rank of `layout`: of the
    whole model, or (`pp_rank`) of the pipeline stages that rank holds (its layers; the embedding
    on the first stage's rank, the final norm and the output on the last's)."""
    D, H, G, Dh, V, tp = llm.dim, llm.n_heads, llm.n_kv_heads, llm.head_dim, llm.vocab_size, layout.tp
    layers = held_layers(llm, layout, pp_rank)
    first, last = (True, True) if pp_rank is None else (0 in layers, llm.n_layers - 1 in layers)
    L, moe, dense = len(layers), llm.moe, len(set(llm.dense_layers) & set(layers))
    sparse = L - dense
    E, F, Fs = moe.num_experts, moe.expert_dim, moe.shared_expert_dim
    weights = D * (H + 2 * G) * Dh + H * Dh * D
    biases = (H + 2 * G) * Dh if llm.attention_bias else 0
    experts = sparse * E * 3 * D * F
    gate = D if moe.shared_expert_gate else 0  # a linear outside the router: cast like the others
    sequence_parallel = sequence_parallel and tp > 1
    norms = "stage" if sequence_parallel else "dp_cp"
    parts = [
        Part("embedding", V * D * first, tp, largest=V * D, group="dp_cp", row=D),
        Part("attention", L * (weights + biases), tp, matrices=L * weights, largest=D * H * Dh, group="dp_cp"),
        Part("norms", (2 * L + last) * D, largest=D, group=norms),
        Part("expert router", sparse * (D * E + gate), matrices=sparse * gate, largest=D * E, group="stage"),
        Part("experts", experts, layout.ep * layout.etp, per_token=experts * moe.top_k // E, matrices=experts,
             largest=E * D * 2 * F, group="edp"),
        Part("shared experts", sparse * 3 * D * Fs, matrices=sparse * 3 * D * Fs, largest=D * Fs, group="stage"),
        Part("dense FFN", dense * 3 * D * llm.dense_ffn_dim, tp, matrices=dense * 3 * D * llm.dense_ffn_dim,
             largest=D * llm.dense_ffn_dim, group="dp_cp"),
        Part("output", D * V * last, tp, matrices=D * V * last, largest=D * V, group="dp_cp", row=D),
    ]
    if llm.qk_norm == "head":  # one weight of Dh per projection, shared by its heads (over tp: by this rank's)
        group = "stage" if tp > 1 else norms
        parts.append(Part("q/k norms", L * 2 * Dh, largest=Dh, group=group))
    elif llm.qk_norm == "projection":  # over all heads, which tp splits
        parts.append(Part("q/k norms", L * (H + G) * Dh, tp, largest=H * Dh, group="dp_cp"))
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
    matrices = 3 * d * d + d * d + d * m + m * d
    cut = matrices + (3 * d if encoder.qkv_bias else 0) + m
    whole = 2 * 2 * d + d + d
    parts = [
        Part("patch embedding", X * d + (d if encoder.patch_bias else 0), matrices=X * d, largest=X * d),
        Part("positions", encoder.positions * d + (d if encoder.cls_token else 0), largest=encoder.positions * d),
        Part("blocks (tp)", n * cut, tp, matrices=n * matrices, largest=max(3 * d * d, d * m)),
        Part("blocks (whole)", n * whole, largest=d),
        Part("norms", 2 * d * (int(encoder.pre_norm) + int(encoder.final_norm)), largest=d),
    ]
    return [part for part in parts if part.count]


def projector_parts(encoder: EncoderConfig, layout: EncoderLayout) -> list[Part]:
    """proj_in (column-parallel) and proj_out (row-parallel: its bias whole); a native tower's
    patch merger."""
    if encoder.native is not None:
        return _merger_parts("merger", encoder.native, layout, norm=encoder.native.dim)
    Q, O = encoder.merged_dim, encoder.out_dim
    return [
        Part("projector (tp)", Q * O + O + O * O, layout.tp, matrices=Q * O + O * O, largest=max(Q, O) * O),
        Part("projector (whole)", O, largest=O),
    ]


def deepstack_parts(encoder: EncoderConfig, layout: EncoderLayout) -> list[Part]:
    """A native tower's DeepStack mergers: they train with the patch merger where the LLM reads
    their levels (`llm.deepstack_levels`), and are held unread where it does not."""
    if encoder.native is None:
        return []
    native, levels = encoder.native, len(encoder.native.deepstack_layers)
    merger = _merger_parts("DeepStack mergers", native, layout, norm=native.merged_dim)
    return [Part(part.name, levels * part.count, part.split, matrices=levels * part.matrices, largest=part.largest)
            for part in merger if levels]


def _native_tower_parts(native: Qwen3VLVisionConfig, layout: EncoderLayout) -> list[Part]:
    """`Qwen3VLVision`'s patch embedding, positions and blocks (the blocks as a ViT's, every
    projection with a bias)."""
    d, m, tp = native.dim, native.mlp_hidden, layout.tp
    matrices = 3 * d * d + d * d + d * m + m * d
    whole = 2 * 2 * d + d + d
    return [
        Part("patch embedding", native.patch_numel * d + d, matrices=native.patch_numel * d,
             largest=native.patch_numel * d),
        Part("positions", native.position_grid**2 * d, largest=native.position_grid**2 * d),
        Part("blocks (tp)", native.depth * (matrices + 3 * d + m), tp, matrices=native.depth * matrices,
             largest=max(3 * d * d, d * m)),
        Part("blocks (whole)", native.depth * whole, largest=d),
    ]


def _merger_parts(name: str, native: Qwen3VLVisionConfig, layout: EncoderLayout, *, norm: int) -> list[Part]:
    """A patch merger: its LayerNorm (of `norm` values) and fc2's bias whole, fc1 (column-parallel)
    and fc2's weight (row-parallel) cut over tp."""
    Q, O = native.merged_dim, native.out_dim
    return [
        Part(f"{name} (tp)", Q * Q + Q + O * Q, layout.tp, matrices=Q * Q + O * Q, largest=max(Q, O) * Q),
        Part(f"{name} (whole)", 2 * norm + O, largest=max(norm, O)),
    ]


@functools.cache  # a layout's groups are listed rank by rank, and asked for once per part and rank
def group_size(layout: EncoderLayout | LLMLayout, group: str) -> int:
    """How many ranks a group of the named kind (`layout.GROUP_NAMES`) holds."""
    return len(layout.groups(group)[0])


# ---- memory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank, by what holds them (an estimate: see the module docstring)."""

    weights: int
    casts: int
    gradients: int
    optimizer: int
    activations: int
    boundary: int
    reduction: int

    @property
    def total(self) -> int:
        return sum(astuple(self))


@dataclass(frozen=True)
class State:
    """What a rank's parameters cost: weights, gradients, optimizer state and the reduction's
    copies (the other `Memory` terms come from the step)."""

    weights: int
    gradients: int
    optimizer: int
    reduction: int


def sharded(trained: Sequence[Part], layout, *, shard_optimizer: bool) -> bool:
    """Whether the pool's optimizer is sharded: train.shard_optimizer, and some trained part has
    replicas (`dyad.service.has_replicas`)."""
    return shard_optimizer and any(group_size(layout, part.group) > 1 for part in trained)


def state_memory(trained: Sequence[Part], frozen: Sequence[Part], layout, *, working_weights: bool,
                 shard_optimizer: bool) -> State:
    """The weights, gradients, optimizer state and reduction copies of a rank of `layout` that
    holds `trained` and `frozen` parts."""
    held = [*trained, *frozen]
    weights = FLOAT32 * per_rank(held) + (BF16 * matrices_per_rank(held) if working_weights else 0)
    is_sharded = sharded(trained, layout, shard_optimizer=shard_optimizer)
    if not is_sharded:
        optimizer = FLOAT32 * ADAMW_STATES * per_rank(trained)
    else:
        pieces = masters = 0
        for part in trained:
            size = group_size(layout, part.group)
            pieces += -(-part.per_rank // size)
            masters += -(-part.matrices_per_rank // size) if working_weights else 0
        optimizer = FLOAT32 * (ADAMW_STATES * pieces + masters)
        weights -= FLOAT32 * matrices_per_rank(trained) if working_weights else 0
    return State(weights, FLOAT32 * per_rank(trained), optimizer, _reduction_copies(trained, layout, is_sharded))


def _reduction_copies(trained: Sequence[Part], layout, is_sharded: bool) -> int:
    """The most bytes the gradient reduction adds at once, in the group where that is most. With
    the optimizer replicated a bucket of several gradients is summed in a copy (one of a single
    gradient in place, so a copy holds at most `BUCKET_BYTES`): `COPIES_IN_FLIGHT` copies in flight
    and the one just made. Sharded, every bucket is copied (a tensor larger than `BUCKET_BYTES` a
    bucket of its own), but its gradients are dropped as they are copied: what adds is the copy
    being filled, and this rank's shard (1/N) of the summed gradients of each bucket in flight. A
    group of one rank copies nothing."""
    most = 0
    for group in {part.group for part in trained}:
        parts = [part for part in trained if part.group == group]
        size = group_size(layout, group)
        if size == 1:
            continue
        if is_sharded:
            bucket = min(max(BUCKET_BYTES, FLOAT32 * max(part.cut(part.largest) for part in parts)),
                         FLOAT32 * per_rank(parts))
            most = max(most, bucket + (COPIES_IN_FLIGHT + 1) * -(-bucket // size))
        else:
            most = max(most, (COPIES_IN_FLIGHT + 1) * min(BUCKET_BYTES, FLOAT32 * per_rank(parts)))
    return most


def weight_casts(parts: Sequence[Part]) -> int:
    """Bytes of autocast's bf16 copies of the matrices of `parts` (one rank's)."""
    return BF16 * matrices_per_rank(parts)


def casts_in_flight(casts: int, *, passes: int = 1, chunks: int = 1, recompute: bool = False) -> int:
    """Bytes of the casts a rank keeps at once, `casts` those of all its matrices: autocast casts
    afresh in each forward pass and the pass's graph keeps its casts until its backward, so
    `passes` passes at once (each of one of `chunks` even chunks of the rank's layers, as
    `llm_activations` counts them) keep theirs each. With recompute a pass keeps none (the
    backward casts again, a block at a time): all the matrices' once."""
    return casts if recompute else passes * casts // chunks


def held_layers(llm: LLMConfig, layout: LLMLayout, pp_rank: int | None = None) -> list[int]:
    """The decoder layers a rank holds: all, or (`pp_rank`) those of its pipeline stages."""
    if pp_rank is None:
        return list(range(llm.n_layers))
    stages = layout.stage_layers(llm.n_layers)
    return [i for stage in layout.rank_stages(pp_rank) for i in stages[stage]]


def llm_activations(llm: LLMConfig, layout: LLMLayout, tokens: int, *, element_size: int, recompute: bool,
                    pp_rank: int | None = None, live: int = 1) -> int:
    """Bytes one LLM rank keeps for the backward pass of `tokens` (its share of a microbatch),
    of its layers (`pp_rank`: its stages'; the logits on the last stage's rank), `live` such
    passes at once (a pipeline rank's forward passes whose backward has not run yet: each of one
    of its `parallel.llm.pp_virtual` chunks, taken as an even share of its layers).

    Per token and layer: the two norms' inputs and outputs (4D), q, k, v and the attention's
    output ((2H + 2G)·Dh / tp); an MoE layer's routed copies, in and out (2kD), and its experts'
    gate, up and activated hidden (3kF / etp), assuming balanced routing, its tokens split over
    tp; a dense layer's 3Fd / tp. With recompute only each block's input (D) stays, and one
    block's tensors while it is recomputed. Plus the float32 logits (V / tp)."""
    D, Dh, tp, moe = llm.dim, llm.head_dim, layout.tp, llm.moe
    attention = 4 * D + (2 * llm.n_heads + 2 * llm.n_kv_heads) * Dh // tp
    routed = moe.top_k * (2 * D + 3 * moe.expert_dim // layout.etp) // tp
    dense_ffn = 3 * llm.dense_ffn_dim // tp
    held = held_layers(llm, layout, pp_rank)
    dense = len(set(llm.dense_layers) & set(held))
    sparse = len(held) - dense
    layers = [attention + routed] * sparse + [attention + dense_ffn] * dense
    kept = D * len(held) + max(layers, default=0) if recompute else sum(layers)
    logits = llm.vocab_size // tp * FLOAT32 if pp_rank is None or llm.n_layers - 1 in held else 0
    return tokens * (live * kept // layout.pp_virtual * element_size + logits)


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
                       recompute: bool, deepstack_levels: int = 0) -> int:
    """Bytes one encoder rank of a native tower keeps for the backward pass of `tokens` merged
    image tokens in flight, s² patches each: per patch and block as `encoder_activations` counts
    a position; per token the merger's normalized input and its hidden before and after the GELU
    (Q + 2·Q / tp), and as much for each DeepStack level the LLM reads."""
    kept = _kept_per_position(native.dim, native.mlp_hidden, native.depth, layout.tp, recompute)
    merger = (1 + deepstack_levels) * (native.merged_dim + 2 * native.merged_dim // layout.tp)
    return tokens * (native.spatial_merge**2 * kept + merger) * element_size


def _kept_per_position(d: int, mlp: int, depth: int, tp: int, recompute: bool) -> int:
    block = 4 * d + (4 * d + 2 * mlp) // tp
    return d * depth + block if recompute else block * depth


# ---- what the step's plan puts on a rank -------------------------------------------------------


def llm_tokens_per_rank(microbatch_shapes: Sequence[tuple[int, int]], layout: LLMLayout) -> int:
    """The most tokens one LLM rank holds at once: a microbatch of `(samples, longest sequence)`
    right-padded to its longest, its sequence cut over cp."""
    return max((samples * -(-longest // layout.cp) for samples, longest in microbatch_shapes), default=0)


def encoder_images_in_flight(plan: BoundaryPlan, rounds: Sequence[int], depth: int, dp_rank: int) -> int:
    """The most images the ranks of encoder data-parallel group `dp_rank` hold activations for:
    the work of `depth` consecutive rounds (`rounds[microbatch]`: its index in its LLM
    data-parallel lane), which the encoder encodes before the oldest one's gradient returns."""
    return _window(_per_round(plan, rounds, dp_rank, lambda work: len(work.images)), depth)


def encoder_rounds_in_flight(plan: BoundaryPlan, rounds: Sequence[int], depth: int, dp_rank: int) -> int:
    """The most rounds with work for group `dp_rank` among `depth` consecutive ones: the forward
    passes its ranks hold at once, as `encoder_images_in_flight` counts their images."""
    return _window(_per_round(plan, rounds, dp_rank, lambda work: 1), depth)


def encoder_tokens_in_flight(plan: BoundaryPlan, rounds: Sequence[int], depth: int, dp_rank: int) -> int:
    """The most image tokens (their rows) the group holds activations for, as
    `encoder_images_in_flight` counts images: what sizes a native tower's work."""
    return _window(_per_round(plan, rounds, dp_rank, lambda work: work.rows), depth)


def llm_boundary(plan: BoundaryPlan, rank: int, *, gradients: bool) -> int:
    """Bytes of LLM `rank`'s boundary buffers at once: the receive buffers of every transfer to it
    in the step, posted up front (`LLMWorker._post_receives`); and of the largest microbatch, its
    spliced image rows and, with `gradients` (an encoder that trains), their gradient and that
    gradient packed to go back."""
    received = [transfer for transfer in plan.transfers if transfer.dst_rank == rank]
    returned = Counter()
    for transfer in received:
        returned[transfer.microbatch] += transfer.rows
    local = max((entry.rows for entry in plan.local_rows if entry.llm_rank == rank), default=0)
    step = (2 * local + max(returned.values(), default=0)) if gradients else local
    return plan.row_bytes * (sum(transfer.rows for transfer in received) + step)


def encoder_boundary(plan: BoundaryPlan, rounds: Sequence[int], depth: int, *, rank: int, dp_rank: int,
                     frozen: bool) -> int:
    """Bytes of encoder `rank`'s (of data-parallel group `dp_rank`) boundary buffers at once: of
    each round in flight (`depth` of them), its output rows and, where the rank sends them (it is
    the transfers' `src_rank`), their packed copies and the buffers their gradients come back in;
    and one round's gradient. A frozen encoder holds every round's rows and copies until the last
    is sent, and gets no gradient."""
    rows = _per_round(plan, rounds, dp_rank, lambda work: work.rows)
    sent = Counter()
    for transfer in plan.transfers:
        if transfer.src_rank == rank:
            sent[rounds[transfer.microbatch]] += transfer.rows
    if frozen:
        return plan.row_bytes * (sum(rows.values()) + sum(sent.values()))
    held = {r: rows.get(r, 0) + 2 * sent[r] for r in {*rows, *sent}}
    return plan.row_bytes * (_window(held, depth) + max(rows.values(), default=0))


def _per_round(plan: BoundaryPlan, rounds: Sequence[int], dp_rank: int, size) -> dict[int, int]:
    per_round: dict[int, int] = {}
    for work in plan.encoder_work:
        if work.encoder_dp_rank == dp_rank:
            per_round[rounds[work.microbatch]] = per_round.get(rounds[work.microbatch], 0) + size(work)
    return per_round


def _window(per_round: dict[int, int], depth: int) -> int:
    """The most of `per_round` over `depth` consecutive rounds."""
    return max((sum(per_round.get(first + r, 0) for r in range(depth)) for first in per_round), default=0)
