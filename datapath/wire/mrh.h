// SPDX-License-Identifier: Apache-2.0
// The MetaRoCE header (MRH) that follows UDP: base header, data and ACK extensions, NAK records,
// their encoding and the validation of every field on decode (docs/spec/wire.md §2-§4).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace metaroce::wire {

inline constexpr uint8_t kMrhVersion = 1;
inline constexpr uint16_t kDefaultUdpPort = 4793;  // spec §1; configurable per link

inline constexpr size_t kBaseHeaderLen = 32;
inline constexpr size_t kDataExtLen = 48;
inline constexpr size_t kAckExtLen = 48;
inline constexpr size_t kNakRecordLen = 16;
inline constexpr size_t kDataHeadersLen = kBaseHeaderLen + kDataExtLen;
inline constexpr size_t kAckHeadersLen = kBaseHeaderLen + kAckExtLen;
inline constexpr uint16_t kMaxPathCount = 256;
inline constexpr uint16_t kMaxNakRecords = 16;  // per ACK; more is malformed
inline constexpr uint32_t kSackBits = 256;

// Base header flags (spec §2.1). A failover copy is a packet first sent on another path that was
// declared failed; bits 0..7 then name that path and DataHeader::orig_seq its sequence there, so
// the receiver can tell whether the original already arrived (spec §3.4).
inline constexpr uint16_t kFlagFailoverCopy = 0x8000;
inline constexpr uint16_t kFlagOrigPathMask = 0x00ff;
inline constexpr bool is_failover_copy(uint16_t flags) { return flags & kFlagFailoverCopy; }
inline constexpr uint16_t orig_path_of(uint16_t flags) { return flags & kFlagOrigPathMask; }
inline constexpr uint16_t failover_flags(uint16_t orig_path) {
  return static_cast<uint16_t>(kFlagFailoverCopy | (orig_path & kFlagOrigPathMask));
}
static_assert(kFlagOrigPathMask + 1 >= 256, "any path id must fit the original-path bits");
// With kFlagFailoverCopy: a redundant copy, sent while its original stays in flight on the
// original path (congestion.md §5.2). A receiver that delivers it, or already had the original,
// also acknowledges the original path, so the sender learns there what the copy achieved.
// Without kFlagFailoverCopy it means nothing and is ignored.
inline constexpr uint16_t kFlagRedundant = 0x4000;
// Data: when it left, its sender had more for this receiver waiting (new data or resends): it is
// held back by its share or by the network, not by its application (congestion.md §3.2).
inline constexpr uint16_t kFlagMore = 0x2000;
// ACK: its echo_timestamp dates no packet of its path (it was sent because a redundant copy
// elsewhere delivered or found this path's packet, or to push a share): no RTT sample, and no
// proof that the path answers (congestion.md §4.4, §5.2).
inline constexpr uint16_t kFlagNoEcho = 0x1000;
// Data requests (not READ_RESP): a 4-byte XRC extension follows the data extension, naming the
// receiver's XRC shared receive queue (spec §2.2.1); the payload starts after it. A bit of its
// own (bit 12, kFlagNoEcho, is an ACK's): no bit means two things by packet kind.
inline constexpr uint16_t kFlagXrc = 0x0800;
inline constexpr size_t kXrcExtLen = 4;
inline constexpr uint32_t kXrcSrqnMask = 0x00ffffff;  // 24 bits; the top byte is reserved (0)
// Where a data packet's payload starts.
inline constexpr size_t data_headers_len(uint16_t flags) {
  return kDataHeadersLen + ((flags & kFlagXrc) ? kXrcExtLen : 0);
}
inline constexpr bool is_redundant_copy(uint16_t flags) {
  return (flags & (kFlagFailoverCopy | kFlagRedundant)) == (kFlagFailoverCopy | kFlagRedundant);
}

