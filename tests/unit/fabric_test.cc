// SPDX-License-Identifier: Apache-2.0
// Tests of the fabric emulator's core on a virtual clock: forwarding, ECMP, queues, ECN marking,
// loss, reordering, duplication, black holes, the control protocol that changes a live fabric,
// and the idle policy of the runner's polling thread.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "datapath/fabric/fabric.h"
#include "datapath/fabric/fabric_control.h"
#include "datapath/fabric/idle_policy.h"
#include "datapath/wire/bytes.h"
#include "datapath/wire/frame.h"

#include <nlohmann/json.hpp>

namespace metaroce::fabric {
namespace {

using namespace std::chrono_literals;

constexpr uint16_t kPort = 4793;

wire::MacAddr mac_of(uint32_t endpoint) { return {0x02, 0, 0, 0, 0, uint8_t(endpoint + 1)}; }
uint32_t ip_of(uint32_t endpoint) { return 0x0a000001u + endpoint; }

struct Delivery {
  uint32_t endpoint, plane;
  Nanos at;
  std::vector<uint8_t> bytes;
};

// Owns every frame's bytes; counts what the fabric hands back so leaks show up as a mismatch.
class TestSink : public FrameSink {
 public:
  FrameRef make(const std::vector<uint8_t>& bytes) {
    auto* buf = new std::vector<uint8_t>(bytes);
    ++live_;
    return FrameRef{buf->data(), static_cast<uint32_t>(buf->size()), buf};
  }
  void deliver(uint32_t endpoint, uint32_t plane, FrameRef f) override {
    auto* buf = static_cast<std::vector<uint8_t>*>(f.handle);
    delivered.push_back(Delivery{endpoint, plane, now, *buf});
    free(f);
  }
  void discard(FrameRef f) override {
    ++discarded;
    free(f);
  }
  bool clone(const FrameRef& f, FrameRef* copy) override {
    if (refuse_clones) return false;
    auto* src = static_cast<std::vector<uint8_t>*>(f.handle);
    *copy = make(*src);
    return true;
  }
  int live() const { return live_; }

  std::vector<Delivery> delivered;
  uint64_t discarded = 0;
  Nanos now{0};
  bool refuse_clones = false;

