// SPDX-License-Identifier: Apache-2.0
// The DPDK port: EAL kept on one detached control thread for the life of the process, devices
// hot-plugged by device string and re-used on reopen, one RX and one TX queue per port.
#include "datapath/io/dpdk_port.h"

#include "datapath/io/kernel_net.h"
#include "datapath/io/pci.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/if_packet.h>
#include <linux/if_xdp.h>
#include <net/if.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <rte_alarm.h>
#include <rte_bus.h>
#include <rte_dev.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_log.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace metaroce::io {
namespace {

constexpr uint32_t kEthHeader = 14;
constexpr uint32_t kBufAlign = 128;         // memif copies whole cache lines; keep buffers aligned
constexpr uint32_t kAfPacketFrames = 512;   // af_packet ring frames per queue and direction
// af_xdp (DPDK 22.11) makes each mbuf of the pool one UMEM chunk, and the kernel takes chunks of
// at most a page: [object header 64][rte_mbuf 128][mbuf headroom 128][XDP headroom 256][frame].
// The mempool spreads objects over memory channels by making their size an odd number of cache
// lines, so the largest object that fits a page is 63 lines.
constexpr uint32_t kPage = 4096;
constexpr uint32_t kCacheLine = 64;
constexpr uint32_t kMempoolObjHeader = 64;  // cache-line aligned rte_mempool_objhdr
constexpr uint32_t kXdpHeadroom = 256;      // XDP_PACKET_HEADROOM
constexpr uint32_t kAfXdpDataRoom = kPage - kCacheLine - kMempoolObjHeader - sizeof(rte_mbuf);
constexpr uint32_t kAfXdpMaxFrame = kAfXdpDataRoom - RTE_PKTMBUF_HEADROOM - kXdpHeadroom;
static_assert(kAfXdpMaxMtu + kEthHeader == kAfXdpMaxFrame);
constexpr uint32_t kBurst = 64;             // mbuf pointers handled per DPDK call
constexpr unsigned kPoolCache = 256;
// How often a port whose kernel TX ring may hold frames the PMD left there kicks it again, and
// for how long after its last burst an af_packet port keeps doing so (DpdkPort::kick_late).
constexpr auto kKickEvery = std::chrono::microseconds(100);
constexpr auto kKickFor = std::chrono::milliseconds(50);
constexpr int kMaxKicks = 64;  // kicks in a row while the kernel keeps taking frames
constexpr auto kLinkWait = std::chrono::milliseconds(250);  // a peer already listening connects
                                                           // well within this on these machines

std::atomic<int> g_log_type{-1};

[[gnu::format(printf, 2, 3)]] void log(uint32_t level, const char* fmt, ...) {
  const int type = g_log_type.load(std::memory_order_relaxed);
  if (type < 0) return;
  va_list ap;
  va_start(ap, fmt);
  rte_vlog(level, static_cast<uint32_t>(type), fmt, ap);
  va_end(ap);
}

std::string errno_text(int e) { return e > 0 ? std::string(strerror(e)) : "unknown error"; }

// --- descriptors -------------------------------------------------------------------------------
// EAL and PMDs open descriptors without O_CLOEXEC; a forked and exec'ed child of the application
// must not inherit them. Control operations record the open set and mark what appeared.

std::set<int> open_fds() {
  std::set<int> fds;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  const int own = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const int fd = atoi(e->d_name);
    if (fd != own) fds.insert(fd);
  }
  closedir(dir);
  return fds;
}

void set_cloexec(int fd) {
  const int flags = fcntl(fd, F_GETFD);
  if (flags >= 0 && (flags & FD_CLOEXEC) == 0) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

// Whether fd is of a kind EAL or a PMD opens from its own threads: epoll, eventfd, timerfd,
// shared-memory files and memif's unix SOCK_SEQPACKET control sockets.
bool dpdk_kind(int fd) {
  char path[64], target[256];
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(path, target, sizeof(target) - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  if (strstr(target, "[eventpoll]") || strstr(target, "[eventfd]") ||
      strstr(target, "[timerfd]") || strncmp(target, "/memfd:", 7) == 0)
    return true;
  if (strncmp(target, "socket:", 7) != 0) return false;
  int domain = 0, type = 0;
  socklen_t len = sizeof(int);
  return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_UNIX &&
         getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_SEQPACKET;
}

// Marks close-on-exec every descriptor opened since `op_start` (during a control operation, so
// by DPDK), and those opened between `last_seen` and `op_start` that are of a DPDK kind (EAL's
// interrupt thread and memif's connection handling open them asynchronously). Descriptors the
// application opened meanwhile are of other kinds, or so we hope; they are left alone.
void mark_cloexec(const std::set<int>& last_seen, const std::set<int>& op_start) {
  for (int fd : open_fds()) {
    if (last_seen.contains(fd)) continue;
    if (!op_start.contains(fd) || dpdk_kind(fd)) set_cloexec(fd);
  }
}

// The socket the af_packet or af_xdp PMD opened for the queue on `iface`: for af_packet the
// AF_PACKET socket bound to it (the PMD keeps another, unbound, for ioctls); for af_xdp the
// AF_XDP socket that appeared since `before` (an XSK socket does not say its interface). -1 if
// none. No other part of the engine opens sockets of either family.
int pmd_queue_socket(const std::string& iface, bool af_xdp, const std::set<int>& before) {
  const unsigned index = if_nametoindex(iface.c_str());
  if (index == 0) return -1;
  for (int fd : open_fds()) {
    int domain = 0;
    socklen_t len = sizeof(domain);
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) continue;
    if (af_xdp) {
      if (domain == AF_XDP && !before.contains(fd)) return fd;
      continue;
    }
    if (domain != AF_PACKET) continue;
    sockaddr_ll sll{};
    len = sizeof(sll);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&sll), &len) == 0 &&
        sll.sll_ifindex == static_cast<int>(index))
      return fd;
  }
  return -1;
}

