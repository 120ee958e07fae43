// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for datapath/transport: two engines on a virtual clock, joined by a wire that
// the input drives event by event (submit, deliver, drop, duplicate, reorder, corrupt, inject,
// advance time, refuse at the receiver, planes down, streams dropped). Checked throughout: no
// crash, every segment placed at most once and byte-exact, each message completed at most once
// and never both acked and failed; at the end, with faults off, every message acked or failed.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <vector>

#include "datapath/transport/engine.h"
#include "datapath/transport/path_stats.h"

namespace metaroce::transport {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kIp[2] = {0xc6120001, 0xc6120002};  // 198.18.0.1, 198.18.0.2
constexpr size_t kMaxWire = 2048;      // packets on the wire; more are dropped as a full queue
constexpr size_t kMaxEvents = 400;
constexpr uint32_t kStreams = 3;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "transport_fuzz: %s\n", what);
  std::abort();
}
void check(bool ok, const char* what) {
  if (!ok) fail(what);
}

// The byte at `pos` of message (stream, msn): the receiver can check any segment on its own.
uint8_t pattern(uint32_t stream, uint32_t msn, uint64_t pos) {
  return static_cast<uint8_t>((stream * 131 + msn * 31 + pos * 7 + (pos >> 8)) & 0xff);
}

struct Message {
  int from = 0;
  uint32_t stream = 0, msn = 0, length = 0;
  Op op = Op::kWrite;
  enum State { kPending, kAcked, kFailed, kDropped } state = kPending;
};

struct World;
bool trace = false;  // TRANSPORT_FUZZ_TRACE set: each event on stderr, to read a crash

class FuzzHost : public Host {
 public:
  FuzzHost(World& w, int self) : w_(w), self_(self) {}
  void gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) override;
  Syndrome deliver(const Segment& seg) override;
  void message_acked(uint64_t cookie) override { complete(cookie, Message::kAcked); }
  void message_failed(uint64_t cookie, Syndrome why) override {
    check(why != Syndrome::kOk, "message failed with kOk");
    complete(cookie, Message::kFailed);
  }
  int rnr_timer(uint32_t) override { return rnr_code; }

  Syndrome verdict = Syndrome::kOk;
  int rnr_code = -1;

 private:
  void complete(uint64_t cookie, Message::State to);
  World& w_;
  int self_;
};

struct Packet {
  int to = 0;
  uint16_t sport = 0;
  uint8_t plane = 0;
  std::vector<uint8_t> bytes;
};

struct World {
  std::map<uint64_t, Message> msgs;  // by cookie
  // Placed segments per receiver: (sender's stream, msn, offset).
  std::map<std::tuple<int, uint32_t, uint32_t, uint32_t>, int> placed;
  std::set<std::pair<int, uint32_t>> parked;  // (receiver, sender's stream) refused kUnreachable
  std::map<std::tuple<int, uint32_t, uint32_t>, uint64_t> by_key;  // (from, stream, msn) -> cookie
  std::vector<Packet> wire;
  uint32_t next_msn[2][kStreams] = {};
  uint64_t next_cookie = 1;
  // A packet reached an engine with bytes no engine wrote: a forgery that guessed a token may
  // place data that was never sent, so placement is checked only while this is false.
  bool tainted = false;
  Time now{0};
  std::unique_ptr<FuzzHost> host[2];
  std::unique_ptr<Engine> e[2];
};

void FuzzHost::gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) {
  auto it = w_.msgs.find(cookie);
  check(it != w_.msgs.end() && it->second.from == self_, "gather of a message not ours");
  check(uint64_t{offset} + out.size() <= it->second.length, "gather beyond the message");
  for (size_t i = 0; i < out.size(); ++i) out[i] = pattern(it->second.stream, it->second.msn, offset + i);
}