 private:
  void free(FrameRef f) {
    delete static_cast<std::vector<uint8_t>*>(f.handle);
    --live_;
  }
  int live_ = 0;
};

std::vector<uint8_t> udp_frame(uint32_t from, uint32_t to, uint16_t src_port, uint32_t payload,
                               wire::Ecn ecn = wire::Ecn::kEct0, uint32_t seq = 0,
                               bool to_known_mac = true) {
  wire::UdpFrameParams p;
  p.src_mac = mac_of(from);
  p.dst_mac = to_known_mac ? mac_of(to) : wire::MacAddr{0x02, 0xee, 0, 0, 0, 0};
  p.src_ip = ip_of(from);
  p.dst_ip = ip_of(to);
  p.src_port = src_port;
  p.dst_port = kPort;
  p.ecn = ecn;
  std::vector<uint8_t> body(payload, 0);
  if (payload >= 4) wire::store_be32(body.data(), seq);
  std::vector<uint8_t> out(wire::kUdpFrameHeaderLen + payload);
  EXPECT_EQ(wire::build_udp_frame(out, p, body), out.size());
  return out;
}

std::vector<uint8_t> arp_request(uint32_t from, uint32_t to) {
  wire::ArpPacket a;
  a.sender_mac = mac_of(from);
  a.sender_ip = ip_of(from);
  a.target_ip = ip_of(to);
  std::vector<uint8_t> out(wire::kArpFrameLen);
  EXPECT_EQ(wire::build_arp(out, a), out.size());
  return out;
}

uint32_t seq_of(const std::vector<uint8_t>& frame) {
  return wire::load_be32(frame.data() + wire::kUdpFrameHeaderLen);
}

// A fabric with no rate limits, queues or delays unless a test sets them.
FabricConfig plain(uint32_t endpoints, uint32_t planes, uint32_t links) {
  FabricConfig c;
  c.endpoints = endpoints;
  c.planes = planes;
  c.links_per_plane = links;
  c.core.rate_bps = 0;
  c.edge.rate_bps = 0;
  c.core.ecn_threshold_bytes = c.edge.ecn_threshold_bytes = 1 << 30;
  return c;
}

// Runs the clock forward in steps until nothing is held; the sink sees each delivery's time.
void run_until_idle(Fabric& f, TestSink& sink, Nanos step = 1us) {
  while (auto next = f.next_event()) {
    sink.now = std::max(sink.now + step, *next);
    f.advance(sink.now);
  }
}

TEST(FabricEcmp, SpreadsSourcePortsOverEveryCoreLinkAndIsStable) {
  std::vector<int> hits(4, 0);
  for (uint16_t port = 49152; port < 49152 + 256; ++port) {
    const uint32_t l = ecmp_link(ip_of(0), ip_of(1), 17, port, kPort, 7, 4);
    ASSERT_LT(l, 4u);
    EXPECT_EQ(l, ecmp_link(ip_of(0), ip_of(1), 17, port, kPort, 7, 4));
    ++hits[l];
  }
  for (int h : hits) EXPECT_GE(h, 40) << "a link got too few of 256 flows";
  int moved = 0;
  for (uint16_t port = 1000; port < 1100; ++port)
    moved += ecmp_link(1, 2, 17, port, kPort, 7, 8) != ecmp_link(1, 2, 17, port, kPort, 8, 8);
  EXPECT_GT(moved, 50) << "the seed should change the mapping";
}

TEST(FabricMarkCe, SetsCeAndKeepsTheHeaderChecksumValid) {
  auto f = udp_frame(0, 1, 1234, 100, wire::Ecn::kEct1);
  ASSERT_TRUE(mark_ce(f.data(), static_cast<uint32_t>(f.size())));
  const auto info = wire::parse_frame(f, kPort);
  EXPECT_EQ(info.error, wire::FrameError::kNone);  // parse_frame checks the IPv4 checksum
  EXPECT_EQ(info.ecn, wire::Ecn::kCe);

  auto not_ect = udp_frame(0, 1, 1234, 100, wire::Ecn::kNotEct);
  const auto before = not_ect;
  EXPECT_FALSE(mark_ce(not_ect.data(), static_cast<uint32_t>(not_ect.size())));
  EXPECT_EQ(not_ect, before);
  auto arp = arp_request(0, 1);
  EXPECT_FALSE(mark_ce(arp.data(), static_cast<uint32_t>(arp.size())));
}

TEST(Fabric, UnicastCrossesCoreThenEdgeWithSerialisationAndDelay) {
  FabricConfig c = plain(2, 1, 1);
  c.core.rate_bps = 1'000'000'000;  // 1000 bytes = 8 us
  c.core.delay = 10us;
  c.edge.rate_bps = 1'000'000'000;
  TestSink sink;
  Fabric f(c, &sink);
  f.ingress(1, 0, sink.make(arp_request(1, 0)), 0ns);  // endpoint 1 makes its MAC known
  run_until_idle(f, sink);
  ASSERT_EQ(sink.delivered.size(), 1u);
  EXPECT_EQ(sink.delivered[0].endpoint, 0u);
  EXPECT_EQ(f.stats().flooded, 1u);
  EXPECT_EQ(f.endpoint_of(0, mac_of(1)), 1u);

  sink.delivered.clear();
  const Nanos t0 = 1ms;
  auto frame = udp_frame(0, 1, 5000, 1000 - wire::kUdpFrameHeaderLen);
  f.ingress(0, 0, sink.make(frame), t0);
  EXPECT_EQ(f.next_event(), t0 + 8us + 10us);  // serialised on the core link, then propagated
  EXPECT_EQ(f.advance(t0 + 25us), 0u);          // still serialising on the edge link
  EXPECT_EQ(f.advance(t0 + 26us), 1u);
  ASSERT_EQ(sink.delivered.size(), 1u);
  EXPECT_EQ(sink.delivered[0].endpoint, 1u);
  EXPECT_EQ(sink.delivered[0].bytes, frame);
  EXPECT_EQ(f.stats().flooded, 1u) << "a learnt destination is not flooded";
  const auto core = f.link_stats(*f.link_index({0, LinkKind::kCore, 0}), t0 + 26us);
  EXPECT_EQ(core.frames_out, 2u);
  EXPECT_EQ(core.bytes_out, 1000u + wire::kArpFrameLen);
  EXPECT_EQ(sink.live(), 0);
}

TEST(Fabric, CountsDeliveredBytesBySenderNotByWhatWasDropped) {
  TestSink sink;
  FabricConfig c = plain(3, 1, 1);
  c.edge.queue_bytes = 2500;  // room for two 1 KiB frames on the receiver's edge link
  c.edge.rate_bps = 8'000'000;  // slow enough that the third frame finds the queue full
  Fabric f(c, &sink);
  // The fabric learns each endpoint's address from the first frame it sends (until then, frames
  // to it flood); the counts below are taken after that.
  for (uint32_t e = 0; e < 3; ++e)
    f.ingress(e, 0, sink.make(udp_frame(e, (e + 1) % 3, 1000, 100)), 0ns);
  run_until_idle(f, sink);
  const uint64_t learn_0 = f.stats().delivered_bytes_from[0];
  const uint64_t learn_1 = f.stats().delivered_bytes_from[1];
  const uint64_t learn_2 = f.stats().delivered_bytes_from[2];
  EXPECT_GT(learn_0, 0u);
  const auto frame_1 = udp_frame(1, 0, 1001, 1024);
  const auto frame_2 = udp_frame(2, 0, 1001, 1024);
  f.ingress(1, 0, sink.make(frame_1), 1s);
  f.ingress(2, 0, sink.make(frame_2), 1s);
  f.ingress(2, 0, sink.make(frame_2), 1s);  // tail-dropped: must not count as delivered
  run_until_idle(f, sink);
  EXPECT_EQ(f.stats().delivered_bytes_from[1] - learn_1, frame_1.size());
  EXPECT_EQ(f.stats().delivered_bytes_from[2] - learn_2, frame_2.size());
  EXPECT_EQ(f.stats().delivered_bytes_from[0], learn_0);
  EXPECT_EQ(f.link_stats(*f.link_index({0, LinkKind::kEdge, 0}), 2s).drop_queue, 1u);
  EXPECT_EQ(sink.live(), 0);
}

TEST(Fabric, BroadcastFloodsToEveryOtherEndpointOfItsPlaneOnly) {
  TestSink sink;
  Fabric f(plain(3, 2, 2), &sink);
  f.ingress(0, 1, sink.make(arp_request(0, 2)), 0ns);
  run_until_idle(f, sink);
  std::set<std::pair<uint32_t, uint32_t>> got;
  for (const auto& d : sink.delivered) got.insert({d.endpoint, d.plane});
  EXPECT_EQ(got, (std::set<std::pair<uint32_t, uint32_t>>{{1, 1}, {2, 1}}));
  EXPECT_EQ(sink.delivered.size(), 2u);
  EXPECT_EQ(sink.live(), 0);

  sink.refuse_clones = true;  // no buffer for a copy: the copy is counted, the original goes on
  f.ingress(0, 1, sink.make(arp_request(0, 2)), 1ms);
  run_until_idle(f, sink);
  EXPECT_EQ(f.stats().dropped_no_buffer, 1u);
  EXPECT_EQ(sink.delivered.size(), 3u);
  EXPECT_EQ(sink.live(), 0);
}

TEST(Fabric, UnknownUnicastFloodsAndKnownAddressRoutesWithoutItsMac) {
  TestSink sink;
  Fabric f(plain(3, 1, 1), &sink);
  // Nothing learnt: flooded to both others.
  f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64)), 0ns);
  run_until_idle(f, sink);
  EXPECT_EQ(sink.delivered.size(), 2u);
  EXPECT_EQ(f.stats().flooded, 1u);
  // Endpoint 1 speaks; a frame to its IP behind an unknown MAC is routed to it alone.
  f.ingress(1, 0, sink.make(udp_frame(1, 0, 1, 64)), 1ms);
  run_until_idle(f, sink);
  sink.delivered.clear();
  f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64, wire::Ecn::kEct0, 0, false)), 2ms);
  run_until_idle(f, sink);
  ASSERT_EQ(sink.delivered.size(), 1u);
  EXPECT_EQ(sink.delivered[0].endpoint, 1u);
  // A frame to the sender's own MAC goes nowhere.
  f.ingress(0, 0, sink.make(udp_frame(0, 0, 1, 64)), 3ms);
  EXPECT_EQ(f.stats().dropped_no_route, 1u);
  EXPECT_EQ(sink.live(), 0);
}

