// SPDX-License-Identifier: Apache-2.0
// Ethernet / IPv4 / UDP / ARP framing around transport packets (spec §2): what the NIC puts in
// front of the MetaRoCE headers and checks on the way in.
#pragma once

#include <cstdint>
#include <span>

#include "datapath/io/port.h"

namespace metaroce::nic {

inline constexpr uint32_t kL2L4Header = 14 + 20 + 8;     // Ethernet II + IPv4 (no options) + UDP
inline constexpr uint32_t kTransportHeaderRoom = 128;    // MetaRoCE headers, ACK/NAK included
inline constexpr uint32_t kFrameOverhead = 20 + 8 + kTransportHeaderRoom;  // of the link MTU
inline constexpr uint32_t kArpFrameLen = 60;             // 42 B padded to the Ethernet minimum
inline constexpr io::MacAddr kBroadcastMac = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

struct FrameAddr {
  io::MacAddr src_mac{}, dst_mac{};
  uint32_t src_ip = 0, dst_ip = 0;  // host byte order
  uint16_t src_port = 0, dst_port = 0;
};

// Writes Ethernet, IPv4 (ECN ECT(0), DF, TTL 64, checksum) and UDP headers (checksum 0, as
// RFC 768 allows over IPv4) into the first kL2L4Header bytes of frame, for a UDP payload of
// payload_len bytes that follows them.
void write_udp_headers(uint8_t* frame, const FrameAddr& a, uint32_t payload_len);

// Writes an ARP request (to broadcast) or reply into frame; returns the frame length.
uint32_t write_arp(uint8_t* frame, bool reply, const io::MacAddr& our_mac, uint32_t our_ip,
                   const io::MacAddr& target_mac, uint32_t target_ip);

enum class FrameKind : uint8_t { kTransport, kArpRequest, kArpReply, kNotOurs, kMalformed };

struct ParsedFrame {
  io::MacAddr src_mac{};
  uint32_t src_ip = 0;
  uint16_t src_port = 0;
  bool ecn_ce = false;
  std::span<const uint8_t> payload;  // the UDP payload
};

// Classifies a received frame. kTransport: IPv4/UDP to our IP and UDP port, headers valid;
// kArpRequest: someone asks for our IP; kArpReply: an answer addressed to us; kNotOurs: valid
// but for someone else (other IP, port, protocol); kMalformed: truncated or inconsistent.
FrameKind parse_frame(std::span<const uint8_t> frame, const io::MacAddr& our_mac, uint32_t our_ip,
                      uint16_t udp_port, ParsedFrame* out);

}  // namespace metaroce::nic
