"""`dyad plan CONFIG --gpus N --profile PROFILE.json`: how to split N GPUs between the two pools,
and each pool's layout, predicted from a short profile of each module on one GPU
(`bench/module_profile.py`, fitted by dyad/app/module_costs.py), the router's own plan of a step
under each candidate and `dyad plan`'s memory estimate. Torch-free, like the rest of `dyad plan`.

A first model, not yet checked against measured runs (docs/scaling.md, "Choosing the split of
GPUs"). Every assumption is written here; the links and efficiencies are `Machine`'s.

Candidates on N GPUs:
- split E+L (non-colocated): the encoder pool on GPUs 0..E-1, the LLM pool on the other L = N - E;
- colocated: both pools on all N GPUs (rank r of each on GPU r), each with its own layout;
- homogeneous: both on all N GPUs with one layout: the encoder takes the LLM's tp and is
  data-parallel over the rest (listed apart from the colocated candidate it equals).
A pool's layouts: the encoder's every dp x tp of its GPUs, the LLM's every tp x cp x dp with
every ep and etp, pp 1 (pipelines are not searched), tp within a host; those the models refuse
(`validate_encoder_layout`, `validate_llm_layout`) are none. Each LLM data-parallel lane keeps
the config's samples per microbatch (`train.microbatches` follows the LLM's dp). The whole config
is then resolved as a run's is: a candidate it refuses is excluded with its reason (the field
named), as is one whose estimated memory (`rank_memories`) on some GPU exceeds the device's.

The step, as the router plans step 0 for the candidate (the same samples for every one):
- encoder: each dp group runs each microbatch's images in one call (`ModuleCosts.encoder_ms`,
  the images assigned by the router's cost balancing); tp divides the work that grows with the
  images, at `tp_efficiency`, and adds per block two all-reduces of the call's patches forward
  and two backward. The slowest group's calls, then the exposed gradient reduction and AdamW.
  A frozen encoder runs forward only, without reduction or AdamW.
- LLM: each dp lane's microbatches, rows padded as the run pads them (`microbatch_shapes`); tp
  and cp divide the work that grows with the tokens (at `tp_efficiency`, `cp_efficiency`), ep
  and etp none (the routing assumed balanced); per layer tp adds two all-reduces of the rank's
  tokens forward and two backward, cp an all-gather of keys and values forward and a
  reduce-scatter backward, and per MoE layer the dispatch and combine all-to-alls both ways over
  ep x etp. The slowest lane, then the exposed gradient reduction and AdamW.
- No collective overlaps compute, but the gradient reduction (train.overlap_grad_reduce: only its
  last bucket's share is exposed; the sharded optimizer's all-gather of the update is exposed
  whole). A collective over ranks more than a host apart runs at `inter_host_bytes_per_s`.
- split E+L: max(encoder, LLM) + min(encoder, LLM) / rounds: the pools overlap (the encoder works
  ahead), but one round of the lesser fills and drains the two-stage pipeline; colocated and
  homogeneous: encoder + LLM, one after the other on the shared GPUs. Both plus the boundary's
  exposed transfers: the first round's rows and the last round's gradients (each message
  `boundary_message_s`, its bytes at `boundary_bytes_per_s`); the rest hides behind compute.
- tokens/s: the step's sequence tokens (text and image rows) over the step time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dyad import config as config_lib
from dyad.app.dry_run import GIB, microbatch_shapes, most_on_a_gpu, pool_parameters, rank_memories
from dyad.app.module_costs import ModuleCosts
from dyad.layout import EncoderLayout, LLMLayout, validate_encoder_layout, validate_llm_layout
from dyad.parallel.buckets import BUCKET_BYTES
from dyad.router import estimate
from dyad.router.boundary import BoundaryPlan
from dyad.router.encoder_cost import image_patches
from dyad.router.steps import StepPlanner, StepSpec


@dataclass(frozen=True)
class Machine:
    """The links and efficiencies the model assumes (H200s, eight to a host)."""

    # NCCL send/recv of 256 MB between two H200s over NVLink (NV18): ../shared/gpu/README.md,
    # measured 2026-11-22. All-reduces, all-gathers and reduce-scatters within a host use it.
    link_bytes_per_s: float = 358e9
    # NCCL all_to_all of 256 MB on two H200s, the same page: the MoE dispatch within a host.
    all_to_all_bytes_per_s: float = 277e9
    # Between hosts: 400 Gb/s InfiniBand per GPU, nominal; not measured here.
    inter_host_bytes_per_s: float = 50e9
    gpus_per_host: int = 8
    # The boundary (ucxx, cuda_ipc): 341 GB/s with 64 messages of 64 MB in flight, and about
    # 0.15 ms a message one at a time (docs/performance.md, "Boundary transfer").
    boundary_bytes_per_s: float = 341e9
    boundary_message_s: float = 0.15e-3
    # The share of ideal speed-up tensor and context parallelism keep on the compute they divide
    # (smaller matmuls, load imbalance of the causal shards): assumed, not measured.
    tp_efficiency: float = 0.85
    cp_efficiency: float = 0.9

    def bandwidth(self, layout: EncoderLayout | LLMLayout, group: str, *, all_to_all: bool = False) -> float:
        """Bytes/s of a collective over the group kind `group` of `layout`: a host's link where its
        ranks lie within `gpus_per_host` consecutive ones of the pool (where the pool starts on
        its host is not taken into account), else between hosts."""
        if _span(layout, group) > self.gpus_per_host:
            return self.inter_host_bytes_per_s
        return self.all_to_all_bytes_per_s if all_to_all else self.link_bytes_per_s


@functools.cache
def _span(layout: EncoderLayout | LLMLayout, group: str) -> int:
    """How many consecutive ranks of its pool a group of the named kind reaches over."""
    ranks = layout.groups(group)[0]
    return ranks[-1] - ranks[0] + 1


H200 = Machine()


@dataclass(frozen=True)
class Candidate:
    placement: str  # "E+L", "colocated" or "homogeneous"
    encoder: EncoderLayout
    llm: LLMLayout
    microbatches: int  # train.microbatches: per LLM dp lane

    @property
    def colocated(self) -> bool:
        return "+" not in self.placement

    def devices(self, gpus: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """parallel.encoder_devices, parallel.llm_devices (GPU indices across hosts)."""
        if self.colocated:
            return tuple(range(gpus)), tuple(range(gpus))
        split = self.encoder.world_size
        return tuple(range(split)), tuple(range(split, gpus))

    def overrides(self, config, gpus: int, machine: Machine) -> list[str]:
        """The fields that make `config` this candidate (the device lists where one host holds it)."""
        e, m = self.encoder, self.llm
        fields = [f"parallel.encoder.dp={e.dp}", f"parallel.encoder.tp={e.tp}"]
        fields += [f"parallel.llm.{axis}={getattr(m, axis)}" for axis in ("tp", "cp", "dp", "ep", "etp")]
        if config.parallel.llm.pp > 1:
            fields += ["parallel.llm.pp=1", "parallel.llm.pp_virtual=1", "parallel.llm.pp_layers=[]"]
        if config.parallel.sequence_parallel and m.tp == 1:
            fields.append("parallel.sequence_parallel=false")
        fields.append(f"train.microbatches={self.microbatches}")
        if gpus <= machine.gpus_per_host:
            encoder_devices, llm_devices = self.devices(gpus)
            fields += [f"parallel.encoder_devices=[{','.join(map(str, encoder_devices))}]",
                       f"parallel.llm_devices=[{','.join(map(str, llm_devices))}]"]
        return fields


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    excluded: str = ""  # why it cannot run; "" where it can
    encoder_s: float = 0.0
    llm_s: float = 0.0
    boundary_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    memory_gib: float = 0.0  # the most on one GPU


def recommend(config, dataset, costs: ModuleCosts, gpus: int, *, device_memory: float | None,
              machine: Machine = H200) -> list[Prediction]:
    """Every candidate on `gpus` GPUs for the resolved `config`: those that can run fastest first,
    then the excluded ones."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    predictions = [_predict(config, dataset, costs, c, gpus, device_memory, machine)
                   for c in candidates(config, gpus, machine)]
    return sorted(predictions, key=lambda p: (bool(p.excluded), -p.tokens_per_s, *_simplicity(p.candidate)))


