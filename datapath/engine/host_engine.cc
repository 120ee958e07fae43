// SPDX-License-Identifier: Apache-2.0
// The host engine: run dir, links, the datapath thread and its idle policy, the control thread
// and the requests of driver contexts and administrators.
#include "datapath/engine/host_engine.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "datapath/engine/serve.h"
#include "datapath/engine/stall_guard.h"
#include "datapath/io/dpdk_port.h"
#include "datapath/io/udp_port.h"
#include "datapath/wire/mrh.h"

namespace metaroce::engine {

using hostif::Message;
using hostif::Op;
using transport::Time;

namespace {

constexpr Time kMinNap = std::chrono::microseconds(5);
constexpr Time kPublishEvery = std::chrono::milliseconds(100);  // `metaroce stat` refresh
// Connections the transport looks at for idleness at each publication: 2,560 a second, so a
// host that talked to 8,192 peers once forgets them within ~3 s of their conn_idle.
constexpr size_t kIdleSweep = 256;
constexpr uint32_t kStatusBytes = 4096;

[[gnu::format(printf, 1, 2)]] void log(const char* fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(line, sizeof(line), fmt, ap);
  va_end(ap);
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  std::fprintf(stderr, "metaroced[%d] %ld.%03ld: %s\n", getpid(), static_cast<long>(ts.tv_sec),
               ts.tv_nsec / 1000000, line);
}

// A plane's port: `udp[,iface=IFACE]` is the UDP-socket backend (docs/spec/link.md §5), any
// other string a DPDK device.
std::unique_ptr<io::Port> open_port(const nic::LinkConfig& cfg, const std::string& devargs,
                                    bool huge, std::string* why) {
  std::string reason;
  std::unique_ptr<io::Port> port;
  if (auto udp = nic::parse_udp_plane(devargs)) {
    io::UdpPortConfig uc;
    uc.ip = cfg.ip;
    uc.udp_port = cfg.udp_port;
    uc.iface = *udp;
    uc.mtu = cfg.mtu;
    port = io::open_udp_port(uc, &reason);
    if (!port) *why = "cannot open UDP sockets" + (udp->empty() ? "" : " on " + *udp) + ": " + reason;
    return port;
  }
  io::DpdkPortConfig pc;
  pc.devargs = devargs;
  pc.mtu = cfg.mtu;
  pc.hugepages = huge;
  port = io::open_dpdk_port(pc, &reason);
  if (!port) *why = "cannot open DPDK device '" + pc.devargs + "': " + reason;
  return port;
}

std::vector<std::unique_ptr<io::Port>> open_ports(const nic::LinkConfig& cfg, bool huge,
                                                  std::string* why) {
  std::vector<std::unique_ptr<io::Port>> ports;
  size_t start = 0;
  for (;;) {
    const size_t end = cfg.devargs.find(nic::kPlaneSeparator, start);
    auto port = open_port(cfg, cfg.devargs.substr(start, end == std::string::npos ? end : end - start),
                          huge, why);
    if (!port) return {};
    ports.push_back(std::move(port));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return ports;
}

std::string record_path(const std::string& rundir, const std::string& name) {
  return rundir + "/sys/class/infiniband/" + name + "/" + nic::kConfigFile;
}

// The run dir's lock, which `metaroce link add|del` hold while they change records.
class RecordLock {
 public:
  explicit RecordLock(const std::string& rundir)
      : fd_(open((rundir + "/.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ >= 0) flock(fd_, LOCK_EX);
  }
  ~RecordLock() {
    if (fd_ >= 0) close(fd_);
  }
  RecordLock(const RecordLock&) = delete;
  RecordLock& operator=(const RecordLock&) = delete;

 private:
  int fd_;
};

void remove_record(const std::string& rundir, const std::string& name) {
  RecordLock lock(rundir);
  std::error_code ec;
  std::filesystem::remove_all(rundir + "/sys/class/infiniband/" + name, ec);
}

}  // namespace

HostEngine::HostEngine(EngineOptions opt)
    : cm_(CmService::Env{
          .links =
              [this] {
                std::vector<CmLinkInfo> out;
                for (const auto& [name, l] : links_)
                  if (!l->kdev)  // a kernel device's connections are the kernel's CM's
                    out.push_back({name, l->cfg.ip, l->cfg.prefix, nic::node_guid_of(l->cfg),
                                   l->nic->active_mtu()});
                return out;
              },
          .send =
              [this](const std::string& link, uint32_t peer, std::span<const uint8_t> msg,
                     uint64_t token) {
                auto it = links_.find(link);
                if (it == links_.end()) {
                  cm_.on_sent(token, false);
                  return;
                }
                nic::Nic* nic = it->second->nic.get();
                on_datapath([&] { nic->cm_send(peer, msg, token); });
              },
          .now = [this] { return now(); },
          .log = [](const char* what) { log("%s", what); },
      }),
      opt_(std::move(opt)) {
  socket_path_ = opt_.rundir + "/" + hostif::kEngineSocket;
}

HostEngine::~HostEngine() { stop(); }

Time HostEngine::now() const {
  return std::chrono::duration_cast<Time>(std::chrono::steady_clock::now().time_since_epoch());
}

size_t HostEngine::session_count() const {
  std::lock_guard lock(sessions_mu_);
  return sessions_.size();
}

// --- start and stop ----------------------------------------------------------------------------

bool HostEngine::start(std::string* why) {
  mkdir(opt_.rundir.c_str(), 0755);
  const std::string lock_path = opt_.rundir + "/engine.lock";
  lock_fd_ = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) {
    *why = "cannot open " + lock_path + ": " + std::strerror(errno);
    return false;
  }
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {};
    [[maybe_unused]] ssize_t n = pread(lock_fd_, pid, sizeof(pid) - 1, 0);
    *why = "an engine already serves " + opt_.rundir + " (pid " +
           std::to_string(std::atoi(pid)) + ")";
    close(lock_fd_);
    lock_fd_ = -1;
    return false;
  }
  const std::string pid = std::to_string(getpid()) + "\n";
  if (ftruncate(lock_fd_, 0) != 0 || pwrite(lock_fd_, pid.data(), pid.size(), 0) < 0) {
    // The pid is only informative.
  }

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path_.size() >= sizeof(addr.sun_path)) {
    *why = "run dir path too long for a socket: " + socket_path_;
    return false;
  }
  std::memcpy(addr.sun_path, socket_path_.c_str(), socket_path_.size() + 1);
  unlink(socket_path_.c_str());  // a dead engine's: we hold the lock
  listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listen_fd_, 128) != 0) {
    *why = "cannot listen on " + socket_path_ + ": " + std::strerror(errno);
    return false;
  }
  // Any user may open a device, as /dev/infiniband/uverbs* is 0666; what a context may do is
  // checked per request (its own objects, rkeys for the rest).
  chmod(socket_path_.c_str(), 0666);
  struct stat sst {};
  if (stat(socket_path_.c_str(), &sst) == 0) socket_inode_ = sst.st_ino;

  if (!make_datapaths(why)) return false;
  control_wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  status_ = Segment::create("metaroce-status", kStatusBytes);
  if (control_wake_fd_ < 0 || epoll_fd_ < 0 || !status_.ok()) {
    *why = std::string("cannot set up the engine: ") + std::strerror(errno);
    return false;
  }
  hostif::init_status(status_.base(), static_cast<uint32_t>(getpid()));
  status_page_ = static_cast<hostif::StatusPage*>(status_.base());
  if (status_.share(true) < 0) {
    *why = std::string("cannot seal the status page: ") + std::strerror(errno);
    return false;
  }
  watch(listen_fd_, EPOLLIN);
  watch(control_wake_fd_, EPOLLIN);

  if (opt_.open_recorded_links) {
    const std::string dir = opt_.rundir + "/sys/class/infiniband";
    if (DIR* d = opendir(dir.c_str())) {
      std::vector<std::string> names;
      while (dirent* e = readdir(d))
        if (e->d_name[0] != '.') names.push_back(e->d_name);
      closedir(d);
      std::sort(names.begin(), names.end());
      for (const std::string& n : names) {
        std::string reason;
        if (open_link(n, &reason) != 0) log("link %s not opened: %s", n.c_str(), reason.c_str());
      }
    }
  }

  if (opt_.serve_kernel_devices && kernel_module_loaded()) {
    // Devices already waiting for an engine are announced at once (handled in control_main).
    kernel_listener_ = open_kernel_listener();
    if (kernel_listener_ >= 0)
      watch(kernel_listener_, EPOLLIN);
    else
      log("cannot listen for kernel devices: %s", std::strerror(errno));
  }

  // Counted before the control thread runs: from then on it alone changes links_ (TSan).
  const size_t links = links_.size();
  datapath_running_.store(true);
  followers_ = static_cast<uint32_t>(dps_.size() - 1);
  for (auto& dp : dps_) {
    Datapath* d = dp.get();
    d->thread = std::thread([this, d] { datapath_main(*d); });
  }
  control_ = std::thread([this] { control_main(); });
  started_ = true;
  log("serving %s (%zu links, spin %s, %zu datapath thread%s)", opt_.rundir.c_str(), links,
      opt_.spin == SpinPolicy::kAlways ? "always" : "adaptive", dps_.size(),
      dps_.size() == 1 ? "" : "s");
  return true;
}

