"""A short profile of a config's two modules on one device, for `dyad plan --gpus N --profile`
(dyad/app/recommend.py) to predict every split of N GPUs from: each model built as the config
resolves it (random weights, the config's dtype, `train.compile` and `train.recompute`), on one
device, timed at several sizes.

- Encoder: forward + backward, and forward alone without autograd (a frozen encoder's), of one
  call over images of one size: a native-resolution tower (Qwen3-VL's) at square images of
  `NATIVE_SIDES` patches a side, as many a call as make about `NATIVE_PATCHES` patches, and the
  smallest also alone; a fixed-resolution tower at its one size, `FIXED_IMAGES` images a call.
- LLM: forward + backward of one microbatch of random tokens (no image rows: they replace token
  embeddings, which costs nothing here) at rows x seq_len of `SEQ_LENS` up to llm.max_seq_len,
  each length as one row and as `ROWS` rows; through the decoder cut to two depths
  (`dyad.app.module_costs.profile_depths`), so that a model whose whole does not fit one GPU is
  profiled all the same; and AdamW's step over the deeper model's parameters.

    python bench/module_profile.py qwen3-30b-a3b-siglip2-8gpu llm.from_hf=... --out $OUT/profile.json   # a GPU
    python bench/module_profile.py --toy --out profile.json   # CPU, the digits config, tiny (CI)

The config and its KEY=VALUE overrides as `dyad plan` takes them (default: digits); the JSON is
`dyad.app.module_costs`'s profile.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from moe_layer import median_ms  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script

from dyad import config as config_lib
from dyad.app.module_costs import model_shape, profile_depths, train_settings
from dyad.compile import compile_blocks
from dyad.data import make_dataset
from dyad.optim import build_optimizer
from dyad.recompute import recompute_blocks
from dyad.service import build_model, compute_context

NATIVE_SIDES = {"cuda": [16, 32, 64, 96, 128], "cpu": [4, 8, 12]}  # patches a side, even (the 2 x 2 merge)
NATIVE_PATCHES = {"cuda": 16384, "cpu": 256}
FIXED_IMAGES = {"cuda": [1, 8, 32, 64], "cpu": [1, 4, 8]}
SEQ_LENS = {"cuda": [512, 1024, 2048, 4096], "cpu": [8, 16, 32]}
ROWS = 2


def resolved_config(name: str | None, overrides: list[str], device: str):
    config = config_lib.load(name, [*overrides, f"train.device={device}"])
    vocab_size = make_dataset(config.data).tokenizer.vocab_size
    return config_lib.resolve(config, vocab_size=vocab_size)


def prepared(model, config, pool: str):
    """`model` as a worker of `pool` runs its blocks: recomputed, compiled, per the config."""
    train = config.train
    if pool in train.recompute:
        recompute_blocks(model)
    if train.compile:
        compile_blocks(model, train.compile_backend)
    return model


def encoder_inputs(config, patches_per_image: int, images: int, device: str):
    """What one encoder call takes for `images` images of `patches_per_image` patches each, and the
    upstream gradient of each output."""
    enc, dtype = config.encoder, torch.bfloat16 if config.train.dtype == "bfloat16" else torch.float32
    if enc.native is None:
        pixels = torch.randn(images, enc.channels, enc.image_size, enc.image_size, device=device)
        outputs = [(images, enc.tokens_per_image, enc.out_dim)]
        return (pixels,), outputs
    native, side = enc.native, int(patches_per_image**0.5)
    pixel_values = torch.randn(images * patches_per_image, native.patch_numel, device=device, dtype=dtype)
    grid_thw = torch.tensor([(1, side, side)] * images, device=device)
    tokens = images * patches_per_image // native.spatial_merge**2
    levels = len(native.deepstack_layers) if config.llm.deepstack_levels else 0
    return (pixel_values, grid_thw), [(tokens, native.out_dim)] * (1 + levels)


def encoder_call(model, config, inputs, shapes, device: str, *, backward: bool):
    enc = config.encoder
    upstream = [torch.randn(*shape, device=device) for shape in shapes]

    def run():
        with compute_context(config), torch.set_grad_enabled(backward):
            if enc.native is None:
                outputs = [model(*inputs)]
            elif config.llm.deepstack_levels:
                merged, levels = model(*inputs)
                outputs = [merged, *levels]
            else:
                outputs = [model.merged_tokens(*inputs)]
        if backward:
            sum((x.float() * u).sum() for x, u in zip(outputs, upstream, strict=True)).backward()

    return run


def encoder_points(config, device: str, iters: int) -> list[dict]:
    enc = config.encoder
    model = prepared(build_model(config, "encoder", device, pretrained=False), config, "encoder")
    if enc.native is None:
        sizes = [(enc.positions, n) for n in FIXED_IMAGES[device]]
        tokens = enc.tokens_per_image
    else:
        sides = NATIVE_SIDES[device]
        sizes = [(sides[0] ** 2, 1)] + [(s * s, max(1, NATIVE_PATCHES[device] // (s * s))) for s in sides]
    points = []
    for patches, images in sizes:
        inputs, shapes = encoder_inputs(config, patches, images, device)
        if enc.native is not None:
            tokens = patches // enc.native.spatial_merge**2
        ms = median_ms(encoder_call(model, config, inputs, shapes, device, backward=True), iters, device)
        forward = median_ms(encoder_call(model, config, inputs, shapes, device, backward=False), iters, device)
        points.append({"images": images, "patches_per_image": patches, "tokens_per_image": tokens,
                       "ms": ms, "forward_ms": forward})
        print(f"encoder: {images} images of {patches} patches: fwd+bwd {ms:.2f} ms, fwd {forward:.2f} ms")
    return points


def llm_shapes(max_seq_len: int, device: str) -> list[tuple[int, int]]:
    lengths = [s for s in SEQ_LENS[device] if s <= max_seq_len] or [max_seq_len]
    return sorted({(rows, s) for s in lengths for rows in (1, ROWS)})


def llm_points(config, device: str, iters: int) -> tuple[list[dict], dict]:
    points = []
    for depth in profile_depths(config.llm):
        llm = dataclasses.replace(config.llm, n_layers=depth, deepstack_levels=0,
                                  dense_layers=tuple(i for i in config.llm.dense_layers if i < depth))
        at_depth, optimizer = depth_points(dataclasses.replace(config, llm=llm), device, iters)
        points += at_depth
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"AdamW: {optimizer['parameters']:,} parameters in {optimizer['ms']:.2f} ms")
    return points, optimizer


def depth_points(cut, device: str, iters: int) -> tuple[list[dict], dict]:
    """The LLM of the config `cut` (its depth cut) at every shape, and its AdamW step."""
    model = prepared(build_model(cut, "llm", device, pretrained=False), cut, "llm")
    points = []
    for rows, seq_len in llm_shapes(cut.llm.max_seq_len, device):
        ms = median_ms(llm_microbatch(model, cut, rows, seq_len, device), iters, device)
        points.append({"layers": cut.llm.n_layers, "rows": rows, "seq_len": seq_len, "ms": ms})
        print(f"llm, {cut.llm.n_layers} layers: {rows} x {seq_len} tokens fwd+bwd {ms:.2f} ms")
    optimizer = build_optimizer(model, cut.train)  # the gradients of the microbatches above are there
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return points, {"parameters": parameters, "ms": median_ms(optimizer.step, iters, device)}


def llm_microbatch(model, config, rows: int, seq_len: int, device: str):
    ids = torch.randint(config.llm.vocab_size, (rows, seq_len), device=device)
    targets = torch.randint(config.llm.vocab_size, (rows, seq_len), device=device)

    def step():
        with compute_context(config):
            logits, aux = model(ids)
            loss = model.loss_sum(logits, targets) / ids.numel() + aux
        loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="a YAML run config, or the NAME of one dyad ships (default: digits)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--toy", action="store_true", help="CPU, the config as given (digits: tiny)")
    parser.add_argument("--iters", type=int, help="timed runs of each point (default: 5 on a GPU, 2 on CPU)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    iters = args.iters or (5 if device == "cuda" else 2)
    if device == "cpu":  # tiny shapes gain nothing from threads, which spin on a busy CI host
        torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.config and "=" in args.config:  # no config named: the first argument is an override
        args.overrides, args.config = [args.config, *args.overrides], None
    config = resolved_config(args.config, args.overrides, device)
    llm, optimizer = llm_points(config, device, iters)
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else None
    result = {**run_header(device), "config": args.config or "digits", "overrides": args.overrides,
              "device_memory_gib": memory, "shape": model_shape(config), "train": train_settings(config),
              "encoder": {"points": encoder_points(config, device, iters)},
              "llm": {"depths": list(profile_depths(config.llm)), "points": llm, "optimizer": optimizer}}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
