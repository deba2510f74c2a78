"""Decoder-only MoE language model that accepts image embeddings spliced into its input.

Legend: B batch, S sequence length, D model dim, V vocab size, H query heads, G kv heads,
Dh head dim, N spliced image tokens, T = B*S flattened tokens; MLA: Q query latent (q_lora_rank),
C key-value latent (kv_lora_rank), Dn and R a head's features without and with rotary, Dqk = Dn + R,
Dv a value head. cos and sin are [S, Dh] (SDh), or [B, S, Dh] per sample under multimodal rotary.

Image tokens follow LLaVA: the caller reserves placeholder tokens in input_ids and passes the flat
indices (into B*S) of those placeholders; their token embeddings are replaced by the image
embeddings. Sequences are right-padded, so a plain causal mask is enough. Qwen3-VL adds to this
its multimodal rotary positions (t, h, w per token, `rope_positions_3BS`) and DeepStack: further
rows per image token, level i added to the residual stream after layer i.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dyad.kernels.flash4 import flash4_applies, flash4_attention
from dyad.kernels.varlen_attention import varlen_attention
from dyad.llm_service.config import LLMConfig
from dyad.llm_service.moe import MoELayer, SwiGLU
from dyad.llm_service.rotary import (
    apply_rotary,
    deinterleave,
    mrope_cos_sin,
    rotary_cos_sin,
    rotary_frequencies,
    yarn_mscale,
)

# DeepSeek's latent norms use RMSNorm's default epsilon, not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Documents:
    """Packed rows' samples as attention takes them: each column's sample (`ids_BS`, numbered
    across the rows, -1 on padding) and, where the rank holds whole rows (no context
    parallelism), `bounds`: the segments of the flattened rows, each sample's columns and each
    row's padding (`dyad.kernels.varlen_attention.segment_bounds`, built on the host)."""

    ids_BS: torch.Tensor
    bounds: tuple[torch.Tensor, int] | None = None


class CausalAttention(nn.Module):
    """Causal attention over the sequence held here (its positions are 0..S-1 in order); with
    `documents` (packed rows), each token attends only to the earlier tokens of its own sample:
    over their `bounds`, variable-length attention (flash attention's kernel on CUDA: no work
    across samples), else a mask of the samples. Without documents: FlashAttention-4 where
    flash-attn-4 is installed (Hopper, Blackwell), else SDPA. Context parallelism replaces it with
    attention over the whole group's keys, masked by the positions and documents
    (`ContextParallelAttention`)."""

    def forward(self, q_BHSDh, k_BGSDh, v_BGSDh, positions_S, scale: float | None = None,
                documents: Documents | None = None):
        """`scale`: the softmax's (None: 1 / sqrt(the query head dim)); values may have their own head dim."""
        gqa = q_BHSDh.shape[1] != k_BGSDh.shape[1]
        if documents is None:
            q_BSHDh, k_BSGDh, v_BSGDv = (x.transpose(1, 2) for x in (q_BHSDh, k_BGSDh, v_BGSDh))
            if flash4_applies(q_BSHDh, k_BSGDh, v_BSGDv):
                return flash4_attention(q_BSHDh, k_BSGDh, v_BSGDv, scale=scale, causal=True).transpose(1, 2)
            return F.scaled_dot_product_attention(q_BHSDh, k_BGSDh, v_BGSDh, is_causal=True, scale=scale, enable_gqa=gqa)
        if documents.bounds is not None:
            B, H, S, _ = q_BHSDh.shape
            q_THDh, k_TGDh, v_TGDv = (x.transpose(1, 2).reshape(B * S, x.shape[1], x.shape[3]) for x in (q_BHSDh, k_BGSDh, v_BGSDh))
            out_THDv = varlen_attention(q_THDh, k_TGDh, v_TGDv, *documents.bounds, scale=scale, causal=True)
            return out_THDv.view(B, S, H, -1).transpose(1, 2)
        allowed_B1SS = document_mask(positions_S, positions_S, documents.ids_BS, documents.ids_BS)
        return F.scaled_dot_product_attention(q_BHSDh, k_BGSDh, v_BGSDh, attn_mask=allowed_B1SS, scale=scale, enable_gqa=gqa)


