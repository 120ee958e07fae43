// SPDX-License-Identifier: Apache-2.0
// Tests of the io layer: the in-memory link's queueing, loss and wake-ups, and the DPDK port
// over a memif pair joined inside this one process.
#include <gtest/gtest.h>
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "datapath/io/dpdk_port.h"
#include "datapath/io/mem_link.h"

namespace metaroce::io {
namespace {

// Sends one frame whose first four bytes are `seq` and whose remaining bytes are seq's low byte.
bool send_seq(Port& port, uint32_t seq, uint32_t len = 64) {
  TxFrame f;
  if (!port.alloc_tx(f, len)) return false;
  std::memset(f.data, static_cast<int>(seq & 0xff), len);
  std::memcpy(f.data, &seq, sizeof(seq));
  f.len = len;
  port.tx_burst(std::span(&f, 1));
  return true;
}

// send_seq's frame with its last tail_len bytes sent from a separate buffer (TxFrame::tail),
// which is overwritten as soon as tx_burst returns: the port must have copied it by then.
bool send_seq_tail(Port& port, uint32_t seq, uint32_t len, uint32_t tail_len) {
  TxFrame f;
  if (!port.alloc_tx(f, len)) return false;
  std::memset(f.data, static_cast<int>(seq & 0xff), len - tail_len);
  std::memset(f.data + len - tail_len, 0xEE, tail_len);  // must not be what is sent
  std::memcpy(f.data, &seq, sizeof(seq));
  std::vector<uint8_t> tail(tail_len, static_cast<uint8_t>(seq & 0xff));
  f.len = len;
  f.tail = tail.data();
  f.tail_len = tail_len;
  port.tx_burst(std::span(&f, 1));
  std::fill(tail.begin(), tail.end(), uint8_t{0xDD});
  return true;
}

uint32_t seq_of(const RxFrame& f) {
  uint32_t seq;
  std::memcpy(&seq, f.data, sizeof(seq));
  return seq;
}

bool frame_intact(const RxFrame& f) {
  const auto fill = static_cast<uint8_t>(seq_of(f) & 0xff);
  for (uint32_t i = 4; i < f.len; ++i)
    if (f.data[i] != fill) return false;
  return true;
}

// Receives everything queued now, releasing each frame; returns the sequence numbers.
std::vector<uint32_t> drain(Port& port) {
  std::vector<uint32_t> seqs;
  RxFrame frames[16];
  while (uint32_t n = port.rx_burst(frames)) {
    for (uint32_t i = 0; i < n; ++i) seqs.push_back(seq_of(frames[i]));
    port.release(std::span(frames, n));
  }
  return seqs;
}

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0;
}

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// --- in-memory link ----------------------------------------------------------------------------

TEST(MemLink, DeliversFramesInOrderIntactAndCountsThem) {
  auto [a, b] = make_mem_link({});
  for (uint32_t s = 1; s <= 100; ++s) ASSERT_TRUE(send_seq(*a, s, 100 + s));
  std::vector<uint32_t> got;
  RxFrame frames[7];  // an odd burst size, so bursts straddle the queue's contents
  while (uint32_t n = b->rx_burst(frames)) {
    for (uint32_t i = 0; i < n; ++i) {
      EXPECT_EQ(frames[i].len, 100 + seq_of(frames[i]));
      EXPECT_TRUE(frame_intact(frames[i]));
      got.push_back(seq_of(frames[i]));
    }
    b->release(std::span(frames, n));
  }
  ASSERT_EQ(got.size(), 100u);
  for (uint32_t i = 0; i < 100; ++i) EXPECT_EQ(got[i], i + 1);
  EXPECT_EQ(a->stats().tx_frames, 100u);
  EXPECT_EQ(b->stats().rx_frames, 100u);
  EXPECT_EQ(a->stats().tx_bytes, b->stats().rx_bytes);
  EXPECT_TRUE(drain(*a).empty());  // nothing loops back to the sender
}

TEST(MemLink, TakesTailsAndSendsThemAsTheFramesEnd) {
  auto [a, b] = make_mem_link({});
  ASSERT_TRUE(a->takes_tails());
  for (uint32_t s = 1; s <= 20; ++s) ASSERT_TRUE(send_seq_tail(*a, s, 1000 + s, 900 + s));
  RxFrame frames[32];
  const uint32_t n = b->rx_burst(frames);
  ASSERT_EQ(n, 20u);
  for (uint32_t i = 0; i < n; ++i) {
    EXPECT_EQ(frames[i].len, 1001 + i);
    EXPECT_TRUE(frame_intact(frames[i])) << "frame " << seq_of(frames[i]);
  }
  b->release(std::span(frames, n));
}

TEST(MemLink, CarriesBothDirectionsIndependently) {
  auto [a, b] = make_mem_link({});
  ASSERT_TRUE(send_seq(*a, 1));
  ASSERT_TRUE(send_seq(*b, 2));
  EXPECT_EQ(drain(*b), std::vector<uint32_t>{1});
  EXPECT_EQ(drain(*a), std::vector<uint32_t>{2});
}

TEST(MemLink, FullQueueDropsFramesAndCountsThemAtTheSender) {
  auto [a, b] = make_mem_link({.queue_frames = 8});
  for (uint32_t s = 1; s <= 12; ++s) ASSERT_TRUE(send_seq(*a, s));
  EXPECT_EQ(a->stats().tx_dropped, 4u);
  EXPECT_EQ(a->stats().tx_frames, 8u);
  EXPECT_EQ(drain(*b), (std::vector<uint32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  ASSERT_TRUE(send_seq(*a, 13));  // room again once the receiver has taken them
  EXPECT_EQ(drain(*b), std::vector<uint32_t>{13});
}

TEST(MemLink, DropEveryLosesEveryNthFrameInEachDirection) {
  auto [a, b] = make_mem_link({.drop_every = 3});
  for (uint32_t s = 1; s <= 9; ++s) ASSERT_TRUE(send_seq(*a, s));
  for (uint32_t s = 1; s <= 4; ++s) ASSERT_TRUE(send_seq(*b, s));
  EXPECT_EQ(drain(*b), (std::vector<uint32_t>{1, 2, 4, 5, 7, 8}));
  EXPECT_EQ(drain(*a), (std::vector<uint32_t>{1, 2, 4}));
  // Lost on the wire, not refused by the port: the sender counts them as sent.
  EXPECT_EQ(a->stats().tx_frames, 9u);
  EXPECT_EQ(a->stats().tx_dropped, 0u);
}

TEST(MemLink, ReceiverHoldingEveryBufferMissesFrames) {
  auto [a, b] = make_mem_link({.queue_frames = 2});  // the receiver has 2 * 2 buffers
  std::vector<RxFrame> held;
  for (uint32_t s = 1; s <= 4; ++s) {
    ASSERT_TRUE(send_seq(*a, s));
    RxFrame f;
    ASSERT_EQ(b->rx_burst(std::span(&f, 1)), 1u);
    held.push_back(f);
  }
  ASSERT_TRUE(send_seq(*a, 5));
  RxFrame f;
  EXPECT_EQ(b->rx_burst(std::span(&f, 1)), 0u);
  EXPECT_EQ(b->stats().rx_missed, 1u);
  // Held frames stay intact while later ones are refused.
  for (uint32_t i = 0; i < held.size(); ++i) {
    EXPECT_EQ(seq_of(held[i]), i + 1);
    EXPECT_TRUE(frame_intact(held[i]));
  }
  b->release(held);
  ASSERT_TRUE(send_seq(*a, 6));
  EXPECT_EQ(drain(*b), std::vector<uint32_t>{6});
}

TEST(MemLink, AllocRefusesFramesLargerThanTheLinkCarries) {
  auto [a, b] = make_mem_link({.frame_size = 1500});
  TxFrame f;
  EXPECT_FALSE(a->alloc_tx(f, 1501));
  ASSERT_TRUE(a->alloc_tx(f, 1500));
  EXPECT_GE(f.capacity, 1500u);
  f.len = 1500;
  a->tx_burst(std::span(&f, 1));
  EXPECT_EQ(b->stats().rx_frames + drain(*b).size(), 1u);
}

TEST(MemLink, SenderRunsOutOfStagingBuffersOnlyWhileItHoldsThem) {
  auto [a, b] = make_mem_link({});
  std::vector<TxFrame> staged;
  TxFrame f;
  while (a->alloc_tx(f, 64)) staged.push_back(f);
  ASSERT_FALSE(staged.empty());
  for (TxFrame& s : staged) s.len = 64;
  a->tx_burst(staged);
  EXPECT_TRUE(a->alloc_tx(f, 64));  // tx_burst gave every staging buffer back
  a->tx_burst(std::span(&f, 1));    // len 0: an empty frame is still a frame
}

TEST(MemLink, ArmedFdWakesOnArrivalAndDisarmClearsIt) {
  auto [a, b] = make_mem_link({});
  const int fd = b->rx_wait_fd();
  ASSERT_GE(fd, 0);
  EXPECT_NE(fd, a->rx_wait_fd());
  EXPECT_FALSE(readable(fd));

  ASSERT_TRUE(send_seq(*a, 1));  // not armed: the receiver is polling, no wake-up needed
  EXPECT_FALSE(readable(fd));

  b->rx_arm();  // a frame is already queued: arming must not sleep past it
  EXPECT_TRUE(readable(fd));
  b->rx_disarm();
  EXPECT_FALSE(readable(fd));
  EXPECT_EQ(drain(*b), std::vector<uint32_t>{1});

  b->rx_arm();
  EXPECT_FALSE(readable(fd));
  ASSERT_TRUE(send_seq(*a, 2));
  EXPECT_TRUE(readable(fd));
  b->rx_disarm();
  EXPECT_FALSE(readable(fd));
  EXPECT_EQ(drain(*b), std::vector<uint32_t>{2});
}

TEST(MemLink, SleepingReceiverThreadIsWokenByTheSender) {
  auto [a, b] = make_mem_link({});
  std::vector<uint32_t> got;
  std::thread receiver([&, &b = b] {
    while (got.size() < 3) {
      b->rx_arm();
      pollfd p{b->rx_wait_fd(), POLLIN, 0};
      poll(&p, 1, 5000);
      b->rx_disarm();
      for (uint32_t s : drain(*b)) got.push_back(s);
    }
  });
  for (uint32_t s = 1; s <= 3; ++s) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(send_seq(*a, s));
  }
  receiver.join();
  EXPECT_EQ(got, (std::vector<uint32_t>{1, 2, 3}));
}

TEST(MemLink, ConcurrentSenderAndReceiverLoseNothingButCountedDrops) {
  auto [a, b] = make_mem_link({.queue_frames = 64});
  constexpr uint32_t kFrames = 20000;
  std::vector<uint32_t> got;
  std::atomic<bool> sender_done{false};
  std::thread receiver([&, &b = b] {
    for (;;) {
      const bool done = sender_done.load();
      auto seqs = drain(*b);
      got.insert(got.end(), seqs.begin(), seqs.end());
      if (done && seqs.empty()) break;
    }
  });
  for (uint32_t s = 1; s <= kFrames; ++s) ASSERT_TRUE(send_seq(*a, s));
  sender_done.store(true);
  receiver.join();
  EXPECT_GT(got.size(), 0u);
  EXPECT_EQ(got.size() + a->stats().tx_dropped, kFrames);
  for (size_t i = 1; i < got.size(); ++i) ASSERT_LT(got[i - 1], got[i]) << "reordered at " << i;
}

TEST(MemLink, EndsHaveDistinctMacsAndSeeThePeerGo) {
  auto [a, b] = make_mem_link({});
  auto [c, d] = make_mem_link({});
  EXPECT_NE(a->mac(), b->mac());
  EXPECT_NE(a->mac(), c->mac());
  EXPECT_NE(b->mac(), d->mac());
  EXPECT_EQ(a->mac()[0] & 0x03, 0x02);  // locally administered, unicast
  EXPECT_TRUE(a->link_up());
  b.reset();
  EXPECT_FALSE(a->link_up());
  ASSERT_TRUE(send_seq(*a, 1));  // sending into a dead link is harmless
}

// --- DPDK --------------------------------------------------------------------------------------

// memif sockets are abstract by default: a name per test process keeps parallel runs apart.
std::string memif(const char* dev, const char* role, const std::string& socket_tag) {
  return std::string(dev) + ",role=" + role + ",socket=/metaroce-io-test-" +
         std::to_string(getpid()) + "-" + socket_tag;
}

TEST(DpdkPort, BadDeviceStringsAreRefusedWithAReasonAndEalStaysUsable) {
  std::string err;
  EXPECT_EQ(open_dpdk_port({.devargs = "net_memif9,role=bogus"}, &err), nullptr);
  EXPECT_FALSE(err.empty());
  EXPECT_EQ(err.find('\n'), std::string::npos);
  err.clear();
  EXPECT_EQ(open_dpdk_port({.devargs = "net_nosuchdriver0"}, &err), nullptr);
  EXPECT_FALSE(err.empty());
  err.clear();
  EXPECT_EQ(open_dpdk_port({.devargs = ""}, &err), nullptr);
  EXPECT_FALSE(err.empty());
  // The name that was refused can be opened once its arguments are right.
  auto port = open_dpdk_port({.devargs = memif("net_memif9", "server", "bad")}, &err);
  ASSERT_NE(port, nullptr) << err;
  EXPECT_FALSE(port->link_up());  // no client
}

class MemifPair : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string err;
    server_ = open_dpdk_port({.devargs = memif("net_memif0", "server", "pair")}, &err);
    ASSERT_NE(server_, nullptr) << err;
    client_ = open_dpdk_port({.devargs = memif("net_memif1", "client", "pair")}, &err);
    ASSERT_NE(client_, nullptr) << err;
    ASSERT_TRUE(wait_until([&] { return server_->link_up() && client_->link_up(); },
                           std::chrono::seconds(3)));
  }