// --- EAL ---------------------------------------------------------------------------------------

// "0-3,6": the CPUs this thread may run on, in EAL's cpu-set syntax.
std::string affinity_list() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return "0";
  std::string out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    int last = cpu;
    while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
    if (!out.empty()) out += ',';
    out += std::to_string(cpu);
    if (last > cpu) out += '-' + std::to_string(last);
    cpu = last;
  }
  return out.empty() ? "0" : out;
}

struct DeviceEntry {
  std::string devargs;  // as probed; a different string for the same name re-probes
  uint16_t port = 0;
  bool open = false;
  int queue_socket = -1;  // af_packet, af_xdp: the PMD's queue socket (DpdkPort::kick_late)
  rte_mempool* pool = nullptr;
  uint32_t buf_size = 0;  // data bytes per mbuf of `pool`
  // Data-less mbufs that carry a frame's tail (TxFrame::tail) as an external buffer, on PMDs
  // that copy every segment of a frame in rte_eth_tx_burst (tails_wanted); nullptr on others.
  rte_mempool* tail_pool = nullptr;
};

// Releases a device's mbuf pools (its port stopped or never started: nothing holds them).
void free_pools(DeviceEntry& entry) {
  rte_mempool_free(entry.pool);
  rte_mempool_free(entry.tail_pool);
  entry.pool = entry.tail_pool = nullptr;
  entry.buf_size = 0;
}

// The process's EAL. It is never destroyed: EAL cannot be initialised twice, so the control
// thread that owns it lives until the process exits.
class Eal {
 public:
  static Eal& get() {
    static Eal* eal = new Eal();
    return *eal;
  }

  // Runs fn on the control thread and waits for it. Returns false, with the reason, when EAL
  // could not be brought up (then it never will be in this process).
  bool run(bool hugepages, const std::function<void()>& fn, std::string* why) {
    start(hugepages);
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return init_done_; });
    if (!init_ok_) {
      *why = init_error_;
      return false;
    }
    bool done = false;
    tasks_.push_back([&] {
      fn();
      std::lock_guard inner(mu_);
      done = true;
      cv_.notify_all();
    });
    cv_.notify_all();
    cv_.wait(lock, [&] { return done; });
    return true;
  }

  // Queues fn without waiting; dropped when EAL is not up.
  void post(std::function<void()> fn) {
    std::lock_guard lock(mu_);
    if (!init_done_ || !init_ok_) return;
    tasks_.push_back(std::move(fn));
    cv_.notify_all();
  }

  // Control-thread state: only touched from tasks.
  std::map<std::string, DeviceEntry> devices;
  uint32_t pool_generation = 0;
  std::set<int> fds_after_last_op;

 private:
  Eal() = default;

  void start(bool hugepages) {
    std::call_once(started_, [&] {
      std::thread([this, hugepages] { main(hugepages); }).detach();
    });
  }

  void main(bool hugepages) {
    // EAL's interrupt thread inherits this mask: signals stay with the application's threads.
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    pthread_setname_np(pthread_self(), "metaroce-eal");

    // Every argument is built here from known values, so EAL never has a reason to print its
    // usage text on the application's stdout.
    const std::string prefix = "metaroce-" + std::to_string(getpid());
    const std::string lcores = "--lcores=0@(" + affinity_list() + ")";
    // PCI devices are probed one by one as links name them (hot-plug), never all at start: an
    // allow-list naming no device that exists keeps EAL from taking every device bound to vfio
    // on the host, which other programs (or another engine) may be using.
    std::vector<std::string> args = {"metaroce", "-a", "ffff:ff:1f.7", "--no-shconf",
                                     "--no-telemetry", "--file-prefix", prefix, lcores,
                                     "--log-level=*:error"};
    // Each port's pool holds ~4k frame buffers of up to 9 KiB (~38 MB); a link has a port per
    // plane, so 8 planes need ~300 MB. Without hugepages this is anonymous memory that is only
    // resident once touched, so a roomy limit costs nothing for one port.
    if (!hugepages) args.insert(args.end(), {"--no-huge", "-m", "1024"});
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);

    const std::set<int> before = open_fds();
    const int rc = rte_eal_init(static_cast<int>(args.size()), argv.data());
    const int err = rte_errno;
    mark_cloexec(before, before);
    fds_after_last_op = open_fds();
    if (rc >= 0) {
      // With --no-shconf EAL keeps nothing in its runtime folder yet never removes it; rmdir
      // only succeeds while it is empty, so nothing EAL relies on can go.
      rmdir(rte_eal_get_runtime_dir());
      g_log_type.store(rte_log_register_type_and_pick_level("metaroce.io", RTE_LOG_NOTICE));
      log(RTE_LOG_INFO, "metaroce.io: EAL up (%s, %s)\n", lcores.c_str(),
          hugepages ? "hugepages" : "no hugepages");
    }
    {
      std::lock_guard lock(mu_);
      init_done_ = true;
      init_ok_ = rc >= 0;
      if (!init_ok_) init_error_ = "DPDK EAL initialisation failed: " + errno_text(err);
      cv_.notify_all();
    }
    if (rc < 0) return;
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::once_flag started_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool init_done_ = false, init_ok_ = false;
  std::string init_error_;
};

