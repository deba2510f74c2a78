"""Pipeline parallelism in the LLM pool: the cut of the single-device model into a rank's stages
(the first step of `parallelize_llm`), and a pipeline rank's part of a step's microbatches (the
`StageWork` that `dyad.parallel.pipeline` runs).

The cut keeps the single-device model and its names (`layers.<i>`), so checkpoints, gradients
gathered to full shapes and pretrained weights address every parameter as before; what the rank's
stages do not hold becomes `OnAnotherStage`, which holds no weights. Stage 0 holds the
embedding (image rows are spliced there, and only there: the boundary delivers them to its ranks
alone; so are their DeepStack levels, added after layers the first stage must hold:
`validate_llm_layout`), the last stage the final norm, the output and the loss, each stage its
layers (`LLMLayout.stage_layers`).

A microbatch's loss, stage by stage: every stage computes the microbatch's layer inputs itself
(`MoELM.layer_inputs`: positions, rotary, masks; no weights), runs its layers (`MoELM.decode`)
and divides their aux loss by the global batch's microbatches as `microbatch_loss` does; the last
stage adds the caption loss over the global batch's target tokens. A stage's backward starts from
its output, with the gradient the next stage returned, and from its own aux loss, so the stages'
parts add up to `microbatch_loss`'s total exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dyad.layout import LLMLayout
from dyad.llm_service.model import LayerInputs, MoELM
from dyad.llm_service.sharding import LocalMicrobatch
from dyad.llm_service.step import model_inputs

_LAST_STAGE_PARTS = ("norm", "output", "caption_loss", "predicted_targets")


class OnAnotherStage(nn.Module):
    """A part of the single-device model that another pipeline stage holds: no weights here, and
    nothing on this stage calls it."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is held by another pipeline stage")

    def extra_repr(self) -> str:
        return self.name


def held(module: nn.Module) -> bool:
    """Whether this pipeline rank holds `module` (every part of the model does without pp)."""
    return not isinstance(module, OnAnotherStage)


def cut_stages(model: MoELM, layout: LLMLayout, pp_rank: int) -> None:
    """Keep on `model` only what pipeline rank `pp_rank`'s stages hold."""
    stages = layout.stage_layers(len(model.layers))
    mine = layout.rank_stages(pp_rank)
    kept = {i for stage in mine for i in stages[stage]}
    for i in range(len(model.layers)):
        if i not in kept:
            model.layers[i] = OnAnotherStage(f"layers.{i}")
    if 0 not in mine:
        model.tok_embeddings = OnAnotherStage("tok_embeddings")
    if layout.stages - 1 not in mine:
        for name in _LAST_STAGE_PARTS:
            setattr(model, name, OnAnotherStage(name))


@dataclass
class StageMicrobatch:
    """A microbatch as this rank has it: its shard, and its image rows (None: it has none, or
    this rank does not splice them)."""

    local: LocalMicrobatch
    rows_NlD: torch.Tensor | None


class _StagePasses:
    """What the forward passes of a pipeline rank's stages share: the microbatches' layer inputs,
    the buffers the previous stage's outputs land in, a chunk's run through its layers.
    `microbatches[m]` is read when microbatch m's first pass here starts (in microbatch order on
    the first stage): its image rows need not have arrived before."""

    def __init__(self, model: MoELM, layout: LLMLayout, pp_rank: int, microbatches: Sequence[StageMicrobatch],
                 device: torch.device):
        self.model, self.microbatches, self.device = model, microbatches, device
        self.stages = layout.rank_stages(pp_rank)
        self.layers = [layout.stage_layers(len(model.layers))[stage] for stage in self.stages]
        self.last_stage = layout.stages - 1
        self._model_inputs: dict[int, tuple[tuple, dict]] = {}
        self._inputs: dict[int, LayerInputs] = {}

    def receive_buffer(self, chunk: int, m: int) -> torch.Tensor:
        shape = self._layer_inputs(m).stream_shape
        return torch.empty(shape, dtype=self.model.stream_dtype, device=self.device)

    def _through_layers(self, chunk: int, m: int, h_in: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chunk's output, its layers' aux loss) of microbatch m."""
        (input_ids_BSl, rows_NlD, positions_Nl), _ = self._arguments(m)
        if self.stages[chunk] == 0:
            h_in = self.model.embed(input_ids_BSl, rows_NlD, positions_Nl)
        return self.model.decode(h_in, self._layer_inputs(m), self.layers[chunk])

    def _arguments(self, m: int) -> tuple[tuple, dict]:
        """Microbatch m's `MoELM.forward` arguments (`model_inputs`)."""
        if m not in self._model_inputs:
            micro = self.microbatches[m]
            self._model_inputs[m] = model_inputs(self.model, micro.local, micro.rows_NlD)
        return self._model_inputs[m]

    def _layer_inputs(self, m: int) -> LayerInputs:
        if m not in self._inputs:
            (input_ids_BSl, _, positions_Nl), kwargs = self._arguments(m)
            self._inputs[m] = self.model.layer_inputs(input_ids_BSl, positions_Nl, **kwargs)
        return self._inputs[m]


