// SPDX-License-Identifier: Apache-2.0
// Memory-region keys and access checks.
#include "datapath/nic/mr_table.h"

#include <algorithm>
#include <cerrno>

namespace metaroce::nic {

uint32_t MrTable::add(uint32_t pd, uint64_t iova, uint64_t va, uint64_t length,
                      unsigned int access, Memory* mem, const Owner* owner, uint32_t want) {
  uint32_t index;
  if (want) {
    index = want >> 8;
    if (index == 0) return 0;
    while (regions_.size() < index) {  // indices skipped on the way are free for others
      regions_.emplace_back();
      free_.push_back(static_cast<uint32_t>(regions_.size()));
    }
    if (regions_[index - 1].valid) return 0;
    std::erase(free_, index);
    regions_[index - 1] = MemoryRegion{iova, length, access, pd, want, mem, owner, true, va};
    ++live_;
    return want;
  }
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

MemoryRegion* MrTable::window_at(uint32_t key, const Owner* owner) {
  const uint32_t index = key >> 8;
  if (index == 0 || index > regions_.size()) return nullptr;
  MemoryRegion& r = regions_[index - 1];
  if (!r.valid || !r.mw_type || (owner && r.owner != owner)) return nullptr;
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
  if (r.mw_type && r.bound) unbind(r);
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
  if (!r || r->mw_type) return MrCheck::kBadKey;
  return check_range(*r, pd, need, addr, len, mr);
}

MrCheck MrTable::check_remote(uint32_t key, uint32_t pd, uint32_t qpn, unsigned int need,
                              uint64_t addr, uint64_t len, const MemoryRegion** mr) const {
  const MemoryRegion* r = find(key);
  if (!r || (r->mw_type && !r->bound) || (r->mw_type == 2 && r->qpn != qpn))
    return MrCheck::kBadKey;
  return check_range(*r, pd, need, addr, len, mr);
}

MrCheck MrTable::check_range(const MemoryRegion& region, uint32_t pd, unsigned int need,
                             uint64_t addr, uint64_t len, const MemoryRegion** mr) {
  const MemoryRegion* r = &region;
  if (r->pd != pd) return MrCheck::kBadPd;
  if ((r->access & need) != need) return MrCheck::kNoAccess;
  // Overflow-safe bounds check.
  if (addr < r->addr || len > r->length || addr - r->addr > r->length - len)
    return MrCheck::kOutOfBounds;
  if (mr) *mr = r;
  return MrCheck::kOk;
}

int MrTable::add_window(uint32_t pd, uint8_t type, const Owner* owner, uint32_t* rkey) {
  if (type != 1 && type != 2) return EINVAL;
  const uint32_t key = add(pd, 0, 0, 0, 0, nullptr, owner);
  if (key == 0) return ENOMEM;
  regions_[(key >> 8) - 1].mw_type = type;
  *rkey = key;
  return 0;
}

void MrTable::unbind(MemoryRegion& w) {
  if (MemoryRegion* parent = const_cast<MemoryRegion*>(find(w.parent)); parent && parent->windows)
    --parent->windows;
  w.bound = false;
  w.parent = w.qpn = 0;
  w.length = w.addr = w.va = 0;
  w.access = 0;
  w.mem = nullptr;
}

int MrTable::bind_window(uint32_t rkey, uint32_t new_rkey, uint32_t pd, uint32_t qpn,
                         uint32_t lkey, uint64_t addr, uint64_t length, unsigned int access) {
  MemoryRegion* w = window_at(rkey, nullptr);
  if (!w || w->pd != pd || (new_rkey >> 8) != (rkey >> 8)) return EINVAL;
  if (w->mw_type == 2 && w->bound) return EINVAL;  // a type 2 window is invalidated first
  if (length == 0) {  // an empty bind: nothing is reachable through the window any more
    if (w->bound) unbind(*w);
    w->key = new_rkey;
    return 0;
  }
  const MemoryRegion* r = find(lkey);
  if (!r || r->mw_type || r->pd != pd || r->owner != w->owner) return EINVAL;
  if (!(r->access & kMwBindAccess)) return EACCES;
  // Remote write or atomic through the window needs the region's local write (IB o10-37).
  if ((access & (kMwRemoteWrite | kMwRemoteAtomic)) && !(r->access & kMwLocalWrite)) return EACCES;
  if (addr < r->addr || length > r->length || addr - r->addr > r->length - length) return ERANGE;
  if (w->bound) unbind(*w);
  w->bound = true;
  w->key = new_rkey;
  w->qpn = w->mw_type == 2 ? qpn : 0;
  w->parent = r->key;
  w->addr = addr;
  w->length = length;
  w->va = r->translate(addr);
  w->mem = r->mem;
  w->access = access;
  const_cast<MemoryRegion*>(r)->windows++;
  return 0;
}

int MrTable::invalidate_window(uint32_t rkey, uint32_t pd, uint32_t qpn) {
  MemoryRegion* w = const_cast<MemoryRegion*>(find(rkey));
  if (!w || w->mw_type != 2 || !w->bound || w->pd != pd || (qpn && w->qpn != qpn)) return EINVAL;
  unbind(*w);
  return 0;
}

std::vector<uint32_t> MrTable::keys_of(const Owner* owner) const {
  std::vector<uint32_t> keys;
  for (const MemoryRegion& r : regions_)
    if (r.valid && r.owner == owner) keys.push_back(r.key);
  return keys;
}

}  // namespace metaroce::nic
