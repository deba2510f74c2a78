"""`dyad train --dry-run`: what a resolved run config would train, on how many GPUs, with how much
memory per rank, and the plan of its first step, printed without starting anything (no router,
worker, process group or run directory; torch-free, like the router).

The numbers come from where a run gets them: the models' parameters and the memory estimate from
`dyad.router.estimate`, the first step from the router's `StepPlanner` over the run's dataset.
"""

from __future__ import annotations

from collections.abc import Sequence

from dyad.data import ImageTokens
from dyad.router import estimate
from dyad.router.boundary import BoundaryPlan
from dyad.router.steps import StepPlanner, StepSpec

GIB = 2**30


def describe(config, dataset, source: str) -> str:
    """The dry run's report for `config` (resolved: `dyad.config.resolve`) over `dataset`."""
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    plan = planner.boundary_plan(spec)
    lines = [f"dyad train --dry-run: {source} resolved and checked as a run is; nothing started", ""]
    lines += _models(config, plan)
    lines += ["", *_layouts(config)]
    lines += ["", *_memory(config, dataset, planner.image_tokens, spec, plan)]
    lines += ["", *_step(config, dataset, spec, plan)]
    return "\n".join(lines)


def _models(config, plan: BoundaryPlan) -> list[str]:
    llm, layout = config.llm, config.parallel.llm
    llm_parts = estimate.llm_parts(llm, layout)
    encoder, encoder_layout = config.encoder, config.parallel.encoder
    tower = estimate.total(estimate.encoder_tower_parts(encoder, encoder_layout)
                           + estimate.held_parts(encoder, encoder_layout))
    projector = estimate.total(estimate.projector_parts(encoder, encoder_layout))
    sparse = llm.n_layers - len(llm.dense_layers)
    if encoder.native is None:
        images = f"{encoder.depth} blocks, {encoder.tokens_per_image} tokens per {encoder.image_size}px image"
    else:
        tokens = [image.tokens for work in plan.encoder_work for image in work.images] or [0]
        images = (f"{encoder.native.depth} blocks, native resolution: {min(tokens):,} to {max(tokens):,} tokens "
                  "per image in step 0; " + (f"{llm.deepstack_levels} DeepStack levels cross the boundary with them"
                                              if llm.deepstack_levels else "its DeepStack mergers held"))
    return [
        "models",
        f"  encoder {tower + projector:>15,} parameters: vision tower {tower:,} ({images}), "
        f"{'patch merger' if encoder.native else 'projector'} {projector:,}"
        + (f"  [{encoder.from_hf}]" if encoder.from_hf else ""),
        f"  llm     {estimate.total(llm_parts):>15,} parameters, {estimate.per_token(llm_parts):,} per token "
        f"(top {llm.moe.top_k} of {llm.moe.num_experts} experts in {sparse} of {llm.n_layers} layers), "
        f"vocabulary {llm.vocab_size:,}" + (f"  [{llm.from_hf}]" if llm.from_hf else ""),
    ]


def _layouts(config) -> list[str]:
    parallel = config.parallel
    enc, llm = parallel.encoder, parallel.llm
    return [
        "layouts (one GPU per rank)",
        f"  encoder dp {enc.dp} x tp {enc.tp} = {enc.world_size} ranks{_devices(parallel.encoder_devices)}",
        (f"  llm     tp {llm.tp} x cp {llm.cp} x dp {llm.dp} = {llm.world_size} ranks; experts etp {llm.etp} x "
        f"ep {llm.ep} x edp {llm.edp}{_devices(parallel.llm_devices)}"),
        f"  GPUs: {_gpus(parallel)}",
    ]


def _devices(devices: Sequence[int]) -> str:
    return f", on GPUs {list(devices)} of one host" if devices else ""


def _gpus(parallel) -> str:
    sizes = {"encoder": parallel.encoder.world_size, "llm": parallel.llm.world_size}
    if parallel.encoder_devices and parallel.llm_devices:
        shared = set(parallel.encoder_devices) & set(parallel.llm_devices)
        used = len(set(parallel.encoder_devices) | set(parallel.llm_devices))
        return f"{used} of one host, {'the pools share ' + str(len(shared)) if shared else 'the pools on disjoint ones'}"
    return (f"{sum(sizes.values())} (encoder {sizes['encoder']} + llm {sizes['llm']}); on one host "
            "parallel.<pool>_devices keeps the pools apart (unset, rank r of each pool takes GPU r % count)")


