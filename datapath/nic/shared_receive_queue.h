// SPDX-License-Identifier: Apache-2.0
// A shared receive queue: entries the application posts and that QPs attached to it claim, in
// posting order, when a message needs one (docs/spec/verbs-mapping.md §6).
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "datapath/nic/device.h"
#include "datapath/nic/spin_lock.h"

namespace metaroce::nic {

class SharedReceiveQueue final : public Srq {
 public:
  SharedReceiveQueue(uint32_t pd, uint32_t max_wr, uint32_t max_sge);

  // Provider side (application threads).
  int post_recv(const RecvWqe& wqe) override;
  void set_limit(uint32_t limit) override { limit_.store(limit, std::memory_order_release); }
  uint32_t limit() const override { return limit_.load(std::memory_order_acquire); }
  void set_limit_notifier(void (*fn)(void* arg), void* arg) override;

  // Progress thread side. Takes the oldest posted entry for a QP: its slot, which stays valid
  // (and out of the queue) until release(); false when nothing is posted.
  bool claim(uint32_t* slot);
  const RecvWqe& entry(uint32_t slot) const { return slots_[slot]; }
  void release(uint32_t slot);
  uint32_t posted() const;  // entries waiting to be claimed

  uint32_t pd() const { return pd_; }
  uint32_t max_sge() const { return max_sge_; }
  uint32_t users = 0;  // QPs attached (guarded by the device lock)

 private:
  const uint32_t pd_;
  const uint32_t max_sge_;
  std::vector<RecvWqe> slots_;     // max_wr entries, posted or claimed or free
  std::vector<uint32_t> free_;     // stack of free slots
  std::vector<uint32_t> fifo_;     // posted slots in posting order (a ring)
  uint32_t mask_;
  uint32_t head_ = 0;              // next fifo position the provider fills
  uint32_t tail_ = 0;              // next fifo position a QP claims
  mutable SpinLock lock_;
  std::atomic<uint32_t> limit_{0};
  void (*notify_fn_)(void*) = nullptr;
  void* notify_arg_ = nullptr;
};

}  // namespace metaroce::nic
