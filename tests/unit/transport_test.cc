// SPDX-License-Identifier: Apache-2.0
// Unit tests of datapath/transport: two engines joined by a scripted in-test fabric on a
// virtual clock, with fake hosts that own the message bytes and record every delivery.
#include <gtest/gtest.h>

#include <climits>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "datapath/transport/engine.h"
#include "datapath/transport/engine_impl.h"
#include "datapath/transport/path_stats.h"
#include "datapath/transport/sack_window.h"
#include "datapath/wire/mrh.h"

namespace metaroce::transport {
namespace {

using namespace std::chrono_literals;
using wire::Opcode;

constexpr uint32_t kIpA = 0x0a000001, kIpB = 0x0a000002;
constexpr uint32_t kMtu = 1024;

class FakeHost : public Host {
 public:
  using Key = std::pair<uint32_t, uint32_t>;                  // src_stream, msn
  using SegKey = std::tuple<uint32_t, uint32_t, uint32_t>;    // src_stream, msn, offset

  void gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) override {
    const auto& src = outgoing.at(cookie);
    ASSERT_LE(offset + out.size(), src.size());
    std::copy_n(src.begin() + offset, out.size(), out.begin());
  }
  Syndrome deliver(const Segment& seg) override {
    ++deliver_calls;
    const Syndrome s = verdict ? verdict(seg) : Syndrome::kOk;
    if (s != Syndrome::kOk) return s;
    segments.push_back(seg);
    segments.back().payload = {};
    auto& buf = received[{seg.src_stream, seg.msn}];
    buf.resize(seg.op == Op::kReadReq ? 0 : seg.total_length);
    std::copy(seg.payload.begin(), seg.payload.end(), buf.begin() + seg.offset);
    ++deliveries[{seg.src_stream, seg.msn, seg.offset}];
    return s;
  }
  void message_acked(uint64_t cookie) override { acked.push_back(cookie); }
  void message_failed(uint64_t cookie, Syndrome why) override { failed.push_back({cookie, why}); }
  int rnr_timer(uint32_t stream) override {
    auto it = rnr_timers.find(stream);
    return it == rnr_timers.end() ? -1 : it->second;
  }

  std::map<uint32_t, int> rnr_timers;  // min_rnr_timer code per receiving stream
  std::map<uint64_t, std::vector<uint8_t>> outgoing;
  std::map<Key, std::vector<uint8_t>> received;
  std::map<SegKey, int> deliveries;
  std::vector<Segment> segments;
  std::vector<uint64_t> acked;
  std::vector<std::pair<uint64_t, Syndrome>> failed;
  std::function<Syndrome(const Segment&)> verdict;
  int deliver_calls = 0;
};

// One transmitted packet as the fabric saw it.
struct Sent {
  int from = 0;
  uint32_t peer_ip = 0;
  uint16_t sport = 0;
  uint8_t plane = 0;
  Time tx_time{0};
  Time arrival{0};
  std::vector<uint8_t> bytes;
  wire::Packet pkt;  // decoded (spans point into bytes)
  bool dropped = false;
  bool ce = false;
};

enum class Fate { kDeliver, kDrop, kDuplicate };

class Fabric {
 public:
  explicit Fabric(EngineConfig base = default_config()) {
    EngineConfig a = base, b = base;
    a.local_ip = kIpA;
    a.seed = 11;
    b.local_ip = kIpB;
    b.seed = 22;
    cfg = base;
    node[0].ip = kIpA;
    node[1].ip = kIpB;
    node[0].e = Engine::create(a, node[0].host);
    node[1].e = Engine::create(b, node[1].host);
    for (int i = 0; i < 2; ++i) sink[i] = std::make_unique<Sink>(*this, i);
  }

  static EngineConfig default_config() {
    EngineConfig c;
    c.num_paths = 4;
    c.num_planes = 2;
    c.mtu_payload = kMtu;
    c.max_packet = kMtu + 128;
    c.rto_initial = 1ms;
    c.rto_min = 200us;
    c.rto_max = 100ms;
    c.max_retries = 7;
    return c;
  }

  struct Node {
    std::unique_ptr<Engine> e;
    FakeHost host;
    uint32_t ip = 0;
  };

  // Queues a message of `size` pseudo-random bytes from node `from` to the other node.
  uint64_t submit(int from, uint32_t stream, uint32_t msn, uint32_t size, Op op = Op::kWrite) {
    const uint64_t cookie = next_cookie_++;
    std::vector<uint8_t> bytes(op == Op::kReadReq ? 0 : size);
    for (auto& x : bytes) x = static_cast<uint8_t>(bytes_rng_());
    node[from].host.outgoing[cookie] = std::move(bytes);
    MessageDesc m;
    m.peer_ip = node[1 - from].ip;
    m.dst_stream = stream + 1000;
    m.src_stream = stream;
    m.msn = msn;
    m.op = op;
    m.length = size;
    m.remote_addr = 0x10000;
    m.rkey = 7;
    m.cookie = cookie;
    m.rnr_retry = rnr_retry;
    m.xrc = xrc_srqn >= 0;
    m.xrc_srqn = m.xrc ? static_cast<uint32_t>(xrc_srqn) : 0;
    node[from].e->submit(m);
    return cookie;
  }

  uint8_t rnr_retry = MessageDesc::kEngineRetries;  // the QP's, for every message submitted
  int64_t xrc_srqn = -1;  // >= 0: every message submitted names this XRC SRQ

  // Advances the virtual clock event by event; false when nothing is left to happen.
  bool step() {
    for (int i = 0; i < 2; ++i) node[i].e->poll_tx(now, *sink[i]);
    Time next = Time::max();
    if (!wire_.empty()) next = wire_.begin()->first;
    for (auto& n : node) next = std::min(next, std::max(n.e->next_deadline(), timers_held_until));
    if (next == Time::max()) return false;
    now = std::max(now, next);
    while (!wire_.empty() && wire_.begin()->first <= now) {
      const size_t idx = wire_.begin()->second;
      wire_.erase(wire_.begin());
      const Sent& s = log[idx];
      const int to = s.peer_ip == kIpA ? 0 : 1;
      arrivals.push_back(idx);
      node[to].e->on_packet(now, node[s.from].ip, s.sport, s.ce, s.bytes, s.plane);
    }
    for (auto& n : node) {
      if (n.e->next_deadline() <= now && now >= timers_held_until) n.e->on_timer(now);
    }
    return true;
  }

  // Runs until both engines are idle and nothing is on the wire, or until limit.
  void run(Time limit = 10s) {
    // Nothing scheduled and nothing on the wire: whether idle or stuck, nothing more happens.
    while (now < limit) {
      if (!step()) return;
    }
  }

  std::vector<const Sent*> data_from(int from) const {
    std::vector<const Sent*> out;
    for (const Sent& s : log) {
      if (s.from == from && wire::is_data_opcode(s.pkt.base.opcode)) out.push_back(&s);
    }
    return out;
  }

  Node node[2];
  EngineConfig cfg;
  Time now{0};
  Time timers_held_until{0};  // no engine's timers fire before (its owner stalled), packets do
  Time delay = 10us;
  std::function<Time(const Sent&)> extra_delay;
  std::function<Fate(const Sent&)> fate;
  std::function<bool(const Sent&)> mark_ce;
  std::vector<Sent> log;
  std::vector<size_t> arrivals;  // indices into log, in arrival order

 private:
  class Sink : public TxSink {
   public:
    Sink(Fabric& f, int from) : f_(f), from_(from) {}
    std::span<uint8_t> begin(uint32_t max_len, uint8_t) override {
      buf_.assign(max_len, 0);
      return buf_;
    }
    void commit(uint32_t peer_ip, uint16_t sport, uint8_t plane, uint32_t len) override {
      Sent s;
      s.from = from_;
      s.peer_ip = peer_ip;
      s.sport = sport;
      s.plane = plane;
      s.tx_time = f_.now;
      s.bytes.assign(buf_.begin(), buf_.begin() + len);
      f_.log.push_back(std::move(s));
      Sent& x = f_.log.back();
      EXPECT_EQ(wire::decode(x.bytes, x.pkt), wire::DecodeError::kNone);
      x.ce = f_.mark_ce && f_.mark_ce(x);
      const Fate fate = f_.fate ? f_.fate(x) : Fate::kDeliver;
      x.arrival = f_.now + f_.delay + (f_.extra_delay ? f_.extra_delay(x) : Time{0});
      const size_t idx = f_.log.size() - 1;
      if (fate == Fate::kDrop) {
        x.dropped = true;
        return;
      }
      f_.wire_.emplace(x.arrival, idx);
      if (fate == Fate::kDuplicate) f_.wire_.emplace(x.arrival + 1us, idx);
    }

   private:
    Fabric& f_;
    int from_;
    std::vector<uint8_t> buf_;
  };

  std::unique_ptr<Sink> sink[2];
  std::multimap<Time, size_t> wire_;
  uint64_t next_cookie_ = 1;
  std::mt19937 bytes_rng_{42};
};

// Every message from `from` arrived byte-exact at the other node, each segment once.
void expect_all_delivered_exactly(const Fabric& f, int from) {
  const FakeHost& tx = f.node[from].host;
  const FakeHost& rx = f.node[1 - from].host;
  EXPECT_TRUE(tx.failed.empty());
  EXPECT_EQ(tx.acked.size(), tx.outgoing.size());
  for (const auto& [seg, count] : rx.deliveries) EXPECT_EQ(count, 1);
  // Cookies were handed out in submission order; map them back to (stream, msn) by scanning.
  for (const Sent* s : f.data_from(from)) {
    const auto key = FakeHost::Key{s->pkt.data.src_stream, s->pkt.data.msn};
    ASSERT_TRUE(rx.received.count(key)) << s->pkt.data.msn;
  }
}

std::vector<uint8_t> sent_bytes(const Fabric& f, int from, uint64_t cookie) {
  return f.node[from].host.outgoing.at(cookie);
}

// A host's transmit queue with room for `room` more packets (then full), each handed on to
// `next` or, without one, dropped where nobody sees it.
struct QueueSink : TxSink {
  explicit QueueSink(int room, TxSink* next = nullptr) : room(room), next(next) {}
  std::span<uint8_t> begin(uint32_t len, uint8_t plane) override {
    if (room <= 0) return {};
    if (next) return next->begin(len, plane);
    buf.assign(len, 0);
    return buf;
  }
  void commit(uint32_t ip, uint16_t sport, uint8_t plane, uint32_t len) override {
    --room;
    if (next) next->commit(ip, sport, plane, len);
  }
  int room;
  TxSink* next;
  std::vector<uint8_t> buf;
};

// ---------------------------------------------------------------------------------------------

TEST(SackWindow, InOrderAndOutOfOrderArrivalsMoveCumAndSack) {
  SackWindow w;
  EXPECT_EQ(w.check(0), SackWindow::Check::kNew);
  w.mark(0);
  EXPECT_EQ(w.cum(), 1u);
  EXPECT_EQ(w.check(0), SackWindow::Check::kDuplicate);
  w.mark(3);
  w.mark(5);
  EXPECT_EQ(w.cum(), 1u);
  auto s = w.sack();  // bit i <-> cum + 1 + i
  EXPECT_EQ(s[0], (1ull << 1) | (1ull << 3));
  EXPECT_EQ(w.check(3), SackWindow::Check::kDuplicate);
  EXPECT_EQ(w.check(1 + 256), SackWindow::Check::kNew);
  EXPECT_EQ(w.check(1 + 257), SackWindow::Check::kOutOfWindow);
  w.mark(257);  // the far edge of the window
  EXPECT_EQ(w.sack()[3] >> 63, 1u);
  w.mark(1);
  w.mark(2);
  EXPECT_EQ(w.cum(), 4u);  // 1,2,3 done; 4 missing
  w.advance_to(5);         // sender gave up on 4; 5 was already here
  EXPECT_EQ(w.cum(), 6u);
  w.advance_to(3);         // floors never move back
  EXPECT_EQ(w.cum(), 6u);
}

// Against a set of received sequences, through reordering, duplicates, floors and the in-order
// shortcut: cum is the first missing sequence and the SACK lists exactly the rest.
TEST(SackWindow, AgreesWithASetOfReceivedSequencesUnderRandomArrivals) {
  std::mt19937 rng(7);
  SackWindow w;
  std::set<uint32_t> got;
  uint32_t cum = 0, next = 0;
  for (int step = 0; step < 200000; ++step) {
    const uint32_t r = rng() % 100;
    uint32_t seq;
    if (r < 60) seq = next++;                                       // in order
    else if (r < 95) seq = cum + rng() % (SackWindow::kSpan + 1);  // anywhere in the window
    else seq = cum - 1 - rng() % 8;                                 // old duplicate
    if (r == 99) {                                                  // the sender's floor
      const uint32_t floor = cum + rng() % 16;
      w.advance_to(floor);
      for (uint32_t s = cum; s != floor; ++s) got.insert(s);
    } else if (w.check(seq) == SackWindow::Check::kNew) {
      ASSERT_FALSE(got.count(seq)) << seq;
      w.mark(seq);
      got.insert(seq);
    } else {
      ASSERT_TRUE(seq_diff(cum, seq) < 0 || got.count(seq) || seq_diff(cum, seq) > 256) << seq;
    }
    while (got.count(cum)) got.erase(cum++);
    if (seq_diff(next, cum) > 0) next = cum;
    ASSERT_EQ(w.cum(), cum) << "step " << step;
    const auto sack = w.sack();
    for (uint32_t i = 0; i < SackWindow::kSpan; ++i) {
      const bool bit = (sack[i / 64] >> (i % 64)) & 1;
      ASSERT_EQ(bit, got.count(cum + 1 + i) == 1) << "step " << step << " bit " << i;
    }
  }
}

TEST(SackWindow, SurvivesSequenceWrap) {
  SackWindow w;
  w.advance_to(0x7fffffffu);  // floors move forward by less than 2^31 at a time
  w.advance_to(0xfffffffeu);
  EXPECT_EQ(w.cum(), 0xfffffffeu);
  w.advance_to(0xfffffff0u);  // behind: floors never move back
  EXPECT_EQ(w.cum(), 0xfffffffeu);
  w.mark(0xffffffffu);
  EXPECT_EQ(w.cum(), 0xfffffffeu);
  w.mark(0xfffffffeu);
  EXPECT_EQ(w.cum(), 0u);
  w.mark(1);
  EXPECT_EQ(w.sack()[0], 1ull);
  EXPECT_EQ(w.check(0xffffffffu), SackWindow::Check::kDuplicate);
}

TEST(TransportSizes, CoreStructsStaySmall) {
  using namespace detail;
  std::printf("sizeof: SackWindow %zu, TxDesc %zu, TxPath %zu, PathCounters %zu, RxPath %zu, "
              "RecvDir %zu, MsgSlot %zu, Connection %zu\n",
              sizeof(SackWindow), sizeof(TxDesc), sizeof(TxPath), sizeof(PathCounters),
              sizeof(RxPath), sizeof(RecvDir), sizeof(MsgSlot), sizeof(Connection));
  const EngineConfig cfg;
  std::printf("8-path connection: %zu B fixed + %zu B per path (send %zu + counters %zu + "
              "receive %zu) + %zu B per packet in flight, allocated as first used, <= %u\n",
              sizeof(Connection) + sizeof(RecvDir),
              sizeof(TxPath) + sizeof(PathCounters) + sizeof(RxPath), sizeof(TxPath),
              sizeof(PathCounters), sizeof(RxPath), sizeof(TxDesc), cfg.conn_window_max);
  EXPECT_LE(sizeof(SackWindow), 48u);
  EXPECT_LE(sizeof(TxDesc), 32u);
  EXPECT_LE(sizeof(TxPath), 72u);
  EXPECT_LE(sizeof(RxPath), 160u);
  // With the streams parked because the peer lost them, the lane profile, a window per plane
  // (16 planes: 96 bytes, what made planes add up linearly), its place in the deadline heap
  // (16 bytes, what keeps timers from scanning every connection), its own resend queue (paced
  // with its data), the late-packet deadline and stamp, and the shares' start and push state.
  EXPECT_LE(sizeof(Connection), 448u);
  EXPECT_LE(sizeof(MsgSlot), 128u);  // the message, its QP's retry limits, its first send,
                                     // since when its stream is unreachable
}

TEST(Transport, ManyMessagesBothWaysArriveByteExact) {
  Fabric f;
  const uint32_t sizes[] = {0, 1, kMtu - 1, kMtu, kMtu + 1, 5000, 20000, 65536};
  std::map<uint64_t, FakeHost::Key> a_msgs, b_msgs;
  for (uint32_t i = 0; i < 48; ++i) {
    const Op op = i % 3 == 0 ? Op::kSend : (i % 3 == 1 ? Op::kWrite : Op::kWriteImm);
    a_msgs[f.submit(0, 1 + i % 3, i, sizes[i % 8], op)] = {1 + i % 3, i};
  }
  for (uint32_t i = 0; i < 16; ++i) b_msgs[f.submit(1, 9, i, sizes[(i + 3) % 8])] = {9, i};
  f.run();
  ASSERT_TRUE(f.node[0].e->idle() && f.node[1].e->idle());
  expect_all_delivered_exactly(f, 0);
  expect_all_delivered_exactly(f, 1);
  for (auto& [cookie, key] : a_msgs) EXPECT_EQ(f.node[1].host.received.at(key), sent_bytes(f, 0, cookie));
  for (auto& [cookie, key] : b_msgs) EXPECT_EQ(f.node[0].host.received.at(key), sent_bytes(f, 1, cookie));
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(f.node[i].e->stats().retransmits, 0u);
    EXPECT_EQ(f.node[i].e->stats().timeouts, 0u);
    EXPECT_EQ(f.node[i].e->stats().duplicates, 0u);
  }
  // Sprayed: every path carried a fair share, from its own source port, on plane p % 2.
  auto ps = path_stats(*f.node[0].e, kIpB);
  ASSERT_EQ(ps.size(), 4u);
  uint64_t total = 0;
  for (const auto& p : ps) total += p.tx_packets;
  for (const auto& p : ps) {
    EXPECT_GT(p.tx_packets, total / 8) << p.path_id;
    EXPECT_EQ(p.udp_src_port, ps[0].udp_src_port + p.path_id);
    EXPECT_EQ(p.plane, p.path_id % 2);
    EXPECT_GT(p.srtt_ns, 0);
    EXPECT_EQ(p.in_flight, 0u);
  }
  // Data leaves from its path's port; ACKs mirror the port of the data they acknowledge.
  auto peer_ps = path_stats(*f.node[1].e, kIpA);
  for (const Sent& s : f.log) {
    if (s.from != 0) continue;
    if (wire::is_data_opcode(s.pkt.base.opcode)) {
      EXPECT_EQ(s.sport, ps[s.pkt.base.path_id].udp_src_port);
    } else {
      EXPECT_EQ(s.sport, peer_ps[s.pkt.base.path_id].udp_src_port);
    }
  }
}

TEST(Transport, MessagesLeaveInSubmissionOrderAndSegmentByMtu) {
  Fabric f;
  f.submit(0, 1, 0, 3 * kMtu + 10);
  f.submit(0, 2, 0, 0);
  f.submit(0, 1, 1, 100000, Op::kReadReq);
  f.submit(0, 1, 2, kMtu);
  f.run();
  auto data = f.data_from(0);
  ASSERT_EQ(data.size(), 4u + 1u + 1u + 1u);
  const uint32_t want_msn[] = {0, 0, 0, 0, 0, 1, 2};
  const uint32_t want_stream[] = {1, 1, 1, 1, 2, 1, 1};
  for (size_t i = 0; i < data.size(); ++i) {
    EXPECT_EQ(data[i]->pkt.data.msn, want_msn[i]);
    EXPECT_EQ(data[i]->pkt.data.src_stream, want_stream[i]);
  }
  EXPECT_EQ(data[3]->pkt.data.offset, 3 * kMtu);
  EXPECT_EQ(data[3]->pkt.payload.size(), 10u);
  EXPECT_EQ(data[4]->pkt.payload.size(), 0u);                 // zero-length message
  EXPECT_EQ(data[5]->pkt.base.opcode, Opcode::kReadReq);       // one packet, no payload
  EXPECT_EQ(data[5]->pkt.data.total_length, 100000u);
  EXPECT_EQ(data[5]->pkt.payload.size(), 0u);
  // Consecutive packets take consecutive paths.
  for (size_t i = 1; i < data.size(); ++i) {
    EXPECT_EQ(data[i]->pkt.base.path_id, (data[i - 1]->pkt.base.path_id + 1) % 4);
  }
  EXPECT_EQ(f.node[0].host.acked.size(), 4u);
  // The NIC sees a write's address per packet, a read request's base.
  for (const Segment& s : f.node[1].host.segments) {
    if (s.op == Op::kWrite) {
      EXPECT_EQ(s.remote_addr, 0x10000u + s.offset);
    } else if (s.op == Op::kReadReq) {
      EXPECT_EQ(s.remote_addr, 0x10000u);
    }
  }
}

