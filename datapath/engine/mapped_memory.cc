// SPDX-License-Identifier: Apache-2.0
// Accesses through mapped memory regions.
#include "datapath/engine/mapped_memory.h"

namespace metaroce::engine {

void MappedMemory::add(uint32_t key, uint64_t iova, uint64_t length, bool writable,
                       std::unique_ptr<RegionMapping> map) {
  remove(key);
  Region& r = by_key_[key];
  r.start = iova;
  r.end = iova + length;
  r.writable = writable;
  r.map = std::move(map);
  by_start_.emplace(iova, &r);
}

std::unique_ptr<RegionMapping> MappedMemory::remove(uint32_t key) {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return nullptr;
  Region* r = &it->second;
  for (auto s = by_start_.lower_bound(r->start); s != by_start_.end() && s->first == r->start; ++s)
    if (s->second == r) {
      by_start_.erase(s);
      break;
    }
  if (last_ == r) last_ = nullptr;
  auto map = std::move(r->map);
  by_key_.erase(it);
  return map;
}

uint8_t* MappedMemory::translate(uint64_t addr, uint32_t len, bool write) {
  const uint64_t end = addr + len;
  if (end < addr) return nullptr;
  auto fits = [&](const Region* r) {
    return r->start <= addr && end <= r->end && (!write || r->writable);
  };
  if (last_ && fits(last_)) return last_->map->start() + (addr - last_->start);
  // Regions starting at or before addr, nearest first.
  for (auto it = by_start_.upper_bound(addr); it != by_start_.begin();) {
    --it;
    if (fits(it->second)) {
      last_ = it->second;
      return last_->map->start() + (addr - last_->start);
    }
  }
  return nullptr;
}

size_t MappedMemory::read(std::span<const nic::Access> a) {
  for (size_t i = 0; i < a.size(); ++i) {
    const uint8_t* src = translate(a[i].addr, a[i].len, false);
    if (!src) return i;
    const nic::Access x{reinterpret_cast<uintptr_t>(src), a[i].local, a[i].len};
    copy_.read({&x, 1});
  }
  return a.size();
}

size_t MappedMemory::write(std::span<const nic::Access> a) {
  for (size_t i = 0; i < a.size(); ++i) {
    uint8_t* dst = translate(a[i].addr, a[i].len, true);
    if (!dst) return i;
    const nic::Access x{reinterpret_cast<uintptr_t>(dst), a[i].local, a[i].len};
    copy_.write({&x, 1});
  }
  return a.size();
}

}  // namespace metaroce::engine
