// SPDX-License-Identifier: Apache-2.0
// Tests of the io layer's kernel side: PCI addresses and drivers read from a sysfs tree, the
// UDP-socket port (GSO out, GRO in, one socket per source port, ECN) and KernelNet's routes and
// neighbours, in a network namespace of the test's own (skipped without CAP_SYS_ADMIN).
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "datapath/io/kernel_net.h"
#include "datapath/io/pci.h"
#include "datapath/io/udp_port.h"

namespace metaroce::io {
namespace {

constexpr uint32_t kA = 0xc6120001;  // 198.18.0.1
constexpr uint32_t kB = 0xc6120002;  // 198.18.0.2

TEST(Pci, AddressesAreRecognisedAndNormalised) {
  EXPECT_EQ(pci_address("0000:03:00.0"), "0000:03:00.0");
  EXPECT_EQ(pci_address("03:00.1"), "0000:03:00.1");
  EXPECT_EQ(pci_address("0000:AF:1f.7"), "0000:af:1f.7");
  EXPECT_FALSE(pci_address("net_memif0"));
  EXPECT_FALSE(pci_address("0000:03:20.0"));  // device numbers stop at 0x1f
  EXPECT_FALSE(pci_address("0000:03:00.8"));  // functions at 7
  EXPECT_FALSE(pci_address("03:00"));
}

TEST(Pci, AbsentUnboundAndKernelBoundDevicesAreRefusedWithTheFix) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("mr-pci-" + std::to_string(getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "devices" / "0000:01:00.0");
  fs::create_directories(root / "devices" / "0000:02:00.0");
  fs::create_directories(root / "devices" / "0000:03:00.0");
  fs::create_directories(root / "drivers" / "vfio-pci");
  fs::create_directories(root / "drivers" / "ixgbe");
  fs::create_directory_symlink(root / "drivers" / "vfio-pci", root / "devices" / "0000:02:00.0" / "driver");
  fs::create_directory_symlink(root / "drivers" / "ixgbe", root / "devices" / "0000:03:00.0" / "driver");
  const std::string dir = (root / "devices").string();

  EXPECT_EQ(check_pci_device(dir, "0000:02:00.0"), "");
  const std::string absent = check_pci_device(dir, "0000:09:00.0");
  EXPECT_NE(absent.find("no PCI device 0000:09:00.0"), std::string::npos) << absent;
  const std::string unbound = check_pci_device(dir, "0000:01:00.0");
  EXPECT_NE(unbound.find("bound to no driver"), std::string::npos) << unbound;
  EXPECT_NE(unbound.find("vfio-pci"), std::string::npos) << unbound;
  const std::string kernel = check_pci_device(dir, "0000:03:00.0");
  EXPECT_NE(kernel.find("kernel driver ixgbe"), std::string::npos) << kernel;
  fs::remove_all(root);
}

// Runs fn on a thread of its own in a new network namespace with 198.18.0.1 and 198.18.0.2 on
// its loopback (the namespace goes with the thread); false when namespaces are not allowed.
bool in_private_netns(const std::function<void()>& fn) {
  bool allowed = false;
  std::thread t([&] {
    if (unshare(CLONE_NEWNET) != 0) return;
    allowed = std::system("ip link set lo up && ip addr add 198.18.0.1/32 dev lo && "
                          "ip addr add 198.18.0.2/32 dev lo") == 0;
    if (allowed) fn();
  });
  t.join();
  return allowed;
}

// Receives until `want` frames arrived or 2 s passed; copies them (ports reuse their buffers).
struct Got {
  std::vector<uint8_t> bytes;
  uint32_t src_ip;
  uint16_t src_port;
  bool ce;
};
std::vector<Got> receive(Port& p, size_t want) {
  std::vector<Got> got;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  RxFrame rx[32];
  while (got.size() < want && std::chrono::steady_clock::now() < deadline) {
    const uint32_t n = p.rx_burst(rx);
    for (uint32_t i = 0; i < n; ++i)
      got.push_back({{rx[i].data, rx[i].data + rx[i].len}, rx[i].src_ip, rx[i].src_port, rx[i].ecn_ce});
    p.release({rx, n});
    if (n == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return got;
}

void put(Port& p, uint32_t dst, uint16_t sport, uint32_t len, uint8_t tag, uint32_t seq,
         std::vector<TxFrame>* batch) {
  TxFrame f;
  ASSERT_TRUE(p.alloc_tx(f, len));
  std::memset(f.data, tag, len);
  std::memcpy(f.data, &seq, sizeof(seq));
  f.len = len;
  f.dst_ip = dst;
  f.src_port = sport;
  batch->push_back(f);
}

TEST(UdpPort, PathsKeepTheirOrderAndSourcePortsThroughGsoAndGro) {
  const bool ran = in_private_netns([] {
    std::string err;
    auto a = open_udp_port({kA, 4793, "", 9000}, &err);
    ASSERT_TRUE(a) << err;
    auto b = open_udp_port({kB, 4793, "", 9000}, &err);
    ASSERT_TRUE(b) << err;
    EXPECT_EQ(a->kind(), PortKind::kUdp);
    EXPECT_GE(b->rx_wait_fd(), 0);
    // Two paths interleaved as the transport sprays them, a short last packet on one, and an
    // acknowledgement-sized packet: each path's packets must arrive in order, whole, from their
    // own source port.
    std::vector<TxFrame> batch;
    uint32_t sent = 0;
    for (uint32_t i = 0; i < 40; ++i) put(*a, kB, static_cast<uint16_t>(50000 + i % 2),
                                          i == 39 ? 1000 : 4176, static_cast<uint8_t>(i % 2), i, &batch), ++sent;
    put(*a, kB, 50007, 80, 7, 1000, &batch), ++sent;
    a->tx_burst(batch);
    EXPECT_EQ(a->stats().tx_frames, sent);
    auto got = receive(*b, sent);
    ASSERT_EQ(got.size(), sent);
    std::map<uint16_t, std::vector<uint32_t>> by_port;
    for (const Got& g : got) {
      EXPECT_EQ(g.src_ip, kA);
      uint32_t seq;
      std::memcpy(&seq, g.bytes.data(), sizeof(seq));
      const uint8_t tag = g.src_port == 50007 ? 7 : static_cast<uint8_t>(g.src_port - 50000);
      EXPECT_EQ(g.bytes.size(), seq == 39 ? 1000u : seq == 1000 ? 80u : 4176u);
      for (size_t k = 4; k < g.bytes.size(); ++k) ASSERT_EQ(g.bytes[k], tag) << "seq " << seq;
      by_port[g.src_port].push_back(seq);
    }
    ASSERT_EQ(by_port.size(), 3u);
    for (auto& [port, seqs] : by_port)
      for (size_t k = 1; k < seqs.size(); ++k) EXPECT_LT(seqs[k - 1], seqs[k]) << "port " << port;
    EXPECT_EQ(by_port[50000].size(), 20u);
    // Not CE-marked: the kernel sends ECT(0) and nobody marked it.
    for (const Got& g : got) EXPECT_FALSE(g.ce);
  });
  if (!ran) GTEST_SKIP() << "no network namespace (needs CAP_SYS_ADMIN)";
}

TEST(UdpPort, FramesWithTailsLeaveWholeInGsoRunsAndAloneAndCountAsFrames) {
  const bool ran = in_private_netns([] {
    std::string err;
    auto a = open_udp_port({kA, 4793, "", 9000}, &err);
    ASSERT_TRUE(a) << err;
    auto b = open_udp_port({kB, 4793, "", 9000}, &err);
    ASSERT_TRUE(b) << err;
    ASSERT_TRUE(a->takes_tails());
    // 30 frames on one path (a GSO run), every other one with its last 4000 bytes as a tail,
    // then one of another length with a tail: each arrives whole, and the tails' buffers are
    // overwritten as soon as tx_burst returns (the kernel copied them by then).
    std::vector<TxFrame> batch;
    std::vector<std::vector<uint8_t>> tails;
    tails.reserve(31);
    for (uint32_t i = 0; i < 31; ++i) {
      const uint32_t len = i == 30 ? 4500 : 4176;
      put(*a, kB, 50001, len, 9, i, &batch);
      if (i % 2 == 0 || i == 30) {
        TxFrame& f = batch.back();
        tails.emplace_back(4000, uint8_t{9});
        std::memset(f.data + len - 4000, 0xEE, 4000);
        f.tail = tails.back().data();
        f.tail_len = 4000;
      }
    }
    a->tx_burst(batch);
    for (auto& t : tails) std::fill(t.begin(), t.end(), uint8_t{0xDD});
    EXPECT_EQ(a->stats().tx_frames, 31u);
    auto got = receive(*b, 31);
    ASSERT_EQ(got.size(), 31u);
    for (const Got& g : got) {
      uint32_t seq;
      std::memcpy(&seq, g.bytes.data(), sizeof(seq));
      EXPECT_EQ(g.bytes.size(), seq == 30 ? 4500u : 4176u);
      for (size_t k = 4; k < g.bytes.size(); ++k) ASSERT_EQ(g.bytes[k], 9) << "seq " << seq;
    }
  });
  if (!ran) GTEST_SKIP() << "no network namespace (needs CAP_SYS_ADMIN)";
}

TEST(UdpPort, AnAddressNotOfThisHostOrATakenPortIsRefusedWithTheReason) {
  const bool ran = in_private_netns([] {
    std::string err;
    EXPECT_FALSE(open_udp_port({0xc6120009, 4793, "", 9000}, &err));
    EXPECT_NE(err.find("198.18.0.9 is not an address of this host"), std::string::npos) << err;
    auto a = open_udp_port({kA, 4793, "", 9000}, &err);
    ASSERT_TRUE(a) << err;
    EXPECT_FALSE(open_udp_port({kA, 4793, "", 9000}, &err));
    EXPECT_NE(err.find("is taken"), std::string::npos) << err;
    EXPECT_FALSE(open_udp_port({kA, 4794, "mr-none0", 9000}, &err));
    EXPECT_NE(err.find("no interface mr-none0"), std::string::npos) << err;
  });
  if (!ran) GTEST_SKIP() << "no network namespace (needs CAP_SYS_ADMIN)";
}

TEST(KernelNet, NextHopsFollowTheKernelsRoutesAndNeighbours) {
  const bool ran = in_private_netns([] {
    ASSERT_EQ(std::system("ip link add mr-t0 type veth peer name mr-t1 && "
                          "ip link set mr-t1 up && ip link set mr-t0 up && "
                          "ip addr add 198.19.0.1/24 dev mr-t0 && "
                          "ip route add 198.18.7.0/24 via 198.19.0.254 dev mr-t0 && "
                          "ip neigh add 198.19.0.254 lladdr 02:00:00:00:00:fe dev mr-t0 nud permanent"),
              0);
    std::string err;
    auto k = KernelNet::open("mr-t0", &err);
    ASSERT_TRUE(k) << err;
    EXPECT_GT(k->ifindex(), 0);
    // Through the router: its address, and the MAC the kernel holds for it.
    NextHop h = k->next_hop(0xc6120705);  // 198.18.7.5
    EXPECT_EQ(h.ip, 0xc61300feu);
    ASSERT_TRUE(h.mac_known);
    EXPECT_EQ(h.mac, (MacAddr{2, 0, 0, 0, 0, 0xfe}));
    // On the link: the peer itself, MAC unknown (ARP will find it).
    h = k->next_hop(0xc6130005);  // 198.19.0.5
    EXPECT_EQ(h.ip, 0xc6130005u);
    EXPECT_FALSE(h.mac_known);
    // No route at all: the peer itself, as on a point-to-point link.
    h = k->next_hop(0xc6128001);
    EXPECT_EQ(h.ip, 0xc6128001u);
    EXPECT_FALSE(KernelNet::open("mr-none0", &err));
    EXPECT_NE(err.find("no interface mr-none0"), std::string::npos) << err;
    auto info = interface_info("mr-t0", &err);
    ASSERT_TRUE(info) << err;
    EXPECT_EQ(info->mtu, 1500u);
  });
  if (!ran) GTEST_SKIP() << "no network namespace (needs CAP_SYS_ADMIN)";
}

}  // namespace
}  // namespace metaroce::io