TEST(Transport, AnXrcMessageNamesItsSrqInEveryPacketResendsIncludedAndCutsLikeAnyOther) {
  Fabric f;
  f.submit(0, 1, 0, 3 * kMtu + 10);  // plain
  f.xrc_srqn = 0x00abcdef;
  const uint64_t cookie = f.submit(0, 2, 0, 3 * kMtu + 10, Op::kSend);
  f.submit(0, 2, 1, 0, Op::kSend);  // zero-length
  bool dropped = false;
  f.fate = [&](const Sent& s) {
    if (!dropped && s.from == 0 && s.pkt.data.src_stream == 2 && s.pkt.data.offset == kMtu &&
        wire::is_data_opcode(s.pkt.base.opcode)) {
      dropped = true;
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
  f.run();
  ASSERT_TRUE(dropped);
  // Per stream, the transmissions of the packets' records (a resend in the tail also has a
  // redundant copy, congestion.md §5.2, which must name the SRQ too).
  std::map<uint32_t, int> packets;
  for (const Sent* s : f.data_from(0)) {
    const bool xrc = s->pkt.data.src_stream == 2;
    EXPECT_EQ((s->pkt.base.flags & wire::kFlagXrc) != 0, xrc);
    EXPECT_EQ(s->pkt.data.xrc_srqn, xrc ? 0x00abcdefu : 0u);
    EXPECT_LE(s->bytes.size(), f.cfg.max_packet);
    EXPECT_EQ(s->bytes.size(), wire::data_headers_len(s->pkt.base.flags) + s->pkt.payload.size());
    if (s->pkt.data.msn == 0 && !wire::is_redundant_copy(s->pkt.base.flags))
      ++packets[s->pkt.data.src_stream];
  }
  EXPECT_EQ(packets[1], 4);
  EXPECT_EQ(packets[2], 5);  // the same 4, and the one lost sent again
  // The NIC sees the SRQ in every packet it places, and the bytes are the message's.
  int xrc_segments = 0;
  for (const Segment& s : f.node[1].host.segments) {
    EXPECT_EQ(s.xrc, s.src_stream == 2);
    EXPECT_EQ(s.xrc_srqn, s.xrc ? 0x00abcdefu : 0u);
    xrc_segments += s.xrc;
  }
  EXPECT_EQ(xrc_segments, 5);
  EXPECT_EQ(f.node[1].host.received.at({2, 0}), sent_bytes(f, 0, cookie));
  EXPECT_EQ(f.node[0].host.acked.size(), 3u);
}

TEST(Transport, OneLostPacketIsResentAtOnceAndOnlyIt) {
  Fabric f;
  const uint64_t cookie = f.submit(0, 1, 0, 20 * kMtu);
  bool dropped = false;
  f.fate = [&](const Sent& s) {
    if (!dropped && s.from == 0 && s.pkt.base.path_id == 1 && s.pkt.base.path_seq == 2 &&
        wire::is_data_opcode(s.pkt.base.opcode)) {
      dropped = true;
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
  f.run();
  ASSERT_TRUE(dropped);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{cookie});
  EXPECT_EQ(f.node[1].host.received.at({1, 0}), sent_bytes(f, 0, cookie));
  EXPECT_EQ(f.node[0].e->stats().retransmits, 1u);
  EXPECT_EQ(f.node[0].e->stats().timeouts, 0u);
  // Only (path 1, seq 2) went out twice.
  std::map<std::pair<uint16_t, uint32_t>, int> tx_count;
  for (const Sent* s : f.data_from(0)) ++tx_count[{s->pkt.base.path_id, s->pkt.base.path_seq}];
  const std::pair<uint16_t, uint32_t> lost{1, 2};
  for (auto& [k, n] : tx_count) EXPECT_EQ(n, (k == lost ? 2 : 1));
  // The first ACK showing the gap (cum 2, seq 3 SACKed) triggered it within one RTT.
  Time gap_seen = Time::max(), resent = Time::max();
  for (const Sent& s : f.log) {
    if (s.from == 1 && s.pkt.base.opcode == Opcode::kAck && s.pkt.base.path_id == 1 &&
        s.pkt.ack.cum_seq == 2 && (s.pkt.ack.sack[0] & 1) && gap_seen == Time::max()) {
      gap_seen = s.arrival;
    }
  }
  for (const Sent* s : f.data_from(0)) {
    if (s->pkt.base.path_id == 1 && s->pkt.base.path_seq == 2) resent = s->tx_time;
  }
  ASSERT_NE(gap_seen, Time::max());
  EXPECT_GE(resent, gap_seen);
  EXPECT_LE(resent - gap_seen, 2 * f.delay);
}

TEST(Transport, AckOfAnOriginalThatRacedItsRetransmissionMarksNothingElseLost) {
  // The first copy of (path 1, seq 2) is held back far longer than an RTT: later packets of the
  // path overtake it, so it is (rightly, paths being FIFO) resent once. When the ACK covering
  // it arrives, packets sent on the path between the original and the resend are still in
  // flight; they must not be taken for lost because of the resend's later transmission.
  Fabric f;
  bool held = false;
  f.extra_delay = [&](const Sent& s) {
    if (!held && s.from == 0 && s.pkt.base.path_id == 1 && s.pkt.base.path_seq == 2 &&
        wire::is_data_opcode(s.pkt.base.opcode)) {
      held = true;
      return Time(300us);
    }
    return Time(0);
  };
  for (uint32_t i = 0; i < 40; ++i) f.submit(0, 1, i, 16 * kMtu);
  f.run();
  ASSERT_TRUE(held);
  expect_all_delivered_exactly(f, 0);
  EXPECT_LE(f.node[0].e->stats().retransmits, 1u);
  EXPECT_LE(f.node[1].e->stats().duplicates, 1u);
}

TEST(Transport, AStallLongerThanTheRtoCostsOneResendPerPathNotACascade) {
  // The receiver stops for 2 ms (a descheduled process): everything sent meanwhile arrives at
  // once, in order, when it wakes. The sender's RTO fires during the stall and resends the oldest
  // packet of each path; when the originals' ACKs then come back, the packets sent between an
  // original and its resend are in flight, not lost.
  Fabric f;
  const Time stall_from = 50us, wake = 2050us;
  // On waking it works through its backlog one packet at a time, ACKing as it goes (as the
  // NIC does burst by burst), arrivals in the order of transmission.
  // A receive queue served one packet per microsecond from `wake` on: what arrives meanwhile
  // (the first resends, new data) waits its turn behind the backlog, as in a real NIC ring.
  Time next_free{0};
  f.extra_delay = [&](const Sent& s) {
    if (s.from != 0 || s.tx_time < stall_from) return Time(0);
    const Time nominal = std::max(s.tx_time + f.delay, wake);
    next_free = std::max(next_free, nominal);
    const Time at = next_free;
    next_free += 1us;
    return at - (s.tx_time + f.delay);
  };
  for (uint32_t i = 0; i < 60; ++i) f.submit(0, 1, i, 16 * kMtu);
  f.run();
  expect_all_delivered_exactly(f, 0);
  const auto& st = f.node[0].e->stats();
  // The timer's resends (RTO with back-off, tail probes): a few per path, and no packet
  // declared lost by SACK, since none was.
  std::printf("stall: retransmits %lu timeouts %lu tail_probes %lu sack_gaps %lu failed %lu\n",
              (unsigned long)st.retransmits, (unsigned long)st.timeouts,
              (unsigned long)st.tail_probes, (unsigned long)st.sack_gaps,
              (unsigned long)st.paths_failed);
  EXPECT_EQ(st.sack_gaps, 0u);
  EXPECT_LE(st.retransmits, 4u * Fabric::default_config().num_paths);
  EXPECT_LE(f.node[1].e->stats().duplicates, st.retransmits);
}

TEST(Transport, ReorderingAcrossPathsCausesNoRetransmission) {
  Fabric f;
  // Each path has its own latency (FIFO within a path), so packets overtake across paths.
  f.extra_delay = [](const Sent& s) { return Time(std::chrono::microseconds(7 * (s.pkt.base.path_id % 4))); };
  for (uint32_t i = 0; i < 10; ++i) f.submit(0, 1, i, 30 * kMtu);
  f.run();
  expect_all_delivered_exactly(f, 0);
  EXPECT_EQ(f.node[0].e->stats().retransmits, 0u);
  EXPECT_EQ(f.node[0].e->stats().timeouts, 0u);
  EXPECT_EQ(f.node[1].e->stats().duplicates, 0u);
  EXPECT_EQ(f.node[0].e->stats().paths_failed, 0u);  // a slower path is not a failed one
  // And reordering really happened: some packet arrived before one sent earlier.
  bool overtaken = false;
  for (size_t i = 1; i < f.arrivals.size(); ++i) {
    const Sent& a = f.log[f.arrivals[i - 1]];
    const Sent& b = f.log[f.arrivals[i]];
    if (a.from == 0 && b.from == 0 && b.tx_time < a.tx_time) overtaken = true;
  }
  EXPECT_TRUE(overtaken);
}

// Every transmission of the packet at `offset` from node 0; redundant copies (congestion.md §5.2)
// only when asked: the others are the transmissions of the packet's record.
std::vector<const Sent*> transmissions_of(const Fabric& f, uint32_t offset,
                                          bool with_redundant = false) {
  std::vector<const Sent*> out;
  for (const Sent* s : f.data_from(0)) {
    if (s->pkt.data.offset == offset &&
        (with_redundant || !wire::is_redundant_copy(s->pkt.base.flags))) {
      out.push_back(s);
    }
  }
  return out;
}

// A fate that drops the first `times` data packets node 0 sends at `offset` of a message,
// counting them in *dropped.
std::function<Fate(const Sent&)> drop_data_at(uint32_t offset, int* dropped, int times = 1) {
  return [=](const Sent& s) {
    if (*dropped < times && s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode) &&
        s.pkt.data.offset == offset) {
      ++*dropped;
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
}

TEST(Transport, LossOfTheLastPacketIsRecoveredByTailProbeWithinTwoRtts) {
  Fabric f;
  const uint64_t cookie = f.submit(0, 1, 0, 8 * kMtu);
  int dropped = 0;
  f.fate = drop_data_at(7 * kMtu, &dropped);
  f.run();
  ASSERT_EQ(dropped, 1);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{cookie});
  EXPECT_EQ(f.node[1].host.received.at({1, 0}), sent_bytes(f, 0, cookie));
  const EngineStats& st = f.node[0].e->stats();
  EXPECT_EQ(st.timeouts, 0u);
  EXPECT_EQ(st.tail_probes, 1u);
  // The tail's path said nothing for two RTTs: the packet goes out on another path and the
  // path is probed (congestion.md §4.1, §5).
  EXPECT_EQ(st.failover_resends, 1u);
  EXPECT_EQ(st.paths_suspected, 1u);
  EXPECT_EQ(st.paths_recovered, 1u);
  // The probe left two smoothed RTTs after the last ACK progress, far below rto_min.
  auto tx = transmissions_of(f, 7 * kMtu);
  ASSERT_EQ(tx.size(), 2u);
  EXPECT_NE(tx[1]->sport, tx[0]->sport);
  const Time rtt = 2 * f.delay;
  Time last_ack = Time{0};
  for (const Sent& s : f.log) {
    if (s.from == 1 && s.pkt.base.opcode == Opcode::kAck && s.arrival < tx[1]->tx_time) {
      last_ack = std::max(last_ack, s.arrival);
    }
  }
  EXPECT_EQ(tx[1]->tx_time - last_ack, 2 * rtt);
  EXPECT_LT(tx[1]->tx_time - tx[0]->tx_time, f.cfg.rto_min);
  // The moved packet left twice, being a resend in the message's tail (congestion.md §5.2):
  // the copy on its new path and a redundant copy on a third, both naming the first
  // transmission.
  auto all = transmissions_of(f, 7 * kMtu, true);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(st.redundant_copies, 1u);
  for (const Sent* x : {all[1], all[2]}) {
    EXPECT_EQ(wire::orig_path_of(x->pkt.base.flags), tx[0]->pkt.base.path_id);
    EXPECT_EQ(x->pkt.data.orig_seq, tx[0]->pkt.base.path_seq);
  }
  EXPECT_NE(all[1]->pkt.base.path_id, all[2]->pkt.base.path_id);
}

// An 8-packet message whose last packet is lost, and its first resend too: it still completes,
// byte for byte, whatever recovers it.
void lose_tail_and_its_probe(Fabric& f) {
  const uint64_t cookie = f.submit(0, 1, 0, 8 * kMtu);
  int dropped = 0;
  f.fate = drop_data_at(7 * kMtu, &dropped, 2);
  f.run();
  ASSERT_EQ(dropped, 2);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{cookie});
  EXPECT_EQ(f.node[1].host.received.at({1, 0}), sent_bytes(f, 0, cookie));
}

// With one tail probe (EngineConfig::tail_probes = 1, the default), the RTO is what is left.
TEST(Transport, LossOfTheLastPacketAndItsProbeIsRecoveredByRto) {
  EngineConfig cfg = Fabric::default_config();
  cfg.tail_probes = 1;
  cfg.tail_redundancy = false;  // its copy of the probe's resend would recover it (§5.2)
  Fabric f(cfg);
  ASSERT_NO_FATAL_FAILURE(lose_tail_and_its_probe(f));
  const EngineStats& st = f.node[0].e->stats();
  EXPECT_EQ(st.timeouts, 1u);
  EXPECT_EQ(st.tail_probes, 1u);
  EXPECT_EQ(st.failover_resends, 2u);  // after the tail probe, and after the timeout
  EXPECT_EQ(st.paths_suspected, 2u);
  // Three transmissions on three paths; the third one RTO after the second.
  auto tx = transmissions_of(f, 7 * kMtu);
  ASSERT_EQ(tx.size(), 3u);
  EXPECT_NE(tx[1]->sport, tx[0]->sport);
  EXPECT_NE(tx[2]->sport, tx[1]->sport);
  EXPECT_GE(tx[2]->tx_time - tx[1]->tx_time, f.cfg.rto_min);
  EXPECT_LE(tx[2]->tx_time - tx[0]->tx_time, f.cfg.rto_initial);
}

// With tail_probes = 3 a second probe recovers it long before an RTO (congestion.md §5): one
// probe left the slowest flows of a lossy permutation to RTOs. The first probe moved the packet
// off its silent path, so the second waits two RTTs of its own, not twice the first's wait.
TEST(Transport, LossOfTheLastPacketAndItsProbeIsRecoveredByTheSecondProbe) {
  EngineConfig cfg = Fabric::default_config();
  cfg.tail_probes = 3;
  cfg.tail_redundancy = false;  // its copy of the probe's resend would recover it (§5.2)
  Fabric f(cfg);
  ASSERT_NO_FATAL_FAILURE(lose_tail_and_its_probe(f));
  const EngineStats& st = f.node[0].e->stats();
  EXPECT_EQ(st.timeouts, 0u);
  EXPECT_EQ(st.tail_probes, 2u);
  auto tx = transmissions_of(f, 7 * kMtu);
  ASSERT_EQ(tx.size(), 3u);
  EXPECT_NE(tx[2]->sport, tx[1]->sport);
  EXPECT_LT(tx[2]->tx_time - tx[0]->tx_time, f.cfg.rto_min);
  EXPECT_LE(tx[2]->tx_time - tx[1]->tx_time, tx[1]->tx_time - tx[0]->tx_time);
}

// The last packet of one path is lost while packets sent after it on other paths arrive: it is
// found lost by time and resent about one RTT after it left, before a tail probe would have been
// sent (congestion.md §5.1). Without late detection the tail probe is what recovers it.
void lose_a_path_tail(bool late_detection) {
  EngineConfig cfg = Fabric::default_config();
  cfg.late_detection = late_detection;
  Fabric f(cfg);
  // A first message gives every path a few RTT samples.
  f.submit(0, 1, 0, 32 * kMtu);
  f.run();
  // 8 packets over 4 paths: the last four are each their path's last; offset 5 is followed by
  // two packets on other paths.
  const uint64_t cookie = f.submit(0, 1, 1, 8 * kMtu);
  int dropped = 0;
  f.fate = drop_data_at(5 * kMtu, &dropped);
  f.run();
  f.node[0].host.acked.erase(f.node[0].host.acked.begin());
  ASSERT_EQ(dropped, 1);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{cookie});
  EXPECT_EQ(f.node[1].host.received.at({1, 1}), sent_bytes(f, 0, cookie));
  for (const auto& [seg, count] : f.node[1].host.deliveries) EXPECT_EQ(count, 1);
  const EngineStats& st = f.node[0].e->stats();
  EXPECT_EQ(st.timeouts, 0u);
  std::vector<const Sent*> tx;
  for (const Sent* s : transmissions_of(f, 5 * kMtu)) {
    if (s->pkt.data.msn == 1) tx.push_back(s);
  }
  ASSERT_GE(tx.size(), 2u);
  const Time rtt = 2 * f.delay;
  if (late_detection) {
    EXPECT_EQ(st.late_losses, 1u);
    EXPECT_EQ(st.tail_probes, 0u);
    EXPECT_EQ(tx[1]->pkt.base.path_id, tx[0]->pkt.base.path_id);  // resent on its own path
    EXPECT_LT(tx[1]->tx_time - tx[0]->tx_time, 2 * rtt);
  } else {
    EXPECT_EQ(st.late_losses, 0u);
    EXPECT_EQ(st.tail_probes, 1u);
    EXPECT_GE(tx[1]->tx_time - tx[0]->tx_time, 2 * rtt);
  }
}

TEST(LateDetection, APathsLostLastPacketIsResentWithinTwoRttsWhileLaterOnesArrive) {
  lose_a_path_tail(true);
}
TEST(LateDetection, WithoutItTheTailProbeRecoversThatPacketLater) { lose_a_path_tail(false); }

// Paths of different, steady delays (each FIFO): packets sent later overtake on faster paths,
// but none is ever overdue on its own path, so nothing is resent.
TEST(LateDetection, PathsOfDifferentDelaysCauseNoResend) {
  Fabric f;
  f.extra_delay = [](const Sent& s) {
    return Time(std::chrono::microseconds(13 * (s.pkt.base.path_id % 4)));
  };
  for (uint32_t i = 0; i < 20; ++i) f.submit(0, 1, i, 16 * kMtu);
  f.run();
  expect_all_delivered_exactly(f, 0);
  EXPECT_EQ(f.node[0].e->stats().late_losses, 0u);
  EXPECT_EQ(f.node[0].e->stats().retransmits, 0u);
  EXPECT_EQ(f.node[1].e->stats().duplicates, 0u);
}

// A path whose queue grows delays its packets past its RTT: where the network marks it (ECN),
// that is congestion, and its late packets are not resent (congestion.md §5.1); the same delay
// unmarked is taken for loss (what makes this test able to fail).
uint64_t late_resends_on_a_queued_path(bool marked) {
  Fabric f;
  f.submit(0, 1, 0, 64 * kMtu);  // RTT samples on every path
  f.run();
  int path1 = -1;
  for (const Sent* s : f.data_from(0)) path1 = s->pkt.base.path_id == 1 ? 1 : path1;
  EXPECT_EQ(path1, 1);
  // Its queue passes the marking threshold (its packets are CE-marked from now on), and after
  // its next 8 packets it delays them by 25 us, more than its RTT's variation covers.
  int sent = 0;
  f.extra_delay = [&sent](const Sent& s) {
    if (s.from != 0 || s.pkt.base.path_id != 1) return Time{0};
    return ++sent > 8 ? Time(25us) : Time{0};
  };
  if (marked) {
    f.mark_ce = [](const Sent& s) { return s.from == 0 && s.pkt.base.path_id == 1; };
  }
  for (uint32_t m = 1; m <= 4; ++m) f.submit(0, 1, m, 32 * kMtu);
  f.run();
  expect_all_delivered_exactly(f, 0);
  return f.node[0].e->stats().late_losses;
}

TEST(LateDetection, APathTheNetworkMarksIsNotJudgedByTime) {
  const uint64_t marked = late_resends_on_a_queued_path(true);
  const uint64_t unmarked = late_resends_on_a_queued_path(false);
  std::printf("late resends: %llu marked, %llu unmarked\n", static_cast<unsigned long long>(marked),
              static_cast<unsigned long long>(unmarked));
  EXPECT_EQ(marked, 0u);
  EXPECT_GT(unmarked, 0u);
}

// In a connection's tail (all its data sent), a resend goes out twice: on its own path and as a
// redundant copy on another (congestion.md §5.2). Here the original and the resend on its path
// are both lost: the copy delivers the packet, the receiver acknowledges the original's path,
// and the message completes without a tail probe or an RTO, each byte delivered once.
void lose_a_tail_twice(bool redundancy) {
  EngineConfig cfg = Fabric::default_config();
  cfg.tail_redundancy = redundancy;
  Fabric f(cfg);
  f.submit(0, 1, 1, 32 * kMtu);  // RTT samples on every path first
  f.run();
  f.node[0].host.acked.clear();
  const uint64_t cookie = f.submit(0, 1, 0, 8 * kMtu);
  std::vector<int> lost_path;  // of each dropped transmission
  f.fate = [&](const Sent& s) {
    if (s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode) && s.pkt.data.offset == 5 * kMtu &&
        s.pkt.data.total_length == 8 * kMtu && !wire::is_failover_copy(s.pkt.base.flags) &&
        lost_path.size() < 2) {
      lost_path.push_back(s.pkt.base.path_id);
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
  f.run();
  ASSERT_EQ(lost_path.size(), 2u);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{cookie});
  EXPECT_EQ(f.node[1].host.received.at({1, 0}), sent_bytes(f, 0, cookie));
  for (const auto& [seg, count] : f.node[1].host.deliveries) EXPECT_EQ(count, 1);
  const EngineStats& st = f.node[0].e->stats();
  if (redundancy) {
    EXPECT_EQ(st.redundant_copies, 1u);
    EXPECT_EQ(st.tail_probes, 0u);
    EXPECT_EQ(st.timeouts, 0u);
    std::vector<const Sent*> tx;
    for (const Sent* x : transmissions_of(f, 5 * kMtu, true)) {
      if (x->pkt.data.src_stream == 1 && x->pkt.data.msn == 0 && x->pkt.data.total_length == 8 * kMtu)
        tx.push_back(x);
    }
    ASSERT_EQ(tx.size(), 3u);
    const Sent& copy = *tx[2];
    EXPECT_TRUE(wire::is_redundant_copy(copy.pkt.base.flags));
    EXPECT_NE(copy.pkt.base.path_id, tx[0]->pkt.base.path_id);
    EXPECT_EQ(wire::orig_path_of(copy.pkt.base.flags), tx[0]->pkt.base.path_id);
    EXPECT_EQ(copy.pkt.data.orig_seq, tx[0]->pkt.base.path_seq);
    EXPECT_EQ(copy.tx_time, tx[1]->tx_time);  // with the resend
    // The original's path was acknowledged because of the copy (its own resend was lost): that
    // ACK says so, and dates nothing (no RTT sample from it).
    bool no_echo = false;
    for (const Sent& x : f.log) {
      no_echo |= x.from == 1 && x.pkt.base.opcode == Opcode::kAck &&
                 x.pkt.base.path_id == tx[0]->pkt.base.path_id &&
                 (x.pkt.base.flags & wire::kFlagNoEcho) && x.tx_time > copy.tx_time;
    }
    EXPECT_TRUE(no_echo);
  } else {
    EXPECT_EQ(st.redundant_copies, 0u);
    EXPECT_GE(st.tail_probes + st.timeouts, 1u);
  }
}

TEST(TailRedundancy, AResendInTheTailThatIsLostAgainIsDeliveredByItsCopyExactlyOnce) {
  lose_a_tail_twice(true);
}
TEST(TailRedundancy, WithoutItASecondLossWaitsForATailProbe) { lose_a_tail_twice(false); }

// When both the resend and its copy arrive, the receiver delivers the packet once and counts the
// other as a copy it already had; a resend before the tail (more data to send) is not copied.
TEST(TailRedundancy, BothCopiesArrivingDeliverOnceAndOnlyTheTailIsCopied) {
  Fabric f;
  f.submit(0, 1, 1, 32 * kMtu);  // RTT samples on every path first
  f.run();
  f.node[0].host.acked.clear();
  const uint64_t cookie = f.submit(0, 1, 0, 8 * kMtu);
  int dropped = 0;
  f.fate = [&](const Sent& s) {  // the 8-packet message's packet at offset 5, once
    if (dropped == 0 && s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode) &&
        s.pkt.data.offset == 5 * kMtu && s.pkt.data.total_length == 8 * kMtu) {
      ++dropped;
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
  f.run();
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{cookie});
  for (const auto& [seg, count] : f.node[1].host.deliveries) EXPECT_EQ(count, 1);
  EXPECT_EQ(f.node[0].e->stats().redundant_copies, 1u);
  EXPECT_EQ(f.node[1].e->stats().failover_duplicates + f.node[1].e->stats().duplicates, 1u);

  // A long transfer with a loss early on: that resend leaves while data is still queued.
  Fabric g;
  for (uint32_t i = 0; i < 8; ++i) g.submit(0, 1, i, 32 * kMtu);
  dropped = 0;
  g.fate = drop_data_at(2 * kMtu, &dropped);
  g.run();
  expect_all_delivered_exactly(g, 0);
  EXPECT_GE(g.node[0].e->stats().retransmits, 1u);
  EXPECT_EQ(g.node[0].e->stats().redundant_copies, 0u);
}

TEST(Transport, PeerThatNeverAnswersFailsWithRetryExceeded) {
  EngineConfig cfg = Fabric::default_config();
  cfg.max_retries = 3;
  Fabric f(cfg);
  f.fate = [](const Sent& s) { return s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
  const uint64_t c1 = f.submit(0, 1, 0, 100);
  f.run(1s);
  EXPECT_TRUE(f.node[0].host.acked.empty());
  ASSERT_EQ(f.node[0].host.failed.size(), 1u);
  EXPECT_EQ(f.node[0].host.failed[0], std::make_pair(c1, Syndrome::kRetryExceeded));
  // Sent once plus max_retries times, each time on another path (each one is suspected in
  // turn), with doubling gaps: the packet carries its back-off from path to path.
  std::vector<Time> tx;
  std::set<uint16_t> ports;
  for (const Sent* s : f.data_from(0)) {
    if (wire::is_redundant_copy(s->pkt.base.flags)) continue;  // they go with each, unrecorded
    tx.push_back(s->tx_time);
    ports.insert(s->sport);
  }
  ASSERT_EQ(tx.size(), 1u + cfg.max_retries);
  EXPECT_EQ(ports.size(), tx.size());
  EXPECT_EQ(tx[1] - tx[0], cfg.rto_initial);
  for (size_t i = 2; i < tx.size(); ++i) EXPECT_EQ(tx[i] - tx[i - 1], 2 * (tx[i - 1] - tx[i - 2]));
  EXPECT_EQ(f.node[0].e->stats().paths_suspected, cfg.max_retries);
  EXPECT_EQ(f.node[1].host.deliver_calls, 0);

  // A multi-packet message fails once, whatever number of its packets ran out.
  Fabric g(cfg);
  g.fate = f.fate;
  const uint64_t c2 = g.submit(0, 2, 0, 3 * kMtu);
  g.run(1s);
  ASSERT_EQ(g.node[0].host.failed.size(), 1u);
  EXPECT_EQ(g.node[0].host.failed[0], std::make_pair(c2, Syndrome::kRetryExceeded));
}

// The back-off of a silent peer does not depend on the clock: at 3 s the low 32 bits of the
// engine's clock are past 2^31, where a wrap-aware comparison with a progress time never set
// (0) used to find the peer "heard" and the gaps stayed at rto_initial (compliance suite,
// silent_peer_rto_backoff_and_retry_exceeded).
TEST(Transport, SilentPeerBacksOffWhateverTheClockReads) {
  for (Time start : {Time(0), Time(3s), Time(int64_t{1} << 32) - 500us}) {
    EngineConfig cfg = Fabric::default_config();
    cfg.max_retries = 4;
    Fabric f(cfg);
    f.now = start;
    f.fate = [](const Sent& s) { return s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
    f.submit(0, 1, 0, 100);
    f.run(start + 1s);
    ASSERT_EQ(f.node[0].host.failed.size(), 1u) << "clock " << start.count();
    std::vector<Time> tx;
    for (const Sent* s : f.data_from(0)) {
      if (!wire::is_redundant_copy(s->pkt.base.flags)) tx.push_back(s->tx_time);
    }
    ASSERT_EQ(tx.size(), 1u + cfg.max_retries) << "clock " << start.count();
    EXPECT_EQ(tx[1] - tx[0], cfg.rto_initial) << "clock " << start.count();
    for (size_t i = 2; i < tx.size(); ++i)
      EXPECT_EQ(tx[i] - tx[i - 1], 2 * (tx[i - 1] - tx[i - 2])) << "clock " << start.count();
  }
}

TEST(Transport, DuplicatedPacketsAreNeverDeliveredTwice) {
  Fabric f;
  f.fate = [](const Sent& s) {
    return wire::is_data_opcode(s.pkt.base.opcode) ? Fate::kDuplicate : Fate::kDeliver;
  };
  for (uint32_t i = 0; i < 5; ++i) f.submit(0, 1, i, 7 * kMtu);
  f.run();
  expect_all_delivered_exactly(f, 0);
  const size_t data_packets = f.data_from(0).size();
  EXPECT_EQ(f.node[1].e->stats().duplicates, data_packets);
  EXPECT_EQ(f.node[1].host.deliver_calls, static_cast<int>(data_packets));
}

TEST(Transport, RemoteAccessErrorFailsTheMessageExactlyOnceEvenIfTheNakIsLost) {
  Fabric f;
  f.node[1].host.verdict = [](const Segment& s) {
    return s.msn == 2 ? Syndrome::kRemoteAccess : Syndrome::kOk;
  };
  const uint64_t c1 = f.submit(0, 1, 1, 3 * kMtu);
  const uint64_t c2 = f.submit(0, 1, 2, 3 * kMtu);
  const uint64_t c3 = f.submit(0, 1, 3, 3 * kMtu);
  int naks_dropped = 0;
  f.fate = [&](const Sent& s) {
    if (s.from == 1 && s.pkt.base.opcode == Opcode::kAck && s.pkt.ack.nak_count > 0 &&
        naks_dropped < 2) {
      ++naks_dropped;
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
  f.run();
  ASSERT_TRUE(f.node[0].e->idle());
  EXPECT_EQ(naks_dropped, 2);
  ASSERT_EQ(f.node[0].host.failed.size(), 1u);
  EXPECT_EQ(f.node[0].host.failed[0].first, c2);
  EXPECT_EQ(f.node[0].host.failed[0].second, Syndrome::kRemoteAccess);
  auto acked = f.node[0].host.acked;
  std::sort(acked.begin(), acked.end());
  EXPECT_EQ(acked, (std::vector<uint64_t>{c1, c3}));
  EXPECT_GE(f.node[1].e->stats().naks_sent, 1u);
  EXPECT_GE(f.node[0].e->stats().naks_received, 1u);
  EXPECT_EQ(f.node[1].host.received.at({1, 3}), sent_bytes(f, 0, c3));
}

// A rejection is the answer to every copy of the packet, whichever of them arrives first and
// on whichever path it is acknowledged: a slow first transmission is resent with a redundant
// copy (congestion.md §5.2), and the arrivals are ordered every way among original, resend and
// copy. The message fails with the receiver's syndrome, never completes.
TEST(Transport, RemoteAccessErrorReachesTheSenderWhicheverCopyArrivesFirst) {
  // Extra delay, in microseconds, of the first transmission, the resend and the redundant copy.
  const std::vector<std::array<int, 3>> orders = {
      {3000, 400, 0}, {3000, 0, 400}, {3000, 0, 0}, {400, 3000, 3000}, {3000, 3000, 0}, {400, 3000, 0}};
  for (const auto& o : orders) {
    SCOPED_TRACE(testing::Message() << o[0] << "/" << o[1] << "/" << o[2]);
    Fabric f;
    f.submit(0, 1, 1, 8 * kMtu);  // RTT samples first
    f.run();
    f.node[1].host.verdict = [](const Segment& s) {
      return s.msn == 2 ? Syndrome::kRemoteAccess : Syndrome::kOk;
    };
    int firsts = 0;
    f.extra_delay = [&](const Sent& s) {
      if (s.from != 0 || !wire::is_data_opcode(s.pkt.base.opcode) || s.pkt.data.msn != 2) {
        return Time{0};
      }
      if (wire::is_redundant_copy(s.pkt.base.flags)) return Time(std::chrono::microseconds(o[2]));
      return Time(std::chrono::microseconds(firsts++ == 0 ? o[0] : o[1]));
    };
    const uint64_t c = f.submit(0, 1, 2, 100);
    f.run();
    EXPECT_GE(firsts, 2);  // it was resent
    EXPECT_GE(f.node[0].e->stats().redundant_copies, 1u);
    EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{c - 1});
    ASSERT_EQ(f.node[0].host.failed.size(), 1u);
    EXPECT_EQ(f.node[0].host.failed[0], std::make_pair(c, Syndrome::kRemoteAccess));
  }
}

// The same under random delays and losses of every packet: a rejected message never completes,
// the ones around it always do.
TEST(Transport, RejectedMessageNeverCompletesUnderRandomDelayAndLoss) {
  for (uint32_t seed = 0; seed < 300; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    Fabric f;
    std::mt19937 rng(seed);
    f.node[1].host.verdict = [](const Segment& s) {
      return s.msn == 2 ? Syndrome::kRemoteAccess : Syndrome::kOk;
    };
    f.extra_delay = [&](const Sent&) {
      return Time(std::chrono::microseconds(rng() % 4 == 0 ? rng() % 3000 : rng() % 50));
    };
    f.fate = [&](const Sent&) { return rng() % 100 < 10 ? Fate::kDrop : Fate::kDeliver; };
    const uint64_t c1 = f.submit(0, 1, 1, (seed % 3) * kMtu + 100);
    const uint64_t c2 = f.submit(0, 1, 2, (seed % 2) * kMtu + 100);
    f.run();
    ASSERT_EQ(f.node[0].host.failed.size(), 1u);
    EXPECT_EQ(f.node[0].host.failed[0], std::make_pair(c2, Syndrome::kRemoteAccess));
    EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{c1});
  }
}

// Rejections one after another on a quiet connection (a test suite's, or a program's that keeps
// using a bad key): the receiver's record of each goes once the sender's ack floor has passed
// it, so the records never fill up, and every one is reported as itself, never as RNR or success.
TEST(Transport, ManyRejectionsInARowEachFailWithTheirSyndrome) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    Fabric f;
    std::mt19937 rng(seed);
    f.node[1].host.verdict = [](const Segment& s) {
      return s.msn % 2 ? Syndrome::kRemoteAccess : Syndrome::kOk;
    };
    f.extra_delay = [&](const Sent&) {
      return Time(std::chrono::microseconds(rng() % 5 == 0 ? rng() % 2000 : rng() % 20));
    };
    std::vector<uint64_t> good, bad;
    for (uint32_t msn = 0; msn < 40; ++msn) {
      (msn % 2 ? bad : good).push_back(f.submit(0, 1, msn, 100));
      f.run(f.now + 1s);
    }
    std::vector<uint64_t> failed;
    for (const auto& [cookie, why] : f.node[0].host.failed) {
      EXPECT_EQ(why, Syndrome::kRemoteAccess);
      failed.push_back(cookie);
    }
    EXPECT_EQ(failed, bad);
    EXPECT_EQ(f.node[0].host.acked, good);
    EXPECT_EQ(f.node[1].e->stats().drop_rnr, 0u);
  }
}

TEST(Transport, RnrIsRetransmittedUntilAccepted) {
  Fabric f;
  int refusals = 0;
  f.node[1].host.verdict = [&](const Segment& s) {
    if (s.msn == 1 && s.offset == 0 && refusals < 3) {
      ++refusals;
      return Syndrome::kRnr;
    }
    return Syndrome::kOk;
  };
  const uint64_t c = f.submit(0, 1, 1, 6 * kMtu);
  f.run();
  EXPECT_EQ(refusals, 3);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{c});
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_EQ(f.node[1].e->stats().drop_rnr, 3u);
  EXPECT_GE(f.node[0].e->stats().retransmits, 3u);
  EXPECT_EQ(f.node[1].host.received.at({1, 1}), sent_bytes(f, 0, c));
  EXPECT_EQ((f.node[1].host.deliveries[{1, 1, 0}]), 1);
}

