// SPDX-License-Identifier: Apache-2.0
// The `metaroce` command as a library: argument parsing, validation and the link commands, with
// every outside dependency (run dir, device dir, privilege, streams) injected so tests can drive it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "datapath/nic/link_config.h"

namespace metaroce::util {

// Exit statuses of the command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;  // the request was understood but cannot be done
inline constexpr int kExitUsage = 2;  // unknown command or option, missing argument
// `metaroce exec`: what a shell returns for a program it cannot run / cannot find.
inline constexpr int kExitCannotRun = 126;
inline constexpr int kExitNotFound = 127;

// Limits `link add` enforces (the record's own parser is more lenient on purpose).
inline constexpr uint32_t kMinMtu = 576;   // smallest IPv4 datagram every host must accept
inline constexpr uint32_t kMaxMtu = 9600;  // largest jumbo frame common switches carry
inline constexpr uint32_t kMaxPaths = 256;
inline constexpr uint32_t kMaxRxCapacityMbps = 10'000'000;  // 10 Tbit/s
inline constexpr size_t kMaxNameLen = 63;  // ibdev names are at most 64 bytes with the NUL
inline constexpr unsigned kMaxUverbs = 1024;  // give up looking for a free uverbsN after this

// Where the command reads and writes; main() fills it from the process, tests from temp dirs.
struct Context {
  std::string rundir;                         // $METAROCE_RUNDIR or /run/metaroce
  std::string dev_dir = "/dev/infiniband";    // libibverbs opens <dev_dir>/uverbsN
  bool is_root = false;                       // may create device nodes
  std::string exe_dir;                        // directory of the running binary
  std::string build_root;                     // meson build root the binary was compiled in
  std::string preload_path;                   // installed libmetaroce-preload.so (LD_PRELOAD)
  // The top folder of a relocatable bundle (scripts/bundle) the binary runs from, else empty:
  // the engine, the provider, the preload library and libibverbs are found below it.
  std::string bundle_root;
  // The engine to start when none serves the run dir (metaroced). Empty: links are records
  // only and no engine is asked (the unit tests of the command).
  std::string engine_program;
  // The metaroce_ib module is loaded: a single-plane link over a kernel interface becomes a
  // kernel device (no sysfs tree entry, no device node, no SYSFS_PATH or preload needed).
  bool kernel_module = false;
  std::ostream* out = nullptr;
  std::ostream* err = nullptr;

  std::string sysfs() const { return rundir + "/sys"; }
};

// The context of this process: environment, euid, /proc/self/exe, std::cout and std::cerr.
Context process_context();

// Runs `metaroce ARGS...` (args excludes argv[0]); returns the exit status.
int run(const std::vector<std::string>& args, const Context& ctx);

// Pieces exposed for tests and for the provider's tools.

// The variables that make libibverbs find the links of ctx, in the order `metaroce env` prints
// them: SYSFS_PATH (unless the kernel module is loaded: its devices are the kernel's, and the
// tree would hide them), RDMAV_DRIVERS only for a binary running from its build tree or a
// bundle, LD_LIBRARY_PATH only from a bundle (its libibverbs before the host's, if any).
std::vector<std::pair<std::string, std::string>> verbs_environment(const Context& ctx);

// The top folder of the bundle whose bin/ is exe_dir (it holds share/metaroce/bundle, which
// scripts/bundle writes), else "".
std::string bundle_root_of(const std::string& exe_dir);

// "1.2.3.4/24" -> (ip, prefix); nullopt and *err when malformed or not a usable unicast address.
std::optional<std::pair<uint32_t, uint8_t>> parse_address(const std::string& text,
                                                         std::string* err);
// Checks `driver[,key=value]*` (optionally `bus:` before the device name) and, when built with
// DPDK, that a DPDK bus recognises the device. Returns false and *err when not.
bool check_devargs(const std::string& devargs, std::string* err);
// Link names: 1..63 characters from [A-Za-z0-9_-]. err may be null.
bool check_name(const std::string& name, std::string* err);
// Kernel interface names: 1..15 characters, no '/', ',', ';' or white space.
bool check_interface_name(const std::string& name, std::string* err);
// The kernel interface a plane's device string sends through: `iface=` of net_af_packet and
// net_af_xdp, the interface of a UDP-socket plane; "" for none (memif, PCI, `--udp any`).
std::string kernel_interface_of(const std::string& devargs);
// The MTU of a kernel interface of this network namespace, nullopt when there is none.
std::optional<uint32_t> interface_mtu(const std::string& iface);
// The device strings of link `link` on planes 0..planes-1 of endpoint `endpoint` of fabric
// `fabric_name`, joined by ';' (the contract is in datapath/nic/link_config.h).
std::string fabric_devargs(const std::string& link, const std::string& fabric_name,
                           uint32_t endpoint, uint32_t planes);
// EUI-64 built from the locally administered MAC 02:00:a:b:c:d of IP a.b.c.d.
uint64_t node_guid_for_ip(uint32_t ip);
// "xxxx:xxxx:xxxx:xxxx" as sysfs node_guid shows it.
std::string format_guid(uint64_t guid);
// Eight "%04x" groups joined by ':' as sysfs gids/N shows them.
std::string format_gid(const uint8_t gid[16]);

}  // namespace metaroce::util
