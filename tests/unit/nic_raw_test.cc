// SPDX-License-Identifier: Apache-2.0
// Raw packet QPs and flow steering on the NIC core (docs/spec/verbs-mapping.md §18): the headers
// rules see, how rules match and in which order they take a frame, and frames out of a raw QP
// onto an in-memory link and into the raw QPs of both devices whose rules match.
#include <arpa/inet.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "datapath/io/mem_link.h"
#include "datapath/nic/flow_table.h"
#include "tests/unit/nic_harness.h"

namespace metaroce::nic {
namespace {

using namespace metaroce::nic::test;
using hostif::FlowRule;
using hostif::FlowType;

constexpr uint32_t kIpA = 0xC6120001, kIpB = 0xC6120002;
const uint8_t kDstMac[6] = {0x01, 0x50, 0x56, 0x19, 0x20, 0xa7};  // multicast
const uint8_t kSrcMac[6] = {0x24, 0x8a, 0x07, 0xa5, 0x28, 0xc8};

// Ethernet | IPv4 or IPv6 | UDP or TCP, as pyverbs' tests build them (IPv4 checksum 0).
std::vector<uint8_t> frame(bool ipv6, bool tcp, uint32_t src_ip4 = 0x01010101,
                           uint16_t sport = 1234, size_t payload = 40, bool vlan = false) {
  std::vector<uint8_t> f;
  f.insert(f.end(), kDstMac, kDstMac + 6);
  f.insert(f.end(), kSrcMac, kSrcMac + 6);
  if (vlan) f.insert(f.end(), {0x81, 0x00, 0xac, 0x0c});
  const uint8_t l4len = tcp ? 20 : 8;
  if (!ipv6) {
    f.insert(f.end(), {0x08, 0x00, 0x45, 0x00, 0, static_cast<uint8_t>(20 + l4len + payload), 0, 0,
                       0x40, 0x00, 64, static_cast<uint8_t>(tcp ? 6 : 17), 0, 0});
    for (int i = 3; i >= 0; --i) f.push_back(static_cast<uint8_t>(src_ip4 >> (8 * i)));
    f.insert(f.end(), {2, 2, 2, 2});
  } else {
    f.insert(f.end(), {0x86, 0xdd, 0x60, 0x00, 0x00, 0x00, 0,
                       static_cast<uint8_t>(l4len + payload), static_cast<uint8_t>(tcp ? 6 : 17), 64});
    for (int i = 0; i < 16; ++i) f.push_back(static_cast<uint8_t>(0xa0 + i));
    for (int i = 0; i < 16; ++i) f.push_back(static_cast<uint8_t>(0xb0 + i));
  }
  f.insert(f.end(), {static_cast<uint8_t>(sport >> 8), static_cast<uint8_t>(sport), 0x16, 0x2e});
  f.resize(f.size() + l4len - 4, 0);
  for (size_t i = 0; i < payload; ++i) f.push_back(static_cast<uint8_t>(i * 3 + 1));
  return f;
}

FlowRule eth_rule(uint16_t ether_type) {
  FlowRule r;
  std::memcpy(r.dst_mac, kDstMac, 6);
  std::memset(r.dst_mac_mask, 0xff, 6);
  // pyverbs' test sets the source MAC's mask to the MAC itself: a partial mask.
  std::memcpy(r.src_mac, kSrcMac, 6);
  std::memcpy(r.src_mac_mask, kSrcMac, 6);
  r.ether_type = htons(ether_type);
  r.ether_type_mask = 0xffff;
  return r;
}

TEST(FlowMatch, HeadersAreReadWhateverTheChecksumAndRulesMatchUnderTheirMasks) {
  const auto v4 = frame(false, false);
  const auto h = parse_headers(v4);
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->l3, 4);
  EXPECT_EQ(h->l4, 17);
  EXPECT_EQ(ntohs(h->src_port), 1234);
  EXPECT_EQ(ntohs(h->dst_port), 5678);
  EXPECT_TRUE(matches(eth_rule(0x0800), *h));
  EXPECT_FALSE(matches(eth_rule(0x86dd), *h));
  FlowRule ip = FlowRule{};
  ip.l3 = 4;
  const uint8_t src[4] = {1, 1, 1, 1}, dst[4] = {2, 2, 2, 2};
  std::memcpy(ip.src_ip, src, 4);
  std::memset(ip.src_ip_mask, 0xff, 4);
  std::memcpy(ip.dst_ip, dst, 4);
  std::memset(ip.dst_ip_mask, 0xff, 4);
  ip.proto = 17;
  ip.proto_mask = 0xff;
  EXPECT_TRUE(matches(ip, *h));
  EXPECT_FALSE(matches(ip, *parse_headers(frame(false, false, 0x01010102))));
  EXPECT_FALSE(matches(ip, *parse_headers(frame(true, false))));  // IPv6 is not IPv4
  FlowRule udp = ip;
  udp.l4 = 17;
  udp.dst_port = htons(5678);
  udp.dst_port_mask = 0xffff;
  EXPECT_TRUE(matches(udp, *h));
  udp.dst_port = htons(5679);
  EXPECT_FALSE(matches(udp, *h));
  // IPv6 with TCP.
  const auto h6 = parse_headers(frame(true, true));
  ASSERT_TRUE(h6.has_value());
  EXPECT_EQ(h6->l3, 6);
  EXPECT_EQ(h6->l4, 6);
  FlowRule tcp6;
  tcp6.l3 = 6;
  tcp6.l4 = 6;
  for (int i = 0; i < 16; ++i) {
    tcp6.dst_ip[i] = static_cast<uint8_t>(0xb0 + i);
    tcp6.dst_ip_mask[i] = 0xff;
  }
  tcp6.src_port = htons(1234);
  tcp6.src_port_mask = 0xffff;
  EXPECT_TRUE(matches(tcp6, *h6));
  EXPECT_FALSE(matches(tcp6, *parse_headers(frame(true, false))));  // UDP is not TCP
  // A VLAN tag: the ether type after it; a rule on the tag needs one.
  const auto hv = parse_headers(frame(false, false, 0x01010101, 1234, 40, true));
  ASSERT_TRUE(hv.has_value());
  EXPECT_TRUE(hv->has_vlan);
  EXPECT_TRUE(matches(eth_rule(0x0800), *hv));
  FlowRule tagged = eth_rule(0x0800);
  tagged.vlan_tag = htons(0xac0c);
  tagged.vlan_tag_mask = 0xffff;
  EXPECT_TRUE(matches(tagged, *hv));
  EXPECT_FALSE(matches(tagged, *h));
  // Short frames.
  EXPECT_FALSE(parse_headers(std::vector<uint8_t>(13)).has_value());
  const auto cut = parse_headers(std::span(v4).first(20));
  ASSERT_TRUE(cut.has_value());
  EXPECT_EQ(cut->l3, 0);  // an IPv4 header cut short is no IPv4 header
  // Rules a NIC could not apply.
  FlowRule bad;
  bad.src_port_mask = 0xffff;  // a port without its protocol
  EXPECT_FALSE(rule_valid(bad));
  bad = FlowRule{};
  bad.l3 = 4;
  bad.src_ip_mask[8] = 0xff;  // past an IPv4 address
  EXPECT_FALSE(rule_valid(bad));
  EXPECT_TRUE(rule_valid(tcp6));
  EXPECT_TRUE(rule_valid(FlowRule{}));
}

TEST(FlowMatch, TheBestPriorityTakesAFrameUnlessItLetsItOnAndDefaultsTakeTheRest) {
  FlowTable t;
  FlowTable::Flow f;
  uint32_t id = 0;
  f.qpn = 10;
  f.priority = 5;
  f.rule = eth_rule(0x0800);
  ASSERT_EQ(t.add(f, &id), 0);
  f.qpn = 11;
  f.priority = 1;  // better
  ASSERT_EQ(t.add(f, &id), 0);
  const uint32_t best = id;
  f.qpn = 12;
  f.priority = 1;  // as good: both take it
  ASSERT_EQ(t.add(f, &id), 0);
  f.qpn = 13;
  f.type = FlowType::kSniffer;
  f.rule = FlowRule{};
  ASSERT_EQ(t.add(f, &id), 0);
  f.qpn = 14;
  f.type = FlowType::kMcDefault;
  ASSERT_EQ(t.add(f, &id), 0);
  const auto h = *parse_headers(frame(false, false));
  std::vector<uint32_t> q;
  t.steer(h, &q);
  EXPECT_EQ(q, (std::vector<uint32_t>{13, 11, 12}));
  // A frame no normal rule takes goes to the (multicast) default.
  q.clear();
  t.steer(*parse_headers(frame(true, false)), &q);
  EXPECT_EQ(q, (std::vector<uint32_t>{13, 14}));
  // Without the trapping rules at priority 1, priority 5 takes it.
  ASSERT_TRUE(t.remove(best));
  t.remove_qp(12);
  q.clear();
  t.steer(h, &q);
  EXPECT_EQ(q, (std::vector<uint32_t>{13, 10}));
  // A rule that does not trap lets the next priority have it too.
  FlowTable::Flow g;
  g.qpn = 20;
  g.priority = 0;
  g.dont_trap = true;
  g.rule = eth_rule(0x0800);
  ASSERT_EQ(t.add(g, &id), 0);
  q.clear();
  t.steer(h, &q);
  EXPECT_EQ(q, (std::vector<uint32_t>{13, 20, 10}));
  EXPECT_EQ(t.count_of(10), 1u);
}

// Microsoft's RSS verification suite: its key, and two of its IPv4 cases.
TEST(Rss, ToeplitzGivesTheVerificationSuitesHashes) {
  const uint8_t key[40] = {0x6d, 0x5a, 0x56, 0xda, 0x25, 0x5b, 0x0e, 0xc2, 0x41, 0x67,
                           0x25, 0x3d, 0x43, 0xa3, 0x8f, 0xb0, 0xd0, 0xca, 0x2b, 0xcb,
                           0xae, 0x7b, 0x30, 0xb4, 0x77, 0xcb, 0x2d, 0xa3, 0x80, 0x30,
                           0xf2, 0x0c, 0x6a, 0x42, 0xb7, 0x3b, 0xbe, 0xac, 0x01, 0xfa};
  struct Case {
    uint8_t src[4], dst[4];
    uint16_t sport, dport;
    uint32_t ip_only, with_ports;
  };
  const Case cases[] = {
      {{66, 9, 149, 187}, {161, 142, 100, 80}, 2794, 1766, 0x323e8fc2, 0x51ccc178},
      {{199, 92, 111, 2}, {65, 69, 140, 83}, 14230, 4739, 0xd718262a, 0xc626b0ea},
  };
  for (const Case& c : cases) {
    // A TCP frame from c.src:sport to c.dst:dport.
    auto f = frame(false, true);
    std::memcpy(f.data() + 26, c.src, 4);
    std::memcpy(f.data() + 30, c.dst, 4);
    f[34] = static_cast<uint8_t>(c.sport >> 8);
    f[35] = static_cast<uint8_t>(c.sport);
    f[36] = static_cast<uint8_t>(c.dport >> 8);
    f[37] = static_cast<uint8_t>(c.dport);
    const auto h = *parse_headers(f);
    uint8_t in[36];
    size_t n = rss_input(h, hostif::kRssSrcIpv4 | hostif::kRssDstIpv4, in);
    ASSERT_EQ(n, 8u);
    EXPECT_EQ(toeplitz(key, {in, n}), c.ip_only);
    n = rss_input(h, hostif::kRssFields, in);
    ASSERT_EQ(n, 12u);
    EXPECT_EQ(toeplitz(key, {in, n}), c.with_ports);
    // UDP port fields say nothing of a TCP frame.
    EXPECT_EQ(rss_input(h, hostif::kRssSrcPortUdp | hostif::kRssDstPortUdp, in), 0u);
  }
}

constexpr unsigned kAccess = kLocalWrite | kRemoteWrite | kRemoteRead;

hostif::QpCaps caps() {
  hostif::QpCaps c;
  c.max_send_wr = c.max_recv_wr = 16;
  c.max_send_sge = c.max_recv_sge = 2;
  c.max_inline = 128;
  return c;
}

struct RawSide {
  TestOwner owner;
  uint32_t pd = 0, key = 0;
  std::unique_ptr<TestCq> cq;
  std::unique_ptr<TestQp> qp;
  std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 16);
  void open(Nic& nic) {
    ASSERT_EQ(nic.alloc_pd(&owner, &pd), 0);
    cq = std::make_unique<TestCq>(nic, &owner, 64);
    qp = std::make_unique<TestQp>(nic, &owner, pd, *cq, *cq, caps(), QpType::kRaw);
    ASSERT_EQ(qp->err, 0);
    uint32_t rkey;
    ASSERT_EQ(nic.reg_mr(&owner, pd, reinterpret_cast<uint64_t>(buf.data()), buf.size(), kAccess,
                         &key, &rkey), 0);
    // RESET -> INIT -> RTR -> RTS, with nothing to say about a peer.
    qp->set_state(QpState::kInit);
    qp->set_state(QpState::kRtr);
    qp->set_state(QpState::kRts);
  }
  Sge sge(size_t off, uint32_t len) {
    return Sge{reinterpret_cast<uint64_t>(buf.data() + off), len, key};
  }
  void post_recvs(int n, size_t off = 8192, uint32_t len = 2048) {
    for (int i = 0; i < n; ++i) {
      RecvWqe r;
      r.wr_id = 100 + i;
      r.num_sge = 1;
      r.sge[0] = sge(off + i * len, len);
      ASSERT_EQ(qp->post_recv(r), 0);
    }
  }
};

