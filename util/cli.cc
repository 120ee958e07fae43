// SPDX-License-Identifier: Apache-2.0
// The `metaroce` command: link records plus the sysfs tree and device node through which an
// unmodified libibverbs discovers a MetaRoCE device on a host without RDMA in the kernel.
#include "util/cli.h"
#include "util/engine_client.h"
#include "util/operator.h"
#include "util/record.h"
#include "util/stat.h"
#include "util/top.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <net/if.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include "datapath/fabric/fabric_control.h"
#include "datapath/io/dpdk_port.h"
#include "datapath/fabric/idle_policy.h"
#ifdef METAROCE_HAVE_DPDK
#include "datapath/fabric/fabric_runner.h"
#endif
#include "kernel/metaroce_ib/metaroce_ib_abi.h"

#ifdef METAROCE_HAVE_DPDK
#define ALLOW_EXPERIMENTAL_API 1  // rte_devargs_reset is still experimental in 22.11
#include <dirent.h>
#include <dlfcn.h>
#include <rte_devargs.h>
#include <rte_log.h>
#endif

#ifndef METAROCE_VERSION
#define METAROCE_VERSION "unknown"
#endif
#ifndef METAROCE_BUILD_ROOT
#define METAROCE_BUILD_ROOT ""
#endif
#ifndef METAROCE_PRELOAD_PATH
#define METAROCE_PRELOAD_PATH ""
#endif
#ifndef METAROCE_ENGINE_PATH
#define METAROCE_ENGINE_PATH ""
#endif

namespace metaroce::util {
namespace {

namespace fs = std::filesystem;

// libibverbs checks the uverbs ABI of class/infiniband_verbs against 3..6; 6 is the current one.
constexpr const char* kUverbsClassAbi = "6";
// /dev/full: opening succeeds, and the one command libibverbs still writes itself
// (create_comp_channel) fails cleanly with ENOSPC instead of reading garbage.
constexpr unsigned kNodeMajor = 1;
constexpr unsigned kNodeMinor = 7;
constexpr const char* kRunDirDefault = "/run/metaroce";
// The file scripts/bundle puts in a bundle's top folder: its binaries run from there.
constexpr const char* kBundleMark = "share/metaroce/bundle";

constexpr const char* kMainHelp =
    "Usage: metaroce [--help] [--version] COMMAND ...\n"
    "\n"
    "Commands:\n"
    "  link add NAME --dpdk DEVARGS --ip ADDR/PREFIX [--mtu BYTES] [--paths N] [--udp-port P]\n"
    "           [--rx-capacity MBPS]\n"
    "  link add NAME --udp IFACE|any --ip ADDR/PREFIX [...]   on kernel UDP sockets\n"
    "  link add NAME --fabric FABRIC:ENDPOINT --ip ADDR/PREFIX [...]\n"
    "  link del NAME\n"
    "  link set NAME --plane P up|down   take one plane of a link out of service, or back\n"
    "  link show [NAME] [--json]\n"
    "  link apply [FILE]        add the links of FILE (default /etc/metaroce/links.conf)\n"
    "  link flush               delete every link\n"
    "  env                      print the shell settings that make libibverbs find the links\n"
    "  exec [--] PROGRAM [ARGS...]   run PROGRAM with those settings\n"
    "  stat NAME [--json] [--watch S]   live per-connection and per-path counters of a link\n"
    "  capture NAME -w FILE [-c N] [-d S]   a link's frames as pcap (Wireshark: metaroce.lua)\n"
    "  export [--listen ADDR:PORT]   every link's counters in the Prometheus text format\n"
    "  events NAME [-d S]       timestamped path failures, failovers, re-picks, timeouts\n"
    "  top [NAME...]            live view of every connection's paths, worst marked, events below\n"
    "  record NAME -o FILE      every path's counters over time, for top --replay and plots\n"
    "  engine start|stop|status  the host's engine, which serves every link to every process\n"
    "  fabric run|set|stat|stop NAME ...   the fabric emulator (see 'metaroce fabric --help')\n"
    "\n"
    "Links live in $METAROCE_RUNDIR (default /run/metaroce); `link add` starts the engine of that\n"
    "run dir (metaroced, or the program $METAROCE_ENGINE names) when none runs. Typical use:\n"
    "  metaroce link add mr0 --dpdk net_memif0,role=server --ip 10.0.0.1/24\n"
    "  metaroce exec -- ib_write_bw -d mr0       (or: eval \"$(metaroce env)\"; ib_write_bw ...)\n";

constexpr const char* kLinkHelp =
    "Usage: metaroce link add NAME --dpdk DEVARGS --ip ADDR/PREFIX [OPTIONS]\n"
    "       metaroce link del NAME\n"
    "       metaroce link set NAME --plane P up|down\n"
    "       metaroce link show [NAME] [--json]\n"
    "       metaroce link apply [FILE] [--check]   (see 'metaroce link apply --help')\n"
    "       metaroce link flush\n"
    "\n"
    "  NAME            device name, 1..63 of [A-Za-z0-9_-] (what `ibv_devices` lists)\n"
    "  --dpdk DEVARGS  DPDK device: driver[,key=value]*, e.g. net_memif0,role=server; given\n"
    "                  N times (N <= 16), one port per plane, plane 0 first\n"
    "                  (net_af_packetN,iface=IF / net_af_xdpN,iface=IF: a kernel interface,\n"
    "                  whose routes and neighbours the link uses; a PCI address: a NIC bound\n"
    "                  to vfio-pci)\n"
    "  --udp IFACE     a plane on kernel UDP sockets (GSO/GRO) through interface IFACE, or\n"
    "                  `any` for wherever the kernel routes; mixes with --dpdk, in order. The\n"
    "                  --ip address must be one of the host's (e.g. on lo)\n"
    "  --fabric FABRIC:ENDPOINT  instead of --dpdk: attach to every plane of endpoint ENDPOINT\n"
    "                  of a running `metaroce fabric run FABRIC`\n"
    "  --ip ADDR/PREFIX  IPv4 address of the link; GID 0 is its IPv4-mapped form\n"
    "  --mtu BYTES     IP MTU, 576..9600 (default: the smallest MTU of the planes' kernel\n"
    "                  interfaces, else 9000; af_xdp: at most 3442)\n"
    "  --paths N       paths (UDP source ports) per connection, 1..256 (default 8 per plane)\n"
    "  --udp-port P    UDP destination port, 1..65535 (default 4793)\n"
    "  --limit qp=N,cq=N,srq=N,pd=N,mr=N,ring-mib=N   what the device holds at most (any subset;\n"
    "                  defaults 16384 QPs, CQs and SRQs, 65536 PDs, 2^20 regions and windows,\n"
    "                  a quarter of the host's memory for rings)\n"
    "  --process-limit ...   what one process may hold of it, as --limit (default: the device's\n"
    "                  limits, an eighth of the host's memory for rings); ibv_query_device\n"
    "                  reports these\n"
    "  --rx-capacity MBPS  inbound capacity the receiver shares among its senders with\n"
    "                  fair-share rate hints (default: none, senders rely on ECN alone)\n"
    "  --json          `show` prints a JSON array\n";

constexpr const char* kEngineHelp =
    "Usage: metaroce engine start [--cores LIST] [--datapath-threads N] [--spin adaptive|always]\n"
    "                             [--spin-us N] [--stall-us N]\n"
    "       metaroce engine stop\n"
    "       metaroce engine status [--json]\n"
    "\n"
    "The engine (metaroced) owns the ports of every link of the run dir and serves them to every\n"
    "process on the host. `start` runs one in the background unless one already serves the run\n"
    "dir (the options go to metaroced: --cores pins its datapath threads, one per core,\n"
    "--datapath-threads divides the links among N threads, --spin always never sleeps);\n"
    "`link add` does it too. `stop` closes every link's ports (applications get\n"
    "IBV_EVENT_DEVICE_FATAL); the links stay recorded and a new engine opens them again.\n"
    "`status` lists the contexts it serves: process, link, objects held.\n";

constexpr const char* kFabricHelp =
    "Usage: metaroce fabric run NAME --endpoints E --planes P [OPTIONS]\n"
    "       metaroce fabric set NAME [--plane P] [--link L] SETTING...\n"
    "       metaroce fabric stat NAME [--json]\n"
    "       metaroce fabric stop NAME\n"
    "\n"
    "A DPDK process emulating E endpoints joined by P leaf-spine planes; endpoint e attaches to\n"
    "plane p over memif socket metaroce-fabric-NAME-e<e>-p<p> (`metaroce link add --fabric`).\n"
    "A frame crosses core link hash(5-tuple) % K of its plane, then the destination's edge link.\n"
    "\n"
    "run options (rates like 100G, 800M; 0 = unlimited):\n"
    "  --endpoints E         1..64                --planes P          1..16\n"
    "  --links-per-plane K   1..1024 (default 4)  --rate R            core links (default 100G)\n"
    "  --edge-rate R         edge links (default --rate)\n"
    "  --queue BYTES         per-link queue, tail drop (default 1048576)\n"
    "  --ecn-threshold BYTES CE-mark ECT frames above this occupancy (default 131072)\n"
    "  --loss PROB  --delay USEC  --reorder PROB  --reorder-delay USEC   core links\n"
    "  --duplicate PROB      core links send a frame on twice (a copy queued behind it)\n"
    "  --seed N              loss/reorder/duplicate draws and ECMP hash (default 1)\n"
    "  --seconds S           stop after S seconds (default: until SIGTERM/SIGINT or `stop`)\n"
    "  --spin adaptive|always  idle policy, as metaroced's: adaptive (default) polls --spin-us N\n"
    "                        microseconds (100) after the last frame, then naps, each nap 1 us\n"
    "                        longer, up to --max-nap-us N (1000); always never sleeps (lowest\n"
    "                        latency, a whole core)\n"
    "\n"
    "set: --plane P (default all), --link coreN|edgeN|N (default all links of the plane);\n"
    "SETTING: loss=PROB delay=USEC rate=R reorder=PROB reorder_delay=USEC dup=PROB\n"
    "ecn=BYTES queue=BYTES down up\n";

// --- small file helpers; every error comes back as text, nothing throws ------------------------

bool write_file(const std::string& path, const std::string& content, std::string* err) {
  std::ofstream f(path, std::ios::out | std::ios::trunc);
  f << content;
  f.close();
  if (!f) {
    *err = "cannot write " + path + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

std::optional<std::string> read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  return line;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_our_node(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode) &&
         major(st.st_rdev) == kNodeMajor && minor(st.st_rdev) == kNodeMinor;
}

// An error that names a privilege problem in the words the brief asks for.
std::string describe(const std::string& what, int e) {
  if (e == EACCES || e == EPERM) return "permission denied: " + what + " (run as root)";
  return what + ": " + std::strerror(e);
}

// Whether this process may create things in dir, or create dir itself where it is missing.
bool writable(const std::string& dir) {
  fs::path d = dir;
  std::error_code ec;
  while (!d.empty() && !fs::exists(d, ec)) {
    if (d == d.parent_path()) break;
    d = d.parent_path();
  }
  return ::access(d.empty() ? "." : d.c_str(), W_OK) == 0;
}

template <typename T>
bool parse_number(const std::string& s, T lo, T hi, T* out) {
  if (s.empty() || s.size() > 12) return false;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi) return false;
  *out = static_cast<T>(v);
  return true;
}

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-';
}

// Quotes a value for `eval` only where the shell would otherwise split or expand it.
std::string shell_quote(const std::string& s) {
  bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return is_name_char(c) || std::strchr("/.,:=@%+", c) != nullptr;
  });
  if (plain) return s;
  std::string q = "'";
  for (char c : s) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      o += buf;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

