// SPDX-License-Identifier: Apache-2.0
// The `metaroce` command: dispatch to the subcommand families (cli_link.cc, cli_fabric.cc,
// cli_engine.cc, stat, top, record, operator), the helpers they share and the checks of cli.h.
#include "util/cli.h"
#include "util/cli_internal.h"
#include "util/operator.h"
#include "util/record.h"
#include "util/stat.h"
#include "util/top.h"

#include <sys/stat.h>
#include <net/if.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>

#include "datapath/fabric/fabric_control.h"
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

}  // namespace

namespace cli_detail {

// --- small file helpers; every error comes back as text, nothing throws ------------------------

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
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

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-';
}

}  // namespace cli_detail

namespace {

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

}  // namespace

namespace cli_detail {

// --- commands -------------------------------------------------------------------------------

Outcome usage(const std::string& what) { return {kExitUsage, what}; }
Outcome fail(const std::string& what) { return {kExitError, what}; }
Outcome ok() { return {kExitOk, {}}; }

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

namespace {

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
}  // namespace cli_detail

using cli_detail::dispatch;
using cli_detail::is_name_char;
using cli_detail::Outcome;
using cli_detail::parse_number;

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
