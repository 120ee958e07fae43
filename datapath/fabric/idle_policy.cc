// SPDX-License-Identifier: Apache-2.0
// The fabric emulator's idle policy (idle_policy.h): spin, then nap, never past a due event or
// trace sample.
#include "datapath/fabric/idle_policy.h"

#include <algorithm>

namespace metaroce::fabric {
namespace {

using std::chrono::microseconds;

// A timed frame this close is polled for rather than slept for: a wake-up from a nap of this
// order arrives late by about its margin (timer slack, scheduling) anyway.
constexpr Nanos kNearEvent = microseconds(200);
// A nap towards a timed frame ends this much before it is due.
constexpr Nanos kWakeMargin = microseconds(100);
// Each nap past the spin phase is this much longer than the one before: a ping-pong's next
// frame is near and its naps stay short, a quiet fabric ends up polled once per max_nap.
constexpr Nanos kNapGrowth = microseconds(1);

}  // namespace

std::string IdlePolicy::validate() const {
  if (spin_before_sleep < Nanos::zero() || spin_before_sleep > kMaxSpinBeforeSleep)
    return "spin before sleep must be 0..1000000 microseconds";
  if (max_nap < microseconds(1) || max_nap > kMaxNapLimit)
    return "longest nap must be 1..1000000 microseconds";
  return "";
}

std::optional<SpinPolicy> parse_spin_policy(const std::string& text) {
  if (text == "adaptive") return SpinPolicy::kAdaptive;
  if (text == "always") return SpinPolicy::kAlways;
  return std::nullopt;
}

const char* spin_policy_name(SpinPolicy spin) {
  return spin == SpinPolicy::kAlways ? "always" : "adaptive";
}

Nanos idle_wait(const IdlePolicy& policy, const IdleState& state) {
  if (policy.spin == SpinPolicy::kAlways) return Nanos::zero();
  if (state.idle_for < policy.spin_before_sleep) return Nanos::zero();
  // A trace sample is due no later than its interval: naps never overshoot it.
  Nanos limit = policy.max_nap;
  if (state.until_sample) limit = std::clamp(*state.until_sample, Nanos::zero(), limit);
  if (state.until_event) {
    if (*state.until_event <= kNearEvent) return Nanos::zero();
    return std::min(*state.until_event - kWakeMargin, limit);
  }
  return std::min<Nanos>(kNapGrowth * state.empty_passes, limit);
}

}  // namespace metaroce::fabric