void HostEngine::wait() {
  std::unique_lock lock(stop_mu_);
  stop_cv_.wait(lock, [&] { return stop_.load(); });
}

void HostEngine::request_stop(const std::string& why) {
  log("%s", why.c_str());
  std::lock_guard lock(stop_mu_);
  stop_.store(true);
  stop_cv_.notify_all();
}

void HostEngine::stop() {
  {
    std::lock_guard lock(stop_mu_);
    stop_.store(true);
    stop_cv_.notify_all();
    if (stopped_) return;
    stopped_ = true;
  }
  if (control_wake_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(control_wake_fd_, &one, sizeof(one));
  }
  if (control_.joinable()) control_.join();
  if (!started_) {
    links_.clear();  // links opened before start(): nothing else runs
  }
  if (listen_fd_ >= 0) {
    // Only our own socket: after a removed run dir, the path may be another engine's now.
    if (started_ && run_dir_intact()) unlink(socket_path_.c_str());
    close(listen_fd_);
  }
  for (int fd : {epoll_fd_, control_wake_fd_, kernel_listener_})
    if (fd >= 0) close(fd);
  listen_fd_ = epoll_fd_ = control_wake_fd_ = kernel_listener_ = -1;
  for (auto& dp : dps_) {
    if (dp->doorbell_fd >= 0) close(dp->doorbell_fd);
    dp->doorbell_fd = -1;
  }
  if (lock_fd_ >= 0) close(lock_fd_);  // drops the lock
  lock_fd_ = -1;
}

