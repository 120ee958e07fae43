// SPDX-License-Identifier: Apache-2.0
// metaroce-sim: one scenario of the simulator, its figures as one JSON object on stdout
// (docs/simulation.md). The endpoints run datapath/transport itself; nothing here models it.
//
//   metaroce-sim [--hosts N] [--hosts-per-leaf K] [--spines S] [--planes P] [--parallel L]
//                [--gbps G] [--host-gbps G] [--delay-ns D] [--queue-kib Q] [--ecn-kib E]
//                [--loss P] [--paths N] [--rx-capacity-gbps G] [--conn-window-init W]
//                [--conn-window-max W] [--tail-probes N]
//                [--workload permutation|incast|allreduce|alltoall|pingpong]
//                [--flow-kib B]
//                [--msg-kib M] [--qps Q] [--fail-core-link-at-us T] [--seed S]
//                [--hint-interval-us T] [--fair-window-us T] [--memory on|off] [--slices S]
//                [--fair-series FILE] [--start-window N] [--late-detection on|off]
//                [--tail-redundancy on|off]
//   --start-window, --late-detection, --tail-redundancy: the transport's (EngineConfig), to
//     measure what each does (docs/simulation.md).
//   --workload pingpong [--exchanges N] [--message-bytes B]: hosts 0 and N-1 exchange N
//     one-packet messages of B bytes (default 1000 of 2 B), each sent when the other arrives;
//     with --fail-core-link-at-us, what the failure cost the exchange it hit (sim/pingpong.h).
//   --slices: all-reduce steps as S pipelined slices each, as NCCL moves a ring (default 1).
//   --fair-window-us: incast fairness windows (default 5 base RTTs, sliding by one base RTT).
//   --memory on: the transport's state per connection and per path at the end, and the peak RSS.
//   --fair-series: incast, each window's Jain index and senders' rates to FILE (gnuplot data).
//   --fail-core-link-at-us: the busiest leaf-spine (fat-tree: aggregation-core) link of plane 0
//     at that time goes down.
//                [--limit-ms L] [--transport metaroce|rocev2] [--roce-rto-us T]
//                [--pfc] [--pfc-xoff-kib X] [--pfc-xon-kib X]
//   --pfc: lossless fabric (PFC on every link, hosts' NICs included); off by default.
//                [--topology leafspine|fattree] [--k K]
//   --topology fattree: k-ary three-tier fat-tree (k even), k^3/4 hosts; --hosts, if given,
//     must agree; --hosts-per-leaf, --spines and --parallel do not apply.
//                [--background-load F] [--background-flow-kib B]
//   --background-load: besides the workload, each host sends flows to random hosts (Poisson
//     arrivals, F of its rate; --background-flow-kib each, or heavy-tailed sizes); counted apart,
//     and the run ends when the workload is done.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <sys/resource.h>

#include "datapath/transport/engine.h"
#include "datapath/transport/engine_impl.h"
#include "sim/background.h"
#include "sim/endpoint.h"
#include "sim/network.h"
#include "sim/pingpong.h"
#include "sim/rocev2.h"

using namespace metaroce;
using namespace metaroce::sim;

namespace {

struct Options {
  TopologyParams topo;
  uint32_t paths = 8;
  uint32_t rx_capacity_mbps = 0;  // receivers' fair-share hints (congestion.md §3); 0: none
  uint32_t conn_window_init = 0, conn_window_max = 0;  // 0: the transport's defaults
  uint32_t tail_probes = 0;
  bool late_detection = true, tail_redundancy = true;  // congestion.md §5.1, §5.2
  int start_window = -1;         // -1: the transport's default (congestion.md §3.4)
  double hint_interval_us = 0;   // 0: the transport's default
  double fair_window_us = 0;     // incast fairness windows; 0: 5 base RTTs
  std::string fair_series;       // incast: every bin's figures to this file (gnuplot data)
  bool mem = false;              // --memory on: the transport's state and the peak RSS
  std::string workload = "permutation";
  uint32_t exchanges = 1000, message_bytes = 2;  // pingpong
  uint64_t flow_bytes = 1 << 20, msg_bytes = 64 << 10;
  uint32_t qps = 1;
  uint32_t slices = 1;  // all-reduce: slices per step's chunk (NCCL-like pipelining)
  double fail_core_at_us = -1;
  Ns limit_ns = 1'000'000'000;
  std::string transport = "metaroce";
  RoceParams roce;
  PfcParams pfc;
  bool hosts_given = false;
  double background_load = 0;
  uint64_t background_flow_bytes = 0;  // 0: heavy-tailed
};

// Watches what a host receives, then hands it on.
class RxTap final : public Node {
 public:
  RxTap(Node* inner, std::function<void(const Packet&)> fn) : inner_(inner), fn_(std::move(fn)) {}
  void receive(Packet&& p) override {
    fn_(p);
    inner_->receive(std::move(p));
  }

