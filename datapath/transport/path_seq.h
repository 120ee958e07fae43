// SPDX-License-Identifier: Apache-2.0
// Per-path sequence numbers: 32-bit, wrapping, compared by signed distance (spec §3.1).
#pragma once

#include <cstdint>

namespace metaroce::transport {

// Signed distance b - a, valid while the two are less than 2^31 apart (windows are 256).
inline constexpr int32_t seq_diff(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(b - a);
}
inline constexpr bool seq_lt(uint32_t a, uint32_t b) { return seq_diff(a, b) > 0; }
inline constexpr bool seq_le(uint32_t a, uint32_t b) { return seq_diff(a, b) >= 0; }

// Transmission order on a path (16 bits, wrapping): the records compared are at most a SACK
// span of sequences and their resends apart, far below 2^15.
inline constexpr bool order_lt(uint16_t a, uint16_t b) {
  return static_cast<int16_t>(static_cast<uint16_t>(b - a)) > 0;
}

static_assert(seq_lt(0xffffffffu, 0u), "sequence comparison must survive the wrap");
static_assert(order_lt(0xffff, 0) && !order_lt(3, 3));
static_assert(!seq_lt(5u, 5u) && seq_le(5u, 5u));

}  // namespace metaroce::transport