// --- links -------------------------------------------------------------------------------------

std::unique_ptr<Link> HostEngine::make_link(const nic::LinkConfig& cfg, std::string* why) {
  auto ports = opt_.open_ports ? opt_.open_ports(cfg, why)
                               : open_ports(cfg, opt_.hugepages, why);
  if (ports.empty()) return nullptr;
  if (ports.size() != std::max<size_t>(cfg.planes, 1)) {
    *why = "link has " + std::to_string(cfg.planes) + " planes but " +
           std::to_string(ports.size()) + " ports";
    return nullptr;
  }
  auto link = std::make_unique<Link>();
  link->cfg = cfg;
  // Entropy, ports: unpredictable too (conn ids and tokens come from getrandom themselves).
  uint64_t seed = 0;
  if (getrandom(&seed, sizeof(seed), 0) != static_cast<ssize_t>(sizeof(seed)))
    seed = (uint64_t{cfg.ip} << 32) ^ static_cast<uint64_t>(getpid()) ^
           static_cast<uint64_t>(now().count());
  link->nic = std::make_unique<nic::Nic>(nic::nic_config(cfg, seed));
  link->layer = std::make_unique<nic::LinkLayer>(*link->nic, std::move(ports));
  link->telemetry = std::make_unique<nic::TelemetryWriter>(opt_.rundir, cfg.name,
                                                           static_cast<uint32_t>(link->layer->planes()));
  return link;
}

int HostEngine::open_link(const std::string& name, std::string* why) {
  if (links_.count(name)) {
    *why = "link " + name + " is already open";
    return EEXIST;
  }
  auto cfg = nic::LinkConfig::load(record_path(opt_.rundir, name), why);
  if (!cfg) return ENOENT;
  auto link = make_link(*cfg, why);
  if (!link) return ENODEV;
  if (!cfg->kernel.empty()) {
    // Kernel-backed: the port goes ACTIVE once the link can carry traffic.
    link->kdev = KernelDevice::attach(name, cfg->kernel, true, opt_.rundir,
                                      link->nic->active_mtu(), why);
    if (!link->kdev) return ENODEV;
    kernel_fds_[link->kdev->fd()] = name;
    watch(link->kdev->fd(), 0);  // EPOLLHUP: the kernel device went away
  }
  Link* raw = link.get();
  if (dps_.empty() && !make_datapaths(why)) return ENOMEM;
  // The thread with the fewest links serves it, for as long as it is open.
  Datapath* dp = dps_.front().get();
  for (auto& d : dps_)
    if (d->links.size() < dp->links.size()) dp = d.get();
  raw->dp = dp;
  links_[name] = std::move(link);
  on_datapath([&] { dp->links.push_back(raw); });
  log("link %s open (%s, %zu plane%s%s%s, datapath thread %u)", name.c_str(),
      nic::format_ipv4(cfg->ip).c_str(), raw->layer->planes(), raw->layer->planes() == 1 ? "" : "s",
      raw->kdev ? ", kernel device over " : "", raw->kdev ? cfg->kernel.c_str() : "", dp->index);
  return 0;
}

void HostEngine::adopt(const KernelNotice& n) {
  if (links_.count(n.name)) return;  // a link of ours (its own attach announced nothing)
  std::string why;
  auto cfg = kernel_link_record(n.name, n.netdev, &why);
  if (cfg) {
    RecordLock lock(opt_.rundir);
    std::error_code ec;
    const std::string dir = opt_.rundir + "/sys/class/infiniband/" + n.name;
    if (std::filesystem::exists(dir, ec)) {
      why = "a link named " + n.name + " is already recorded";
      cfg.reset();
    } else {
      std::filesystem::create_directories(dir, ec);
      if (ec || !cfg->save(record_path(opt_.rundir, n.name), &why)) {
        if (ec) why = ec.message();
        cfg.reset();
      }
    }
  }
  if (!cfg) {
    log("kernel device %s (over %s) not served: %s", n.name.c_str(), n.netdev.c_str(), why.c_str());
    return;
  }
  if (open_link(n.name, &why) != 0) {
    log("kernel device %s (over %s) not served: %s", n.name.c_str(), n.netdev.c_str(), why.c_str());
    remove_record(opt_.rundir, n.name);
  }
}

