"""Where a boundary message's time goes: UCX itself (`ucx_perftest`), plain ucxx under each of
its progress modes, and dyad's `UcxTransport`, ping-pong between two processes.

    python bench/ucx_message_cost.py --out $OUT/message_cost.json     # GPU(s): cuda buffers
    python bench/ucx_message_cost.py --toy                            # CPU, small sizes (CI)

With one GPU both processes use it (cuda_ipc within the device); with two, rank r uses GPU r.
Each row is the median half round trip (one message one way) over `--iters`; its bandwidth is
size / that time. `ucx_perftest` (shipped in the libucx wheel) gives UCX's own floor: C, no
Python, its progress loop polling.

Variants (`--variants`, comma-separated): `perftest` and `perftest-bw` (tag_bw: messages
streamed, a message's time is size over bandwidth); `dyad` (the transport's default progress
mode), `dyad-<mode>`, and `dyad-window<W>` (W messages one way at once, the time over W);
`ucxx-<mode>[+option...]` with options `nofuture`, `header`, `event`, `hop`, `direct` and
`window<W>` (see `_raw_side`). Results: docs/performance.md, "Boundary transfer".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import time

import torch

MB = 1 << 20
GPU_SIZES = [8, 1 * MB, 16 * MB, 64 * MB, 256 * MB]
TOY_SIZES = [8, 1 * MB]
RAW_MODES = ["thread", "thread-polling", "polling", "blocking"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _buffer(nbytes: int, device: str, rank: int) -> torch.Tensor:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)


def _ucxx_buffer(tensor: torch.Tensor):
    return tensor if tensor.is_cuda else tensor.numpy()  # CUDA: via __cuda_array_interface__


def _raw_side(rank, mode, options, sizes, iters, device, to_0, to_1, result_q):
    """Plain ucxx on a loop in a background thread. Options, to find what dyad's path adds:
    "nofuture" (requests polled by the loop, no notifier thread), "header" (an 8-byte host
    message beside each payload, as dyad sends), "hop" (every message posted from the main
    thread and waited on there, as dyad's callers do), "event" (a CUDA event recorded and
    queried before each message, as dyad does), "direct" (requests posted on ucxx's Cython
    endpoint and their futures gathered, without its coroutines), "window<W>" (W messages one
    way at once between barriers, the time over W, instead of a ping-pong)."""
    import array
    import threading

    import ucxx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    window = next((int(o[len("window"):]) for o in options if o.startswith("window")), 1)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    meet = _meeting(rank, to_0, to_1)
    def post(endpoint, buffer, sending):
        """One request on the Cython endpoint, no coroutine (ucxx cancels a request whose
        object is collected: the caller keeps it until it completes)."""
        if sending:
            return endpoint._ep.tag_send(Array(buffer), Tag(1))
        return endpoint._ep.tag_recv(Array(buffer), Tag(1), TagMaskFull)

    async def transfer(endpoint, buffer, sending):
        if "event" in options and device == "cuda":
            event = torch.cuda.Event()
            event.record()
            event.query()
        buffers = [array.array("Q", [buffer.nbytes]), buffer] if "header" in options else [buffer]
        if "direct" in options:
            requests = [post(endpoint, b, sending) for b in buffers]
            await asyncio.gather(*[request.future for request in requests])
            return
        operation = endpoint.send if sending else endpoint.recv
        await asyncio.gather(*[operation(b) for b in buffers])

    async def exchange(endpoint, buffer):
        await transfer(endpoint, buffer, rank == 0)
        await transfer(endpoint, buffer, rank == 1)

    def pingpong(endpoint, buffer):
        start = time.perf_counter()
        if "hop" in options:
            call(transfer(endpoint, buffer, rank == 0))
            call(transfer(endpoint, buffer, rank == 1))
        else:
            call(exchange(endpoint, buffer))
        return (time.perf_counter() - start) / 2

    def one_way(endpoint, buffers):
        sending = rank == 0
        start = time.perf_counter()
        if "hop" in options:
            futures = [asyncio.run_coroutine_threadsafe(transfer(endpoint, b, sending), loop) for b in buffers]
            for future in futures:
                future.result()
        else:

            async def together():
                await asyncio.gather(*[transfer(endpoint, b, sending) for b in buffers])

            call(together())
        return (time.perf_counter() - start) / len(buffers)

    async def start():
        future = "nofuture" not in options and mode.startswith("thread")
        ucxx.init(progress_mode=mode, enable_python_future=future)
        if rank == 0:
            return await ucxx.create_endpoint("127.0.0.1", meet(None))
        accepted = asyncio.get_running_loop().create_future()

        async def accept(endpoint):
            accepted.set_result(endpoint)
            await asyncio.sleep(3600)  # ucxx closes the endpoint when its handler returns

        listener = ucxx.create_listener(accept)
        meet(listener.port)
        return await accepted

    endpoint = call(start())
    times = {}
    for nbytes in sizes:
        buffers = [_ucxx_buffer(_buffer(nbytes, device, rank)) for _ in range(window)]
        samples = []
        for i in range(iters + 3):
            if window > 1:
                meet(i)
                samples.append(one_way(endpoint, buffers))
            else:
                samples.append(pingpong(endpoint, buffers[0]))
        times[nbytes] = statistics.median(samples[3:])
    meet("done")
    if rank == 1:
        result_q.put(times)
    meet("reported")  # the receiver's last messages completed before anyone closes
    ucxx.stop_notifier_thread()  # not a daemon: the process would never exit


def _meeting(rank, to_0, to_1):
    """`meet(value)`: give the peer `value` and take its own; a barrier too."""

    def meet(value):
        (to_1 if rank == 0 else to_0).put(value)
        return (to_0 if rank == 0 else to_1).get(timeout=600)

    return meet


def _pair(target, *args) -> dict[int, float]:
    """Two processes, each with the other's queue for `meet`; rank 1 reports."""
    ctx = mp.get_context("spawn")
    to_0, to_1, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, to_0, to_1, result_q)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 300
    while result_q.empty():  # a side that died fails the variant now, not at the deadline
        dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"a side exited with {dead}" if dead else "no result within 300 s")
        time.sleep(0.1)
    result = result_q.get()
    for proc in procs:
        proc.join(60)
    return result


