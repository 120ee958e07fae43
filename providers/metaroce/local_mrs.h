// SPDX-License-Identifier: Apache-2.0
// The regions a context registered at their own addresses, by lkey: what lets post_send copy a
// small message's bytes into its WQE at post time (verbs-mapping.md §1, "Small messages"), so
// that the engine sends them without reading the application's memory.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <shared_mutex>
#include <unordered_map>

namespace metaroce::provider {

class LocalMrs {
 public:
  // A region at [addr, addr + length) of the process's own addresses (not an IOVA, not
  // on-demand): nothing else is ever copied from.
  void add(uint32_t lkey, uint64_t addr, uint64_t length) noexcept {
    std::unique_lock lock(mu_);
    try {
      map_[lkey] = {addr, length};
    } catch (...) {  // not known here: its messages go the engine's way
    }
  }
  void remove(uint32_t lkey) noexcept {
    std::unique_lock lock(mu_);
    map_.erase(lkey);
  }
  // Whether every SGE lies whole inside a known region under its own lkey.
  bool covers(const ibv_sge* sg, int n) const noexcept {
    std::shared_lock lock(mu_);
    for (int i = 0; i < n; ++i) {
      auto it = map_.find(sg[i].lkey);
      if (it == map_.end()) return false;
      const auto [addr, length] = it->second;
      if (sg[i].addr < addr || sg[i].length > length || sg[i].addr - addr > length - sg[i].length)
        return false;
    }
    return true;
  }

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<uint32_t, std::pair<uint64_t, uint64_t>> map_;
};

}  // namespace metaroce::provider