// Non-EAL threads (the NIC's progress thread, an application thread running the engine inline)
// get an lcore id on first use so that the mempool's per-lcore cache serves them; the id is
// returned when the thread exits.
struct ThreadRegistration {
  bool tried = false, registered = false;
  ~ThreadRegistration() {
    if (registered) rte_thread_unregister();
  }
};
thread_local ThreadRegistration t_registration;

inline void ensure_registered() {
  if (t_registration.tried) [[likely]]
    return;
  t_registration.tried = true;
  if (rte_lcore_id() != LCORE_ID_ANY) return;  // an EAL thread already
  // Failure (every lcore id taken) only costs the cache: the mempool still works without one.
  t_registration.registered = rte_thread_register() == 0;
  if (!t_registration.registered)
    log(RTE_LOG_DEBUG, "metaroce.io: thread not registered with EAL: %s\n",
        rte_strerror(rte_errno));
}

// memif tears a connection down from EAL's interrupt thread when the peer hangs up, and from
// the caller's thread on rte_eth_dev_stop, with no lock between them: two teardowns at once
// free the same memory twice. An alarm callback runs on the interrupt thread, so a stop issued
// from there cannot overlap the peer's. Returns the stop's result, or -errno.
int stop_on_interrupt_thread(uint16_t port) {
  struct Stop {
    uint16_t port;
    int rc = 0;
    std::atomic<bool> done{false};
  } stop{port};
  auto run = [](void* arg) {
    auto* s = static_cast<Stop*>(arg);
    s->rc = rte_eth_dev_stop(s->port);
    s->done.store(true, std::memory_order_release);
  };
  if (rte_eal_alarm_set(1, run, &stop) != 0) return rte_eth_dev_stop(port);  // no alarm: best effort
  while (!stop.done.load(std::memory_order_acquire))
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  return stop.rc;
}

// --- the port ----------------------------------------------------------------------------------

class DpdkPort final : public Port {
 public:
  DpdkPort(std::string name, uint16_t port, bool hugepages, const MacAddr& mac,
           std::unique_ptr<KernelNet> kernel)
      : name_(std::move(name)), port_(port), hugepages_(hugepages), mac_(mac),
        kernel_(std::move(kernel)) {}

  ~DpdkPort() override {
    if (xsk_map_ != nullptr) munmap(xsk_map_, xsk_map_len_);
    if (stash_next_ < stash_n_) rte_pktmbuf_free_bulk(stash_ + stash_next_, stash_n_ - stash_next_);
    std::string why;
    Eal::get().run(hugepages_, [&] {
      // Stopped, not removed: a later open of the same device string restarts it (hot-plug
      // removal and re-probe would tear down a memif server socket the peer knows).
      const int rc = stop_on_interrupt_thread(port_);
      if (rc != 0) log(RTE_LOG_WARNING, "metaroce.io: stop %s: %s\n", name_.c_str(),
                       errno_text(-rc).c_str());
      auto it = Eal::get().devices.find(name_);
      if (it != Eal::get().devices.end()) {
        it->second.open = false;
        // EAL's memory is a fixed budget (-m): a closed port must not keep ~40 MB of jumbo
        // buffers. The stopped port touches the pool no more; the next open makes a new one.
        free_pools(it->second);
      }
    }, &why);
  }

  const MacAddr& mac() const override { return mac_; }
  std::string kernel_interface() const override { return kernel_ ? kernel_->ifname() : ""; }
  NextHop next_hop(uint32_t peer_ip) override {
    return kernel_ ? kernel_->next_hop(peer_ip) : Port::next_hop(peer_ip);
  }

  bool link_up() const override {
    rte_eth_link link{};
    const bool up = rte_eth_link_get_nowait(port_, &link) == 0 && link.link_status != 0;
    if (up && !was_up_.exchange(true)) {
      // The peer just connected and the PMD opened descriptors for it.
      Eal::get().post([] {
        Eal& eal = Eal::get();
        const std::set<int> now = open_fds();
        mark_cloexec(eal.fds_after_last_op, now);
        eal.fds_after_last_op = now;
      });
    } else if (!up) {
      was_up_.store(false, std::memory_order_relaxed);
    }
    return up;
  }

  uint32_t rx_burst(std::span<RxFrame> out) override {
    ensure_registered();
    if (kick_pending_) kick_late();
    rte_mbuf* mbufs[kBurst];
    uint32_t filled = 0, bad = 0;
    uint64_t bytes = 0;
    while (filled < out.size()) {
      const auto want = static_cast<uint16_t>(std::min<size_t>(kBurst, out.size() - filled));
      const uint16_t got = rte_eth_rx_burst(port_, 0, mbufs, want);
      for (uint16_t i = 0; i < got; ++i) {
        rte_mbuf* m = mbufs[i];
        // The NIC reads a frame as one contiguous buffer. A peer with smaller buffers sends
        // chains; our mbufs have room for a whole frame, so joining them never allocates.
        if (m->nb_segs > 1 && rte_pktmbuf_linearize(m) != 0) {
          rte_pktmbuf_free(m);
          ++bad;
          continue;
        }
        out[filled++] = RxFrame{rte_pktmbuf_mtod(m, const uint8_t*), rte_pktmbuf_data_len(m), m};
        bytes += rte_pktmbuf_data_len(m);
      }
      if (got < want) break;
    }
    if (filled != 0) {
      rx_frames_.fetch_add(filled, std::memory_order_relaxed);
      rx_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    }
    if (bad != 0) rx_unusable_.fetch_add(bad, std::memory_order_relaxed);
    return filled;
  }