// Splits at top-level commas; DPDK kvargs lets a value hold a bracketed list "[a,b]".
std::optional<std::vector<std::string>> split_devargs(const std::string& s) {
  std::vector<std::string> parts(1);
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) return std::nullopt;
    if (c == ',' && depth == 0) {
      parts.emplace_back();
    } else {
      parts.back() += c;
    }
  }
  if (depth != 0) return std::nullopt;
  return parts;
}

std::vector<std::string> split_planes(const std::string& devargs) {
  std::vector<std::string> parts(1);
  for (char c : devargs) {
    if (c == nic::kPlaneSeparator) {
      parts.emplace_back();
    } else {
      parts.back() += c;
    }
  }
  return parts;
}

// --- DPDK's own parser, used without initialising EAL ----------------------------------------

#ifdef METAROCE_HAVE_DPDK
// Buses and drivers are plugins that EAL would dlopen during init; loading the ones needed here
// makes rte_devargs_parse recognise devices exactly as the datapath will, at a fraction of the
// cost of rte_eal_init (which would also pin this thread and leave a runtime folder behind).
class DpdkPlugins {
 public:
  static DpdkPlugins& get() {
    static DpdkPlugins p;  // dlopen is process-wide anyway; load each plugin at most once
    return p;
  }

  // True when some bus recognises the device; loads matching drivers first, then all of them.
  bool recognises(const std::string& devargs) {
    std::lock_guard lock(mu_);
    // DPDK reports its parse failures itself; the command prints its own single line instead.
    rte_log_set_global_level(RTE_LOG_EMERG);
    // Drivers linked into this program (a bundle's: docs/bundle.md) need no plugin, and a
    // plugin of the same driver loaded beside them would register it twice (EAL panics).
    if (parses(devargs)) return true;
    if (!buses_loaded_) {
      load_matching([](const std::string& lib) { return lib.rfind("bus_", 0) == 0; });
      buses_loaded_ = true;
    }
    if (parses(devargs)) return true;
    std::string dev = devargs.substr(0, devargs.find(','));
    if (auto colon = dev.find(':'); colon != std::string::npos) dev = dev.substr(colon + 1);
    // vdev matches a driver whose name is a prefix of the device name (net_memif -> net_memif0).
    load_matching([&](const std::string& lib) { return dev.rfind(lib, 0) == 0; });
    if (parses(devargs)) return true;
    load_matching([](const std::string&) { return true; });  // aliases (eth_memif, ...)
    return parses(devargs);
  }

  bool plugin_dir_usable() {
    std::lock_guard lock(mu_);
    return fs::is_directory(RTE_EAL_PMD_PATH);
  }