TEST(Fabric, SourcePortChoosesTheCoreLinkSoOneFlowSpraysOverAll) {
  TestSink sink;
  Fabric f(plain(2, 1, 4), &sink);
  f.ingress(1, 0, sink.make(arp_request(1, 0)), 0ns);
  for (uint16_t port = 0; port < 64; ++port)
    f.ingress(0, 0, sink.make(udp_frame(0, 1, uint16_t(49152 + port), 64)), 0ns);
  run_until_idle(f, sink);
  uint64_t total = 0;
  for (uint32_t k = 0; k < 4; ++k) {
    const auto s = f.link_stats(*f.link_index({0, LinkKind::kCore, k}), sink.now);
    EXPECT_GT(s.frames_in, 0u) << "core link " << k << " unused";
    total += s.frames_in;
  }
  EXPECT_EQ(total, 65u);
  // One 5-tuple always takes one link.
  for (int i = 0; i < 10; ++i)
    f.ingress(0, 0, sink.make(udp_frame(0, 1, 40000, 64)), 1ms);
  run_until_idle(f, sink);
  int links_used = 0;
  for (uint32_t k = 0; k < 4; ++k)
    links_used += f.link_stats(*f.link_index({0, LinkKind::kCore, k}), sink.now).frames_in >= 10;
  EXPECT_GE(links_used, 1);
  EXPECT_EQ(sink.delivered.size(), 75u);
}

