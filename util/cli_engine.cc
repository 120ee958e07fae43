// SPDX-License-Identifier: Apache-2.0
// `metaroce engine` (start, stop, status of the host's engine), `metaroce env` and `metaroce exec`
// with the environment that makes libibverbs find the links.
#include "util/cli_internal.h"
#include "util/engine_client.h"
#include "util/json_text.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <string_view>
#include <thread>

namespace metaroce::util {
namespace {

namespace fs = std::filesystem;

}  // namespace

namespace cli_detail {
namespace {

constexpr const char* kEngineHelp =
    "Usage: metaroce engine start [--cores LIST] [--datapath-threads N] [--spin adaptive|always]\n"
    "                             [--spin-us N] [--stall-us N] [--nice N]\n"
    "       metaroce engine stop\n"
    "       metaroce engine status [--json]\n"
    "\n"
    "The engine (metaroced) owns the ports of every link of the run dir and serves them to every\n"
    "process on the host. `start` runs one in the background unless one already serves the run\n"
    "dir (the options go to metaroced: --cores pins its datapath threads, one per core,\n"
    "--datapath-threads divides the links among N threads, --spin always never sleeps, --nice\n"
    "sets the datapath threads' nice value, -10 by default);\n"
    "`link add` does it too. `stop` closes every link's ports (applications get\n"
    "IBV_EVENT_DEVICE_FATAL); the links stay recorded and a new engine opens them again.\n"
    "`status` lists the contexts it serves: process, link, objects held.\n";

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

}  // namespace

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
          a != "--datapath-threads" && a != "--nice")
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
      if (json) *ctx.out << json_text(OrderedJson{{"running", false}});
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
      OrderedJson contexts = OrderedJson::array();
      for (const auto& x : sessions) {
        contexts.push_back(OrderedJson{{"pid", x.pid},
                                       {"link", hostif::get_name(x.link)},
                                       {"pds", x.pds},
                                       {"mrs", x.mrs},
                                       {"cqs", x.cqs},
                                       {"srqs", x.srqs},
                                       {"qps", x.qps},
                                       {"mrs_shared", x.mrs_shared},
                                       {"shared_bytes", x.shared_bytes},
                                       {"direct_accesses", x.direct_accesses},
                                       {"fallback_accesses", x.fallback_accesses},
                                       {"memory_syscalls", x.memory_syscalls}});
      }
      o << json_text(OrderedJson{{"running", true},
                                 {"pid", info->pid},
                                 {"links", info->links},
                                 {"cm_ids", info->cm_ids},
                                 {"datapath_threads", info->datapath_threads},
                                 {"links_port_wake", info->links_port_wake},
                                 {"naps", info->naps},
                                 {"naps_frame", info->naps_frame},
                                 {"naps_doorbell", info->naps_doorbell},
                                 {"datapath_nice", info->datapath_nice},
                                 {"contexts", std::move(contexts)}});
    } else {
      o << "engine pid " << info->pid << " serves " << ctx.rundir << ": " << info->links
        << " link(s) on " << info->datapath_threads << " datapath thread(s) at nice "
        << info->datapath_nice << ", " << sessions.size()
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

}  // namespace cli_detail

using cli_detail::load_store;
using cli_detail::Paths;

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

}  // namespace metaroce::util
