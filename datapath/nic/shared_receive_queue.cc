// SPDX-License-Identifier: Apache-2.0
// Shared receive queue: claiming in posting order, returning slots, and the limit event.
#include "datapath/nic/shared_receive_queue.h"

namespace metaroce::nic {

SharedReceiveQueue::SharedReceiveQueue(uint32_t id, Owner* owner, uint32_t pd,
                                       hostif::SrqHeader* ring, uint64_t handle, uint32_t xrcd,
                                       CompletionQueue* cq, uint32_t max_tags)
    : id_(id), owner_(owner), pd_(pd), ring_(ring), handle_(handle), xrcd_(xrcd), cq_(cq),
      slots_(hostif::srq_slot(ring, 0)), posted_(hostif::srq_posted_ring(ring)),
      free_(hostif::srq_free_ring(ring)), mask_(ring->entries - 1), stride_(ring->stride),
      max_wr_(ring->max_wr), max_sge_(ring->max_sge), free_head_(ring->free_head.peek()),
      held_(ring->max_wr, false),
      tags_(max_tags ? std::make_unique<TagMatcher>(max_tags) : nullptr) {}

bool SharedReceiveQueue::claim(uint32_t* slot, bool* limit_hit) {
  *limit_hit = false;
  const uint32_t head = ring_->posted_head.load();
  for (;;) {
    // A driver cannot post more than max_wr (it holds no more slots): more is garbage.
    if (tail_ == head || head - tail_ > max_wr_) return false;
    const uint32_t s = posted_[tail_ & mask_];
    ++tail_;
    ring_->posted_tail.store(tail_);
    if (s >= max_wr_ || held_[s]) continue;  // not a slot, or one posted twice: skip it
    held_[s] = true;
    *slot = s;
    break;
  }
  const uint32_t left = head - tail_;
  const uint32_t armed = ring_->limit.peek();
  // One event per arming: whoever clears the limit reports it.
  if (armed != 0 && left < armed) {
    uint32_t expected = armed;
    *limit_hit = ring_->limit.v.compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
  }
  return true;
}

void SharedReceiveQueue::release(uint32_t s) {
  if (s >= max_wr_ || !held_[s]) return;
  held_[s] = false;
  free_[free_head_ & mask_] = s;
  ++free_head_;
  ring_->free_head.store(free_head_);
}

uint32_t SharedReceiveQueue::posted() const {
  const uint32_t n = ring_->posted_head.load() - tail_;
  return n > max_wr_ ? 0 : n;
}

}  // namespace metaroce::nic
