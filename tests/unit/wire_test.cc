// SPDX-License-Identifier: Apache-2.0
// Unit tests of datapath/wire: every header round-trips, every malformed input is refused with
// its own reason, checksums are right.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "datapath/wire/bytes.h"
#include "datapath/wire/frame.h"
#include "datapath/wire/mrh.h"

namespace metaroce::wire {
namespace {

BaseHeader sample_base(Opcode op) {
  BaseHeader b;
  b.opcode = op;
  b.flags = 0x0102;
  b.conn_id = 0xdeadbeef;
  b.token = 0x0123456789abcdefull;
  b.path_id = 5;
  b.path_count = 8;
  b.path_seq = 1000;
  b.timestamp = 0xfeedface;
  b.ack_floor = 990;
  return b;
}

DataHeader sample_data(uint32_t payload_len) {
  DataHeader d;
  d.dst_stream = 11;
  d.src_stream = 22;
  d.msn = 33;
  d.rsn = 44;
  d.offset = 4096;
  d.total_length = 4096 + payload_len + 7;
  d.remote_addr = 0x00007fff12345000ull;
  d.rkey = 0xabcd;
  d.imm = 0x11223344;
  d.payload_len = payload_len;
  return d;
}

// A message of one packet: len bytes at offset 0, naming no receive (atomics, ATOMIC_WRITE).
DataHeader one_packet_data(uint32_t len) {
  DataHeader d = sample_data(len);
  d.offset = 0;
  d.total_length = len;
  d.rsn = 0;
  return d;
}

std::vector<uint8_t> data_packet(const BaseHeader& b, const DataHeader& d) {
  std::vector<uint8_t> buf(kDataHeadersLen + d.payload_len);
  EXPECT_EQ(encode_data(buf, b, d), kDataHeadersLen);
  for (uint32_t i = 0; i < d.payload_len; ++i) buf[kDataHeadersLen + i] = static_cast<uint8_t>(i);
  return buf;
}

std::vector<uint8_t> ack_packet(const BaseHeader& b, const AckHeader& a,
                                const std::vector<NakRecord>& naks) {
  std::vector<uint8_t> buf(kAckHeadersLen + naks.size() * kNakRecordLen);
  EXPECT_EQ(encode_ack(buf, b, a, naks), buf.size());
  return buf;
}

TEST(Bytes, BigEndianAccessorsPutTheMostSignificantByteFirst) {
  uint8_t b[8];
  store_be64(b, 0x0102030405060708ull);
  EXPECT_EQ(b[0], 1);
  EXPECT_EQ(b[7], 8);
  EXPECT_EQ(load_be32(b + 4), 0x05060708u);
  EXPECT_EQ(load_be16(b + 2), 0x0304);
  EXPECT_EQ(load_be64(b), 0x0102030405060708ull);
}

TEST(Mrh, EveryDataOpcodeRoundTrips) {
  for (Opcode op : {Opcode::kWrite, Opcode::kWriteImm, Opcode::kSend, Opcode::kSendImm,
                    Opcode::kReadReq, Opcode::kReadResp, Opcode::kAtomicCmpSwp,
                    Opcode::kAtomicFetchAdd, Opcode::kSendInv}) {
    const bool atomic = is_atomic_opcode(op);
    const uint32_t len = op == Opcode::kReadReq ? 0 : atomic ? kAtomicRequestLen : 100;
    BaseHeader b = sample_base(op);
    DataHeader d = sample_data(len);
    if (op == Opcode::kReadReq || atomic) d.offset = 0;
    if (atomic) d.total_length = kAtomicRequestLen;
    // Only what consumes a receive names one.
    if (op != Opcode::kSend && op != Opcode::kSendImm && op != Opcode::kWriteImm &&
        op != Opcode::kSendInv)
      d.rsn = 0;
    auto buf = data_packet(b, d);
    Packet p;
    ASSERT_EQ(decode(buf, p), DecodeError::kNone) << static_cast<int>(op);
    EXPECT_EQ(p.base.opcode, op);
    EXPECT_EQ(p.base.version, kMrhVersion);
    EXPECT_EQ(p.base.flags, b.flags);
    EXPECT_EQ(p.base.conn_id, b.conn_id);
    EXPECT_EQ(p.base.token, b.token);
    EXPECT_EQ(p.base.path_id, b.path_id);
    EXPECT_EQ(p.base.path_count, b.path_count);
    EXPECT_EQ(p.base.path_seq, b.path_seq);
    EXPECT_EQ(p.base.timestamp, b.timestamp);
    EXPECT_EQ(p.base.ack_floor, b.ack_floor);
    EXPECT_EQ(p.data.dst_stream, d.dst_stream);
    EXPECT_EQ(p.data.src_stream, d.src_stream);
    EXPECT_EQ(p.data.msn, d.msn);
    EXPECT_EQ(p.data.rsn, d.rsn);
    EXPECT_EQ(p.data.offset, d.offset);
    EXPECT_EQ(p.data.total_length, d.total_length);
    EXPECT_EQ(p.data.remote_addr, d.remote_addr);
    EXPECT_EQ(p.data.rkey, d.rkey);
    EXPECT_EQ(p.data.imm, d.imm);
    ASSERT_EQ(p.payload.size(), len);
    if (len) {
      EXPECT_EQ(p.payload[len - 1], len - 1);
    }
  }
}

TEST(Mrh, FieldsSitAtTheDocumentedOffsets) {
  auto buf = data_packet(sample_base(Opcode::kWrite), sample_data(0));
  EXPECT_EQ(buf[0], 1);
  EXPECT_EQ(buf[1], 1);
  EXPECT_EQ(load_be32(&buf[4]), 0xdeadbeefu);
  EXPECT_EQ(load_be64(&buf[8]), 0x0123456789abcdefull);
  EXPECT_EQ(load_be16(&buf[16]), 5);
  EXPECT_EQ(load_be16(&buf[18]), 8);
  EXPECT_EQ(load_be32(&buf[20]), 1000u);
  EXPECT_EQ(load_be32(&buf[28]), 990u);
  EXPECT_EQ(load_be32(&buf[32]), 11u);             // dst_stream
  EXPECT_EQ(load_be64(&buf[32 + 24]), 0x00007fff12345000ull);  // remote_addr
  EXPECT_EQ(load_be32(&buf[32 + 40]), 0u);         // payload_len
}

// Verbs hands immediate data in network order (__be32); the wire carries those four bytes as
// they lie in memory, as a RoCE NIC does, so any decoder reading the field big-endian gets the
// application's number (wire.md §2.2). Until 2026-12 the encoder byte-swapped them.
TEST(Mrh, ImmediateDataKeepsVerbsByteOrderOnTheWire) {
  const uint8_t app[4] = {0x0a, 0x0b, 0x0c, 0x0d};  // htonl(0x0a0b0c0d), as verbs holds it
  DataHeader d = sample_data(0);
  std::memcpy(&d.imm, app, 4);
  auto buf = data_packet(sample_base(Opcode::kSendImm), d);
  EXPECT_EQ(load_be32(&buf[32 + 36]), 0x0a0b0c0du);
  Packet p;
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(std::memcmp(&p.data.imm, app, 4), 0);
}

TEST(Mrh, AckWithNakRecordsRoundTrips) {
  BaseHeader b = sample_base(Opcode::kAck);
  AckHeader a;
  a.cum_seq = 77;
  a.sack = {0x8000000000000001ull, 2, 0, 0xffull << 56};
  a.echo_timestamp = 12345;
  a.ecn_ce_count = 3;
  a.rate_hint = 25000;
  std::vector<NakRecord> naks = {{80, 22, 33, 2}, {90, 23, 34, 5}};
  auto buf = ack_packet(b, a, naks);
  ASSERT_EQ(buf.size(), kAckHeadersLen + 2 * kNakRecordLen);
  Packet p;
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.base.opcode, Opcode::kAck);
  EXPECT_EQ(p.ack.cum_seq, 77u);
  EXPECT_EQ(p.ack.sack, a.sack);
  EXPECT_EQ(p.ack.echo_timestamp, 12345u);
  EXPECT_EQ(p.ack.ecn_ce_count, 3);
  EXPECT_EQ(p.ack.nak_count, 2);
  EXPECT_EQ(p.ack.rate_hint, 25000u);
  for (size_t i = 0; i < naks.size(); ++i) {
    const NakRecord r = p.nak(i);
    EXPECT_EQ(r.path_seq, naks[i].path_seq);
    EXPECT_EQ(r.src_stream, naks[i].src_stream);
    EXPECT_EQ(r.msn, naks[i].msn);
    EXPECT_EQ(r.syndrome, naks[i].syndrome);
  }
}

TEST(Mrh, ProbeRoundTripsAndIsBaseOnly) {
  BaseHeader b = sample_base(Opcode::kProbe);
  std::vector<uint8_t> buf(kBaseHeaderLen);
  ASSERT_EQ(encode_base(buf, b), kBaseHeaderLen);
  Packet p;
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.base.opcode, Opcode::kProbe);
  EXPECT_EQ(p.base.path_seq, 1000u);
  buf.push_back(0);
  EXPECT_EQ(decode(buf, p), DecodeError::kLengthMismatch);
}

