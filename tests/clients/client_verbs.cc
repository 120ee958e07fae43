// SPDX-License-Identifier: Apache-2.0
// What UCX, Open MPI and perftest rely on of a device, checked through the real libibverbs on one
// device over NIC loopback (docs/spec/verbs-mapping.md §1, §7, §20):
//   - a completion channel is free again once its CQs are gone, whichever constructor made
//     them (UCX closes its channel right after its CQs);
//   - a zero-length RDMA WRITE with rkey and address 0 (UCX's endpoint flush) succeeds, and a
//     SEND after it lands;
//   - a UD receive carries the GRH of an IPv4 datagram and says so in wc.sl (2), with the
//     destination address in the GRH's last 4 bytes, where UCX's UD transport looks;
//   - every limit ibv_query_device reports can be used at its value and is refused one past it
//     (max_cqe, max_qp_wr, max_sge, max_inline_data), and a QP is granted inline data as a NIC
//     grants it: at least what was asked, never less than 128 bytes;
//   - an inline SEND of the whole granted size arrives byte for byte.
// Exit status 0 only if every check passed; each failure prints one line.
#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "client_verbs";
using namespace metaroce::test;

namespace {

constexpr unsigned kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                             IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
constexpr uint32_t kLibraryInline = 64;  // what UCX asks for (UCX_RC_VERBS_TX_MIN_INLINE)

struct Dev {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_gid gid{};
  ibv_device_attr attr{};
  std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 16);
  ibv_mr* mr = nullptr;
};

Dev open_dev(const char* name) {
  Dev d;
  d.ctx = open_device_named(name);
  d.pd = ibv_alloc_pd(d.ctx);
  d.cq = ibv_create_cq(d.ctx, 256, nullptr, nullptr, 0);
  if (!d.pd || !d.cq) die("pd/cq");
  if (ibv_query_gid(d.ctx, 1, 0, &d.gid)) die("ibv_query_gid");
  if (ibv_query_device(d.ctx, &d.attr)) die("ibv_query_device");
  d.mr = ibv_reg_mr(d.pd, d.buf.data(), d.buf.size(), kAccess);
  if (!d.mr) die("ibv_reg_mr");
  return d;
}

// One completion of cq (10 s at most); its status, or -1 when none came.
int wait_wc(ibv_cq* cq, ibv_wc* wc) {
  for (long i = 0; i < 10'000'000; ++i) {
    const int n = ibv_poll_cq(cq, 1, wc);
    if (n < 0) return -1;
    if (n == 1) return wc->status;
    if (i % 1000 == 999) usleep(1000);
  }
  return -1;
}

ibv_qp* make_qp(Dev& d, ibv_qp_type type, ibv_qp_cap cap) {
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = d.cq;
  a.qp_type = type;
  a.cap = cap;
  return ibv_create_qp(d.pd, &a);
}

ibv_qp_cap small_cap() {
  ibv_qp_cap c{};
  c.max_send_wr = c.max_recv_wr = 16;
  c.max_send_sge = c.max_recv_sge = 1;
  c.max_inline_data = kLibraryInline;
  return c;
}

// Two RC QPs of d joined to each other (NIC loopback).
std::pair<ibv_qp*, ibv_qp*> rc_pair(Dev& d, ibv_qp_cap cap) {
  ibv_qp* a = make_qp(d, IBV_QPT_RC, cap);
  ibv_qp* b = make_qp(d, IBV_QPT_RC, cap);
  if (!a || !b) die("create RC QPs");
  for (auto [q, peer] : {std::pair{a, b}, std::pair{b, a}}) {
    modify_to_init(q, kAccess);
    RcPeer p;
    p.qpn = peer->qp_num;
    p.gid = d.gid.raw;
    modify_to_rts(q, p);
  }
  return {a, b};
}

int post_recv(ibv_qp* qp, Dev& d, size_t off, uint32_t len, uint64_t wr_id) {
  ibv_sge s{reinterpret_cast<uint64_t>(d.buf.data() + off), len, d.mr->lkey};
  ibv_recv_wr r{};
  r.wr_id = wr_id;
  r.sg_list = &s;
  r.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp, &r, &bad);
}

