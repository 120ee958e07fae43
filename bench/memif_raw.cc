// SPDX-License-Identifier: Apache-2.0
// memif_raw: the physical limits of this host, raw DPDK memif between two processes, printed as
// one JSON line: packet rate measured at the receiver (the yardstick for ib_write_bw over
// MetaRoCE in the same run), or with --pingpong the round-trip time of one frame at a time (the
// yardstick for ib_write_lat / ib_send_lat).
//
//   memif_raw [--role both|server|client] [--socket NAME] [--size BYTES] [--seconds S]
//             [--burst N] [--pin] [--hugepages] [--pingpong [--iterations N] [--warmup N]]
//
// Throughput: the server receives and measures, the client sends. Ping-pong: the client sends a
// frame, waits for it to come back and measures; the server echoes. `both` (the default) forks
// one of each and waits for them. Every process ends by itself: the measuring side after S
// seconds (or N round trips), the other when asked to stop, and everything at a hard deadline.
#include <getopt.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr uint16_t kMaxBurst = 256;
constexpr auto kConnectLimit = 10s;  // a peer that has not shown up by then never will
constexpr auto kFirstPacketLimit = 10s;
constexpr uint64_t kStopMarker = ~uint64_t{0};  // sequence number of the receiver's "stop" frame

struct Options {
  std::string role = "both";
  std::string socket;
  uint32_t size = 4096;
  double seconds = 5;
  uint16_t burst = 32;
  bool pin = false;
  bool hugepages = false;
  bool pingpong = false;
  uint32_t iterations = 10000;  // measured round trips (--pingpong)
  uint32_t warmup = 1000;       // round trips before measuring: caches, page faults, the scheduler
};

[[noreturn]] void usage(const char* why) {
  fprintf(stderr,
          "memif_raw: %s\nusage: memif_raw [--role both|server|client] [--socket NAME] "
          "[--size BYTES] [--seconds S] [--burst N] [--pin] [--hugepages]\n"
          "                 [--pingpong [--iterations N] [--warmup N]]\n",
          why);
  exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  static const option longs[] = {
      {"role", required_argument, nullptr, 'r'},   {"socket", required_argument, nullptr, 's'},
      {"size", required_argument, nullptr, 'z'},   {"seconds", required_argument, nullptr, 't'},
      {"burst", required_argument, nullptr, 'b'},  {"pin", no_argument, nullptr, 'p'},
      {"hugepages", no_argument, nullptr, 'H'},    {"help", no_argument, nullptr, 'h'},
      {"pingpong", no_argument, nullptr, 'P'},     {"iterations", required_argument, nullptr, 'n'},
      {"warmup", required_argument, nullptr, 'w'},
      {nullptr, 0, nullptr, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "", longs, nullptr)) != -1) {
    switch (c) {
      case 'r': o.role = optarg; break;
      case 's': o.socket = optarg; break;
      case 'z': o.size = static_cast<uint32_t>(strtoul(optarg, nullptr, 10)); break;
      case 't': o.seconds = strtod(optarg, nullptr); break;
      case 'b': o.burst = static_cast<uint16_t>(strtoul(optarg, nullptr, 10)); break;
      case 'p': o.pin = true; break;
      case 'H': o.hugepages = true; break;
      case 'P': o.pingpong = true; break;
      case 'n': o.iterations = static_cast<uint32_t>(strtoul(optarg, nullptr, 10)); break;
      case 'w': o.warmup = static_cast<uint32_t>(strtoul(optarg, nullptr, 10)); break;
      case 'h': usage("help");
      default: usage("bad option");
    }
  }
  if (o.role != "both" && o.role != "server" && o.role != "client") usage("bad --role");
  // Throughput frames carry a sequence number; ping-pong frames may be as small as a perftest
  // payload (one frame in flight needs no sequence to be matched).
  if (o.size < (o.pingpong ? 1u : 64u) || o.size > 9216)
    usage(o.pingpong ? "--size must be 1..9216" : "--size must be 64..9216");
  if (!(o.seconds > 0 && o.seconds <= 600)) usage("--seconds must be in (0, 600]");
  if (o.burst == 0 || o.burst > kMaxBurst) usage("--burst must be 1..256");
  if (o.iterations == 0 || o.iterations > 10'000'000) usage("--iterations must be 1..10000000");
  if (o.warmup > 10'000'000) usage("--warmup must be 0..10000000");
  if (o.socket.empty()) o.socket = "/metaroce-memif-raw-" + std::to_string(getpid());
  return o;
}