TEST(Mrh, EncodersRefuseShortBuffersAndWrongOpcodes) {
  std::vector<uint8_t> small(kDataHeadersLen - 1);
  EXPECT_EQ(encode_data(small, sample_base(Opcode::kWrite), sample_data(0)), 0u);
  std::vector<uint8_t> big(512);
  EXPECT_EQ(encode_data(big, sample_base(Opcode::kAck), sample_data(0)), 0u);
  EXPECT_EQ(encode_ack(big, sample_base(Opcode::kWrite), AckHeader{}, {}), 0u);
  std::vector<NakRecord> too_many(kMaxNakRecords + 1, NakRecord{1, 1, 1, 2});
  EXPECT_EQ(encode_ack(big, sample_base(Opcode::kAck), AckHeader{}, too_many), 0u);
}

TEST(Mrh, TruncatedPacketsAreRefusedAtEveryLength) {
  auto data = data_packet(sample_base(Opcode::kWrite), sample_data(0));
  auto ack = ack_packet(sample_base(Opcode::kAck), AckHeader{}, {{1, 2, 3, 2}});
  Packet p;
  for (size_t n = 0; n < kDataHeadersLen; ++n) {
    EXPECT_EQ(decode(std::span(data.data(), n), p), DecodeError::kTruncated) << n;
  }
  for (size_t n = 0; n < ack.size(); ++n) {
    EXPECT_EQ(decode(std::span(ack.data(), n), p), DecodeError::kTruncated) << n;
  }
}

TEST(Mrh, WrongVersionAndUnknownOpcodeHaveTheirOwnReasons) {
  auto buf = data_packet(sample_base(Opcode::kWrite), sample_data(0));
  Packet p;
  for (uint8_t v : {0, 2, 255}) {
    auto bad = buf;
    bad[0] = v;
    EXPECT_EQ(decode(bad, p), DecodeError::kBadVersion);
  }
  // 10 and 11 are multicast datagrams: never a connection's packet (decode_datagram's).
  for (uint8_t op : {0, 10, 11, 15, 18, 255}) {
    auto bad = buf;
    bad[1] = op;
    EXPECT_EQ(decode(bad, p), DecodeError::kBadOpcode) << int{op};
  }
}