// A channel whose CQs are destroyed can be destroyed: both constructors count it once.
void check_channel(Dev& d) {
  ibv_comp_channel* ch = ibv_create_comp_channel(d.ctx);
  if (!ch) die("ibv_create_comp_channel");
  ibv_cq_init_attr_ex x{};
  x.cqe = 64;
  x.channel = ch;
  x.wc_flags = IBV_WC_STANDARD_FLAGS;
  ibv_cq_ex* cqx = ibv_create_cq_ex(d.ctx, &x);
  CHECK(cqx, "ibv_create_cq_ex with a channel: %s", std::strerror(errno));
  ibv_cq* cq = ibv_create_cq(d.ctx, 64, nullptr, ch, 0);
  CHECK(cq, "ibv_create_cq with a channel: %s", std::strerror(errno));
  CHECK(ch->refcnt == 2, "two CQs use the channel, refcnt %d", ch->refcnt);
  CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "a channel in use is busy");
  if (cqx) CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) == 0, "destroy the extended CQ");
  if (cq) CHECK(ibv_destroy_cq(cq) == 0, "destroy the CQ");
  const int e = ibv_destroy_comp_channel(ch);
  CHECK(e == 0, "a channel whose CQs are gone is destroyed, got %d (refcnt %d)", e, ch->refcnt);
}

// UCX's flush: an empty inline WRITE to address 0 with rkey 0; then a SEND must still land.
void check_flush(Dev& d) {
  auto [a, b] = rc_pair(d, small_cap());
  CHECK(post_recv(b, d, 4096, 64, 7) == 0, "post_recv");
  ibv_send_wr w{};
  w.wr_id = 1;
  w.opcode = IBV_WR_RDMA_WRITE;
  w.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  ibv_send_wr* bad = nullptr;
  CHECK(ibv_post_send(a, &w, &bad) == 0, "post the empty WRITE");
  ibv_wc wc{};
  const int st = wait_wc(d.cq, &wc);
  CHECK(st == IBV_WC_SUCCESS && wc.wr_id == 1, "empty WRITE with rkey 0: %s",
        st < 0 ? "no completion" : ibv_wc_status_str(static_cast<ibv_wc_status>(st)));
  const char msg[] = "after the flush";
  std::memcpy(d.buf.data(), msg, sizeof msg);
  ibv_sge s{reinterpret_cast<uint64_t>(d.buf.data()), sizeof msg, d.mr->lkey};
  w = {};
  w.wr_id = 2;
  w.opcode = IBV_WR_SEND;
  w.send_flags = IBV_SEND_SIGNALED;
  w.sg_list = &s;
  w.num_sge = 1;
  CHECK(ibv_post_send(a, &w, &bad) == 0, "post the SEND");
  int seen = 0;
  for (int i = 0; i < 2; ++i) {
    if (wait_wc(d.cq, &wc) != IBV_WC_SUCCESS) break;
    seen |= wc.wr_id == 2 ? 1 : wc.wr_id == 7 ? 2 : 0;
  }
  CHECK(seen == 3, "the SEND after the flush and its receive complete (seen %d)", seen);
  CHECK(std::memcmp(d.buf.data() + 4096, msg, sizeof msg) == 0, "the SEND's bytes landed");
  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
}