def _memory(config, dataset, image_tokens: ImageTokens, spec: StepSpec, plan: BoundaryPlan) -> list[str]:
    train = config.train
    element_size = estimate.ELEMENT_SIZE[train.dtype]
    enc, enc_layout, llm, llm_layout = config.encoder, config.parallel.encoder, config.llm, config.parallel.llm
    tower = estimate.encoder_tower_parts(enc, enc_layout)
    projector = estimate.projector_parts(enc, enc_layout)
    held_by_encoder = estimate.per_rank(tower + projector + estimate.held_parts(enc, enc_layout))
    llm_parts = estimate.llm_parts(llm, llm_layout)
    frozen = set(train.freeze)
    enc_trained = 0 if "encoder" in frozen else estimate.per_rank(projector) + (
        0 if "vision_tower" in frozen else estimate.per_rank(tower))
    in_flight, activations = _encoder_in_flight(config, spec, plan)
    encoder = estimate.state_memory(
        held_by_encoder, enc_trained, working_weights=train.working_weights, activations=activations,
    )
    tokens = estimate.llm_tokens_per_rank(_microbatch_shapes(dataset, image_tokens, spec), llm_layout)
    held = estimate.per_rank(llm_parts)
    llm_memory = estimate.state_memory(
        held, 0 if "llm" in frozen else held, working_weights=train.working_weights,
        activations=estimate.llm_activations(llm, llm_layout, tokens, element_size=element_size,
                                             recompute="llm" in train.recompute),
    )
    header = f"  {'':8}{'parameters':>15} {'weights':>8} {'grads':>8} {'AdamW':>8} {'activ.':>8} {'total':>8}"
    return [
        (f"memory per rank, GiB (an estimate: float32 weights, gradients and AdamW moments; activations at "
        f"{train.dtype} of {tokens:,} tokens per LLM rank, {in_flight} in flight per encoder rank)"),
        header,
        _memory_row("encoder", held_by_encoder, encoder),
        _memory_row("llm", held, llm_memory),
    ]


def _memory_row(pool: str, held: int, memory: estimate.Memory) -> str:
    cells = (memory.weights, memory.gradients, memory.optimizer, memory.activations, memory.total)
    return f"  {pool:8}{held:>15,} " + " ".join(f"{value / GIB:>8.1f}" for value in cells)


def _rounds(spec: StepSpec) -> list[int]:
    """Each microbatch's index in its LLM data-parallel lane."""
    seen: dict[int, int] = {}
    rounds = []
    for lane in spec.llm_dp_ranks:
        rounds.append(seen.get(lane, 0))
        seen[lane] = rounds[-1] + 1
    return rounds


def _encoder_in_flight(config, spec: StepSpec, plan: BoundaryPlan) -> tuple[str, int]:
    """What an encoder rank holds activations for at once, in words, and their bytes: images of
    a fixed-resolution tower, image tokens of a native one (none when the encoder is frozen)."""
    enc, layout, train = config.encoder, config.parallel.encoder, config.train
    held = "encoder" in train.freeze
    element_size, recompute = estimate.ELEMENT_SIZE[train.dtype], "encoder" in train.recompute
    depth = config.boundary.prefetch_depth
    if enc.native is None:
        images = 0 if held else estimate.encoder_images_in_flight(plan, _rounds(spec), depth)
        activations = estimate.encoder_activations(enc, layout, images, element_size=element_size, recompute=recompute)
        return f"{images} images", activations
    tokens = 0 if held else estimate.encoder_tokens_in_flight(plan, _rounds(spec), depth)
    activations = estimate.native_activations(enc.native, layout, tokens, element_size=element_size,
                                              recompute=recompute)
    return f"{tokens:,} image tokens", activations


def _microbatch_shapes(dataset, image_tokens: ImageTokens, spec: StepSpec) -> list[tuple[int, int]]:
    """Each microbatch's (rows, their padded length): a sample a row, or its packed rows."""
    shapes = []
    for index, ids in enumerate(spec.microbatches):
        lengths = [dataset.shape(s, image_tokens).seq_len for s in ids]
        rows, start = [], 0
        for size in spec.row_sizes[index] if spec.row_sizes else [1] * len(ids):
            rows.append(sum(lengths[start : start + size]))
            start += size
        shapes.append((len(rows), max(rows)))
    return shapes


def _step(config, dataset, spec: StepSpec, plan: BoundaryPlan) -> list[str]:
    train = config.train
    lines = [
        (f"step 0 as the router plans it: {sum(map(len, spec.microbatches))} samples, {spec.tokens:,} tokens "
        f"({spec.target_tokens:,} caption targets), {len(spec.microbatches)} microbatches "
        f"({train.microbatches} per LLM dp rank), rows of {plan.hidden} x {plan.element_size} bytes"),
    ]
    for index, (ids, lane) in enumerate(zip(spec.microbatches, spec.llm_dp_ranks)):
        work = [w for w in plan.encoder_work if w.microbatch == index]
        encoded = ", ".join(f"encoder dp {w.encoder_dp_rank}: {len(w.images)} images" for w in work) or "no images"
        sends = ", ".join(f"encoder {t.src_rank} -> llm {t.dst_rank}: {t.rows:,} rows"
                          for t in plan.transfers if t.microbatch == index)
        packed = f" packed in {len(spec.row_sizes[index])} rows" if spec.row_sizes else ""
        lines.append(f"  microbatch {index} (llm dp {lane}): {len(ids)} samples{packed}; {encoded}")
        if sends:
            lines.append(f"    {sends}")
    lines.append(
        f"  boundary: {plan.bytes_forward / 2**20:,.1f} MiB to the LLM, {plan.bytes_backward / 2**20:,.1f} MiB of "
        f"gradient back; encoder imbalance {plan.encoder_imbalance:.2f} (max / mean cost per encoder dp rank)"
    )
    return lines