// --- multicast datagrams (spec §8) --------------------------------------------------------

std::vector<uint8_t> datagram(const Datagram& d, std::span<const uint8_t> payload) {
  std::vector<uint8_t> b(kDatagramHeadersLen + payload.size());
  EXPECT_EQ(encode_datagram(b, d, static_cast<uint32_t>(payload.size())), kDatagramHeadersLen);
  std::copy(payload.begin(), payload.end(), b.begin() + kDatagramHeadersLen);
  return b;
}

TEST(Datagram, ImmediateDataKeepsVerbsByteOrderOnTheWire) {
  const uint8_t app[4] = {0x0a, 0x0b, 0x0c, 0x0d};  // htonl(0x0a0b0c0d), as verbs holds it
  Datagram d;
  d.with_imm = true;
  d.src_qpn = 5;
  std::memcpy(&d.imm, app, 4);
  auto b = datagram(d, {});
  EXPECT_EQ(load_be32(&b[32 + 36]), 0x0a0b0c0du);
}

TEST(Datagram, RoundTripsWithAndWithoutImmediate) {
  const uint8_t payload[5] = {1, 2, 3, 4, 5};
  for (bool imm : {false, true}) {
    Datagram d;
    d.with_imm = imm;
    d.src_qpn = 0xabcdef;
    d.msn = 77;
    d.qkey = 0x01234567;
    d.imm = imm ? 0xdeadbeef : 0;
    d.timestamp = 0x1234;
    auto b = datagram(d, payload);
    EXPECT_EQ(b[1], imm ? 11 : 10);
    // Every connection field zero, path_count 1; the group's QP 0xffffff in dst_stream.
    EXPECT_EQ(load_be32(&b[4]), 0u);
    EXPECT_EQ(load_be64(&b[8]), 0u);
    EXPECT_EQ(load_be16(&b[18]), 1u);
    EXPECT_EQ(load_be32(&b[32]), kMulticastQpn);
    Datagram out;
    ASSERT_EQ(decode_datagram(b, out), DecodeError::kNone);
    EXPECT_EQ(out.with_imm, imm);
    EXPECT_EQ(out.src_qpn, d.src_qpn);
    EXPECT_EQ(out.msn, 77u);
    EXPECT_EQ(out.qkey, 0x01234567u);
    EXPECT_EQ(out.imm, d.imm);
    EXPECT_EQ(out.timestamp, 0x1234u);
    ASSERT_EQ(out.payload.size(), 5u);
    EXPECT_EQ(out.payload[4], 5);
    // A connection's decoder refuses it: its opcode is not one of a connection's.
    Packet p;
    EXPECT_EQ(decode(b, p), DecodeError::kBadOpcode);
  }
  Datagram big;
  big.src_qpn = 0x1000000;  // 25 bits
  std::vector<uint8_t> b(kDatagramHeadersLen);
  EXPECT_EQ(encode_datagram(b, big, 0), 0u);
  EXPECT_EQ(encode_datagram(std::span<uint8_t>(b).first(79), Datagram{}, 0), 0u);
}

TEST(Datagram, EveryFieldOutsideTheSpecIsRefused) {
  const uint8_t payload[3] = {7, 8, 9};
  Datagram d;
  d.src_qpn = 12;
  d.qkey = 5;
  const auto good = datagram(d, payload);
  Datagram out;
  ASSERT_EQ(decode_datagram(good, out), DecodeError::kNone);
  for (size_t len = 0; len < kDatagramHeadersLen; ++len)
    EXPECT_EQ(decode_datagram(std::span(good).first(len), out), DecodeError::kTruncated) << len;
  auto bad = good;
  bad[0] = 2;
  EXPECT_EQ(decode_datagram(bad, out), DecodeError::kBadVersion);
  for (uint8_t op : {1, 3, 4, 9, 12, 16, 17}) {
    bad = good;
    bad[1] = op;
    EXPECT_EQ(decode_datagram(bad, out), DecodeError::kBadOpcode) << int{op};
  }
  bad = good;
  bad.push_back(0);
  EXPECT_EQ(decode_datagram(bad, out), DecodeError::kLengthMismatch);
  // Base: flags, conn_id, token, path_id, path_count (!= 1), path_seq, ack_floor. Data:
  // dst_stream (!= 0xffffff), src_stream past 24 bits, rsn, offset, total_length, remote_addr,
  // imm without the opcode saying so, orig_seq.
  struct Poke {
    size_t at;
    uint8_t value;
  };
  for (Poke k : {Poke{2, 1}, Poke{7, 1}, Poke{15, 1}, Poke{17, 1}, Poke{19, 2}, Poke{23, 1},
                 Poke{31, 1}, Poke{35, 0xfe}, Poke{36, 1}, Poke{47, 1}, Poke{51, 1}, Poke{55, 9},
                 Poke{63, 1}, Poke{71, 1}, Poke{79, 1}}) {
    bad = good;
    bad[k.at] = k.value;
    EXPECT_EQ(decode_datagram(bad, out), DecodeError::kBadField) << k.at;
  }
}

