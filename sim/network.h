// SPDX-License-Identifier: Apache-2.0
// The simulated network: unidirectional links (rate, delay, a finite FIFO with an ECN marking
// threshold, tail drop, random loss, failure, optionally PFC) between nodes, switches that
// forward by ECMP on the 5-tuple, and a leaf-spine or fat-tree topology of P independent planes
// (docs/simulation.md).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "sim/event_queue.h"

namespace metaroce::sim {

class Link;

// One packet: the headers that route it, and of what the transport wrote (the UDP payload) its
// length and first kHeadBytes, which hold every header: the payload after them means nothing
// here (sim/endpoint.cc gathers none), so it does not travel, and a run at scale holds
// headers, not megabytes of zeros, in its queues.
struct Packet {
  static constexpr uint32_t kHeadBytes = 256;
  uint32_t src_ip = 0, dst_ip = 0;
  uint16_t sport = 0;
  uint8_t plane = 0;
  bool ce = false;
  uint32_t length = 0;        // UDP payload bytes
  std::vector<uint8_t> head;  // its first min(length, kHeadBytes)
  Link* via = nullptr;          // with PFC: the link it last arrived over (whose buffer it holds)
  uint32_t wire_bytes() const { return length + 42 + 4; }
};

class Node {
 public:
  virtual ~Node() = default;
  virtual void receive(Packet&& p) = 0;
};

// Priority flow control (IEEE 802.1Qbb) on the one traffic class the simulator has. The far end
// of a link counts the bytes that arrived over it and still wait in its egress queues; above
// xoff it sends a PAUSE back (it reaches the transmitter after the link's delay), at or below
// xon a resume. A paused transmitter finishes the frame it is sending and starts no other.
struct PfcParams {
  bool on = false;
  uint32_t xoff_bytes = 128 * 1024;
  uint32_t xon_bytes = 96 * 1024;
  // The largest frame, for the headroom: what may still arrive once xoff is crossed.
  static constexpr uint32_t kMaxFrame = 9216;
};

struct LinkParams {
  double gbps = 100;            // bits per ns
  Ns delay_ns = 1000;           // propagation
  uint32_t queue_bytes = 1 << 20;   // tail drop above this (without PFC)
  uint32_t ecn_bytes = 100 * 1024;  // CE-mark a packet that finds more than this queued
  double loss = 0;              // probability a packet is lost on this link
  PfcParams pfc;
};

struct LinkCounters {
  uint64_t packets = 0, bytes = 0, drop_queue = 0, drop_loss = 0, drop_down = 0, ce_marked = 0;
  uint32_t max_backlog = 0;
  // PFC: pause frames this link's far end sent back, packets its far end dropped because they
  // overflowed the headroom (also in drop_queue of the link they were queued for: a sizing
  // bug, not congestion), and the most bytes from this link its far end held at once.
  uint64_t pause_frames = 0, drop_headroom = 0;
  uint32_t max_held = 0;
};

// A transmitter and the wire after it. Without PFC the queue is kept as the time its
// transmitter is busy until, and a packet that finds more than queue_bytes ahead of it is
// dropped. With PFC it is a FIFO of packets that a transmitter takes one at a time (it can be
// paused), and what came from a switch's upstream link waits without a byte limit of its own:
// it counts against that link's pause thresholds, and is dropped only past their headroom.
class Link {
 public:
  Link(EventQueue& q, Rng& rng, LinkParams p, Node* to, std::string name)
      : q_(q), rng_(rng), p_(p), to_(to), name_(std::move(name)) {}
  void send(Packet&& pkt);
  // Bytes waiting ahead of a packet sent now.
  uint32_t backlog() const;
  // When the backlog will be at most `bytes` (while paused, a guess: the caller looks again).
  Ns drains_to(uint32_t bytes) const;
  void set_up(bool up) { up_ = up; }
  bool up() const { return up_; }
  const LinkCounters& counters() const { return c_; }
  const std::string& name() const { return name_; }
  const LinkParams& params() const { return p_; }
  // PFC: time this transmitter has spent paused, to now.
  Ns paused_ns() const { return paused_ns_ + (paused_ ? q_.now() - paused_since_ : 0); }

