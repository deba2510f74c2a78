"""`dyad plan` and `dyad train --dry-run` (the same report): what a resolved run config would train,
on how many GPUs, with how much memory on each rank, and the plan of its first step, printed
without starting anything (no router, worker, process group or run directory; torch-free, like
the router). Given a device's memory, each rank whose estimate exceeds it, and each GPU whose
ranks' estimates together do, gets a warning saying by how much.

The numbers come from where a run gets them: the models' parameters and the memory estimate from
`dyad.router.estimate`, the first step from the router's `StepPlanner` over the run's dataset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dyad.data import ImageTokens
from dyad.layout import EncoderLayout, LLMLayout
from dyad.pipeline_schedule import live_passes
from dyad.router import estimate
from dyad.router.boundary import BoundaryPlan
from dyad.router.steps import StepPlanner, StepSpec

GIB = 2**30
TERMS = ("weights", "casts", "gradients", "optimizer", "activations", "boundary", "reduction")
HEADINGS = ("weights", "casts", "grads", "AdamW", "activ.", "bound.", "reduce")


@dataclass(frozen=True)
class RankMemory:
    """The estimate of one rank of a pool, and where it sits in the pool's layout."""

    pool: str
    rank: int
    coords: dict[str, int]  # on the layout's axes of more than one rank
    memory: estimate.Memory


def describe(config, dataset, source: str, *, command: str = "dyad train --dry-run",
             device_memory: float | None = None) -> str:
    """The report for `config` (resolved: `dyad.config.resolve`) over `dataset`; with
    `device_memory` (GiB) its warnings last."""
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    plan = planner.boundary_plan(spec)
    ranks = rank_memories(config, dataset, planner.image_tokens, spec, plan)
    lines = [f"{command}: {source} resolved and checked as a run is; nothing started", ""]
    lines += _models(config, plan)
    lines += ["", *_layouts(config)]
    lines += ["", *_memory(config, dataset, planner.image_tokens, spec, plan, ranks)]
    lines += ["", *_step(config, dataset, spec, plan)]
    if device_memory is not None:
        lines += ["", *shortfalls(config, ranks, device_memory)]
    return "\n".join(lines)


def rank_memories(config, dataset, image_tokens: ImageTokens, spec: StepSpec, plan: BoundaryPlan) -> list[RankMemory]:
    """The estimate of every rank of both pools for the step `spec`, planned as `plan`."""
    return [*_encoder_ranks(config, spec, plan), *_llm_ranks(config, dataset, image_tokens, spec, plan)]


def shortfalls(config, ranks: Sequence[RankMemory], device_memory: float) -> list[str]:
    """A warning for each rank whose estimate exceeds `device_memory` GiB, and for each GPU that
    holds several ranks (`parallel.<pool>_devices`) whose estimates together do; or a line saying
    every one fits."""
    limit = device_memory * GIB
    warnings = [
        f"warning: {r.pool} rank {r.rank} ({_coords(r.coords)}) needs an estimated {_gib(r.memory.total)} GiB, "
        f"{_gib(r.memory.total - limit)} GiB more than the device's {device_memory:g} GiB"
        for r in ranks if r.memory.total > limit
    ]
    for gpu, shared in _shared_gpus(config, ranks).items():
        together = sum(r.memory.total for r in shared)
        if together > limit:
            warnings.append(
                f"warning: GPU {gpu} holds {' and '.join(f'{r.pool} rank {r.rank}' for r in shared)}, an estimated "
                f"{_gib(together)} GiB together, {_gib(together - limit)} GiB more than the device's "
                f"{device_memory:g} GiB"
            )
    largest = most_on_a_gpu(config, ranks)
    return warnings or [f"every rank fits a device of {device_memory:g} GiB (the most on one: {_gib(largest)} GiB)"]


def most_on_a_gpu(config, ranks: Sequence[RankMemory]) -> int:
    """The largest estimate of one GPU: of a rank, or of the ranks that share one GPU."""
    return max([r.memory.total for r in ranks]
               + [sum(r.memory.total for r in shared) for shared in _shared_gpus(config, ranks).values()])