Syndrome FuzzHost::deliver(const Segment& seg) {
  check(uint64_t{seg.offset} + seg.payload.size() <= seg.total_length ||
            seg.op == Op::kReadReq,
        "segment beyond its message");
  check(seg.peer_ip == kIp[1 - self_] || w_.tainted, "segment from a peer that never sent");
  if (trace) {
    std::fprintf(stderr, "  engine %d deliver stream %u msn %u offset %u path %u seq %u: %u\n", self_,
                 seg.src_stream, seg.msn, seg.offset, seg.ref.path, seg.ref.seq, unsigned(verdict));
  }
  if (verdict == Syndrome::kUnreachable) w_.parked.insert({self_, seg.src_stream});
  if (verdict != Syndrome::kOk) return verdict;
  if (w_.tainted) return Syndrome::kOk;
  const int from = 1 - self_;
  auto it = w_.by_key.find({from, seg.src_stream, seg.msn});
  check(it != w_.by_key.end(), "segment of a message never submitted");
  const Message& m = w_.msgs.at(it->second);
  check(seg.op == m.op && seg.total_length == m.length, "segment disagrees with its message");
  for (size_t i = 0; i < seg.payload.size(); ++i) {
    check(seg.payload[i] == pattern(m.stream, m.msn, seg.offset + i), "payload corrupted");
  }
  // A stream refused as unreachable is parked and its messages sent again whole (congestion.md
  // §4.6), which Host::deliver's idempotence allows; otherwise a segment is placed once.
  check(++w_.placed[{self_, seg.src_stream, seg.msn, seg.offset}] == 1 ||
            w_.parked.count({self_, seg.src_stream}),
        "segment placed twice");
  return Syndrome::kOk;
}

void FuzzHost::complete(uint64_t cookie, Message::State to) {
  auto it = w_.msgs.find(cookie);
  check(it != w_.msgs.end() && it->second.from == self_, "completion of a message not ours");
  check(it->second.state != Message::kDropped, "completion after its stream was dropped");
  check(it->second.state == Message::kPending, "message completed twice");
  it->second.state = to;
}

class WireSink : public TxSink {
 public:
  WireSink(World& w, int self) : w_(w), self_(self) {}
  std::span<uint8_t> begin(uint32_t max_len, uint8_t) override {
    buf_.assign(max_len, 0);
    return buf_;
  }
  void commit(uint32_t peer_ip, uint16_t sport, uint8_t plane, uint32_t len) override {
    check(len <= buf_.size(), "commit beyond begin's room");
    check(peer_ip == kIp[1 - self_] || w_.tainted, "packet to a peer nobody named");
    if (peer_ip != kIp[1 - self_] || w_.wire.size() >= kMaxWire) return;  // nowhere / full
    w_.wire.push_back({1 - self_, sport, plane, {buf_.begin(), buf_.begin() + len}});
  }

 private:
  World& w_;
  int self_;
  std::vector<uint8_t> buf_;
};

EngineConfig config(FuzzedDataProvider& in, int self) {
  EngineConfig c;
  c.local_ip = kIp[self];
  c.seed = 11 + self;
  c.num_paths = in.ConsumeIntegralInRange<uint16_t>(1, 8);
  c.num_planes = in.ConsumeIntegralInRange<uint8_t>(1, 2);
  c.mtu_payload = 256;
  c.max_packet = 256 + 128;
  c.rto_initial = 1ms;
  c.rto_min = 200us;
  c.rto_max = 20ms;
  c.max_retries = 3;
  c.path_window_init = in.ConsumeIntegralInRange<uint32_t>(1, 16);
  c.conn_window_init = in.ConsumeIntegralInRange<uint32_t>(2, 32);
  c.conn_window_max = 64;
  c.rx_capacity_mbps = in.ConsumeBool() ? 10000 : 0;
  c.tail_loss_probe = in.ConsumeBool();
  c.late_detection = in.ConsumeBool();
  c.tail_redundancy = in.ConsumeBool();
  c.suspect_silent_paths = in.ConsumeBool();
  c.rnr_delay = 500us;
  c.rnr_retry = 3;
  c.conn_idle = 1s;
  return c;
}

void poll_all(World& w, WireSink* sinks) {
  for (int i = 0; i < 2; ++i) {
    if (w.e[i]->next_deadline() <= w.now) w.e[i]->on_timer(w.now);
    w.e[i]->poll_tx(w.now, sinks[i]);
  }
}

void arrive(World& w, const Packet& p, bool ce) {
  w.e[p.to]->on_packet(w.now, kIp[1 - p.to], p.sport, ce, p.bytes, p.plane);
}

