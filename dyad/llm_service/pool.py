"""The LLM pool type: its config, its folded layout, and its worker (`dyad.pools`)."""

from __future__ import annotations

import dataclasses

from dyad.layout import LLMLayout, validate_llm_layout
from dyad.llm_service.config import LLMConfig
from dyad.llm_service.hf_config import pretrained, vocabulary_growth
from dyad.pipeline_schedule import first_stage_lead
from dyad.pools import PoolType


def _resolve(run, vocab_size: int | None) -> LLMConfig:
    """Its vocabulary is the tokenizer's; its architecture the checkpoint's where it starts from
    one (`llm.from_hf`, which needs the tokenizer named); its layout must shard the model and
    split the batch; the features that do not combine are refused here, naming both fields."""
    llm = run.llm
    if llm.from_hf:
        if not run.data.tokenizer:
            raise ValueError(
                "llm.from_hf needs data.tokenizer (the checkpoint's tokenizer.json): the word-level "
                "tokenizer built over the captions does not match the checkpoint's embedding"
            )
        if vocab_size is not None:
            llm = pretrained(llm, vocab_size)
    elif vocab_size is not None:
        llm = dataclasses.replace(llm, vocab_size=vocab_size)
    layout, train = run.parallel.llm, run.train
    validate_llm_layout(layout, llm)
    if run.parallel.sequence_parallel and layout.tp == 1:
        raise ValueError("parallel.sequence_parallel needs parallel.llm.tp > 1 (it splits over tp)")
    if llm.fp8:
        _check_fp8(run)
    if "llm" in train.recompute and llm.moe.expert_bias and train.compile and train.dtype == "float32":
        raise ValueError(
            "train.recompute cannot hold 'llm' with llm.moe.expert_bias under train.compile in float32 "
            "train.dtype: there the grouped matmul breaks the MoE block's graph, and the part after the "
            "break would count the block's tokens again when it is recomputed (use bfloat16, or no compile)"
        )
    if train.seq_len > llm.max_seq_len:
        raise ValueError(f"train.seq_len ({train.seq_len}) must be <= llm.max_seq_len ({llm.max_seq_len}): "
                         "a packed row is one LLM sequence")
    if layout.pp_virtual > 1 and train.microbatches % layout.pp:
        raise ValueError(
            f"train.microbatches ({train.microbatches}) must be a multiple of parallel.llm.pp ({layout.pp}) "
            f"for the interleaved schedule (parallel.llm.pp_virtual {layout.pp_virtual}): it runs them in rounds of pp"
        )
    lead = first_stage_lead(layout.pp, train.microbatches, layout.pp_virtual)
    if run.boundary.prefetch_depth < lead:
        raise ValueError(
            f"boundary.prefetch_depth ({run.boundary.prefetch_depth}) must be >= {lead} with parallel.llm.pp "
            f"{layout.pp} (pp_virtual {layout.pp_virtual}) and train.microbatches {train.microbatches}: the first "
            f"pipeline stage takes {lead} microbatches' image rows before it returns the first one's gradient, "
            "and the encoder works only prefetch_depth microbatches ahead of the gradients it has"
        )
    needed = train.microbatches * layout.dp
    if train.global_batch < needed:
        raise ValueError(
            f"train.global_batch ({train.global_batch}) must be >= train.microbatches "
            f"({train.microbatches}) * parallel.llm.dp ({layout.dp})"
        )
    return llm


def _check_fp8(run) -> None:
    if run.train.dtype != "bfloat16":
        raise ValueError(f"llm.fp8 needs train.dtype 'bfloat16' (its GEMMs return bf16), got {run.train.dtype!r}")
    layout = run.parallel.llm
    if layout.tp > 1 or layout.etp > 1:
        raise ValueError(
            f"llm.fp8 needs parallel.llm.tp == 1 and etp == 1 (tensor-parallel linears have no float8 path "
            f"yet), got tp={layout.tp}, etp={layout.etp}"
        )
    if run.train.working_weights:
        raise ValueError(
            "train.working_weights cannot be combined with llm.fp8: the float8 layers quantize their float32 "
            "weights themselves"
        )


def _scale(run, replicas: int):
    """The step keeps its microbatches (the aux losses are per microbatch): each of the new
    data-parallel ranks takes an equal share of them."""
    layout = run.parallel.llm
    per_replica = layout.tp * layout.cp * layout.pp
    if replicas % per_replica:
        raise ValueError(
            f"replicas ({replicas}) must be a multiple of parallel.llm.tp*cp*pp ({layout.tp}*{layout.cp}*{layout.pp})"
        )
    dp = replicas // per_replica
    total = run.train.microbatches * layout.dp
    if total % dp:
        raise ValueError(
            f"replicas ({replicas}) gives parallel.llm.dp={dp}, which must divide the step's "
            f"{total} microbatches (train.microbatches * parallel.llm.dp)"
        )
    return dataclasses.replace(
        run,
        train=dataclasses.replace(run.train, microbatches=total // dp),
        parallel=dataclasses.replace(run.parallel, llm=dataclasses.replace(layout, dp=dp)),
    )


def _warnings(run) -> list[str]:
    growth = vocabulary_growth(run.llm)
    return [growth] if growth else []


POOL = PoolType(
    name="llm",
    wire="POOL_LLM",
    config=LLMConfig,
    layout=LLMLayout,
    resolve=_resolve,
    scale=_scale,
    seed_offset=2,
    service="dyad.llm_service.worker:LLMWorker",
    warnings=_warnings,
    freezable=("llm",),
)
