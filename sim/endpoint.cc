// SPDX-License-Identifier: Apache-2.0
// The simulated host: packets in and out of the real transport engine, its timers on the
// event queue, the NIC's transmit queue as the uplink's backlog.
#include "sim/endpoint.h"

#include <algorithm>

namespace metaroce::sim {

namespace {
// What the NIC lets wait in front of its port before the transport must stop (a few packets);
// a port that PFC pauses fills to it and holds the transport there.
constexpr uint32_t kNicQueue = 32 * 1024;
}  // namespace

class Endpoint::Sink final : public transport::TxSink {
 public:
  explicit Sink(Endpoint& e) : e_(e) {}
  std::span<uint8_t> begin(uint32_t max_len, uint8_t plane) override {
    Link* up = e_.topo_.uplink(e_.host_, plane);
    if (up->backlog() > kNicQueue) {
      e_.wake_at(up->drains_to(kNicQueue / 2));
      return {};
    }
    buf_.resize(max_len);
    return buf_;
  }
  void commit(uint32_t peer_ip, uint16_t sport, uint8_t plane, uint32_t len) override {
    Packet p;
    p.src_ip = Topology::ip_of(e_.host_);
    p.dst_ip = peer_ip;
    p.sport = sport;
    p.plane = plane;
    p.length = len;
    p.head.assign(buf_.begin(), buf_.begin() + std::min(len, Packet::kHeadBytes));
    e_.topo_.uplink(e_.host_, plane)->send(std::move(p));
  }

 private:
  Endpoint& e_;
  std::vector<uint8_t> buf_;
};

Endpoint::Endpoint(EventQueue& q, Topology& topo, uint32_t host,
                   const transport::EngineConfig& cfg)
    : q_(q), topo_(topo), host_(host) {
  transport::EngineConfig c = cfg;
  c.local_ip = Topology::ip_of(host);
  c.seed = cfg.seed * 7919 + host;
  engine_ = transport::Engine::create(c, *this);
  sink_ = std::make_unique<Sink>(*this);
  topo_.attach(host, this);
}

Endpoint::~Endpoint() = default;

void Endpoint::send(uint32_t to, uint32_t stream, uint32_t bytes, std::function<void(Ns)> done) {
  transport::MessageDesc m;
  m.peer_ip = Topology::ip_of(to);
  m.src_stream = stream;
  m.dst_stream = stream;
  m.msn = next_msn_[{to, stream}]++;
  m.op = transport::Op::kWrite;
  m.length = bytes;
  m.rkey = 1;
  m.cookie = next_cookie_++;
  msgs_[m.cookie] = Msg{std::move(done)};
  engine_->submit(m);
  kick();
}

void Endpoint::receive(Packet&& p) {
  // The payload as it arrived: headers, then bytes nobody reads.
  rx_buf_.resize(p.length);
  std::copy(p.head.begin(), p.head.end(), rx_buf_.begin());
  engine_->on_packet(transport::Time(q_.now()), p.src_ip, p.sport, p.ce, rx_buf_, p.plane);
  kick();
}

void Endpoint::gather(uint64_t, uint32_t, std::span<uint8_t>) {}  // the bytes do not matter

transport::Syndrome Endpoint::deliver(const transport::Segment& seg) {
  rx_bytes_ += seg.payload.size();
  if (arrived_ && seg.offset + seg.payload.size() == seg.total_length)
    arrived_(Topology::host_of(seg.peer_ip), seg.dst_stream, seg.msn);
  return transport::Syndrome::kOk;
}

void Endpoint::message_acked(uint64_t cookie) {
  auto it = msgs_.find(cookie);
  if (it == msgs_.end()) return;
  auto done = std::move(it->second.done);
  msgs_.erase(it);
  if (done) done(q_.now());
}

void Endpoint::message_failed(uint64_t cookie, transport::Syndrome) {
  ++failed_;
  msgs_.erase(cookie);
}

void Endpoint::wake_at(Ns t) {
  if (wake_pending_) return;
  wake_pending_ = true;
  q_.at(t, [this] {
    wake_pending_ = false;
    kick();
  });
}

void Endpoint::kick() {
  const transport::Time now(q_.now());
  engine_->poll_tx(now, *sink_);
  const transport::Time next = engine_->next_deadline();
  if (next == transport::Time::max()) return;
  const Ns t = std::max<Ns>(next.count(), q_.now());
  if (t >= timer_at_) return;
  timer_at_ = t;
  const uint64_t gen = ++timer_gen_;
  q_.at(t, [this, gen] {
    if (gen != timer_gen_) return;  // a sooner timer replaced this one
    timer_at_ = INT64_MAX;
    engine_->on_timer(transport::Time(q_.now()));
    kick();
  });
}

}  // namespace metaroce::sim
