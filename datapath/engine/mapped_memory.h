// SPDX-License-Identifier: Apache-2.0
// A kernel-backed context's address space as the NIC reaches it (docs/design.md, "The kernel
// module"): only its memory regions exist, each the pages the module pinned and the engine mapped
// (KernelDevice::map_region), so an access is a plain copy with no system call. An address that
// no region covers, or a write into a region pinned read-only, fails that access only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>

#include "datapath/engine/kernel_device.h"
#include "datapath/nic/memory.h"

namespace metaroce::engine {

class MappedMemory final : public nic::Memory {
 public:
  explicit MappedMemory(uint32_t pid) : pid_(pid) {}
  size_t read(std::span<const nic::Access> a) override;
  size_t write(std::span<const nic::Access> a) override;
  uint32_t pid() const override { return pid_; }

  // Region `key` is [iova, iova + length), mapped by `map` (kept until remove).
  void add(uint32_t key, uint64_t iova, uint64_t length, bool writable,
           std::unique_ptr<RegionMapping> map);
  // The region's mapping, handed back so that the caller unmaps it outside the datapath.
  std::unique_ptr<RegionMapping> remove(uint32_t key);
  size_t regions() const { return by_key_.size(); }

 private:
  struct Region {
    uint64_t start = 0, end = 0;
    bool writable = false;
    std::unique_ptr<RegionMapping> map;
  };
  // Where [addr, addr + len) is in the engine, or nullptr.
  uint8_t* translate(uint64_t addr, uint32_t len, bool write);

  const uint32_t pid_;
  std::map<uint32_t, Region> by_key_;
  std::multimap<uint64_t, Region*> by_start_;  // regions may overlap (registered twice)
  const Region* last_ = nullptr;               // consecutive accesses mostly hit one region
  nic::DirectMemory copy_;                     // the copies themselves, ordered as the NIC promises
};

}  // namespace metaroce::engine
