"""The `dyad` command.

    dyad train   [--config FILE_OR_NAME] [--set key=value ...] [--steps N] [--device cpu|cuda] [--out DIR]
                 [--dry-run]
    dyad plan    [FILE_OR_NAME] [key=value ...] [--device-memory GIB]
                 [--gpus N --profile PROFILE.json [--top K] [--json PATH]]
    dyad verify  [--config FILE] [--set key=value ...] [--steps N] [--tolerance T]
    dyad eval    CHECKPOINT_OR_RUN_DIR [--config FILE] [--set key=value ...] [--device cpu|cuda]
    dyad router  [--host H] [--port P] [--token-file F] [--join-token-file F] [--tls-cert ...]

Against a running router (--router HOST:PORT, default $DYAD_ROUTER or 127.0.0.1:50051; the token
from --token-file or $DYAD_TOKEN; TLS with --tls-ca [--tls-cert --tls-key]); a command given no
RUN_ID acts on the router's active run:

    dyad submit  [--config FILE] [--set key=value ...] [--steps N] [--device D] [--out DIR]
    dyad status [RUN_ID] | dyad watch [RUN_ID] [--from-step N] | dyad stop [RUN_ID]
    dyad scale {encoder,llm} REPLICAS [--run RUN_ID] | dyad checkpoint [RUN_ID]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

import grpc

from dyad.app.client import RouterClient
from dyad.credentials import CLIENT_TOKEN_ENV, load_token
from dyad.pools import pool_names
from dyad.router.__main__ import add_arguments as add_router_arguments
from dyad.wire import pb

# Client commands import the model code (`dyad.config` and below) only when they build a config.
DEFAULT_ROUTER = "127.0.0.1:50051"
ACTIVE_RUN_HELP = "default: the router's active run"


def _add_connection_arguments(parser: argparse.ArgumentParser, default_router: str | None) -> None:
    if default_router is None:
        router_help = "use a running router at HOST:PORT instead of a local one"
    else:
        router_help = f"the router's HOST:PORT (default: $DYAD_ROUTER or {DEFAULT_ROUTER})"
    parser.add_argument("--router", default=default_router, help=router_help)
    parser.add_argument("--token-file", help=f"the client token (default: ${CLIENT_TOKEN_ENV})")
    parser.add_argument("--tls-ca", help="use TLS, trusting this CA (PEM; default: $DYAD_TLS_CA)")
    parser.add_argument("--tls-cert", help="client certificate for mTLS (default: $DYAD_TLS_CERT)")
    parser.add_argument("--tls-key", help="its private key (default: $DYAD_TLS_KEY)")


def _connect(args) -> RouterClient:
    return RouterClient(
        args.router,
        token=load_token(CLIENT_TOKEN_ENV, args.token_file),
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def _add_job_arguments(
    parser: argparse.ArgumentParser, default_steps: int | None, *, local: bool = True
) -> None:
    parser.add_argument(
        "--config", help="a YAML run config, or the NAME of one dyad ships (dyad/configs/NAME.yaml; default: digits)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config field by dotted key, e.g. --set train.lr=1e-3 (repeatable)",
    )
    parser.add_argument("--steps", type=int, default=default_steps, help="training steps")
    if local:
        device_default, out_default = "cuda when present", "runs/<timestamp>/"
    else:
        device_default, out_default = "the config's", "the router's runs/<run id>/"
    parser.add_argument("--device", choices=["cpu", "cuda"], help=f"default: {device_default}")
    parser.add_argument("--out", help=f"output directory (default: {out_default})")


def _job_config(args, *, local: bool = True):
    """The run config from the job arguments, checked before anything starts (`_check`). A
    `local` job (train, verify) also picks the device and the output directory here; a submitted
    one leaves what is unset to the router."""
    config = _checked_config(args, local=local)
    if args.device is None and local:
        train = dataclasses.replace(config.train, device=_default_device())
        config = dataclasses.replace(config, train=train)
    out = args.out
    if out is None and local:
        out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    return dataclasses.replace(config, out_dir=str(Path(out).resolve())) if out else config


def _checked_config(args, *, local: bool):
    """The run config from --config, --set, --steps and --device, checked (`_check`)."""
    from dyad import config as config_lib

    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.device is not None:
        overrides.append(f"train.device={args.device}")
    try:
        config = config_lib.load(args.config, overrides)
    except OSError as error:  # the --config file
        from dyad.config import bundled_configs

        raise ValueError(
            f"--config {args.config}: {error.strerror} (dyad ships: {', '.join(bundled_configs())})"
        ) from None
    _check(config, local=local, local_router=local and not args.router, command=args.command)
    return config


def _check(config, *, local: bool, local_router: bool, command: str) -> None:
    """What the router checks before it starts a run, checked here (ValueError naming the field)
    before a router, a worker or a run directory exists, and without torch (whose import alone
    takes seconds): every field and value, and the pools' layouts against their models. A `local`
    job also reads its data (paths and records) and `checkpoint.resume_from` here; a submitted one
    leaves those to the router, whose files they are (its paths). A `local_router` runs as many
    workers as this machine's launcher allows."""
    from dyad import config as config_lib

    vocab_size = None
    if local:
        vocab_size = _dataset(config).tokenizer.vocab_size
    config_lib.resolve(config, vocab_size=vocab_size)
    if local_router:
        from dyad.router.launcher import local_max_workers
        from dyad.router.run import check_worker_count, pool_sizes

        check_worker_count(pool_sizes(config), local_max_workers())
    if local and config.checkpoint.resume_from:
        _check_resume(config, command)


