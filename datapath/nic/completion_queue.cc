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
  // Pairs with the fence in arm(): either we see the CQ armed or arm() sees this completion.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (armed_.load(std::memory_order_relaxed)) fire();
  return true;
}

void CompletionQueue::set_notifier(void (*fn)(void*), void* arg) {
  notify_fn_ = fn;
  notify_arg_ = arg;
}

void CompletionQueue::fire() {
  if (armed_.exchange(false, std::memory_order_acq_rel) && notify_fn_) notify_fn_(notify_arg_);
}

void CompletionQueue::arm(bool /*solicited_only*/) {
  // Solicited-only arming is treated as arming for any completion: the NIC does not track the
  // solicited bit, and an extra event only costs the application one empty poll.
  armed_.store(true, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (head_.load(std::memory_order_relaxed) != tail_.load(std::memory_order_relaxed)) fire();
}

int CompletionQueue::poll(int n, Cqe* out) {
  // Cheap empty check without the lock: pollers spin here.
  if (head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_relaxed)) {
    if (!idle_fn_) return 0;
    idle_fn_(idle_arg_);
    if (head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_relaxed)) return 0;
  }
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