 private:
  template <typename Pred>
  void load_matching(Pred pred) {
    DIR* d = ::opendir(RTE_EAL_PMD_PATH);
    if (d == nullptr) return;
    while (dirent* e = ::readdir(d)) {
      std::string f = e->d_name;
      constexpr std::string_view kPrefix = "librte_", kSuffix = ".so";
      if (f.size() <= kPrefix.size() + kSuffix.size() || f.rfind(kPrefix, 0) != 0 ||
          f.compare(f.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
        continue;
      std::string lib = f.substr(kPrefix.size(), f.size() - kPrefix.size() - kSuffix.size());
      if (loaded_.count(lib) || !pred(lib)) continue;
      loaded_[lib] = true;
      // A plugin whose own dependencies are missing simply stays unknown.
      (void)::dlopen((std::string(RTE_EAL_PMD_PATH) + "/" + f).c_str(), RTLD_NOW | RTLD_LOCAL);
    }
    ::closedir(d);
  }

  static bool parses(const std::string& devargs) {
    rte_devargs da;
    std::memset(&da, 0, sizeof(da));
    int rc = rte_devargs_parse(&da, devargs.c_str());
    if (rc == 0) rte_devargs_reset(&da);
    return rc == 0;
  }

  std::mutex mu_;
  bool buses_loaded_ = false;
  std::map<std::string, bool> loaded_;
};
#endif

// --- the link store -------------------------------------------------------------------------

struct Paths {
  std::string sysfs, ib_class, verbs_class;
  explicit Paths(const Context& ctx)
      : sysfs(ctx.sysfs()),
        ib_class(sysfs + "/class/infiniband"),
        verbs_class(sysfs + "/class/infiniband_verbs") {}
  std::string link_dir(const std::string& name) const { return ib_class + "/" + name; }
  std::string record(const std::string& name) const {
    return link_dir(name) + "/" + nic::kConfigFile;
  }
};

struct Store {
  std::vector<nic::LinkConfig> links;  // sorted by name
  std::vector<std::string> problems;   // unreadable records, one line each
};

Store load_store(const Paths& p) {
  Store s;
  std::error_code ec;
  if (!fs::is_directory(p.ib_class, ec)) return s;
  for (const auto& entry : fs::directory_iterator(p.ib_class, ec)) {
    std::string name = entry.path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    std::string err;
    auto c = nic::LinkConfig::load(p.record(name), &err);
    if (c) {
      s.links.push_back(std::move(*c));
    } else {
      s.problems.push_back(err);
    }
  }
  std::sort(s.links.begin(), s.links.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return s;
}

// Serialises `link add`/`link del` of one run dir so two adds never pick the same uverbsN.
class RunDirLock {
 public:
  RunDirLock() = default;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  ~RunDirLock() {
    if (fd_ >= 0) ::close(fd_);  // closing drops the flock
  }

  bool acquire(const std::string& rundir, std::string* err) {
    std::error_code ec;
    fs::create_directories(rundir, ec);
    if (ec) {
      *err = describe("cannot create " + rundir, ec.value());
      return false;
    }
    std::string path = rundir + "/.lock";
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0 || ::flock(fd_, LOCK_EX) != 0) {
      *err = describe("cannot lock " + path, errno);
      return false;
    }
    return true;
  }

 private:
  int fd_ = -1;
};

// The lowest N whose sysfs entry is free here and whose device node is absent or already ours.
std::optional<unsigned> pick_uverbs(const Context& ctx, const Paths& p) {
  for (unsigned n = 0; n < kMaxUverbs; ++n) {
    std::string entry = "uverbs" + std::to_string(n);
    if (path_exists(p.verbs_class + "/" + entry)) continue;
    std::string node = ctx.dev_dir + "/" + entry;
    if (path_exists(node) && !is_our_node(node)) continue;  // a real RDMA device: never touch it
    return n;
  }
  return std::nullopt;
}

// The files of one link, relative to class/infiniband/NAME and class/infiniband_verbs/uverbsN.
bool build_link_tree(const nic::LinkConfig& c, const std::string& ib_dir,
                     const std::string& verbs_dir, std::string* err) {
  std::error_code ec;
  const std::string port = ib_dir + "/ports/1";
  for (const std::string& d : {verbs_dir, port + "/gids", port + "/gid_attrs/types", port + "/pkeys"}) {
    fs::create_directories(d, ec);
    if (ec) {
      *err = describe("cannot create " + d, ec.value());
      return false;
    }
  }
  uint8_t gid[16];
  nic::ipv4_to_gid(c.ip, gid);
  const uint8_t zero[16] = {};
  std::vector<std::pair<std::string, std::string>> files = {
      {verbs_dir + "/ibdev", c.name},
      {verbs_dir + "/dev", std::to_string(kNodeMajor) + ":" + std::to_string(kNodeMinor)},
      {verbs_dir + "/abi_version", std::to_string(nic::kUverbsAbi)},
      {ib_dir + "/node_type", "1: CA"},
      {ib_dir + "/node_guid", format_guid(c.node_guid)},
      {port + "/state", "4: ACTIVE"},
      {port + "/link_layer", "Ethernet"},
      {port + "/pkeys/0", "0xffff"},
  };
  for (uint32_t i = 0; i < nic::kGidTableLen; ++i) {
    // libibverbs needs a file for every index below gid_tbl_len; zero GIDs read as "empty".
    files.emplace_back(port + "/gids/" + std::to_string(i), format_gid(i == 0 ? gid : zero));
    files.emplace_back(port + "/gid_attrs/types/" + std::to_string(i), "RoCE v2");
  }
  for (const auto& [path, content] : files)
    if (!write_file(path, content + "\n", err)) return false;
  return c.save(ib_dir + "/" + nic::kConfigFile, err);
}

// Makes <dev_dir>/<entry> a 0666 char device 1:7 unless it already is one. *created tells the
// caller whether to remove it again on a later failure.
bool ensure_node(const Context& ctx, const std::string& entry, bool* created, std::string* err) {
  *created = false;
  std::string node = ctx.dev_dir + "/" + entry;
  if (is_our_node(node)) return true;
  std::error_code ec;
  fs::create_directories(ctx.dev_dir, ec);
  if (ec) {
    *err = describe("cannot create " + ctx.dev_dir, ec.value());
    return false;
  }
  if (::mknod(node.c_str(), S_IFCHR | 0666, makedev(kNodeMajor, kNodeMinor)) != 0) {
    *err = describe("cannot create device node " + node, errno);
    return false;
  }
  *created = true;
  // mknod honours the umask; a 0644 node makes non-root opens fail with a misleading ENOENT.
  if (::chmod(node.c_str(), 0666) != 0) {
    *err = describe("cannot chmod " + node, errno);
    ::unlink(node.c_str());
    *created = false;
    return false;
  }
  return true;
}

bool ensure_class_dirs(const Paths& p, std::string* err) {
  std::error_code ec;
  for (const std::string& d : {p.ib_class, p.verbs_class}) {
    fs::create_directories(d, ec);
    if (ec) {
      *err = describe("cannot create " + d, ec.value());
      return false;
    }
  }
  // librdmacm reads the CM's ABI version here (without RDMA netlink); the marker tells the
  // preload that the engine of this run dir is the host's RDMA CM (docs/spec/cm.md §1).
  const std::string cm = p.sysfs + "/class/misc/rdma_cm";
  if (read_first_line(cm + "/abi_version") != "4") {
    fs::create_directories(cm, ec);
    if (ec || !write_file(cm + "/abi_version", "4\n", err) ||
        !write_file(cm + "/metaroce", "served by the MetaRoCE engine of this run dir\n", err)) {
      if (ec) *err = describe("cannot create " + cm, ec.value());
      return false;
    }
  }
  std::string abi = p.verbs_class + "/abi_version";
  if (read_first_line(abi) == kUverbsClassAbi) return true;
  std::string tmp = abi + ".tmp";
  if (!write_file(tmp, std::string(kUverbsClassAbi) + "\n", err)) return false;
  if (::rename(tmp.c_str(), abi.c_str()) != 0) {
    *err = describe("cannot write " + abi, errno);
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

// --- commands -------------------------------------------------------------------------------

struct Outcome {
  int status;
  std::string message;  // for the single stderr line; empty when status is 0
};

Outcome usage(const std::string& what) { return {kExitUsage, what}; }
Outcome fail(const std::string& what) { return {kExitError, what}; }
Outcome ok() { return {kExitOk, {}}; }

// The record `link add ARGS` would create, checked against everything but the run dir's current
// links; `link apply` validates a whole file with it before adding anything. *help: --help given.
std::optional<nic::LinkConfig> parse_link_add(const std::vector<std::string>& args,
                                              const Context& ctx, bool* help, Outcome* error) {
  *help = false;
  auto usage = [&](const std::string& what) {
    *error = {kExitUsage, what};
    return std::nullopt;
  };
  auto fail = [&](const std::string& what) {
    *error = {kExitError, what};
    return std::nullopt;
  };
  std::optional<std::string> name;
  std::map<std::string, std::string> opt;
  std::vector<std::string> dpdk;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      *help = true;
      return std::nullopt;
    }
    if (a.size() > 1 && a[0] == '-') {
      std::string key = a, value;
      bool inline_value = false;
      if (auto eq = a.find('='); eq != std::string::npos) {
        key = a.substr(0, eq);
        value = a.substr(eq + 1);
        inline_value = true;
      }
      if (key != "--dpdk" && key != "--udp" && key != "--fabric" && key != "--ip" &&
          key != "--mtu" && key != "--paths" && key != "--udp-port" && key != "--rx-capacity" &&
          key != "--limit" && key != "--process-limit")
        return usage("link add: unknown option '" + key + "'");
      if (!inline_value) {
        if (i + 1 >= args.size()) return usage("link add: option " + key + " needs a value");
        value = args[++i];
      }
      if (key == "--dpdk" || key == "--udp") {
        // One per plane, plane 0 first (docs/spec/link.md §3), in the order given.
        if (key == "--udp") {
          if (value.empty()) return usage("link add: --udp needs an interface name or 'any'");
          value = nic::udp_plane(value == "any" ? "" : value);
        }
        dpdk.push_back(value);
        opt["--dpdk"] = value;
        continue;
      }
      if (opt.count(key)) return usage("link add: option " + key + " given twice");
      opt[key] = value;
    } else if (!name) {
      name = a;
    } else {
      return usage("link add: unexpected argument '" + a + "'");
    }
  }
  if (!name) return usage("link add: missing NAME");
  if (opt.count("--dpdk") && opt.count("--fabric"))
    return usage("link add: give --dpdk/--udp or --fabric, not both");
  if (!opt.count("--dpdk") && !opt.count("--fabric"))
    return usage("link add: missing --dpdk DEVARGS (or --udp IFACE, --fabric FABRIC:ENDPOINT)");
  if (!opt.count("--ip")) return usage("link add: missing --ip ADDR/PREFIX");

  // Everything that does not depend on the run dir is checked before touching it.
  std::string err;
  nic::LinkConfig c;
  c.name = *name;
  if (!check_name(c.name, &err)) return fail(err);
  auto addr = parse_address(opt["--ip"], &err);
  if (!addr) return fail(err);
  c.ip = addr->first;
  c.prefix = addr->second;
  if (opt.count("--mtu") && !parse_number(opt["--mtu"], kMinMtu, kMaxMtu, &c.mtu))
    return fail("bad --mtu '" + opt["--mtu"] + "': expected " + std::to_string(kMinMtu) + ".." +
                std::to_string(kMaxMtu));
  if (opt.count("--paths") &&
      !parse_number(opt["--paths"], uint16_t{1}, static_cast<uint16_t>(kMaxPaths), &c.paths))
    return fail("bad --paths '" + opt["--paths"] + "': expected 1.." + std::to_string(kMaxPaths));
  if (opt.count("--udp-port") &&
      !parse_number(opt["--udp-port"], uint16_t{1}, uint16_t{65535}, &c.udp_port))
    return fail("bad --udp-port '" + opt["--udp-port"] + "': expected 1..65535");
  if (opt.count("--rx-capacity") &&
      !parse_number(opt["--rx-capacity"], uint32_t{1}, kMaxRxCapacityMbps, &c.rx_capacity_mbps))
    return fail("bad --rx-capacity '" + opt["--rx-capacity"] + "': expected 1.." +
                std::to_string(kMaxRxCapacityMbps) + " (Mbit/s)");
  if (opt.count("--limit")) {
    auto l = nic::parse_limits(opt["--limit"], nic::Limits{}, &err);
    if (!l) return fail("link add: --limit: " + err);
    c.limits = *l;
  }
  // A process's share: what is not given is the device's (ring memory: its own default).
  nic::Limits share = c.limits;
  share.ring_mib = 0;
  c.process_limits = share;
  if (opt.count("--process-limit")) {
    auto l = nic::parse_limits(opt["--process-limit"], share, &err);
    if (!l) return fail("link add: --process-limit: " + err);
    const nic::Limits& d = c.limits;
    for (auto [mine, dev, what] : {std::tuple{l->qp, d.qp, "qp"}, {l->cq, d.cq, "cq"},
                                   {l->srq, d.srq, "srq"}, {l->pd, d.pd, "pd"}, {l->mr, d.mr, "mr"},
                                   {l->ring_mib, d.ring_mib ? d.ring_mib : UINT32_MAX, "ring-mib"}}) {
      if (mine > dev)
        return fail("link add: --process-limit " + std::string(what) + "=" + std::to_string(mine) +
                    " is above the device's " + std::to_string(dev));
    }
    c.process_limits = *l;
  }
  if (opt.count("--dpdk")) {
    if (dpdk.size() > nic::kMaxPlanes)
      return fail("link add: at most " + std::to_string(nic::kMaxPlanes) +
                  " --dpdk devices (one per plane), got " + std::to_string(dpdk.size()));
    std::set<std::string> seen;
    for (const std::string& one : dpdk) {
      if (auto udp = nic::parse_udp_plane(one)) {
        if (!udp->empty() && !check_interface_name(*udp, &err)) return fail(err);
        if (!seen.insert(one).second)
          return fail("link add: --udp " + (udp->empty() ? "any" : *udp) + " given for two planes");
        continue;
      }
      if (!check_devargs(one, &err)) return fail(err);
      const std::string dev = one.substr(0, one.find(','));
      if (!seen.insert(dev).second)
        return fail("link add: DPDK device '" + dev + "' given for two planes");
    }
    // Planes on kernel interfaces: the link's MTU follows theirs (the smallest), and one below
    // the link's is refused: the kernel drops every larger packet (a veth is 1500 by default)
    // and nothing else would say why.
    std::optional<uint32_t> smallest;
    std::string smallest_iface;
    for (const std::string& one : dpdk) {
      const std::string iface = kernel_interface_of(one);
      if (iface.empty()) continue;
      auto if_mtu = interface_mtu(iface);
      if (!if_mtu) return fail("link add: no interface " + iface + " in this network namespace");
      if (!smallest || *if_mtu < *smallest) {
        smallest = *if_mtu;
        smallest_iface = iface;
      }
    }
    if (!opt.count("--mtu") && smallest) {
      if (*smallest < kMinMtu)
        return fail("link add: interface " + smallest_iface + " has MTU " +
                    std::to_string(*smallest) + ", below the " + std::to_string(kMinMtu) +
                    " a link needs");
      c.mtu = std::min(*smallest, kMaxMtu);
    }
    if (smallest && *smallest < c.mtu)
      return fail("link add: interface " + smallest_iface + " has MTU " + std::to_string(*smallest) +
                  ", below the link's " + std::to_string(c.mtu) + ": raise it (ip link set " +
                  smallest_iface + " mtu " + std::to_string(c.mtu) + ") or give --mtu " +
                  std::to_string(*smallest));
    for (const std::string& one : dpdk)
      if (one.starts_with("net_af_xdp") && c.mtu > io::kAfXdpMaxMtu)
        return fail("link add: af_xdp frames hold an MTU of at most " +
                    std::to_string(io::kAfXdpMaxMtu) + " (one page per frame in DPDK 22.11), " +
                    "not " + std::to_string(c.mtu) + ": give --mtu " +
                    std::to_string(io::kAfXdpMaxMtu) + " or less and set the interface's MTU to it");
    c.devargs = dpdk[0];
    for (size_t p = 1; p < dpdk.size(); ++p) c.devargs += nic::kPlaneSeparator + dpdk[p];
    c.planes = static_cast<uint16_t>(dpdk.size());
  } else {
    // One device string per plane of the fabric endpoint; the fabric's state says how many.
    const std::string& spec = opt["--fabric"];
    const auto colon = spec.rfind(':');
    uint32_t endpoint = 0;
    if (colon == std::string::npos ||
        !parse_number(spec.substr(colon + 1), uint32_t{0}, fabric::kMaxEndpoints - 1, &endpoint))
      return fail("bad --fabric '" + spec + "': expected FABRIC:ENDPOINT, e.g. fab0:1");
    const std::string fabric_name = spec.substr(0, colon);
    if (!fabric::check_fabric_name(fabric_name, &err)) return fail(err);
    auto info = fabric::read_info(ctx.rundir, fabric_name, &err);
    if (!info) return fail(err);
    if (endpoint >= info->endpoints)
      return fail("fabric " + fabric_name + " has endpoints 0.." +
                  std::to_string(info->endpoints - 1) + ", not " + std::to_string(endpoint));
    c.devargs = fabric_devargs(c.name, fabric_name, endpoint, info->planes);
    c.planes = static_cast<uint16_t>(info->planes);
    for (auto& one : split_planes(c.devargs))
      if (!check_devargs(one, &err)) return fail(err);
  }
  // Without --paths, 8 paths per plane: each plane sprays as a one-plane link does (one path per
  // plane made 8 planes 0.90 of 8 x one plane on the fabric benchmark, where 8 per plane give
  // each plane the smoother sum of several windows).
  if (!opt.count("--paths"))
    c.paths = static_cast<uint16_t>(std::min<uint32_t>(uint32_t{nic::kDefaultPaths} * c.planes, kMaxPaths));
  c.node_guid = node_guid_for_ip(c.ip);
  return c;
}

// Creates the link of a record that parse_link_add accepted; all or nothing.
Outcome create_link(nic::LinkConfig c, const Context& ctx) {
  std::string err;
  if (!ctx.is_root && !writable(ctx.rundir))
    return fail("permission denied: cannot write " + ctx.rundir + " (run as root)");
  RunDirLock lock;
  if (!lock.acquire(ctx.rundir, &err)) return fail(err);

  // Checks against the links already recorded, under the lock.
  const Paths p(ctx);
  if (path_exists(p.link_dir(c.name))) return fail("link " + c.name + " already exists");
  Store store = load_store(p);
  for (const auto& other : store.links)
    if (other.ip == c.ip)
      return fail("address " + nic::format_ipv4(c.ip) + " is already used by link " + other.name);

  // A kernel device (the engine creates and attaches it): the record alone, no uverbs entry.
  if (ctx.kernel_module && c.planes == 1) c.kernel = kernel_interface_of(c.devargs);
  if (!c.kernel.empty()) {
    if (!ctx.is_root) return fail("permission denied: kernel devices need root (run as root)");
    std::error_code ec;
    fs::create_directories(p.link_dir(c.name), ec);
    if (ec) return fail(describe("cannot create " + p.link_dir(c.name), ec.value()));
    if (!c.save(p.record(c.name), &err)) {
      fs::remove_all(p.link_dir(c.name), ec);
      return fail(err);
    }
    return ok();
  }
  auto n = pick_uverbs(ctx, p);
  if (!n) return fail("no free uverbs number below " + std::to_string(kMaxUverbs));
  c.uverbs = "uverbs" + std::to_string(*n);
  if (!ctx.is_root && !is_our_node(ctx.dev_dir + "/" + c.uverbs))
    return fail("permission denied: creating device node " + ctx.dev_dir + "/" + c.uverbs +
                " needs root (run as root)");

  // Build the link aside and move it into place in two renames; undo everything on failure.
  const std::string staging = ctx.rundir + "/.staging-" + std::to_string(::getpid());
  const std::string ib_dest = p.link_dir(c.name), verbs_dest = p.verbs_class + "/" + c.uverbs;
  std::error_code ec;
  fs::remove_all(staging, ec);
  bool node_created = false, ib_moved = false;
  auto undo = [&](const std::string& why) {
    std::error_code ignored;
    if (ib_moved) fs::remove_all(ib_dest, ignored);
    if (node_created) ::unlink((ctx.dev_dir + "/" + c.uverbs).c_str());
    fs::remove_all(staging, ignored);
    return fail(why);
  };
  if (!build_link_tree(c, staging + "/ib", staging + "/verbs", &err)) return undo(err);
  if (!ensure_node(ctx, c.uverbs, &node_created, &err)) return undo(err);
  if (!ensure_class_dirs(p, &err)) return undo(err);
  // The class/infiniband side first: libibverbs only looks at it once uverbsN names it.
  if (::rename((staging + "/ib").c_str(), ib_dest.c_str()) != 0)
    return undo(describe("cannot create " + ib_dest, errno));
  ib_moved = true;
  if (::rename((staging + "/verbs").c_str(), verbs_dest.c_str()) != 0)
    return undo(describe("cannot create " + verbs_dest, errno));
  fs::remove_all(staging, ec);
  return ok();
}

Outcome remove_record(const std::string& name, const Context& ctx);

// Has the run dir's engine (started if none runs) open a link just recorded; the record goes
// again if it cannot, so that `link add` is all or nothing.
Outcome open_in_engine(const std::string& name, const Context& ctx) {
  if (ctx.engine_program.empty()) return ok();
  std::string why;
  auto fail_and_remove = [&](const std::string& what) {
    (void)remove_record(name, ctx);
    return fail(what);
  };
  auto conn = std::make_unique<EngineConnection>(ctx.rundir);
  if (!conn->ok()) {
    if (!start_engine(ctx.engine_program, ctx.rundir, {}, &why)) return fail_and_remove(why);
    conn = std::make_unique<EngineConnection>(ctx.rundir);
    if (!conn->ok())
      return fail_and_remove(describe("cannot reach the engine of " + ctx.rundir, errno));
  }
  hostif::LinkReq req;
  hostif::put_name(req.link, name);
  hostif::Message resp;
  const int e = conn->call(hostif::Op::kLinkOpen, req, &resp);
  if (e == EEXIST) return ok();  // the engine found the record first (it was just starting)
  if (e) return fail_and_remove("the engine cannot open link " + name + ": " + engine_reason(resp, e));
  return ok();
}

Outcome link_add(const std::vector<std::string>& args, const Context& ctx) {
  bool help = false;
  Outcome error{kExitOk, {}};
  auto c = parse_link_add(args, ctx, &help, &error);
  if (help) {
    *ctx.out << kLinkHelp;
    return ok();
  }
  if (!c) return error;
  const std::string name = c->name;
  Outcome r = create_link(std::move(*c), ctx);
  if (r.status != kExitOk) return r;
  return open_in_engine(name, ctx);
}

Outcome link_del(const std::vector<std::string>& args, const Context& ctx) {
  std::optional<std::string> name;
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      *ctx.out << kLinkHelp;
      return ok();
    }
    if (a.size() > 1 && a[0] == '-') return usage("link del: unknown option '" + a + "'");
    if (name) return usage("link del: unexpected argument '" + a + "'");
    name = a;
  }
  if (!name) return usage("link del: missing NAME");
  std::string err;
  if (!check_name(*name, &err)) return fail(err);
  const Paths p(ctx);
  if (!fs::is_directory(p.link_dir(*name))) return fail("no link named " + *name);
  if (!ctx.engine_program.empty()) {
    // The engine closes the link first: its contexts see the device go away.
    EngineConnection conn(ctx.rundir);
    hostif::LinkReq req;
    hostif::put_name(req.link, *name);
    hostif::Message resp;
    if (conn.ok()) {
      const int e = conn.call(hostif::Op::kLinkClose, req, &resp);
      if (e && e != ENOENT)
        return fail("the engine cannot close link " + *name + ": " + engine_reason(resp, e));
    }
  }
  return remove_record(*name, ctx);
}

