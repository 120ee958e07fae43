// SPDX-License-Identifier: Apache-2.0
// `metaroce top [NAME...]`: a live view of every connection's paths (rate, RTT
// against the connection's best, ECN-mark and retransmission rates, window,
// state) with the last path events below, refreshed every second; `metaroce top
// --replay FILE` plays back what `metaroce record` wrote. On a terminal it
// redraws in place; otherwise it prints one plain frame per refresh.
#pragma once

#include <string>
#include <vector>

#include "datapath/nic/telemetry.h"
#include "util/cli.h"

namespace metaroce::util {

int top_command(const std::vector<std::string>& args, const Context& ctx, std::string* why);

// One path's figures between two snapshots of its link (exposed for tests).
struct PathRow {
  std::string link;
  uint32_t peer_ip = 0, lane = 0;
  uint16_t path = 0, udp_port = 0;
  uint8_t plane = 0, state = 0;
  double rate_mbps = 0;  // payload and headers sent per second
  double rtt_us = 0;
  double rtt_ratio = 0;  // against the connection's best active path (0: no sample)
  double ecn_pct = 0;    // ECN-marked echoes per packet sent, in %
  double retx_pct = 0;   // retransmissions per packet sent, in %
  uint32_t window = 0, in_flight = 0;
  // Active, but failed since the earlier snapshot: a failed path re-picks its port and is often
  // back before the next refresh, so its state alone would hide the failure ("flapped").
  bool flapped = false;
  // Failed, probing, plane down, flapped, RTT >= 2x the best, or >= 1 % resent.
  bool worst = false;
};

enum class TopSort { kRate, kRtt, kEcn, kRetx, kState, kPath };
inline constexpr int kTopSorts = 6;
const char* to_string(TopSort s);

// The rows of one link: before may be null (the first snapshot: rates are 0).
std::vector<PathRow> path_rows(const std::string& link, const nic::TelemetrySnapshot* before,
                               const nic::TelemetrySnapshot& after);
void sort_rows(std::vector<PathRow>& rows, TopSort by);

// One frame of the view, `width` columns by at most `height` lines (0: as many
// as it needs), with ANSI colour when `color`. `when` heads it; `events`
// (newest last) fill the bottom.
std::vector<std::string> render_top(const std::vector<PathRow>& rows,
                                    const std::vector<std::string>& events, const std::string& when,
                                    TopSort by, int width, int height, bool color);

}  // namespace metaroce::util