TEST(Transport, RandomLossOfDataAndAcksStillDeliversEverythingOnce) {
  Fabric f;
  std::mt19937 rng(7);
  f.fate = [&](const Sent&) { return rng() % 100 < 15 ? Fate::kDrop : Fate::kDeliver; };
  f.extra_delay = [](const Sent& s) { return Time(std::chrono::microseconds(3 * (s.sport % 5))); };
  std::map<uint64_t, FakeHost::Key> msgs;
  for (uint32_t i = 0; i < 30; ++i) msgs[f.submit(0, 1 + i % 2, i, (i * 3001) % 40000)] = {1 + i % 2, i};
  f.run(60s);
  ASSERT_TRUE(f.node[0].e->idle());
  expect_all_delivered_exactly(f, 0);
  for (auto& [cookie, key] : msgs) EXPECT_EQ(f.node[1].host.received.at(key), sent_bytes(f, 0, cookie));
  EXPECT_GT(f.node[0].e->stats().retransmits, 0u);
}

TEST(Transport, DropStreamForgetsItsMessagesWithoutCallbacks) {
  Fabric f;
  bool blackhole = true;
  f.fate = [&](const Sent& s) { return blackhole && s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
  f.submit(0, 5, 0, 10 * kMtu);
  f.submit(0, 5, 1, 10 * kMtu);
  const uint64_t keep = f.submit(0, 6, 0, 2 * kMtu);
  f.step();
  f.step();
  f.node[0].e->drop_stream(5);
  blackhole = false;
  f.run();
  EXPECT_TRUE(f.node[0].e->idle());
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{keep});
  EXPECT_TRUE(f.node[0].host.failed.empty());
  for (const Segment& s : f.node[1].host.segments) EXPECT_EQ(s.src_stream, 6u);
}

TEST(Transport, EcnMarksAreEchoedPerPath) {
  Fabric f;
  f.mark_ce = [](const Sent& s) { return s.from == 0 && s.pkt.base.path_id == 2; };
  f.submit(0, 1, 0, 16 * kMtu);
  f.run();
  auto ps = path_stats(*f.node[0].e, kIpB);
  ASSERT_EQ(ps.size(), 4u);
  EXPECT_EQ(ps[2].ecn_ce_echoed, 4u);
  EXPECT_EQ(ps[0].ecn_ce_echoed + ps[1].ecn_ce_echoed + ps[3].ecn_ce_echoed, 0u);
}

// ---------------------------------------------------------------------------------------------
// A multi-node fabric for congestion, fairness and failure: N engines, a fixed propagation
// delay, and one FIFO bottleneck per receiving node (its downlink) that marks CE above a backlog
// threshold and drops above a larger one. Packets are routed to one of kLinks links by a hash of
// their UDP source port, as ECMP would, so a black-holed link eats exactly the paths whose port
// hashes onto it and an entropy re-pick can escape it.

constexpr int kLinks = 8;
int link_of(uint16_t sport) { return static_cast<int>((sport * 2654435761u) >> 29) % kLinks; }

struct NetPacket {
  int from = 0, to = 0;
  uint16_t sport = 0;
  uint8_t plane = 0;
  bool ce = false;
  std::vector<uint8_t> bytes;
  wire::Packet pkt;
};

class Net {
 public:
  struct Config {
    int nodes = 2;
    Time prop = 5us;
    uint64_t bottleneck_mbps = 10000;  // 0: none
    Time mark_backlog = 12us;          // CE above this queueing delay (~ one BDP; 0: never)
    Time drop_backlog = 400us;         // tail drop above this
    bool per_plane = false;            // a bottleneck per (receiver, plane), not per receiver
  };

  Net(Config nc, const std::vector<EngineConfig>& cfgs) : nc_(nc) {
    node.resize(nc.nodes);
    free_at_.assign(size_t(nc.nodes) * 32, Time{0});
    for (int i = 0; i < nc.nodes; ++i) {
      EngineConfig c = cfgs[std::min<size_t>(i, cfgs.size() - 1)];
      node[i].ip = 0x0a000001 + i;
      c.local_ip = node[i].ip;
      c.seed = 100 + i;
      node[i].host = std::make_unique<FakeHost>();
      node[i].e = Engine::create(c, *node[i].host);
      node[i].sink = std::make_unique<Sink>(*this, i);
    }
  }

  static EngineConfig config(uint16_t paths = 8) {
    EngineConfig c = Fabric::default_config();
    c.num_paths = paths;
    c.num_planes = 1;
    return c;
  }

  int index_of(uint32_t ip) const { return static_cast<int>(ip - 0x0a000001); }

  uint64_t submit(int from, int to, uint32_t stream, uint32_t msn, uint32_t size,
                  Op op = Op::kWrite) {
    const uint64_t cookie = next_cookie_++;
    std::vector<uint8_t> bytes(op == Op::kReadReq ? 0 : size);
    for (auto& x : bytes) x = static_cast<uint8_t>(rng_());
    node[from].host->outgoing[cookie] = std::move(bytes);
    MessageDesc m;
    m.peer_ip = node[to].ip;
    m.dst_stream = stream + 1000;
    m.src_stream = stream;
    m.msn = msn;
    m.op = op;
    m.length = size;
    m.remote_addr = 0x10000;
    m.rkey = 7;
    m.cookie = cookie;
    m.retry_cnt = retry_cnt;
    m.timeout = timeout;
    node[from].e->submit(m);
    return cookie;
  }

  // The QP limits every message gets (MessageDesc defaults: the engine's).
  uint8_t retry_cnt = MessageDesc::kEngineRetries;
  Time timeout{0};

  // Something to do at a given virtual time (app-limited senders).
  void at(Time t, std::function<void()> fn) { actions_.emplace(t, std::move(fn)); }

  bool step() {
    for (auto& n : node) n.e->poll_tx(now, *n.sink);
    Time next = Time::max();
    if (!wire_.empty()) next = wire_.begin()->first;
    if (!actions_.empty()) next = std::min(next, actions_.begin()->first);
    for (auto& n : node) next = std::min(next, n.e->next_deadline());
    if (next == Time::max()) return false;
    now = std::max(now, next);
    while (!actions_.empty() && actions_.begin()->first <= now) {
      auto fn = std::move(actions_.begin()->second);
      actions_.erase(actions_.begin());
      fn();
    }
    while (!wire_.empty() && wire_.begin()->first <= now) {
      NetPacket p = std::move(wire_.begin()->second);
      wire_.erase(wire_.begin());
      if (wire::is_data_opcode(p.pkt.base.opcode)) {
        // Whole UDP payloads, MRH included: that is what the receiver measures and hints in.
        delivered.push_back({now, p.from, p.to, static_cast<uint32_t>(p.bytes.size())});
      }
      if (on_arrival) on_arrival(p, now);
      node[p.to].e->on_packet(now, node[p.from].ip, p.sport, p.ce, p.bytes, p.plane);
    }
    for (auto& n : node) {
      if (n.e->next_deadline() <= now) n.e->on_timer(now);
    }
    return true;
  }

  void run_until(Time limit) {
    while (now < limit && step()) {}
  }
  // Until every engine is idle and the wire empty (probing paths keep timers: ignore them).
  void run_idle(Time limit) {
    while (now < limit) {
      bool all_idle = wire_.empty() && actions_.empty();
      for (auto& n : node) all_idle = all_idle && n.e->idle();
      if (all_idle) return;
      if (!step()) return;
    }
  }

  // Data bytes (UDP payload) from `from` that reached `to` in [t0, t1), as Mbit/s.
  double rate_mbps(int from, int to, Time t0, Time t1) const {
    uint64_t bytes = 0;
    for (const auto& d : delivered) {
      if (d.from == from && d.to == to && d.t >= t0 && d.t < t1) bytes += d.bytes;
    }
    return static_cast<double>(bytes) * 8e3 / static_cast<double>((t1 - t0).count());
  }

  struct Node {
    std::unique_ptr<Engine> e;
    std::unique_ptr<FakeHost> host;
    uint32_t ip = 0;
    std::unique_ptr<TxSink> sink;
  };
  struct Delivery {
    Time t;
    int from, to;
    uint32_t bytes;
  };

  std::vector<Node> node;
  Time now{0};
  std::function<bool(const NetPacket&)> drop;        // true: lost
  std::function<Time(const NetPacket&)> extra_delay;  // per packet, before the bottleneck
  std::function<void(const NetPacket&, Time)> on_arrival;
  std::function<bool(const NetPacket&)> mark;         // true: CE-marked regardless of queue
  std::vector<Delivery> delivered;
  uint64_t queue_drops = 0, ce_marks = 0;

 private:
  class Sink : public TxSink {
   public:
    Sink(Net& n, int from) : n_(n), from_(from) {}
    std::span<uint8_t> begin(uint32_t max_len, uint8_t) override {
      buf_.assign(max_len, 0);
      return buf_;
    }
    void commit(uint32_t peer_ip, uint16_t sport, uint8_t plane, uint32_t len) override {
      NetPacket p;
      p.from = from_;
      p.to = n_.index_of(peer_ip);
      p.sport = sport;
      p.plane = plane;
      p.bytes.assign(buf_.begin(), buf_.begin() + len);
      EXPECT_EQ(wire::decode(p.bytes, p.pkt), wire::DecodeError::kNone);
      if (n_.drop && n_.drop(p)) return;
      if (n_.mark && n_.mark(p)) {
        p.ce = true;
        ++n_.ce_marks;
      }
      Time t = n_.now + n_.nc_.prop + (n_.extra_delay ? n_.extra_delay(p) : Time{0});
      if (n_.nc_.bottleneck_mbps) {
        Time& free = n_.free_at_[size_t(p.to) * 32 + (n_.nc_.per_plane ? p.plane : 0)];
        const Time backlog = free > t ? free - t : Time{0};
        if (backlog > n_.nc_.drop_backlog) {
          ++n_.queue_drops;
          return;
        }
        if (n_.nc_.mark_backlog > Time{0} && backlog > n_.nc_.mark_backlog) {
          p.ce = true;
          ++n_.ce_marks;
        }
        const Time ser(static_cast<int64_t>(len) * 8000 / static_cast<int64_t>(n_.nc_.bottleneck_mbps));
        free = std::max(free, t) + ser;
        t = free;
      }
      // Keep every (from, to, sport) FIFO even when extra delays differ between packets.
      n_.wire_.emplace(t, std::move(p));
    }

