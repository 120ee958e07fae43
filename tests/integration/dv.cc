// SPDX-License-Identifier: Apache-2.0
// The direct verbs of <infiniband/metaroce_dv.h> end to end, over two devices joined by a link
// of several real DPDK ports (one per plane): every call and its error paths, which planes a
// QP's paths use and that data moves only there, how QPs ride lanes, a live change of plane mask
// and path count, entropy re-picks, and a plane set down mid-transfer (`metaroce link set`):
// traffic moves to the other planes of the mask and nothing fails.
// Usage: dv --a DEV --b DEV --metaroce PATH (DEV a: the side whose planes are switched).
#include <infiniband/metaroce_dv.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/test_support.h"

namespace metaroce::test {
const char* const kProgram = "dv";
}
using namespace metaroce::test;

namespace {

constexpr size_t kBuf = 1 << 20;

struct Side {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<uint8_t> buf = std::vector<uint8_t>(kBuf);
  ibv_gid gid{};
};

ibv_context* open_dev(const char* name) {
  ibv_context* ctx = open_device_named(name);
  CHECK(mrdv_is_supported(ctx->device), "%s is not reported as a MetaRoCE device", name);
  return ctx;
}

void setup(Side& s, const char* name) {
  s.ctx = open_dev(name);
  s.pd = ibv_alloc_pd(s.ctx);
  s.cq = ibv_create_cq(s.ctx, 256, nullptr, nullptr, 0);
  s.mr = ibv_reg_mr(s.pd, s.buf.data(), s.buf.size(),
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!s.pd || !s.cq || !s.mr || ibv_query_gid(s.ctx, 1, 0, &s.gid)) die("setup");
}

ibv_qp_init_attr_ex rc_attr(Side& s) {
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_RC;
  a.send_cq = a.recv_cq = s.cq;
  a.cap.max_send_wr = 64;
  a.cap.max_recv_wr = 4;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  a.comp_mask = IBV_QP_INIT_ATTR_PD;
  a.pd = s.pd;
  return a;
}

ibv_qp* dv_qp(Side& s, uint64_t mask, uint16_t paths, uint32_t planes, uint32_t flags) {
  ibv_qp_init_attr_ex a = rc_attr(s);
  mrdv_qp_init_attr m{};
  m.comp_mask = mask;
  m.num_paths = paths;
  m.plane_mask = planes;
  m.flags = flags;
  return mrdv_create_qp(s.ctx, &a, &m, sizeof(m));
}

ibv_qp* plain_qp(Side& s) {
  ibv_qp_init_attr_ex a = rc_attr(s);
  return ibv_create_qp_ex(s.ctx, &a);
}

void connect(ibv_qp* q, Side& far, ibv_qp* fq) {
  const unsigned acc = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
  modify_to_init(q, acc);
  RcPeer p;
  p.qpn = fq->qp_num;
  p.gid = far.gid.raw;
  modify_to_rts(q, p);
}

// n RDMA WRITEs of `len` bytes from a into b's buffer, 16 in flight; every completion checked.
void write_many(Side& a, ibv_qp* q, Side& b, int n, uint32_t len) {
  int posted = 0, done = 0;
  while (done < n) {
    while (posted < n && posted - done < 16) {
      ibv_sge sge{reinterpret_cast<uintptr_t>(a.buf.data()), len, a.mr->lkey};
      ibv_send_wr wr{}, *bad = nullptr;
      wr.wr_id = static_cast<uint64_t>(posted);
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(b.buf.data());
      wr.wr.rdma.rkey = b.mr->rkey;
      if (ibv_post_send(q, &wr, &bad)) die("post_send");
      ++posted;
    }
    ibv_wc wc[16];
    const int got = ibv_poll_cq(a.cq, 16, wc);
    if (got < 0) die("poll_cq");
    for (int i = 0; i < got; ++i) {
      CHECK(wc[i].status == IBV_WC_SUCCESS, "write %llu: %s", (unsigned long long)wc[i].wr_id,
            ibv_wc_status_str(wc[i].status));
      if (wc[i].status != IBV_WC_SUCCESS) std::exit(1);
    }
    done += got;
  }
}

std::vector<mrdv_path_stats> paths_of(ibv_qp* q) {
  std::vector<mrdv_path_stats> v(256);
  uint32_t n = 0;
  const int e = mrdv_query_paths(q, v.data(), static_cast<uint32_t>(v.size()), sizeof(v[0]), &n);
  CHECK(e == 0, "mrdv_query_paths: %s", std::strerror(e));
  v.resize(std::min<size_t>(n, v.size()));
  return v;
}

uint64_t bytes_on_plane(const std::vector<mrdv_path_stats>& v, uint8_t plane) {
  uint64_t b = 0;
  for (const auto& p : v) b += p.plane == plane ? p.tx_bytes : 0;
  return b;
}

mrdv_qp_conn conn_of(ibv_qp* q) {
  mrdv_qp_conn c{};
  const int e = mrdv_query_qp_conn(q, &c, sizeof(c));
  CHECK(e == 0, "mrdv_query_qp_conn: %s", std::strerror(e));
  return c;
}

void set_plane(const std::string& metaroce, const char* dev, int plane, const char* what) {
  const std::string cmd = metaroce + " link set " + dev + " --plane " + std::to_string(plane) +
                          " " + what;
  if (std::system(cmd.c_str()) != 0) die(cmd.c_str());
}

// The engine learns a plane's state within a pass or two: wait for it (not a timed assertion:
// the condition is what is checked, the wait only bounds a hang).
uint32_t wait_planes_up(ibv_context* ctx, uint32_t want) {
  mrdv_device_attr d{};
  for (int i = 0; i < 1000; ++i) {
    d = {};
    if (mrdv_query_device(ctx, &d, sizeof(d))) die("mrdv_query_device");
    if (d.planes_up == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return d.planes_up;
}

}  // namespace

int main(int argc, char** argv) {
  const char *da = nullptr, *db = nullptr;
  std::string metaroce = "metaroce";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--a")) da = argv[i + 1];
    else if (!std::strcmp(argv[i], "--b")) db = argv[i + 1];
    else if (!std::strcmp(argv[i], "--metaroce")) metaroce = argv[i + 1];
  }
  if (!da || !db) {
    std::fprintf(stderr, "usage: dv --a DEV --b DEV [--metaroce PATH]\n");
    return 2;
  }
  Side a, b;
  setup(a, da);
  setup(b, db);

  // --- device -------------------------------------------------------------------------------
  mrdv_device_attr d{};
  CHECK(mrdv_query_device(a.ctx, &d, sizeof(d)) == 0, "query_device");
  CHECK(d.planes == 4 && d.max_planes == MRDV_MAX_PLANES, "planes %u max %u", d.planes,
        d.max_planes);
  CHECK(d.sack_bits == 256 && d.wire_version == MRDV_WIRE_VERSION && d.max_paths == 256,
        "sack %u wire %u max_paths %u", d.sack_bits, d.wire_version, d.max_paths);
  CHECK(d.default_paths == 32 && d.udp_dport == 4793, "default paths %u (8 per plane) port %u",
        d.default_paths, d.udp_dport);
  CHECK((d.device_caps & MRDV_CAP_PLANE_MASK) && (d.device_caps & MRDV_CAP_ISOLATED_CONN),
        "caps %llx", (unsigned long long)d.device_caps);
  CHECK(wait_planes_up(a.ctx, 0xf) == 0xf, "planes up %x", d.planes_up);
  {
    mrdv_device_attr x{};
    x.comp_mask = 1;
    CHECK(mrdv_query_device(a.ctx, &x, sizeof(x)) == EINVAL, "comp_mask 1");
    CHECK(mrdv_query_device(a.ctx, &x, 8) == EINVAL, "inlen 8");
    CHECK(mrdv_query_device(a.ctx, nullptr, sizeof(x)) == EINVAL, "NULL attr");
    // A newer caller's longer structure: its tail is zeroed.
    std::vector<uint8_t> big(sizeof(mrdv_device_attr) + 16, 0xab);
    std::memset(big.data(), 0, sizeof(uint64_t));
    CHECK(mrdv_query_device(a.ctx, reinterpret_cast<mrdv_device_attr*>(big.data()),
                            static_cast<uint32_t>(big.size())) == 0, "longer attr");
    CHECK(big.back() == 0, "tail of a longer attr not zeroed");
  }

  // --- creation errors ------------------------------------------------------------------------
  {
    errno = 0;
    CHECK(!dv_qp(a, MRDV_QP_INIT_PATHS, 0, 0, 0) && errno == EINVAL, "0 paths");
    CHECK(!dv_qp(a, MRDV_QP_INIT_PATHS, 257, 0, 0) && errno == EINVAL, "257 paths");
    CHECK(!dv_qp(a, MRDV_QP_INIT_PLANE_MASK, 0, 0, 0) && errno == EINVAL, "empty mask");
    CHECK(!dv_qp(a, MRDV_QP_INIT_PLANE_MASK, 0, 1u << 4, 0) && errno == EINVAL, "plane 4");
    CHECK(!dv_qp(a, 1u << 7, 0, 0, 0) && errno == EINVAL, "unknown comp_mask");
    CHECK(!dv_qp(a, MRDV_QP_INIT_FLAGS, 0, 0, 1u << 9) && errno == EINVAL, "unknown flag");
    ibv_qp_init_attr_ex ud = rc_attr(a);
    ud.qp_type = IBV_QPT_UD;
    mrdv_qp_init_attr m{};
    CHECK(!mrdv_create_qp(a.ctx, &ud, &m, sizeof(m)) && errno == EOPNOTSUPP, "UD");
    ibv_qp_init_attr_ex rc = rc_attr(a);
    CHECK(!mrdv_create_qp(a.ctx, &rc, &m, 8) && errno == EINVAL, "short inlen");
    CHECK(!mrdv_create_qp(a.ctx, &rc, nullptr, sizeof(m)) && errno == EINVAL, "NULL attr");
  }

  // --- a QP on planes 0 and 1, 4 paths ----------------------------------------------------------
  ibv_qp* qa = dv_qp(a, MRDV_QP_INIT_PATHS | MRDV_QP_INIT_PLANE_MASK, 4, 0x3, 0);
  ibv_qp* qb = plain_qp(b);
  if (!qa || !qb) die("create QPs");
  {
    uint32_t n = 0;
    mrdv_path_stats one{};
    CHECK(mrdv_query_paths(qa, &one, 1, sizeof(one), &n) == ENOTCONN, "paths before RTR");
    CHECK(mrdv_repath(qa, 0, nullptr) == ENOTCONN, "repath before RTR");
    CHECK(mrdv_query_paths(qa, &one, 1, 8, &n) == EINVAL, "short entry_len");
    CHECK(mrdv_query_paths(qa, nullptr, 1, sizeof(one), &n) == EINVAL, "NULL entries");
    const mrdv_qp_conn c = conn_of(qa);
    CHECK(c.conn_id == 0 && c.peer_ipv4 == 0 && c.num_paths == 4 && c.plane_mask == 3,
          "before RTR: conn %u peer %x paths %u mask %x", c.conn_id, c.peer_ipv4, c.num_paths,
          c.plane_mask);
    mrdv_qp_conn bad{};
    bad.comp_mask = 1;
    CHECK(mrdv_query_qp_conn(qa, &bad, sizeof(bad)) == EINVAL, "conn comp_mask");
    mrdv_qp_attr m{};
    m.comp_mask = 1u << 5;
    CHECK(mrdv_modify_qp(qa, &m, sizeof(m)) == EINVAL, "modify comp_mask");
    m.comp_mask = MRDV_QP_ATTR_PLANE_MASK;
    m.plane_mask = 0x10;
    CHECK(mrdv_modify_qp(qa, &m, sizeof(m)) == EINVAL, "modify plane 4");
    m.comp_mask = MRDV_QP_ATTR_PATHS;
    m.num_paths = 0;
    CHECK(mrdv_modify_qp(qa, &m, sizeof(m)) == EINVAL, "modify 0 paths");
  }
  connect(qa, b, qb);
  connect(qb, a, qa);
  write_many(a, qa, b, 256, 16384);
  auto ps = paths_of(qa);
  CHECK(ps.size() == 4, "%zu paths, want 4", ps.size());
  for (const auto& p : ps) {
    CHECK(p.plane == (p.path_id % 2), "path %u on plane %u", p.path_id, p.plane);
    CHECK(p.tx_bytes > 0, "path %u carried nothing (spraying)", p.path_id);
    CHECK(p.state == MRDV_PATH_ACTIVE, "path %u state %u", p.path_id, p.state);
    CHECK(p.srtt_ns > 0 && p.min_rtt_ns > 0 && p.min_rtt_ns <= p.srtt_ns * 8,
          "path %u srtt %llu min %llu", p.path_id, (unsigned long long)p.srtt_ns,
          (unsigned long long)p.min_rtt_ns);
  }
  const mrdv_qp_conn ca = conn_of(qa);
  CHECK(ca.conn_id != 0 && ca.lane != 0 && ca.streams == 1 && ca.num_paths == 4 &&
            ca.plane_mask == 3 && ca.paths_active == 4,
        "conn %u lane %x streams %u paths %u/%u mask %x", ca.conn_id, ca.lane, ca.streams,
        ca.paths_active, ca.num_paths, ca.plane_mask);
  {
    ibv_gid g = b.gid;
    uint32_t ip;
    std::memcpy(&ip, g.raw + 12, 4);
    CHECK(ca.peer_ipv4 == ip, "peer %x, want %x", ca.peer_ipv4, ip);
  }

  // --- lanes: shared by settings, isolated on request -----------------------------------------
  ibv_qp* qa2 = dv_qp(a, MRDV_QP_INIT_PATHS | MRDV_QP_INIT_PLANE_MASK, 4, 0x3, 0);
  ibv_qp* qa3 = plain_qp(a);
  ibv_qp* qa4 = dv_qp(a, MRDV_QP_INIT_FLAGS, 0, 0, MRDV_QP_ISOLATED);
  ibv_qp* qb2 = plain_qp(b);
  ibv_qp* qb3 = plain_qp(b);
  ibv_qp* qb4 = plain_qp(b);
  if (!qa2 || !qa3 || !qa4 || !qb2 || !qb3 || !qb4) die("create more QPs");
  connect(qa2, b, qb2);
  connect(qb2, a, qa2);
  connect(qa3, b, qb3);
  connect(qb3, a, qa3);
  connect(qa4, b, qb4);
  connect(qb4, a, qa4);
  write_many(a, qa2, b, 8, 4096);
  write_many(a, qa3, b, 8, 4096);
  write_many(a, qa4, b, 8, 4096);
  const mrdv_qp_conn c2 = conn_of(qa2), c3 = conn_of(qa3), c4 = conn_of(qa4);
  CHECK(c2.lane == ca.lane && c2.conn_id == ca.conn_id && c2.streams == 2,
        "same settings: lane %x/%x conn %u/%u streams %u", c2.lane, ca.lane, c2.conn_id,
        ca.conn_id, c2.streams);
  CHECK(c3.lane == 0 && c3.conn_id != ca.conn_id && c3.num_paths == 32 && c3.plane_mask == 0xf,
        "default QP: lane %x paths %u mask %x", c3.lane, c3.num_paths, c3.plane_mask);
  CHECK(c4.lane != 0 && c4.lane != ca.lane && c4.conn_id != c3.conn_id && c4.streams == 1 &&
            (c4.flags & MRDV_QP_ISOLATED),
        "isolated QP: lane %x conn %u streams %u flags %x", c4.lane, c4.conn_id, c4.streams,
        c4.flags);

  // --- entropy ----------------------------------------------------------------------------------
  {
    uint16_t port = 0;
    const uint16_t before = paths_of(qa)[1].udp_sport;
    CHECK(mrdv_repath(qa, 1, &port) == 0 && port != 0 && port != before, "repath %u -> %u",
          before, port);
    CHECK(paths_of(qa)[1].udp_sport == port, "telemetry port after repath");
    CHECK(mrdv_repath(qa, 4, &port) == EINVAL, "repath path 4 of 4");
    write_many(a, qa, b, 32, 16384);
  }

  // --- a live change: plane 2 only, 2 paths (a shared QP moves to that lane) ---------------------
  {
    mrdv_qp_attr m{};
    m.comp_mask = MRDV_QP_ATTR_PATHS | MRDV_QP_ATTR_PLANE_MASK;
    m.num_paths = 2;
    m.plane_mask = 0x4;
    CHECK(mrdv_modify_qp(qa, &m, sizeof(m)) == 0, "modify to plane 2");
    write_many(a, qa, b, 64, 16384);
    const auto v = paths_of(qa);
    CHECK(v.size() == 2, "%zu paths after modify", v.size());
    CHECK(bytes_on_plane(v, 2) > 0 && bytes_on_plane(v, 0) + bytes_on_plane(v, 1) == 0,
          "after modify: plane 2 %llu, planes 0+1 %llu", (unsigned long long)bytes_on_plane(v, 2),
          (unsigned long long)(bytes_on_plane(v, 0) + bytes_on_plane(v, 1)));
    const mrdv_qp_conn c = conn_of(qa);
    CHECK(c.lane != ca.lane && c.num_paths == 2 && c.plane_mask == 4, "lane %x paths %u mask %x",
          c.lane, c.num_paths, c.plane_mask);
    // An isolated QP changes its own connection: same lane, more paths.
    m.comp_mask = MRDV_QP_ATTR_PATHS;
    m.num_paths = 12;
    CHECK(mrdv_modify_qp(qa4, &m, sizeof(m)) == 0, "grow isolated");
    write_many(a, qa4, b, 64, 16384);
    const mrdv_qp_conn c4b = conn_of(qa4);
    CHECK(c4b.lane == c4.lane && c4b.conn_id == c4.conn_id && c4b.num_paths == 12,
          "isolated after grow: lane %x conn %u paths %u", c4b.lane, c4b.conn_id, c4b.num_paths);
    CHECK(paths_of(qa4).size() == 12, "isolated QP paths after grow");
    m.num_paths = 3;
    CHECK(mrdv_modify_qp(qa4, &m, sizeof(m)) == 0, "shrink isolated");
    write_many(a, qa4, b, 64, 16384);
    CHECK(paths_of(qa4).size() == 3, "isolated QP paths after shrink");
  }

  // --- a plane set down mid-transfer: planes 0 and 1, then plane 0 down ---------------------
  {
    mrdv_qp_attr m{};
    m.comp_mask = MRDV_QP_ATTR_PATHS | MRDV_QP_ATTR_PLANE_MASK;
    m.num_paths = 4;
    m.plane_mask = 0x3;
    CHECK(mrdv_modify_qp(qa, &m, sizeof(m)) == 0, "back to planes 0-1");
    write_many(a, qa, b, 64, 16384);  // the lane of before, counters go on
    const uint64_t p0_before = bytes_on_plane(paths_of(qa), 0);
    set_plane(metaroce, da, 0, "down");
    CHECK(wait_planes_up(a.ctx, 0xe) == 0xe, "plane 0 not reported down");
    write_many(a, qa, b, 512, 16384);  // every write completes: no error for the application
    auto v = paths_of(qa);
    // Packets already on the wire when the plane went down may be counted after; nothing new.
    const uint64_t p0_down = bytes_on_plane(v, 0);
    for (const auto& p : v)
      if (p.plane == 0) CHECK(p.state == MRDV_PATH_PLANE_DOWN, "path %u state %u", p.path_id, p.state);
    CHECK(bytes_on_plane(v, 1) > 0, "plane 1 carried nothing");
    write_many(a, qa, b, 256, 16384);
    CHECK(bytes_on_plane(paths_of(qa), 0) == p0_down,
          "plane 0 carried data while down: %llu -> %llu", (unsigned long long)p0_down,
          (unsigned long long)bytes_on_plane(paths_of(qa), 0));
    CHECK(p0_down >= p0_before, "counters went back");
    set_plane(metaroce, da, 0, "up");
    CHECK(wait_planes_up(a.ctx, 0xf) == 0xf, "plane 0 not reported up");
    // Back in service once its probes are answered: traffic returns to it.
    uint64_t p0_after = p0_down;
    // (Bounded by 10 s of traffic, not by a count: a loaded machine may take a while.)
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (p0_after == p0_down && std::chrono::steady_clock::now() < until) {
      write_many(a, qa, b, 32, 16384);
      p0_after = bytes_on_plane(paths_of(qa), 0);
    }
    CHECK(p0_after > p0_down, "plane 0 never carried data again after it came up");
  }

  ibv_qp* all[] = {qa, qa2, qa3, qa4, qb, qb2, qb3, qb4};
  for (ibv_qp* q : all) CHECK(ibv_destroy_qp(q) == 0, "destroy QP");
  for (Side* s : {&a, &b}) {
    ibv_dereg_mr(s->mr);
    ibv_destroy_cq(s->cq);
    ibv_dealloc_pd(s->pd);
    ibv_close_device(s->ctx);
  }
  if (failures) {
    std::fprintf(stderr, "dv: %d failure(s)\n", failures);
    return 1;
  }
  std::printf("PASS dv\n");
  return 0;
}