void submit(World& w, FuzzedDataProvider& in) {
  static constexpr Op kOps[] = {Op::kWrite, Op::kWriteImm, Op::kSend,          Op::kSendImm,
                                Op::kReadReq, Op::kAtomicCmpSwp, Op::kAtomicFetchAdd,
                                Op::kSendInv, Op::kAtomicWrite};
  const int from = in.ConsumeBool();
  const uint32_t stream = in.ConsumeIntegralInRange<uint32_t>(0, kStreams - 1);
  Message m;
  m.from = from;
  m.stream = stream + 1;
  m.msn = w.next_msn[from][stream]++;
  m.op = in.PickValueInArray(kOps);
  m.length = in.ConsumeIntegralInRange<uint32_t>(0, 2000);
  if (m.op == Op::kAtomicCmpSwp || m.op == Op::kAtomicFetchAdd) m.length = 16;
  if (m.op == Op::kAtomicWrite) m.length = 8;
  const uint64_t cookie = w.next_cookie++;
  w.msgs[cookie] = m;
  w.by_key[{from, m.stream, m.msn}] = cookie;
  MessageDesc d;
  d.peer_ip = kIp[1 - from];
  d.dst_stream = m.stream + 100;
  d.src_stream = m.stream;
  d.msn = m.msn;
  d.rsn = (m.op == Op::kSend || m.op == Op::kSendImm || m.op == Op::kWriteImm ||
           m.op == Op::kSendInv) ? m.msn + 1 : 0;
  d.op = m.op;
  d.length = m.length;
  d.remote_addr = 0x10000;
  d.rkey = 7;
  d.cookie = cookie;
  d.retry_cnt = in.ConsumeBool() ? MessageDesc::kEngineRetries : 2;
  d.timeout = in.ConsumeBool() ? 0ms : 5ms;
  d.lane = in.ConsumeIntegralInRange<uint32_t>(0, 1);
  if (trace) {
    std::fprintf(stderr, "  submit %d stream %u msn %u op %u len %u retry %u timeout %lld lane %u\n",
                 from, d.src_stream, d.msn, unsigned(d.op), d.length, d.retry_cnt,
                 (long long)d.timeout.count(), d.lane);
  }
  w.e[from]->submit(d);
}

// Everything delivered in order, no faults, timers fired, until both engines are idle. False
// when they are not idle after 30 s of that.
bool settle(World& w, WireSink* sinks) {
  for (auto& h : w.host) h->verdict = Syndrome::kOk;
  for (int i = 0; i < 2; ++i) {
    for (uint8_t p = 0; p < 2; ++p) w.e[i]->set_plane_up(w.now, p, true);
  }
  const Time limit = w.now + 30s;
  for (int steps = 0; steps < 200000 && w.now < limit; ++steps) {
    poll_all(w, sinks);
    if (!w.wire.empty()) {
      w.now += 5us;
      std::vector<Packet> batch;
      batch.swap(w.wire);
      for (const Packet& p : batch) arrive(w, p, false);
      continue;
    }
    if (w.e[0]->idle() && w.e[1]->idle()) return true;
    const Time next = std::min(w.e[0]->next_deadline(), w.e[1]->next_deadline());
    check(next != Time::max(), "engine not idle but has no deadline");
    w.now = std::max(w.now, next);
  }
  return false;
}

