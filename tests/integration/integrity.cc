// SPDX-License-Identifier: Apache-2.0
// Data-integrity and error-path check of a verbs device, written against plain libibverbs:
// RDMA WRITE, WRITE_WITH_IMM, SEND, SEND_WITH_IMM and READ of known patterns with every byte
// checked on the other side, then the errors verbs specifies (wrong rkey, out-of-bounds address,
// posting to a QP in RESET, too many SGEs) with a guard area proving nothing was written.
//
//   integrity --dev NAME --server [--port P] [--listen ADDR]   (responder side; loopback)
//   integrity --dev NAME --connect HOST [--port P] [--sizes 1,4096,...]
// Exit status 0 only if every check passed; each failure prints one line.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "integrity";
using namespace metaroce::test;

namespace {

constexpr int kDataQp = 0, kBadKeyQp = 1, kBoundsQp = 2, kBadReadQp = 3, kNumQps = 4;
constexpr uint8_t kGuard = 0xEE;
constexpr uint32_t kImm = 0x12345678;

uint8_t pattern(uint32_t seed, size_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x ^ (x >> 17));
}
void fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = pattern(seed, i);
}
// Returns the first mismatching index, or -1.
long verify(const uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != pattern(seed, i)) return static_cast<long>(i);
  return -1;
}

struct Wire {  // what the two sides exchange over TCP
  uint32_t qpn[kNumQps];
  uint8_t gid[16];
  uint32_t rkey;
  uint64_t addr;
  uint64_t region;  // bytes per region
};

struct Ctx {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_mr* mr = nullptr;
  ibv_qp* qp[kNumQps] = {};
  ibv_qp* reset_qp = nullptr;
  uint8_t* buf = nullptr;
  size_t region = 0;
  uint8_t* region_ptr(int i) { return buf + i * region; }
};

ibv_qp* make_qp(Ctx& c) {
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = c.cq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = 64;
  a.cap.max_recv_wr = 64;
  a.cap.max_send_sge = 4;
  a.cap.max_recv_sge = 4;
  ibv_qp* qp = ibv_create_qp(c.pd, &a);
  if (!qp) die("ibv_create_qp");
  return qp;
}

ibv_wc wait_wc(Ctx& c, const char* what) {
  ibv_wc wc{};
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    int n = ibv_poll_cq(c.cq, 1, &wc);
    if (n < 0) die("ibv_poll_cq");
    if (n == 1) return wc;
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "FAIL: timed out waiting for %s\n", what);
      std::exit(1);
    }
  }
}

int post(ibv_qp* qp, ibv_wr_opcode op, uint64_t wr_id, ibv_sge* sge, int nsge, uint64_t raddr,
         uint32_t rkey, bool imm = false) {
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = sge;
  wr.num_sge = nsge;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  if (imm) wr.imm_data = htonl(kImm);
  int rc = ibv_post_send(qp, &wr, &bad);
  if (rc == 0 && bad) ++failures;
  return rc;
}

void post_recv(ibv_qp* qp, uint64_t wr_id, ibv_sge* sge, int nsge) {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = sge;
  wr.num_sge = nsge;
  if (ibv_post_recv(qp, &wr, &bad)) die("ibv_post_recv");
}

