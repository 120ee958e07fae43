// SPDX-License-Identifier: Apache-2.0
// The transport's sending side (congestion.md §2, §5): a path's timers and choice, in-flight
// records and their resolution, submission, and the packets each poll sends: ACKs, resends,
// failover copies, new data.
#include "datapath/transport/engine_impl.h"

#include <algorithm>

#include "datapath/transport/engine_util.h"
#include "datapath/transport/path_seq.h"

namespace metaroce::transport {

using detail::DescState;
using detail::kNil;
using detail::kNoSlot;

// RFC 6298 from the path's own samples, clamped, then exponential back-off (spec §6.3).
Time EngineImpl::rto(const TxPath& tp, uint8_t backoff) const {
  Time base = cfg_.rto_initial;
  if (tp.srtt_ns != 0) base = Time(int64_t{tp.srtt_ns} + std::max<int64_t>(4 * int64_t{tp.rttvar_ns}, 1000));
  base = std::clamp(base, cfg_.rto_min, cfg_.rto_max);
  backoff = std::max(backoff, tp.backoff);
  for (uint8_t i = 0; i < backoff && base < cfg_.rto_max; ++i) base *= 2;
  return std::min(base, cfg_.rto_max);
}

uint32_t EngineImpl::seg_len(uint32_t slot, uint32_t offset) const {
  const MessageDesc& m = slots_[slot].m;
  if (m.op == Op::kReadReq) return 0;
  return std::min(seg_size_, m.length - offset);
}

// The path's own smoothed RTT, or before its first sample the smallest of its siblings'; 0 when
// the connection has none.
int64_t EngineImpl::srtt_ref(const Connection& c, const TxPath& tp) const {
  return tp.srtt_ns ? tp.srtt_ns : c.min_srtt_ns;
}

// The smallest smoothed RTT of the connection's active paths, kept in c.min_srtt_ns: called
// wherever a path's RTT or state changes, since the sprayer needs it for every packet.
void EngineImpl::refresh_min_srtt(Connection& c) {
  uint32_t best = 0;
  for (const TxPath& o : c.tx) {
    if (o.srtt_ns && o.state == PathState::kActive && (!best || o.srtt_ns < best)) best = o.srtt_ns;
  }
  c.min_srtt_ns = best;
}

bool EngineImpl::path_open(const Connection& c, const TxPath& tp) const {
  return tp.state == PathState::kActive && usable_plane(c, tp.plane) &&
         c.plane_in_flight[tp.plane] < window_packets(c.plane_cwnd[tp.plane]) &&
         tp.next_seq - tp.una < kPathWindow &&
         tp.in_flight < window_packets(tp.cwnd);
}

// Spraying (congestion.md §2.4): round-robin over open paths, preferring those without a recent
// CE mark, then those whose smoothed RTT is within 1.5x of the connection's best; a packet
// leaving a suspected path avoids that path's plane while another plane has room (§4.2).
uint16_t EngineImpl::choose_path(const Connection& c, Time now, int avoid_plane,
                                 uint16_t exclude) const {
  const uint16_t np = c.paths_used;
  const uint32_t min_srtt = c.min_srtt_ns;
  if (c.mask_planes < 2) avoid_plane = -1;
  uint16_t best = kNoPath;
  int best_class = 8;
  for (uint16_t k = 0; k < np; ++k) {
    const auto p = static_cast<uint16_t>((c.rr_next + k) % np);
    const TxPath& tp = c.tx[p];
    if (p == exclude || !path_open(c, tp)) continue;
    int cls = 0;
    const int64_t rtt = std::max<int64_t>(tp.srtt_ns, 1000);
    if (now.count() - tp.last_md_ns < 2 * rtt) cls += 2;
    // A slow path's sample goes stale when it carries nothing: after 8 of the best RTTs without
    // progress it is tried again, or a path slow once (an early timeout, a repath) would never
    // get the packet that shows it is fast now.
    if (min_srtt && uint64_t{tp.srtt_ns} * 2 > uint64_t{min_srtt} * 3 &&
        now.count() - tp.last_progress_ns < 8 * int64_t{min_srtt})
      cls += 1;
    if (tp.plane == avoid_plane) cls += 4;
    if (cls < best_class) {
      best = p;
      best_class = cls;
      if (cls == 0) break;
    }
  }
  return best;
}

uint32_t EngineImpl::alloc_slot() {
  if (!free_slots_.empty()) {
    const uint32_t s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }
  slots_.emplace_back();
  return static_cast<uint32_t>(slots_.size() - 1);
}

// ---------------------------------------------------------------------------------------------
// In-flight records

void EngineImpl::list_append(Connection& c, uint16_t path, uint16_t idx) {
  TxPath& tp = c.tx[path];
  TxDesc& d = c.pool[idx];
  d.next = kNil;
  d.path = path;
  d.state = DescState::kInFlight;
  if (tp.tail != kNil) c.pool[tp.tail].next = idx;
  else tp.head = idx;
  tp.tail = idx;
  ++tp.in_flight;
  ++c.plane_in_flight[tp.plane];
}

void EngineImpl::list_remove(Connection& c, uint16_t path, uint16_t prev, uint16_t idx) {
  TxPath& tp = c.tx[path];
  TxDesc& d = c.pool[idx];
  if (prev == kNil) tp.head = d.next;
  else c.pool[prev].next = d.next;
  if (tp.tail == idx) tp.tail = prev;
  d.next = kNil;
  --tp.in_flight;
  --c.plane_in_flight[tp.plane];
}

uint16_t EngineImpl::find_in_flight(const Connection& c, uint16_t path, uint32_t seq) const {
  for (uint16_t i = c.tx[path].head; i != kNil; i = c.pool[i].next) {
    if (c.pool[i].seq == seq) return i;
  }
  return kNil;
}

// The message of the packet sent as `seq` on `path`, wherever it is now: still on that path, or
// moved off it (a failover copy in flight elsewhere, or waiting to go); kNoSlot if resolved.
uint32_t EngineImpl::find_named(const Connection& c, uint16_t path, uint32_t seq) const {
  const uint16_t idx = find_in_flight(c, path, seq);
  if (idx != kNil) return c.pool[idx].slot;
  if (!c.tx[path].moved) return kNoSlot;
  auto names = [&](const TxDesc& d) {
    return (d.flags & detail::kCopy) && d.orig_path == path && d.orig_seq == seq;
  };
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    if (p == path) continue;
    for (uint16_t i = c.tx[p].head; i != kNil; i = c.pool[i].next) {
      if (names(c.pool[i])) return c.pool[i].slot;
    }
  }
  for (uint16_t i = c.move_head; i != kNil; i = c.pool[i].next) {
    if (names(c.pool[i])) return c.pool[i].slot;
  }
  return kNoSlot;
}

