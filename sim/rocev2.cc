// SPDX-License-Identifier: Apache-2.0
// The RoCEv2 baseline: go-back-N RC with DCQCN (see rocev2.h for what it is held to).
#include "sim/rocev2.h"

#include <algorithm>
#include <cstring>

namespace metaroce::sim {

namespace {

enum Type : uint8_t { kData = 1, kAck = 2, kNak = 3, kCnp = 4 };
constexpr uint32_t kHeader = 16;        // BTH + RETH-ish: type, qpn, psn (what we carry)

// DCQCN defaults (Zhu et al. 2015, Table 1 and section 5).
constexpr double kG = 1.0 / 256;
constexpr Ns kAlphaTimer = 55'000;
constexpr Ns kRateTimer = 55'000;
constexpr uint64_t kByteCounter = 10'000'000;
constexpr int kFastRecovery = 5;
constexpr double kRaiGbps = 0.040, kRhaiGbps = 0.100;
constexpr Ns kCnpInterval = 50'000;

void put32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
uint32_t get32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

struct RoceEndpoint::Qp {
  uint32_t peer_ip = 0, qpn = 0;
  uint16_t sport = 0;
  uint8_t plane = 0;
  // Messages: the PSN one past their last packet, and their callbacks, in order.
  struct Msg {
    uint32_t end_psn;
    std::function<void(Ns)> done;
  };
  std::deque<Msg> msgs;
  std::deque<uint32_t> lens;  // payload of every PSN not yet acknowledged, from una
  uint32_t una = 0;           // oldest unacknowledged PSN
  uint32_t next = 0;          // next PSN to send (rewound by go-back-N)
  uint32_t end = 0;           // one past the last PSN queued
  Ns last_progress = 0;
  uint64_t rto_gen = 0;
  bool rto_armed = false;
  bool pump_pending = false;
  Ns next_tx = 0;             // pacing
  // DCQCN reaction point.
  double rc = 0, rt = 0, alpha = 1;
  bool cnp_in_period = false;
  int stage = 0, byte_stage = 0;
  uint64_t bytes_since = 0;
  bool timers = false;
};

RoceEndpoint::RoceEndpoint(EventQueue& q, Topology& topo, uint32_t host, uint32_t planes,
                           double line_gbps, RoceParams p)
    : q_(q), topo_(topo), host_(host), planes_(planes), line_gbps_(line_gbps), p_(p) {
  topo_.attach(host, this);
}

RoceEndpoint::~RoceEndpoint() = default;

RoceEndpoint::Qp& RoceEndpoint::qp_to(uint32_t to, uint32_t stream) {
  auto& slot = qps_[{to, stream}];
  if (!slot) {
    slot = std::make_unique<Qp>();
    Qp& qp = *slot;
    qp.peer_ip = Topology::ip_of(to);
    qp.qpn = static_cast<uint32_t>(qps_.size());
    // A QP's one path: its source port (what ECMP hashes) and its NIC port.
    uint64_t h = (uint64_t{host_} << 32 | to) * 0x9e3779b97f4a7c15ull + stream;
    h ^= h >> 31;
    qp.sport = static_cast<uint16_t>(49152 + h % 16384);
    qp.plane = static_cast<uint8_t>((stream + to) % planes_);
    qp.rc = qp.rt = line_gbps_;
    by_qpn_.push_back(&qp);
  }
  return *slot;
}

void RoceEndpoint::send(uint32_t to, uint32_t stream, uint32_t bytes, std::function<void(Ns)> done) {
  Qp& qp = qp_to(to, stream);
  const uint32_t pkts = bytes ? (bytes + p_.mtu - 1) / p_.mtu : 1;
  for (uint32_t k = 0; k < pkts; ++k) {
    qp.lens.push_back(std::min(p_.mtu, bytes - std::min(bytes, k * p_.mtu)));
    ++qp.end;
  }
  qp.msgs.push_back({qp.end, std::move(done)});
  if (!qp.timers) {
    qp.timers = true;
    Qp* x = &qp;
    q_.at(q_.now() + kAlphaTimer, [this, x] { dcqcn_timer(*x); });
  }
  pump(qp);
}

void RoceEndpoint::emit(uint32_t dst_ip, uint16_t sport, uint8_t plane, uint8_t type, uint32_t qpn,
                        uint32_t psn, uint32_t len) {
  Packet p;
  p.src_ip = Topology::ip_of(host_);
  p.dst_ip = dst_ip;
  p.sport = sport;
  p.plane = plane;
  p.length = kHeader + len;
  p.head.assign(kHeader, 0);
  p.head[0] = type;
  put32(&p.head[4], qpn);
  put32(&p.head[8], psn);
  topo_.uplink(host_, plane)->send(std::move(p));
}

// Sends at the DCQCN rate while the QP's outstanding bytes allow.
void RoceEndpoint::pump(Qp& qp) {
  if (qp.pump_pending) return;
  uint64_t outstanding = 0;  // counted once here, then kept as packets leave
  for (uint32_t s = qp.una; s != qp.next; ++s) outstanding += qp.lens[s - qp.una];
  while (qp.next != qp.end) {
    if (q_.now() < qp.next_tx) {
      qp.pump_pending = true;
      Qp* x = &qp;
      q_.at(qp.next_tx, [this, x] {
        x->pump_pending = false;
        pump(*x);
      });
      return;
    }
    if (outstanding >= p_.window) return;  // an ACK resumes it
    Link* up = topo_.uplink(host_, qp.plane);
    // The NIC's port is full (as the transport's sink sees it), or paused by PFC: the QP holds
    // its packets until the port drains.
    if (up->backlog() > 32 * 1024) {
      qp.pump_pending = true;
      Qp* x = &qp;
      q_.at(up->drains_to(16 * 1024), [this, x] {
        x->pump_pending = false;
        pump(*x);
      });
      return;
    }
    const uint32_t len = qp.lens[qp.next - qp.una];
    emit(qp.peer_ip, qp.sport, qp.plane, kData, qp.qpn, qp.next, len);
    ++qp.next;
    outstanding += len;
    const uint32_t wire = len + kHeader + 46;
    qp.next_tx = q_.now() + static_cast<Ns>(wire * 8 / qp.rc);
    // DCQCN byte counter: a stage of increase every kByteCounter bytes.
    qp.bytes_since += wire;
    if (qp.bytes_since >= kByteCounter) {
      qp.bytes_since = 0;
      ++qp.byte_stage;
    }
    arm_rto(qp);
  }
}

void RoceEndpoint::arm_rto(Qp& qp) {
  if (qp.rto_armed) return;
  qp.rto_armed = true;
  const uint64_t gen = ++qp.rto_gen;
  Qp* x = &qp;
  q_.at(q_.now() + p_.rto_ns, [this, x, gen] {
    if (gen != x->rto_gen) return;
    x->rto_armed = false;
    if (x->una == x->next) return;
    if (q_.now() - x->last_progress < p_.rto_ns) {
      arm_rto(*x);
      return;
    }
    // Timeout: go back to the oldest unacknowledged packet.
    ++stats_.timeouts;
    stats_.retransmits += x->next - x->una;
    x->next = x->una;
    x->last_progress = q_.now();
    pump(*x);
  });
}

void RoceEndpoint::on_ack(Qp& qp, uint32_t psn, bool nak) {
  // ACK psn: everything before psn arrived; NAK psn: psn is the one expected (go back to it).
  if (static_cast<int32_t>(psn - qp.una) > 0 && static_cast<int32_t>(qp.end - psn) >= 0) {
    while (qp.una != psn) {
      qp.lens.pop_front();
      ++qp.una;
    }
    qp.last_progress = q_.now();
    while (!qp.msgs.empty() && static_cast<int32_t>(qp.una - qp.msgs.front().end_psn) >= 0) {
      auto done = std::move(qp.msgs.front().done);
      qp.msgs.pop_front();
      if (done) done(q_.now());
    }
    if (static_cast<int32_t>(qp.next - qp.una) < 0) qp.next = qp.una;
  }
  if (nak && psn == qp.una && qp.next != qp.una) {
    stats_.retransmits += qp.next - qp.una;
    qp.next = qp.una;
  }
  pump(qp);
}

void RoceEndpoint::on_cnp(Qp& qp) {
  qp.rt = qp.rc;
  qp.rc = std::max(qp.rc * (1 - qp.alpha / 2), 0.01);
  qp.alpha = (1 - kG) * qp.alpha + kG;
  qp.cnp_in_period = true;
  qp.stage = qp.byte_stage = 0;
  qp.bytes_since = 0;
}

// The alpha timer and the rate-increase timer (both 55 us): fast recovery for F stages, then
// additive, then hyper increase once both the timer and the byte counter passed F stages.
void RoceEndpoint::dcqcn_timer(Qp& qp) {
  if (!qp.cnp_in_period) qp.alpha = (1 - kG) * qp.alpha;
  qp.cnp_in_period = false;
  if (qp.rc < line_gbps_) {
    ++qp.stage;
    const int st = std::max(qp.stage, qp.byte_stage);
    if (std::min(qp.stage, qp.byte_stage) > kFastRecovery) qp.rt += kRhaiGbps;
    else if (st > kFastRecovery) qp.rt += kRaiGbps;
    qp.rt = std::min(qp.rt, line_gbps_);
    qp.rc = std::min((qp.rt + qp.rc) / 2, line_gbps_);
  }
  static_assert(kRateTimer == kAlphaTimer, "one timer serves both");
  if (qp.una == qp.end && qp.rc >= line_gbps_) {
    qp.timers = false;  // idle at line rate: nothing to time
    return;
  }
  Qp* x = &qp;
  q_.at(q_.now() + kAlphaTimer, [this, x] { dcqcn_timer(*x); });
}

void RoceEndpoint::receive(Packet&& p) {
  if (p.head.size() < kHeader) return;
  const uint8_t type = p.head[0];
  const uint32_t qpn = get32(&p.head[4]);
  const uint32_t psn = get32(&p.head[8]);
  if (type == kData) {
    Rx& rx = rx_[{p.src_ip, qpn}];
    // The notification point: a CE mark turns into a CNP, at most one per interval.
    if (p.ce && q_.now() - rx.last_cnp >= kCnpInterval) {
      rx.last_cnp = q_.now();
      emit(p.src_ip, p.sport, p.plane, kCnp, qpn, 0, 0);
    }
    if (psn == rx.expected) {
      ++rx.expected;
      rx.nak_sent = false;
      emit(p.src_ip, p.sport, p.plane, kAck, qpn, rx.expected, 0);
    } else if (static_cast<int32_t>(psn - rx.expected) > 0) {
      // Out of sequence: a loss. One NAK until the expected packet arrives (go-back-N).
      if (!rx.nak_sent) {
        rx.nak_sent = true;
        emit(p.src_ip, p.sport, p.plane, kNak, qpn, rx.expected, 0);
      }
    } else {
      emit(p.src_ip, p.sport, p.plane, kAck, qpn, rx.expected, 0);  // a duplicate
    }
    return;
  }
  // Sender side: the QP by its number (1-based, in creation order).
  if (qpn == 0 || qpn > by_qpn_.size() || by_qpn_[qpn - 1]->peer_ip != p.src_ip) return;
  Qp& qp = *by_qpn_[qpn - 1];
  if (type == kCnp) on_cnp(qp);
  else on_ack(qp, psn, type == kNak);
}

}  // namespace metaroce::sim