// Packet buffers: one shared memif buffer and one mbuf per packet, never chains.
uint16_t buffer_size(uint32_t size) { return static_cast<uint16_t>((size + 127) / 128 * 128); }

std::string cpu_list(int only_cpu) {
  if (only_cpu >= 0) return std::to_string(only_cpu);
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof(set), &set);
  std::string out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    if (!out.empty()) out += ',';
    out += std::to_string(cpu);
  }
  return out.empty() ? "0" : out;
}

// The n-th CPU this process may run on, or -1.
int nth_cpu(int n) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return -1;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set) && n-- == 0) return cpu;
  return -1;
}

class MemifEnd {
 public:
  MemifEnd(const Options& o, bool server, int cpu) : opt_(o), server_(server) {
    const std::string prefix = "memif_raw-" + std::to_string(getpid());
    const std::string vdev = "--vdev=net_memif0,role=" + std::string(server ? "server" : "client") +
                             ",socket=" + o.socket + ",bsize=" + std::to_string(buffer_size(o.size));
    std::vector<std::string> args = {server ? "memif_raw-server" : "memif_raw-client",
                                     "--no-pci", "--no-shconf", "--no-telemetry",
                                     "--file-prefix", prefix,
                                     "--lcores=0@(" + cpu_list(cpu) + ")",
                                     "--log-level=*:error", vdev};
    if (!o.hugepages) args.insert(args.end(), {"--no-huge", "-m", "256"});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (rte_eal_init(static_cast<int>(args.size()), argv.data()) < 0) fail("EAL init");
    eal_up_ = true;
    if (rte_eth_dev_count_avail() < 1) fail("no memif port");
    port_ = 0;
    pool_ = rte_pktmbuf_pool_create("pool", 8191, 256, 0,
                                    static_cast<uint16_t>(buffer_size(o.size) +
                                                          RTE_PKTMBUF_HEADROOM),
                                    static_cast<int>(rte_socket_id()));
    if (pool_ == nullptr) fail("mbuf pool");
    rte_eth_conf conf{};
    if (rte_eth_dev_configure(port_, 1, 1, &conf) != 0) fail("configure");
    if (rte_eth_rx_queue_setup(port_, 0, 1024, rte_socket_id(), nullptr, pool_) != 0)
      fail("rx queue");
    if (rte_eth_tx_queue_setup(port_, 0, 1024, rte_socket_id(), nullptr) != 0) fail("tx queue");
    // A memif client cannot start before its server listens: retry until the connect limit.
    const auto deadline = Clock::now() + kConnectLimit;
    while (rte_eth_dev_start(port_) != 0) {
      if (server || Clock::now() > deadline) fail("start");
      std::this_thread::sleep_for(100ms);
    }
  }

  ~MemifEnd() {
    if (!eal_up_) return;
    // Stopping disconnects memif cleanly. When the peer has already hung up, memif's control
    // thread is tearing the connection down itself, and a second teardown racing it frees memory
    // twice (22.11); closing the port or rte_eal_cleanup() add nothing for a process that exits.
    if (link_up()) rte_eth_dev_stop(port_);
    const std::string runtime_dir = rte_eal_get_runtime_dir();
    // EAL leaves its runtime folder behind; a benchmark run many times should not.
    std::error_code ec;
    std::filesystem::remove_all(runtime_dir, ec);
  }

  bool link_up() const {
    rte_eth_link link{};
    return rte_eth_link_get_nowait(port_, &link) == 0 && link.link_status != 0;
  }

  // Waits for the peer; a client that started before its server reconnects by restarting.
  bool connect() {
    const auto deadline = Clock::now() + kConnectLimit;
    auto retry = Clock::now() + 500ms;
    while (!link_up()) {
      if (Clock::now() > deadline) return false;
      if (!server_ && Clock::now() > retry) {
        rte_eth_dev_stop(port_);
        if (rte_eth_dev_start(port_) != 0) return false;  // the server went away meanwhile
        retry = Clock::now() + 500ms;
      }
      std::this_thread::sleep_for(2ms);
    }
    return true;
  }