   private:
    Net& n_;
    int from_;
    std::vector<uint8_t> buf_;
  };

  Config nc_;
  std::vector<Time> free_at_;
  std::multimap<Time, NetPacket> wire_;
  std::multimap<Time, std::function<void()>> actions_;
  uint64_t next_cookie_ = 1;
  std::mt19937 rng_{5};
};

// Every message node `from` submitted was acknowledged, none failed, and every segment was
// handed to the receiver's host exactly once.
void expect_exactly_once(const Net& n, int from, int to) {
  const FakeHost& tx = *n.node[from].host;
  const FakeHost& rx = *n.node[to].host;
  EXPECT_TRUE(tx.failed.empty());
  EXPECT_EQ(tx.acked.size(), tx.outgoing.size());
  for (const auto& [seg, count] : rx.deliveries) EXPECT_EQ(count, 1);
}

// Submits `count` messages of `size` bytes from `from` to `to` on stream `stream`.
void submit_bulk(Net& n, int from, int to, uint32_t stream, uint32_t count, uint32_t size) {
  for (uint32_t i = 0; i < count; ++i) n.submit(from, to, stream, i, size);
}

// Time from the start until every message of node 0 was acknowledged.
Time bulk_transfer_time(double loss, uint64_t seed) {
  Net n(Net::Config{}, {Net::config()});
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  if (loss > 0) n.drop = [&](const NetPacket&) { return u(rng) < loss; };
  submit_bulk(n, 0, 1, 1, 64, 64 * 1024);  // 4 MiB
  n.run_idle(1s);
  EXPECT_TRUE(n.node[0].e->idle());
  expect_exactly_once(n, 0, 1);
  return n.now;
}

TEST(Congestion, RandomLossWithoutEcnKeepsGoodputHigh) {
  const Time clean = bulk_transfer_time(0, 1);
  const Time one = bulk_transfer_time(0.01, 2);
  const Time ten = bulk_transfer_time(0.10, 3);
  const double g1 = static_cast<double>(clean.count()) / static_cast<double>(one.count());
  const double g10 = static_cast<double>(clean.count()) / static_cast<double>(ten.count());
  std::printf("4 MiB over 10 Gbit/s: clean %.1f us, 1%% loss %.1f us (%.2f), 10%% loss %.1f us "
              "(%.2f)\n", clean.count() / 1e3, one.count() / 1e3, g1, ten.count() / 1e3, g10);
  // The loss-free run is bottleneck-bound (4 MiB at 10 Gbit/s is ~3.5 ms of wire time).
  EXPECT_LT(clean, 4500us);
  EXPECT_GE(g1, 0.9);
  EXPECT_GE(g10, 0.7);
}

// Runs a bulk transfer with no bottleneck and returns the sender's windows at the end.
struct Windows {
  uint32_t conn = 0, min_path = UINT32_MAX, max_path = 0;
  uint64_t decreases = 0, sack_gaps = 0;
};
Windows windows_after(const std::function<bool(const NetPacket&)>& drop,
                      const std::function<bool(const NetPacket&)>& mark) {
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config()});
  n.drop = drop;
  n.mark = mark;
  submit_bulk(n, 0, 1, 1, 32, 64 * 1024);
  n.run_idle(1s);
  expect_exactly_once(n, 0, 1);
  Windows w;
  w.conn = conn_stats(*n.node[0].e, n.node[1].ip).window;
  for (const auto& p : path_stats(*n.node[0].e, n.node[1].ip)) {
    w.min_path = std::min(w.min_path, p.window);
    w.max_path = std::max(w.max_path, p.window);
  }
  w.decreases = n.node[0].e->stats().ecn_decreases;
  w.sack_gaps = n.node[0].e->stats().sack_gaps;
  return w;
}

TEST(Congestion, RandomLossDoesNotCollapseTheWindowsTheWayCeMarksDo) {
  std::mt19937_64 rng(9);
  auto is_data = [](const NetPacket& p) { return wire::is_data_opcode(p.pkt.base.opcode); };
  const Windows lossy = windows_after([&](const NetPacket& p) { return is_data(p) && rng() % 10 == 0; },
                                      nullptr);
  const Windows marked = windows_after(nullptr, [&](const NetPacket& p) { return is_data(p) && rng() % 10 == 0; });
  std::printf("windows after 2 MiB: 10%% loss conn %u path %u..%u; 10%% CE conn %u path %u..%u\n",
              lossy.conn, lossy.min_path, lossy.max_path, marked.conn, marked.min_path,
              marked.max_path);
  const EngineConfig cfg = Net::config();
  EXPECT_GT(lossy.sack_gaps, 100u);
  EXPECT_EQ(lossy.decreases, 0u);
  // Loss never shrinks the connection window; a path loses at most a bounded share (RTOs).
  EXPECT_GE(lossy.conn, cfg.conn_window_init);
  EXPECT_GE(lossy.min_path, cfg.path_window_init / 2);
  // The same rate of CE marks is congestion: both windows come down hard.
  EXPECT_GT(marked.decreases, 20u);
  EXPECT_LT(marked.conn * 4, lossy.conn);
  EXPECT_LT(marked.max_path, lossy.min_path);
}

TEST(Congestion, CeMarksShrinkOnlyTheMarkedPathAndSteerTrafficAway) {
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config(4)});
  n.mark = [](const NetPacket& p) {
    return p.from == 0 && wire::is_data_opcode(p.pkt.base.opcode) && p.pkt.base.path_id == 2;
  };
  // First half: the path-2 marks start; second half: traffic after the windows settled.
  submit_bulk(n, 0, 1, 1, 16, 64 * 1024);
  n.run_idle(1s);
  expect_exactly_once(n, 0, 1);
  auto mid = path_stats(*n.node[0].e, n.node[1].ip);
  const uint32_t conn_mid = conn_stats(*n.node[0].e, n.node[1].ip).window;
  submit_bulk(n, 0, 1, 2, 16, 64 * 1024);
  n.run_idle(2s);
  expect_exactly_once(n, 0, 1);
  auto end = path_stats(*n.node[0].e, n.node[1].ip);
  const EngineConfig cfg = Net::config(4);
  EXPECT_LE(mid[2].window, 2u);
  for (int p : {0, 1, 3}) {
    EXPECT_GE(mid[p].window, cfg.path_window_init) << p;
    EXPECT_EQ(mid[p].ecn_ce_echoed, 0u);
  }
  EXPECT_GT(mid[2].ecn_ce_echoed, 0u);
  EXPECT_LT(conn_mid, cfg.conn_window_init + 16 * 64);  // it was decreased too
  // Steering: in the second transfer the marked path carried a small fraction of the packets.
  uint64_t marked = end[2].tx_packets - mid[2].tx_packets, clear = 0;
  for (int p : {0, 1, 3}) clear += end[p].tx_packets - mid[p].tx_packets;
  std::printf("second transfer: marked path %llu packets, the three clear paths %llu\n",
              static_cast<unsigned long long>(marked), static_cast<unsigned long long>(clear));
  EXPECT_LT(marked * 12, clear);
  EXPECT_GT(n.node[0].e->stats().ecn_decreases, 0u);
}

// A path's cut follows the fraction of its packets that were marked (DCTCP's alpha): a path
// whose packets are all marked halves, one mark after a long clean run costs it a few percent.
// Halving on every isolated mark stretched a 16-host permutation beside 50 % background traffic
// from 42 to 177 us (84 with alpha).
TEST(Congestion, ARareMarkCutsLittleWhereMarksOnEveryPacketHalve) {
  // Marks from packet `from` on, or on that packet only.
  auto window_after = [](int from, bool only) -> double {
    Net::Config nc;
    nc.bottleneck_mbps = 0;
    EngineConfig cfg = Net::config(1);
    cfg.path_window_init = 32;
    Net n(nc, {cfg});
    int data = 0;
    n.mark = [&](const NetPacket& p) {
      if (p.from != 0 || !wire::is_data_opcode(p.pkt.base.opcode)) return false;
      ++data;
      return only ? data == from : data >= from;
    };
    // The window as each packet reaches the sender, before it is processed: the cut shows as
    // the smallest ratio between consecutive samples.
    uint32_t last = 0;
    double cut = 1;
    n.on_arrival = [&](const NetPacket& p, Time) {
      if (p.to != 0) return;
      const auto ps = path_stats(*n.node[0].e, n.node[1].ip);
      if (ps.empty()) return;
      if (last) cut = std::min(cut, double(ps[0].window) / last);
      last = ps[0].window;
    };
    submit_bulk(n, 0, 1, 1, 1, 600 * kMtu);  // 600 packets on the one path
    n.run_idle(1s);
    expect_exactly_once(n, 0, 1);
    EXPECT_GE(n.node[0].e->stats().ecn_decreases, 1u);
    return cut;
  };
  const double all = window_after(1, false), late = window_after(500, true);
  std::printf("window kept at a cut: every packet marked %.3f, one mark on packet 500 %.3f\n",
              all, late);
  EXPECT_LE(all, 0.55);   // halved
  EXPECT_GE(late, 0.95);  // a few percent
}

TEST(Congestion, AnAppLimitedSenderSteersAwayFromAMarkedPathItsWindowDoesNotLimit) {
  // One packet every 3 us never fills any window: only the spraying preference can keep
  // traffic off the marked path.
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config(4)});
  n.mark = [](const NetPacket& p) {
    return p.from == 0 && wire::is_data_opcode(p.pkt.base.opcode) && p.pkt.base.path_id == 2;
  };
  uint32_t msn = 0;
  std::function<void()> tick = [&] {
    n.submit(0, 1, 1, msn++, kMtu);
    if (msn < 1000) n.at(n.now + 3us, tick);
  };
  n.at(Time{0}, tick);
  n.run_idle(1s);
  expect_exactly_once(n, 0, 1);
  uint64_t total = 0;
  auto ps = path_stats(*n.node[0].e, n.node[1].ip);
  for (const auto& p : ps) total += p.tx_packets;
  std::printf("app-limited: marked path carried %llu of %llu packets\n",
              static_cast<unsigned long long>(ps[2].tx_packets), static_cast<unsigned long long>(total));
  EXPECT_LT(ps[2].tx_packets * 6, total);  // round-robin alone would give it a quarter
}

// Two or N senders into one receiver behind a 10 Gbit/s downlink, with unequal windows, so
// that without hints the bigger window would take most of the link.
void fair_share_test(int senders) {
  std::vector<EngineConfig> cfgs;
  EngineConfig rx = Net::config();
  rx.rx_capacity_mbps = 10000;
  cfgs.push_back(rx);
  for (int i = 0; i < senders; ++i) {
    EngineConfig c = Net::config();
    c.conn_window_init = i == 0 ? 64 : 16;  // the first sender is much more aggressive
    c.path_window_init = i == 0 ? 8 : 2;
    // Shares are a policy of the whole fabric: its senders divide their own inbound capacity
    // too, and so start with start_window packets until their first share (congestion.md §3.4).
    c.rx_capacity_mbps = 10000;
    cfgs.push_back(c);
  }
  Net::Config nc;
  nc.nodes = senders + 1;
  Net n(nc, cfgs);
  for (int i = 1; i <= senders; ++i) submit_bulk(n, i, 0, 1, 64, 64 * 1024);
  Time first_hint = Time::max();
  std::set<int> hinted;
  n.on_arrival = [&](const NetPacket& p, Time t) {
    // The first hint every sender has had: from then on the receiver knows them all.
    if (p.to != 0 && p.pkt.base.opcode == Opcode::kAck && p.pkt.ack.rate_hint &&
        !hinted.count(p.to) && (hinted.insert(p.to), hinted.size() == size_t(senders))) {
      first_hint = t;
    }
  };
  n.run_until(3ms);
  ASSERT_NE(first_hint, Time::max());
  // "Two RTTs": the largest smoothed RTT of any sender's paths, at the end (the first hint now
  // comes with the first ACK, before any sample).
  int64_t rtt = 0;
  for (int i = 1; i <= senders; ++i) {
    for (const auto& ps : path_stats(*n.node[i].e, n.node[0].ip)) rtt = std::max(rtt, ps.srtt_ns);
  }
  ASSERT_GT(rtt, 0);
  std::printf("first hint at %.1f us, RTT then %.1f us\n", first_hint.count() / 1e3, rtt / 1e3);
  const Time t0 = first_hint + 2 * Time(rtt);
  const Time t1 = t0 + 500us;
  ASSERT_LT(t1, n.now);
  const double share = 10000.0 * kHintPercent / 100 / senders;
  double total = 0;
  for (int i = 1; i <= senders; ++i) {
    const double r = n.rate_mbps(i, 0, t0, t1);
    total += r;
    const ConnStats cs = conn_stats(*n.node[i].e, n.node[0].ip);
    std::printf("sender %d: %.0f Mbit/s (share %.0f), hint in force %u, window %u, in flight %u, "
                "ecn decreases %llu, pacing waits %llu\n", i, r, share, cs.rate_hint_mbps, cs.window,
                cs.in_flight, static_cast<unsigned long long>(n.node[i].e->stats().ecn_decreases),
                static_cast<unsigned long long>(n.node[i].e->stats().pacing_waits));
    EXPECT_NEAR(r, share, 0.1 * share) << "sender " << i;
  }
  EXPECT_GT(total, 0.85 * 10000);
  EXPECT_GT(n.node[1].e->stats().pacing_waits, 0u);
  // The same senders where nobody shares by hints: from the start to 100 us after t0 the
  // aggressive one takes more than twice what another gets (ECN alone evens them out only over
  // hundreds of microseconds), where with hints it takes its share from the start (what makes
  // this test able to fail).
  for (auto& c : cfgs) c.rx_capacity_mbps = 0;
  Net plain(nc, cfgs);
  for (int i = 1; i <= senders; ++i) submit_bulk(plain, i, 0, 1, 64, 64 * 1024);
  const Time early = t0 + 100us;
  plain.run_until(early + 1us);
  std::printf("to %.0f us: with hints sender 1 %.0f Mbit/s, sender 2 %.0f; without %.0f, %.0f\n",
              early.count() / 1e3, n.rate_mbps(1, 0, Time{0}, early), n.rate_mbps(2, 0, Time{0}, early),
              plain.rate_mbps(1, 0, Time{0}, early), plain.rate_mbps(2, 0, Time{0}, early));
  EXPECT_GT(plain.rate_mbps(1, 0, Time{0}, early), 2 * plain.rate_mbps(2, 0, Time{0}, early));
  EXPECT_LT(n.rate_mbps(1, 0, Time{0}, early), 1.25 * n.rate_mbps(2, 0, Time{0}, early));
}

// Node 0 shares rx_capacity_mbps among its senders by hints; the other nodes are plain.
std::vector<EngineConfig> hinting_receiver(uint32_t rx_capacity_mbps) {
  EngineConfig rx = Net::config();
  rx.rx_capacity_mbps = rx_capacity_mbps;
  return {rx, Net::config()};
}

TEST(FairShare, TwoSendersReachTheirSharesWithinTwoRttsOfTheFirstHint) { fair_share_test(2); }
TEST(FairShare, FourSendersReachTheirSharesWithinTwoRttsOfTheFirstHint) { fair_share_test(4); }

TEST(FairShare, ASenderUsingLessThanItsShareLeavesTheRestToTheOthers) {
  const std::vector<EngineConfig> cfgs = hinting_receiver(10000);
  Net::Config nc;
  nc.nodes = 4;
  Net n(nc, cfgs);
  // Node 1 is app-limited to 1 Gbit/s (4 KiB every 32.768 us); nodes 2 and 3 are greedy.
  uint32_t msn = 0;
  std::function<void()> tick = [&] {
    n.submit(1, 0, 1, msn++, 4096);
    if (n.now < 3ms) n.at(n.now + 32768ns, tick);
  };
  n.at(Time{0}, tick);
  for (int i = 2; i <= 3; ++i) submit_bulk(n, i, 0, 1, 64, 64 * 1024);
  n.run_until(3ms);
  const Time t0 = 1ms, t1 = 3ms;
  const double limited = n.rate_mbps(1, 0, t0, t1);
  const double greedy_share = (10000.0 * kHintPercent / 100 - limited) / 2;
  std::printf("limited %.0f Mbit/s, greedy %.0f and %.0f (max-min share %.0f, equal split %.0f)\n",
              limited, n.rate_mbps(2, 0, t0, t1), n.rate_mbps(3, 0, t0, t1), greedy_share,
              10000.0 * kHintPercent / 100 / 3);
  // 1000 Mbit/s of payload is 1078 on the wire (80 header bytes per 1024).
  EXPECT_NEAR(limited, 1000.0 * (kMtu + wire::kDataHeadersLen) / kMtu, 50);
  for (int i = 2; i <= 3; ++i) EXPECT_NEAR(n.rate_mbps(i, 0, t0, t1), greedy_share, 0.1 * greedy_share);
}

TEST(FairShare, PacingShowsInNextDeadline) {
  // One sender, hint far below the link: packets leave spaced by the hint, and the engine asks
  // to be woken for the next one.
  const std::vector<EngineConfig> cfgs = hinting_receiver(2000);
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, cfgs);
  submit_bulk(n, 1, 0, 1, 16, 64 * 1024);
  n.run_until(500us);
  const ConnStats cs = conn_stats(*n.node[1].e, n.node[0].ip);
  ASSERT_GT(cs.rate_hint_mbps, 0u);
  EXPECT_LE(cs.rate_hint_mbps, 2000u);
  // Wire rate (headers included) matches the hint within 5%.
  const double wire_mbps = n.rate_mbps(1, 0, 200us, 500us);
  EXPECT_NEAR(wire_mbps, cs.rate_hint_mbps, 0.05 * cs.rate_hint_mbps);
  // Right after a poll that sent what the credit allowed, the engine wants to be woken when
  // the next packet's credit is there: after now, and within one packet time at the hint.
  QueueSink sink(INT_MAX);
  n.node[1].e->poll_tx(n.now, sink);
  const Time wake = n.node[1].e->next_deadline();
  const Time packet_time((kMtu + wire::kDataHeadersLen) * 8000 / cs.rate_hint_mbps + 1);
  EXPECT_GT(wake, n.now);
  EXPECT_LE(wake, n.now + packet_time);
  EXPECT_GT(n.node[1].e->stats().pacing_waits, 100u);
}

// A receiver that shares its capacity gives a sender its share in the ACK of its very first
// packet, and tells senders whose share fell to half or less at once, by an ACK on the path
// their data came by (congestion.md §3.3), not with the ACK of their next packet.
TEST(FairShare, TheFirstAckCarriesAShareAndASharesFallIsPushed) {
  EngineConfig rx = Net::config();
  rx.rx_capacity_mbps = 10000;
  Net::Config nc;
  nc.nodes = 3;
  Net n(nc, {rx, Net::config()});
  std::map<int, std::vector<std::pair<Time, uint32_t>>> hints;  // per sender: (arrival, hint)
  n.on_arrival = [&](const NetPacket& p, Time t) {
    if (p.to != 0 && p.pkt.base.opcode == Opcode::kAck) hints[p.to].push_back({t, p.pkt.ack.rate_hint});
  };
  submit_bulk(n, 1, 0, 1, 32, 64 * 1024);
  n.run_until(100us);
  ASSERT_FALSE(hints[1].empty());
  EXPECT_EQ(hints[1].front().second, 10000u * kHintPercent / 100);  // alone: all of it
  submit_bulk(n, 2, 0, 1, 32, 64 * 1024);
  n.run_until(300us);
  ASSERT_FALSE(hints[2].empty());
  EXPECT_EQ(hints[2].front().second, 10000u * kHintPercent / 100 / 2);
  // Sender 1 hears its halved share within one path delay of sender 2's admission (its first
  // packet's arrival), by a pushed ACK.
  EXPECT_GE(n.node[0].e->stats().share_pushes, 1u);
  Time halved = Time::max();
  for (auto [t, h] : hints[1]) {
    if (h <= 10000u * kHintPercent / 100 / 2) {
      halved = t;
      break;
    }
  }
  Time admitted = Time::max();
  for (const auto& d : n.delivered) {
    if (d.from == 2) {
      admitted = d.t;
      break;
    }
  }
  ASSERT_NE(halved, Time::max());
  EXPECT_LE(halved, admitted + nc.prop + 1us);
}

// Resends and failover copies wait for the share's credit like new data (congestion.md §3.3): a
// sender that loses a burst does not send faster than its share to repair it.
TEST(FairShare, ResendsArePacedToTheShare) {
  const std::vector<EngineConfig> cfgs = hinting_receiver(2000);
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, cfgs);
  std::vector<std::pair<Time, uint32_t>> sent;  // data from node 1: (time, bytes)
  int dropped = 0;
  n.drop = [&](const NetPacket& p) {
    if (p.from != 1 || !wire::is_data_opcode(p.pkt.base.opcode)) return false;
    sent.push_back({n.now, static_cast<uint32_t>(p.bytes.size())});
    // Every packet first sent between 100 and 140 us is lost once.
    if (n.now >= 100us && n.now < 140us && p.pkt.data.orig_seq == 0 &&
        !wire::is_failover_copy(p.pkt.base.flags) && dropped < 64) {
      ++dropped;
      return true;
    }
    return false;
  };
  submit_bulk(n, 1, 0, 1, 16, 64 * 1024);
  n.run_until(800us);
  ASSERT_GT(dropped, 5);
  // Resent, or moved to other paths as failover copies: both are paced.
  EXPECT_GE(n.node[1].e->stats().retransmits + n.node[1].e->stats().failover_resends, 5u);
  const uint32_t hint = conn_stats(*n.node[1].e, n.node[0].ip).rate_hint_mbps;
  ASSERT_GT(hint, 0u);
  // Over any 100 us from 150 us on, what node 1 sent (resends included) is within its share
  // plus the two packets of burst the bucket holds.
  for (Time t0 = 150us; t0 + 100us <= 800us; t0 += 50us) {
    uint64_t bytes = 0;
    for (auto [t, b] : sent) bytes += (t >= t0 && t < t0 + 100us) ? b : 0;
    EXPECT_LE(static_cast<double>(bytes) * 8e3 / 1e5, hint * 1.0 + 2.0 * (kMtu + 128) * 8e3 / 1e5)
        << "from " << t0.count() / 1000 << " us";
  }
}