class NicRawTest : public ::testing::Test {
 protected:
  void SetUp() override {
    io::MemLinkConfig lc;
    lc.queue_frames = 1024;
    auto [pa, pb] = io::make_mem_link(lc);
    std::vector<std::unique_ptr<io::Port>> va, vb;
    va.push_back(std::move(pa));
    vb.push_back(std::move(pb));
    a_ = std::make_unique<Device>(test_link("a", kIpA), std::move(va), 1);
    b_ = std::make_unique<Device>(test_link("b", kIpB), std::move(vb), 2);
    client_.open(*a_->nic);
    server_.open(*a_->nic);
    remote_.open(*b_->nic);
  }
  void step() {
    clock_ += std::chrono::microseconds(10);
    a_->progress(clock_);
    b_->progress(clock_);
  }
  std::vector<Cqe> run_until(TestCq& cq, size_t want, int rounds = 2000) {
    std::vector<Cqe> got;
    for (int i = 0; i < rounds && got.size() < want; ++i) {
      step();
      Cqe c[8];
      const int n = cq.poll(8, c);
      got.insert(got.end(), c, c + n);
    }
    return got;
  }
  // Sends `bytes` as one frame from the client (written into its buffer first).
  void send(const std::vector<uint8_t>& bytes, uint64_t wr_id = 1) {
    std::memcpy(client_.buf.data(), bytes.data(), bytes.size());
    SendWqe w;
    w.wr_id = wr_id;
    w.op = WqeOp::kSend;
    w.signaled = true;
    w.num_sge = 1;
    w.sge[0] = client_.sge(0, static_cast<uint32_t>(bytes.size()));
    ASSERT_EQ(client_.qp->post_send(w), 0);
  }
  uint32_t add_flow(RawSide& s, Nic& nic, const FlowRule& r, uint32_t priority = 0) {
    hostif::CreateFlowReq req;
    req.qpn = s.qp->qpn();
    req.priority = priority;
    req.rule = r;
    uint32_t id = 0;
    EXPECT_EQ(nic.create_flow(&s.owner, req, &id), 0);
    return id;
  }