void EngineImpl::free_desc(Connection& c, uint16_t idx) {
  TxDesc& d = c.pool[idx];
  d = TxDesc{};
  d.next = c.free_head;
  c.free_head = idx;
  --c.in_flight;
}

// The record left every list: release the pin its failover copy held on the original path.
void EngineImpl::resolve(Connection& c, uint16_t idx) {
  const TxDesc& d = c.pool[idx];
  if (d.flags & detail::kCopy) {
    TxPath& op = c.tx[d.orig_path];
    if (op.moved && --op.moved == 0) update_una(c, d.orig_path);
  }
  free_desc(c, idx);
}

void EngineImpl::update_una(Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  uint32_t u = tp.head != kNil ? c.pool[tp.head].seq : tp.next_seq;
  // A moved packet is unresolved until its copy is: the receiver must still be able to tell
  // whether the original arrived (congestion.md §4.3).
  if (tp.moved && seq_lt(tp.moved_floor, u)) u = tp.moved_floor;
  tp.una = u;
}

// A resend request: the connection's own queue (paced with its other packets, §3.3), and the
// connection on the engine's list of those with resends to send, in the order they first asked.
// An entry whose record moved or was freed since has lost kRetxQueued and is skipped.
void EngineImpl::queue_retx(Connection& c, uint16_t idx) {
  c.pool[idx].flags |= detail::kRetxQueued;
  c.retx_q.push_back(idx);
  if (!c.retx_listed) {
    c.retx_listed = true;
    retx_conns_.push_back(&c);
  }
}

// A connection that has no share from its peer yet, where shares are in use, sends at most
// start_window packets: the share comes with the first ACK (congestion.md §3.4). A share is
// forgotten by the peer once we have sent it nothing for kActiveIntervals of its intervals, so
// after such a pause ours is dropped too and the next burst waits for a fresh one.
bool EngineImpl::start_held(Time now, Connection& c) {
  if (!cfg_.rx_capacity_mbps || !cfg_.start_window || !c.rate_hints ||
      c.peer_shares == detail::PeerShares::kNo) {
    return false;
  }
  if (c.hint_mbps && now.count() - c.last_tx_ns > kActiveIntervals * cfg_.hint_interval.count()) {
    c.hint_mbps = 0;
  }
  return !c.hint_mbps && c.in_flight >= cfg_.start_window;
}

