// SPDX-License-Identifier: Apache-2.0
// Per-path telemetry of one connection, for `metaroce stat` and tests; read outside the packet
// path (it allocates).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "datapath/transport/engine.h"
#include "datapath/wire/mrh.h"

namespace metaroce::transport {

struct PathStats {
  uint16_t path_id = 0;
  uint16_t udp_src_port = 0;
  uint8_t plane = 0;
  // Sender side of the path.
  uint64_t tx_packets = 0, tx_bytes = 0, retransmits = 0, timeouts = 0, acks_received = 0;
  uint64_t ecn_ce_echoed = 0;   // CE marks the peer reported for this path
  uint32_t next_seq = 0, ack_floor = 0, in_flight = 0;
  int64_t srtt_ns = 0;          // 0 until the first sample
  int64_t rto_ns = 0;           // current, including back-off
  // Receiver side (the newest direction from the peer), zero when none.
  uint64_t rx_packets = 0, rx_bytes = 0, duplicates = 0, ecn_ce_received = 0;
  uint32_t rx_cum = 0;
};

// One entry per path of the connection to peer_ip; empty when there is none, or when engine
// was not made by Engine::create.
std::vector<PathStats> path_stats(const Engine& engine, uint32_t peer_ip);

// Drops by wire decode reason (index: wire::DecodeError), finer than EngineStats.
std::array<uint64_t, static_cast<size_t>(wire::DecodeError::kCount)> decode_drops(
    const Engine& engine);

}  // namespace metaroce::transport
