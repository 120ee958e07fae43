// SPDX-License-Identifier: Apache-2.0
// Batched cross-process copies.
#include "datapath/engine/process_memory.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

namespace metaroce::engine {

namespace {
constexpr size_t kIovMax = 1024;  // IOV_MAX on Linux
}

size_t ProcessMemory::transfer(std::span<const nic::Access> a, bool write) {
  if (gone_.load(std::memory_order_acquire)) return 0;
  size_t done = 0;
  while (done < a.size()) {
    const size_t n = std::min(kIovMax, a.size() - done);
    local_.resize(n);
    remote_.resize(n);
    size_t bytes = 0;
    for (size_t i = 0; i < n; ++i) {
      const nic::Access& x = a[done + i];
      local_[i] = {x.local, x.len};
      remote_[i] = {reinterpret_cast<void*>(x.addr), x.len};
      bytes += x.len;
    }
    ssize_t got;
    do {
      ++calls_;
      got = write ? process_vm_writev(pid_, local_.data(), n, remote_.data(), n, 0)
                  : process_vm_readv(pid_, local_.data(), n, remote_.data(), n, 0);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
      // The first one failed (EFAULT), or the process is gone (ESRCH: it exited, and the
      // engine will reclaim its objects as soon as the control thread hears of it).
      if (errno == ESRCH) mark_gone();
      return done;
    }
    if (static_cast<size_t>(got) == bytes) {
      done += n;
      continue;
    }
    // Partial: the kernel stops at the first vector it cannot complete.
    size_t left = static_cast<size_t>(got);
    size_t i = 0;
    while (i < n && left >= a[done + i].len) left -= a[done + i++].len;
    return done + i;
  }
  return done;
}

}  // namespace metaroce::engine