def _models(config, plan: BoundaryPlan) -> list[str]:
    llm, layout = config.llm, config.parallel.llm
    llm_parts = estimate.llm_parts(llm, layout)
    encoder, encoder_layout = config.encoder, config.parallel.encoder
    tower = estimate.total(estimate.encoder_tower_parts(encoder, encoder_layout)
                           + estimate.deepstack_parts(encoder, encoder_layout))
    projector = estimate.total(estimate.projector_parts(encoder, encoder_layout))
    sparse = llm.n_layers - len(llm.dense_layers)
    if encoder.native is None:
        images = f"{encoder.depth} blocks, {encoder.tokens_per_image} tokens per {encoder.image_size}px image"
    else:
        tokens = [image.tokens for work in plan.encoder_work for image in work.images] or [0]
        images = (f"{encoder.native.depth} blocks, native resolution: {min(tokens):,} to {max(tokens):,} tokens "
                  "per image in step 0; " + (f"{llm.deepstack_levels} DeepStack levels cross the boundary with them"
                                              if llm.reads_deepstack else "its DeepStack mergers held"))
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
        (f"  llm     tp {llm.tp} x cp {llm.cp} x dp {llm.dp}{_pipeline(llm)} = {llm.world_size} ranks; experts etp "
        f"{llm.etp} x ep {llm.ep} x edp {llm.edp}{_stages(llm)}{_devices(parallel.llm_devices)}"),
        f"  GPUs: {_gpus(parallel)}",
    ]


def _pipeline(llm) -> str:
    return f" x pp {llm.pp}" if llm.pp > 1 else ""


def _stages(llm) -> str:
    if llm.pp == 1:
        return ""
    chunks = f", {llm.pp_virtual} chunks a rank (interleaved)" if llm.pp_virtual > 1 else ""
    layers = f", layers per stage {list(llm.pp_layers)}" if llm.pp_layers else ""
    return f" in each stage{chunks}{layers}"


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


# ---- memory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolParameters:
    """A pool's parameters on one rank: what trains, what is held, and what autocast casts."""

    layout: EncoderLayout | LLMLayout
    trained: list[estimate.Part]
    held: list[estimate.Part]
    casts: int

    def state(self, train) -> estimate.State:
        return estimate.state_memory(self.trained, self.held, self.layout, working_weights=train.working_weights,
                                     shard_optimizer=train.shard_optimizer)


def pool_parameters(config, pp_rank: int = 0) -> dict[str, PoolParameters]:
    """The encoder: nothing trains under train.freeze "encoder", only the projector (with a native
    tower's DeepStack mergers where the LLM reads their levels, else they are held unread) under
    "vision_tower"; what trains is cast (no gradient flows through the rest). The LLM: nothing
    trains under "llm"; its matrices are cast wherever a gradient flows through it (into the
    encoder's rows when the LLM is frozen); a rank of pipeline rank `pp_rank` holds its stages'."""
    train, parallel = config.train, config.parallel
    enc, enc_layout = config.encoder, parallel.encoder
    tower, projector = estimate.encoder_tower_parts(enc, enc_layout), estimate.projector_parts(enc, enc_layout)
    deepstack = estimate.deepstack_parts(enc, enc_layout)
    read, unread = (deepstack, []) if config.llm.reads_deepstack else ([], deepstack)
    encoder_frozen = "encoder" in train.freeze
    trained = [] if encoder_frozen else projector + read + ([] if "vision_tower" in train.freeze else tower)
    held = [part for part in tower + projector + read if part not in trained] + unread
    encoder = PoolParameters(enc_layout, trained, held, estimate.weight_casts(trained) if _casts(train) else 0)
    parts = estimate.llm_parts(config.llm, parallel.llm, sequence_parallel=parallel.sequence_parallel, pp_rank=pp_rank)
    llm_frozen = "llm" in train.freeze
    casts = _casts(train) and not (llm_frozen and encoder_frozen)
    llm = PoolParameters(parallel.llm, [] if llm_frozen else parts, parts if llm_frozen else [],
                estimate.weight_casts(parts) if casts else 0)
    return {"encoder": encoder, "llm": llm}


def _casts(train) -> bool:
    """Whether autocast casts the matrices: bfloat16 compute from float32 weights."""
    return train.dtype == "bfloat16" and not train.working_weights