// With a rate hint, whether a packet of len bytes (UDP payload) must wait for credit; if so, the
// connection's pace_at says until when (congestion.md §3.3).
bool EngineImpl::must_wait(Time now, Connection& c, uint32_t len) {
  if (!c.hint_mbps) return false;
  refill(c, now);
  const int64_t cost = int64_t{len} * 8000;
  if (c.credit >= cost) return false;
  c.pace_at = now + Time((cost - c.credit + c.hint_mbps - 1) / c.hint_mbps);
  ++stats_.pacing_waits;
  return true;
}

uint32_t EngineImpl::packet_len(const TxDesc& d) const {
  return headers_len(slots_[d.slot].m) + seg_len(d.slot, d.offset);
}

// The connection's queued resends, oldest request first, as its credit allows. False when the
// sink is full.
bool EngineImpl::send_retx(Time now, Connection& c, TxSink& sink, uint32_t& sent) {
  size_t i = 0;
  bool ok = true;
  for (; i < c.retx_q.size(); ++i) {
    const uint16_t idx = c.retx_q[i];
    const TxDesc& d = c.pool[idx];
    if (d.state != DescState::kInFlight || !(d.flags & detail::kRetxQueued)) continue;
    if (must_wait(now, c, packet_len(d))) break;
    if (!emit_data(now, c, idx, sink, TxKind::kRetx)) {
      ok = false;
      break;
    }
    ++sent;
    const uint64_t copies = stats_.redundant_copies;
    ok = emit_redundant(now, c, idx, sink);
    sent += static_cast<uint32_t>(stats_.redundant_copies - copies);
    if (!ok) {
      ++i;
      break;
    }
  }
  c.retx_q.erase(c.retx_q.begin(), c.retx_q.begin() + static_cast<std::ptrdiff_t>(i));
  return ok;
}

// ---------------------------------------------------------------------------------------------
// Submission and sending

void EngineImpl::submit(const MessageDesc& msg) {
  Connection& c = conn_for(msg.peer_ip, msg.lane);
  ensure_send(c);
  const uint32_t idx = alloc_slot();
  detail::MsgSlot& s = slots_[idx];
  s = detail::MsgSlot{};
  s.m = msg;
  // kReadReq and a zero-length message are one packet without payload (spec §4.1).
  s.pkts_total = (msg.op == Op::kReadReq || msg.length == 0)
                     ? 1
                     : static_cast<uint32_t>((uint64_t{msg.length} + seg_size_ - 1) / seg_size_);
  s.prev = c.tail;
  if (c.tail != kNoSlot) slots_[c.tail].next = idx;
  else c.head = idx;
  c.tail = idx;
  if (c.cursor == kNoSlot) c.cursor = idx;
}

