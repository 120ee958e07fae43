// SPDX-License-Identifier: Apache-2.0
// Asynchronous events and fork behaviour of a verbs device, in one process over NIC loopback:
// COMM_EST, SRQ_LIMIT_REACHED, QP_FATAL (retries exhausted towards a peer that does not exist),
// QP_LAST_WQE_REACHED through ibv_get_async_event; and ibv_fork_init / fork with a device open.
//
//   verbs_async --dev NAME --test events
//   verbs_async --dev NAME --test fork [--no-fork-init]
// Exit status 0 only if every check passed; each failure prints one line.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/wait.h>
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

const char* const metaroce::test::kProgram = "verbs_async";
using namespace metaroce::test;

namespace {


constexpr size_t kBuf = 1 << 16;

struct Dev {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_mr* mr = nullptr;
  uint8_t* buf = nullptr;
  ibv_gid gid{};
};

Dev open_dev(const char* name) {
  Dev d;
  d.ctx = open_device_named(name);
  d.pd = ibv_alloc_pd(d.ctx);
  d.cq = ibv_create_cq(d.ctx, 256, nullptr, nullptr, 0);
  d.buf = static_cast<uint8_t*>(aligned_alloc(4096, kBuf));
  std::memset(d.buf, 0, kBuf);
  d.mr = ibv_reg_mr(d.pd, d.buf, kBuf,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!d.pd || !d.cq || !d.mr) die("pd/cq/mr");
  if (ibv_query_gid(d.ctx, 1, 0, &d.gid)) die("ibv_query_gid");
  return d;
}

ibv_qp* make_qp(Dev& d, ibv_srq* srq) {
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = d.cq;
  a.srq = srq;
  a.cap.max_send_wr = a.cap.max_recv_wr = 64;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  a.qp_type = IBV_QPT_RC;
  ibv_qp* qp = ibv_create_qp(d.pd, &a);
  if (!qp) die("ibv_create_qp");
  ibv_qp_attr m{};
  m.qp_state = IBV_QPS_INIT;
  m.port_num = 1;
  m.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    die("modify INIT");
  return qp;
}

// INIT -> RTR (and RTS unless rtr_only) towards qpn at gid; retry_cnt small for QP_FATAL.
void connect_qp(ibv_qp* qp, const ibv_gid& gid, uint32_t qpn, bool rtr_only) {
  ibv_qp_attr m{};
  m.qp_state = IBV_QPS_RTR;
  m.path_mtu = IBV_MTU_1024;
  m.dest_qp_num = qpn;
  m.max_dest_rd_atomic = 1;
  m.min_rnr_timer = 12;
  m.ah_attr.is_global = 1;
  m.ah_attr.grh.dgid = gid;
  m.ah_attr.grh.hop_limit = 1;
  m.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    die("modify RTR");
  if (rtr_only) return;
  m.qp_state = IBV_QPS_RTS;
  m.timeout = 10;
  m.retry_cnt = 1;
  m.rnr_retry = 7;
  m.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    die("modify RTS");
}

void to_rts(ibv_qp* qp) {
  ibv_qp_attr m{};
  m.qp_state = IBV_QPS_RTS;
  m.timeout = 14;
  m.retry_cnt = 7;
  m.rnr_retry = 7;
  m.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &m, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    die("modify RTS");
}

int post(ibv_qp* qp, ibv_wr_opcode op, Dev& d, size_t off, uint32_t len, uint64_t wr_id,
         uint64_t raddr = 0, uint32_t rkey = 0) {
  ibv_sge s{reinterpret_cast<uintptr_t>(d.buf + off), len, d.mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &s;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(qp, &wr, &bad);
}

// Polls until n completions arrived or `secs` passed.
std::vector<ibv_wc> wait_wc(ibv_cq* cq, size_t n, double secs) {
  std::vector<ibv_wc> got;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  while (got.size() < n && std::chrono::steady_clock::now() < end) {
    ibv_wc wc[8];
    int k = ibv_poll_cq(cq, 8, wc);
    if (k < 0) die("ibv_poll_cq");
    got.insert(got.end(), wc, wc + k);
  }
  return got;
}

struct Event {
  ibv_event_type type;
  void* element;
};

// Reads async events until `want` is among them or `secs` passed; returns all read.
std::vector<Event> wait_event(ibv_context* ctx, ibv_event_type want, double secs,
                              std::vector<Event>& seen) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  for (;;) {
    for (const Event& e : seen)
      if (e.type == want) return seen;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        end - std::chrono::steady_clock::now());
    if (left.count() <= 0) return seen;
    pollfd p{ctx->async_fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    ibv_async_event ev;
    if (ibv_get_async_event(ctx, &ev)) die("ibv_get_async_event");
    seen.push_back({ev.event_type, ev.element.qp});  // a union: any member names the object
    ibv_ack_async_event(&ev);
  }
}

bool has(const std::vector<Event>& v, ibv_event_type t, void* element) {
  for (const Event& e : v)
    if (e.type == t && e.element == element) return true;
  return false;
}

int test_events(const char* dev) {
  Dev d = open_dev(dev);
  std::vector<Event> seen;

  // SRQ with 8 receives, limit armed at 6; a QP on it stays in RTR so its first message is
  // COMM_EST; the peer QP has its own receive queue.
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = 16;
  sa.attr.max_sge = 1;
  ibv_srq* srq = ibv_create_srq(d.pd, &sa);
  if (!srq) die("ibv_create_srq");
  for (int i = 0; i < 8; ++i) {
    ibv_sge s{reinterpret_cast<uintptr_t>(d.buf + 8192 + i * 1024), 1024, d.mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = 1000 + i;
    wr.sg_list = &s;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    CHECK(ibv_post_srq_recv(srq, &wr, &bad) == 0, "ibv_post_srq_recv");
  }
  ibv_srq_attr lim{};
  lim.srq_limit = 20;
  CHECK(ibv_modify_srq(srq, &lim, IBV_SRQ_LIMIT) == EINVAL, "a limit above max_wr is refused");
  lim.srq_limit = 6;
  CHECK(ibv_modify_srq(srq, &lim, IBV_SRQ_LIMIT) == 0, "arming the SRQ limit");
  ibv_srq_attr q{};
  CHECK(ibv_query_srq(srq, &q) == 0 && q.srq_limit == 6 && q.max_wr == 16, "ibv_query_srq");

  ibv_qp* a = make_qp(d, nullptr);
  ibv_qp* b = make_qp(d, srq);
  {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    CHECK(ibv_post_recv(b, &wr, &bad) == EINVAL, "post_recv on a QP with an SRQ is refused");
  }
  connect_qp(a, d.gid, b->qp_num, false);
  connect_qp(b, d.gid, a->qp_num, true);
  for (int i = 0; i < 3; ++i) {
    std::memset(d.buf + i * 100, 'a' + i, 100);
    CHECK(post(a, IBV_WR_SEND, d, i * 100, 100, i) == 0, "post SEND %d", i);
  }
  auto wc = wait_wc(d.cq, 6, 10);
  CHECK(wc.size() == 6, "6 completions (3 sends, 3 receives), got %zu", wc.size());
  int recvs = 0;
  for (const ibv_wc& w : wc) {
    CHECK(w.status == IBV_WC_SUCCESS, "completion %lu: %s", static_cast<unsigned long>(w.wr_id),
          ibv_wc_status_str(w.status));
    if (w.opcode == IBV_WC_RECV) {
      // The QP took SRQ entries in posting order: the k-th message in entry 1000 + k.
      CHECK(w.wr_id == 1000u + recvs, "receive %d in SRQ entry %lu", recvs,
            static_cast<unsigned long>(w.wr_id));
      CHECK(d.buf[8192 + recvs * 1024] == 'a' + recvs, "receive %d bytes", recvs);
      ++recvs;
    }
  }
  wait_event(d.ctx, IBV_EVENT_SRQ_LIMIT_REACHED, 5, seen);
  wait_event(d.ctx, IBV_EVENT_COMM_EST, 5, seen);
  CHECK(has(seen, IBV_EVENT_SRQ_LIMIT_REACHED, srq), "IBV_EVENT_SRQ_LIMIT_REACHED for the SRQ");
  CHECK(has(seen, IBV_EVENT_COMM_EST, b), "IBV_EVENT_COMM_EST for the QP still in RTR");
  CHECK(ibv_query_srq(srq, &q) == 0 && q.srq_limit == 0, "the limit disarms once it fired");
  to_rts(b);

  // A QP towards an address nobody answers: its WRITE exhausts the retries.
  ibv_qp* c = make_qp(d, nullptr);
  ibv_gid nobody = d.gid;
  nobody.raw[15] = 99;
  connect_qp(c, nobody, 0x999, false);
  CHECK(post(c, IBV_WR_RDMA_WRITE, d, 0, 64, 77, 0x10000, 1) == 0, "post WRITE to nobody");
  wc = wait_wc(d.cq, 1, 20);
  CHECK(wc.size() == 1 && wc[0].status == IBV_WC_RETRY_EXC_ERR,
        "the WRITE to nobody fails with IBV_WC_RETRY_EXC_ERR");
  wait_event(d.ctx, IBV_EVENT_QP_FATAL, 5, seen);
  CHECK(has(seen, IBV_EVENT_QP_FATAL, c), "IBV_EVENT_QP_FATAL for that QP");
  ibv_qp_attr qa{};
  ibv_qp_init_attr qi{};
  CHECK(ibv_query_qp(c, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_ERR,
        "the QP is in ERR");

  // The SRQ's QP to ERR: LAST_WQE_REACHED, and the SRQ keeps its unclaimed entries.
  ibv_qp_attr err{};
  err.qp_state = IBV_QPS_ERR;
  CHECK(ibv_modify_qp(b, &err, IBV_QP_STATE) == 0, "modify to ERR");
  wait_event(d.ctx, IBV_EVENT_QP_LAST_WQE_REACHED, 5, seen);
  CHECK(has(seen, IBV_EVENT_QP_LAST_WQE_REACHED, b), "IBV_EVENT_QP_LAST_WQE_REACHED");
  CHECK(ibv_destroy_srq(srq) == EBUSY, "an SRQ in use is not destroyed");
  for (ibv_qp* qp : {a, b, c}) CHECK(ibv_destroy_qp(qp) == 0, "ibv_destroy_qp");
  CHECK(ibv_destroy_srq(srq) == 0, "ibv_destroy_srq");
  for (const Event& e : seen) std::printf("event %s\n", ibv_event_type_str(e.type));
  return 0;
}

// One loopback WRITE of `seed`-filled bytes from offset 0 to offset 32768; true if it landed.
bool write_round(Dev& d, ibv_qp* from, uint8_t seed) {
  std::memset(d.buf, seed, 4096);
  if (post(from, IBV_WR_RDMA_WRITE, d, 0, 4096, seed,
           reinterpret_cast<uintptr_t>(d.buf + 32768), d.mr->rkey))
    return false;
  auto wc = wait_wc(d.cq, 1, 10);
  if (wc.size() != 1 || wc[0].status != IBV_WC_SUCCESS) return false;
  for (int i = 0; i < 4096; ++i)
    if (d.buf[32768 + i] != seed) return false;
  return true;
}

int test_fork(const char* dev, bool fork_init) {
  if (fork_init) {
    CHECK(ibv_fork_init() == 0, "ibv_fork_init before any verbs call");
    const ibv_fork_status st = ibv_is_fork_initialized();
    CHECK(st == IBV_FORK_ENABLED || st == IBV_FORK_UNNEEDED, "ibv_is_fork_initialized = %d", st);
  }
  Dev d = open_dev(dev);
  // Opening the device starts DPDK, whose mlx4/mlx5 drivers call ibv_fork_init themselves: from
  // then on registered memory is not inherited by children, with or without our own call.
  const ibv_fork_status st = ibv_is_fork_initialized();
  std::printf("ibv_is_fork_initialized() after open: %d\n", st);
  ibv_qp* a = make_qp(d, nullptr);
  ibv_qp* b = make_qp(d, nullptr);
  connect_qp(a, d.gid, b->qp_num, false);
  connect_qp(b, d.gid, a->qp_num, false);
  CHECK(write_round(d, a, 0x11), "WRITE before fork");
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child < 0) die("fork");
  if (child == 0) {
    // libibverbs documents that a child may not use its parent's verbs objects. It may use its
    // own memory, and exit normally (running atexit handlers) without disturbing the parent.
    std::vector<uint8_t> mine(1 << 20, 0x5a);
    // Without fork protection the child has a copy of the registered buffer; writing it must
    // not reach the parent. With it, the buffer is absent here (MADV_DONTFORK): not touched.
    if (st == IBV_FORK_DISABLED) std::memset(d.buf, 0x77, kBuf);
    std::exit(mine[12345] == 0x5a ? 0 : 3);
  }
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit status %d", status);
  CHECK(d.buf[32768] == 0x11, "the child's writes are its own");
  for (uint8_t seed = 0x21; seed < 0x29; ++seed)
    CHECK(write_round(d, a, seed), "WRITE after the child exited (seed %#x)", seed);
  CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "ibv_destroy_qp");
  CHECK(ibv_dereg_mr(d.mr) == 0, "ibv_dereg_mr");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dev, test;
  bool fork_init = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dev" && i + 1 < argc) dev = argv[++i];
    else if (a == "--test" && i + 1 < argc) test = argv[++i];
    else if (a == "--no-fork-init") fork_init = false;
    else {
      std::fprintf(stderr, "usage: verbs_async --dev NAME --test events|fork [--no-fork-init]\n");
      return 2;
    }
  }
  if (test == "events") test_events(dev.c_str());
  else if (test == "fork") test_fork(dev.c_str(), fork_init);
  else return 2;
  if (failures) {
    std::fprintf(stderr, "verbs_async %s: %d check(s) failed\n", test.c_str(), failures);
    return 1;
  }
  std::printf("verbs_async %s: all checks passed\n", test.c_str());
  return 0;
}
