// SPDX-License-Identifier: Apache-2.0
// The fabric core: forwarding (learning, flooding, ECMP), per-link queues with rate, tail drop,
// ECN marking, loss, delay, reordering, duplication and black holes, all on the caller's clock.
#include "datapath/fabric/fabric.h"

#include <algorithm>
#include <span>

#include "datapath/wire/bytes.h"

namespace metaroce::fabric {
namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdull;
  z = (z ^ (z >> 33)) * 0xc4ceb9fe1a85ec53ull;
  return z ^ (z >> 33);
}

uint64_t mac_bits(const wire::MacAddr& m) {
  uint64_t v = 0;
  for (uint8_t b : m) v = (v << 8) | b;
  return v;
}

// Whether parse_frame got far enough to have read (and checked) the IPv4 header.
bool ipv4_header_valid(const wire::FrameInfo& info) {
  using wire::FrameError;
  switch (info.error) {
    case FrameError::kNone: return info.kind == wire::FrameKind::kMetaRoce;
    case FrameError::kNotUdp:
    case FrameError::kWrongPort:
    case FrameError::kUdpLength:
    case FrameError::kUdpChecksum: return true;
    default: return false;
  }
}

// Serialisation time of len bytes at rate bits/s, rounded up so that back-to-back frames never
// exceed the rate. Frames are far below 2^31 bytes, so len * 8e9 fits in 64 bits.
int64_t serialisation_ns(uint32_t len, uint64_t rate_bps) {
  if (rate_bps == 0) return 0;
  const uint64_t bits_ns = uint64_t{std::min(len, 1u << 30)} * 8 * 1'000'000'000u;
  return static_cast<int64_t>(bits_ns / rate_bps + (bits_ns % rate_bps != 0));
}

}  // namespace

std::string FabricConfig::validate() const {
  if (endpoints < 1 || endpoints > kMaxEndpoints)
    return "endpoints must be 1.." + std::to_string(kMaxEndpoints);
  if (planes < 1 || planes > kMaxPlanes) return "planes must be 1.." + std::to_string(kMaxPlanes);
  if (links_per_plane < 1 || links_per_plane > kMaxLinksPerPlane)
    return "links per plane must be 1.." + std::to_string(kMaxLinksPerPlane);
  if (max_in_flight < 16) return "max_in_flight must be at least 16";
  for (const LinkParams* p : {&core, &edge}) {
    if (!(p->loss >= 0 && p->loss <= 1)) return "loss must be 0..1";
    if (!(p->reorder >= 0 && p->reorder <= 1)) return "reorder must be 0..1";
    if (!(p->duplicate >= 0 && p->duplicate <= 1)) return "duplicate must be 0..1";
    if (p->delay.count() < 0 || p->reorder_delay.count() < 0) return "delays must be >= 0";
    if (p->queue_bytes == 0) return "queue must hold at least one byte";
  }
  return {};
}

uint32_t ecmp_link(uint32_t src_ip, uint32_t dst_ip, uint8_t proto, uint16_t src_port,
                   uint16_t dst_port, uint64_t seed, uint32_t links) {
  uint64_t h = mix64(seed ^ ((uint64_t{src_ip} << 32) | dst_ip));
  h = mix64(h ^ ((uint64_t{proto} << 32) | (uint64_t{src_port} << 16) | dst_port));
  return links <= 1 ? 0 : static_cast<uint32_t>(h % links);
}

bool mark_ce(uint8_t* frame, uint32_t len) {
  if (len < wire::kEthHeaderLen + wire::kIpv4HeaderLen ||
      wire::load_be16(frame + 12) != wire::kEtherTypeIpv4)
    return false;
  uint8_t* ip = frame + wire::kEthHeaderLen;
  const uint32_t ihl = uint32_t{ip[0] & 0x0fu} * 4;
  if ((ip[0] >> 4) != 4 || ihl < wire::kIpv4HeaderLen || wire::kEthHeaderLen + ihl > len)
    return false;
  const auto ecn = static_cast<wire::Ecn>(ip[1] & 3);
  if (ecn == wire::Ecn::kNotEct) return false;
  if (ecn == wire::Ecn::kCe) return true;
  ip[1] = static_cast<uint8_t>(ip[1] | 3);
  wire::store_be16(ip + 10, 0);
  wire::store_be16(ip + 10, static_cast<uint16_t>(~wire::ones_complement_sum({ip, ihl})));
  return true;
}