def _simplicity(candidate: Candidate) -> tuple[int, int]:
    """Between candidates predicted alike, the one that cuts the experts' width least (the model
    does not see that etp makes their matmuls smaller), then the one with the fewest cuts."""
    llm = candidate.llm
    return llm.etp, llm.tp * llm.cp * llm.ep * candidate.encoder.tp


# ---- candidates -----------------------------------------------------------------------------


def candidates(config, gpus: int, machine: Machine = H200) -> list[Candidate]:
    """Every placement and pair of layouts on `gpus` GPUs (the module docstring)."""
    found = []
    for encoder_gpus in range(1, gpus):
        for llm in llm_layouts(config, gpus - encoder_gpus, machine):
            found += [Candidate(f"{encoder_gpus}+{gpus - encoder_gpus}", encoder, llm, _microbatches(config, llm))
                      for encoder in encoder_layouts(config, encoder_gpus)]
    shared = encoder_layouts(config, gpus)
    for llm in llm_layouts(config, gpus, machine):
        for encoder in shared:
            placement = "homogeneous" if encoder.tp == llm.tp else "colocated"
            found.append(Candidate(placement, encoder, llm, _microbatches(config, llm)))
    return found


def encoder_layouts(config, world: int) -> list[EncoderLayout]:
    tower = config.encoder.native or config.encoder
    return [layout for layout in (EncoderLayout(dp=world // tp, tp=tp) for tp in _divisors(world))
            if _accepts(validate_encoder_layout, layout, tower)]


def llm_layouts(config, world: int, machine: Machine = H200) -> list[LLMLayout]:
    layouts = []
    for tp in (d for d in _divisors(world) if d <= machine.gpus_per_host):
        for cp in _divisors(world // tp):
            for ep in _divisors(world):
                for etp in _divisors(world // ep):
                    try:
                        layout = LLMLayout(tp=tp, cp=cp, dp=world // (tp * cp), ep=ep, etp=etp)
                    except ValueError:  # etp*ep must divide the stage
                        continue
                    if _accepts(validate_llm_layout, layout, config.llm):
                        layouts.append(layout)
    return layouts


def _accepts(validate, layout, model) -> bool:
    try:
        validate(layout, model)
    except ValueError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _microbatches(config, llm: LLMLayout) -> int:
    """train.microbatches that keeps the config's samples per microbatch at `llm.dp` lanes."""
    train = config.train
    per_microbatch = train.global_batch / (train.microbatches * config.parallel.llm.dp)
    return max(1, round(train.global_batch / (llm.dp * per_microbatch)))


def candidate_config(config, candidate: Candidate, gpus: int):
    """`config` with the candidate's layouts, devices and microbatches, resolved as a run's is
    (ValueError naming the field it refuses)."""
    encoder_devices, llm_devices = candidate.devices(gpus)
    parallel = dataclasses.replace(
        config.parallel, encoder=candidate.encoder, llm=candidate.llm, encoder_devices=encoder_devices,
        llm_devices=llm_devices, sequence_parallel=config.parallel.sequence_parallel and candidate.llm.tp > 1,
    )
    train = dataclasses.replace(config.train, microbatches=candidate.microbatches)
    return config_lib.resolve(dataclasses.replace(config, parallel=parallel, train=train))


# ---- the step's time ------------------------------------------------------------------------


def _predict(config, dataset, costs: ModuleCosts, candidate: Candidate, gpus: int, device_memory: float | None,
             machine: Machine) -> Prediction:
    try:
        config = candidate_config(config, candidate, gpus)
    except ValueError as error:
        return Prediction(candidate, excluded=str(error))
    planner = StepPlanner(config, dataset)
    spec = planner.next(0)
    plan = planner.boundary_plan(spec)
    ranks = rank_memories(config, dataset, planner.image_tokens, spec, plan)
    memory = most_on_a_gpu(config, ranks) / GIB
    optimizer_parameters = {pool: next(r for r in ranks if r.pool == pool).memory.optimizer
                            / (estimate.ADAMW_STATES * estimate.FLOAT32) for pool in ("encoder", "llm")}
    encoder = encoder_seconds(config, plan, costs, machine, optimizer_parameters["encoder"])
    llm = llm_seconds(config, dataset, planner.image_tokens, spec, costs, machine, optimizer_parameters["llm"])
    boundary = boundary_seconds(config, spec, plan, machine)
    if candidate.colocated:
        step = encoder + llm + boundary
    else:
        step = max(encoder, llm) + min(encoder, llm) / config.train.microbatches + boundary
    excluded = ""
    if device_memory is not None and memory > device_memory:
        excluded = f"memory: an estimated {memory:.1f} GiB on one GPU, more than the device's {device_memory:g} GiB"
    return Prediction(candidate, excluded, encoder, llm, boundary, step, spec.tokens / step, memory)


def encoder_seconds(config, plan: BoundaryPlan, costs: ModuleCosts, machine: Machine,
                    optimizer_parameters: float) -> float:
    """The encoder pool's step: its slowest dp group's calls, then its gradient reduction and AdamW."""
    layout, train = config.parallel.encoder, config.train
    tower = config.encoder.native or config.encoder
    frozen = "encoder" in train.freeze
    share = 1 / (layout.tp * (machine.tp_efficiency if layout.tp > 1 else 1))
    patches_of, element_size = image_patches(config.encoder), estimate.ELEMENT_SIZE[train.dtype]
    groups = [0.0] * layout.dp
    for work in plan.encoder_work:
        tokens = [image.tokens for image in work.images]
        seconds = costs.encoder_ms(tokens, backward=not frozen, share=share) / 1e3
        activations = sum(patches_of(t) for t in tokens) * tower.dim * element_size
        all_reduces = (2 if frozen else 4) * tower.depth
        seconds += all_reduces * _all_reduce(activations, layout.tp, machine.bandwidth(layout, "tp"))
        groups[work.encoder_dp_rank] += seconds
    if frozen:
        return max(groups)
    trained = pool_parameters(config)["encoder"].trained
    return (max(groups) + _reduction_seconds(trained, layout, train, machine)
            + optimizer_parameters * costs.optimizer_ms_per_parameter / 1e3)


def llm_seconds(config, dataset, image_tokens, spec: StepSpec, costs: ModuleCosts, machine: Machine,
                optimizer_parameters: float) -> float:
    """The LLM pool's step: its slowest lane's microbatches, then its gradient reduction and AdamW."""
    layout, train, llm = config.parallel.llm, config.train, config.llm
    share = 1 / (layout.tp * (machine.tp_efficiency if layout.tp > 1 else 1)
                 * layout.cp * (machine.cp_efficiency if layout.cp > 1 else 1))
    lanes = [0.0] * layout.dp
    for (rows, length), lane in zip(microbatch_shapes(dataset, image_tokens, spec), spec.llm_dp_ranks, strict=True):
        lanes[lane] += (costs.llm_ms([length] * rows, llm.n_layers, share=share) / 1e3
                        + _llm_collectives(config, rows * length, machine))
    seconds = max(lanes)
    if "llm" in train.freeze:
        return seconds
    trained = pool_parameters(config)["llm"].trained
    return (seconds + _reduction_seconds(trained, layout, train, machine)
            + optimizer_parameters * costs.optimizer_ms_per_parameter / 1e3)


def _llm_collectives(config, tokens: int, machine: Machine) -> float:
    """One microbatch of `tokens` on one LLM rank: tp's all-reduces, cp's key-value all-gathers,
    the experts' all-to-alls."""
    layout, llm = config.parallel.llm, config.llm
    element_size = estimate.ELEMENT_SIZE[config.train.dtype]
    held = tokens / layout.cp  # this rank's share of the sequences
    moe_layers = llm.n_layers - len(llm.dense_layers)
    seconds = 4 * llm.n_layers * _all_reduce(held * llm.dim * element_size, layout.tp,
                                             machine.bandwidth(layout, "tp"))
    keys_values = 2 * tokens * llm.n_kv_heads * llm.head_dim / layout.tp * element_size
    seconds += 2 * llm.n_layers * _all_gather(keys_values, layout.cp, machine.bandwidth(layout, "cp"))
    experts = layout.ep * layout.etp
    routed = held / layout.tp * llm.moe.top_k * llm.dim * element_size
    seconds += 4 * moe_layers * (experts - 1) / experts * routed / machine.bandwidth(layout, "ep_etp", all_to_all=True)
    return seconds


def _reduction_seconds(trained: Sequence[estimate.Part], layout, train, machine: Machine) -> float:
    """The exposed part of a step's gradient reduction: with train.overlap_grad_reduce the last
    bucket's share of it (the rest overlaps the backward pass), and with the optimizer sharded
    the all-gather of the update, whole."""
    by_group = Counter()
    for part in trained:
        by_group[part.group] += estimate.FLOAT32 * part.per_rank
    total = sum(by_group.values())
    if not total:
        return 0.0
    is_sharded = estimate.sharded(trained, layout, shard_optimizer=train.shard_optimizer)
    exposed = min(1.0, BUCKET_BYTES / total) if train.overlap_grad_reduce else 1.0
    seconds = 0.0
    for group, nbytes in by_group.items():
        size, bandwidth = estimate.group_size(layout, group), machine.bandwidth(layout, group)
        if is_sharded:
            seconds += exposed * _all_gather(nbytes, size, bandwidth) + _all_gather(nbytes, size, bandwidth)
        else:
            seconds += exposed * _all_reduce(nbytes, size, bandwidth)
    return seconds


def boundary_seconds(config, spec: StepSpec, plan: BoundaryPlan, machine: Machine) -> float:
    """The boundary's exposed transfers: the first round's rows, and the last round's gradients
    (none to a frozen encoder), to the LLM rank that receives most."""
    lanes: dict[int, list[int]] = {}
    for index, lane in enumerate(spec.llm_dp_ranks):
        lanes.setdefault(lane, []).append(index)
    rounds = [{mbs[0] for mbs in lanes.values()}]
    if "encoder" not in config.train.freeze:
        rounds.append({mbs[-1] for mbs in lanes.values()})
    seconds = 0.0
    for microbatches in rounds:
        received: dict[int, list[int]] = {}
        for transfer in plan.transfers:
            if transfer.microbatch in microbatches:
                received.setdefault(transfer.dst_rank, []).append(transfer.rows * plan.row_bytes)
        seconds += max((len(sizes) * machine.boundary_message_s + sum(sizes) / machine.boundary_bytes_per_s
                        for sizes in received.values()), default=0.0)
    return seconds


def _all_reduce(nbytes: float, ranks: int, bandwidth: float) -> float:
    return 2 * _all_gather(nbytes, ranks, bandwidth)


def _all_gather(nbytes: float, ranks: int, bandwidth: float) -> float:
    """A ring all-gather (or reduce-scatter) of `nbytes` in all over `ranks` ranks."""
    return (ranks - 1) / ranks * nbytes / bandwidth


# ---- the report -----------------------------------------------------------------------------


def describe(predictions: Sequence[Prediction], config, costs: ModuleCosts, gpus: int, source: str, *,
             device_memory: float | None, memory_source: str, top: int, machine: Machine = H200) -> str:
    runnable = [p for p in predictions if not p.excluded]
    excluded = [p for p in predictions if p.excluded]
    lines = [
        (f"dyad plan --gpus {gpus}: {source} on {gpus} GPU{'s' if gpus > 1 else ''}, predicted from the profile "
         f"{costs.source} ({costs.device}); a model, not yet checked against measured runs (docs/scaling.md)"),
        f"  the profile's curves fit its points within {_fit_error(costs):.0%}; "
        + (f"memory against {device_memory:g} GiB a GPU ({memory_source})" if device_memory is not None
           else "memory not checked (no --device-memory, and the profile names no GPU's)"),
        "",
    ]
    if runnable:
        lines += _table(runnable[: top or None], gpus)
        if top and len(runnable) > top:
            lines.append(f"  ... {len(runnable) - top} more (--top 0 lists all)")
    else:
        lines.append("no candidate can run: every one is excluded (below)")
    if excluded:
        reasons = Counter(p.excluded.split(" ")[0].rstrip(":") for p in excluded)  # the field, or "memory"
        lines += ["", f"excluded: {len(excluded)} candidates ("
                  + ", ".join(f"{reason}: {count}" for reason, count in reasons.most_common()) + ")"]
    if runnable:
        pick = runnable[0]
        lines += ["", f"the pick, {pick.candidate.placement}: " + " ".join(pick.candidate.overrides(config, gpus, machine))]
    return "\n".join(lines)


def _fit_error(costs: ModuleCosts) -> float:
    return max(c.worst_error for c in (costs.encoder, costs.encoder_forward, costs.llm_layer, costs.llm_rest))


def _table(predictions: Sequence[Prediction], gpus: int) -> list[str]:
    header = (f"  {'':1} {'#':>3}  {'placement':<11} {'encoder':<10} {'llm':<22} {'mb':>3} {'encoder s':>10} "
              f"{'llm s':>9} {'boundary s':>10} {'step s':>9} {'tokens/s':>11} {'GiB/GPU':>8}")
    lines = [header]
    for index, p in enumerate(predictions, 1):
        c = p.candidate
        llm = f"tp{c.llm.tp} cp{c.llm.cp} dp{c.llm.dp} ep{c.llm.ep} etp{c.llm.etp}"
        lines.append(
            f"  {'*' if index == 1 else '':1} {index:>3}  {c.placement:<11} {f'dp{c.encoder.dp} tp{c.encoder.tp}':<10} "
            f"{llm:<22} {c.microbatches:>3} {p.encoder_s:>10.4f} {p.llm_s:>9.4f} {p.boundary_s:>10.4f} "
            f"{p.step_s:>9.4f} {p.tokens_per_s:>11,.0f} {p.memory_gib:>8.1f}"
        )
    return lines


def to_json(predictions: Sequence[Prediction], config, gpus: int, costs: ModuleCosts, device_memory: float | None,
            machine: Machine = H200) -> str:
    """Every candidate, predicted or excluded, for a later comparison with measured runs."""
    def entry(p: Prediction) -> dict:
        c = p.candidate
        return {"placement": c.placement, "encoder": {"dp": c.encoder.dp, "tp": c.encoder.tp},
                "llm": {axis: getattr(c.llm, axis) for axis in ("tp", "cp", "dp", "ep", "etp")},
                "microbatches": c.microbatches, "overrides": c.overrides(config, gpus, machine), "excluded": p.excluded,
                **({} if p.excluded and not p.step_s else {
                    "encoder_s": p.encoder_s, "llm_s": p.llm_s, "boundary_s": p.boundary_s, "step_s": p.step_s,
                    "tokens_per_s": p.tokens_per_s, "memory_gib": p.memory_gib})}

    return json.dumps({"gpus": gpus, "profile": costs.source, "device": costs.device, "device_memory_gib": device_memory,
                       "machine": dataclasses.asdict(machine), "candidates": [entry(p) for p in predictions]}, indent=1)
