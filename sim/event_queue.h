// SPDX-License-Identifier: Apache-2.0
// The simulator's clock and its one event queue: integer nanoseconds, events of equal time in
// the order they were scheduled, so that a run is a function of its seed alone.
#pragma once

#include <cstdint>
#include <functional>
#include <queue>
#include <vector>

namespace metaroce::sim {

using Ns = int64_t;

class EventQueue {
 public:
  void at(Ns t, std::function<void()> fn) { heap_.push({t < now_ ? now_ : t, seq_++, std::move(fn)}); }
  Ns now() const { return now_; }
  // Runs events up to and including `until`, or until an event calls stop(); false when none is
  // left.
  bool run_until(Ns until) {
    while (!stopped_ && !heap_.empty() && heap_.top().t <= until) {
      Event e = std::move(const_cast<Event&>(heap_.top()));
      heap_.pop();
      now_ = e.t;
      ++executed_;
      e.fn();
    }
    if (stopped_) return !heap_.empty();
    if (now_ < until && heap_.empty()) return false;
    now_ = std::max(now_, until);
    return !heap_.empty();
  }
  // Ends run_until after the event that calls it (a run that ends before its queue drains).
  void stop() { stopped_ = true; }
  bool empty() const { return heap_.empty(); }
  uint64_t executed() const { return executed_; }

 private:
  struct Event {
    Ns t;
    uint64_t seq;
    std::function<void()> fn;
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.t != b.t ? a.t > b.t : a.seq > b.seq;
    }
  };
  std::priority_queue<Event, std::vector<Event>, Later> heap_;
  Ns now_ = 0;
  uint64_t seq_ = 0;
  uint64_t executed_ = 0;
  bool stopped_ = false;
};

// splitmix64: the simulator's only randomness (loss, ECMP seeds, permutations).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t s_;
};

}  // namespace metaroce::sim