def _dataset(config):
    from dyad.data import make_dataset

    try:
        return make_dataset(config.data)
    except OSError as error:  # e.g. a data.path that exists but cannot be read
        raise ValueError(f"data: cannot read {error.filename or config.data.path}: {error.strerror}") from None


def _check_resume(config, command: str) -> None:
    """A run resumed from `checkpoint.resume_from` continues from its newest committed
    checkpoint: refused past `train.steps`. The router plans each step's learning rate from the
    config it runs (warm-up, then cosine decay to `train.steps`): a `train.steps` other than the
    run's own bends the decay from the resumed step on, which a warning says with the rates."""
    from dyad.router.checkpoints import resume_candidates

    newest = resume_candidates(config.checkpoint.resume_from)[0]
    train = config.train
    if newest.step > train.steps:
        raise ValueError(
            f"checkpoint.resume_from ({config.checkpoint.resume_from}) continues from step {newest.step}, "
            f"past train.steps ({train.steps})"
        )
    from dyad.router.schedule import schedule_change, steps_of_run

    # <out_dir>/checkpoints/step_N: the config its router wrote is in <out_dir>
    change = schedule_change(newest.step, train, steps_of_run(newest.path.parent.parent))
    if change:
        print(f"dyad {command}: warning: {change}", file=sys.stderr)


def _default_device() -> str:
    import torch  # seconds: only once the config is known to be good

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolved(config):
    from dyad import config as config_lib

    dataset = _dataset(config)
    return config_lib.resolve(config, vocab_size=dataset.tokenizer.vocab_size), dataset


def _run_job(args, config):
    """The job on the router named by --router, else on a local one."""
    from dyad.app.jobs import run_job

    with _connect(args) if args.router else contextlib.nullcontext() as client:
        return run_job(config, router=client, progress=not args.quiet)


def cmd_train(args) -> int:
    if args.dry_run:
        return _dry_run(args)
    config = _job_config(args)
    print(f"dyad train: writing to {config.out_dir}", flush=True)  # before the progress on stderr
    job = _run_job(args, config)
    out_dir = Path(config.out_dir)
    if not job.succeeded:
        print(f"run {job.info.run_id} did not succeed: {job.info.message}", file=sys.stderr)
        return 1
    last = job.metrics[-1]
    final = job.evaluations[-1] if job.evaluations else None
    evaluated = ""
    if final and final["step"] == job.info.total_steps:  # eval.final
        evaluated = f", held-out loss {final['loss']:.4f}"
        if final["answered"]:
            evaluated += f", caption_accuracy {final['accuracy']:.3f} on {final['answered']} held-out samples"
    print(
        f"done: {len(job.metrics)} steps, final loss {last['loss']:.4f}{evaluated}\n"
        f"  metrics: {out_dir / 'metrics.jsonl'}\n  plot: {out_dir / 'loss.png'}\n"
        f"  checkpoint: {job.final_checkpoint()}"
    )
    return 0


def _dry_run(args, device_memory: float | None = None) -> int:
    """The config checked as `dyad train` checks it, then its models, layouts, memory per rank and
    first step printed (dyad/app/dry_run.py); nothing starts, and torch is not imported. A rank
    past `device_memory` (GiB) is a warning in the report, not a failure."""
    from dyad.app.dry_run import describe

    config = _checked_config(args, local=True)
    resolved, dataset = _resolved(config)
    command = "dyad plan" if args.command == "plan" else "dyad train --dry-run"
    print(describe(resolved, dataset, args.config or "the default config (digits)", command=command,
                   device_memory=device_memory))
    return 0