// Token bucket on the engine's clock: credit in Mbit/s * ns, a byte costs 8000 (congestion.md §3.3).
void EngineImpl::refill(Connection& c, Time now) {
  if (!c.hint_mbps) return;
  int64_t el = now.count() - c.credit_ns;
  c.credit_ns = now.count();
  if (el <= 0) return;
  el = std::min<int64_t>(el, 1'000'000'000);
  const int64_t cap = int64_t{kPaceBurst} * cfg_.max_packet * 8000;
  c.credit = std::min(cap, c.credit + el * c.hint_mbps);
}

// Writes one data packet of record d's segment on `path` with sequence `seq`: the record's own
// transmission, or a redundant copy of it (§5.2). False when the sink has no room.
bool EngineImpl::write_data(Time now, Connection& c, const TxDesc& d, uint16_t path, uint32_t seq,
                            uint16_t flags, uint32_t orig_seq, TxSink& sink) {
  const MessageDesc& m = slots_[d.slot].m;
  const uint32_t plen = seg_len(d.slot, d.offset);
  const uint32_t hlen = headers_len(m);
  const uint32_t len = hlen + plen;
  TxPath& tp = c.tx[path];
  std::span<uint8_t> buf = sink.begin(len, tp.plane);
  if (buf.size() < len) return false;

  wire::BaseHeader b;
  b.opcode = static_cast<wire::Opcode>(m.op);
  // It has more waiting to go than this packet: its receiver's share holds it back (§3.2).
  const bool more = c.cursor != kNoSlot || c.move_head != kNil || c.retx_q.size() > 1;
  b.flags = static_cast<uint16_t>(flags | (more ? wire::kFlagMore : 0) |
                                  (m.xrc ? wire::kFlagXrc : 0));
  b.conn_id = c.conn_id;
  b.token = c.token;
  b.path_id = path;
  b.path_count = static_cast<uint16_t>(c.tx.size());
  b.path_seq = seq;
  b.timestamp = ts32(now);
  b.ack_floor = tp.una;  // never above seq: una <= every listed seq <= next_seq
  wire::DataHeader h;
  h.dst_stream = m.dst_stream;
  h.src_stream = m.src_stream;
  h.msn = m.msn;
  h.rsn = m.rsn;
  h.offset = d.offset;
  h.total_length = m.length;
  h.remote_addr = m.remote_addr;
  h.rkey = m.rkey;
  h.imm = m.imm;
  h.payload_len = plen;
  h.orig_seq = orig_seq;
  h.xrc_srqn = m.xrc_srqn & wire::kXrcSrqnMask;
  wire::encode_data(buf, b, h);
  if (plen) host_.gather(m.cookie, d.offset, buf.subspan(hlen, plen));
  sink.commit(c.peer_ip, tp.port, tp.plane, len);
  // Strictly increasing per connection, so that packets a poll sends at one instant still have
  // an order for late-packet detection (§5.1): a nanosecond apart.
  c.last_tx_ns = std::max<int64_t>(now.count(), c.last_tx_ns + 1);
  detail::PathCounters& pc = c.counters[path];
  ++pc.tx_packets;
  pc.tx_bytes += len;
  ++stats_.tx_packets;
  stats_.tx_bytes += len;
  if (c.hint_mbps) {
    refill(c, now);
    const int64_t cap = int64_t{kPaceBurst} * cfg_.max_packet * 8000;
    c.credit = std::max(c.credit - int64_t{len} * 8000, -4 * cap);
  }
  return true;
}

bool EngineImpl::emit_data(Time now, Connection& c, uint16_t idx, TxSink& sink, TxKind kind) {
  TxDesc& d = c.pool[idx];
  TxPath& tp = c.tx[d.path];
  const bool copy = d.flags & detail::kCopy;
  // Its timeouts back its timer off only while the peer has said nothing since it last left
  // (expire()): the back-off it carries to a new path is 0 when the connection made progress.
  const uint8_t backoff =
      d.rto_retries && !heard_since(c, d.sent_ts, now) ? d.rto_retries : 0;
  if (!write_data(now, c, d, d.path, d.seq, copy ? wire::failover_flags(d.orig_path) : 0,
                  copy ? d.orig_seq : 0, sink)) {
    return false;
  }

  d.tx_order = tp.tx_order++;
  d.sent_ts = ts32(Time(c.last_tx_ns));
  d.flags &= static_cast<uint8_t>(~detail::kRetxQueued);
  if (kind == TxKind::kRetx) d.flags |= detail::kResent;
  if (kind == TxKind::kRetx) {
    ++c.counters[d.path].retransmits;
    ++stats_.retransmits;
  } else if (kind == TxKind::kCopy) {
    ++stats_.failover_resends;
  }
  if (tp.deadline == Time::max()) tp.deadline = now + rto(tp, backoff);
  return true;
}

// Redundancy in the tail (congestion.md §5.2): once a connection has sent all its data, a packet
// it resends goes out twice, on its own path and, unrecorded, on another open path (another
// plane if it can), flagged as a redundant copy of the original. In the tail nothing new waits,
// so the copy costs no goodput; a resend is what the message's completion waits for, and under
// heavy loss one path loses it as often as the first time (a round trip each). Only a record on
// its first path is copied: a failover copy's original is elsewhere, and its receive window
// could not tell the receiver about this one. The copy consumes a sequence on its path that no
// record holds; that path's ack floor passes it at once.
bool EngineImpl::emit_redundant(Time now, Connection& c, uint16_t idx, TxSink& sink, bool moving) {
  const TxDesc& d = c.pool[idx];
  // Nor one the receiver refused for want of a receive (RNR): it is not lost, and a copy
  // would only be refused too.
  if (!cfg_.tail_redundancy || d.rnr_retries || c.cursor != kNoSlot ||
      (c.move_head != kNil && !moving)) {
    return true;
  }
  // A failover copy's copy names the first transmission too (§4.3): the receiver acknowledges
  // that path, and the sender resolves the moved record from it (resolve_moved).
  const bool moved = d.flags & detail::kCopy;
  const uint16_t orig_path = moved ? d.orig_path : d.path;
  const uint32_t orig_seq = moved ? d.orig_seq : d.seq;
  const uint16_t q = choose_path(c, now, c.tx[d.path].plane, d.path);
  if (q == kNoPath) return true;
  // Paced, it goes only on credit to spare: it must not delay the resends the peer's share is for.
  if (c.hint_mbps) {
    refill(c, now);
    if (c.credit < int64_t{packet_len(d)} * 8000) return true;
  }
  TxPath& tq = c.tx[q];
  if (q == orig_path) return true;
  const auto flags = static_cast<uint16_t>(wire::failover_flags(orig_path) | wire::kFlagRedundant);
  if (!write_data(now, c, d, q, tq.next_seq, flags, orig_seq, sink)) return false;
  ++tq.tx_order;
  ++tq.next_seq;
  update_una(c, q);
  ++stats_.redundant_copies;
  return true;
}

bool EngineImpl::emit_probe(Time now, Connection& c, uint16_t path, TxSink& sink) {
  TxPath& tp = c.tx[path];
  std::span<uint8_t> buf = sink.begin(wire::kBaseHeaderLen, tp.plane);
  if (buf.size() < wire::kBaseHeaderLen) return false;
  // Entropy re-pick: every probe tries another route through the fabric (congestion.md §4.4).
  tp.port = random_port();
  wire::BaseHeader b;
  b.opcode = wire::Opcode::kProbe;
  b.conn_id = c.conn_id;
  b.token = c.token;
  b.path_id = path;
  b.path_count = static_cast<uint16_t>(c.tx.size());
  b.path_seq = tp.next_seq;
  b.timestamp = ts32(now);
  b.ack_floor = tp.una;
  wire::encode_base(buf, b);
  sink.commit(c.peer_ip, tp.port, tp.plane, wire::kBaseHeaderLen);
  tp.state = PathState::kProbing;
  Time interval = std::max(Time(2 * srtt_ref(c, tp)), cfg_.rto_min);
  for (uint8_t i = 0; i < tp.backoff && interval < cfg_.rto_max; ++i) interval *= 2;
  if (tp.backoff < kMaxBackoff) ++tp.backoff;
  tp.deadline = now + std::min(interval, cfg_.rto_max);
  ++c.counters[path].probes;
  ++stats_.probes_sent;
  ++stats_.tx_packets;
  stats_.tx_bytes += wire::kBaseHeaderLen;
  return true;
}

bool EngineImpl::emit_ack(Time now, Connection& c, RecvDir& d, uint16_t path, TxSink& sink) {
  RxPath& rp = d.paths[path];
  // NAK records stay until cum has passed them by the SACK span (spec §5.3).
  uint8_t kept = 0;
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (seq_diff(rp.naks[i].seq, rp.win.cum()) <= static_cast<int32_t>(wire::kSackBits)) {
      rp.naks[kept++] = rp.naks[i];
    }
  }
  rp.nak_count = kept;
  std::array<wire::NakRecord, kNakSlots> naks;
  const uint32_t n = kept;
  for (uint32_t i = 0; i < n; ++i) {
    naks[i] = {rp.naks[i].seq, rp.naks[i].src_stream, rp.naks[i].msn, rp.naks[i].syndrome,
               rp.naks[i].rnr_timer};
  }
  const uint32_t len = wire::kAckHeadersLen + n * wire::kNakRecordLen;
  // Back where the data arrived; while that plane is down, on the first plane that is up (the
  // sender takes an ACK on any plane).
  uint8_t plane = rp.plane;
  if (!plane_up(plane) && planes_up_ & all_planes(cfg_.num_planes)) {
    plane = static_cast<uint8_t>(std::countr_zero(planes_up_ & all_planes(cfg_.num_planes)));
  }
  std::span<uint8_t> buf = sink.begin(len, plane);
  if (buf.size() < len) return false;

  wire::BaseHeader b;
  b.opcode = wire::Opcode::kAck;
  b.flags = rp.echo_fresh ? 0 : wire::kFlagNoEcho;
  b.conn_id = d.conn_id;
  b.token = d.token;
  b.path_id = path;
  b.path_count = d.path_count;
  b.timestamp = ts32(now);
  wire::AckHeader a;
  a.cum_seq = rp.win.cum();
  a.sack = rp.win.sack();
  a.echo_timestamp = rp.echo_ts;
  a.ecn_ce_count = rp.ce_since_ack;
  a.rate_hint = current_hint(c);
  c.rx_hint_told = a.rate_hint;
  wire::encode_ack(buf, b, a, std::span(naks.data(), n));
  // The ACK mirrors the data's source port, so a sender's entropy re-pick moves both
  // directions of the path (spec §3.3).
  const uint16_t port = rp.port || c.tx.empty() ? rp.port : c.tx[path % c.tx.size()].port;
  sink.commit(c.peer_ip, port, plane, len);

  // An RNR record is said once: the packet is still missing, so if this ACK is lost the
  // sender's loss recovery resends it and a new refusal makes a new record (congestion.md §6).
  kept = 0;
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (rp.naks[i].syndrome != static_cast<uint8_t>(Syndrome::kRnr)) rp.naks[kept++] = rp.naks[i];
  }
  rp.nak_count = kept;
  rp.ack_pending = false;
  rp.echo_fresh = false;
  rp.ce_since_ack = 0;
  ++stats_.acks_sent;
  ++stats_.tx_packets;
  stats_.tx_bytes += len;
  return true;
}

