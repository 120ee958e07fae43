// SPDX-License-Identifier: Apache-2.0
// A tiny test-and-set lock for the producer and consumer ends of the NIC's rings.
#pragma once

#include <atomic>

namespace metaroce::nic {

// Held for a few stores only: cheaper than a mutex, and never sleeps.
class SpinLock {
 public:
  void lock() {
    while (flag_.test_and_set(std::memory_order_acquire)) {
      while (flag_.test(std::memory_order_relaxed)) __builtin_ia32_pause();
    }
  }
  void unlock() { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag flag_ = ATOMIC_FLAG_INIT;
};

}  // namespace metaroce::nic
