// SPDX-License-Identifier: Apache-2.0
// Small helpers the transport's files share (engine_impl.h's EngineImpl is spread over
// engine_impl.cc, engine_send.cc, engine_receive.cc and engine_recovery.cc). Internal.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "datapath/transport/engine_impl.h"

namespace metaroce::transport {

inline uint32_t ts32(Time t) { return static_cast<uint32_t>(t.count()); }

inline bool sack_bit(const std::array<uint64_t, 4>& sack, uint32_t i) {
  return i < wire::kSackBits && ((sack[i / 64] >> (i % 64)) & 1);
}

inline uint32_t window_packets(uint32_t w) { return std::max<uint32_t>(1, w / kWinUnit); }

inline uint32_t all_planes(uint8_t n) { return n >= 32 ? UINT32_MAX : (1u << n) - 1; }

// Path p of a connection uses the (p mod n)-th of the n planes in its mask (congestion.md §4.7).
inline uint8_t plane_for(uint32_t mask, uint8_t n, uint16_t p) {
  uint32_t k = p % n;
  for (uint8_t b = 0; b < 32; ++b) {
    if (!((mask >> b) & 1)) continue;
    if (k-- == 0) return b;
  }
  return 0;
}

}  // namespace metaroce::transport
