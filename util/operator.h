// SPDX-License-Identifier: Apache-2.0
// The operator's tools of the metaroce command: `capture` (a link's frames as pcap), `export`
// (every link's counters in the Prometheus text format, printed or served over HTTP) and
// `events` (a timestamped log of path failures, recoveries, entropy re-picks and RTOs).
#pragma once

#include <signal.h>

#include <string>
#include <vector>

#include "datapath/nic/telemetry.h"
#include "util/cli.h"

namespace metaroce::util {

// Each returns the exit status; on failure *why holds the one-line reason.
int capture_command(const std::vector<std::string>& args, const Context& ctx, std::string* why);
int export_command(const std::vector<std::string>& args, const Context& ctx, std::string* why);
int events_command(const std::vector<std::string>& args, const Context& ctx, std::string* why);

// Stops at SIGINT/SIGTERM while it lives: requested() turns true (the old handlers come back
// when it goes). One at a time.
class StopOnSignal {
 public:
  StopOnSignal();
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
  static bool requested();

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

// Whether ctx's run dir has a link of that name (a valid name with a readable record).
bool link_exists(const Context& ctx, const std::string& name);
// The most recently published of a link's snapshots, or null.
const nic::TelemetrySnapshot* newest(const std::vector<nic::TelemetrySnapshot>& snaps);

// The Prometheus text exposition of the given links' snapshots (exposed for tests).
std::string prometheus_text(
    const std::vector<std::pair<std::string, std::vector<nic::TelemetrySnapshot>>>& links);

// What changed on the paths between two snapshots of one link, one line per event, each
// starting with the later snapshot's time (exposed for tests).
std::vector<std::string> path_events(const std::string& link, const nic::TelemetrySnapshot& before,
                                     const nic::TelemetrySnapshot& after);

}  // namespace metaroce::util
