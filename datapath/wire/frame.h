// SPDX-License-Identifier: Apache-2.0
// Ethernet II / IPv4 / UDP framing and ARP, as the software NIC puts them around MetaRoCE
// packets and checks them on arrival (docs/spec/wire.md §1). No VLAN tags, no IPv4 fragments.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace metaroce::wire {

using MacAddr = std::array<uint8_t, 6>;
inline constexpr MacAddr kBroadcastMac = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

inline constexpr size_t kEthHeaderLen = 14;
inline constexpr size_t kIpv4HeaderLen = 20;  // we send no options
inline constexpr size_t kUdpHeaderLen = 8;
inline constexpr size_t kUdpFrameHeaderLen = kEthHeaderLen + kIpv4HeaderLen + kUdpHeaderLen;
inline constexpr size_t kArpFrameLen = 60;    // 42 bytes of ARP, zero-padded to the Ethernet min
inline constexpr uint16_t kEtherTypeIpv4 = 0x0800;
inline constexpr uint16_t kEtherTypeArp = 0x0806;
inline constexpr uint8_t kIpProtoUdp = 17;

// The two ECN bits of the IPv4 TOS byte (RFC 3168).
enum class Ecn : uint8_t { kNotEct = 0, kEct1 = 1, kEct0 = 2, kCe = 3 };

// The Ethernet address an IPv4 group's frames go to: 01:00:5e and the group's low 23 bits
// (RFC 1112 §6.4). group in host order.
constexpr MacAddr multicast_mac(uint32_t group) {
  return {0x01, 0x00, 0x5e, static_cast<uint8_t>((group >> 16) & 0x7f),
          static_cast<uint8_t>(group >> 8), static_cast<uint8_t>(group)};
}

struct UdpFrameParams {
  MacAddr src_mac{};
  MacAddr dst_mac{};
  uint32_t src_ip = 0;   // host byte order
  uint32_t dst_ip = 0;
  uint16_t src_port = 0; // the path's entropy
  uint16_t dst_port = 0;
  uint8_t dscp = 0;      // 0..63
  Ecn ecn = Ecn::kEct0;  // data packets are ECN-capable
  uint8_t ttl = 64;
  uint16_t ip_id = 0;
  bool udp_checksum = false;  // 0 (none) is allowed for UDP over IPv4
};

// Writes Ethernet + IPv4 (with header checksum) + UDP headers into hdr[0, 42) for a payload of
// payload_len bytes. With params.udp_checksum the payload must follow the headers in the same
// buffer (hdr.size() >= 42 + payload_len). Returns 42, or 0 when something does not fit.
size_t write_udp_headers(std::span<uint8_t> hdr, const UdpFrameParams& params,
                         size_t payload_len);
// The headers of every frame to one peer on one plane, but for the lengths and the UDP source
// port (the path's entropy): written once by make_udp_template, then stamped on each packet by
// stamp_udp_headers, which patches three fields and adds the length to the IPv4 header's
// precomputed sum. Byte for byte what write_udp_headers writes (wire_test checks it).
struct UdpHeaderTemplate {
  std::array<uint8_t, kUdpFrameHeaderLen> bytes{};
  uint32_t ip_sum = 0;  // ones' complement sum of the IPv4 header, length and checksum zero
};
// False (nothing usable) for parameters write_udp_headers refuses, and with udp_checksum,
// whose sum covers the payload.
bool make_udp_template(UdpHeaderTemplate& t, const UdpFrameParams& params);
// Returns 42, or 0 when hdr is short or payload_len too long.
size_t stamp_udp_headers(std::span<uint8_t> hdr, const UdpHeaderTemplate& t, uint16_t src_port,
                         size_t payload_len);
// Headers plus a copy of payload into out. Returns the frame length or 0.
size_t build_udp_frame(std::span<uint8_t> out, const UdpFrameParams& params,
                       std::span<const uint8_t> payload);

enum class ArpOp : uint16_t { kRequest = 1, kReply = 2 };

struct ArpPacket {
  ArpOp op = ArpOp::kRequest;
  MacAddr sender_mac{};
  uint32_t sender_ip = 0;
  MacAddr target_mac{};  // zero in a request
  uint32_t target_ip = 0;
};

// Request: broadcast, asks who has target_ip. Reply: unicast to target_mac. Returns
// kArpFrameLen or 0 when out is too small.
size_t build_arp(std::span<uint8_t> out, const ArpPacket& arp);

