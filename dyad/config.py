"""A run's config, composed of each component's own small config: the sections every run has,
and one `<pool>:` section and `parallel.<pool>:` layout per registered pool type
(`dyad.pools`).

Loaded from YAML (a file, a string or dotted `--set key=value` overrides). Unknown keys and bad
values raise ValueError naming the dotted field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import reprlib
import sys
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dyad.data import DataConfig
from dyad.pools import PoolType, pool_names, pool_type, pool_types

# dyad/configs/ installs as package data (`dyad.configs`), so a wheel install has its default too.
DEFAULT_CONFIG = Path(str(resources.files("dyad.configs").joinpath("digits.yaml")))


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 800
    global_batch: int = 32
    microbatches: int = 2  # per LLM data-parallel rank
    # 0: each sample one row of its LLM microbatch, right-padded to the microbatch's longest.
    # N: a microbatch's samples packed into rows of at most N tokens, each sample attending only
    # to itself, its positions restarting (dyad/router/packing.py). The same loss and gradients.
    seq_len: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # Steps whose update the run may skip (a non-finite loss or global gradient norm: every
    # worker drops the step's gradients and keeps its weights and optimizer state) before it
    # fails: one such step is noise, many are a diverged run.
    max_skipped_steps: int = 10
    dtype: str = "float32"
    device: str = "cpu"
    compile: bool = False  # torch.compile each transformer block of both pools (dyad/compile.py)
    compile_backend: str = "inductor"  # any torch._dynamo backend; "aot_eager" keeps eager kernels
    # Pools ("encoder", "llm") whose transformer blocks run their forward again in the backward
    # pass instead of keeping its activations (dyad/recompute.py): less memory, the same math.
    recompute: tuple[str, ...] = ()
    # Sum each bucket of gradients over its data-parallel group while the step's last backward
    # pass goes on (dyad/parallel/overlap.py); false: all of them after it. The same sums. false
    # costs no code of its own (it is the flush every step ends with) and keeps the backward pass
    # free of collectives, to tell a slow or hung reduction from a slow backward.
    overlap_grad_reduce: bool = True
    # bf16 copies of both pools' matrices, cast from their float32 master weights once per
    # optimizer step instead of at every use (dyad/working_weights.py). The same gradients.
    working_weights: bool = False
    # Each parameter's float32 master and AdamW moments split over the ranks that hold replicas
    # of it, its gradient reduce-scattered and its update all-gathered (ZeRO-1:
    # dyad/parallel/sharded_optimizer.py), in a pool where some parameter has replicas; false:
    # every rank keeps the whole state. The same updates.
    shard_optimizer: bool = True
    # Parts that keep their weights, as training is staged (each pool type names its parts:
    # "encoder", the whole encoder pool, which then runs without autograd and gets no gradient
    # back over the boundary; "vision_tower", the encoder but its projector; "llm").
    freeze: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 0:
            raise ValueError(f"train.seq_len must be >= 0 (0: no packing), got {self.seq_len}")
        if self.microbatches > self.global_batch:
            raise ValueError(
                f"train.microbatches ({self.microbatches}) must be <= train.global_batch "
                f"({self.global_batch})"
            )
        if not self.lr > 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"train.eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.grad_clip > 0:
            raise ValueError(f"train.grad_clip must be > 0, got {self.grad_clip}")
        if self.max_skipped_steps < 0:
            raise ValueError(f"train.max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"train.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"train.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.working_weights and self.dtype != "bfloat16":
            raise ValueError(f"train.working_weights needs train.dtype 'bfloat16', got {self.dtype!r}")
        unknown = [pool for pool in self.recompute if pool not in pool_names()]
        if unknown or len(set(self.recompute)) != len(self.recompute):
            pools = " and ".join(repr(name) for name in pool_names())
            raise ValueError(f"train.recompute must list distinct pools out of {pools}, got {list(self.recompute)}")
        _check_freeze_parts(self.freeze)
        if self.freeze and self.working_weights:
            raise ValueError("train.freeze cannot be combined with train.working_weights (its copies of held matrices would train)")
        if self.compile:
            from dyad.compile import compile_backends  # imports torch._dynamo: only when asked for

            known = compile_backends()
            if self.compile_backend not in known:
                raise ValueError(
                    f"train.compile_backend ({self.compile_backend!r}) is not a torch.compile backend; "
                    f"known: {', '.join(known)}"
                )


def _check_freeze_parts(freeze: tuple[str, ...]) -> None:
    parts = {part: pool for pool in pool_types() for part in pool.freezable}
    unknown = [part for part in freeze if part not in parts]
    if unknown or len(set(freeze)) != len(freeze):
        raise ValueError(f"train.freeze must list distinct parts out of {', '.join(map(repr, parts))}, got {list(freeze)}")
    for pool in pool_types():
        mine = [part for part in freeze if parts[part] is pool]
        if len(mine) > 1:
            raise ValueError(f"train.freeze names {' and '.join(map(repr, mine))}, parts of one pool: name one")
    if pool_types() and all(pool.name in freeze for pool in pool_types()):
        raise ValueError(f"train.freeze {list(freeze)} leaves nothing to train")


@dataclass(kw_only=True)
class BoundaryConfig:
    prefetch_depth: int = 2  # rounds (one microbatch per LLM dp lane) the encoder works ahead

    def __post_init__(self) -> None:
        if self.prefetch_depth < 1:
            raise ValueError(f"boundary.prefetch_depth must be >= 1, got {self.prefetch_depth}")


@dataclass(kw_only=True)
class ParallelConfig:
    """`parallel:`. With each pool type's two fields (`composed_types`): `<pool>`, its layout, and
    `<pool>_devices`: on one GPU host, the GPUs its ranks use, in rank order (rank r on
    devices[r % len]). Empty: rank r on GPU r % count, so the pools share the GPUs (colocated);
    e.g. encoder_devices [0] and llm_devices [1] put the pools on disjoint GPUs."""

    sequence_parallel: bool = False  # LLM pool: split the residual stream over tp (needs tp > 1)

    def __post_init__(self) -> None:
        for name in (f"{pool}_devices" for pool in pool_names()):
            if any(index < 0 for index in getattr(self, name, ())):
                raise ValueError(f"parallel.{name} must hold GPU indices >= 0, got {getattr(self, name)}")

    def __reduce__(self):  # composed classes are rebuilt from their values (see `composed_types`)
        return _rebuilt, ("parallel", to_dict(self))

    def local_gpu(self, pool: str, rank: int, gpu_count: int) -> int:
        """The local GPU index of `pool`'s `rank`."""
        devices = getattr(self, f"{pool}_devices")
        index = devices[rank % len(devices)] if devices else rank % gpu_count
        if index >= gpu_count:
            raise ValueError(f"parallel.{pool}_devices names GPU {index}, this host has {gpu_count}")
        return index


