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
  void set_notifier(void (*fn)(void* arg), void* arg) override;
  void arm(bool solicited_only) override;

  // Called by poll() on an empty queue: the device runs its engine on the caller's thread
  // when nobody else is (an application spinning on its CQ lends the NIC its cycles).
  void set_idle_hook(void (*fn)(void* arg), void* arg) {
    idle_fn_ = fn;
    idle_arg_ = arg;
  }

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
  std::atomic<bool> armed_{false};
  void (*idle_fn_)(void*) = nullptr;
  void* idle_arg_ = nullptr;
  void (*notify_fn_)(void*) = nullptr;
  void* notify_arg_ = nullptr;
  void fire();
};

}  // namespace metaroce::nic
