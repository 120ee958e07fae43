// SPDX-License-Identifier: Apache-2.0
// metaroced: the MetaRoCE engine of a host (docs/design.md, "The engine"). Started by systemd
// (metaroced.service) or, where none runs, by `metaroce link add`.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "datapath/engine/host_engine.h"

namespace {

using metaroce::engine::EngineOptions;
using metaroce::engine::HostEngine;
using metaroce::engine::SpinPolicy;

constexpr const char* kUsage =
    "Usage: metaroced [--rundir DIR] [--cores LIST] [--datapath-threads N]\n"
    "                 [--spin adaptive|always] [--spin-us N] [--stall-us N] [--nice N]\n"
    "                 [--hugepages]\n"
    "                 [--kernel-devices serve|ignore] [--daemon [--log FILE]]\n"
    "\n"
    "The MetaRoCE engine: serves every link recorded in DIR (default $METAROCE_RUNDIR or\n"
    "/run/metaroce) to every process on the host. Its links are divided among datapath threads:\n"
    "one per four CPUs it may run on (at least 1, at most 8), one per core of --cores (which pins\n"
    "each to its core, e.g. 1 or 2-3), or --datapath-threads N (1..8). --spin always never\n"
    "sleeps (lowest latency, a whole core per thread), adaptive (default) spins\n"
    "--spin-us microseconds (20) after the last work and then naps. The datapath threads run at\n"
    "nice -10 (--nice N, -20..19, sets another) so that one woken by a frame runs before a\n"
    "spinning application. After a pass that came more than --stall-us microseconds (250; 0:\n"
    "never) after the one before, the transport's timers wait until what arrived meanwhile is\n"
    "read (16 passes at most), and the QPs' retry limits do not count that time as the peers'\n"
    "silence. --kernel-devices serve (default for\n"
    "/run/metaroce, where the metaroce_ib module is loaded) serves the devices\n"
    "`rdma link add NAME type metaroce netdev IF` creates. --daemon detaches once the engine\n"
    "serves, logging to FILE (default DIR/engine.log).\n";

HostEngine* g_engine = nullptr;
int g_signal_pipe[2] = {-1, -1};

void on_signal(int) {
  const char c = 1;
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &c, 1);
}

bool parse_cores(const std::string& text, std::vector<int>* out) {
  size_t i = 0;
  while (i < text.size()) {
    size_t end = text.find(',', i);
    if (end == std::string::npos) end = text.size();
    const std::string part = text.substr(i, end - i);
    const size_t dash = part.find('-');
    char* e = nullptr;
    const long a = std::strtol(part.c_str(), &e, 10);
    if (e == part.c_str() || a < 0 || a >= CPU_SETSIZE) return false;
    long b = a;
    if (dash != std::string::npos) {
      const std::string hi = part.substr(dash + 1);
      char* e2 = nullptr;
      b = std::strtol(hi.c_str(), &e2, 10);
      if (e2 == hi.c_str() || *e2 || b < a || b >= CPU_SETSIZE) return false;
    } else if (*e) {
      return false;
    }
    for (long c = a; c <= b; ++c) out->push_back(static_cast<int>(c));
    i = end + 1;
  }
  return !out->empty();
}

// systemd's readiness protocol (sd_notify) without libsystemd: one datagram to $NOTIFY_SOCKET.
void notify_ready() {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (!path || !*path) return;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const size_t len = std::strlen(path);
  if (len >= sizeof(a.sun_path)) return;
  std::memcpy(a.sun_path, path, len);
  if (a.sun_path[0] == '@') a.sun_path[0] = '\0';
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  const char msg[] = "READY=1";
  sendto(fd, msg, sizeof(msg) - 1, MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&a),
         static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len));
  close(fd);
}

bool parse_threads(const char* what, const std::string& v, EngineOptions* opt) {
  char* e = nullptr;
  const long n = std::strtol(v.c_str(), &e, 10);
  if (e == v.c_str() || *e || n < 1 || n > static_cast<long>(metaroce::hostif::kMaxDatapathThreads)) {
    std::fprintf(stderr, "metaroced: bad %s '%s': expected 1..%u\n", what, v.c_str(),
                 metaroce::hostif::kMaxDatapathThreads);
    return false;
  }
  opt->datapath_threads = static_cast<uint32_t>(n);
  return true;
}

struct Args {
  EngineOptions opt;
  bool daemon = false;
  std::string log_file;
  std::string kernel_devices;
};