// Removes the record and tree of a link (its engine no longer has it open).
Outcome remove_record(const std::string& name, const Context& ctx) {
  std::string err;
  const Paths p(ctx);
  RunDirLock lock;
  if (!lock.acquire(ctx.rundir, &err)) return fail(err);
  if (!fs::is_directory(p.link_dir(name))) return fail("no link named " + name);

  // Every uverbs entry that names this device, so a damaged record cannot leave one behind.
  std::vector<std::string> entries;
  std::error_code ec;
  if (fs::is_directory(p.verbs_class, ec)) {
    for (const auto& e : fs::directory_iterator(p.verbs_class, ec)) {
      if (e.is_directory(ec) && read_first_line(e.path().string() + "/ibdev") == name)
        entries.push_back(e.path().string());
    }
  }
  // Rename out of sight first (the device vanishes at once), then delete at leisure.
  const std::string trash = ctx.rundir + "/.trash-" + std::to_string(::getpid());
  fs::remove_all(trash, ec);
  fs::create_directories(trash, ec);
  if (ec) return fail(describe("cannot create " + trash, ec.value()));
  // (from, to) of each rename done so far, undone in reverse if a later one fails.
  std::vector<std::pair<std::string, std::string>> moved;
  auto undo = [&](const std::string& why) {
    for (auto it = moved.rbegin(); it != moved.rend(); ++it)
      (void)::rename(it->second.c_str(), it->first.c_str());
    std::error_code ignored;
    fs::remove_all(trash, ignored);
    return fail(why);
  };
  entries.push_back(p.link_dir(name));  // last: the uverbs entries must not outlive it
  for (const auto& e : entries) {
    std::string to = trash + "/" + std::to_string(moved.size());
    if (::rename(e.c_str(), to.c_str()) != 0) return undo(describe("cannot remove " + e, errno));
    moved.emplace_back(e, to);
  }
  fs::remove_all(trash, ec);
  return ok();
}

Outcome link_show(const std::vector<std::string>& args, const Context& ctx) {
  std::optional<std::string> name;
  bool json = false;
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      *ctx.out << kLinkHelp;
      return ok();
    }
    if (a == "--json") {
      json = true;
    } else if (a.size() > 1 && a[0] == '-') {
      return usage("link show: unknown option '" + a + "'");
    } else if (name) {
      return usage("link show: unexpected argument '" + a + "'");
    } else {
      name = a;
    }
  }
  Store store = load_store(Paths(ctx));
  std::vector<nic::LinkConfig> shown;
  for (auto& l : store.links)
    if (!name || l.name == *name) shown.push_back(l);
  if (name && shown.empty()) return fail("no link named " + *name);

  std::ostream& o = *ctx.out;
  if (json) {
    o << "[";
    for (size_t i = 0; i < shown.size(); ++i) {
      const auto& l = shown[i];
      o << (i ? ",\n " : "\n ") << "{\"name\": " << json_string(l.name)
        << ", \"uverbs\": " << json_string(l.uverbs) << ", \"ip\": " << json_string(nic::format_ipv4(l.ip))
        << ", \"prefix\": " << unsigned{l.prefix} << ", \"mtu\": " << l.mtu
        << ", \"paths\": " << l.paths << ", \"planes\": " << l.planes
        << ", \"udp_port\": " << l.udp_port << ", \"rx_capacity_mbps\": " << l.rx_capacity_mbps
        << ", \"node_guid\": " << json_string(format_guid(l.node_guid))
        << ", \"kernel\": " << json_string(l.kernel)
        << ", \"limits\": " << json_string(nic::format_limits(l.limits))
        << ", \"process_limits\": " << json_string(nic::format_limits(l.process_limits))
        << ", \"devargs\": " << json_string(l.devargs) << "}";
    }
    o << (shown.empty() ? "]\n" : "\n]\n");
  } else {
    std::vector<std::vector<std::string>> rows = {
        {"NAME", "UVERBS", "ADDRESS", "MTU", "PATHS", "UDP", "DEVARGS"}};
    for (const auto& l : shown)
      rows.push_back({l.name, l.kernel.empty() ? l.uverbs : "(kernel)", nic::format_ipv4(l.ip) + "/" + std::to_string(l.prefix),
                      std::to_string(l.mtu), std::to_string(l.paths), std::to_string(l.udp_port),
                      l.devargs});
    std::vector<size_t> width(rows[0].size(), 0);
    for (const auto& r : rows)
      for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
    for (const auto& r : rows) {
      for (size_t i = 0; i + 1 < r.size(); ++i) o << std::left << std::setw(int(width[i] + 2)) << r[i];
      o << r.back() << "\n";
    }
  }
  // Only reported for the whole listing: a damaged record of another link is not this one's error.
  if (!name && !store.problems.empty()) return fail("unreadable link record " + store.problems[0]);
  return ok();
}

Outcome env(const std::vector<std::string>& args, const Context& ctx) {
  if (!args.empty()) {
    if (args[0] == "--help" || args[0] == "-h") {
      *ctx.out << "Usage: eval \"$(metaroce env)\"\n";
      return ok();
    }
    return usage("env: unexpected argument '" + args[0] + "'");
  }
  for (const auto& [key, value] : verbs_environment(ctx))
    *ctx.out << "export " << key << "=" << shell_quote(value) << "\n";
  return ok();
}

