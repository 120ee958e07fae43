// SPDX-License-Identifier: Apache-2.0
// Background flows: Poisson arrivals per host, random destinations, fixed or heavy-tailed sizes.
#include "sim/background.h"

#include <algorithm>
#include <cmath>

namespace metaroce::sim {

namespace {
// Heavy-tailed sizes: Pareto with shape 1.2 from 4 KiB, clipped at 4 MiB (mean 19 KiB; half
// the flows are under 7.1 KiB, and the 3.6 % over 64 KiB carry 46 % of the bytes) -- the shape
// of the data-centre flow-size measurements, not any one of them.
constexpr double kShape = 1.2;
constexpr double kMinBytes = 4096, kMaxBytes = 4 << 20;
}  // namespace

Background::Background(EventQueue& q, std::vector<std::unique_ptr<HostModel>>& hosts,
                       BackgroundParams p)
    : q_(q), hosts_(hosts), p_(p) {
  // host_gbps is bits per ns: flows per ns = load * rate / (8 * mean flow bytes).
  per_ns_ = p_.load * p_.host_gbps / (8 * mean_bytes());
  for (size_t h = 0; h < hosts_.size(); ++h) rng_.emplace_back(p_.seed * 0x2545f4914f6cdd1dull + h);
}

double Background::mean_bytes() const {
  if (p_.flow_bytes) return static_cast<double>(p_.flow_bytes);
  // E[min(X, M)] for X Pareto(xm, a): xm + xm / (a - 1) * (1 - (xm / M)^(a - 1)).
  return kMinBytes + kMinBytes / (kShape - 1) * (1 - std::pow(kMinBytes / kMaxBytes, kShape - 1));
}

uint64_t Background::sample_bytes(Rng& rng) const {
  if (p_.flow_bytes) return p_.flow_bytes;
  const double u = 1 - rng.uniform();  // (0, 1]
  return static_cast<uint64_t>(std::min(kMaxBytes, kMinBytes * std::pow(u, -1 / kShape)));
}

void Background::start() {
  if (per_ns_ <= 0 || hosts_.size() < 2) return;
  for (uint32_t h = 0; h < hosts_.size(); ++h) {
    const double gap = -std::log(1 - rng_[h].uniform()) / per_ns_;
    q_.at(q_.now() + static_cast<Ns>(gap), [this, h] { arrival(h); });
  }
}

void Background::arrival(uint32_t host) {
  if (stopped_) return;
  Rng& rng = rng_[host];
  auto to = static_cast<uint32_t>(rng.next() % (hosts_.size() - 1));
  if (to >= host) ++to;
  const size_t f = flows_.size();
  flows_.push_back({q_.now(), -1, sample_bytes(rng), 0, to});
  const uint32_t stream = p_.first_stream + static_cast<uint32_t>(f % p_.streams);
  for (uint64_t off = 0; off < flows_[f].bytes; off += p_.msg_bytes) {
    const auto len = static_cast<uint32_t>(std::min(p_.msg_bytes, flows_[f].bytes - off));
    hosts_[host]->send(to, stream, len, [this, f, len](Ns t) {
      Flow& x = flows_[f];
      x.acked += len;
      if (x.acked == x.bytes) x.done = t;
    });
  }
  const double gap = -std::log(1 - rng.uniform()) / per_ns_;
  q_.at(q_.now() + std::max<Ns>(1, static_cast<Ns>(gap)), [this, host] { arrival(host); });
}

uint64_t Background::bytes_done() const {
  uint64_t b = 0;
  for (const Flow& f : flows_)
    if (f.done >= 0) b += f.bytes;
  return b;
}

std::vector<double> Background::fct_us(const std::function<bool(uint32_t)>& to) const {
  std::vector<double> v;
  for (const Flow& f : flows_)
    if (f.done >= 0 && (!to || to(f.to))) v.push_back(static_cast<double>(f.done - f.start) / 1000);
  return v;
}

}  // namespace metaroce::sim