enum class Opcode : uint8_t {
  kWrite = 1,
  kWriteImm = 2,
  kSend = 3,
  kSendImm = 4,
  kReadReq = 5,
  kReadResp = 6,
  kAtomicCmpSwp = 7,    // 16-byte payload: compare, swap (big-endian); answered by a READ_RESP
  kAtomicFetchAdd = 8,  // 16-byte payload: add, 0 (big-endian); answered by a READ_RESP
  kSendInv = 9,         // SEND with invalidate: rkey names what the receiver invalidates
  // Multicast datagrams (spec §8): outside every connection, to an IPv4 group address; decoded
  // by decode_datagram, never by decode (the transport drops them as unknown opcodes).
  kDatagram = 10,
  kDatagramImm = 11,
  kAtomicWrite = 12,  // 8-byte payload stored whole at an aligned target once every earlier
                      // message of the stream is in place (spec §2.2); acknowledged as a WRITE
  kAck = 16,
  kProbe = 17,
};

inline constexpr bool is_data_opcode(Opcode op) {
  return (static_cast<uint8_t>(op) >= 1 && static_cast<uint8_t>(op) <= 9) ||
         op == Opcode::kAtomicWrite;
}
inline constexpr bool is_atomic_opcode(Opcode op) {
  return op == Opcode::kAtomicCmpSwp || op == Opcode::kAtomicFetchAdd;
}
inline constexpr uint32_t kAtomicRequestLen = 16;  // an atomic's operands (spec §2.2)
inline constexpr uint32_t kAtomicWriteLen = 8;     // an ATOMIC_WRITE's value (spec §2.2)

// Why decode() refused a packet; the engine counts each separately.
enum class DecodeError : uint8_t {
  kNone = 0,
  kTruncated,       // shorter than the headers its opcode needs
  kBadVersion,      // version != kMrhVersion
  kBadOpcode,       // opcode not in Opcode
  kLengthMismatch,  // bytes after the headers disagree with payload_len / nak_count
  kBadField,        // a field outside its stated range (spec tables)
  kCount,
};

// Base header, 32 bytes, present in every packet (spec §2.1).
struct BaseHeader {
  uint8_t version = kMrhVersion;
  Opcode opcode = Opcode::kWrite;
  uint16_t flags = 0;        // kFlagFailoverCopy | original path (data only); other bits 0/ignored
  uint32_t conn_id = 0;      // data direction id chosen by its sender, never 0
  uint64_t token = 0;        // per-direction random secret; must match the direction's
  uint16_t path_id = 0;      // < path_count
  uint16_t path_count = 1;   // paths of this direction, 1..256
  uint32_t path_seq = 0;     // data: sequence on path_id; probe: sender's next seq; ACK: 0
  uint32_t timestamp = 0;    // sender clock, ns, low 32 bits
  uint32_t ack_floor = 0;    // every seq below it is resolved at the sender (spec §3.1)
};

// Data extension, 48 bytes, for opcodes 1..9 (spec §2.2).
struct DataHeader {
  uint32_t dst_stream = 0;
  uint32_t src_stream = 0;
  uint32_t msn = 0;
  uint32_t rsn = 0;
  uint32_t offset = 0;        // of this payload in the message
  uint32_t total_length = 0;  // message bytes (READ_REQ: bytes requested)
  uint64_t remote_addr = 0;   // message base address (WRITE*, READ_REQ, READ_RESP)
  uint32_t rkey = 0;
  uint32_t imm = 0;           // verbs' __be32, its bytes put on the wire as they lie (§2.2)
  uint32_t payload_len = 0;   // bytes after the headers
  uint32_t orig_seq = 0;      // failover copy: its sequence on the original path; else 0
  uint32_t xrc_srqn = 0;      // with kFlagXrc: the receiver's XRC SRQ (extension, §2.2.1)
};