// Three SGEs over [p, p+n): exercises gather/scatter across element boundaries.
int split_sges(ibv_sge* sge, uint8_t* p, size_t n, uint32_t lkey) {
  size_t a = n / 3, b = n / 2;
  sge[0] = {reinterpret_cast<uint64_t>(p), static_cast<uint32_t>(a), lkey};
  sge[1] = {reinterpret_cast<uint64_t>(p + a), static_cast<uint32_t>(b - a), lkey};
  sge[2] = {reinterpret_cast<uint64_t>(p + b), static_cast<uint32_t>(n - b), lkey};
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dev_name, host;
  bool server = false;
  int port = 18600;
  std::vector<size_t> sizes = {1, 2, 4095, 4096, 4097, 65536, 1 << 20};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "integrity: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--dev") dev_name = next();
    else if (a == "--server") server = true;
    else if (a == "--listen") host = next();
    else if (a == "--connect") host = next();
    else if (a == "--port") port = std::atoi(next().c_str());
    else if (a == "--sizes") {
      sizes.clear();
      std::string s = next();
      for (size_t pos = 0; pos < s.size();) {
        size_t comma = s.find(',', pos);
        sizes.push_back(std::strtoull(s.substr(pos, comma - pos).c_str(), nullptr, 0));
        pos = comma == std::string::npos ? s.size() : comma + 1;
      }
    } else {
      std::fprintf(stderr, "integrity: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (dev_name.empty() || (!server && host.empty())) {
    std::fprintf(stderr, "usage: integrity --dev NAME (--server | --connect HOST) [--port P]\n");
    return 2;
  }
  size_t max_size = 0;
  for (size_t s : sizes) max_size = std::max(max_size, s);

  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ibv_device* dev = nullptr;
  for (int i = 0; i < n; ++i)
    if (dev_name == ibv_get_device_name(list[i])) dev = list[i];
  if (!dev) {
    std::fprintf(stderr, "integrity: no device %s\n", dev_name.c_str());
    return 2;
  }
  Ctx c;
  c.ctx = ibv_open_device(dev);
  if (!c.ctx) die("ibv_open_device");
  ibv_gid gid;
  if (ibv_query_gid(c.ctx, 1, 0, &gid)) die("ibv_query_gid");
  c.pd = ibv_alloc_pd(c.ctx);
  c.cq = ibv_create_cq(c.ctx, 256, nullptr, nullptr, 0);
  if (!c.pd || !c.cq) die("pd/cq");
  // Regions: 0 WRITE target, 1 WRITE_IMM target, 2 SEND target, 3 READ source, 4 guard.
  c.region = max_size + 64;
  const size_t total = c.region * 5;
  c.buf = static_cast<uint8_t*>(aligned_alloc(4096, (total + 4095) / 4096 * 4096));
  c.mr = ibv_reg_mr(c.pd, c.buf, total,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!c.mr) die("ibv_reg_mr");
  for (auto& q : c.qp) q = make_qp(c);
  c.reset_qp = make_qp(c);

  int sock = tcp_open(host.c_str(), port, server);
  Wire mine{}, peer{};
  for (int i = 0; i < kNumQps; ++i) mine.qpn[i] = c.qp[i]->qp_num;
  std::memcpy(mine.gid, gid.raw, 16);
  mine.rkey = c.mr->rkey;
  mine.addr = reinterpret_cast<uint64_t>(c.buf);
  mine.region = c.region;
  write_all(sock, &mine, sizeof(mine));
  read_all(sock, &peer, sizeof(peer));
  for (int i = 0; i < kNumQps; ++i) {
    modify_to_init(c.qp[i], IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    modify_to_rts(c.qp[i], RcPeer{peer.qpn[i], peer.gid});
  }
  const uint64_t rbase = peer.addr;
  char sync = 0;

  // Local argument errors, before any traffic.
  if (!server) {
    ibv_sge sge[8];
    for (auto& s : sge) s = {reinterpret_cast<uint64_t>(c.buf), 8, c.mr->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.opcode = IBV_WR_SEND;
    wr.sg_list = sge;
    wr.num_sge = 8;  // the QP was created with max_send_sge 4
    CHECK(ibv_post_send(c.qp[kDataQp], &wr, &bad) == EINVAL && bad == &wr,
          "too many SGEs: expected EINVAL and bad_wr set");
    wr.num_sge = 1;
    bad = nullptr;
    CHECK(ibv_post_send(c.reset_qp, &wr, &bad) == EINVAL && bad == &wr,
          "post_send to a QP in RESET: expected EINVAL");
  }

  for (size_t size : sizes) {
    const uint32_t seed = static_cast<uint32_t>(size * 7);
    std::memset(c.buf, 0, c.region * 4);
    std::memset(c.region_ptr(4), kGuard, c.region);
    if (server) {
      fill(c.region_ptr(3), size, seed + 3);  // what the client READs
      ibv_sge s1[3], s2[3];
      // WRITE_IMM consumes a receive with no buffer; SEND scatters into three SGEs.
      post_recv(c.qp[kDataQp], 1, nullptr, 0);
      post_recv(c.qp[kDataQp], 2, s2, split_sges(s2, c.region_ptr(2), size, c.mr->lkey));
      post_recv(c.qp[kDataQp], 3, s1, 0);
      write_all(sock, &sync, 1);  // receives are posted
      ibv_wc wc = wait_wc(c, "RECV_RDMA_WITH_IMM");
      CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1 &&
                wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && (wc.wc_flags & IBV_WC_WITH_IMM) &&
                ntohl(wc.imm_data) == kImm,
            "size %zu: WRITE_WITH_IMM completion: status %d wr_id %lu opcode %d imm %x", size,
            wc.status, wc.wr_id, wc.opcode, ntohl(wc.imm_data));
      wc = wait_wc(c, "RECV");
      CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 2 && wc.opcode == IBV_WC_RECV &&
                wc.byte_len == size,
            "size %zu: SEND completion: status %d wr_id %lu byte_len %u", size, wc.status,
            wc.wr_id, wc.byte_len);
      wc = wait_wc(c, "zero-length SEND_WITH_IMM");
      CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 3 && wc.byte_len == 0 &&
                (wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == kImm,
            "size %zu: zero-length SEND_WITH_IMM: status %d byte_len %u", size, wc.status,
            wc.byte_len);
      read_all(sock, &sync, 1);  // the client's READ finished
      long bad;
      CHECK((bad = verify(c.region_ptr(0), size, seed)) < 0, "size %zu: WRITE data wrong at %ld",
            size, bad);
      CHECK((bad = verify(c.region_ptr(1), size, seed + 1)) < 0,
            "size %zu: WRITE_WITH_IMM data wrong at %ld", size, bad);
      CHECK((bad = verify(c.region_ptr(2), size, seed + 2)) < 0,
            "size %zu: SEND data wrong at %ld", size, bad);
      CHECK(c.region_ptr(0)[size] == 0 && c.region_ptr(1)[size] == 0 &&
                c.region_ptr(2)[size] == 0,
            "size %zu: bytes written past the end of a message", size);
      write_all(sock, &sync, 1);
    } else {
      fill(c.region_ptr(0), size, seed);
      fill(c.region_ptr(1), size, seed + 1);
      fill(c.region_ptr(2), size, seed + 2);
      read_all(sock, &sync, 1);
      ibv_sge sge[3];
      CHECK(post(c.qp[kDataQp], IBV_WR_RDMA_WRITE, 10, sge,
                 split_sges(sge, c.region_ptr(0), size, c.mr->lkey), rbase, peer.rkey) == 0,
            "post WRITE");
      ibv_sge one = {reinterpret_cast<uint64_t>(c.region_ptr(1)), static_cast<uint32_t>(size),
                     c.mr->lkey};
      CHECK(post(c.qp[kDataQp], IBV_WR_RDMA_WRITE_WITH_IMM, 11, &one, 1, rbase + peer.region,
                 peer.rkey, true) == 0, "post WRITE_WITH_IMM");
      CHECK(post(c.qp[kDataQp], IBV_WR_SEND, 12, sge,
                 split_sges(sge, c.region_ptr(2), size, c.mr->lkey), 0, 0) == 0, "post SEND");
      CHECK(post(c.qp[kDataQp], IBV_WR_SEND_WITH_IMM, 13, nullptr, 0, 0, 0, true) == 0,
            "post SEND_WITH_IMM");
      ibv_sge rd = {reinterpret_cast<uint64_t>(c.region_ptr(3)), static_cast<uint32_t>(size),
                    c.mr->lkey};
      CHECK(post(c.qp[kDataQp], IBV_WR_RDMA_READ, 14, &rd, 1, rbase + 3 * peer.region,
                 peer.rkey) == 0, "post READ");
      const ibv_wc_opcode expect[] = {IBV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE, IBV_WC_SEND,
                                      IBV_WC_SEND, IBV_WC_RDMA_READ};
      for (int k = 0; k < 5; ++k) {
        ibv_wc wc = wait_wc(c, "send completion");
        CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == uint64_t(10 + k) &&
                  wc.opcode == expect[k],
              "size %zu: completion %d: status %s wr_id %lu opcode %d", size, k,
              ibv_wc_status_str(wc.status), wc.wr_id, wc.opcode);
      }
      long bad;
      CHECK((bad = verify(c.region_ptr(3), size, seed + 3)) < 0,
            "size %zu: READ data wrong at %ld", size, bad);
      write_all(sock, &sync, 1);
      read_all(sock, &sync, 1);
    }
    if (failures) break;
  }

  // Remote errors: each on its own QP, since an error moves the requester's QP to ERR.
  if (!server) {
    ibv_sge sge = {reinterpret_cast<uint64_t>(c.buf), 64, c.mr->lkey};
    const uint64_t guard = rbase + 4 * peer.region;
    CHECK(post(c.qp[kBadKeyQp], IBV_WR_RDMA_WRITE, 20, &sge, 1, guard, peer.rkey ^ 0x5a5a00) == 0,
          "post bad-rkey WRITE");
    // Behind it, a valid WRITE that must complete flushed. It aims outside the guard: sprayed
    // over paths of unequal delay its packet may overtake the rejected one and be placed
    // (docs/design.md, "Errors as an RC responder"), which the guard must not count.
    CHECK(post(c.qp[kBadKeyQp], IBV_WR_RDMA_WRITE, 21, &sge, 1, rbase, peer.rkey) == 0,
          "post WRITE behind it");
    ibv_wc wc = wait_wc(c, "bad-rkey completion");
    CHECK(wc.wr_id == 20 && wc.status == IBV_WC_REM_ACCESS_ERR,
          "wrong rkey: expected REM_ACCESS_ERR, got %s (wr_id %lu)", ibv_wc_status_str(wc.status),
          wc.wr_id);
    wc = wait_wc(c, "flushed completion");
    CHECK(wc.wr_id == 21 && wc.status == IBV_WC_WR_FLUSH_ERR,
          "WR behind an error: expected WR_FLUSH_ERR, got %s", ibv_wc_status_str(wc.status));
    // The QP is in the error state now: a WR posted there is accepted and completes flushed
    // (as on hardware devices and rxe), not refused.
    CHECK(post(c.qp[kBadKeyQp], IBV_WR_RDMA_WRITE, 24, &sge, 1, guard, peer.rkey) == 0,
          "post WRITE to a QP in the error state");
    wc = wait_wc(c, "flushed completion after the error");
    CHECK(wc.wr_id == 24 && wc.status == IBV_WC_WR_FLUSH_ERR,
          "WR posted in the error state: expected WR_FLUSH_ERR, got %s", ibv_wc_status_str(wc.status));
    // Out of bounds: starts inside the MR, ends past it.
    const uint64_t mr_end = rbase + 5 * peer.region;
    CHECK(post(c.qp[kBoundsQp], IBV_WR_RDMA_WRITE, 22, &sge, 1, mr_end - 16, peer.rkey) == 0,
          "post out-of-bounds WRITE");
    wc = wait_wc(c, "out-of-bounds completion");
    CHECK(wc.wr_id == 22 && wc.status == IBV_WC_REM_ACCESS_ERR,
          "out of bounds: expected REM_ACCESS_ERR, got %s", ibv_wc_status_str(wc.status));
    CHECK(post(c.qp[kBadReadQp], IBV_WR_RDMA_READ, 23, &sge, 1, rbase, peer.rkey + 0x100) == 0,
          "post bad-rkey READ");
    wc = wait_wc(c, "bad READ completion");
    CHECK(wc.wr_id == 23 && wc.status == IBV_WC_REM_ACCESS_ERR,
          "READ with wrong rkey: expected REM_ACCESS_ERR, got %s", ibv_wc_status_str(wc.status));
    write_all(sock, &sync, 1);
  } else {
    read_all(sock, &sync, 1);
    for (size_t i = 0; i < c.region; ++i)
      if (c.region_ptr(4)[i] != kGuard) {
        CHECK(false, "guard byte %zu was written by a rejected WRITE", i);
        break;
      }
  }
  int peer_failures = 0;
  write_all(sock, &failures, sizeof(failures));
  read_all(sock, &peer_failures, sizeof(peer_failures));
  close(sock);
  for (auto* q : c.qp) ibv_destroy_qp(q);
  ibv_destroy_qp(c.reset_qp);
  ibv_dereg_mr(c.mr);
  ibv_destroy_cq(c.cq);
  ibv_dealloc_pd(c.pd);
  ibv_close_device(c.ctx);
  ibv_free_device_list(list);
  std::printf("integrity %s: %d failures here, %d at the peer\n", server ? "server" : "client",
              failures, peer_failures);
  return failures || peer_failures ? 1 : 0;
}
