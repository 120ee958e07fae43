// SPDX-License-Identifier: Apache-2.0
// The DPDK side of the fabric emulator: EAL, one memif server port per endpoint and plane, the
// polling loop that feeds the core and backs off when idle (idle_policy.h), the state folder and
// control socket.
#include "datapath/fabric/fabric_runner.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_log.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <thread>
#include <vector>

#include "datapath/fabric/fabric_control.h"
#include "datapath/fabric/idle_policy.h"
#include "datapath/wire/frame.h"

namespace metaroce::fabric {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr uint16_t kBurst = 32;
constexpr uint16_t kDescriptors = 1024;
// Large enough for a 9600-byte MTU frame in one mbuf, so the core always sees contiguous bytes.
constexpr uint16_t kDataRoom = 9728 + RTE_PKTMBUF_HEADROOM;
constexpr unsigned kPoolSize = 16383;  // 2^n - 1 suits the mempool ring; ~160 MB of -m 512
constexpr unsigned kPoolCache = 256;
// Records the core may hold, below the pool so that RX and flood copies still find buffers.
constexpr uint32_t kMaxInFlight = 12288;
constexpr auto kControlPeriod = std::chrono::milliseconds(2);
constexpr auto kLinkPeriod = std::chrono::milliseconds(5);

volatile std::sig_atomic_t g_stop_signal = 0;
void on_signal(int) { g_stop_signal = 1; }

// The process's CPUs as EAL's lcore map wants them: "0@(0,1)" lets the main lcore float.
std::string lcore_map() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::string cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (!CPU_ISSET(c, &set)) continue;
      if (!cpus.empty()) cpus += ',';
      cpus += std::to_string(c);
    }
  }
  return "--lcores=0@(" + (cpus.empty() ? std::string("0") : cpus) + ")";
}

struct PortState {
  uint16_t port = 0;
  uint32_t endpoint = 0, plane = 0;
  bool up = false;
  // The endpoint said goodbye (docs/spec/link.md §4): leave its rings alone until its link has
  // gone down, since memif unmaps them from the interrupt thread when the peer disconnects.
  bool quiet = false;
  std::chrono::steady_clock::time_point quiet_since{};  // at most kQuietMax, as the NIC does
  rte_mbuf* tx[kBurst * 4];
  uint16_t tx_count = 0;
  uint64_t rx_frames = 0, tx_frames = 0, tx_dropped = 0, rx_unusable = 0, goodbyes = 0;
};

// The goodbye exchange of docs/spec/link.md §4 is link-local, like MAC control frames: the fabric
// answers it on the port it came from and forwards nothing. Returns true when m was one (freed).
constexpr auto kQuietMax = std::chrono::seconds(1);
bool answer_goodbye(rte_mempool* pool, PortState& p, rte_mbuf* m) {
  const auto kind =
      wire::goodbye_kind({rte_pktmbuf_mtod(m, const uint8_t*), rte_pktmbuf_data_len(m)});
  if (!kind) return false;
  rte_pktmbuf_free(m);
  if (*kind != wire::kGoodbye) return true;
  if (rte_mbuf* a = rte_pktmbuf_alloc(pool)) {
    if (auto* d = reinterpret_cast<uint8_t*>(rte_pktmbuf_append(a, wire::kGoodbyeFrameLen))) {
      // The fabric's ports have no address of their own; the acknowledgement's source is zero.
      wire::build_goodbye({d, wire::kGoodbyeFrameLen}, wire::MacAddr{}, wire::kGoodbyeAck);
      if (rte_eth_tx_burst(p.port, 0, &a, 1) == 1) a = nullptr;
    }
    if (a) rte_pktmbuf_free(a);
  }
  p.quiet = true;
  p.quiet_since = std::chrono::steady_clock::now();
  ++p.goodbyes;
  return true;
}

// Frames are mbufs: delivery buffers them per port, discards free them, floods copy them.
class MbufSink final : public FrameSink {
 public:
  MbufSink(rte_mempool* pool, std::vector<PortState>* ports, uint32_t planes)
      : pool_(pool), ports_(ports), planes_(planes) {}

