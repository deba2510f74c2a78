"""The pool types a run is made of, each declared by its service and registered here: shared code
asks the registry and never names a pool.

A service package declares one `PoolType` (torch-free: its config and layout types and the import
path of its worker-side service) and is found through the `dyad.pools` entry-point group of the
installed distributions, so a third-party package adds a pool type by declaring one; a test may
`register` one directly. The built-in pools come in the order pyproject.toml declares them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "dyad.pools"


@dataclass(frozen=True, kw_only=True)
class PoolType:
    """What the runtime needs from a service.

    - `name`: the run config's `<name>:` section, its `parallel.<name>:` layout, `--pool <name>`,
      and its checkpoint directory `<step>/<name>/`.
    - `wire`: its `Pool` value on the wire: the name of one of dyad.proto's, or a number (proto3
      enums are open: a plug-in's needs no new .proto). Read where the wire is (`wire_id`), so
      that a config loads without the gRPC stubs.
    - `config`, `layout`: dataclasses without torch, validated on construction (ValueError naming
      the field); the router and the CLI check configs without loading model code.
    - `resolve(run, vocab_size)`: its section with the fields it derives from other components
      (`vocab_size`: the tokenizer's, None where the run config is resolved already), after
      checking what spans them (its layout against its model, say). ValueError naming the field.
    - `scale(run, replicas)`: the run config with this pool resized to `replicas` processes,
      validated like a new one.
    - `seed_offset`: its initial weights come from stream `seed * 10 + seed_offset` of the run
      seed, whatever the layout.
    - `service`: `"module:Class"` of its `dyad.service.PoolService`, imported only where a worker
      of this pool runs (the model's code and torch load there, not in the router).
    - `warnings(run)`: what a run of the resolved config should be told as it starts (a `warning`
      notice each, in `dyad watch` and metrics.jsonl); none by default.
    - `freezable`: the parts `train.freeze` may name (its service's `freeze` holds them); the
      pool's own name freezes all of it.
    - `reads`: the pools whose resolved sections its `resolve` reads (the encoder's rows are the
      LLM's width, which a checkpoint may fix): they are resolved first.
    """

    name: str
    wire: str | int
    config: type
    layout: type
    resolve: Callable[[Any, int | None], Any]
    scale: Callable[[Any, int], Any]
    seed_offset: int
    service: str
    warnings: Callable[[Any], list[str]] = lambda run: []
    freezable: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()

    @property
    def wire_id(self) -> int:
        if isinstance(self.wire, int):
            return self.wire
        from dyad.wire import pb  # generates the stubs on first use

        return pb.Pool.Value(self.wire)

    def service_class(self) -> type:
        module, _, attribute = self.service.partition(":")
        return getattr(importlib.import_module(module), attribute)


_registered: dict[str, PoolType] = {}
_discovered = False


def register(pool: PoolType) -> None:
    """Add a pool type (a plug-in's; the built-in ones register through entry points)."""
    _discover()
    clash = next((p for p in _registered.values() if p.wire == pool.wire and p.name != pool.name), None)
    if clash is not None:
        raise ValueError(f"pool type {pool.name!r}: wire value {pool.wire!r} is {clash.name!r}'s")
    _registered[pool.name] = pool


def unregister(name: str) -> None:
    _discover()
    _registered.pop(name, None)


def pool_types() -> tuple[PoolType, ...]:
    """Every registered pool type: the built-in ones in the order they are declared, then the
    others in the order they were registered."""
    _discover()
    return tuple(_registered.values())


def pool_names() -> tuple[str, ...]:
    return tuple(pool.name for pool in pool_types())


def pool_type(name: str) -> PoolType:
    _discover()
    if name not in _registered:
        raise ValueError(f"unknown pool {name!r}; pools: {', '.join(pool_names())}")
    return _registered[name]


def pool_on_wire(wire_id: int) -> PoolType | None:
    """The pool type a wire `Pool` value names; None for one no registered type has."""
    return next((pool for pool in pool_types() if pool.wire_id == wire_id), None)


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        pool = entry.load()
        _registered.setdefault(pool.name, pool)
    if not _registered:
        _discovered = False
        raise RuntimeError(
            f"no pool types are registered: dyad's own are found through the {ENTRY_POINT_GROUP!r} entry points "
            "of the installed distribution (pip install -e . in a checkout), not from a source tree on PYTHONPATH"
        )
