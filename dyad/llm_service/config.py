"""The LLM service's configuration (`llm:` and `llm.moe:` of a run's config), validated on
construction with errors naming the field. Plain dataclasses without torch: the router and the
CLI read and check configs without loading the model code."""

from dataclasses import dataclass, field

SCORE_FUNCS = ("softmax", "sigmoid")
QK_NORMS = ("none", "head", "projection")
AUX_LOSSES = ("micro_batch", "seq", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHER_NAMES = ("alltoall", "allgather")  # token dispatchers under expert parallelism


@dataclass(kw_only=True)
class MoEConfig:
    num_experts: int = 4
    top_k: int = 2
    expert_dim: int = 128
    shared_expert_dim: int = 0  # 0: no shared expert
    # The shared expert's output scaled by sigmoid(a learned linear of the token) (Qwen2-MoE).
    shared_expert_gate: bool = False
    aux_loss_coef: float = 0.01
    norm_topk_prob: bool = True
    score_func: str = "softmax"
    topk_before_softmax: bool = False
    aux_loss: str = "micro_batch"
    z_loss_coef: float = 0.0
    expert_bias: bool = False
    expert_bias_rate: float = 1e-3
    n_groups: int = 1
    topk_groups: int = 1
    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probs"
    dispatcher: str = "alltoall"  # how tokens reach experts on other ranks (ep > 1)

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"llm.moe.num_experts ({self.num_experts}) must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"llm.moe.top_k ({self.top_k}) must be in [1, llm.moe.num_experts ({self.num_experts})]")
        if self.expert_dim < 1:
            raise ValueError(f"llm.moe.expert_dim ({self.expert_dim}) must be >= 1")
        if self.shared_expert_dim < 0:
            raise ValueError(f"llm.moe.shared_expert_dim ({self.shared_expert_dim}) must be >= 0 (0 disables it)")
        if self.shared_expert_gate and self.shared_expert_dim == 0:
            raise ValueError("llm.moe.shared_expert_gate needs a shared expert (llm.moe.shared_expert_dim > 0)")
        for name in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"llm.moe.{name} ({getattr(self, name)}) must be >= 0")
        choices = (
            ("score_func", SCORE_FUNCS),
            ("aux_loss", AUX_LOSSES),
            ("drop_policy", DROP_POLICIES),
            ("dispatcher", DISPATCHER_NAMES),
        )
        for name, options in choices:
            if getattr(self, name) not in options:
                raise ValueError(f"llm.moe.{name} ({getattr(self, name)!r}) must be one of {', '.join(options)}")
        if self.topk_before_softmax and self.score_func != "softmax":
            raise ValueError(
                f"llm.moe.topk_before_softmax needs llm.moe.score_func 'softmax', got {self.score_func!r}"
            )
        if not self.expert_bias_rate > 0:
            raise ValueError(f"llm.moe.expert_bias_rate ({self.expert_bias_rate}) must be > 0")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"llm.moe.capacity_factor ({self.capacity_factor}) must be > 0 (or null: dropless)")
        self._validate_groups()

    def _validate_groups(self):
        if self.n_groups < 1 or self.num_experts % self.n_groups:
            raise ValueError(f"llm.moe.n_groups ({self.n_groups}) must divide llm.moe.num_experts ({self.num_experts})")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(
                f"llm.moe.topk_groups ({self.topk_groups}) must be in [1, llm.moe.n_groups ({self.n_groups})]"
            )
        if self.top_k % self.topk_groups:
            raise ValueError(f"llm.moe.topk_groups ({self.topk_groups}) must divide llm.moe.top_k ({self.top_k})")
        per_group = self.num_experts // self.n_groups
        if self.top_k // self.topk_groups > per_group:
            raise ValueError(
                f"llm.moe.top_k / llm.moe.topk_groups ({self.top_k // self.topk_groups}) must be <= the experts "
                f"per group ({per_group})"
            )


@dataclass(kw_only=True)
class LLMConfig:
    # A Hugging Face model directory (Mixtral, Qwen3-MoE) whose architecture and weights the LLM
    # starts from (dyad/llm_service/hf_config.py); "": dyad's own, from the fields below.
    from_hf: str = ""
    vocab_size: int = 0  # set from the tokenizer by the composer
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0: dim // n_heads (Qwen3-MoE sets its own, e.g. 128 with dim 2048 and 32 heads)
    # RMSNorm of the queries and keys before the rotary embedding: "head", each head's (Qwen3-MoE:
    # one weight of head_dim shared by the heads); "projection", over the whole projection (OLMoE).
    qk_norm: str = "none"
    attention_bias: bool = False  # biases on the query, key and value projections (Qwen2-MoE)
    # A token id whose embedding row never learns (transformers' padding_idx: OLMoE's pad); -1: none.
    pad_token_id: int = -1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dense_ffn_dim: int = 128
    dense_layers: tuple[int, ...] = (0,)  # layers with a dense SwiGLU instead of MoE
    max_seq_len: int = 256
    moe: MoEConfig = field(default_factory=MoEConfig)
    fp8: bool = False  # attention, dense FFN and expert GEMMs in float8 (dyad/llm_service/fp8.py)

    def __post_init__(self):
        self.dense_layers = tuple(self.dense_layers)
        if self.vocab_size < 0:
            raise ValueError(f"llm.vocab_size ({self.vocab_size}) must be >= 0 (0: set from the tokenizer)")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "dense_ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"llm.{name} ({value}) must be >= 1")
        if self.pad_token_id < -1 or self.vocab_size and self.pad_token_id >= self.vocab_size:
            raise ValueError(f"llm.pad_token_id ({self.pad_token_id}) must be -1 (none) or an id below llm.vocab_size")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"llm.qk_norm ({self.qk_norm!r}) must be one of {', '.join(QK_NORMS)}")
        if self.head_dim < 0:
            raise ValueError(f"llm.head_dim ({self.head_dim}) must be >= 0 (0: llm.dim // llm.n_heads)")
        if self.rope_theta <= 0:
            raise ValueError(f"llm.rope_theta ({self.rope_theta}) must be > 0")
        if self.norm_eps <= 0:
            raise ValueError(f"llm.norm_eps ({self.norm_eps}) must be > 0")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"llm.n_heads ({self.n_heads}) must divide llm.dim ({self.dim}) (or set llm.head_dim)")
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ValueError(f"llm.head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"llm.n_kv_heads ({self.n_kv_heads}) must divide llm.n_heads ({self.n_heads})")
        for i in self.dense_layers:
            if not 0 <= i < self.n_layers:
                raise ValueError(f"llm.dense_layers entry ({i}) must be in [0, llm.n_layers ({self.n_layers}))")