TEST(Fabric, QueueTailDropsBeyondItsBytesAndRecordsDepth) {
  FabricConfig c = plain(2, 1, 1);
  c.core.rate_bps = 1'000'000'000;
  c.core.queue_bytes = 3000;
  TestSink sink;
  Fabric f(c, &sink);
  for (int i = 0; i < 5; ++i)
    f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 1000 - wire::kUdpFrameHeaderLen)), 0ns);
  const uint32_t core = *f.link_index({0, LinkKind::kCore, 0});
  auto s = f.link_stats(core, 0ns);
  EXPECT_EQ(s.frames_in, 5u);
  EXPECT_EQ(s.drop_queue, 2u);
  EXPECT_EQ(s.queue_bytes, 3000u);
  EXPECT_EQ(s.max_queue_bytes, 3000u);
  // 8 us per frame: after 12 us one has left, one is half out.
  EXPECT_EQ(f.link_stats(core, 12us).queue_bytes, 2000u);
  run_until_idle(f, sink);
  s = f.link_stats(core, sink.now);
  EXPECT_EQ(s.queue_bytes, 0u);
  EXPECT_EQ(s.frames_out, 3u);
  EXPECT_EQ(sink.delivered.size(), 3u);
  // Frames leave back to back at the link rate.
  EXPECT_EQ(sink.delivered[0].at, 8us);
  EXPECT_EQ(sink.delivered[2].at, 24us);
  EXPECT_EQ(sink.live(), 0);
}

TEST(Fabric, MarksCeOnlyAboveThresholdAndOnlyEctFrames) {
  FabricConfig c = plain(2, 1, 1);
  c.core.rate_bps = 1'000'000'000;
  c.core.ecn_threshold_bytes = 1500;
  TestSink sink;
  Fabric f(c, &sink);
  // Occupancy found on arrival: 0, 1000, 2000, 3000 bytes; then a non-ECT frame at 4000.
  for (uint32_t i = 0; i < 4; ++i)
    f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 1000 - wire::kUdpFrameHeaderLen,
                                        wire::Ecn::kEct0, i)), 0ns);
  f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 1000 - wire::kUdpFrameHeaderLen,
                                      wire::Ecn::kNotEct, 4)), 0ns);
  run_until_idle(f, sink);
  ASSERT_EQ(sink.delivered.size(), 5u);
  std::vector<wire::Ecn> ecn;
  for (const auto& d : sink.delivered) {
    const auto info = wire::parse_frame(d.bytes, kPort);
    EXPECT_EQ(info.error, wire::FrameError::kNone) << "checksum broken by marking";
    ecn.push_back(info.ecn);
  }
  EXPECT_EQ(ecn, (std::vector<wire::Ecn>{wire::Ecn::kEct0, wire::Ecn::kEct0, wire::Ecn::kCe,
                                         wire::Ecn::kCe, wire::Ecn::kNotEct}));
  EXPECT_EQ(f.link_stats(*f.link_index({0, LinkKind::kCore, 0}), sink.now).ce_marked, 2u);
}

