// SPDX-License-Identifier: Apache-2.0
// Shared receive queue: posting, claiming in posting order, and the limit event.
#include "datapath/nic/shared_receive_queue.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <mutex>

namespace metaroce::nic {

SharedReceiveQueue::SharedReceiveQueue(uint32_t pd, uint32_t max_wr, uint32_t max_sge)
    : pd_(pd), max_sge_(max_sge), slots_(std::max(max_wr, 1u)),
      fifo_(std::bit_ceil(std::max(max_wr, 1u))),
      mask_(static_cast<uint32_t>(fifo_.size()) - 1) {
  free_.reserve(slots_.size());
  for (uint32_t i = static_cast<uint32_t>(slots_.size()); i-- > 0;) free_.push_back(i);
}

int SharedReceiveQueue::post_recv(const RecvWqe& wqe) {
  std::lock_guard lock(lock_);
  if (free_.empty()) return ENOMEM;
  const uint32_t slot = free_.back();
  free_.pop_back();
  RecvWqe& s = slots_[slot];
  s.wr_id = wqe.wr_id;
  s.num_sge = wqe.num_sge;
  std::memcpy(s.sge, wqe.sge, sizeof(Sge) * wqe.num_sge);
  fifo_[head_++ & mask_] = slot;
  return 0;
}

void SharedReceiveQueue::set_limit_notifier(void (*fn)(void* arg), void* arg) {
  std::lock_guard lock(lock_);
  notify_fn_ = fn;
  notify_arg_ = arg;
}

bool SharedReceiveQueue::claim(uint32_t* slot) {
  bool fire = false;
  {
    std::lock_guard lock(lock_);
    if (head_ == tail_) return false;
    *slot = fifo_[tail_++ & mask_];
    const uint32_t left = head_ - tail_;
    uint32_t armed = limit_.load(std::memory_order_relaxed);
    // One event per arming: whoever clears the limit reports it.
    fire = armed != 0 && left < armed &&
           limit_.compare_exchange_strong(armed, 0, std::memory_order_acq_rel);
  }
  if (fire && notify_fn_) notify_fn_(notify_arg_);
  return true;
}

void SharedReceiveQueue::release(uint32_t slot) {
  std::lock_guard lock(lock_);
  free_.push_back(slot);
}

uint32_t SharedReceiveQueue::posted() const {
  std::lock_guard lock(lock_);
  return head_ - tail_;
}

}  // namespace metaroce::nic