def cmd_plan(args) -> int:
    """`dyad train --dry-run`'s report, the config and its overrides given as arguments; with
    --device-memory, warnings of the ranks it would not hold. With --gpus and --profile, the
    candidate splits of that many GPUs and their layouts instead, by predicted tokens/s."""
    args.set = list(args.overrides)
    if args.gpus is not None or args.profile is not None:
        return _recommend(args)
    return _dry_run(args, device_memory=args.device_memory)


def _recommend(args) -> int:
    """Every split of --gpus GPUs between the pools and each pool's layout, predicted from the
    --profile of the modules (dyad/app/recommend.py); memory against --device-memory, else the
    profile's GPU's. Torch is not imported."""
    if args.gpus is None:
        raise ValueError("--profile needs --gpus N: the GPUs to split between the pools")
    if args.profile is None:
        raise ValueError("--gpus needs --profile PROFILE.json (bench/module_profile.py CONFIG writes one on a GPU)")
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    from dyad.app.module_costs import load_profile
    from dyad.app.recommend import describe, recommend, to_json

    resolved, dataset = _resolved(_checked_config(args, local=True))
    costs = load_profile(args.profile, resolved)
    memory, memory_source = args.device_memory, "--device-memory"
    if memory is None and costs.device_memory_gib:
        memory, memory_source = costs.device_memory_gib, f"the profile's {costs.device}"
    predictions = recommend(resolved, dataset, costs, args.gpus, device_memory=memory)
    print(describe(predictions, resolved, costs, args.gpus, args.config or "the default config (digits)",
                   device_memory=memory, memory_source=memory_source, top=args.top))
    if args.json:
        Path(args.json).write_text(to_json(predictions, resolved, args.gpus, costs, memory))
    return 0


def _committed_and_config(args):
    """The committed checkpoint args.checkpoint names (or a run's newest), and the config of its
    run (config.yaml in its run directory, or --config; --set; --device)."""
    from dyad import config as config_lib
    from dyad.router.checkpoints import resolve_resume

    committed = resolve_resume(args.checkpoint, named="CHECKPOINT")  # ValueError naming what is wrong
    path = args.config or committed.path.parent.parent / "config.yaml"  # the run's, as it ran
    if not Path(path).is_file():
        raise ValueError(f"no config.yaml in the run directory of {committed.path}: name the run's with --config")
    overrides = [*args.set, f"train.device={args.device}"] if args.device else list(args.set)
    try:
        config = config_lib.load(path, overrides)
    except OSError as error:
        raise ValueError(f"--config {path}: {error.strerror}") from None
    return committed, config


def cmd_eval(args) -> int:
    """A committed checkpoint (or a run's newest) on the held-out split, on one device: its loss
    and the task's accuracy. Any layout wrote it: the pools' parts are read whole."""
    committed, config = _committed_and_config(args)
    if not args.device:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, device=_default_device()))
    from dyad.app.evaluate import caption_accuracy, heldout_loss, load_trained  # torch and the models

    resolved, dataset = _resolved(config)
    encoder, llm = load_trained(resolved, committed.path)
    loss, tokens = heldout_loss(resolved, dataset, encoder, llm)
    accuracy, samples = caption_accuracy(resolved, dataset, encoder, llm)
    print(f"{committed.path} (step {committed.step}): held-out loss {loss:.4f} over {tokens} caption tokens, "
          f"caption_accuracy {accuracy:.3f} on {samples} held-out samples")
    return 0


def cmd_export(args) -> int:
    """A committed checkpoint as a Hugging Face model directory: a LLaVA, a whole Qwen3-VL, or its LLM alone
    (dyad/app/export.py)."""
    args.device = None
    committed, config = _committed_and_config(args)
    from dyad.app.export import export_llava, export_llm, export_qwen3_vl, llava_shaped, qwen3_vl_whole

    resolved, _ = _resolved(config)
    export, what = export_llm, "the LLM"
    if qwen3_vl_whole(resolved) and not args.llm_only:
        export, what = export_qwen3_vl, "the whole Qwen3-VL"
    elif llava_shaped(resolved) and not args.llm_only:
        export, what = export_llava, "the LLaVA"
    written = export(resolved, committed.path, Path(args.to_hf))
    print(f"{committed.path} (step {committed.step}): {what} written to {args.to_hf} "
          f"({len(written)} safetensors file{'s' if len(written) > 1 else ''})")
    return 0


def cmd_verify(args) -> int:
    config = _job_config(args)
    job = _run_job(args, config)
    if not job.succeeded:
        print(f"run {job.info.run_id} did not succeed: {job.info.message}", file=sys.stderr)
        return 1
    from dyad.app.verify import compare_with_reference  # torch and the models

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
    from dyad.router.__main__ import run

    run(args)
    return 0