// Where shares are in use, a connection sends start_window packets before its peer's first ACK;
// a peer that answers without a share lifts the limit, one that shares paces what follows
// (congestion.md §3.4). After a pause long enough for the peer to forget its share, the next
// burst waits for a fresh one.
TEST(FairShare, AConnectionStartsWithStartWindowPacketsWhereSharesAreInUse) {
  for (bool peer_shares : {true, false}) {
    EngineConfig tx = Net::config(), rx = Net::config();
    tx.rx_capacity_mbps = 10000;
    rx.rx_capacity_mbps = peer_shares ? 10000 : 0;
    Net::Config nc;
    Net n(nc, {rx, tx});
    Time first_ack = Time::max();
    n.on_arrival = [&](const NetPacket& p, Time t) {
      if (p.to == 1 && p.pkt.base.opcode == Opcode::kAck && first_ack == Time::max()) first_ack = t;
    };
    std::vector<Time> sent;
    n.drop = [&](const NetPacket& p) {
      if (p.from == 1 && wire::is_data_opcode(p.pkt.base.opcode)) sent.push_back(n.now);
      return false;
    };
    submit_bulk(n, 1, 0, 1, 4, 64 * 1024);
    n.run_idle(10ms);
    expect_exactly_once(n, 1, 0);
    size_t before = 0;
    for (Time t : sent) before += t < first_ack;
    EXPECT_EQ(before, tx.start_window) << "peer shares: " << peer_shares;
    // Idle for longer than the peer remembers a sender: the next burst starts small again
    // where shares are in use, at once where they are not.
    const Time pause = n.now + 4 * tx.hint_interval;
    n.at(pause, [] {});
    n.run_until(pause);
    ASSERT_EQ(n.now, pause);
    sent.clear();
    first_ack = Time::max();
    submit_bulk(n, 1, 0, 2, 1, 64 * 1024);
    n.run_idle(20ms);
    before = 0;
    for (Time t : sent) before += t < first_ack;
    if (peer_shares) EXPECT_EQ(before, tx.start_window);
    else EXPECT_GT(before, 2 * tx.start_window);  // what its windows allow
  }
}

// The pacing wait ends while the host's transmit queue is full: the timer that ends it must not
// leave the deadline in the past, or a host that polls again at the deadline spins at one
// instant for ever (a simulated all-to-all with hints did).
TEST(FairShare, APacingWaitThatEndsBehindAFullQueueLeavesNoDeadlineInThePast) {
  const std::vector<EngineConfig> cfgs = hinting_receiver(2000);
  Net::Config nc;
  nc.nodes = 3;
  nc.bottleneck_mbps = 0;
  Net n(nc, cfgs);
  submit_bulk(n, 1, 0, 1, 16, 64 * 1024);
  n.run_until(300us);
  ASSERT_GT(conn_stats(*n.node[1].e, n.node[0].ip).rate_hint_mbps, 0u);
  QueueSink full(0);
  Engine& e = *n.node[1].e;
  e.poll_tx(n.now, *n.node[1].sink);  // sends what the credit allows, then waits for credit
  const Time paced = e.next_deadline();
  ASSERT_GT(paced, n.now);
  // Another connection with data to send is ahead of it when the queue is full.
  n.submit(1, 2, 2, 0, 64 * 1024);
  e.on_timer(paced);
  e.poll_tx(paced, full);
  EXPECT_GT(e.next_deadline(), paced);
  // Once the queue has room, sending goes on.
  n.run_idle(n.now + 1s);
  expect_exactly_once(n, 1, 0);
  expect_exactly_once(n, 1, 2);
}

// ---------------------------------------------------------------------------------------------
// Path failure

TEST(PathFailure, OneBlackHoledPathOfEightIsDetectedWithinThreeRttsAndRePicked) {
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config()});
  ASSERT_TRUE(path_stats(*n.node[0].e, n.node[1].ip).empty());  // no connection yet
  // Warm up so every path has an RTT, then black-hole the link of path 3's port.
  submit_bulk(n, 0, 1, 1, 4, 16 * 1024);
  n.run_idle(10ms);
  auto before = path_stats(*n.node[0].e, n.node[1].ip);
  const int bad = link_of(before[3].udp_src_port);
  int victims = 0;
  for (const auto& p : before) victims += link_of(p.udp_src_port) == bad;
  const Time hole = n.now;
  n.drop = [&](const NetPacket& p) { return p.from == 0 && link_of(p.sport) == bad; };
  submit_bulk(n, 0, 1, 2, 32, 64 * 1024);
  // The first probe leaves the moment the path is declared failed; find it in the run.
  Time first_probe_tx = Time::max();
  uint64_t probes_before = n.node[0].e->stats().probes_sent;
  while (n.now < hole + 50ms) {
    if (!n.step()) break;
    if (first_probe_tx == Time::max() && n.node[0].e->stats().probes_sent > probes_before) {
      first_probe_tx = n.now;
    }
    bool idle = n.node[0].e->idle() && n.node[1].e->idle();
    if (idle && n.node[0].e->stats().paths_recovered >= static_cast<uint64_t>(victims)) break;
  }
  expect_exactly_once(n, 0, 1);
  EXPECT_TRUE(n.node[0].host->failed.empty());  // no application-visible error
  const auto& st = n.node[0].e->stats();
  EXPECT_EQ(st.paths_failed, static_cast<uint64_t>(victims));
  EXPECT_GT(st.failover_resends, 0u);
  ASSERT_NE(first_probe_tx, Time::max());
  const Time rtt = 2 * nc.prop;
  // The first packet into the hole left at `hole`; its path was declared failed within 3 RTTs
  // of the last acknowledgement it could have had (hole + 1 RTT).
  std::printf("%d victim path(s); declared failed %.1f us after the hole (RTT %.1f us)\n", victims,
              (first_probe_tx - hole).count() / 1e3, rtt.count() / 1e3);
  EXPECT_LE(first_probe_tx - hole, 4 * rtt + 2us);
  // Re-picked: a new source port whose link works, and back in service.
  auto after = path_stats(*n.node[0].e, n.node[1].ip);
  EXPECT_EQ(st.paths_recovered, static_cast<uint64_t>(victims));
  for (size_t p = 0; p < after.size(); ++p) {
    EXPECT_EQ(after[p].state, PathState::kActive) << p;
    if (link_of(before[p].udp_src_port) == bad) {
      EXPECT_NE(after[p].udp_src_port, before[p].udp_src_port);
      EXPECT_NE(link_of(after[p].udp_src_port), bad);
      EXPECT_EQ(after[p].failures, 1u);
      EXPECT_GE(after[p].probes, 1u);
    } else {
      EXPECT_EQ(after[p].udp_src_port, before[p].udp_src_port);
      EXPECT_EQ(after[p].failures, 0u);
    }
  }
  // The receiver saw each segment once even though copies and originals share nothing but
  // (stream, msn, offset).
  EXPECT_EQ(n.node[1].host->deliveries.size(), 4u * 16 + 32u * 64);
}

// The fabric holds every packet for 5 ms (on this host: the emulator's process descheduled; on a
// real one, a peer engine off its CPU) while a bulk transfer has packets in flight on all 8
// paths. Their timeouts are the whole connection's silence, not a path's: none is suspected,
// each is resent in place with back-off, and everything arrives once (congestion.md §4.1).
// Suspecting them failed 7 of the 8 paths at the first timeouts, each moving its packets onto
// the others, just as silent, and re-picked 7 ports that were fine.
TEST(PathFailure, AStallOfEveryPathAtOnceFailsNoPath) {
  EngineConfig cfg = Fabric::default_config();
  cfg.num_paths = 8;
  cfg.num_planes = 1;
  Fabric f(cfg);
  f.submit(0, 1, 0, 64 * kMtu);
  f.run();  // RTT samples on every path
  for (uint32_t m = 1; m <= 8; ++m) f.submit(0, 1, m, 64 * kMtu);
  const Time start = f.now;
  while (f.now < start + 30us) ASSERT_TRUE(f.step());
  const auto before = path_stats(*f.node[0].e, kIpB);
  int busy = 0;
  for (const auto& p : before) busy += p.in_flight > 0;
  ASSERT_EQ(busy, 8);
  const Time stall_to = f.now + 5ms;
  f.extra_delay = [&](const Sent&) { return f.now < stall_to ? stall_to - f.now : Time{0}; };
  f.run(stall_to + 1s);
  expect_all_delivered_exactly(f, 0);
  const EngineStats& st = f.node[0].e->stats();
  EXPECT_GE(st.timeouts, 8u);  // the stall outlasted every path's RTO
  EXPECT_EQ(st.paths_suspected, 0u);
  EXPECT_EQ(st.paths_failed, 0u);
  EXPECT_EQ(st.failover_resends, 0u);
  const auto after = path_stats(*f.node[0].e, kIpB);
  for (size_t p = 0; p < after.size(); ++p) {
    EXPECT_EQ(after[p].udp_src_port, before[p].udp_src_port) << p;
  }
}

// Two one-packet messages on two paths whose link is dead, the other six paths idle: the two
// silent paths are a few of the connection's, not most of it, so the tail probe and their first
// timeout resend in place (it might be a stall) but the second timeout suspects them, and both
// messages get through on the idle paths long before the QP's retries run out. Never suspecting
// paths that are silent together took 51 ms.
TEST(PathFailure, TwoBusyPathsDeadTogetherStillFailOverToIdleOnes) {
  EngineConfig cfg = Fabric::default_config();
  cfg.num_paths = 8;
  cfg.num_planes = 1;
  cfg.tail_redundancy = false;  // its copies on a third path would recover them (§5.2)
  Fabric f(cfg);
  f.submit(0, 1, 0, 64 * kMtu);
  f.run();  // RTT samples on every path
  const size_t first = f.log.size();
  std::set<uint16_t> dead;
  f.fate = [&](const Sent& s) {
    if (s.from != 0 || !wire::is_data_opcode(s.pkt.base.opcode)) return Fate::kDeliver;
    // The link of the first two data packets' ports: dead from then on.
    if (dead.size() < 2 && &s - f.log.data() >= static_cast<ptrdiff_t>(first)) dead.insert(s.sport);
    return dead.count(s.sport) ? Fate::kDrop : Fate::kDeliver;
  };
  const Time start = f.now;
  f.submit(0, 1, 1, 100);
  f.submit(0, 1, 2, 100);
  f.run(start + 1s);
  ASSERT_EQ(dead.size(), 2u);  // sprayed on two paths
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_EQ(f.node[0].host.acked.size(), 3u);
  const EngineStats& st = f.node[0].e->stats();
  EXPECT_GE(st.timeouts, 2u);
  EXPECT_GE(st.paths_suspected, 1u);
  // Spared once: resent after one RTO, suspected at the next (a back-off later), each
  // timeout far below the QP's budget.
  EXPECT_LT(f.now - start, 10 * f.cfg.rto_initial);
}

TEST(PathFailure, CopiesOfPacketsThatHadArrivedAreNotDeliveredTwice) {
  // Path 1's ACKs are black-holed on the way back: its data arrives, the sender hears nothing,
  // declares it failed and resends its packets elsewhere. The receiver already has them.
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config(4)});
  submit_bulk(n, 0, 1, 1, 2, 8 * 1024);
  n.run_idle(10ms);
  const uint16_t port1 = path_stats(*n.node[0].e, n.node[1].ip)[1].udp_src_port;
  n.drop = [&](const NetPacket& p) {
    return p.from == 1 && p.pkt.base.opcode == Opcode::kAck && p.sport == port1;
  };
  submit_bulk(n, 0, 1, 2, 8, 32 * 1024);
  n.run_idle(100ms);
  expect_exactly_once(n, 0, 1);
  EXPECT_EQ(n.node[0].e->stats().paths_failed, 1u);
  EXPECT_GT(n.node[0].e->stats().failover_resends, 0u);
  EXPECT_GT(n.node[1].e->stats().failover_duplicates, 0u);
  for (uint32_t m = 0; m < 8; ++m) {
    EXPECT_EQ(n.node[1].host->received.at({2, m}), n.node[0].host->outgoing.at(3 + m)) << m;
  }
  // The ACK mirrors the probe's new port, so the re-pick repaired the return direction too.
  EXPECT_EQ(n.node[0].e->stats().paths_recovered, 1u);
}

TEST(PathFailure, ASlowPathDeclaredFailedIsNotDeliveredTwiceWhenItsOriginalsArrive) {
  // Path 1 is not dead but 2 ms late: it is declared failed, its packets are resent elsewhere,
  // and then the originals arrive too. The receiver must hand each segment over once.
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config(4)});
  submit_bulk(n, 0, 1, 1, 2, 8 * 1024);
  n.run_idle(10ms);
  const uint16_t slow_port = path_stats(*n.node[0].e, n.node[1].ip)[1].udp_src_port;
  n.extra_delay = [&](const NetPacket& p) {
    return p.from == 0 && p.sport == slow_port ? Time(2ms) : Time{0};
  };
  submit_bulk(n, 0, 1, 2, 8, 32 * 1024);
  n.run_idle(100ms);
  n.extra_delay = nullptr;
  n.run_until(n.now + 5ms);  // let the late originals land
  expect_exactly_once(n, 0, 1);
  EXPECT_GE(n.node[0].e->stats().paths_failed, 1u);
  EXPECT_GT(n.node[0].e->stats().failover_resends, 0u);
  EXPECT_GT(n.node[1].e->stats().duplicates, 0u);  // the originals, recognised as such
  for (uint32_t m = 0; m < 8; ++m) {
    EXPECT_EQ(n.node[1].host->received.at({2, m}), n.node[0].host->outgoing.at(3 + m)) << m;
  }
}

// A copy may name a sequence of its original path further ahead than the receiver's 256-wide
// window there (that path's packets stopped arriving while its sender went on). The sender has
// resolved everything 256 before it (it never has more than 64 in flight on a path), so the
// window moves up to it: the copy is delivered and recorded there, and a second copy of the
// same packet, or its original arriving late, is known for a duplicate.
TEST(Transport, CopiesNamingASequencePastTheOriginalPathsWindowDeliverOnce) {
  Fabric f;
  f.submit(0, 1, 0, 4 * kMtu);
  f.run();
  const Sent* model = f.data_from(0).back();
  const uint32_t far = model->pkt.base.path_seq + 1000;  // path 0's window ends ~256 past cum
  auto inject = [&](uint16_t path, uint32_t seq, uint16_t flags, uint32_t orig_seq) {
    wire::BaseHeader b = model->pkt.base;
    wire::DataHeader h = model->pkt.data;
    b.path_id = path;
    b.path_seq = seq;
    b.ack_floor = seq;
    b.flags = flags;
    h.msn = 1;
    h.offset = 0;
    h.total_length = 100;
    h.payload_len = 100;
    h.orig_seq = orig_seq;
    std::vector<uint8_t> bytes(wire::kDataHeadersLen + 100, 0x5a);
    wire::encode_data(bytes, b, h);
    f.node[1].e->on_packet(f.now, kIpA, model->sport, false, bytes, 0);
  };
  const uint32_t q1 = 500, q2 = 700;  // sequences on paths 1 and 2, floors with them
  inject(1, q1, wire::failover_flags(0), far);
  inject(2, q2, wire::failover_flags(0) | wire::kFlagRedundant, far);
  inject(0, far, 0, 0);  // the original, late
  EXPECT_EQ((f.node[1].host.deliveries[{1, 1, 0}]), 1);
  EXPECT_EQ(f.node[1].e->stats().failover_duplicates, 1u);
  EXPECT_EQ(f.node[1].e->stats().duplicates, 1u);
}

// A path whose every packet is lost for a long while, on whatever route it re-picks, while the
// transfer goes on: it is failed, probed, returned and failed again, and its sequence runs far
// ahead of what the receiver has seen of it. Copies naming its sequences (two of each in the
// tail) must still be delivered once.
TEST(PathFailure, APathLostForLongRunsAheadOfItsReceiverAndCopiesStillDeliverOnce) {
  for (uint32_t seed = 0; seed < 6; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    Fabric f;
    std::mt19937 rng(seed);
    Time dead_until = Time(std::chrono::milliseconds(40 + 20 * seed));
    f.fate = [&](const Sent& s) {
      const bool lost_path = s.from == 0 && s.pkt.base.path_id == seed % 4 &&
                             (!wire::is_data_opcode(s.pkt.base.opcode) ||
                              !wire::is_failover_copy(s.pkt.base.flags));
      return lost_path && f.now < dead_until ? Fate::kDrop : Fate::kDeliver;
    };
    f.extra_delay = [&](const Sent&) { return Time(std::chrono::microseconds(rng() % 40)); };
    for (uint32_t i = 0; i < 400; ++i) f.submit(0, 1 + i % 3, i / 3, 2 * kMtu + 100 * (i % 7));
    f.run(5s);
    expect_all_delivered_exactly(f, 0);
    EXPECT_GE(f.node[0].e->stats().paths_failed, 1u);
  }
}

// Everything at once, over many seeds: random loss both ways, duplication, delays from none to
// far beyond the RTO, and paths that go dead for a while on every route they re-pick. Every
// segment is delivered exactly once (a READ or a receive completes by counting bytes: a segment
// delivered twice would complete it with a hole).
TEST(PathFailure, ExactlyOnceUnderLossDuplicationLongDelaysAndDeadPaths) {
  for (uint32_t seed = 0; seed < 60; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    Fabric f;
    std::mt19937 rng(seed);
    const uint16_t dead = seed % 4;
    f.fate = [&](const Sent& s) {
      const bool data = s.from == 0 && s.pkt.base.opcode != Opcode::kAck;
      if (data && s.pkt.base.path_id == dead && (f.now.count() / 3000000) % 2 == 0) {
        return Fate::kDrop;  // the dead path, 3 ms of every 6
      }
      const uint32_t r = rng() % 100;
      return r < 8 ? Fate::kDrop : r < 12 ? Fate::kDuplicate : Fate::kDeliver;
    };
    f.extra_delay = [&](const Sent&) {
      const uint32_t r = rng() % 100;
      return Time(std::chrono::microseconds(r < 3 ? 2000 + rng() % 20000 : rng() % 60));
    };
    for (uint32_t i = 0; i < 120; ++i) f.submit(0, 1 + i % 3, i / 3, 1 + (rng() % 12) * kMtu);
    f.run(30s);
    expect_all_delivered_exactly(f, 0);
  }
}

// The copies made when a slow path is declared failed are all lost, and its originals arrive
// late: the ACKs of the original path acknowledge the moved packets wherever they are
// (congestion.md §4.3), so the message completes without a timeout for the lost copies.
TEST(PathFailure, AnAckOfTheOriginalPathResolvesItsMovedPacketsWhoseCopiesWereLost) {
  for (bool lose_copies : {false, true}) {
    Net::Config nc;
    nc.bottleneck_mbps = 0;
    Net n(nc, {Net::config(4)});
    submit_bulk(n, 0, 1, 1, 2, 8 * 1024);
    n.run_idle(10ms);
    const uint16_t slow_port = path_stats(*n.node[0].e, n.node[1].ip)[1].udp_src_port;
    n.extra_delay = [&](const NetPacket& p) {
      return p.from == 0 && p.sport == slow_port ? Time(100us) : Time{0};
    };
    uint64_t copies_lost = 0;
    n.drop = [&](const NetPacket& p) {
      const bool copy = p.from == 0 && wire::is_data_opcode(p.pkt.base.opcode) &&
                        wire::is_failover_copy(p.pkt.base.flags);
      if (lose_copies && copy) ++copies_lost;
      return lose_copies && copy;
    };
    const Time t0 = n.now;
    submit_bulk(n, 0, 1, 2, 1, 32 * 1024);
    n.run_idle(100ms);
    n.drop = nullptr;
    n.extra_delay = nullptr;
    expect_exactly_once(n, 0, 1);
    EXPECT_GE(n.node[0].e->stats().paths_failed, 1u);
    std::printf("copies lost: %llu; done in %.1f us, %llu timeouts\n",
                static_cast<unsigned long long>(copies_lost), (n.now - t0).count() / 1e3,
                static_cast<unsigned long long>(n.node[0].e->stats().timeouts));
    if (lose_copies) {
      EXPECT_GT(copies_lost, 0u);
    }
    // Without those ACKs the moved packets could only be resolved by their copies, which never
    // arrive: the message ran out of retries. With them, at most one RTO on the way.
    EXPECT_LE(n.node[0].e->stats().timeouts, 1u);
    EXPECT_LT(n.now - t0, 1ms);
  }
}

TEST(PathFailure, WhenAllPathsOfAPlaneFailTrafficFailsOverToTheOtherPlane) {
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  EngineConfig cfg = Net::config(8);
  cfg.num_planes = 2;
  Net n(nc, {cfg});
  submit_bulk(n, 0, 1, 1, 2, 16 * 1024);
  n.run_idle(10ms);
  bool plane1_down = true;
  n.drop = [&](const NetPacket& p) { return plane1_down && p.from == 0 && p.plane == 1; };
  submit_bulk(n, 0, 1, 2, 16, 64 * 1024);
  n.run_idle(20ms);
  expect_exactly_once(n, 0, 1);
  auto ps = path_stats(*n.node[0].e, n.node[1].ip);
  for (const auto& p : ps) {
    if (p.plane == 1) {
      EXPECT_NE(p.state, PathState::kActive) << p.path_id;
      EXPECT_EQ(p.failures, 1u) << p.path_id;
    } else {
      EXPECT_EQ(p.state, PathState::kActive) << p.path_id;
    }
  }
  EXPECT_EQ(conn_stats(*n.node[0].e, n.node[1].ip).paths_active, 4u);
  // The plane comes back: probes are answered and its paths return.
  plane1_down = false;
  n.run_until(n.now + 300ms);
  for (const auto& p : path_stats(*n.node[0].e, n.node[1].ip)) {
    EXPECT_EQ(p.state, PathState::kActive) << p.path_id;
  }
}

// ---------------------------------------------------------------------------------------------
// Failure under every traffic pattern (congestion.md §4.1, §4.5): one packet in flight, a READ
// or an atomic (request one way, response the other), one-way traffic whose ACKs die, a whole
// plane. Each pattern runs with the path suspicion on (every exchange completes, the one caught by
// the failure within a few round trips) and off (the same failure exhausts a QP's retries: the
// test can tell the mechanism is there).

enum class Pattern { kPingPong, kRead, kAtomic, kOneWayAcksLost, kPlaneDown };

struct PatternRun {
  bool all_done = false;       // every exchange completed, no message failed
  Time clean_exchange{0};      // mean exchange time before the failure
  Time worst_after{0};         // longest exchange from the failure on
  uint64_t suspected = 0;      // paths suspected by both engines
};