  void deliver(uint32_t endpoint, uint32_t plane, FrameRef frame) override {
    PortState& p = (*ports_)[endpoint * planes_ + plane];
    auto* m = static_cast<rte_mbuf*>(frame.handle);
    if (!p.up) {  // nobody attached: the frame has nowhere to go
      ++p.tx_dropped;
      rte_pktmbuf_free(m);
      return;
    }
    if (p.tx_count == std::size(p.tx)) flush(p);
    p.tx[p.tx_count++] = m;
  }
  void discard(FrameRef frame) override { rte_pktmbuf_free(static_cast<rte_mbuf*>(frame.handle)); }
  bool clone(const FrameRef& frame, FrameRef* copy) override {
    rte_mbuf* m = rte_pktmbuf_copy(static_cast<rte_mbuf*>(frame.handle), pool_, 0, UINT32_MAX);
    if (m == nullptr) return false;
    *copy = FrameRef{rte_pktmbuf_mtod(m, uint8_t*), rte_pktmbuf_data_len(m), m};
    return true;
  }

  static void flush(PortState& p) {
    if (p.tx_count == 0) return;
    const uint16_t sent = p.up && !p.quiet ? rte_eth_tx_burst(p.port, 0, p.tx, p.tx_count) : 0;
    p.tx_frames += sent;
    if (sent < p.tx_count) {
      // The endpoint's ring is full: a real port would pause; the fabric drops and counts.
      p.tx_dropped += p.tx_count - sent;
      rte_pktmbuf_free_bulk(p.tx + sent, p.tx_count - sent);
    }
    p.tx_count = 0;
  }

 private:
  rte_mempool* pool_;
  std::vector<PortState>* ports_;
  uint32_t planes_;
};