  // Sends `count` frames of `len` bytes from one end and collects them at the other.
  static std::vector<uint32_t> move_frames(Port& from, Port& to, uint32_t first, uint32_t count,
                                           uint32_t len) {
    for (uint32_t s = first; s < first + count; ++s) EXPECT_TRUE(send_seq(from, s, len));
    std::vector<uint32_t> got;
    RxFrame frames[32];
    wait_until([&] {
      const uint32_t n = to.rx_burst(frames);
      for (uint32_t i = 0; i < n; ++i) {
        EXPECT_EQ(frames[i].len, len);
        EXPECT_TRUE(frame_intact(frames[i])) << "frame " << seq_of(frames[i]);
        got.push_back(seq_of(frames[i]));
      }
      to.release(std::span(frames, n));
      return got.size() >= count;
    }, std::chrono::seconds(2));
    return got;
  }

  static std::vector<uint32_t> iota(uint32_t first, uint32_t count) {
    std::vector<uint32_t> v;
    for (uint32_t s = first; s < first + count; ++s) v.push_back(s);
    return v;
  }

  std::unique_ptr<Port> server_, client_;
};

TEST_F(MemifPair, JumboFramesCrossWholeAndInOrderBothWays) {
  EXPECT_NE(server_->mac(), client_->mac());
  EXPECT_EQ(move_frames(*client_, *server_, 1, 200, 9014), iota(1, 200));
  EXPECT_EQ(move_frames(*server_, *client_, 1000, 200, 9014), iota(1000, 200));
  EXPECT_EQ(move_frames(*client_, *server_, 5000, 10, 60), iota(5000, 10));
  EXPECT_EQ(client_->stats().tx_frames, 210u);
  EXPECT_EQ(server_->stats().rx_frames, 210u);
  EXPECT_EQ(server_->stats().rx_bytes, 200u * 9014 + 10 * 60);
  EXPECT_EQ(client_->stats().tx_dropped, 0u);
}