uint64_t losses_with_seed(uint64_t seed) {
  FabricConfig c = plain(2, 1, 1);
  c.core.loss = 0.1;
  c.seed = seed;
  TestSink sink;
  Fabric f(c, &sink);
  for (int i = 0; i < 10000; ++i) {
    f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64)), Nanos(i * 1000));
    f.advance(Nanos(i * 1000));
  }
  run_until_idle(f, sink);
  const auto s = f.link_stats(0, sink.now);
  EXPECT_EQ(s.drop_loss + sink.delivered.size(), 10000u);
  EXPECT_EQ(sink.live(), 0);
  return s.drop_loss;
}

TEST(Fabric, RandomLossIsNearItsProbabilityAndRepeatsWithTheSeed) {
  const uint64_t a = losses_with_seed(42);
  EXPECT_GT(a, 850u);
  EXPECT_LT(a, 1150u);
  EXPECT_EQ(losses_with_seed(42), a);
  EXPECT_NE(losses_with_seed(43), a);
}

TEST(Fabric, ReorderHoldsSomeFramesBackButLosesNone) {
  FabricConfig c = plain(2, 1, 1);
  c.core.reorder = 0.3;
  c.core.reorder_delay = 50us;
  TestSink sink;
  Fabric f(c, &sink);
  for (uint32_t i = 0; i < 200; ++i) {
    sink.now = Nanos(i * 1000);
    f.advance(sink.now);
    f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64, wire::Ecn::kEct0, i)), sink.now);
  }
  run_until_idle(f, sink);
  ASSERT_EQ(sink.delivered.size(), 200u);
  int inversions = 0;
  for (size_t i = 1; i < sink.delivered.size(); ++i)
    inversions += seq_of(sink.delivered[i].bytes) < seq_of(sink.delivered[i - 1].bytes);
  EXPECT_GT(inversions, 10);
  const uint64_t held = f.link_stats(0, sink.now).reordered;  // about 0.3 of 200
  EXPECT_GT(held, 30u);
  EXPECT_LT(held, 90u);

  TestSink in_order_sink;
  Fabric g(plain(2, 1, 1), &in_order_sink);
  for (uint32_t i = 0; i < 50; ++i)
    g.ingress(0, 0, in_order_sink.make(udp_frame(0, 1, 1, 64, wire::Ecn::kEct0, i)), Nanos(i));
  run_until_idle(g, in_order_sink);
  for (size_t i = 0; i < in_order_sink.delivered.size(); ++i)
    EXPECT_EQ(seq_of(in_order_sink.delivered[i].bytes), i);
}

// Duplication: about its probability of the frames get a second copy, byte for byte, right
// behind the original (reordered like any frame); nothing is lost, counters add up, and the
// copies are handed back like any frame. No draw is made at 0, so existing seeds keep their runs.
TEST(Fabric, DuplicateSendsSomeFramesTwiceByteForByte) {
  FabricConfig c = plain(2, 1, 1);
  c.core.duplicate = 0.1;
  TestSink sink;
  Fabric f(c, &sink);
  for (uint32_t i = 0; i < 2000; ++i) {
    sink.now = Nanos(i * 1000);
    f.advance(sink.now);
    f.ingress(0, 0, sink.make(udp_frame(0, 1, 7, 64, wire::Ecn::kEct0, i)), sink.now);
  }
  run_until_idle(f, sink);
  const LinkStats s = f.link_stats(*f.link_index({0, LinkKind::kCore, 0}), sink.now);
  EXPECT_GT(s.duplicated, 150u);
  EXPECT_LT(s.duplicated, 250u);
  EXPECT_EQ(s.frames_in, 2000u);
  EXPECT_EQ(s.frames_out, 2000u + s.duplicated);
  ASSERT_EQ(sink.delivered.size(), 2000u + s.duplicated);
  std::vector<int> copies(2000, 0);
  for (const Delivery& d : sink.delivered) {
    const uint32_t seq = seq_of(d.bytes);
    ASSERT_LT(seq, 2000u);
    ++copies[seq];
    EXPECT_EQ(d.bytes, udp_frame(0, 1, 7, 64, wire::Ecn::kEct0, seq));
  }
  EXPECT_EQ(uint64_t(std::count(copies.begin(), copies.end(), 2)), s.duplicated);
  EXPECT_EQ(std::count(copies.begin(), copies.end(), 1), 2000 - int64_t(s.duplicated));
  EXPECT_EQ(sink.live(), 0);

  // A copy is lost like its original when the link goes down with both on it.
  FabricConfig d = plain(2, 1, 1);
  d.core.duplicate = 1;
  d.core.delay = 100us;
  TestSink down_sink;
  Fabric g(d, &down_sink);
  g.ingress(0, 0, down_sink.make(udp_frame(0, 1, 7, 64)), 0ns);
  EXPECT_EQ(g.in_flight(), 2u);
  LinkParams p = g.params(0);
  p.up = false;
  g.set_params(0, p, 10us);
  run_until_idle(g, down_sink);
  EXPECT_TRUE(down_sink.delivered.empty());
  EXPECT_EQ(g.link_stats(0, down_sink.now).drop_down, 2u);
  EXPECT_EQ(down_sink.live(), 0);

  // With no buffer for the copy, the original still goes and the shortage is counted.
  TestSink no_buffer_sink;
  no_buffer_sink.refuse_clones = true;
  Fabric h(d, &no_buffer_sink);
  h.ingress(0, 0, no_buffer_sink.make(udp_frame(0, 1, 7, 64)), 0ns);
  run_until_idle(h, no_buffer_sink);
  EXPECT_EQ(no_buffer_sink.delivered.size(), 1u);
  EXPECT_EQ(h.stats().dropped_no_buffer, 1u);
  EXPECT_EQ(no_buffer_sink.live(), 0);
}

