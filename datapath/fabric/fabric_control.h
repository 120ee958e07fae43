// SPDX-License-Identifier: Apache-2.0
// How a running fabric is found and driven: its state folder and memif socket names, the
// one-line control protocol (shared by the runner and `metaroce fabric`), and the commands
// applied to a Fabric core. No DPDK here, so the CLI and the unit tests use it directly.
//
// State folder $METAROCE_RUNDIR/fabric/NAME/: `pid`, `fabric.conf` (key=value: endpoints, planes,
// links_per_plane, socket_prefix), `control` (unix stream socket). A request is one line; the
// reply starts with "ok" or "error: REASON" on its own line, then the body, then EOF.
//   stat [json]                          per-link counters
//   set PLANE LINK SETTING...            PLANE: N or *; LINK: * or coreN, edgeN, N (= coreN)
//                                        SETTING: loss=P delay=USEC rate=R reorder=P dup=P
//                                        ecn=BYTES queue=BYTES down up
//   stop                                 the runner exits cleanly
// The DPDK runner alone also answers `ports` (memif state per port) and `trace INTERVAL_US FILE`
// / `trace off` (per-link counters sampled over time into FILE; see fabric_runner.cc).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "datapath/fabric/fabric.h"

namespace metaroce::fabric {

inline constexpr const char* kControlSocket = "control";
inline constexpr const char* kPidFile = "pid";
inline constexpr const char* kInfoFile = "fabric.conf";

// Fabric names: 1..32 characters from [A-Za-z0-9_-] (they become part of memif socket names).
inline constexpr size_t kMaxFabricNameLen = 32;
bool check_fabric_name(const std::string& name, std::string* err);

// memif socket (abstract namespace) of endpoint e on plane p of fabric `name`.
std::string socket_name(const std::string& name, uint32_t endpoint, uint32_t plane);
// $rundir/fabric/NAME
std::string state_dir(const std::string& rundir, const std::string& name);
// A probability written as a decimal in [0, 1] (loss=, reorder=, dup=, and the CLI's --loss,
// --reorder, --duplicate).
bool parse_probability(const std::string& s, double* out);

// What fabric.conf records.
struct FabricInfo {
  uint32_t endpoints = 0;
  uint32_t planes = 0;
  uint32_t links_per_plane = 0;
  pid_t pid = 0;  // from the pid file; 0 when absent
};
std::optional<FabricInfo> read_info(const std::string& rundir, const std::string& name,
                                    std::string* err);
bool write_info(const std::string& dir, const FabricInfo& info, std::string* err);

// Sends one request line, returns the whole reply; nullopt and *err when nobody answers.
std::optional<std::string> control_request(const std::string& rundir, const std::string& name,
                                           const std::string& line, std::string* err,
                                           std::chrono::milliseconds timeout =
                                               std::chrono::milliseconds(3000));

// "100G", "25g", "1.5G", "800M", "10k", "1000000" (bits/s); "0" = unlimited.
std::optional<uint64_t> parse_rate(const std::string& text);
std::string format_rate(uint64_t bps);
// Applies one SETTING (see above) to p; false and *err when malformed or out of range.
bool apply_setting(const std::string& setting, LinkParams* p, std::string* err);

// Runs a control request against the core at time now. Sets *stop for "stop".
std::string handle_request(Fabric& fabric, const std::string& line, Nanos now, bool* stop);
// Every link's counters and settings: a table, or one JSON object.
std::string stats_text(Fabric& fabric, Nanos now);
std::string stats_json(Fabric& fabric, Nanos now);

}  // namespace metaroce::fabric
