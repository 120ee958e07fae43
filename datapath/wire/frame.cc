// SPDX-License-Identifier: Apache-2.0
// Ethernet / IPv4 / UDP / ARP encode and parse for the software NIC (docs/spec/wire.md §1).
#include "datapath/wire/frame.h"

#include <algorithm>
#include <cstring>

#include "datapath/wire/bytes.h"

namespace metaroce::wire {
namespace {

static_assert(kUdpFrameHeaderLen == 42);
static_assert(kArpFrameLen >= kEthHeaderLen + 28);

constexpr size_t kArpLen = 28;
constexpr uint16_t kMaxUdpPayload = 65535 - kIpv4HeaderLen - kUdpHeaderLen;

uint32_t partial_sum(const uint8_t* p, size_t n, uint32_t sum) {
  for (; n >= 2; p += 2, n -= 2) sum += load_be16(p);
  if (n) sum += uint32_t{*p} << 8;
  return sum;
}

uint16_t fold(uint32_t sum) {
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  return static_cast<uint16_t>(sum);
}

// The ones' complement sum of a 20-byte IPv4 header, in the host's byte order: the sum does not
// depend on the order its 16-bit words are read in, only the result's bytes swap (RFC 1071 §2),
// so two native 64-bit loads and a 32-bit one do what ten big-endian 16-bit ones would (every
// packet has one), with the carry out of the 64-bit add added back in (end-around carry).
uint16_t ip_header_sum_native(const uint8_t* ip) {
  uint64_t a, b;
  uint32_t c;
  std::memcpy(&a, ip, 8);
  std::memcpy(&b, ip + 8, 8);
  std::memcpy(&c, ip + 16, 4);
  uint64_t sum = a + b;
  sum += sum < a;  // cannot wrap: a sum that carried is at most 2^64 - 2
  sum = (sum & 0xffffffff) + (sum >> 32) + c;
  sum = (sum & 0xffffffff) + (sum >> 32);
  return fold(static_cast<uint32_t>((sum & 0xffff) + (sum >> 16)));
}

// UDP checksum over the IPv4 pseudo header, UDP header and payload (RFC 768).
uint16_t udp_sum(uint32_t src_ip, uint32_t dst_ip, const uint8_t* udp, size_t udp_len) {
  uint32_t s = (src_ip >> 16) + (src_ip & 0xffff) + (dst_ip >> 16) + (dst_ip & 0xffff) +
               kIpProtoUdp + static_cast<uint32_t>(udp_len);
  return fold(partial_sum(udp, udp_len, s));
}

void write_mac(uint8_t* p, const MacAddr& m) { std::copy(m.begin(), m.end(), p); }
MacAddr read_mac(const uint8_t* p) {
  MacAddr m;
  std::copy(p, p + 6, m.begin());
  return m;
}

// The parsers fill the caller's FrameInfo in place: passed and returned by value, it was copied
// twice per frame.
void fail(FrameInfo& info, FrameKind kind, FrameError e) {
  info.kind = kind;
  info.error = e;
}

void parse_arp(FrameInfo& info, std::span<const uint8_t> body) {
  if (body.size() < kArpLen) return fail(info, FrameKind::kMalformed, FrameError::kTruncated);
  const uint8_t* p = body.data();
  const uint16_t op = load_be16(p + 6);
  if (load_be16(p) != 1 || load_be16(p + 2) != kEtherTypeIpv4 || p[4] != 6 || p[5] != 4 ||
      (op != 1 && op != 2)) {
    return fail(info, FrameKind::kMalformed, FrameError::kArpFormat);
  }
  info.arp.op = static_cast<ArpOp>(op);
  info.arp.sender_mac = read_mac(p + 8);
  info.arp.sender_ip = load_be32(p + 14);
  info.arp.target_mac = read_mac(p + 18);
  info.arp.target_ip = load_be32(p + 24);
  info.kind = FrameKind::kArp;
  info.error = FrameError::kNone;
}

}  // namespace

uint16_t ones_complement_sum(std::span<const uint8_t> data, uint32_t seed) {
  return fold(partial_sum(data.data(), data.size(), seed));
}

size_t write_udp_headers(std::span<uint8_t> hdr, const UdpFrameParams& pr, size_t payload_len) {
  if (hdr.size() < kUdpFrameHeaderLen || payload_len > kMaxUdpPayload || pr.dscp > 63) return 0;
  if (pr.udp_checksum && hdr.size() < kUdpFrameHeaderLen + payload_len) return 0;
  uint8_t* e = hdr.data();
  write_mac(e, pr.dst_mac);
  write_mac(e + 6, pr.src_mac);
  store_be16(e + 12, kEtherTypeIpv4);

  uint8_t* ip = e + kEthHeaderLen;
  ip[0] = 0x45;  // version 4, IHL 5
  ip[1] = static_cast<uint8_t>((pr.dscp << 2) | static_cast<uint8_t>(pr.ecn));
  store_be16(ip + 2, static_cast<uint16_t>(kIpv4HeaderLen + kUdpHeaderLen + payload_len));
  store_be16(ip + 4, pr.ip_id);
  store_be16(ip + 6, 0x4000);  // DF: paths must not fragment
  ip[8] = pr.ttl;
  ip[9] = kIpProtoUdp;
  store_be16(ip + 10, 0);
  store_be32(ip + 12, pr.src_ip);
  store_be32(ip + 16, pr.dst_ip);
  const uint16_t csum = static_cast<uint16_t>(~ip_header_sum_native(ip));
  std::memcpy(ip + 10, &csum, 2);  // native order, as it was summed

  uint8_t* udp = ip + kIpv4HeaderLen;
  const size_t udp_len = kUdpHeaderLen + payload_len;
  store_be16(udp, pr.src_port);
  store_be16(udp + 2, pr.dst_port);
  store_be16(udp + 4, static_cast<uint16_t>(udp_len));
  store_be16(udp + 6, 0);
  if (pr.udp_checksum) {
    uint16_t c = static_cast<uint16_t>(~udp_sum(pr.src_ip, pr.dst_ip, udp, udp_len));
    store_be16(udp + 6, c == 0 ? 0xffff : c);  // 0 would mean "no checksum"
  }
  return kUdpFrameHeaderLen;
}

bool make_udp_template(UdpHeaderTemplate& t, const UdpFrameParams& pr) {
  if (pr.udp_checksum || write_udp_headers(t.bytes, pr, 0) == 0) return false;
  uint8_t* ip = t.bytes.data() + kEthHeaderLen;
  store_be16(ip + 2, 0);
  store_be16(ip + 10, 0);
  t.ip_sum = ip_header_sum_native(ip);
  return true;
}

size_t stamp_udp_headers(std::span<uint8_t> hdr, const UdpHeaderTemplate& t, uint16_t src_port,
                         size_t payload_len) {
  if (hdr.size() < kUdpFrameHeaderLen || payload_len > kMaxUdpPayload) return 0;
  uint8_t* e = hdr.data();
  std::memcpy(e, t.bytes.data(), kUdpFrameHeaderLen);
  uint8_t* ip = e + kEthHeaderLen;
  store_be16(ip + 2, static_cast<uint16_t>(kIpv4HeaderLen + kUdpHeaderLen + payload_len));
  uint16_t len_native;
  std::memcpy(&len_native, ip + 2, 2);  // summed in the order the template's sum was
  const uint16_t csum = static_cast<uint16_t>(~fold(t.ip_sum + len_native));
  std::memcpy(ip + 10, &csum, 2);
  uint8_t* udp = ip + kIpv4HeaderLen;
  store_be16(udp, src_port);
  store_be16(udp + 4, static_cast<uint16_t>(kUdpHeaderLen + payload_len));
  return kUdpFrameHeaderLen;
}

size_t build_udp_frame(std::span<uint8_t> out, const UdpFrameParams& pr,
                       std::span<const uint8_t> payload) {
  if (out.size() < kUdpFrameHeaderLen + payload.size()) return 0;
  std::copy(payload.begin(), payload.end(), out.begin() + kUdpFrameHeaderLen);
  if (write_udp_headers(out, pr, payload.size()) == 0) return 0;
  return kUdpFrameHeaderLen + payload.size();
}

size_t build_goodbye(std::span<uint8_t> out, const MacAddr& src_mac, uint8_t kind) {
  if (out.size() < kGoodbyeFrameLen) return 0;
  uint8_t* f = out.data();
  std::memset(f, 0, kGoodbyeFrameLen);
  std::memcpy(f, kBroadcastMac.data(), 6);
  std::memcpy(f + 6, src_mac.data(), 6);
  store_be16(f + 12, kEtherTypeGoodbye);
  f[14] = kind;
  return kGoodbyeFrameLen;
}

std::optional<uint8_t> goodbye_kind(std::span<const uint8_t> frame) {
  if (frame.size() < 15 || load_be16(frame.data() + 12) != kEtherTypeGoodbye) return std::nullopt;
  return frame[14];
}

size_t build_arp(std::span<uint8_t> out, const ArpPacket& a) {
  if (out.size() < kArpFrameLen) return 0;
  uint8_t* e = out.data();
  std::fill(e, e + kArpFrameLen, 0);
  write_mac(e, a.op == ArpOp::kRequest ? kBroadcastMac : a.target_mac);
  write_mac(e + 6, a.sender_mac);
  store_be16(e + 12, kEtherTypeArp);
  uint8_t* p = e + kEthHeaderLen;
  store_be16(p, 1);  // Ethernet
  store_be16(p + 2, kEtherTypeIpv4);
  p[4] = 6;
  p[5] = 4;
  store_be16(p + 6, static_cast<uint16_t>(a.op));
  write_mac(p + 8, a.sender_mac);
  store_be32(p + 14, a.sender_ip);
  write_mac(p + 18, a.op == ArpOp::kRequest ? MacAddr{} : a.target_mac);
  store_be32(p + 24, a.target_ip);
  return kArpFrameLen;
}

size_t build_igmp(std::span<uint8_t> out, const MacAddr& src_mac, uint32_t src_ip, IgmpType type,
                  uint32_t group) {
  if (out.size() < kIgmpFrameLen) return 0;
  constexpr size_t kIhl = 24;  // 20 + the Router Alert option
  constexpr size_t kIgmpLen = 8;
  uint8_t* e = out.data();
  std::fill(e, e + kIgmpFrameLen, 0);
  const uint32_t dst = type == IgmpType::kLeave ? kAllRoutersGroup : group;
  write_mac(e, multicast_mac(dst));
  write_mac(e + 6, src_mac);
  store_be16(e + 12, kEtherTypeIpv4);
  uint8_t* ip = e + kEthHeaderLen;
  ip[0] = 0x40 | kIhl / 4;
  ip[1] = 0xc0;  // DSCP CS6, network control, as hosts send IGMP
  store_be16(ip + 2, kIhl + kIgmpLen);
  store_be16(ip + 6, 0x4000);  // DF
  ip[8] = 1;                   // TTL 1: IGMP never leaves the segment
  ip[9] = kIpProtoIgmp;
  store_be32(ip + 12, src_ip);
  store_be32(ip + 16, dst);
  store_be32(ip + 20, 0x94040000);  // Router Alert (RFC 2113): routers look at it
  store_be16(ip + 10, static_cast<uint16_t>(~ones_complement_sum({ip, kIhl})));
  uint8_t* g = ip + kIhl;
  g[0] = static_cast<uint8_t>(type);
  store_be32(g + 4, group);
  store_be16(g + 2, static_cast<uint16_t>(~ones_complement_sum({g, kIgmpLen})));
  return kIgmpFrameLen;
}

bool parse_igmp(std::span<const uint8_t> b, IgmpMessage& out) {
  if (b.size() < 8 || ones_complement_sum(b) != 0xffff) return false;
  out.type = static_cast<IgmpType>(b[0]);
  out.max_resp = b[1];
  out.group = load_be32(b.data() + 4);
  return true;
}

namespace {

void parse_into(FrameInfo& info, std::span<const uint8_t> f, uint16_t udp_port) {
  if (f.size() < kEthHeaderLen) return fail(info, FrameKind::kMalformed, FrameError::kTruncated);
  info.dst_mac = read_mac(f.data());
  info.src_mac = read_mac(f.data() + 6);
  const uint16_t type = load_be16(f.data() + 12);
  if (type == kEtherTypeArp) return parse_arp(info, f.subspan(kEthHeaderLen));
  if (type != kEtherTypeIpv4) return fail(info, FrameKind::kOther, FrameError::kEtherType);

  const auto ipb = f.subspan(kEthHeaderLen);
  if (ipb.size() < kIpv4HeaderLen) return fail(info, FrameKind::kMalformed, FrameError::kTruncated);
  const uint8_t* ip = ipb.data();
  const size_t ihl = size_t{ip[0] & 0x0fu} * 4;
  if ((ip[0] >> 4) != 4 || ihl < kIpv4HeaderLen) {
    return fail(info, FrameKind::kMalformed, FrameError::kIpVersion);
  }
  if (ipb.size() < ihl) return fail(info, FrameKind::kMalformed, FrameError::kTruncated);
  const uint16_t hsum = ihl == kIpv4HeaderLen ? ip_header_sum_native(ip) : ones_complement_sum({ip, ihl});
  if (hsum != 0xffff) {  // 0xffff in either byte order
    return fail(info, FrameKind::kMalformed, FrameError::kIpChecksum);
  }
  const size_t total = load_be16(ip + 2);
  // Bytes past the IP total length are Ethernet padding and ignored.
  if (total < ihl || total > ipb.size()) {
    return fail(info, FrameKind::kMalformed, FrameError::kIpLength);
  }
  if ((load_be16(ip + 6) & 0x3fff) != 0) {
    return fail(info, FrameKind::kMalformed, FrameError::kIpFragment);
  }
  info.dscp = static_cast<uint8_t>(ip[1] >> 2);
  info.ecn = static_cast<Ecn>(ip[1] & 3);
  info.src_ip = load_be32(ip + 12);
  info.dst_ip = load_be32(ip + 16);
  info.ip_proto = ip[9];
  if (ip[9] != kIpProtoUdp) {
    info.ip_payload = ipb.subspan(ihl, total - ihl);
    return fail(info, FrameKind::kOther, FrameError::kNotUdp);
  }

  const uint8_t* udp = ip + ihl;
  const size_t room = total - ihl;
  if (room < kUdpHeaderLen) return fail(info, FrameKind::kMalformed, FrameError::kTruncated);
  const size_t udp_len = load_be16(udp + 4);
  if (udp_len < kUdpHeaderLen || udp_len > room) {
    return fail(info, FrameKind::kMalformed, FrameError::kUdpLength);
  }
  info.src_port = load_be16(udp);
  info.dst_port = load_be16(udp + 2);
  if (info.dst_port != udp_port) return fail(info, FrameKind::kOther, FrameError::kWrongPort);
  if (load_be16(udp + 6) != 0 && udp_sum(info.src_ip, info.dst_ip, udp, udp_len) != 0xffff) {
    return fail(info, FrameKind::kMalformed, FrameError::kUdpChecksum);
  }
  info.payload = std::span<const uint8_t>(udp + kUdpHeaderLen, udp_len - kUdpHeaderLen);
  info.kind = FrameKind::kMetaRoce;
  info.error = FrameError::kNone;
}

}  // namespace

FrameInfo parse_frame(std::span<const uint8_t> f, uint16_t udp_port) {
  FrameInfo info;
  parse_into(info, f, udp_port);
  return info;
}

const char* to_string(FrameError e) {
  switch (e) {
    case FrameError::kNone: return "ok";
    case FrameError::kTruncated: return "truncated";
    case FrameError::kEtherType: return "not IPv4/ARP";
    case FrameError::kArpFormat: return "bad ARP";
    case FrameError::kIpVersion: return "bad IP version/IHL";
    case FrameError::kIpChecksum: return "bad IP checksum";
    case FrameError::kIpLength: return "bad IP length";
    case FrameError::kIpFragment: return "IP fragment";
    case FrameError::kNotUdp: return "not UDP";
    case FrameError::kUdpLength: return "bad UDP length";
    case FrameError::kUdpChecksum: return "bad UDP checksum";
    case FrameError::kWrongPort: return "not our UDP port";
    case FrameError::kCount: break;
  }
  return "?";
}

}  // namespace metaroce::wire