void HostEngine::kernel_device_gone(int fd) {
  auto it = kernel_fds_.find(fd);
  if (it == kernel_fds_.end()) return;
  const std::string name = it->second;
  log("kernel device %s went away (rdma link delete, or its interface)", name.c_str());
  close_link(name);
  remove_record(opt_.rundir, name);
}

int HostEngine::close_link(const std::string& name, bool remove_kernel) {
  auto it = links_.find(name);
  if (it == links_.end()) return ENOENT;
  Link* link = it->second.get();
  // Every context on it sees the device go away (IBV_EVENT_DEVICE_FATAL from its provider).
  std::vector<int> socks;
  for (auto& [sock, s] : sessions_)
    if (s->link() == link) socks.push_back(sock);
  for (int sock : socks) reclaim(sock);
  on_datapath([&] { std::erase(link->dp->links, link); });
  if (link->kdev) {
    unwatch(link->kdev->fd());
    kernel_fds_.erase(link->kdev->fd());
    // Its contexts are disassociated (IB_EVENT_DEVICE_FATAL); otherwise closing the file only
    // detaches it (port DOWN) and a restarted engine attaches it again.
    if (remove_kernel && link->kdev->remove() != 0)
      log("link %s: kernel device not removed: %s", name.c_str(), std::strerror(errno));
  }
  links_.erase(it);  // goodbye on every plane, then the ports close
  log("link %s closed", name.c_str());
  return 0;
}

// --- datapath threads --------------------------------------------------------------------------

uint32_t datapath_threads_for(const EngineOptions& opt, int cpus) {
  uint32_t n = opt.datapath_threads;
  if (n == 0) {
    n = opt.cores.empty() ? static_cast<uint32_t>(std::max(cpus, 1) / 4)
                          : static_cast<uint32_t>(opt.cores.size());
  }
  return std::clamp<uint32_t>(n, 1, hostif::kMaxDatapathThreads);
}

bool HostEngine::make_datapaths(std::string* why) {
  if (!dps_.empty()) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  const uint32_t n = datapath_threads_for(opt_, cpus);
  for (uint32_t i = 0; i < n; ++i) {
    auto dp = std::make_unique<Datapath>();
    dp->index = i;
    dp->doorbell_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (dp->doorbell_fd < 0) {
      *why = std::string("cannot make a doorbell: ") + std::strerror(errno);
      for (auto& d : dps_) close(d->doorbell_fd);
      dps_.clear();
      return false;
    }
    dps_.push_back(std::move(dp));
  }
  return true;
}

void HostEngine::wake_datapath() {
  uint64_t one = 1;
  for (auto& dp : dps_) [[maybe_unused]] ssize_t n = write(dp->doorbell_fd, &one, sizeof(one));
}

void HostEngine::on_datapath(const std::function<void()>& fn) {
  if (!datapath_running_.load(std::memory_order_acquire)) {
    fn();
    return;
  }
  std::unique_lock lock(cmd_mu_);
  cmds_.push_back(&fn);
  const uint64_t ticket = ++cmd_next_;
  cmd_pending_.store(true, std::memory_order_release);
  wake_datapath();
  cmd_cv_.wait(lock, [&] { return cmd_done_ >= ticket; });
}

// Stop the world: a command may touch any link (a QP of one, the statistics of all), and a link
// is polled by its thread without a lock, so commands run on thread 0 only while every other
// datapath thread waits here between two passes.
void HostEngine::rendezvous(const Datapath& dp) {
  std::unique_lock lock(cmd_mu_);
  if (dp.index != 0) {
    const uint64_t round = cmd_rounds_;
    ++parked_;
    cmd_cv_.notify_all();
    // Thread 0 counts them out (parked_ = 0): one that has not yet left when the next round
    // begins is not counted as parked for it. Nor does anyone wait once thread 0 has left.
    cmd_cv_.wait(lock, [&] {
      return cmd_rounds_ != round || followers_leave_.load(std::memory_order_acquire);
    });
    return;
  }
  cmd_cv_.wait(lock, [&] { return parked_ == followers_; });
  lock.unlock();
  run_commands();
  lock.lock();
  parked_ = 0;
  ++cmd_rounds_;
  cmd_cv_.notify_all();
}

void HostEngine::run_commands() {
  std::unique_lock lock(cmd_mu_);
  while (!cmds_.empty()) {
    const std::function<void()>* fn = cmds_.front();
    cmds_.pop_front();
    lock.unlock();
    (*fn)();
    lock.lock();
    ++cmd_done_;
  }
  cmd_pending_.store(false, std::memory_order_release);
  cmd_cv_.notify_all();
}

bool HostEngine::links_left() const {
  for (const auto& dp : dps_)
    if (!dp->links.empty()) return true;
  return false;
}