 private:
  void send_fifo(Packet&& pkt);
  void admit(Packet& pkt, uint32_t ahead, uint32_t size);
  void start_tx();
  void tx_done();
  void arrive(std::shared_ptr<Packet> pkt);
  // The far end's accounting of bytes that came over this link and wait there.
  void hold(uint32_t bytes);
  void release(uint32_t bytes);
  void set_paused(bool paused);
  uint32_t headroom_limit() const;

  EventQueue& q_;
  Rng& rng_;
  LinkParams p_;
  Node* to_;
  std::string name_;
  Ns busy_until_ = 0;
  bool up_ = true;
  LinkCounters c_;
  // With PFC: the FIFO, the frame on the transmitter, the pause state.
  std::deque<Packet> fifo_;
  uint64_t fifo_bytes_ = 0;
  Packet on_tx_;
  bool tx_busy_ = false, paused_ = false, xoff_sent_ = false;
  Ns paused_since_ = 0, paused_ns_ = 0;
  uint32_t held_ = 0;
};

// Forwards by destination: among the candidate links for it, the one the 5-tuple hashes to.
class Switch final : public Node {
 public:
  explicit Switch(uint64_t seed) : seed_(seed) {}
  void receive(Packet&& p) override;
  // Packets to dst_ip leave on one of `links`.
  void route(uint32_t dst_ip, std::vector<Link*> links);
  void set_default(std::vector<Link*> links) { default_ = std::move(links); }

 private:
  uint64_t seed_;
  std::vector<std::pair<uint32_t, std::vector<Link*>>> routes_;  // sorted by ip
  std::vector<Link*> default_;
};

// The fabric, one copy per plane. Host h (IPv4 198.18.0.0 + h + 1) has one uplink and one
// downlink per plane.
//   leafspine: two tiers, hosts_per_leaf hosts on each leaf, every leaf joined to every spine
//     by `parallel` links each way.
//   fattree: three tiers, k-ary (Al-Fares et al., SIGCOMM 2008): k pods of k/2 edge and k/2
//     aggregation switches, (k/2)^2 core switches, k^3/4 hosts (k/2 per edge switch). Edge and
//     aggregation switches spread upward traffic by ECMP; downward, each has one way.
enum class TopologyKind { kLeafSpine, kFatTree };

struct TopologyParams {
  TopologyKind kind = TopologyKind::kLeafSpine;
  uint32_t hosts = 16, hosts_per_leaf = 4, spines = 2, planes = 1, parallel = 1;
  uint32_t k = 4;  // fattree only
  LinkParams host_link, fabric_link;
  uint64_t seed = 1;
};

class Topology {
 public:
  Topology(EventQueue& q, Rng& rng, const TopologyParams& p);
  ~Topology();
  // Simulated hosts are numbered in 198.18.0.0/15, the benchmarking range (up to 131,070).
  static uint32_t ip_of(uint32_t host) { return 0xc6120001 + host; }
  static uint32_t host_of(uint32_t ip) { return ip - 0xc6120001; }
  // Where host h's packets of plane p enter the network, and where the network delivers them.
  Link* uplink(uint32_t host, uint32_t plane) { return up_[plane * hosts_ + host]; }
  void attach(uint32_t host, Node* n) { hosts_nodes_[host] = n; }
  std::vector<std::unique_ptr<Link>>& links() { return links_; }
  // Core links of one plane, for failures: leaf <-> spine, or aggregation <-> core.
  std::vector<Link*> core_links(uint32_t plane) const;
  // The core link of `plane` that carried the most packets so far: one the run really uses,
  // whichever transport (RoCEv2's one path per QP may avoid any given link). What
  // --fail-core-link-at-us takes down.
  Link* busiest_core_link(uint32_t plane) const;

 private:
  class HostPort;
  Link* link(const LinkParams& lp, Node* to, std::string name);
  void build_leaf_spine(const TopologyParams& p);
  void build_fat_tree(const TopologyParams& p);

  EventQueue& q_;
  Rng& rng_;
  uint32_t hosts_;
  std::vector<std::unique_ptr<Switch>> switches_;
  std::vector<std::unique_ptr<Link>> links_;
  std::vector<std::unique_ptr<HostPort>> ports_;
  std::vector<Link*> up_;
  std::vector<Node*> hosts_nodes_;
  std::vector<std::vector<Link*>> core_;
};

}  // namespace metaroce::sim
