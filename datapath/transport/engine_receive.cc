// SPDX-License-Identifier: Apache-2.0
// The transport's receiving side (wire.md §5, congestion.md §3, §5, §6): data, probes and ACKs
// as they arrive, the receiver's shares, NAKs and RNR.
#include "datapath/transport/engine_impl.h"

#include <algorithm>

#include "datapath/transport/engine_util.h"
#include "datapath/transport/path_seq.h"

namespace metaroce::transport {

using detail::DescState;
using detail::kNil;
using detail::kNoSlot;

// ---------------------------------------------------------------------------------------------
// Receiving

void EngineImpl::on_packet(Time now, uint32_t peer_ip, uint16_t udp_src_port, bool ecn_ce,
                           std::span<const uint8_t> udp_payload, uint8_t plane) {
  ++stats_.rx_packets;
  stats_.rx_bytes += udp_payload.size();
  wire::Packet pkt;
  const wire::DecodeError err = wire::decode(udp_payload, pkt);
  if (err != wire::DecodeError::kNone) {
    ++decode_drops_[static_cast<size_t>(err)];
    if (err == wire::DecodeError::kBadVersion) ++stats_.drop_version;
    else ++stats_.drop_malformed;
    return;
  }
  if (wire::is_data_opcode(pkt.base.opcode)) {
    if (forgotten(peer_ip, pkt.base.conn_id)) {
      // A direction we forgot: never a new one (§4.6). (A conn_id the peer drew again since
      // would be a new direction: 1 in 2^32 per direction of the 4,096 remembered.)
      Connection* known = find_conn(peer_ip);
      if (!known || !find_dir(*known, pkt.base.conn_id)) {
        ++stats_.drop_forgotten;
        return;
      }
    }
    handle_data(now, conn_for(peer_ip), udp_src_port, ecn_ce, plane, pkt);
  } else if (pkt.base.opcode == wire::Opcode::kAck) {
    handle_ack(now, peer_ip, pkt);
  } else {
    Connection* c = find_conn(peer_ip);
    if (!c) ++stats_.drop_unknown_conn;
    else handle_probe(now, *c, udp_src_port, ecn_ce, plane, pkt);
    if (c) touch(*c);
  }
  flush_completions();
}

EngineImpl::RecvDir* EngineImpl::find_dir(Connection& c, uint32_t conn_id) {
  for (RecvDir& d : c.rx) {
    if (d.conn_id == conn_id) return &d;
  }
  return nullptr;
}

// 0-RTT: the first valid data packet of an unknown direction creates its state (spec §3.2).
EngineImpl::RecvDir& EngineImpl::create_dir(Connection& c, const wire::BaseHeader& b, Time now) {
  RecvDir* d = nullptr;
  if (c.rx.size() < kMaxRecvDirs) {
    d = &c.rx.emplace_back();
  } else {
    // A peer that restarted abandons its old direction; the least recently used one goes.
    d = &*std::min_element(c.rx.begin(), c.rx.end(), [](const RecvDir& x, const RecvDir& y) {
      return x.last_used_ns < y.last_used_ns;
    });
  }
  d->conn_id = b.conn_id;
  d->token = b.token;
  d->path_count = b.path_count;
  d->last_used_ns = now.count();
  d->paths.assign(b.path_count, RxPath{});
  return *d;
}

void EngineImpl::request_ack(Connection& c, RecvDir& d, uint16_t path, uint32_t ts, bool ecn_ce,
                             bool own) {
  RxPath& rp = d.paths[path];
  if (own) {
    rp.echo_ts = ts;
    rp.echo_fresh = true;
  }
  if (ecn_ce) {
    if (rp.ce_since_ack != UINT16_MAX) ++rp.ce_since_ack;
    ++rp.ce_total;
  }
  if (!rp.ack_pending) {
    rp.ack_pending = true;
    acks_.push_back({&c, d.conn_id, path});
  }
}

void EngineImpl::note_unreachable(RxPath& rp, uint32_t seq, uint32_t src_stream, uint32_t msn) {
  const auto unreachable = static_cast<uint8_t>(Syndrome::kUnreachable);
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    detail::NakEntry& n = rp.naks[i];
    if (n.syndrome == unreachable && n.src_stream == src_stream) {
      if (seq_lt(n.seq, seq)) n = {seq, src_stream, msn, unreachable};
      return;
    }
  }
  if (rp.nak_count < kNakSlots) rp.naks[rp.nak_count++] = {seq, src_stream, msn, unreachable};
}

// The sender has resolved every sequence below its ack floor: the window skips them, and NAK
// records for them are no longer needed by anyone (spec §5.3).
void EngineImpl::apply_floor(RxPath& rp, uint32_t ack_floor) {
  rp.win.advance_to(ack_floor);
  uint8_t kept = 0;
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (!seq_lt(rp.naks[i].seq, ack_floor)) rp.naks[kept++] = rp.naks[i];
  }
  rp.nak_count = kept;
}

// False when the path's records are full (the record is not kept).
bool EngineImpl::add_nak(RxPath& rp, uint32_t seq, uint32_t src_stream, uint32_t msn,
                         Syndrome why, uint8_t rnr_timer) {
  const detail::NakEntry e{seq, src_stream, msn, static_cast<uint8_t>(why), rnr_timer};
  for (uint8_t i = 0; i < rp.nak_count; ++i) {
    if (rp.naks[i].seq == seq) {
      rp.naks[i] = e;
      return true;
    }
  }
  if (rp.nak_count == kNakSlots) return false;
  rp.naks[rp.nak_count++] = e;
  return true;
}

