// SPDX-License-Identifier: Apache-2.0
// Per-path and per-connection telemetry of the transport, for `metaroce stat` and tests; read
// outside the packet path (it allocates).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "datapath/transport/engine.h"
#include "datapath/wire/mrh.h"

namespace metaroce::transport {

// Service state of a sending path (docs/spec/congestion.md §4).
enum class PathState : uint8_t {
  kActive = 0,   // carries data
  kFailed = 1,   // declared failed; its packets moved to other paths, a probe is due
  kProbing = 2,  // a probe under a fresh UDP source port is out; back in service when answered
};

const char* to_string(PathState s);

struct PathStats {
  uint16_t path_id = 0;
  uint16_t udp_src_port = 0;    // current entropy (changes when the path is re-probed)
  uint8_t plane = 0;
  PathState state = PathState::kActive;
  // Sender side of the path.
  uint64_t tx_packets = 0, tx_bytes = 0, retransmits = 0, timeouts = 0, acks_received = 0;
  uint64_t ecn_ce_echoed = 0;   // CE marks the peer reported for this path
  uint64_t sack_gaps = 0;       // packets found missing by SACK and resent
  uint64_t late_losses = 0;     // packets found lost by time, a later one delivered
  uint64_t failures = 0;        // times declared failed
  uint64_t probes = 0;          // PROBE packets sent
  uint32_t next_seq = 0, ack_floor = 0, in_flight = 0;
  uint32_t window = 0;          // congestion window, packets
  int64_t srtt_ns = 0;          // 0 until the first sample
  int64_t min_rtt_ns = 0;       // smallest sample, 0 until the first
  int64_t rto_ns = 0;           // current, including back-off
  uint64_t in_flight_bytes = 0; // payload of the unresolved packets
  bool plane_down = false;      // its plane is down: it carries nothing meanwhile
  // Receiver side (the newest direction from the peer), zero when none.
  uint64_t rx_packets = 0, rx_bytes = 0, duplicates = 0, ecn_ce_received = 0;
  uint32_t rx_cum = 0;
};

struct ConnStats {
  bool exists = false;
  // Sender side.
  uint32_t window = 0;          // connection congestion window, packets
  uint32_t in_flight = 0;       // unresolved packets (including ones waiting to fail over)
  uint32_t records = 0;         // in-flight records allocated: the most it ever had in flight
  uint32_t rate_hint_mbps = 0;  // the peer's fair-share hint in force (we pace to it), 0 = none
  uint32_t paths_active = 0;
  uint32_t conn_id = 0;         // our direction's id on the wire
  uint16_t num_paths = 0;       // in use (LaneProfile::num_paths)
  uint32_t plane_mask = 0;      // in use
  bool rate_hints = true;
  // Receiver side: what we measured from and granted to this peer.
  uint32_t rx_rate_mbps = 0;
  uint32_t rx_hint_mbps = 0;
};

// One entry per path of the connection to peer_ip; empty when there is none, or when engine
// was not made by Engine::create.
std::vector<PathStats> path_stats(const Engine& engine, uint32_t peer_ip, uint32_t lane = 0);

// The connection to peer_ip; exists == false when there is none.
ConnStats conn_stats(const Engine& engine, uint32_t peer_ip, uint32_t lane = 0);

// The lanes of every connection to peer_ip, lane 0 first (when it exists).
std::vector<uint32_t> lanes(const Engine& engine, uint32_t peer_ip);

// Drops by wire decode reason (index: wire::DecodeError), finer than EngineStats.
std::array<uint64_t, static_cast<size_t>(wire::DecodeError::kCount)> decode_drops(
    const Engine& engine);

}  // namespace metaroce::transport
