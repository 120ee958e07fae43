// SPDX-License-Identifier: Apache-2.0
// The MetaRoCE engine of a host (docs/design.md, "The engine"): one per run dir, as a NIC is one
// per host. It owns the ports and the NIC of every link, runs them on datapath threads (each link
// on one) with the idle policy its user chose, and serves every process's driver contexts through the control
// socket <run dir>/engine.sock and the shared rings of each object. metaroced runs it; tests
// host it in-process with in-memory ports.
//
// Threads: a link's datapath thread alone touches its NIC and link layer; the control thread
// accepts connections, checks and answers requests, opens and closes links, and notices
// processes that exit. It hands every NIC operation to the datapath threads (run while all are
// parked) and waits for it.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "datapath/engine/cm.h"
#include "datapath/engine/kernel_device.h"
#include "datapath/engine/session.h"
#include "datapath/engine/shm.h"
#include "datapath/hostif/control.h"
#include "datapath/io/port.h"
#include "datapath/nic/link_layer.h"
#include "datapath/nic/nic.h"
#include "datapath/nic/telemetry_writer.h"

namespace metaroce::engine {

enum class SpinPolicy : uint8_t {
  kAdaptive,  // spin a little after the last work, then nap in proportion to idleness
  kAlways,    // never sleep: lowest latency, a whole core
};

using PortOpener = std::function<std::vector<std::unique_ptr<io::Port>>(const nic::LinkConfig&,
                                                                         std::string* why)>;


struct EngineOptions {
  std::string rundir;             // links are <rundir>/sys/class/infiniband/*/metaroce.conf
  std::vector<int> cores;         // CPUs of the datapath threads (one each); empty: anywhere
  SpinPolicy spin = SpinPolicy::kAdaptive;
  transport::Time spin_before_sleep = std::chrono::microseconds(20);
  // Nice value of the datapath threads (-20..19): ahead of the applications, so that a thread
  // woken by a frame or a doorbell preempts one spinning on the only CPUs there are, as a NIC's
  // interrupt would (docs/design.md, "Datapath threads run first"). Below the engine's own
  // value needs CAP_SYS_NICE; without it they stay as they are.
  int nice = -10;
  // A pass later than this after the previous one is a stall of the engine's own (descheduled,
  // a long command, a paused VM): timers wait while it catches up (datapath_main). 0: never.
  transport::Time stall = std::chrono::microseconds(250);
  // Longest nap while a link has queue pairs (frames are only seen when awake: memif has no
  // receive interrupt in DPDK 22.11), and while none has any.
  transport::Time max_nap = std::chrono::milliseconds(1);
  transport::Time max_nap_unused = std::chrono::milliseconds(20);
  bool hugepages = false;
  PortOpener open_ports;          // default: the DPDK device strings of the record
  bool open_recorded_links = true;  // at start, open every link recorded in the run dir
  // Serve the metaroce_ib devices that `rdma link add` makes (docs/spec/kernel.md §2): each gets
  // a link record of its own (UDP sockets on its interface) and is attached. One engine per host
  // does (metaroced: the one of the default run dir).
  bool serve_kernel_devices = false;
  // Datapath threads the links are divided among (1..hostif::kMaxDatapathThreads); 0: decided
  // from the CPUs the engine may run on (datapath_threads_for).
  uint32_t datapath_threads = 0;
};

// How many datapath threads an engine runs when not told: one per four CPUs of its CPU set (the
// rest are the applications'), at least one, at most hostif::kMaxDatapathThreads; with --cores,
// one per listed core.
uint32_t datapath_threads_for(const EngineOptions& opt, int cpus);

struct Link;
// One datapath thread: the links it serves, its doorbell (drivers of those links ring it when
// its StatusPage::sleeping[index] says it sleeps).
struct Datapath {
  uint32_t index = 0;
  int doorbell_fd = -1;
  std::vector<Link*> links;  // changed only by commands, while every datapath thread is parked
  std::thread thread;
};

// One open link.
struct Link {
  nic::LinkConfig cfg;
  std::unique_ptr<nic::Nic> nic;
  std::unique_ptr<nic::LinkLayer> layer;
  std::unique_ptr<nic::TelemetryWriter> telemetry;
  transport::Time next_publish{};
  std::atomic<uint32_t> sessions{0};
  std::unique_ptr<KernelDevice> kdev;  // kernel-backed links: the attached kernel device
  Datapath* dp = nullptr;              // the thread that serves it
};

class HostEngine {
 public:
  explicit HostEngine(EngineOptions opt);
  ~HostEngine();
  HostEngine(const HostEngine&) = delete;
  HostEngine& operator=(const HostEngine&) = delete;

  // Takes the run dir (its lock and socket), opens the recorded links, starts both threads.
  // False, with a one-line reason, when another engine holds the run dir or the socket cannot
  // be made. A link that cannot be opened is logged and left closed.
  bool start(std::string* why);
  // Blocks until stop() or a kShutdown request.
  void wait();
  // Closes every session and link (goodbyes included) and stops the threads.
  void stop();

  // 0 or an errno; *why says what went wrong. Control thread (or before start()).
  int open_link(const std::string& name, std::string* why);
  // remove_kernel: unregister a kernel-backed link's kernel device too (`metaroce link del`);
  // otherwise it is only detached (the engine stops, or the device already went away).
  int close_link(const std::string& name, bool remove_kernel = false);

  const std::string& socket_path() const { return socket_path_; }
  size_t session_count() const;

 private:
  static constexpr size_t kMaxWaitFds = 32;  // ports' receive descriptors one nap waits on