  transport::Time clock_{std::chrono::seconds(1)};
  std::unique_ptr<Device> a_, b_;
  RawSide client_, server_, remote_;
};

TEST_F(NicRawTest, AFrameLeavesOnThePortAndReachesTheRawQpsWhoseRulesMatchOnBothDevices) {
  add_flow(server_, *a_->nic, eth_rule(0x0800));
  add_flow(remote_, *b_->nic, eth_rule(0x0800));
  server_.post_recvs(2);
  remote_.post_recvs(2);
  client_.post_recvs(2);  // no rule: it gets nothing of its own
  const auto f = frame(false, false);
  send(f);
  auto sc = run_until(*client_.cq, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].status, WcStatus::kSuccess);
  EXPECT_EQ(sc[0].opcode, hostif::WcOpcode::kSend);
  for (RawSide* s : {&server_, &remote_}) {
    auto rc = run_until(*s->cq, 1);
    ASSERT_EQ(rc.size(), 1u);
    EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
    EXPECT_EQ(rc[0].opcode, hostif::WcOpcode::kRecv);
    EXPECT_EQ(rc[0].byte_len, f.size());
    EXPECT_EQ(rc[0].wr_id, 100u);
    EXPECT_EQ(std::memcmp(s->buf.data() + 8192, f.data(), f.size()), 0);
  }
  Cqe c[4];
  EXPECT_EQ(client_.cq->poll(4, c), 0);
  EXPECT_EQ(a_->nic->counters().raw_tx, 1u);
  EXPECT_EQ(b_->layer->counters().rx_raw, 1u);
  // An IPv6 frame matches no rule: nobody gets it.
  send(frame(true, false), 2);
  ASSERT_EQ(run_until(*client_.cq, 1).size(), 1u);
  for (int i = 0; i < 50; ++i) step();
  EXPECT_EQ(server_.cq->poll(4, c), 0);
  EXPECT_EQ(remote_.cq->poll(4, c), 0);
  EXPECT_EQ(b_->layer->counters().rx_drop_not_ours, 1u);
}