// Arrival accounting for fair-share hints (congestion.md §3.1). A sender not heard from in the
// last kActiveIntervals is admitted at once with an unlimited demand: its first ACK carries a
// share, and the other unsatisfied senders' shares shrink with the same ACKs (§3.2).
void EngineImpl::account_rx(Time now, Connection& c, size_t bytes, bool more) {
  if (!cfg_.rx_capacity_mbps) return;
  if (interval_start_ == Time::min()) {
    interval_start_ = now;
    share_remaining_ = uint64_t{cfg_.rx_capacity_mbps} * kHintPercent / 100;
  } else if (now - interval_start_ >= cfg_.hint_interval) {
    close_rate_interval(now);
  }
  if (!heard(c)) {
    c.rx_rate_mbps = 0;
    c.rx_demand = UINT32_MAX;
    c.rx_frozen = false;
    ++share_unsat_;
    share_spare_ = 0;
    share_level_ = share_remaining_ / share_unsat_;
    shares_fell_ = true;
  }
  c.rx_bytes_interval += bytes;
  c.rx_heard_interval = interval_idx_ + 1;
  if (more) c.rx_more = true;
}

// Senders whose share fell to half or less of what we last told them hear it now, in an ACK on
// the path their data last came by, instead of with the ACK of their next packet: that packet may
// wait behind the queue the newcomers build, while the way back is clear (congestion.md §3.3).
void EngineImpl::push_shares() {
  shares_fell_ = false;
  for (Connection* c : conn_list_) {
    if (!heard(*c) || uint64_t{current_hint(*c)} * 2 > c->rx_hint_told) continue;
    RecvDir* d = find_dir(*c, c->rx_dir);
    if (!d || c->rx_path >= d->paths.size()) continue;
    request_ack(*c, *d, c->rx_path, d->paths[c->rx_path].echo_ts, false, false);
    ++stats_.share_pushes;
  }
}

bool EngineImpl::heard(const Connection& c) const {
  return c.rx_heard_interval != 0 && interval_idx_ + 1 - c.rx_heard_interval < kActiveIntervals;
}

// The share an ACK to this sender carries now (congestion.md §3.3): its demand and the spare if
// the last division satisfied it, else the level every unsatisfied sender gets.
uint32_t EngineImpl::current_hint(const Connection& c) const {
  if (!cfg_.rx_capacity_mbps || !heard(c)) return 0;
  const uint64_t cap = uint64_t{cfg_.rx_capacity_mbps} * kHintPercent / 100;
  if (c.rx_frozen) return static_cast<uint32_t>(std::min<uint64_t>(c.rx_demand + share_spare_, cap));
  return static_cast<uint32_t>(std::clamp<uint64_t>(share_level_, 1, cap));
}

// Max-min fair division of our inbound capacity among the senders heard in the last few
// intervals, by water-filling over their demands; capacity a sender does not demand is shared
// by the others (congestion.md §3.2). A sender that said it had more to send (kFlagMore) is
// held back by its share or by the network, not by its application: its demand does not fall
// below 0.9 of its share, so a stall while it recovers a loss costs it a tenth per interval, not
// its share. One that had nothing more wants its measured rate plus a quarter. Once per interval.
void EngineImpl::close_rate_interval(Time now) {
  const int64_t elapsed = std::max<int64_t>((now - interval_start_).count(), 1);
  const uint64_t cap = uint64_t{cfg_.rx_capacity_mbps} * kHintPercent / 100;
  uint32_t n = 0;
  for (Connection* c : conn_list_) {
    if (heard(*c)) {
      const auto sample = static_cast<uint32_t>(
          std::min<uint64_t>(c->rx_bytes_interval * 8000 / static_cast<uint64_t>(elapsed), UINT32_MAX / 2));
      // Smoothed over intervals (gain 1/4): an interval holds only a few packets of a slow
      // sender. A sender that was silent before starts from its sample.
      const bool fresh = c->rx_rate_mbps == 0;
      c->rx_rate_mbps = fresh ? sample
                              : static_cast<uint32_t>((3 * uint64_t{c->rx_rate_mbps} + sample) / 4);
      uint64_t d = uint64_t{c->rx_rate_mbps} * 5 / 4 + 1;
      if (c->rx_more) {
        const uint32_t share = current_hint(*c);
        d = share ? std::max<uint64_t>(d, uint64_t{share} * 9 / 10) : cap;
      }
      c->rx_demand = static_cast<uint32_t>(std::min<uint64_t>(d, UINT32_MAX));
      c->rx_frozen = false;
      ++n;
    } else {
      c->rx_rate_mbps = 0;
      c->rx_demand = 0;
      c->rx_frozen = true;
    }
    c->rx_bytes_interval = 0;
    c->rx_more = false;
  }
  const uint32_t active = n;
  uint64_t remaining = cap;
  for (bool changed = true; changed && n;) {
    changed = false;
    const uint64_t level = remaining / n;
    for (Connection* c : conn_list_) {
      if (c->rx_frozen || c->rx_demand > level) continue;
      c->rx_frozen = true;
      remaining -= c->rx_demand;
      --n;
      changed = true;
    }
  }
  // Unsatisfied senders share the rest equally; when everyone is satisfied, the rest is spread
  // over all of them so the hints add up to the capacity. Senders admitted before the next
  // division take from what is left (account_rx).
  share_remaining_ = remaining;
  share_unsat_ = n;
  share_level_ = n ? remaining / n : 0;
  share_spare_ = (!n && active) ? remaining / active : 0;
  ++interval_idx_;
  interval_start_ = now;
}

