// SPDX-License-Identifier: Apache-2.0
// The fabric emulator's idle policy: what its polling thread does after a pass that moved no
// frame. It uses the host engine's words (metaroced(8): --spin adaptive|always, --spin-us) and
// is a function of the times it is handed, so the unit tests drive it without a clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "datapath/fabric/fabric.h"

namespace metaroce::fabric {

enum class SpinPolicy : uint8_t {
  kAdaptive,  // poll spin_before_sleep after the last frame, then nap longer each empty pass
  kAlways,    // never sleep (sched_yield between passes): lowest latency, a whole core
};

// Limits of the options (the CLI's ranges; validate() checks them).
inline constexpr Nanos kMaxSpinBeforeSleep = std::chrono::seconds(1);
inline constexpr Nanos kMaxNapLimit = std::chrono::seconds(1);

struct IdlePolicy {
  SpinPolicy spin = SpinPolicy::kAdaptive;
  // adaptive only. The policy before it could be chosen polled for 64 empty passes, which took
  // 90-530 µs (median 160 µs) on a loaded 2-core host: 100 µs is near the low end of that.
  Nanos spin_before_sleep = std::chrono::microseconds(100);
  // adaptive only: the longest nap. A napping fabric sees arriving frames only when it wakes
  // (memif has no receive interrupt in DPDK 22.11), so this bounds how late a frame is forwarded.
  Nanos max_nap = std::chrono::milliseconds(1);

  // Empty when usable, else the reason.
  std::string validate() const;
};

// "adaptive" or "always"; nullopt for anything else.
std::optional<SpinPolicy> parse_spin_policy(const std::string& text);
const char* spin_policy_name(SpinPolicy spin);

// Where the polling loop stands after a pass that moved nothing.
struct IdleState {
  Nanos idle_for{0};                  // since the last pass that moved a frame
  uint32_t empty_passes = 0;          // passes since then, this one included
  std::optional<Nanos> until_event;   // the core's next timed event (queued or delayed frame)
  std::optional<Nanos> until_sample;  // the trace's next sample, when a trace runs
};

// How long to sleep before the next pass; zero: sched_yield and poll again.
Nanos idle_wait(const IdlePolicy& policy, const IdleState& state);

}  // namespace metaroce::fabric