// --- the fabric emulator ---------------------------------------------------------------------

// Splits `--key value`, `--key=value` and flags; positional arguments in order.
struct ParsedArgs {
  std::vector<std::string> positional;
  std::map<std::string, std::string> opt;
  bool help = false;
};

std::optional<ParsedArgs> parse_args(const std::string& cmd, const std::vector<std::string>& args,
                                     const std::vector<std::string>& with_value,
                                     const std::vector<std::string>& flags, Outcome* error) {
  ParsedArgs r;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      r.help = true;
      return r;
    }
    if (a.size() > 2 && a.compare(0, 2, "--") == 0) {
      std::string key = a, value;
      const auto eq = a.find('=');
      if (eq != std::string::npos) {
        key = a.substr(0, eq);
        value = a.substr(eq + 1);
      }
      const bool takes_value =
          std::find(with_value.begin(), with_value.end(), key) != with_value.end();
      const bool is_flag = std::find(flags.begin(), flags.end(), key) != flags.end();
      if (!takes_value && !is_flag) {
        *error = usage(cmd + ": unknown option '" + key + "'");
        return std::nullopt;
      }
      if (is_flag && eq != std::string::npos) {
        *error = usage(cmd + ": option " + key + " takes no value");
        return std::nullopt;
      }
      if (takes_value && eq == std::string::npos) {
        if (i + 1 >= args.size()) {
          *error = usage(cmd + ": option " + key + " needs a value");
          return std::nullopt;
        }
        value = args[++i];
      }
      if (r.opt.count(key)) {
        *error = usage(cmd + ": option " + key + " given twice");
        return std::nullopt;
      }
      r.opt[key] = value;
    } else {
      r.positional.push_back(a);
    }
  }
  return r;
}

// `link set NAME --plane P up|down`: the operator's switch of one plane (link.md §3).
Outcome link_set(const std::vector<std::string>& args, const Context& ctx) {
  Outcome error{kExitOk, {}};
  auto parsed = parse_args("link set", args, {"--plane"}, {}, &error);
  if (!parsed) return error;
  if (parsed->help) {
    *ctx.out << kLinkHelp;
    return ok();
  }
  if (parsed->positional.empty()) return usage("link set: missing NAME");
  if (!parsed->opt.count("--plane")) return usage("link set: missing --plane P");
  if (parsed->positional.size() != 2)
    return usage("link set: expected NAME --plane P up|down");
  const std::string& name = parsed->positional[0];
  const std::string& what = parsed->positional[1];
  if (what != "up" && what != "down")
    return usage("link set: expected up or down, not '" + what + "'");
  std::string err;
  if (!check_name(name, &err)) return fail(err);
  const Paths p(ctx);
  if (!fs::is_directory(p.link_dir(name))) return fail("no link named " + name);
  auto cfg = nic::LinkConfig::load(p.link_dir(name) + "/" + nic::kConfigFile, &err);
  if (!cfg) return fail(err);
  uint32_t plane = 0;
  if (!parse_number(parsed->opt["--plane"], uint32_t{0}, uint32_t{cfg->planes} - 1u, &plane))
    return fail("bad --plane '" + parsed->opt["--plane"] + "': link " + name + " has planes 0.." +
                std::to_string(cfg->planes - 1));
  EngineConnection conn(ctx.rundir);
  if (!conn.ok()) return fail("no engine serves " + ctx.rundir + " (the plane is its state)");
  hostif::LinkPlaneReq req;
  hostif::put_name(req.link, name);
  req.plane = plane;
  req.up = what == "up";
  hostif::Message resp;
  const int e = conn.call(hostif::Op::kLinkPlane, req, &resp);
  if (e) return fail("the engine cannot set plane " + std::to_string(plane) + " of " + name +
                     " " + what + ": " + engine_reason(resp, e));
  return ok();
}

Outcome fabric_run(const std::vector<std::string>& args, const Context& ctx) {
  Outcome error{kExitOk, {}};
  auto parsed = parse_args("fabric run", args,
                           {"--endpoints", "--planes", "--links-per-plane", "--rate", "--edge-rate",
                            "--queue", "--ecn-threshold", "--loss", "--delay", "--reorder",
                            "--reorder-delay", "--duplicate", "--seed", "--seconds", "--spin",
                            "--spin-us", "--max-nap-us"},
                           {}, &error);
  if (!parsed) return error;
  if (parsed->help) {
    *ctx.out << kFabricHelp;
    return ok();
  }
  auto& opt = parsed->opt;
  if (parsed->positional.empty()) return usage("fabric run: missing NAME");
  if (parsed->positional.size() > 1)
    return usage("fabric run: unexpected argument '" + parsed->positional[1] + "'");
  if (!opt.count("--endpoints")) return usage("fabric run: missing --endpoints E");
  if (!opt.count("--planes")) return usage("fabric run: missing --planes P");
  std::string err;
  const std::string& name = parsed->positional[0];
  if (!fabric::check_fabric_name(name, &err)) return fail(err);

  fabric::FabricConfig c;
  auto number = [&](const char* key, uint32_t lo, uint32_t hi, uint32_t* out) {
    if (!opt.count(key)) return true;
    if (parse_number(opt[key], lo, hi, out)) return true;
    err = std::string("bad ") + key + " '" + opt[key] + "': expected " + std::to_string(lo) +
          ".." + std::to_string(hi);
    return false;
  };
  if (!number("--endpoints", 1, fabric::kMaxEndpoints, &c.endpoints) ||
      !number("--planes", 1, fabric::kMaxPlanes, &c.planes) ||
      !number("--links-per-plane", 1, fabric::kMaxLinksPerPlane, &c.links_per_plane))
    return fail(err);
  auto rate = [&](const char* key, uint64_t* out) {
    if (!opt.count(key)) return true;
    if (auto r = fabric::parse_rate(opt[key])) {
      *out = *r;
      return true;
    }
    err = std::string("bad ") + key + " '" + opt[key] + "': expected bits/s like 100G, 800M, 0";
    return false;
  };
  if (!rate("--rate", &c.core.rate_bps)) return fail(err);
  c.edge.rate_bps = c.core.rate_bps;
  if (!rate("--edge-rate", &c.edge.rate_bps)) return fail(err);
  auto bytes = [&](const char* key, uint64_t* out) {
    uint32_t v = 0;
    if (!opt.count(key)) return true;
    if (!parse_number(opt[key], uint32_t{1}, uint32_t{1} << 30, &v)) {
      err = std::string("bad ") + key + " '" + opt[key] + "': expected bytes 1..1073741824";
      return false;
    }
    *out = v;
    return true;
  };
  if (!bytes("--queue", &c.core.queue_bytes) || !bytes("--ecn-threshold", &c.core.ecn_threshold_bytes))
    return fail(err);
  c.edge.queue_bytes = c.core.queue_bytes;
  c.edge.ecn_threshold_bytes = c.core.ecn_threshold_bytes;
  for (const char* key : {"--loss", "--reorder", "--duplicate"}) {
    if (!opt.count(key)) continue;
    const std::string k = key;
    double* out = k == "--loss" ? &c.core.loss : k == "--reorder" ? &c.core.reorder
                                                                  : &c.core.duplicate;
    if (!fabric::parse_probability(opt[key], out))
      return fail(std::string("bad ") + key + " '" + opt[key] + "': expected a probability 0..1");
  }
  uint32_t usec = 0;
  if (opt.count("--delay")) {
    if (!number("--delay", 0, 10'000'000, &usec)) return fail(err);
    c.core.delay = std::chrono::microseconds(usec);
  }
  if (opt.count("--reorder-delay")) {
    if (!number("--reorder-delay", 0, 10'000'000, &usec)) return fail(err);
    c.core.reorder_delay = std::chrono::microseconds(usec);
  }
  if (opt.count("--seed") && !parse_number(opt["--seed"], uint64_t{0}, ~uint64_t{0}, &c.seed))
    return fail("bad --seed '" + opt["--seed"] + "': expected a number");
  double seconds = 0;
  if (opt.count("--seconds")) {
    char* end = nullptr;
    const std::string& v = opt["--seconds"];
    seconds = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !(seconds > 0 && seconds <= 86400))
      return fail("bad --seconds '" + v + "': expected 0 < S <= 86400");
  }
  if (auto bad = c.validate(); !bad.empty()) return fail("fabric run: " + bad);
  // The idle policy, in metaroced's words (--spin, --spin-us).
  fabric::IdlePolicy idle;
  if (opt.count("--spin")) {
    const auto spin = fabric::parse_spin_policy(opt["--spin"]);
    if (!spin) return fail("bad --spin '" + opt["--spin"] + "': expected adaptive or always");
    idle.spin = *spin;
  }
  if (opt.count("--spin-us")) {
    if (!number("--spin-us", 0, 1'000'000, &usec)) return fail(err);
    idle.spin_before_sleep = std::chrono::microseconds(usec);
  }
  if (opt.count("--max-nap-us")) {
    if (!number("--max-nap-us", 1, 1'000'000, &usec)) return fail(err);
    idle.max_nap = std::chrono::microseconds(usec);
  }
  for (const char* key : {"--spin-us", "--max-nap-us"}) {
    if (idle.spin == fabric::SpinPolicy::kAlways && opt.count(key))
      return fail(std::string("fabric run: ") + key +
                  " applies to --spin adaptive only (always never naps)");
  }
  if (auto bad = idle.validate(); !bad.empty()) return fail("fabric run: " + bad);
#ifdef METAROCE_HAVE_DPDK
  if (!ctx.is_root && !writable(ctx.rundir))
    return fail("permission denied: cannot write " + ctx.rundir + " (run as root)");
  fabric::RunOptions ro;
  ro.name = name;
  ro.rundir = ctx.rundir;
  ro.config = c;
  ro.seconds = seconds;
  ro.idle = idle;
  std::string why;
  if (fabric::run_fabric(ro, *ctx.out, &why) != 0) return fail("fabric " + name + ": " + why);
  return ok();
#else
  return fail("fabric run: this metaroce was built without DPDK");
#endif
}

// The reply body, or the fabric's own error as this command's error.
Outcome fabric_call(const Context& ctx, const std::string& name, const std::string& request,
                    std::string* body) {
  std::string err;
  auto reply = fabric::control_request(ctx.rundir, name, request, &err);
  if (!reply) return fail(err);
  if (reply->rfind("ok\n", 0) == 0) {
    *body = reply->substr(3);
    return ok();
  }
  std::string line = reply->substr(0, reply->find('\n'));
  if (line.rfind("error: ", 0) == 0) line = line.substr(7);
  return fail("fabric " + name + ": " + line);
}

bool fabric_link_ok(const std::string& l) {
  std::string num = l;
  if (l.rfind("core", 0) == 0 || l.rfind("edge", 0) == 0) num = l.substr(4);
  uint32_t v = 0;
  return parse_number(num, uint32_t{0}, fabric::kMaxLinksPerPlane - 1, &v);
}