// Drives the net until done() or a message fails; true if done.
bool run_until(Net& n, const std::function<bool()>& done, Time limit) {
  while (n.now < limit) {
    if (done()) return true;
    if (!n.node[0].host->failed.empty() || !n.node[1].host->failed.empty()) return false;
    if (!n.step()) break;
  }
  return done();
}

PatternRun run_pattern(Pattern pat, bool suspect) {
  EngineConfig cfg = Net::config(8);
  if (pat == Pattern::kPlaneDown) cfg.num_planes = 2;
  cfg.suspect_silent_paths = suspect;
  // A resend's redundant copy (congestion.md §5.2) also goes round a dead path: the control run
  // without suspicion goes without it too.
  cfg.tail_redundancy = suspect;
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  Net n(nc, {cfg});
  FakeHost& responder = *n.node[1].host;
  // The responder answers READs and atomics from inside deliver(), as the NIC does.
  uint32_t resp_msn = 0;
  responder.verdict = [&](const Segment& seg) {
    if (seg.op == Op::kReadReq) n.submit(1, 0, 9, resp_msn++, seg.total_length, Op::kReadResp);
    if (seg.op == Op::kSend && seg.src_stream == 3) n.submit(1, 0, 9, resp_msn++, 8, Op::kReadResp);
    return Syndrome::kOk;
  };
  uint32_t msn = 0;
  // One exchange: what the application waits for before it issues the next.
  auto exchange = [&]() -> bool {
    const uint32_t m = msn++;
    const size_t acked0 = n.node[0].host->acked.size();
    switch (pat) {
      case Pattern::kPingPong:
      case Pattern::kPlaneDown: {
        const uint64_t a = n.submit(0, 1, 1, m, 2);
        if (!run_until(n, [&] { return n.node[0].host->acked.size() > acked0; }, n.now + 1s))
          return false;
        const size_t acked1 = n.node[1].host->acked.size();
        (void)a;
        n.submit(1, 0, 2, m, 2);
        return run_until(n, [&] { return n.node[1].host->acked.size() > acked1; }, n.now + 1s);
      }
      case Pattern::kRead:
      case Pattern::kAtomic: {
        const uint32_t want = resp_msn + 1;
        if (pat == Pattern::kRead) n.submit(0, 1, 3 + 1, m, 64, Op::kReadReq);
        else n.submit(0, 1, 3, m, 28, Op::kSend);
        // Complete when the whole response has arrived at the requester.
        return run_until(n, [&] {
          return resp_msn >= want && n.node[0].host->received.count({9, want - 1}) &&
                 n.node[1].host->acked.size() >= want;
        }, n.now + 1s);
      }
      case Pattern::kOneWayAcksLost:
        n.submit(0, 1, 5, m, 2);
        return run_until(n, [&] { return n.node[0].host->acked.size() > acked0; }, n.now + 1s);
    }
    return false;
  };
  PatternRun r;
  constexpr int kWarm = 20, kAfter = 100;
  const Time t0 = n.now;
  for (int i = 0; i < kWarm; ++i) {
    if (!exchange()) return r;
  }
  r.clean_exchange = (n.now - t0) / kWarm;
  // The failure: the core link of path 3 black-holed both ways (the ACKs only, for one-way
  // traffic), or every packet of plane 1.
  const int bad = link_of(path_stats(*n.node[0].e, n.node[1].ip)[3].udp_src_port);
  n.drop = [&](const NetPacket& p) {
    switch (pat) {
      case Pattern::kPlaneDown: return p.plane == 1;
      case Pattern::kOneWayAcksLost:
        return p.from == 1 && p.pkt.base.opcode == Opcode::kAck && link_of(p.sport) == bad;
      default: return link_of(p.sport) == bad;
    }
  };
  for (int i = 0; i < kAfter; ++i) {
    const Time start = n.now;
    if (!exchange()) return r;
    r.worst_after = std::max(r.worst_after, n.now - start);
  }
  r.all_done = n.node[0].host->failed.empty() && n.node[1].host->failed.empty();
  r.suspected = n.node[0].e->stats().paths_suspected + n.node[1].e->stats().paths_suspected;
  return r;
}

class FailurePattern : public ::testing::TestWithParam<Pattern> {};

TEST_P(FailurePattern, NoSingleDeadPathOrPlaneExhaustsTheRetriesAndRecoveryTakesRoundTrips) {
  const PatternRun on = run_pattern(GetParam(), true);
  ASSERT_TRUE(on.all_done);
  EXPECT_GT(on.suspected, 0u);
  std::printf("clean exchange %.1f us, worst after the failure %.1f us (%.1fx)\n",
              on.clean_exchange.count() / 1e3, on.worst_after.count() / 1e3,
              static_cast<double>(on.worst_after.count()) / on.clean_exchange.count());
  // A tail probe (two RTTs) and one more round trip, not a retransmission timer (rto_min is
  // 20 RTTs here).
  EXPECT_LE(on.worst_after, 4 * on.clean_exchange);
  // The same failure without path suspicion (nor redundant copies): resent on the dead path
  // until the retries run out.
  const PatternRun off = run_pattern(GetParam(), false);
  EXPECT_FALSE(off.all_done);
}

INSTANTIATE_TEST_SUITE_P(
    Transport, FailurePattern,
    ::testing::Values(Pattern::kPingPong, Pattern::kRead, Pattern::kAtomic,
                      Pattern::kOneWayAcksLost, Pattern::kPlaneDown),
    [](const ::testing::TestParamInfo<Pattern>& i) {
      switch (i.param) {
        case Pattern::kPingPong: return "OnePacketPingPong";
        case Pattern::kRead: return "ReadResponses";
        case Pattern::kAtomic: return "Atomics";
        case Pattern::kOneWayAcksLost: return "OneWayTrafficWhoseAcksDie";
        case Pattern::kPlaneDown: return "WholePlaneDown";
      }
      return "?";
    });

TEST(PathFailure, PingPongAtTenPercentLossWithNoisyDelaysNeverRunsOutOfRetries) {
  // 64 KiB ping-pong, 10 % loss of every packet both ways, a third of the packets up to 5 ms
  // late (descheduled processes on a loaded host: smoothed RTTs of milliseconds, RTOs of tens),
  // the QP limits of ibv_rc_pingpong (retry_cnt 7, timeout 14 = 67 ms). A packet may time out
  // many times while the peer answers for the others: that must not fail the QP.
  for (uint64_t seed : {1, 2, 3}) {
    Net::Config nc;
    nc.bottleneck_mbps = 0;
    Net n(nc, {Net::config(8)});
    n.retry_cnt = 7;
    n.timeout = Time(int64_t{4096} << 14);
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    n.drop = [&](const NetPacket&) { return u(rng) < 0.10; };
    n.extra_delay = [&](const NetPacket&) {
      return u(rng) < 0.3 ? Time(static_cast<int64_t>(u(rng) * 5e6)) : Time{0};
    };
    uint32_t msn = 0;
    int done = 0;
    for (int i = 0; i < 300; ++i, ++msn) {
      const size_t a0 = n.node[0].host->acked.size();
      n.submit(0, 1, 1, msn, 64 * 1024);
      if (!run_until(n, [&] { return n.node[0].host->acked.size() > a0; }, n.now + 10s)) break;
      const size_t a1 = n.node[1].host->acked.size();
      n.submit(1, 0, 2, msn, 64 * 1024);
      if (!run_until(n, [&] { return n.node[1].host->acked.size() > a1; }, n.now + 10s)) break;
      ++done;
    }
    EXPECT_EQ(done, 300) << "seed " << seed;
    EXPECT_TRUE(n.node[0].host->failed.empty()) << "seed " << seed;
    EXPECT_TRUE(n.node[1].host->failed.empty()) << "seed " << seed;
    const auto& s0 = n.node[0].e->stats();
    std::printf("seed %llu: %d exchanges in %.1f ms, timeouts %llu, suspected %llu, tail probes %llu\n",
                static_cast<unsigned long long>(seed), done, n.now.count() / 1e6,
                static_cast<unsigned long long>(s0.timeouts),
                static_cast<unsigned long long>(s0.paths_suspected),
                static_cast<unsigned long long>(s0.tail_probes));
  }
}

TEST(PathFailure, TheTailProbeIsWhatRecoversALostLastPacketInRoundTrips) {
  // With the probe off, the same tail loss waits for the retransmission timer.
  for (bool tlp : {true, false}) {
    EngineConfig cfg = Fabric::default_config();
    cfg.tail_loss_probe = tlp;
    Fabric f(cfg);
    f.submit(0, 1, 0, 2 * kMtu);
    f.run();  // RTT samples
    const Time start = f.now;
    f.submit(0, 1, 0, 8 * kMtu);
    int dropped = 0;
    f.fate = drop_data_at(7 * kMtu, &dropped);
    f.run();
    ASSERT_EQ(dropped, 1);
    ASSERT_EQ(f.node[0].host.acked.size(), 2u);
    const Time rtt = 2 * f.delay;
    if (tlp) EXPECT_LE(f.now - start, 4 * rtt);
    else EXPECT_GE(f.now - start, f.cfg.rto_min);
  }
}

TEST(PathFailure, AReceiverWhoseStreamIsGoneStillAcknowledgesWhatItAccepted) {
  // The last acknowledgement (congestion.md §4.6): the receiver accepted the message, its ACK
  // was lost, and then the stream went away (QP destroyed). The sender's resend must still be
  // acknowledged so that its message completes instead of running out of retries.
  Fabric f;
  f.submit(0, 1, 0, 100);
  f.run();  // RTT samples
  const uint64_t last = f.submit(0, 1, 0, 100);
  bool ack_lost = false;
  f.fate = [&](const Sent& s) {
    if (!ack_lost && s.from == 1 && s.pkt.base.opcode == Opcode::kAck) {
      ack_lost = true;
      f.node[1].host.verdict = [](const Segment&) { return Syndrome::kUnreachable; };
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
  f.run(1s);
  ASSERT_TRUE(ack_lost);
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_EQ(f.node[0].host.acked.back(), last);
  EXPECT_EQ(f.node[1].host.deliveries.size(), 1u);  // {stream 0, msn 0, offset 0}, twice sent
  EXPECT_GT(f.node[1].e->stats().duplicates + f.node[1].e->stats().failover_duplicates, 0u);
}

TEST(PathFailure, LastAnsweredTracksAcceptedDataOnly) {
  // What a closing NIC lingers on (§4.6): data it accepted (or had accepted), not packets for
  // streams it does not have, which nobody waits on.
  Fabric f;
  EXPECT_EQ(f.node[1].e->last_answered(), Time::min());
  f.submit(0, 1, 0, 100);
  f.run();
  const Time accepted = f.node[1].e->last_answered();
  EXPECT_GT(accepted, Time{0});
  EXPECT_LE(accepted, f.now);
  f.node[1].host.verdict = [](const Segment&) { return Syndrome::kUnreachable; };
  f.submit(0, 2, 0, 100);
  f.run(f.now + 5ms);
  EXPECT_GT(f.node[1].e->stats().drop_unreachable, 0u);
  EXPECT_EQ(f.node[1].e->last_answered(), accepted);
}

// A WRITE of `length` bytes (each `fill`) from node 0's stream 1 to node 1's stream 1001 with
// its QP's retry limits (retry_cnt 7, `timeout`), under a cookie apart from Fabric::submit's.
constexpr uint64_t kQpLimitsCookie = uint64_t{1} << 40;
void submit_with_qp_limits(Fabric& f, uint32_t length, uint8_t fill, Time timeout) {
  MessageDesc m;
  m.peer_ip = kIpB;
  m.dst_stream = 1001;
  m.src_stream = 1;
  m.op = Op::kWrite;
  m.length = length;
  m.cookie = kQpLimitsCookie;
  m.retry_cnt = 7;
  m.timeout = timeout;
  f.node[0].host.outgoing[m.cookie] = std::vector<uint8_t>(length, fill);
  f.node[0].e->submit(m);
}

// Steps the fabric until node 0 has a failed message; when that was (Time::max(): not by limit).
Time step_until_node0_fails(Fabric& f, Time limit) {
  while (f.now < limit && f.step())
    if (!f.node[0].host.failed.empty()) return f.now;
  return Time::max();
}

TEST(PathFailure, AStreamThatIsGoneFailsAfterItsTimeoutWhileTheConnectionLives) {
  // One connection, two streams (QPs of two processes): stream 1's QP at the receiver is gone,
  // stream 2 keeps the connection busy and answered. Stream 1's message must fail with
  // RETRY_EXC after its QP's timeout x (retry_cnt + 1), not hang (the peer is not silent) and
  // not fail at once (a straggler to a QP that just went away is normal); its resends back off.
  Fabric f;
  f.submit(0, 2, 0, 4096);
  f.run();
  f.node[1].host.verdict = [](const Segment& s) {
    return s.src_stream == 1 ? Syndrome::kUnreachable : Syndrome::kOk;
  };
  const Time start = f.now;
  submit_with_qp_limits(f, 8 * kMtu, 1, 2ms);
  uint32_t msn = 1;
  Time failed_at = Time::max();
  while (f.now < start + 200ms && failed_at == Time::max()) {
    if (f.node[0].host.acked.size() + 2 > msn) f.submit(0, 2, msn++, 4096);  // stream 2 stays busy
    if (!f.step()) break;
    for (auto& [cookie, why] : f.node[0].host.failed)
      if (cookie == kQpLimitsCookie) {
        EXPECT_EQ(why, Syndrome::kRetryExceeded);
        failed_at = f.now;
      }
  }
  ASSERT_NE(failed_at, Time::max()) << "a message to a stream that is gone never failed";
  EXPECT_GE(failed_at - start, 16ms);  // 2 ms x (7 + 1)
  EXPECT_LE(failed_at - start, 40ms);
  size_t stream1_packets = 0;
  for (const Sent* s : f.data_from(0)) stream1_packets += s->pkt.data.src_stream == 1;
  // 8 packets, resent with back-off: far from the thousands of a 1 ms RNR rhythm or a resend
  // per SACK gap.
  EXPECT_LE(stream1_packets, 8u * 16);
  EXPECT_GT(msn, 20u) << "stream 2 did not progress meanwhile";
  EXPECT_GT(f.node[1].e->stats().drop_unreachable, 0u);
}

TEST(PathFailure, APacketIsResentBeforeItsQpGivesUpEvenIfTheTimersRanLate) {
  // The engine's owner did not run the timers for longer than the QP's timeout x (retry_cnt + 1)
  // (a host that kept the engine off the CPU; the engine's stall guard holding them): the peer
  // was not silent, nobody asked it again. The lost packet must be resent and its message
  // complete, not fail with RETRY_EXC at the first expiry with no retransmission at all (what a
  // loaded host's failover test met: 742 ms of "silence", 0 retries).
  Fabric f;
  f.submit(0, 2, 0, 100);
  f.run();  // RTT samples
  bool dropped = false;
  f.fate = [&](const Sent& s) {
    if (dropped || s.from != 0 || !wire::is_data_opcode(s.pkt.base.opcode)) return Fate::kDeliver;
    dropped = true;
    return Fate::kDrop;
  };
  f.timers_held_until = f.now + 20ms;  // more than 2 ms x (7 + 1)
  submit_with_qp_limits(f, 100, 3, 2ms);
  f.run(f.now + 1s);
  ASSERT_TRUE(dropped);
  EXPECT_TRUE(f.node[0].host.failed.empty()) << "failed without a resend";
  ASSERT_EQ(f.node[0].host.acked.size(), 2u);
  EXPECT_EQ(f.node[0].host.acked.back(), kQpLimitsCookie);
  EXPECT_GE(f.node[0].e->stats().timeouts, 1u);
}

// Runs f through a stall of node 0's engine from..to (its timers held), told of it or not, and
// 2 s beyond: told, nothing fails; not told (the control), the QP's message fails RETRY_EXC.
void through_stall(Fabric& f, Time from, Time to, bool told) {
  f.timers_held_until = to;
  if (told) f.node[0].e->stalled(from, to);
  f.run(f.now + 2s);
  if (told) {
    EXPECT_TRUE(f.node[0].host.failed.empty());
    return;
  }
  ASSERT_EQ(f.node[0].host.failed.size(), 1u) << "the control no longer fails";
  EXPECT_EQ(f.node[0].host.failed[0].second, Syndrome::kRetryExceeded);
}

TEST(PathFailure, AStallOfTheWholeHostIsNotThePeersSilence) {
  // Both engines off the CPU for 600 ms (a loaded host or a paused VM) with a WRITE in flight,
  // its QP's limits those of ibv_rc_pingpong (timeout 14 = 67 ms, retry_cnt 7: 537 ms of
  // silence), and the peer slow to answer once back (3 ms: its own backlog first). The sender's
  // first expiry after the stall resends; the next, a back-off later, came after 537 ms of
  // wall-clock silence, so it failed the QP (what realnet's pp_dpdk in CI may have met:
  // RETRY_EXC on both sides of a ping-pong between two live engines). Told of its stall, the sender counts the silence
  // from the end of it and the WRITE completes. Not told (the control), it fails as before.
  const Time timeout(int64_t{4096} << 14);
  for (bool told : {true, false}) {
    Fabric f;
    f.submit(0, 2, 0, 100);
    f.run();  // RTT samples
    const Time stall_from = f.now, stall_to = f.now + 600ms;
    f.extra_delay = [&](const Sent& s) {
      // Node 1 reads nothing that node 0 sent until 3 ms after the stall.
      return s.from == 0 && f.now < stall_to + 3ms ? stall_to + 3ms - f.now : Time{0};
    };
    submit_with_qp_limits(f, 100, 4, timeout);
    through_stall(f, stall_from, stall_to, told);
    if (!told) continue;
    ASSERT_EQ(f.node[0].host.acked.size(), 2u);
    EXPECT_EQ(f.node[0].host.acked.back(), kQpLimitsCookie);
    EXPECT_GE(f.node[0].e->stats().timeouts, 1u);
  }
  // A stall tells nothing about a peer that is really gone: it still fails, its silence
  // counted from the end of the stall (no sooner than `timeout` after it, as TheQpsTimeout-
  // BoundsWhenRetriesRunOut, where untold it fails within milliseconds of the stall's end).
  Fabric f;
  f.submit(0, 2, 0, 100);
  f.run();
  const Time stall_to = f.now + 600ms;
  f.fate = [](const Sent& s) { return s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
  f.timers_held_until = stall_to;
  submit_with_qp_limits(f, 100, 5, timeout);
  f.node[0].e->stalled(f.now, stall_to);
  const Time failed_at = step_until_node0_fails(f, stall_to + 2s);
  ASSERT_NE(failed_at, Time::max());
  EXPECT_EQ(f.node[0].host.failed[0].second, Syndrome::kRetryExceeded);
  EXPECT_GE(failed_at, stall_to + timeout);
  EXPECT_LE(failed_at, stall_to + timeout * 8 + f.cfg.rto_max);
}

TEST(PathFailure, AStreamThatAppearsLateStillGetsItsMessage) {
  // A sender a little ahead of its peer's QP (it exists a few milliseconds later): the message
  // waits out the unreachable answers and completes.
  Fabric f;
  bool exists = false;
  f.node[1].host.verdict = [&](const Segment&) { return exists ? Syndrome::kOk : Syndrome::kUnreachable; };
  submit_with_qp_limits(f, 3 * kMtu, 2, 5ms);
  f.run(f.now + 4ms);
  EXPECT_TRUE(f.node[0].host.acked.empty());
  exists = true;
  f.run(f.now + 100ms);
  ASSERT_EQ(f.node[0].host.acked.size(), 1u);
  EXPECT_TRUE(f.node[0].host.failed.empty());
}

TEST(PathFailure, AStallOfTheWholeHostIsNotTimeAStreamWasUnreachable) {
  // A message parked because its stream did not exist yet at the receiver (W§6.4), then both
  // engines off the CPU for 600 ms, longer than the QP's timeout x (retry_cnt + 1) = 537 ms; the
  // stream exists by then. Told of its stall, the sender resends after it and the message
  // completes; not told (the control), the first pass after the stall gives it up unasked.
  const Time timeout(int64_t{4096} << 14);
  for (bool told : {true, false}) {
    Fabric f;
    bool exists = false;
    f.node[1].host.verdict = [&](const Segment&) {
      return exists ? Syndrome::kOk : Syndrome::kUnreachable;
    };
    submit_with_qp_limits(f, 100, 5, timeout);
    f.run(f.now + 4ms);
    ASSERT_TRUE(f.node[0].host.acked.empty());
    // To the next refusal: the message is parked when the stall begins.
    const uint64_t naks = f.node[0].e->stats().naks_received;
    while (f.node[0].e->stats().naks_received == naks) ASSERT_TRUE(f.step());
    exists = true;
    through_stall(f, f.now, f.now + 600ms, told);
    if (told) {
      EXPECT_EQ(f.node[0].host.acked.size(), 1u);
    }
  }
}

TEST(PathFailure, TheQpsTimeoutBoundsWhenRetriesRunOut) {
  // retry_cnt 7, timeout 1 ms: the error comes no sooner than 1 ms after the message left (a
  // peer descheduled for less must not fail it) and no later than 8 ms.
  EngineConfig cfg = Fabric::default_config();
  cfg.rto_initial = 100us;
  cfg.rto_min = 20us;
  for (Time timeout : {Time(1ms), Time(40ms)}) {
    Fabric f(cfg);
    f.fate = [](const Sent& s) { return s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
    submit_with_qp_limits(f, 0, 0, timeout);
    const Time failed_at = step_until_node0_fails(f, 1s);
    ASSERT_NE(failed_at, Time::max());
    EXPECT_EQ(f.node[0].host.failed[0].second, Syndrome::kRetryExceeded);
    EXPECT_GE(failed_at, timeout);
    EXPECT_LE(failed_at, timeout * 8 + cfg.rto_max);
  }
}

TEST(PathFailure, APeerSilentForLessThanTimeoutTimesRetriesPlusOneIsNotGivenUpOn) {
  // retry_cnt 7, timeout 10 ms, RTOs of 0.1 ms and up: the packet times out 7 times well
  // within 50 ms. A peer silent for 50 ms (its engine off the CPU on a starved host, say) is
  // still within what an InfiniBand requester waits, 8 x 10 ms: the message completes once it
  // answers. Giving up at the 7th expiry once one timeout had passed failed it at 25.5 ms.
  EngineConfig cfg = Fabric::default_config();
  cfg.rto_initial = 100us;
  cfg.rto_min = 20us;
  Fabric f(cfg);
  bool silent = true;
  f.fate = [&](const Sent& s) { return silent && s.from == 1 ? Fate::kDrop : Fate::kDeliver; };
  submit_with_qp_limits(f, kMtu, 3, 10ms);
  EXPECT_EQ(step_until_node0_fails(f, f.now + 50ms), Time::max());
  EXPECT_GE(f.node[0].e->stats().timeouts, 7u);
  silent = false;
  f.run(f.now + 1s);
  ASSERT_EQ(f.node[0].host.acked.size(), 1u);
  EXPECT_TRUE(f.node[0].host.failed.empty());
}

// ---------------------------------------------------------------------------------------------
// RNR

TEST(Rnr, ARefusedPacketIsResentAfterTheBackOffAndNotCountedAsLoss) {
  EngineConfig cfg = Fabric::default_config();
  cfg.rnr_delay = 300us;
  cfg.max_retries = 1;  // an RNR counted as a timeout retry would fail the message
  Fabric f(cfg);
  int refusals = 0;
  f.node[1].host.verdict = [&](const Segment& s) {
    if (s.offset == 0 && refusals < 5) {
      ++refusals;
      return Syndrome::kRnr;
    }
    return Syndrome::kOk;
  };
  const uint64_t c = f.submit(0, 1, 0, 4 * kMtu);
  f.run();
  EXPECT_EQ(refusals, 5);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{c});
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_EQ(f.node[0].e->stats().rnr_naks_received, 5u);
  EXPECT_EQ(f.node[1].e->stats().rnr_naks_sent, 5u);
  // Each resend of the refused packet left at least rnr_delay after the NAK that refused it.
  auto tx = transmissions_of(f, 0);
  ASSERT_EQ(tx.size(), 6u);
  for (size_t i = 1; i < tx.size(); ++i) {
    EXPECT_GE(tx[i]->tx_time - tx[i - 1]->tx_time, cfg.rnr_delay + 2 * f.delay) << i;
    EXPECT_LT(tx[i]->tx_time - tx[i - 1]->tx_time, cfg.rnr_delay + cfg.rto_min) << i;
  }
}

// A message larger than the connection's window whose every packet is refused until the
// receive is posted (a SEND that arrives first, as a ring all-reduce's does): it completes once
// the receive is there (found by bench/ring_allreduce, which hung with 8 MiB SENDs).
TEST(Rnr, AMessageLargerThanTheWindowRefusedWholeCompletesOnceTheReceiveIsPosted) {
  Fabric f;
  const Time posted = f.now + 5ms;
  uint64_t refusals = 0;
  f.node[1].host.verdict = [&](const Segment&) {
    if (f.now < posted) {
      ++refusals;
      return Syndrome::kRnr;
    }
    return Syndrome::kOk;
  };
  const uint64_t c = f.submit(0, 1, 1, 2048 * kMtu);
  f.run(f.now + 2s);
  EXPECT_GT(refusals, 0u);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{c});
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_EQ(f.node[1].host.received.at({1, 1}), sent_bytes(f, 0, c));
  // Refused packets waited: none of them made a path look dead.
  EXPECT_EQ(f.node[0].e->stats().paths_failed, 0u);
}

TEST(Rnr, RetriesAreBoundedByRnrRetryAndSevenMeansForever) {
  for (uint8_t limit : {0, 3, 7}) {
    EngineConfig cfg = Fabric::default_config();
    cfg.rnr_delay = 50us;
    cfg.rnr_retry = limit;
    Fabric f(cfg);
    int refusals = 0;
    f.node[1].host.verdict = [&](const Segment& s) {
      if (s.offset == kMtu && refusals < 20) {
        ++refusals;
        return Syndrome::kRnr;
      }
      return Syndrome::kOk;
    };
    const uint64_t c = f.submit(0, 1, 0, 3 * kMtu);
    f.run();
    if (limit == 7) {
      EXPECT_EQ(refusals, 20);
      EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{c});
      EXPECT_TRUE(f.node[0].host.failed.empty());
    } else {
      EXPECT_EQ(refusals, limit + 1) << int{limit};
      ASSERT_EQ(f.node[0].host.failed.size(), 1u) << int{limit};
      EXPECT_EQ(f.node[0].host.failed[0].second, Syndrome::kRnr);
      EXPECT_TRUE(f.node[0].host.acked.empty());
    }
    EXPECT_TRUE(f.node[0].e->idle());
  }
}

TEST(Rnr, TheQpsRnrRetryDecidesNotTheEngines) {
  // Each message carries its QP's rnr_retry: 2 fails after three refusals where the engine
  // would retry for ever, 7 retries for ever where the engine would give up at once.
  for (auto [engine, qp] : {std::pair<uint8_t, uint8_t>{7, 2}, {0, 7}}) {
    EngineConfig cfg = Fabric::default_config();
    cfg.rnr_delay = 50us;
    cfg.rnr_retry = engine;
    Fabric f(cfg);
    f.rnr_retry = qp;
    int refusals = 0;
    f.node[1].host.verdict = [&](const Segment&) {
      if (refusals >= 12) return Syndrome::kOk;
      ++refusals;
      return Syndrome::kRnr;
    };
    const uint64_t c = f.submit(0, 1, 0, 100);
    f.run();
    if (qp == 7) {
      EXPECT_EQ(refusals, 12);
      EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{c});
    } else {
      EXPECT_EQ(refusals, qp + 1);
      ASSERT_EQ(f.node[0].host.failed.size(), 1u);
      EXPECT_EQ(f.node[0].host.failed[0].second, Syndrome::kRnr);
    }
    EXPECT_TRUE(f.node[0].e->idle());
  }
}

