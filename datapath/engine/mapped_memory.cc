// SPDX-License-Identifier: Apache-2.0
// Accesses through mapped memory regions, and the rest through the fallback.
#include "datapath/engine/mapped_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <cerrno>

namespace metaroce::engine {

namespace {
constexpr uint64_t kGrowStep = uint64_t{1} << 30;  // the memfd is mapped a GiB at a time
}

MappedMemory::~MappedMemory() {
  if (shared_base_) munmap(shared_base_, shared_len_);
}

void MappedMemory::add(uint32_t key, uint64_t iova, uint64_t length, bool writable,
                       std::unique_ptr<RegionMapping> map) {
  remove(key);
  Region& r = by_key_.emplace(key, Region{})->second;
  r.start = iova;
  r.end = iova + length;
  r.writable = writable;
  r.at = map->start();
  r.map = std::move(map);
  index(&r);
}

void MappedMemory::add_piece(uint32_t key, const hostif::SharedPiece& p) {
  Region& r = by_key_.emplace(key, Region{})->second;
  r.start = p.va;
  r.end = p.va + p.len;
  r.writable = true;  // the NIC checks the region's access rights before any access
  r.off = p.off;
  index(&r);
}

std::unique_ptr<RegionMapping> MappedMemory::remove(uint32_t key) {
  std::unique_ptr<RegionMapping> map;
  auto [first, last] = by_key_.equal_range(key);
  for (auto it = first; it != last; ++it) {
    Region* r = &it->second;
    for (auto s = by_start_.lower_bound(r->start); s != by_start_.end() && s->first == r->start; ++s)
      if (s->second == r) {
        by_start_.erase(s);
        break;
      }
    if (last_ == r) last_ = nullptr;
    if (r->map) map = std::move(r->map);
  }
  by_key_.erase(first, last);
  return map;
}

int MappedMemory::map_shared(int fd, uint64_t need) {
  struct stat st {};
  struct statfs fs {};
  // Only a memfd sealed against shrinking, of ordinary shared memory: a mapping of anything else
  // could fault the engine (a file cut short, a hugetlbfs page that cannot be had).
  const int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC || seals < 0 ||
      !(seals & F_SEAL_SHRINK) || !S_ISREG(st.st_mode) || need > static_cast<uint64_t>(st.st_size))
    return EINVAL;
  if (shared_base_ && (st.st_dev != shared_dev_ || st.st_ino != shared_ino_)) return EINVAL;
  if (need <= shared_len_) return 0;
  const uint64_t len = std::min<uint64_t>((need + kGrowStep - 1) / kGrowStep * kGrowStep,
                                          static_cast<uint64_t>(st.st_size));
  void* p = shared_base_
                ? mremap(shared_base_, shared_len_, len, MREMAP_MAYMOVE)
                : mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) return ENOMEM;
  shared_base_ = static_cast<uint8_t*>(p);
  shared_len_ = len;
  shared_dev_ = st.st_dev;
  shared_ino_ = st.st_ino;
  return 0;
}

MappedMemory::Stats MappedMemory::stats() const {
  Stats s;
  s.direct = direct_;
  s.fallback = to_fallback_;
  uint32_t last = 0;
  bool any = false;
  for (const auto& [key, r] : by_key_) {
    if (r.at) continue;
    s.shared_bytes += r.end - r.start;
    if (!any || key != last) ++s.shared_regions;
    any = true;
    last = key;
  }
  return s;
}

uint8_t* MappedMemory::translate(uint64_t addr, uint32_t len, bool write) {
  const uint64_t end = addr + len;
  if (end < addr) return nullptr;
  auto fits = [&](const Region* r) {
    return r->start <= addr && end <= r->end && (!write || r->writable);
  };
  auto at = [&](const Region* r) {
    return (r->at ? r->at : shared_base_ + r->off) + (addr - r->start);
  };
  if (last_ && fits(last_)) return at(last_);
  // Regions starting at or before addr, nearest first.
  for (auto it = by_start_.upper_bound(addr); it != by_start_.begin();) {
    --it;
    if (fits(it->second)) {
      last_ = it->second;
      return at(last_);
    }
  }
  return nullptr;
}

uint8_t* MappedMemory::view(uint64_t addr, uint32_t len, bool write) {
  uint8_t* p = translate(addr, len, write);
  if (p) ++direct_;
  return p;
}

size_t MappedMemory::access(std::span<const nic::Access> a, bool write) {
  // Runs of accesses no region covers go to the fallback in one call, in order with the rest.
  size_t run = 0;  // where the pending run starts in a
  pending_.clear();
  auto flush = [&]() -> bool {
    if (pending_.empty()) return true;
    to_fallback_ += pending_.size();
    const size_t n = write ? fallback_->write(pending_) : fallback_->read(pending_);
    const bool all = n == pending_.size();
    run += n;
    pending_.clear();
    return all;
  };
  for (size_t i = 0; i < a.size(); ++i) {
    uint8_t* p = translate(a[i].addr, a[i].len, write);
    if (!p) {
      if (!fallback_) return i;
      if (pending_.empty()) run = i;
      pending_.push_back(a[i]);
      continue;
    }
    if (!flush()) return run;
    ++direct_;
    const nic::Access x{reinterpret_cast<uintptr_t>(p), a[i].local, a[i].len};
    write ? copy_.write({&x, 1}) : copy_.read({&x, 1});
  }
  return flush() ? a.size() : run;
}

}  // namespace metaroce::engine
