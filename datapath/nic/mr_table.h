// SPDX-License-Identifier: Apache-2.0
// The NIC's memory-region table: key allocation and the checks every local and remote access
// goes through (key, protection domain, access right, bounds). A region remembers the address
// space it lies in, so an rkey reaches the memory of the process that registered it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "datapath/nic/memory.h"

namespace metaroce::nic {

class Owner;

struct MemoryRegion {
  uint64_t addr = 0;        // where the region starts in the addresses verbs use for it (its IOVA)
  uint64_t length = 0;
  unsigned int access = 0;  // ibv_access_flags values
  uint32_t pd = 0;
  uint32_t key = 0;         // lkey == rkey
  Memory* mem = nullptr;
  const Owner* owner = nullptr;
  bool valid = false;
  uint64_t va = 0;          // where byte 0 lies in mem (== addr unless registered with an IOVA)

  // The address in mem of verbs address a (checked to lie in the region).
  uint64_t translate(uint64_t a) const { return va + (a - addr); }
};

enum class MrCheck : uint8_t { kOk, kBadKey, kBadPd, kNoAccess, kOutOfBounds };

class MrTable {
 public:
  // Returns the new key, or 0 when the table is full (2^24 regions). iova: the address verbs
  // use for byte 0 (local SGEs and remote accesses alike); va: where it lies in mem.
  uint32_t add(uint32_t pd, uint64_t iova, uint64_t va, uint64_t length, unsigned int access,
               Memory* mem, const Owner* owner);
  // The region of key, to change in place (ibv_rereg_mr); nullptr when there is none.
  MemoryRegion* find_mutable(uint32_t key, const Owner* owner);
  // The region of key if it belongs to owner (nullptr: any owner).
  const MemoryRegion* find(uint32_t key, const Owner* owner = nullptr) const;
  bool remove(uint32_t key);
  // Checks that [addr, addr + len) lies in the region named by key, which belongs to pd and
  // grants every bit of `need`. On success *mr is the region.
  MrCheck check(uint32_t key, uint32_t pd, unsigned int need, uint64_t addr, uint64_t len,
                const MemoryRegion** mr) const;
  size_t size() const { return live_; }
  // Every key of owner (for reclaiming a process's objects).
  std::vector<uint32_t> keys_of(const Owner* owner) const;

 private:
  std::vector<MemoryRegion> regions_;  // index = key >> 8; key & 0xff = generation
  std::vector<uint32_t> free_;
  size_t live_ = 0;
};

}  // namespace metaroce::nic
