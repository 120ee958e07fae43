// SPDX-License-Identifier: Apache-2.0
// What the files of the `metaroce` command (cli.cc, cli_link.cc, cli_fabric.cc, cli_engine.cc)
// share: outcomes, argument and file helpers, the link store, and each family's commands.
#pragma once

#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "datapath/nic/link_config.h"
#include "util/cli.h"

namespace metaroce::util::cli_detail {

// --- small file helpers (cli.cc) -------------------------------------------------------------

bool path_exists(const std::string& path);
std::string describe(const std::string& what, int e);
bool writable(const std::string& dir);

template <typename T>
bool parse_number(const std::string& s, T lo, T hi, T* out) {
  if (s.empty() || s.size() > 12) return false;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi) return false;
  *out = static_cast<T>(v);
  return true;
}

bool is_name_char(char c);

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

// Every link record of the run dir (cli_link.cc).
Store load_store(const Paths& p);

// --- commands -------------------------------------------------------------------------------

struct Outcome {
  int status;
  std::string message;  // for the single stderr line; empty when status is 0
};

Outcome usage(const std::string& what);
Outcome fail(const std::string& what);
Outcome ok();

// Splits `--key value`, `--key=value` and flags; positional arguments in order.
struct ParsedArgs {
  std::vector<std::string> positional;
  std::map<std::string, std::string> opt;
  bool help = false;
};

// *error holds the usage error when it returns nullopt (cli.cc).
std::optional<ParsedArgs> parse_args(const std::string& cmd, const std::vector<std::string>& args,
                                     const std::vector<std::string>& with_value,
                                     const std::vector<std::string>& flags, Outcome* error);

// --- the subcommand families, which dispatch (cli.cc) calls ----------------------------------

// `metaroce link ...` (cli_link.cc); dispatch prints kLinkHelp for `metaroce link --help` too.
extern const char* const kLinkHelp;
Outcome link_add(const std::vector<std::string>& args, const Context& ctx);
Outcome link_del(const std::vector<std::string>& args, const Context& ctx);
Outcome link_show(const std::vector<std::string>& args, const Context& ctx);
Outcome link_set(const std::vector<std::string>& args, const Context& ctx);
Outcome link_apply(const std::vector<std::string>& args, const Context& ctx);
Outcome link_flush(const std::vector<std::string>& args, const Context& ctx);

// `metaroce fabric ...` (cli_fabric.cc).
Outcome fabric_command(const std::vector<std::string>& rest, const Context& ctx);

// `metaroce env`, `metaroce exec` and `metaroce engine ...` (cli_engine.cc).
Outcome env(const std::vector<std::string>& args, const Context& ctx);
Outcome exec_program(const std::vector<std::string>& args, const Context& ctx);
Outcome engine_command(const std::vector<std::string>& args, const Context& ctx);

}  // namespace metaroce::util::cli_detail
