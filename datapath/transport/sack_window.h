// SPDX-License-Identifier: Apache-2.0
// Receiver side of one path: the cumulative sequence and which of the next 256 sequences have
// arrived (spec §5.1). Small, allocation-free, and shared with the simulator.
#pragma once

#include <array>
#include <bit>
#include <cstdint>

#include "datapath/transport/path_seq.h"

namespace metaroce::transport {

class SackWindow {
 public:
  static constexpr uint32_t kSpan = 256;  // sequences cum+1 .. cum+kSpan can be held

  enum class Check : uint8_t { kNew, kDuplicate, kOutOfWindow };

  // First sequence not yet received; everything below it was.
  uint32_t cum() const { return cum_; }

  Check check(uint32_t seq) const {
    const int32_t off = seq_diff(cum_, seq);
    if (off < 0) return Check::kDuplicate;
    if (off > static_cast<int32_t>(kSpan)) return Check::kOutOfWindow;
    return test(static_cast<uint32_t>(off)) ? Check::kDuplicate : Check::kNew;
  }

  // Records seq; the caller has checked it is kNew (anything else is ignored).
  void mark(uint32_t seq) {
    const uint32_t off = seq - cum_;
    if (off > kSpan) return;
    // In order with nothing ahead, as a path's packets almost always are: the window only moves.
    if (off == 0 && (bits_[0] | bits_[1] | bits_[2] | bits_[3] | bits_[4]) == 0) {
      ++cum_;
      return;
    }
    bits_[off / 64] |= uint64_t{1} << (off % 64);
    normalize();
  }

  // The sender has resolved everything below floor: treat it as received.
  void advance_to(uint32_t floor) {
    const int32_t off = seq_diff(cum_, floor);
    if (off <= 0) return;
    shift_right(static_cast<uint32_t>(off));
    cum_ = floor;
    normalize();
  }

  // The wire SACK: bit i of word i/64 set when cum + 1 + i was received.
  std::array<uint64_t, 4> sack() const {
    std::array<uint64_t, 4> out{};
    for (int w = 0; w < 4; ++w) out[w] = (bits_[w] >> 1) | (bits_[w + 1] << 63);
    return out;
  }

 private:
  static constexpr int kWords = 5;  // bit i <-> cum_ + i for i in [0, 256]; bit 0 is always 0

  bool test(uint32_t off) const { return (bits_[off / 64] >> (off % 64)) & 1; }

  void shift_right(uint32_t n) {
    if (n >= kWords * 64) {
      bits_.fill(0);
      return;
    }
    const uint32_t words = n / 64, bits = n % 64;
    for (int i = 0; i < kWords; ++i) {
      const int src = i + static_cast<int>(words);
      uint64_t v = src < kWords ? bits_[src] >> bits : 0;
      if (bits && src + 1 < kWords) v |= bits_[src + 1] << (64 - bits);
      bits_[i] = v;
    }
  }

  // Slides the window over the run of received sequences starting at cum_.
  void normalize() {
    uint32_t run = 0;
    for (int i = 0; i < kWords; ++i) {
      const int ones = std::countr_one(bits_[i]);
      run += static_cast<uint32_t>(ones);
      if (ones < 64) break;
    }
    if (run) {
      shift_right(run);
      cum_ += run;
    }
  }

  uint32_t cum_ = 0;
  std::array<uint64_t, kWords> bits_{};
};

}  // namespace metaroce::transport
