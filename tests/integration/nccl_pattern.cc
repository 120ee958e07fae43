// SPDX-License-Identifier: Apache-2.0
// Drives a verbs device the way NCCL's IB transport does (research notes §4.1), with every byte
// checked: the receiver posts zero-SGE receives and announces each buffer by an RDMA WRITE of a
// 64-byte "clear to send" slot into the sender's fifo; the sender spins on that memory without
// any verbs call, then splits the message across several QPs of the connection as chained
// unsignaled WRITEs ending in a signaled WRITE_WITH_IMM (imm = size), and the receiver expects
// one IBV_WC_RECV_RDMA_WITH_IMM per QP. 512-deep send queues, a CQ of 512 polled 4 at a time,
// 8 slots in flight, a detached thread blocked in ibv_get_async_event.
//
//   nccl_pattern --dev NAME --server [--port P] [--qps N] [--iters N] [--size BYTES]
//   nccl_pattern --dev NAME --connect HOST [same options]
// Exit status 0 only if every check passed (both sides report over the TCP connection).
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "nccl_pattern";
using namespace metaroce::test;

namespace {

constexpr int kSlots = 8;                  // NCCL_STEPS: receives announced ahead
constexpr uint32_t kChunk = 64 * 1024;     // bytes per WRITE work request
constexpr uint32_t kAlign = 128;           // per-QP share alignment, as NCCL splits data
constexpr int kMaxQps = 16;
constexpr uint32_t kSendDepth = 512, kRecvDepth = 256, kCqDepth = 512;


// The clear-to-send slot the receiver writes into the sender's fifo, laid out like NCCL's: the
// sequence number the sender spins on sits inside the slot, not at its end, so the sender relies
// on the 64 bytes being placed in ascending address order.
struct alignas(64) CtsSlot {
  uint64_t addr;
  uint32_t rkey;
  uint32_t size;
  uint64_t tag;
  volatile uint64_t idx;  // iteration + 1, written last by address order
  uint8_t pad[32];
};
static_assert(sizeof(CtsSlot) == 64);

uint8_t pattern(uint32_t iter, size_t i) {
  uint64_t x = (iter + 1) * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return static_cast<uint8_t>(x ^ (x >> 13));
}

// The size of iteration `iter`: 0, tiny, odd and full-size messages, from a fixed sequence both
// sides compute.
uint32_t size_of(uint32_t iter, uint32_t max) {
  switch (iter % 7) {
    case 0: return 0;
    case 1: return 1;
    case 2: return max;
    case 3: return 4097;
    default: {
      uint64_t x = (iter + 7) * 0xD1B54A32D192ED03ull;
      return static_cast<uint32_t>((x >> 17) % (max + 1));
    }
  }
}


struct Wire {  // what the two sides exchange over TCP
  uint32_t qpn[kMaxQps];
  uint8_t gid[16];
  uint8_t active_mtu;
  uint32_t fifo_rkey;  // sender: where CTS slots go
  uint64_t fifo_addr;
};

struct Side {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp[kMaxQps] = {};
  int nqps = 4;
  ibv_port_attr port{};
  ibv_gid gid{};
};

std::atomic<int> async_events{0};

// NCCL keeps one detached thread per port blocked in ibv_get_async_event.
void async_thread(ibv_context* ctx) {
  for (;;) {
    ibv_async_event ev;
    if (ibv_get_async_event(ctx, &ev)) return;
    // COMM_EST is benign (NCCL ignores it); anything else is a failure of the run.
    if (ev.event_type != IBV_EVENT_COMM_EST) {
      std::fprintf(stderr, "async event: %s\n", ibv_event_type_str(ev.event_type));
      async_events.fetch_add(1);
    }
    ibv_ack_async_event(&ev);
  }
}

void open_side(Side& s, const std::string& dev) {
  if (ibv_fork_init()) die("ibv_fork_init");
  s.ctx = open_device_named(dev);
  ibv_device_attr da;
  if (ibv_query_device(s.ctx, &da)) die("ibv_query_device");
  CHECK(da.max_qp >= s.nqps && da.max_qp_wr >= static_cast<int>(kSendDepth), "device limits");
  if (ibv_query_port(s.ctx, 1, &s.port)) die("ibv_query_port");
  CHECK(s.port.state == IBV_PORT_ACTIVE, "port not ACTIVE");
  CHECK(s.port.link_layer == IBV_LINK_LAYER_ETHERNET, "link layer not Ethernet");
  if (ibv_query_gid(s.ctx, 1, 0, &s.gid)) die("ibv_query_gid");
  std::thread(async_thread, s.ctx).detach();
  s.pd = ibv_alloc_pd(s.ctx);
  s.cq = ibv_create_cq(s.ctx, kCqDepth, nullptr, nullptr, 0);
  if (!s.pd || !s.cq) die("pd/cq");
  for (int q = 0; q < s.nqps; ++q) {
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = s.cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = kSendDepth;
    a.cap.max_recv_wr = kRecvDepth;
    a.cap.max_send_sge = a.cap.max_recv_sge = 1;
    a.cap.max_inline_data = 0;
    s.qp[q] = ibv_create_qp(s.pd, &a);
    if (!s.qp[q]) die("ibv_create_qp");
    modify_to_init(s.qp[q], IBV_ACCESS_REMOTE_WRITE);  // NCCL's INIT: remote WRITE only
  }
}

void connect_side(Side& s, const Wire& peer) {
  // NCCL's RTR/RTS: the smaller active MTU, hop limit 255, timeout 20 (NCCL_IB_TIMEOUT).
  for (int q = 0; q < s.nqps; ++q) {
    RcPeer p{peer.qpn[q], peer.gid,
             static_cast<ibv_mtu>(std::min<int>(s.port.active_mtu, peer.active_mtu))};
    p.hop_limit = 255;
    p.timeout = 20;
    modify_to_rts(s.qp[q], p);
  }
}

ibv_mr* reg(Side& s, void* p, size_t n) {
  ibv_mr* mr = ibv_reg_mr(s.pd, p, n,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!mr) die("ibv_reg_mr");
  return mr;
}

void* page_alloc(size_t n) {
  void* p = aligned_alloc(4096, (n + 4095) & ~size_t{4095});
  if (!p) die("aligned_alloc");
  std::memset(p, 0, n);
  return p;
}

// wr_id: low 8 bits the slot, then the QP, then the iteration (NCCL keeps the request in the
// low bits too).
uint64_t make_id(uint32_t iter, int q, int slot) {
  return (uint64_t{iter} << 16) | (uint64_t(q) << 8) | uint64_t(slot);
}

using Clock = std::chrono::steady_clock;

// Receiver: announces buffers, counts per-QP WRITE_WITH_IMM completions, checks every byte.
void run_receiver(Side& s, int tcp, uint32_t iters, uint32_t max) {
  auto* data = static_cast<uint8_t*>(page_alloc(size_t{max} * kSlots));
  auto* cts = static_cast<CtsSlot*>(page_alloc(sizeof(CtsSlot) * kSlots));
  ibv_mr* data_mr = reg(s, data, size_t{max} * kSlots + (max == 0));
  ibv_mr* cts_mr = reg(s, cts, sizeof(CtsSlot) * kSlots);
  Wire peer{};
  read_all(tcp, &peer, sizeof(peer));  // the sender's fifo
  std::vector<int> got(kSlots, 0);     // WRITE_WITH_IMM completions of the slot's iteration
  uint32_t announced = 0, done = 0, cts_unsignaled = 0;

  auto announce = [&](uint32_t iter) {
    const int slot = static_cast<int>(iter % kSlots);
    for (int q = 0; q < s.nqps; ++q) {
      ibv_recv_wr wr{}, *bad = nullptr;
      wr.wr_id = make_id(iter, q, slot);
      wr.sg_list = nullptr;  // zero-SGE receive: WRITE_WITH_IMM consumes it without data
      wr.num_sge = 0;
      if (ibv_post_recv(s.qp[q], &wr, &bad)) die("ibv_post_recv");
    }
    CtsSlot& c = cts[slot];
    c.addr = reinterpret_cast<uintptr_t>(data + static_cast<size_t>(slot) * max);
    c.rkey = data_mr->rkey;
    c.size = max;
    c.tag = 0x4e43434c;  // "NCCL"
    c.idx = iter + 1;
    ibv_sge sge{reinterpret_cast<uintptr_t>(&c), sizeof(CtsSlot), cts_mr->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = make_id(iter, 0, slot) | (uint64_t{1} << 63);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    // Mostly unsignaled, as NCCL; one in kSlots signaled so the send queue is known to drain.
    wr.send_flags = (++cts_unsignaled % kSlots == 0) ? IBV_SEND_SIGNALED : 0;
    wr.wr.rdma.remote_addr = peer.fifo_addr + sizeof(CtsSlot) * slot;
    wr.wr.rdma.rkey = peer.fifo_rkey;
    if (ibv_post_send(s.qp[0], &wr, &bad)) die("ibv_post_send (CTS)");
  };

  while (announced < std::min<uint32_t>(iters, kSlots)) announce(announced++);
  auto last_progress = Clock::now();
  while (done < iters) {
    ibv_wc wc[4];
    const int n = ibv_poll_cq(s.cq, 4, wc);
    if (n < 0) die("ibv_poll_cq");
    if (n == 0) {
      CHECK(Clock::now() - last_progress < std::chrono::seconds(30), "receiver stalled at %u", done);
      if (failures) break;
      continue;
    }
    last_progress = Clock::now();
    for (int i = 0; i < n; ++i) {
      const ibv_wc& w = wc[i];
      CHECK(w.status == IBV_WC_SUCCESS, "receiver completion: %s", ibv_wc_status_str(w.status));
      if (w.wr_id >> 63) continue;  // a signaled CTS WRITE
      const uint32_t iter = static_cast<uint32_t>(w.wr_id >> 16);
      const int slot = static_cast<int>(w.wr_id & 0xff);
      CHECK(w.opcode == IBV_WC_RECV_RDMA_WITH_IMM, "opcode %d", w.opcode);
      CHECK(w.wc_flags & IBV_WC_WITH_IMM, "no immediate");
      // NCCL reads imm_data raw: the sender put the size in host order.
      CHECK(w.imm_data == size_of(iter, max), "iteration %u: imm %u, expected size %u", iter,
            w.imm_data, size_of(iter, max));
      CHECK(w.byte_len == 0 || w.byte_len <= max, "byte_len %u", w.byte_len);
      CHECK(iter == done + static_cast<uint32_t>((slot - static_cast<int>(done % kSlots) +
                                                  kSlots) % kSlots),
            "completion for iteration %u out of order (done %u)", iter, done);
      ++got[slot];
    }
    // Iterations complete in order: check the oldest while all its QPs have reported.
    while (done < iters && got[done % kSlots] == s.nqps) {
      const int slot = static_cast<int>(done % kSlots);
      const uint32_t size = size_of(done, max);
      const uint8_t* p = data + static_cast<size_t>(slot) * max;
      for (uint32_t i = 0; i < size; ++i)
        if (p[i] != pattern(done, i)) {
          CHECK(false, "iteration %u byte %u: %#x, expected %#x", done, i, p[i],
                pattern(done, i));
          break;
        }
      got[slot] = 0;
      ++done;
      if (announced < iters) announce(announced++);
    }
    if (failures) break;
  }
  std::printf("receiver: %u iterations checked\n", done);
}

// Sender: spins on the fifo for each CTS, then splits the message across the QPs.
void run_sender(Side& s, int tcp, uint32_t iters, uint32_t max) {
  auto* fifo = static_cast<CtsSlot*>(page_alloc(sizeof(CtsSlot) * kSlots));
  auto* src = static_cast<uint8_t*>(page_alloc(size_t{max} * kSlots + 1));
  ibv_mr* fifo_mr = reg(s, fifo, sizeof(CtsSlot) * kSlots);
  ibv_mr* src_mr = reg(s, src, size_t{max} * kSlots + 1);
  Wire w{};
  w.fifo_addr = reinterpret_cast<uintptr_t>(fifo);
  w.fifo_rkey = fifo_mr->rkey;
  write_all(tcp, &w, sizeof(w));
  std::vector<int> pending(kSlots, 0);  // signaled WRITE_WITH_IMMs of the slot not completed
  uint64_t spins = 0;
  std::vector<ibv_send_wr> wrs(kSendDepth);
  std::vector<ibv_sge> sges(kSendDepth);

  auto reap = [&](bool block_for_slot, int slot) {
    auto start = Clock::now();
    for (;;) {
      ibv_wc wc[4];
      const int n = ibv_poll_cq(s.cq, 4, wc);
      if (n < 0) die("ibv_poll_cq");
      for (int i = 0; i < n; ++i) {
        CHECK(wc[i].status == IBV_WC_SUCCESS, "sender completion: %s",
              ibv_wc_status_str(wc[i].status));
        CHECK(wc[i].opcode == IBV_WC_RDMA_WRITE, "sender opcode %d", wc[i].opcode);
        --pending[wc[i].wr_id & 0xff];
      }
      if (!block_for_slot || pending[slot] == 0 || failures) return;
      if (Clock::now() - start > std::chrono::seconds(30)) {
        CHECK(false, "sender: slot %d never completed", slot);
        return;
      }
    }
  };

  for (uint32_t iter = 0; iter < iters && !failures; ++iter) {
    const int slot = static_cast<int>(iter % kSlots);
    reap(true, slot);  // the slot's previous send buffer is free again
    // Clear to send? Spin on memory the peer's WRITE fills: no verbs call in this loop.
    CtsSlot& c = fifo[slot];
    const auto start = Clock::now();
    while (c.idx != iter + 1) {
      ++spins;
      if ((spins & 0xfffff) == 0 && Clock::now() - start > std::chrono::seconds(30)) {
        CHECK(false, "sender: no CTS for iteration %u", iter);
        return;
      }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    CHECK(c.tag == 0x4e43434c, "CTS %u: tag %#lx (slot placed out of order?)", iter,
          static_cast<unsigned long>(c.tag));
    const uint32_t size = size_of(iter, max);
    CHECK(size <= c.size, "CTS %u: buffer of %u for %u bytes", iter, c.size, size);
    uint8_t* p = src + static_cast<size_t>(slot) * max;
    for (uint32_t i = 0; i < size; ++i) p[i] = pattern(iter, i);
    // Each QP carries an aligned share; its last WR is the signaled WRITE_WITH_IMM.
    const uint32_t share = ((size + s.nqps - 1) / s.nqps + kAlign - 1) / kAlign * kAlign;
    for (int q = 0; q < s.nqps; ++q) {
      const uint32_t off = std::min<uint32_t>(size, share * q);
      const uint32_t len = std::min<uint32_t>(size - off, share);
      int n = 0;
      uint32_t pos = 0;
      do {
        const uint32_t piece = std::min(kChunk, len - pos);
        ibv_sge& g = sges[n];
        g = {reinterpret_cast<uintptr_t>(p + off + pos), piece, src_mr->lkey};
        ibv_send_wr& wr = wrs[n];
        wr = {};
        wr.wr_id = make_id(iter, q, slot);
        wr.sg_list = piece ? &g : nullptr;
        wr.num_sge = piece ? 1 : 0;
        wr.opcode = IBV_WR_RDMA_WRITE;
        wr.wr.rdma.remote_addr = c.addr + off + pos;
        wr.wr.rdma.rkey = c.rkey;
        if (n > 0) wrs[n - 1].next = &wr;
        pos += piece;
        ++n;
      } while (pos < len);
      ibv_send_wr& last = wrs[n - 1];
      last.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      last.imm_data = size;  // host order, read back raw by the receiver
      last.send_flags = IBV_SEND_SIGNALED;
      ++pending[slot];
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(s.qp[q], &wrs[0], &bad)) die("ibv_post_send (data)");
    }
  }
  for (int slot = 0; slot < kSlots && !failures; ++slot) reap(true, slot);
  std::printf("sender: %u iterations sent, %llu spins on the fifo\n", iters,
              static_cast<unsigned long long>(spins));
}

}  // namespace

int main(int argc, char** argv) {
  std::string dev, host;
  bool server = false;
  int port = 18700;
  uint32_t iters = 400, size = 1 << 20;
  Side s;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? argv[++i] : (std::exit(2), ""); };
    if (a == "--dev") dev = next();
    else if (a == "--server") server = true;
    else if (a == "--connect") host = next();
    else if (a == "--port") port = std::atoi(next());
    else if (a == "--qps") s.nqps = std::clamp(std::atoi(next()), 1, kMaxQps);
    else if (a == "--iters") iters = static_cast<uint32_t>(std::atol(next()));
    else if (a == "--size") size = static_cast<uint32_t>(std::atol(next()));
    else {
      std::fprintf(stderr, "nccl_pattern: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (dev.empty() || (!server && host.empty())) {
    std::fprintf(stderr, "usage: nccl_pattern --dev NAME (--server | --connect HOST) ...\n");
    return 2;
  }
  open_side(s, dev);
  const int tcp = tcp_open(host.c_str(), port, server);
  Wire mine{}, peer{};
  for (int q = 0; q < s.nqps; ++q) mine.qpn[q] = s.qp[q]->qp_num;
  std::memcpy(mine.gid, s.gid.raw, 16);
  mine.active_mtu = static_cast<uint8_t>(s.port.active_mtu);
  write_all(tcp, &mine, sizeof(mine));
  read_all(tcp, &peer, sizeof(peer));
  connect_side(s, peer);
  char ready = 'r';  // both at RTS before any traffic, as NCCL's connect handshake ensures
  write_all(tcp, &ready, 1);
  read_all(tcp, &ready, 1);
  const auto t0 = Clock::now();
  if (server) run_receiver(s, tcp, iters, size);
  else run_sender(s, tcp, iters, size);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  CHECK(async_events.load() == 0, "%d unexpected async events", async_events.load());
  int32_t mine_ok = failures, peer_failures = 0;
  write_all(tcp, &mine_ok, sizeof(mine_ok));
  read_all(tcp, &peer_failures, sizeof(peer_failures));
  close(tcp);
  if (failures || peer_failures) {
    std::fprintf(stderr, "nccl_pattern: %d failure(s) here, %d at the peer\n", failures,
                 peer_failures);
    return 1;
  }
  std::printf("nccl_pattern %s: %u iterations, %d QPs, up to %u bytes, %.2f s: all checks passed\n",
              server ? "receiver" : "sender", iters, s.nqps, size, secs);
  return 0;
}