// Failover copies go first among data, on whichever open path the sprayer picks.
bool EngineImpl::send_moving(Time now, Connection& c, TxSink& sink, uint32_t& sent) {
  while (c.move_head != kNil) {
    const uint16_t idx = c.move_head;
    TxDesc& d = c.pool[idx];
    // d.path still names the path it left.
    uint16_t p = choose_path(c, now, c.tx[d.path].plane);
    if (p == kNoPath) p = overflow_path(c);
    if (p == kNoPath || must_wait(now, c, packet_len(d))) return true;
    TxPath& tp = c.tx[p];
    d.path = p;
    d.seq = tp.next_seq;
    if (!emit_data(now, c, idx, sink, TxKind::kCopy)) return false;
    c.move_head = d.next;
    if (c.move_head == kNil) c.move_tail = kNil;
    if (tp.in_flight == 0) tp.last_progress_ns = now.count();
    list_append(c, p, idx);
    ++tp.next_seq;
    update_una(c, p);
    c.rr_next = static_cast<uint16_t>((p + 1) % c.paths_used);
    ++sent;
    // In the tail a moved packet is a resend like any other: it goes twice (§5.2). One sent once
    // left the all-to-all at 10 % loss with a packet through five backed-off RTOs (6.7 ms).
    const uint64_t copies = stats_.redundant_copies;
    if (!emit_redundant(now, c, idx, sink, true)) return false;
    sent += static_cast<uint32_t>(stats_.redundant_copies - copies);
  }
  return true;
}

