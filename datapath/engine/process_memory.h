// SPDX-License-Identifier: Apache-2.0
// Another process's address space as the NIC reaches it (docs/design.md, "Application memory"):
// process_vm_readv/writev, many accesses per call. An address that is not mapped fails that
// access with EFAULT in the kernel; nothing in the engine faults.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <vector>

#include "datapath/nic/memory.h"

namespace metaroce::engine {

class ProcessMemory final : public nic::Memory {
 public:
  explicit ProcessMemory(pid_t pid) : pid_(pid) {}
  size_t read(std::span<const nic::Access> a) override { return transfer(a, false); }
  size_t write(std::span<const nic::Access> a) override { return transfer(a, true); }
  uint32_t pid() const override { return static_cast<uint32_t>(pid_); }
  bool alive() const override { return !gone_.load(std::memory_order_acquire); }
  // Once the process is known to have exited, every access fails without a system call (its
  // pid could name another process soon).
  void mark_gone() { gone_.store(true, std::memory_order_release); }
  // System calls made so far (benchmarks: accesses per call).
  uint64_t calls() const { return calls_; }

 private:
  size_t transfer(std::span<const nic::Access> a, bool write);
  const pid_t pid_;
  std::atomic<bool> gone_{false};
  std::vector<iovec> local_, remote_;
  uint64_t calls_ = 0;
};

}  // namespace metaroce::engine