// A UD datagram's receive: GRH flag, sl 2 (IPv4), the destination address in the last 4 bytes
// of the 40-byte GRH, and an AH made from the completion that reaches the sender again.
void check_ud(Dev& d) {
  constexpr uint32_t kQkey = 0x1ee7a330;  // UCX's
  ibv_qp* q[2];
  for (ibv_qp*& qp : q) {
    qp = make_qp(d, IBV_QPT_UD, small_cap());
    if (!qp) die("create UD QP");
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_INIT;
    at.port_num = 1;
    at.qkey = kQkey;
    if (ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
      die("UD INIT");
    at = {};
    at.qp_state = IBV_QPS_RTR;
    if (ibv_modify_qp(qp, &at, IBV_QP_STATE)) die("UD RTR");
    at.qp_state = IBV_QPS_RTS;
    if (ibv_modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_SQ_PSN)) die("UD RTS");
  }
  CHECK(post_recv(q[1], d, 8192, 40 + 64, 9) == 0, "post UD receive");
  ibv_ah_attr aa{};
  aa.is_global = 1;
  aa.grh.dgid = d.gid;
  aa.grh.hop_limit = 64;
  aa.port_num = 1;
  ibv_ah* ah = ibv_create_ah(d.pd, &aa);
  if (!ah) die("ibv_create_ah");
  const char msg[] = "ud datagram";
  ibv_sge s{reinterpret_cast<uint64_t>(d.buf.data()), sizeof msg, d.mr->lkey};
  std::memcpy(d.buf.data(), msg, sizeof msg);
  ibv_send_wr w{};
  w.wr_id = 3;
  w.opcode = IBV_WR_SEND;
  w.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE | IBV_SEND_SOLICITED;
  w.sg_list = &s;
  w.num_sge = 1;
  w.wr.ud.ah = ah;
  w.wr.ud.remote_qpn = q[1]->qp_num;
  w.wr.ud.remote_qkey = kQkey;
  ibv_send_wr* bad = nullptr;
  CHECK(ibv_post_send(q[0], &w, &bad) == 0, "post UD send");
  ibv_wc got{}, wc{};
  for (int i = 0; i < 2; ++i) {
    if (wait_wc(d.cq, &wc) != IBV_WC_SUCCESS) break;
    if (wc.wr_id == 9) got = wc;
  }
  CHECK(got.wr_id == 9, "the datagram arrived");
  CHECK(got.wc_flags & IBV_WC_GRH, "IBV_WC_GRH");
  CHECK(got.sl == 2, "wc.sl is the L3 type of an IPv4 datagram (2), got %u", got.sl);
  CHECK(got.byte_len == 40 + sizeof msg, "byte_len %u", got.byte_len);
  const uint8_t* grh = d.buf.data() + 8192;
  CHECK(std::memcmp(grh + 36, d.gid.raw + 12, 4) == 0, "the GRH ends with the destination IPv4");
  CHECK(grh[20] == 0x45, "an IPv4 header at offset 20");
  CHECK(std::memcmp(grh + 40, msg, sizeof msg) == 0, "the payload after the GRH");
  ibv_ah_attr back{};
  CHECK(ibv_init_ah_from_wc(d.ctx, 1, &got, reinterpret_cast<ibv_grh*>(d.buf.data() + 8192),
                            &back) == 0,
        "ibv_init_ah_from_wc");
  CHECK(std::memcmp(back.grh.dgid.raw, d.gid.raw, 16) == 0, "the AH from the wc names the sender");
  ibv_destroy_ah(ah);
  for (ibv_qp* qp : q) ibv_destroy_qp(qp);
}

// Each QP limit at its value works and one past it is refused; the granted inline size.
void check_qp_limits(Dev& d) {
  const ibv_device_attr& at = d.attr;
  ibv_qp_cap c = small_cap();
  c.max_send_wr = c.max_recv_wr = static_cast<uint32_t>(at.max_qp_wr);
  c.max_send_sge = c.max_recv_sge = static_cast<uint32_t>(at.max_sge);
  ibv_qp* qp = make_qp(d, IBV_QPT_RC, c);
  CHECK(qp, "a QP of max_qp_wr %d and max_sge %d: %s", at.max_qp_wr, at.max_sge,
        std::strerror(errno));
  if (qp) ibv_destroy_qp(qp);
  for (int which = 0; which < 3; ++which) {
    ibv_qp_cap over = small_cap();
    if (which == 0) over.max_send_wr = static_cast<uint32_t>(at.max_qp_wr) + 1;
    if (which == 1) over.max_send_sge = static_cast<uint32_t>(at.max_sge) + 1;
    if (which == 2) over.max_recv_wr = static_cast<uint32_t>(at.max_qp_wr) + 1;
    errno = 0;
    qp = make_qp(d, IBV_QPT_RC, over);
    CHECK(!qp && errno == EINVAL, "limit %d one past: EINVAL, got %s", which,
          qp ? "a QP" : std::strerror(errno));
    if (qp) ibv_destroy_qp(qp);
  }
  // Inline: as much as the WQE holds, at least 128; the largest offered works, one more is not.
  c = small_cap();
  qp = make_qp(d, IBV_QPT_RC, c);
  if (!qp) die("create QP");
  ibv_qp_attr qa{};
  ibv_qp_init_attr qi{};
  CHECK(ibv_query_qp(qp, &qa, IBV_QP_CAP, &qi) == 0, "ibv_query_qp");
  CHECK(qi.cap.max_inline_data >= 128, "asked %u inline bytes, granted %u (a NIC grants more)",
        kLibraryInline, qi.cap.max_inline_data);
  ibv_destroy_qp(qp);
  uint32_t top = 128;
  for (uint32_t n = 128; n <= 65536; n *= 2) {
    c.max_inline_data = n;
    qp = make_qp(d, IBV_QPT_RC, c);
    if (!qp) break;
    top = n;
    ibv_destroy_qp(qp);
  }
  c.max_inline_data = top;
  qp = make_qp(d, IBV_QPT_RC, c);
  CHECK(qp && top >= 512, "inline data of %u bytes (hardware offers hundreds)", top);
  if (qp) ibv_destroy_qp(qp);
  std::printf("max_inline_data %u, max_qp_wr %d, max_sge %d\n", top, at.max_qp_wr, at.max_sge);
}