def cmd_worker(args) -> int:
    import logging

    from dyad.app.pod import run_pod

    logging.basicConfig(level=os.environ.get("DYAD_LOG_LEVEL", "INFO"),
                        format="%(asctime)s pod %(levelname)s %(message)s")
    return run_pod(args.pool, args.health_port)


def _state_name(state: int) -> str:
    return pb.RunState.Name(state).removeprefix("RUN_STATE_")


def _describe(info: pb.RunInfo) -> str:
    lines = [
        f"run {info.run_id}: {_state_name(info.state)}, step {info.step}/{info.total_steps}",
        (f"  generation {info.generation}, recoveries {info.recoveries}, "
         f"replicas: encoder {info.encoder_replicas}, llm {info.llm_replicas}"),
        f"  out_dir: {info.out_dir}",
    ]
    if info.last_checkpoint:
        lines.append(f"  last checkpoint: {info.last_checkpoint}")
    if info.skipped_steps:
        lines.append(f"  skipped steps (not finite, no update): {info.skipped_steps}")
    if info.message:
        lines.append(f"  message: {info.message}")
    return "\n".join(lines)


def _describe_step(step: pb.StepMetrics) -> str:
    return (
        f"step {step.step} loss {step.loss:.4f} lm_loss {step.lm_loss:.4f} "
        f"aux_loss {step.aux_loss:.4f} grad_norm {step.grad_norm:.3f} lr {step.lr:.2e} "
        f"tokens/s {step.tokens_per_s:.0f}" + (" skipped (not finite: no update)" if step.skipped else "")
    )


def _describe_notice(notice: pb.RunNotice) -> str:
    return (
        f"{notice.kind} at step {notice.step}: {notice.message} "
        f"(generation {notice.generation}, recoveries {notice.recoveries})"
    )


def cmd_submit(args) -> int:
    from dyad import config as config_lib

    # Paths as the user wrote them, from here: the router may run elsewhere.
    config = config_lib.with_absolute_paths(_job_config(args, local=False), Path.cwd())
    with _connect(args) as client:
        info = client.start_run(config_lib.to_yaml(config))
    print(info.run_id)
    return 0


def _run_id(args, client: RouterClient) -> str:
    """The run named on the command line, else the router's active run."""
    if args.run_id:
        return args.run_id
    run_id = client.active_run_id()
    if not run_id:
        raise ValueError(
            f"no run is active on the router at {client.address}; name one: {args.naming_a_run}"
        )
    return run_id


def cmd_status(args) -> int:
    with _connect(args) as client:
        print(_describe(client.get_run(_run_id(args, client))))
    return 0


def cmd_watch(args) -> int:
    """One line per step, evaluation and notice, then the run's final state; succeeds iff the
    run did."""
    from dyad.app.jobs import describe_evaluation

    with _connect(args) as client:
        run_id = _run_id(args, client)
        for event in client.watch(run_id, from_step=args.from_step):
            kind = event.WhichOneof("event")
            if kind == "step":
                print(_describe_step(event.step), flush=True)
            elif kind == "evaluation":
                print(describe_evaluation(event.evaluation), flush=True)
            elif kind == "notice":
                print(_describe_notice(event.notice), flush=True)
        info = client.get_run(run_id)  # the same as the stream's final event
    print(_describe(info))
    return 0 if info.state == pb.RUN_STATE_SUCCEEDED else 1


def cmd_stop(args) -> int:
    with _connect(args) as client:
        print(_describe(client.stop_run(_run_id(args, client))))
    return 0


def cmd_scale(args) -> int:
    with _connect(args) as client:
        print(_describe(client.scale_pool(_run_id(args, client), args.pool, args.replicas)))
    return 0


