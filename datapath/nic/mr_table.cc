// SPDX-License-Identifier: Apache-2.0
// Memory-region keys and access checks.
#include "datapath/nic/mr_table.h"

namespace metaroce::nic {

uint32_t MrTable::add(uint32_t pd, uint64_t addr, uint64_t length, unsigned int access) {
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
  r = MemoryRegion{addr, length, access, pd, (index << 8) | gen, true};
  ++live_;
  return r.key;
}

bool MrTable::remove(uint32_t key) {
  uint32_t index = key >> 8;
  if (index == 0 || index > regions_.size()) return false;
  MemoryRegion& r = regions_[index - 1];
  if (!r.valid || r.key != key) return false;
  r.valid = false;
  free_.push_back(index);
  --live_;
  return true;
}

MrCheck MrTable::check(uint32_t key, uint32_t pd, unsigned int need, uint64_t addr, uint64_t len,
                       uint8_t** host) const {
  uint32_t index = key >> 8;
  if (index == 0 || index > regions_.size()) return MrCheck::kBadKey;
  const MemoryRegion& r = regions_[index - 1];
  if (!r.valid || r.key != key) return MrCheck::kBadKey;
  if (r.pd != pd) return MrCheck::kBadPd;
  if ((r.access & need) != need) return MrCheck::kNoAccess;
  // Overflow-safe bounds check.
  if (addr < r.addr || len > r.length || addr - r.addr > r.length - len) return MrCheck::kOutOfBounds;
  if (host) *host = reinterpret_cast<uint8_t*>(addr);
  return MrCheck::kOk;
}

}  // namespace metaroce::nic
