"""What each module costs on one GPU, from a short profile (`bench/module_profile.py` writes it),
as curves `dyad plan --gpus` (dyad/app/recommend.py) evaluates at any image size and token count.
Torch-free: the profile is JSON.

The profile, of the models a config resolves to, each on one device, random weights:
- `shape`: `model_shape(config)`; a profile of another model is refused;
- `train`: the dtype, compile and recompute it ran with (the config's);
- `encoder.points`: `images` images of `patches_per_image` patches each in one call, forward +
  backward `ms` and forward alone (no autograd, as a frozen encoder runs) `forward_ms`;
- `llm.points`: one microbatch of `rows` rows of `seq_len` tokens, forward + backward `ms`,
  through the decoder cut to `layers` layers (two depths: the model itself need not fit);
- `llm.optimizer`: AdamW's step over `parameters` parameters, `ms`;
- `device_memory_gib`: the GPU's memory.

The curves (P: an image's patches; T: a microbatch's tokens, padding included; Q: the sum over
its rows of seq_len**2):
- an encoder call of images P_i: c + a * sum(P_i) + b * sum(P_i**2), the quadratic term the
  attention within each image (`dyad.router.encoder_cost`'s form);
- an LLM layer: c + a * T + b * Q (causal attention over each row);
- the rest of the LLM (embedding, final norm, output and loss): c + a * T;
- AdamW: ms per parameter, for both pools.
Each shape's per-layer ms is the difference of its two depths over their difference, the rest
what the shallower one leaves; the first depth holds every dense layer (`profile_depths`), so
the layers counted per layer are MoE ones. Coefficients are fitted by least squares of the
relative error, and kept non-negative: the best fit among the subsets of terms whose
coefficients all come out >= 0.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dyad.router.encoder_cost import image_patches

PROFILE_SCRIPT = "bench/module_profile.py"


def model_shape(config) -> dict:
    """The dimensions of a resolved config's two models that their costs depend on."""
    enc, llm = config.encoder, config.llm
    if enc.native is not None:
        n = enc.native
        encoder = {"tower": "native", "patch_size": n.patch_size, "temporal_patch": n.temporal_patch, "dim": n.dim,
                   "depth": n.depth, "heads": n.heads, "mlp_hidden": n.mlp_hidden, "spatial_merge": n.spatial_merge,
                   "deepstack_layers": list(n.deepstack_layers), "out_dim": n.out_dim}
    else:
        encoder = {"tower": "fixed", "image_size": enc.image_size, "patch_size": enc.patch_size,
                   "channels": enc.channels, "dim": enc.dim, "depth": enc.depth, "heads": enc.heads,
                   "mlp_dim": enc.mlp_dim, "spatial_merge": enc.spatial_merge, "cls_token": enc.cls_token,
                   "out_dim": enc.out_dim}
    moe = llm.moe
    return {"encoder": encoder, "llm": {
        "dim": llm.dim, "n_layers": llm.n_layers, "n_heads": llm.n_heads, "n_kv_heads": llm.n_kv_heads,
        "head_dim": llm.head_dim, "attention": llm.attention, "vocab_size": llm.vocab_size,
        "dense_ffn_dim": llm.dense_ffn_dim, "dense_layers": list(llm.dense_layers), "num_experts": moe.num_experts,
        "top_k": moe.top_k, "expert_dim": moe.expert_dim, "shared_expert_dim": moe.shared_expert_dim,
        "deepstack_levels": llm.deepstack_levels, "fp8": llm.fp8}}


def train_settings(config) -> dict:
    """What of `train:` changes the modules' time on a GPU."""
    train = config.train
    return {"dtype": train.dtype, "compile": train.compile, "recompute": sorted(train.recompute)}


def profile_depths(llm) -> tuple[int, int]:
    """The decoder depths the profile times: the first holds every dense layer (they come first
    in the families dyad trains), the second one MoE layer more."""
    first = max(max(llm.dense_layers, default=-1) + 1, 1)
    return first, first + 1


@dataclass(frozen=True)
class Curve:
    """ms = sum of coefficient * feature, over the named features ("calls" is 1 per call)."""

    coefficients: dict[str, float]
    worst_error: float  # the largest relative error over the points it was fitted to

    def __call__(self, **features: float) -> float:
        return sum(value * features[name] for name, value in self.coefficients.items())


def fit(features: dict[str, Sequence[float]], ms: Sequence[float]) -> Curve:
    """The non-negative least-squares fit of relative error (see the module docstring)."""
    y = np.asarray(ms, dtype=float)
    names = list(features)
    X = np.column_stack([np.asarray(features[n], dtype=float) for n in names]) / y[:, None]
    best = None
    for size in range(len(names), 0, -1):
        for chosen in itertools.combinations(range(len(names)), size):
            columns = X[:, chosen]
            scale = np.abs(columns).max(axis=0)
            if (scale == 0).any():
                continue
            solution = np.linalg.lstsq(columns / scale, np.ones(len(y)), rcond=None)[0] / scale
            if (solution < 0).any():
                continue
            residual = float(np.abs(columns @ solution - 1).max())
            if best is None or residual < best[0] - 1e-12:
                best = (residual, dict(zip((names[i] for i in chosen), solution.tolist())))
    assert best is not None, "a single term with a positive sum always fits"
    coefficients = {name: best[1].get(name, 0.0) for name in names}
    return Curve(coefficients, best[0])


