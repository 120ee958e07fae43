// SPDX-License-Identifier: Apache-2.0
// The verbs of the second completeness round through the real libibverbs, on one device over NIC
// loopback (docs/spec/verbs-mapping.md §8, §12-§14):
//
//   verbs_complete --dev NAME --test memory   ibv_reg_mr_iova2, implicit ODP and its caps,
//                                             ibv_advise_mr, ibv_reg_dmabuf_mr, ibv_rereg_mr,
//                                             relaxed ordering, ECE, ibv_resize_cq, windows
//   verbs_complete --dev NAME --test domains  thread and parent domains, their allocators
//   verbs_complete --dev NAME --test port     IBV_EVENT_PORT_ERR / PORT_ACTIVE: prints "ready",
//                                             then waits for down, up, down, up (the script
//                                             takes the port down and up twice), each seen in
//                                             ibv_query_port too
//   verbs_complete --dev NAME --test import   ibv_import_device/pd/mr (verbs-mapping.md §21):
//                                             traffic through imports, bad handles and
//                                             descriptors, the first context closed first; then
//                                             prints "ready" and waits for DEVICE_FATAL on the
//                                             import (the script kills the engine)
// Exit status 0 only if every check passed; each failure prints one line.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "verbs_complete";
using namespace metaroce::test;

namespace {

constexpr size_t kBuf = 1 << 16;
constexpr unsigned kRemote = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                             IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

using Dev = DeviceBasics;

Dev open_dev(const char* name) { return open_basics(name, 64); }

// Two RC QPs of the device connected to each other.
std::pair<ibv_qp*, ibv_qp*> qp_pair(Dev& d) {
  ibv_qp* q[2];
  for (auto& x : q) {
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = d.cq;
    a.cap.max_send_wr = a.cap.max_recv_wr = 16;
    a.cap.max_send_sge = a.cap.max_recv_sge = 1;
    a.qp_type = IBV_QPT_RC;
    x = ibv_create_qp(d.pd, &a);
    if (!x) die("ibv_create_qp");
    modify_to_init(x, kRemote);
  }
  for (int i = 0; i < 2; ++i) {
    RcPeer p;
    p.qpn = q[1 - i]->qp_num;
    p.gid = d.gid.raw;
    modify_to_rts(q[i], p);
  }
  return {q[0], q[1]};
}

std::vector<ibv_wc> wait_wc(ibv_cq* cq, size_t n, double secs = 10) {
  std::vector<ibv_wc> got;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  while (got.size() < n && std::chrono::steady_clock::now() < end) {
    ibv_wc wc[8];
    const int k = ibv_poll_cq(cq, 8, wc);
    if (k < 0) die("ibv_poll_cq");
    got.insert(got.end(), wc, wc + k);
  }
  return got;
}

// One signaled RDMA work request (wr_id 7) of len bytes from (lkey, laddr) to (rkey, raddr):
// its completion, or none if it could not be posted or did not complete.
std::optional<ibv_wc> post_rdma(Dev& d, ibv_qp* qp, ibv_wr_opcode op, uint32_t lkey,
                                const void* laddr, uint32_t len, uint32_t rkey, uint64_t raddr) {
  ibv_sge s{reinterpret_cast<uintptr_t>(laddr), len, lkey};
  ibv_send_wr wr{};
  wr.wr_id = 7;
  wr.sg_list = &s;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(qp, &wr, &bad)) return std::nullopt;
  auto c = wait_wc(d.cq, 1);
  if (c.size() != 1) return std::nullopt;
  return c[0];
}

// An RDMA WRITE's completion status; -1 if it was not posted or did not complete.
int write_status(Dev& d, ibv_qp* qp, uint32_t lkey, const void* laddr, uint32_t len,
                 uint32_t rkey, uint64_t raddr) {
  const auto wc = post_rdma(d, qp, IBV_WR_RDMA_WRITE, lkey, laddr, len, rkey, raddr);
  return wc ? wc->status : -1;
}

