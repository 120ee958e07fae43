// SPDX-License-Identifier: Apache-2.0
// Memory the engine reaches with plain copies, no system call (docs/design.md, "Shared memory
// regions"):
// - a kernel-backed context's regions (docs/design.md, "The kernel module"): only they exist,
//   each the pages the module pinned and the engine mapped (KernelDevice::map_region); an
//   address no region covers, or a write into a region pinned read-only, fails that access only;
// - a kernel-free context's shared pages: the whole pages of its regions that its provider moved
//   into a memfd (providers/metaroce/shared_pages.h), mapped here once; every other access goes
//   to the fallback (process_vm_readv/writev), which sees the same pages.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "datapath/engine/kernel_device.h"
#include "datapath/hostif/control.h"
#include "datapath/nic/memory.h"

namespace metaroce::engine {

class MappedMemory final : public nic::Memory {
 public:
  // fallback: what serves an access no region covers (nullptr: it fails).
  explicit MappedMemory(uint32_t pid, nic::Memory* fallback = nullptr)
      : pid_(pid), fallback_(fallback) {}
  ~MappedMemory() override;
  MappedMemory(const MappedMemory&) = delete;
  MappedMemory& operator=(const MappedMemory&) = delete;
  size_t read(std::span<const nic::Access> a) override { return access(a, false); }
  size_t write(std::span<const nic::Access> a) override { return access(a, true); }
  uint8_t* view(uint64_t addr, uint32_t len, bool write) override;
  uint32_t pid() const override { return pid_; }
  bool alive() const override { return !fallback_ || fallback_->alive(); }

  // Region `key` is [iova, iova + length), mapped by `map` (kept until remove).
  void add(uint32_t key, uint64_t iova, uint64_t length, bool writable,
           std::unique_ptr<RegionMapping> map);
  // The region's mapping, handed back so that the caller unmaps it outside the datapath; its
  // shared pieces are forgotten too.
  std::unique_ptr<RegionMapping> remove(uint32_t key);
  size_t regions() const { return by_key_.size(); }

  // The memfd of shared pages (sealed against shrinking): mapped up to `need` bytes (grown when
  // a later piece needs more). 0, or EINVAL (not a sealed memfd, another one than before,
  // past its end) or ENOMEM.
  int map_shared(int fd, uint64_t need);
  // Region `key` (already registered) has [p.va, p.va + p.len) at p.off of the memfd.
  void add_piece(uint32_t key, const hostif::SharedPiece& p);

  // What it served, for `metaroce engine status`.
  struct Stats {
    uint32_t shared_regions = 0;  // keys with shared pieces
    uint64_t shared_bytes = 0;
    uint64_t direct = 0;          // accesses served by a plain copy
    uint64_t fallback = 0;        // accesses handed to the fallback
  };
  Stats stats() const;

 private:
  struct Region {
    uint64_t start = 0, end = 0;
    bool writable = false;
    uint8_t* at = nullptr;  // where start is in the engine; nullptr: shared_base_ + off
    uint64_t off = 0;
    std::unique_ptr<RegionMapping> map;
  };
  size_t access(std::span<const nic::Access> a, bool write);
  // Where [addr, addr + len) is in the engine, or nullptr.
  uint8_t* translate(uint64_t addr, uint32_t len, bool write);
  void index(Region* r) { by_start_.emplace(r->start, r); }

  const uint32_t pid_;
  nic::Memory* const fallback_;
  std::multimap<uint32_t, Region> by_key_;    // a shared region has a piece per range
  std::multimap<uint64_t, Region*> by_start_;  // regions may overlap (registered twice)
  const Region* last_ = nullptr;               // consecutive accesses mostly hit one region
  uint8_t* shared_base_ = nullptr;             // the memfd's mapping
  uint64_t shared_len_ = 0;
  dev_t shared_dev_ = 0;
  ino_t shared_ino_ = 0;
  uint64_t direct_ = 0, to_fallback_ = 0;
  std::vector<nic::Access> pending_;  // consecutive accesses for the fallback
  nic::DirectMemory copy_;            // the copies themselves, ordered as the NIC promises
};

}  // namespace metaroce::engine
