// SPDX-License-Identifier: Apache-2.0
// Unit tests of datapath/transport: two engines joined by a scripted in-test fabric on a
// virtual clock, with fake hosts that own the message bytes and record every delivery.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
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
    node[from].e->submit(m);
    return cookie;
  }

  // Advances the virtual clock event by event; false when nothing is left to happen.
  bool step() {
    for (int i = 0; i < 2; ++i) node[i].e->poll_tx(now, *sink[i]);
    Time next = Time::max();
    if (!wire_.empty()) next = wire_.begin()->first;
    for (auto& n : node) next = std::min(next, n.e->next_deadline());
    if (next == Time::max()) return false;
    now = std::max(now, next);
    while (!wire_.empty() && wire_.begin()->first <= now) {
      const size_t idx = wire_.begin()->second;
      wire_.erase(wire_.begin());
      const Sent& s = log[idx];
      const int to = s.peer_ip == kIpA ? 0 : 1;
      arrivals.push_back(idx);
      node[to].e->on_packet(now, node[s.from].ip, s.sport, s.ce, s.bytes);
    }
    for (auto& n : node) {
      if (n.e->next_deadline() <= now) n.e->on_timer(now);
    }
    return true;
  }

  // Runs until both engines are idle and nothing is on the wire, or until limit.
  void run(Time limit = 10s) {
    while (now < limit) {
      if (!step() && node[0].e->idle() && node[1].e->idle()) return;
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
    std::span<uint8_t> begin(uint32_t max_len) override {
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
  std::printf("sizeof: SackWindow %zu, TxDesc %zu, TxPath %zu, RxPath %zu, RecvDir %zu, "
              "MsgSlot %zu, Connection %zu\n",
              sizeof(SackWindow), sizeof(TxDesc), sizeof(TxPath), sizeof(RxPath),
              sizeof(RecvDir), sizeof(MsgSlot), sizeof(Connection));
  const size_t per_path_tx = sizeof(TxPath) + kPathWindow * sizeof(TxDesc);
  std::printf("per path: send %zu B (ring of %u), receive %zu B; 8-path connection ~%zu B\n",
              per_path_tx, kPathWindow, sizeof(RxPath),
              sizeof(Connection) + 8 * (per_path_tx + sizeof(RxPath)) + sizeof(RecvDir));
  EXPECT_LE(sizeof(SackWindow), 48u);
  EXPECT_LE(sizeof(TxDesc), 32u);
  EXPECT_LE(sizeof(TxPath), 128u);
  EXPECT_LE(sizeof(RxPath), 192u);
  EXPECT_LE(sizeof(Connection), 160u);
  EXPECT_LE(sizeof(MsgSlot), 96u);
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
  for (const Sent& s : f.log) {
    if (s.from == 0) {
      EXPECT_EQ(s.sport, ps[s.pkt.base.path_id].udp_src_port);
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
  // And reordering really happened: some packet arrived before one sent earlier.
  bool overtaken = false;
  for (size_t i = 1; i < f.arrivals.size(); ++i) {
    const Sent& a = f.log[f.arrivals[i - 1]];
    const Sent& b = f.log[f.arrivals[i]];
    if (a.from == 0 && b.from == 0 && b.tx_time < a.tx_time) overtaken = true;
  }
  EXPECT_TRUE(overtaken);
}

TEST(Transport, LossOfTheLastPacketIsRecoveredByRto) {
  Fabric f;
  const uint64_t cookie = f.submit(0, 1, 0, 8 * kMtu);
  bool dropped = false;
  f.fate = [&](const Sent& s) {
    if (!dropped && s.from == 0 && wire::is_data_opcode(s.pkt.base.opcode) &&
        s.pkt.data.offset == 7 * kMtu) {
      dropped = true;
      return Fate::kDrop;
    }
    return Fate::kDeliver;
  };
  f.run();
  ASSERT_TRUE(dropped);
  EXPECT_EQ(f.node[0].host.acked, std::vector<uint64_t>{cookie});
  EXPECT_EQ(f.node[1].host.received.at({1, 0}), sent_bytes(f, 0, cookie));
  EXPECT_EQ(f.node[0].e->stats().timeouts, 1u);
  EXPECT_EQ(f.node[0].e->stats().retransmits, 1u);
  // The retransmission left one RTO after the original: at least rto_min, well under rto_max.
  auto data = f.data_from(0);
  const Sent* first = nullptr;
  const Sent* second = nullptr;
  for (const Sent* s : data) {
    if (s->pkt.data.offset != 7 * kMtu) continue;
    (first ? second : first) = s;
  }
  ASSERT_TRUE(first && second);
  EXPECT_GE(second->tx_time - first->tx_time, f.cfg.rto_min);
  EXPECT_LE(second->tx_time - first->tx_time, f.cfg.rto_initial);
}

TEST(Transport, PeerThatNeverAnswersFailsWithRetryExceeded) {
  EngineConfig cfg = Fabric::default_config();
  cfg.max_retries = 3;
  Fabric f(cfg);
  f.fate = [](const Sent& s) { return s.from == 0 ? Fate::kDrop : Fate::kDeliver; };
  const uint64_t c1 = f.submit(0, 1, 0, 100);
  const uint64_t c2 = f.submit(0, 2, 0, 3 * kMtu);
  f.run();
  ASSERT_TRUE(f.node[0].e->idle());
  EXPECT_TRUE(f.node[0].host.acked.empty());
  auto& failed = f.node[0].host.failed;
  ASSERT_EQ(failed.size(), 2u);
  std::map<uint64_t, int> seen;
  for (auto& [cookie, why] : failed) {
    EXPECT_EQ(why, Syndrome::kRetryExceeded);
    ++seen[cookie];
  }
  EXPECT_EQ(seen[c1], 1);
  EXPECT_EQ(seen[c2], 1);
  // The single-packet message: sent once plus max_retries times, with doubling gaps.
  std::vector<Time> tx;
  for (const Sent* s : f.data_from(0)) {
    if (s->pkt.data.src_stream == 1) tx.push_back(s->tx_time);
  }
  ASSERT_EQ(tx.size(), 1u + cfg.max_retries);
  for (size_t i = 2; i < tx.size(); ++i) EXPECT_EQ(tx[i] - tx[i - 1], 2 * (tx[i - 1] - tx[i - 2]));
  EXPECT_EQ(tx[1] - tx[0], cfg.rto_initial);
  EXPECT_EQ(f.node[1].host.deliver_calls, 0);
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
  bad[1] = 9;
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
    std::span<uint8_t> begin(uint32_t n) override { buf.assign(n, 0); return buf; }
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

}  // namespace
}  // namespace metaroce::transport