// The link's port went down or came back: every context of the device hears it, as from a
// NIC's port (element: the port number).
void HostEngine::port_event(const Link& link) {
  const auto ev = link.nic->port_active() ? hostif::AsyncEvent::kPortActive
                                          : hostif::AsyncEvent::kPortErr;
  log("link %s: port %s", link.cfg.name.c_str(), link.nic->port_active() ? "active" : "down");
  // A kernel device's port follows its interface: the module raises the port's events itself.
  if (link.kdev) return;
  std::lock_guard lock(sessions_mu_);
  for (auto& [sock, s] : sessions_)
    if (s->link() == &link) s->async_event(1, ev);
}

void HostEngine::pin(const Datapath& dp) {
  if (opt_.cores.empty()) return;
  // One core each when there are enough; otherwise every thread may use every listed core.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (opt_.cores.size() >= dps_.size()) CPU_SET(opt_.cores[dp.index], &set);
  else
    for (int c : opt_.cores) CPU_SET(c, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0)
    log("cannot pin datapath thread %u to the given cores", dp.index);
}

// The nice value the options ask of the datapath threads (EngineOptions::nice); each thread
// sets its own, and thread 0 says what it got.
void HostEngine::set_priority(const Datapath& dp) {
  const auto tid = static_cast<id_t>(gettid());
  if (setpriority(PRIO_PROCESS, tid, opt_.nice) != 0 && dp.index == 0) {
    const int e = errno;
    log("datapath threads stay at nice %d: nice %d needs CAP_SYS_NICE (%s)",
        getpriority(PRIO_PROCESS, tid), opt_.nice, std::strerror(e));
  }
  if (dp.index == 0)
    datapath_nice_.store(getpriority(PRIO_PROCESS, tid), std::memory_order_relaxed);
}

// One pass over the thread's links; whether any had work.
bool HostEngine::pass(Datapath& dp, Time t, bool timers, uint64_t stalls) {
  bool work = false;
  for (Link* l : dp.links) {
    work |= l->layer->poll(t, timers);
    if (l->nic->take_port_change()) port_event(*l);
    if (l->nic->has_cm_events() && !cm_wake_.exchange(true, std::memory_order_acq_rel)) {
      uint64_t one = 1;
      [[maybe_unused]] ssize_t w = write(control_wake_fd_, &one, sizeof(one));
    }
    if (t >= l->next_publish) {
      l->next_publish = t + kPublishEvery;
      nic::publish_telemetry(*l->telemetry, *l->nic, *l->layer, l->sessions.load(), stalls);
      l->layer->flush_capture();  // a capture of a quiet link does not lag behind it
      l->nic->transport().sweep_idle(t, kIdleSweep);  // congestion.md §4.6
    }
  }
  return work;
}

void HostEngine::datapath_main(Datapath& dp) {
  const std::string name = "metaroce-dp" + (dp.index ? std::to_string(dp.index) : std::string());
  prctl(PR_SET_NAME, name.c_str(), 0, 0, 0);
  prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);  // short naps stay short
  pin(dp);
  set_priority(dp);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  const int cpus = sched_getaffinity(0, sizeof(mine), &mine) == 0 ? CPU_COUNT(&mine) : 1;
  Time last_work = now();
  StallGuard stalls(opt_.stall, last_work);
  const bool leader = dp.index == 0;
  for (;;) {
    if (commands_pending()) rendezvous(dp);
    if (leader ? stop_.load(std::memory_order_acquire) && !links_left()
               : followers_leave_.load(std::memory_order_acquire))
      break;
    const Time t = now();
    // After a stall of its own, what arrived meanwhile (the ACKs a timer would give up waiting
    // for; on two links of this engine, the peer's packets not yet even answered) is read
    // before any timer fires.
    const bool timers = stalls.begin(t);
    // The peers' silence does not count that time against them either (congestion.md §4.5).
    if (const auto from = stalls.stalled_from())
      for (Link* l : dp.links) l->nic->transport().stalled(*from, t);
    if (pass(dp, t, timers, stalls.stalls())) {
      last_work = t;
      continue;
    }
    stalls.quiet();
    if (opt_.spin == SpinPolicy::kAlways || t - last_work < opt_.spin_before_sleep) {
      // With fewer cores than threads that want one, spinning on a core takes it from the
      // application whose work we wait for: give it up each pass (docs/design.md, "Spinning").
      if (crowded(cpus)) sched_yield();
      else __builtin_ia32_pause();
      continue;
    }
    const Time meant = idle_wait(dp, t, t - last_work);
    stalls.napped(meant, now());
  }
  if (!leader) {
    std::lock_guard lock(cmd_mu_);
    --followers_;  // thread 0 no longer waits for this one to park
    cmd_cv_.notify_all();
    return;
  }
  // The others leave, then thread 0; commands queued meanwhile run inline from then on.
  {
    std::lock_guard lock(cmd_mu_);
    followers_leave_.store(true, std::memory_order_release);
    cmd_cv_.notify_all();  // those parked for a command
  }
  wake_datapath();
  for (auto& d : dps_)
    if (d.get() != &dp && d->thread.joinable()) d->thread.join();
  datapath_running_.store(false, std::memory_order_release);
  run_commands();
}

