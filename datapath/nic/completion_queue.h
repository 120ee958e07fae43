// SPDX-License-Identifier: Apache-2.0
// A completion queue: a ring the progress thread fills and application threads drain, as a
// hardware CQ is a ring the NIC writes and the driver reads.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

#include "datapath/nic/device.h"

namespace metaroce::nic {

class CompletionQueue final : public Cq {
 public:
  explicit CompletionQueue(uint32_t cqe);
  uint32_t capacity() const override { return capacity_; }
  int poll(int n, Cqe* out) override;
  bool overflowed() const override { return overflowed_.load(std::memory_order_relaxed); }

  // Producer side: the progress thread only. Returns false (and records the overflow) when full.
  bool push(const Cqe& cqe);
  uint32_t users = 0;  // QPs using this CQ (guarded by the device lock)

 private:
  std::vector<Cqe> ring_;
  uint32_t mask_;
  uint32_t capacity_;
  alignas(64) std::atomic<uint32_t> head_{0};  // next slot the producer writes
  alignas(64) std::atomic<uint32_t> tail_{0};  // next slot a consumer reads
  std::mutex consumer_mu_;
  std::atomic<bool> overflowed_{false};
};

}  // namespace metaroce::nic