@dataclass(kw_only=True)
class RouterConfig:
    heartbeat_interval_s: float = 1.0
    worker_timeout_s: float = 60.0  # a worker silent this long is lost (the run recovers)
    start_timeout_s: float = 120.0  # all workers must register within this
    step_timeout_s: float = 900.0  # a step with no result from some worker this long: hung
    reconnect_timeout_s: float = 300.0  # a worker that cannot reach its router this long exits
    stop_grace_s: float = 10.0  # workers told to stop get this long before they are killed
    # ... except when they are stopped to recover from a failure: their step cannot finish, and
    # one waiting for the dead peer may never return (local processes are killed then; on
    # Kubernetes a worker left waiting ends itself this long after its release, which the
    # router's heartbeat replies tell it)
    abort_grace_s: float = 1.0
    max_recoveries: int = 3  # recoveries from lost workers before the run fails
    # Send the next step's command with this step's update (not after every worker has applied
    # it), so that each worker starts the next step as soon as its own update is queued: the
    # encoder's first microbatch overlaps the LLM's update. Never where a checkpoint or a
    # resize falls between the two steps (those wait for the step boundary): false takes that
    # path at every step, which costs no code of its own (docs/performance.md, "End to end on
    # two GPUs": send-ahead shortens the LLM's wait for its first rows, not the step).
    send_ahead: bool = True

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_interval_s", "worker_timeout_s", "start_timeout_s", "step_timeout_s",
            "reconnect_timeout_s", "stop_grace_s", "abort_grace_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"router.{name} must be > 0, got {getattr(self, name)}")
        if self.max_recoveries < 0:
            raise ValueError(f"router.max_recoveries must be >= 0, got {self.max_recoveries}")