 private:
  Node* inner_;
  std::function<void(const Packet&)> fn_;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "metaroce-sim: %s (see the comment at the top of sim/main.cc)\n", why);
  std::exit(2);
}

double number(const char* opt, const char* v, double lo, double hi) {
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (!end || *end || x < lo || x > hi) {
    std::fprintf(stderr, "metaroce-sim: bad %s '%s': expected %g..%g\n", opt, v, lo, hi);
    std::exit(2);
  }
  return x;
}

Options parse(int argc, char** argv) {
  Options o;
  o.topo.host_link.gbps = o.topo.fabric_link.gbps = 400;
  o.topo.host_link.delay_ns = o.topo.fabric_link.delay_ns = 1000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--pfc") {  // the one option without a value
      o.pfc.on = true;
      continue;
    }
    if (i + 1 >= argc) usage(("option " + a + " needs a value").c_str());
    const char* v = argv[++i];
    if (a == "--hosts") {
      o.topo.hosts = static_cast<uint32_t>(number("--hosts", v, 2, 1 << 16));
      o.hosts_given = true;
    }
    else if (a == "--hosts-per-leaf") o.topo.hosts_per_leaf = static_cast<uint32_t>(number(a.c_str(), v, 1, 1024));
    else if (a == "--spines") o.topo.spines = static_cast<uint32_t>(number(a.c_str(), v, 1, 1024));
    else if (a == "--planes") o.topo.planes = static_cast<uint32_t>(number(a.c_str(), v, 1, 16));
    else if (a == "--parallel") o.topo.parallel = static_cast<uint32_t>(number(a.c_str(), v, 1, 64));
    else if (a == "--gbps") o.topo.fabric_link.gbps = number(a.c_str(), v, 0.001, 1e4);
    else if (a == "--host-gbps") o.topo.host_link.gbps = number(a.c_str(), v, 0.001, 1e4);
    else if (a == "--delay-ns") o.topo.host_link.delay_ns = o.topo.fabric_link.delay_ns = static_cast<Ns>(number(a.c_str(), v, 0, 1e9));
    else if (a == "--queue-kib") o.topo.host_link.queue_bytes = o.topo.fabric_link.queue_bytes = static_cast<uint32_t>(number(a.c_str(), v, 8, 1 << 20) * 1024);
    else if (a == "--ecn-kib") o.topo.host_link.ecn_bytes = o.topo.fabric_link.ecn_bytes = static_cast<uint32_t>(number(a.c_str(), v, 0, 1 << 20) * 1024);
    else if (a == "--loss") o.topo.fabric_link.loss = number(a.c_str(), v, 0, 0.5);
    else if (a == "--rx-capacity-gbps")
      o.rx_capacity_mbps = static_cast<uint32_t>(number(a.c_str(), v, 0, 4e6) * 1000);
    else if (a == "--conn-window-init")
      o.conn_window_init = static_cast<uint32_t>(number(a.c_str(), v, 2, 65534));
    else if (a == "--conn-window-max")
      o.conn_window_max = static_cast<uint32_t>(number(a.c_str(), v, 2, 65534));
    else if (a == "--tail-probes")
      o.tail_probes = static_cast<uint32_t>(number(a.c_str(), v, 1, 16));
    else if (a == "--hint-interval-us") o.hint_interval_us = number(a.c_str(), v, 0.1, 1e6);
    else if (a == "--start-window") o.start_window = static_cast<int>(number(a.c_str(), v, 0, 4096));
    else if (a == "--late-detection" || a == "--tail-redundancy") {
      if (std::strcmp(v, "on") && std::strcmp(v, "off")) usage((a + ": on or off").c_str());
      (a == "--late-detection" ? o.late_detection : o.tail_redundancy) = !std::strcmp(v, "on");
    }
    else if (a == "--memory") {
      if (std::strcmp(v, "on") && std::strcmp(v, "off")) usage("--memory: on or off");
      o.mem = !std::strcmp(v, "on");
    } else if (a == "--fair-window-us") o.fair_window_us = number(a.c_str(), v, 0.01, 1e6);
    else if (a == "--fair-series") o.fair_series = v;
    else if (a == "--paths") o.paths = static_cast<uint32_t>(number(a.c_str(), v, 1, 256));
    else if (a == "--workload") {
      o.workload = v;
      if (o.workload != "permutation" && o.workload != "incast" && o.workload != "allreduce" &&
          o.workload != "alltoall" && o.workload != "pingpong")
        usage("--workload: permutation, incast, allreduce, alltoall or pingpong");
    } else if (a == "--exchanges") {
      o.exchanges = static_cast<uint32_t>(number(a.c_str(), v, 1, 1e7));
    } else if (a == "--message-bytes") {
      o.message_bytes = static_cast<uint32_t>(number(a.c_str(), v, 1, 4096));
    } else if (a == "--flow-kib") o.flow_bytes = static_cast<uint64_t>(number(a.c_str(), v, 1, 1 << 30) * 1024);
    else if (a == "--msg-kib") o.msg_bytes = static_cast<uint64_t>(number(a.c_str(), v, 1, 1 << 20) * 1024);
    else if (a == "--slices") o.slices = static_cast<uint32_t>(number(a.c_str(), v, 1, 64));
    else if (a == "--qps") o.qps = static_cast<uint32_t>(number(a.c_str(), v, 1, 1024));
    else if (a == "--fail-core-link-at-us") o.fail_core_at_us = number(a.c_str(), v, 0, 1e9);
    else if (a == "--seed") o.topo.seed = static_cast<uint64_t>(number(a.c_str(), v, 0, 1e18));
    else if (a == "--transport") {
      o.transport = v;
      if (o.transport != "metaroce" && o.transport != "rocev2") usage("--transport: metaroce or rocev2");
    } else if (a == "--roce-rto-us") o.roce.rto_ns = static_cast<Ns>(number(a.c_str(), v, 1, 1e7) * 1000);
    else if (a == "--topology") {
      if (std::strcmp(v, "leafspine") == 0) o.topo.kind = TopologyKind::kLeafSpine;
      else if (std::strcmp(v, "fattree") == 0) o.topo.kind = TopologyKind::kFatTree;
      else usage("--topology: leafspine or fattree");
    } else if (a == "--k") o.topo.k = static_cast<uint32_t>(number(a.c_str(), v, 2, 64));
    else if (a == "--background-load") o.background_load = number(a.c_str(), v, 0, 1);
    else if (a == "--background-flow-kib")
      o.background_flow_bytes = static_cast<uint64_t>(number(a.c_str(), v, 1, 1 << 20) * 1024);
    else if (a == "--pfc-xoff-kib") o.pfc.xoff_bytes = static_cast<uint32_t>(number(a.c_str(), v, 1, 1 << 16) * 1024);
    else if (a == "--pfc-xon-kib") o.pfc.xon_bytes = static_cast<uint32_t>(number(a.c_str(), v, 0, 1 << 16) * 1024);
    else if (a == "--limit-ms") o.limit_ns = static_cast<Ns>(number(a.c_str(), v, 0.001, 1e7) * 1e6);
    else usage(("unknown option " + a).c_str());
  }
  if (o.topo.kind == TopologyKind::kFatTree) {
    if (o.topo.k % 2) usage("--k must be even");
    const uint32_t hosts = o.topo.k * o.topo.k * o.topo.k / 4;
    if (o.hosts_given && o.topo.hosts != hosts) usage("--hosts must be k^3/4 on a fat-tree");
    o.topo.hosts = hosts;
    o.topo.hosts_per_leaf = o.topo.k / 2;  // per edge switch; not used to build it
  }
  if (o.topo.hosts % o.topo.hosts_per_leaf) usage("--hosts must be a multiple of --hosts-per-leaf");
  if (o.pfc.xon_bytes > o.pfc.xoff_bytes) usage("--pfc-xon-kib must be at most --pfc-xoff-kib");
  o.topo.host_link.pfc = o.topo.fabric_link.pfc = o.pfc;
  return o;
}