def cmd_checkpoint(args) -> int:
    with _connect(args) as client:
        print(_describe(client.checkpoint(_run_id(args, client))))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dyad", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train (default: digits, local processes)")
    _add_job_arguments(train, default_steps=None)
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument(
        "--dry-run", action="store_true",
        help="check the config as a run would, print its models' parameters, layouts, an estimate of each "
        "rank's memory and the plan of the first step; start nothing",
    )
    _add_connection_arguments(train, default_router=None)
    train.set_defaults(func=cmd_train)
    plan = commands.add_parser(
        "plan", help="what a config would train and each rank's memory, checked as `dyad train` checks it; "
        "starts nothing (the same report as `dyad train --dry-run`)",
    )
    plan.add_argument(
        "config", nargs="?", help="a YAML run config, or the NAME of one dyad ships (default: digits)"
    )
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config fields by dotted key, as --set")
    plan.add_argument(
        "--device-memory", type=float, metavar="GIB",
        help="a GPU's memory in GiB (an H100 has 79.6, an H200 140.4): warn of each rank, and each GPU shared by "
        "several, whose estimate exceeds it",
    )
    plan.add_argument(
        "--gpus", type=int, metavar="N",
        help="predict the best split of N GPUs between the pools and each pool's layout (needs --profile)",
    )
    plan.add_argument("--profile", metavar="PROFILE.json",
                      help="each module's time on one GPU, as bench/module_profile.py writes it for this config")
    plan.add_argument("--top", type=int, default=15, help="with --gpus: candidates listed (0: all; default 15)")
    plan.add_argument("--json", metavar="PATH", help="with --gpus: every candidate, predicted or excluded, as JSON")
    plan.set_defaults(func=cmd_plan, steps=None, device=None, router=None)
    verify = commands.add_parser("verify", help="check a layout against single-process training")
    _add_job_arguments(verify, default_steps=10)
    verify.add_argument("--quiet", action="store_true", help="no progress bar")
    verify.add_argument("--tolerance", type=float, default=1e-5, help="relative tolerance")
    _add_connection_arguments(verify, default_router=None)
    verify.set_defaults(func=cmd_verify)
    evaluate = commands.add_parser("eval", help="a checkpoint's held-out loss and accuracy, on one device")
    evaluate.add_argument("checkpoint", help="a committed checkpoint directory, or a run's (its newest)")
    evaluate.add_argument("--config", help="the run's config (default: config.yaml in its run directory)")
    evaluate.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    evaluate.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    evaluate.set_defaults(func=cmd_eval)
    export = commands.add_parser(
        "export", help="a checkpoint as a Hugging Face model directory (a LLaVA, or the LLM alone)"
    )
    export.add_argument("checkpoint", help="a committed checkpoint directory, or a run's (its newest)")
    export.add_argument("--to-hf", required=True, metavar="OUT", help="the directory to write (new or empty)")
    export.add_argument("--llm-only", action="store_true",
                        help="the LLM alone, as its family's class, also from a run that is a LLaVA")
    export.add_argument("--config", help="the run's config (default: config.yaml in its run directory)")
    export.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    export.set_defaults(func=cmd_export)
    router = commands.add_parser("router", help="serve the router")
    add_router_arguments(router, default_port=50051)
    router.set_defaults(func=cmd_router)
    worker = commands.add_parser(
        "worker", help="a pool pod's workers (Kubernetes; see dyad/app/pod.py for the environment)"
    )
    worker.add_argument("--pool", choices=pool_names(), required=True)
    worker.add_argument("--health-port", type=int, default=8081)
    worker.set_defaults(func=cmd_worker)

    remote_router = os.environ.get("DYAD_ROUTER", DEFAULT_ROUTER)

    def client_command(name: str, func, help: str) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help)
        _add_connection_arguments(command, default_router=remote_router)
        command.set_defaults(func=func)
        return command

    def run_command(name: str, func, help: str) -> argparse.ArgumentParser:
        """A client command about one run, named by an optional RUN_ID."""
        command = client_command(name, func, help)
        command.add_argument("run_id", nargs="?", help=ACTIVE_RUN_HELP)
        command.set_defaults(naming_a_run=f"dyad {name} RUN_ID")
        return command

    submit = client_command("submit", cmd_submit, "start a run on the router; prints its id")
    _add_job_arguments(submit, default_steps=None, local=False)
    run_command("status", cmd_status, "a run's state")
    watch = run_command("watch", cmd_watch, "follow a run until it ends")
    watch.add_argument("--from-step", type=int, default=0, help="replay steps from this one")
    run_command("stop", cmd_stop, "stop a run")
    scale = client_command("scale", cmd_scale, "resize a pool of a running run")
    scale.add_argument("pool", choices=pool_names())
    scale.add_argument("replicas", type=int)
    scale.add_argument("--run", dest="run_id", metavar="RUN_ID", help=ACTIVE_RUN_HELP)
    scale.set_defaults(naming_a_run="dyad scale POOL REPLICAS --run RUN_ID")
    run_command("checkpoint", cmd_checkpoint, "commit a checkpoint")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        sys.exit(args.func(args))
    except ValueError as error:
        print(f"dyad {args.command}: {error}", file=sys.stderr)
        sys.exit(2)
    except grpc.RpcError as error:
        print(f"dyad {args.command}: {error.code().name}: {error.details()}", file=sys.stderr)
        sys.exit(1)
    except OSError as error:  # e.g. a full disk under --out: the file and why, not a traceback
        print(f"dyad {args.command}: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