TEST(Mrh, AtomicsHaveTheirOwnOpcodesAndATaggedWriteIsMalformed) {
  Packet p;
  BaseHeader b = sample_base(Opcode::kAtomicFetchAdd);
  DataHeader d = one_packet_data(kAtomicRequestLen);
  auto buf = data_packet(b, d);
  EXPECT_EQ(buf[1], 8);
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.payload.size(), kAtomicRequestLen);
  // One packet of exactly its two operands, at offset 0, naming no receive.
  { auto y = d; y.payload_len = 8; y.total_length = 8; EXPECT_EQ(decode(data_packet(b, y), p), DecodeError::kBadField); }
  { auto y = d; y.total_length = 32; EXPECT_EQ(decode(data_packet(b, y), p), DecodeError::kBadField); }
  { auto y = d; y.rsn = 1; EXPECT_EQ(decode(data_packet(b, y), p), DecodeError::kBadField); }
  // What version 1 drafts sent for an atomic, a WRITE whose rsn tagged it, is refused instead of
  // performed as a write of the operands; so is any WRITE, READ or READ_RESP that names a receive.
  for (Opcode op : {Opcode::kWrite, Opcode::kReadResp}) {
    BaseHeader w = sample_base(op);
    DataHeader y = d;
    y.rsn = 0x41464100;
    EXPECT_EQ(decode(data_packet(w, y), p), DecodeError::kBadField) << int(op);
    y.rsn = 0;
    EXPECT_EQ(decode(data_packet(w, y), p), DecodeError::kNone) << int(op);
  }
}

TEST(Mrh, AtomicWriteIsOnePacketOfEightBytes) {
  Packet p;
  BaseHeader b = sample_base(Opcode::kAtomicWrite);
  DataHeader d = one_packet_data(kAtomicWriteLen);
  auto buf = data_packet(b, d);
  EXPECT_EQ(buf[1], 12);
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.base.opcode, Opcode::kAtomicWrite);
  EXPECT_EQ(p.payload.size(), kAtomicWriteLen);
  EXPECT_TRUE(is_data_opcode(Opcode::kAtomicWrite));
  EXPECT_FALSE(is_atomic_opcode(Opcode::kAtomicWrite));  // no answer but the ACK
  // Exactly 8 bytes at offset 0, naming no receive; anything else is malformed, not a write.
  { auto y = d; y.payload_len = 4; y.total_length = 4; EXPECT_EQ(decode(data_packet(b, y), p), DecodeError::kBadField); }
  { auto y = d; y.total_length = 16; EXPECT_EQ(decode(data_packet(b, y), p), DecodeError::kBadField); }
  { auto y = d; y.total_length = 16; y.offset = 8; EXPECT_EQ(decode(data_packet(b, y), p), DecodeError::kBadField); }
  { auto y = d; y.rsn = 1; EXPECT_EQ(decode(data_packet(b, y), p), DecodeError::kBadField); }
}

TEST(Mrh, PayloadLengthMustMatchTheBytesPresent) {
  auto buf = data_packet(sample_base(Opcode::kSend), sample_data(10));
  Packet p;
  auto longer = buf;
  longer.push_back(0);
  EXPECT_EQ(decode(longer, p), DecodeError::kLengthMismatch);
  EXPECT_EQ(decode(std::span(buf.data(), buf.size() - 1), p), DecodeError::kLengthMismatch);
  auto ack = ack_packet(sample_base(Opcode::kAck), AckHeader{}, {});
  ack.push_back(0);
  EXPECT_EQ(decode(ack, p), DecodeError::kLengthMismatch);
}

TEST(Mrh, OutOfRangeFieldsAreRefused) {
  Packet p;
  auto expect_bad = [&](BaseHeader b, DataHeader d) {
    auto buf = data_packet(b, d);
    EXPECT_EQ(decode(buf, p), DecodeError::kBadField);
  };
  BaseHeader b = sample_base(Opcode::kWrite);
  DataHeader d = sample_data(16);
  d.rsn = 0;
  { auto x = b; x.conn_id = 0; expect_bad(x, d); }
  { auto x = b; x.path_count = 0; x.path_id = 0; expect_bad(x, d); }
  { auto x = b; x.path_count = 257; expect_bad(x, d); }
  { auto x = b; x.path_id = 8; expect_bad(x, d); }
  { auto x = b; x.ack_floor = x.path_seq + 1; expect_bad(x, d); }
  { auto y = d; y.total_length = y.offset + y.payload_len - 1; expect_bad(b, y); }
  { auto y = d; y.offset = 0xfffffff8u; expect_bad(b, y); }
  { auto y = d; y.remote_addr = ~0ull - 4; expect_bad(b, y); }
  {
    auto x = b;
    x.opcode = Opcode::kReadReq;
    auto y = d;
    y.offset = 1;
    y.payload_len = 0;
    expect_bad(x, y);
  }
  // The floor may lag far behind: that is the receiver's window check, not malformation.
  { auto x = b; x.ack_floor = x.path_seq - 100000; EXPECT_EQ(decode(data_packet(x, d), p), DecodeError::kNone); }
  // A floor across the wrap is fine.
  { auto x = b; x.path_seq = 3; x.ack_floor = 0xfffffffeu; EXPECT_EQ(decode(data_packet(x, d), p), DecodeError::kNone); }
}

TEST(Mrh, AckNakCountAndSyndromesAreChecked) {
  Packet p;
  for (uint8_t s : {0, 6, 200}) {
    auto buf = ack_packet(sample_base(Opcode::kAck), AckHeader{}, {{1, 2, 3, s}});
    EXPECT_EQ(decode(buf, p), DecodeError::kBadField) << int{s};
  }
  auto buf = ack_packet(sample_base(Opcode::kAck), AckHeader{}, {});
  buf.resize(kAckHeadersLen + 17 * kNakRecordLen);
  store_be16(&buf[kBaseHeaderLen + 42], 17);
  EXPECT_EQ(decode(buf, p), DecodeError::kBadField);
}

