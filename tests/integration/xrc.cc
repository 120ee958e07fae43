// SPDX-License-Identifier: Apache-2.0
// XRC between real processes (docs/spec/verbs-mapping.md §17), one role per process:
//   initiator (device A): an XRC_SEND QP that sends to the SRQs of two processes of device B,
//     alternating between them, then RDMA WRITE, READ and fetch-and-add through each SRQ's PD;
//   target (device B): opens the XRC domain of a file (O_CREAT), makes an XRC SRQ and the XRC
//     target QP the initiator connects to, and checks what its SRQ received;
//   peer (device B, another process): opens the same file's domain, opens the target QP by number
//     (ibv_open_qp) and has an SRQ of its own in the domain.
// The roles exchange numbers through small files in --dir (name=value lines, written whole and
// renamed). The script kills the target mid-stream: the peer, which holds the target QP open,
// must keep receiving, and a request for the killed process's SRQ must fail as an invalid request.
#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include "tests/integration/test_support.h"

using namespace metaroce::test;

const char* const metaroce::test::kProgram = "xrc";

namespace {

constexpr uint32_t kPhase1 = 64;       // messages, alternating SRQs, of up to 12000 bytes
constexpr uint32_t kPhase2Max = 8000;  // messages to the peer's SRQ until the target is killed,
constexpr uint32_t kAfterKill = 64;    // and after, of up to 1 KiB
constexpr uint32_t kSlot = 16384;      // bytes per receive of phase 1
constexpr uint32_t kSmallSlot = 1024;  // and of phase 2
// The peer posts a receive for every message it may get, so that its SRQ never runs dry: the
// stream tests XRC, not the RNR back-off.
constexpr uint32_t kPeerRecvs = kPhase1 / 2 + kPhase2Max + kAfterKill;
constexpr uint32_t kBufBytes = 16 << 20;
constexpr uint32_t kRdmaOff = 14 << 20;  // where WRITE and the atomic target lie in each MR
static_assert((kPhase1 / 2) * kSlot + uint64_t{kPeerRecvs} * kSmallSlot <= kRdmaOff);
constexpr unsigned kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                             IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

std::string dir;

// Message j's length and byte k: lengths from one packet to several in phase 1.
uint32_t msg_len(uint32_t j) {
  return j < kPhase1 ? 1 + (j * 2749u) % 12000u : 1 + (j * 997u) % kSmallSlot;
}
uint8_t msg_byte(uint32_t j, uint32_t k) { return static_cast<uint8_t>(j * 31u + k * 7u + 1u); }

void publish(const std::string& name, const std::map<std::string, uint64_t>& kv) {
  const std::string tmp = dir + "/." + name;
  {
    std::ofstream f(tmp);
    for (auto& [k, v] : kv) f << k << "=" << v << "\n";
  }
  if (rename(tmp.c_str(), (dir + "/" + name).c_str())) die("rename");
}

bool exists(const std::string& name) {
  struct stat st;
  return stat((dir + "/" + name).c_str(), &st) == 0;
}

// Waits (60 s at most) for another role's file and reads it.
std::map<std::string, uint64_t> wait_for(const std::string& name) {
  for (int i = 0; i < 6000 && !exists(name); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::ifstream f(dir + "/" + name);
  if (!f) die(("no " + name).c_str());
  std::map<std::string, uint64_t> kv;
  std::string line;
  while (std::getline(f, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = std::stoull(line.substr(eq + 1));
  }
  return kv;
}

// The next completion within `ms` milliseconds, if any.
bool poll_for(ibv_cq* cq, int ms, ibv_wc* wc) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    const int n = ibv_poll_cq(cq, 1, wc);
    if (n < 0) die("ibv_poll_cq");
    if (n == 1) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
  }
}

ibv_wc poll_one(ibv_cq* cq) {
  ibv_wc wc{};
  if (!poll_for(cq, 30000, &wc)) {
    errno = ETIMEDOUT;
    die("no completion");
  }
  return wc;
}

// The GID as two 64-bit numbers, for the exchange files.
void put_gid(std::map<std::string, uint64_t>& kv, const ibv_gid& g) {
  uint64_t hi, lo;
  std::memcpy(&hi, g.raw, 8);
  std::memcpy(&lo, g.raw + 8, 8);
  kv["gid_hi"] = hi;
  kv["gid_lo"] = lo;
}
ibv_gid get_gid(std::map<std::string, uint64_t>& kv) {
  ibv_gid g;
  const uint64_t hi = kv.at("gid_hi"), lo = kv.at("gid_lo");
  std::memcpy(g.raw, &hi, 8);
  std::memcpy(g.raw + 8, &lo, 8);
  return g;
}

// A receiving process's domain, PD, CQ, memory and XRC SRQ with n receives posted.
struct Receiver {
  ibv_context* ctx = nullptr;
  ibv_xrcd* xrcd = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_srq* srq = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<uint8_t> buf = std::vector<uint8_t>(kBufBytes);
  uint32_t srqn = 0;

