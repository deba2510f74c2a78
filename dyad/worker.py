"""A worker process: registers with the router, heartbeats, and executes the router's commands
with its pool's service (`encoder_service.worker` or `llm_service.worker`).

    python -m dyad.worker --router HOST:PORT --run-id ID --pool encoder --rank 0 \
        --dist-address HOST:PORT

`--dist-address` is the pool's torch.distributed rendezvous (its rank 0 hosts the store); the
pool's world size comes from the run's layout.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import traceback

import grpc
import torch
import torch.distributed as dist

from dyad import config as config_lib
from dyad.transport import UcxTransport
from dyad.wire import GRPC_OPTIONS, pb, rpc

log = logging.getLogger("dyad.worker")
POOL_ENUMS = {"encoder": pb.POOL_ENCODER, "llm": pb.POOL_LLM}

def _service_class(pool: str):
    # Imported lazily so each process loads only its own model code.
    if pool == "encoder":
        from dyad.encoder_service.worker import EncoderWorker

        return EncoderWorker
    from dyad.llm_service.worker import LLMWorker

    return LLMWorker


class WorkerRuntime:
    def __init__(self, router: str, run_id: str, pool: str, rank: int, dist_address: str):
        self.run_id = run_id
        self.dist_address = dist_address
        self.worker = pb.WorkerId(pool=POOL_ENUMS[pool], rank=rank)
        self.pool, self.rank = pool, rank
        self.channel = grpc.insecure_channel(router, options=GRPC_OPTIONS)
        self.stub = rpc.CoordinatorStub(self.channel)
        self._stopped = threading.Event()

    def run(self) -> None:
        with UcxTransport() as transport:
            reply = self.stub.Register(
                pb.RegisterRequest(
                    run_id=self.run_id, worker=self.worker, data_address=transport.address
                ),
                wait_for_ready=True,
                timeout=60,
            )
            config = config_lib.from_yaml(reply.config_yaml)
            interval = config.router.heartbeat_interval_s
            threading.Thread(target=self._heartbeat, args=(interval,), daemon=True).start()
            self._join_pool(config)
            service = _service_class(self.pool)(config, transport, self.rank, self.run_id)
            try:
                self._execute(service)
            finally:
                self._stopped.set()
                service.close()
                dist.destroy_process_group()

    def _join_pool(self, config) -> None:
        world_size = getattr(config.parallel, self.pool).world_size
        backend = "nccl" if config.train.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://{self.dist_address}",
            rank=self.rank,
            world_size=world_size,
        )

    def _execute(self, service) -> None:
        commands = self.stub.Commands(
            pb.CommandStreamRequest(run_id=self.run_id, worker=self.worker)
        )
        for command in commands:
            kind = command.WhichOneof("command")
            if kind == "stop":
                return
            try:
                result = getattr(service, kind)(getattr(command, kind))
            except Exception:  # noqa: BLE001 - reported to the router, then this worker exits
                self._report(error=traceback.format_exc())
                raise
            if result is not None:
                self._report(**{kind: result})

    def _report(self, **result) -> None:
        self.stub.ReportResult(
            pb.WorkerResult(run_id=self.run_id, worker=self.worker, **result), timeout=30
        )

    def _heartbeat(self, interval_s: float) -> None:
        request = pb.HeartbeatRequest(run_id=self.run_id, worker=self.worker)
        while not self._stopped.wait(interval_s):
            try:
                if self.stub.Heartbeat(request, timeout=interval_s * 5).stop:
                    return
            except grpc.RpcError as error:
                log.warning("heartbeat failed: %s", error.code())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dyad.worker")
    parser.add_argument("--router", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--pool", choices=sorted(POOL_ENUMS), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dist-address", required=True, help="the pool's rendezvous HOST:PORT")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("DYAD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {args.pool}/{args.rank} %(levelname)s %(message)s",
    )
    WorkerRuntime(args.router, args.run_id, args.pool, args.rank, args.dist_address).run()


if __name__ == "__main__":
    main()