bool HostEngine::crowded(int cpus) const {
  // Threads that want a core: the datapath threads with links (one without naps), and a
  // polling thread per context (perftest, UCX and NCCL poll their CQs). An estimate, but the
  // counts that matter are small.
  uint32_t busy = 0;
  for (const auto& dp : dps_) {
    busy += !dp->links.empty();
    for (const Link* l : dp->links) busy += l->sessions.load(std::memory_order_relaxed);
  }
  return static_cast<uint32_t>(cpus) < busy;
}

// Returns when it meant to wake: t + the nap it took (t if none).
Time HostEngine::idle_wait(Datapath& dp, Time t, Time idle_for) {
  Time deadline = Time::max();
  bool queues = false;
  Time shortest = Time::max();
  for (Link* l : dp.links) {
    deadline = std::min(deadline, l->nic->next_deadline());
    queues |= l->nic->qp_count() > 0;
    shortest = std::min(shortest, l->nic->shortest_timer());
  }
  // While a link has queue pairs, a frame may be waiting unseen for as long as the nap: never
  // longer than the shortest time after which its sender takes it for lost.
  const Time nap = queues ? std::min(opt_.max_nap, shortest) : opt_.max_nap_unused;
  Time sleep = std::min(nap, deadline > t ? deadline - t : Time::zero());
  if (sleep <= Time::zero()) return t;
  // Every link whose ports can wake us (UDP sockets, af_packet and af_xdp queue sockets,
  // in-process links: every plane's) is waited on together with the doorbell, so a ping-pong
  // between two such links is woken by its packet, not at the end of a nap.
  pollfd fds[1 + kMaxWaitFds];
  nfds_t nfds = 1;
  fds[0] = {dp.doorbell_fd, POLLIN, 0};
  bool all_wake = true;
  for (Link* l : dp.links) {
    int lfds[kMaxWaitFds];
    const size_t n = l->layer->rx_wait_fds(lfds, kMaxWaitFds + 1 - nfds);
    if (n == 0) {
      all_wake = false;
      continue;
    }
    for (size_t p = 0; p < n; ++p) fds[nfds++] = {lfds[p], POLLIN, 0};
  }
  // Without a receive descriptor, arriving frames are noticed only when awake. Nap in
  // proportion to how long the link has been idle: a ping-pong keeps the naps short (its next
  // packet is near), a quiet link ends up polled once per `nap`.
  if (!all_wake) sleep = std::min(sleep, std::clamp(idle_for / 2, kMinNap, nap));
  for (Link* l : dp.links) l->layer->rx_arm();
  hostif::Index& sleeping = status_page_->sleeping[dp.index];
  sleeping.store(1);
  // Pairs with the fence drivers put between publishing a WQE and reading `sleeping`: either
  // they see us asleep and ring, or we see their work here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  bool work = commands_pending();
  for (Link* l : dp.links) work = work || l->nic->has_new_work();
  if (!work) {
    timespec ts{static_cast<time_t>(sleep.count() / 1000000000),
                static_cast<long>(sleep.count() % 1000000000)};
    if (ppoll(fds, nfds, &ts, nullptr) > 0) note_wake(fds, nfds);
    naps_.fetch_add(1, std::memory_order_relaxed);
  }
  sleeping.store(0);
  for (Link* l : dp.links) l->layer->rx_disarm();
  uint64_t drain;
  [[maybe_unused]] ssize_t r = read(dp.doorbell_fd, &drain, sizeof(drain));
  return work ? t : t + sleep;
}

// What ended a nap: the doorbell, or a frame on a port (counted; `metaroce engine status`). A
// socket with a pending error (an AF_PACKET socket says ENETDOWN when its interface goes down)
// polls as ready until the error is read: it is read here, or every nap would end at once.
void HostEngine::note_wake(pollfd* fds, nfds_t nfds) {
  if (fds[0].revents & POLLIN) naps_doorbell_.fetch_add(1, std::memory_order_relaxed);
  bool frame = false;
  for (nfds_t i = 1; i < nfds; ++i) {
    frame |= (fds[i].revents & POLLIN) != 0;
    if (fds[i].revents & POLLERR) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fds[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
    }
  }
  if (frame) naps_frame_.fetch_add(1, std::memory_order_relaxed);
}

// --- control thread --------------------------------------------------------------------------

void HostEngine::watch(int fd, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
}

void HostEngine::unwatch(int fd) { epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr); }