// A data packet (wire.md §5): its direction found or made, its path's window consulted (a
// duplicate is answered, a failover copy of a packet already here too), its bytes delivered to
// the host, and the outcome recorded for the ACK that answers it.
void EngineImpl::handle_data(Time now, Connection& c, uint16_t sport, bool ecn_ce, uint8_t plane,
                             const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  RecvDir* d = data_dir(now, c, b);
  if (!d) return;
  account_rx(now, c, wire::data_headers_len(b.flags) + pkt.payload.size(), b.flags & wire::kFlagMore);
  RxPath& rp = d->paths[b.path_id];
  rp.port = sport;
  rp.plane = plane;
  apply_floor(rp, b.ack_floor);
  c.rx_dir = d->conn_id;
  c.rx_path = b.path_id;

  switch (rp.win.check(b.path_seq)) {
    case SackWindow::Check::kOutOfWindow:
      ++stats_.drop_out_of_window;
      return;
    case SackWindow::Check::kDuplicate:
      // The ACK that covered it was lost or is late: say it again, deliver nothing.
      ++stats_.duplicates;
      ++rp.duplicates;
      last_answered_ = now;  // a packet we accepted: its sender needs this answer (§4.6)
      request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
      return;
    case SackWindow::Check::kNew:
      break;
  }

  // A failover copy is delivered only if its original has not arrived; the original's receive
  // window on its own path is the record of that (congestion.md §4.3).
  const uint16_t opath = wire::orig_path_of(b.flags);
  bool mark_orig = false;
  if (wire::is_failover_copy(b.flags) && opath < d->paths.size() &&
      !take_copy(now, c, *d, pkt, ecn_ce, &mark_orig))
    return;

  const uint32_t dir_id = d->conn_id;
  const Syndrome why = host_.deliver(segment_of(c, dir_id, pkt));
  // deliver() may submit (a READ response); our receive state is untouched by that, but look
  // the direction up again rather than trust a pointer across a callback.
  d = find_dir(c, dir_id);
  if (!d) return;
  record_delivery(*d, pkt, why, mark_orig);
  if (why != Syndrome::kUnreachable) last_answered_ = now;  // nothing is owed for those
  request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
}

// The receiving direction a data packet names: made at its first packet, grown with the
// sender's lane; nullptr (counted) when the packet carries the wrong token.
inline EngineImpl::RecvDir* EngineImpl::data_dir(Time now, Connection& c, const wire::BaseHeader& b) {
  RecvDir* d = find_dir(c, b.conn_id);
  if (!d) {
    d = &create_dir(c, b, now);
  } else if (d->token != b.token) {
    ++stats_.drop_token;
    return nullptr;
  } else if (d->path_count < b.path_count) {
    // The sender's lane grew (wire.md §3.4): a direction's paths never shrink; packets sent
    // before the change still name the smaller count.
    d->path_count = b.path_count;
    d->paths.resize(b.path_count);
  }
  d->last_used_ns = now.count();
  return d;
}

// A failover copy, new on its own path: false when its original is here already (the copy is
// answered, and a rejection the original earned goes with it); else it is to be delivered, and
// *mark_orig says whether the original's sequence is to be marked received with it.
inline bool EngineImpl::take_copy(Time now, Connection& c, RecvDir& d, const wire::Packet& pkt,
                           bool ecn_ce, bool* mark_orig) {
  const wire::BaseHeader& b = pkt.base;
  const wire::DataHeader& h = pkt.data;
  const uint16_t opath = wire::orig_path_of(b.flags);
  RxPath& rp = d.paths[b.path_id];
  RxPath& o = d.paths[opath];
  SackWindow::Check oc = o.win.check(h.orig_seq);
  if (oc == SackWindow::Check::kOutOfWindow) {
    // The original's path went on at its sender while nothing of it reached us: everything
    // 256 before the original is resolved there (no more than 64 are ever in flight on a
    // path, §3.1), so its window moves up to it and the original is recorded when this copy
    // delivers it (a second copy, or the original arriving late, is then a duplicate).
    apply_floor(o, h.orig_seq - wire::kSackBits);
    oc = o.win.check(h.orig_seq);
  }
  // A redundant copy's original stays in flight at the sender: its path is acknowledged too,
  // whichever of the two got here first (congestion.md §5.2).
  // Flagged kFlagNoEcho: an echo of the copy could make a path the sender is probing look
  // answered (congestion.md §4.4) when only the copy's route is, and an echo of the path's own
  // newest packet, maybe long ago, would be an RTT sample of everything since.
  if (wire::is_redundant_copy(b.flags) && oc != SackWindow::Check::kOutOfWindow) {
    request_ack(c, d, opath, o.echo_ts, false, false);
  }
  if (oc == SackWindow::Check::kDuplicate) {
    ++stats_.failover_duplicates;
    ++rp.rx_packets;
    rp.rx_bytes += pkt.payload.size();
    // A rejection the original earned must reach the sender through the copy too; with no
    // room for its record, the copy is left unmarked, like an RNR (§5.3): it comes again.
    bool recorded = true;
    for (uint8_t i = 0; i < o.nak_count; ++i) {
      if (o.naks[i].seq == h.orig_seq && o.naks[i].syndrome != static_cast<uint8_t>(Syndrome::kRnr)) {
        recorded &= add_nak(rp, b.path_seq, o.naks[i].src_stream, o.naks[i].msn,
                            static_cast<Syndrome>(o.naks[i].syndrome));
      }
    }
    if (!recorded) {
      ++stats_.drop_rnr;
      request_ack(c, d, b.path_id, b.timestamp, ecn_ce);
      return false;
    }
    rp.win.mark(b.path_seq);
    last_answered_ = now;
    request_ack(c, d, b.path_id, b.timestamp, ecn_ce);
    return false;
  }
  *mark_orig = oc == SackWindow::Check::kNew;
  return true;
}