// The unix control socket: non-blocking listen, one short request per connection.
class ControlSocket {
 public:
  ~ControlSocket() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  bool open(const std::string& path, std::string* err) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof(addr.sun_path)) {
      *err = "control socket path too long (" + std::to_string(path.size()) + " bytes): " + path;
      return false;
    }
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    ::unlink(path.c_str());
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd_, 8) != 0) {
      *err = "control socket " + path + ": " + std::strerror(errno);
      return false;
    }
    path_ = path;
    return true;
  }
  // Reads one request (the client sends it whole, then shuts down its side), or "" on timeout.
  std::optional<int> accept_one(std::string* line) {
    const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) return std::nullopt;
    line->clear();
    char buf[512];
    const auto deadline = Clock::now() + std::chrono::milliseconds(200);
    while (Clock::now() < deadline && line->find('\n') == std::string::npos && line->size() < 4096) {
      pollfd p{c, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::read(c, buf, sizeof(buf));
      if (n <= 0) break;
      line->append(buf, static_cast<size_t>(n));
    }
    if (auto nl = line->find('\n'); nl != std::string::npos) line->resize(nl);
    return c;
  }
  static void reply(int c, const std::string& text) {
    size_t off = 0;
    while (off < text.size()) {
      const ssize_t n = ::send(c, text.data() + off, text.size() - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(c);
  }

 private:
  int fd_ = -1;
  std::string path_;
};

std::string ports_text(const std::vector<PortState>& ports) {
  std::string s;
  for (const auto& p : ports) {
    s += "port e" + std::to_string(p.endpoint) + ".p" + std::to_string(p.plane) + ": " +
         (p.up ? "connected" : "waiting") + ", rx " + std::to_string(p.rx_frames) + ", tx " +
         std::to_string(p.tx_frames) + ", tx_dropped " + std::to_string(p.tx_dropped) +
         ", rx_unusable " + std::to_string(p.rx_unusable) + ", goodbyes " +
         std::to_string(p.goodbyes) + "\n";
  }
  return s;
}

// `trace INTERVAL_US FILE` / `trace off` (requests only the runner knows): cumulative counters
// sampled every interval into a text file, so a benchmark sees goodput, queues and drops over
// time at a resolution no polling client could reach. One header line names the columns; every
// sample is one line of integers; control requests that change the fabric are logged as
// "# event T_US REQUEST" lines at the time they took effect.
class Trace {
 public:
  ~Trace() { close(); }
  bool active() const { return file_ != nullptr; }
  Clock::time_point next() const { return next_; }

  std::string start(Fabric& fabric, const std::string& args, Clock::time_point wall) {
    const size_t space = args.find(' ');
    if (space == std::string::npos) return "error: usage: trace INTERVAL_US FILE | trace off\n";
    char* end = nullptr;
    const unsigned long us = std::strtoul(args.c_str(), &end, 10);
    if (end != args.c_str() + space || us < 100 || us > 10'000'000)
      return "error: trace interval must be 100..10000000 microseconds\n";
    close();
    const std::string path = args.substr(space + 1);
    file_ = std::fopen(path.c_str(), "we");
    if (file_ == nullptr) return "error: trace " + path + ": " + std::strerror(errno) + "\n";
    // A large stdio buffer: the polling thread writes a line per interval and must not stall.
    std::setvbuf(file_, nullptr, _IOFBF, 1 << 20);
    interval_ = std::chrono::microseconds(us);
    std::fprintf(file_, "t_us");
    for (uint32_t i = 0; i < fabric.link_count(); ++i) {
      const std::string n = fabric.link_name(i);
      std::fprintf(file_, " %s.bytes_out %s.drops %s.queue %s.ce", n.c_str(), n.c_str(), n.c_str(),
                   n.c_str());
    }
    for (uint32_t e = 0; e < fabric.config().endpoints; ++e)
      std::fprintf(file_, " from%u.bytes", e);
    std::fprintf(file_, "\n");
    next_ = wall;
    return "ok\ntracing every " + std::to_string(us) + " us to " + path + "\n";
  }

  void sample(Fabric& fabric, Nanos now, Clock::time_point wall) {
    std::fprintf(file_, "%lld", static_cast<long long>(now.count() / 1000));
    for (uint32_t i = 0; i < fabric.link_count(); ++i) {
      const LinkStats s = fabric.link_stats(i, now);
      std::fprintf(file_, " %llu %llu %llu %llu", static_cast<unsigned long long>(s.bytes_out),
                   static_cast<unsigned long long>(s.drop_queue + s.drop_loss + s.drop_down),
                   static_cast<unsigned long long>(s.queue_bytes),
                   static_cast<unsigned long long>(s.ce_marked));
    }
    for (uint32_t e = 0; e < fabric.config().endpoints; ++e)
      std::fprintf(file_, " %llu",
                   static_cast<unsigned long long>(fabric.stats().delivered_bytes_from[e]));
    std::fprintf(file_, "\n");
    // Missed intervals are skipped, not replayed: each line carries its own time.
    next_ += interval_;
    if (next_ <= wall) next_ = wall + interval_;
  }

  void event(Nanos now, const std::string& line) {
    if (file_ != nullptr)
      std::fprintf(file_, "# event %lld %s\n", static_cast<long long>(now.count() / 1000),
                   line.c_str());
  }

  void close() {
    if (file_ != nullptr) std::fclose(file_);
    file_ = nullptr;
  }

 private:
  std::FILE* file_ = nullptr;
  Clock::duration interval_{};
  Clock::time_point next_{};
};

// The idle policy in the start-up line, so that a log says what the latencies were taken with.
std::string idle_text(const IdlePolicy& p) {
  if (p.spin == SpinPolicy::kAlways) return "--spin always (never sleeps)";
  auto us = [](Nanos t) {
    return std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(t).count());
  };
  return "--spin adaptive (polls " + us(p.spin_before_sleep) + " us, then naps up to " +
         us(p.max_nap) + " us)";
}

bool pid_alive(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

}  // namespace