TEST(Rnr, TheSenderWaitsTheTimerTheRefusingQpNamesInItsNak) {
  // Stream 1000 refuses with min_rnr_timer 16 (2.56 ms), stream 1001 with 1 (10 us); the
  // engine's own back-off (300 us) is neither. Each sender's resend waits its responder's time.
  EngineConfig cfg = Fabric::default_config();
  cfg.rnr_delay = 300us;
  Fabric f(cfg);
  f.node[1].host.rnr_timers = {{1000, 16}, {1001, 1}};
  std::map<uint32_t, int> refusals;
  f.node[1].host.verdict = [&](const Segment& s) {
    if (refusals[s.dst_stream] >= 3) return Syndrome::kOk;
    ++refusals[s.dst_stream];
    return Syndrome::kRnr;
  };
  f.submit(0, 0, 0, 100);
  f.submit(0, 1, 0, 100);
  f.run();
  ASSERT_EQ(f.node[0].host.acked.size(), 2u);
  std::map<uint32_t, std::vector<Time>> sent;  // by stream: when each copy left
  for (const Sent* t : transmissions_of(f, 0)) sent[t->pkt.data.src_stream].push_back(t->tx_time);
  ASSERT_EQ(sent[0].size(), 4u);
  ASSERT_EQ(sent[1].size(), 4u);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_GE(sent[0][i] - sent[0][i - 1], 2560us) << i;
    EXPECT_LT(sent[0][i] - sent[0][i - 1], 2560us + cfg.rto_min) << i;
    EXPECT_LT(sent[1][i] - sent[1][i - 1], cfg.rnr_delay) << i;
  }
}

TEST(Rnr, VerbsTimerCodesMapToInfiniBandsTable) {
  EXPECT_EQ(rnr_timer_delay(0), 655360us);
  EXPECT_EQ(rnr_timer_delay(1), 10us);
  EXPECT_EQ(rnr_timer_delay(12), 640us);
  EXPECT_EQ(rnr_timer_delay(31), 491520us);
}

// ---------------------------------------------------------------------------------------------
// Packets crafted by hand into one engine.

class Crafted : public ::testing::Test {
 protected:
  Crafted() { e = Engine::create(Fabric::default_config(), host); }

  std::vector<uint8_t> data(uint32_t conn, uint64_t token, uint32_t seq, uint32_t floor = 0,
                            uint32_t len = 8) {
    wire::BaseHeader b;
    b.opcode = Opcode::kWrite;
    b.conn_id = conn;
    b.token = token;
    b.path_id = 0;
    b.path_count = 4;
    b.path_seq = seq;
    b.ack_floor = floor;
    wire::DataHeader d;
    d.src_stream = 1;
    d.msn = seq;
    d.total_length = len;
    d.payload_len = len;
    std::vector<uint8_t> buf(wire::kDataHeadersLen + len);
    wire::encode_data(buf, b, d);
    return buf;
  }
  std::vector<uint8_t> ack(uint32_t conn, uint64_t token) {
    wire::BaseHeader b;
    b.opcode = Opcode::kAck;
    b.conn_id = conn;
    b.token = token;
    b.path_count = 4;
    std::vector<uint8_t> buf(wire::kAckHeadersLen);
    wire::encode_ack(buf, b, wire::AckHeader{}, {});
    return buf;
  }
  void feed(const std::vector<uint8_t>& p) { e->on_packet(Time{1000}, kIpA, 50000, false, p); }
  uint64_t drops(wire::DecodeError r) { return decode_drops(*e)[static_cast<size_t>(r)]; }

  FakeHost host;
  std::unique_ptr<Engine> e;
};

TEST_F(Crafted, MalformedPacketsAreDroppedAndCountedByReason) {
  auto good = data(77, 99, 0);
  feed(std::vector<uint8_t>(good.begin(), good.begin() + 20));
  EXPECT_EQ(drops(wire::DecodeError::kTruncated), 1u);
  auto bad = good;
  bad[0] = 2;
  feed(bad);
  EXPECT_EQ(e->stats().drop_version, 1u);
  bad = good;
  bad[1] = 10;  // the first unassigned opcode after the data ones
  feed(bad);
  EXPECT_EQ(drops(wire::DecodeError::kBadOpcode), 1u);
  bad = good;
  bad.push_back(0);
  feed(bad);
  EXPECT_EQ(drops(wire::DecodeError::kLengthMismatch), 1u);
  bad = good;
  bad[19] = 9;  // path_count 9 is fine, but...
  bad[17] = 9;  // ...path_id 9 is not below it
  feed(bad);
  EXPECT_EQ(drops(wire::DecodeError::kBadField), 1u);
  EXPECT_EQ(e->stats().drop_malformed, 4u);
  EXPECT_EQ(host.deliver_calls, 0);
  EXPECT_TRUE(e->idle());
}

TEST_F(Crafted, WrongTokenUnknownConnAndOutOfWindowAreDroppedAndCounted) {
  feed(data(77, 99, 0));  // 0-RTT: creates the direction
  EXPECT_EQ(host.deliver_calls, 1);
  feed(data(77, 98, 1));  // same direction, wrong token
  EXPECT_EQ(e->stats().drop_token, 1u);
  feed(data(77, 99, 1 + 257));  // beyond cum + 256
  EXPECT_EQ(e->stats().drop_out_of_window, 1u);
  feed(data(77, 99, 0));  // duplicate
  EXPECT_EQ(e->stats().duplicates, 1u);
  EXPECT_EQ(host.deliver_calls, 1);
  // Once the sender's floor has moved, the same sequence is inside the window.
  feed(data(77, 99, 1 + 257, 100));
  EXPECT_EQ(host.deliver_calls, 2);

  auto* impl = dynamic_cast<EngineImpl*>(e.get());
  ASSERT_NE(impl, nullptr);
  const uint32_t ours = impl->conn_id(kIpA);  // the connection exists since the first packet
  ASSERT_NE(ours, 0u);
  feed(ack(ours + 1, 5));
  EXPECT_EQ(e->stats().drop_unknown_conn, 1u);
  feed(ack(ours, 5));
  EXPECT_EQ(e->stats().drop_token, 2u);
  EXPECT_EQ(e->stats().acks_received, 0u);

  wire::BaseHeader probe;
  probe.opcode = Opcode::kProbe;
  probe.conn_id = 12345;
  probe.token = 99;
  probe.path_count = 4;
  std::vector<uint8_t> p(wire::kBaseHeaderLen);
  wire::encode_base(p, probe);
  feed(p);
  EXPECT_EQ(e->stats().drop_unknown_conn, 2u);
  EXPECT_EQ(host.deliver_calls, 2);
}

TEST_F(Crafted, AProbeElicitsAnAckThatEchoesItsTimestamp) {
  feed(data(77, 99, 0));
  struct Capture : TxSink {
    std::vector<uint8_t> buf;
    std::vector<std::vector<uint8_t>> out;
    std::span<uint8_t> begin(uint32_t n, uint8_t) override { buf.assign(n, 0); return buf; }
    void commit(uint32_t, uint16_t, uint8_t, uint32_t len) override {
      out.emplace_back(buf.begin(), buf.begin() + len);
    }
  } sink;
  EXPECT_EQ(e->poll_tx(Time{2000}, sink), 1u);  // the ACK for the data packet
  wire::BaseHeader probe;
  probe.opcode = Opcode::kProbe;
  probe.conn_id = 77;
  probe.token = 99;
  probe.path_count = 4;
  probe.path_seq = 1;
  probe.timestamp = 4242;
  std::vector<uint8_t> p(wire::kBaseHeaderLen);
  wire::encode_base(p, probe);
  feed(p);
  EXPECT_EQ(e->poll_tx(Time{3000}, sink), 1u);
  wire::Packet a;
  ASSERT_EQ(wire::decode(sink.out.back(), a), wire::DecodeError::kNone);
  EXPECT_EQ(a.base.opcode, Opcode::kAck);
  EXPECT_EQ(a.base.conn_id, 77u);
  EXPECT_EQ(a.base.token, 99u);
  EXPECT_EQ(a.ack.cum_seq, 1u);
  EXPECT_EQ(a.ack.echo_timestamp, 4242u);
  EXPECT_TRUE(e->idle());
}

// ---------------------------------------------------------------------------------------------
// Lanes and planes (wire.md §3.4, congestion.md §4.7)

EngineConfig four_planes() {
  EngineConfig c = Fabric::default_config();
  c.num_planes = 4;
  return c;
}

uint64_t submit_lane(Fabric& f, int from, uint32_t stream, uint32_t msn, uint32_t size,
                     uint32_t lane) {
  static uint64_t next = 1000000;  // apart from Fabric::submit's cookies
  const uint64_t cookie = next++;
  std::vector<uint8_t> bytes(size, static_cast<uint8_t>(msn));
  f.node[from].host.outgoing[cookie] = bytes;
  MessageDesc m;
  m.peer_ip = f.node[1 - from].ip;
  m.dst_stream = stream + 1000;
  m.src_stream = stream;
  m.msn = msn;
  m.op = Op::kWrite;
  m.length = size;
  m.rkey = 7;
  m.cookie = cookie;
  m.lane = lane;
  f.node[from].e->submit(m);
  return cookie;
}

TEST(Lanes, APlaneMaskKeepsEveryPacketOfTheLaneOnItsPlanesAndAcksComeBackThere) {
  Fabric f(four_planes());
  LaneProfile prof;
  prof.num_paths = 6;
  prof.plane_mask = 0b1010;  // planes 1 and 3
  ASSERT_TRUE(f.node[0].e->set_lane(f.now, kIpB, 9, prof));
  for (uint32_t i = 0; i < 20; ++i) submit_lane(f, 0, 1, i, 3 * kMtu, 9);
  f.run();
  EXPECT_EQ(f.node[0].host.acked.size(), 20u);
  EXPECT_TRUE(f.node[0].host.failed.empty());
  std::set<uint8_t> data_planes, ack_planes;
  for (const Sent& s : f.log) {
    if (s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode)) data_planes.insert(s.plane);
    if (s.from == 1 && s.pkt.base.opcode == Opcode::kAck) ack_planes.insert(s.plane);
  }
  EXPECT_EQ(data_planes, (std::set<uint8_t>{1, 3}));
  EXPECT_EQ(ack_planes, (std::set<uint8_t>{1, 3}));  // where the data arrived
  const auto ps = path_stats(*f.node[0].e, kIpB, 9);
  ASSERT_EQ(ps.size(), 6u);
  for (const auto& p : ps) {
    EXPECT_EQ(p.plane, p.path_id % 2 ? 3 : 1) << p.path_id;
    EXPECT_GT(p.tx_packets, 0u) << p.path_id;
    EXPECT_GT(p.min_rtt_ns, 0) << p.path_id;
    EXPECT_LE(p.min_rtt_ns, p.srtt_ns + 1) << p.path_id;
  }
  const ConnStats cs = conn_stats(*f.node[0].e, kIpB, 9);
  EXPECT_TRUE(cs.exists);
  EXPECT_EQ(cs.num_paths, 6u);
  EXPECT_EQ(cs.plane_mask, 0b1010u);
  EXPECT_FALSE(conn_stats(*f.node[0].e, kIpB, 0).exists);  // lane 0 never used
}

TEST(Lanes, EachLaneIsAConnectionOfItsOwnAndBadProfilesAreRefused) {
  Fabric f(four_planes());
  EXPECT_FALSE(f.node[0].e->set_lane(f.now, kIpB, 0, {}));  // lane 0 is the engine's
  LaneProfile bad;
  bad.plane_mask = 1u << 4;  // a plane the device lacks
  EXPECT_FALSE(f.node[0].e->set_lane(f.now, kIpB, 3, bad));
  bad = {};
  bad.num_paths = 257;
  EXPECT_FALSE(f.node[0].e->set_lane(f.now, kIpB, 3, bad));
  EXPECT_FALSE(conn_stats(*f.node[0].e, kIpB, 3).exists);
  submit_lane(f, 0, 1, 0, 2 * kMtu, 0);
  submit_lane(f, 0, 2, 0, 2 * kMtu, 3);  // a lane never set: the engine's defaults
  f.run();
  expect_all_delivered_exactly(f, 0);
  const ConnStats c0 = conn_stats(*f.node[0].e, kIpB, 0), c3 = conn_stats(*f.node[0].e, kIpB, 3);
  ASSERT_TRUE(c0.exists && c3.exists);
  EXPECT_NE(c0.conn_id, c3.conn_id);
  EXPECT_EQ(c3.num_paths, f.cfg.num_paths);
  EXPECT_EQ(lanes(*f.node[0].e, kIpB), (std::vector<uint32_t>{0, 3}));
  std::set<uint32_t> ids;
  for (const Sent* s : f.data_from(0)) ids.insert(s->pkt.base.conn_id);
  EXPECT_EQ(ids, (std::set<uint32_t>{c0.conn_id, c3.conn_id}));
}

TEST(Lanes, PathsGrowAndShrinkMidTransferAndEveryByteArrivesOnce) {
  Fabric f(four_planes());
  LaneProfile prof;
  prof.num_paths = 2;
  ASSERT_TRUE(f.node[0].e->set_lane(f.now, kIpB, 5, prof));
  uint32_t msn = 0;
  for (; msn < 30; ++msn) submit_lane(f, 0, 1, msn, 4 * kMtu, 5);
  for (int i = 0; i < 20; ++i) f.step();  // packets in flight on both paths
  prof.num_paths = 12;
  ASSERT_TRUE(f.node[0].e->set_lane(f.now, kIpB, 5, prof));
  for (; msn < 60; ++msn) submit_lane(f, 0, 1, msn, 4 * kMtu, 5);
  for (int i = 0; i < 40; ++i) f.step();
  EXPECT_EQ(path_stats(*f.node[0].e, kIpB, 5).size(), 12u);
  prof.num_paths = 3;
  const size_t mark = f.log.size();
  ASSERT_TRUE(f.node[0].e->set_lane(f.now, kIpB, 5, prof));
  for (; msn < 90; ++msn) submit_lane(f, 0, 1, msn, 4 * kMtu, 5);
  f.run();
  EXPECT_EQ(f.node[0].host.acked.size(), 90u);
  EXPECT_TRUE(f.node[0].host.failed.empty());
  for (const auto& [seg, count] : f.node[1].host.deliveries) EXPECT_EQ(count, 1);
  EXPECT_EQ(f.node[1].e->stats().drop_malformed, 0u);
  EXPECT_EQ(f.node[0].e->stats().drop_malformed, 0u);
  // After the shrink, new data went on paths 0..2 only (copies of what was in flight included).
  for (size_t i = mark; i < f.log.size(); ++i) {
    const Sent& s = f.log[i];
    if (s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode)) {
      EXPECT_LT(s.pkt.base.path_id, 3);
    }
  }
  const auto ps = path_stats(*f.node[0].e, kIpB, 5);
  ASSERT_EQ(ps.size(), 3u);
  for (const auto& p : ps) EXPECT_EQ(p.failures, 0u) << "a retired path is not a failure";
}

TEST(Planes, APlaneSetDownCarriesNothingUntilItIsBackAndNothingFails) {
  Fabric f(four_planes());
  for (uint32_t i = 0; i < 10; ++i) f.submit(0, 1, i, 8 * kMtu);
  for (int i = 0; i < 15; ++i) f.step();  // packets on every plane in flight
  f.node[0].e->set_plane_up(f.now, 2, false);
  f.node[1].e->set_plane_up(f.now, 2, false);
  EXPECT_EQ(f.node[0].e->planes_up() & 0xf, 0b1011u);
  // What a down plane held is lost (the port is off).
  f.fate = [](const Sent& s) { return s.plane == 2 ? Fate::kDrop : Fate::kDeliver; };
  const size_t mark = f.log.size();
  for (uint32_t i = 10; i < 40; ++i) f.submit(0, 1, i, 8 * kMtu);
  f.run();
  expect_all_delivered_exactly(f, 0);
  for (size_t i = mark; i < f.log.size(); ++i)
    EXPECT_NE(f.log[i].plane, 2) << "packet " << i << " on the down plane";
  for (const auto& p : path_stats(*f.node[0].e, kIpB)) {
    if (p.plane == 2) {
      EXPECT_TRUE(p.plane_down) << p.path_id;
    }
    EXPECT_EQ(p.failures, 0u) << "a plane that is down is not a path failure";
  }
  // Back: probed, then in service again.
  f.fate = nullptr;
  f.node[0].e->set_plane_up(f.now, 2, true);
  f.node[1].e->set_plane_up(f.now, 2, true);
  const size_t mark2 = f.log.size();
  for (uint32_t i = 40; i < 80; ++i) f.submit(0, 1, i, 8 * kMtu);
  f.run();
  expect_all_delivered_exactly(f, 0);
  bool used = false;
  for (size_t i = mark2; i < f.log.size(); ++i)
    used |= f.log[i].from == 0 && f.log[i].plane == 2 && wire::is_data_opcode(f.log[i].pkt.base.opcode);
  EXPECT_TRUE(used);
  for (const auto& p : path_stats(*f.node[0].e, kIpB)) EXPECT_EQ(p.state, PathState::kActive);
}