  int receive() {
    rte_mbuf* bufs[kMaxBurst];
    const auto first_deadline = Clock::now() + kFirstPacketLimit;
    uint64_t packets = 0, bytes = 0, lost = 0, misordered = 0, expect = 0;
    Clock::time_point start{};
    const auto window = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(opt_.seconds));
    for (;;) {
      const uint16_t n = rte_eth_rx_burst(port_, 0, bufs, opt_.burst);
      if (n == 0) {
        if (packets == 0 && Clock::now() > first_deadline) {
          fprintf(stderr, "memif_raw: no packet within %llds\n",
                  static_cast<long long>(kFirstPacketLimit.count()));
          return 1;
        }
        if (packets != 0 && Clock::now() - start >= window) break;
        continue;
      }
      for (uint16_t i = 0; i < n; ++i) {
        uint64_t seq;
        memcpy(&seq, rte_pktmbuf_mtod(bufs[i], const void*), sizeof(seq));
        if (packets == 0) {
          start = Clock::now();
          expect = seq;
        }
        if (seq > expect) lost += seq - expect;
        if (seq < expect) ++misordered;  // duplicated or late: memif never should
        expect = seq + 1;
        bytes += rte_pktmbuf_pkt_len(bufs[i]);
        ++packets;
      }
      rte_pktmbuf_free_bulk(bufs, n);
      if (Clock::now() - start >= window) break;
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    hang_up();
    const double pps = static_cast<double>(packets) / elapsed;
    printf("{\"bench\":\"memif_raw\",\"pps\":%.0f,\"gbps\":%.3f,\"size\":%u,\"packets\":%" PRIu64
           ",\"seconds\":%.3f,\"lost\":%" PRIu64 ",\"misordered\":%" PRIu64
           ",\"burst\":%u,\"pinned\":%s,\"hugepages\":%s}\n",
           pps, static_cast<double>(bytes) * 8 / elapsed / 1e9, opt_.size, packets, elapsed,
           lost, misordered, opt_.burst, opt_.pin ? "true" : "false", opt_.hugepages ? "true" : "false");
    fflush(stdout);
    return 0;
  }

  // memif (DPDK 22.11) unmaps the shared rings from its control thread when the peer
  // disconnects, even while this process is inside a burst on them. So the receiver never just
  // stops: it tells the sender to stop, waits until the sender has closed its end, and only then
  // closes its own, sending nothing meanwhile.
  void hang_up() {
    rte_mbuf* stop[4];
    if (rte_pktmbuf_alloc_bulk(pool_, stop, 4) == 0) {
      for (rte_mbuf* m : stop) {
        m->data_len = 64;
        m->pkt_len = 64;
        memcpy(rte_pktmbuf_mtod(m, void*), &kStopMarker, sizeof(kStopMarker));
      }
      const uint16_t sent = rte_eth_tx_burst(port_, 0, stop, 4);
      if (sent < 4) rte_pktmbuf_free_bulk(stop + sent, 4 - sent);
    }
    const auto limit = Clock::now() + 2s;
    while (link_up() && Clock::now() < limit) std::this_thread::sleep_for(1ms);
  }

  // Whether the receiver asked us to stop; also hands memif the buffers the receiver needs to
  // send that request.
  bool stop_requested() {
    rte_mbuf* bufs[kMaxBurst];
    const uint16_t n = rte_eth_rx_burst(port_, 0, bufs, kMaxBurst);
    bool stop = false;
    for (uint16_t i = 0; i < n; ++i) {
      uint64_t seq;
      memcpy(&seq, rte_pktmbuf_mtod(bufs[i], const void*), sizeof(seq));
      stop = stop || seq == kStopMarker;
    }
    if (n != 0) rte_pktmbuf_free_bulk(bufs, n);
    return stop;
  }

