// SPDX-License-Identifier: Apache-2.0
// Framing, ARP, goodbye and loopback of a link; the pass that drives its NIC.
#include "datapath/nic/link_layer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "datapath/wire/frame.h"

namespace metaroce::nic {

using transport::Time;

namespace {

constexpr Time kArpRetry = std::chrono::milliseconds(10);
// After a second without an answer, a peer (or its router) is asked once a second.
constexpr Time kArpPatience = std::chrono::seconds(1);
constexpr Time kArpRetrySlow = std::chrono::seconds(1);
// Routes and neighbours of ports on kernel interfaces are read again this often: a route the
// operator changes is followed within it.
constexpr Time kRouteRefresh = std::chrono::seconds(1);
constexpr uint32_t kL2L4Header = wire::kUdpFrameHeaderLen;
// Link goodbye (wire::build_goodbye): long enough for a peer whose engine is napping or
// descheduled on a loaded host to answer; the close waits only until the answer comes (well
// under a millisecond when idle).
constexpr auto kGoodbyeWait = std::chrono::milliseconds(500);
constexpr Time kQuietMax = std::chrono::seconds(1);

}  // namespace

// Transmit sink: builds Ethernet/IPv4/UDP in front of what the engine writes, on a buffer of the
// packet's plane. Frames wait in a batch per plane until flush(), when their payloads have been
// read from application memory; a packet to our own address goes back into the NIC instead.
// On a port that takes tails (io::Port::takes_tails), a payload the engine can see in place is
// not copied into the frame: the port copies it from there as it sends (attach_tail).
class LinkLayer::Sink final : public FrameSink {
 public:
  explicit Sink(LinkLayer& link) : link_(link), batches_(link.planes_.size()) {}
  ~Sink() override { drop_open(); }

  std::span<uint8_t> begin(uint32_t max_len, uint8_t plane) override {
    drop_open();
    const uint32_t p = plane % link_.planes_.size();
    const uint32_t room = link_.planes_[p].header_room;
    if (!link_.planes_[p].port->alloc_tx(open_, max_len + room)) return {};
    open_plane_ = p;
    has_open_ = true;
    return {open_.data + room, max_len};
  }

  bool attach_tail(std::span<uint8_t> at, const uint8_t* src) override {
    if (!has_open_ || at.empty() || !link_.planes_[open_plane_].tails ||
        at.data() < open_.data || at.data() + at.size() > open_.data + open_.capacity)
      return false;
    // Only the payload's last piece can be a tail: an earlier one goes into the frame now.
    materialize_open();
    open_.tail = src;
    open_.tail_len = static_cast<uint32_t>(at.size());
    tail_at_ = at.data();
    return true;
  }

  void commit(uint32_t peer_ip, uint16_t udp_src_port, uint8_t /*plane*/, uint32_t len) override {
    has_open_ = false;
    Plane& pl = link_.planes_[open_plane_];
    // A tail that does not end the packet, or one going back into this NIC, is copied now.
    if (open_.tail && (tail_at_ + open_.tail_len != open_.data + pl.header_room + len ||
                       peer_ip == link_.cfg_.ip))
      materialize_open();
    Pending f{open_, peer_ip, udp_src_port};
    open_.tail = nullptr;
    if (peer_ip != link_.cfg_.ip && pl.udp) {
      if (pl.admin_down) {
        give_back(open_plane_, open_);
        return;
      }
      f.frame.dst_ip = peer_ip;
      f.frame.src_port = udp_src_port;
    } else if (peer_ip != link_.cfg_.ip) {
      if (pl.quiet || pl.admin_down) {
        give_back(open_plane_, open_);  // the peer is closing that plane, or it is down: a loss
        return;
      }
      Plane::HeaderCache& h = pl.hdr;
      if (h.peer_ip != peer_ip || h.arp_gen != pl.arp.gen() || h.src_ip != link_.cfg_.ip ||
          h.udp_port != link_.cfg_.udp_port) {
        fill_header_cache(pl, peer_ip);
      }
      wire::stamp_udp_headers({f.frame.data, kL2L4Header}, h.t, udp_src_port, len);
    }
    f.frame.len = pl.header_room + len;
    Batch& b = batches_[open_plane_];
    b.frames.push_back(f);
  }