TEST(Fabric, DownLinkBlackHolesWhatItHoldsAndWhatArrivesUntilUp) {
  FabricConfig c = plain(2, 1, 1);
  c.core.delay = 100us;
  TestSink sink;
  Fabric f(c, &sink);
  const uint32_t core = 0;
  for (int i = 0; i < 3; ++i) f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64)), 0ns);
  LinkParams p = f.params(core);
  p.up = false;
  f.set_params(core, p, 10us);
  f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64)), 20us);
  run_until_idle(f, sink);
  EXPECT_TRUE(sink.delivered.empty());
  EXPECT_EQ(f.link_stats(core, sink.now).drop_down, 4u);
  p.up = true;
  f.set_params(core, p, sink.now);
  f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64)), sink.now);
  run_until_idle(f, sink);
  EXPECT_EQ(sink.delivered.size(), 1u);
  EXPECT_EQ(sink.live(), 0);
}

TEST(Fabric, FramesStillHeldAtDestructionAreHandedBack) {
  TestSink sink;
  {
    FabricConfig c = plain(2, 1, 1);
    c.core.delay = 1ms;
    Fabric f(c, &sink);
    f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64)), 0ns);
    EXPECT_EQ(f.in_flight(), 1u);
  }
  EXPECT_EQ(sink.live(), 0);
}

TEST(Fabric, RunsOutOfRecordsCleanly) {
  FabricConfig c = plain(2, 1, 1);
  c.max_in_flight = 16;
  c.core.delay = 1ms;
  TestSink sink;
  Fabric f(c, &sink);
  for (int i = 0; i < 20; ++i) f.ingress(0, 0, sink.make(udp_frame(0, 1, 1, 64)), 0ns);
  EXPECT_EQ(f.stats().dropped_no_record, 4u);
  run_until_idle(f, sink);
  EXPECT_EQ(sink.delivered.size(), 16u);
  EXPECT_EQ(sink.live(), 0);
}

TEST(FabricConfig, ValidateRejectsOutOfRange) {
  EXPECT_EQ(plain(2, 2, 4).validate(), "");
  EXPECT_NE(plain(0, 1, 1).validate(), "");
  EXPECT_NE(plain(2, kMaxPlanes + 1, 1).validate(), "");
  EXPECT_NE(plain(2, 1, 0).validate(), "");
  FabricConfig c = plain(2, 1, 1);
  c.core.loss = 1.5;
  EXPECT_NE(c.validate(), "");
}

