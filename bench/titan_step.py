"""torchtitan 0.3.0's own Qwen3 MoE model trained as its trainer trains on one GPU, one optimizer
step timed: the peer of bench/llm_step.py's "qwen3-1b-active" in the same run. The model is a
flavor registered in torchtitan's qwen3 registry (`qwen3_configs`, built with its own
`_build_qwen3_moe_layers` and inits) with dyad's shape: vocab 32,000, dim 2048, 16 layers, 32
query / 4 kv heads of 128 with per-head q/k RMSNorm, rope theta 1e6, 32 experts of 768, top-8,
softmax routing with normalised top-k, no shared expert, RMSNorm eps 1e-6, untied output; its
aux-loss-free load balancing (expert bias, `load_balance_coeff` 1e-3, updated in an optimizer
pre-hook), no auxiliary loss. The step is the trainer's (torchtitan/trainer.py): torch.distributed
over one rank, `ParallelDims` and the default `spmd_types` backend, `parallelize_qwen3` (each
block compiled, FSDP2 with bf16 parameters and fp32 reduction over the one-rank mesh), meta-device
build then `init_weights`, flex attention with the packed-document block-causal mask built per
microbatch from positions (one document per sequence here, so the mask is causal; one mask for all
microbatches under CUDA graphs, see make_step), its `CrossEntropyLoss` (fp32, summed, divided by the
step's tokens) over the whole logits (`--loss chunked`: the qwen3 recipes' `ChunkedLossWrapper`,
whose backward fails under torch 2.11's FSDP2), a CUDA graph around each microbatch's forward +
backward (the trainer's default; `--no-cuda-graphs`), gradient-norm clipping at 1.0,
fused AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.01, as bench/llm_step.py). No
activation checkpointing (as llm_step's compiled variants; `--ac selective|full` for the recipes').
Not timed: the data loader, the learning-rate scheduler (constant lr), metrics and checkpoints.
On torch 2.11 (the GPU hosts) two names torchtitan 0.3.0 takes from torch 2.13 are stood in for
(shim_older_torch).

MFU as bench/llm_step.py: (6 x active non-embedding parameters + 12 x layers x heads x head_dim x sequence) x
tokens / step time / 989 TFLOP/s.

Wheels the GPU hosts lack (from the checkout, then on the host):
    bash ../shared/gpu/fetch-wheels.sh torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
        docstring_parser==0.18.0 typeguard==4.6.1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH

    python bench/titan_step.py --out $OUT/titan_step.json [--microbatches 2 --sequences 4]
    python bench/titan_step.py --toy                  # CPU, tiny, eager, gloo (a check, not a time)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import tempfile

import torch
from moe_layer import median_ms  # beside this script
from run_info import bench_device, run_header, write_json  # beside this script

PEAK_TFLOPS = 989.0
SHAPES = {  # dyad's "qwen3-1b-active" and a CPU toy
    "qwen3-1b-active": dict(vocab=32000, dim=2048, layers=16, heads=32, kv_heads=4, head_dim=128,
                            experts=32, expert_dim=768, top_k=8, seq=4096),
    "toy": dict(vocab=128, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                experts=4, expert_dim=32, top_k=2, seq=128),
}


def register_flavor(name: str, shape: dict, causal_sdpa: bool = False) -> None:
    """Adds `name` to torchtitan's qwen3 registry, built as its 30B-A3B flavor is; `causal_sdpa`
    (the CPU toy: flex attention has no backward on CPU) puts SDPA with is_causal in flex's place."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, ScaledDotProductAttention
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
        qwen3_configs,
    )

    s = shape

    def flavor(attn_backend: str, moe_comm_backend: str = "standard") -> Qwen3Model.Config:
        config = Qwen3Model.Config(
            vocab_size=s["vocab"], dim=s["dim"], norm=_qwen3_norm(s["dim"]),
            tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"],
                                            param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"], param_init=_LINEAR_INIT),
            layers=_build_qwen3_moe_layers(
                fuse_qkv=True, n_layers=s["layers"], dim=s["dim"], n_heads=s["heads"], n_kv_heads=s["kv_heads"],
                head_dim=s["head_dim"], moe_hidden_dim=s["expert_dim"], num_experts=s["experts"],
                top_k=s["top_k"], attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
                rope=CosSinRoPE.Config(dim=s["head_dim"], max_seq_len=s["seq"], theta=1e6)),
        )
        for layer in config.layers if causal_sdpa else ():
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        return config

    qwen3_configs[name] = flavor