  // Where receive number i (its wr_id) lands: kPhase1 / 2 large slots, then small ones.
  static uint64_t slot_of(uint64_t i) {
    return i < kPhase1 / 2 ? i * kSlot : (kPhase1 / 2) * kSlot + (i - kPhase1 / 2) * kSmallSlot;
  }
  void post_recv(uint32_t i) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(buf.data()) + slot_of(i),
                i < kPhase1 / 2 ? kSlot : kSmallSlot, mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad;
    if (ibv_post_srq_recv(srq, &wr, &bad)) die("ibv_post_srq_recv");
  }

  void open(const std::string& dev, const std::string& file, int oflags, uint32_t n) {
    ctx = open_device_named(dev);
    const int fd = ::open(file.c_str(), O_RDONLY | O_CREAT, 0600);
    if (fd < 0) die("open the domain's file");
    ibv_xrcd_init_attr xa{};
    xa.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
    xa.fd = fd;
    xa.oflags = oflags;
    xrcd = ibv_open_xrcd(ctx, &xa);
    if (!xrcd) die("ibv_open_xrcd");
    close(fd);  // the domain lives on without the descriptor
    pd = ibv_alloc_pd(ctx);
    cq = ibv_create_cq(ctx, 1024, nullptr, nullptr, 0);
    mr = ibv_reg_mr(pd, buf.data(), buf.size(), kAccess);
    if (!pd || !cq || !mr) die("pd, cq, mr");
    ibv_srq_init_attr_ex sa{};
    sa.attr.max_wr = n;
    sa.attr.max_sge = 1;
    sa.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_XRCD |
                   IBV_SRQ_INIT_ATTR_CQ;
    sa.srq_type = IBV_SRQT_XRC;
    sa.pd = pd;
    sa.xrcd = xrcd;
    sa.cq = cq;
    srq = ibv_create_srq_ex(ctx, &sa);
    if (!srq) die("ibv_create_srq_ex");
    if (ibv_get_srq_num(srq, &srqn)) die("ibv_get_srq_num");
    for (uint32_t i = 0; i < n; ++i) post_recv(i);
    // The atomic's target: 8 aligned bytes.
    const uint64_t start = 1000;
    std::memcpy(buf.data() + kRdmaOff, &start, 8);
  }

  void describe(std::map<std::string, uint64_t>& kv) const {
    kv["srqn"] = srqn;
    kv["addr"] = reinterpret_cast<uintptr_t>(buf.data());
    kv["rkey"] = mr->rkey;
  }

  // Its `index`-th receive completion is wc, message j of the initiator's QP into the target QP
  // (receives are claimed in posting order: the index-th posted).
  void expect(const ibv_wc& wc, uint32_t index, uint32_t j, uint32_t tgt_qpn, uint32_t ini_qpn) {
    CHECK(wc.status == IBV_WC_SUCCESS, "receive %u: status %s", index, ibv_wc_status_str(wc.status));
    CHECK(wc.opcode == IBV_WC_RECV, "receive %u: opcode %d", index, wc.opcode);
    CHECK(wc.wr_id == index, "receive %u completed as wr_id %llu", index,
          static_cast<unsigned long long>(wc.wr_id));
    CHECK(wc.byte_len == msg_len(j), "receive %u: %u bytes, message %u has %u", index,
          wc.byte_len, j, msg_len(j));
    CHECK(wc.qp_num == tgt_qpn, "receive %u: qp_num %u, the target is %u", index, wc.qp_num, tgt_qpn);
    CHECK(wc.src_qp == ini_qpn, "receive %u: src_qp %u", index, wc.src_qp);
    const uint8_t* p = buf.data() + slot_of(wc.wr_id);
    for (uint32_t k = 0; k < wc.byte_len && k < kSlot; ++k) {
      if (p[k] != msg_byte(j, k)) {
        CHECK(false, "receive %u (message %u): byte %u is %u, not %u", index, j, k, p[k],
              msg_byte(j, k));
        break;
      }
    }
  }