class StageSteps(_StagePasses):
    """A pipeline rank's forward and backward passes of a step's microbatches (a `StageWork`).

    `lm` (on the last stage) and `aux` sum the microbatches' losses as `microbatch_loss` reports
    them (detached, float64, on the device); `returned(m)` is called once microbatch m's image
    rows have their gradient (after its backward on stage 0)."""

    def __init__(
        self,
        model: MoELM,
        layout: LLMLayout,
        pp_rank: int,
        microbatches: Sequence[StageMicrobatch],
        *,
        device: torch.device,
        global_target_tokens: int,
        global_microbatches: int,
        compute: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        returned: Callable[[int], None] = lambda m: None,
    ):
        super().__init__(model, layout, pp_rank, microbatches, device)
        self.global_target_tokens, self.global_microbatches = global_target_tokens, global_microbatches
        self.compute, self.returned = compute, returned
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, list[torch.Tensor]]] = {}
        self.lm = torch.zeros((), dtype=torch.float64, device=device)
        self.aux = torch.zeros((), dtype=torch.float64, device=device)

    def forward(self, chunk: int, m: int, h_in: torch.Tensor | None) -> torch.Tensor | None:
        if h_in is not None:
            h_in.requires_grad_(True)
        with self.compute():
            h_BSD, aux = self._through_layers(chunk, m, h_in)
            aux = aux / self.global_microbatches
            self.aux = self.aux + aux.detach()
            if self.stages[chunk] < self.last_stage:
                self._saved[(chunk, m)] = (h_in, [h_BSD, aux])
                return h_BSD
            targets_BSl = self.microbatches[m].local.targets_BSl
            lm = self.model.loss_sum(self.model.head(h_BSD), targets_BSl) / self.global_target_tokens
        self.lm = self.lm + lm.detach()
        self._saved[(chunk, m)] = (h_in, [lm + aux])
        return None

    def backward(self, chunk: int, m: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        h_in, outputs = self._saved.pop((chunk, m))
        grads = [grad_out, None] if grad_out is not None else [None]
        starts = [(out, grad) for out, grad in zip(outputs, grads) if out.requires_grad]
        if starts:  # not where nothing before it trains (a frozen LLM, no images)
            torch.autograd.backward([out for out, _ in starts], [grad for _, grad in starts])
        if self.stages[chunk] == 0:
            self.returned(m)
            return None
        return h_in.grad if h_in.grad is not None else torch.zeros_like(h_in)


class StageHeldOut(_StagePasses):
    """A pipeline rank's forward passes of an evaluation's microbatches (a `StageWork`, forward
    only): on the last stage `held_out(m, logits_BSV)` takes each microbatch's logits."""

    def __init__(self, model: MoELM, layout: LLMLayout, pp_rank: int, microbatches: Sequence[StageMicrobatch], *,
                 device: torch.device, held_out: Callable[[int, torch.Tensor], None],
                 compute: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        super().__init__(model, layout, pp_rank, microbatches, device)
        self.held_out, self.compute = held_out, compute

    @torch.no_grad()
    def forward(self, chunk: int, m: int, h_in: torch.Tensor | None) -> torch.Tensor | None:
        with self.compute():
            h_BSD, _ = self._through_layers(chunk, m, h_in)
            if self.stages[chunk] < self.last_stage:
                return h_BSD
            self.held_out(m, self.model.head(h_BSD))
        return None

    def backward(self, chunk: int, m: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        raise RuntimeError("an evaluation runs forward passes only")
