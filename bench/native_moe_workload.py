"""The native-resolution multimodal MoE workload of the several-GPU benchmarks, written to a
directory as a user would hold it: a Qwen3-VL-MoE checkpoint with random weights, conversation
records with images of a mix of sizes, and the run config (`workload.yaml`) that trains them in
packed rows; every GPU script that takes a config takes it.

- The checkpoint: Qwen3-VL-30B-A3B's vision tower as it is (27 blocks of 1,152, patches of 16,
  the 2 x 2 merger, DeepStack after blocks 8, 16 and 24: 0.54 B parameters), and a Qwen3-MoE LLM
  of its layer shapes scaled to one host (2,048 wide, 32 query and 4 key-value heads of 128, q/k
  norms, experts of 768 with top-8; 24 layers of 48 experts where it has 48 of 128: 1.5 B
  parameters a token, as `dyad plan` counts them, of 6.0 B). At 16 bytes a parameter trained in bf16 with float32 state (weights, gradients, two
  moments) the LLM alone is 96 GB: one H200 holds it only with its activations spread, so the
  sweeps' LLM layouts take ep >= 2. Weights random (normal, 0.02; norms one, biases zero) in
  bfloat16, sharded with their index, as transformers writes; `config.json` is transformers'
  `Qwen3VLMoeConfig`'s, `preprocessor_config.json` Qwen3-VL's processor with images resized to at
  most 1,048,576 pixels (1,024 tokens).
- The data: `--samples` conversations (LLaVA's `conversations` with human / gpt turns), of one to
  three turns, the first with one image (80 %), two (10 %) or none (10 %); questions of 8 to 40
  words and answers of 16 to 240 of a 4,000-word vocabulary; the images drawn from `--images`
  random-pixel PNGs of the sizes in `SIZES` (phone photos, screenshots, documents, thumbnails)
  with the weights given there. A word-level tokenizer of that vocabulary with ChatML's special
  tokens and template.
- The config: the two from_hf, the data, packed rows of 8,192 tokens (`train.seq_len`), bf16 with
  working weights, compiled blocks, a global batch of 64 samples, and a starting layout for
  eight GPUs (encoder dp 2; LLM dp 6 with ep 2); the sweeps set their own.

    python bench/native_moe_workload.py --dir $OUT/workload            # the GPU host's (about 13 GB)
    python bench/native_moe_workload.py --toy --dir /tmp/workload      # tiny, CPU (CI)
    python bench/native_moe_workload.py --no-weights --dir /tmp/shapes # all but the weights: dyad plan
    python bench/module_profile.py $OUT/workload/workload.yaml --out $OUT/profile.json
    NCCL_NVLS_ENABLE=0 python bench/plan_sweep.py $OUT/workload/workload.yaml --gpus 8 \\
        --profile $OUT/profile.json --out $OUT/plan_sweep.json --work $OUT/runs
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATE_WORDS = ["system", "user", "assistant", "You", "are", "a", "helpful", "."]

# Qwen3-VL-30B-A3B's tower, whole; its LLM's layer shapes, fewer layers and experts.
VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
          "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "deepstack_visual_indexes": [8, 16, 24], "num_position_embeddings": 2304, "out_hidden_size": 2048}
TEXT = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
        "num_experts": 48, "num_experts_per_tok": 8, "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20]}}
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
             "merge_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 1048576},
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# (width, height): weight. Resized by the processor to multiples of 32 within its pixel bounds.
SIZES = {(1024, 768): 3, (768, 1024): 2, (1280, 720): 2, (800, 600): 3, (640, 480): 3, (1920, 1080): 1,
         (612, 792): 1, (448, 448): 2, (336, 336): 2, (256, 256): 1}

TOY_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "in_channels": 3,
              "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "deepstack_visual_indexes": [0],
              "num_position_embeddings": 16, "out_hidden_size": 32}
TOY_TEXT = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [4, 2, 2]}}
TOY_PROCESSOR = {**PROCESSOR, "patch_size": 4, "size": {"shortest_edge": 256, "longest_edge": 4096}}
TOY_SIZES = {(37, 23): 1, (64, 96): 1, (20, 12): 1, (16, 40): 1}
SHARD_BYTES = 5 * 1024**3


def hf_config(vision: dict, text: dict, vocab_rows: int):
    """transformers' Qwen3VLMoeConfig of these shapes, the LLM's vocabulary `vocab_rows`."""
    import transformers

    return transformers.Qwen3VLMoeConfig(vision_config=vision, text_config={**text, "vocab_size": vocab_rows},
                                         tie_word_embeddings=False)


def random_value(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A weight of a freshly initialised model: norms one, biases zero, the rest normal (0.02)."""
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if "norm" in name.rsplit(".", 2)[-2]:
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def write_checkpoint(directory: Path, config, processor: dict, weights: bool = True) -> int:
    """Random bfloat16 weights under transformers' names, in shards with their index (unless not
    `weights`); the config and the processor's JSON. Returns the bytes written."""
    import transformers

    config.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    if not weights:
        return 0
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in transformers.Qwen3VLMoeForConditionalGeneration(config)
                  .state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    shards, shard, size, total = [], {}, 0, 0
    for name, shape in shapes.items():
        tensor = random_value(name, shape, generator)
        if shard and size + tensor.nbytes > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name], size, total = tensor, size + tensor.nbytes, total + tensor.nbytes
    shards.append(shard)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        print(f"checkpoint: {file} written ({sum(t.nbytes for t in tensors.values()) / 1e9:.2f} GB)", flush=True)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def write_tokenizer(directory: Path, words: list[str]) -> Path:
    """A word-level tokenizer.json of `words` with ChatML's special tokens, and its
    tokenizer_config.json with the template."""
    vocab = {token: i for i, token in enumerate(["<unk>", *SPECIALS, *dict.fromkeys([*TEMPLATE_WORDS, *words])])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>",
              "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def write_images(directory: Path, sizes: dict, count: int, rng: np.random.Generator) -> list[str]:
    """`count` PNGs of random pixels, their (width, height) drawn from `sizes` by weight."""
    (directory / "images").mkdir(exist_ok=True)
    choices, weights = list(sizes), np.array(list(sizes.values()), dtype=float)
    names = []
    for k in range(count):
        width, height = choices[rng.choice(len(choices), p=weights / weights.sum())]
        name = f"images/{k:04d}_{width}x{height}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(directory / name)
        names.append(name)
    return names


def conversations(samples: int, images: list[str], words: list[str], scale: float, rng: random.Random) -> list[dict]:
    """LLaVA-format records: one to three turns, the first with 1 image (80 %), 2 (10 %) or none;
    questions of 8 to 40 words and answers of 16 to 240 (times `scale`)."""

    def text(low: int, high: int) -> str:
        return " ".join(rng.choices(words, k=max(1, round(rng.randint(low, high) * scale))))

    records = []
    for _ in range(samples):
        draw = rng.random()
        shown = rng.sample(images, 1 if draw < 0.8 else 2 if draw < 0.9 else 0)
        turns = []
        for turn in range(rng.choice([1, 1, 2, 3])):
            question = text(8, 40)
            if turn == 0 and shown:
                question = "<image>\n" * len(shown) + question
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": text(16, 240)}]
        records.append({"images": shown, "conversations": turns})
    return records


def run_config(directory: Path, toy: bool) -> dict:
    """The run config that trains the workload (see the module docstring)."""
    common = {"seed": 0,
              "data": {"name": "conversations", "path": str(directory / "conversations.jsonl"),
                       "tokenizer": str(directory / "tokenizer.json"), "channels": 3, "heldout_fraction": 0.05},
              "encoder": {"from_hf": str(directory)}, "llm": {"from_hf": str(directory)},
              "checkpoint": {"interval_steps": 0}, "router": {"max_recoveries": 0, "step_timeout_s": 600}}
    if toy:
        return common | {"train": {"device": "cpu", "steps": 3, "global_batch": 8, "microbatches": 2, "seq_len": 256,
                                   "warmup_steps": 1},
                         "parallel": {"encoder": {"dp": 1}, "llm": {"dp": 1}}}
    return common | {"train": {"device": "cuda", "dtype": "bfloat16", "working_weights": True, "compile": True,
                               "steps": 1000, "global_batch": 64, "microbatches": 2, "seq_len": 8192, "lr": 3.0e-4,
                               "warmup_steps": 20},
                     "parallel": {"encoder": {"dp": 2}, "llm": {"dp": 6, "ep": 2}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="where to write it (created; must be empty)")
    parser.add_argument("--toy", action="store_true", help="tiny shapes, a few samples, CPU (CI)")
    parser.add_argument("--samples", type=int, help="conversations (default: 4,096; toy 24)")
    parser.add_argument("--images", type=int, help="distinct images (default: 64; toy 4)")
    parser.add_argument("--no-weights", dest="weights", action="store_false",
                        help="everything but the weights: enough for `dyad plan`, not to train")
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise SystemExit(f"--dir {directory} is not empty")
    toy = args.toy
    samples, image_count = args.samples or (24 if toy else 4096), args.images or (4 if toy else 64)
    words = [f"w{i}" for i in range(60 if toy else 4000)]
    rng = random.Random(0)
    images = write_images(directory, TOY_SIZES if toy else SIZES, image_count, np.random.default_rng(0))
    records = conversations(samples, images, words, 0.1 if toy else 1.0, rng)
    (directory / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = write_tokenizer(directory, words)
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    text = TOY_TEXT if toy else TEXT
    config = hf_config(TOY_VISION if toy else VISION, text, max(vocab, text["vocab_size"]))
    total = write_checkpoint(directory, config, TOY_PROCESSOR if toy else PROCESSOR, args.weights)
    (directory / "workload.yaml").write_text(yaml.safe_dump(run_config(directory, toy), sort_keys=False))
    print(f"{directory}: {samples} conversations over {image_count} images, a {total / 1e9:.2f} GB checkpoint, "
          f"workload.yaml")


if __name__ == "__main__":
    main()
