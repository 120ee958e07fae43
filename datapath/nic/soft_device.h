// SPDX-License-Identifier: Apache-2.0
// The software NIC of one link in one process: owns the port, the transport engine, the MR,
// CQ and QP tables, ARP, and the progress thread that moves data with no application call.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "datapath/io/port.h"
#include "datapath/nic/completion_queue.h"
#include "datapath/nic/device.h"
#include "datapath/nic/mr_table.h"
#include "datapath/nic/queue_pair.h"
#include "datapath/nic/shared_receive_queue.h"
#include "datapath/nic/telemetry_writer.h"
#include "datapath/transport/engine.h"

namespace metaroce::nic {

struct SoftDeviceOptions {
  bool start_thread = true;  // tests may drive progress() by hand
  std::function<transport::Time()> clock;  // default: steady_clock; tests inject a virtual one
  transport::EngineConfig engine;
  // On close, keep answering peers (with the progress thread) until none has been answered for
  // this long, at most linger_max: a peer still missing our last ACK resends within its RTO
  // (docs/spec/congestion.md §4.6). Zero: close at once.
  transport::Time linger_quiet = 2 * transport::EngineConfig{}.rto_max;
  transport::Time linger_max = std::chrono::seconds(1);
};

class SoftDevice final : public Device, private transport::Host {
 public:
  // One port per plane (the link's device strings, plane 0 first).
  SoftDevice(const LinkConfig& cfg, std::vector<std::unique_ptr<io::Port>> ports,
             const SoftDeviceOptions& opt);
  SoftDevice(const LinkConfig& cfg, std::unique_ptr<io::Port> port, const SoftDeviceOptions& opt);
  ~SoftDevice() override;

  const LinkConfig& config() const override { return cfg_; }
  // The port is ACTIVE once its DPDK port is started, whether or not the peer end (a memif
  // partner, a cable) is there yet: perftest and NCCL refuse a port that is not ACTIVE before
  // they even exchange addresses with the peer. Carrier loss is a transport matter (spec §7).
  bool port_active() const override { return true; }
  size_t planes() const { return planes_.size(); }
  uint32_t active_mtu() const override { return active_mtu_; }
  int reg_mr(uint32_t pd, uint64_t addr, uint64_t length, unsigned int access, uint32_t* lkey,
             uint32_t* rkey) override;
  int dereg_mr(uint32_t lkey) override;
  Cq* create_cq(uint32_t cqe, int* err) override;
  int destroy_cq(Cq* cq) override;
  Qp* create_qp(const QpInit& init, int* err) override;
  int destroy_qp(Qp* qp) override;
  Srq* create_srq(uint32_t pd, uint32_t max_wr, uint32_t max_sge, int* err) override;
  int destroy_srq(Srq* srq) override;
  void kick() override;
  DeviceCounters counters() const override;

  // One pass of the progress loop; returns true if it found work. Public for tests.
  bool progress();
  // A pass on the caller's thread if no other thread is in one (the CQ idle hook).
  static void assist(void* self);
  const transport::EngineStats& engine_stats() const { return engine_->stats(); }

  // For queue pairs (device lock held).
  std::mutex& lock() { return mu_; }
  const MrTable& mrs() const { return mrs_; }
  transport::Engine& engine() { return *engine_; }
  void queue_read_response(const transport::MessageDesc& msg, uint64_t local_addr);
  void resolve(uint32_t ip);  // start ARP for a peer
  // Queues a packet the device sent to its own address; delivered in the next progress pass.
  void loop_back(uint16_t udp_src_port, std::span<const uint8_t> udp_payload);
  static uint64_t cookie(uint32_t qpn, uint32_t msn) { return (uint64_t{qpn} << 32) | msn; }

 private:
  class Sink;
  struct ReadResponse {
    uint64_t addr = 0;
    uint32_t length = 0;
  };

  // transport::Host
  void gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) override;
  transport::Syndrome deliver(const transport::Segment& seg) override;
  void message_acked(uint64_t cookie) override;
  void message_failed(uint64_t cookie, transport::Syndrome why) override;

  void run();
  void linger();
  bool progress_locked();
  void idle_wait(transport::Time now, transport::Time idle_for);
  // A port and what the NIC knows about the far side of it.
  struct Plane {
    std::unique_ptr<io::Port> port;
    std::unordered_map<uint32_t, io::MacAddr> arp;  // peer IP -> MAC on this plane
    // Set when the peer said goodbye: the port is not touched until the link comes back.
    bool quiet = false;
    bool quiet_saw_down = false;
    transport::Time quiet_since{};
  };

  void send_arp(Plane& pl, bool reply, uint32_t target_ip, const io::MacAddr& target_mac);
  void send_goodbye(Plane& pl, uint8_t kind);
  void say_goodbye(Plane& pl);
  void handle_frame(transport::Time now, Plane& pl, const io::RxFrame& f);
  static std::optional<uint8_t> goodbye_kind(const io::RxFrame& f);
  QueuePair* find_qp(uint32_t qpn);
  bool sends_pending() const;
  // Refreshes the block `metaroce stat` reads (every kPublishEvery, outside the packet path).
  void publish_stats(transport::Time now);
  transport::Time now() const;

  const LinkConfig cfg_;
  const std::function<transport::Time()> clock_;
  const transport::Time linger_quiet_, linger_max_;
  std::vector<Plane> planes_;
  uint32_t active_mtu_;
  mutable std::mutex mu_;
  MrTable mrs_;
  std::vector<std::unique_ptr<SharedReceiveQueue>> srqs_;  // outlive the QPs attached to them
  std::unordered_map<uint32_t, std::unique_ptr<QueuePair>> qps_;
  std::vector<QueuePair*> qp_list_;  // iteration order for draining send queues
  std::vector<std::unique_ptr<CompletionQueue>> cqs_;
  uint32_t next_qpn_;
  std::unique_ptr<transport::Engine> engine_;
  std::unique_ptr<Sink> sink_;
  std::unique_ptr<TelemetryWriter> telemetry_;
  transport::Time next_publish_{};
  std::unordered_map<uint64_t, ReadResponse> reads_;  // key: cookie with kReadRespTag
  std::vector<transport::MessageDesc> pending_reads_;  // submitted after on_packet returns
  uint32_t next_read_id_ = 0;

  // Loopback: packets to our own address, with buffers reused (no allocation once warm).
  struct LoopPacket {
    uint16_t src_port = 0;
    std::vector<uint8_t> bytes;
  };
  std::vector<std::unique_ptr<LoopPacket>> loop_pool_;
  std::vector<LoopPacket*> loop_free_;
  std::vector<LoopPacket*> loop_queue_;

  // ARP requests in flight (sent on every plane), by peer IP.
  std::unordered_map<uint32_t, transport::Time> arp_asked_;
  DeviceCounters counters_;

  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  int doorbell_fd_ = -1;
};

}  // namespace metaroce::nic
