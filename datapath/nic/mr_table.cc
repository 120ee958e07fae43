// SPDX-License-Identifier: Apache-2.0
// Memory-region keys and access checks.
#include "datapath/nic/mr_table.h"

namespace metaroce::nic {

uint32_t MrTable::add(uint32_t pd, uint64_t iova, uint64_t va, uint64_t length,
                      unsigned int access, Memory* mem, const Owner* owner) {
  uint32_t index;
  if (!free_.empty()) {
    index = free_.back();
    free_.pop_back();
  } else {
    if (regions_.size() >= (1u << 24) - 1) return 0;
    regions_.emplace_back();
    index = static_cast<uint32_t>(regions_.size());  // index 0 unused: key 0 is never valid
  }
  MemoryRegion& r = regions_[index - 1];
  // A new generation per reuse, so a stale key of a freed region does not match its successor.
  uint32_t gen = ((r.key & 0xff) + 1) & 0xff;
  r = MemoryRegion{iova, length, access, pd, (index << 8) | gen, mem, owner, true, va};
  ++live_;
  return r.key;
}

const MemoryRegion* MrTable::find(uint32_t key, const Owner* owner) const {
  uint32_t index = key >> 8;
  if (index == 0 || index > regions_.size()) return nullptr;
  const MemoryRegion& r = regions_[index - 1];
  if (!r.valid || r.key != key || (owner && r.owner != owner)) return nullptr;
  return &r;
}

MemoryRegion* MrTable::find_mutable(uint32_t key, const Owner* owner) {
  return const_cast<MemoryRegion*>(find(key, owner));
}

bool MrTable::remove(uint32_t key) {
  uint32_t index = key >> 8;
  if (index == 0 || index > regions_.size()) return false;
  MemoryRegion& r = regions_[index - 1];
  if (!r.valid || r.key != key) return false;
  r.valid = false;
  r.mem = nullptr;
  r.owner = nullptr;
  free_.push_back(index);
  --live_;
  return true;
}

MrCheck MrTable::check(uint32_t key, uint32_t pd, unsigned int need, uint64_t addr, uint64_t len,
                       const MemoryRegion** mr) const {
  const MemoryRegion* r = find(key);
  if (!r) return MrCheck::kBadKey;
  if (r->pd != pd) return MrCheck::kBadPd;
  if ((r->access & need) != need) return MrCheck::kNoAccess;
  // Overflow-safe bounds check.
  if (addr < r->addr || len > r->length || addr - r->addr > r->length - len)
    return MrCheck::kOutOfBounds;
  if (mr) *mr = r;
  return MrCheck::kOk;
}

std::vector<uint32_t> MrTable::keys_of(const Owner* owner) const {
  std::vector<uint32_t> keys;
  for (const MemoryRegion& r : regions_)
    if (r.valid && r.owner == owner) keys.push_back(r.key);
  return keys;
}

}  // namespace metaroce::nic