// What a data packet gives the host to deliver (RxRef: where to answer a refusal, §5.3).
inline Segment EngineImpl::segment_of(const Connection& c, uint32_t dir_id, const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  const wire::DataHeader& h = pkt.data;
  Segment seg;
  seg.peer_ip = c.peer_ip;
  seg.op = static_cast<Op>(b.opcode);
  seg.dst_stream = h.dst_stream;
  seg.src_stream = h.src_stream;
  seg.msn = h.msn;
  seg.rsn = h.rsn;
  seg.offset = h.offset;
  seg.total_length = h.total_length;
  const bool addressed = seg.op == Op::kWrite || seg.op == Op::kWriteImm || seg.op == Op::kReadResp;
  seg.remote_addr = addressed ? h.remote_addr + h.offset : h.remote_addr;
  seg.rkey = h.rkey;
  seg.imm = h.imm;
  seg.xrc = b.flags & wire::kFlagXrc;
  seg.xrc_srqn = h.xrc_srqn;
  seg.payload = pkt.payload;
  seg.ref = RxRef{c.peer_ip, dir_id, b.path_seq, h.src_stream, h.msn, b.path_id};
  return seg;
}

// The host's verdict on a delivered packet, in its path's receive state: marked received (with
// its original, for a copy), or not (the sender resends it), and the NAK record it earned.
[[gnu::always_inline]] inline void EngineImpl::record_delivery(RecvDir& d, const wire::Packet& pkt, Syndrome why,
                                 bool mark_orig) {
  const wire::BaseHeader& b = pkt.base;
  const wire::DataHeader& h = pkt.data;
  const uint16_t opath = wire::orig_path_of(b.flags);
  RxPath& r = d.paths[b.path_id];
  ++r.rx_packets;
  r.rx_bytes += pkt.payload.size();
  if (why == Syndrome::kOk) {
    r.win.mark(b.path_seq);
    if (mark_orig) d.paths[opath].win.mark(h.orig_seq);
  } else if (why == Syndrome::kUnreachable) {
    // No such stream here: not marked (nothing was delivered), and said in one NAK record per
    // stream and path, moved to the newest such packet, so that the sender parks the stream and
    // its QP's timeout decides, not the connection's silence (the peer's other streams answer).
    ++stats_.drop_unreachable;
    note_unreachable(r, b.path_seq, h.src_stream, h.msn);
  } else if (why == Syndrome::kRnr || r.nak_count == kNakSlots ||
             (mark_orig && d.paths[opath].nak_count == kNakSlots)) {
    // Not marked: the sender resends it. An RNR is reported (once) so that the sender backs
    // off instead of treating it as loss; a full NAK list is treated the same way, so that no
    // rejection goes unreported (spec §5.3).
    ++stats_.drop_rnr;
    if (why == Syndrome::kRnr && r.nak_count < kNakSlots) {
      // The refusing QP's min_rnr_timer travels with the refusal (spec §2.4).
      const int t = host_.rnr_timer(h.dst_stream);
      const uint8_t timer =
          t < 0 ? 0 : static_cast<uint8_t>(wire::kRnrTimerValid | (t & wire::kRnrTimerCodeMask));
      add_nak(r, b.path_seq, h.src_stream, h.msn, Syndrome::kRnr, timer);
      ++stats_.rnr_naks_sent;
    }
  } else {
    add_nak(r, b.path_seq, h.src_stream, h.msn, why);
    r.win.mark(b.path_seq);
    if (mark_orig) {
      // The original's path is acknowledged too (and a redundant copy asked for its ACK): the
      // rejection goes with it, or the sender would take that ACK for a delivery (spec §5.3).
      d.paths[opath].win.mark(h.orig_seq);
      add_nak(d.paths[opath], h.orig_seq, h.src_stream, h.msn, why);
    }
    ++stats_.naks_sent;
  }
}

void EngineImpl::handle_probe(Time now, Connection& c, uint16_t sport, bool ecn_ce,
                              uint8_t plane, const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  RecvDir* d = find_dir(c, b.conn_id);
  if (!d) {
    ++stats_.drop_unknown_conn;
    return;
  }
  if (d->token != b.token) {
    ++stats_.drop_token;
    return;
  }
  if (d->path_count < b.path_count) {
    d->path_count = b.path_count;
    d->paths.resize(b.path_count);
  }
  d->last_used_ns = now.count();
  RxPath& rp = d->paths[b.path_id];
  rp.port = sport;
  rp.plane = plane;
  apply_floor(rp, b.ack_floor);
  request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
}

