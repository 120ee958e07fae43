// SPDX-License-Identifier: Apache-2.0
// Encoding and validating decoding of the MetaRoCE header (docs/spec/wire.md §2-§4).
#include "datapath/wire/mrh.h"

#include <cstring>

#include "datapath/wire/bytes.h"

namespace metaroce::wire {
namespace {

// Field offsets, from the start of each part (spec §2 tables).
namespace base_off {
inline constexpr size_t kVersion = 0, kOpcode = 1, kFlags = 2, kConnId = 4, kToken = 8,
                        kPathId = 16, kPathCount = 18, kPathSeq = 20, kTimestamp = 24,
                        kAckFloor = 28, kEnd = 32;
}
namespace data_off {
inline constexpr size_t kDstStream = 0, kSrcStream = 4, kMsn = 8, kRsn = 12, kOffset = 16,
                        kTotalLength = 20, kRemoteAddr = 24, kRkey = 32, kImm = 36,
                        kPayloadLen = 40, kOrigSeq = 44, kEnd = 48;
}
namespace ack_off {
inline constexpr size_t kCumSeq = 0, kSack = 4, kEchoTimestamp = 36, kEcnCe = 40,
                        kNakCount = 42, kRateHint = 44, kEnd = 48;
}
namespace nak_off {
inline constexpr size_t kPathSeq = 0, kSrcStream = 4, kMsn = 8, kSyndrome = 12, kRnrTimer = 13,
                        kEnd = 16;
}
static_assert(base_off::kEnd == kBaseHeaderLen);
static_assert(data_off::kEnd == kDataExtLen);
static_assert(ack_off::kEnd == kAckExtLen);
static_assert(nak_off::kEnd == kNakRecordLen);
static_assert(ack_off::kEchoTimestamp - ack_off::kSack == kSackBits / 8);
static_assert(kAckHeadersLen + kMaxNakRecords * kNakRecordLen <= 512,
              "an ACK must fit any sane packet buffer");

// NAK syndromes a receiver may send: transport::Syndrome kRnr..kRemoteOp, and kUnreachable (7,
// no such stream). 6 (kRetryExceeded) is a sender-local outcome and never travels.
constexpr uint8_t kMinNakSyndrome = 1, kMaxNakSyndrome = 7, kLocalOnlySyndrome = 6;

bool known_opcode(uint8_t op) {
  return (op >= 1 && op <= 9) || op == static_cast<uint8_t>(Opcode::kAtomicWrite) ||
         op == static_cast<uint8_t>(Opcode::kAck) ||
         op == static_cast<uint8_t>(Opcode::kProbe);
}

bool base_fields_ok(const BaseHeader& b) {
  if (b.conn_id == 0 || b.path_count < 1 || b.path_count > kMaxPathCount ||
      b.path_id >= b.path_count)
    return false;
  // An XRC SRQ is named by requests only: a READ answer goes to the requester's own QP.
  if ((b.flags & kFlagXrc) && b.opcode == Opcode::kReadResp) return false;
  // Only data can be a failover copy, and only of another existing path of the direction.
  if (is_failover_copy(b.flags)) {
    return is_data_opcode(b.opcode) && orig_path_of(b.flags) < b.path_count;
  }
  return true;
}

// The floor may not lie above the sequence the packet carries (wrap-aware). How far below it
// may lie is the receiver's business: a sequence beyond its window is dropped there.
bool floor_ok(const BaseHeader& b) {
  return static_cast<int32_t>(b.path_seq - b.ack_floor) >= 0;
}

bool data_fields_ok(Opcode op, const DataHeader& d) {
  if (uint64_t{d.offset} + d.payload_len > d.total_length) return false;
  if (op == Opcode::kReadReq && (d.payload_len != 0 || d.offset != 0)) return false;
  // An atomic is one packet: its two operands, at offset 0.
  if (is_atomic_opcode(op) && (d.total_length != kAtomicRequestLen ||
                               d.payload_len != kAtomicRequestLen || d.offset != 0))
    return false;
  if (op == Opcode::kAtomicWrite && (d.total_length != kAtomicWriteLen ||
                                     d.payload_len != kAtomicWriteLen || d.offset != 0))
    return false;
  // Only what consumes a receive names one (an RDMA WRITE, READ or atomic with an rsn is
  // malformed, not a write to perform).
  if (d.rsn != 0 && op != Opcode::kSend && op != Opcode::kSendImm && op != Opcode::kWriteImm &&
      op != Opcode::kSendInv)
    return false;
  // An address range that wraps the 64-bit space cannot name memory.
  if (d.remote_addr + uint64_t{d.total_length} < d.remote_addr) return false;
  return true;
}

void load_base(const uint8_t* p, BaseHeader& b) {
  b.version = p[base_off::kVersion];
  b.opcode = static_cast<Opcode>(p[base_off::kOpcode]);
  b.flags = load_be16(p + base_off::kFlags);
  b.conn_id = load_be32(p + base_off::kConnId);
  b.token = load_be64(p + base_off::kToken);
  b.path_id = load_be16(p + base_off::kPathId);
  b.path_count = load_be16(p + base_off::kPathCount);
  b.path_seq = load_be32(p + base_off::kPathSeq);
  b.timestamp = load_be32(p + base_off::kTimestamp);
  b.ack_floor = load_be32(p + base_off::kAckFloor);
}

// The data extension's 48 bytes at p (not the XRC extension).
void load_data_ext(const uint8_t* q, DataHeader& d) {
  d.dst_stream = load_be32(q + data_off::kDstStream);
  d.src_stream = load_be32(q + data_off::kSrcStream);
  d.msn = load_be32(q + data_off::kMsn);
  d.rsn = load_be32(q + data_off::kRsn);
  d.offset = load_be32(q + data_off::kOffset);
  d.total_length = load_be32(q + data_off::kTotalLength);
  d.remote_addr = load_be64(q + data_off::kRemoteAddr);
  d.rkey = load_be32(q + data_off::kRkey);
  std::memcpy(&d.imm, q + data_off::kImm, sizeof(d.imm));  // opaque: verbs' bytes as they are
  d.payload_len = load_be32(q + data_off::kPayloadLen);
  d.orig_seq = load_be32(q + data_off::kOrigSeq);
}

void store_data_ext(uint8_t* p, const DataHeader& d) {
  store_be32(p + data_off::kDstStream, d.dst_stream);
  store_be32(p + data_off::kSrcStream, d.src_stream);
  store_be32(p + data_off::kMsn, d.msn);
  store_be32(p + data_off::kRsn, d.rsn);
  store_be32(p + data_off::kOffset, d.offset);
  store_be32(p + data_off::kTotalLength, d.total_length);
  store_be64(p + data_off::kRemoteAddr, d.remote_addr);
  store_be32(p + data_off::kRkey, d.rkey);
  std::memcpy(p + data_off::kImm, &d.imm, sizeof(d.imm));
  store_be32(p + data_off::kPayloadLen, d.payload_len);
  store_be32(p + data_off::kOrigSeq, d.orig_seq);
}

}  // namespace

NakRecord Packet::nak(size_t i) const {
  const uint8_t* p = nak_bytes.data() + i * kNakRecordLen;
  NakRecord r;
  r.path_seq = load_be32(p + nak_off::kPathSeq);
  r.src_stream = load_be32(p + nak_off::kSrcStream);
  r.msn = load_be32(p + nak_off::kMsn);
  r.syndrome = p[nak_off::kSyndrome];
  // Only an RNR record names a timer; a sender ignores the byte in any other.
  r.rnr_timer = r.syndrome == 1 ? p[nak_off::kRnrTimer] : 0;
  return r;
}

size_t encode_base(std::span<uint8_t> out, const BaseHeader& b) {
  if (out.size() < kBaseHeaderLen) return 0;
  uint8_t* p = out.data();
  p[base_off::kVersion] = b.version;
  p[base_off::kOpcode] = static_cast<uint8_t>(b.opcode);
  store_be16(p + base_off::kFlags, b.flags);
  store_be32(p + base_off::kConnId, b.conn_id);
  store_be64(p + base_off::kToken, b.token);
  store_be16(p + base_off::kPathId, b.path_id);
  store_be16(p + base_off::kPathCount, b.path_count);
  store_be32(p + base_off::kPathSeq, b.path_seq);
  store_be32(p + base_off::kTimestamp, b.timestamp);
  store_be32(p + base_off::kAckFloor, b.ack_floor);
  return kBaseHeaderLen;
}

size_t encode_data(std::span<uint8_t> out, const BaseHeader& b, const DataHeader& d) {
  const size_t len = data_headers_len(b.flags);
  if (out.size() < len || !is_data_opcode(b.opcode)) return 0;
  if ((b.flags & kFlagXrc) && (b.opcode == Opcode::kReadResp || (d.xrc_srqn & ~kXrcSrqnMask)))
    return 0;
  encode_base(out, b);
  uint8_t* p = out.data() + kBaseHeaderLen;
  store_data_ext(p, d);
  if (b.flags & kFlagXrc) store_be32(p + kDataExtLen, d.xrc_srqn);
  return len;
}

size_t encode_ack(std::span<uint8_t> out, const BaseHeader& b, const AckHeader& a,
                  std::span<const NakRecord> naks) {
  if (naks.size() > kMaxNakRecords || b.opcode != Opcode::kAck) return 0;
  const size_t len = kAckHeadersLen + naks.size() * kNakRecordLen;
  if (out.size() < len) return 0;
  encode_base(out, b);
  uint8_t* p = out.data() + kBaseHeaderLen;
  store_be32(p + ack_off::kCumSeq, a.cum_seq);
  for (size_t w = 0; w < a.sack.size(); ++w) store_be64(p + ack_off::kSack + 8 * w, a.sack[w]);
  store_be32(p + ack_off::kEchoTimestamp, a.echo_timestamp);
  store_be16(p + ack_off::kEcnCe, a.ecn_ce_count);
  store_be16(p + ack_off::kNakCount, static_cast<uint16_t>(naks.size()));
  store_be32(p + ack_off::kRateHint, a.rate_hint);
  p += kAckExtLen;
  for (const NakRecord& r : naks) {
    store_be32(p + nak_off::kPathSeq, r.path_seq);
    store_be32(p + nak_off::kSrcStream, r.src_stream);
    store_be32(p + nak_off::kMsn, r.msn);
    p[nak_off::kSyndrome] = r.syndrome;
    p[nak_off::kRnrTimer] = r.syndrome == 1 ? r.rnr_timer : 0;
    p[nak_off::kRnrTimer + 1] = p[nak_off::kRnrTimer + 2] = 0;
    p += kNakRecordLen;
  }
  return len;
}

DecodeError decode(std::span<const uint8_t> in, Packet& out) {
  if (in.size() < kBaseHeaderLen) return DecodeError::kTruncated;
  const uint8_t* p = in.data();
  BaseHeader& b = out.base;
  load_base(p, b);
  if (b.version != kMrhVersion) return DecodeError::kBadVersion;
  if (!known_opcode(p[base_off::kOpcode])) return DecodeError::kBadOpcode;
  if (!base_fields_ok(b)) return DecodeError::kBadField;
  out.payload = {};
  out.nak_bytes = {};

  if (is_data_opcode(b.opcode)) {
    if (in.size() < kDataHeadersLen) return DecodeError::kTruncated;
    const uint8_t* q = p + kBaseHeaderLen;
    DataHeader& d = out.data;
    load_data_ext(q, d);
    const size_t headers = data_headers_len(b.flags);
    d.xrc_srqn = 0;
    if (headers > kDataHeadersLen) {
      if (in.size() < headers) return DecodeError::kTruncated;
      d.xrc_srqn = load_be32(q + kDataExtLen);
      if (d.xrc_srqn & ~kXrcSrqnMask) return DecodeError::kBadField;
    }
    if (d.payload_len != in.size() - headers) return DecodeError::kLengthMismatch;
    if (!floor_ok(b) || !data_fields_ok(b.opcode, d)) return DecodeError::kBadField;
    out.payload = in.subspan(headers);
    return DecodeError::kNone;
  }

  if (b.opcode == Opcode::kProbe) {
    if (in.size() != kBaseHeaderLen) return DecodeError::kLengthMismatch;
    if (!floor_ok(b)) return DecodeError::kBadField;
    return DecodeError::kNone;
  }

  // kAck
  if (in.size() < kAckHeadersLen) return DecodeError::kTruncated;
  const uint8_t* q = p + kBaseHeaderLen;
  AckHeader& a = out.ack;
  a.cum_seq = load_be32(q + ack_off::kCumSeq);
  for (size_t w = 0; w < a.sack.size(); ++w) a.sack[w] = load_be64(q + ack_off::kSack + 8 * w);
  a.echo_timestamp = load_be32(q + ack_off::kEchoTimestamp);
  a.ecn_ce_count = load_be16(q + ack_off::kEcnCe);
  a.nak_count = load_be16(q + ack_off::kNakCount);
  a.rate_hint = load_be32(q + ack_off::kRateHint);
  if (a.nak_count > kMaxNakRecords) return DecodeError::kBadField;
  const size_t want = kAckHeadersLen + size_t{a.nak_count} * kNakRecordLen;
  if (in.size() < want) return DecodeError::kTruncated;
  if (in.size() > want) return DecodeError::kLengthMismatch;
  out.nak_bytes = in.subspan(kAckHeadersLen);
  for (size_t i = 0; i < a.nak_count; ++i) {
    const uint8_t s = out.nak_bytes[i * kNakRecordLen + nak_off::kSyndrome];
    if (s < kMinNakSyndrome || s > kMaxNakSyndrome || s == kLocalOnlySyndrome)
      return DecodeError::kBadField;
    // An RNR timer is absent (0) or valid with a 5-bit code; other bits set: not a timer.
    const uint8_t t = out.nak_bytes[i * kNakRecordLen + nak_off::kRnrTimer];
    if (s == 1 && t != 0 && (t & ~(kRnrTimerValid | kRnrTimerCodeMask)))
      return DecodeError::kBadField;
  }
  return DecodeError::kNone;
}

size_t encode_datagram(std::span<uint8_t> out, const Datagram& d, uint32_t payload_len) {
  if (out.size() < kDatagramHeadersLen || (d.src_qpn & ~kQpnMask)) return 0;
  BaseHeader b;
  b.opcode = d.with_imm ? Opcode::kDatagramImm : Opcode::kDatagram;
  b.timestamp = d.timestamp;
  encode_base(out, b);  // conn_id, token, path and sequence fields stay 0; path_count 1
  DataHeader x;         // rsn, offset, remote_addr, orig_seq stay 0
  x.dst_stream = kMulticastQpn;
  x.src_stream = d.src_qpn;
  x.msn = d.msn;
  x.total_length = x.payload_len = payload_len;
  x.rkey = d.qkey;
  x.imm = d.with_imm ? d.imm : 0;
  store_data_ext(out.data() + kBaseHeaderLen, x);
  return kDatagramHeadersLen;
}

DecodeError decode_datagram(std::span<const uint8_t> in, Datagram& out) {
  if (in.size() < kDatagramHeadersLen) return DecodeError::kTruncated;
  BaseHeader b;
  load_base(in.data(), b);
  if (b.version != kMrhVersion) return DecodeError::kBadVersion;
  if (b.opcode != Opcode::kDatagram && b.opcode != Opcode::kDatagramImm)
    return DecodeError::kBadOpcode;
  DataHeader x;
  load_data_ext(in.data() + kBaseHeaderLen, x);
  if (x.payload_len != in.size() - kDatagramHeadersLen) return DecodeError::kLengthMismatch;
  out.with_imm = b.opcode == Opcode::kDatagramImm;
  // Every field a connection gives meaning to is zero (path_count 1); the rest as spec §8.
  const bool base_ok = b.flags == 0 && b.conn_id == 0 && b.token == 0 && b.path_id == 0 &&
                       b.path_count == 1 && b.path_seq == 0 && b.ack_floor == 0;
  const bool data_ok = x.dst_stream == kMulticastQpn && (x.src_stream & ~kQpnMask) == 0 &&
                       x.rsn == 0 && x.offset == 0 && x.total_length == x.payload_len &&
                       x.remote_addr == 0 && x.orig_seq == 0 && (out.with_imm || x.imm == 0);
  if (!base_ok || !data_ok) return DecodeError::kBadField;
  out.src_qpn = x.src_stream;
  out.msn = x.msn;
  out.qkey = x.rkey;
  out.imm = x.imm;
  out.timestamp = b.timestamp;
  out.payload = in.subspan(kDatagramHeadersLen);
  return DecodeError::kNone;
}

const char* to_string(DecodeError e) {
  switch (e) {
    case DecodeError::kNone: return "ok";
    case DecodeError::kTruncated: return "truncated";
    case DecodeError::kBadVersion: return "bad version";
    case DecodeError::kBadOpcode: return "bad opcode";
    case DecodeError::kLengthMismatch: return "length mismatch";
    case DecodeError::kBadField: return "field out of range";
    case DecodeError::kCount: break;
  }
  return "?";
}

}  // namespace metaroce::wire
