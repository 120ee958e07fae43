// SPDX-License-Identifier: Apache-2.0
// The baseline every simulated figure is compared with: RoCEv2 as NICs run it. One path per QP
// (its UDP source port hashed by ECMP, its NIC port fixed), PSNs in order, go-back-N on a NAK
// or a timeout, and DCQCN rate control with the published defaults (Zhu et al., SIGCOMM 2015:
// g = 1/256, 55 us timers, 10 MB byte counter, 5 fast-recovery stages, 40/100 Mbit/s additive /
// hyper increase; CNPs at most every 50 us per QP). A model, unlike sim/endpoint (ours is the
// real code); it is kept to what those papers and the RoCEv2 specification fix.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "sim/host.h"

namespace metaroce::sim {

struct RoceParams {
  uint32_t mtu = 4096;          // payload bytes per packet
  Ns rto_ns = 1'000'000;        // go-back-N after this long without progress
  uint32_t window = 1 << 20;    // bytes in flight per QP at most (NIC outstanding limit)
};

class RoceEndpoint final : public HostModel {
 public:
  RoceEndpoint(EventQueue& q, Topology& topo, uint32_t host, uint32_t planes, double line_gbps,
               RoceParams p);
  ~RoceEndpoint() override;
  void send(uint32_t to, uint32_t stream, uint32_t bytes, std::function<void(Ns)> done) override;
  void receive(Packet&& p) override;
  HostStats stats() const override { return stats_; }

 private:
  struct Qp;
  Qp& qp_to(uint32_t to, uint32_t stream);
  void pump(Qp& qp);
  void arm_rto(Qp& qp);
  void on_ack(Qp& qp, uint32_t psn, bool nak);
  void on_cnp(Qp& qp);
  void dcqcn_timer(Qp& qp);
  void emit(uint32_t dst_ip, uint16_t sport, uint8_t plane, uint8_t type, uint32_t qpn,
            uint32_t psn, uint32_t len);

  EventQueue& q_;
  Topology& topo_;
  const uint32_t host_;
  const uint32_t planes_;
  const double line_gbps_;
  const RoceParams p_;
  std::map<std::pair<uint32_t, uint32_t>, std::unique_ptr<Qp>> qps_;  // (peer, stream)
  std::vector<Qp*> by_qpn_;
  // Receiver side, by (source ip, qpn): the next PSN expected, NAK and CNP state.
  struct Rx {
    uint32_t expected = 0;
    bool nak_sent = false;
    Ns last_cnp = INT64_MIN / 2;
  };
  std::map<std::pair<uint32_t, uint32_t>, Rx> rx_;
  HostStats stats_;
};

}  // namespace metaroce::sim