// An ACK (wire.md §2.3, congestion.md §2-§6): its connection and path checked, then in order
// the receiver's share, its NAK records, what it acknowledges, the holes it shows, its RTT
// sample, and the path's and the connection's progress.
void EngineImpl::handle_ack(Time now, uint32_t peer_ip, const wire::Packet& pkt) {
  Connection* cp = ack_conn(peer_ip, pkt);
  if (!cp) return;
  Connection& c = *cp;
  const wire::BaseHeader& b = pkt.base;
  const wire::AckHeader& a = pkt.ack;
  const uint16_t path = b.path_id;
  TxPath& tp = c.tx[path];
  ++stats_.acks_received;
  detail::PathCounters& pc = c.counters[path];
  ++pc.acks_received;
  pc.ce_echoed += a.ecn_ce_count;
  take_hint(now, c, a.rate_hint);
  // NAKs before acknowledgements: a rejected packet is also marked received (spec §5.3).
  for (size_t i = 0; i < a.nak_count; ++i) apply_nak(now, c, path, pkt.nak(i));
  // Packets moved off this path are acknowledged by its ACKs too (the original, or a redundant
  // copy naming it, got through): §4.3, §5.2.
  if (tp.moved) resolve_moved(c, path, a);
  bool rack_moved = false;
  const uint32_t newly = acknowledge(c, path, a, b.flags, &rack_moved);
  queue_sack_gaps(c, path);
  if (!(b.flags & wire::kFlagNoEcho)) take_rtt_sample(now, c, path, a.echo_timestamp);
  update_una(c, path);
  congestion_on_ack(now, c, path, newly, a.ecn_ce_count);
  if (newly && tp.state == PathState::kActive) path_progress(now, c, path);
  if (rack_moved && cfg_.late_detection) detect_late(now, c);
}

// The connection an ACK from peer_ip is for, nullptr (counted) when it names none of peer_ip's,
// carries the wrong token, or cannot be ours (a path or a sequence we never had).
inline EngineImpl::Connection* EngineImpl::ack_conn(uint32_t peer_ip, const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  auto it = by_id_.find(b.conn_id);
  if (it == by_id_.end() || it->second->peer_ip != peer_ip) {
    ++stats_.drop_unknown_conn;
    return nullptr;
  }
  Connection& c = *it->second;
  touch(c);
  if (c.token != b.token) {
    ++stats_.drop_token;
    return nullptr;
  }
  // An ACK of a packet sent before the lane grew names the smaller count.
  if (b.path_count > c.tx.size()) {
    ++stats_.drop_malformed;
    return nullptr;
  }
  // An ACK for a sequence never sent is forged or corrupt.
  if (seq_lt(c.tx[b.path_id].next_seq, pkt.ack.cum_seq)) {
    ++stats_.drop_malformed;
    return nullptr;
  }
  return &c;
}

// The receiver's fair share for us; pacing starts with a small burst of credit. A lane that
// does not take part in hints only records it.
inline void EngineImpl::take_hint(Time now, Connection& c, uint32_t rate_hint) {
  c.last_hint_mbps = rate_hint;
  // A peer that answers without a share does not divide its capacity: no start window for it.
  // (One that does gives every sender it hears a share; a zero from it only means it had not
  // heard us lately.)
  if (rate_hint) c.peer_shares = detail::PeerShares::kYes;
  else if (c.peer_shares == detail::PeerShares::kUnknown) c.peer_shares = detail::PeerShares::kNo;
  if (c.rate_hints && rate_hint != c.hint_mbps) {
    if (!c.hint_mbps) {
      c.credit = int64_t{kPaceBurst} * cfg_.max_packet * 8000;
      c.credit_ns = now.count();
    } else {
      refill(c, now);
    }
    c.hint_mbps = rate_hint;
  }
}

// One NAK record of an ACK on `path` (spec §5.3): an unreachable stream parks, an RNR waits
// its timer, any other refusal fails its message.
inline void EngineImpl::apply_nak(Time now, Connection& c, uint16_t path, const wire::NakRecord& r) {
  TxPath& tp = c.tx[path];
  ++stats_.naks_received;
  if (r.syndrome == static_cast<uint8_t>(Syndrome::kUnreachable)) {
    // The record names the newest packet of the stream the receiver refused on this path:
    // the stream is parked if some packet of it at or before that one is still in flight here
    // (a stale record, older than everything of the stream now in flight, is not news).
    for (uint16_t k = tp.head; k != kNil; k = c.pool[k].next) {
      const TxDesc& d = c.pool[k];
      if (seq_lt(r.path_seq, d.seq)) break;
      if (slots_[d.slot].m.src_stream == r.src_stream) {
        park(c, d.slot, now);
        break;
      }
    }
    return;
  }
  if (r.syndrome == static_cast<uint8_t>(Syndrome::kRnr)) {
    const uint16_t idx = find_in_flight(c, path, r.path_seq);
    if (idx == kNil) return;
    const MessageDesc& m = slots_[c.pool[idx].slot].m;
    if (m.src_stream == r.src_stream && m.msn == r.msn) rnr_nak(now, c, idx, r.rnr_timer);
    return;
  }
  // A rejection may name a packet since moved off this path: this ACK, which also covers it,
  // must not resolve its copies as delivered (§4.3).
  const uint32_t slot = find_named(c, path, r.path_seq);
  if (slot == kNoSlot) return;
  const MessageDesc& m = slots_[slot].m;
  if (m.src_stream != r.src_stream || m.msn != r.msn) return;
  fail_message(c, slot, static_cast<Syndrome>(r.syndrome), now);
}

