// SPDX-License-Identifier: Apache-2.0
// A MetaRoCE link as `metaroce link add` records it and the provider reads it back: one
// `key=value` per line in <sysfs tree>/class/infiniband/<name>/metaroce.conf.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "datapath/hostif/queues.h"

namespace metaroce::nic {

inline constexpr uint16_t kDefaultUdpPort = 4793;  // docs/spec/ §2: configurable
inline constexpr uint32_t kDefaultMtu = 9000;      // link MTU (IP packet bytes)
inline constexpr uint16_t kDefaultPaths = 8;
inline constexpr uint32_t kGidTableLen = 16;     // gids/0 is the link's address, 1..15 are zero
inline constexpr uint32_t kUverbsAbi = 1;        // class/infiniband_verbs/uverbsN/abi_version
inline constexpr const char* kConfigFile = "metaroce.conf";  // inside class/infiniband/<name>/

inline constexpr uint16_t kMaxPlanes = 16;
inline constexpr char kPlaneSeparator = ';';  // between the device strings of a multiplane link

// What a device holds at most (docs/spec/verbs-mapping.md §20). Objects are counted per kind;
// `mr` counts memory regions and windows together (one key space); `ring_mib` is the shared
// memory of QP, CQ and SRQ rings, 0 for the default: a quarter of the host's memory for the
// device, an eighth for one process.
struct Limits {
  uint32_t qp = hostif::kMaxQps, cq = hostif::kMaxCqs, srq = hostif::kMaxSrqs, pd = hostif::kMaxPds;
  uint32_t mr = 1u << 20;
  uint32_t ring_mib = 0;
  bool operator==(const Limits&) const = default;
};
// "qp=N,cq=N,srq=N,pd=N,mr=N,ring-mib=N" (any subset, over `base`) as `link add --limit` and
// `--process-limit` take it; nullopt and a one-line reason in *err when malformed.
std::optional<Limits> parse_limits(const std::string& text, const Limits& base, std::string* err);
std::string format_limits(const Limits& l);

// Multiplane links (`metaroce link add --fabric NAME:ENDPOINT`): `planes=P` and `devargs` holds P
// DPDK device strings joined by ';', plane 0 first; the NIC opens one port per plane and plane p
// of every device on a fabric reaches plane p of every other. Each string is
// `net_memif_<tag>_p<p>,role=client,id=0,socket=metaroce-fabric-<fabric>-e<E>-p<p>` (abstract
// socket), where <tag> is the link name, or a hash of it when the name is too long for a DPDK
// device name, so the vdev names of two links in one process never collide. A record without
// `planes` is a single-plane link (planes=1) whose devargs holds no ';'.
struct LinkConfig {
  std::string name;             // ibdev name, e.g. "mr0"
  std::string devargs;          // DPDK device string(s) (vdev like "net_memif0,role=server,...")
  uint32_t ip = 0;              // IPv4, host byte order
  uint8_t prefix = 24;
  uint32_t mtu = kDefaultMtu;   // link MTU in bytes (576..9600)
  uint16_t udp_port = kDefaultUdpPort;
  uint16_t paths = kDefaultPaths;  // paths per connection (1..256)
  uint64_t node_guid = 0;       // derived from the IP unless given
  std::string uverbs;           // e.g. "uverbs0": the entry under class/infiniband_verbs
  uint16_t planes = 1;          // device strings in devargs (1..kMaxPlanes)
  // Inbound capacity the receiver shares among senders with fair-share rate hints
  // (docs/spec/congestion.md §3); 0: no hints.
  uint32_t rx_capacity_mbps = 0;
  // Kernel-backed (docs/design.md, "The kernel module"): the interface the link's metaroce_ib
  // device is over; the engine attaches it, and there is no uverbs entry in the tree. Empty for
  // a kernel-free link.
  std::string kernel;
  Limits limits;          // the whole device (every process together)
  Limits process_limits;  // what one process may hold of it (ibv_query_device reports this)
  // Not stored: the run dir the record was loaded from (<run dir>/sys/class/infiniband/<name>/),
  // empty when the file lies elsewhere. The NIC publishes its live counters there.
  std::string run_dir;

  // Parses the file at path; on failure returns nullopt and a one-line reason in *err.
  static std::optional<LinkConfig> load(const std::string& path, std::string* err);
  // The same for a record's text; origin names it in *err.
  static std::optional<LinkConfig> parse(const std::string& text, const std::string& origin,
                                         std::string* err);
  // The record's text: what parse reads back as this record (but run_dir).
  std::string to_text() const;
  // Writes the file atomically (temp file + rename). Returns false and *err on failure.
  bool save(const std::string& path, std::string* err) const;
  bool operator==(const LinkConfig&) const = default;
};

// A plane on kernel UDP sockets instead of a DPDK device (docs/spec/link.md §5): its device
// string in the record is "udp", or "udp,iface=NAME" to send and receive through one interface.
// parse_udp_plane gives the interface ("" for none), nullopt for any other device string.
std::optional<std::string> parse_udp_plane(const std::string& devargs);
std::string udp_plane(const std::string& iface);

// Address helpers shared by the CLI and the provider.
std::optional<uint32_t> parse_ipv4(const std::string& text);  // "a.b.c.d" -> host order
std::string format_ipv4(uint32_t ip);
// IPv4-mapped IPv6 GID (::ffff:a.b.c.d) as 16 network-order bytes.
void ipv4_to_gid(uint32_t ip, uint8_t gid[16]);
// The device's node GUID (host order): the record's, or one derived from the IP.
constexpr uint64_t node_guid_of(const LinkConfig& cfg) {
  if (cfg.node_guid != 0) return cfg.node_guid;
  return 0x020000fffe000000ull | (uint64_t{cfg.ip & 0xffffffu}) | (uint64_t{cfg.ip >> 24} << 48);
}
// The IPv4 inside an IPv4-mapped GID, or nullopt when the GID is not IPv4-mapped.
std::optional<uint32_t> gid_to_ipv4(const uint8_t gid[16]);

}  // namespace metaroce::nic
