// SPDX-License-Identifier: Apache-2.0
// What a workload sees of a simulated host, whichever transport it runs (ours, or the RoCEv2
// baseline).
#pragma once

#include <cstdint>
#include <functional>

#include "sim/network.h"

namespace metaroce::sim {

struct HostStats {
  uint64_t retransmits = 0, timeouts = 0, failed = 0;
  uint64_t paths_failed = 0, failover_resends = 0, tail_probes = 0;  // ours only
  uint64_t late_losses = 0, late_spurious = 0, redundant_copies = 0;  // ours only
  HostStats& operator+=(const HostStats& o) {
    retransmits += o.retransmits;
    timeouts += o.timeouts;
    failed += o.failed;
    paths_failed += o.paths_failed;
    failover_resends += o.failover_resends;
    tail_probes += o.tail_probes;
    late_losses += o.late_losses;
    late_spurious += o.late_spurious;
    redundant_copies += o.redundant_copies;
    return *this;
  }
};

class HostModel : public Node {
 public:
  // A WRITE of `bytes` to host `to` on `stream` (one QP per (peer, stream)); done(now) once it
  // is acknowledged.
  virtual void send(uint32_t to, uint32_t stream, uint32_t bytes, std::function<void(Ns)> done) = 0;
  virtual HostStats stats() const = 0;
};

}  // namespace metaroce::sim