TEST_F(MemifPair, ThreadsOutsideEalSendAndReceive) {
  std::vector<uint32_t> got;
  std::thread([&] { got = move_frames(*client_, *server_, 1, 500, 4096); }).join();
  EXPECT_EQ(got, iota(1, 500));
  std::thread([&] { got = move_frames(*server_, *client_, 7, 3, 4096); }).join();
  EXPECT_EQ(got, iota(7, 3));
}

TEST_F(MemifPair, FramesWithTailsArriveWholeAndTheTailIsCopiedBeforeTheSendReturns) {
  ASSERT_TRUE(client_->takes_tails());
  std::vector<uint32_t> got;
  for (uint32_t s = 1; s <= 300; ++s)
    ASSERT_TRUE(send_seq_tail(*client_, s, 9014, s % 3 == 0 ? 9000 : 4096 + s));
  RxFrame frames[32];
  wait_until([&] {
    const uint32_t n = server_->rx_burst(frames);
    for (uint32_t i = 0; i < n; ++i) {
      EXPECT_EQ(frames[i].len, 9014u);
      EXPECT_TRUE(frame_intact(frames[i])) << "frame " << seq_of(frames[i]);
      got.push_back(seq_of(frames[i]));
    }
    server_->release(std::span(frames, n));
    return got.size() >= 300;
  }, std::chrono::seconds(3));
  EXPECT_EQ(got, iota(1, 300));
  // Frames without a tail still go as one segment, in the same bursts.
  EXPECT_EQ(move_frames(*client_, *server_, 400, 50, 4096), iota(400, 50));
  EXPECT_EQ(client_->stats().tx_dropped, 0u);
}