TEST(Mrh, RnrNakRecordsAreAccepted) {
  Packet p;
  auto buf = ack_packet(sample_base(Opcode::kAck), AckHeader{}, {{9, 2, 3, 1}});
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.nak(0).syndrome, 1);
}

TEST(Mrh, AnRnrNakCarriesTheRespondersTimerAndOnlyAnRnrNak) {
  Packet p;
  const uint8_t timer = kRnrTimerValid | 16;  // 2.56 ms
  auto buf = ack_packet(sample_base(Opcode::kAck), AckHeader{},
                        {{9, 2, 3, 1, timer}, {10, 2, 4, 2, timer}});
  EXPECT_EQ(buf[kAckHeadersLen + 13], timer);
  EXPECT_EQ(buf[kAckHeadersLen + kNakRecordLen + 13], 0);  // not RNR: sent as 0
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.nak(0).rnr_timer, timer);
  EXPECT_EQ(p.nak(1).rnr_timer, 0);
  // No timer named (0) is valid; a byte that is neither 0 nor kRnrTimerValid | code is not.
  buf[kAckHeadersLen + 13] = 0;
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.nak(0).rnr_timer, 0);
  buf[kAckHeadersLen + 13] = kRnrTimerValid | 0x20;
  EXPECT_EQ(decode(buf, p), DecodeError::kBadField);
  // The byte of a record that is not RNR is ignored.
  buf[kAckHeadersLen + 13] = timer;
  buf[kAckHeadersLen + kNakRecordLen + 13] = 0xff;
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.nak(1).rnr_timer, 0);
}

TEST(Mrh, FailoverCopyCarriesItsOriginalPathAndSequence) {
  BaseHeader b = sample_base(Opcode::kSend);
  b.flags = failover_flags(7);
  DataHeader d = sample_data(8);
  d.orig_seq = 0xa1b2c3d4u;
  auto buf = data_packet(b, d);
  EXPECT_EQ(load_be16(&buf[2]), 0x8007);
  EXPECT_EQ(load_be32(&buf[76]), 0xa1b2c3d4u);  // the data extension's last word
  Packet p;
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_TRUE(is_failover_copy(p.base.flags));
  EXPECT_EQ(orig_path_of(p.base.flags), 7);
  EXPECT_EQ(p.data.orig_seq, 0xa1b2c3d4u);
  // A plain packet has no original.
  auto plain = data_packet(sample_base(Opcode::kSend), sample_data(8));
  ASSERT_EQ(decode(plain, p), DecodeError::kNone);
  EXPECT_FALSE(is_failover_copy(p.base.flags));
  EXPECT_EQ(p.data.orig_seq, 0u);
  // The original path must exist (path_count 8 here) ...
  b.flags = failover_flags(8);
  EXPECT_EQ(decode(data_packet(b, d), p), DecodeError::kBadField);
  // ... and only data can be a copy.
  BaseHeader probe = sample_base(Opcode::kProbe);
  probe.flags = failover_flags(1);
  std::vector<uint8_t> pb(kBaseHeaderLen);
  ASSERT_EQ(encode_base(pb, probe), kBaseHeaderLen);
  EXPECT_EQ(decode(pb, p), DecodeError::kBadField);
  BaseHeader ack = sample_base(Opcode::kAck);
  ack.flags = failover_flags(1);
  EXPECT_EQ(decode(ack_packet(ack, AckHeader{}, {}), p), DecodeError::kBadField);
}

// An XRC packet (spec §2.2.1): the SRQ number in 4 bytes after the data extension, the payload
// after it; payload_len still counts the payload alone.
std::vector<uint8_t> xrc_packet(Opcode op, uint32_t srqn, uint32_t payload_len) {
  BaseHeader b = sample_base(op);
  b.flags |= kFlagXrc;
  DataHeader d = sample_data(payload_len);
  d.xrc_srqn = srqn;
  if (op != Opcode::kSend && op != Opcode::kSendImm && op != Opcode::kWriteImm) d.rsn = 0;
  std::vector<uint8_t> buf(kDataHeadersLen + kXrcExtLen + payload_len);
  EXPECT_EQ(encode_data(buf, b, d), kDataHeadersLen + kXrcExtLen);
  for (uint32_t i = 0; i < payload_len; ++i)
    buf[kDataHeadersLen + kXrcExtLen + i] = static_cast<uint8_t>(0x40 + i);
  return buf;
}

TEST(Mrh, AnXrcRequestCarriesItsSrqNumberBetweenTheHeadersAndThePayload) {
  auto buf = xrc_packet(Opcode::kSend, 0x00abcdef, 12);
  EXPECT_EQ(load_be16(&buf[2]) & kFlagXrc, kFlagXrc);
  EXPECT_EQ(load_be32(&buf[80]), 0x00abcdefu);
  EXPECT_EQ(load_be32(&buf[72]), 12u);  // payload_len: the payload, not the extension
  Packet p;
  ASSERT_EQ(decode(buf, p), DecodeError::kNone);
  EXPECT_EQ(p.data.xrc_srqn, 0x00abcdefu);
  ASSERT_EQ(p.payload.size(), 12u);
  EXPECT_EQ(p.payload[0], 0x40);
  EXPECT_EQ(data_headers_len(p.base.flags), kDataHeadersLen + kXrcExtLen);
  // Every request opcode may name one; a zero-length one too.
  for (Opcode op : {Opcode::kWrite, Opcode::kWriteImm, Opcode::kSendImm, Opcode::kSendInv})
    EXPECT_EQ(decode(xrc_packet(op, 1, 0), p), DecodeError::kNone);
  // Without the flag the same bytes are a packet whose payload_len is 4 short.
  auto unflagged = buf;
  unflagged[2] &= static_cast<uint8_t>(~(kFlagXrc >> 8));
  EXPECT_EQ(decode(unflagged, p), DecodeError::kLengthMismatch);
  // A plain packet names no SRQ.
  ASSERT_EQ(decode(data_packet(sample_base(Opcode::kSend), sample_data(8)), p), DecodeError::kNone);
  EXPECT_EQ(p.data.xrc_srqn, 0u);
}

