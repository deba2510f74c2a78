"""The encoder service's configuration (`encoder:` of a run's config), validated on construction
with errors naming the field. A plain dataclass without torch: the router and the CLI read and
check configs without loading the model code."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")  # exact GELU; SigLIP's tanh form; CLIP's x*sigmoid(1.702x)


@dataclass(kw_only=True)
class EncoderConfig:
    # A Hugging Face vision tower (SigLIP, CLIP; alone, or a SigLIP/CLIP/LLaVA model's) whose
    # architecture and weights the encoder starts from (dyad/encoder_service/hf_config.py), the
    # projector drawn from the run's seed; or a Qwen3-VL(-MoE) model or its tower alone, a
    # native-resolution tower (`native`); "": dyad's own, from the fields below.
    from_hf: str = ""
    # A native-resolution tower: resolved from a Qwen3-VL `from_hf` (its config.json), never set
    # by hand. It replaces the fixed-resolution ViT the fields below describe: each image is
    # encoded at its own size and gives its own number of tokens (dyad/data/image_tokens.py).
    native: Qwen3VLVisionConfig | None = None
    feature_layer: int = -2  # with from_hf: the block whose output the LLM gets (LLaVA's: -2, the one before the last)
    image_size: int = 16
    patch_size: int = 4
    channels: int = 1
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: float = 4.0
    mlp_hidden: int = 0  # the MLP's hidden width; 0: dim * mlp_ratio (pretrained towers set it)
    out_dim: int = 64  # the LLM hidden size; the composer sets it
    norm_eps: float = 1e-6
    spatial_merge: int = 1  # m: each m x m square of patches becomes one LLM token
    # The parts pretrained towers differ by (SigLIP, CLIP; dyad/encoder_service/hf_config.py):
    activation: str = "gelu"  # the MLP's: one of ACTIVATIONS
    qkv_bias: bool = False  # biases on the query, key and value projections
    patch_bias: bool = True  # a bias on the patch embedding (CLIP has none)
    cls_token: bool = False  # a learned class token before the patches (CLIP); never sent to the LLM
    pre_norm: bool = False  # a LayerNorm of the embeddings before the first block (CLIP's)
    final_norm: bool = True  # a LayerNorm after the last block (LLaVA takes features before it)

    def __post_init__(self):
        positive = ("image_size", "patch_size", "channels", "dim", "depth", "heads", "out_dim", "spatial_merge")
        if self.mlp_hidden < 0:
            raise ValueError(f"encoder.mlp_hidden ({self.mlp_hidden}) must be >= 0 (0: encoder.dim * encoder.mlp_ratio)")
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"encoder.{name} ({value}) must be >= 1")
        if self.mlp_dim < 1:
            raise ValueError(f"encoder.mlp_ratio ({self.mlp_ratio}) must give an MLP dim >= 1 (dim * mlp_ratio)")
        if self.norm_eps <= 0:
            raise ValueError(f"encoder.norm_eps ({self.norm_eps}) must be > 0")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"encoder.activation ({self.activation!r}) must be one of {', '.join(ACTIVATIONS)}")
        if self.patch_size > self.image_size:
            raise ValueError(
                f"encoder.patch_size ({self.patch_size}) must be <= encoder.image_size ({self.image_size})"
            )
        if self.dim % self.heads:
            raise ValueError(f"encoder.heads ({self.heads}) must divide encoder.dim ({self.dim})")
        if self.patch_grid % self.spatial_merge:
            raise ValueError(
                f"encoder.spatial_merge ({self.spatial_merge}) must divide the patch grid side "
                f"({self.patch_grid} = encoder.image_size // encoder.patch_size)"
            )

    @property
    def patch_grid(self) -> int:
        """Patches along each side of an image. Where the patch does not divide the image, its
        last image_size % patch_size rows and columns are not read, as a strided convolution
        reads them (SigLIP-so400m-patch14-384: 27 x 27 patches of a 384-pixel image)."""
        return self.image_size // self.patch_size

    @property
    def patches_per_image(self) -> int:
        return self.patch_grid**2

    @property
    def positions(self) -> int:
        """Rows of the position embedding: the patches, and the class token's first."""
        return self.patches_per_image + int(self.cls_token)

    @property
    def tokens_per_image(self) -> int:
        """Rows per image the LLM receives (a native tower's differ by image: dyad/data/image_tokens.py)."""
        return (self.patch_grid // self.spatial_merge) ** 2

    @property
    def merged_dim(self) -> int:
        """Width of one merged token: the projector's input."""
        return self.dim * self.spatial_merge**2

    @property
    def mlp_dim(self) -> int:
        return self.mlp_hidden or int(self.dim * self.mlp_ratio)

    @property
    def tp_split(self) -> dict[str, int]:
        """The widths tensor parallelism splits (the projector's hidden: out_dim)."""
        return {"heads": self.heads, "mlp_dim": self.mlp_dim, "out_dim": self.out_dim}


@dataclass(kw_only=True)
class Qwen3VLVisionConfig:
    """Qwen3-VL's native-resolution vision tower (dyad/encoder_service/qwen3_vl.py; a checkpoint's
    is `dyad.encoder_service.hf_config.qwen3_vl_vision_config`'s). Images of any patch grid: each
    patch a `temporal_patch` x `patch_size` x `patch_size` block of `channels`, positions learned
    on a `position_grid` square resampled to each image's grid plus a 2-D rotary in the blocks,
    each `spatial_merge` x `spatial_merge` square of patches merged into one `out_dim` token, and
    the blocks `deepstack_layers` name each giving one more such token set (DeepStack)."""

    patch_size: int = 4
    temporal_patch: int = 2  # frames per patch (an image is repeated to fill them)
    channels: int = 3
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_hidden: int = 256
    activation: str = "gelu_tanh"  # the blocks' MLP's: one of ACTIVATIONS (the mergers' is exact GELU)
    norm_eps: float = 1e-6
    position_grid: int = 8  # side of the learned square of position embeddings
    rope_theta: float = 10000.0
    spatial_merge: int = 2
    out_dim: int = 64  # the LLM hidden size
    deepstack_layers: tuple[int, ...] = (0,)  # blocks (0-based, increasing) whose output a DeepStack merger reads

    def __post_init__(self):
        positive = ("patch_size", "temporal_patch", "channels", "dim", "depth", "heads", "mlp_hidden",
                    "position_grid", "spatial_merge", "out_dim")
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"encoder.{name} ({value}) must be >= 1")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ValueError(f"encoder.{name} ({getattr(self, name)}) must be > 0")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"encoder.activation ({self.activation!r}) must be one of {', '.join(ACTIVATIONS)}")
        if self.dim % self.heads or (self.dim // self.heads) % 4:
            raise ValueError(f"encoder.heads ({self.heads}) must divide encoder.dim ({self.dim}) into heads of a "
                             f"multiple of 4 (the 2-D rotary turns pairs of each half: rows', columns')")
        layers = list(self.deepstack_layers)
        if layers != sorted(set(layers)) or any(not 0 <= i < self.depth for i in layers):
            raise ValueError(f"encoder.deepstack_layers ({layers}) must be increasing block indices in "
                             f"[0, {self.depth}) (encoder.depth: {self.depth})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def patch_numel(self) -> int:
        """Values of one flattened patch: (channels, temporal_patch, patch_size, patch_size)."""
        return self.channels * self.temporal_patch * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        """Width of one merged token before a merger's MLP."""
        return self.dim * self.spatial_merge**2

    @property
    def tp_split(self) -> dict[str, int]:
        """The widths tensor parallelism splits (the mergers' hidden: merged_dim)."""
        return {"heads": self.heads, "mlp_hidden": self.mlp_hidden, "merged_dim": self.merged_dim}