@dataclass(kw_only=True)
class CheckpointConfig:
    interval_steps: int = 0  # commit a checkpoint every this many steps (0: only at the end)
    # Start from a committed checkpoint: its directory, or a run's out_dir (its newest
    # committed one). Any layout or pool sizes: the pools reshard on load.
    resume_from: str = ""
    # Periodic and on-demand checkpoints: the router syncs their files to stable storage and then
    # writes the manifest on a thread while training goes on. false, and for the checkpoints the
    # run waits for (before a resize, at the end): every worker syncs its own files as it writes
    # them (for a shared filesystem where one client's fsync does not cover another's writes).
    sync_in_background: bool = True
    # Committed checkpoints kept in the run's out_dir: once one is committed, those older than
    # the newest this many are deleted (0: keep all). The newest is what a recovery or a resize
    # restores; the ones before it are what a recovery falls back to if it fails verification.
    keep_last: int = 5

    def __post_init__(self) -> None:
        for name in ("interval_steps", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"checkpoint.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(kw_only=True)
class MetricsConfig:
    """`metrics:`. Where a run's metrics go besides metrics.jsonl (always written)."""

    tensorboard: bool = True  # event files in out_dir/tensorboard/ (`tensorboard --logdir`)
    wandb_project: str = ""  # a Weights & Biases project to log to (needs `pip install wandb`)
    wandb_mode: str = "online"  # "online", "offline" (synced later with `wandb sync`) or "disabled"
    mlflow_tracking_uri: str = ""  # an MLflow tracking server or a file:// store (needs `pip install mlflow`)
    mlflow_experiment: str = "dyad"

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("online", "offline", "disabled"):
            raise ValueError(f"metrics.wandb_mode must be 'online', 'offline' or 'disabled', got {self.wandb_mode!r}")


@dataclass(kw_only=True)
class EvalConfig:
    """`eval:`. The model on the held-out split (`data.heldout_fraction`), in the pools' own
    layouts with forward passes only: its loss per caption token and, where samples have an
    answer, the task's accuracy (metrics.jsonl, `dyad watch`, the sinks, Prometheus)."""

    interval_steps: int = 0  # evaluate every this many steps (0: not during training)
    final: bool = True  # evaluate the trained model at the end of the run
    # At most this many held-out samples, the first of the split's fixed order (0: all of them).
    max_samples: int = 0

    def __post_init__(self) -> None:
        for name in ("interval_steps", "max_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(kw_only=True)
class RunConfig:
    """A run's config: the sections every run has and, in the class `composed_types` builds from
    the registered pool types, one `<pool>:` section per pool (e.g. `config.llm`)."""

    seed: int = 0
    out_dir: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    boundary: BoundaryConfig = field(default_factory=BoundaryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def __reduce__(self):  # composed classes are rebuilt from their values (see `composed_types`)
        return _rebuilt, ("run", to_dict(self))


def composed_types() -> tuple[type, type]:
    """(RunConfig, ParallelConfig) with a section and a layout for each registered pool type."""
    return _composed(pool_types())


@functools.cache
def _composed(pools: tuple[PoolType, ...]) -> tuple[type, type]:
    namespace = {"__module__": __name__}
    parallel = dataclasses.make_dataclass(
        "ParallelConfig",
        [(pool.name, pool.layout, field(default_factory=pool.layout)) for pool in pools]
        + [(f"{pool.name}_devices", tuple[int, ...], field(default=())) for pool in pools],
        bases=(ParallelConfig,), kw_only=True, namespace=namespace,
    )
    run = dataclasses.make_dataclass(
        "RunConfig",
        [(pool.name, pool.config, field(default_factory=pool.config)) for pool in pools]
        + [("parallel", parallel, field(default_factory=parallel))],
        bases=(RunConfig,), kw_only=True, namespace=namespace,
    )
    return run, parallel


def _rebuilt(kind: str, values: dict[str, Any]):
    run, parallel = composed_types()
    return build(run if kind == "run" else parallel, values, prefix="" if kind == "run" else "parallel")


# ----------------------------------------------------------------------------- building


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_FLOAT_MAX = sys.float_info.max
_INT64 = range(-(2**63), 2**63)  # what the wire (protobuf int64) and torch's seeds carry


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80


def _short(value: Any) -> str:
    """A bounded repr: a message quotes a value, never all of a big one (and never walks it all)."""
    return _SHORT_REPR.repr(value)


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, options[0], name)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping, got {_short(value)}")
        return build(annotation, value, prefix=name)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {_short(value)}")
        return tuple(_coerce(v, typing.get_args(annotation)[0], name) for v in value)
    if annotation is float:
        return _float(value, name)
    if annotation in (int, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise ValueError(f"{name} must be {annotation.__name__}, got {_short(value)}")
    if annotation is int and value not in _INT64:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {_short(value)}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 (PyYAML) reads "1e-3", without a dot, as a string
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be float, got {_short(value)}")  # noqa: TRY004 - a user's mistake
    # A range, not math.isfinite: it refuses NaN and the infinities, and ints too big for a float.
    if not -_FLOAT_MAX <= value <= _FLOAT_MAX:
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    return float(value)


def build(cls, values: dict[str, Any], prefix: str = ""):
    """Build dataclass `cls` from a nested dict; unknown keys are errors."""
    types_by_name = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in types_by_name:
            raise ValueError(f"unknown config field {_short(name)}{_did_you_mean(cls, name)}")
        kwargs[key] = _coerce(value, types_by_name[key], name)
    try:
        return cls(**kwargs)
    except TypeError as error:  # e.g. a missing required field
        raise ValueError(f"{prefix or 'config'}: {error}") from None


def _did_you_mean(cls, name: str) -> str:
    """The hint after "unknown config field" for a `name` that `cls` (at its prefix) lacks, e.g.
    "; did you mean 'train.lr'?": the closest known dotted field at any depth below, else those
    whose last part is closest to `name`'s (`lr` given without its section); "" if none is close."""
    if len(name) > 200:  # no one types that: not worth comparing
        return ""
    prefix, _, key = name.rpartition(".")
    known = list(_dotted_fields(cls, prefix))
    close = difflib.get_close_matches(name, known, n=1)
    if not close:
        by_last = {}
        for dotted in known:
            by_last.setdefault(dotted.rpartition(".")[2], []).append(dotted)
        close = [dotted for last in difflib.get_close_matches(key, by_last, n=1) for dotted in by_last[last]]
    return f"; did you mean {' or '.join(repr(dotted) for dotted in close)}?" if close else ""


def _dotted_fields(cls, prefix: str):
    """Every field of dataclass `cls` and of the sections below it, dotted from `prefix`."""
    for key, annotation in _field_types(cls).items():
        name = f"{prefix}.{key}" if prefix else key
        yield name
        if dataclasses.is_dataclass(annotation):
            yield from _dotted_fields(annotation, name)


def to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(_plain(to_dict(config)), sort_keys=False)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(assignment: str) -> dict[str, Any]:
    """`train.lr=1e-3` -> {"train": {"lr": 0.001}} (values parsed as YAML)."""
    if "=" not in assignment:
        raise ValueError(f"--set expects key=value, got {_short(assignment)}")
    key, raw = assignment.split("=", 1)
    value = _parse_yaml(raw, f"--set {_short(key)}") if raw else ""
    nested: dict[str, Any] = {}
    cursor = nested
    parts = key.strip().split(".")
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    return nested


def load_yaml_text(text: str) -> dict[str, Any]:
    values = _parse_yaml(text, "config") or {}
    if not isinstance(values, dict):
        raise ValueError("config must be a YAML mapping")  # noqa: TRY004 - a user's mistake
    return values


# Far above any real config (the default is 1 KB, 4 levels deep); they bound what reading one
# costs, and keep PyYAML's composer, which recurses once per level, far from Python's limit.
MAX_CONFIG_CHARS = 2**20
MAX_CONFIG_DEPTH = 32


class _Refused(yaml.MarkedYAMLError):
    """YAML that parses but that a config may not hold."""


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases, whose values a few hundred bytes of nested
    anchors multiply into billions wherever something walks them (a message quoting one, a
    copy), and with nesting bounded as the composer goes, before anything deeper is read."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(None, None, f"a config may not use YAML aliases (*{event.anchor})", event.start_mark)
        if self._depth == MAX_CONFIG_DEPTH:
            raise _Refused(None, None, f"values nest more than {MAX_CONFIG_DEPTH} levels deep", event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _parse_yaml(text: str, what: str) -> Any:
    if len(text) > MAX_CONFIG_CHARS:
        raise ValueError(f"{what} is {len(text)} characters, more than the {MAX_CONFIG_CHARS} a config may hold")
    try:
        return yaml.load(text, Loader=_ConfigLoader)
    except _Refused as error:
        raise ValueError(f"{what}: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{what} is not valid YAML: {error}") from None


def bundled_configs() -> list[str]:
    """The names of the configs dyad ships (dyad/configs/NAME.yaml)."""
    return sorted(path.stem for path in DEFAULT_CONFIG.parent.glob("*.yaml"))


def config_path(name_or_path: str | Path | None) -> Path:
    """A config file, or the NAME of one dyad ships; None: the default."""
    if name_or_path is None:
        return DEFAULT_CONFIG
    path = Path(name_or_path)
    bundled = DEFAULT_CONFIG.parent / f"{name_or_path}.yaml"
    if not path.exists() and path.name == str(name_or_path) and bundled.is_file():
        return bundled
    return path


def load(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """The config in file `path` (or the bundled config of that name; None: the default), with
    `--set` overrides."""
    values = load_yaml_text(config_path(path).read_text())
    for assignment in overrides:
        values = merge(values, parse_override(assignment))
    return build(composed_types()[0], values)


def from_yaml(text: str) -> RunConfig:
    return build(composed_types()[0], load_yaml_text(text))


def resolve(config: RunConfig, *, vocab_size: int | None = None) -> RunConfig:
    """Fill the fields one component derives from another (documented in configs/) and check
    what spans components: each pool type checks its own section against the others and its
    layout (`PoolType.resolve`). `vocab_size`: the tokenizer's; None keeps the one a resolved
    config has. A pool that reads others' sections (`PoolType.reads`) sees them resolved."""
    resolved = {}
    for pool in _resolution_order(pool_types()):
        resolved[pool.name] = pool.resolve(dataclasses.replace(config, **resolved), vocab_size)
    return dataclasses.replace(config, **resolved)


def _resolution_order(pools: tuple[PoolType, ...]) -> list[PoolType]:
    """`pools`, each after the registered pools it reads."""
    names = {pool.name for pool in pools}
    order: list[PoolType] = []
    while len(order) < len(pools):
        placed = {pool.name for pool in order}
        ready = [p for p in pools if p.name not in placed and names & set(p.reads) <= placed]
        assert ready, f"pool types read each other: {[(p.name, p.reads) for p in pools if p.name not in placed]}"
        order.append(ready[0])
    return order


# Fields that name files or directories: relative ones are relative to where the config was
# written (the client's working directory), not to where the router happens to run.
PATH_FIELDS = ("out_dir", "data.path", "data.tokenizer", "checkpoint.resume_from", "llm.from_hf", "encoder.from_hf")


def with_absolute_paths(config: RunConfig, base: str | Path) -> RunConfig:
    """`config` with each relative path of PATH_FIELDS made absolute against `base`."""
    for dotted in PATH_FIELDS:
        *sections, name = dotted.split(".")
        owners = [config]
        for section in sections:
            owners.append(getattr(owners[-1], section))
        value = getattr(owners[-1], name)
        if not value or Path(value).is_absolute():
            continue
        updated = dataclasses.replace(owners[-1], **{name: str(Path(base) / value)})
        for owner, key in zip(reversed(owners[:-1]), reversed(sections), strict=True):
            updated = dataclasses.replace(owner, **{key: updated})
        config = updated
    return config


def scaled(config: RunConfig, pool: str, replicas: int) -> RunConfig:
    """`config` with `pool` resized to `replicas` processes: the data-parallel degree follows,
    every other degree stays, and the step keeps its global batch and microbatches. Validated
    like a new config (ValueError naming the field)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    scaled_config = pool_type(pool).scale(config, replicas)
    return resolve(scaled_config)