TEST(Mrh, XrcExtensionsThatCannotBeAreRefused) {
  Packet p;
  // The top byte of the SRQ number is reserved.
  auto bad = xrc_packet(Opcode::kSend, 1, 4);
  bad[80] = 1;
  EXPECT_EQ(decode(bad, p), DecodeError::kBadField);
  // Cut inside the extension.
  auto full = xrc_packet(Opcode::kSend, 1, 0);
  EXPECT_EQ(decode(std::span(full).first(kDataHeadersLen + 2), p), DecodeError::kTruncated);
  // A READ answer goes to the requester's QP, never to an SRQ.
  BaseHeader b = sample_base(Opcode::kReadResp);
  DataHeader d = sample_data(4);
  d.rsn = 0;
  std::vector<uint8_t> resp(kDataHeadersLen + kXrcExtLen + 4);
  b.flags |= kFlagXrc;
  EXPECT_EQ(encode_data(resp, b, d), 0u);
  b.flags &= static_cast<uint16_t>(~kFlagXrc);
  ASSERT_EQ(encode_data(resp, b, d), kDataHeadersLen);
  resp[2] |= kFlagXrc >> 8;
  EXPECT_EQ(decode(resp, p), DecodeError::kBadField);
  // The encoder refuses an SRQ number past 24 bits.
  BaseHeader s = sample_base(Opcode::kSend);
  s.flags |= kFlagXrc;
  DataHeader big = sample_data(0);
  big.xrc_srqn = 0x01000000;
  std::vector<uint8_t> out(kDataHeadersLen + kXrcExtLen);
  EXPECT_EQ(encode_data(out, s, big), 0u);
  // On an ACK the flag means nothing and is ignored, as other unassigned bits are.
  BaseHeader ack = sample_base(Opcode::kAck);
  ack.flags |= kFlagXrc;
  EXPECT_EQ(decode(ack_packet(ack, AckHeader{}, {}), p), DecodeError::kNone);
}

UdpFrameParams sample_params() {
  UdpFrameParams pr;
  pr.src_mac = {2, 0, 0, 0, 0, 1};
  pr.dst_mac = {2, 0, 0, 0, 0, 2};
  pr.src_ip = 0xc0a80001;  // 192.168.0.1
  pr.dst_ip = 0xc0a800c7;  // 192.168.0.199
  pr.src_port = 49200;
  pr.dst_port = kDefaultUdpPort;
  return pr;
}

TEST(Frame, Ipv4ChecksumMatchesAWorkedExample) {
  // The classic worked example: 45 00 0073 0000 4000 40 11 xxxx c0a80001 c0a800c7 -> b861.
  UdpFrameParams pr = sample_params();
  pr.ecn = Ecn::kNotEct;
  std::vector<uint8_t> frame(kUdpFrameHeaderLen + 87);
  ASSERT_EQ(write_udp_headers(frame, pr, 87), kUdpFrameHeaderLen);
  EXPECT_EQ(load_be16(&frame[kEthHeaderLen + 2]), 0x73);
  EXPECT_EQ(load_be16(&frame[kEthHeaderLen + 10]), 0xb861);
}

// The per-packet path stamps a template instead of writing every field: byte for byte the same
// headers, for every length and source port, and parse_frame accepts them.
TEST(Frame, StampedTemplateEqualsWrittenHeaders) {
  for (uint8_t dscp : {0, 26, 63}) {
    UdpFrameParams pr = sample_params();
    pr.dscp = dscp;
    pr.ttl = static_cast<uint8_t>(1 + dscp);
    UdpHeaderTemplate t;
    ASSERT_TRUE(make_udp_template(t, pr));
    for (size_t len : {size_t{0}, size_t{1}, size_t{87}, size_t{4096 + 64}, size_t{65507}}) {
      for (uint16_t port : {uint16_t{0}, uint16_t{49200}, uint16_t{65535}}) {
        pr.src_port = port;
        std::vector<uint8_t> want(kUdpFrameHeaderLen + len), got(kUdpFrameHeaderLen + len);
        ASSERT_EQ(write_udp_headers(want, pr, len), kUdpFrameHeaderLen);
        ASSERT_EQ(stamp_udp_headers(got, t, port, len), kUdpFrameHeaderLen);
        EXPECT_EQ(want, got) << "dscp " << int{dscp} << " len " << len << " port " << port;
        EXPECT_EQ(parse_frame(got, pr.dst_port).kind, FrameKind::kMetaRoce);
      }
    }
  }
  UdpFrameParams pr = sample_params();
  UdpHeaderTemplate t;
  std::array<uint8_t, kUdpFrameHeaderLen> hdr{};
  ASSERT_TRUE(make_udp_template(t, pr));
  EXPECT_EQ(stamp_udp_headers(std::span(hdr.data(), 41), t, 1, 10), 0u);
  EXPECT_EQ(stamp_udp_headers(hdr, t, 1, 65508), 0u);
  pr.udp_checksum = true;  // its sum covers the payload: no template
  EXPECT_FALSE(make_udp_template(t, pr));
  pr = sample_params();
  pr.dscp = 64;
  EXPECT_FALSE(make_udp_template(t, pr));
}

