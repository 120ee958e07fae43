// SPDX-License-Identifier: Apache-2.0
// Background traffic beside a workload: every host starts flows to random other hosts, Poisson
// arrivals at a fraction of its rate, over whichever transport the hosts run. Its flows are
// counted apart from the workload's (docs/simulation.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "sim/event_queue.h"
#include "sim/host.h"

namespace metaroce::sim {

struct BackgroundParams {
  double load = 0;          // offered load, a fraction of each host's rate
  double host_gbps = 400;   // a host's rate (all its ports)
  uint64_t flow_bytes = 0;  // every flow this long; 0: heavy-tailed sizes (see sample_bytes)
  uint64_t msg_bytes = 64 << 10;  // a flow is WRITEs of at most this
  uint32_t first_stream = 1000;   // a flow's stream: first_stream + (its number % streams)
  uint32_t streams = 4;
  uint64_t seed = 1;
};

class Background {
 public:
  Background(EventQueue& q, std::vector<std::unique_ptr<HostModel>>& hosts, BackgroundParams p);
  // Schedules each host's first arrival; stop() ends the arrivals (flows started go on).
  void start();
  void stop() { stopped_ = true; }
  // The mean of the flow sizes drawn, which sets the arrival rate.
  double mean_bytes() const;

  uint64_t flows() const { return flows_.size(); }
  uint64_t bytes_done() const;
  // Completion times of the flows done (those to a host `to` accepts, if given), in us.
  std::vector<double> fct_us(const std::function<bool(uint32_t)>& to = {}) const;

 private:
  struct Flow {
    Ns start = 0, done = -1;
    uint64_t bytes = 0, acked = 0;
    uint32_t to = 0;
  };
  void arrival(uint32_t host);
  uint64_t sample_bytes(Rng& rng) const;

  EventQueue& q_;
  std::vector<std::unique_ptr<HostModel>>& hosts_;
  const BackgroundParams p_;
  double per_ns_ = 0;      // arrivals per ns per host
  std::vector<Rng> rng_;   // one per host
  std::vector<Flow> flows_;
  bool stopped_ = false;
};

}  // namespace metaroce::sim
