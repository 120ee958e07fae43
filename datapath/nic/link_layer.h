// SPDX-License-Identifier: Apache-2.0
// The link layer of one MetaRoCE link (docs/spec/link.md): its ports, one per plane; Ethernet,
// IPv4 and UDP framing; ARP; the goodbye exchange before a port closes; packets a device sends
// to its own address. It drives the NIC core with what arrives and carries what the NIC sends.
#pragma once

#include <array>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "datapath/io/port.h"
#include "datapath/nic/capture.h"
#include "datapath/nic/nic.h"
#include "datapath/transport/engine.h"
#include "datapath/wire/frame.h"

namespace metaroce::nic {

struct LinkCounters {
  uint64_t rx_frames = 0, tx_frames = 0, rx_drop_malformed = 0, rx_drop_not_ours = 0;
  uint64_t arp_requests = 0, arp_replies = 0;
  uint64_t rx_raw = 0;  // frames the flow rules steered to raw QPs (verbs-mapping.md §18)
  // Frames of raw QPs, and datagrams to groups, that could not leave: their plane was down, or
  // the port had had no room for 100 ms (LinkLayer::send_raw).
  uint64_t tx_raw_dropped = 0;
  uint64_t tx_mcast_dropped = 0;
  // IGMP (wire.md §8): membership reports and leaves sent, queries answered, IGMP messages too
  // short or with a wrong checksum.
  uint64_t igmp_reports = 0, igmp_leaves = 0, igmp_queries = 0, igmp_rx_malformed = 0;
};

class LinkLayer {
 public:
  static constexpr uint32_t kRxBurst = 32;

  // ports: one per plane, plane 0 first. goodbye: say goodbye when closing (tests of one
  // process, whose peers are not polled meanwhile, do without).
  LinkLayer(Nic& nic, std::vector<std::unique_ptr<io::Port>> ports, bool goodbye = true);
  // Tells the peer of every plane goodbye (link.md §4) and waits for its answer.
  ~LinkLayer();
  LinkLayer(const LinkLayer&) = delete;
  LinkLayer& operator=(const LinkLayer&) = delete;

  // One pass: receive and place, then transmit (timers too, unless held). Returns true if it
  // found work.
  bool poll(transport::Time now, bool timers = true);
  size_t planes() const { return planes_.size(); }
  const LinkCounters& counters() const { return counters_; }
  // The ports' own counters, summed over the planes (io::PortStats).
  io::PortStats port_stats() const {
    io::PortStats sum;
    for (const Plane& pl : planes_) {
      const io::PortStats s = pl.port->stats();
      sum.rx_frames += s.rx_frames;
      sum.rx_bytes += s.rx_bytes;
      sum.tx_frames += s.tx_frames;
      sum.tx_bytes += s.tx_bytes;
      sum.tx_dropped += s.tx_dropped;
      sum.rx_missed += s.rx_missed;
      sum.tx_late_kicks += s.tx_late_kicks;
    }
    return sum;
  }
  Nic& nic() { return nic_; }
  // The descriptors to sleep on for arriving frames, one per plane, written to out (room at
  // most); returns how many: 0 when a plane's port has none (memif) or they do not fit, since a
  // frame on that plane would then go unseen. Arm before sleeping on them, disarm after.
  size_t rx_wait_fds(int* out, size_t room) const;
  void rx_arm();
  void rx_disarm();
  // Planes (link.md §3): one set down by its operator (`metaroce link set --plane P down`)
  // sends and receives nothing until set up; on a link of several planes, one whose port lost
  // its link counts as down too. The transport moves the traffic of a plane that is down to the
  // others. False for a plane the link does not have.
  bool set_plane_admin(size_t plane, bool up);
  uint32_t planes_up() const;
  // The verbs port (verbs-mapping.md §8): ACTIVE while some plane is in service and has carrier
  // (a plane whose carrier was never up counts as up: memif and af_xdp links come up when their
  // peer connects, and the device serves loopback before that).
  bool port_active() const { return port_active_; }
  uint32_t planes_admin_down() const;
  // Every frame sent and received from now on is written to `capture` (nullptr: no more);
  // returns the one it replaces, flushed.
  std::unique_ptr<Capture> set_capture(std::unique_ptr<Capture> capture);
  const Capture* capture() const { return capture_.get(); }
  void flush_capture() {
    if (capture_) capture_->flush();
  }

 private:
  class Sink;
  // Peer IP -> MAC with a generation that every change bumps, so that what was built from an
  // entry (a frame header) knows when it is stale.
  class ArpTable {
   public:
    const io::MacAddr* find(uint32_t ip) const {
      auto it = map_.find(ip);
      return it == map_.end() ? nullptr : &it->second;
    }
    // Asked for every frame received (its sender teaches its address): the last address found
    // is remembered until the table next changes.
    bool count(uint32_t ip) const {
      if (ip == known_ip_ && known_gen_ == gen_) return true;
      if (!map_.count(ip)) return false;
      known_ip_ = ip;
      known_gen_ = gen_;
      return true;
    }
    void set(uint32_t ip, const io::MacAddr& mac) {
      auto [it, added] = map_.try_emplace(ip, mac);
      if (!added && it->second == mac) return;
      it->second = mac;
      ++gen_;
    }
    void erase(uint32_t ip) { gen_ += map_.erase(ip); }
    uint64_t gen() const { return gen_; }