struct Flow {
  uint32_t from = 0, to = 0;
  uint64_t bytes = 0, acked = 0;
  Ns done = -1;
  std::vector<size_t> then;  // flows that start when this one is done (a collective's steps)
  uint32_t waits = 1;        // of the flows that name it in `then`, how many must be done
  bool at_start = true;
};

Flow flow(uint32_t from, uint32_t to, uint64_t bytes) {
  Flow f;
  f.from = from;
  f.to = to;
  f.bytes = bytes;
  return f;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5))];
}

// PFC's figures: pause frames sent, time transmitters spent paused (all of them, and hosts' NICs
// alone), packets past a headroom (0 unless it is too small), the most bytes held for one link.
void print_pfc(Topology& topo, const TopologyParams& p) {
  uint64_t frames = 0, headroom = 0;
  Ns paused = 0, host_paused = 0;
  uint32_t held = 0;
  for (const auto& l : topo.links()) {
    frames += l->counters().pause_frames;
    headroom += l->counters().drop_headroom;
    held = std::max(held, l->counters().max_held);
    paused += l->paused_ns();
  }
  for (uint32_t pl = 0; pl < p.planes; ++pl)
    for (uint32_t h = 0; h < p.hosts; ++h) host_paused += topo.uplink(h, pl)->paused_ns();
  std::printf(", \"pfc_pause_frames\": %" PRIu64 ", \"pfc_paused_us\": %.3f"
              ", \"pfc_host_paused_us\": %.3f, \"pfc_headroom_drops\": %" PRIu64
              ", \"pfc_max_held_kib\": %.1f",
              frames, static_cast<double>(paused) / 1000, static_cast<double>(host_paused) / 1000,
              headroom, held / 1024.0);
}