TEST_F(NicRawTest, AFrameWithNoReceivePostedIsDroppedAndATooShortReceiveIsALengthError) {
  add_flow(server_, *a_->nic, eth_rule(0x0800));
  send(frame(false, false));
  ASSERT_EQ(run_until(*client_.cq, 1).size(), 1u);
  for (int i = 0; i < 20; ++i) step();
  EXPECT_EQ(a_->nic->counters().raw_rx_no_recv, 1u);
  RecvWqe r;
  r.wr_id = 7;
  r.num_sge = 1;
  r.sge[0] = server_.sge(8192, 20);  // shorter than the frame
  ASSERT_EQ(server_.qp->post_recv(r), 0);
  server_.post_recvs(1);
  send(frame(false, false), 2);
  auto rc = run_until(*server_.cq, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].wr_id, 7u);
  EXPECT_EQ(rc[0].status, WcStatus::kLocLenErr);
  // The QP goes on: the next frame lands in the next receive.
  send(frame(false, false), 3);
  rc = run_until(*server_.cq, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
}

TEST_F(NicRawTest, WhatARawQpCannotSendFailsAndItsFlowsGoBeforeIt) {
  // Too short for an Ethernet header; too long for the link; not a SEND.
  send(std::vector<uint8_t>(10, 0), 1);
  auto sc = run_until(*client_.cq, 1);
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].status, WcStatus::kLocLenErr);
  EXPECT_EQ(client_.qp->state(), QpState::kErr);
  EXPECT_EQ(a_->nic->counters().raw_tx, 0u);
  // A raw QP is no transport stream.
  transport::Segment seg;
  seg.peer_ip = kIpB;
  seg.op = transport::Op::kSend;
  seg.dst_stream = server_.qp->qpn();
  EXPECT_EQ(a_->nic->find_qp(server_.qp->qpn())->deliver(seg), transport::Syndrome::kUnreachable);
  // Flows: only the owner's raw QPs, only rules a NIC can apply; a QP with flows is busy.
  hostif::CreateFlowReq req;
  req.qpn = server_.qp->qpn();
  uint32_t id = 0;
  TestOwner stranger;
  EXPECT_EQ(a_->nic->create_flow(&stranger, req, &id), EINVAL);
  req.rule.src_port_mask = 0xffff;
  EXPECT_EQ(a_->nic->create_flow(&server_.owner, req, &id), EINVAL);
  req.rule = eth_rule(0x0800);
  req.flags = hostif::kFlowDontTrap;
  req.type = FlowType::kSniffer;
  EXPECT_EQ(a_->nic->create_flow(&server_.owner, req, &id), EINVAL);
  req.type = FlowType::kNormal;
  ASSERT_EQ(a_->nic->create_flow(&server_.owner, req, &id), 0);
  EXPECT_EQ(a_->nic->destroy_qp(&server_.owner, server_.qp->qpn()), EBUSY);
  EXPECT_EQ(a_->nic->destroy_flow(&stranger, id), EINVAL);
  EXPECT_EQ(a_->nic->destroy_flow(&server_.owner, id), 0);
  EXPECT_EQ(a_->nic->destroy_flow(&server_.owner, id), EINVAL);
  EXPECT_EQ(a_->nic->destroy_qp(&server_.owner, server_.qp->qpn()), 0);
  // A process that goes away takes its flows, tables and WQs with it.
  add_flow(remote_, *b_->nic, eth_rule(0x0800));
  TestQp wq(*b_->nic, &remote_.owner, remote_.pd, *remote_.cq, *remote_.cq, caps(), QpType::kWq);
  hostif::IndTableReq t;
  t.wqn[0] = wq.qpn();
  ASSERT_EQ(b_->nic->create_ind_table(&remote_.owner, t, &id), 0);
  EXPECT_EQ(b_->nic->owned_by(&remote_.owner).flows, 1u);
  EXPECT_EQ(b_->nic->owned_by(&remote_.owner).ind_tables, 1u);
  b_->nic->release(&remote_.owner);
  EXPECT_FALSE(b_->nic->owns_anything(&remote_.owner));
}

