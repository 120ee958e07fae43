// SPDX-License-Identifier: Apache-2.0
// The transport state machine: spraying, per-path SACK, selective retransmission, NAKs and
// timers, driven only by the calls of transport::Engine (docs/spec/wire.md §3-§6).
#include "datapath/transport/engine_impl.h"

#include <algorithm>

#include "datapath/transport/path_seq.h"

namespace metaroce::transport {

using detail::DescState;
using detail::kNoSlot;

namespace {

uint32_t ts32(Time t) { return static_cast<uint32_t>(t.count()); }

EngineConfig sanitize(EngineConfig c) {
  c.num_paths = std::clamp<uint16_t>(c.num_paths, 1, wire::kMaxPathCount);
  c.num_planes = std::max<uint8_t>(c.num_planes, 1);
  // An ACK must carry every NAK record a path keeps, or a rejection could go unreported.
  c.max_packet = std::max<uint32_t>(
      c.max_packet, static_cast<uint32_t>(wire::kAckHeadersLen + kNakSlots * wire::kNakRecordLen));
  c.mtu_payload = std::max<uint32_t>(c.mtu_payload, 1);
  if (c.rto_min > c.rto_max) c.rto_min = c.rto_max;
  return c;
}

bool sack_bit(const std::array<uint64_t, 4>& sack, uint32_t i) {
  return i < wire::kSackBits && ((sack[i / 64] >> (i % 64)) & 1);
}

}  // namespace

std::unique_ptr<Engine> Engine::create(const EngineConfig& cfg, Host& host) {
  return std::make_unique<EngineImpl>(cfg, host);
}

EngineImpl::EngineImpl(const EngineConfig& cfg, Host& host)
    : cfg_(sanitize(cfg)), host_(host), rng_state_(cfg.seed) {
  seg_size_ = std::min<uint32_t>(cfg_.mtu_payload,
                                 cfg_.max_packet - static_cast<uint32_t>(wire::kDataHeadersLen));
  acks_.reserve(256);
  retx_.reserve(256);
  done_.reserve(64);
}

// splitmix64: tiny, seedable, good enough for ids, tokens and port bases.
uint64_t EngineImpl::next_random() {
  uint64_t z = (rng_state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

EngineImpl::Connection& EngineImpl::conn_for(uint32_t peer_ip) {
  if (auto it = conns_.find(peer_ip); it != conns_.end()) return *it->second;
  auto c = std::make_unique<Connection>();
  c->peer_ip = peer_ip;
  const uint32_t span = 65536u - kEphemeralPortBase - cfg_.num_paths + 1;
  c->port_base = static_cast<uint16_t>(kEphemeralPortBase + next_random() % span);
  do {
    c->conn_id = static_cast<uint32_t>(next_random());
  } while (c->conn_id == 0);
  c->token = next_random();
  c->tx.resize(cfg_.num_paths);
  c->descs.resize(size_t{cfg_.num_paths} * kPathWindow);
  c->rr_next = static_cast<uint16_t>(next_random() % cfg_.num_paths);
  Connection& ref = *c;
  conn_list_.push_back(c.get());
  conns_.emplace(peer_ip, std::move(c));
  return ref;
}

uint32_t EngineImpl::conn_id(uint32_t peer_ip) const {
  auto it = conns_.find(peer_ip);
  return it == conns_.end() ? 0 : it->second->conn_id;
}

// RFC 6298 from the path's own samples, clamped, then exponential back-off (spec §6.3).
Time EngineImpl::rto(const TxPath& tp) const {
  Time base = cfg_.rto_initial;
  if (tp.srtt_ns != 0) base = Time(tp.srtt_ns + std::max<int64_t>(4 * tp.rttvar_ns, 1000));
  base = std::clamp(base, cfg_.rto_min, cfg_.rto_max);
  for (uint8_t i = 0; i < tp.backoff && base < cfg_.rto_max; ++i) base *= 2;
  return std::min(base, cfg_.rto_max);
}

uint16_t EngineImpl::port_of(const Connection& c, uint16_t path) const {
  return static_cast<uint16_t>(c.port_base + path % cfg_.num_paths);
}

uint8_t EngineImpl::plane_of(uint16_t path) const {
  return static_cast<uint8_t>(path % cfg_.num_planes);
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
// Submission and sending

void EngineImpl::submit(const MessageDesc& msg) {
  Connection& c = conn_for(msg.peer_ip);
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

bool EngineImpl::emit_data(Time now, Connection& c, uint16_t path, uint32_t seq, TxSink& sink,
                           bool retx) {
  TxDesc& d = desc(c, path, seq);
  const MessageDesc& m = slots_[d.slot].m;
  const uint32_t len = wire::kDataHeadersLen + d.len;
  std::span<uint8_t> buf = sink.begin(len);
  if (buf.size() < len) return false;
  TxPath& tp = c.tx[path];

  wire::BaseHeader b;
  b.opcode = static_cast<wire::Opcode>(m.op);
  b.conn_id = c.conn_id;
  b.token = c.token;
  b.path_id = path;
  b.path_count = cfg_.num_paths;
  b.path_seq = seq;
  b.timestamp = ts32(now);
  b.ack_floor = tp.una;
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
  h.payload_len = d.len;
  wire::encode_data(buf, b, h);
  if (d.len) host_.gather(m.cookie, d.offset, buf.subspan(wire::kDataHeadersLen, d.len));
  sink.commit(c.peer_ip, port_of(c, path), plane_of(path), len);

  d.sent_ns = now.count();
  d.tx_order = tp.tx_order++;
  d.retx_queued = false;
  ++tp.tx_packets;
  tp.tx_bytes += len;
  ++stats_.tx_packets;
  stats_.tx_bytes += len;
  if (retx) {
    ++tp.retransmits;
    ++stats_.retransmits;
  }
  if (tp.rto_deadline == Time::max()) tp.rto_deadline = now + rto(tp);
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
    naks[i] = {rp.naks[i].seq, rp.naks[i].src_stream, rp.naks[i].msn, rp.naks[i].syndrome};
  }
  const uint32_t len = wire::kAckHeadersLen + n * wire::kNakRecordLen;
  std::span<uint8_t> buf = sink.begin(len);
  if (buf.size() < len) return false;

  wire::BaseHeader b;
  b.opcode = wire::Opcode::kAck;
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
  wire::encode_ack(buf, b, a, std::span(naks.data(), n));
  sink.commit(c.peer_ip, port_of(c, path), plane_of(path), len);

  rp.ack_pending = false;
  rp.ce_since_ack = 0;
  ++stats_.acks_sent;
  ++stats_.tx_packets;
  stats_.tx_bytes += len;
  return true;
}

uint32_t EngineImpl::poll_tx(Time now, TxSink& sink) {
  uint32_t sent = 0;
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

  // 2. Retransmissions, oldest request first.
  for (; retx_head_ < retx_.size(); ++retx_head_) {
    const RetxRef r = retx_[retx_head_];
    TxPath& tp = r.conn->tx[r.path];
    if (!seq_le(tp.una, r.seq) || !seq_lt(r.seq, tp.next_seq)) continue;
    TxDesc& d = desc(*r.conn, r.path, r.seq);
    if (d.state != DescState::kInFlight || !d.retx_queued) continue;
    if (!emit_data(now, *r.conn, r.path, r.seq, sink, true)) return sent;
    ++sent;
  }
  retx_.clear();
  retx_head_ = 0;

  // 3. New packets, sprayed one by one over the paths that have window (spec §6.1).
  for (Connection* c : conn_list_) {
    while (c->cursor != kNoSlot) {
      const uint16_t np = cfg_.num_paths;
      uint16_t path = np;
      for (uint16_t k = 0; k < np; ++k) {
        const uint16_t p = static_cast<uint16_t>((c->rr_next + k) % np);
        if (c->tx[p].next_seq - c->tx[p].una < kPathWindow) {
          path = p;
          break;
        }
      }
      if (path == np) break;
      detail::MsgSlot& s = slots_[c->cursor];
      TxPath& tp = c->tx[path];
      const uint32_t seq = tp.next_seq;
      TxDesc& d = desc(*c, path, seq);
      d = TxDesc{};
      d.slot = c->cursor;
      d.offset = s.next_offset;
      d.len = s.m.op == Op::kReadReq ? 0 : std::min(seg_size_, s.m.length - s.next_offset);
      d.state = DescState::kInFlight;
      if (!emit_data(now, *c, path, seq, sink, false)) {
        d.state = DescState::kFree;
        return sent;
      }
      ++sent;
      ++tp.next_seq;
      ++tp.in_flight;
      ++c->in_flight;
      c->rr_next = static_cast<uint16_t>((path + 1) % np);
      s.next_offset += d.len;
      if (++s.pkts_sent == s.pkts_total) c->cursor = s.next;
    }
  }
  return sent;
}

// ---------------------------------------------------------------------------------------------
// Receiving

void EngineImpl::on_packet(Time now, uint32_t peer_ip, uint16_t /*udp_src_port*/, bool ecn_ce,
                           std::span<const uint8_t> udp_payload) {
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
    handle_data(now, conn_for(peer_ip), ecn_ce, pkt);
  } else if (pkt.base.opcode == wire::Opcode::kAck) {
    handle_ack(now, peer_ip, pkt);
  } else {
    auto it = conns_.find(peer_ip);
    if (it == conns_.end()) ++stats_.drop_unknown_conn;
    else handle_probe(now, *it->second, ecn_ce, pkt);
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

void EngineImpl::request_ack(Connection& c, RecvDir& d, uint16_t path, uint32_t ts, bool ecn_ce) {
  RxPath& rp = d.paths[path];
  rp.echo_ts = ts;
  if (ecn_ce) {
    if (rp.ce_since_ack != UINT16_MAX) ++rp.ce_since_ack;
    ++rp.ce_total;
  }
  if (!rp.ack_pending) {
    rp.ack_pending = true;
    acks_.push_back({&c, d.conn_id, path});
  }
}

void EngineImpl::handle_data(Time now, Connection& c, bool ecn_ce, const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  RecvDir* d = find_dir(c, b.conn_id);
  if (!d) {
    d = &create_dir(c, b, now);
  } else if (d->token != b.token) {
    ++stats_.drop_token;
    return;
  } else if (d->path_count != b.path_count) {
    ++stats_.drop_malformed;
    return;
  }
  d->last_used_ns = now.count();
  RxPath& rp = d->paths[b.path_id];
  rp.win.advance_to(b.ack_floor);

  switch (rp.win.check(b.path_seq)) {
    case SackWindow::Check::kOutOfWindow:
      ++stats_.drop_out_of_window;
      return;
    case SackWindow::Check::kDuplicate:
      // The ACK that covered it was lost or is late: say it again, deliver nothing.
      ++stats_.duplicates;
      ++rp.duplicates;
      request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
      return;
    case SackWindow::Check::kNew:
      break;
  }

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
  seg.payload = pkt.payload;
  const uint32_t dir_id = d->conn_id;
  const uint16_t path = b.path_id;

  const Syndrome why = host_.deliver(seg);
  // deliver() may submit (a READ response); our receive state is untouched by that, but look
  // the direction up again rather than trust a pointer across a callback.
  d = find_dir(c, dir_id);
  if (!d) return;
  RxPath& r = d->paths[path];
  ++r.rx_packets;
  r.rx_bytes += pkt.payload.size();
  if (why == Syndrome::kOk) {
    r.win.mark(b.path_seq);
  } else if (why == Syndrome::kRnr || r.nak_count == kNakSlots) {
    // Not marked: the sender sees the hole and retransmits. A full NAK list is treated the same
    // way, so that no rejection goes unreported (spec §5.3).
    ++stats_.drop_rnr;
  } else {
    r.naks[r.nak_count++] = {b.path_seq, h.src_stream, h.msn, static_cast<uint8_t>(why)};
    r.win.mark(b.path_seq);
    ++stats_.naks_sent;
  }
  request_ack(c, *d, path, b.timestamp, ecn_ce);
}

void EngineImpl::handle_probe(Time now, Connection& c, bool ecn_ce, const wire::Packet& pkt) {
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
  if (d->path_count != b.path_count) {
    ++stats_.drop_malformed;
    return;
  }
  d->last_used_ns = now.count();
  d->paths[b.path_id].win.advance_to(b.ack_floor);
  request_ack(c, *d, b.path_id, b.timestamp, ecn_ce);
}

void EngineImpl::handle_ack(Time now, uint32_t peer_ip, const wire::Packet& pkt) {
  const wire::BaseHeader& b = pkt.base;
  auto it = conns_.find(peer_ip);
  if (it == conns_.end() || it->second->conn_id != b.conn_id) {
    ++stats_.drop_unknown_conn;
    return;
  }
  Connection& c = *it->second;
  if (c.token != b.token) {
    ++stats_.drop_token;
    return;
  }
  if (b.path_count != cfg_.num_paths) {
    ++stats_.drop_malformed;
    return;
  }
  const uint16_t path = b.path_id;
  TxPath& tp = c.tx[path];
  const wire::AckHeader& a = pkt.ack;
  // An ACK for a sequence never sent is forged or corrupt.
  if (seq_lt(tp.next_seq, a.cum_seq)) {
    ++stats_.drop_malformed;
    return;
  }
  ++stats_.acks_received;
  ++tp.acks_received;
  tp.ce_echoed += a.ecn_ce_count;

  // NAKs before acknowledgements: a rejected packet is also marked received (spec §5.3).
  for (size_t i = 0; i < a.nak_count; ++i) {
    const wire::NakRecord r = pkt.nak(i);
    ++stats_.naks_received;
    if (!seq_le(tp.una, r.path_seq) || !seq_lt(r.path_seq, tp.next_seq)) continue;
    TxDesc& d = desc(c, path, r.path_seq);
    if (d.state != DescState::kInFlight) continue;
    const MessageDesc& m = slots_[d.slot].m;
    if (m.src_stream != r.src_stream || m.msn != r.msn) continue;
    fail_message(c, d.slot, static_cast<Syndrome>(r.syndrome), now);
  }

  bool progress = false;
  for (uint32_t seq = tp.una; seq != tp.next_seq; ++seq) {
    TxDesc& d = desc(c, path, seq);
    if (d.state != DescState::kInFlight) continue;
    const bool acked = seq_lt(seq, a.cum_seq) ||
                       (seq != a.cum_seq && sack_bit(a.sack, seq - a.cum_seq - 1));
    if (!acked) continue;
    if (seq_lt(tp.delivered_order, d.tx_order + 1)) tp.delivered_order = d.tx_order + 1;
    ack_desc(c, tp, d);
    progress = true;
  }

  // Paths are FIFO: a packet transmitted before one that arrived, and still missing, is lost.
  // Retransmitted once; it is not suspected again until something sent after it arrives.
  for (uint32_t seq = tp.una; seq != tp.next_seq; ++seq) {
    TxDesc& d = desc(c, path, seq);
    if (d.state == DescState::kInFlight && !d.retx_queued &&
        seq_lt(d.tx_order, tp.delivered_order)) {
      queue_retx(c, path, seq);
    }
  }

  const uint32_t sample = ts32(now) - a.echo_timestamp;
  if (static_cast<int32_t>(sample) >= 0) {
    const int64_t r = sample;
    if (tp.srtt_ns == 0) {
      tp.srtt_ns = std::max<int64_t>(r, 1);
      tp.rttvar_ns = r / 2;
    } else {
      const int64_t dev = tp.srtt_ns > r ? tp.srtt_ns - r : r - tp.srtt_ns;
      tp.rttvar_ns = (3 * tp.rttvar_ns + dev) / 4;
      tp.srtt_ns = std::max<int64_t>((7 * tp.srtt_ns + r) / 8, 1);
    }
  }
  advance_una(c, path);
  if (progress) {
    tp.backoff = 0;
    tp.rto_deadline = tp.in_flight ? now + rto(tp) : Time::max();
  }
}

// ---------------------------------------------------------------------------------------------
// Resolution of packets and messages

void EngineImpl::ack_desc(Connection& c, TxPath& tp, TxDesc& d) {
  d.state = DescState::kDone;
  --tp.in_flight;
  --c.in_flight;
  detail::MsgSlot& s = slots_[d.slot];
  if (++s.pkts_acked == s.pkts_total) {
    done_.push_back({s.m.cookie, Syndrome::kOk});
    unlink(c, d.slot);
  }
}

void EngineImpl::advance_una(Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  while (tp.una != tp.next_seq) {
    TxDesc& d = desc(c, path, tp.una);
    if (d.state == DescState::kInFlight) break;
    d.state = DescState::kFree;
    ++tp.una;
  }
}

// Stops tracking every packet of a message; the next packets on those paths carry the new
// ack floor, so the receiver skips them (spec §3.1). now == Time::min(): keep the timers.
void EngineImpl::abandon(Connection& c, uint32_t slot, Time now) {
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    TxPath& tp = c.tx[p];
    bool changed = false;
    for (uint32_t seq = tp.una; seq != tp.next_seq; ++seq) {
      TxDesc& d = desc(c, p, seq);
      if (d.state == DescState::kInFlight && d.slot == slot) {
        d.state = DescState::kDone;
        --tp.in_flight;
        --c.in_flight;
        changed = true;
      }
    }
    if (!changed) continue;
    advance_una(c, p);
    if (tp.in_flight == 0) tp.rto_deadline = Time::max();
    else if (now != Time::min()) tp.rto_deadline = now + rto(tp);
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

void EngineImpl::queue_retx(Connection& c, uint16_t path, uint32_t seq) {
  desc(c, path, seq).retx_queued = true;
  retx_.push_back({&c, path, seq});
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
    for (uint32_t s = c->head; s != kNoSlot;) {
      const uint32_t next = slots_[s].next;
      if (slots_[s].m.src_stream == src_stream) {
        abandon(*c, s, Time::min());
        unlink(*c, s);
      }
      s = next;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Timers

void EngineImpl::expire(Time now, Connection& c, uint16_t path) {
  TxPath& tp = c.tx[path];
  if (tp.in_flight == 0) {
    tp.rto_deadline = Time::max();
    return;
  }
  ++stats_.timeouts;
  ++tp.timeouts;
  TxDesc& d = desc(c, path, tp.una);  // in flight: una stops at the oldest unresolved packet
  if (d.rto_retries >= cfg_.max_retries) {
    fail_message(c, d.slot, Syndrome::kRetryExceeded, now);
    return;
  }
  ++d.rto_retries;
  if (tp.backoff < kMaxBackoff) ++tp.backoff;
  if (!d.retx_queued) queue_retx(c, path, tp.una);
  tp.rto_deadline = now + rto(tp);
}

void EngineImpl::on_timer(Time now) {
  for (Connection* c : conn_list_) {
    if (c->in_flight == 0) continue;
    for (uint16_t p = 0; p < c->tx.size(); ++p) {
      if (c->tx[p].rto_deadline <= now) expire(now, *c, p);
    }
  }
  flush_completions();
}

Time EngineImpl::next_deadline() const {
  Time t = Time::max();
  for (const Connection* c : conn_list_) {
    if (c->in_flight == 0) continue;
    for (const TxPath& tp : c->tx) t = std::min(t, tp.rto_deadline);
  }
  return t;
}

bool EngineImpl::idle() const {
  if (!acks_.empty() || retx_head_ < retx_.size()) return false;
  for (const Connection* c : conn_list_) {
    if (c->cursor != kNoSlot || c->in_flight != 0) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Telemetry

std::vector<PathStats> EngineImpl::path_stats(uint32_t peer_ip) const {
  std::vector<PathStats> out;
  auto it = conns_.find(peer_ip);
  if (it == conns_.end()) return out;
  const Connection& c = *it->second;
  const RecvDir* newest = nullptr;
  for (const RecvDir& d : c.rx) {
    if (!newest || d.last_used_ns > newest->last_used_ns) newest = &d;
  }
  for (uint16_t p = 0; p < c.tx.size(); ++p) {
    const TxPath& tp = c.tx[p];
    PathStats s;
    s.path_id = p;
    s.udp_src_port = port_of(c, p);
    s.plane = plane_of(p);
    s.tx_packets = tp.tx_packets;
    s.tx_bytes = tp.tx_bytes;
    s.retransmits = tp.retransmits;
    s.timeouts = tp.timeouts;
    s.acks_received = tp.acks_received;
    s.ecn_ce_echoed = tp.ce_echoed;
    s.next_seq = tp.next_seq;
    s.ack_floor = tp.una;
    s.in_flight = tp.in_flight;
    s.srtt_ns = tp.srtt_ns;
    s.rto_ns = rto(tp).count();
    if (newest && p < newest->paths.size()) {
      const RxPath& rp = newest->paths[p];
      s.rx_packets = rp.rx_packets;
      s.rx_bytes = rp.rx_bytes;
      s.duplicates = rp.duplicates;
      s.ecn_ce_received = rp.ce_total;
      s.rx_cum = rp.win.cum();
    }
    out.push_back(s);
  }
  return out;
}

std::vector<PathStats> path_stats(const Engine& engine, uint32_t peer_ip) {
  const auto* e = dynamic_cast<const EngineImpl*>(&engine);
  return e ? e->path_stats(peer_ip) : std::vector<PathStats>{};
}

std::array<uint64_t, static_cast<size_t>(wire::DecodeError::kCount)> decode_drops(
    const Engine& engine) {
  const auto* e = dynamic_cast<const EngineImpl*>(&engine);
  if (!e) return {};
  return e->decode_drops();
}

}  // namespace metaroce::transport