void run(FuzzedDataProvider& in) {
  World w;
  for (int i = 0; i < 2; ++i) w.host[i] = std::make_unique<FuzzHost>(w, i);
  for (int i = 0; i < 2; ++i) {
    const EngineConfig c = config(in, i);
    if (trace) {
      std::fprintf(stderr, "engine %d: paths %u planes %u pwin %u cwin %u rx %u tlp %d late %d red %d suspect %d\n",
                   i, c.num_paths, c.num_planes, c.path_window_init, c.conn_window_init,
                   c.rx_capacity_mbps, c.tail_loss_probe, c.late_detection, c.tail_redundancy,
                   c.suspect_silent_paths);
    }
    w.e[i] = Engine::create(c, *w.host[i]);
  }
  WireSink sinks[2] = {WireSink(w, 0), WireSink(w, 1)};

  for (size_t ev = 0; ev < kMaxEvents && in.remaining_bytes() > 0; ++ev) {
    const uint8_t op = in.ConsumeIntegralInRange<uint8_t>(0, 12);
    const size_t pick = w.wire.empty() ? 0 : in.ConsumeIntegralInRange<size_t>(0, w.wire.size() - 1);
    if (trace) std::fprintf(stderr, "t=%lldus event %u pick %zu of %zu\n", (long long)(w.now.count() / 1000), op, pick, w.wire.size());
    switch (op) {
      case 0:
      case 1:
        submit(w, in);
        break;
      case 2:  // deliver one packet, in any order (the others wait: reordering and delay)
      case 3:
        if (!w.wire.empty()) {
          const Packet p = std::move(w.wire[pick]);
          w.wire.erase(w.wire.begin() + static_cast<ptrdiff_t>(pick));
          arrive(w, p, in.ConsumeBool());
        }
        break;
      case 4:  // drop one
        if (!w.wire.empty()) w.wire.erase(w.wire.begin() + static_cast<ptrdiff_t>(pick));
        break;
      case 5:  // deliver a copy, keep the original on the wire
        if (!w.wire.empty()) arrive(w, Packet(w.wire[pick]), false);
        break;
      case 6:  // corrupt bytes of one and deliver it
        if (!w.wire.empty()) {
          Packet p = w.wire[pick];
          for (int n = in.ConsumeIntegralInRange<int>(1, 4); n > 0 && !p.bytes.empty(); --n) {
            const size_t at = in.ConsumeIntegralInRange<size_t>(0, p.bytes.size() - 1);
            p.bytes[at] ^= in.ConsumeIntegralInRange<uint8_t>(1, 255);
          }
          if (in.ConsumeBool()) p.bytes.resize(in.ConsumeIntegralInRange<size_t>(0, p.bytes.size()));
          w.tainted = true;
          arrive(w, p, false);
        }
        break;
      case 7: {  // arbitrary bytes, from the peer or a stranger
        const int to = in.ConsumeBool();
        const uint32_t src = in.ConsumeBool() ? kIp[1 - to] : in.ConsumeIntegral<uint32_t>();
        const auto bytes = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 400));
        w.tainted = true;
        w.e[to]->on_packet(w.now, src, in.ConsumeIntegral<uint16_t>(), in.ConsumeBool(), bytes,
                           in.ConsumeIntegralInRange<uint8_t>(0, 1));
        break;
      }
      case 8:  // time passes
        w.now += std::chrono::microseconds(in.ConsumeIntegralInRange<uint32_t>(0, 30000));
        break;
      case 9: {  // to the next timer
        const Time next = std::min(w.e[0]->next_deadline(), w.e[1]->next_deadline());
        if (next != Time::max()) w.now = std::max(w.now, next);
        break;
      }
      case 10: {  // what the receiving NIC answers from now on
        static constexpr Syndrome kVerdicts[] = {Syndrome::kOk, Syndrome::kRnr,
                                                 Syndrome::kRemoteAccess, Syndrome::kRemoteBounds,
                                                 Syndrome::kRemoteInvalid, Syndrome::kRemoteOp,
                                                 Syndrome::kUnreachable};
        FuzzHost& h = *w.host[in.ConsumeBool()];
        h.verdict = in.PickValueInArray(kVerdicts);
        h.rnr_code = in.ConsumeIntegralInRange<int>(-1, 3);
        if (trace) std::fprintf(stderr, "  verdict %u rnr %d\n", unsigned(h.verdict), h.rnr_code);
        break;
      }
      case 11: {  // a plane's port goes down or comes back
        const int n = in.ConsumeBool();
        const uint8_t plane = in.ConsumeIntegralInRange<uint8_t>(0, 1);
        const bool up = in.ConsumeBool();
        if (trace) std::fprintf(stderr, "  engine %d plane %u up %d\n", n, plane, up);
        w.e[n]->set_plane_up(w.now, plane, up);
        break;
      }
      case 12: {  // a QP goes away, or idle connections are swept
        const int n = in.ConsumeBool();
        if (in.ConsumeBool()) {
          w.e[n]->sweep_idle(w.now, 4);
          break;
        }
        const uint32_t stream = in.ConsumeIntegralInRange<uint32_t>(1, kStreams);
        for (auto& [cookie, m] : w.msgs) {
          if (m.from == n && m.stream == stream && m.state == Message::kPending) {
            m.state = Message::kDropped;
          }
        }
        w.e[n]->drop_stream(stream);
        break;
      }
    }
    poll_all(w, sinks);
  }

  if (!settle(w, sinks)) fail("engines did not settle with faults off");
  for (const auto& [cookie, m] : w.msgs) {
    check(m.state != Message::kPending, "message neither acked nor failed after settling");
  }
}

}  // namespace
}  // namespace metaroce::transport

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metaroce::transport::trace = std::getenv("TRANSPORT_FUZZ_TRACE") != nullptr;
  FuzzedDataProvider in(data, size);
  metaroce::transport::run(in);
  return 0;
}