TEST_F(NicRawTest, RulesDoNotTakeTheTransportsOwnTraffic) {
  // A rule for every IPv4 frame on device b, and an RC SEND from a to b: the transport's frames
  // are not the rule's.
  FlowRule all4;
  all4.ether_type = htons(0x0800);
  all4.ether_type_mask = 0xffff;
  add_flow(remote_, *b_->nic, all4);
  remote_.post_recvs(4);
  TestCq cqa(*a_->nic, &client_.owner, 16), cqb(*b_->nic, &remote_.owner, 16);
  TestQp qa(*a_->nic, &client_.owner, client_.pd, cqa, cqa, caps());
  TestQp qb(*b_->nic, &remote_.owner, remote_.pd, cqb, cqb, caps());
  for (auto [q, ip, peer] : {std::tuple{&qa, kIpB, &qb}, std::tuple{&qb, kIpA, &qa}}) {
    q->set_access(kAccess);
    q->set_state(QpState::kInit);
    hostif::QpRemote r;
    r.ip = ip;
    r.qpn = peer->qpn();
    q->set_remote(r);
    q->set_state(QpState::kRtr);
    q->set_state(QpState::kRts);
  }
  RecvWqe r;
  r.wr_id = 9;
  r.num_sge = 1;
  r.sge[0] = remote_.sge(0, 4096);
  ASSERT_EQ(qb.post_recv(r), 0);
  SendWqe w;
  w.wr_id = 1;
  w.op = WqeOp::kSend;
  w.signaled = true;
  w.num_sge = 1;
  w.sge[0] = client_.sge(0, 1000);
  ASSERT_EQ(qa.post_send(w), 0);
  auto rc = run_until(cqb, 1);
  ASSERT_EQ(rc.size(), 1u);
  EXPECT_EQ(rc[0].status, WcStatus::kSuccess);
  Cqe c[4];
  EXPECT_EQ(remote_.cq->poll(4, c), 0);
  EXPECT_EQ(b_->layer->counters().rx_raw, 0u);
}