TEST(DpdkPort, TailsAreOnlyForPmdsThatCopyAndCanBeTurnedOff) {
  std::string err;
  setenv("METAROCE_TX_TAILS", "0", 1);
  auto off = open_dpdk_port({.devargs = memif("net_memif7", "server", "tails")}, &err);
  unsetenv("METAROCE_TX_TAILS");
  ASSERT_NE(off, nullptr) << err;
  EXPECT_FALSE(off->takes_tails());
  auto on = open_dpdk_port({.devargs = memif("net_memif8", "client", "tails")}, &err);
  ASSERT_NE(on, nullptr) << err;
  EXPECT_TRUE(on->takes_tails());
  ASSERT_TRUE(wait_until([&] { return off->link_up() && on->link_up(); }, std::chrono::seconds(3)));
  // A port without tails still carries frames from one with them.
  for (uint32_t s = 1; s <= 10; ++s) ASSERT_TRUE(send_seq_tail(*on, s, 3000, 2000));
  uint32_t got = 0;
  RxFrame frames[16];
  wait_until([&] {
    const uint32_t n = off->rx_burst(frames);
    for (uint32_t i = 0; i < n; ++i) EXPECT_TRUE(frame_intact(frames[i]));
    got += n;
    off->release(std::span(frames, n));
    return got >= 10;
  }, std::chrono::seconds(2));
  EXPECT_EQ(got, 10u);
}

