// SPDX-License-Identifier: Apache-2.0
// The DPDK ports on a kernel interface (af_xdp, af_packet) send everything they were given
// without another burst to push it out: a burst of several DPDK bursts reaches the wire whole
// while the port is only polled (DpdkPort::kick_late). The whole process runs in a
// network namespace of its own (EAL's threads included), on a veth pair it creates; skipped
// (exit 77) where namespaces are not allowed.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <thread>

#include "datapath/io/dpdk_port.h"

namespace metaroce::io {
namespace {

constexpr uint16_t kEtherType = 0x88b5;  // IEEE local experimental
constexpr uint32_t kFrameLen = 1000;
constexpr uint32_t kFrames = 256;  // four of the port's DPDK bursts; Linux 6.18 takes ~10 a kick

// A raw socket on the far end of the veth that counts our frames, each once.
class Listener {
 public:
  explicit Listener(const char* ifname) {
    fd_ = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(kEtherType));
    sockaddr_ll sll{};
    sll.sll_family = AF_PACKET;
    sll.sll_protocol = htons(kEtherType);
    sll.sll_ifindex = static_cast<int>(if_nametoindex(ifname));
    const int room = 16 << 20;  // the whole burst, read or not
    ok_ = fd_ >= 0 && setsockopt(fd_, SOL_SOCKET, SO_RCVBUFFORCE, &room, sizeof(room)) == 0 &&
          bind(fd_, reinterpret_cast<sockaddr*>(&sll), sizeof(sll)) == 0;
  }
  ~Listener() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return ok_; }
  void drain() {
    uint8_t buf[2048];
    for (;;) {
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n < 18) return;
      uint32_t seq;
      std::memcpy(&seq, buf + 14, sizeof(seq));
      seen_.insert(seq);
    }
  }
  size_t count() const { return seen_.size(); }

 private:
  int fd_ = -1;
  bool ok_ = false;
  std::set<uint32_t> seen_;
};

// Hands the port kFrames frames in one tx_burst, then only polls it (no further burst) and
// returns how many frames reached the far end within 2 s.
size_t burst_then_poll(Port& port, Listener& far) {
  std::vector<TxFrame> frames(kFrames);
  for (uint32_t seq = 0; seq < kFrames; ++seq) {
    TxFrame& f = frames[seq];
    if (!port.alloc_tx(f, kFrameLen)) return 0;
    std::memset(f.data, 0xff, 6);  // broadcast
    std::memcpy(f.data + 6, port.mac().data(), 6);
    f.data[12] = kEtherType >> 8;
    f.data[13] = kEtherType & 0xff;
    std::memcpy(f.data + 14, &seq, sizeof(seq));
    std::memset(f.data + 18, 0x5a, kFrameLen - 18);
    f.len = kFrameLen;
  }
  port.tx_burst(frames);
  RxFrame rx[32];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (far.count() < kFrames && std::chrono::steady_clock::now() < deadline) {
    const uint32_t n = port.rx_burst(rx);
    port.release(std::span(rx, n));
    far.drain();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return far.count();
}

class KernelRing : public ::testing::TestWithParam<const char*> {};

TEST_P(KernelRing, ABurstReachesTheWireWithoutAnotherBurst) {
  const std::string kind = GetParam();
  // A pair per test: an XDP program or a socket of the one before must not be in the way.
  const std::string tag = kind == "af_xdp" ? "x" : "p";
  const std::string a = "mr-k" + tag + "0", b = "mr-k" + tag + "1";
  ASSERT_EQ(std::system(("ip link add " + a + " type veth peer name " + b + " && ip link set " +
                         a + " up && ip link set " + b + " up")
                            .c_str()),
            0);
  Listener far(b.c_str());
  ASSERT_TRUE(far.ok()) << strerror(errno);
  std::string err;
  auto port = open_dpdk_port(
      {.devargs = "net_" + kind + "7,iface=" + a, .mtu = 1500}, &err);
  if (port == nullptr && kind == "af_xdp" && err.find("XDP") != std::string::npos)
    GTEST_SKIP() << "no af_xdp here: " << err;
  ASSERT_NE(port, nullptr) << err;
  EXPECT_EQ(burst_then_poll(*port, far), kFrames);
  // Whether the kernel left frames for the port to kick out depends on the kernel and the load;
  // said, not asserted (on this host's Linux 6.18 af_xdp needed them under load in realnet,
  // not here).
  std::printf("%s: kicks that found frames waiting: %llu\n", kind.c_str(),
              static_cast<unsigned long long>(port->stats().tx_late_kicks));
  EXPECT_EQ(port->stats().tx_dropped, 0u);
}

INSTANTIATE_TEST_SUITE_P(Pmds, KernelRing, ::testing::Values("af_xdp", "af_packet"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace metaroce::io

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Before EAL's threads exist, so that they share the namespace.
  if (unshare(CLONE_NEWNET) != 0 || std::system("ip link set lo up") != 0) {
    std::puts("SKIP: no network namespace (needs CAP_SYS_ADMIN)");
    return 77;
  }
  return RUN_ALL_TESTS();
}