  void release(std::span<RxFrame> frames) override {
    ensure_registered();
    rte_mbuf* mbufs[kBurst];
    uint32_t n = 0;
    for (RxFrame& f : frames) {
      if (f.handle == nullptr) continue;
      mbufs[n++] = static_cast<rte_mbuf*>(f.handle);
      f.handle = nullptr;
      if (n == kBurst) {
        rte_pktmbuf_free_bulk(mbufs, n);
        n = 0;
      }
    }
    if (n != 0) rte_pktmbuf_free_bulk(mbufs, n);
  }

  // Buffers come from a small stash refilled kStash at a time (one mempool dequeue and one
  // reset loop instead of one of each per frame); a pool too empty for a whole refill still
  // gives what it has, one at a time.
  bool alloc_tx(TxFrame& frame, uint32_t size) override {
    ensure_registered();
    if (stash_next_ == stash_n_) {
      stash_next_ = stash_n_ = 0;
      if (rte_pktmbuf_alloc_bulk(pool_, stash_, kStash) == 0) stash_n_ = kStash;
    }
    rte_mbuf* m = stash_next_ < stash_n_ ? stash_[stash_next_++] : rte_pktmbuf_alloc(pool_);
    if (m == nullptr) return false;
    const uint32_t room = rte_pktmbuf_tailroom(m);
    if (size > room) {
      rte_pktmbuf_free(m);
      return false;
    }
    frame = TxFrame{rte_pktmbuf_mtod(m, uint8_t*), room, 0, m};
    return true;
  }

  bool takes_tails() const override { return tail_pool_ != nullptr; }
  void tx_burst(std::span<TxFrame> frames) override { send(frames, false); }
  uint32_t tx_try(std::span<TxFrame> frames) override { return send(frames, true); }

  // One DPDK burst at a time. Where the link takes part of a burst, the rest of it is freed and
  // counted dropped (keep false), or left with the caller and nothing more is offered (keep true).
  uint32_t send(std::span<TxFrame> frames, bool keep) {
    ensure_registered();
    rte_mbuf* mbufs[kBurst];
    uint32_t index[kBurst];
    uint64_t sent_frames = 0, sent_bytes = 0, dropped = 0;
    size_t i = 0;
    while (i < frames.size()) {
      uint16_t n = 0;
      uint64_t bytes[kBurst];
      for (; i < frames.size() && n < kBurst; ++i) {
        TxFrame& f = frames[i];
        if (f.handle == nullptr) continue;
        auto* m = static_cast<rte_mbuf*>(f.handle);
        if (f.len == 0) {  // an unused buffer given back
          f.handle = nullptr;
          rte_pktmbuf_free(m);
          continue;
        }
        const uint32_t len = std::min(f.len, f.capacity);
        m->data_len = static_cast<uint16_t>(len);
        m->pkt_len = len;
        if (f.tail) chain_tail(m, f, len, keep);
        bytes[n] = len;
        index[n] = static_cast<uint32_t>(i);
        mbufs[n++] = m;
      }
      if (n == 0) continue;
      const uint16_t sent = rte_eth_tx_burst(port_, 0, mbufs, n);
      for (uint16_t k = 0; k < sent; ++k) {
        sent_bytes += bytes[k];
        frames[index[k]].handle = nullptr;
      }
      sent_frames += sent;
      if (sent < n) {
        if (keep) break;
        rte_pktmbuf_free_bulk(mbufs + sent, n - sent);
        for (uint16_t k = sent; k < n; ++k) frames[index[k]].handle = nullptr;
        dropped += n - sent;
      }
    }
    tx_frames_.fetch_add(sent_frames, std::memory_order_relaxed);
    tx_bytes_.fetch_add(sent_bytes, std::memory_order_relaxed);
    if (kick_fd_ >= 0 && sent_frames != 0) {
      kick_pending_ = true;
      last_tx_ = last_kick_ = std::chrono::steady_clock::now();  // the PMD has just kicked
    }
    if (dropped != 0) tx_dropped_.fetch_add(dropped, std::memory_order_relaxed);
    return static_cast<uint32_t>(sent_frames);
  }

  // af_packet and af_xdp: the queue's kernel socket, which poll() finds readable while a frame
  // waits in its RX ring (TPACKET_V2: the newest frame is still the PMD's; XSK: the ring is not
  // empty), so a napping engine wakes for the frame. None of the three PMDs of DPDK 22.11 has
  // rx_queue_intr_enable, so this is the socket found by pmd_queue_socket. memif signals RX on
  // a per-queue eventfd only while the receiver clears MEMIF_RING_FLAG_MASK_INT in the shared
  // ring, and the 22.11 PMD sets that flag on its RX rings at connect and exposes neither: a
  // memif port naps with back-off (docs/design.md, "A nap ends when a frame arrives").
  int rx_wait_fd() override { return kick_fd_; }
  void rx_arm() override {}
  void rx_disarm() override {}