Fabric::Fabric(const FabricConfig& config, FrameSink* sink)
    : config_(config), sink_(sink), rng_(config.seed) {
  const uint32_t per_plane = config_.links_per_plane + config_.endpoints;
  links_.resize(size_t{per_plane} * config_.planes);
  for (uint32_t i = 0; i < links_.size(); ++i)
    links_[i].params = link_id(i).kind == LinkKind::kCore ? config_.core : config_.edge;
  learnt_.resize(size_t{config_.planes} * config_.endpoints);
  records_.resize(config_.max_in_flight);
  free_records_.reserve(config_.max_in_flight);
  for (uint32_t i = config_.max_in_flight; i-- > 0;) free_records_.push_back(i);
  heap_.reserve(config_.max_in_flight);
}

Fabric::~Fabric() {
  for (const Event& e : heap_) sink_->discard(records_[e.record].frame);
}

std::optional<uint32_t> Fabric::link_index(const LinkId& id) const {
  if (id.plane >= config_.planes) return std::nullopt;
  const uint32_t base = id.plane * (config_.links_per_plane + config_.endpoints);
  if (id.kind == LinkKind::kCore) {
    if (id.index >= config_.links_per_plane) return std::nullopt;
    return base + id.index;
  }
  if (id.index >= config_.endpoints) return std::nullopt;
  return base + config_.links_per_plane + id.index;
}

LinkId Fabric::link_id(uint32_t index) const {
  const uint32_t per_plane = config_.links_per_plane + config_.endpoints;
  LinkId id;
  id.plane = index / per_plane;
  const uint32_t i = index % per_plane;
  if (i < config_.links_per_plane) {
    id.kind = LinkKind::kCore;
    id.index = i;
  } else {
    id.kind = LinkKind::kEdge;
    id.index = i - config_.links_per_plane;
  }
  return id;
}

std::string Fabric::link_name(uint32_t index) const {
  const LinkId id = link_id(index);
  return "p" + std::to_string(id.plane) + (id.kind == LinkKind::kCore ? ".core" : ".edge") +
         std::to_string(id.index);
}

uint32_t Fabric::edge_link(uint32_t plane, uint32_t endpoint) const {
  return plane * (config_.links_per_plane + config_.endpoints) + config_.links_per_plane +
         endpoint;
}

bool Fabric::event_after(const Event& a, const Event& b) {
  return a.at_ns != b.at_ns ? a.at_ns > b.at_ns : a.seq > b.seq;
}

std::optional<uint32_t> Fabric::take_record() {
  if (free_records_.empty()) return std::nullopt;
  const uint32_t r = free_records_.back();
  free_records_.pop_back();
  records_[r].next = kNone;
  return r;
}

void Fabric::drop(uint32_t record) {
  sink_->discard(records_[record].frame);
  free_records_.push_back(record);
}

std::optional<uint32_t> Fabric::endpoint_of(uint32_t plane, const wire::MacAddr& mac) const {
  if (plane >= config_.planes) return std::nullopt;
  for (uint32_t e = 0; e < config_.endpoints; ++e) {
    const Learnt& l = learnt_[size_t{plane} * config_.endpoints + e];
    if (l.known && l.mac == mac) return e;
  }
  return std::nullopt;
}

