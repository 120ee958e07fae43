// SPDX-License-Identifier: Apache-2.0
// The NIC's memory accesses of one pass, collected and carried out together: one read or write
// call per address space per pass instead of one per packet (a process_vm_writev costs more than
// copying a 4 KiB packet on these machines; docs/design.md, "Application memory").
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "datapath/nic/memory.h"

namespace metaroce::nic {

class AccessBatch {
 public:
  // Queues an access; `origin` is what the failure callback names if it cannot be done.
  void add(Memory* m, const Access& a, uint32_t origin) {
    if (!pending_.empty() && pending_.back().mem != m) mixed_ = true;
    pending_.push_back({m, a, origin});
  }

  // A write that lands in ascending address order at 8-byte granularity when it is small
  // (kOrderedMax): NCCL announces buffers with a small WRITE whose sequence number sits mid-slot
  // and spins on it, trusting the bytes below it to be there already, as a hardware NIC's
  // in-order PCIe writes guarantee. Each 8-byte piece is its own access: the kernel copies
  // vectors in order.
  void add_write(Memory* m, uint64_t addr, const uint8_t* src, uint32_t len, uint32_t origin) {
    if (len <= 8 || len > kOrderedMax) {
      add(m, {addr, const_cast<uint8_t*>(src), len}, origin);
      return;
    }
    for (uint32_t off = 0; off < len; off += 8)
      add(m, {addr + off, const_cast<uint8_t*>(src) + off, std::min<uint32_t>(8, len - off)},
          origin);
  }

  bool empty() const { return pending_.empty(); }

  // Carries out every queued access as reads (read=true) or writes, grouped by address space and
  // in queueing order within one; calls fail(origin, local, memory) for each access that failed.
  template <typename Fail>
  void flush(bool read, Fail&& fail) {
    if (pending_.empty()) return;
    // Usually one address space per pass: grouping is needed only when several were reached.
    if (mixed_)
      std::stable_sort(pending_.begin(), pending_.end(),
                       [](const Item& a, const Item& b) { return a.mem < b.mem; });
    mixed_ = false;
    scratch_.clear();
    size_t i = 0;
    while (i < pending_.size()) {
      size_t j = i;
      scratch_.clear();
      while (j < pending_.size() && pending_[j].mem == pending_[i].mem) scratch_.push_back(pending_[j++].a);
      Memory* m = pending_[i].mem;
      size_t done = 0;
      while (done < scratch_.size()) {
        std::span<const Access> rest(scratch_.data() + done, scratch_.size() - done);
        const size_t n = read ? m->read(rest) : m->write(rest);
        done += n;
        if (done < scratch_.size()) {
          fail(pending_[i + done].origin, pending_[i + done].a.local, m);
          ++done;  // skip the one that failed; the rest may still be fine
        }
      }
      i = j;
    }
    pending_.clear();
  }

 private:
  struct Item {
    Memory* mem;
    Access a;
    uint32_t origin;
  };
  std::vector<Item> pending_;
  std::vector<Access> scratch_;
  bool mixed_ = false;  // pending_ holds accesses of more than one address space
};

}  // namespace metaroce::nic
