// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for datapath/wire: arbitrary bytes through parse_frame() and decode(), and
// what either accepts re-encoded and re-parsed, which must give back the same fields (and, for
// every byte the encoder owns, the same bytes).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "datapath/wire/frame.h"
#include "datapath/wire/mrh.h"

namespace metaroce::wire {
namespace {

// A broken invariant: say which and abort, so that libFuzzer keeps the input as a crash.
[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "wire_fuzz: %s\n", what);
  std::abort();
}
void check(bool ok, const char* what) {
  if (!ok) fail(what);
}

bool inside(std::span<const uint8_t> part, std::span<const uint8_t> whole) {
  return part.empty() ||
         (part.data() >= whole.data() && part.data() + part.size() <= whole.data() + whole.size());
}

bool same_base(const BaseHeader& a, const BaseHeader& b) {
  return a.version == b.version && a.opcode == b.opcode && a.flags == b.flags &&
         a.conn_id == b.conn_id && a.token == b.token && a.path_id == b.path_id &&
         a.path_count == b.path_count && a.path_seq == b.path_seq &&
         a.timestamp == b.timestamp && a.ack_floor == b.ack_floor;
}

bool same_nak(const NakRecord& a, const NakRecord& b) {
  return a.path_seq == b.path_seq && a.src_stream == b.src_stream && a.msn == b.msn &&
         a.syndrome == b.syndrome && a.rnr_timer == b.rnr_timer;
}

// A packet decode() accepted: its spans lie in the input, and encoding its fields again gives
// a packet that decodes to the same fields.
void round_trip_mrh(std::span<const uint8_t> in, const Packet& p) {
  check(inside(p.payload, in) && inside(p.nak_bytes, in), "span outside the input");
  std::vector<uint8_t> out(in.size() + 64, 0xa5);
  if (is_data_opcode(p.base.opcode)) {
    const size_t hdr = encode_data(out, p.base, p.data);
    check(hdr == data_headers_len(p.base.flags), "encode_data refused a decoded packet");
    check(p.payload.size() == p.data.payload_len && hdr + p.payload.size() == in.size(),
          "data length disagrees with payload_len");
    std::memcpy(out.data() + hdr, p.payload.data(), p.payload.size());
    // Every byte of a data packet is a field: the encoding must be the input itself.
    check(std::memcmp(out.data(), in.data(), in.size()) == 0, "data re-encoding differs");
  } else if (p.base.opcode == Opcode::kProbe) {
    check(in.size() == kBaseHeaderLen, "probe of the wrong length");
    check(encode_base(out, p.base) == kBaseHeaderLen, "encode_base refused a decoded probe");
    check(std::memcmp(out.data(), in.data(), in.size()) == 0, "probe re-encoding differs");
  } else {
    check(p.base.opcode == Opcode::kAck, "decoded an unknown opcode");
    check(p.ack.nak_count <= kMaxNakRecords &&
              p.nak_bytes.size() == size_t{p.ack.nak_count} * kNakRecordLen,
          "NAK records disagree with nak_count");
    std::vector<NakRecord> naks;
    for (size_t i = 0; i < p.ack.nak_count; ++i) naks.push_back(p.nak(i));
    const size_t len = encode_ack(out, p.base, p.ack, naks);
    check(len == in.size(), "encode_ack refused or resized a decoded ACK");
    // The base and ACK extension are all fields; a NAK record's padding (and a non-RNR
    // record's timer byte) is ignored on decode and written as zero.
    check(std::memcmp(out.data(), in.data(), kAckHeadersLen) == 0, "ACK re-encoding differs");
    Packet q;
    check(decode(std::span<const uint8_t>(out.data(), len), q) == DecodeError::kNone,
          "re-encoded ACK does not decode");
    check(same_base(q.base, p.base) && q.ack.nak_count == p.ack.nak_count, "ACK fields differ");
    for (size_t i = 0; i < naks.size(); ++i) check(same_nak(q.nak(i), naks[i]), "NAK differs");
  }
}

// A frame parse_frame() took for ours or for ARP, built again from what it read: the result
// parses to the same fields.
void round_trip_frame(std::span<const uint8_t> in, const FrameInfo& f, uint16_t port) {
  std::vector<uint8_t> out(kUdpFrameHeaderLen + f.payload.size() + kArpFrameLen);
  if (f.kind == FrameKind::kArp) {
    check(f.error == FrameError::kNone, "ARP with an error");
    const size_t n = build_arp(out, f.arp);
    check(n == kArpFrameLen, "build_arp refused a parsed ARP");
    const FrameInfo g = parse_frame(std::span<const uint8_t>(out.data(), n), port);
    check(g.kind == FrameKind::kArp && g.arp.op == f.arp.op &&
              g.arp.sender_mac == f.arp.sender_mac && g.arp.sender_ip == f.arp.sender_ip &&
              g.arp.target_ip == f.arp.target_ip,
          "ARP round trip differs");
    return;
  }
  check(f.kind == FrameKind::kMetaRoce && f.error == FrameError::kNone, "kind and error differ");
  check(inside(f.payload, in), "payload outside the frame");
  UdpFrameParams params;
  params.src_mac = f.src_mac;
  params.dst_mac = f.dst_mac;
  params.src_ip = f.src_ip;
  params.dst_ip = f.dst_ip;
  params.src_port = f.src_port;
  params.dst_port = f.dst_port;
  params.dscp = f.dscp;
  params.ecn = f.ecn;
  params.udp_checksum = (in.size() & 1) != 0;  // both encodings, by the input's parity
  const size_t n = build_udp_frame(out, params, f.payload);
  check(n == kUdpFrameHeaderLen + f.payload.size(), "build_udp_frame refused a parsed frame");
  const FrameInfo g = parse_frame(std::span<const uint8_t>(out.data(), n), port);
  check(g.kind == FrameKind::kMetaRoce, "rebuilt frame not ours");
  check(g.src_mac == f.src_mac && g.dst_mac == f.dst_mac && g.src_ip == f.src_ip &&
            g.dst_ip == f.dst_ip && g.src_port == f.src_port && g.dst_port == f.dst_port &&
            g.dscp == f.dscp && g.ecn == f.ecn,
        "rebuilt frame's fields differ");
  check(g.payload.size() == f.payload.size() &&
            std::memcmp(g.payload.data(), f.payload.data(), f.payload.size()) == 0,
        "rebuilt frame's payload differs");
}

// A datagram decode_datagram() accepted (spec §8): its payload lies in the input, a
// connection's decoder refuses it, and encoding its fields again gives the input's bytes.
void round_trip_datagram(std::span<const uint8_t> in, const Datagram& d) {
  check(d.payload.data() == in.data() + kDatagramHeadersLen &&
            d.payload.size() == in.size() - kDatagramHeadersLen,
        "datagram payload span");
  Packet p;
  check(decode(in, p) == DecodeError::kBadOpcode, "a datagram decoded as a connection's packet");
  std::vector<uint8_t> out(kDatagramHeadersLen);
  check(encode_datagram(out, d, static_cast<uint32_t>(d.payload.size())) == kDatagramHeadersLen,
        "accepted datagram does not re-encode");
  check(std::memcmp(out.data(), in.data(), kDatagramHeadersLen) == 0,
        "datagram re-encodes differently");
}

// An IGMP message parse_igmp() accepted: a report and a leave of its group, built by
// build_igmp(), parse as IGMP frames of that group from the frame's addresses.
void round_trip_igmp(const FrameInfo& f, const IgmpMessage& m) {
  std::vector<uint8_t> out(kIgmpFrameLen);
  for (IgmpType t : {IgmpType::kV2Report, IgmpType::kLeave}) {
    check(build_igmp(out, f.src_mac, f.src_ip, t, m.group) == kIgmpFrameLen, "build_igmp refused");
    const FrameInfo g = parse_frame(out, kDefaultUdpPort);
    IgmpMessage n;
    check(g.error == FrameError::kNotUdp && g.ip_proto == kIpProtoIgmp &&
              parse_igmp(g.ip_payload, n) && n.type == t && n.group == m.group &&
              g.src_ip == f.src_ip && g.src_mac == f.src_mac &&
              g.dst_ip == (t == IgmpType::kLeave ? kAllRoutersGroup : m.group),
          "built IGMP does not parse back");
  }
}

void one_input(std::span<const uint8_t> in) {
  // The whole input as a UDP payload, of a connection and of a group.
  Packet p;
  const DecodeError e = decode(in, p);
  check(e < DecodeError::kCount && to_string(e)[0] != '?', "decode error out of range");
  if (e == DecodeError::kNone) round_trip_mrh(in, p);
  Datagram d;
  const DecodeError de = decode_datagram(in, d);
  check(de < DecodeError::kCount, "datagram decode error out of range");
  check(de != DecodeError::kNone || e != DecodeError::kNone, "both decoders took one packet");
  if (de == DecodeError::kNone) round_trip_datagram(in, d);

  // The whole input as an Ethernet frame; what it carries as a UDP payload.
  const FrameInfo f = parse_frame(in, kDefaultUdpPort);
  check(f.error < FrameError::kCount && to_string(f.error)[0] != '?', "frame error out of range");
  check((f.error == FrameError::kNone) ==
            (f.kind == FrameKind::kArp || f.kind == FrameKind::kMetaRoce),
        "frame kind and error disagree");
  if (f.error == FrameError::kNotUdp) {
    check(inside(f.ip_payload, in), "IP payload outside the frame");
    IgmpMessage m;
    if (f.ip_proto == kIpProtoIgmp && parse_igmp(f.ip_payload, m)) round_trip_igmp(f, m);
  }
  if (f.error != FrameError::kNone) return;
  round_trip_frame(in, f, kDefaultUdpPort);
  if (f.kind == FrameKind::kMetaRoce) {
    Packet q;
    if (decode(f.payload, q) == DecodeError::kNone) round_trip_mrh(f.payload, q);
    Datagram g;
    if (decode_datagram(f.payload, g) == DecodeError::kNone) round_trip_datagram(f.payload, g);
  }
}

}  // namespace
}  // namespace metaroce::wire

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  metaroce::wire::one_input({data, size});
  return 0;
}