void HostEngine::control_main() {
  prctl(PR_SET_NAME, "metaroce-ctl", 0, 0, 0);
  std::vector<int> dead, gone_devices;
  while (!stop_.load(std::memory_order_acquire)) {
    epoll_event ev[32];
    const int n = epoll_wait(epoll_fd_, ev, 32, cm_.wants_tick_soon() ? 20 : 1000);
    if (n < 0 && errno != EINTR) break;
    if (n == 0) {
      // Sessions of processes that exited, where no pidfd says so (a forked child may hold
      // their socket open).
      for (auto& [sock, x] : sessions_)
        if (x->link() && x->pidfd() < 0 && kill(x->peer_pid(), 0) != 0 && errno == ESRCH)
          dead.push_back(sock);
      for (int sock : dead) reclaim(sock);
      dead.clear();
    }
    if (n == 0 && !run_dir_intact()) {
      // Nobody can reach an engine whose socket is gone (its run dir was removed, or another
      // engine took it over): it would only hold its ports and spin.
      request_stop(socket_path_ + " is gone: stopping");
      break;
    }
    // Descriptors close only after the whole batch: a number reused within it would be wrong.
    for (int i = 0; i < n; ++i) {
      const int fd = ev[i].data.fd;
      if (fd == listen_fd_) {
        accept_one();
      } else if (fd == control_wake_fd_) {
        uint64_t drain;
        [[maybe_unused]] ssize_t r = read(control_wake_fd_, &drain, sizeof(drain));
        cm_drain();
      } else if (fd == kernel_listener_) {
        while (auto notice = read_kernel_notice(kernel_listener_))
          if (notice->added) adopt(*notice);
      } else if (kernel_fds_.count(fd)) {
        gone_devices.push_back(fd);
      } else if (auto p = pidfds_.find(fd); p != pidfds_.end()) {
        dead.push_back(p->second);  // the process exited
      } else if (auto s = sessions_.find(fd); s != sessions_.end()) {
        const bool keep = (ev[i].events & EPOLLIN) ? handle(*s->second) : true;
        if (!keep || ((ev[i].events & (EPOLLHUP | EPOLLERR | EPOLLRDHUP)) && !(ev[i].events & EPOLLIN)))
          dead.push_back(fd);
      }
    }
    for (int sock : dead) reclaim(sock);
    dead.clear();
    for (int fd : gone_devices) kernel_device_gone(fd);
    gone_devices.clear();
    cm_.tick();
  }
  // Shutdown: every context, then every link (each says goodbye while the others still run).
  std::vector<int> socks;
  for (auto& [sock, s] : sessions_) socks.push_back(sock);
  for (int sock : socks) reclaim(sock);
  std::vector<std::string> names;
  for (auto& [name, l] : links_) names.push_back(name);
  for (const std::string& name : names) close_link(name);
  // Thread 0 leaves once no thread has a link left and it sees stop_; it takes the others along.
  wake_datapath();
  if (!dps_.empty() && dps_.front()->thread.joinable()) dps_.front()->thread.join();
}

bool HostEngine::run_dir_intact() const {
  struct stat st {};
  return stat(socket_path_.c_str(), &st) == 0 && st.st_ino == socket_inode_;
}

void HostEngine::accept_one() {
  for (;;) {
    const int sock = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (sock < 0) return;
    ucred cr{};
    socklen_t len = sizeof(cr);
    int one = 1;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 ||
        setsockopt(sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)) != 0) {
      close(sock);
      continue;
    }
    auto s = std::make_unique<Session>(sock, cr.pid, cr.uid);
    watch(sock, EPOLLIN | EPOLLRDHUP);
    std::lock_guard lock(sessions_mu_);
    sessions_[sock] = std::move(s);
  }
}

void HostEngine::reclaim(int sock) {
  auto it = sessions_.find(sock);
  if (it == sessions_.end()) return;
  Session& s = *it->second;
  unwatch(sock);
  if (s.pidfd() >= 0) {
    unwatch(s.pidfd());
    pidfds_.erase(s.pidfd());
  }
  s.mark_gone();
  if (s.cm_channel) cm_.close_channel(s.cm_channel);
  if (Link* link = s.link()) {
    on_datapath([&] { link->nic->release(&s); });
    link->sessions.fetch_sub(1);
  }
  std::lock_guard lock(sessions_mu_);
  sessions_.erase(it);  // closes its socket: a live driver sees the device go away
}

bool HostEngine::handle(Session& s) {
  Message req;
  const int err = hostif::recv_message(s.sock(), &req);
  if (err == EAGAIN || err == EINTR) return true;
  // Closed by the driver, or not speaking the protocol: forget it.
  if (err != 0) return false;
  Message resp;
  // Every message must come from the process that connected: a child that inherited the
  // descriptor is not that context (its memory is another address space).
  if (req.pid != static_cast<uint32_t>(s.peer_pid())) {
    resp = reply_to(req, EPERM);
  } else if (static_cast<uint16_t>(req.header.op) >= 100) {
    admin(s, req, &resp);
  } else if (req.header.op == Op::kHello) {
    hello(s, req, &resp);
  } else if (req.header.op == Op::kCmOpen) {
    cm_open(s, req, &resp);
  } else if (req.header.op == Op::kCmCommand) {
    cm_command(s, req, &resp);
  } else if (!s.link()) {
    resp = reply_to(req, EPROTO);  // kHello first
  } else {
    serve(s, req, &resp);
  }
  hostif::close_fds(&req);  // those no operation took
  const int sent = hostif::send_message(s.sock(), resp, MSG_DONTWAIT);
  hostif::close_fds(&resp);
  return sent == 0;  // a driver that does not read its answers is dropped
}