TEST(FabricControl, ParsesRatesAndSettings) {
  EXPECT_EQ(parse_rate("100G"), 100'000'000'000u);
  EXPECT_EQ(parse_rate("1.5g"), 1'500'000'000u);
  EXPECT_EQ(parse_rate("800M"), 800'000'000u);
  EXPECT_EQ(parse_rate("0"), 0u);
  EXPECT_FALSE(parse_rate(""));
  EXPECT_FALSE(parse_rate("fast"));
  EXPECT_FALSE(parse_rate("-1G"));
  EXPECT_FALSE(parse_rate("10"));  // below 1 kbit/s
  LinkParams p;
  std::string err;
  EXPECT_TRUE(apply_setting("loss=0.25", &p, &err));
  EXPECT_EQ(p.loss, 0.25);
  EXPECT_TRUE(apply_setting("delay=15", &p, &err));
  EXPECT_EQ(p.delay, 15us);
  EXPECT_TRUE(apply_setting("rate=10G", &p, &err));
  EXPECT_EQ(p.rate_bps, 10'000'000'000u);
  EXPECT_TRUE(apply_setting("dup=0.05", &p, &err));
  EXPECT_EQ(p.duplicate, 0.05);
  EXPECT_TRUE(apply_setting("down", &p, &err));
  EXPECT_FALSE(p.up);
  for (const char* bad : {"loss=2", "dup=-0.1", "dup=1.5", "loss=", "delay=-1", "rate=x",
                          "speed=1", "sideways", "ecn=a"})
    EXPECT_FALSE(apply_setting(bad, &p, &err)) << bad;
  EXPECT_NE(err, "");
}

TEST(FabricControl, SetChangesOnlyTheNamedLinksAndStatReportsThem) {
  TestSink sink;
  Fabric f(plain(2, 2, 3), &sink);
  bool stop = false;
  EXPECT_EQ(handle_request(f, "set 1 core2 loss=0.5 delay=7", 0ns, &stop).rfind("ok", 0), 0u);
  const uint32_t changed = *f.link_index({1, LinkKind::kCore, 2});
  EXPECT_EQ(f.params(changed).loss, 0.5);
  EXPECT_EQ(f.params(changed).delay, 7us);
  for (uint32_t i = 0; i < f.link_count(); ++i) {
    const double expected = i == changed ? 0.5 : 0.0;
    EXPECT_EQ(f.params(i).loss, expected) << f.link_name(i);
  }

  EXPECT_EQ(handle_request(f, "set * edge1 down", 0ns, &stop).rfind("ok", 0), 0u);
  EXPECT_FALSE(f.params(*f.link_index({0, LinkKind::kEdge, 1})).up);
  EXPECT_FALSE(f.params(*f.link_index({1, LinkKind::kEdge, 1})).up);
  EXPECT_TRUE(f.params(*f.link_index({0, LinkKind::kEdge, 0})).up);
  EXPECT_EQ(handle_request(f, "set 0 * up", 0ns, &stop).rfind("ok", 0), 0u);
  EXPECT_TRUE(f.params(*f.link_index({0, LinkKind::kEdge, 1})).up);

  // Errors change nothing, even when only a later setting is bad.
  for (const char* bad : {"set 2 core0 up", "set 0 core3 up", "set 0 edge2 up", "set 0 0",
                          "set 0 0 loss=0.1 bogus", "frobnicate", "stat xml", ""}) {
    EXPECT_EQ(handle_request(f, bad, 0ns, &stop).rfind("error: ", 0), 0u) << bad;
  }
  EXPECT_EQ(f.params(*f.link_index({0, LinkKind::kCore, 0})).loss, 0);
  EXPECT_FALSE(stop);

  const std::string reply = handle_request(f, "stat json", 0ns, &stop);
  ASSERT_EQ(reply.rfind("ok\n{", 0), 0u);
  const nlohmann::json stats = nlohmann::json::parse(reply.substr(3));
  EXPECT_EQ(stats.at("planes"), 2);
  EXPECT_EQ(stats.at("links").size(), f.link_count());
  bool found = false;
  for (const auto& l : stats.at("links")) {
    if (l.at("name") != "p1.core2") continue;
    found = true;
    EXPECT_EQ(l.at("loss"), 0.5);
    EXPECT_EQ(l.at("kind"), "core");
    EXPECT_EQ(l.at("duplicated"), 0);
  }
  EXPECT_TRUE(found) << reply;
  const std::string text = handle_request(f, "stat", 0ns, &stop);
  EXPECT_NE(text.find("p1.edge1"), std::string::npos);
  EXPECT_EQ(handle_request(f, "stop", 0ns, &stop), "ok\n");
  EXPECT_TRUE(stop);
}

TEST(FabricControl, NamesAndStateFolder) {
  std::string err;
  EXPECT_TRUE(check_fabric_name("fab_1-x", &err));
  EXPECT_FALSE(check_fabric_name("", &err));
  EXPECT_FALSE(check_fabric_name("a/b", &err));
  EXPECT_FALSE(check_fabric_name(std::string(kMaxFabricNameLen + 1, 'a'), &err));
  EXPECT_EQ(socket_name("f", 1, 0), "metaroce-fabric-f-e1-p0");
  EXPECT_EQ(state_dir("/run/metaroce", "f"), "/run/metaroce/fabric/f");
}

// --- the idle policy of the polling thread ------------------------------------------------------

IdleState idle_after(Nanos idle_for, uint32_t passes) {
  IdleState s;
  s.idle_for = idle_for;
  s.empty_passes = passes;
  return s;
}

TEST(IdlePolicy, AlwaysNeverSleepsWhateverIsIdleOrDue) {
  IdlePolicy p;
  p.spin = SpinPolicy::kAlways;
  for (IdleState s : {idle_after(0ns, 1), idle_after(10s, 4'000'000'000u)}) {
    EXPECT_EQ(idle_wait(p, s), 0ns);
    s.until_event = 5s;
    EXPECT_EQ(idle_wait(p, s), 0ns);
    s.until_sample = 3s;
    EXPECT_EQ(idle_wait(p, s), 0ns);
  }
}

TEST(IdlePolicy, AdaptivePollsForSpinUsThenNapsLongerEachPassUpToMaxNap) {
  IdlePolicy p;  // the default: 100 us of polling, naps up to 1 ms
  EXPECT_EQ(p.spin, SpinPolicy::kAdaptive);
  EXPECT_EQ(idle_wait(p, idle_after(99us, 60)), 0ns);
  EXPECT_EQ(idle_wait(p, idle_after(100us, 60)), 60us);
  EXPECT_EQ(idle_wait(p, idle_after(160us, 61)), 61us);
  EXPECT_EQ(idle_wait(p, idle_after(2s, 5000)), 1ms);
  p.spin_before_sleep = 0us;
  p.max_nap = 20us;
  EXPECT_EQ(idle_wait(p, idle_after(0us, 1)), 1us);
  EXPECT_EQ(idle_wait(p, idle_after(1ms, 100)), 20us);
}

TEST(IdlePolicy, AdaptiveSpinPhaseComesFirstEvenWithAFrameDueLater) {
  IdlePolicy p;
  p.spin_before_sleep = 500us;
  IdleState s = idle_after(400us, 10);
  s.until_event = 800us;
  EXPECT_EQ(idle_wait(p, s), 0ns);
  s.idle_for = 500us;
  EXPECT_EQ(idle_wait(p, s), 700us);  // wakes a margin before the frame is due
}

TEST(IdlePolicy, AdaptiveSleepsTowardsATimedFrameButPollsForANearOne) {
  IdlePolicy p;
  IdleState s = idle_after(1ms, 500);
  s.until_event = 150us;
  EXPECT_EQ(idle_wait(p, s), 0ns);
  s.until_event = 5ms;
  EXPECT_EQ(idle_wait(p, s), 1ms);  // never longer than max_nap, however far the frame
}

TEST(IdlePolicy, AdaptiveNapsNeverOvershootTheTraceSample) {
  IdlePolicy p;
  IdleState s = idle_after(1s, 5000);
  s.until_sample = 300us;
  EXPECT_EQ(idle_wait(p, s), 300us);
  s.until_event = 5ms;
  EXPECT_EQ(idle_wait(p, s), 300us);
  s.until_sample = -20us;  // overdue: poll, the next pass samples it
  EXPECT_EQ(idle_wait(p, s), 0ns);
}

TEST(IdlePolicy, ParsesTheEngineWordsAndValidatesRanges) {
  EXPECT_EQ(parse_spin_policy("adaptive"), SpinPolicy::kAdaptive);
  EXPECT_EQ(parse_spin_policy("always"), SpinPolicy::kAlways);
  for (const char* bad : {"", "spin", "Always", "nap", "adaptive "})
    EXPECT_FALSE(parse_spin_policy(bad)) << bad;
  EXPECT_STREQ(spin_policy_name(SpinPolicy::kAlways), "always");
  EXPECT_STREQ(spin_policy_name(SpinPolicy::kAdaptive), "adaptive");
  IdlePolicy p;
  EXPECT_EQ(p.validate(), "");
  p.max_nap = 0us;
  EXPECT_NE(p.validate(), "");
  p.max_nap = kMaxNapLimit;
  EXPECT_EQ(p.validate(), "");
  p.spin_before_sleep = kMaxSpinBeforeSleep + 1us;
  EXPECT_NE(p.validate(), "");
  p.spin_before_sleep = -1us;
  EXPECT_NE(p.validate(), "");
}

}  // namespace
}  // namespace metaroce::fabric