// No path is open, yet failover copies wait: they go on the active path with the most room left
// in its SACK span, past its window. A copy held back could be what that window waits for (its
// original pins the ack floor of the path it left, §4.3), and while it waits no timer runs for
// it, so nothing would ever fail its message if the peer were gone.
uint16_t EngineImpl::overflow_path(const Connection& c) const {
  uint16_t best = kNoPath;
  uint32_t best_used = SackWindow::kSpan - 1;
  for (uint16_t p = 0; p < c.paths_used; ++p) {
    const TxPath& tp = c.tx[p];
    const uint32_t used = tp.next_seq - tp.una;
    if (tp.state == PathState::kActive && usable_plane(c, tp.plane) && used < best_used) {
      best = p;
      best_used = used;
    }
  }
  return best;
}

// One more in-flight record, false at conn_window_max. The pool grows only here, where no
// reference into it is held; a connection has as many records as it ever had in flight.
bool EngineImpl::grow_pool(Connection& c) {
  if (c.pool.size() >= cfg_.conn_window_max) return false;
  c.pool.emplace_back();
  c.free_head = static_cast<uint16_t>(c.pool.size() - 1);
  return true;
}

bool EngineImpl::send_new(Time now, Connection& c, TxSink& sink, uint32_t& sent, bool& more) {
  more = false;
  // c.turn_sent: what it sent of its turn, kept when the sink stopped it mid-turn.
  for (; c.cursor != kNoSlot; ++c.turn_sent) {
    if (c.turn_sent >= kTxBurst) {  // its turn is over; the work list comes back to it
      c.turn_sent = 0;
      more = true;
      return true;
    }
    const uint16_t p = choose_path(c, now);
    if (p == kNoPath) return true;
    if (c.free_head == kNil && !grow_pool(c)) return true;  // conn_window_max records in all
    if (start_held(now, c)) return true;
    detail::MsgSlot& s = slots_[c.cursor];
    if (s.resume_ns > now.count()) return true;  // refused (RNR): waits out its back-off
    const uint32_t len = seg_len(c.cursor, s.next_offset);
    if (must_wait(now, c, headers_len(s.m) + len)) return true;
    TxPath& tp = c.tx[p];
    if (s.pkts_sent == 0) s.first_tx_ns = now.count();
    const uint16_t idx = c.free_head;
    TxDesc& d = c.pool[idx];
    c.free_head = d.next;
    ++c.in_flight;
    d = TxDesc{};
    d.slot = c.cursor;
    d.offset = s.next_offset;
    d.path = p;
    d.seq = tp.next_seq;
    d.state = DescState::kInFlight;
    if (!emit_data(now, c, idx, sink, TxKind::kNew)) {
      free_desc(c, idx);
      return false;
    }
    if (tp.in_flight == 0) tp.last_progress_ns = now.count();
    list_append(c, p, idx);
    ++tp.next_seq;
    update_una(c, p);
    ++sent;
    c.rr_next = static_cast<uint16_t>((p + 1) % c.paths_used);
    s.next_offset += len;
    if (++s.pkts_sent == s.pkts_total) c.cursor = s.next;
  }
  return true;
}