  PortStats stats() const override {
    PortStats s;
    s.rx_frames = rx_frames_.load(std::memory_order_relaxed);
    s.rx_bytes = rx_bytes_.load(std::memory_order_relaxed);
    s.tx_frames = tx_frames_.load(std::memory_order_relaxed);
    s.tx_bytes = tx_bytes_.load(std::memory_order_relaxed);
    s.tx_dropped = tx_dropped_.load(std::memory_order_relaxed);
    s.tx_late_kicks = tx_late_kicks_.load(std::memory_order_relaxed);
    rte_eth_stats es{};
    const uint64_t pmd_missed = rte_eth_stats_get(port_, &es) == 0 ? es.imissed + es.rx_nombuf : 0;
    s.rx_missed = pmd_missed + rx_unusable_.load(std::memory_order_relaxed);
    return s;
  }

  // The frame's tail as a second segment that points at it, which the PMD copies with the rest
  // before rte_eth_tx_burst returns; copied into the frame where no segment can be had (or
  // when the frame may outlive this call: keep).
  void chain_tail(rte_mbuf* m, TxFrame& f, uint32_t len, bool keep) {
    const uint32_t tail = std::min(f.tail_len, len);
    rte_mbuf* t = keep ? nullptr : rte_pktmbuf_alloc(tail_pool_);
    if (t == nullptr) {
      std::memcpy(f.data + len - tail, f.tail, tail);
    } else {
      rte_mbuf_ext_refcnt_update(&tail_info_, 1);
      rte_pktmbuf_attach_extbuf(t, const_cast<uint8_t*>(f.tail), RTE_BAD_IOVA,
                                static_cast<uint16_t>(tail), &tail_info_);
      t->data_len = static_cast<uint16_t>(tail);
      m->data_len = static_cast<uint16_t>(len - tail);
      m->next = t;
      m->nb_segs = 2;
    }
    f.tail = nullptr;
  }

  void set_pool(rte_mempool* pool) { pool_ = pool; }
  void set_tail_pool(rte_mempool* pool) {
    tail_pool_ = pool;
    // One record for every tail: the port holds a reference, each attached tail another, and
    // the count never reaches 0 while the port exists (the PMD frees a tail once it copied it).
    tail_info_.free_cb = [](void*, void*) {};
    tail_info_.fcb_opaque = nullptr;
    rte_mbuf_ext_refcnt_set(&tail_info_, 1);
  }
  // The queue's kernel socket, which kick_late() kicks (af_packet, af_xdp). For af_xdp, the
  // indices of its TX ring, mapped read-only, say whether the kernel has taken every frame.
  bool set_kick_socket(int fd, bool af_xdp) {
    if (af_xdp) {
      xdp_mmap_offsets off{};
      socklen_t len = sizeof(off);
      if (getsockopt(fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &len) != 0) return false;
      void* map = mmap(nullptr, off.tx.desc, PROT_READ, MAP_SHARED, fd, XDP_PGOFF_TX_RING);
      if (map == MAP_FAILED) return false;
      xsk_map_ = map;
      xsk_map_len_ = off.tx.desc;
      const auto* base = static_cast<const uint8_t*>(map);
      xsk_prod_ = reinterpret_cast<const uint32_t*>(base + off.tx.producer);
      xsk_cons_ = reinterpret_cast<const uint32_t*>(base + off.tx.consumer);
    }
    kick_fd_ = fd;
    return true;
  }

 private:
  // Frames the PMD handed the kernel's TX ring that the kernel has not taken yet; -1 where the
  // port cannot tell (af_packet).
  int64_t xsk_tx_pending() const {
    if (xsk_prod_ == nullptr) return -1;
    const uint32_t prod = __atomic_load_n(xsk_prod_, __ATOMIC_ACQUIRE);
    const uint32_t cons = __atomic_load_n(xsk_cons_, __ATOMIC_ACQUIRE);
    return static_cast<uint32_t>(prod - cons);
  }