def document_mask(q_positions_S, k_positions_S, q_documents_BS, k_documents_BS) -> torch.Tensor:
    """[B, 1, Sq, Sk] bool: key at or before the query and of the query's document (a packed
    row's sample; -1, padding, is its own document, so every query keeps itself)."""
    causal_SS = k_positions_S.unsqueeze(0) <= q_positions_S.unsqueeze(1)
    same_BSS = q_documents_BS.unsqueeze(2) == k_documents_BS.unsqueeze(1)
    return (causal_SS & same_BSS).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm, self.k_norm = (_qk_norm(cfg, heads) for heads in (cfg.n_heads, cfg.n_kv_heads))
        self.core = CausalAttention()

    def forward(self, x_BSD, cos_SDh, sin_SDh, positions_S, documents: Documents | None = None) -> torch.Tensor:
        # Shapes come from the projections: under sequence parallelism x holds part of the
        # sequence and the projections gather the rest.
        q_BSX, k_BSX, v_BSX = self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD)
        B, S, _ = q_BSX.shape
        q_BSHDh = apply_rotary(self.q_norm(q_BSX.view(B, S, self.n_heads, self.head_dim)), cos_SDh, sin_SDh)
        k_BSGDh = apply_rotary(self.k_norm(k_BSX.view(B, S, self.n_kv_heads, self.head_dim)), cos_SDh, sin_SDh)
        v_BSGDh = v_BSX.view(B, S, self.n_kv_heads, self.head_dim)
        if q_BSHDh.numel() == 0:  # cuDNN attention returns None for an empty batch (torch 2.11)
            return self.wo(q_BSHDh.reshape(B, S, self.n_heads * self.head_dim))
        out_BHSDh = self.core(
            q_BSHDh.transpose(1, 2), k_BSGDh.transpose(1, 2), v_BSGDh.transpose(1, 2), positions_S, documents=documents
        )
        return self.wo(out_BHSDh.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), names as DeepSeek's reference code: the
    queries through a normed low-rank latent (wq_a, q_norm, wq_b; or one projection wq), the keys'
    and values' no-rotary parts through one normed latent shared by the heads (wkv_a, kv_norm,
    wkv_b), the keys' rotary part one head shared by all (the rest of wkv_a's output).

    Tensor parallelism splits the heads (wq_b or wq, wkv_b column-parallel, wo row-parallel); the
    latents are every rank's, and `rope_key`, the shared rotary key, becomes where it enters the
    head-parallel region (each rank's heads contribute to its gradient).
    """

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        mla, D, H = cfg.mla, cfg.dim, cfg.n_heads
        self.n_heads, self.nope_dim, self.rope_dim, self.v_dim = H, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank, self.interleaved = mla.kv_lora_rank, mla.rope_interleave
        if mla.q_lora_rank:
            self.wq, self.wq_a = None, nn.Linear(D, mla.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, H * mla.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(D, H * mla.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(D, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(mla.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, H * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = nn.Linear(H * mla.v_head_dim, D, bias=False)
        self.rope_key = nn.Identity()
        self.core = CausalAttention()
        self.scale = mla_softmax_scale(cfg)

    def forward(self, x_BSD, cos_SR, sin_SR, positions_S, documents: Documents | None = None) -> torch.Tensor:
        # Shapes come from the head-parallel projections: under sequence parallelism x and the
        # latents hold part of the sequence, and the projections gather the rest.
        q_BSX = self.wq(x_BSD) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        B, S, _ = q_BSX.shape
        q_nope_BSHDn, q_rope_BSHR = q_BSX.view(B, S, self.n_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        kv_latent_BsC, k_rope_BsR = self.wkv_a(x_BSD).split([self.kv_rank, self.rope_dim], -1)
        kv_BSHX = self.wkv_b(self.kv_norm(kv_latent_BsC)).view(B, S, self.n_heads, -1)
        k_nope_BSHDn, v_BSHDv = kv_BSHX.split([self.nope_dim, self.v_dim], -1)
        k_rope_BS1R = self.rope_key(k_rope_BsR).view(B, S, 1, self.rope_dim)
        q_rope_BSHR, k_rope_BS1R = (self._rotate(x, cos_SR, sin_SR) for x in (q_rope_BSHR, k_rope_BS1R))
        q_BSHDqk = torch.cat([q_nope_BSHDn, q_rope_BSHR], -1)
        k_BSHDqk = torch.cat([k_nope_BSHDn, k_rope_BS1R.expand(B, S, self.n_heads, self.rope_dim)], -1)
        if q_BSHDqk.numel() == 0:  # cuDNN attention returns None for an empty batch (torch 2.11)
            return self.wo(v_BSHDv.reshape(B, S, self.n_heads * self.v_dim))
        out_BHSDv = self.core(
            q_BSHDqk.transpose(1, 2), k_BSHDqk.transpose(1, 2), v_BSHDv.transpose(1, 2), positions_S, scale=self.scale,
            documents=documents,
        )
        return self.wo(out_BHSDv.transpose(1, 2).reshape(B, S, self.n_heads * self.v_dim))

    def _rotate(self, x_BSHR, cos_SR, sin_SR):
        return apply_rotary(deinterleave(x_BSHR) if self.interleaved else x_BSHR, cos_SR, sin_SR)


def mla_softmax_scale(cfg: LLMConfig) -> float:
    """1 / sqrt(Dqk), times YaRN's mscale(factor, mscale_all_dim) squared where the config has one
    (DeepSeek-V3's attention temperature for the longer context)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    if cfg.rope_type == "yarn" and cfg.yarn.mscale_all_dim:
        mscale = yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class ProjectionNorm(nn.RMSNorm):
    """An RMSNorm over all heads of a projection, [B, S, H, Dh] in and out (OLMoE's q/k norms).
    Tensor parallelism, which splits the heads, replaces it with `ProjectionParallelRMSNorm`."""

    def forward(self, x_BSHDh: torch.Tensor) -> torch.Tensor:
        return super().forward(x_BSHDh.flatten(-2)).view_as(x_BSHDh)


def _qk_norm(cfg: LLMConfig, heads: int) -> nn.Module:
    """llm.qk_norm's norm of a projection of `heads` heads, [B, S, H, Dh] in and out."""
    if cfg.qk_norm == "head":  # one weight, shared by the heads
        return nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
    if cfg.qk_norm == "projection":
        return ProjectionNorm(heads * cfg.head_dim, eps=cfg.norm_eps)
    return nn.Identity()


class DecoderBlock(nn.Module):
    def __init__(self, cfg: LLMConfig, is_moe: bool):
        super().__init__()
        self.is_moe = is_moe
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MoELayer(cfg.dim, cfg.moe) if is_moe else SwiGLU(cfg.dim, cfg.dense_ffn_dim)

    def forward(
        self,
        h_BSD: torch.Tensor,
        cos_SDh: torch.Tensor,
        sin_SDh: torch.Tensor,
        positions_S: torch.Tensor,
        valid_T: torch.Tensor | None = None,
        seq_ids_T: torch.Tensor | None = None,
        documents: Documents | None = None,
    ):
        """Returns (h_BSD, the MoE layer's scaled aux loss or None for a dense layer)."""
        B, S, D = h_BSD.shape
        h_BSD = h_BSD + self.attention(self.attn_norm(h_BSD), cos_SDh, sin_SDh, positions_S, documents)
        x_TD = self.ffn_norm(h_BSD).reshape(B * S, D)
        if not self.is_moe:
            return h_BSD + self.feed_forward(x_TD).view(B, S, D), None
        y_TD, aux_loss = self.feed_forward(x_TD, valid_T, seq_ids_T)
        return h_BSD + y_TD.view(B, S, D), aux_loss


def splice_image_embeds(h_BSD: torch.Tensor, image_embeds_ND: torch.Tensor, image_positions_N: torch.Tensor) -> torch.Tensor:
    """Replace the rows at flat positions (into B*S) by the image embeddings, out of place."""
    B, S, D = h_BSD.shape
    _check_rows("image_embeds", image_embeds_ND, image_positions_N, D)
    h_TD = h_BSD.reshape(B * S, D).index_put((image_positions_N,), image_embeds_ND.to(h_BSD.dtype))
    return h_TD.view(B, S, D)


def _check_rows(name: str, rows_ND: torch.Tensor, positions_N: torch.Tensor, D: int) -> None:
    if rows_ND.dim() != 2 or rows_ND.shape[1] != D:
        raise ValueError(f"{name} must have shape [N, {D}], got {list(rows_ND.shape)}")
    if positions_N.shape != (rows_ND.shape[0],):
        raise ValueError(f"image_positions shape {list(positions_N.shape)} does not match {rows_ND.shape[0]} {name} rows")


def add_rows(h_BSD: torch.Tensor, rows_ND: torch.Tensor, positions_N: torch.Tensor) -> torch.Tensor:
    """h plus the rows at flat positions (into B*S), out of place."""
    B, S, D = h_BSD.shape
    return h_BSD.reshape(B * S, D).index_add(0, positions_N, rows_ND.to(h_BSD.dtype)).view(B, S, D)


class WholeSequence:
    """Where the decoder layers' residual stream lives: here, the whole sequence held by this
    rank. Sequence parallelism replaces it with a split over the tensor-parallel group."""

    def scatter(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD

    def columns(self, x_BS: torch.Tensor) -> torch.Tensor:
        return x_BS

    def rows(self, rows_ND: torch.Tensor, positions_N: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at flat positions into B*S as the stream held here adds them (`add_rows`): here,
        all of them, where they are."""
        return rows_ND, positions_N

    def gather(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD


@dataclass
class LayerInputs:
    """What every decoder layer of a batch takes besides the residual stream (`MoELM.layer_inputs`):
    the rotary's cos and sin, the columns' positions, the real tokens and each token's sequence
    as the stream held here has them, the packed rows' documents, DeepStack's (rows, positions)
    per level; and the stream's shape here."""

    cos_SDh: torch.Tensor
    sin_SDh: torch.Tensor
    positions_S: torch.Tensor
    valid_T: torch.Tensor | None
    seq_ids_T: torch.Tensor
    documents: Documents | None
    deepstack: list[tuple[torch.Tensor, torch.Tensor]]
    stream_shape: tuple[int, int, int]


class MoELM(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError(
                f"llm.vocab_size ({cfg.vocab_size}) must be > 0 to build the model; set it from the tokenizer"
            )
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_token_id if cfg.pad_token_id >= 0 else None)
        self.layers = nn.ModuleList(DecoderBlock(cfg, is_moe=i not in cfg.dense_layers) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.caption_loss = CaptionLoss()
        self.predicted_targets = PredictedTargets()
        self.sequence = WholeSequence()

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        image_embeds_ND: torch.Tensor | None = None,
        image_positions_N: torch.Tensor | None = None,
        *,
        position_ids_S: torch.Tensor | None = None,
        valid_BS: torch.Tensor | None = None,
        rope_positions_3BS: torch.Tensor | None = None,
        deepstack_embeds: list[torch.Tensor] | None = None,
        documents_BS: torch.Tensor | None = None,
        sample_positions_BS: torch.Tensor | None = None,
        document_bounds: tuple[torch.Tensor, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits_BSV, aux_loss): the sum of the MoE layers' aux losses, each already scaled
        by its coefficients. position_ids_S: the global positions of the columns held here (default
        0..S-1; a context-parallel shard passes its own), the sequence's order that attention
        masks by. valid_BS (True: a real token) keeps padding out of the routing statistics.

        Multimodal (llm.mrope_section set): rope_positions_3BS, the (t, h, w) rotary positions
        of the columns held here (`dyad.llm_service.rope_index`; default: position_ids_S on
        each axis, plain rotary). deepstack_embeds: DeepStack's levels, each [N, D] at
        image_positions as image_embeds; level i is added after layer i.

        Packed rows (several samples a row): documents_BS, each column's sample (numbered across
        the microbatch's rows, -1 on padding): a token attends only to its own sample's, and a
        per-sequence balance loss (llm.moe.aux_loss "seq") takes each sample as its sequence;
        sample_positions_BS, each column's position in its sample, the rotary's (restarting at
        each sample, as the sample alone would be); document_bounds, where the rows are held
        whole (no context parallelism), their samples' and padding's segments of the flattened
        rows (`segment_bounds`): attention then runs over them with no work across samples.

        The pass is `embed`, `decode` over every layer with the `layer_inputs`, `head`: a pipeline
        stage (`dyad.llm_service.pipeline`) runs the parts it holds."""
        h_BSD = self.embed(input_ids_BS, image_embeds_ND, image_positions_N)
        inputs = self.layer_inputs(
            input_ids_BS, image_positions_N, position_ids_S=position_ids_S, valid_BS=valid_BS,
            rope_positions_3BS=rope_positions_3BS, deepstack_embeds=deepstack_embeds, documents_BS=documents_BS,
            sample_positions_BS=sample_positions_BS, document_bounds=document_bounds,
        )
        h_BSD, aux_loss = self.decode(h_BSD, inputs, range(len(self.layers)))
        return self.head(h_BSD), aux_loss

    def embed(self, input_ids_BS, image_embeds_ND=None, image_positions_N=None) -> torch.Tensor:
        """The residual stream entering the first layer, as the layers hold it (`sequence`): the
        token embeddings with the image embeddings spliced in."""
        self._check_length(input_ids_BS.shape[1])
        if (image_embeds_ND is None) != (image_positions_N is None):
            raise ValueError("image_embeds and image_positions must be given together")
        h_BSD = self.tok_embeddings(input_ids_BS)
        if image_embeds_ND is not None:
            h_BSD = splice_image_embeds(h_BSD, image_embeds_ND, image_positions_N)
        return self.sequence.scatter(h_BSD)

    def layer_inputs(
        self,
        input_ids_BS: torch.Tensor,
        image_positions_N: torch.Tensor | None = None,
        *,
        position_ids_S: torch.Tensor | None = None,
        valid_BS: torch.Tensor | None = None,
        rope_positions_3BS: torch.Tensor | None = None,
        deepstack_embeds: list[torch.Tensor] | None = None,
        documents_BS: torch.Tensor | None = None,
        sample_positions_BS: torch.Tensor | None = None,
        document_bounds: tuple[torch.Tensor, int] | None = None,
    ) -> LayerInputs:
        """What every layer takes besides the residual stream, from the batch's shape, positions
        and masks (`forward`'s arguments): no weight is read."""
        B, S = input_ids_BS.shape
        device = input_ids_BS.device
        self._check_length(S)
        if position_ids_S is None:
            position_ids_S = torch.arange(S, device=device)
        cos_SDh, sin_SDh = self._cos_sin(position_ids_S, rope_positions_3BS, sample_positions_BS, (B, S), device)
        deepstack = self._deepstack_rows(deepstack_embeds, image_positions_N, S)
        valid_T = None if valid_BS is None else self.sequence.columns(valid_BS).reshape(-1)
        if documents_BS is not None and documents_BS.shape != (B, S):
            raise ValueError(f"documents must have shape {[B, S]}, got {list(documents_BS.shape)}")
        seq_ids_BS = torch.arange(B, device=device).unsqueeze(1).expand(B, S) if documents_BS is None else documents_BS
        documents = None if documents_BS is None else Documents(documents_BS, document_bounds)
        seq_ids_BSl = self.sequence.columns(seq_ids_BS)
        return LayerInputs(
            cos_SDh, sin_SDh, position_ids_S, valid_T, seq_ids_BSl.reshape(-1), documents, deepstack,
            stream_shape=(*seq_ids_BSl.shape, self.cfg.dim),
        )

    def decode(self, h_BSD: torch.Tensor, inputs: LayerInputs, layers: range) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after `layers` (consecutive indices), and the sum of their aux
        losses; DeepStack's level i is added after layer i."""
        aux_loss = torch.zeros((), device=h_BSD.device, dtype=torch.float32)
        for i in layers:
            h_BSD, layer_aux = self.layers[i](
                h_BSD, inputs.cos_SDh, inputs.sin_SDh, inputs.positions_S, inputs.valid_T, inputs.seq_ids_T,
                inputs.documents,
            )
            if layer_aux is not None:
                aux_loss = aux_loss + layer_aux
            if i < len(inputs.deepstack):
                h_BSD = add_rows(h_BSD, *inputs.deepstack[i])
        return h_BSD, aux_loss

    @property
    def stream_dtype(self) -> torch.dtype:
        """The residual stream's dtype: its norms' (autocast and bf16 working weights cast only
        the matmuls' weights, whose outputs the stream adds in its own dtype)."""
        return next(module.weight.dtype for module in self.modules() if isinstance(module, nn.RMSNorm))

    def head(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The logits of the residual stream after the last layer."""
        return self.output(self.sequence.gather(self.norm(h_BSD)))

    def _check_length(self, S: int) -> None:
        if S > self.cfg.max_seq_len:
            raise ValueError(f"sequence length ({S}) exceeds llm.max_seq_len ({self.cfg.max_seq_len})")

    def _cos_sin(self, position_ids_S, rope_positions_3BS, sample_positions_BS, shape: tuple[int, int], device):
        """cos and sin: [S, Dh] of the sequence positions, or [B, S, Dh] of each sample's or of
        multimodal ones."""
        frequencies = rotary_frequencies(self.cfg, device)
        if sample_positions_BS is not None:
            if rope_positions_3BS is not None:
                raise ValueError("sample_positions and rope_positions are both rotary positions: give one")
            if sample_positions_BS.shape != shape:
                raise ValueError(f"sample_positions must have shape {list(shape)}, got {list(sample_positions_BS.shape)}")
            cos_TDh, sin_TDh = rotary_cos_sin(sample_positions_BS.reshape(-1), *frequencies)
            return cos_TDh.view(*shape, -1), sin_TDh.view(*shape, -1)
        if rope_positions_3BS is None:
            return rotary_cos_sin(position_ids_S, *frequencies)
        if not self.cfg.multimodal_rope:
            raise ValueError("rope_positions need a multimodal rotary embedding (llm.mrope_section)")
        if rope_positions_3BS.shape != (3, *shape):
            expected = [3, *shape]
            raise ValueError(f"rope_positions must have shape {expected}, got {list(rope_positions_3BS.shape)}")
        return mrope_cos_sin(rope_positions_3BS, *frequencies, self.cfg.mrope_section)

    def _deepstack_rows(self, deepstack_embeds, image_positions_N, S: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each DeepStack level's (rows, flat positions) as the residual stream here holds them."""
        if not deepstack_embeds:
            return []
        if image_positions_N is None:
            raise ValueError("deepstack_embeds need image_embeds and image_positions (their rows' places)")
        if len(deepstack_embeds) > len(self.layers):
            raise ValueError(f"{len(deepstack_embeds)} deepstack levels, but llm.n_layers is {len(self.layers)}")
        for rows_ND in deepstack_embeds:
            _check_rows("deepstack_embeds", rows_ND, image_positions_N, self.cfg.dim)
        return [self.sequence.rows(rows_ND, image_positions_N, S) for rows_ND in deepstack_embeds]

    def loss_sum(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Summed caption cross-entropy of the logits `forward` returned."""
        return self.caption_loss(logits_BSV, targets_BS)

    def targets_predicted(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """[B, S] bool: where the target is the argmax of the logits `forward` returned."""
        return self.predicted_targets(logits_BSV, targets_BS)


class CaptionLoss(nn.Module):
    """`caption_loss_sum` of the whole vocabulary's logits. Tensor parallelism replaces it with the
    vocabulary-parallel loss of its sharded logits (`VocabParallelCrossEntropy`). Compiled with
    the blocks (`dyad.compile.compile_blocks`): eagerly the float32 copy of the logits and the
    softmax's passes over them took 11 ms of a 610 ms step of Qwen3-MoE's shape on an H200."""

    compiled_with_blocks = True

    def forward(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        return caption_loss_sum(logits_BSV, targets_BS)


class PredictedTargets(nn.Module):
    """Where each target is the argmax of the whole vocabulary's logits (the first of equal
    maxima, as `torch.argmax`). Tensor parallelism replaces it with the vocabulary-parallel
    argmax of its sharded logits (`VocabParallelPredictedTargets`)."""

    def forward(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        return logits_BSV.argmax(dim=-1) == targets_BS


def caption_loss_sum(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of float32 cross-entropy over non-ignored targets (targets[b, s] is predicted at s)."""
    V = logits_BSV.shape[-1]
    return F.cross_entropy(
        logits_BSV.reshape(-1, V).float(), targets_BS.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


@torch.no_grad()
def greedy_next_token(
    model: MoELM,
    input_ids_BS: torch.Tensor,
    image_embeds: torch.Tensor | None,
    image_positions: torch.Tensor | None,
    lengths_B: torch.Tensor,
    **inputs,
) -> torch.Tensor:
    """Argmax of the logits at position lengths_B - 1 of each row: the next token, [B] long.
    `inputs`: the model's further keyword inputs (multimodal rotary positions, DeepStack)."""
    logits_BSV, _ = model(input_ids_BS, image_embeds, image_positions, **inputs)
    rows_B = torch.arange(input_ids_BS.shape[0], device=logits_BSV.device)
    return logits_BSV[rows_B, lengths_B.to(logits_BSV.device) - 1].argmax(dim=-1)