Outcome fabric_set(const std::vector<std::string>& args, const Context& ctx) {
  Outcome error{kExitOk, {}};
  auto parsed = parse_args("fabric set", args, {"--plane", "--link"}, {}, &error);
  if (!parsed) return error;
  if (parsed->help) {
    *ctx.out << kFabricHelp;
    return ok();
  }
  if (parsed->positional.empty()) return usage("fabric set: missing NAME");
  if (parsed->positional.size() < 2) return usage("fabric set: missing SETTING (e.g. loss=0.01)");
  std::string err;
  const std::string& name = parsed->positional[0];
  if (!fabric::check_fabric_name(name, &err)) return fail(err);
  std::string plane = "*", link = "*";
  if (parsed->opt.count("--plane")) {
    plane = parsed->opt["--plane"];
    uint32_t p = 0;
    if (!parse_number(plane, uint32_t{0}, fabric::kMaxPlanes - 1, &p))
      return fail("bad --plane '" + plane + "': expected 0.." +
                  std::to_string(fabric::kMaxPlanes - 1));
  }
  if (parsed->opt.count("--link")) {
    link = parsed->opt["--link"];
    if (!fabric_link_ok(link))
      return fail("bad --link '" + link + "': expected coreN, edgeN or N");
  }
  std::string request = "set " + plane + " " + link;
  fabric::LinkParams scratch;
  for (size_t i = 1; i < parsed->positional.size(); ++i) {
    if (!fabric::apply_setting(parsed->positional[i], &scratch, &err)) return fail(err);
    request += " " + parsed->positional[i];
  }
  std::string body;
  Outcome r = fabric_call(ctx, name, request, &body);
  if (r.status == kExitOk) *ctx.out << body;
  return r;
}

Outcome fabric_stat(const std::vector<std::string>& args, const Context& ctx) {
  Outcome error{kExitOk, {}};
  auto parsed = parse_args("fabric stat", args, {}, {"--json"}, &error);
  if (!parsed) return error;
  if (parsed->help) {
    *ctx.out << kFabricHelp;
    return ok();
  }
  if (parsed->positional.empty()) return usage("fabric stat: missing NAME");
  if (parsed->positional.size() > 1)
    return usage("fabric stat: unexpected argument '" + parsed->positional[1] + "'");
  std::string err;
  const std::string& name = parsed->positional[0];
  if (!fabric::check_fabric_name(name, &err)) return fail(err);
  const bool json = parsed->opt.count("--json") != 0;
  std::string body;
  Outcome r = fabric_call(ctx, name, json ? "stat json" : "stat", &body);
  if (r.status != kExitOk) return r;
  *ctx.out << body;
  if (!json && fabric_call(ctx, name, "ports", &body).status == kExitOk) *ctx.out << body;
  return ok();
}

Outcome fabric_stop(const std::vector<std::string>& args, const Context& ctx) {
  Outcome error{kExitOk, {}};
  auto parsed = parse_args("fabric stop", args, {}, {}, &error);
  if (!parsed) return error;
  if (parsed->help) {
    *ctx.out << kFabricHelp;
    return ok();
  }
  if (parsed->positional.empty()) return usage("fabric stop: missing NAME");
  if (parsed->positional.size() > 1)
    return usage("fabric stop: unexpected argument '" + parsed->positional[1] + "'");
  std::string err;
  const std::string& name = parsed->positional[0];
  if (!fabric::check_fabric_name(name, &err)) return fail(err);
  auto info = fabric::read_info(ctx.rundir, name, &err);
  if (!info) return fail(err);
  std::string body;
  if (fabric_call(ctx, name, "stop", &body).status != kExitOk) {
    // A wedged or half-started fabric: the pid file still names it.
    if (info->pid <= 0 || ::kill(info->pid, SIGTERM) != 0)
      return fail("fabric " + name + " does not answer and has no live process");
  }
  const std::string dir = fabric::state_dir(ctx.rundir, name);
  for (int i = 0; i < 200; ++i) {  // it removes its state folder as it exits
    if (!path_exists(dir)) return ok();
    if (info->pid > 0 && ::kill(info->pid, 0) != 0 && errno == ESRCH) {
      std::error_code ec;
      fs::remove_all(dir, ec);
      return ok();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return fail("fabric " + name + " did not stop within 10 s");
}

Outcome fabric_command(const std::vector<std::string>& rest, const Context& ctx) {
  if (rest.empty()) return usage("fabric: missing subcommand (run, set, stat, stop)");
  const std::string& sub = rest[0];
  std::vector<std::string> sub_args(rest.begin() + 1, rest.end());
  if (sub == "--help" || sub == "-h" || sub == "help") {
    *ctx.out << kFabricHelp;
    return ok();
  }
  if (sub == "run") return fabric_run(sub_args, ctx);
  if (sub == "set") return fabric_set(sub_args, ctx);
  if (sub == "stat" || sub == "stats") return fabric_stat(sub_args, ctx);
  if (sub == "stop") return fabric_stop(sub_args, ctx);
  return usage("fabric: unknown subcommand '" + sub + "'");
}

// --- links from a file, flush, exec ----------------------------------------------------------

constexpr const char* kLinksConfDefault = "/etc/metaroce/links.conf";
constexpr std::uintmax_t kMaxLinksConfBytes = 1 << 20;  // a links file is a few lines; refuse junk

constexpr const char* kApplyHelp =
    "Usage: metaroce link apply [FILE] [--check]\n"
    "       metaroce link flush\n"
    "\n"
    "apply: adds the links of FILE (default /etc/metaroce/links.conf), one line per link holding\n"
    "the arguments of `metaroce link add`; '#' starts a comment. The whole file is checked first:\n"
    "one bad line and nothing is added. A link that already exists with the same settings is\n"
    "kept, so apply can run again; with different settings it is an error. --check: only check.\n"
    "flush: deletes every link of the run dir.\n";

// Same settings as far as a user can give them (uverbs and node GUID are derived, not given).
bool same_settings(const nic::LinkConfig& a, const nic::LinkConfig& b) {
  return a.name == b.name && a.devargs == b.devargs && a.ip == b.ip && a.prefix == b.prefix &&
         a.mtu == b.mtu && a.udp_port == b.udp_port && a.paths == b.paths && a.planes == b.planes;
}

// Words of one line of a links file; '#' at the start of a word starts a comment. No quoting:
// nothing `link add` accepts may contain blanks.
std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line);
  std::string w;
  while (in >> w) {
    if (w[0] == '#') break;
    words.push_back(w);
  }
  return words;
}

Outcome link_apply(const std::vector<std::string>& args, const Context& ctx) {
  Outcome error{kExitOk, {}};
  auto parsed = parse_args("link apply", args, {}, {"--check"}, &error);
  if (!parsed) return error;
  if (parsed->help) {
    *ctx.out << kApplyHelp;
    return ok();
  }
  if (parsed->positional.size() > 1)
    return usage("link apply: unexpected argument '" + parsed->positional[1] + "'");
  const bool explicit_file = !parsed->positional.empty();
  const std::string file = explicit_file ? parsed->positional[0] : kLinksConfDefault;
  std::error_code ec;
  if (!explicit_file && !fs::exists(file, ec)) return ok();  // nothing configured
  if (!fs::is_regular_file(file, ec)) return fail("cannot read " + file + ": not a regular file");
  if (fs::file_size(file, ec) > kMaxLinksConfBytes)
    return fail(file + ": larger than " + std::to_string(kMaxLinksConfBytes) + " bytes");
  std::ifstream in(file);
  if (!in) return fail(describe("cannot read " + file, errno));

  // Pass 1: every line parsed and checked, against each other and against existing links.
  struct Pending {
    nic::LinkConfig config;
    unsigned line;
  };
  std::vector<Pending> pending;
  std::vector<std::pair<nic::LinkConfig, unsigned>> wanted;
  const Store store = load_store(Paths(ctx));
  std::string line;
  for (unsigned n = 1; std::getline(in, line); ++n) {
    const std::string where = file + ":" + std::to_string(n) + ": ";
    auto words = split_words(line);
    if (words.empty()) continue;
    bool help = false;
    auto c = parse_link_add(words, ctx, &help, &error);
    if (help) return fail(where + "--help is not a link setting");
    if (!c) return {error.status, where + error.message};
    for (const auto& [other, other_line] : wanted) {
      if (other.name == c->name)
        return fail(where + "link " + c->name + " is also defined on line " +
                    std::to_string(other_line));
      if (other.ip == c->ip)
        return fail(where + "address " + nic::format_ipv4(c->ip) + " is also used on line " +
                    std::to_string(other_line));
    }
    wanted.emplace_back(*c, n);
    bool present = false;
    for (const auto& have : store.links) {
      if (have.name == c->name) {
        if (!same_settings(have, *c))
          return fail(where + "link " + c->name +
                      " already exists with other settings (metaroce link del " + c->name +
                      " first)");
        present = true;
      } else if (have.ip == c->ip) {
        return fail(where + "address " + nic::format_ipv4(c->ip) +
                    " is already used by link " + have.name);
      }
    }
    if (!present) pending.push_back({std::move(*c), n});
  }
  if (in.bad()) return fail(describe("cannot read " + file, errno));
  if (parsed->opt.count("--check")) return ok();

  // Pass 2: add them; a failure (no privilege, disk full, a racing `link add`) takes back the
  // links this run added, so the file is applied whole or not at all.
  std::vector<std::string> added;
  for (auto& p : pending) {
    const std::string name = p.config.name;
    Outcome r = create_link(std::move(p.config), ctx);
    if (r.status == kExitOk) r = open_in_engine(name, ctx);
    if (r.status != kExitOk) {
      for (auto it = added.rbegin(); it != added.rend(); ++it) (void)link_del({*it}, ctx);
      return {r.status, file + ":" + std::to_string(p.line) + ": " + r.message +
                            (added.empty() ? "" : " (links added before it were deleted again)")};
    }
    added.push_back(name);
  }
  return ok();
}