  int send() {
    rte_mbuf* bufs[kMaxBurst];
    uint16_t pending = 0;
    uint64_t seq = 0;
    // The receiver stops after its window; this is only the backstop if it vanishes silently.
    const auto deadline = Clock::now() + kFirstPacketLimit +
                          std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(opt_.seconds)) + 5s;
    for (uint32_t round = 0;; ++round) {
      if ((round & 255) == 0 && (stop_requested() || !link_up() || Clock::now() > deadline))
        break;
      if (pending < opt_.burst) {
        const uint16_t want = opt_.burst - pending;
        if (rte_pktmbuf_alloc_bulk(pool_, bufs + pending, want) == 0) {
          for (uint16_t i = pending; i < pending + want; ++i) {
            rte_mbuf* m = bufs[i];
            m->data_len = static_cast<uint16_t>(opt_.size);
            m->pkt_len = opt_.size;
            memcpy(rte_pktmbuf_mtod(m, void*), &seq, sizeof(seq));
            ++seq;
          }
          pending += want;
        }
      }
      const uint16_t sent = rte_eth_tx_burst(port_, 0, bufs, pending);
      // Unsent packets are retried first, so the receiver's sequence check sees no false gap.
      if (sent != 0 && sent < pending) memmove(bufs, bufs + sent, (pending - sent) * sizeof(bufs[0]));
      pending -= sent;
    }
    if (pending != 0) rte_pktmbuf_free_bulk(bufs, pending);
    return 0;
  }

  // Ping-pong, measuring side: one frame in flight; each round trip timed from just before the
  // send to the moment its echo is seen. Percentiles come from the sorted samples (no histogram
  // buckets: the figures are a few microseconds, buckets would round them).
  int ping() {
    rte_mbuf* bufs[kMaxBurst];
    std::vector<double> rtt_us;
    rtt_us.reserve(opt_.iterations);
    const auto window = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(opt_.seconds));
    const auto start = Clock::now();
    uint64_t lost = 0;
    for (uint64_t seq = 0; rtt_us.size() < opt_.iterations; ++seq) {
      if (Clock::now() - start > window) break;
      rte_mbuf* m = rte_pktmbuf_alloc(pool_);
      if (m == nullptr) {
        fprintf(stderr, "memif_raw (client): mbuf pool empty\n");
        return 1;
      }
      m->data_len = static_cast<uint16_t>(opt_.size);
      m->pkt_len = opt_.size;
      memcpy(rte_pktmbuf_mtod(m, void*), &seq, std::min<size_t>(sizeof(seq), opt_.size));
      const auto t0 = Clock::now();
      while (rte_eth_tx_burst(port_, 0, &m, 1) == 0) {
        if (Clock::now() - t0 > 1s) {
          rte_pktmbuf_free(m);
          fprintf(stderr, "memif_raw (client): cannot send for 1 s\n");
          return 1;
        }
      }
      bool back = false;
      while (!back) {
        const uint16_t n = rte_eth_rx_burst(port_, 0, bufs, kMaxBurst);
        const auto t1 = Clock::now();
        for (uint16_t i = 0; i < n; ++i) {
          uint64_t got = 0;
          memcpy(&got, rte_pktmbuf_mtod(bufs[i], const void*),
                 std::min<size_t>(sizeof(got), opt_.size));
          const uint64_t want = opt_.size >= sizeof(seq) ? seq : seq & ((1ull << (8 * opt_.size)) - 1);
          if (got == want && rte_pktmbuf_pkt_len(bufs[i]) == opt_.size) {
            back = true;
            if (seq >= opt_.warmup)
              rtt_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          }
        }
        if (n != 0) rte_pktmbuf_free_bulk(bufs, n);
        if (!back && t1 - t0 > 1s) {  // memif never loses a frame; a peer that died does
          ++lost;
          break;
        }
      }
      if (lost != 0) {
        fprintf(stderr, "memif_raw (client): frame %" PRIu64 " not echoed within 1 s\n", seq);
        hang_up();
        return 1;
      }
    }
    hang_up();
    if (rtt_us.empty()) {
      fprintf(stderr, "memif_raw (client): no round trip measured (warm-up longer than --seconds)\n");
      return 1;
    }
    std::sort(rtt_us.begin(), rtt_us.end());
    auto pct = [&](double q) {
      const size_t i = static_cast<size_t>(q * static_cast<double>(rtt_us.size() - 1) + 0.5);
      return rtt_us[std::min(i, rtt_us.size() - 1)];
    };
    double sum = 0;
    for (double v : rtt_us) sum += v;
    printf("{\"bench\":\"memif_raw_pingpong\",\"size\":%u,\"iterations\":%zu,\"warmup\":%u,"
           "\"rtt_min_us\":%.3f,\"rtt_p50_us\":%.3f,\"rtt_p99_us\":%.3f,\"rtt_max_us\":%.3f,"
           "\"rtt_mean_us\":%.3f,\"oneway_p50_us\":%.3f,\"oneway_p99_us\":%.3f,"
           "\"pinned\":%s,\"hugepages\":%s}\n",
           opt_.size, rtt_us.size(), opt_.warmup, rtt_us.front(), pct(0.5), pct(0.99),
           rtt_us.back(), sum / static_cast<double>(rtt_us.size()), pct(0.5) / 2, pct(0.99) / 2,
           opt_.pin ? "true" : "false", opt_.hugepages ? "true" : "false");
    fflush(stdout);
    return 0;
  }

  // Ping-pong, echoing side: every frame goes straight back (memif copies it into the peer's
  // buffers, so the mbuf is ours to send) until the stop frame, the peer leaving, or a deadline.
  int echo() {
    rte_mbuf* bufs[kMaxBurst];
    const auto deadline = Clock::now() + kFirstPacketLimit +
                          std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(opt_.seconds)) + 5s;
    for (uint32_t round = 0;; ++round) {
      if ((round & 1023) == 0 && (!link_up() || Clock::now() > deadline)) break;
      const uint16_t n = rte_eth_rx_burst(port_, 0, bufs, kMaxBurst);
      if (n == 0) continue;
      bool stop = false;
      uint16_t keep = 0;
      for (uint16_t i = 0; i < n; ++i) {
        uint64_t seq = 0;
        if (rte_pktmbuf_pkt_len(bufs[i]) >= sizeof(seq))
          memcpy(&seq, rte_pktmbuf_mtod(bufs[i], const void*), sizeof(seq));
        // Ping frames never carry the marker: their sequence numbers count up from 0.
        if (seq == kStopMarker && rte_pktmbuf_pkt_len(bufs[i]) == 64) {
          stop = true;
          rte_pktmbuf_free(bufs[i]);
        } else {
          bufs[keep++] = bufs[i];
        }
      }
      uint16_t sent = 0;
      const auto t0 = Clock::now();
      while (sent < keep && Clock::now() - t0 < 1s)
        sent += rte_eth_tx_burst(port_, 0, bufs + sent, keep - sent);
      if (sent < keep) rte_pktmbuf_free_bulk(bufs + sent, keep - sent);
      if (stop) break;
    }
    return 0;
  }

 private:
  [[noreturn]] void fail(const char* what) {
    fprintf(stderr, "memif_raw (%s): %s failed: %s\n", server_ ? "server" : "client", what,
            rte_strerror(rte_errno));
    if (eal_up_) rte_eal_cleanup();
    exit(1);
  }

  const Options& opt_;
  const bool server_;
  bool eal_up_ = false;
  uint16_t port_ = 0;
  rte_mempool* pool_ = nullptr;
};