// The command line into *args; the exit status when the program ends here (--help, a bad
// argument), nothing when it goes on.
std::optional<int> parse_args(int argc, char** argv, Args* args) {
  EngineOptions& opt = args->opt;
  const char* env = std::getenv("METAROCE_RUNDIR");
  opt.rundir = env && *env ? env : "/run/metaroce";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* what) -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "metaroced: %s needs a value\n%s", what, kUsage);
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--rundir") {
      opt.rundir = value("--rundir");
    } else if (arg == "--cores") {
      const std::string v = value("--cores");
      if (!parse_cores(v, &opt.cores)) {
        std::fprintf(stderr, "metaroced: bad --cores '%s': expected a list like 1 or 0,2-3\n",
                     v.c_str());
        return 2;
      }
    } else if (arg == "--datapath-threads") {
      if (!parse_threads("--datapath-threads", value("--datapath-threads"), &opt)) return 2;
    } else if (arg == "--spin") {
      const std::string v = value("--spin");
      if (v == "always") opt.spin = SpinPolicy::kAlways;
      else if (v == "adaptive") opt.spin = SpinPolicy::kAdaptive;
      else {
        std::fprintf(stderr, "metaroced: bad --spin '%s': expected adaptive or always\n", v.c_str());
        return 2;
      }
    } else if (arg == "--spin-us" || arg == "--stall-us") {
      const std::string v = value(arg.c_str());
      char* e = nullptr;
      const long us = std::strtol(v.c_str(), &e, 10);
      if (e == v.c_str() || *e || us < 0 || us > 1000000) {
        std::fprintf(stderr, "metaroced: bad %s '%s': expected 0..1000000\n", arg.c_str(), v.c_str());
        return 2;
      }
      (arg == "--spin-us" ? opt.spin_before_sleep : opt.stall) = std::chrono::microseconds(us);
    } else if (arg == "--nice") {
      const std::string v = value("--nice");
      char* e = nullptr;
      const long n = std::strtol(v.c_str(), &e, 10);
      if (e == v.c_str() || *e || n < -20 || n > 19) {
        std::fprintf(stderr, "metaroced: bad --nice '%s': expected -20..19\n", v.c_str());
        return 2;
      }
      opt.nice = static_cast<int>(n);
    } else if (arg == "--hugepages") {
      opt.hugepages = true;
    } else if (arg == "--kernel-devices") {
      args->kernel_devices = value("--kernel-devices");
      if (args->kernel_devices != "serve" && args->kernel_devices != "ignore") {
        std::fprintf(stderr, "metaroced: bad --kernel-devices '%s': expected serve or ignore\n",
                     args->kernel_devices.c_str());
        return 2;
      }
    } else if (arg == "--daemon") {
      args->daemon = true;
    } else if (arg == "--log") {
      args->log_file = value("--log");
    } else {
      std::fprintf(stderr, "metaroced: unknown argument '%s'\n%s", arg.c_str(), kUsage);
      return 2;
    }
  }
  // The tests run whole suites with several threads through the environment (scripts/test).
  if (const char* n = std::getenv("METAROCE_DATAPATH_THREADS");
      n && *n && opt.datapath_threads == 0 && !parse_threads("METAROCE_DATAPATH_THREADS", n, &opt))
    return 2;
  // One engine per host serves `rdma link add`: the system's, unless told otherwise.
  opt.serve_kernel_devices = args->kernel_devices.empty() ? opt.rundir == "/run/metaroce"
                                                          : args->kernel_devices == "serve";
  if (!args->log_file.empty() && !args->daemon) {
    std::fprintf(stderr, "metaroced: --log only goes with --daemon\n");
    return 2;
  }
  return std::nullopt;
}

// Detaches: the parent waits until the child serves (or says why it cannot), then exits with
// the status returned here; the child goes on (nothing returned) with ready[1] to say which,
// logging to log_file (default rundir/engine.log).
std::optional<int> detach(const std::string& rundir, std::string log_file, int ready[2]) {
  if (pipe2(ready, O_CLOEXEC) != 0) {
    std::perror("metaroced: pipe");
    return 1;
  }
  const pid_t child = fork();
  if (child < 0) {
    std::perror("metaroced: fork");
    return 1;
  }
  if (child > 0) {
    close(ready[1]);
    char buf[512];
    ssize_t n = read(ready[0], buf, sizeof(buf) - 1);
    if (n > 0 && buf[0] == 'R') return 0;
    if (n > 1) {
      buf[n] = '\0';
      std::fprintf(stderr, "metaroced: %s\n", buf + 1);
    } else {
      std::fprintf(stderr, "metaroced: the engine exited before serving\n");
    }
    return 1;
  }
  close(ready[0]);
  setsid();
  if (log_file.empty()) log_file = rundir + "/engine.log";
  const int log = open(log_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null >= 0) dup2(null, 0);
  if (log >= 0) {
    dup2(log, 1);
    dup2(log, 2);
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const auto status = parse_args(argc, argv, &args)) return *status;
  const EngineOptions& opt = args.opt;
  const bool daemon = args.daemon;
  mkdir(opt.rundir.c_str(), 0755);
  int ready[2] = {-1, -1};
  if (daemon) {
    if (const auto status = detach(opt.rundir, args.log_file, ready)) return *status;
  }

  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) return 1;
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  HostEngine engine(opt);
  g_engine = &engine;
  std::string why;
  if (!engine.start(&why)) {
    if (daemon) {
      const std::string msg = "E" + why;
      [[maybe_unused]] ssize_t n = write(ready[1], msg.data(), msg.size());
    } else {
      std::fprintf(stderr, "metaroced: %s\n", why.c_str());
    }
    return 1;
  }
  if (daemon) {
    [[maybe_unused]] ssize_t n = write(ready[1], "R", 1);
    close(ready[1]);
  }
  notify_ready();
  // A signal or a kShutdown request ends the engine.
  std::thread waiter([&] {
    char c;
    [[maybe_unused]] ssize_t n = read(g_signal_pipe[0], &c, 1);
    engine.stop();
  });
  engine.wait();
  on_signal(0);  // a kShutdown: let the waiter stop it
  waiter.join();
  engine.stop();
  std::fprintf(stderr, "metaroced: stopped\n");
  return 0;
}
