// SPDX-License-Identifier: Apache-2.0
// The ping-pong workload (docs/simulation.md, "Recovery under a ping-pong"): one message in
// flight, as ib_send_lat and a latency-bound collective have; what a failure costs the exchange
// it hits, in clean exchanges, with no host scheduling in the figure.
#pragma once

#include <cstdint>
#include <string>

#include "sim/endpoint.h"

namespace metaroce::sim {

struct PingPongParams {
  uint32_t exchanges = 1000;
  uint32_t bytes = 2;          // per message: one packet
  double fail_core_at_us = -1;  // the busiest core link of plane 0 goes down then (< 0: never)
  Ns limit_ns = 0;
};

// Host a and host b (on different leaves, so that the spray crosses the core) exchange
// p.exchanges messages, each sent when the other's arrives. The figures as the JSON fields that
// follow the simulator's common ones (", \"exchanges\": ..."); unfinished exchanges in *left.
std::string run_pingpong(EventQueue& q, Topology& topo, Endpoint& a, Endpoint& b,
                         const PingPongParams& p, uint32_t* left);

}  // namespace metaroce::sim