Outcome link_flush(const std::vector<std::string>& args, const Context& ctx) {
  if (!args.empty()) {
    if (args[0] == "--help" || args[0] == "-h") {
      *ctx.out << kApplyHelp;
      return ok();
    }
    return usage("link flush: unexpected argument '" + args[0] + "'");
  }
  // Every folder of class/infiniband, readable record or not: a damaged one must go too.
  const Paths p(ctx);
  std::vector<std::string> names;
  std::error_code ec;
  if (fs::is_directory(p.ib_class, ec)) {
    for (const auto& e : fs::directory_iterator(p.ib_class, ec)) {
      std::string name = e.path().filename().string(), err;
      if (e.is_directory(ec) && check_name(name, &err)) names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  Outcome first = ok();
  for (const auto& name : names) {
    Outcome r = link_del({name}, ctx);
    if (r.status != kExitOk && first.status == kExitOk) first = r;
  }
  return first;
}

Outcome exec_program(const std::vector<std::string>& args, const Context& ctx) {
  size_t at = 0;
  if (at < args.size() && (args[at] == "--help" || args[at] == "-h")) {
    *ctx.out << "Usage: metaroce exec [--] PROGRAM [ARGS...]\n"
                "Runs PROGRAM with the settings of `metaroce env`, so libibverbs finds the links.\n";
    return ok();
  }
  if (at < args.size() && args[at] == "--") ++at;
  if (at >= args.size()) return usage("exec: missing PROGRAM (metaroce exec -- PROGRAM ARGS...)");
  const std::string& program = args[at];
  if (program.empty()) return {kExitNotFound, "exec: empty program name"};

  // A fresh environment block: the settings replace inherited values of the same name, and this
  // process's own environment stays untouched should execvpe return.
  const auto settings = verbs_environment(ctx);
  std::vector<std::string> env_strings;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv(*e);
    const auto key = kv.substr(0, kv.find('='));
    bool replaced = std::any_of(settings.begin(), settings.end(),
                                [&](const auto& s) { return s.first == key; });
    if (!replaced) env_strings.emplace_back(kv);
  }
  for (const auto& [key, value] : settings) env_strings.push_back(key + "=" + value);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings(args.begin() + static_cast<std::ptrdiff_t>(at), args.end());
  for (auto& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  ctx.out->flush();
  ctx.err->flush();
  ::execvpe(argv[0], argv.data(), envp.data());
  const int e = errno;
  // The statuses a shell gives a command it cannot find or cannot run.
  if (e == ENOENT || e == ENOTDIR)
    return {kExitNotFound, "exec: " + program + ": command not found"};
  return {kExitCannotRun, describe("exec: cannot run " + program, e)};
}

Outcome engine_command(const std::vector<std::string>& args, const Context& ctx) {
  if (args.empty()) return usage("engine: missing subcommand (start, stop, status)");
  const std::string& sub = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (sub == "--help" || sub == "-h" || sub == "help") {
    *ctx.out << kEngineHelp;
    return ok();
  }
  if (sub == "start") {
    std::vector<std::string> extra;
    for (size_t i = 0; i < rest.size(); ++i) {
      const std::string& a = rest[i];
      if (a == "--help" || a == "-h") {
        *ctx.out << kEngineHelp;
        return ok();
      }
      if (a != "--cores" && a != "--spin" && a != "--spin-us" && a != "--stall-us" &&
          a != "--datapath-threads")
        return usage("engine start: unknown option '" + a + "'");
      if (i + 1 >= rest.size()) return usage("engine start: option " + a + " needs a value");
      extra.push_back(a);
      extra.push_back(rest[++i]);
    }
    if (ctx.engine_program.empty()) return fail("engine start: no engine program known");
    if (EngineConnection(ctx.rundir).ok()) {
      *ctx.out << "an engine already serves " << ctx.rundir << "\n";
      return ok();
    }
    std::string why;
    if (!start_engine(ctx.engine_program, ctx.rundir, extra, &why)) return fail(why);
    return ok();
  }
  if (sub == "stop") {
    if (!rest.empty()) return usage("engine stop: unexpected argument '" + rest[0] + "'");
    EngineConnection conn(ctx.rundir);
    if (!conn.ok()) return ok();  // nothing runs: already stopped
    hostif::Message resp;
    const int e = conn.call(hostif::Op::kShutdown, nullptr, 0, &resp);
    if (e) return fail("engine stop: " + engine_reason(resp, e));
    // Gone once its socket no longer answers (its links closed, goodbyes said).
    for (int i = 0; i < 200; ++i) {
      if (!EngineConnection(ctx.rundir).ok()) return ok();
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return fail("engine stop: the engine of " + ctx.rundir + " did not stop within 5 s");
  }
  if (sub == "status") {
    bool json = false;
    for (const auto& a : rest) {
      if (a == "--json") json = true;
      else return usage("engine status: unexpected argument '" + a + "'");
    }
    EngineConnection conn(ctx.rundir);
    if (!conn.ok()) {
      if (json) *ctx.out << "{\"running\": false}\n";
      else *ctx.out << "no engine serves " << ctx.rundir << "\n";
      return json ? ok() : fail("no engine serves " + ctx.rundir);
    }
    hostif::Message resp;
    int e = conn.call(hostif::Op::kEngineInfo, nullptr, 0, &resp);
    auto info = resp.as<hostif::EngineInfoResp>();
    if (e || !info) return fail("engine status: " + engine_reason(resp, e ? e : EPROTO));
    std::vector<hostif::SessionInfoResp> sessions;
    for (uint32_t i = 0;; ++i) {
      hostif::SessionInfoReq q;
      q.index = i;
      e = conn.call(hostif::Op::kSessionInfo, q, &resp);
      auto s2 = resp.as<hostif::SessionInfoResp>();
      if (e || !s2) break;
      sessions.push_back(*s2);
    }
    std::ostream& o = *ctx.out;
    if (json) {
      o << "{\"running\": true, \"pid\": " << info->pid << ", \"links\": " << info->links
        << ", \"cm_ids\": " << info->cm_ids << ", \"datapath_threads\": " << info->datapath_threads
        << ", \"links_port_wake\": " << info->links_port_wake
        << ", \"naps\": " << info->naps << ", \"naps_frame\": " << info->naps_frame
        << ", \"naps_doorbell\": " << info->naps_doorbell << ", \"contexts\": [";
      for (size_t i = 0; i < sessions.size(); ++i) {
        const auto& x = sessions[i];
        o << (i ? ", " : "") << "{\"pid\": " << x.pid << ", \"link\": "
          << json_string(hostif::get_name(x.link)) << ", \"pds\": " << x.pds << ", \"mrs\": "
          << x.mrs << ", \"cqs\": " << x.cqs << ", \"srqs\": " << x.srqs << ", \"qps\": "
          << x.qps << ", \"mrs_shared\": " << x.mrs_shared << ", \"shared_bytes\": "
          << x.shared_bytes << ", \"direct_accesses\": " << x.direct_accesses
          << ", \"fallback_accesses\": " << x.fallback_accesses << ", \"memory_syscalls\": "
          << x.memory_syscalls << "}";
      }
      o << "]}\n";
    } else {
      o << "engine pid " << info->pid << " serves " << ctx.rundir << ": " << info->links
        << " link(s) on " << info->datapath_threads << " datapath thread(s), " << sessions.size()
        << " context(s), " << info->cm_ids << " CM id(s)\n"
        << "  naps " << info->naps << " (" << info->naps_frame << " ended by a frame, "
        << info->naps_doorbell << " by a doorbell); " << info->links_port_wake << " of "
        << info->links << " link(s) wake it when a frame arrives\n";
      for (const auto& x : sessions)
        o << "  pid " << x.pid << "  " << hostif::get_name(x.link) << "  pds " << x.pds
          << "  mrs " << x.mrs << " (" << x.mrs_shared << " shared, " << x.shared_bytes
          << " B)  cqs " << x.cqs << "  srqs " << x.srqs << "  qps " << x.qps << "\n"
          << "    memory: " << x.direct_accesses << " direct accesses, " << x.fallback_accesses
          << " by system call (" << x.memory_syscalls << " calls)\n";
    }
    return ok();
  }
  return usage("engine: unknown subcommand '" + sub + "'");
}

Outcome dispatch(const std::vector<std::string>& args, const Context& ctx) {
  if (args.empty()) return usage("missing command (try 'metaroce --help')");
  const std::string& cmd = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    *ctx.out << kMainHelp;
    return ok();
  }
  if (cmd == "--version" || cmd == "-V") {
    *ctx.out << "metaroce " << METAROCE_VERSION << "\n";
    return ok();
  }
  if (cmd == "env") return env(rest, ctx);
  if (cmd == "exec") return exec_program(rest, ctx);
  if (cmd == "fabric") return fabric_command(rest, ctx);
  if (cmd == "engine") return engine_command(rest, ctx);
  if (cmd == "stat") {
    std::string why;
    const int status = stat_command(rest, ctx, &why);
    return {status, why};
  }
  if (cmd == "capture" || cmd == "export" || cmd == "events" || cmd == "top" || cmd == "record") {
    std::string why;
    const int status = cmd == "capture"  ? capture_command(rest, ctx, &why)
                       : cmd == "export" ? export_command(rest, ctx, &why)
                       : cmd == "top"    ? top_command(rest, ctx, &why)
                       : cmd == "record" ? record_command(rest, ctx, &why)
                                         : events_command(rest, ctx, &why);
    return {status, why};
  }
  if (cmd != "link") return usage("unknown command '" + cmd + "' (try 'metaroce --help')");
  if (rest.empty()) return usage("link: missing subcommand (add, del, show, apply, flush)");
  const std::string& sub = rest[0];
  std::vector<std::string> sub_args(rest.begin() + 1, rest.end());
  if (sub == "--help" || sub == "-h" || sub == "help") {
    *ctx.out << kLinkHelp;
    return ok();
  }
  if (sub == "add") return link_add(sub_args, ctx);
  if (sub == "del" || sub == "delete") return link_del(sub_args, ctx);
  if (sub == "show" || sub == "list") return link_show(sub_args, ctx);
  if (sub == "apply") return link_apply(sub_args, ctx);
  if (sub == "flush") return link_flush(sub_args, ctx);
  if (sub == "set") return link_set(sub_args, ctx);
  return usage("link: unknown subcommand '" + sub + "'");
}

}  // namespace

// --- exposed helpers ------------------------------------------------------------------------

bool check_name(const std::string& name, std::string* err) {
  if (name.empty() || name.size() > kMaxNameLen ||
      !std::all_of(name.begin(), name.end(), is_name_char)) {
    if (err)
      *err = "bad link name '" + name + "': expected 1.." + std::to_string(kMaxNameLen) +
             " characters from [A-Za-z0-9_-]";
    return false;
  }
  return true;
}

std::optional<std::pair<uint32_t, uint8_t>> parse_address(const std::string& text,
                                                         std::string* err) {
  auto slash = text.find('/');
  if (slash == std::string::npos) {
    *err = "bad --ip '" + text + "': expected ADDR/PREFIX, e.g. 10.0.0.1/24";
    return std::nullopt;
  }
  auto ip = nic::parse_ipv4(text.substr(0, slash));
  uint8_t prefix = 0;
  if (!ip) {
    *err = "bad --ip '" + text + "': '" + text.substr(0, slash) + "' is not an IPv4 address";
    return std::nullopt;
  }
  if (!parse_number(text.substr(slash + 1), uint8_t{1}, uint8_t{32}, &prefix)) {
    *err = "bad --ip '" + text + "': prefix must be 1..32";
    return std::nullopt;
  }
  const uint8_t first = static_cast<uint8_t>(*ip >> 24);
  if (first == 0 || first == 127 || first >= 224) {
    *err = "bad --ip '" + text + "': not a unicast host address";
    return std::nullopt;
  }
  if (prefix <= 30) {  // /31 and /32 have no network or broadcast address
    const uint32_t host_mask = ~uint32_t{0} >> prefix;
    if ((*ip & host_mask) == 0 || (*ip & host_mask) == host_mask) {
      *err = "bad --ip '" + text + "': that is the network or broadcast address of the subnet";
      return std::nullopt;
    }
  }
  return std::make_pair(*ip, prefix);
}

bool check_interface_name(const std::string& name, std::string* err) {
  bool ok = !name.empty() && name.size() < IFNAMSIZ && name != "." && name != "..";
  for (unsigned char ch : name)
    ok = ok && ch > ' ' && ch < 0x7f && ch != '/' && ch != ',' && ch != ';' && ch != ':';
  if (!ok) *err = "bad interface name '" + name + "': 1..15 printable characters, no / , ; :";
  return ok;
}

std::string kernel_interface_of(const std::string& devargs) {
  if (auto udp = nic::parse_udp_plane(devargs)) return *udp;
  if (!devargs.starts_with("net_af_packet") && !devargs.starts_with("net_af_xdp")) return {};
  const auto at = devargs.find(",iface=");
  if (at == std::string::npos) return {};
  return devargs.substr(at + 7, devargs.find(',', at + 7) - (at + 7));
}

std::optional<uint32_t> interface_mtu(const std::string& iface) {
  std::string err;
  if (!check_interface_name(iface, &err)) return std::nullopt;
  std::ifstream f("/sys/class/net/" + iface + "/mtu");
  uint32_t mtu = 0;
  if (!(f >> mtu)) return std::nullopt;
  return mtu;
}

bool check_devargs(const std::string& devargs, std::string* err) {
  auto bad = [&](const std::string& why) {
    *err = "bad --dpdk '" + devargs + "': " + why;
    return false;
  };
  if (devargs.empty()) return bad("empty");
  for (unsigned char ch : devargs)
    if (ch <= ' ' || ch >= 0x7f) return bad("spaces and control characters are not allowed");
  if (devargs.find(nic::kPlaneSeparator) != std::string::npos)
    return bad("';' separates the planes of a --fabric link and cannot appear here");
  auto parts = split_devargs(devargs);
  if (!parts) return bad("unbalanced [ ]");
  const std::string& dev = (*parts)[0];
  if (dev.empty()) return bad("missing the device name before the first ','");
  for (char ch : dev)
    if (!is_name_char(ch) && ch != '.' && ch != ':')
      return bad("device name '" + dev + "' may hold only [A-Za-z0-9_.:-]");
  for (size_t i = 1; i < parts->size(); ++i) {
    const std::string& kv = (*parts)[i];
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == kv.size())
      return bad("expected key=value, got '" + kv + "'");
    const std::string key = kv.substr(0, eq);
    for (char ch : key)
      if (!is_name_char(ch) && ch != '.') return bad("bad key '" + key + "'");
  }
#ifdef METAROCE_HAVE_DPDK
  auto& dpdk = DpdkPlugins::get();
  if (dpdk.plugin_dir_usable() && !dpdk.recognises(devargs))
    return bad("no DPDK bus or driver knows device '" + dev + "'");
#endif
  return true;
}