def _encoder_ranks(config, spec: StepSpec, plan: BoundaryPlan) -> list[RankMemory]:
    pool, layout = pool_parameters(config)["encoder"], config.parallel.encoder
    state = pool.state(config.train)
    rounds, depth = _rounds(spec), config.boundary.prefetch_depth
    ranks = []
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        _, activations = _encoder_in_flight(config, rounds, plan, coords["dp"])
        boundary = estimate.encoder_boundary(plan, rounds, depth, rank=rank, dp_rank=coords["dp"],
                                             frozen="encoder" in config.train.freeze)
        casts = estimate.casts_in_flight(pool.casts, recompute="encoder" in config.train.recompute,
                                         passes=estimate.encoder_rounds_in_flight(plan, rounds, depth, coords["dp"]))
        memory = estimate.Memory(state.weights, casts, state.gradients, state.optimizer, activations, boundary,
                                 state.reduction)
        ranks.append(RankMemory("encoder", rank, _spread(coords, layout.axes()), memory))
    return ranks


def _llm_ranks(config, dataset, image_tokens: ImageTokens, spec: StepSpec, plan: BoundaryPlan) -> list[RankMemory]:
    layout, train = config.parallel.llm, config.train
    pools = [pool_parameters(config, pp_rank)["llm"] for pp_rank in range(layout.pp)]
    shapes = microbatch_shapes(dataset, image_tokens, spec)
    ranks = []
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        pool = pools[coords["pp"]]
        state = pool.state(train)
        lane = [shape for shape, dp_rank in zip(shapes, spec.llm_dp_ranks) if dp_rank == coords["dp"]]
        live, recompute = live_passes(layout.pp, coords["pp"], len(lane), layout.pp_virtual), "llm" in train.recompute
        activations = estimate.llm_activations(
            config.llm, layout, estimate.llm_tokens_per_rank(lane, layout),
            element_size=estimate.ELEMENT_SIZE[train.dtype], recompute=recompute, pp_rank=coords["pp"], live=live,
        )
        boundary = estimate.llm_boundary(plan, rank, gradients="encoder" not in train.freeze)
        casts = estimate.casts_in_flight(pool.casts, passes=live, chunks=layout.pp_virtual, recompute=recompute)
        memory = estimate.Memory(state.weights, casts, state.gradients, state.optimizer, activations, boundary,
                                 state.reduction)
        ranks.append(RankMemory("llm", rank, _spread(coords, layout.attention_axes() | layout.expert_axes()),
                                memory))
    return ranks


def _memory(config, dataset, image_tokens: ImageTokens, spec: StepSpec, plan: BoundaryPlan,
            ranks: Sequence[RankMemory]) -> list[str]:
    train, parallel = config.train, config.parallel
    tokens = estimate.llm_tokens_per_rank(microbatch_shapes(dataset, image_tokens, spec), parallel.llm)
    in_flight = max(_encoder_in_flight(config, _rounds(spec), plan, dp)[0] for dp in range(parallel.encoder.dp))
    lines = [
        (f"memory per rank, GiB (an estimate of a step's peak, dyad/router/estimate.py: activations at {train.dtype} "
         f"of at most {tokens:,} tokens per LLM rank, {in_flight:,} {_in_flight_unit(config)} in flight per encoder "
         "rank)"),
        *_pool_lines(config),
    ]
    rows = [(f"{pool} {_ranges([r.rank for r in same])}", _cells(same[0].memory))
            for pool in ("encoder", "llm") for same in _alike([r for r in ranks if r.pool == pool])]
    width = max(len(label) for label, _ in rows) + 1
    lines.append(f"  {'':{width}}" + " ".join(f"{heading:>7}" for heading in (*HEADINGS, "total")))
    lines += [f"  {label:{width}}{cells}" for label, cells in rows]
    lines += _gpu_lines(config, ranks)
    return lines


def _pool_lines(config) -> list[str]:
    """Per pool: the parameters a rank holds, and how its optimizer state is kept."""
    lines = []
    for name, pool in pool_parameters(config).items():
        held = estimate.per_rank(pool.trained + pool.held)
        if name == "llm" and config.parallel.llm.pp > 1:
            stages = [estimate.per_rank(p.trained + p.held)
                      for p in (pool_parameters(config, r)["llm"] for r in range(config.parallel.llm.pp))]
            held = f"{min(stages):,} to {max(stages):,}"
        if not pool.trained:
            optimizer = "nothing trains"
        elif not config.train.shard_optimizer:
            optimizer = "AdamW whole on every rank (train.shard_optimizer false)"
        elif estimate.sharded(pool.trained, pool.layout, shard_optimizer=True):
            groups = {part.group: estimate.group_size(pool.layout, part.group) for part in pool.trained}
            optimizer = "AdamW sharded over the ranks of " + ", ".join(f"{g} ({n})" for g, n in groups.items())
        else:
            optimizer = "AdamW whole: no parameter has replicas"
        lines.append(f"  {name}: {held if isinstance(held, str) else f'{held:,}'} parameters per rank; {optimizer}")
    return lines


