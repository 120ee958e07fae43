// SPDX-License-Identifier: Apache-2.0
// How the NIC reaches the memory of whoever registered it (docs/design.md, "Application
// memory"): the engine reaches another process's address space (process_vm_readv/writev, in
// datapath/engine), tests reach their own. The NIC batches its accesses per pass and carries
// them out in few calls; an address that is not mapped fails that access only, never the NIC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace metaroce::nic {

// One contiguous access: `len` bytes at `addr` in the address space, `local` in the NIC's.
struct Access {
  uint64_t addr = 0;
  uint8_t* local = nullptr;
  uint32_t len = 0;
};

class Memory {
 public:
  virtual ~Memory() = default;
  // Carry out the accesses in order. Returns how many were done completely before the first
  // that could not be (all of them: a.size()); that one may have been done in part.
  virtual size_t read(std::span<const Access> a) = 0;   // address space -> local
  virtual size_t write(std::span<const Access> a) = 0;  // local -> address space
  // Where the NIC can read (or, with write, write) [addr, addr + len) in place, without a call,
  // for the rest of this pass (commands, which may unmap memory, run between passes); nullptr:
  // only through read() and write().
  virtual uint8_t* view(uint64_t /*addr*/, uint32_t /*len*/, bool /*write*/) { return nullptr; }
  // The process it belongs to, for telemetry (0 for the NIC's own).
  virtual uint32_t pid() const { return 0; }
  // False once the address space is known to be gone (its process exited): an access that
  // failed for that reason is not the application's fault, and its objects go soon anyway.
  virtual bool alive() const { return true; }
};

// Writes up to this size land in ascending address order, 8 bytes at a time (AccessBatch).
inline constexpr uint32_t kOrderedMax = 256;

// The NIC's own address space (unit tests, the simulator): plain copies.
class DirectMemory final : public Memory {
 public:
  size_t read(std::span<const Access> a) override {
    for (const Access& x : a) std::memcpy(x.local, reinterpret_cast<const void*>(x.addr), x.len);
    return a.size();
  }
  uint8_t* view(uint64_t addr, uint32_t /*len*/, bool /*write*/) override {
    return reinterpret_cast<uint8_t*>(addr);
  }
  size_t write(std::span<const Access> a) override {
    for (const Access& x : a) {
      auto* dst = reinterpret_cast<uint8_t*>(x.addr);
      if (x.len > kOrderedMax) {
        std::memcpy(dst, x.local, x.len);
        continue;
      }
      // Ascending 8-byte stores for a small write, as AccessBatch::add_write promises.
      size_t i = 0;
      for (; i + 8 <= x.len; i += 8) {
        uint64_t w;
        std::memcpy(&w, x.local + i, 8);
        std::memcpy(dst + i, &w, 8);
        asm volatile("" ::: "memory");
      }
      for (; i < x.len; ++i) dst[i] = x.local[i];
    }
    return a.size();
  }
};

}  // namespace metaroce::nic