def trainer_config(flavor: str, args, seq: int, compiled: bool) -> argparse.Namespace:
    """The parts of the Trainer.Config a qwen3 recipe would hold for this run
    (torchtitan/models/qwen3/config_registry.py); not Trainer.Config itself, whose module imports
    the data loaders' packages (torchdata, datasets), absent on the GPU hosts."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.qwen3 import model_registry

    spec = model_registry(flavor, attn_backend="flex")
    ac = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[args.ac]
    loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
    return argparse.Namespace(
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=loss) if args.loss == "chunked" else loss,
        optimizer=default_adamw(lr=1e-4, weight_decay=0.01),  # AdamW, betas (0.9, 0.95), eps 1e-8, fused
        training=TrainingConfig(local_batch_size=args.sequences, global_batch_size=args.sequences * args.microbatches,
                                seq_len=seq, disable_cuda_graphs=not args.cuda_graphs),
        parallelism=ParallelismConfig(),  # dp_shard -1: FSDP over the one rank
        compile=CompileConfig(enable=compiled, components=["model"]),
        activation_checkpoint=ac,
    )


def titan_on_cpu() -> None:
    """torchtitan takes "cuda" when it finds no accelerator; the CPU toy tells it otherwise (gloo)
    before the modules that copy its device type are imported."""
    import sys

    import torchtitan.tools.utils as titan_utils

    assert "torchtitan.distributed.parallel_dims" not in sys.modules, "patch before its import"
    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu


def shim_older_torch() -> None:
    """torchtitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims`, new in torch 2.13
    (the GPU hosts run 2.11): set before its modules load; on one rank its spmd_types path never hands one to fully_shard
    (`resolve_fsdp_mesh` returns None for a size-1 mesh), so a stand-in name is enough."""
    from torch.distributed import fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass
        class DataParallelMeshDims:
            shard: str | tuple[str, ...] | None = None
            replicate: str | None = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
    # its mask builder passes create_block_mask's `separate_full_blocks` (torch 2.13; True, the
    # only behaviour of 2.11's create_block_mask)
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:

        def without_flag(*args, separate_full_blocks: bool = True, **kwargs):
            assert separate_full_blocks, "torch 2.11 always separates full blocks"
            return create_block_mask(*args, **kwargs)

        attention._compiled_create_block_mask = torch.compile(without_flag)


def init_one_rank(device: str) -> None:
    """The environment torchrun gives one rank; torchtitan's init_distributed reads it (env://)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from torchtitan.config import CommConfig
    from torchtitan.distributed import utils as dist_utils

    dist_utils.init_distributed(CommConfig(), base_folder=tempfile.mkdtemp(prefix="titan_step"))
    if device == "cuda":
        torch.cuda.set_device(0)


def build(config, device: str):
    """What Trainer.__init__ does for one rank without pipeline parallelism: returns the parallelized
    model, its loss, optimizers and the forward + backward of one microbatch (CUDA-graphed on a GPU
    unless disabled), in the trainer's order."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
    from torchtitan.tools import utils

    parallel_dims = ParallelDims.from_config(config.parallelism, torch.distributed.get_world_size())
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    torch.manual_seed(0)
    spec, model_config = config.model_spec, config.model_spec.model
    # Qwen3Model.Config.update_from_config without its Trainer import: with the standard token
    # dispatcher and the rope cache already at seq_len, what remains is the sharding config
    set_qwen3_sharding_config(model_config, enable_sp=config.parallelism.enable_sequence_parallel,
                              enable_ep=config.parallelism.expert_parallel_degree > 1)
    with torch.device("meta"), utils.set_default_dtype(torch.float32):
        model = model_config.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint, dump_folder=tempfile.mkdtemp())
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)  # MoE expert-bias update hook
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    def forward_backward(inputs, labels, global_valid_tokens, extra_kwargs):  # Trainer._forward_backward_body
        import spmd_types as spmd

        with train_context():
            pred = model(inputs, **extra_kwargs)
            loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra_kwargs["positions"])
            del pred
            with spmd.no_typecheck():
                loss.backward()
        return loss

    graphed = device == "cuda" and not config.training.disable_cuda_graphs
    return model, optimizers, wrap_with_cuda_graph(forward_backward) if graphed else forward_backward


def make_step(model, optimizers, forward_backward, config, vocab: int, S: int, M: int, B: int, device: str):
    """One optimizer step as Trainer.train_step takes it: M microbatches of B sequences of S tokens
    (one document each), gradients accumulated, the loss normalised by the step's token count."""
    from torchtitan.distributed import utils as dist_utils

    ids = torch.randint(vocab, (M, B, S), device=device)
    labels = torch.randint(vocab, (M, B, S), device=device)
    positions = torch.arange(S, device=device).expand(B, S).contiguous()  # one document per sequence
    params = [p for p in model.parameters()]
    keep_grads = not config.training.disable_cuda_graphs  # the trainer zeroes in place under graphs
    masked = device == "cuda"  # the CPU toy's SDPA takes no mask
    # Under CUDA graphs one mask serves every microbatch (its positions never change): torch 2.11's
    # BlockMask carries its mask_mod closure in the structure the graph checks, so a fresh mask per
    # microbatch, as the trainer builds, fails that check
    shared_mask = model.get_attention_masks(positions=positions) if masked and keep_grads else None

    def step():
        optimizers.zero_grad(set_to_none=not keep_grads)
        global_valid_tokens = torch.tensor(M * B * S, dtype=torch.int64).to(device)
        for m in range(M):
            extra = {"positions": positions}
            if masked:  # Trainer.post_dataloading_process, for flex attention
                extra["attention_masks"] = (shared_mask if shared_mask is not None
                                           else model.get_attention_masks(positions=positions))
            forward_backward(ids[m], labels[m], global_valid_tokens, extra)
        dist_utils.clip_grad_norm_(params, config.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()

    return step


def parameter_counts(model, shape: dict) -> tuple[int, int]:
    """(active, total) from the model's own parameters: active leaves out the input embedding and
    the (experts - top_k) / experts share of the routed experts' weights."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    experts = sum(p.numel() for block in model.layers.values()
                  for p in block.moe.routed_experts.inner_experts.parameters())
    idle = experts * (shape["experts"] - shape["top_k"]) // shape["experts"]
    return total - embedding - idle, total


def dyad_active(shape: dict) -> int:
    """bench/llm_step.py's count for the same shape (it leaves out the q/k and final norms)."""
    from llm_step import active_parameters  # beside this script

    from dyad.llm_service.config import LLMConfig, MoEConfig

    s = shape
    cfg = LLMConfig(vocab_size=s["vocab"], dim=s["dim"], n_layers=s["layers"], n_heads=s["heads"],
                    n_kv_heads=s["kv_heads"], head_dim=s["head_dim"], qk_norm="head", dense_layers=(),
                    max_seq_len=s["seq"], moe=MoEConfig(num_experts=s["experts"], top_k=s["top_k"],
                                                        expert_dim=s["expert_dim"]))
    return active_parameters(cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--ac", choices=("none", "selective", "full"), default="none")
    parser.add_argument("--loss", choices=("chunked", "full"), default="full",
                        help="the qwen3 recipes' ChunkedLossWrapper (its backward fails under torch 2.11's FSDP2), "
                             "or cross entropy over the whole sequence's logits")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="forward + backward launched eagerly (the trainer's --training.disable_cuda_graphs)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = bench_device(args.toy)
    name = "toy" if device == "cpu" else "qwen3-1b-active"
    shape, S, M, B = SHAPES[name], SHAPES[name]["seq"], args.microbatches, args.sequences
    if device == "cpu":
        titan_on_cpu()
    shim_older_torch()
    init_one_rank(device)
    register_flavor(f"dyad-{name}", shape, causal_sdpa=device == "cpu")
    config = trainer_config(f"dyad-{name}", args, S, compiled=args.compile and device == "cuda")
    model, optimizers, forward_backward = build(config, device)
    active, total = parameter_counts(model, shape)
    step = make_step(model, optimizers, forward_backward, config, shape["vocab"], S, M, B, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = median_ms(step, args.iters, device) / 1e3
    tokens = M * B * S
    tflops = (6 * active + 12 * shape["layers"] * shape["heads"] * shape["head_dim"] * S) * tokens / seconds / 1e12
    dyad_count = dyad_active(shape)
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
    print(f"torchtitan-0.3.0 {name}: active {active / 1e9:.3f}B (dyad's formula {dyad_count / 1e9:.3f}B, "
          f"{active - dyad_count:+,}) of {total / 1e9:.3f}B params")
    print(f"torchtitan-0.3.0 {M}mb-x{B}{'-compiled' if config.compile.enable else ''}"
          f"{'' if config.training.disable_cuda_graphs or device != 'cuda' else '-cudagraph'}, {tokens} tokens/step: "
          f"{seconds * 1e3:.1f} ms/step, {tokens / seconds:,.0f} tok/s, {tflops:.0f} TFLOP/s, "
          f"MFU {tflops / PEAK_TFLOPS:.1%}, peak memory {peak_gb:.1f} GB")
    result = {
        **run_header(device), "shape": shape, "active_params": active, "total_params": total,
        "dyad_formula_active_params": dyad_count, "microbatches": M, "sequences_per_microbatch": B,
        "compiled_blocks": config.compile.enable, "cuda_graphs": device == "cuda" and args.cuda_graphs,
        "activation_checkpointing": args.ac, "loss": args.loss, "step_s": seconds, "tokens_per_step": tokens,
        "tokens_per_s": tokens / seconds, "model_tflops": tflops, "mfu": tflops / PEAK_TFLOPS,
        "peak_memory_gb": peak_gb,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if device == "cuda" else 0.0,
    }
    write_json(args.out, result)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