int run_fabric(const RunOptions& o, std::ostream& out, std::string* err) {
  auto fail = [&](const std::string& what) {
    *err = what;
    return 1;
  };
  std::string why;
  if (!check_fabric_name(o.name, &why)) return fail(why);
  FabricConfig config = o.config;
  config.max_in_flight = std::min(config.max_in_flight, kMaxInFlight);
  if (auto bad = config.validate(); !bad.empty()) return fail(bad);
  if (auto bad = o.idle.validate(); !bad.empty()) return fail(bad);

  // The state folder: refuse a live fabric of the same name, clear a dead one's leftovers.
  const std::string dir = state_dir(o.rundir, o.name);
  std::error_code ec;
  {
    std::ifstream pid_in(dir + "/" + kPidFile);
    long old = 0;
    if (pid_in >> old && pid_alive(static_cast<pid_t>(old)) && old != ::getpid())
      return fail("already running (pid " + std::to_string(old) + ")");
  }
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return fail("cannot create " + dir + ": " + ec.message());
  ControlSocket control;
  if (!control.open(dir + "/" + kControlSocket, &why)) {
    fs::remove_all(dir, ec);
    return fail(why);
  }

  // EAL: once per process. Its threads inherit the blocked signals, so SIGTERM and SIGINT are
  // always taken by this thread.
  const uint32_t n_ports = config.endpoints * config.planes;
  std::vector<std::string> args = {"metaroce-fabric", "--no-pci", "--no-huge", "-m", "512",
                                   "--no-shconf", "--no-telemetry", "--file-prefix",
                                   "metaroce-fabric-" + std::to_string(::getpid()), lcore_map(),
                                   "--log-level=*:error"};
  for (uint32_t e = 0; e < config.endpoints; ++e)
    for (uint32_t p = 0; p < config.planes; ++p)
      args.push_back("--vdev=net_memif" + std::to_string(e * config.planes + p) +
                     ",role=server,id=0,socket=" + socket_name(o.name, e, p));
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  sigset_t block, old_mask;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGINT);
  pthread_sigmask(SIG_BLOCK, &block, &old_mask);
  const int eal_rc = rte_eal_init(static_cast<int>(argv.size() - 1), argv.data());
  const int eal_errno = rte_errno;
  g_stop_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  pthread_sigmask(SIG_UNBLOCK, &block, nullptr);
  if (eal_rc < 0) {
    fs::remove_all(dir, ec);
    return fail(std::string("EAL init failed: ") + rte_strerror(eal_errno));
  }
  const std::string eal_dir = rte_eal_get_runtime_dir();
  auto cleanup = [&] {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
    fs::remove_all(eal_dir, ignored);  // EAL never removes its runtime folder itself
  };

  rte_mempool* pool = rte_pktmbuf_pool_create("fabric_pool", kPoolSize, kPoolCache, 0, kDataRoom,
                                              static_cast<int>(rte_socket_id()));
  if (pool == nullptr) {
    cleanup();
    return fail(std::string("mbuf pool: ") + rte_strerror(rte_errno));
  }
  std::vector<PortState> ports(n_ports);
  for (uint32_t i = 0; i < n_ports; ++i) {
    PortState& ps = ports[i];
    ps.endpoint = i / config.planes;
    ps.plane = i % config.planes;
    const std::string dev = "net_memif" + std::to_string(i);
    if (rte_eth_dev_get_port_by_name(dev.c_str(), &ps.port) != 0) {
      cleanup();
      return fail("memif port " + dev + " missing after EAL init");
    }
    rte_eth_conf conf{};
    if (rte_eth_dev_configure(ps.port, 1, 1, &conf) != 0 ||
        rte_eth_rx_queue_setup(ps.port, 0, kDescriptors, rte_socket_id(), nullptr, pool) != 0 ||
        rte_eth_tx_queue_setup(ps.port, 0, kDescriptors, rte_socket_id(), nullptr) != 0 ||
        rte_eth_dev_start(ps.port) != 0) {
      cleanup();
      return fail("cannot start memif port " + dev);
    }
  }

  // Clients may attach from here on: publish the shape, then the pid.
  FabricInfo info{config.endpoints, config.planes, config.links_per_plane, ::getpid()};
  if (!write_info(dir, info, &why)) {
    cleanup();
    return fail(why);
  }
  {
    std::ofstream pid_out(dir + "/" + kPidFile, std::ios::trunc);
    pid_out << ::getpid() << "\n";
  }
  out << "fabric " << o.name << ": " << config.endpoints << " endpoints, " << config.planes
      << " planes, " << config.links_per_plane << " core links per plane; memif sockets "
      << socket_name(o.name, 0, 0) << " .. "
      << socket_name(o.name, config.endpoints - 1, config.planes - 1) << "; control " << dir
      << "/" << kControlSocket << "; idle " << idle_text(o.idle) << std::endl;

  MbufSink sink(pool, &ports, config.planes);
  int status = 0;
  {
    Fabric fabric(config, &sink);
    const auto start = Clock::now();
    const auto deadline = o.seconds > 0
                              ? start + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(o.seconds))
                              : Clock::time_point::max();
    auto next_control = start, next_link = start;
    Trace trace;
    auto last_work = start;
    uint32_t idle = 0;
    bool stop = false;
    rte_mbuf* bufs[kBurst];
    while (!stop && g_stop_signal == 0) {
      const auto wall = Clock::now();
      if (wall >= deadline) break;
      const Nanos now = std::chrono::duration_cast<Nanos>(wall - start);
      if (wall >= next_link) {
        next_link = wall + kLinkPeriod;
        for (auto& p : ports) {
          rte_eth_link link{};
          p.up = rte_eth_link_get_nowait(p.port, &link) == 0 && link.link_status != 0;
          // The old peer is gone (or long enough past its goodbye): the port is usable again.
          if (!p.up || wall - p.quiet_since > kQuietMax) p.quiet = false;
        }
      }
      uint32_t received = 0;
      for (auto& p : ports) {
        if (!p.up || p.quiet) continue;
        const uint16_t n = rte_eth_rx_burst(p.port, 0, bufs, kBurst);
        for (uint16_t i = 0; i < n; ++i) {
          rte_mbuf* m = bufs[i];
          if (answer_goodbye(pool, p, m)) continue;  // link-local: never forwarded
          if (m->nb_segs > 1 && rte_pktmbuf_linearize(m) != 0) {
            ++p.rx_unusable;
            rte_pktmbuf_free(m);
            continue;
          }
          fabric.ingress(p.endpoint, p.plane,
                         FrameRef{rte_pktmbuf_mtod(m, uint8_t*), rte_pktmbuf_data_len(m), m}, now);
        }
        p.rx_frames += n;
        received += n;
      }
      const uint32_t delivered = fabric.advance(now);
      for (auto& p : ports) MbufSink::flush(p);
      if (trace.active() && wall >= trace.next()) trace.sample(fabric, now, wall);

      if (wall >= next_control) {
        next_control = wall + kControlPeriod;
        std::string line;
        while (auto c = control.accept_one(&line)) {
          std::string reply;
          if (line == "ports") {
            reply = "ok\n" + ports_text(ports);
          } else if (line == "trace off") {
            trace.close();
            reply = "ok\n";
          } else if (line.rfind("trace ", 0) == 0) {
            reply = trace.start(fabric, line.substr(6), wall);
          } else {
            reply = handle_request(fabric, line, now, &stop);
            if (line.rfind("set ", 0) == 0 && reply.rfind("ok", 0) == 0) trace.event(now, line);
          }
          ControlSocket::reply(*c, reply);
        }
      }

      // Back-off (o.idle): these hosts have two cores shared with the endpoints' progress threads.
      if (received != 0 || delivered != 0) {
        last_work = wall;
        idle = 0;
        continue;
      }
      IdleState st;
      st.idle_for = std::chrono::duration_cast<Nanos>(wall - last_work);
      if (idle != UINT32_MAX) ++idle;  // a fabric spinning for hours must not wrap to short naps
      st.empty_passes = idle;
      if (const auto next = fabric.next_event()) st.until_event = *next - now;
      if (trace.active()) st.until_sample = std::chrono::duration_cast<Nanos>(trace.next() - wall);
      if (const Nanos nap = idle_wait(o.idle, st); nap > Nanos::zero())
        std::this_thread::sleep_for(nap);
      else
        sched_yield();
    }
    out << handle_request(fabric, "stat", std::chrono::duration_cast<Nanos>(Clock::now() - start),
                          &stop).substr(3)
        << ports_text(ports) << std::flush;
  }
  // Ports are not stopped: memif tears a connection down from its own thread when a client
  // leaves, and a second teardown racing it frees memory twice (DPDK 22.11). The process is
  // about to exit, which closes everything.
  for (auto& p : ports) {
    if (p.tx_count != 0) rte_pktmbuf_free_bulk(p.tx, p.tx_count);
    p.tx_count = 0;
  }
  cleanup();
  return status;
}

}  // namespace metaroce::fabric