  // Both kernel-ring PMDs of DPDK 22.11 put a burst in the kernel's TX ring and then kick the
  // kernel with a non-blocking send, and both can leave frames in the ring that only the next
  // burst's kick sends: af_packet when that send stops early (EAGAIN: the socket's buffer is
  // full of frames still inside the kernel; ENOBUFS: the device refused one) yet the PMD
  // reports the whole burst sent; af_xdp in copy mode, where the kernel sends at most a batch
  // per kick and the PMD's kick can end before the ring is empty. With one packet in flight
  // there is no next burst until a retransmission timer fires. Measured in realnet (af_xdp
  // host, Linux 6.18, four engines on two cores): after a bulk transfer, frames reached the
  // router up to 2.4 s after the engine sent them, a ping-pong behind them ended with
  // RETRY_EXC, and probes could not bring failed paths back. So the port kicks the ring again
  // every kKickEvery while frames wait in it (af_xdp: its indices say so), or for kKickFor after
  // a burst (af_packet: until a kick sends nothing). A kick that found frames waiting is
  // counted (tx_late_kicks).
  void kick_late() {
    const auto t = std::chrono::steady_clock::now();
    int64_t pending = xsk_tx_pending();
    if (pending == 0) {
      kick_pending_ = false;
      return;
    }
    if (t - last_kick_ < kKickEvery) return;
    last_kick_ = t;
    if (pending > 0) {
      // Linux 6.18 takes about ten frames per kick of a veth's XSK ring in copy mode and
      // reports success: kick while the kernel keeps taking them.
      tx_late_kicks_.fetch_add(1, std::memory_order_relaxed);
      for (int i = 0; i < kMaxKicks && pending > 0; ++i) {
        sendto(kick_fd_, nullptr, 0, MSG_DONTWAIT, nullptr, 0);
        const int64_t left = xsk_tx_pending();
        if (left >= pending) break;
        pending = left;
      }
      return;
    }
    const ssize_t sent = sendto(kick_fd_, nullptr, 0, MSG_DONTWAIT, nullptr, 0);
    if (sent > 0) {
      tx_late_kicks_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (sent == 0 || t - last_tx_ > kKickFor) kick_pending_ = false;
  }

  const std::string name_;
  const uint16_t port_;
  const bool hugepages_;
  const MacAddr mac_;
  const std::unique_ptr<KernelNet> kernel_;  // af_packet, af_xdp: routes and neighbours
  rte_mempool* pool_ = nullptr;
  rte_mempool* tail_pool_ = nullptr;  // see DeviceEntry::tail_pool
  rte_mbuf_ext_shared_info tail_info_{};
  static constexpr uint32_t kStash = 32;
  rte_mbuf* stash_[kStash] = {};  // allocated, not yet handed out (alloc_tx)
  uint32_t stash_n_ = 0, stash_next_ = 0;
  mutable std::atomic<bool> was_up_{false};
  std::atomic<uint64_t> rx_frames_{0}, rx_bytes_{0}, tx_frames_{0}, tx_bytes_{0};
  std::atomic<uint64_t> tx_dropped_{0}, rx_unusable_{0}, tx_late_kicks_{0};
  int kick_fd_ = -1;  // owned by the PMD
  bool kick_pending_ = false;
  void* xsk_map_ = nullptr;  // af_xdp: the TX ring's head, read-only
  size_t xsk_map_len_ = 0;
  const uint32_t* xsk_prod_ = nullptr;
  const uint32_t* xsk_cons_ = nullptr;
  std::chrono::steady_clock::time_point last_tx_{}, last_kick_{};
};

// rte_dev_probe returns -1 when the driver rejects its arguments, -errno otherwise.
std::string probe_error(int rc) {
  switch (-rc) {
    case 1: return "the driver rejected its arguments";
    case EFAULT:
    case ENODEV: return "no such driver, or malformed device string";
    case EEXIST: return "device already present";
    default: return errno_text(-rc);
  }
}

bool has_key(const std::string& devargs, const char* key) {
  const std::string k = std::string(",") + key + "=";
  return devargs.find(k) != std::string::npos;
}

std::string key_value(const std::string& devargs, const char* key) {
  const std::string k = std::string(",") + key + "=";
  const size_t at = devargs.find(k);
  if (at == std::string::npos) return {};
  const size_t from = at + k.size();
  return devargs.substr(from, devargs.find(',', from) - from);
}

// Whether the port's frames may carry their payload as a tail segment (TxFrame::tail): PMDs
// that copy every segment into their own ring inside rte_eth_tx_burst and free the frame there
// (DPDK 22.11: memif in copy mode, af_packet), not a device that reads buffers by DMA later,
// nor memif's zero-copy mode (it hands the mbufs themselves to the peer).
// METAROCE_TX_TAILS=0 turns it off (measurements, docs/design.md "The port copies the payload").
bool tails_wanted(const std::string& name, const std::string& devargs,
                  const rte_eth_dev_info& info) {
  if (const char* e = std::getenv("METAROCE_TX_TAILS"); e && std::string(e) == "0") return false;
  if (!(info.tx_offload_capa & RTE_ETH_TX_OFFLOAD_MULTI_SEGS)) return false;
  if (name.starts_with("net_memif")) return key_value(devargs, "zero-copy") != "yes";
  return name.starts_with("net_af_packet");
}

// Releases a device that was probed with other arguments, so that it can be probed again.
void remove_device(const std::string& name, DeviceEntry& entry) {
  rte_eth_dev_info info{};
  if (rte_eth_dev_info_get(entry.port, &info) == 0 && info.device != nullptr) {
    rte_eth_dev_close(entry.port);
    const int rc = rte_dev_remove(info.device);
    if (rc != 0) log(RTE_LOG_WARNING, "metaroce.io: remove %s: %s\n", name.c_str(),
                     errno_text(-rc).c_str());
  }
  free_pools(entry);
  entry = DeviceEntry{};
}

}  // namespace

