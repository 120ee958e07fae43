#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What the engine could reach of the memory NCCL registers (docs/bundle.md, "What NCCL
registers"): for each kind of buffer, the /proc/self/maps line that holds it and whether another
process can read it with process_vm_readv (the engine's fallback; the shared-memfd path needs a
private anonymous mapping). Kinds: plain anonymous memory (the reference), and with CUDA
(PyTorch): cudaHostAlloc'd memory (a pinned tensor), anonymous memory pinned by
cudaHostRegister, and device memory (cudaMalloc).

  probe_memory.py OUT.json [--cpu]
"""

import ctypes
import json
import mmap
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def maps_line(addr):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.strip()
    return None


def readable_by_another_process(addr, length, expect):
    """Forks a child that reads [addr, addr+length) of this process with process_vm_readv."""
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        buf = ctypes.create_string_buffer(length)
        local, remote = IoVec(ctypes.addressof(buf), length), IoVec(addr, length)
        n = libc.process_vm_readv(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        err = ctypes.get_errno()
        ok = n == length and buf.raw[:len(expect)] == expect
        os.write(w, json.dumps({"bytes": n, "errno": os.strerror(err) if n < 0 else None,
                                "content_matches": ok}).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)


def probe(kind, addr, length, expect):
    return {"kind": kind, "addr": hex(addr), "maps": maps_line(addr),
            "process_vm_readv": readable_by_another_process(addr, length, expect)}


def main():
    out, cpu = sys.argv[1], "--cpu" in sys.argv[2:]
    n = 1 << 20
    pattern = b"metaroce" * 8
    results = []
    anon = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anon[:len(pattern)] = pattern
    anon_addr = ctypes.addressof(ctypes.c_char.from_buffer(anon))
    results.append(probe("anonymous (reference)", anon_addr, 4096, pattern))
    if not cpu:
        import torch
        pinned = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
        pinned[:len(pattern)] = torch.frombuffer(bytearray(pattern), dtype=torch.uint8)
        results.append(probe("cudaHostAlloc (torch pin_memory)", pinned.data_ptr(), 4096, pattern))
        reg = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        reg[:len(pattern)] = pattern
        reg_addr = ctypes.addressof(ctypes.c_char.from_buffer(reg))
        rc = torch.cuda.cudart().cudaHostRegister(reg_addr, n, 0)
        row = probe("anonymous + cudaHostRegister", reg_addr, 4096, pattern)
        row["cudaHostRegister"] = int(rc)
        results.append(row)
        dev = torch.zeros(n, dtype=torch.uint8, device="cuda")
        results.append(probe("cudaMalloc (device memory)", dev.data_ptr(), 4096, b""))
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    for r in results:
        print(f"{r['kind']}: {r['maps']} | process_vm_readv {r['process_vm_readv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