// Resolves the path's records the ACK's cumulative sequence and SACK bits cover; how many.
// *rack_moved: a packet sent once dated a newer delivery (late detection, §5.1).
[[gnu::always_inline]] inline uint32_t EngineImpl::acknowledge(Connection& c, uint16_t path, const wire::AckHeader& a,
                                 uint16_t flags, bool* rack_moved) {
  TxPath& tp = c.tx[path];
  uint32_t newly = 0;
  // The path's records are in sequence order: nothing at or past `end` (cum_seq, or one past
  // the highest SACK bit) can be acknowledged by this ACK.
  uint32_t end = a.cum_seq;
  for (int w = 3; w >= 0; --w) {
    if (a.sack[w]) {
      end = a.cum_seq + 1 + static_cast<uint32_t>(w * 64 + 63 - std::countl_zero(a.sack[w])) + 1;
      break;
    }
  }
  for (uint16_t prev = kNil, idx = tp.head; idx != kNil;) {
    TxDesc& d = c.pool[idx];
    if (!seq_lt(d.seq, end)) break;
    const uint16_t next = d.next;
    const bool acked = seq_lt(d.seq, a.cum_seq) ||
                       (d.seq != a.cum_seq && sack_bit(a.sack, d.seq - a.cum_seq - 1));
    if (acked) {
      // Only a packet sent once dates the delivery: had a resend's later order been taken when
      // the original was what arrived, everything sent between the two, still in flight, would
      // look lost (a receiver stalled past the RTO made a cascade of such resends).
      if (!(d.flags & detail::kResent)) {
        if (order_lt(tp.delivered_order, static_cast<uint16_t>(d.tx_order + 1)))
          tp.delivered_order = static_cast<uint16_t>(d.tx_order + 1);
        if (!c.rack_valid || seq_lt(c.rack_ts, d.sent_ts)) {
          c.rack_ts = d.sent_ts;
          c.rack_valid = true;
          *rack_moved = true;
        }
      } else if ((d.flags & detail::kLate) && !(flags & wire::kFlagNoEcho)) {
        judge_late(tp, d, a.echo_timestamp);  // (an ACK for a copy dates nothing)
      }
      list_remove(c, path, prev, idx);
      ack_desc(c, idx);
      ++newly;
    } else {
      prev = idx;
    }
    idx = next;
  }
  return newly;
}


// Paths are FIFO: a packet transmitted before one that arrived, and still missing, is lost.
// Retransmitted once; it is not suspected again until something sent after it arrives.
// A record sent once and after everything delivered ends the search: every later record was
// first sent after it (and a resend is later still).
inline void EngineImpl::queue_sack_gaps(Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  detail::PathCounters& pc = c.counters[path];
  for (uint16_t idx = tp.head; idx != kNil; idx = c.pool[idx].next) {
    TxDesc& d = c.pool[idx];
    const bool lost = order_lt(d.tx_order, tp.delivered_order);
    if (!lost && !(d.flags & detail::kResent)) break;
    if (lost && !(d.flags & (detail::kRetxQueued | detail::kRnrWait))) {
      queue_retx(c, idx);
      ++pc.sack_gaps;
      ++stats_.sack_gaps;
    }
  }
}

// The RTT an ACK's echo gives (one not flagged kFlagNoEcho): a probing path's answer brings it
// back (§4.4); an active path's smoothed RTT takes it (W§6.3).
inline void EngineImpl::take_rtt_sample(Time now, Connection& c, uint16_t path, uint32_t echo) {
  TxPath& tp = c.tx[path];
  const uint32_t sample = ts32(now) - echo;
  if (static_cast<int32_t>(sample) < 0) return;
  if (tp.state == PathState::kProbing) {
    // Only an answer to a probe (or to data sent after the failure) proves the new route.
    if (seq_diff(static_cast<uint32_t>(tp.last_progress_ns), echo) >= 0) {
      path_recovered(now, c, path, sample);
    }
    return;
  }
  if (tp.state != PathState::kActive) return;
  // Every echo is a sample, ACKs that acknowledge nothing new included (copies,
  // duplicates): taking only ACKs with progress left paths' RTTs stale under heavy loss
  // (the all-reduce at 10 % loss kept 0.80 instead of 0.84). Those flagged kFlagNoEcho
  // (share pushes, ACKs for a redundant copy) date nothing.
  detail::PathCounters& pc = c.counters[path];
  const int64_t r = sample;
  if (!pc.min_rtt_ns || sample < pc.min_rtt_ns) pc.min_rtt_ns = std::max<uint32_t>(sample, 1);
  if (tp.srtt_ns == 0) {
    tp.srtt_ns = static_cast<uint32_t>(std::max<int64_t>(r, 1));
    tp.rttvar_ns = static_cast<uint32_t>(r / 2);
  } else {
    const int64_t dev = tp.srtt_ns > r ? tp.srtt_ns - r : r - tp.srtt_ns;
    tp.rttvar_ns = static_cast<uint32_t>((3 * int64_t{tp.rttvar_ns} + dev) / 4);
    tp.srtt_ns = static_cast<uint32_t>(std::max<int64_t>((7 * int64_t{tp.srtt_ns} + r) / 8, 1));
  }
  refresh_min_srtt(c);
}

// An active path's ACK acknowledged something new: its timer restarts, and the connection has
// made progress (failure detection, §4.1; tail probes, §5.3).
inline void EngineImpl::path_progress(Time now, Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  tp.backoff = 0;
  tp.deadline = tp.in_flight ? now + rto(tp) : Time::max();
  tp.last_progress_ns = now.count();
  // After the whole connection was silent (a stalled peer, a congested host), its paths
  // resume one by one as the backlog drains: only silence since then counts (§4.1).
  if (now.count() - c.last_progress_ns > 2 * srtt_ref(c, tp)) c.progress_since_ns = now.count();
  c.last_progress_ns = now.count();
  c.tlp_count = 0;
  c.tlp_backoff = 0;
  arm_tlp(now, c);
}

