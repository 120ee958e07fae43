// SPDX-License-Identifier: Apache-2.0
// `metaroce stat NAME [--json] [--watch SECONDS]`: the live counters every process using a
// link publishes (datapath/nic/telemetry.h), per device, per connection and per path.
#pragma once

#include <string>
#include <vector>

#include "util/cli.h"

namespace metaroce::util {

// Returns the exit status; on failure *why holds the one-line reason.
int stat_command(const std::vector<std::string>& args, const Context& ctx, std::string* why);

}  // namespace metaroce::util
