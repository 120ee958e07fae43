// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the `metaroce` command's link management (util/cli): arbitrary arguments
// to `link add|del|set|show|flush|apply`, and arbitrary links.conf files to `link apply`, against
// a run dir and device dir of its own holding two links. Checked besides "no crash, no sanitizer
// report": the exit status is 0, 1 or 2; a refusal says why on stderr and changes nothing in the
// run dir or the device dir (the guide's "a bad CLI argument prints what is wrong and changes
// nothing"; `link apply` applies a file whole or not at all).
// Input: first byte chooses the form (even: arguments after `link`, separated by NUL bytes;
// odd: a links.conf, applied, or only checked when bit 1 is set).
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "util/cli.h"

namespace fs = std::filesystem;

namespace metaroce::util {
namespace {

void check(bool ok, const char* what, const std::vector<std::string>& args) {
  if (ok) return;
  std::fprintf(stderr, "cli_fuzz: %s; metaroce", what);
  for (const auto& a : args) std::fprintf(stderr, " '%s'", a.c_str());
  std::fprintf(stderr, "\n");
  std::abort();
}

// Every entry under dir: files with their content, links with their target, nodes with numbers.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> m;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    const std::string rel = fs::relative(it->path(), dir, ec).string();
    struct stat st {};
    ::lstat(it->path().c_str(), &st);
    if (S_ISDIR(st.st_mode)) {
      m[rel] = "<dir>";
    } else if (S_ISLNK(st.st_mode)) {
      m[rel] = "<link " + fs::read_symlink(it->path(), ec).string() + ">";
    } else if (S_ISCHR(st.st_mode)) {
      m[rel] = "<chr " + std::to_string(major(st.st_rdev)) + ":" +
               std::to_string(minor(st.st_rdev)) + ">";
    } else {
      std::ifstream f(it->path());
      std::stringstream ss;
      ss << f.rdbuf();
      m[rel] = ss.str();
    }
  }
  return m;
}

struct World {
  std::string root, conf;
  Context ctx;
  std::ostringstream out, err;
  std::map<std::string, std::string> baseline;

  World() {
    char tmpl[] = "/tmp/metaroce-cli-fuzz-XXXXXX";
    if (!::mkdtemp(tmpl)) std::abort();
    root = tmpl;
    conf = root + "/links.conf";
    ctx.rundir = root + "/state/run";
    ctx.dev_dir = root + "/state/dev/infiniband";
    ctx.is_root = ::geteuid() == 0;
    ctx.build_root = root + "/build";
    ctx.exe_dir = root + "/bin";
    ctx.out = &out;
    ctx.err = &err;
    reset();
  }
  ~World() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  int run(const std::vector<std::string>& args) {
    out.str("");
    err.str("");
    return util::run(args, ctx);
  }
  // Two links recorded (where links can be made here), nothing else.
  void reset() {
    std::error_code ec;
    fs::remove_all(root + "/state", ec);
    fs::create_directories(root + "/state/run", ec);
    run({"link", "add", "fz0", "--dpdk", "net_memif0,role=server", "--ip", "198.18.0.1/24"});
    run({"link", "add", "fz1", "--dpdk", "net_memif1,role=server", "--ip", "198.18.0.2/24",
         "--paths", "4", "--limit", "qp=16"});
    baseline = snapshot(root + "/state");
  }
};

World& world() {
  static World w;
  return w;
}

}  // namespace
}  // namespace metaroce::util

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace metaroce::util;
  if (size == 0 || size > 4096) return 0;
  World& w = world();
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::vector<std::string> args = {"link"};
  if (data[0] & 1) {
    std::ofstream(w.conf, std::ios::binary | std::ios::trunc) << rest;
    args.push_back("apply");
    if (data[0] & 2) args.push_back("--check");
    args.push_back(w.conf);
  } else {
    std::string a;
    for (char c : rest) {
      if (c == '\0') {
        args.push_back(a);
        a.clear();
      } else {
        a += c;
      }
    }
    args.push_back(a);
    if (args.size() > 24) return 0;
  }
  const int status = w.run(args);
  check(status == kExitOk || status == kExitError || status == kExitUsage, "an exit status not 0, 1 or 2", args);
  const auto now = snapshot(w.root + "/state");
  if (status != kExitOk) {
    check(!w.err.str().empty(), "a refusal that does not say why", args);
    check(now == w.baseline, "a refused command changed the run dir or the device dir", args);
  } else if (now != w.baseline) {
    w.reset();
  }
  return 0;
}