// IGMP (RFC 2236, version 2; RFC 3376's queries are read as version 2's): the membership of
// the device's multicast groups, told to snooping switches and multicast routers (wire.md §8).
inline constexpr uint8_t kIpProtoIgmp = 2;
inline constexpr uint32_t kAllSystemsGroup = 0xe0000001;  // 224.0.0.1: general queries
inline constexpr uint32_t kAllRoutersGroup = 0xe0000002;  // 224.0.0.2: leaves
inline constexpr size_t kIgmpFrameLen = 60;  // 14 + 24 (IPv4 with Router Alert) + 8, padded
enum class IgmpType : uint8_t {
  kQuery = 0x11,
  kV1Report = 0x12,
  kV2Report = 0x16,
  kLeave = 0x17,
  kV3Report = 0x22,
};
struct IgmpMessage {
  IgmpType type = IgmpType::kQuery;
  uint8_t max_resp = 0;  // queries: tenths of a second
  uint32_t group = 0;    // host order; 0 in a general query
};
// A version 2 membership report (to the group) or leave (to 224.0.0.2) of group from src:
// IPv4 TTL 1 with the Router Alert option (RFC 2113), IGMP checksum. Returns kIgmpFrameLen,
// or 0 when out is too small.
size_t build_igmp(std::span<uint8_t> out, const MacAddr& src_mac, uint32_t src_ip, IgmpType type,
                  uint32_t group);
// The IGMP message in an IPv4 payload (FrameInfo::ip_payload of a frame of protocol 2): false
// when it is shorter than 8 bytes or its checksum is wrong.
bool parse_igmp(std::span<const uint8_t> ip_payload, IgmpMessage& out);

// Link goodbye (docs/spec/link.md §4): a port about to close tells its peer to stop touching the
// shared link first. DPDK 22.11's memif unmaps its rings from the interrupt thread when the peer
// disconnects, even while another thread is inside rx/tx on them.
inline constexpr uint16_t kEtherTypeGoodbye = 0x88b5;  // IEEE 802 local experimental
inline constexpr uint8_t kGoodbye = 1, kGoodbyeAck = 2;
inline constexpr size_t kGoodbyeFrameLen = 60;
// A broadcast goodbye frame of `kind` from src_mac. Returns kGoodbyeFrameLen, or 0 when out is too
// small.
size_t build_goodbye(std::span<uint8_t> out, const MacAddr& src_mac, uint8_t kind);
// The kind byte of a goodbye frame (any value: the receiver ignores kinds it does not know), or
// nullopt when the frame is not one.
std::optional<uint8_t> goodbye_kind(std::span<const uint8_t> frame);

enum class FrameKind : uint8_t { kArp, kMetaRoce, kOther, kMalformed };

// Why a frame is not a MetaRoCE packet; kNone for kArp and kMetaRoce.
enum class FrameError : uint8_t {
  kNone = 0,
  kTruncated,        // shorter than the headers it announces
  kEtherType,        // neither IPv4 nor ARP (kOther)
  kArpFormat,        // not Ethernet/IPv4 ARP, or unknown op
  kIpVersion,        // version != 4 or IHL < 5
  kIpChecksum,
  kIpLength,         // total length below the header or beyond the frame
  kIpFragment,       // MF set or fragment offset != 0: we never fragment, so drop
  kNotUdp,           // another IP protocol (kOther)
  kUdpLength,
  kUdpChecksum,      // non-zero and wrong
  kWrongPort,        // UDP, but not to our port (kOther)
  kCount,
};

struct FrameInfo {
  FrameKind kind = FrameKind::kMalformed;
  FrameError error = FrameError::kTruncated;
  MacAddr src_mac{};
  MacAddr dst_mac{};
  uint32_t src_ip = 0;      // host byte order
  uint32_t dst_ip = 0;
  uint16_t src_port = 0;
  uint16_t dst_port = 0;
  uint8_t dscp = 0;
  Ecn ecn = Ecn::kNotEct;
  ArpPacket arp;            // kArp
  std::span<const uint8_t> payload;  // kMetaRoce: the UDP payload
  uint8_t ip_proto = 0;     // IPv4 frames: the protocol
  std::span<const uint8_t> ip_payload;  // kOther with kNotUdp: the IPv4 payload
};

FrameInfo parse_frame(std::span<const uint8_t> frame, uint16_t udp_port);

// Internet checksum (RFC 1071) over data, folded, not inverted; seed adds a partial sum.
uint16_t ones_complement_sum(std::span<const uint8_t> data, uint32_t seed = 0);
const char* to_string(FrameError e);

}  // namespace metaroce::wire