  // What the initiator's WRITE and fetch-and-add left.
  void check_rdma(uint8_t fill, uint64_t added) {
    uint64_t v;
    std::memcpy(&v, buf.data() + kRdmaOff, 8);
    CHECK(v == 1000 + added, "the atomic's target holds %llu, not %llu",
          static_cast<unsigned long long>(v), static_cast<unsigned long long>(1000 + added));
    for (uint32_t k = 0; k < 4096; ++k)
      if (buf[kRdmaOff + 64 + k] != fill) {
        CHECK(false, "written byte %u is %u, not %u", k, buf[kRdmaOff + 64 + k], fill);
        break;
      }
  }
};

ibv_qp* make_target(ibv_context* ctx, ibv_xrcd* xrcd) {
  ibv_qp_init_attr_ex qa{};
  qa.qp_type = IBV_QPT_XRC_RECV;
  qa.comp_mask = IBV_QP_INIT_ATTR_XRCD;
  qa.xrcd = xrcd;
  ibv_qp* qp = ibv_create_qp_ex(ctx, &qa);
  if (!qp) die("ibv_create_qp_ex XRC_RECV");
  return qp;
}

// The XRC rows of ibv_modify_qp: a target asks the responder's attributes at RTR and only the
// timeout and send PSN at RTS; an initiator the requester's.
void connect(ibv_qp* qp, bool target, uint32_t peer_qpn, const ibv_gid& gid) {
  modify_to_init(qp, target ? kAccess : 0);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer_qpn;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = gid;
  a.ah_attr.grh.hop_limit = 1;
  a.ah_attr.port_num = 1;
  int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  if (target) mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  if (ibv_modify_qp(qp, &a, mask)) die("modify RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 16;
  mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN;
  if (!target) mask |= IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  if (ibv_modify_qp(qp, &a, mask)) die("modify RTS");
}

int run_target(const std::string& dev, const std::string& file) {
  Receiver r;
  r.open(dev, file, O_CREAT, kPhase1 / 2);
  auto ini = wait_for("initiator");
  ibv_qp* tgt = make_target(r.ctx, r.xrcd);
  connect(tgt, true, static_cast<uint32_t>(ini.at("qpn")), get_gid(ini));
  std::map<std::string, uint64_t> kv;
  r.describe(kv);
  kv["qpn"] = tgt->qp_num;
  ibv_gid gid;
  if (ibv_query_gid(r.ctx, 1, 0, &gid)) die("ibv_query_gid");
  put_gid(kv, gid);
  publish("target", kv);
  // Messages 0, 2, 4, ... are ours, in order.
  for (uint32_t i = 0; i < kPhase1 / 2; ++i)
    r.expect(poll_one(r.cq), i, 2 * i, tgt->qp_num, static_cast<uint32_t>(ini.at("qpn")));
  wait_for("rdma-done");
  r.check_rdma(0xa1, 5);
  std::printf("target ok\n");
  std::fflush(stdout);
  if (failures) return 1;
  // Holding everything until the script kills it.
  for (;;) pause();
}

int run_peer(const std::string& dev, const std::string& file) {
  auto tgt = wait_for("target");
  Receiver r;
  r.open(dev, file, 0, kPeerRecvs);  // the target's domain: no O_CREAT
  const uint32_t ini_qpn = static_cast<uint32_t>(wait_for("initiator").at("qpn"));
  ibv_qp_open_attr oa{};
  oa.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  oa.qp_num = static_cast<uint32_t>(tgt.at("qpn"));
  oa.xrcd = r.xrcd;
  oa.qp_type = IBV_QPT_XRC_RECV;
  ibv_qp* held = ibv_open_qp(r.ctx, &oa);
  if (!held) die("ibv_open_qp");
  CHECK(held->qp_num == oa.qp_num, "opened QP %u, asked %u", held->qp_num, oa.qp_num);
  // A QP of another type, or one the domain does not have, does not open.
  oa.qp_type = IBV_QPT_RC;
  CHECK(!ibv_open_qp(r.ctx, &oa) && errno == EINVAL, "an RC 'target' opened");
  oa.qp_type = IBV_QPT_XRC_RECV;
  oa.qp_num ^= 0x5a5a;
  CHECK(!ibv_open_qp(r.ctx, &oa) && errno == EINVAL, "a QP the domain lacks opened");
  // Its domain cannot close under what it holds.
  CHECK(ibv_close_xrcd(r.xrcd) == EBUSY, "ibv_close_xrcd under an SRQ and a QP");
  std::map<std::string, uint64_t> kv;
  r.describe(kv);
  publish("peer", kv);
  const uint32_t tgt_qpn = held->qp_num;
  // Messages 1, 3, 5, ... of phase 1; then every message of phase 2, during which the target
  // process is killed: we hold the QP, so they keep coming.
  uint32_t got = 0;
  auto take = [&](const ibv_wc& wc) {
    const uint32_t j = got < kPhase1 / 2 ? 2 * got + 1 : kPhase1 + (got - kPhase1 / 2);
    r.expect(wc, got, j, tgt_qpn, ini_qpn);
    ++got;
  };
  auto last = std::chrono::steady_clock::now();
  for (uint64_t total = 0;;) {
    if (!total && exists("phase2-count")) total = kPhase1 / 2 + wait_for("phase2-count").at("n");
    if (total && got >= total) break;
    ibv_wc wc{};
    if (poll_for(r.cq, 10, &wc)) {
      take(wc);
      last = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - last > std::chrono::seconds(30)) {
      std::fprintf(stderr, "xrc: %u receives of %llu\n", got, static_cast<unsigned long long>(total));
      errno = ETIMEDOUT;
      die("the stream stopped");
    }
  }
  CHECK(got >= kPhase1 / 2 + kAfterKill, "only %u receives", got);
  wait_for("initiator-done");
  ibv_wc extra{};
  CHECK(!poll_for(r.cq, 100, &extra), "a receive beyond the messages sent (wr_id %llu)",
        static_cast<unsigned long long>(extra.wr_id));
  r.check_rdma(0xb2, 7);
  ibv_qp_attr qa;
  ibv_qp_init_attr qi;
  CHECK(ibv_query_qp(held, &qa, IBV_QP_STATE, &qi) == 0, "ibv_query_qp");
  // The initiator's last request named the killed process's SRQ: an invalid request, which
  // ends the target as an RC responder's error does.
  CHECK(qa.qp_state == IBV_QPS_ERR, "the target QP is in state %d after an invalid request",
        qa.qp_state);
  CHECK(ibv_destroy_qp(held) == 0, "closing the target");
  CHECK(ibv_destroy_srq(r.srq) == 0, "ibv_destroy_srq");
  CHECK(ibv_close_xrcd(r.xrcd) == 0, "ibv_close_xrcd");
  std::printf("peer ok\n");
  return failures ? 1 : 0;
}

void post(ibv_qp* qp, ibv_send_wr& wr) {
  ibv_send_wr* bad;
  if (ibv_post_send(qp, &wr, &bad)) die("ibv_post_send");
}

int run_initiator(const std::string& dev) {
  ibv_context* ctx = open_device_named(dev);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 1024, nullptr, nullptr, 0);
  std::vector<uint8_t> buf(kBufBytes);
  ibv_mr* mr = ibv_reg_mr(pd, buf.data(), buf.size(), kAccess);
  if (!pd || !cq || !mr) die("pd, cq, mr");
  ibv_qp_init_attr_ex qa{};
  qa.qp_type = IBV_QPT_XRC_SEND;
  qa.comp_mask = IBV_QP_INIT_ATTR_PD;
  qa.pd = pd;
  qa.send_cq = cq;
  qa.cap.max_send_wr = 256;
  qa.cap.max_send_sge = 1;
  ibv_qp* qp = ibv_create_qp_ex(ctx, &qa);
  if (!qp) die("ibv_create_qp_ex XRC_SEND");
  std::map<std::string, uint64_t> kv{{"qpn", qp->qp_num}};
  ibv_gid gid;
  if (ibv_query_gid(ctx, 1, 0, &gid)) die("ibv_query_gid");
  put_gid(kv, gid);
  publish("initiator", kv);
  auto tgt = wait_for("target");
  auto peer = wait_for("peer");
  connect(qp, false, static_cast<uint32_t>(tgt.at("qpn")), get_gid(tgt));
  const uint32_t srqn[2] = {static_cast<uint32_t>(tgt.at("srqn")),
                            static_cast<uint32_t>(peer.at("srqn"))};
  // Each message is sent from its own slot of the buffer, which stays until it completed.
  auto send = [&](uint32_t j, uint32_t to) {
    uint8_t* p = buf.data() + uint64_t{j % 256} * kSlot;
    for (uint32_t k = 0; k < msg_len(j); ++k) p[k] = msg_byte(j, k);
    ibv_sge sge{reinterpret_cast<uintptr_t>(p), msg_len(j), mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = j;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.qp_type.xrc.remote_srqn = to;
    post(qp, wr);
  };
  // Phase 1: consecutive messages to different SRQs, 32 in flight at a time.
  for (uint32_t j = 0; j < kPhase1; ++j) {
    send(j, srqn[j % 2]);
    if (j % 32 == 31)
      for (int k = 0; k < 32; ++k) {
        const ibv_wc wc = poll_one(cq);
        CHECK(wc.status == IBV_WC_SUCCESS, "send %llu: %s", static_cast<unsigned long long>(wc.wr_id),
              ibv_wc_status_str(wc.status));
      }
  }
  // RDMA through each SRQ's PD: a WRITE of 4 KiB, a READ of it back, a fetch-and-add.
  const uint8_t fill[2] = {0xa1, 0xb2};
  const uint64_t add[2] = {5, 7};
  for (int s = 0; s < 2; ++s) {
    auto& kvp = s == 0 ? tgt : peer;
    const uint64_t raddr = kvp.at("addr") + kRdmaOff;
    const uint32_t rkey = static_cast<uint32_t>(kvp.at("rkey"));
    uint8_t* w = buf.data() + (6 << 20);
    std::memset(w, fill[s], 4096);
    ibv_sge sge{reinterpret_cast<uintptr_t>(w), 4096, mr->lkey};
    ibv_send_wr wr{};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.qp_type.xrc.remote_srqn = srqn[s];
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.wr.rdma.remote_addr = raddr + 64;
    wr.wr.rdma.rkey = rkey;
    post(qp, wr);
    uint8_t* back = w + 8192;
    std::memset(back, 0, 4096);
    sge.addr = reinterpret_cast<uintptr_t>(back);
    wr.opcode = IBV_WR_RDMA_READ;
    post(qp, wr);
    uint64_t* old = reinterpret_cast<uint64_t*>(w + 16384);
    sge.addr = reinterpret_cast<uintptr_t>(old);
    sge.length = 8;
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.wr.atomic.remote_addr = raddr;
    wr.wr.atomic.rkey = rkey;
    wr.wr.atomic.compare_add = add[s];
    post(qp, wr);
    for (int k = 0; k < 3; ++k) {
      const ibv_wc wc = poll_one(cq);
      CHECK(wc.status == IBV_WC_SUCCESS, "RDMA through SRQ %u: %s", srqn[s],
            ibv_wc_status_str(wc.status));
    }
    CHECK(back[0] == fill[s] && back[4095] == fill[s], "the READ brought %u..%u", back[0], back[4095]);
    CHECK(*old == 1000, "fetch-and-add returned %llu", static_cast<unsigned long long>(*old));
  }
  publish("rdma-done", {});
  // Phase 2: a stream to the peer's SRQ, while the script kills the target process (it says so
  // once the engine reclaimed it), and kAfterKill messages more after that.
  std::printf("phase2\n");
  std::fflush(stdout);
  uint32_t outstanding = 0, n = 0, after = 0;
  auto reap = [&](uint32_t down_to) {
    for (; outstanding > down_to; --outstanding) {
      const ibv_wc wc = poll_one(cq);
      CHECK(wc.status == IBV_WC_SUCCESS, "phase 2 send %llu: %s",
            static_cast<unsigned long long>(wc.wr_id), ibv_wc_status_str(wc.status));
    }
  };
  // Paced a little (each message is still sent at once), so that the kill usually finds the
  // stream going; on a machine too slow for that, the stream pauses for it instead.
  uint32_t before_kill = 0;
  while (n < kPhase2Max && !exists("killed")) {
    send(kPhase1 + n++, srqn[1]);
    ++before_kill;
    if (++outstanding == 64) reap(32);
    if (n % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  wait_for("killed");
  while (after < kAfterKill) {
    send(kPhase1 + n++, srqn[1]);
    ++after;
    if (++outstanding == 64) reap(32);
  }
  reap(0);
  std::fprintf(stderr, "phase 2: %u messages before the kill was known, %u after\n", before_kill,
               after);
  publish("phase2-count", {{"n", n}});
  // The killed process's SRQ went with it: a request naming it is an invalid request.
  send(9999, srqn[0]);
  const ibv_wc wc = poll_one(cq);
  CHECK(wc.status == IBV_WC_REM_INV_REQ_ERR, "a SEND to the killed process's SRQ: %s",
        ibv_wc_status_str(wc.status));
  publish("initiator-done", {});
  std::printf("initiator ok\n");
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string role, dev, file;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--role") role = argv[i + 1];
    else if (a == "--dev") dev = argv[i + 1];
    else if (a == "--dir") dir = argv[i + 1];
    else if (a == "--file") file = argv[i + 1];
  }
  if (role.empty() || dev.empty() || dir.empty()) {
    std::fprintf(stderr, "usage: xrc --role initiator|target|peer --dev DEV --dir DIR [--file F]\n");
    return 2;
  }
  if (role == "initiator") return run_initiator(dev);
  if (role == "target") return run_target(dev, file);
  if (role == "peer") return run_peer(dev, file);
  std::fprintf(stderr, "xrc: unknown role %s\n", role.c_str());
  return 2;
}