uint32_t EngineImpl::poll_tx(Time now, TxSink& sink) {
  uint32_t sent = 0;
  if (shares_fell_) push_shares();
  // 1. ACKs first: they unblock the peer's windows (spec §5.2).
  size_t i = 0;
  for (; i < acks_.size(); ++i) {
    const AckRef r = acks_[i];
    RecvDir* d = find_dir(*r.conn, r.conn_id);
    if (!d || r.path >= d->paths.size() || !d->paths[r.path].ack_pending) continue;
    if (!emit_ack(now, *r.conn, *d, r.path, sink)) break;
    ++sent;
  }
  acks_.erase(acks_.begin(), acks_.begin() + static_cast<std::ptrdiff_t>(i));
  if (!acks_.empty()) return sent;  // the sink is full

  // 2. Probes of failed paths. Only connections that changed since they were last visited can
  // have something to send (congestion.md §7.1): a path fails, a window opens, a message or a
  // timer comes only through a call that touches its connection.
  for (Connection* c : work_) {
    if (!c->failed_paths) continue;
    touch(*c, false);  // a probe arms the path's probe deadline
    // Retired paths and those on a plane that is down are not probed.
    for (uint16_t p = 0; p < c->paths_used; ++p) {
      if (c->tx[p].state != PathState::kFailed || !usable_plane(*c, c->tx[p].plane)) continue;
      if (!emit_probe(now, *c, p, sink)) return finish_poll(sent);
      ++sent;
    }
  }

  // 3. Retransmissions of every connection before anyone's new data, connections in the order
  // they first asked; a connection whose credit runs out keeps the rest for later (§3.3).
  bool full = false;
  for (Connection*& c : retx_conns_) {
    touch(*c, false);
    if (!send_retx(now, *c, sink, sent)) {
      full = true;
      break;
    }
    if (!c->retx_q.empty()) continue;  // waits for credit
    c->retx_listed = false;
    c = nullptr;
  }
  std::erase(retx_conns_, nullptr);
  if (full) return finish_poll(sent);

  // 4. Failover copies, then new packets, sprayed one by one over open paths (spec §6.1).
  // Connections take turns of kTxBurst new packets, as a NIC arbitrates among its queue pairs:
  // sending each connection its whole window in turn made a host's peers receive from all
  // hosts in the same order, a rolling incast (congestion.md §7.1). A connection leaves the
  // work list once it has nothing more it may send; one that the sink stopped stays, first.
  size_t visited = 0;
  for (; visited < work_.size(); ++visited) {
    Connection* c = work_[visited];
    ++conn_visits_;
    touch(*c, false);
    bool more = false;
    if (!send_moving(now, *c, sink, sent) || !send_new(now, *c, sink, sent, more)) break;
    if (c->tlp_deadline == Time::max()) arm_tlp(now, *c);
    if (more) {
      work_.push_back(c);  // another turn, after the others
    } else {
      c->queued = false;
      c->turn_sent = 0;
    }
  }
  work_.erase(work_.begin(), work_.begin() + static_cast<std::ptrdiff_t>(visited));
  return finish_poll(sent);
}