@dataclass(frozen=True)
class ModuleCosts:
    """A profile's fitted curves; ms throughout."""

    source: str
    device: str
    device_memory_gib: float | None
    encoder: Curve  # one call, forward + backward; features calls, patches, squares
    encoder_forward: Curve
    llm_layer: Curve  # one microbatch; features calls, tokens, squares
    llm_rest: Curve
    optimizer_ms_per_parameter: float
    patches_of: object  # tokens -> patches of an image, the config's tower's

    def encoder_ms(self, image_tokens: Sequence[int], *, backward: bool = True, share: float = 1.0) -> float:
        """One call over images of `image_tokens` LLM tokens each; `share`: the part of the work
        that grows with the images one rank does (the per-call part it does whole)."""
        patches = [self.patches_of(t) for t in image_tokens]
        curve = self.encoder if backward else self.encoder_forward
        return _shared(curve, share, patches=sum(patches), squares=sum(p * p for p in patches))

    def llm_ms(self, row_lengths: Sequence[int], layers: int, *, share: float = 1.0) -> float:
        """One microbatch of rows of these lengths through `layers` decoder layers; `share` as
        `encoder_ms`'s."""
        tokens, squares = sum(row_lengths), sum(s * s for s in row_lengths)
        return (_shared(self.llm_rest, share, tokens=tokens)
                + layers * _shared(self.llm_layer, share, tokens=tokens, squares=squares))


def _shared(curve: Curve, share: float, **features: float) -> float:
    per_call = curve.coefficients.get("calls", 0.0)
    return per_call + share * curve(calls=0, **features)


def load_profile(path: str | Path, config) -> ModuleCosts:
    """The profile at `path`, checked against the resolved `config` (ValueError naming the file and
    the field that differs), fitted."""
    where = f"--profile {path}"
    try:
        profile = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"{where}: {error.strerror} ({PROFILE_SCRIPT} writes a profile on a GPU)") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error})") from None
    for key in ("shape", "train", "encoder", "llm"):
        if not isinstance(profile, dict) or key not in profile:
            raise ValueError(f"{where}: no '{key}' section (not a profile {PROFILE_SCRIPT} wrote?)")
    _check_same(where, "the profile's model", profile["shape"], model_shape(config), "")
    _check_same(where, "the profile ran", profile["train"], train_settings(config), "train.")
    try:
        return _fitted(str(path), profile, config)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"{where}: malformed points ({type(error).__name__}: {error})") from None


def _check_same(where: str, what: str, theirs: dict, ours: dict, prefix: str) -> None:
    theirs, ours = _dotted(theirs, prefix), _dotted(ours, prefix)
    differ = [f"{key} {theirs.get(key)!r} there, {ours.get(key)!r} in this config"
              for key in sorted(set(theirs) | set(ours)) if theirs.get(key) != ours.get(key)]
    if differ:
        raise ValueError(f"{where}: {what} differs from this config's: {'; '.join(differ[:4])}"
                         + (f" (and {len(differ) - 4} more)" if len(differ) > 4 else "")
                         + f"; profile this config ({PROFILE_SCRIPT} CONFIG KEY=VALUE ...)")


def _dotted(values: dict, prefix: str) -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat |= _dotted(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _fitted(source: str, profile: dict, config) -> ModuleCosts:
    points = profile["encoder"]["points"]
    encoder_features = {"calls": [1.0] * len(points),
                        "patches": [p["images"] * p["patches_per_image"] for p in points],
                        "squares": [p["images"] * p["patches_per_image"] ** 2 for p in points]}
    layers, rest = _per_layer(profile["llm"]["points"])
    optimizer = profile["llm"]["optimizer"]
    memory = profile.get("device_memory_gib")
    return ModuleCosts(
        source=source, device=str(profile.get("device", "?")), device_memory_gib=float(memory) if memory else None,
        encoder=fit(encoder_features, [p["ms"] for p in points]),
        encoder_forward=fit(encoder_features, [p["forward_ms"] for p in points]),
        llm_layer=fit({"calls": [1.0] * len(layers), "tokens": [r * s for r, s, _ in layers],
                       "squares": [r * s * s for r, s, _ in layers]}, [ms for *_, ms in layers]),
        llm_rest=fit({"calls": [1.0] * len(rest), "tokens": [r * s for r, s, _ in rest]}, [ms for *_, ms in rest]),
        optimizer_ms_per_parameter=optimizer["ms"] / optimizer["parameters"],
        patches_of=image_patches(config.encoder),
    )


def _per_layer(points: list[dict]) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """(rows, seq_len, ms of one layer) and (rows, seq_len, ms of the rest) of each shape timed at
    two depths; a difference the timing noise made negative counts as a tiny positive one."""
    by_shape: dict[tuple[int, int], dict[int, float]] = {}
    for p in points:
        by_shape.setdefault((int(p["rows"]), int(p["seq_len"])), {})[int(p["layers"])] = float(p["ms"])
    layer, rest = [], []
    for (rows, seq), at in by_shape.items():
        if len(at) < 2:
            continue
        (d1, t1), (d2, t2) = sorted(at.items())[:2]
        per_layer = max((t2 - t1) / (d2 - d1), 1e-3 * t2)
        layer.append((rows, seq, per_layer))
        rest.append((rows, seq, max(t1 - d1 * per_layer, 1e-3 * t1)))
    if not layer:
        raise ValueError("no LLM shape timed at two depths")
    return layer, rest