TEST(Planes, WithEveryPlaneOfItsMaskDownALaneFailsAsOnADeadLinkInsteadOfHanging) {
  Fabric f(four_planes());
  LaneProfile prof;
  prof.plane_mask = 0b0001;
  ASSERT_TRUE(f.node[0].e->set_lane(f.now, kIpB, 4, prof));
  f.node[0].e->set_plane_up(f.now, 0, false);
  f.fate = [](const Sent& s) { return s.plane == 0 ? Fate::kDrop : Fate::kDeliver; };
  submit_lane(f, 0, 1, 0, kMtu, 4);
  f.run(60s);
  ASSERT_EQ(f.node[0].host.failed.size(), 1u);
  EXPECT_EQ(f.node[0].host.failed[0].second, Syndrome::kRetryExceeded);
}

// Found by tests/fuzz/transport_fuzz: with fewer paths than planes, a plane set down before the
// first message took every path of the lane out of service although another plane was up. The
// message was never sent, and once the plane came back the probes went to a receiver that had
// never seen the connection, which drops them: the message hung for ever.
TEST(Planes, ALaneWithNoPathOnAPlaneThatIsUpSendsAsOnADeadLinkInsteadOfHanging) {
  EngineConfig cfg = Fabric::default_config();
  cfg.num_paths = 1;  // path 0 on plane 0; plane 1 is up but carries no path of the lane
  Fabric f(cfg);
  f.node[0].e->set_plane_up(f.now, 0, false);
  f.submit(0, 1, 0, 0);
  f.node[0].e->set_plane_up(f.now, 0, true);
  f.run(10s);
  EXPECT_EQ(f.node[0].host.acked.size(), 1u);
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_TRUE(f.node[0].e->idle());

  // Down for good: the retries decide, as on a dead link, and the message fails.
  Fabric g(cfg);
  g.node[0].e->set_plane_up(g.now, 0, false);
  g.fate = [](const Sent& s) { return s.plane == 0 ? Fate::kDrop : Fate::kDeliver; };
  g.submit(0, 1, 0, kMtu);
  g.run(60s);
  ASSERT_EQ(g.node[0].host.failed.size(), 1u);
  EXPECT_EQ(g.node[0].host.failed[0].second, Syndrome::kRetryExceeded);
}

// Found by tests/fuzz/transport_fuzz: every path of a lane out of service (those of one plane
// because it was down, then probed unanswered; the others because their plane went down) before
// the receiver saw any data of the direction. The messages waited for an active path, the probes
// went to a receiver that drops probes of unknown directions (wire.md §2.5), and no timer ran for
// a packet not in flight: the message was neither sent nor failed, for ever. Now the lane's
// longest-failed usable path goes back in service unproven (congestion.md §4.7).
TEST(Planes, ALaneWithEveryPathOutOfServiceBeforeItsFirstAckDoesNotHang) {
  Fabric f;  // 4 paths on 2 planes
  f.node[0].e->set_plane_up(f.now, 1, false);
  f.submit(0, 1, 0, 2 * kMtu);
  QueueSink lost(100);  // the first packets, on plane 0, are lost
  ASSERT_EQ(f.node[0].e->poll_tx(f.now, lost), 2u);
  f.node[0].e->set_plane_up(f.now, 1, true);   // its paths are probed: unknown direction
  f.node[0].e->set_plane_up(f.now, 0, false);  // what was in flight moves to plane 1's paths
  f.run(10s);
  EXPECT_EQ(f.node[0].host.acked.size(), 1u);
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_TRUE(f.node[0].e->idle());
  EXPECT_EQ(f.node[0].e->stats().paths_reinstated, 1u);

  // The same with plane 1 dead for good: its retries decide, and the message fails.
  Fabric g;
  g.node[0].e->set_plane_up(g.now, 1, false);
  g.submit(0, 1, 0, 2 * kMtu);
  QueueSink lost_too(100);
  ASSERT_EQ(g.node[0].e->poll_tx(g.now, lost_too), 2u);
  g.fate = [](const Sent& s) { return s.plane == 1 && s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
  g.node[0].e->set_plane_up(g.now, 1, true);
  g.node[0].e->set_plane_up(g.now, 0, false);
  g.run(60s);
  ASSERT_EQ(g.node[0].host.failed.size(), 1u);
  EXPECT_EQ(g.node[0].host.failed[0].second, Syndrome::kRetryExceeded);
}

// Every plane down, then one back: the paths left in service on the planes still down (as on a
// dead link) leave it, their packets move to the plane that came back.
TEST(Planes, APlaneBackAfterEveryPlaneWasDownTakesTheTraffic) {
  Fabric f;  // 4 paths on 2 planes
  f.node[0].e->set_plane_up(f.now, 0, false);
  f.node[0].e->set_plane_up(f.now, 1, false);
  f.submit(0, 1, 0, 8 * kMtu);
  f.fate = [](const Sent& s) { return s.plane == 0 ? Fate::kDrop : Fate::kDeliver; };
  QueueSink lost(100);
  f.node[0].e->poll_tx(f.now, lost);
  f.node[0].e->set_plane_up(f.now, 1, true);
  f.run(10s);
  EXPECT_EQ(f.node[0].host.acked.size(), 1u);
  EXPECT_TRUE(f.node[0].host.failed.empty());
  EXPECT_TRUE(f.node[0].e->idle());
}

TEST(Lanes, AClosedLaneIsForgottenOnceIdleAndComesBackWhenUsed) {
  Fabric f(four_planes());
  LaneProfile prof;
  prof.num_paths = 3;
  ASSERT_TRUE(f.node[0].e->set_lane(f.now, kIpB, 0x80000005, prof));
  for (uint32_t i = 0; i < 5; ++i) submit_lane(f, 0, 1, i, 2 * kMtu, 0x80000005);
  f.node[0].e->close_lane(kIpB, 0x80000005);  // still in flight: kept
  f.node[0].e->on_timer(f.now);
  EXPECT_TRUE(conn_stats(*f.node[0].e, kIpB, 0x80000005).exists);
  f.run();
  EXPECT_EQ(f.node[0].host.acked.size(), 5u);
  f.node[0].e->on_timer(f.now);
  EXPECT_FALSE(conn_stats(*f.node[0].e, kIpB, 0x80000005).exists);
  EXPECT_TRUE(lanes(*f.node[0].e, kIpB).empty());
  submit_lane(f, 0, 1, 5, kMtu, 0x80000005);
  f.run();
  EXPECT_EQ(f.node[0].host.acked.size(), 6u);
  EXPECT_TRUE(conn_stats(*f.node[0].e, kIpB, 0x80000005).exists);
}

// What an off-path sender must guess to inject (wire.md §3.2): with secret_ids, a direction's
// conn_id and token come from getrandom, not from the seeded generator, whose every output
// (each peer sees its own connection's) gives away the others. Same seed, same traffic: equal
// names without it, different names with it.
TEST(Lanes, SecretIdsNameDirectionsUnpredictably) {
  auto names = [](bool secret) {
    EngineConfig cfg = Fabric::default_config();
    cfg.secret_ids = secret;
    Fabric f(cfg);
    f.submit(0, 1, 0, kMtu);
    f.run();
    EXPECT_EQ(f.node[0].host.acked.size(), 1u);
    for (const Sent& s : f.log) {
      if (s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode))
        return std::pair{s.pkt.base.conn_id, s.pkt.base.token};
    }
    return std::pair{0u, uint64_t{0}};
  };
  EXPECT_EQ(names(false), names(false));
  const auto a = names(true), b = names(true);
  EXPECT_NE(a.first, b.first);
  EXPECT_NE(a.second, b.second);
  EXPECT_NE(a.second, names(false).second);
}

TEST(Lanes, RepathGivesThePathANewSourcePortThatItsPacketsAndAcksUse) {
  Fabric f(four_planes());
  EXPECT_EQ(f.node[0].e->repath(kIpB, 0, 99), 0);  // no such path
  const uint16_t before = [&] {
    submit_lane(f, 0, 1, 0, kMtu, 0);
    f.run();
    return path_stats(*f.node[0].e, kIpB)[1].udp_src_port;
  }();
  const uint16_t port = f.node[0].e->repath(kIpB, 0, 1);
  ASSERT_NE(port, 0);
  EXPECT_NE(port, before);
  EXPECT_EQ(path_stats(*f.node[0].e, kIpB)[1].udp_src_port, port);
  const size_t mark = f.log.size();
  for (uint32_t i = 1; i < 20; ++i) submit_lane(f, 0, 1, i, 2 * kMtu, 0);
  f.run();
  bool data = false, ack = false;
  for (size_t i = mark; i < f.log.size(); ++i) {
    const Sent& s = f.log[i];
    if (s.pkt.base.path_id != 1) continue;
    if (s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode)) data |= s.sport == port;
    if (s.from == 1 && s.pkt.base.opcode == Opcode::kAck) ack |= s.sport == port;
  }
  EXPECT_TRUE(data);
  EXPECT_TRUE(ack);
}

TEST(Lanes, ALaneOutOfRateHintsRecordsThemButDoesNotPace) {
  for (bool hints : {true, false}) {
    EngineConfig cfg = four_planes();
    Fabric f(cfg);
    // Node 1 as a receiver that shares 200 Mbit/s: a sender that obeys waits for credit.
    EngineConfig rx = cfg;
    rx.local_ip = kIpB;
    rx.seed = 22;
    rx.rx_capacity_mbps = 200;
    f.node[1].e = Engine::create(rx, f.node[1].host);
    LaneProfile prof;
    prof.rate_hints = hints;
    ASSERT_TRUE(f.node[0].e->set_lane(f.now, kIpB, 6, prof));
    for (uint32_t i = 0; i < 200; ++i) submit_lane(f, 0, 1, i, 4 * kMtu, 6);
    f.run(60s);
    EXPECT_EQ(f.node[0].host.acked.size(), 200u);
    EXPECT_GT(conn_stats(*f.node[0].e, kIpB, 6).rate_hint_mbps, 0u) << hints;
    if (hints) {
      EXPECT_GT(f.node[0].e->stats().pacing_waits, 0u);
    } else {
      EXPECT_EQ(f.node[0].e->stats().pacing_waits, 0u);
    }
  }
}

// Each plane its own bottleneck (a spine per plane): the planes add up. The connection window
// must grow with its paths, or it caps a connection that ECN cuts on one plane at a time
// (congestion.md §2.3).
// Scheduling (congestion.md §7.1). Node 0 first exchanges a message with each of `idle` peers,
// then sends to peer 1 through 2 ms in which everything it sends there is lost: RTOs, then
// recovery. Returns how many times node 0's engine looked at a connection after the first
// phase, and checks that the second message arrived.
uint64_t visits_around_a_lossy_exchange(int idle) {
  Net::Config nc;
  nc.nodes = idle + 1;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config()});
  for (int to = 1; to <= idle; ++to) n.submit(0, to, 1, 0, 4096);
  n.run_idle(1s);
  EXPECT_EQ(n.node[0].host->acked.size(), size_t(idle));
  n.step();  // the ACKs just received queued each connection for one more look by poll_tx
  auto* impl = dynamic_cast<EngineImpl*>(n.node[0].e.get());
  const uint64_t before = impl->conn_visits();
  const Time lossy_until = n.now + 2ms;
  n.drop = [&](const NetPacket& p) { return p.from == 0 && p.to == 1 && n.now < lossy_until; };
  n.submit(0, 1, 1, 1, 16 * 1024);
  n.run_idle(n.now + 1s);
  EXPECT_EQ(n.node[0].host->acked.size(), size_t(idle) + 1);
  EXPECT_TRUE(n.node[0].host->failed.empty());
  EXPECT_GT(n.node[0].e->stats().timeouts, 0u);
  return impl->conn_visits() - before;
}

// Timers and the sending step look only at connections that have something due: with 300 idle
// connections beside it, the one that loses its packets costs exactly what it costs alone (it
// was every connection at every timer and every poll).
// A lane-0 connection idle both ways for conn_idle is forgotten by the sweep, on both sides; a
// late resend of its direction is then dropped and counted, never taken for a new direction and
// delivered twice; talking again makes a new connection (congestion.md §4.6). A connection with
// something in flight, or another lane, is kept however long it is quiet.
TEST(Connections, AnIdleConnectionIsForgottenAndALateResendOfItIsNeverDeliveredTwice) {
  EngineConfig cfg = Fabric::default_config();
  cfg.conn_idle = 1ms;
  Fabric f(cfg);
  f.submit(0, 1, 0, 4 * kMtu);
  f.run();
  ASSERT_EQ(f.node[0].host.acked.size(), 1u);
  const ConnStats before = conn_stats(*f.node[0].e, kIpB);
  ASSERT_TRUE(before.exists);
  ASSERT_TRUE(conn_stats(*f.node[1].e, kIpA).exists);
  // Not yet idle long enough: kept.
  EXPECT_EQ(f.node[0].e->sweep_idle(f.now + 500us, 16), 0u);
  EXPECT_EQ(f.node[1].e->sweep_idle(f.now + 500us, 16), 0u);
  const Time later = f.now + 2ms;
  EXPECT_EQ(f.node[0].e->sweep_idle(later, 16), 1u);
  EXPECT_EQ(f.node[1].e->sweep_idle(later, 16), 1u);
  EXPECT_FALSE(conn_stats(*f.node[0].e, kIpB).exists);
  EXPECT_FALSE(conn_stats(*f.node[1].e, kIpA).exists);
  // A copy of one of its data packets arrives late: dropped, counted, nothing delivered again.
  const Sent* old = f.data_from(0).front();
  f.node[1].e->on_packet(later, kIpA, old->sport, false, old->bytes, old->plane);
  EXPECT_EQ(f.node[1].e->stats().drop_forgotten, 1u);
  EXPECT_FALSE(conn_stats(*f.node[1].e, kIpA).exists);
  for (const auto& [seg, count] : f.node[1].host.deliveries) EXPECT_EQ(count, 1);
  // Talking again: a new connection (a new direction id), delivered.
  f.now = later;
  f.submit(0, 1, 1, 4 * kMtu);
  f.run(later + 10s);
  EXPECT_EQ(f.node[0].host.acked.size(), 2u);
  EXPECT_NE(conn_stats(*f.node[0].e, kIpB).conn_id, before.conn_id);
  EXPECT_EQ(f.node[1].host.received.count({1, 1}), 1u);
  for (const auto& [seg, count] : f.node[1].host.deliveries) EXPECT_EQ(count, 1);

  // Something in flight that nobody answers: never idle, whatever the time.
  f.fate = [](const Sent& s) { return s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
  f.submit(0, 1, 2, 2 * kMtu);
  for (int i = 0; i < 3; ++i) f.step();
  ASSERT_GT(conn_stats(*f.node[0].e, kIpB).in_flight, 0u);
  EXPECT_EQ(f.node[0].e->sweep_idle(f.now + 1s, 16), 0u);
  EXPECT_TRUE(conn_stats(*f.node[0].e, kIpB).exists);
}

TEST(Connections, TheSweepVisitsAtMostWhatItIsGivenAndSparesOtherLanes) {
  EngineConfig cfg = Net::config();
  cfg.conn_idle = 1ms;
  Net::Config nc;
  nc.nodes = 5;
  Net n(nc, {cfg});
  for (int to = 1; to <= 4; ++to) n.submit(0, to, 1, 0, 4 * kMtu);
  ASSERT_TRUE(n.node[0].e->set_lane(n.now, n.node[1].ip, 7, LaneProfile{4, 0, true}));
  n.run_idle(1s);
  const Time later = n.now + 2ms;
  EXPECT_EQ(n.node[0].e->sweep_idle(later, 1), 1u);
  EXPECT_EQ(n.node[0].e->sweep_idle(later, 100), 3u);
  EXPECT_EQ(lanes(*n.node[0].e, n.node[1].ip), std::vector<uint32_t>{7});
}

TEST(Scheduling, IdleConnectionsCostNothingToTimersOrPolling) {
  const uint64_t alone = visits_around_a_lossy_exchange(1);
  const uint64_t crowd = visits_around_a_lossy_exchange(300);
  std::printf("connection visits: 1 connection %lu, beside 299 idle ones %lu\n",
              (unsigned long)alone, (unsigned long)crowd);
  EXPECT_GT(alone, 0u);
  EXPECT_EQ(crowd, alone);
}

// The engine's next deadline is the earliest of its connections', as they change: a message on
// one connection among many brings it forward, its ACK moves it back to none.
// Probes that go out in a poll the transmit queue cuts short still arm their deadlines: a
// probe's timeout must come even when the poll stopped before the sending step.
TEST(Scheduling, AProbeSentBeforeTheQueueFilledArmsItsDeadline) {
  Fabric f;  // 4 paths over 2 planes
  f.submit(0, 1, 0, kMtu);
  f.run();
  ASSERT_EQ(f.node[0].host.acked.size(), 1u);
  Engine& e = *f.node[0].e;
  e.set_plane_up(f.now, 1, false);  // plane 1's paths leave service, unprobed
  e.set_plane_up(f.now, 1, true);   // and are probed again from the next poll
  ASSERT_EQ(e.next_deadline(), Time::max());
  QueueSink one(1);  // takes one packet (into nowhere), then is full
  EXPECT_EQ(e.poll_tx(f.now, one), 1u);  // the first probe; the second finds the queue full
  EXPECT_LT(e.next_deadline(), Time::max());
}

TEST(Scheduling, NextDeadlineFollowsTheEarliestConnection) {
  Net::Config nc;
  nc.nodes = 6;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config()});
  for (int to = 1; to < 6; ++to) n.submit(0, to, 1, 0, 1024);
  n.run_idle(1s);
  Engine& e = *n.node[0].e;
  EXPECT_EQ(e.next_deadline(), Time::max());
  n.drop = [](const NetPacket& p) { return p.from == 0; };
  n.submit(0, 3, 1, 1, 1024);
  e.poll_tx(n.now, *n.node[0].sink);
  const Time rto_at = e.next_deadline();
  EXPECT_GT(rto_at, n.now);
  EXPECT_LE(rto_at, n.now + 2ms);  // rto_initial 1 ms (the fail timer needs other paths' progress)
  n.drop = nullptr;
  n.run_idle(n.now + 1s);
  EXPECT_EQ(n.node[0].host->acked.size(), 6u);
  EXPECT_EQ(e.next_deadline(), Time::max());
}

// The in-flight records are allocated as a connection first needs them: a lone message takes
// one, and a bulk transfer over 8 paths of 64 packets each can have 512 in flight (the fixed
// pool of 256 capped a connection at 1 MiB per round trip).
TEST(Scheduling, InFlightRecordsGrowWithUseBeyondTheOldCap) {
  EngineConfig cfg = Net::config(8);
  cfg.path_window_init = kPathWindow;
  cfg.conn_window_init = 1024;
  Net::Config nc;
  nc.bottleneck_mbps = 0;
  nc.prop = 100us;  // a long round trip: the windows, not the wire, limit
  Net n(nc, {cfg});
  n.submit(0, 1, 1, 0, 1024);
  n.run_idle(1s);
  EXPECT_EQ(conn_stats(*n.node[0].e, n.node[1].ip).records, 1u);
  uint32_t peak = 0;
  n.on_arrival = [&](const NetPacket&, Time) {
    peak = std::max(peak, conn_stats(*n.node[0].e, n.node[1].ip).in_flight);
  };
  submit_bulk(n, 0, 1, 2, 32, 64 * 1024);  // 2 MiB, 2048 packets
  n.run_idle(n.now + 1s);
  expect_exactly_once(n, 0, 1);
  const ConnStats cs = conn_stats(*n.node[0].e, n.node[1].ip);
  std::printf("peak in flight %u, records %u\n", peak, cs.records);
  EXPECT_EQ(peak, 8 * kPathWindow);
  EXPECT_EQ(cs.records, 8 * kPathWindow);
}

// A sender with data for several peers gives them turns of kTxBurst packets, as a NIC
// arbitrates among its QPs, even when its transmit queue stops it mid-turn: each peer's whole
// window in turn made every host of an all-to-all send to the same peer at once (64 hosts:
// 3.1 ms, 272k drops; with turns 0.53 ms, 17k).
TEST(Scheduling, ConnectionsTakeTurnsOfABurstEvenWhenTheQueueStopsThem) {
  Net::Config nc;
  nc.nodes = 4;
  nc.bottleneck_mbps = 0;
  Net n(nc, {Net::config()});
  for (int to = 1; to < 4; ++to) submit_bulk(n, 0, to, 1, 4, 64 * 1024);
  // A queue that takes 5 packets per poll: turns of 8 span polls.
  QueueSink small(0, n.node[0].sink.get());
  for (int poll = 0; poll < 10; ++poll) {
    small.room = 5;
    n.node[0].e->poll_tx(n.now, small);
  }
  n.run_until(n.now + 10us);  // what was sent arrives, in the order it left
  std::vector<int> order;
  for (const auto& d : n.delivered)
    if (d.from == 0 && order.size() < 48) order.push_back(d.to);
  ASSERT_EQ(order.size(), 48u);
  for (size_t i = 0; i < order.size(); ++i)
    EXPECT_EQ(order[i], 1 + int(i / kTxBurst) % 3) << "packet " << i;
  n.run_idle(n.now + 1s);
  for (int to = 1; to < 4; ++to) expect_exactly_once(n, 0, to);
}

TEST(Planes, GoodputGrowsLinearlyWithPlanesThatAreEachABottleneck) {
  // 8 paths in all (the device default: one path per plane at 8 planes), then 8 per plane.
  for (uint16_t paths_per_plane : {0, 8}) {
  auto goodput = [paths_per_plane](uint8_t planes) {
    Net::Config nc;
    nc.bottleneck_mbps = 1000;
    nc.per_plane = true;
    nc.mark_backlog = 100us;
    nc.drop_backlog = 2ms;
    EngineConfig cfg = Net::config(paths_per_plane ? uint16_t(paths_per_plane * planes) : 8);
    cfg.num_planes = planes;
    Net n(nc, {cfg});
    submit_bulk(n, 0, 1, 1, 1200, 64 * 1024);
    n.run_until(80ms);
    uint64_t bytes = 0;
    for (const auto& d : n.delivered) bytes += (d.t >= 20ms && d.t < 80ms) ? d.bytes : 0;
    return double(bytes) * 8 / 60e-3 / 1e9;  // Gbit/s
  };
  const double one = goodput(1);
  std::printf("planes goodput: 1 %.3f", one);
  EXPECT_GT(one, 0.9);
  for (uint8_t p : {2, 4, 8}) {
    const double g = goodput(p);
    std::printf(", %u %.3f (%.2f of linear)", p, g, g / (p * one));
    EXPECT_GE(g, 0.9 * p * one) << p << " planes, " << paths_per_plane << " paths per plane";
  }
  std::printf("\n");
  }
}

}  // namespace
}  // namespace metaroce::transport