def _dyad_proc(rank, progress, window, sizes, iters, device, to_0, to_1, result_q):
    from dyad.transport import Direction, MessageTag, UcxTransport

    meet = _meeting(rank, to_0, to_1)

    with UcxTransport(progress=progress) as transport:
        peer = meet(transport.address)
        transport.authorize(b"ucx-message-cost-bench-secret!!!", [peer])
        times = {}
        for size_index, nbytes in enumerate(sizes):
            if window > 1:
                buffers = [_buffer(nbytes, device, rank) for _ in range(window)]
                samples = []
                for i in range(iters + 3):
                    tags = [MessageTag("bench", i, k, Direction.FORWARD, size_index) for k in range(window)]
                    meet(i)
                    start = time.perf_counter()
                    move = transport.send if rank == 0 else transport.recv
                    for future in [move(peer, tag, buffer) for tag, buffer in zip(tags, buffers)]:
                        future.result()
                    samples.append((time.perf_counter() - start) / window)
                times[nbytes] = statistics.median(samples[3:])
                continue
            buffer = _buffer(nbytes, device, rank)
            samples = []
            for i in range(iters + 3):
                there = MessageTag("bench", i, size_index, Direction.FORWARD, 0)
                back = MessageTag("bench", i, size_index, Direction.BACKWARD, 0)
                start = time.perf_counter()
                if rank == 0:
                    transport.send(peer, there, buffer).result()
                    transport.recv(peer, back, buffer).result()
                else:
                    transport.recv(peer, there, buffer).result()
                    transport.send(peer, back, buffer).result()
                samples.append((time.perf_counter() - start) / 2)
            times[nbytes] = statistics.median(samples[3:])
        meet("done")
        if rank == 1:
            result_q.put(times)


def _perftest(sizes, iters, device, test="tag_lat") -> dict[int, float]:
    """tag_lat: the median half round trip; tag_bw (messages streamed): size over bandwidth."""
    import libucx

    root = os.path.dirname(libucx.__file__)
    binary = os.path.join(root, "bin", "ucx_perftest")
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(root, "lib") + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    memory = ["-m", "cuda,cuda"] if device == "cuda" else []
    times = {}
    for nbytes in sizes:
        port = str(_free_port())
        server_env = dict(env)
        if device == "cuda" and torch.cuda.device_count() > 1:
            server_env["CUDA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"] = "1", "0"
        server = subprocess.Popen([binary, "-p", port], env=server_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
        args = [binary, "127.0.0.1", "-p", port, "-t", test, "-s", str(nbytes), "-n", str(iters), "-w", "3", *memory]
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        server.communicate(timeout=60)
        final = [line for line in out.stdout.splitlines() if line.startswith("Final:")]
        if not final:
            raise RuntimeError(f"ucx_perftest failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        fields = final[0].split()  # Final: iters p50 average overall bw-average bw-overall (MB/s)...
        times[nbytes] = float(fields[2]) * 1e-6 if test == "tag_lat" else nbytes / (float(fields[6]) * MB)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--variants", default="perftest,dyad,dyad-thread," + ",".join(f"ucxx-{m}" for m in RAW_MODES))
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cpu" if args.toy or not torch.cuda.is_available() else "cuda"
    sizes = TOY_SIZES if args.toy else GPU_SIZES
    rows = {}
    for variant in args.variants.split(","):
        start = time.perf_counter()
        try:
            if variant == "perftest":
                times = _perftest(sizes, args.iters, device)
            elif variant.startswith("dyad-window"):
                times = _pair(_dyad_proc, None, int(variant[len("dyad-window"):]), sizes, args.iters, device)
            elif variant == "dyad" or variant.startswith("dyad-"):
                times = _pair(_dyad_proc, variant[5:] or None, 1, sizes, args.iters, device)
            elif variant == "perftest-bw":
                times = _perftest(sizes, args.iters, device, test="tag_bw")
            elif variant.startswith("ucxx-"):
                mode, *options = variant[5:].split("+")
                times = _pair(_raw_side, mode, set(options), sizes, args.iters, device)
            else:
                raise SystemExit(f"--variants: unknown variant {variant!r}")
        except Exception as e:  # one variant failing must not lose the others
            rows[variant] = {"error": repr(e)}
            print(f"{variant}: failed: {e!r}", flush=True)
            continue
        rows[variant] = {str(n): t for n, t in times.items()}
        cells = "  ".join(f"{n:>10d} B {t * 1e6:9.1f} us {n / t / 1e9:7.1f} GB/s" for n, t in times.items())
        print(f"{variant:26s} ({time.perf_counter() - start:.0f}s) {cells}", flush=True)
    if args.out:
        info = {"device": device if device == "cpu" else torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__, "half_round_trip_s": rows}
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