void Fabric::ingress(uint32_t endpoint, uint32_t plane, FrameRef frame, Nanos now) {
  ++stats_.frames_in;
  if (endpoint >= config_.endpoints || plane >= config_.planes ||
      frame.len < wire::kEthHeaderLen) {
    ++stats_.dropped_no_route;
    sink_->discard(frame);
    return;
  }
  const wire::FrameInfo info =
      wire::parse_frame({frame.data, frame.len}, config_.udp_port);
  const bool ip_ok = ipv4_header_valid(info);

  // Learning: what an endpoint sends from tells the plane where that MAC and IP live.
  Learnt& me = learnt_[size_t{plane} * config_.endpoints + endpoint];
  if ((info.src_mac[0] & 1) == 0) {
    me.mac = info.src_mac;
    me.known = true;
  }
  if (ip_ok && info.src_ip != 0) me.ip = info.src_ip;
  if (info.kind == wire::FrameKind::kArp && info.arp.sender_ip != 0) me.ip = info.arp.sender_ip;

  uint32_t dst = kFlood;
  if ((info.dst_mac[0] & 1) == 0) {
    if (auto e = endpoint_of(plane, info.dst_mac)) {
      dst = *e;
    } else if (ip_ok) {
      // An unknown MAC but a known address: route at layer 3, as a leaf would.
      for (uint32_t e = 0; e < config_.endpoints; ++e) {
        const Learnt& l = learnt_[size_t{plane} * config_.endpoints + e];
        if (l.ip != 0 && l.ip == info.dst_ip) {
          dst = e;
          break;
        }
      }
    }
  }
  if (dst == endpoint) {
    ++stats_.dropped_no_route;
    sink_->discard(frame);
    return;
  }
  if (dst == kFlood) ++stats_.flooded;

  uint32_t core;
  if (ip_ok) {
    const uint8_t proto = frame.data[wire::kEthHeaderLen + 9];
    core = ecmp_link(info.src_ip, info.dst_ip, proto, info.src_port, info.dst_port,
                     config_.seed, config_.links_per_plane);
  } else {
    // Not IP (ARP, other EtherTypes): the MAC pair stands in for the flow.
    core = ecmp_link(static_cast<uint32_t>(mac_bits(info.src_mac)),
                     static_cast<uint32_t>(mac_bits(info.dst_mac)), 0,
                     static_cast<uint16_t>(mac_bits(info.src_mac) >> 32),
                     static_cast<uint16_t>(mac_bits(info.dst_mac) >> 32), config_.seed,
                     config_.links_per_plane);
  }

  auto r = take_record();
  if (!r) {
    ++stats_.dropped_no_record;
    sink_->discard(frame);
    return;
  }
  Record& rec = records_[*r];
  rec.frame = frame;
  rec.src = endpoint;
  rec.dst = dst;
  enqueue(plane * (config_.links_per_plane + config_.endpoints) + core, *r, now.count());
}

void Fabric::drain(Link& l, int64_t now_ns) {
  while (l.head != kNone && records_[l.head].depart_ns <= now_ns) {
    l.stats.queue_bytes -= records_[l.head].frame.len;
    l.head = records_[l.head].next;
  }
  if (l.head == kNone) l.tail = kNone;
}

void Fabric::enqueue(uint32_t link, uint32_t record, int64_t now_ns, bool copy) {
  Link& l = links_[link];
  Record& rec = records_[record];
  const uint32_t len = rec.frame.len;
  if (!copy) {
    l.stats.frames_in++;
    l.stats.bytes_in += len;
  }
  if (!l.params.up) {
    ++l.stats.drop_down;
    return drop(record);
  }
  if (!copy && rng_.chance(l.params.loss)) {
    ++l.stats.drop_loss;
    return drop(record);
  }
  drain(l, now_ns);
  if (l.stats.queue_bytes + len > l.params.queue_bytes) {
    ++l.stats.drop_queue;
    return drop(record);
  }
  // Marking on the occupancy the frame finds, as a switch's egress queue does on enqueue.
  if (l.stats.queue_bytes > l.params.ecn_threshold_bytes && mark_ce(rec.frame.data, len))
    ++l.stats.ce_marked;

  const int64_t start = std::max(now_ns, l.busy_until_ns);
  rec.depart_ns = start + serialisation_ns(len, l.params.rate_bps);
  l.busy_until_ns = rec.depart_ns;
  rec.next = kNone;
  if (l.tail == kNone) {
    l.head = record;
  } else {
    records_[l.tail].next = record;
  }
  l.tail = record;
  l.stats.queue_bytes += len;
  l.stats.max_queue_bytes = std::max(l.stats.max_queue_bytes, l.stats.queue_bytes);

  int64_t at = rec.depart_ns + l.params.delay.count();
  if (rng_.chance(l.params.reorder)) {
    at += l.params.reorder_delay.count();
    ++l.stats.reordered;
  }
  rec.link = link;
  rec.epoch = l.epoch;
  heap_.push_back(Event{at, next_seq_++, record});
  std::push_heap(heap_.begin(), heap_.end(), event_after);

  // A duplicate queues right behind the original (records_ never reallocates: `rec` stays valid).
  if (copy || !rng_.chance(l.params.duplicate)) return;
  auto dup = take_record();
  if (!dup) {
    ++stats_.dropped_no_record;
    return;
  }
  if (!sink_->clone(rec.frame, &records_[*dup].frame)) {
    ++stats_.dropped_no_buffer;
    free_records_.push_back(*dup);
    return;
  }
  records_[*dup].src = rec.src;
  records_[*dup].dst = rec.dst;
  ++l.stats.duplicated;
  enqueue(link, *dup, now_ns, true);
}

