"""The router's durable memory: runs and their event history in SQLite, so a restarted router
resumes the runs that were active and `WatchRun` can replay what happened before.

One connection per call (sqlite3 connections are per thread); WAL mode so watchers read while
the driver writes. Without a path nothing is persisted (`NullStore`).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dyad.wire import pb

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event BLOB NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS commands (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    pools TEXT,
    command BLOB NOT NULL,
    PRIMARY KEY (run_id, seq)
);
"""

# A command sent to the pools named (None: all), as `Run.send` keeps it.
SentCommand = tuple[int, "tuple[str, ...] | None", pb.WorkerCommand]


@dataclass
class RunRecord:
    """What a router needs to resume a run (the RunInfo fields live in `info`)."""

    run_id: str
    config_yaml: str  # the current config: its layouts follow the pools' sizes
    info: bytes = b""  # serialized pb.RunInfo
    secret: str = ""  # hex of the per-run data-plane secret
    rendezvous: dict[str, str] = field(default_factory=dict)  # pool -> torch.distributed address
    formed_at: dict[str, int] = field(default_factory=dict)  # pool -> generation it re-formed at
    pids: dict[str, int] = field(default_factory=dict)  # "pool/rank" -> pid (local processes)
    # pool -> how long the processes it replaced at its last re-forming may take to end
    exit_within_s: dict[str, float] = field(default_factory=dict)
    restores: bool = False  # the current generation's setup restores a checkpoint


class NullStore:
    """A router without `--state-db`: runs live in memory only, and die with the router."""

    def save_run(self, record: RunRecord) -> None:
        pass

    def append_event(self, run_id: str, seq: int, event: pb.RunEvent) -> None:
        pass

    def keep_command(self, run_id: str, sent: SentCommand, keep: int) -> None:
        pass

    def runs(self) -> list[RunRecord]:
        return []

    def events(self, run_id: str) -> list[pb.RunEvent]:
        return []

    def commands(self, run_id: str) -> list[SentCommand]:
        return []


class SqliteStore(NullStore):
    def __init__(self, path: str | Path):
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def save_run(self, record: RunRecord) -> None:
        values = asdict(record)
        values["info"] = values["info"].hex()
        with self._lock, self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO runs (run_id, record) VALUES (?, ?)",
                (record.run_id, json.dumps(values)),
            )

    def append_event(self, run_id: str, seq: int, event: pb.RunEvent) -> None:
        with self._lock, self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO events (run_id, seq, event) VALUES (?, ?, ?)",
                (run_id, seq, event.SerializeToString()),
            )

    def keep_command(self, run_id: str, sent: SentCommand, keep: int) -> None:
        """Add a sent command; only the last `keep` of the run are kept."""
        seq, pools, command = sent
        with self._lock, self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO commands (run_id, seq, pools, command) VALUES (?, ?, ?, ?)",
                (run_id, seq, None if pools is None else json.dumps(pools), command.SerializeToString()),
            )
            db.execute("DELETE FROM commands WHERE run_id = ? AND seq <= ?", (run_id, seq - keep))

    def runs(self) -> list[RunRecord]:
        with self._connect() as db:
            rows = db.execute("SELECT record FROM runs").fetchall()
        records = []
        for (text,) in rows:
            values = json.loads(text)
            values["info"] = bytes.fromhex(values["info"])
            records.append(RunRecord(**values))
        return records

    def events(self, run_id: str) -> list[pb.RunEvent]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT event FROM events WHERE run_id = ? ORDER BY seq", (run_id,)
            ).fetchall()
        return [pb.RunEvent.FromString(blob) for (blob,) in rows]

    def commands(self, run_id: str) -> list[SentCommand]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT seq, pools, command FROM commands WHERE run_id = ? ORDER BY seq", (run_id,)
            ).fetchall()
        return [
            (seq, None if pools is None else tuple(json.loads(pools)), pb.WorkerCommand.FromString(blob))
            for seq, pools, blob in rows
        ]


def open_store(path: str | Path | None) -> NullStore:
    return SqliteStore(path) if path else NullStore()