TEST(Frame, UdpFrameRoundTripsWithEcnDscpAndPorts) {
  UdpFrameParams pr = sample_params();
  pr.dscp = 26;
  pr.ecn = Ecn::kEct0;
  pr.udp_checksum = true;
  std::vector<uint8_t> payload(300);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7);
  std::vector<uint8_t> frame(2000);
  const size_t n = build_udp_frame(frame, pr, payload);
  ASSERT_EQ(n, kUdpFrameHeaderLen + payload.size());
  frame.resize(n + 6);  // Ethernet padding after the IP packet must be ignored
  FrameInfo f = parse_frame(frame, kDefaultUdpPort);
  ASSERT_EQ(f.kind, FrameKind::kMetaRoce) << to_string(f.error);
  EXPECT_EQ(f.src_mac, pr.src_mac);
  EXPECT_EQ(f.dst_mac, pr.dst_mac);
  EXPECT_EQ(f.src_ip, pr.src_ip);
  EXPECT_EQ(f.dst_ip, pr.dst_ip);
  EXPECT_EQ(f.src_port, 49200);
  EXPECT_EQ(f.dst_port, kDefaultUdpPort);
  EXPECT_EQ(f.dscp, 26);
  EXPECT_EQ(f.ecn, Ecn::kEct0);
  ASSERT_EQ(f.payload.size(), payload.size());
  EXPECT_TRUE(std::equal(payload.begin(), payload.end(), f.payload.begin()));

  frame[kEthHeaderLen + 1] |= 3;  // a switch marks CE and fixes nothing else...
  EXPECT_EQ(parse_frame(frame, kDefaultUdpPort).error, FrameError::kIpChecksum);
  // ...a real one updates the checksum too.
  store_be16(&frame[kEthHeaderLen + 10], 0);
  store_be16(&frame[kEthHeaderLen + 10],
             static_cast<uint16_t>(~ones_complement_sum({&frame[kEthHeaderLen], 20})));
  f = parse_frame(frame, kDefaultUdpPort);
  ASSERT_EQ(f.kind, FrameKind::kMetaRoce);
  EXPECT_EQ(f.ecn, Ecn::kCe);
}

TEST(Frame, MalformedAndForeignFramesGetTheirReasons) {
  UdpFrameParams pr = sample_params();
  pr.udp_checksum = true;
  std::vector<uint8_t> payload(64, 0x5a);
  std::vector<uint8_t> good(kUdpFrameHeaderLen + payload.size());
  ASSERT_NE(build_udp_frame(good, pr, payload), 0u);
  ASSERT_EQ(parse_frame(good, kDefaultUdpPort).kind, FrameKind::kMetaRoce);
  auto fix_ip_sum = [](std::vector<uint8_t>& f) {
    store_be16(&f[kEthHeaderLen + 10], 0);
    store_be16(&f[kEthHeaderLen + 10],
               static_cast<uint16_t>(~ones_complement_sum({&f[kEthHeaderLen], 20})));
  };
  auto expect = [](const std::vector<uint8_t>& f, FrameKind k, FrameError e) {
    FrameInfo i = parse_frame(f, kDefaultUdpPort);
    EXPECT_EQ(i.kind, k);
    EXPECT_EQ(i.error, e) << to_string(i.error);
  };
  for (size_t n : {size_t{0}, size_t{13}, size_t{20}, size_t{33}, size_t{40}}) {
    expect(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<long>(n)),
           FrameKind::kMalformed, n < 34 ? FrameError::kTruncated : FrameError::kIpLength);
  }
  { auto f = good; store_be16(&f[12], 0x86dd); expect(f, FrameKind::kOther, FrameError::kEtherType); }
  { auto f = good; f[kEthHeaderLen] = 0x65; fix_ip_sum(f); expect(f, FrameKind::kMalformed, FrameError::kIpVersion); }
  { auto f = good; f[kEthHeaderLen] = 0x44; fix_ip_sum(f); expect(f, FrameKind::kMalformed, FrameError::kIpVersion); }
  { auto f = good; f[kEthHeaderLen + 8] ^= 1; expect(f, FrameKind::kMalformed, FrameError::kIpChecksum); }
  { auto f = good; store_be16(&f[kEthHeaderLen + 2], 2000); fix_ip_sum(f); expect(f, FrameKind::kMalformed, FrameError::kIpLength); }
  { auto f = good; store_be16(&f[kEthHeaderLen + 6], 0x2000); fix_ip_sum(f); expect(f, FrameKind::kMalformed, FrameError::kIpFragment); }
  { auto f = good; store_be16(&f[kEthHeaderLen + 6], 0x0001); fix_ip_sum(f); expect(f, FrameKind::kMalformed, FrameError::kIpFragment); }
  { auto f = good; f[kEthHeaderLen + 9] = 6; fix_ip_sum(f); expect(f, FrameKind::kOther, FrameError::kNotUdp); }
  { auto f = good; store_be16(&f[kEthHeaderLen + 20 + 4], 7); expect(f, FrameKind::kMalformed, FrameError::kUdpLength); }
  { auto f = good; store_be16(&f[kEthHeaderLen + 20 + 4], 200); expect(f, FrameKind::kMalformed, FrameError::kUdpLength); }
  { auto f = good; f.back() ^= 0xff; expect(f, FrameKind::kMalformed, FrameError::kUdpChecksum); }
  { auto f = good; store_be16(&f[kEthHeaderLen + 20 + 2], 4791); expect(f, FrameKind::kOther, FrameError::kWrongPort); }
  // A zero UDP checksum means "none" and is accepted.
  { auto f = good; f.back() ^= 0xff; store_be16(&f[kEthHeaderLen + 26], 0); expect(f, FrameKind::kMetaRoce, FrameError::kNone); }
}