// Back to RTS after an error (the completions of the QP's past life are gone with the reset).
void restate(Dev& d, ibv_qp* qp, ibv_qp* peer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RESET;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE)) die("modify RESET");
  modify_to_init(qp, kRemote);
  RcPeer p;
  p.qpn = peer->qp_num;
  p.gid = d.gid.raw;
  modify_to_rts(qp, p);
}

void test_memory(const char* name) {
  Dev d = open_dev(name);
  auto [a, b] = qp_pair(d);
  auto* src = static_cast<uint8_t*>(aligned_alloc(4096, kBuf));
  auto* dst = static_cast<uint8_t*>(aligned_alloc(4096, kBuf));
  std::memset(dst, 0, kBuf);
  for (size_t i = 0; i < kBuf; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  ibv_mr* smr = ibv_reg_mr(d.pd, src, kBuf, IBV_ACCESS_LOCAL_WRITE);
  if (!smr) die("reg src");

  // ibv_reg_mr_iova2: the peer addresses the region at its IOVA.
  constexpr uint64_t kIova = 0x7000000000ull;
  ibv_mr* imr = ibv_reg_mr_iova2(d.pd, dst, kBuf, kIova, kRemote);
  CHECK(imr, "ibv_reg_mr_iova2: %s", std::strerror(errno));
  if (imr) {
    CHECK(write_status(d, a, smr->lkey, src, 64, imr->rkey, kIova + 128) == IBV_WC_SUCCESS,
          "WRITE to an IOVA");
    CHECK(std::memcmp(dst + 128, src, 64) == 0, "the WRITE landed at IOVA + 128");
    CHECK(ibv_dereg_mr(imr) == 0, "dereg the IOVA region");
  }

  // ATOMIC_WRITE through ibv_post_send (verbs-mapping.md §3): the 8 bytes of its SGE, stored as
  // they lie; an SGE of another length is a local length error.
  {
    ibv_mr* amr = ibv_reg_mr(d.pd, dst, kBuf, kRemote);
    if (!amr) die("reg atomic target");
    auto atomic_write = [&](uint32_t len, uint64_t raddr) {
      return post_rdma(d, a, IBV_WR_ATOMIC_WRITE, smr->lkey, src + 1024, len, amr->rkey, raddr)
          .value_or(ibv_wc{});  // wr_id 0: not posted, or no completion
    };
    const auto target = reinterpret_cast<uintptr_t>(dst) + 40960;
    ibv_wc wc = atomic_write(8, target);
    CHECK(wc.wr_id == 7 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_ATOMIC_WRITE,
          "ATOMIC_WRITE completes as IBV_WC_ATOMIC_WRITE (status %d, opcode %d)", wc.status,
          wc.opcode);
    CHECK(std::memcmp(dst + 40960, src + 1024, 8) == 0 && dst[40968] == 0,
          "its 8 bytes landed, and nothing more");
    wc = atomic_write(4, target + 64);
    CHECK(wc.wr_id == 7 && wc.status == IBV_WC_LOC_LEN_ERR,
          "an ATOMIC_WRITE of 4 bytes: IBV_WC_LOC_LEN_ERR (status %d)", wc.status);
    CHECK(dst[40960 + 64] == 0, "and nothing landed");
    restate(d, a, b);  // both ends: a reset QP numbers its messages from 0 again
    restate(d, b, a);
    CHECK(ibv_dereg_mr(amr) == 0, "dereg the atomic target");
  }

  // Implicit ODP, announced in the caps; a prefetch of a range it covers is accepted.
  ibv_device_attr_ex attr{};
  CHECK(ibv_query_device_ex(d.ctx, nullptr, &attr) == 0, "ibv_query_device_ex");
  CHECK(attr.odp_caps.general_caps & IBV_ODP_SUPPORT_IMPLICIT, "implicit ODP in the caps");
  CHECK((attr.odp_caps.per_transport_caps.rc_odp_caps & IBV_ODP_SUPPORT_WRITE) &&
            (attr.odp_caps.per_transport_caps.rc_odp_caps & IBV_ODP_SUPPORT_SRQ_RECV),
        "RC ODP caps");
  CHECK(attr.orig_attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B, "type 2B windows");
  ibv_mr* odp = ibv_reg_mr(d.pd, nullptr, SIZE_MAX, kRemote | IBV_ACCESS_ON_DEMAND);
  CHECK(odp, "implicit ODP region: %s", std::strerror(errno));
  if (odp) {
    std::memset(dst, 0, kBuf);
    CHECK(write_status(d, a, smr->lkey, src, 256, odp->rkey,
                       reinterpret_cast<uintptr_t>(dst) + 512) == IBV_WC_SUCCESS,
          "WRITE through the implicit region to memory registered nowhere else");
    CHECK(std::memcmp(dst + 512, src, 256) == 0, "it landed");
    ibv_sge sg{reinterpret_cast<uintptr_t>(dst), 4096, odp->lkey};
    CHECK(ibv_advise_mr(d.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH, &sg,
                        1) == 0,
          "prefetch advice");
    sg.lkey = smr->lkey + 0x1000;
    CHECK(ibv_advise_mr(d.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sg, 1) == EFAULT,
          "advice on a key that is none: EFAULT");
    CHECK(ibv_dereg_mr(odp) == 0, "dereg implicit");
  }
  errno = 0;
  CHECK(!ibv_reg_mr(d.pd, nullptr, SIZE_MAX, kRemote) && errno == EINVAL,
        "the whole address space needs ON_DEMAND");

  // dmabuf: no exporter is reachable by process address.
  errno = 0;
  CHECK(!ibv_reg_dmabuf_mr(d.pd, 0, 4096, 0, 0, IBV_ACCESS_LOCAL_WRITE) && errno == EOPNOTSUPP,
        "ibv_reg_dmabuf_mr: EOPNOTSUPP (errno %d)", errno);

  // Relaxed ordering is accepted, and so is a region registered with it.
  ibv_mr* ro = ibv_reg_mr(d.pd, dst, kBuf, kRemote | IBV_ACCESS_RELAXED_ORDERING);
  CHECK(ro, "relaxed ordering: %s", std::strerror(errno));

  // ibv_rereg_mr: a refused change leaves the region working; access taken away fails WRITEs.
  if (ro) {
    CHECK(ibv_rereg_mr(ro, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                       IBV_ACCESS_REMOTE_WRITE) == IBV_REREG_MR_ERR_CMD && errno == EINVAL,
          "remote write without local write: EINVAL");
    CHECK(write_status(d, a, smr->lkey, src, 8, ro->rkey, reinterpret_cast<uintptr_t>(dst)) ==
              IBV_WC_SUCCESS,
          "the region still works after a refused rereg");
    CHECK(ibv_rereg_mr(ro, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                       IBV_ACCESS_LOCAL_WRITE) == 0,
          "rereg access");
    CHECK(write_status(d, a, smr->lkey, src, 8, ro->rkey, reinterpret_cast<uintptr_t>(dst)) ==
              IBV_WC_REM_ACCESS_ERR,
          "a WRITE after remote write was taken away");
    restate(d, a, b);
    restate(d, b, a);
    CHECK(ibv_rereg_mr(ro, IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_ACCESS, nullptr,
                       dst + 4096, 4096, kRemote) == 0,
          "rereg translation and access");
    CHECK(write_status(d, a, smr->lkey, src, 8, ro->rkey,
                       reinterpret_cast<uintptr_t>(dst) + 4096) == IBV_WC_SUCCESS,
          "a WRITE into the new translation");
  }

  // ECE: our vendor's; a peer of another vendor is refused.
  ibv_ece ece{};
  CHECK(ibv_query_ece(a, &ece) == 0, "ibv_query_ece");
  ibv_ece mine = ece;
  CHECK(ibv_set_ece(b, &mine) == 0, "ibv_set_ece with the peer's");
  ibv_ece other = ece;
  other.vendor_id ^= 1;
  CHECK(ibv_set_ece(b, &other) == EINVAL, "another vendor's ECE: EINVAL");

  // Resize: a CQ holding 3 completions cannot shrink to 2; it grows, keeping them.
  for (int i = 0; i < 3; ++i)
    CHECK(write_status(d, a, smr->lkey, src, 8, ro ? ro->rkey : 0,
                       reinterpret_cast<uintptr_t>(dst) + 4096) == IBV_WC_SUCCESS,
          "WRITE %d", i);
  ibv_cq* cq2 = ibv_create_cq(d.ctx, 4, nullptr, nullptr, 0);
  if (!cq2) die("cq2");
  CHECK(ibv_resize_cq(cq2, 100) == 0 && cq2->cqe >= 100, "resize an empty CQ to 100");
  CHECK(ibv_resize_cq(cq2, 0) == EINVAL, "resize to 0: EINVAL");
  CHECK(ibv_destroy_cq(cq2) == 0, "destroy the resized CQ");

  // A type 1 window onto part of a region; a WRITE through it; invalidated by an empty bind.
  ibv_mr* wmr = ibv_reg_mr(d.pd, dst, kBuf, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  ibv_mw* mw = ibv_alloc_mw(d.pd, IBV_MW_TYPE_1);
  CHECK(wmr && mw, "MW_BIND region and a type 1 window: %s", std::strerror(errno));
  errno = 0;
  CHECK(!ibv_alloc_mw(d.pd, static_cast<ibv_mw_type>(3)) && errno == EINVAL, "type 3: EINVAL");
  if (wmr && mw) {
    ibv_mw_bind bind{};
    bind.wr_id = 55;
    bind.send_flags = IBV_SEND_SIGNALED;
    bind.bind_info.mr = wmr;
    bind.bind_info.addr = reinterpret_cast<uintptr_t>(dst) + 8192;
    bind.bind_info.length = 4096;
    bind.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
    const uint32_t before = mw->rkey;
    CHECK(ibv_bind_mw(b, mw, &bind) == 0 && mw->rkey != before, "ibv_bind_mw");
    auto c = wait_wc(d.cq, 1);
    CHECK(c.size() == 1 && c[0].status == IBV_WC_SUCCESS && c[0].opcode == IBV_WC_BIND_MW &&
              c[0].wr_id == 55,
          "the bind completes");
    CHECK(write_status(d, a, smr->lkey, src, 32, mw->rkey,
                       reinterpret_cast<uintptr_t>(dst) + 8192 + 64) == IBV_WC_SUCCESS,
          "WRITE through the window");
    CHECK(std::memcmp(dst + 8192 + 64, src, 32) == 0, "it landed");
    CHECK(ibv_dereg_mr(wmr) == EBUSY, "dereg of a region with a bound window: EBUSY");
    bind.bind_info.length = 0;
    bind.bind_info.addr = 0;
    bind.bind_info.mr = nullptr;
    CHECK(ibv_bind_mw(b, mw, &bind) == 0, "an empty bind");
    wait_wc(d.cq, 1);
    CHECK(write_status(d, a, smr->lkey, src, 32, mw->rkey,
                       reinterpret_cast<uintptr_t>(dst) + 8192) == IBV_WC_REM_ACCESS_ERR,
          "no WRITE through an unbound window");
    CHECK(ibv_dealloc_mw(mw) == 0, "ibv_dealloc_mw");
    CHECK(ibv_dereg_mr(wmr) == 0, "dereg once nothing is bound");
  }
  std::printf("verbs_complete memory: done\n");
}

// A parent domain's allocators that count what the provider asks for.
struct AllocLog {
  int allocs = 0, frees = 0;
  std::vector<uint64_t> types;
};
void* log_alloc(ibv_pd*, void* ctx, size_t size, size_t alignment, uint64_t type) {
  auto* log = static_cast<AllocLog*>(ctx);
  ++log->allocs;
  log->types.push_back(type);
  void* p = nullptr;
  return posix_memalign(&p, alignment < sizeof(void*) ? sizeof(void*) : alignment, size) ? nullptr
                                                                                           : p;
}
void log_free(ibv_pd*, void* ctx, void* ptr, uint64_t) {
  ++static_cast<AllocLog*>(ctx)->frees;
  std::free(ptr);
}

// Thread and parent domains: a parent domain is its PD for every verb, and the provider's
// memory for the QPs and CQs made with it comes from its allocators.
void test_domains(const char* name) {
  Dev d = open_dev(name);
  ibv_td_init_attr ta{};
  ibv_td* td = ibv_alloc_td(d.ctx, &ta);
  CHECK(td, "ibv_alloc_td: %s", std::strerror(errno));
  AllocLog log;
  ibv_parent_domain_init_attr pa{};
  pa.pd = d.pd;
  pa.td = td;
  pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
  pa.alloc = log_alloc;
  pa.free = log_free;
  pa.pd_context = &log;
  ibv_pd* parent = ibv_alloc_parent_domain(d.ctx, &pa);
  CHECK(parent, "ibv_alloc_parent_domain: %s", std::strerror(errno));
  if (!td || !parent) return;
  pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS;
  pa.free = nullptr;
  errno = 0;
  CHECK(!ibv_alloc_parent_domain(d.ctx, &pa) && errno == EINVAL, "allocators without free");
  ibv_cq_init_attr_ex ca{};
  ca.cqe = 16;
  ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  ca.parent_domain = parent;
  ibv_cq_ex* cqx = ibv_create_cq_ex(d.ctx, &ca);
  CHECK(cqx, "a CQ of the parent domain: %s", std::strerror(errno));
  ca.parent_domain = d.pd;
  errno = 0;
  CHECK(!ibv_create_cq_ex(d.ctx, &ca) && errno == EINVAL, "a plain PD is no parent domain");
  if (!cqx) return;
  ibv_cq* cq = ibv_cq_ex_to_cq(cqx);
  ibv_qp* q[2];
  for (auto& x : q) {
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = cq;
    a.cap.max_send_wr = a.cap.max_recv_wr = 4;
    a.cap.max_send_sge = a.cap.max_recv_sge = 1;
    a.qp_type = IBV_QPT_RC;
    x = ibv_create_qp(parent, &a);
    if (!x) die("ibv_create_qp in a parent domain");
    modify_to_init(x, kRemote);
  }
  CHECK(log.allocs == 3 && log.types.size() == 3 && log.types[0] != log.types[1] &&
            log.types[1] == log.types[2],
        "one allocation for the CQ, one per QP (got %d)", log.allocs);
  for (int i = 0; i < 2; ++i) {
    RcPeer p;
    p.qpn = q[1 - i]->qp_num;
    p.gid = d.gid.raw;
    modify_to_rts(q[i], p);
  }
  // The parent domain is the PD: a region of the PD serves its QPs.
  auto* buf = static_cast<uint8_t*>(aligned_alloc(4096, 8192));
  std::memset(buf, 0x5a, 4096);
  std::memset(buf + 4096, 0, 4096);
  ibv_mr* mr = ibv_reg_mr(d.pd, buf, 8192, kRemote);
  if (!mr) die("reg");
  Dev view = d;
  view.cq = cq;
  CHECK(write_status(view, q[0], mr->lkey, buf, 64, mr->rkey,
                     reinterpret_cast<uintptr_t>(buf) + 4096) == IBV_WC_SUCCESS,
        "WRITE between QPs of the parent domain");
  CHECK(buf[4096 + 63] == 0x5a, "it landed");
  CHECK(ibv_dealloc_pd(parent) == EBUSY, "a parent domain in use: EBUSY");
  CHECK(ibv_dealloc_td(td) == EBUSY, "a thread domain in use: EBUSY");
  CHECK(ibv_dealloc_pd(d.pd) == EBUSY, "the PD it extends: EBUSY");
  for (ibv_qp* x : q) CHECK(ibv_destroy_qp(x) == 0, "destroy QP");
  CHECK(ibv_destroy_cq(cq) == 0, "destroy CQ");
  CHECK(log.frees == 3, "every allocation given back (%d)", log.frees);
  CHECK(ibv_dealloc_pd(parent) == 0, "dealloc the parent domain");
  CHECK(ibv_dealloc_td(td) == 0, "dealloc the thread domain");
  std::printf("verbs_complete domains: done\n");
}

// Reads async events until one of type `want` or `secs` passed.
bool wait_port_event(ibv_context* ctx, ibv_event_type want, double secs) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(secs);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        end - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{ctx->async_fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    ibv_async_event ev;
    if (ibv_get_async_event(ctx, &ev)) die("ibv_get_async_event");
    const bool hit = ev.event_type == want && ev.element.port_num == 1;
    ibv_ack_async_event(&ev);
    if (hit) return true;
  }
}

void test_port(const char* name) {
  ibv_context* ctx = open_device_named(name);
  ibv_port_attr pa{};
  CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE, "ACTIVE at first");
  std::printf("ready\n");
  std::fflush(stdout);
  for (int round = 0; round < 2; ++round) {
    CHECK(wait_port_event(ctx, IBV_EVENT_PORT_ERR, 30), "round %d: IBV_EVENT_PORT_ERR", round);
    CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_DOWN, "round %d: DOWN", round);
    std::printf("down %d\n", round);
    std::fflush(stdout);
    CHECK(wait_port_event(ctx, IBV_EVENT_PORT_ACTIVE, 30), "round %d: IBV_EVENT_PORT_ACTIVE",
          round);
    CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE, "round %d: ACTIVE",
          round);
    std::printf("up %d\n", round);
    std::fflush(stdout);
    if (failures) break;
  }
  ibv_close_device(ctx);
}