   private:
    std::unordered_map<uint32_t, io::MacAddr> map_;
    uint64_t gen_ = 0;
    mutable uint32_t known_ip_ = 0;
    mutable uint64_t known_gen_ = ~uint64_t{0};
  };
  // A port and what the link knows about the far side of it.
  struct Plane {
    std::unique_ptr<io::Port> port;
    // A UDP-socket plane: the kernel frames, routes and resolves; no ARP, no goodbye.
    bool udp = false;
    uint32_t header_room = 0;  // bytes in front of the UDP payload that the link layer writes
    bool kernel = false;       // the port has a kernel interface: routes come from the kernel
    bool tails = false;        // the port takes frames with a tail (io::Port::takes_tails)
    // Peer IP -> the MAC its packets go to on this plane: the peer's own, or its next hop's.
    ArpTable arp;
    // The headers of the last peer's frames, stamped on each packet to it (Sink::commit):
    // valid while the peer, the ARP table's generation and our address are those it was made for.
    struct HeaderCache {
      uint32_t peer_ip = 0, src_ip = 0;
      uint16_t udp_port = 0;
      uint64_t arp_gen = ~uint64_t{0};
      wire::UdpHeaderTemplate t;
    } hdr;
    // Peers reached through a router on this plane (the kernel's route): peer -> next hop.
    std::unordered_map<uint32_t, uint32_t> via;
    // Set when the peer said goodbye: the port is not touched until the link comes back.
    bool quiet = false;
    bool quiet_saw_down = false;
    bool admin_down = false;
    bool carrier = true;
    bool carrier_seen = false;    // its port's link was up once
    bool link = true;             // its port's link at the last check (check_planes)
    bool reported_up = true;      // what the NIC was last told
    transport::Time quiet_since{};
    std::array<io::RxFrame, kRxBurst> rx;  // this pass's frames, held until the NIC placed them
    uint32_t rx_n = 0;
  };
  // Packets to our own address, with buffers reused (no allocation once warm).
  struct LoopPacket {
    uint16_t src_port = 0;
    std::vector<uint8_t> bytes;
  };

  void send_arp(Plane& pl, bool reply, uint32_t target_ip, const io::MacAddr& target_mac);
  void tap(const Plane& pl, std::span<const uint8_t> bytes) {
    if (capture_ && capture_->wants(static_cast<uint8_t>(&pl - planes_.data()))) capture_->frame(bytes);
  }
  void send_goodbye(Plane& pl, uint8_t kind);
  // IGMP: a report or leave of group on pl (planes carrying Ethernet frames, in service); the
  // reports of every group of the device on pl; a query or another host's message.
  void send_igmp(Plane& pl, wire::IgmpType type, uint32_t group);
  void report_groups(Plane& pl);
  void on_igmp(Plane& pl, const wire::FrameInfo& p);
  void say_goodbye(Plane& pl);
  void handle_frame(transport::Time now, Plane& pl, const io::RxFrame& f);
  void loop_back(uint16_t udp_src_port, std::span<const uint8_t> udp_payload);
  // Frames raw QPs sent (onto plane 0, and back to this device's own flow rules) and UD QPs'
  // datagrams to groups, in the order posted, as the ports have room. True if any left.
  bool send_raw(transport::Time now);
  // Puts f on its plane: it left, it is lost (no plane can carry it, as on a port that is down),
  // or its port has no room for it now.
  enum class Put { kLeft, kLost, kNoRoom };
  Put put_raw(const RawFrame& f);
  void resolve(transport::Time now);
  // Asks the port for the peer's next hop on each Ethernet plane with a kernel interface;
  // returns whether some plane's next hop changed (its MAC must be found again).
  bool route(uint32_t peer_ip);
  void check_planes(transport::Time now);

  Nic& nic_;
  const LinkConfig& cfg_;
  const bool goodbye_;
  std::vector<Plane> planes_;
  std::unique_ptr<Sink> sink_;
  std::vector<std::unique_ptr<LoopPacket>> loop_pool_;
  std::vector<LoopPacket*> loop_free_;
  std::vector<LoopPacket*> loop_queue_;
  std::vector<LoopPacket*> loop_batch_;
  std::vector<RawFrame> raw_loop_queue_, raw_loop_batch_;  // raw frames seen by our own flows
  std::vector<RawFrame> mcast_loop_queue_, mcast_loop_batch_;  // datagrams our members take
  // Frames of raw and UD QPs waiting for room on their port, oldest first; the WQEs that left.
  std::deque<RawFrame> raw_backlog_;
  std::vector<std::pair<uint32_t, uint32_t>> raw_left_;
  transport::Time raw_blocked_since_ = transport::Time::min();
  std::vector<uint8_t> tap_copy_;
  // Peers whose MAC some Ethernet plane still lacks: when they were first asked for, and last.
  struct Asking {
    transport::Time first = transport::Time::min(), last = transport::Time::min();
  };
  std::unordered_map<uint32_t, Asking> arp_asked_;
  std::vector<uint32_t> peers_;  // every peer the NIC asked to resolve, for the route refresh
  transport::Time routes_checked_ = transport::Time::min();
  LinkCounters counters_;
  std::unique_ptr<Capture> capture_;
  transport::Time carrier_checked_ = transport::Time::min();
  bool port_active_ = true;
};

}  // namespace metaroce::nic
