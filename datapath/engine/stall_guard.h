// SPDX-License-Identifier: Apache-2.0
// The engine's own stalls are not its peers' silence (docs/design.md, "The engine's own
// stalls"). A pass that begins more than `limit` after the previous one follows a stall of the
// datapath thread (descheduled, a long command, a paused VM): the transport's timers wait until
// a pass finds nothing to do, or kPasses passes, so that what arrived meanwhile is read first.
#pragma once

#include <algorithm>
#include <cstdint>

#include "datapath/transport/engine.h"

namespace metaroce::engine {

class StallGuard {
 public:
  static constexpr int kPasses = 16;
  using Time = transport::Time;

  // limit 0: never.
  StallGuard(Time limit, Time start) : limit_(limit), last_(start) {}

  // A pass begins at t: true when it may fire timers.
  bool begin(Time t) {
    if (limit_ > Time::zero() && t - last_ > limit_) {
      catch_up_ = kPasses;
      ++stalls_;
    }
    last_ = t;
    if (catch_up_ == 0) return true;
    --catch_up_;
    return false;
  }
  // The pass found nothing to do: nothing came in that the timers should see first.
  void quiet() { catch_up_ = 0; }
  // Back from a nap it meant to end at `meant` (the pass that began it, if none): a nap is no
  // stall, waking later than it asked is.
  void napped(Time meant, Time now) { last_ = std::min(meant, now); }
  uint64_t stalls() const { return stalls_; }

 private:
  Time limit_;
  Time last_;
  int catch_up_ = 0;
  uint64_t stalls_ = 0;
};

}  // namespace metaroce::engine
