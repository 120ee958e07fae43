// SPDX-License-Identifier: Apache-2.0
// `metaroce fabric run`: the fabric core behind one DPDK memif server port per endpoint and plane,
// forwarded by a single polling thread, with a state folder and a control socket.
#pragma once

#include <iosfwd>
#include <string>

#include "datapath/fabric/fabric.h"
#include "datapath/fabric/idle_policy.h"

namespace metaroce::fabric {

struct RunOptions {
  std::string name;     // checked with check_fabric_name
  std::string rundir;   // state goes to state_dir(rundir, name)
  FabricConfig config;  // must validate()
  double seconds = 0;   // 0: until SIGTERM/SIGINT or a `stop` request
  IdlePolicy idle;      // must validate(); what the polling thread does when nothing moves
};

// Initialises EAL in this process (it can never be initialised again here), runs the fabric
// (progress lines and the final counters on out) and returns 0 after a clean stop, or 1 and a
// one-line reason in *err when something could not be set up.
int run_fabric(const RunOptions& options, std::ostream& out, std::string* err);

}  // namespace metaroce::fabric
