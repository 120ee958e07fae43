// SPDX-License-Identifier: Apache-2.0
// Completion ring between the progress thread and the application.
#include "datapath/nic/completion_queue.h"

#include <bit>

namespace metaroce::nic {

CompletionQueue::CompletionQueue(uint32_t cqe)
    : ring_(std::bit_ceil(cqe + 1)), mask_(static_cast<uint32_t>(ring_.size()) - 1),
      capacity_(static_cast<uint32_t>(ring_.size()) - 1) {}

bool CompletionQueue::push(const Cqe& cqe) {
  uint32_t head = head_.load(std::memory_order_relaxed);
  if (head - tail_.load(std::memory_order_acquire) >= capacity_) {
    overflowed_.store(true, std::memory_order_relaxed);
    return false;
  }
  ring_[head & mask_] = cqe;
  head_.store(head + 1, std::memory_order_release);
  return true;
}

int CompletionQueue::poll(int n, Cqe* out) {
  // Cheap empty check without the lock: pollers spin here.
  if (head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_relaxed)) return 0;
  std::lock_guard lock(consumer_mu_);
  uint32_t tail = tail_.load(std::memory_order_relaxed);
  uint32_t head = head_.load(std::memory_order_acquire);
  int got = 0;
  while (got < n && tail != head) {
    out[got++] = ring_[tail & mask_];
    ++tail;
  }
  tail_.store(tail, std::memory_order_release);
  return got;
}

}  // namespace metaroce::nic
