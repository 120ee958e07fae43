// SPDX-License-Identifier: Apache-2.0
// Ethernet / IPv4 / UDP / ARP encode and decode with explicit big-endian accessors.
#include "datapath/nic/framing.h"

#include <cstring>

namespace metaroce::nic {
namespace {

constexpr uint16_t kEtherIpv4 = 0x0800;
constexpr uint16_t kEtherArp = 0x0806;
constexpr uint8_t kIpProtoUdp = 17;
constexpr uint8_t kEcnMask = 0x3;
constexpr uint8_t kEcnCe = 0x3;
constexpr uint8_t kEcnEct0 = 0x2;

void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}
void put32(uint8_t* p, uint32_t v) {
  put16(p, static_cast<uint16_t>(v >> 16));
  put16(p + 2, static_cast<uint16_t>(v));
}
uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>((p[0] << 8) | p[1]); }
uint32_t get32(const uint8_t* p) { return (uint32_t{get16(p)} << 16) | get16(p + 2); }

uint16_t ip_checksum(const uint8_t* h, size_t len) {
  uint32_t sum = 0;
  for (size_t i = 0; i + 1 < len; i += 2) sum += get16(h + i);
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  return static_cast<uint16_t>(~sum);
}

void put_mac(uint8_t* p, const io::MacAddr& m) { std::memcpy(p, m.data(), 6); }
io::MacAddr get_mac(const uint8_t* p) {
  io::MacAddr m;
  std::memcpy(m.data(), p, 6);
  return m;
}

}  // namespace

void write_udp_headers(uint8_t* f, const FrameAddr& a, uint32_t payload_len) {
  put_mac(f, a.dst_mac);
  put_mac(f + 6, a.src_mac);
  put16(f + 12, kEtherIpv4);
  uint8_t* ip = f + 14;
  ip[0] = 0x45;                // version 4, 5 words
  ip[1] = kEcnEct0;            // DSCP 0, ECN-capable transport: the fabric may mark CE
  put16(ip + 2, static_cast<uint16_t>(20 + 8 + payload_len));
  put16(ip + 4, 0);            // identification: unused with DF
  put16(ip + 6, 0x4000);       // DF
  ip[8] = 64;
  ip[9] = kIpProtoUdp;
  put16(ip + 10, 0);
  put32(ip + 12, a.src_ip);
  put32(ip + 16, a.dst_ip);
  put16(ip + 10, ip_checksum(ip, 20));
  uint8_t* udp = ip + 20;
  put16(udp, a.src_port);
  put16(udp + 2, a.dst_port);
  put16(udp + 4, static_cast<uint16_t>(8 + payload_len));
  put16(udp + 6, 0);
}

uint32_t write_arp(uint8_t* f, bool reply, const io::MacAddr& our_mac, uint32_t our_ip,
                   const io::MacAddr& target_mac, uint32_t target_ip) {
  std::memset(f, 0, kArpFrameLen);
  put_mac(f, reply ? target_mac : kBroadcastMac);
  put_mac(f + 6, our_mac);
  put16(f + 12, kEtherArp);
  uint8_t* a = f + 14;
  put16(a, 1);                 // hardware: Ethernet
  put16(a + 2, kEtherIpv4);
  a[4] = 6;
  a[5] = 4;
  put16(a + 6, reply ? 2 : 1);
  put_mac(a + 8, our_mac);
  put32(a + 14, our_ip);
  put_mac(a + 18, reply ? target_mac : io::MacAddr{});
  put32(a + 24, target_ip);
  return kArpFrameLen;
}

FrameKind parse_frame(std::span<const uint8_t> frame, const io::MacAddr& our_mac, uint32_t our_ip,
                      uint16_t udp_port, ParsedFrame* out) {
  if (frame.size() < 14) return FrameKind::kMalformed;
  const uint8_t* f = frame.data();
  const io::MacAddr dst = get_mac(f);
  if (dst != our_mac && dst != kBroadcastMac) return FrameKind::kNotOurs;
  out->src_mac = get_mac(f + 6);
  const uint16_t type = get16(f + 12);
  if (type == kEtherArp) {
    if (frame.size() < 14 + 28) return FrameKind::kMalformed;
    const uint8_t* a = f + 14;
    if (get16(a) != 1 || get16(a + 2) != kEtherIpv4 || a[4] != 6 || a[5] != 4)
      return FrameKind::kMalformed;
    if (get32(a + 24) != our_ip) return FrameKind::kNotOurs;
    out->src_mac = get_mac(a + 8);
    out->src_ip = get32(a + 14);
    const uint16_t op = get16(a + 6);
    if (op == 1) return FrameKind::kArpRequest;
    if (op == 2) return FrameKind::kArpReply;
    return FrameKind::kMalformed;
  }
  if (type != kEtherIpv4) return FrameKind::kNotOurs;
  if (frame.size() < kL2L4Header) return FrameKind::kMalformed;
  const uint8_t* ip = f + 14;
  const uint32_t ihl = (ip[0] & 0xf) * 4u;
  if ((ip[0] >> 4) != 4 || ihl < 20) return FrameKind::kMalformed;
  const uint32_t total = get16(ip + 2);
  if (total < ihl + 8 || 14 + total > frame.size()) return FrameKind::kMalformed;
  if (ip_checksum(ip, ihl) != 0) return FrameKind::kMalformed;
  if (get32(ip + 16) != our_ip) return FrameKind::kNotOurs;
  if (ip[9] != kIpProtoUdp) return FrameKind::kNotOurs;
  if ((get16(ip + 6) & 0x3fff) != 0) return FrameKind::kNotOurs;  // fragments: never ours
  const uint8_t* udp = ip + ihl;
  if (get16(udp + 2) != udp_port) return FrameKind::kNotOurs;
  const uint32_t udp_len = get16(udp + 4);
  if (udp_len < 8 || udp_len > total - ihl) return FrameKind::kMalformed;
  out->src_ip = get32(ip + 12);
  out->src_port = get16(udp);
  out->ecn_ce = (ip[1] & kEcnMask) == kEcnCe;
  out->payload = frame.subspan(14 + ihl + 8, udp_len - 8);
  return FrameKind::kTransport;
}

}  // namespace metaroce::nic