TEST_F(MemifPair, SecondOpenOfAnOpenDeviceIsRefused) {
  std::string err;
  EXPECT_EQ(open_dpdk_port({.devargs = memif("net_memif1", "client", "pair")}, &err), nullptr);
  EXPECT_NE(err.find("already open"), std::string::npos) << err;
}

TEST_F(MemifPair, ClosedAndReopenedClientReconnects) {
  client_.reset();
  EXPECT_TRUE(wait_until([&] { return !server_->link_up(); }, std::chrono::seconds(2)));
  std::string err;
  client_ = open_dpdk_port({.devargs = memif("net_memif1", "client", "pair")}, &err);
  ASSERT_NE(client_, nullptr) << err;
  ASSERT_TRUE(wait_until([&] { return server_->link_up() && client_->link_up(); },
                         std::chrono::seconds(3)));
  EXPECT_EQ(move_frames(*client_, *server_, 1, 50, 9014), iota(1, 50));
}

TEST_F(MemifPair, SendingWithoutPeerDropsAndCounts) {
  client_.reset();
  ASSERT_TRUE(wait_until([&] { return !server_->link_up(); }, std::chrono::seconds(2)));
  for (uint32_t s = 1; s <= 5; ++s) ASSERT_TRUE(send_seq(*server_, s));
  EXPECT_EQ(server_->stats().tx_dropped, 5u);
}