uint32_t EngineImpl::finish_poll(uint32_t sent) {
  settle();
  return sent;
}

// ---------------------------------------------------------------------------------------------
// Resolution of packets and messages

void EngineImpl::ack_desc(Connection& c, uint16_t idx) {
  const uint32_t slot = c.pool[idx].slot;
  resolve(c, idx);
  detail::MsgSlot& s = slots_[slot];
  s.unreachable_ns = 0;  // the stream answered
  if (++s.pkts_acked == s.pkts_total) {
    done_.push_back({s.m.cookie, Syndrome::kOk});
    unlink(c, slot);
  }
}

// Stops tracking every packet of a message; the next packets on those paths carry the new
// ack floor, so the receiver skips them (spec §3.1). now == Time::min(): keep the timers.
void EngineImpl::abandon(Connection& c, uint32_t slot, Time now) {
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    TxPath& tp = c.tx[p];
    bool changed = false;
    for (uint16_t prev = kNil, idx = tp.head; idx != kNil;) {
      const uint16_t next = c.pool[idx].next;
      if (c.pool[idx].slot == slot) {
        list_remove(c, p, prev, idx);
        resolve(c, idx);
        changed = true;
      } else {
        prev = idx;
      }
      idx = next;
    }
    if (!changed) continue;
    update_una(c, p);
    if (tp.state != PathState::kActive) continue;
    if (tp.in_flight == 0) tp.deadline = Time::max();
    else if (now != Time::min()) tp.deadline = now + rto(tp);
  }
  for (uint16_t prev = kNil, idx = c.move_head; idx != kNil;) {
    const uint16_t next = c.pool[idx].next;
    if (c.pool[idx].slot == slot) {
      if (prev == kNil) c.move_head = next;
      else c.pool[prev].next = next;
      if (c.move_tail == idx) c.move_tail = prev;
      resolve(c, idx);
    } else {
      prev = idx;
    }
    idx = next;
  }
}

void EngineImpl::fail_message(Connection& c, uint32_t slot, Syndrome why, Time now) {
  abandon(c, slot, now);
  done_.push_back({slots_[slot].m.cookie, why});
  unlink(c, slot);
}

void EngineImpl::unlink(Connection& c, uint32_t slot) {
  detail::MsgSlot& s = slots_[slot];
  if (c.cursor == slot) c.cursor = s.next;
  if (s.prev != kNoSlot) slots_[s.prev].next = s.next;
  else c.head = s.next;
  if (s.next != kNoSlot) slots_[s.next].prev = s.prev;
  else c.tail = s.prev;
  s.prev = s.next = kNoSlot;
  free_slots_.push_back(slot);
}

// Host callbacks run last, once our state is consistent: they may submit or drop streams.
void EngineImpl::flush_completions() {
  for (size_t i = 0; i < done_.size(); ++i) {
    const Completion x = done_[i];
    if (x.why == Syndrome::kOk) host_.message_acked(x.cookie);
    else host_.message_failed(x.cookie, x.why);
  }
  done_.clear();
}

void EngineImpl::drop_stream(uint32_t src_stream) {
  for (Connection* c : conn_list_) {
    touch(*c);
    for (uint32_t s = c->head; s != kNoSlot;) {
      const uint32_t next = slots_[s].next;
      if (slots_[s].m.src_stream == src_stream) {
        abandon(*c, s, Time::min());
        unlink(*c, s);
      }
      s = next;
    }
    for (size_t i = 0; i < c->parked.size();) {
      if (slots_[c->parked[i]].m.src_stream == src_stream) {
        free_slots_.push_back(c->parked[i]);
        c->parked[i] = c->parked.back();
        c->parked.pop_back();
      } else {
        ++i;
      }
    }
  }
  settle();
}

void EngineImpl::reject(const RxRef& ref, Syndrome why) {
  Connection* c = find_conn(ref.peer_ip);
  if (!c || why == Syndrome::kOk) return;
  RecvDir* d = find_dir(*c, ref.dir);
  if (!d || ref.path >= d->paths.size()) return;
  // The packet stays marked received: the NAK, processed before the acknowledgements of the
  // same ACK, fails its message at the sender (spec §5.3).
  add_nak(d->paths[ref.path], ref.seq, ref.src_stream, ref.msn, why);
  ++stats_.naks_sent;
}

}  // namespace metaroce::transport
