// SPDX-License-Identifier: Apache-2.0
// Live counters the engine publishes per link for `metaroce stat`: a versioned block of plain
// data in a file under <run dir>/stat/<link>.<engine pid>, mapped shared and updated under a
// sequence lock. The layout is this header; readers never link the datapath.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace metaroce::nic {

inline constexpr uint32_t kTelemetryMagic = 0x5453524d;  // "MRST"
inline constexpr uint32_t kTelemetryVersion = 3;  // 3: lanes (a connection per lane)
inline constexpr uint32_t kTelemetryConns = 64;     // connections shown per device
inline constexpr uint32_t kTelemetryPaths = 64;     // paths shown per connection
inline constexpr uint32_t kTelemetryCounters = 64;  // named device counters
inline constexpr uint32_t kTelemetryStreams = 64;   // streams (QPs) shown per connection

struct TelemetryPath {
  uint16_t path_id;
  uint16_t udp_src_port;  // current entropy
  uint8_t plane;
  uint8_t state;          // 0 active, 1 failed, 2 probing (transport::PathState), 3 its
                          // plane is down
  uint16_t reserved;
  uint32_t window;        // packets
  uint32_t in_flight;
  uint64_t tx_packets, tx_bytes, retransmits, timeouts, ecn_ce_echoed, sack_gaps, failures;
  uint64_t rx_packets, rx_bytes, duplicates, ecn_ce_received;
  int64_t srtt_ns;
  int64_t rto_ns;
};

// A QP of this device that is a stream of the connection.
struct TelemetryStream {
  uint32_t qpn;
  uint32_t remote_qpn;
  uint32_t pid;    // of the process that owns it
  uint8_t state;   // hostif::QpState
  uint8_t type;    // hostif::QpType
  uint16_t reserved;
};

struct TelemetryConn {
  uint32_t peer_ip;       // host byte order
  uint32_t num_paths;
  uint32_t window, in_flight, rate_hint_mbps, rx_rate_mbps, rx_hint_mbps, paths_active;
  uint32_t num_streams;   // QPs to the peer on this lane (may exceed kTelemetryStreams)
  uint32_t lane;          // wire.md §3.4: 0 the shared connection of default QPs
  uint32_t plane_mask;
  uint32_t reserved;
  TelemetryPath paths[kTelemetryPaths];
  TelemetryStream streams[kTelemetryStreams];
};

inline constexpr uint8_t kTelemetryPlaneDown = 3;

struct TelemetryCounter {
  char name[40];
  uint64_t value;
};

struct TelemetryBlock {
  uint32_t magic;
  uint32_t version;
  uint32_t pid;
  uint32_t planes;
  std::atomic<uint64_t> seq;   // odd while the writer is updating
  int64_t updated_unix_ns;
  char link[64];
  uint32_t num_counters;
  uint32_t num_conns;
  TelemetryCounter counters[kTelemetryCounters];
  TelemetryConn conns[kTelemetryConns];
};

// A consistent copy of one block.
struct TelemetrySnapshot {
  std::string file;
  uint32_t pid = 0;
  uint32_t planes = 0;
  int64_t updated_unix_ns = 0;
  std::vector<TelemetryCounter> counters;
  std::vector<TelemetryConn> conns;
};

// The stat directory of a run dir.
std::string telemetry_dir(const std::string& run_dir);

// Reads every live block of `link` in run_dir (files of exited processes are removed).
// Returns nullopt and *err when the directory cannot be read.
std::optional<std::vector<TelemetrySnapshot>> read_telemetry(const std::string& run_dir,
                                                             const std::string& link,
                                                             std::string* err);

}  // namespace metaroce::nic
