"""The `dyad` command.

    dyad train   [--config FILE] [--set key=value ...] [--steps N] [--device cpu|cuda] [--out DIR]
    dyad verify  [--config FILE] [--set key=value ...] [--steps N] [--tolerance T]
    dyad router  [--host H] [--port P]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from dyad import config as config_lib
from dyad.config import RunConfig
from dyad.data import make_dataset


def _add_job_arguments(parser: argparse.ArgumentParser, default_steps: int | None) -> None:
    parser.add_argument("--config", help="YAML run config (default: configs/digits.yaml)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config field by dotted key, e.g. --set train.lr=1e-3 (repeatable)",
    )
    parser.add_argument("--steps", type=int, default=default_steps, help="training steps")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    parser.add_argument("--out", help="output directory (default: runs/<timestamp>/)")
    parser.add_argument("--router", help="use a running router at HOST:PORT instead of a local one")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _job_config(args) -> RunConfig:
    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    overrides.append(f"train.device={device}")
    config = config_lib.load(args.config, overrides)
    out = args.out or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    return dataclasses.replace(config, out_dir=str(Path(out).resolve()))


def _resolved(config: RunConfig):
    dataset = make_dataset(config.data)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


def cmd_train(args) -> int:
    from dyad.evaluate import caption_accuracy, load_trained
    from dyad.jobs import append_record, plot_losses, run_job

    config = _job_config(args)
    print(f"dyad train: writing to {config.out_dir}")
    job = run_job(config, router=args.router, progress=not args.quiet)
    out_dir = Path(config.out_dir)
    if job.metrics:
        plot_losses(job.metrics, out_dir / "loss.png")
    if not job.succeeded:
        print(f"run {job.info.run_id} did not succeed: {job.info.message}", file=sys.stderr)
        return 1
    resolved, dataset = _resolved(config)
    encoder, llm = load_trained(resolved, job.final_checkpoint())
    accuracy, count = caption_accuracy(resolved, dataset, encoder, llm)
    append_record(out_dir, {"caption_accuracy": accuracy, "heldout_samples": count,
                            "step": job.info.total_steps})
    last = job.metrics[-1]
    print(
        f"done: {len(job.metrics)} steps, final loss {last['loss']:.4f}, "
        f"caption_accuracy {accuracy:.3f} on {count} held-out samples\n"
        f"  metrics: {out_dir / 'metrics.jsonl'}\n  plot: {out_dir / 'loss.png'}\n"
        f"  checkpoint: {job.final_checkpoint()}"
    )
    return 0


def cmd_verify(args) -> int:
    from dyad.jobs import run_job
    from dyad.verify import compare_with_reference

    config = _job_config(args)
    job = run_job(config, router=args.router, progress=not args.quiet)
    if not job.succeeded:
        print(f"run {job.info.run_id} did not succeed: {job.info.message}", file=sys.stderr)
        return 1
    resolved, dataset = _resolved(config)
    comparison = compare_with_reference(resolved, dataset, job)
    print(f"{'step':>5} {'layout loss':>14} {'reference loss':>15} {'rel. error':>11}")
    for step, loss, expected, error in comparison.losses:
        print(f"{step:>5} {loss:>14.8f} {expected:>15.8f} {error:>11.2e}")
    print(
        f"largest parameter difference: {comparison.worst_param_error:.2e} "
        f"(relative 2-norm, {comparison.worst_param}); largest single entry "
        f"{comparison.worst_param_max_error:.2e} of its tensor's largest"
    )
    if comparison.passed(args.tolerance):
        print(f"PASS: within {args.tolerance:g}")
        return 0
    print(f"FAIL: beyond tolerance {args.tolerance:g}", file=sys.stderr)
    return 1


def cmd_router(args) -> int:
    from dyad.router.__main__ import main as router_main

    router_main(["--host", args.host, "--port", str(args.port)])
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dyad", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train (default: digits, local processes)")
    _add_job_arguments(train, default_steps=None)
    train.set_defaults(func=cmd_train)
    verify = commands.add_parser("verify", help="check a layout against single-process training")
    _add_job_arguments(verify, default_steps=10)
    verify.add_argument("--tolerance", type=float, default=1e-5, help="relative tolerance")
    verify.set_defaults(func=cmd_verify)
    router = commands.add_parser("router", help="serve the router")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=50051)
    router.set_defaults(func=cmd_router)
    args = parser.parse_args(argv)
    try:
        sys.exit(args.func(args))
    except ValueError as error:
        print(f"dyad {args.command}: {error}", file=sys.stderr)
        sys.exit(2)