// The records moved off `path` (failover copies, on other paths' lists or waiting to go) whose
// original sequence this ACK of `path` acknowledges: the receiver has their packet, by the
// original or by a copy naming it, so they are acknowledged wherever they are now.
void EngineImpl::resolve_moved(Connection& c, uint16_t path, const wire::AckHeader& a) {
  auto covered = [&](uint32_t seq) {
    return seq_lt(seq, a.cum_seq) ||
           (seq != a.cum_seq && seq_lt(a.cum_seq, seq) && sack_bit(a.sack, seq - a.cum_seq - 1));
  };
  for (uint16_t p = 0; p < c.tx.size() && c.tx[path].moved; ++p) {
    if (p == path) continue;
    TxPath& tq = c.tx[p];
    bool changed = false;
    for (uint16_t prev = kNil, idx = tq.head; idx != kNil;) {
      const TxDesc& d = c.pool[idx];
      const uint16_t next = d.next;
      if ((d.flags & detail::kCopy) && d.orig_path == path && covered(d.orig_seq)) {
        list_remove(c, p, prev, idx);
        ack_desc(c, idx);
        changed = true;
      } else {
        prev = idx;
      }
      idx = next;
    }
    if (changed) update_una(c, p);
  }
  for (uint16_t prev = kNil, idx = c.move_head; idx != kNil && c.tx[path].moved;) {
    const TxDesc& d = c.pool[idx];
    const uint16_t next = d.next;
    if (d.orig_path == path && covered(d.orig_seq)) {
      if (prev == kNil) c.move_head = next;
      else c.pool[prev].next = next;
      if (c.move_tail == idx) c.move_tail = prev;
      ack_desc(c, idx);
    } else {
      prev = idx;
    }
    idx = next;
  }
}

// ECN AIMD (congestion.md §2): a CE echo halves the path's window, at most once per its RTT,
// and takes the same amount off the connection window; unmarked progress adds one packet per
// window's worth of acknowledgements to both, outside the RTT that follows a decrease.
void EngineImpl::congestion_on_ack(Time now, Connection& c, uint16_t path, uint32_t newly,
                                   uint16_t ce) {
  TxPath& tp = c.tx[path];
  const int64_t rtt = std::max<int64_t>(srtt_ref(c, tp), 1000);
  const bool settled = now.count() - tp.last_md_ns >= rtt;
  // The fraction of the path's packets that came back CE-marked, smoothed per packet (DCTCP's
  // alpha, gain 1/16, from 1): a path whose packets are all marked halves, marks that are rare
  // cut it by as little (congestion.md §2.2). An ACK may cover many packets; its marks count as
  // the newest.
  const uint32_t n = std::max<uint32_t>(newly, 1), m = std::min<uint32_t>(ce, n);
  uint32_t a = tp.alpha;
  for (uint32_t i = n - std::min<uint32_t>(n, 64); i < n; ++i)
    a = a - (a >> kAlphaShift) + ((i >= n - m ? kAlphaOne : 0) >> kAlphaShift);
  tp.alpha = static_cast<uint16_t>(a);
  if (ce) {
    if (!settled) return;
    const uint32_t old = tp.cwnd;
    const uint32_t cut = static_cast<uint32_t>(uint64_t{old} * tp.alpha / (2 * kAlphaOne));
    tp.cwnd = std::max(old - cut, kWinUnit);
    uint32_t& pw = c.plane_cwnd[tp.plane];
    const uint32_t dec = std::min(old - tp.cwnd, pw / 2);
    pw = std::max(pw - dec, kMinConnWindow * kWinUnit);
    tp.last_md_ns = now.count();
    ++stats_.ecn_decreases;
    return;
  }
  if (!newly || !settled) return;
  const uint64_t u2 = uint64_t{kWinUnit} * kWinUnit;
  // A window grows only while it is what limits (it was full before these ACKs): one that the
  // connection's window holds back would grow unchecked, and its next halving would then take
  // more off the connection than the path ever had in flight (congestion.md §2.3).
  if (tp.in_flight + newly >= window_packets(tp.cwnd))
    tp.cwnd = static_cast<uint32_t>(
        std::min<uint64_t>(tp.cwnd + newly * u2 / tp.cwnd, kPathWindow * kWinUnit));
  // The plane's window: one packet per RTT per plane (congestion.md §2.3), so a connection is as
  // aggressive as one flow at a bottleneck inside a plane, and planes, independent networks,
  // neither hold each other back nor share one window's cuts. One window for the connection
  // made 2, 4 and 8 planes 0.70, 0.64 and 0.53 of linear (Planes.GoodputGrowsLinearly...).
  uint32_t& pw = c.plane_cwnd[tp.plane];
  if (c.plane_in_flight[tp.plane] + newly >= window_packets(pw))
    pw = static_cast<uint32_t>(std::min<uint64_t>(pw + newly * u2 / pw,
                                                  uint64_t{cfg_.conn_window_max} * kWinUnit));
}

// An RNR NAK (congestion.md §6): wait out the back-off the responder named (its QP's
// min_rnr_timer; none named: rnr_delay), then resend; not a loss, not an RTO retry. The message
// fails with kRnr only after its QP's rnr_retry refusals (7: never).
void EngineImpl::rnr_nak(Time now, Connection& c, uint16_t idx, uint8_t rnr_timer) {
  TxDesc& d = c.pool[idx];
  ++stats_.rnr_naks_received;
  if (d.flags & detail::kRnrWait) return;
  detail::MsgSlot& s = slots_[d.slot];
  const uint8_t limit = s.m.rnr_retry == MessageDesc::kEngineRetries
                            ? cfg_.rnr_retry
                            : std::min(s.m.rnr_retry, kRnrInfinite);
  if (d.rnr_retries < UINT8_MAX) ++d.rnr_retries;
  if (limit != kRnrInfinite && d.rnr_retries > limit) {
    fail_message(c, d.slot, Syndrome::kRnr, now);
    return;
  }
  const Time wait = (rnr_timer & wire::kRnrTimerValid)
                        ? rnr_timer_delay(rnr_timer & wire::kRnrTimerCodeMask)
                        : cfg_.rnr_delay;
  s.resume_ns = std::max(s.resume_ns, (now + wait).count());
  c.rnr_deadline = std::min(c.rnr_deadline, Time(s.resume_ns));
  hold_message(c, d.slot);
}