TEST(Frame, HeaderWriterRefusesWhatCannotBeFramed) {
  UdpFrameParams pr = sample_params();
  std::vector<uint8_t> hdr(kUdpFrameHeaderLen);
  EXPECT_EQ(write_udp_headers(std::span(hdr.data(), 41), pr, 10), 0u);
  EXPECT_EQ(write_udp_headers(hdr, pr, 65508), 0u);
  pr.dscp = 64;
  EXPECT_EQ(write_udp_headers(hdr, pr, 10), 0u);
  pr.dscp = 0;
  pr.udp_checksum = true;  // needs the payload in the same buffer
  EXPECT_EQ(write_udp_headers(hdr, pr, 10), 0u);
}

TEST(Arp, RequestAndReplyRoundTrip) {
  ArpPacket req{ArpOp::kRequest, {2, 0, 0, 0, 0, 1}, 0x0a000001, {9, 9, 9, 9, 9, 9}, 0x0a000002};
  std::vector<uint8_t> f(kArpFrameLen);
  ASSERT_EQ(build_arp(f, req), kArpFrameLen);
  FrameInfo i = parse_frame(f, kDefaultUdpPort);
  ASSERT_EQ(i.kind, FrameKind::kArp);
  EXPECT_EQ(i.dst_mac, kBroadcastMac);
  EXPECT_EQ(i.arp.op, ArpOp::kRequest);
  EXPECT_EQ(i.arp.sender_mac, req.sender_mac);
  EXPECT_EQ(i.arp.sender_ip, 0x0a000001u);
  EXPECT_EQ(i.arp.target_mac, MacAddr{});  // unknown in a request
  EXPECT_EQ(i.arp.target_ip, 0x0a000002u);

  ArpPacket rep{ArpOp::kReply, {2, 0, 0, 0, 0, 2}, 0x0a000002, {2, 0, 0, 0, 0, 1}, 0x0a000001};
  ASSERT_EQ(build_arp(f, rep), kArpFrameLen);
  i = parse_frame(f, kDefaultUdpPort);
  ASSERT_EQ(i.kind, FrameKind::kArp);
  EXPECT_EQ(i.dst_mac, rep.target_mac);
  EXPECT_EQ(i.arp.op, ArpOp::kReply);
  EXPECT_EQ(i.arp.target_mac, rep.target_mac);

  std::vector<uint8_t> small(59);
  EXPECT_EQ(build_arp(small, rep), 0u);
}

TEST(Goodbye, FrameHasTheSpecLayoutAndOnlyItIsRecognised) {
  const MacAddr src{2, 0, 0, 0, 0, 7};
  std::vector<uint8_t> f(kGoodbyeFrameLen, 0xee);
  ASSERT_EQ(build_goodbye(f, src, kGoodbye), kGoodbyeFrameLen);
  // link.md §4: broadcast, the closing port's MAC, EtherType 0x88B5, the kind, zero padding.
  EXPECT_TRUE(std::equal(kBroadcastMac.begin(), kBroadcastMac.end(), f.begin()));
  EXPECT_TRUE(std::equal(src.begin(), src.end(), f.begin() + 6));
  EXPECT_EQ(f[12], 0x88);
  EXPECT_EQ(f[13], 0xb5);
  EXPECT_EQ(f[14], 1);
  EXPECT_TRUE(std::all_of(f.begin() + 15, f.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_EQ(goodbye_kind(f), std::optional<uint8_t>(kGoodbye));
  ASSERT_EQ(build_goodbye(f, src, kGoodbyeAck), kGoodbyeFrameLen);
  EXPECT_EQ(goodbye_kind(f), std::optional<uint8_t>(kGoodbyeAck));
  // A kind the receiver does not know is still a goodbye frame (to be ignored), never traffic.
  f[14] = 9;
  EXPECT_EQ(goodbye_kind(f), std::optional<uint8_t>(9));
  EXPECT_EQ(goodbye_kind(std::span<const uint8_t>(f.data(), 14)), std::nullopt);
  std::vector<uint8_t> arp(kArpFrameLen);
  build_arp(arp, ArpPacket{ArpOp::kRequest, src, 1, {}, 2});
  EXPECT_EQ(goodbye_kind(arp), std::nullopt);
  std::vector<uint8_t> small(kGoodbyeFrameLen - 1);
  EXPECT_EQ(build_goodbye(small, src, kGoodbye), 0u);
}

TEST(Arp, MalformedArpIsRefused) {
  ArpPacket req{ArpOp::kRequest, {2, 0, 0, 0, 0, 1}, 1, {}, 2};
  std::vector<uint8_t> good(kArpFrameLen);
  build_arp(good, req);
  { auto f = good; f.resize(kEthHeaderLen + 27); EXPECT_EQ(parse_frame(f, 1).error, FrameError::kTruncated); }
  for (size_t at : {size_t{14 + 1}, size_t{14 + 3}, size_t{14 + 4}, size_t{14 + 5}, size_t{14 + 7}}) {
    auto f = good;
    f[at] ^= 0x10;
    EXPECT_EQ(parse_frame(f, 1).error, FrameError::kArpFormat) << at;
  }
}

}  // namespace
}  // namespace metaroce::wire