std::string fabric_devargs(const std::string& link, const std::string& fabric_name,
                           uint32_t endpoint, uint32_t planes) {
  // DPDK device names hold at most 63 characters; "net_memif_" + tag + "_pNN" must fit.
  std::string tag = link;
  if (tag.size() > 40) {
    uint32_t h = 2166136261u;  // FNV-1a: stable across runs and processes
    for (unsigned char ch : link) h = (h ^ ch) * 16777619u;
    char buf[16];
    std::snprintf(buf, sizeof(buf), "h%08x", h);
    tag = buf;
  }
  std::string out;
  for (uint32_t p = 0; p < planes; ++p) {
    if (p != 0) out += nic::kPlaneSeparator;
    out += "net_memif_" + tag + "_p" + std::to_string(p) + ",role=client,id=0,socket=" +
           fabric::socket_name(fabric_name, endpoint, p);
  }
  return out;
}

uint64_t node_guid_for_ip(uint32_t ip) {
  // 02:00 (locally administered, unicast) + the IP as MAC, stretched to EUI-64 with ff:fe.
  return (uint64_t{0x0200} << 48) | (uint64_t{ip >> 24} << 40) | (uint64_t{0xfffe} << 24) |
         uint64_t{ip & 0xffffff};
}

std::string format_guid(uint64_t guid) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%04x:%04x:%04x:%04x", unsigned(guid >> 48) & 0xffff,
                unsigned(guid >> 32) & 0xffff, unsigned(guid >> 16) & 0xffff, unsigned(guid) & 0xffff);
  return buf;
}

std::string format_gid(const uint8_t gid[16]) {
  std::string s;
  char buf[8];
  for (int i = 0; i < 16; i += 2) {
    std::snprintf(buf, sizeof(buf), "%s%04x", i ? ":" : "", (unsigned{gid[i]} << 8) | gid[i + 1]);
    s += buf;
  }
  return s;
}

std::vector<std::pair<std::string, std::string>> verbs_environment(const Context& ctx) {
  std::vector<std::pair<std::string, std::string>> settings;
  // With the kernel module, kernel devices and their completion channels are the kernel's:
  // nothing to redirect (docs/design.md, "The kernel module"). A kernel-free link (memif, several
  // planes) exists only in the generated tree, so where one is recorded the redirect stays, and
  // hides the kernel's devices from that program (libibverbs reads a single sysfs root).
  bool redirect = !ctx.kernel_module;
  if (!redirect) {
    for (const nic::LinkConfig& c : load_store(Paths(ctx)).links) redirect |= c.kernel.empty();
  }
  if (redirect) settings.emplace_back("SYSFS_PATH", ctx.sysfs());
  // A binary run from the build tree points libibverbs at the provider built next to it, one
  // from a bundle at the bundle's provider and libibverbs; an installed one relies on
  // /etc/libibverbs.d.
  std::string preload = ctx.preload_path;
  if (!ctx.bundle_root.empty()) {
    const std::string lib = ctx.bundle_root + "/lib";
    settings.emplace_back("RDMAV_DRIVERS", lib + "/libibverbs/libmetaroce");
    // First in the search path, before whatever the caller had (kept once).
    std::string path = lib;
    if (const char* had = std::getenv("LD_LIBRARY_PATH"); had && *had)
      path = (had == lib || std::string_view(had).starts_with(lib + ":")) ? had : lib + ":" + had;
    settings.emplace_back("LD_LIBRARY_PATH", path);
    preload = lib + "/metaroce/libmetaroce-preload.so";
  } else if (!ctx.build_root.empty() && !ctx.exe_dir.empty()) {
    std::error_code ec;
    fs::path root = fs::weakly_canonical(ctx.build_root, ec);
    fs::path exe = fs::weakly_canonical(ctx.exe_dir, ec);
    auto rel = exe.lexically_relative(root);
    if (!ec && !rel.empty() && *rel.begin() != "..") {
      settings.emplace_back("RDMAV_DRIVERS", root.string() + "/providers/metaroce/libmetaroce");
      preload = root.string() + "/providers/metaroce/preload/libmetaroce-preload.so";
    }
  }
  // Completion channels: libmetaroce-preload.so interposes ibv_create_comp_channel (no kernel
  // can answer it). Put first in LD_PRELOAD, what the caller had kept after it (a sanitizer's
  // runtime before it: it must come first of all); left out where the library is not
  // installed, since a missing preload makes every program complain.
  std::error_code ec;
  if (redirect && !preload.empty() && fs::is_regular_file(preload, ec)) {
    std::string runtimes, value = preload;
    const char* inherited = std::getenv("LD_PRELOAD");
    std::string rest = inherited ? inherited : "";
    for (size_t at = 0; at < rest.size();) {
      const size_t end = std::min(rest.find_first_of(" :", at), rest.size());
      const std::string item = rest.substr(at, end - at);
      const std::string file = fs::path(item).filename().string();
      if (file.rfind("libasan", 0) == 0 || file.rfind("libtsan", 0) == 0 ||
          file.rfind("libclang_rt.", 0) == 0) {
        runtimes += item + " ";
      } else if (!item.empty() && item != preload) {
        value += " " + item;
      }
      at = end + 1;
    }
    settings.emplace_back("LD_PRELOAD", runtimes + value);
  }
  return settings;
}

std::string bundle_root_of(const std::string& exe_dir) {
  if (exe_dir.empty()) return "";
  std::error_code ec;
  const fs::path top = fs::path(exe_dir).parent_path();
  return fs::is_regular_file(top / kBundleMark, ec) ? top.string() : "";
}

Context process_context() {
  Context ctx;
  const char* rd = std::getenv("METAROCE_RUNDIR");
  ctx.rundir = (rd && *rd) ? rd : kRunDirDefault;
  while (ctx.rundir.size() > 1 && ctx.rundir.back() == '/') ctx.rundir.pop_back();
  ctx.is_root = ::geteuid() == 0;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) ctx.exe_dir = exe.parent_path().string();
  ctx.build_root = METAROCE_BUILD_ROOT;
  ctx.preload_path = METAROCE_PRELOAD_PATH;
  ctx.engine_program = METAROCE_ENGINE_PATH;
  ctx.kernel_module = ::access(MRIB_DEV_NODE, F_OK) == 0;
  // Run from a bundle: the engine beside this binary. From the build tree: the engine built
  // next to it.
  ctx.bundle_root = bundle_root_of(ctx.exe_dir);
  if (!ctx.bundle_root.empty()) {
    ctx.engine_program = ctx.bundle_root + "/bin/metaroced";
  } else if (!ctx.build_root.empty() && !ctx.exe_dir.empty()) {
    fs::path root = fs::weakly_canonical(ctx.build_root, ec);
    fs::path exe = fs::weakly_canonical(ctx.exe_dir, ec);
    auto rel = exe.lexically_relative(root);
    if (!ec && !rel.empty() && *rel.begin() != "..")
      ctx.engine_program = (root / "datapath/engine/metaroced").string();
  }
  // Another engine program (a sanitized build of it: docs/security.md).
  if (const char* e = std::getenv("METAROCE_ENGINE"); e && *e) ctx.engine_program = e;
  ctx.out = &std::cout;
  ctx.err = &std::cerr;
  return ctx;
}

int run(const std::vector<std::string>& args, const Context& ctx) {
  Outcome r = dispatch(args, ctx);
  ctx.out->flush();
  if (r.status != kExitOk) {
    // Messages quote user input; keep them to the promised single line.
    std::string line;
    for (unsigned char c : r.message) {
      if (c < 0x20 || c == 0x7f) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\x%02x", c);
        line += buf;
      } else {
        line += static_cast<char>(c);
      }
    }
    *ctx.err << "metaroce: " << line << "\n";
  }
  return r.status;
}

}  // namespace metaroce::util
