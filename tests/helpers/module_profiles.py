"""Profiles of a config's modules as `bench/module_profile.py` writes them, with times made up
from simple per-patch and per-token costs: what `dyad plan --gpus` should then recommend is
known without a GPU."""

from __future__ import annotations

import json

from dyad.app.module_costs import model_shape, profile_depths, train_settings
from dyad.router.encoder_cost import image_patches


def synthetic_profile(path, config, *, ms_per_patch: float, ms_per_token: float, device_memory_gib=None,
                      **changes) -> str:
    """A profile of the resolved `config` at `path`: an encoder call costs 0.1 ms and `ms_per_patch`
    a patch (a millionth of it more a patch squared), forward alone a third of it; an LLM layer
    `ms_per_token` a token, the rest of the LLM a tenth of that; AdamW 1e-6 ms a parameter.
    `changes`: sections of the profile replaced (to break it)."""
    patches = image_patches(config.encoder)(config.encoder.tokens_per_image if config.encoder.native is None else 64)
    encoder = []
    for images in (1, 4, 16):
        ms = 0.1 + images * (ms_per_patch * patches + 1e-6 * ms_per_patch * patches**2)
        encoder.append({"images": images, "patches_per_image": patches, "tokens_per_image": 0, "ms": ms,
                        "forward_ms": ms / 3})
    llm = []
    for depth in profile_depths(config.llm):
        for rows, seq_len in ((1, 16), (1, 64), (4, 16), (2, 64)):
            tokens = rows * seq_len
            llm.append({"layers": depth, "rows": rows, "seq_len": seq_len,
                        "ms": 0.1 + ms_per_token * tokens * (depth + 0.1)})
    profile = {"device": "synthetic", "torch": "-", "device_memory_gib": device_memory_gib,
               "shape": model_shape(config), "train": train_settings(config),
               "encoder": {"points": encoder},
               "llm": {"points": llm, "optimizer": {"parameters": 1_000_000, "ms": 1.0}}}
    profile.update(changes)
    with open(path, "w") as f:
        json.dump(profile, f)
    return str(path)
