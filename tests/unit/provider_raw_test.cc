// SPDX-License-Identifier: Apache-2.0
// Unit tests of the provider's pure parts for raw packet QPs (verbs-mapping.md §18): the flow
// specifications ibv_create_flow walks, the raw packet and WQ state machines, the RSS caps.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "providers/metaroce/device_attr.h"
#include "providers/metaroce/flow_spec.h"
#include "providers/metaroce/qp_transition.h"
#include "providers/metaroce/wq.h"

namespace metaroce::provider {
namespace {

// An ibv_flow_attr followed by its specifications, laid out as libibverbs passes them.
class FlowAttr {
 public:
  FlowAttr() : bytes_(sizeof(ibv_flow_attr)) {
    attr().port = 1;
    attr().size = sizeof(ibv_flow_attr);
  }
  ibv_flow_attr& attr() { return *reinterpret_cast<ibv_flow_attr*>(bytes_.data()); }
  template <typename Spec>
  void add(const Spec& s) {
    const size_t at = bytes_.size();
    bytes_.resize(at + sizeof(Spec));
    std::memcpy(bytes_.data() + at, &s, sizeof(Spec));
    attr().num_of_specs++;
    attr().size = static_cast<uint16_t>(bytes_.size());
  }
  int parse(hostif::CreateFlowReq* out) { return parse_flow(attr(), out); }

