// SPDX-License-Identifier: Apache-2.0
// `metaroce link`: link records plus the sysfs tree and device node through which an unmodified
// libibverbs discovers a MetaRoCE device on a host without RDMA in the kernel.
#include "util/cli_internal.h"
#include "util/engine_client.h"
#include "util/json_text.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>

#include "datapath/fabric/fabric_control.h"
#include "datapath/io/dpdk_port.h"

namespace metaroce::util::cli_detail {
namespace {

namespace fs = std::filesystem;

// libibverbs checks the uverbs ABI of class/infiniband_verbs against 3..6; 6 is the current one.
constexpr const char* kUverbsClassAbi = "6";
// /dev/full: opening succeeds, and the one command libibverbs still writes itself
// (create_comp_channel) fails cleanly with ENOSPC instead of reading garbage.
constexpr unsigned kNodeMajor = 1;
constexpr unsigned kNodeMinor = 7;

}  // namespace

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

namespace {

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

bool is_our_node(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode) &&
         major(st.st_rdev) == kNodeMajor && minor(st.st_rdev) == kNodeMinor;
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

}  // namespace

// --- the link store -------------------------------------------------------------------------

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

namespace {

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

}  // namespace

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

namespace {

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

}  // namespace

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
    OrderedJson all = OrderedJson::array();
    for (const auto& l : shown) {
      all.push_back(OrderedJson{{"name", l.name},
                                {"uverbs", l.uverbs},
                                {"ip", nic::format_ipv4(l.ip)},
                                {"prefix", unsigned{l.prefix}},
                                {"mtu", l.mtu},
                                {"paths", l.paths},
                                {"planes", l.planes},
                                {"udp_port", l.udp_port},
                                {"rx_capacity_mbps", l.rx_capacity_mbps},
                                {"node_guid", format_guid(l.node_guid)},
                                {"kernel", l.kernel},
                                {"limits", nic::format_limits(l.limits)},
                                {"process_limits", nic::format_limits(l.process_limits)},
                                {"devargs", l.devargs}});
    }
    o << json_text(all);
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

namespace {

// --- links from a file, flush ----------------------------------------------------------------

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

}  // namespace

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

}  // namespace metaroce::util::cli_detail