// An inline SEND of the whole granted size arrives byte for byte, the source reused at once.
void check_inline_send(Dev& d) {
  ibv_qp_cap c = small_cap();
  auto [a, b] = rc_pair(d, c);
  ibv_qp_attr qa{};
  ibv_qp_init_attr qi{};
  if (ibv_query_qp(a, &qa, IBV_QP_CAP, &qi)) die("ibv_query_qp");
  const uint32_t n = qi.cap.max_inline_data;
  std::vector<uint8_t> src(n);
  for (uint32_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  CHECK(post_recv(b, d, 16384, n, 11) == 0, "post_recv");
  ibv_sge s{reinterpret_cast<uint64_t>(src.data()), n, 0};  // inline: no lkey needed
  ibv_send_wr w{};
  w.wr_id = 4;
  w.opcode = IBV_WR_SEND;
  w.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  w.sg_list = &s;
  w.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  CHECK(ibv_post_send(a, &w, &bad) == 0, "post an inline SEND of %u bytes", n);
  std::memset(src.data(), 0xee, n);  // inline data is the WQE's: the buffer is free at once
  ibv_wc wc{};
  int seen = 0;
  for (int i = 0; i < 2; ++i) {
    if (wait_wc(d.cq, &wc) != IBV_WC_SUCCESS) break;
    if (wc.wr_id == 11) CHECK(wc.byte_len == n, "received %u of %u bytes", wc.byte_len, n);
    ++seen;
  }
  CHECK(seen == 2, "the inline SEND and its receive complete");
  bool same = true;
  for (uint32_t i = 0; i < n; ++i) same &= d.buf[16384 + i] == static_cast<uint8_t>(i * 7 + 3);
  CHECK(same, "the %u inline bytes arrived as posted", n);
  w.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  s.length = n + 1;
  CHECK(ibv_post_send(a, &w, &bad) == EINVAL, "an inline SEND over the granted size: EINVAL");
  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
}

// A CQ of max_cqe entries (perftest -q 1024 asks one of 131,072), and one past refused.
void check_cq_limit(Dev& d) {
  const int max = d.attr.max_cqe;
  CHECK(max >= (1 << 22) - 1, "max_cqe %d, as ConnectX offers", max);
  ibv_cq* cq = ibv_create_cq(d.ctx, max, nullptr, nullptr, 0);
  CHECK(cq && cq->cqe >= max, "a CQ of max_cqe %d entries: %s", max, std::strerror(errno));
  if (cq) CHECK(ibv_destroy_cq(cq) == 0, "destroy it");
  errno = 0;
  cq = ibv_create_cq(d.ctx, max + 1, nullptr, nullptr, 0);
  CHECK(!cq && errno == EINVAL, "max_cqe + 1: EINVAL, got %s", cq ? "a CQ" : std::strerror(errno));
  if (cq) ibv_destroy_cq(cq);
  std::printf("max_cqe %d\n", max);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: client_verbs DEVICE\n");
    return 2;
  }
  Dev d = open_dev(argv[1]);
  check_channel(d);
  check_flush(d);
  check_ud(d);
  check_qp_limits(d);
  check_inline_send(d);
  check_cq_limit(d);
  if (failures) {
    std::fprintf(stderr, "client_verbs: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("client_verbs: all checks passed\n");
  return 0;
}