// Every packet of a refused message still in flight was refused too, or will be (the receive is
// not there): all wait out the back-off, and send_new sends no more of it until then. Left to
// look lost, they were resent into the same refusal, timed their paths out and moved, until the
// resends had filled every path's SACK span and nothing could be sent at all (an 8 MiB SEND
// that came before its receive hung for good). Their paths answered, and will be quiet until
// the back-off ends: silence counts from then.
void EngineImpl::hold_message(Connection& c, uint32_t slot) {
  const int64_t resume = slots_[slot].resume_ns;
  for (uint16_t p = 0; p < c.paths_used; ++p) {
    TxPath& tp = c.tx[p];
    bool held = false;
    for (uint16_t i = tp.head; i != kNil; i = c.pool[i].next) {
      TxDesc& o = c.pool[i];
      if (o.slot != slot) continue;
      o.flags = static_cast<uint8_t>((o.flags | detail::kRnrWait) & ~detail::kRetxQueued);
      held = true;
    }
    if (held) tp.last_progress_ns = std::max(tp.last_progress_ns, resume);
  }
}

// The peer has no such stream (congestion.md §6.1): every message of that stream to that peer
// is parked, all their packets resolved (none was delivered; they must not look lost and get
// their paths suspected), and resent whole after a back-off that grows with how long the stream
// has been gone (rnr_delay .. rto_max), with fresh sequence numbers. They fail when the stream
// has been gone for the QP's timeout * (retry_cnt + 1). One NAK record per stream and path is
// enough, whatever the number of packets in flight.
void EngineImpl::park(Connection& c, uint32_t nak_slot, Time now) {
  const uint32_t src = slots_[nak_slot].m.src_stream, dst = slots_[nak_slot].m.dst_stream;
  const int64_t since = slots_[nak_slot].unreachable_ns ? slots_[nak_slot].unreachable_ns : now.count();
  const Time backoff = std::clamp((now - Time(since)) / 4, cfg_.rnr_delay, cfg_.rto_max);
  for (uint32_t slot = c.head; slot != kNoSlot;) {
    detail::MsgSlot& s = slots_[slot];
    const uint32_t next = s.next;
    if (s.m.src_stream != src || s.m.dst_stream != dst) {
      slot = next;
      continue;
    }
    abandon(c, slot, now);
    if (c.cursor == slot) c.cursor = next;
    if (s.prev != kNoSlot) slots_[s.prev].next = next;
    else c.head = next;
    if (next != kNoSlot) slots_[next].prev = s.prev;
    else c.tail = s.prev;
    s.prev = s.next = kNoSlot;
    if (s.unreachable_ns == 0) s.unreachable_ns = since;
    s.pkts_sent = s.pkts_acked = s.next_offset = 0;
    s.resume_ns = (now + backoff).count();
    c.parked.push_back(slot);  // in submission order: they resume in it
    slot = next;
  }
  c.park_deadline = std::min(c.park_deadline, now + backoff);
}

// Parked messages whose back-off ended go back to the end of the connection's queue, or fail.
void EngineImpl::resume_parked(Connection& c, Time now) {
  c.park_deadline = Time::max();
  size_t kept = 0;
  for (uint32_t slot : c.parked) {
    detail::MsgSlot& s = slots_[slot];
    if (s.resume_ns > now.count()) {
      c.parked[kept++] = slot;
      c.park_deadline = std::min(c.park_deadline, Time(s.resume_ns));
      continue;
    }
    if (unreachable_too_long(s, now)) {
      // The stream has been gone for its QP's whole timeout: unreachable, as far as it goes.
      done_.push_back({s.m.cookie, Syndrome::kRetryExceeded});
      free_slots_.push_back(slot);
      continue;
    }
    s.prev = c.tail;
    if (c.tail != kNoSlot) slots_[c.tail].next = slot;
    else c.head = slot;
    c.tail = slot;
    if (c.cursor == kNoSlot) c.cursor = slot;
  }
  c.parked.resize(kept);
}

// The engine's own stalls are left out, as for silence: a parked message whose back-off ended
// during a stall is checked at the first pass after it, without having asked again.
bool EngineImpl::unreachable_too_long(const detail::MsgSlot& s, Time now) const {
  if (s.unreachable_ns == 0 || s.m.timeout <= Time{0}) return false;
  return budget_spent(s, Time(s.unreachable_ns), now);
}

// The QP's retry_cnt, or the engine's for a message that names none.
uint32_t EngineImpl::retry_limit(const detail::MsgSlot& s) const {
  return s.m.retry_cnt == MessageDesc::kEngineRetries ? cfg_.max_retries : s.m.retry_cnt;
}

// Whether the QP's whole retry budget, timeout * (retry_cnt + 1), has passed since `since`,
// leaving out the time the engine itself was stalled meanwhile (§4.5).
bool EngineImpl::budget_spent(const detail::MsgSlot& s, Time since, Time now) const {
  return now - since - stalled_since(since) >= s.m.timeout * (int64_t{retry_limit(s)} + 1);
}

}  // namespace metaroce::transport
