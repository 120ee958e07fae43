// SPDX-License-Identifier: Apache-2.0
// Resource limits through unmodified libibverbs (verbs-mapping.md §20): what ibv_query_device
// reports is what a process gets, and the next object fails with ENOMEM.
//   resource_limits --dev NAME --test exhaust     every kind up to its reported limit, then ring memory
//   resource_limits --dev NAME --test hold N      makes N QPs, prints "HELD N", waits to be killed
//   resource_limits --dev NAME --test qps         makes QPs until refused, prints "QPS n errno e"
// Exit status 0 when every check held; each failed check prints one line.
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "resource_limits";

namespace {

int failures = 0;

void check(bool ok, const char* what, long got, long want) {
  if (ok) return;
  ++failures;
  std::printf("FAIL %s: got %ld, expected %ld\n", what, got, want);
}

ibv_qp* make_qp(ibv_pd* pd, ibv_cq* cq) {
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = cq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = a.cap.max_recv_wr = 1;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  return ibv_create_qp(pd, &a);
}

// Makes objects with `make` until it fails; returns how many, the failure's errno in *err.
template <typename T, typename Make>
std::vector<T*> until_refused(Make make, int* err, size_t cap = 100000) {
  std::vector<T*> v;
  while (v.size() < cap) {
    errno = 0;
    T* o = make();
    if (!o) {
      *err = errno;
      return v;
    }
    v.push_back(o);
  }
  *err = 0;
  return v;
}

int exhaust(ibv_context* ctx) {
  ibv_device_attr d{};
  if (ibv_query_device(ctx, &d) != 0) {
    std::printf("FAIL ibv_query_device\n");
    return 1;
  }
  std::printf("reported: max_qp %d max_cq %d max_srq %d max_pd %d max_mr %d max_mw %d\n", d.max_qp,
              d.max_cq, d.max_srq, d.max_pd, d.max_mr, d.max_mw);
  int err = 0;
  // PDs.
  auto pds = until_refused<ibv_pd>([&] { return ibv_alloc_pd(ctx); }, &err);
  check(static_cast<int>(pds.size()) == d.max_pd, "PDs made", static_cast<long>(pds.size()), d.max_pd);
  check(err == ENOMEM, "errno of the PD past the limit", err, ENOMEM);
  ibv_pd* pd = pds[0];
  for (size_t i = 1; i < pds.size(); ++i) ibv_dealloc_pd(pds[i]);
  // Regions and windows share one count.
  static char buf[4096];
  auto mrs = until_refused<ibv_mr>([&] {
    return ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  }, &err);
  check(static_cast<int>(mrs.size()) == d.max_mr, "MRs made", static_cast<long>(mrs.size()), d.max_mr);
  check(err == ENOMEM, "errno of the MR past the limit", err, ENOMEM);
  ibv_dereg_mr(mrs.back());
  mrs.pop_back();
  ibv_mw* mw = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
  check(mw != nullptr, "a window in the place of a region", mw != nullptr, 1);
  errno = 0;
  ibv_mw* mw2 = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
  check(mw2 == nullptr && errno == ENOMEM, "errno of a window past the limit", errno, ENOMEM);
  if (mw) ibv_dealloc_mw(mw);
  if (mw2) ibv_dealloc_mw(mw2);
  for (ibv_mr* m : mrs) ibv_dereg_mr(m);
  // CQs.
  auto cqs = until_refused<ibv_cq>([&] { return ibv_create_cq(ctx, 1, nullptr, nullptr, 0); }, &err);
  check(static_cast<int>(cqs.size()) == d.max_cq, "CQs made", static_cast<long>(cqs.size()), d.max_cq);
  check(err == ENOMEM, "errno of the CQ past the limit", err, ENOMEM);
  ibv_cq* cq = cqs[0];
  for (size_t i = 1; i < cqs.size(); ++i) ibv_destroy_cq(cqs[i]);
  // QPs.
  auto qps = until_refused<ibv_qp>([&] { return make_qp(pd, cq); }, &err);
  check(static_cast<int>(qps.size()) == d.max_qp, "QPs made", static_cast<long>(qps.size()), d.max_qp);
  check(err == ENOMEM, "errno of the QP past the limit", err, ENOMEM);
  for (ibv_qp* q : qps) ibv_destroy_qp(q);
  // SRQs.
  auto srqs = until_refused<ibv_srq>([&] {
    ibv_srq_init_attr a{};
    a.attr.max_wr = 1;
    a.attr.max_sge = 1;
    return ibv_create_srq(pd, &a);
  }, &err);
  check(static_cast<int>(srqs.size()) == d.max_srq, "SRQs made", static_cast<long>(srqs.size()), d.max_srq);
  check(err == ENOMEM, "errno of the SRQ past the limit", err, ENOMEM);
  for (ibv_srq* s : srqs) ibv_destroy_srq(s);
  // Ring memory: large CQs (about 1 MiB of ring each) run out of it before their count does.
  const int big = 16384;
  auto rings = until_refused<ibv_cq>([&] { return ibv_create_cq(ctx, big, nullptr, nullptr, 0); },
                                     &err, static_cast<size_t>(d.max_cq));
  std::printf("large CQs (%d entries) before the ring memory ran out: %zu\n", big, rings.size());
  check(!rings.empty() && rings.size() + 1 < static_cast<size_t>(d.max_cq),
        "large CQs made (some, then ring memory ran out)", static_cast<long>(rings.size()),
        d.max_cq - 2);
  check(err == ENOMEM, "errno of the CQ past the ring memory", err, ENOMEM);
  for (ibv_cq* c : rings) ibv_destroy_cq(c);
  // Everything given back: the same again succeeds.
  auto again = until_refused<ibv_qp>([&] { return make_qp(pd, cq); }, &err);
  check(again.size() == qps.size(), "QPs made after all was freed", static_cast<long>(again.size()),
        static_cast<long>(qps.size()));
  for (ibv_qp* q : again) ibv_destroy_qp(q);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  std::printf("%s\n", failures ? "FAILED" : "PASS exhaust");
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const char* dev = nullptr;
  std::string test;
  long n = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dev" && i + 1 < argc) {
      dev = argv[++i];
    } else if (a == "--test" && i + 1 < argc) {
      test = argv[++i];
      if (test == "hold" && i + 1 < argc) n = std::strtol(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: resource_limits --dev NAME --test exhaust|hold N|qps\n");
      return 2;
    }
  }
  if (!dev) {
    std::fprintf(stderr, "usage: resource_limits --dev NAME --test exhaust|hold N|qps\n");
    return 2;
  }
  ibv_context* ctx = metaroce::test::open_device_named(dev);
  if (test == "exhaust") return exhaust(ctx);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = pd ? ibv_create_cq(ctx, 1, nullptr, nullptr, 0) : nullptr;
  if (!cq) {
    std::printf("FAIL pd/cq: %s\n", std::strerror(errno));
    return 1;
  }
  int err = 0;
  if (test == "hold") {
    auto qps = until_refused<ibv_qp>([&] { return make_qp(pd, cq); }, &err, static_cast<size_t>(n));
    std::printf("HELD %zu\n", qps.size());
    std::fflush(stdout);
    for (;;) pause();
  }
  if (test == "qps") {
    auto qps = until_refused<ibv_qp>([&] { return make_qp(pd, cq); }, &err);
    std::printf("QPS %zu errno %d\n", qps.size(), err);
    for (ibv_qp* q : qps) ibv_destroy_qp(q);
    return 0;
  }
  std::fprintf(stderr, "resource_limits: unknown --test '%s'\n", test.c_str());
  return 2;
}