uint32_t Fabric::advance(Nanos now) {
  uint32_t delivered = 0;
  while (!heap_.empty() && heap_.front().at_ns <= now.count()) {
    std::pop_heap(heap_.begin(), heap_.end(), event_after);
    const Event ev = heap_.back();
    heap_.pop_back();
    Record& rec = records_[ev.record];
    Link& l = links_[rec.link];
    if (rec.epoch != l.epoch) {  // the link went down while the frame was on it
      ++l.stats.drop_down;
      drop(ev.record);
      continue;
    }
    drain(l, ev.at_ns);  // takes this frame off the link's FIFO too: it departed by now
    ++l.stats.frames_out;
    l.stats.bytes_out += rec.frame.len;
    const LinkId id = link_id(rec.link);
    if (id.kind == LinkKind::kEdge) {
      stats_.delivered_bytes_from[rec.src] += rec.frame.len;
      sink_->deliver(id.index, id.plane, rec.frame);
      free_records_.push_back(ev.record);
      ++stats_.delivered;
      ++delivered;
      continue;
    }
    // At the spine: on to the destination's edge link, or a copy to every other endpoint.
    if (rec.dst != kFlood) {
      enqueue(edge_link(id.plane, rec.dst), ev.record, ev.at_ns);
      continue;
    }
    uint32_t last = kFlood;
    for (uint32_t e = 0; e < config_.endpoints; ++e)
      if (e != rec.src) last = e;
    if (last == kFlood) {
      drop(ev.record);
      continue;
    }
    for (uint32_t e = 0; e < last; ++e) {
      if (e == rec.src) continue;
      auto copy = take_record();
      if (!copy) {
        ++stats_.dropped_no_record;
        continue;
      }
      if (!sink_->clone(rec.frame, &records_[*copy].frame)) {
        ++stats_.dropped_no_buffer;
        free_records_.push_back(*copy);
        continue;
      }
      records_[*copy].src = rec.src;
      records_[*copy].dst = e;
      enqueue(edge_link(id.plane, e), *copy, ev.at_ns);
    }
    rec.dst = last;
    enqueue(edge_link(id.plane, last), ev.record, ev.at_ns);
  }
  return delivered;
}

std::optional<Nanos> Fabric::next_event() const {
  if (heap_.empty()) return std::nullopt;
  return Nanos(heap_.front().at_ns);
}

void Fabric::set_params(uint32_t index, const LinkParams& params, Nanos now) {
  Link& l = links_[index];
  const bool going_down = l.params.up && !params.up;
  l.params = params;
  if (!going_down) return;
  // Everything queued or propagating is lost: the records still in the event heap see a new
  // epoch when they come due and are dropped then.
  ++l.epoch;
  l.head = l.tail = kNone;
  l.stats.queue_bytes = 0;
  l.busy_until_ns = now.count();
}

LinkStats Fabric::link_stats(uint32_t index, Nanos now) {
  Link& l = links_[index];
  drain(l, now.count());
  return l.stats;
}

}  // namespace metaroce::fabric