// RSS: an RSS QP's flows steer frames to the WQs of its indirection table, each frame to the
// entry its Toeplitz hash picks; tables and WQs in use are busy.
TEST_F(NicRawTest, AnRssQpSpreadsFramesOverItsTablesWqsByTheirHash) {
  Nic& nic = *a_->nic;
  RawSide& s = server_;
  constexpr uint32_t kLog = 2;
  std::vector<std::unique_ptr<TestQp>> wqs;
  hostif::IndTableReq t;
  t.log_size = kLog;
  for (uint32_t i = 0; i < (1u << kLog); ++i) {
    wqs.push_back(std::make_unique<TestQp>(nic, &s.owner, s.pd, *s.cq, *s.cq, caps(),
                                           QpType::kWq));
    ASSERT_EQ(wqs.back()->err, 0);
    wqs.back()->set_state(QpState::kRtr);  // IBV_WQS_RDY
    for (int k = 0; k < 8; ++k) {
      RecvWqe r;
      r.wr_id = uint64_t{i} << 8 | k;
      r.num_sge = 1;
      r.sge[0] = s.sge(4096 + (i * 8 + k) * 256, 256);
      ASSERT_EQ(wqs.back()->post_recv(r), 0);
    }
    t.wqn[i] = wqs.back()->qpn();
  }
  uint32_t table = 0;
  TestOwner stranger;
  EXPECT_EQ(nic.create_ind_table(&stranger, t, &table), EINVAL);  // not its WQs
  t.wqn[3] = client_.qp->qpn();
  EXPECT_EQ(nic.create_ind_table(&s.owner, t, &table), EINVAL);  // a raw QP is no WQ
  t.wqn[3] = wqs[3]->qpn();
  ASSERT_EQ(nic.create_ind_table(&s.owner, t, &table), 0);
  const uint8_t key[40] = {0x6d, 0x5a, 0x56, 0xda, 0x25, 0x5b, 0x0e, 0xc2, 0x41, 0x67,
                           0x25, 0x3d, 0x43, 0xa3, 0x8f, 0xb0, 0xd0, 0xca, 0x2b, 0xcb,
                           0xae, 0x7b, 0x30, 0xb4, 0x77, 0xcb, 0x2d, 0xa3, 0x80, 0x30,
                           0xf2, 0x0c, 0x6a, 0x42, 0xb7, 0x3b, 0xbe, 0xac, 0x01, 0xfa};
  hostif::CreateRssQpReq rq;
  rq.pd = s.pd;
  rq.table = table;
  rq.key_len = sizeof(key);
  std::memcpy(rq.key, key, sizeof(key));
  rq.fields = hostif::kRssSrcIpv4 | hostif::kRssDstIpv4;
  Ring ring(hostif::qp_layout(hostif::QpCaps{}).bytes);
  hostif::init_qp(ring.mem, 0, QpType::kRss, hostif::QpCaps{});
  auto* header = reinterpret_cast<hostif::QpHeader*>(ring.mem);
  uint32_t rss = 0;
  hostif::CreateRssQpReq bad = rq;
  bad.key_len = 0;
  EXPECT_EQ(nic.create_rss_qp(&s.owner, bad, header, &rss), EINVAL);
  bad = rq;
  bad.function = 2;
  EXPECT_EQ(nic.create_rss_qp(&s.owner, bad, header, &rss), EINVAL);
  ASSERT_EQ(nic.create_rss_qp(&s.owner, rq, header, &rss), 0);
  hostif::CreateFlowReq f;
  f.qpn = rss;
  f.rule = eth_rule(0x0800);
  uint32_t flow = 0;
  ASSERT_EQ(nic.create_flow(&s.owner, f, &flow), 0);
  // 16 frames from 16 sources: each lands in the WQ the hash of its addresses names.
  std::vector<uint32_t> per_wq(1u << kLog);
  for (uint32_t i = 0; i < 16; ++i) {
    const uint32_t src = 0x0a000001 + i * 0x01010101;
    const auto fr = frame(false, false, src);
    uint8_t in[8];
    for (int b = 0; b < 4; ++b) in[b] = static_cast<uint8_t>(src >> (24 - 8 * b));
    std::memset(in + 4, 2, 4);
    ++per_wq[toeplitz(key, in) & ((1u << kLog) - 1)];
    send(fr, 10 + i);
    ASSERT_EQ(run_until(*client_.cq, 1).size(), 1u);
  }
  const auto got = run_until(*s.cq, 16);
  ASSERT_EQ(got.size(), 16u);
  std::vector<uint32_t> seen(1u << kLog);
  for (const Cqe& c : got) {
    EXPECT_EQ(c.status, WcStatus::kSuccess);
    uint32_t i = 0;
    while (i < wqs.size() && wqs[i]->qpn() != c.qp_num) ++i;
    ASSERT_LT(i, wqs.size());
    EXPECT_EQ(c.wr_id >> 8, i);  // its own receive
    ++seen[i];
  }
  EXPECT_EQ(seen, per_wq);
  EXPECT_GE(std::count_if(seen.begin(), seen.end(), [](uint32_t n) { return n > 0; }), 2);
  // What holds what: the flow its QP, the QP its table, the table its WQs.
  EXPECT_EQ(nic.destroy_qp(&s.owner, wqs[0]->qpn()), EBUSY);
  EXPECT_EQ(nic.destroy_ind_table(&s.owner, table), EBUSY);
  EXPECT_EQ(nic.destroy_qp(&s.owner, rss), EBUSY);
  EXPECT_EQ(nic.destroy_flow(&s.owner, flow), 0);
  EXPECT_EQ(nic.destroy_qp(&s.owner, rss), 0);
  EXPECT_EQ(nic.destroy_ind_table(&stranger, table), EINVAL);
  EXPECT_EQ(nic.destroy_ind_table(&s.owner, table), 0);
  EXPECT_EQ(nic.destroy_qp(&s.owner, wqs[0]->qpn()), 0);
}

}  // namespace
}  // namespace metaroce::nic