int run_role(const Options& o, bool server, int cpu) {
  MemifEnd end(o, server, cpu);
  if (!end.connect()) {
    fprintf(stderr, "memif_raw (%s): no peer on %s within %llds\n", server ? "server" : "client",
            o.socket.c_str(), static_cast<long long>(kConnectLimit.count()));
    return 1;
  }
  if (o.pingpong) return server ? end.echo() : end.ping();
  return server ? end.receive() : end.send();
}

// Forks a server and a client, waits for both, and kills them at a hard deadline.
int run_both(const Options& o) {
  const int server_cpu = o.pin ? nth_cpu(0) : -1;
  const int client_cpu = o.pin ? nth_cpu(1) : -1;
  fflush(stdout);
  const pid_t server = fork();
  if (server == 0) _exit(run_role(o, true, server_cpu));
  std::this_thread::sleep_for(200ms);  // let the server listen first (the client retries anyway)
  const pid_t client = fork();
  if (client == 0) _exit(run_role(o, false, client_cpu));

  const auto deadline = Clock::now() + kConnectLimit + kFirstPacketLimit +
                        std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(o.seconds)) + 10s;
  int rc = 0, alive = 2;
  while (alive > 0) {
    int status = 0;
    const pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      --alive;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "memif_raw: %s %s %d\n", done == server ? "server" : "client",
                WIFEXITED(status) ? "exited with" : "killed by signal",
                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        rc = 1;
      }
      continue;
    }
    if (Clock::now() > deadline) {
      fprintf(stderr, "memif_raw: deadline passed, killing the children\n");
      kill(server, SIGKILL);
      kill(client, SIGKILL);
      rc = 1;
      for (; alive > 0; --alive) waitpid(-1, nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.role == "both") return run_both(o);
  return run_role(o, o.role == "server", o.pin ? nth_cpu(o.role == "server" ? 0 : 1) : -1);
}
