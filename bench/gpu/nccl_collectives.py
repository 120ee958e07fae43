#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One rank of NCCL collectives through PyTorch (torch.distributed, backend nccl), every result
checked. bench/gpu/run starts two, each under `metaroce exec` with its own NCCL_IB_HCA and
NCCL_HOSTID, so that NCCL's network transport (IB verbs over MetaRoCE, or its socket transport
for the reference) carries every byte between them.

  nccl_collectives.py --rank R --world N --port P --out FILE [--max-bytes B] [--ops a,b]
                      [--iters K]

Writes one JSON object per (collective, size) to FILE (rank 0 only): bytes, time per call,
algorithm and bus bandwidth (nccl-tests' definitions), wrong elements; rank 0 also prints each
as it is measured (bench/gpu/run watches them to black-hole a path mid-run).
Exit status: 0 every result right; 1 a result was wrong; 2 setup failed.
"""

import argparse
import json
import sys

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# Bus bandwidth / algorithm bandwidth, as nccl-tests defines it for n ranks.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def sizes(max_bytes):
    s = 1024
    while s <= max_bytes:
        yield s
        s *= 4


def pattern(torch, rank, count, salt):
    # Small integers in float32: every sum is exact, so results compare with ==.
    return ((torch.arange(count, device="cuda", dtype=torch.int64) % 251) + 3 * (rank + 1)
            + salt % 7).to(torch.float32)


def prepare(torch, dist, op, nbytes, rank, world, salt):
    """The inputs of one call of op on nbytes (nccl-tests' size: the larger of input and
    output): (run, wrong), run() the bare collective, wrong() the count of wrong elements of
    its result afterwards."""
    count = nbytes // 4
    per = count // world
    if op == "all_reduce":
        t = pattern(torch, rank, count, salt)
        want = sum(pattern(torch, r, count, salt) for r in range(world))
        return (lambda: dist.all_reduce(t)), (lambda: int((t != want).sum()))
    out = torch.empty(per if op == "reduce_scatter" else per * world, device="cuda")
    if op == "all_gather":
        inp = pattern(torch, rank, per, salt)
        want = torch.cat([pattern(torch, r, per, salt) for r in range(world)])
        return (lambda: dist.all_gather_into_tensor(out, inp)), (lambda: int((out != want).sum()))
    if op == "reduce_scatter":
        inp = pattern(torch, rank, per * world, salt)
        want = sum(pattern(torch, r, per * world, salt) for r in range(world))[rank * per:(rank + 1) * per]
        return (lambda: dist.reduce_scatter_tensor(out, inp)), (lambda: int((out != want).sum()))
    # all_to_all: rank r's block j goes to rank j; each value says which rank it came from.
    inp = pattern(torch, rank, per * world, salt) + 1000 * rank
    want = torch.cat([(pattern(torch, r, per * world, salt) + 1000 * r)[rank * per:(rank + 1) * per]
                      for r in range(world)])
    return (lambda: dist.all_to_all_single(out, inp)), (lambda: int((out != want).sum()))


def measure(torch, dist, op, nbytes, rank, world, iters):
    """(seconds per call, wrong elements) over a checked warm-up and iters checked calls; only
    the collectives are timed (CUDA events), not building or checking the tensors."""
    run, check = prepare(torch, dist, op, nbytes, rank, world, -1)
    run()
    wrong = check()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    elapsed_ms = 0.0
    for i in range(iters):
        run, check = prepare(torch, dist, op, nbytes, rank, world, i)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        elapsed_ms += start.elapsed_time(end)
        wrong += check()
    return elapsed_ms / 1e3 / iters, wrong


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"nccl_collectives: {e}", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)  # every rank on the one GPU; NCCL_HOSTID makes them two hosts
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=a.world, device_id=torch.device("cuda", 0))
    results, wrong_total = [], 0
    for op in a.ops.split(","):
        for nbytes in sizes(a.max_bytes):
            iters = max(2, a.iters * (64 << 20) // nbytes) if nbytes > (64 << 20) else a.iters
            sec, wrong = measure(torch, dist, op, nbytes, a.rank, a.world, iters)
            algbw = nbytes / sec / 1e9
            row = {"op": op, "bytes": nbytes, "iters": iters, "time_us": sec * 1e6,
                   "algbw_GBs": algbw, "busbw_GBs": algbw * BUS_FACTOR[op](a.world), "wrong": wrong}
            wrong_total += wrong
            if a.rank == 0:
                print(json.dumps(row), flush=True)
                results.append(row)
    dist.destroy_process_group()
    if a.rank == 0:
        with open(a.out, "w") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
    return 0 if wrong_total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