// One NAK record inside an ACK, 16 bytes (spec §2.4).
struct NakRecord {
  uint32_t path_seq = 0;
  uint32_t src_stream = 0;  // the data sender's stream, as it was in the rejected packet
  uint32_t msn = 0;
  uint8_t syndrome = 0;     // transport::Syndrome 1 (RNR: not received, retry later) .. 7
  uint8_t rnr_timer = 0;    // RNR: kRnrTimerValid | the responder's minimum RNR timer (verbs'
                            // 5-bit code); 0: none named, the sender's own back-off. Else 0
};

// NakRecord::rnr_timer (spec §2.4): the responder's QP names how long the sender waits.
inline constexpr uint8_t kRnrTimerValid = 0x80;
inline constexpr uint8_t kRnrTimerCodeMask = 0x1f;

// ACK extension, 48 bytes, followed by nak_count NAK records (spec §2.3).
struct AckHeader {
  uint32_t cum_seq = 0;                // every seq below it was received; cum_seq itself was not
  std::array<uint64_t, 4> sack{};      // bit i (word i/64, bit i%64): cum_seq + 1 + i received
  uint32_t echo_timestamp = 0;         // timestamp of the newest packet received on the path
  uint16_t ecn_ce_count = 0;           // CE-marked packets since the previous ACK (saturating)
  uint16_t nak_count = 0;              // <= kMaxNakRecords
  uint32_t rate_hint = 0;              // Mbit/s the receiver grants, 0 = no hint
};

// A decoded packet. Spans point into the buffer handed to decode().
struct Packet {
  BaseHeader base;
  DataHeader data;                     // valid for data opcodes
  AckHeader ack;                       // valid for kAck
  std::span<const uint8_t> payload;    // data opcodes: payload_len bytes (after the extensions)
  std::span<const uint8_t> nak_bytes;  // kAck: nak_count * kNakRecordLen bytes

  NakRecord nak(size_t i) const;       // i < ack.nak_count
};

// Writers return the bytes written, or 0 when out is too small or a field is out of range.
size_t encode_base(std::span<uint8_t> out, const BaseHeader& base);
// Writes base + data extension (+ the XRC extension when base.flags has kFlagXrc); the
// payload_len bytes of payload go right after, at data_headers_len(base.flags) (caller).
size_t encode_data(std::span<uint8_t> out, const BaseHeader& base, const DataHeader& data);
size_t encode_ack(std::span<uint8_t> out, const BaseHeader& base, const AckHeader& ack,
                  std::span<const NakRecord> naks);

// Parses and validates every field of one UDP payload.
DecodeError decode(std::span<const uint8_t> in, Packet& out);

// --- multicast datagrams (spec §8) ---------------------------------------------------------
// A UD SEND to a multicast group: the base header and data extension of a data packet with
// every connection field zero, sent once to the group's address, never acknowledged or
// retransmitted. 80 bytes of headers, then the payload.
inline constexpr uint32_t kMulticastQpn = 0xffffff;  // the destination QP of every datagram
inline constexpr uint32_t kQpnMask = 0xffffff;
struct Datagram {
  bool with_imm = false;  // kDatagramImm
  uint32_t src_qpn = 0;   // the sender's QP (24 bits)
  uint32_t msn = 0;       // the sender QP's count of datagrams it sent to groups
  uint32_t qkey = 0;
  uint32_t imm = 0;       // verbs' __be32, as DataHeader::imm; 0 without with_imm
  uint32_t timestamp = 0;
  std::span<const uint8_t> payload;  // decode: after the headers
};
inline constexpr size_t kDatagramHeadersLen = kDataHeadersLen;
// Writes the 80 bytes of headers for a payload of payload_len bytes; 0 when out is too small.
size_t encode_datagram(std::span<uint8_t> out, const Datagram& d, uint32_t payload_len);
// Parses and validates one UDP payload sent to a group address.
DecodeError decode_datagram(std::span<const uint8_t> in, Datagram& out);
// IPv4 multicast (224.0.0.0/4), host order.
inline constexpr bool is_multicast_ipv4(uint32_t ip) { return (ip >> 28) == 0xe; }

const char* to_string(DecodeError e);

}  // namespace metaroce::wire
