// SPDX-License-Identifier: Apache-2.0
#include "sim/pingpong.h"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace metaroce::sim {

namespace {

double us(Ns t) { return static_cast<double>(t) / 1000; }

double quantile(std::vector<Ns> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto at = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return us(v[std::min(v.size() - 1, at)]);
}

}  // namespace

std::string run_pingpong(EventQueue& q, Topology& topo, Endpoint& a, Endpoint& b,
                         const PingPongParams& p, uint32_t* left) {
  constexpr uint32_t kStream = 1;
  std::vector<Ns> ends;  // when each exchange's answer arrived back at a
  uint32_t next_at_a = 0, next_at_b = 0;  // msn expected next (a copy seen twice counts once)
  auto noop = [](Ns) {};
  b.on_arrival([&](uint32_t, uint32_t stream, uint32_t msn) {
    if (stream != kStream || msn != next_at_b) return;
    ++next_at_b;
    b.send(a.host(), kStream, p.bytes, noop);
  });
  a.on_arrival([&](uint32_t, uint32_t stream, uint32_t msn) {
    if (stream != kStream || msn != next_at_a) return;
    ++next_at_a;
    ends.push_back(q.now());
    if (ends.size() < p.exchanges) a.send(b.host(), kStream, p.bytes, noop);
    else q.stop();
  });
  a.send(b.host(), kStream, p.bytes, noop);
  if (p.fail_core_at_us >= 0) {
    q.at(static_cast<Ns>(p.fail_core_at_us * 1000),
         [&topo] { topo.busiest_core_link(0)->set_up(false); });
  }
  q.run_until(p.limit_ns);
  a.on_arrival(nullptr);
  b.on_arrival(nullptr);

  // Exchange i lasts from the previous answer (or the start) to its own answer. Before: the
  // exchanges that ended before the failure (all of them without one); after: the rest, of
  // which the failure may hit one or several (each direction's packets meet the dead link on
  // their own paths, at their own time).
  std::vector<Ns> before, after;
  Ns prev = 0;
  const Ns fail_at = p.fail_core_at_us >= 0 ? static_cast<Ns>(p.fail_core_at_us * 1000) : -1;
  for (Ns e : ends) {
    (fail_at >= 0 && e > fail_at ? after : before).push_back(e - prev);
    prev = e;
  }
  *left = p.exchanges - static_cast<uint32_t>(ends.size());
  const double p50 = quantile(before, 0.5);
  double excess = 0;  // what the exchanges after the failure took beyond the clean p50
  for (Ns t : after) excess += std::max(0.0, us(t) - p50);
  const double worst = quantile(after, 1.0);
  char buf[640];
  std::snprintf(buf, sizeof buf,
                ", \"exchanges\": %zu, \"message_bytes\": %u, \"exchange_p50_us\": %.3f"
                ", \"exchange_p99_us\": %.3f, \"exchange_max_us\": %.3f"
                ", \"after_failure_worst_us\": %.3f, \"after_failure_worst_x_p50\": %.2f"
                ", \"after_failure_slow\": %zu, \"after_failure_excess_x_p50\": %.2f",
                ends.size(), p.bytes, p50, quantile(before, 0.99), quantile(before, 1.0), worst,
                p50 > 0 ? worst / p50 : 0.0,
                static_cast<size_t>(std::count_if(after.begin(), after.end(),
                                                  [&](Ns t) { return us(t) > 1.5 * p50; })),
                p50 > 0 ? excess / p50 : 0.0);
  return buf;
}

}  // namespace metaroce::sim