def _alike(ranks: Sequence[RankMemory]) -> list[list[RankMemory]]:
    """The ranks grouped by the row they print, in rank order of each group's first."""
    groups: dict[str, list[RankMemory]] = {}
    for r in ranks:
        groups.setdefault(_cells(r.memory), []).append(r)
    return list(groups.values())


def _cells(memory: estimate.Memory) -> str:
    values = [getattr(memory, term) for term in TERMS] + [memory.total]
    return " ".join(f"{value / GIB:>7.1f}" for value in values)


def _ranges(ranks: Sequence[int]) -> str:
    """0, 1, 2, 5 -> "0-2,5"."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _shared_gpus(config, ranks: Sequence[RankMemory]) -> dict[int, list[RankMemory]]:
    """The GPUs of one host that `parallel.<pool>_devices` give several ranks, and those ranks."""
    parallel = config.parallel
    devices = {"encoder": parallel.encoder_devices, "llm": parallel.llm_devices}
    if not all(devices.values()):
        return {}
    on: dict[int, list[RankMemory]] = {}
    for r in ranks:
        on.setdefault(parallel.local_gpu(r.pool, r.rank, max(devices[r.pool]) + 1), []).append(r)
    return {gpu: held for gpu, held in sorted(on.items()) if len(held) > 1}


def _gpu_lines(config, ranks: Sequence[RankMemory]) -> list[str]:
    shared = _shared_gpus(config, ranks)
    if not shared:
        return []
    lines = ["  GPUs that hold several ranks:"]
    for gpu, held in shared.items():
        names = " + ".join(f"{r.pool} {r.rank}" for r in held)
        lines.append(f"    GPU {gpu}: {names} = {_gib(sum(r.memory.total for r in held))} GiB")
    return lines


def _spread(coords: dict[str, int], axes: dict[str, int]) -> dict[str, int]:
    return {axis: index for axis, index in coords.items() if axes[axis] > 1}


def _coords(coords: dict[str, int]) -> str:
    return ", ".join(f"{axis} {index}" for axis, index in coords.items())


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def _rounds(spec: StepSpec) -> list[int]:
    """Each microbatch's index in its LLM data-parallel lane."""
    seen: dict[int, int] = {}
    rounds = []
    for lane in spec.llm_dp_ranks:
        rounds.append(seen.get(lane, 0))
        seen[lane] = rounds[-1] + 1
    return rounds


def _in_flight_unit(config) -> str:
    return "images" if config.encoder.native is None else "image tokens"


def _encoder_in_flight(config, rounds: Sequence[int], plan: BoundaryPlan, dp_rank: int) -> tuple[int, int]:
    """What the ranks of encoder data-parallel group `dp_rank` hold activations for at once, and
    its bytes: images of a fixed-resolution tower, image tokens of a native one (none when the
    encoder is frozen)."""
    enc, layout, train = config.encoder, config.parallel.encoder, config.train
    held = "encoder" in train.freeze
    element_size, recompute = estimate.ELEMENT_SIZE[train.dtype], "encoder" in train.recompute
    depth = config.boundary.prefetch_depth
    if enc.native is None:
        images = 0 if held else estimate.encoder_images_in_flight(plan, rounds, depth, dp_rank)
        return images, estimate.encoder_activations(enc, layout, images, element_size=element_size,
                                                    recompute=recompute)
    tokens = 0 if held else estimate.encoder_tokens_in_flight(plan, rounds, depth, dp_rank)
    return tokens, estimate.native_activations(enc.native, layout, tokens, element_size=element_size,
                                               recompute=recompute, deepstack_levels=config.llm.deepstack_levels)


def microbatch_shapes(dataset, image_tokens: ImageTokens, spec: StepSpec) -> list[tuple[int, int]]:
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