  // Headers to peer_ip as write_udp_headers makes them; until ARP answers, to the broadcast
  // address: every link we run on is point to point or a fabric plane.
  void fill_header_cache(Plane& pl, uint32_t peer_ip) {
    const io::MacAddr* known = pl.arp.find(peer_ip);
    wire::UdpFrameParams a;
    a.src_mac = pl.port->mac();
    a.dst_mac = known ? *known : wire::kBroadcastMac;
    a.src_ip = link_.cfg_.ip;
    a.dst_ip = peer_ip;
    a.dst_port = link_.cfg_.udp_port;
    wire::make_udp_template(pl.hdr.t, a);  // these parameters are always valid
    pl.hdr.peer_ip = peer_ip;
    pl.hdr.src_ip = link_.cfg_.ip;
    pl.hdr.udp_port = link_.cfg_.udp_port;
    pl.hdr.arp_gen = pl.arp.gen();
  }

  void flush(std::span<uint8_t* const> bad) override {
    drop_open();
    for (size_t p = 0; p < batches_.size(); ++p) {
      Batch& b = batches_[p];
      if (b.frames.empty()) continue;
      const uint32_t room = link_.planes_[p].header_room;
      out_.clear();
      for (Pending& f : b.frames) {
        bool poisoned = false;
        for (uint8_t* x : bad)
          poisoned |= x >= f.frame.data && x < f.frame.data + f.frame.len;
        if (poisoned) {
          f.frame.len = 0;  // its payload could not be read: as a loss
          f.frame.tail = nullptr;
        } else if (f.peer_ip == link_.cfg_.ip) {
          // Two QPs of this device talking to each other: the packet never leaves the NIC.
          link_.loop_back(f.udp_src_port, {f.frame.data + room, f.frame.len - room});
          f.frame.len = 0;
        } else {
          ++link_.counters_.tx_frames;
          if (Capture* c = link_.capture_.get(); c && c->wants(static_cast<uint8_t>(p))) {
            materialize(f.frame);  // the capture sees the frame as the wire does
            if (link_.planes_[p].udp)
              c->datagram(link_.cfg_.ip, f.peer_ip, f.udp_src_port, link_.cfg_.udp_port, false,
                          {f.frame.data, f.frame.len});
            else
              c->frame({f.frame.data, f.frame.len});
          }
        }
        out_.push_back(f.frame);
      }
      link_.planes_[p].port->tx_burst(out_);
      b.frames.clear();
    }
  }

 private:
  struct Pending {
    io::TxFrame frame;
    uint32_t peer_ip;
    uint16_t udp_src_port;
  };
  struct Batch {
    std::vector<Pending> frames;
  };
  void give_back(uint32_t plane, io::TxFrame f) {
    f.len = 0;  // tx_burst frees a frame of length 0 unsent
    f.tail = nullptr;
    link_.planes_[plane].port->tx_burst({&f, 1});
  }
  void drop_open() {
    if (!has_open_) return;
    has_open_ = false;
    give_back(open_plane_, open_);
    open_.tail = nullptr;
  }
  // Copies a committed frame's tail into the frame, as its last tail_len bytes; the frame no
  // longer has one. materialize_open: the same for the frame being built, whose tail is at
  // tail_at_ (its length is not known yet).
  void materialize(io::TxFrame& f) {
    if (!f.tail) return;
    std::memcpy(f.data + f.len - f.tail_len, f.tail, f.tail_len);
    counted_as_copy(f);
  }
  void materialize_open() {
    if (!open_.tail) return;
    std::memcpy(tail_at_, open_.tail, open_.tail_len);
    counted_as_copy(open_);
  }
  void counted_as_copy(io::TxFrame& f) {
    NicCounters& n = link_.nic_.mutable_counters();
    n.tx_payload_attached -= f.tail_len;
    n.tx_payload_copied += f.tail_len;
    f.tail = nullptr;
  }