TEST(DpdkPort, ChainedFramesFromAPeerWithSmallBuffersArriveWhole) {
  // Both ends ask for 2 KiB shared buffers, so each 9014-byte frame crosses memif as a chain of
  // five descriptors; the port must still hand over one contiguous frame (memif 22.11 copies the
  // chain into our large mbufs itself; other PMDs may leave it to the port's linearising).
  std::string err;
  auto server =
      open_dpdk_port({.devargs = memif("net_memif3", "server", "chain") + ",bsize=2048"}, &err);
  ASSERT_NE(server, nullptr) << err;
  auto client =
      open_dpdk_port({.devargs = memif("net_memif4", "client", "chain") + ",bsize=2048"}, &err);
  ASSERT_NE(client, nullptr) << err;
  ASSERT_TRUE(wait_until([&] { return server->link_up() && client->link_up(); },
                         std::chrono::seconds(3)));
  // Half of them with tails: a two-segment frame is copied into the same chain of buffers.
  for (uint32_t s = 1; s <= 20; ++s)
    ASSERT_TRUE(s % 2 ? send_seq(*client, s, 9014) : send_seq_tail(*client, s, 9014, 7000 + s));
  std::vector<uint32_t> got;
  RxFrame frames[8];
  wait_until([&] {
    const uint32_t n = server->rx_burst(frames);
    for (uint32_t i = 0; i < n; ++i) {
      EXPECT_EQ(frames[i].len, 9014u);
      EXPECT_TRUE(frame_intact(frames[i]));
      got.push_back(seq_of(frames[i]));
    }
    server->release(std::span(frames, n));
    return got.size() >= 20;
  }, std::chrono::seconds(2));
  EXPECT_EQ(got.size(), 20u);
}

TEST(DpdkPort, ReopenWithOtherArgumentsProbesTheDeviceAfresh) {
  std::string err;
  auto server = open_dpdk_port({.devargs = memif("net_memif5", "server", "first")}, &err);
  ASSERT_NE(server, nullptr) << err;
  server.reset();
  // Same device name, another socket: the old instance must go, the new one must listen there.
  server = open_dpdk_port({.devargs = memif("net_memif5", "server", "second")}, &err);
  ASSERT_NE(server, nullptr) << err;
  auto client = open_dpdk_port({.devargs = memif("net_memif6", "client", "second")}, &err);
  ASSERT_NE(client, nullptr) << err;
  EXPECT_TRUE(wait_until([&] { return server->link_up() && client->link_up(); },
                         std::chrono::seconds(3)));
}

TEST(DpdkPort, ManyDevicesOpenedAndClosedInTurnNeverRunOutOfPorts) {
  // A long-lived engine sees links come and go; closed ports are kept stopped for a quick
  // reopen, but never so many that a new device finds no ethdev slot (32 in Debian's DPDK).
  constexpr int kMany = 40;
  std::string err;
  for (int i = 0; i < kMany; ++i) {
    const std::string dev = "net_null" + std::to_string(100 + i);
    auto port = open_dpdk_port({.devargs = dev}, &err);
    ASSERT_NE(port, nullptr) << dev << ": " << err;
  }
  // A device kept open meanwhile survives the clean-up of the closed ones.
  auto kept = open_dpdk_port({.devargs = "net_null99"}, &err);
  ASSERT_NE(kept, nullptr) << err;
  for (int i = 0; i < kMany; ++i) {
    auto port = open_dpdk_port({.devargs = "net_null" + std::to_string(200 + i)}, &err);
    ASSERT_NE(port, nullptr) << err;
  }
  EXPECT_TRUE(kept->link_up());
}

}  // namespace
}  // namespace metaroce::io