  // Datapath threads. Thread 0 leads: it runs the commands while the others are parked, and
  // leaves last.
  bool make_datapaths(std::string* why);
  void datapath_main(Datapath& dp);
  void pin(const Datapath& dp);
  void set_priority(const Datapath& dp);
  bool pass(Datapath& dp, transport::Time t, bool timers, uint64_t stalls);
  transport::Time idle_wait(Datapath& dp, transport::Time now, transport::Time idle_for);
  void note_wake(pollfd* fds, nfds_t nfds);
  // Whether the host has fewer of the datapath's CPUs (cpus) than threads that want one.
  bool crowded(int cpus) const;
  bool commands_pending() const { return cmd_pending_.load(std::memory_order_acquire); }
  // Thread 0 runs the queued commands once every other datapath thread is parked; the others
  // park until it has.
  void rendezvous(const Datapath& dp);
  void run_commands();
  // Runs fn while every datapath thread is parked (on thread 0), and waits for it; inline when
  // they are not running. Every NIC operation goes through it.
  void on_datapath(const std::function<void()>& fn);
  void wake_datapath();
  bool links_left() const;
  transport::Time now() const;

  // Control thread.
  void control_main();
  void accept_one();
  // One request of s and its answer; false when the session is to be dropped.
  bool handle(Session& s);
  // The answer to one object request of s (serve.h: a handler per operation, NIC operations
  // run on the datapath thread). An operation that keeps a descriptor of the request sets its
  // entry to -1; the rest are closed after.
  void serve(Session& s, hostif::Message& req, hostif::Message* resp);
  friend class Server;
  // ENOMEM when one more object of `kind` (-1: none) or `ring_bytes` more ring memory would take
  // the process over its share of the link, or the link over its ring memory; else 0.
  int room(const Session& s, int kind, size_t ring_bytes) const;
  // An administrator's request (admin.cc: `metaroce link`, `engine`, `stat`, `capture`), and
  // the handlers of those that take more than a line: 0 or an errno, the answer's body in r.
  void admin(Session& s, const hostif::Message& req, hostif::Message* resp);
  int admin_link(const hostif::Message& req, hostif::Message& r);
  int engine_info(hostif::Message& r);
  int link_plane(const hostif::Message& req);
  int link_capture(const hostif::Message& req, hostif::Message& r);
  int session_info(const hostif::Message& req, hostif::Message& r);
  // Wakes wait(), saying why in the log.
  void request_stop(const std::string& why);
  void hello(Session& s, hostif::Message& req, hostif::Message* resp);
  // Releases everything a session holds and forgets it.
  void reclaim(int sock);
  // False once engine.sock is no longer the socket this engine made.
  bool run_dir_intact() const;
  void watch(int fd, uint32_t events);
  void unwatch(int fd);
  std::unique_ptr<Link> make_link(const nic::LinkConfig& cfg, std::string* why);
  // A kernel device to serve (`rdma link add`): its record, then the link.
  void adopt(const KernelNotice& n);
  // A kernel-backed link's device went away: the link and its record go too.
  void kernel_device_gone(int fd);
  // The RDMA CM (docs/spec/cm.md): a channel's first message, its commands, and what the
  // links' NICs received or could not deliver for it.
  void cm_open(Session& s, hostif::Message& req, hostif::Message* resp);
  void cm_command(Session& s, const hostif::Message& req, hostif::Message* resp);
  void cm_drain();
  CmService cm_;
  std::atomic<bool> cm_wake_{false};  // the datapath asked the control thread to drain

  const EngineOptions opt_;
  std::string socket_path_;
  ino_t socket_inode_ = 0;
  int lock_fd_ = -1;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int control_wake_fd_ = -1;  // eventfd: stop the control thread
  // The datapath threads; each has a doorbell (eventfd: drivers and commands wake it).
  std::vector<std::unique_ptr<Datapath>> dps_;
  Segment status_;            // hostif::StatusPage every driver maps read-only
  hostif::StatusPage* status_page_ = nullptr;

  // Links: the map is the control thread's; each Datapath's `links` is its thread's share.
  std::map<std::string, std::unique_ptr<Link>> links_;
  std::unordered_map<int, std::string> kernel_fds_;  // attached kernel device fd -> link
  int kernel_listener_ = -1;                          // notices of devices to serve

  // Sessions by socket and by pidfd (control thread only).
  std::unordered_map<int, std::unique_ptr<Session>> sessions_;
  std::unordered_map<int, int> pidfds_;  // pidfd -> socket
  void port_event(const Link& link);
  mutable std::mutex sessions_mu_;       // session_count() from other threads

  // Commands for the datapath thread.
  std::mutex cmd_mu_;
  std::condition_variable cmd_cv_;
  std::deque<const std::function<void()>*> cmds_;
  uint64_t cmd_done_ = 0, cmd_next_ = 0;
  std::atomic<bool> cmd_pending_{false};
  uint32_t parked_ = 0;          // datapath threads (not 0) waiting in rendezvous
  uint32_t followers_ = 0;       // datapath threads (not 0) still running
  uint64_t cmd_rounds_ = 0;      // rendezvous thread 0 has finished: the others go on
  std::atomic<bool> followers_leave_{false};

  std::thread control_;
  std::atomic<bool> datapath_running_{false};
  // Naps of the datapath thread, and those a frame on a port or the doorbell ended (note_wake).
  std::atomic<uint64_t> naps_{0}, naps_frame_{0}, naps_doorbell_{0};
  std::atomic<int> datapath_nice_{0};  // what thread 0 runs at (set_priority)
  std::atomic<bool> stop_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopped_ = false;
  bool started_ = false;
};

}  // namespace metaroce::engine