// Background traffic's figures, apart from the workload's; under incast, also of its victims:
// background flows that do not go to its receiver (host 0), slowed only by sharing the fabric
// with it (head-of-line blocking, under PFC).
void print_background(const Background& bg, const Options& o) {
  const std::vector<double> fct = bg.fct_us();
  std::printf(", \"background_load\": %.3f, \"bg_flows\": %" PRIu64 ", \"bg_unfinished\": %" PRIu64
              ", \"bg_mean_kib\": %.1f, \"bg_fct_p50_us\": %.3f, \"bg_fct_p99_us\": %.3f",
              o.background_load, bg.flows(), bg.flows() - fct.size(), bg.mean_bytes() / 1024,
              percentile(fct, 0.5), percentile(fct, 0.99));
  if (o.workload == "incast") {
    const std::vector<double> v = bg.fct_us([](uint32_t to) { return to != 0; });
    std::printf(", \"bg_victim_fct_p50_us\": %.3f, \"bg_victim_fct_p99_us\": %.3f",
                percentile(v, 0.5), percentile(v, 0.99));
  }
}

// The ping-pong workload between hosts 0 and N-1: its own figures (sim/pingpong.h).
int pingpong(const Options& o, EventQueue& q, Topology& topo,
             std::vector<std::unique_ptr<HostModel>>& hosts,
             std::chrono::steady_clock::time_point wall0) {
  if (o.transport != "metaroce" || hosts.size() < 2)
    usage("--workload pingpong: --transport metaroce and at least 2 hosts");
  auto& a = static_cast<Endpoint&>(*hosts.front());
  auto& b = static_cast<Endpoint&>(*hosts.back());
  PingPongParams p;
  p.exchanges = o.exchanges;
  p.bytes = o.message_bytes;
  p.fail_core_at_us = o.fail_core_at_us;
  p.limit_ns = o.limit_ns;
  uint32_t left = 0;
  const std::string figures = run_pingpong(q, topo, a, b, p, &left);
  HostStats s;
  for (const auto& h : hosts) s += h->stats();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  std::printf("{\"transport\": \"%s\", \"workload\": \"pingpong\", \"hosts\": %u, \"planes\": %u"
              ", \"paths\": %u, \"seed\": %" PRIu64 ", \"unfinished\": %u, \"failed_messages\": %" PRIu64
              "%s, \"retransmits\": %" PRIu64 ", \"timeouts\": %" PRIu64 ", \"tail_probes\": %" PRIu64
              ", \"paths_failed\": %" PRIu64 ", \"failover_resends\": %" PRIu64
              ", \"events\": %" PRIu64 ", \"wall_s\": %.3f}\n",
              o.transport.c_str(), o.topo.hosts, o.topo.planes, o.paths, o.topo.seed, left, s.failed,
              figures.c_str(), s.retransmits, s.timeouts, s.tail_probes, s.paths_failed,
              s.failover_resends, q.executed(), wall);
  return left || s.failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const auto wall0 = std::chrono::steady_clock::now();
  EventQueue q;
  Rng rng(o.topo.seed);
  Topology topo(q, rng, o.topo);

  transport::EngineConfig cfg;
  cfg.num_paths = static_cast<uint16_t>(o.paths);
  cfg.num_planes = static_cast<uint8_t>(o.topo.planes);
  cfg.seed = o.topo.seed;
  cfg.rx_capacity_mbps = o.rx_capacity_mbps;
  if (o.conn_window_init) cfg.conn_window_init = o.conn_window_init;
  if (o.conn_window_max) cfg.conn_window_max = o.conn_window_max;
  if (o.tail_probes) cfg.tail_probes = static_cast<uint8_t>(o.tail_probes);
  cfg.late_detection = o.late_detection;
  cfg.tail_redundancy = o.tail_redundancy;
  if (o.start_window >= 0) cfg.start_window = static_cast<uint32_t>(o.start_window);
  if (o.hint_interval_us > 0)
    cfg.hint_interval = transport::Time(static_cast<int64_t>(o.hint_interval_us * 1000));
  std::vector<std::unique_ptr<HostModel>> hosts;
  for (uint32_t h = 0; h < o.topo.hosts; ++h) {
    if (o.transport == "metaroce") hosts.push_back(std::make_unique<Endpoint>(q, topo, h, cfg));
    else hosts.push_back(std::make_unique<RoceEndpoint>(q, topo, h, o.topo.planes,
                                                        o.topo.host_link.gbps, o.roce));
  }

  if (o.workload == "pingpong") return pingpong(o, q, topo, hosts, wall0);

  // Incast fairness: what reaches host 0 from each sender, in steps of one base RTT (the
  // propagation delay of a path across the top tier and back: 4 links each way on a leaf-spine,
  // 6 on a fat-tree); Jain's index is taken over windows of --fair-window-us (default 5 base RTTs,
  // long enough for each of 63 senders' fair share to be several packets) sliding by one step.
  const Ns base_rtt = std::max<Ns>(
      (o.topo.kind == TopologyKind::kFatTree ? 12 : 8) * o.topo.fabric_link.delay_ns, 1);
  const Ns window = o.fair_window_us > 0 ? static_cast<Ns>(o.fair_window_us * 1000) : 5 * base_rtt;
  const size_t window_steps = static_cast<size_t>(std::max<Ns>((window + base_rtt - 1) / base_rtt, 1));
  std::vector<std::vector<uint64_t>> rx_steps;  // [step][sender]
  RxTap tap(hosts[0].get(), [&](const Packet& p) {
    const size_t b = static_cast<size_t>(q.now() / base_rtt);
    if (rx_steps.size() <= b) rx_steps.resize(b + 1, std::vector<uint64_t>(o.topo.hosts, 0));
    rx_steps[b][Topology::host_of(p.src_ip)] += p.length;
  });
  if (o.workload == "incast") topo.attach(0, &tap);

  // Who sends to whom: a random derangement (permutation); everyone to host 0 (incast); ring
  // all-reduce of a --flow-kib buffer per host (2(N-1) steps of buffer/N to the next host, each
  // step once the previous one's chunk has arrived); all-to-all (--flow-kib per host, split over
  // every other host).
  std::vector<Flow> flows;
  const uint32_t n = o.topo.hosts;
  if (o.workload == "permutation") {
    std::vector<uint32_t> perm(n);
    for (uint32_t i = 0; i < n; ++i) perm[i] = i;
    Rng prng(o.topo.seed * 31 + 7);
    for (uint32_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[prng.next() % i]);  // Sattolo
    for (uint32_t i = 0; i < n; ++i) flows.push_back(flow(i, perm[i], o.flow_bytes));
  } else if (o.workload == "incast") {
    for (uint32_t i = 1; i < n; ++i) flows.push_back(flow(i, 0, o.flow_bytes));
  } else if (o.workload == "alltoall") {
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t j = 0; j < n; ++j)
        if (i != j) flows.push_back(flow(i, j, std::max<uint64_t>(o.flow_bytes / (n - 1), 1)));
  } else {
    // Each step's chunk goes as --slices slices, as NCCL pipelines a ring through its buffer
    // slots: slice k of (step st, host i) waits for slice k of (st - 1, host i - 1), the data it
    // forwards, and, with more than one slice, for its own slice k of step st - 1 (the slot
    // it reuses at the next host). One slice: each step waits for the whole previous chunk.
    const uint64_t chunk = std::max<uint64_t>(o.flow_bytes / n, 1);
    const uint32_t steps = 2 * (n - 1), sl = o.slices;
    const uint64_t slice = std::max<uint64_t>(chunk / sl, 1);
    auto idx = [&](uint32_t st, uint32_t i, uint32_t k) { return (size_t{st} * n + i) * sl + k; };
    for (uint32_t st = 0; st < steps; ++st)
      for (uint32_t i = 0; i < n; ++i)
        for (uint32_t k = 0; k < sl; ++k) flows.push_back(flow(i, (i + 1) % n, slice));
    for (uint32_t st = 1; st < steps; ++st)
      for (uint32_t i = 0; i < n; ++i)
        for (uint32_t k = 0; k < sl; ++k) {
          const size_t f = idx(st, i, k);
          flows[f].at_start = false;
          flows[idx(st - 1, (i + n - 1) % n, k)].then.push_back(f);
          if (sl > 1) {
            flows[f].waits = 2;
            flows[idx(st - 1, i, k)].then.push_back(f);
          }
        }
  }
  // Background flows, if asked: the run ends when the workload's last flow is done.
  std::unique_ptr<Background> background;
  size_t workload_left = flows.size();
  if (o.background_load > 0) {
    BackgroundParams bp;
    bp.load = o.background_load;
    bp.host_gbps = o.topo.host_link.gbps * o.topo.planes;
    bp.flow_bytes = o.background_flow_bytes;
    bp.msg_bytes = o.msg_bytes;
    bp.first_stream = o.qps + 1;  // the workload's streams are 1..qps
    bp.seed = o.topo.seed;
    background = std::make_unique<Background>(q, hosts, bp);
    background->start();
  }
  std::function<void(size_t)> start = [&](size_t f) {
    Flow& fl = flows[f];
    for (uint64_t off = 0; off < fl.bytes; off += o.msg_bytes) {
      const auto len = static_cast<uint32_t>(std::min(o.msg_bytes, fl.bytes - off));
      const uint32_t stream = 1 + static_cast<uint32_t>((off / o.msg_bytes) % o.qps);
      hosts[fl.from]->send(fl.to, stream, len, [&, f, len](Ns t) {
        Flow& x = flows[f];
        x.acked += len;
        if (x.acked != x.bytes) return;
        x.done = t;
        for (size_t g : x.then)
          if (--flows[g].waits == 0) start(g);
        if (--workload_left == 0 && background) q.stop();
      });
    }
  };
  for (size_t f = 0; f < flows.size(); ++f)
    if (flows[f].at_start) start(f);
  if (o.fail_core_at_us >= 0) {
    q.at(static_cast<Ns>(o.fail_core_at_us * 1000),
         [&topo] { topo.busiest_core_link(0)->set_up(false); });
  }
  q.run_until(o.limit_ns);

  std::vector<double> fct_us;
  uint64_t bytes = 0, unfinished = 0;
  Ns last = 0;
  for (const Flow& f : flows) {
    if (f.done < 0) {
      ++unfinished;
      continue;
    }
    fct_us.push_back(static_cast<double>(f.done) / 1000);
    bytes += f.bytes;
    last = std::max(last, f.done);
  }
  uint64_t drop_queue = 0, drop_loss = 0, drop_down = 0, ce = 0;
  for (const auto& l : topo.links()) {
    drop_queue += l->counters().drop_queue;
    drop_loss += l->counters().drop_loss;
    drop_down += l->counters().drop_down;
    ce += l->counters().ce_marked;
  }
  HostStats sum;
  for (const auto& h : hosts) sum += h->stats();
  const uint64_t retx = sum.retransmits, timeouts = sum.timeouts, failed = sum.failed,
                 paths_failed = sum.paths_failed, failover = sum.failover_resends,
                 tlp = sum.tail_probes, late = sum.late_losses, late_spurious = sum.late_spurious,
                 redundant = sum.redundant_copies;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  const double goodput = last ? static_cast<double>(bytes) * 8 / static_cast<double>(last) : 0;  // Gbit/s
  // All-reduce bus bandwidth (as NCCL reports it): 2(N-1)/N x buffer / time, per host.
  const double busbw = (o.workload == "allreduce" && last && !unfinished)
                           ? 2.0 * (n - 1) / n * static_cast<double>(o.flow_bytes) * 8 /
                                 static_cast<double>(last)
                           : 0;
  const double host_rate = o.topo.host_link.gbps * o.topo.planes;  // a port per plane
  std::string extra;
  if (o.transport == "metaroce" && o.mem) {
    // The transport's state at the end of the run, from its containers (hash indices aside),
    // and the process's peak resident size (links, queues and the event queue included).
    transport::EngineImpl::Footprint t;
    for (const auto& h : hosts) {
      const auto& engine = static_cast<Endpoint&>(*h).engine();
      const auto* e = dynamic_cast<const transport::EngineImpl*>(&engine);
      if (e) t += e->footprint();
    }
    auto per = [](uint64_t bytes, uint64_t n) {
      return n ? static_cast<double>(bytes) / static_cast<double>(n) : 0.0;
    };
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  ", \"connections\": %" PRIu64 ", \"bytes_per_connection\": %.0f"
                  ", \"tx_paths\": %" PRIu64 ", \"bytes_per_tx_path\": %.0f"
                  ", \"rx_paths\": %" PRIu64 ", \"bytes_per_rx_path\": %.0f"
                  ", \"records\": %" PRIu64 ", \"record_bytes\": %" PRIu64
                  ", \"transport_mib\": %.1f, \"max_rss_mib\": %.1f",
                  t.connections, per(t.conn_bytes, t.connections), t.tx_paths,
                  per(t.tx_path_bytes, t.tx_paths), t.rx_paths, per(t.rx_path_bytes, t.rx_paths),
                  t.records, t.record_bytes,
                  static_cast<double>(t.conn_bytes + t.tx_path_bytes + t.rx_path_bytes +
                                      t.record_bytes + t.slot_bytes) / (1 << 20),
                  static_cast<double>(ru.ru_maxrss) / 1024);
    extra = buf;
  }
  if (o.workload == "incast") {
    // Jain's index of the senders' bytes in each window that ends before the first flow finishes
    // (while every sender still sends); settled: the first window start, in base RTTs, from
    // which every window's index is >= 0.99; and the senders' shares over all windows from
    // 2 base RTTs on together.
    Ns first_done = INT64_MAX;
    for (const Flow& f : flows) first_done = std::min(first_done, f.done < 0 ? INT64_MAX : f.done);
    auto jain = [n](auto value) {
      double sum = 0, sq = 0;
      for (uint32_t i = 1; i < n; ++i) {
        const double x = value(i);
        sum += x;
        sq += x * x;
      }
      return sq > 0 ? sum * sum / ((n - 1) * sq) : 0.0;
    };
    const size_t full_steps = first_done == INT64_MAX
                                  ? rx_steps.size()
                                  : std::min(rx_steps.size(), static_cast<size_t>(first_done / base_rtt));
    std::vector<double> jains;  // by window start, in steps
    std::vector<uint64_t> win(n, 0);
    for (size_t k = 0; k + window_steps <= full_steps; ++k) {
      std::fill(win.begin(), win.end(), 0);
      for (size_t b = k; b < k + window_steps; ++b)
        for (uint32_t i = 1; i < n; ++i) win[i] += rx_steps[b][i];
      jains.push_back(jain([&](uint32_t i) { return static_cast<double>(win[i]); }));
    }
    size_t settled = jains.size();
    while (settled > 0 && jains[settled - 1] >= 0.99) --settled;
    double min_after2 = 1;
    for (size_t k = 2; k < jains.size(); ++k) min_after2 = std::min(min_after2, jains[k]);
    std::vector<double> share(n, 0);
    for (size_t b = 2; b < full_steps; ++b)
      for (uint32_t i = 1; i < n; ++i) share[i] += static_cast<double>(rx_steps[b][i]);
    const double jain_after2 = jain([&](uint32_t i) { return share[i]; });
    if (!o.fair_series.empty()) {
      // Per window start: Jain's index, the slowest and fastest sender's rate and the total.
      FILE* f = std::fopen(o.fair_series.c_str(), "w");
      if (!f) usage(("--fair-series: cannot write " + o.fair_series).c_str());
      std::fprintf(f, "# window_start_us jain min_gbps max_gbps total_gbps (window %.1f us)\n",
                   static_cast<double>(window_steps * base_rtt) / 1000);
      const double to_gbps = 8.0 / static_cast<double>(window_steps * base_rtt);
      for (size_t k = 0; k < jains.size(); ++k) {
        uint64_t lo = UINT64_MAX, hi = 0, sum = 0;
        for (uint32_t i = 1; i < n; ++i) {
          uint64_t x = 0;
          for (size_t b = k; b < k + window_steps; ++b) x += rx_steps[b][i];
          lo = std::min(lo, x);
          hi = std::max(hi, x);
          sum += x;
        }
        std::fprintf(f, "%.3f %.4f %.3f %.3f %.3f\n", static_cast<double>(k * base_rtt) / 1000,
                     jains[k], static_cast<double>(lo) * to_gbps,
                     static_cast<double>(hi) * to_gbps, static_cast<double>(sum) * to_gbps);
      }
      std::fclose(f);
    }
    auto first = [&](size_t k) { return k < jains.size() ? jains[k] : 0.0; };
    const double settled_rtts = settled == jains.size() ? -1.0 : static_cast<double>(settled);
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  ", \"fair_window_us\": %.3f, \"fair_windows\": %zu"
                  ", \"jain_first_windows\": [%.4f, %.4f, %.4f, %.4f], \"jain_settled_rtts\": %.2f"
                  ", \"jain_min_after_2rtt\": %.4f, \"jain_after_2rtt\": %.4f",
                  static_cast<double>(window_steps * base_rtt) / 1000, jains.size(), first(0),
                  first(1), first(2), first(3), settled_rtts, min_after2, jain_after2);
    extra += buf;
  }
  std::printf(
      "{\"transport\": \"%s\", \"workload\": \"%s\", \"hosts\": %u, \"planes\": %u, \"paths\": %u, \"seed\": %" PRIu64
      ", \"flows\": %zu, \"unfinished\": %" PRIu64 ", \"failed_messages\": %" PRIu64
      ", \"completion_us\": %.3f, \"fct_p50_us\": %.3f, \"fct_p99_us\": %.3f"
      ", \"goodput_gbps\": %.3f, \"goodput_per_flow_of_host_rate\": %.4f, \"busbw_gbps\": %.3f"
      ", \"drop_queue\": %" PRIu64 ", \"drop_loss\": %" PRIu64 ", \"drop_down\": %" PRIu64
      ", \"ce_marked\": %" PRIu64 ", \"retransmits\": %" PRIu64 ", \"timeouts\": %" PRIu64
      ", \"paths_failed\": %" PRIu64 ", \"failover_resends\": %" PRIu64
      ", \"tail_probes\": %" PRIu64 ", \"late_losses\": %" PRIu64 ", \"late_spurious\": %" PRIu64
      ", \"redundant_copies\": %" PRIu64 ", \"events\": %" PRIu64 ", \"wall_s\": %.3f%s",
      o.transport.c_str(), o.workload.c_str(), n, o.topo.planes, o.paths, o.topo.seed, flows.size(), unfinished, failed,
      static_cast<double>(last) / 1000, percentile(fct_us, 0.5), percentile(fct_us, 0.99), goodput,
      fct_us.empty() ? 0.0 : goodput / static_cast<double>(flows.size()) / host_rate, busbw,
      drop_queue,
      drop_loss, drop_down, ce, retx, timeouts, paths_failed, failover, tlp, late, late_spurious,
      redundant, q.executed(), wall,
      extra.c_str());
  if (o.topo.kind == TopologyKind::kFatTree)
    std::printf(", \"topology\": \"fattree\", \"k\": %u", o.topo.k);
  if (o.pfc.on) print_pfc(topo, o.topo);
  if (background) print_background(*background, o);
  std::printf("}\n");
  return unfinished || failed ? 1 : 0;
}
