// SPDX-License-Identifier: Apache-2.0
// `metaroce record NAME -o FILE`: the per-path telemetry of a link over time,
// for `metaroce top --replay` and bench/plot_record. The format
// (docs/operations.md, "Records") is JSON lines: a header object, then one
// object per snapshot the engine published.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "datapath/nic/telemetry.h"
#include "util/cli.h"

namespace metaroce::util {

inline constexpr int kRecordVersion = 1;

int record_command(const std::vector<std::string>& args, const Context& ctx, std::string* why);

// The header line and one snapshot's line (no newline), as record writes them.
std::string record_header(const std::string& link, int64_t started_unix_ns);
std::string record_sample(const nic::TelemetrySnapshot& s);

struct Recording {
  std::string link;
  int64_t started_unix_ns = 0;
  std::vector<nic::TelemetrySnapshot> samples;  // in the order written
};
// Reads a record; nullopt and *err (naming the line) when it is not one, is of
// a later version, or is cut short inside a line (a record cut at a line's end
// is whole).
std::optional<Recording> read_record(const std::string& path, std::string* err);

}  // namespace metaroce::util