 private:
  std::vector<uint8_t> bytes_;  // ibv_flow_attr is 8-byte aligned at the start of a vector's data
};

ibv_flow_spec_eth eth(uint16_t ether_type) {
  ibv_flow_spec_eth s{};
  s.type = IBV_FLOW_SPEC_ETH;
  s.size = sizeof(s);
  const uint8_t dst[6] = {0x01, 0x50, 0x56, 0x19, 0x20, 0xa7};
  std::memcpy(s.val.dst_mac, dst, 6);
  std::memset(s.mask.dst_mac, 0xff, 6);
  s.val.ether_type = htons(ether_type);
  s.mask.ether_type = 0xffff;
  return s;
}

ibv_flow_spec_ipv4_ext ipv4(uint8_t proto) {
  ibv_flow_spec_ipv4_ext s{};
  s.type = IBV_FLOW_SPEC_IPV4_EXT;
  s.size = sizeof(s);
  s.val.src_ip = htonl(0x01010101);
  s.mask.src_ip = 0xffffffff;
  s.val.dst_ip = htonl(0x02020202);
  s.mask.dst_ip = 0xffffffff;
  s.val.proto = proto;
  s.mask.proto = 0xff;
  return s;
}

ibv_flow_spec_ipv6 ipv6() {
  ibv_flow_spec_ipv6 s{};
  s.type = IBV_FLOW_SPEC_IPV6;
  s.size = sizeof(s);
  for (int i = 0; i < 16; ++i) s.val.dst_ip[i] = static_cast<uint8_t>(0xb0 + i);
  std::memset(s.mask.dst_ip, 0xff, 16);
  return s;
}

ibv_flow_spec_tcp_udp port(ibv_flow_spec_type type, uint16_t dst) {
  ibv_flow_spec_tcp_udp s{};
  s.type = type;
  s.size = sizeof(s);
  s.val.dst_port = htons(dst);
  s.mask.dst_port = 0xffff;
  return s;
}

TEST(FlowSpec, PyverbsEthIpv4UdpSpecsBecomeOneRule) {
  FlowAttr a;
  a.attr().priority = 3;
  a.add(eth(0x0800));
  a.add(ipv4(17));
  a.add(port(IBV_FLOW_SPEC_UDP, 5678));
  hostif::CreateFlowReq r;
  ASSERT_EQ(a.parse(&r), 0);
  EXPECT_EQ(r.priority, 3u);
  EXPECT_EQ(r.type, hostif::FlowType::kNormal);
  EXPECT_EQ(r.rule.ether_type, htons(0x0800));
  EXPECT_EQ(r.rule.dst_mac[0], 0x01);
  EXPECT_EQ(r.rule.l3, 4);
  EXPECT_EQ(r.rule.l4, 17);
  EXPECT_EQ(r.rule.proto, 17);
  const uint8_t src[4] = {1, 1, 1, 1};
  EXPECT_EQ(std::memcmp(r.rule.src_ip, src, 4), 0);
  EXPECT_EQ(r.rule.src_ip_mask[3], 0xff);
  EXPECT_EQ(r.rule.src_ip_mask[4], 0);  // an IPv4 rule says nothing past 4 bytes
  EXPECT_EQ(r.rule.dst_port, htons(5678));
  // The plain IPV4 specification: addresses only.
  FlowAttr plain;
  ibv_flow_spec_ipv4 v4{};
  v4.type = IBV_FLOW_SPEC_IPV4;
  v4.size = sizeof(v4);
  v4.val.dst_ip = htonl(0x02020202);
  v4.mask.dst_ip = 0xffffffff;
  plain.add(v4);
  ASSERT_EQ(plain.parse(&r), 0);
  EXPECT_EQ(r.rule.l3, 4);
  EXPECT_EQ(r.rule.dst_ip[0], 2);
  EXPECT_EQ(r.rule.dst_ip_mask[0], 0xff);
  EXPECT_EQ(r.rule.src_ip_mask[0], 0);
  EXPECT_EQ(r.rule.proto_mask, 0);
  // No specification at all: every frame (a rule of masks all zero).
  FlowAttr empty;
  ASSERT_EQ(empty.parse(&r), 0);
  EXPECT_EQ(r.rule.l3, 0);
  EXPECT_EQ(r.rule.ether_type_mask, 0);
}

TEST(FlowSpec, Ipv6TcpParsesAndContradictionsAreInvalid) {
  FlowAttr a;
  a.add(eth(0x86dd));
  a.add(ipv6());
  a.add(port(IBV_FLOW_SPEC_TCP, 80));
  hostif::CreateFlowReq r;
  ASSERT_EQ(a.parse(&r), 0);
  EXPECT_EQ(r.rule.l3, 6);
  EXPECT_EQ(r.rule.l4, 6);
  // IPv4 and IPv6 at once; TCP and UDP at once; a port without an IP header.
  FlowAttr both;
  both.add(ipv4(17));
  both.add(ipv6());
  EXPECT_EQ(both.parse(&r), EINVAL);
  FlowAttr two_l4;
  two_l4.add(ipv4(17));
  two_l4.add(port(IBV_FLOW_SPEC_TCP, 1));
  two_l4.add(port(IBV_FLOW_SPEC_UDP, 1));
  EXPECT_EQ(two_l4.parse(&r), EINVAL);
  FlowAttr bare_port;
  bare_port.add(port(IBV_FLOW_SPEC_UDP, 1));
  EXPECT_EQ(bare_port.parse(&r), EINVAL);
}

TEST(FlowSpec, WhatIsNotOfferedIsEopnotsuppAndWhatIsMalformedEinval) {
  hostif::CreateFlowReq r;
  // Tunnels and inner headers, egress rules: not offered.
  FlowAttr inner;
  auto e = eth(0x0800);
  e.type = static_cast<ibv_flow_spec_type>(IBV_FLOW_SPEC_ETH | IBV_FLOW_SPEC_INNER);
  inner.add(e);
  EXPECT_EQ(inner.parse(&r), EOPNOTSUPP);
  FlowAttr vxlan;
  ibv_flow_spec_tunnel t{};
  t.type = IBV_FLOW_SPEC_VXLAN_TUNNEL;
  t.size = sizeof(t);
  vxlan.add(t);
  EXPECT_EQ(vxlan.parse(&r), EOPNOTSUPP);
  FlowAttr egress;
  egress.attr().flags = IBV_FLOW_ATTR_FLAGS_EGRESS;
  EXPECT_EQ(egress.parse(&r), EOPNOTSUPP);
  // Another port, an unknown flag or type, DONT_TRAP on a default rule, a spec that claims
  // more bytes than the attribute holds, a spec shorter than its kind.
  FlowAttr port2;
  port2.attr().port = 2;
  EXPECT_EQ(port2.parse(&r), EINVAL);
  FlowAttr flag;
  flag.attr().flags = 1u << 7;
  EXPECT_EQ(flag.parse(&r), EINVAL);
  FlowAttr type;
  type.attr().type = static_cast<ibv_flow_attr_type>(IBV_FLOW_ATTR_SNIFFER + 1);
  EXPECT_EQ(type.parse(&r), EINVAL);
  FlowAttr trap;
  trap.attr().type = IBV_FLOW_ATTR_ALL_DEFAULT;
  trap.attr().flags = IBV_FLOW_ATTR_FLAGS_DONT_TRAP;
  EXPECT_EQ(trap.parse(&r), EINVAL);
  trap.attr().type = IBV_FLOW_ATTR_NORMAL;
  ASSERT_EQ(trap.parse(&r), 0);
  EXPECT_EQ(r.flags, uint32_t{hostif::kFlowDontTrap});
  FlowAttr longer;
  auto big = eth(0x0800);
  big.size = sizeof(big) + 8;
  longer.add(big);
  EXPECT_EQ(longer.parse(&r), EINVAL);
  FlowAttr shorter;
  auto small = ipv4(6);
  small.size = 8;
  shorter.add(small);
  EXPECT_EQ(shorter.parse(&r), EINVAL);
}

TEST(QpTransition, ARawPacketQpNeedsOnlyAPortAndOffersNoRateLimit) {
  EXPECT_EQ(check_raw_modify(IBV_QPS_RESET, IBV_QP_STATE | IBV_QP_PORT, IBV_QPS_INIT), 0);
  EXPECT_EQ(check_raw_modify(IBV_QPS_RESET, IBV_QP_STATE, IBV_QPS_INIT), EINVAL);
  EXPECT_EQ(check_raw_modify(IBV_QPS_INIT, IBV_QP_STATE, IBV_QPS_RTR), 0);
  EXPECT_EQ(check_raw_modify(IBV_QPS_INIT, IBV_QP_STATE | IBV_QP_AV, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_raw_modify(IBV_QPS_RTR, IBV_QP_STATE, IBV_QPS_RTS), 0);
  EXPECT_EQ(check_raw_modify(IBV_QPS_RTR, IBV_QP_STATE | IBV_QP_SQ_PSN, IBV_QPS_RTS), EINVAL);
  EXPECT_EQ(check_raw_modify(IBV_QPS_RESET, IBV_QP_STATE, IBV_QPS_RTS), EINVAL);
  EXPECT_EQ(check_raw_modify(IBV_QPS_RTS, IBV_QP_STATE, IBV_QPS_ERR), 0);
  EXPECT_EQ(check_raw_modify(IBV_QPS_ERR, IBV_QP_STATE, IBV_QPS_RESET), 0);
}

TEST(WqTransition, ReadyFromResetOrReadyAndErrorLeavesOnlyByReset) {
  EXPECT_EQ(check_wq_transition(IBV_WQS_RESET, IBV_WQS_RDY), 0);
  EXPECT_EQ(check_wq_transition(IBV_WQS_RDY, IBV_WQS_RDY), 0);
  EXPECT_EQ(check_wq_transition(IBV_WQS_RDY, IBV_WQS_ERR), 0);
  EXPECT_EQ(check_wq_transition(IBV_WQS_ERR, IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(check_wq_transition(IBV_WQS_ERR, IBV_WQS_RESET), 0);
  EXPECT_EQ(check_wq_transition(IBV_WQS_RDY, IBV_WQS_UNKNOWN), EINVAL);
}

TEST(DeviceAttr, ReportsFlowSteeringAndToeplitzRssOverRawPacketQps) {
  nic::LinkConfig cfg;
  const ibv_device_attr_ex a = device_attr(cfg);
  EXPECT_TRUE(a.orig_attr.device_cap_flags & IBV_DEVICE_MANAGED_FLOW_STEERING);
  EXPECT_EQ(a.rss_caps.supported_qpts, 1u << IBV_QPT_RAW_PACKET);
  EXPECT_EQ(a.rss_caps.rx_hash_function, uint32_t{IBV_RX_HASH_FUNC_TOEPLITZ});
  EXPECT_EQ(a.rss_caps.max_rwq_indirection_table_size, 256u);
  EXPECT_EQ(a.rss_caps.rx_hash_fields_mask,
            uint64_t{IBV_RX_HASH_SRC_IPV4 | IBV_RX_HASH_DST_IPV4 | IBV_RX_HASH_SRC_IPV6 |
                     IBV_RX_HASH_DST_IPV6 | IBV_RX_HASH_SRC_PORT_TCP | IBV_RX_HASH_DST_PORT_TCP |
                     IBV_RX_HASH_SRC_PORT_UDP | IBV_RX_HASH_DST_PORT_UDP});
  EXPECT_GT(a.max_wq_type_rq, 0u);
}

}  // namespace
}  // namespace metaroce::provider
