// SPDX-License-Identifier: Apache-2.0
// Writes the wire target's seed corpus (tests/fuzz/corpus/wire/): one valid packet of every kind
// the encoders make, bare and inside an Ethernet/IPv4/UDP frame, ARP and IGMP. Run by
// make_seeds.sh; its output is committed, so that the fuzzer starts from packets that decode.
#include <cstdio>
#include <string>
#include <vector>

#include "datapath/wire/frame.h"
#include "datapath/wire/mrh.h"

namespace metaroce::wire {
namespace {

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f)) {
    std::perror(path.c_str());
    std::exit(1);
  }
}

BaseHeader base(Opcode op) {
  BaseHeader b;
  b.opcode = op;
  b.conn_id = 0x11223344;
  b.token = 0x0102030405060708;
  b.path_id = 2;
  b.path_count = 4;
  b.path_seq = 9;
  b.timestamp = 123456;
  b.ack_floor = 7;
  return b;
}

std::vector<uint8_t> data(Opcode op, uint16_t flags, uint32_t payload) {
  BaseHeader b = base(op);
  b.flags = flags;
  DataHeader d;
  d.dst_stream = 1001;
  d.src_stream = 1;
  d.msn = 5;
  d.rsn = (op == Opcode::kSend || op == Opcode::kSendImm || op == Opcode::kWriteImm) ? 3 : 0;
  d.total_length = op == Opcode::kReadReq ? 4096 : payload;
  d.remote_addr = 0x10000;
  d.rkey = 7;
  d.imm = 0xdeadbeef;
  d.payload_len = payload;
  d.orig_seq = (flags & kFlagFailoverCopy) ? 4 : 0;
  d.xrc_srqn = (flags & kFlagXrc) ? 0x123456 : 0;
  std::vector<uint8_t> out(data_headers_len(flags) + payload);
  const size_t n = encode_data(out, b, d);
  for (size_t i = n; i < out.size(); ++i) out[i] = static_cast<uint8_t>(i);
  return out;
}

std::vector<uint8_t> ack(std::vector<NakRecord> naks) {
  AckHeader a;
  a.cum_seq = 9;
  a.sack = {0x5, 0, 0, 1ull << 63};
  a.echo_timestamp = 123000;
  a.ecn_ce_count = 2;
  a.rate_hint = 25000;
  std::vector<uint8_t> out(kAckHeadersLen + naks.size() * kNakRecordLen);
  BaseHeader b = base(Opcode::kAck);
  b.path_seq = b.ack_floor = 0;
  encode_ack(out, b, a, naks);
  return out;
}

std::vector<uint8_t> frame(const std::vector<uint8_t>& payload, bool checksum) {
  UdpFrameParams p;
  p.src_mac = {2, 0, 0, 0, 0, 1};
  p.dst_mac = {2, 0, 0, 0, 0, 2};
  p.src_ip = 0xc6120001;  // 198.18.0.1
  p.dst_ip = 0xc6120002;
  p.src_port = 49200;
  p.dst_port = kDefaultUdpPort;
  p.dscp = 26;
  p.udp_checksum = checksum;
  std::vector<uint8_t> out(kUdpFrameHeaderLen + payload.size());
  out.resize(build_udp_frame(out, p, payload));
  return out;
}

std::vector<uint8_t> arp(ArpOp op) {
  ArpPacket a;
  a.op = op;
  a.sender_mac = {2, 0, 0, 0, 0, 1};
  a.sender_ip = 0xc6120001;
  a.target_mac = {2, 0, 0, 0, 0, 2};
  a.target_ip = 0xc6120002;
  std::vector<uint8_t> out(kArpFrameLen);
  build_arp(out, a);
  return out;
}

// An IGMP report of 230.18.0.1, or (query) a general query made from one.
std::vector<uint8_t> igmp(bool query) {
  std::vector<uint8_t> out(kIgmpFrameLen);
  build_igmp(out, {2, 0, 0, 0, 0, 1}, 0xc6120001, IgmpType::kV2Report, 0xe6120001);
  if (query) {
    uint8_t* g = out.data() + kEthHeaderLen + 24;
    g[0] = static_cast<uint8_t>(IgmpType::kQuery);
    g[1] = 100;
    std::fill(g + 2, g + 8, 0);
    const uint16_t sum = static_cast<uint16_t>(~ones_complement_sum({g, 8}));
    g[2] = static_cast<uint8_t>(sum >> 8);
    g[3] = static_cast<uint8_t>(sum);
  }
  return out;
}

}  // namespace
}  // namespace metaroce::wire

int main(int argc, char** argv) {
  using namespace metaroce::wire;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  const std::vector<std::pair<std::string, std::vector<uint8_t>>> seeds = {
      {"write", data(Opcode::kWrite, 0, 100)},
      {"write-imm", data(Opcode::kWriteImm, kFlagMore, 0)},
      {"send-xrc", data(Opcode::kSend, kFlagXrc, 64)},
      {"send-inv", data(Opcode::kSendInv, 0, 16)},
      {"read-req", data(Opcode::kReadReq, 0, 0)},
      {"read-resp", data(Opcode::kReadResp, 0, 200)},
      {"atomic-cas", data(Opcode::kAtomicCmpSwp, 0, kAtomicRequestLen)},
      {"atomic-write", data(Opcode::kAtomicWrite, 0, kAtomicWriteLen)},
      {"failover-copy", data(Opcode::kWrite, failover_flags(1) | kFlagRedundant, 32)},
      {"probe", [] {
         std::vector<uint8_t> out(kBaseHeaderLen);
         encode_base(out, base(Opcode::kProbe));
         return out;
       }()},
      {"ack", ack({})},
      {"ack-naks", ack({{9, 1, 5, 1, kRnrTimerValid | 12}, {10, 1, 6, 2, 0}, {11, 2, 0, 7, 0}})},
      {"frame-write", frame(data(Opcode::kWrite, 0, 100), false)},
      {"frame-ack-csum", frame(ack({{9, 1, 5, 3, 0}}), true)},
      {"arp-request", arp(ArpOp::kRequest)},
      {"arp-reply", arp(ArpOp::kReply)},
      {"igmp-report", igmp(false)},
      {"igmp-query", igmp(true)},
  };
  for (const auto& [name, bytes] : seeds) write_file(dir + "/" + name, bytes);
  return 0;
}
