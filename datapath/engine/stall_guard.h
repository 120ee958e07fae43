// SPDX-License-Identifier: Apache-2.0
// The engine's own stalls are not its peers' silence (docs/design.md, "The engine's own
// stalls"). A pass that begins more than `limit` after the previous one follows a stall of the
// datapath thread (descheduled, a long command, a paused VM): the transport's timers wait until
// a pass finds nothing to do, or kPasses passes, so that what arrived meanwhile is read first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

#include "datapath/transport/engine.h"

namespace metaroce::engine {

class StallGuard {
 public:
  static constexpr int kPasses = 16;
  using Time = transport::Time;

  // limit 0: never.
  StallGuard(Time limit, Time start) : limit_(limit), last_(start) {}

  // A pass begins at t: true when it may fire timers. A stall while the timers wait does not
  // make them wait longer, and the pass that ends a wait fires them even if it follows another
  // stall, so they fire at least once every kPasses + 1 passes: on a host that deschedules the
  // engine between any two passes every pass follows a stall, and re-arming the wait at each
  // held the timers as long as passes found work (742 ms once: a lost packet was not resent).
  bool begin(Time t) {
    const bool stalled = limit_ > Time::zero() && t - last_ > limit_;
    stalled_from_ = stalled ? std::optional<Time>(last_) : std::nullopt;
    last_ = t;
    if (stalled) ++stalls_;
    if (stalled && !waiting_) {
      waiting_ = true;
      held_ = 0;
    }
    if (!waiting_) return true;
    if (held_ < kPasses) {
      ++held_;
      return false;
    }
    waiting_ = false;
    return true;
  }
  // The pass found nothing to do: nothing came in that the timers should see first.
  void quiet() { waiting_ = false; }
  // Back from a nap it meant to end at `meant` (the pass that began it, if none): a nap is no
  // stall, waking later than it asked is.
  void napped(Time meant, Time now) { last_ = std::min(meant, now); }
  uint64_t stalls() const { return stalls_; }
  // Where the stall the last begin() found began (it ended there); nullopt: that pass followed
  // no stall.
  std::optional<Time> stalled_from() const { return stalled_from_; }

 private:
  Time limit_;
  Time last_;
  bool waiting_ = false;  // the timers wait for a quiet pass, held_ passes so far
  int held_ = 0;
  uint64_t stalls_ = 0;
  std::optional<Time> stalled_from_;
};

}  // namespace metaroce::engine