bool wait_fatal(ibv_context* ctx, double secs) {
  pollfd p{ctx->async_fd, POLLIN, 0};
  while (poll(&p, 1, static_cast<int>(secs * 1000)) > 0) {
    ibv_async_event ev;
    if (ibv_get_async_event(ctx, &ev)) return false;
    const bool fatal = ev.event_type == IBV_EVENT_DEVICE_FATAL;
    ibv_ack_async_event(&ev);
    if (fatal) return true;
  }
  return false;
}

void test_import(const char* name) {
  Dev d = open_dev(name);
  auto* src = static_cast<uint8_t*>(aligned_alloc(4096, kBuf));
  auto* dst = static_cast<uint8_t*>(aligned_alloc(4096, kBuf));
  for (size_t i = 0; i < kBuf; ++i) src[i] = static_cast<uint8_t>(i * 13 + 5);
  std::memset(dst, 0, kBuf);
  ibv_mr* smr = ibv_reg_mr(d.pd, src, kBuf, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = ibv_reg_mr(d.pd, dst, kBuf, kRemote);
  if (!smr || !dmr) die("reg");

  // Descriptors that are no context's.
  int pfd[2];
  if (pipe(pfd)) die("pipe");
  errno = 0;
  CHECK(!ibv_import_device(pfd[0]) && errno == EINVAL, "a pipe: EINVAL (errno %d)", errno);
  close(pfd[0]);
  close(pfd[1]);
  const int null_fd = open("/dev/null", O_RDWR);
  errno = 0;
  CHECK(!ibv_import_device(null_fd) && errno == ENODEV, "/dev/null: ENODEV (errno %d)", errno);
  close(null_fd);

  // A dup of the context's descriptor, as one passes it to another component.
  const int fd = dup(d.ctx->cmd_fd);
  ibv_context* ic = ibv_import_device(fd);
  CHECK(ic, "ibv_import_device: %s", std::strerror(errno));
  if (!ic) return;
  ibv_device_attr attr{};
  CHECK(ibv_query_device(ic, &attr) == 0 && attr.max_qp > 0, "ibv_query_device on the import");
  errno = 0;
  CHECK(!ibv_import_pd(ic, d.pd->handle + 1000) && errno == ENOENT,
        "a PD handle the context does not hold: ENOENT (errno %d)", errno);
  ibv_pd* ipd = ibv_import_pd(ic, d.pd->handle);
  CHECK(ipd && ipd->handle == d.pd->handle, "ibv_import_pd: %s", std::strerror(errno));
  if (!ipd) return;
  errno = 0;
  CHECK(!ibv_import_mr(ipd, smr->handle ^ 0x5a5a00) && errno == ENOENT,
        "an MR handle the context does not hold: ENOENT (errno %d)", errno);
  ibv_mr* ismr = ibv_import_mr(ipd, smr->handle);
  ibv_mr* idmr = ibv_import_mr(ipd, dmr->handle);
  CHECK(ismr && idmr, "ibv_import_mr: %s", std::strerror(errno));
  if (!ismr || !idmr) return;
  CHECK(ismr->lkey == smr->lkey && idmr->rkey == dmr->rkey && idmr->length == kBuf &&
            ismr->addr == src,
        "the imported regions are the registered ones");
  CHECK(ibv_dealloc_pd(d.pd) == EBUSY, "the imported PD is in use: EBUSY");

  // QPs of the import, in the imported PD, moving data with the imported keys.
  Dev id{ic, ipd, ibv_create_cq(ic, 64, nullptr, nullptr, 0), d.gid};
  if (!id.cq) die("ibv_create_cq on the import");
  auto [a, b] = qp_pair(id);
  CHECK(write_status(id, a, ismr->lkey, src, 4096, idmr->rkey,
                     reinterpret_cast<uintptr_t>(dst) + 4096) == IBV_WC_SUCCESS,
        "a WRITE between the import's QPs");
  CHECK(std::memcmp(dst + 4096, src, 4096) == 0, "it landed");

  // The first context closed first: the import keeps the engine's context (and its PD and
  // regions) alive, as the kernel keeps the file open while a descriptor refers to it.
  CHECK(ibv_destroy_cq(d.cq) == 0, "destroy the first context's CQ");
  CHECK(ibv_close_device(d.ctx) == 0, "close the first context");
  std::memset(dst, 0, kBuf);
  CHECK(write_status(id, b, ismr->lkey, src + 100, 3000, idmr->rkey,
                     reinterpret_cast<uintptr_t>(dst) + 7) == IBV_WC_SUCCESS,
        "a WRITE after the first context closed");
  CHECK(std::memcmp(dst + 7, src + 100, 3000) == 0, "it landed");
  CHECK(ibv_dereg_mr(idmr) == 0, "ibv_dereg_mr of an import releases it");
  ibv_unimport_mr(ismr);
  CHECK(write_status(id, a, smr->lkey, src, 64, dmr->rkey, reinterpret_cast<uintptr_t>(dst)) ==
            IBV_WC_SUCCESS,
        "the regions stay registered (the first context did not deregister them)");

  // The engine killed: the import hears it too.
  std::printf("ready\n");
  std::fflush(stdout);
  CHECK(wait_fatal(ic, 30), "IBV_EVENT_DEVICE_FATAL on the import");
  ibv_destroy_qp(a);
  ibv_destroy_qp(b);
  ibv_destroy_cq(id.cq);
  ibv_unimport_pd(ipd);
  CHECK(ibv_close_device(ic) == 0, "close the import");
  close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dev, test;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dev" && i + 1 < argc) dev = argv[++i];
    else if (a == "--test" && i + 1 < argc) test = argv[++i];
    else {
      std::fprintf(stderr, "usage: verbs_complete --dev NAME --test memory|domains|port|import\n");
      return 2;
    }
  }
  if (test == "memory") test_memory(dev.c_str());
  else if (test == "domains") test_domains(dev.c_str());
  else if (test == "port") test_port(dev.c_str());
  else if (test == "import") test_import(dev.c_str());
  else return 2;
  if (failures) {
    std::fprintf(stderr, "verbs_complete %s: %d check(s) failed\n", test.c_str(), failures);
    return 1;
  }
  std::printf("verbs_complete %s: all checks passed\n", test.c_str());
  return 0;
}
