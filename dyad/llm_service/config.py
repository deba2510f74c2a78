"""The LLM service's configuration (`llm:` and `llm.moe:` of a run's config), validated on
construction with errors naming the field. Plain dataclasses without torch: the router and the
CLI read and check configs without loading the model code."""

from dataclasses import dataclass, field

SCORE_FUNCS = ("softmax", "sigmoid")
ATTENTIONS = ("gqa", "mla")
ROPE_TYPES = ("default", "yarn")
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
    # A group's strength: the sum of its this-many top keys; 0: top_k / topk_groups. DeepSeek-V3
    # sums its top 2 whatever top_k is.
    group_score_experts: int = 0
    # The routed experts' summed output times this (DeepSeek-V3's routed_scaling_factor); the
    # shared expert's is not scaled.
    routed_scaling_factor: float = 1.0
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
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"llm.moe.routed_scaling_factor ({self.routed_scaling_factor}) must be > 0")
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
        per_group = self.num_experts // self.n_groups
        if not 0 <= self.group_score_experts <= per_group:
            raise ValueError(
                f"llm.moe.group_score_experts ({self.group_score_experts}) must be in [0, the experts per group "
                f"({per_group})] (0: llm.moe.top_k / llm.moe.topk_groups)"
            )
        if self.group_score_experts:  # the chosen groups need only hold top_k experts
            if self.top_k > self.topk_groups * per_group:
                raise ValueError(
                    f"llm.moe.top_k ({self.top_k}) must be <= llm.moe.topk_groups x the experts per group "
                    f"({self.topk_groups * per_group})"
                )
            return
        if self.top_k % self.topk_groups:
            raise ValueError(f"llm.moe.topk_groups ({self.topk_groups}) must divide llm.moe.top_k ({self.top_k})")
        if self.top_k // self.topk_groups > per_group:
            raise ValueError(
                f"llm.moe.top_k / llm.moe.topk_groups ({self.top_k // self.topk_groups}) must be <= the experts "
                f"per group ({per_group})"
            )


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3; used with llm.attention "mla"): the
    queries through a low-rank latent (or one projection), the keys and values through one latent
    shared by the heads, each head's query and key a part without rotary (qk_nope_head_dim) and
    a rotary part (qk_rope_head_dim, the key's shared by the heads)."""

    q_lora_rank: int = 0  # 0: the queries by one projection of the model dim
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # The rotary part's pairs are adjacent features (DeepSeek's weights), not the two halves.
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"llm.mla.{name} ({getattr(self, name)}) must be >= 1")
        if self.q_lora_rank < 0:
            raise ValueError(f"llm.mla.q_lora_rank ({self.q_lora_rank}) must be >= 0 (0: no query latent)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"llm.mla.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary embeddings")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(kw_only=True)
class YarnConfig:
    """YaRN's rotary scaling (used with llm.rope_type "yarn"), as transformers computes it
    (`_compute_yarn_parameters`): the frequencies interpolated by `factor` where their wavelength
    is long against original_max_seq_len, kept where short, ramped between (beta_fast, beta_slow
    rotations); cos and sin scaled by attention_factor (0: from factor, mscale, mscale_all_dim)."""

    factor: float = 1.0
    original_max_seq_len: int = 0  # the context the model was pretrained on (required)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: none
    # MLA's softmax scale is multiplied by yarn_mscale(factor, mscale_all_dim)^2 (DeepSeek-V3); 0: not.
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0
    truncate: bool = True  # the ramp's ends rounded to whole dims

    def __post_init__(self):
        if not self.factor >= 1:
            raise ValueError(f"llm.yarn.factor ({self.factor}) must be >= 1")
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"llm.yarn.beta_fast ({self.beta_fast}) must be > llm.yarn.beta_slow ({self.beta_slow}) > 0"
            )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"llm.yarn.{name} ({getattr(self, name)}) must be >= 0 (0: unset)")


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
    # "gqa": grouped-query attention of n_heads queries over n_kv_heads keys and values of
    # head_dim; "mla": multi-head latent attention (DeepSeek-V3), its shapes llm.mla's.
    attention: str = "gqa"
    mla: MLAConfig = field(default_factory=MLAConfig)
    # RMSNorm of the queries and keys before the rotary embedding: "head", each head's (Qwen3-MoE:
    # one weight of head_dim shared by the heads); "projection", over the whole projection (OLMoE).
    qk_norm: str = "none"
    attention_bias: bool = False  # biases on the query, key and value projections (Qwen2-MoE)
    # A token id whose embedding row never learns (transformers' padding_idx: OLMoE's pad); -1: none.
    pad_token_id: int = -1
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "yarn": the frequencies and scales of llm.yarn
    yarn: YarnConfig = field(default_factory=YarnConfig)
    # Multimodal rotary (Qwen3-VL): the rotary frequencies' counts turned by the (t, h, w)
    # positions, interleaved (t, h, w, t, h, w, ..., the rest t) as Qwen3-VL lays them out;
    # they sum to half the rotary features. (): one position per token (plain rotary).
    mrope_section: tuple[int, ...] = ()
    # DeepStack (Qwen3-VL): how many further sets of image rows, beside the merged tokens, come
    # over the boundary from the vision tower's DeepStack mergers; set i is added to the hidden
    # states of the image tokens after layer i. 0: the image rows are the merged tokens alone.
    deepstack_levels: int = 0
    norm_eps: float = 1e-5
    dense_ffn_dim: int = 128
    dense_layers: tuple[int, ...] = (0,)  # layers with a dense SwiGLU instead of MoE
    max_seq_len: int = 256
    moe: MoEConfig = field(default_factory=MoEConfig)
    fp8: bool = False  # attention, dense FFN and expert GEMMs in float8 (dyad/llm_service/fp8.py)

    def __post_init__(self):
        self.dense_layers = tuple(self.dense_layers)
        self.mrope_section = tuple(self.mrope_section)
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
        for name, options in (("attention", ATTENTIONS), ("rope_type", ROPE_TYPES)):
            if getattr(self, name) not in options:
                raise ValueError(f"llm.{name} ({getattr(self, name)!r}) must be one of {', '.join(options)}")
        if self.rope_type == "yarn" and self.yarn.original_max_seq_len < 1:
            raise ValueError(
                f"llm.yarn.original_max_seq_len ({self.yarn.original_max_seq_len}) must be >= 1 with llm.rope_type 'yarn'"
            )
        if self.attention == "mla":
            self._validate_mla()
        else:
            self._validate_gqa()
        for i in self.dense_layers:
            if not 0 <= i < self.n_layers:
                raise ValueError(f"llm.dense_layers entry ({i}) must be in [0, llm.n_layers ({self.n_layers}))")
        if self.mrope_section:
            self._validate_mrope()
        if not 0 <= self.deepstack_levels <= self.n_layers:
            raise ValueError(f"llm.deepstack_levels ({self.deepstack_levels}) must be in [0, llm.n_layers ({self.n_layers})]")

    def _validate_mrope(self):
        """Three counts summing to the rotary frequencies, h and w each within the interleaving:
        h turns frequencies 1, 4, 7, ... and w 2, 5, 8, ...; t the rest."""
        section, half = self.mrope_section, self.rope_dim // 2
        if len(section) != 3 or min(section) < 0 or sum(section) != half:
            raise ValueError(
                f"llm.mrope_section ({list(section)}) must be three counts (t, h, w) >= 0 summing to half the "
                f"rotary features ({half})"
            )
        _, h, w = section
        if 3 * h - 2 >= half or 3 * w - 1 >= half:
            raise ValueError(
                f"llm.mrope_section ({list(section)}): interleaved, h and w turn every third of the {half} "
                f"frequencies (from the second and the third): h must be <= {(half + 1) // 3}, w <= {half // 3}"
            )

    def _validate_gqa(self):
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"llm.n_heads ({self.n_heads}) must divide llm.dim ({self.dim}) (or set llm.head_dim)")
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ValueError(f"llm.head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"llm.n_kv_heads ({self.n_kv_heads}) must divide llm.n_heads ({self.n_heads})")

    def _validate_mla(self):
        """MLA's heads each have their keys and values, of llm.mla's dims; GQA's options do not apply."""
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"llm.n_kv_heads ({self.n_kv_heads}) must equal llm.n_heads ({self.n_heads}) with llm.attention "
                "'mla' (each head has its own key and value)"
            )
        if self.head_dim not in (0, self.mla.qk_head_dim):
            raise ValueError(
                f"llm.head_dim ({self.head_dim}) must be 0 or llm.mla.qk_nope_head_dim + llm.mla.qk_rope_head_dim "
                f"({self.mla.qk_head_dim}) with llm.attention 'mla'"
            )
        self.head_dim = self.mla.qk_head_dim
        for name, refused in (("qk_norm", self.qk_norm != "none"), ("attention_bias", self.attention_bias)):
            if refused:
                raise ValueError(f"llm.{name} ({getattr(self, name)!r}) is not an option of llm.attention 'mla'")

    @property
    def boundary_width(self) -> int:
        """Features of one image row crossing the boundary: its merged token and each DeepStack
        level's, side by side (`image_rows`)."""
        return self.dim * (1 + self.deepstack_levels)

    @property
    def multimodal_rope(self) -> bool:
        """Whether positions are (t, h, w) triples: image tokens placed on their grid (mrope_section)."""
        return bool(self.mrope_section)

    @property
    def reads_deepstack(self) -> bool:
        """Whether the LLM adds DeepStack levels, so the encoder sends them beside each merged token."""
        return self.deepstack_levels > 0

    @property
    def rope_dim(self) -> int:
        """The features of a query or key head that the rotary embedding turns."""
        return self.mla.qk_rope_head_dim if self.attention == "mla" else self.head_dim