std::unique_ptr<Port> open_dpdk_port(const DpdkPortConfig& cfg, std::string* err) {
  std::string scratch;
  if (err == nullptr) err = &scratch;
  if (cfg.devargs.empty() || cfg.devargs.front() == ',') {
    *err = "empty DPDK device string";
    return nullptr;
  }
  if (cfg.mtu < 68 || cfg.mtu + kEthHeader + kBufAlign + RTE_PKTMBUF_HEADROOM > UINT16_MAX) {
    *err = "MTU " + std::to_string(cfg.mtu) + " out of range (68..65000)";
    return nullptr;
  }
  const std::string name = cfg.devargs.substr(0, cfg.devargs.find(','));
  uint32_t buf_size = (cfg.mtu + kEthHeader + kBufAlign - 1) / kBufAlign * kBufAlign;

  // memif copies frames into shared buffers of `bsize` bytes (2048 by default) and chains
  // several for a larger frame. Buffers the size of ours keep every frame in one buffer on both
  // sides and let the PMD use its single-copy path; the peer must use the same MTU.
  std::string devargs = cfg.devargs;
  if (auto pci = pci_address(name)) {
    // DPDK would only say "cannot find device", or probe nothing without a word.
    if (std::string why = check_pci_device("/sys/bus/pci/devices", *pci); !why.empty()) {
      *err = why;
      return nullptr;
    }
  }
  // Ports on a kernel interface: its MTU bounds what the link may send and receive.
  const bool af_xdp = name.starts_with("net_af_xdp");
  const std::string iface =
      af_xdp || name.starts_with("net_af_packet") ? key_value(devargs, "iface") : std::string();
  std::unique_ptr<KernelNet> kernel;
  if (!iface.empty()) {
    std::string why;
    kernel = KernelNet::open(iface, &why);
    if (!kernel) {
      *err = why;
      return nullptr;
    }
    if (auto info = interface_info(iface, &why); info && info->mtu < cfg.mtu) {
      *err = "interface " + iface + " has MTU " + std::to_string(info->mtu) + ", below the link's " +
             std::to_string(cfg.mtu);
      return nullptr;
    }
  }
  if (af_xdp) {
    // Each frame is one UMEM chunk of a page (see kAfXdpMaxFrame): no larger MTU fits, and the
    // kernel refuses XDP on a veth whose peer's MTU exceeds about the same.
    if (cfg.mtu + kEthHeader > kAfXdpMaxFrame) {
      *err = "af_xdp frames hold at most " + std::to_string(kAfXdpMaxFrame) +
             " bytes (one page per frame in DPDK 22.11): the link MTU " + std::to_string(cfg.mtu) +
             " does not fit; use --mtu " + std::to_string(kAfXdpMaxFrame - kEthHeader) +
             " or less (and the same on " + (iface.empty() ? "the interface" : iface) + ")";
      return nullptr;
    }
    buf_size = kAfXdpDataRoom - RTE_PKTMBUF_HEADROOM;
  }
  if (name.starts_with("net_memif") && !has_key(devargs, "bsize"))
    devargs += ",bsize=" + std::to_string(buf_size);
  // af_packet's kernel ring holds frames of `framesz` bytes (2048 by default: a larger frame is
  // cut), each copied into one mbuf, and the PMD refuses (ENOMEM) mbufs smaller than a ring
  // frame; it also addresses frame i at i x framesz, so a block must hold whole frames. Frames
  // that hold the link's MTU (TPACKET2 header and sockaddr_ll in front), a page multiple, one
  // per block, and mbufs that hold a frame (DPDK 22.11 rte_eth_af_packet.c).
  if (name.starts_with("net_af_packet") && !has_key(devargs, "framesz")) {
    constexpr uint32_t kTpacketRoom = 128;
    const uint32_t frame = (cfg.mtu + kEthHeader + kTpacketRoom + 4095) / 4096 * 4096;
    const uint32_t block = frame;
    devargs += ",framesz=" + std::to_string(frame) + ",blocksz=" + std::to_string(block) +
               ",framecnt=" + std::to_string(kAfPacketFrames);
    buf_size = std::max(buf_size, (frame + kBufAlign - 1) / kBufAlign * kBufAlign);
  }

  std::unique_ptr<DpdkPort> result;
  std::string why;
  const bool ok = Eal::get().run(cfg.hugepages, [&] {
    Eal& eal = Eal::get();
    const std::set<int> before = open_fds();
    // A second link naming a device that is open (two links of one engine): refused without
    // touching the open one's buffers.
    if (auto open = eal.devices.find(name); open != eal.devices.end() && open->second.open) {
      why = "device " + name + " is already open in this process (another link uses it)";
      return;
    }
    DeviceEntry& entry = eal.devices[name];
    auto fail = [&](std::string reason) {
      why = std::move(reason);
      free_pools(entry);  // the port is not started: nothing holds its buffers
      if (entry.devargs.empty()) eal.devices.erase(name);
      mark_cloexec(eal.fds_after_last_op, before);
      eal.fds_after_last_op = open_fds();
    };
    if (!entry.devargs.empty() && entry.devargs != devargs) remove_device(name, entry);
    if (entry.devargs.empty()) {
      int rc = rte_dev_probe(devargs.c_str());
      if (rc != 0 && rte_eth_dev_count_total() >= RTE_MAX_ETHPORTS) {
        // Every ethdev slot is taken (32 in Debian's DPDK), by ports of links that closed and
        // were kept stopped for a quick reopen: a long-lived engine that saw many links come
        // and go. Release those and try once more.
        for (auto it = eal.devices.begin(); it != eal.devices.end();) {
          if (it->first != name && !it->second.open && !it->second.devargs.empty()) {
            remove_device(it->first, it->second);
            it = eal.devices.erase(it);
          } else {
            ++it;
          }
        }
        rc = rte_dev_probe(devargs.c_str());
      }
      uint16_t port = 0;
      if (rc != 0) return fail("DPDK refused device '" + devargs + "': " + probe_error(rc));
      if (rte_eth_dev_get_port_by_name(name.c_str(), &port) != 0)
        return fail("device '" + name + "' probed but is no ethernet port");
      entry.devargs = devargs;
      entry.port = port;
    }
    const uint16_t port = entry.port;

    rte_eth_dev_info info{};
    int rc = rte_eth_dev_info_get(port, &info);
    if (rc != 0) return fail("device info of " + name + ": " + errno_text(-rc));
    rte_eth_conf conf{};
    // Some PMDs (memif) report a 1518-byte frame limit yet carry any frame their buffers hold;
    // ask for what the device accepts and rely on the buffer size for the rest.
    const uint32_t overhead =
        info.max_rx_pktlen > info.max_mtu ? info.max_rx_pktlen - info.max_mtu : kEthHeader + 4;
    if (cfg.mtu <= info.max_mtu && cfg.mtu + overhead <= info.max_rx_pktlen) {
      conf.rxmode.mtu = cfg.mtu;
    } else {
      log(RTE_LOG_NOTICE, "metaroce.io: %s reports max frame %u < %u; not set\n", name.c_str(),
          info.max_rx_pktlen, cfg.mtu + overhead);
    }
    rc = rte_eth_dev_configure(port, 1, 1, &conf);
    if (rc != 0) return fail("configure " + name + ": " + errno_text(-rc));
    uint16_t nb_rx = cfg.rx_descriptors, nb_tx = cfg.tx_descriptors;
    rte_eth_dev_adjust_nb_rx_tx_desc(port, &nb_rx, &nb_tx);

    if (entry.pool == nullptr) {
      const unsigned count = std::max(2u * (nb_rx + nb_tx), 2048u) - 1;  // 2^n - 1 suits the ring
      const std::string pool_name = "mr_io_" + std::to_string(++eal.pool_generation);
      const int socket = rte_eth_dev_socket_id(port);
      entry.pool = rte_pktmbuf_pool_create(pool_name.c_str(), count, kPoolCache, 0,
                                           static_cast<uint16_t>(buf_size + RTE_PKTMBUF_HEADROOM),
                                           socket < 0 ? SOCKET_ID_ANY : socket);
      if (entry.pool == nullptr) {
        entry.buf_size = 0;
        return fail("mbuf pool for " + name + ": " + errno_text(rte_errno));
      }
      entry.buf_size = buf_size;
    }
    if (entry.tail_pool == nullptr && tails_wanted(name, devargs, info)) {
      const unsigned count = std::max(unsigned{nb_tx}, 512u) - 1;
      const std::string pool_name = "mr_tl_" + std::to_string(++eal.pool_generation);
      const int socket = rte_eth_dev_socket_id(port);
      // None is no loss: frames then carry their payloads as before.
      entry.tail_pool = rte_pktmbuf_pool_create(pool_name.c_str(), count, kPoolCache, 0, 0,
                                                socket < 0 ? SOCKET_ID_ANY : socket);
    }
    const int socket = rte_eth_dev_socket_id(port);
    const unsigned sock = socket < 0 ? SOCKET_ID_ANY : static_cast<unsigned>(socket);
    rc = rte_eth_rx_queue_setup(port, 0, nb_rx, sock, nullptr, entry.pool);
    if (rc != 0) return fail("RX queue of " + name + ": " + errno_text(-rc));
    rc = rte_eth_tx_queue_setup(port, 0, nb_tx, sock, nullptr);
    if (rc != 0) return fail("TX queue of " + name + ": " + errno_text(-rc));
    rc = rte_eth_dev_start(port);
    if (rc != 0) return fail("start " + name + ": " + errno_text(-rc));

    // A peer that is already there connects within milliseconds; one that comes later is seen
    // through link_up().
    const auto deadline = std::chrono::steady_clock::now() + kLinkWait;
    rte_eth_link link{};
    while (rte_eth_link_get_nowait(port, &link) == 0 && link.link_status == 0 &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));

    // A memif client hands the server its receive buffers only from inside rx_burst, so the
    // server cannot send before the client's first poll. Poll once now, while no other thread
    // can use the queue; anything that arrived before the port existed is discarded.
    if (link.link_status != 0) {
      rte_mbuf* early[kBurst];
      const uint16_t n = rte_eth_rx_burst(port, 0, early, kBurst);
      if (n != 0) rte_pktmbuf_free_bulk(early, n);
    }

    rte_ether_addr addr{};
    rte_eth_macaddr_get(port, &addr);
    MacAddr mac;
    std::copy(std::begin(addr.addr_bytes), std::end(addr.addr_bytes), mac.begin());
    entry.open = true;
    result = std::make_unique<DpdkPort>(name, port, cfg.hugepages, mac, std::move(kernel));
    result->set_pool(entry.pool);
    if (entry.tail_pool != nullptr) result->set_tail_pool(entry.tail_pool);
    if (af_xdp || name.starts_with("net_af_packet")) {
      // See DpdkPort::kick_late. For af_packet, a send buffer that holds the whole ring makes
      // early stops rare (the default, ~200 KB, is ~45 frames of a 3442-byte MTU).
      // An XSK socket outlives a stopped port (and is then no longer new); af_packet's stop
      // closes its socket, so it is looked for again.
      if (!af_xdp || entry.queue_socket < 0)
        entry.queue_socket = pmd_queue_socket(iface, af_xdp, before);
      const int fd = entry.queue_socket;
      if (fd >= 0 && !af_xdp) {
        const int want = static_cast<int>(kAfPacketFrames * (cfg.mtu + kEthHeader + 1024));
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &want, sizeof(want)) != 0)
          setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof(want));
      }
      if (fd < 0 || !result->set_kick_socket(fd, af_xdp))
        log(RTE_LOG_WARNING, "metaroce.io: %s: the queue's socket on %s not found; frames the "
            "kernel leaves in its TX ring wait for the next burst\n", name.c_str(), iface.c_str());
    }
    mark_cloexec(eal.fds_after_last_op, before);
    eal.fds_after_last_op = open_fds();
    log(RTE_LOG_INFO, "metaroce.io: %s is port %u, link %s\n", name.c_str(), port,
        link.link_status ? "up" : "down");
  }, &why);
  if (!ok || result == nullptr) {
    *err = why;
    log(RTE_LOG_ERR, "metaroce.io: %s\n", why.c_str());
    return nullptr;
  }
  return result;
}

}  // namespace metaroce::io
