// SPDX-License-Identifier: Apache-2.0
// `metaroce fabric`: runs the fabric emulator (a DPDK process, when built with DPDK) and sets,
// reads and stops a running one through its control socket.
#include "util/cli_internal.h"

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <ostream>
#include <thread>

#include "datapath/fabric/fabric_control.h"
#include "datapath/fabric/idle_policy.h"
#ifdef METAROCE_HAVE_DPDK
#include "datapath/fabric/fabric_runner.h"
#endif

namespace metaroce::util::cli_detail {
namespace {

namespace fs = std::filesystem;

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

}  // namespace

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

}  // namespace metaroce::util::cli_detail
