// SPDX-License-Identifier: Apache-2.0
// A simulated host: the real transport (datapath/transport, the code that ships) on the
// simulator's clock, one NIC port per plane, and the messages a workload gives it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "datapath/transport/engine.h"
#include "sim/host.h"
#include "sim/network.h"

namespace metaroce::sim {

class Endpoint final : public HostModel, private transport::Host {
 public:
  Endpoint(EventQueue& q, Topology& topo, uint32_t host, const transport::EngineConfig& cfg);
  ~Endpoint() override;

  // A WRITE of `bytes` to host `to` on `stream`; done(now) once every packet is acknowledged,
  // failed(now) if the transport gives it up.
  void send(uint32_t to, uint32_t stream, uint32_t bytes, std::function<void(Ns)> done) override;
  void receive(Packet&& p) override;
  HostStats stats() const override {
    const transport::EngineStats& s = engine_->stats();
    return {s.retransmits,     s.timeouts,    failed_,       s.paths_failed,
            s.failover_resends, s.tail_probes, s.late_losses, s.late_spurious,
            s.redundant_copies};
  }

  const transport::Engine& engine() const { return *engine_; }
  uint32_t host() const { return host_; }
  // Called with (sender host, stream, msn) when the last byte of a message arrives (in offset
  // order: exact for one-packet messages, which is what the ping-pong workload sends).
  void on_arrival(std::function<void(uint32_t, uint32_t, uint32_t)> f) { arrived_ = std::move(f); }
  uint64_t failed() const { return failed_; }
  uint64_t rx_bytes() const { return rx_bytes_; }

 private:
  class Sink;
  struct Msg {
    std::function<void(Ns)> done;
  };
  // transport::Host
  void gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) override;
  transport::Syndrome deliver(const transport::Segment& seg) override;
  void message_acked(uint64_t cookie) override;
  void message_failed(uint64_t cookie, transport::Syndrome why) override;

  // Sends what windows allow and arms the next timer.
  void kick();
  // The NIC queue was full: poll again once it has drained (one wake-up pending at a time).
  void wake_at(Ns t);

  EventQueue& q_;
  Topology& topo_;
  const uint32_t host_;
  std::unique_ptr<transport::Engine> engine_;
  std::unique_ptr<Sink> sink_;
  std::map<uint64_t, Msg> msgs_;
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> next_msn_;  // (peer, stream) -> msn
  uint64_t next_cookie_ = 1;
  Ns timer_at_ = INT64_MAX;
  uint64_t timer_gen_ = 0;
  bool wake_pending_ = false;
  uint64_t failed_ = 0, rx_bytes_ = 0;
  std::vector<uint8_t> rx_buf_;
  std::function<void(uint32_t, uint32_t, uint32_t)> arrived_;
};

}  // namespace metaroce::sim