  LinkLayer& link_;
  std::vector<Batch> batches_;
  std::vector<io::TxFrame> out_;
  io::TxFrame open_;
  uint8_t* tail_at_ = nullptr;  // where open_'s tail would be in its buffer
  uint32_t open_plane_ = 0;
  bool has_open_ = false;
};

LinkLayer::LinkLayer(Nic& nic, std::vector<std::unique_ptr<io::Port>> ports, bool goodbye)
    : nic_(nic), cfg_(nic.config()), goodbye_(goodbye) {
  for (auto& p : ports) {
    Plane pl;
    pl.udp = p->kind() == io::PortKind::kUdp;
    // Raw packet QPs put frames on plane 0: a UDP-socket plane carries none.
    if (planes_.empty()) nic_.set_raw_ethernet(!pl.udp);
    pl.header_room = pl.udp ? 0 : kL2L4Header;
    pl.kernel = !pl.udp && !p->kernel_interface().empty();
    pl.tails = p->takes_tails();
    pl.port = std::move(p);
    planes_.push_back(std::move(pl));
  }
  sink_ = std::make_unique<Sink>(*this);
}

LinkLayer::~LinkLayer() {
  sink_.reset();
  if (goodbye_)
    for (Plane& p : planes_) say_goodbye(p);
}

void LinkLayer::send_arp(Plane& pl, bool reply, uint32_t target_ip, const io::MacAddr& target_mac) {
  if (pl.udp) return;
  io::TxFrame f;
  if (!pl.port->alloc_tx(f, wire::kArpFrameLen)) return;
  wire::ArpPacket arp;
  arp.op = reply ? wire::ArpOp::kReply : wire::ArpOp::kRequest;
  arp.sender_mac = pl.port->mac();
  arp.sender_ip = cfg_.ip;
  arp.target_mac = reply ? target_mac : io::MacAddr{};
  arp.target_ip = target_ip;
  f.len = static_cast<uint32_t>(wire::build_arp({f.data, f.capacity}, arp));
  tap(pl, {f.data, f.len});
  pl.port->tx_burst({&f, 1});
  if (reply) counters_.arp_replies++;
  else counters_.arp_requests++;
}

// --- IGMP (wire.md §8) --------------------------------------------------------------------------
// A snooping switch forwards a group's frames only to ports that reported members, and a
// multicast router only to segments that did: the device reports each group when it gains its
// first member, leaves it when the last goes, answers queries, and reports again on a plane
// whose link comes back (a switch forgets a port's groups when its link goes down).

void LinkLayer::send_igmp(Plane& pl, wire::IgmpType type, uint32_t group) {
  if (pl.udp || pl.quiet || pl.admin_down) return;
  io::TxFrame f;
  if (!pl.port->alloc_tx(f, wire::kIgmpFrameLen)) return;
  f.len = static_cast<uint32_t>(
      wire::build_igmp({f.data, f.capacity}, pl.port->mac(), cfg_.ip, type, group));
  tap(pl, {f.data, f.len});
  pl.port->tx_burst({&f, 1});
  ++(type == wire::IgmpType::kLeave ? counters_.igmp_leaves : counters_.igmp_reports);
}

void LinkLayer::report_groups(Plane& pl) {
  nic_.for_each_mcast_group([&](uint32_t g) { send_igmp(pl, wire::IgmpType::kV2Report, g); });
}

void LinkLayer::on_igmp(Plane& pl, const wire::FrameInfo& p) {
  wire::IgmpMessage m;
  if (!wire::parse_igmp(p.ip_payload, m)) {
    counters_.igmp_rx_malformed++;
    return;
  }
  // Other members' reports and leaves change nothing here: every query is answered (a
  // version 2 host may stay silent when another member answered first; answering anyway costs
  // a frame per group and keeps a snooping switch's port entry alive).
  if (m.type != wire::IgmpType::kQuery) return;
  counters_.igmp_queries++;
  if (m.group == 0)
    report_groups(pl);
  else if (nic_.mcast_member(m.group))
    send_igmp(pl, wire::IgmpType::kV2Report, m.group);
}

void LinkLayer::send_goodbye(Plane& pl, uint8_t kind) {
  if (pl.udp) return;  // nothing shared to let go of: the kernel owns the sockets' buffers
  io::TxFrame f;
  if (!pl.port->alloc_tx(f, wire::kGoodbyeFrameLen)) return;
  f.len = static_cast<uint32_t>(
      wire::build_goodbye({f.data, wire::kGoodbyeFrameLen}, pl.port->mac(), kind));
  tap(pl, {f.data, f.len});
  pl.port->tx_burst({&f, 1});
}

void LinkLayer::say_goodbye(Plane& pl) {
  if (pl.udp || !pl.port->link_up()) return;
  send_goodbye(pl, wire::kGoodbye);
  // Real time even under a test clock: this waits for another process (or for the other end
  // of a link this engine also serves, which can no longer answer: it waits the full time only
  // if that end is still open, and links close one after the other).
  const auto deadline = std::chrono::steady_clock::now() + kGoodbyeWait;
  io::RxFrame rx[kRxBurst];
  while (std::chrono::steady_clock::now() < deadline) {
    uint32_t n = pl.port->rx_burst(rx);
    bool acked = false;
    for (uint32_t i = 0; i < n; ++i) {
      auto kind = wire::goodbye_kind({rx[i].data, rx[i].len});
      acked |= kind == wire::kGoodbyeAck;
      // Both ends closing at once: answer the other's goodbye too, or it waits its full time.
      if (kind == wire::kGoodbye) send_goodbye(pl, wire::kGoodbyeAck);
    }
    pl.port->release({rx, n});
    if (acked) return;
    if (n == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void LinkLayer::handle_frame(Time t, Plane& pl, const io::RxFrame& f) {
  counters_.rx_frames++;
  if (capture_ && capture_->wants(static_cast<uint8_t>(&pl - planes_.data()))) {
    if (pl.udp)
      capture_->datagram(f.src_ip, cfg_.ip, f.src_port, cfg_.udp_port, f.ecn_ce, {f.data, f.len});
    else
      capture_->frame({f.data, f.len});
  }
  if (pl.udp) {
    // The kernel delivered a UDP payload of our port and address: the MetaRoCE headers.
    nic_.on_packet(t, f.src_ip, f.src_port, f.ecn_ce, {f.data, f.len},
                   static_cast<uint8_t>(&pl - planes_.data()));
    return;
  }
  if (auto kind = wire::goodbye_kind({f.data, f.len})) {
    if (*kind == wire::kGoodbye) {
      // The peer is closing its end: answer, then leave the link alone until it is back.
      send_goodbye(pl, wire::kGoodbyeAck);
      pl.quiet = true;
      pl.quiet_since = t;
      pl.quiet_saw_down = false;
    }
    return;
  }
  const wire::FrameInfo p = wire::parse_frame({f.data, f.len}, cfg_.udp_port);
  if (p.kind == wire::FrameKind::kMalformed) {
    // Not ours to place; raw QPs' rules may still want it (steering checks no checksum).
    if (nic_.on_raw_frame({f.data, f.len})) counters_.rx_raw++;
    else counters_.rx_drop_malformed++;
    return;
  }
  if (p.kind == wire::FrameKind::kOther && p.ip_proto == wire::kIpProtoIgmp) {
    on_igmp(pl, p);
    if (nic_.on_raw_frame({f.data, f.len})) counters_.rx_raw++;  // a sniffer's rules may want it
    return;
  }
  const bool to_us = p.dst_mac == pl.port->mac() || p.dst_mac == wire::kBroadcastMac;
  if (p.kind == wire::FrameKind::kArp) {
    if (!to_us || p.arp.target_ip != cfg_.ip) {
      if (nic_.on_raw_frame({f.data, f.len})) counters_.rx_raw++;
      else counters_.rx_drop_not_ours++;
      return;
    }
    pl.arp.set(p.arp.sender_ip, p.arp.sender_mac);
    if (p.arp.op == wire::ArpOp::kRequest) send_arp(pl, true, p.arp.sender_ip, p.arp.sender_mac);
    return;
  }
  // A datagram to a multicast group (wire.md §8): the group's members here take it.
  if (p.kind == wire::FrameKind::kMetaRoce && wire::is_multicast_ipv4(p.dst_ip) &&
      p.dst_mac == wire::multicast_mac(p.dst_ip) &&
      nic_.on_datagram(p.src_ip, p.dst_ip, p.payload))
    return;
  if (p.kind != wire::FrameKind::kMetaRoce || !to_us || p.dst_ip != cfg_.ip) {
    // What the transport does not take, the flow rules of raw QPs may (verbs-mapping.md §18).
    if (nic_.on_raw_frame({f.data, f.len})) counters_.rx_raw++;
    else counters_.rx_drop_not_ours++;
    return;
  }
  // Every frame of ours teaches the peer's address, so ARP is rarely on the critical path.
  if (!pl.arp.count(p.src_ip)) pl.arp.set(p.src_ip, p.src_mac);
  nic_.on_packet(t, p.src_ip, p.src_port, p.ecn == wire::Ecn::kCe, p.payload,
                 static_cast<uint8_t>(&pl - planes_.data()));
}

void LinkLayer::loop_back(uint16_t udp_src_port, std::span<const uint8_t> udp_payload) {
  LoopPacket* p;
  if (loop_free_.empty()) {
    loop_pool_.push_back(std::make_unique<LoopPacket>());
    p = loop_pool_.back().get();
  } else {
    p = loop_free_.back();
    loop_free_.pop_back();
  }
  p->src_port = udp_src_port;
  p->bytes.assign(udp_payload.begin(), udp_payload.end());
  loop_queue_.push_back(p);
}

LinkLayer::Put LinkLayer::put_raw(const RawFrame& f) {
  // A datagram goes to the group's address on the first plane in service: the fabric (or the
  // peer of a point-to-point link) delivers it to every member. A raw QP's frame is whole already
  // and goes on plane 0.
  Plane* out = nullptr;
  if (f.group) {
    for (Plane& pl : planes_)
      if (!pl.udp && !pl.quiet && !pl.admin_down && pl.carrier && pl.link) {
        out = &pl;
        break;
      }
  } else if (!planes_.empty()) {
    Plane& pl = planes_[0];
    if (!pl.udp && !pl.quiet && !pl.admin_down && pl.link) out = &pl;
  }
  if (!out) return Put::kLost;
  const auto len = static_cast<uint32_t>(f.bytes.size());
  const uint32_t size = f.group ? kL2L4Header + len : len;
  io::TxFrame t;
  if (!out->port->alloc_tx(t, size)) return Put::kNoRoom;
  if (f.group) {
    wire::UdpFrameParams a;
    a.src_mac = out->port->mac();
    a.dst_mac = wire::multicast_mac(f.group);
    a.src_ip = cfg_.ip;
    a.dst_ip = f.group;
    a.src_port = f.src_port;
    a.dst_port = cfg_.udp_port;
    a.ecn = wire::Ecn::kNotEct;  // no congestion control answers for a group's datagrams
    wire::write_udp_headers({t.data, kL2L4Header}, a, len);
    std::memcpy(t.data + kL2L4Header, f.bytes.data(), len);
  } else {
    std::memcpy(t.data, f.bytes.data(), len);
  }
  t.len = size;
  // Captured once taken (a frame offered again is not seen twice); the port owns the buffer
  // then, so a capture keeps a copy.
  const bool capturing = capture_ && capture_->wants(static_cast<uint8_t>(out - planes_.data()));
  if (capturing) tap_copy_.assign(t.data, t.data + size);
  if (out->port->tx_try({&t, 1}) == 0) {
    t.len = 0;  // given back unsent
    out->port->tx_burst({&t, 1});
    return Put::kNoRoom;
  }
  if (capturing) tap(*out, tap_copy_);
  ++counters_.tx_frames;
  return Put::kLeft;
}

bool LinkLayer::send_raw(Time now) {
  if (raw_backlog_.empty()) return false;
  // A port that has had no room for this long is taken as stuck (a peer that stopped reading):
  // its frames are lost from then on, so that no WQE waits forever.
  constexpr auto kStuck = std::chrono::milliseconds(100);
  const bool stuck = raw_blocked_since_ != Time::min() && now - raw_blocked_since_ > kStuck;
  raw_left_.clear();
  // At most a burst a pass, so that a long backlog does not hold up receiving.
  while (!raw_backlog_.empty() && raw_left_.size() < kRxBurst) {
    RawFrame& f = raw_backlog_.front();
    const Put put = put_raw(f);
    if (put == Put::kNoRoom && !stuck) {
      if (raw_blocked_since_ == Time::min()) raw_blocked_since_ = now;
      break;
    }
    if (put == Put::kLeft)
      raw_blocked_since_ = Time::min();
    else  // lost; its WQE completes all the same
      ++(f.group ? counters_.tx_mcast_dropped : counters_.tx_raw_dropped);
    raw_left_.emplace_back(f.qpn, f.msn);
    // A NIC loops what it sends back to its own rules and multicast members, sent or not.
    (f.group ? mcast_loop_queue_ : raw_loop_queue_).push_back(std::move(f));
    raw_backlog_.pop_front();
  }
  if (raw_backlog_.empty()) raw_blocked_since_ = Time::min();  // the next frames wait again
  if (raw_left_.empty()) return false;
  nic_.raw_frames_left(raw_left_);
  return true;
}

bool LinkLayer::route(uint32_t peer) {
  bool changed = false;
  for (Plane& pl : planes_) {
    if (!pl.kernel) continue;
    const io::NextHop h = pl.port->next_hop(peer);
    auto old = pl.via.find(peer);
    const uint32_t before = old == pl.via.end() ? peer : old->second;
    if (h.ip == peer) {
      if (old != pl.via.end()) pl.via.erase(old);
    } else {
      pl.via[peer] = h.ip;
    }
    if (h.mac_known) {
      // The kernel's neighbour entry (static, or one it resolved itself) is the authority.
      pl.arp.set(h.ip, h.mac);
      pl.arp.set(peer, h.mac);
    } else if (before != h.ip) {
      pl.arp.erase(peer);
      changed = true;
    }
  }
  return changed;
}

// ARP (link.md §2) for the next hop of every peer an Ethernet plane cannot address yet: the peer
// itself, or, on a port with a kernel interface, the router the kernel's route names.
void LinkLayer::resolve(Time t) {
  for (uint32_t ip : nic_.take_resolve_requests()) {
    if (std::find(peers_.begin(), peers_.end(), ip) == peers_.end()) {
      peers_.push_back(ip);
      route(ip);
    }
    arp_asked_.try_emplace(ip);
  }
  // (Time::min() first: t - min overflows, and the refresh never ran until UBSan said so.)
  if (routes_checked_ == Time::min() || t - routes_checked_ >= kRouteRefresh) {
    routes_checked_ = t;
    for (uint32_t ip : peers_)
      if (route(ip)) arp_asked_.try_emplace(ip);
  }
  for (auto it = arp_asked_.begin(); it != arp_asked_.end();) {
    const uint32_t peer = it->first;
    Asking& a = it->second;
    if (a.first == Time::min()) a.first = t;
    const bool due = a.last == Time::min() ||
                     t - a.last >= (t - a.first < kArpPatience ? kArpRetry : kArpRetrySlow);
    bool all = true;
    for (Plane& pl : planes_) {
      if (pl.udp || pl.arp.count(peer)) continue;
      auto via = pl.via.find(peer);
      const uint32_t hop = via == pl.via.end() ? peer : via->second;
      if (const io::MacAddr* mac = pl.arp.find(hop)) {
        pl.arp.set(peer, *mac);
        continue;
      }
      all = false;
      if (due && !pl.quiet) send_arp(pl, false, hop, wire::kBroadcastMac);
    }
    if (all) {
      it = arp_asked_.erase(it);
      continue;
    }
    if (due) a.last = t;
    ++it;
  }
}

std::unique_ptr<Capture> LinkLayer::set_capture(std::unique_ptr<Capture> capture) {
  if (capture_) capture_->flush();
  std::swap(capture_, capture);
  return capture;
}

bool LinkLayer::set_plane_admin(size_t plane, bool up) {
  if (plane >= planes_.size()) return false;
  const bool was_down = planes_[plane].admin_down;
  planes_[plane].admin_down = !up;
  carrier_checked_ = Time::min();  // told at the next poll
  if (was_down && up) report_groups(planes_[plane]);
  return true;
}

uint32_t LinkLayer::planes_up() const {
  uint32_t m = 0;
  for (size_t i = 0; i < planes_.size(); ++i) m |= planes_[i].reported_up ? 1u << i : 0;
  return m;
}

uint32_t LinkLayer::planes_admin_down() const {
  uint32_t m = 0;
  for (size_t i = 0; i < planes_.size(); ++i) m |= planes_[i].admin_down ? 1u << i : 0;
  return m;
}

// Every 10 ms: a port's link state costs a call into the driver.
void LinkLayer::check_planes(Time t) {
  if (carrier_checked_ != Time::min() && t - carrier_checked_ < std::chrono::milliseconds(10))
    return;
  carrier_checked_ = t;
  bool port = false;
  for (size_t i = 0; i < planes_.size(); ++i) {
    Plane& pl = planes_[i];
    const bool link = pl.port->link_up();
    if (link && !pl.link) report_groups(pl);
    pl.link = link;
    pl.carrier_seen |= link;
    port |= !pl.admin_down && (link || !pl.carrier_seen);
    // One plane: nothing to move its traffic to; its link state is the goodbye logic's.
    if (planes_.size() > 1) pl.carrier = link;
    const bool up = !pl.admin_down && pl.carrier;
    if (up != pl.reported_up) {
      pl.reported_up = up;
      nic_.set_plane_up(t, static_cast<uint8_t>(i), up);
    }
  }
  if (port != port_active_) {
    port_active_ = port;
    nic_.set_port_active(port);
  }
}

bool LinkLayer::poll(Time t, bool timers) {
  bool work = false;
  check_planes(t);
  if (nic_.has_group_changes()) {
    for (const auto& [group, joined] : nic_.take_group_changes())
      for (Plane& pl : planes_)
        send_igmp(pl, joined ? wire::IgmpType::kV2Report : wire::IgmpType::kLeave, group);
    work = true;
  }
  for (size_t i = 0; i < planes_.size(); ++i) {
    Plane& pl = planes_[i];
    pl.rx_n = 0;
    if (pl.admin_down) {
      // Set down: what arrives is dropped, as by a port that is off.
      const uint32_t n = pl.port->rx_burst(pl.rx);
      if (n) pl.port->release({pl.rx.data(), n});
      continue;
    }
    if (pl.quiet) {
      // Resume once the old peer is gone and a new one connected (or after kQuietMax).
      const bool up = pl.port->link_up();
      pl.quiet_saw_down |= !up;
      if (up && (pl.quiet_saw_down || t - pl.quiet_since > kQuietMax)) pl.quiet = false;
      if (pl.quiet) continue;
    }
    pl.rx_n = pl.port->rx_burst(pl.rx);
    for (uint32_t k = 0; k < pl.rx_n; ++k) handle_frame(t, pl, pl.rx[k]);
    work |= pl.rx_n != 0;
  }
  if (!loop_queue_.empty()) {
    // Packets this device sent itself, delivered as if they had come back from the wire.
    loop_batch_.swap(loop_queue_);
    for (LoopPacket* p : loop_batch_) nic_.on_packet(t, cfg_.ip, p->src_port, false, p->bytes);
    work = true;
  }
  if (!raw_loop_queue_.empty()) {
    raw_loop_batch_.swap(raw_loop_queue_);
    for (const RawFrame& f : raw_loop_batch_)
      if (nic_.on_raw_frame(f.bytes)) counters_.rx_raw++;
    work = true;
  }
  if (!mcast_loop_queue_.empty()) {
    mcast_loop_batch_.swap(mcast_loop_queue_);
    for (const RawFrame& f : mcast_loop_batch_) nic_.on_datagram(cfg_.ip, f.group, f.bytes);
    work = true;
  }
  // The frames' bytes are what the NIC writes into application memory: released after it did.
  nic_.end_rx(t);
  for (Plane& pl : planes_)
    if (pl.rx_n) pl.port->release({pl.rx.data(), pl.rx_n});
  for (LoopPacket* p : loop_batch_) loop_free_.push_back(p);
  loop_batch_.clear();
  raw_loop_batch_.clear();
  mcast_loop_batch_.clear();
  resolve(t);
  if (nic_.poll_tx(t, *sink_, timers)) work = true;
  for (RawFrame& f : nic_.take_raw_frames()) raw_backlog_.push_back(std::move(f));
  if (send_raw(t) || !raw_backlog_.empty()) work = true;
  return work;
}

size_t LinkLayer::rx_wait_fds(int* out, size_t room) const {
  if (planes_.size() > room) return 0;
  for (size_t p = 0; p < planes_.size(); ++p) {
    out[p] = planes_[p].port->rx_wait_fd();
    if (out[p] < 0) return 0;
  }
  return planes_.size();
}

void LinkLayer::rx_arm() {
  for (Plane& pl : planes_) pl.port->rx_arm();
}

void LinkLayer::rx_disarm() {
  for (Plane& pl : planes_) pl.port->rx_disarm();
}

}  // namespace metaroce::nic