// --- RDMA CM (docs/spec/cm.md) ---------------------------------------------------------------

void HostEngine::cm_open(Session& s, Message& req, Message* resp) {
  if (s.link() || s.cm_channel || req.fds.size() != 1 || !req.body.empty()) {
    *resp = reply_to(req, EINVAL);
    return;
  }
  const int fd = take_fd(req, 0);
  int type = 0;
  socklen_t len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_SEQPACKET) {
    close(fd);
    *resp = reply_to(req, EINVAL);
    return;
  }
  hostif::CmOpenResp r;
  r.channel = s.cm_channel = cm_.open_channel(fd, static_cast<uint32_t>(s.peer_pid()));
  *resp = reply_to(req, 0);
  resp->set(r);
}

void HostEngine::cm_command(Session& s, const Message& req, Message* resp) {
  hostif::CmCommandReq h;
  const bool fits = req.body.size() >= sizeof(h);
  if (fits) std::memcpy(&h, req.body.data(), sizeof(h));
  const hostif::CmCommandReq* head = fits ? &h : nullptr;
  if (!s.cm_channel || !head ||
      req.body.size() != sizeof(hostif::CmCommandReq) + head->body_len + head->extra_len) {
    *resp = reply_to(req, s.cm_channel ? EINVAL : EPROTO);
    return;
  }
  const std::span<const uint8_t> all(req.body);
  const auto body = all.subspan(sizeof(hostif::CmCommandReq), head->body_len);
  const auto extra = all.subspan(sizeof(hostif::CmCommandReq) + head->body_len);
  std::vector<uint8_t> out;
  const int e = cm_.command(s.cm_channel, head->cmd, body, extra, head->out, &out);
  *resp = reply_to(req, e);
  if (!e) resp->body = std::move(out);
}

void HostEngine::cm_drain() {
  cm_wake_.store(false, std::memory_order_release);
  for (auto& [name, l] : links_) {
    std::vector<nic::Nic::CmEvent> evs;
    nic::Nic* nic = l->nic.get();
    on_datapath([&] { evs = nic->take_cm_events(); });
    for (auto& e : evs) {
      if (e.kind == nic::Nic::CmEvent::kMessage) cm_.on_message(name, e.peer_ip, e.bytes);
      else cm_.on_sent(e.token, e.kind == nic::Nic::CmEvent::kDelivered);
    }
  }
}

void HostEngine::hello(Session& s, Message& req, Message* resp) {
  auto body = req.as<hostif::HelloReq>();
  const bool kernel = body && (body->flags & hostif::kHelloKernel);
  if (!body || s.link() || req.fds.size() > (kernel ? 0u : 1u) ||
      (body->flags & ~hostif::kHelloKernel)) {
    *resp = reply_to(req, EINVAL);
    return;
  }
  if (body->abi != hostif::kAbiVersion) {
    *resp = reply_to(req, EPROTONOSUPPORT);
    return;
  }
  auto it = links_.find(hostif::get_name(body->link));
  if (it == links_.end()) {
    *resp = reply_to(req, ENODEV);
    return;
  }
  Link* link = it->second.get();
  // A kernel-backed link is opened through its kernel device only: its objects must be kernel
  // objects (their numbers come from the module), and its events go through the kernel.
  if (kernel != (link->kdev != nullptr)) {
    *resp = reply_to(req, kernel ? EINVAL : EPERM);
    return;
  }
  const int async_fd = take_fd(req, 0);
  bool attached;
  {
    // The datapath thread reads sessions' links (port events) under this lock.
    std::lock_guard lock(sessions_mu_);
    attached = s.attach(link, async_fd, link->kdev.get());
  }
  if (!attached) {
    const int e = errno ? errno : ESRCH;
    if (async_fd >= 0) close(async_fd);
    *resp = reply_to(req, e);
    return;
  }
  if (s.pidfd() >= 0) {
    pidfds_[s.pidfd()] = s.sock();
    watch(s.pidfd(), EPOLLIN);
  }
  link->sessions.fetch_add(1);
  hostif::HelloResp h;
  h.ip = link->cfg.ip;
  h.link_mtu = link->cfg.mtu;
  h.active_mtu = link->nic->active_mtu();
  h.paths = link->cfg.paths;
  h.planes = static_cast<uint16_t>(link->layer->planes());
  h.max_qp_wr = nic::kMaxQpWr;
  h.max_sge = nic::kMaxSge;
  h.max_inline = nic::kMaxInline;
  h.max_cqe = nic::kMaxCqe;
  h.max_srq_wr = nic::kMaxSrqWr;
  h.max_rd_atomic = nic::kMaxRdAtomic;
  h.status_bytes = kStatusBytes;
  h.engine_pid = static_cast<uint32_t>(getpid());
  h.datapath = link->dp->index;
  Message r = reply_to(req, 0);
  r.set(h);
  // The kernel duplicates them into the driver (closed here after sending); ours stay ours.
  r.fds = {dup(link->dp->doorbell_fd), dup(status_.fd())};
  *resp = std::move(r);
}

}  // namespace metaroce::engine
