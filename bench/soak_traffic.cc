// SPDX-License-Identifier: Apache-2.0
// soak_traffic: one side of a fault-soak traffic pair (bench/soak.sh), plain libibverbs. Every
// byte that crosses is checked against a pattern seeded by the session, the message and the
// operation, so data from another message, another session or a killed process shows up.
//
//   soak_traffic --kind rc|srq|ud --server --dev NAME --port P
//   soak_traffic --kind rc|srq|ud --connect HOST --dev NAME --port P --until UNIX_SECONDS
//
//   rc   one RC QP, up to 8 iterations in flight: WRITE (up to 256 KiB) into the server's slot,
//        READ (up to 256 KiB) of the server's pattern region, SEND_WITH_IMM (up to 64 KiB,
//        three SGEs) carrying the iteration number. The server checks the SEND's bytes and the
//        WRITE's (RC ordering: the WRITE is placed before the SEND completes), and that
//        iterations arrive once each and in order; its zero-length SEND_WITH_IMM frees the slot.
//        The client checks every byte READ.
//   srq  four RC QPs whose SENDs (up to 16 KiB) land in one shared receive queue of the server:
//        each completion's QP, sequence (in order per QP) and bytes are checked.
//   ud   UD datagrams (up to the port MTU) to the server, which checks each and echoes it back;
//        the client checks the echo. Duplicates are failures (the transport delivers a datagram
//        at most once, verbs-mapping.md §7); a datagram never echoed is counted as lost.
//
// A server serves one client session after another until a client, past --until, ends with
// FIN: then both print their totals and exit 0 if nothing failed. A peer that dies (SIGKILL)
// ends the session: the survivor sees its TCP connection close, destroys everything it holds
// and waits for (server) or reconnects to (client) the next one. A work completion in error
// while the peer still answers on TCP is a failure. Progress lines ("progress {...}") every
// 2 s, a final "result {...}"; exit status 0 only if every check passed.
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "soak_traffic";

namespace {

using Clock = std::chrono::steady_clock;

// --- patterns ---------------------------------------------------------------------------------

uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// The seed of one operation of one message of one session.
uint64_t seed_of(uint64_t session, uint32_t tag, uint64_t n) {
  return mix(session ^ (uint64_t{tag} << 56) ^ mix(n));
}
// Byte `off` of the stream `seed`: 8 bytes per mixed word.
void fill(uint8_t* p, size_t n, uint64_t seed, uint64_t off = 0) {
  for (size_t i = 0; i < n; ++i) {
    const uint64_t o = off + i;
    p[i] = static_cast<uint8_t>(mix(seed ^ (o >> 3)) >> ((o & 7) * 8));
  }
}
// First byte that differs, or -1.
long check(const uint8_t* p, size_t n, uint64_t seed, uint64_t off = 0) {
  uint64_t word = 0, have = ~uint64_t{0};
  for (size_t i = 0; i < n; ++i) {
    const uint64_t o = off + i;
    if ((o >> 3) != have) {
      have = o >> 3;
      word = mix(seed ^ have);
    }
    if (p[i] != static_cast<uint8_t>(word >> ((o & 7) * 8))) return static_cast<long>(i);
  }
  return -1;
}
// A size for message n: mostly small and odd, some page-sized, some large.
uint32_t size_of(uint64_t session, uint32_t tag, uint64_t n, uint32_t max) {
  const uint64_t r = mix(session ^ (uint64_t{tag} << 48) ^ (n * 0x51ed27u));
  uint32_t s;
  switch (r % 8) {
    case 0: s = 1 + static_cast<uint32_t>((r >> 8) % 64); break;
    case 1: s = 4095 + static_cast<uint32_t>((r >> 8) % 3); break;
    case 2: s = max; break;
    default: s = 1 + static_cast<uint32_t>((r >> 8) % max); break;
  }
  return std::min(s, max);
}

// --- options, counters, failures -----------------------------------------------------------------

struct Options {
  std::string kind, dev, host;
  bool server = false;
  int port = 0;
  long until = 0;  // client: unix time after which it finishes
};
Options opt;

struct Totals {
  uint64_t bytes_write = 0, bytes_read = 0, bytes_send = 0, bytes_srq = 0, bytes_ud = 0;
  uint64_t msgs = 0, sessions = 0, sessions_lost = 0, ud_lost = 0, failures = 0;
  uint64_t credits_waited = 0;  // credits that found their send queue full (see Credits)
} tot;

#define FAILED(...)                                                   \
  do {                                                                \
    std::fprintf(stderr, "FAIL soak_traffic %s %s: ", opt.kind.c_str(), \
                 opt.server ? "server" : "client");                   \
    std::fprintf(stderr, __VA_ARGS__);                                \
    std::fputc('\n', stderr);                                         \
    ++tot.failures;                                                   \
  } while (0)

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "soak_traffic %s: %s: %s\n", opt.kind.c_str(), what,
               errno ? std::strerror(errno) : "failed");
  std::exit(2);
}

void print_totals(const char* label) {
  std::printf("%s {\"kind\": \"%s\", \"role\": \"%s\", \"pid\": %d, \"bytes_write\": %" PRIu64
              ", \"bytes_read\": %" PRIu64 ", \"bytes_send\": %" PRIu64 ", \"bytes_srq\": %" PRIu64
              ", \"bytes_ud\": %" PRIu64 ", \"msgs\": %" PRIu64 ", \"sessions\": %" PRIu64
              ", \"sessions_lost\": %" PRIu64 ", \"ud_lost\": %" PRIu64
              ", \"credits_waited\": %" PRIu64 ", \"failures\": %" PRIu64 "}\n",
              label, opt.kind.c_str(), opt.server ? "server" : "client", getpid(),
              tot.bytes_write, tot.bytes_read, tot.bytes_send, tot.bytes_srq, tot.bytes_ud,
              tot.msgs, tot.sessions, tot.sessions_lost, tot.ud_lost, tot.credits_waited,
              tot.failures);
  std::fflush(stdout);
}

Clock::time_point last_progress = Clock::now();
void maybe_progress() {
  if (Clock::now() - last_progress < std::chrono::seconds(2)) return;
  last_progress = Clock::now();
  print_totals("progress");
}

// --- TCP: the session's control channel ------------------------------------------------------

enum MsgType : uint32_t { kFin = 1, kFinAck = 2, kErrQuery = 3, kErrAnswer = 4 };
struct Msg {
  uint32_t type = 0, pad = 0;
  uint64_t a = 0;
};

bool write_full(int fd, const void* p, size_t n) {
  auto* b = static_cast<const uint8_t*>(p);
  while (n) {
    const ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    b += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}
bool read_full(int fd, void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  while (n) {
    const ssize_t r = read(fd, b, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// 1: a message was read into *m; 0: nothing yet; -1: the peer is gone.
int poll_msg(int fd, Msg* m) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return 0;
  return read_full(fd, m, sizeof(*m)) ? 1 : -1;
}

int listen_on(int port) {
  const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)) || listen(ls, 4)) die("listen");
  return ls;
}

// Connects, retrying while the server is not (yet, or again) up; -1 after `until` + 120 s.
int connect_to(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res)) die("resolve");
  for (;;) {
    const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(s, res->ai_addr, res->ai_addrlen) == 0) {
      freeaddrinfo(res);
      const int one = 1;
      setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return s;
    }
    close(s);
    if (time(nullptr) > opt.until + 120) {
      freeaddrinfo(res);
      return -1;
    }
    usleep(100000);
  }
}

// --- verbs resources of one session ------------------------------------------------------------

struct Hello {
  uint64_t magic = 0x534f414b54524146ull;  // "SOAKTRAF"
  uint64_t session = 0;                     // the client's: seeds every pattern
  uint32_t kind = 0, nqp = 0;
  uint32_t qpn[4] = {};
  uint8_t gid[16] = {};
  uint32_t rkey = 0, mtu = 0;
  uint64_t addr = 0;
};
constexpr int kMaxQps = 4;

struct Session {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_srq* srq = nullptr;
  ibv_mr* mr = nullptr;
  ibv_ah* ah = nullptr;
  ibv_qp* qp[kMaxQps] = {};
  int nqp = 0;
  std::vector<uint8_t> mem;
  uint8_t* buf = nullptr;
  ibv_gid gid{};
  ibv_port_attr port{};
  ~Session() {
    for (auto* q : qp)
      if (q) ibv_destroy_qp(q);
    if (ah) ibv_destroy_ah(ah);
    if (srq) ibv_destroy_srq(srq);
    if (mr) ibv_dereg_mr(mr);
    if (cq) ibv_destroy_cq(cq);
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
  }
};

void open_session(Session& s, size_t bytes) {
  s.ctx = metaroce::test::open_device_named(opt.dev);
  if (ibv_query_gid(s.ctx, 1, 0, &s.gid) || ibv_query_port(s.ctx, 1, &s.port)) die("query");
  s.pd = ibv_alloc_pd(s.ctx);
  s.cq = ibv_create_cq(s.ctx, 1024, nullptr, nullptr, 0);
  if (!s.pd || !s.cq) die("pd/cq");
  s.mem.assign(bytes + 4096, 0);
  s.buf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(s.mem.data()) + 4095) & ~4095ul);
  s.mr = ibv_reg_mr(s.pd, s.buf, bytes,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!s.mr) die("ibv_reg_mr");
}

ibv_qp* make_qp(Session& s, ibv_qp_type type, int send_wr, int recv_wr) {
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = s.cq;
  a.srq = s.srq;
  a.qp_type = type;
  a.cap.max_send_wr = static_cast<uint32_t>(send_wr);
  a.cap.max_recv_wr = s.srq ? 0 : static_cast<uint32_t>(recv_wr);
  a.cap.max_send_sge = 3;
  a.cap.max_recv_sge = 3;
  ibv_qp* qp = ibv_create_qp(s.pd, &a);
  if (!qp) die("ibv_create_qp");
  return qp;
}

// RC to the peer's QP through test_support.h's sequence: 4 READs in flight each way (the client
// keeps up to 8 iterations, each with a READ, outstanding); timeout 67 ms, the transport's own
// retries ride out flaps (congestion.md §4).
void rc_connect(ibv_qp* qp, uint32_t dest_qpn, const uint8_t* gid) {
  metaroce::test::modify_to_init(qp, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  metaroce::test::RcPeer peer{dest_qpn, gid, IBV_MTU_4096};
  peer.rd_atomic = 4;
  metaroce::test::modify_to_rts(qp, peer);
}

constexpr uint32_t kQkey = 0x11111111;
void ud_ready(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qkey = kQkey;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
    die("modify UD INIT");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE)) die("modify UD RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN)) die("modify UD RTS");
}

ibv_ah* make_ah(Session& s, const uint8_t* gid) {
  ibv_ah_attr a{};
  a.is_global = 1;
  std::memcpy(a.grh.dgid.raw, gid, 16);
  a.grh.hop_limit = 1;
  a.port_num = 1;
  ibv_ah* ah = ibv_create_ah(s.pd, &a);
  if (!ah) die("ibv_create_ah");
  return ah;
}

void post_send(ibv_qp* qp, ibv_wr_opcode op, uint64_t wr_id, ibv_sge* sge, int nsge,
               uint64_t raddr = 0, uint32_t rkey = 0, uint32_t imm = 0, ibv_ah* ah = nullptr,
               uint32_t remote_qpn = 0) {
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = nsge ? sge : nullptr;
  wr.num_sge = nsge;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(imm);
  if (ah) {
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = remote_qpn;
    wr.wr.ud.remote_qkey = kQkey;
  } else {
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
  }
  if (const int rc = ibv_post_send(qp, &wr, &bad)) {
    errno = rc;
    die("ibv_post_send");
  }
}

void post_recv(Session& s, ibv_qp* qp, uint64_t wr_id, uint8_t* p, uint32_t len) {
  ibv_sge sge{reinterpret_cast<uint64_t>(p), len, s.mr->lkey};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = len ? &sge : nullptr;
  wr.num_sge = len ? 1 : 0;
  if (s.srq) {
    if (ibv_post_srq_recv(s.srq, &wr, &bad)) die("ibv_post_srq_recv");
  } else if (ibv_post_recv(qp, &wr, &bad)) {
    die("ibv_post_recv");
  }
}

ibv_sge sge_of(Session& s, uint8_t* p, uint32_t len) {
  return ibv_sge{reinterpret_cast<uint64_t>(p), len, s.mr->lkey};
}

// A server's credits (zero-length SEND_WITH_IMM), never more on a QP than its send queue holds.
// A send completes when the peer's acknowledgement arrives, which a flap can hold back while the
// peer's own data keeps coming in (an early version posted regardless, and one 60-second soak
// ended in a failed ibv_post_send), so a credit waits here for room.
constexpr int kSendQueue = 64;
struct Credits {
  std::deque<uint32_t> waiting[kMaxQps];
  int out[kMaxQps] = {};
  void send(Session& s, int q, uint32_t imm) {
    if (out[q] >= kSendQueue) ++tot.credits_waited;
    waiting[q].push_back(imm);
    flush(s, q);
  }
  // A send completion on QP q.
  void completed(Session& s, int q) {
    --out[q];
    flush(s, q);
  }
  void flush(Session& s, int q) {
    for (; !waiting[q].empty() && out[q] < kSendQueue; ++out[q], waiting[q].pop_front())
      post_send(s.qp[q], IBV_WR_SEND_WITH_IMM, 1000 + static_cast<uint64_t>(q), nullptr, 0, 0,
                0, waiting[q].front());
  }
};

// --- one session's event loop -------------------------------------------------------------------

// Why a session ended.
enum class End { kFinished, kPeerGone, kError };

// A completion in error: the peer's death explains it (its TCP connection closes, as the kernel
// does for a killed process), anything else is a failure. Asks the peer; any message from it
// (its answer, its own question, a FIN sent meanwhile) means it lives.
End completion_error(int sock, const ibv_wc& wc, const char* what) {
  Msg m;
  m.type = kErrQuery;
  if (write_full(sock, &m, sizeof(m)) && read_full(sock, &m, sizeof(m))) {
    FAILED("%s completed with %s (vendor_err %u, wr_id %" PRIu64 ") while the peer lives", what,
           ibv_wc_status_str(wc.status), wc.vendor_err, wc.wr_id);
    return End::kError;
  }
  return End::kPeerGone;
}

// The control channel between completions: the peer's FIN, its error query, or its death.
// Returns true when the session must end (*end says how).
bool control(int sock, End* end) {
  Msg m;
  const int r = poll_msg(sock, &m);
  if (r == 0) return false;
  if (r < 0) {
    *end = End::kPeerGone;
    return true;
  }
  if (m.type == kErrQuery) {
    Msg a;
    a.type = kErrAnswer;
    write_full(sock, &a, sizeof(a));
    *end = End::kError;  // the peer counts the failure; this side starts over
    return true;
  }
  if (m.type == kFin && opt.server) {
    Msg a;
    a.type = kFinAck;
    write_full(sock, &a, sizeof(a));
    *end = End::kFinished;
    return true;
  }
  FAILED("unexpected control message %u", m.type);
  *end = End::kError;
  return true;
}

void idle_pause() {
  timespec t{0, 100'000};
  nanosleep(&t, nullptr);
}

bool past_until() { return !opt.server && time(nullptr) >= opt.until; }

// The client's FIN, once its traffic has drained; the server's FINACK ends the session. A
// server that meanwhile asks about an error completion gets its answer (it counts the failure).
End finish(int sock) {
  Msg m;
  m.type = kFin;
  if (!write_full(sock, &m, sizeof(m))) return End::kPeerGone;
  while (read_full(sock, &m, sizeof(m))) {
    if (m.type == kFinAck) return End::kFinished;
    if (m.type == kErrQuery) {
      m.type = kErrAnswer;
      write_full(sock, &m, sizeof(m));
      return End::kError;
    }
  }
  return End::kPeerGone;
}

// -- rc ------------------------------------------------------------------------------------------
constexpr int kSlots = 8;
constexpr uint32_t kMaxWrite = 256 << 10, kMaxRead = 256 << 10, kMaxSend = 64 << 10;
constexpr uint32_t kReadRegion = 1 << 20;
enum Tag : uint32_t { kTagWrite = 1, kTagSend = 2, kTagRead = 3, kTagSrq = 4, kTagUd = 5 };

// Client layout: per slot, WRITE source, SEND source, READ target. Server: per slot, WRITE
// target and SEND target; then the READ region.
constexpr size_t kRcSlotBytes = kMaxWrite + kMaxSend + kMaxRead;
constexpr size_t kRcBytes = kSlots * kRcSlotBytes + kReadRegion;

// What a side sets up before it tells the peer it is ready: the READ region and the receives.
void rc_prepare(Session& s, uint64_t session) {
  if (opt.server) {
    fill(s.buf + kSlots * kRcSlotBytes, kReadRegion, seed_of(session, kTagRead, 0));
    for (int k = 0; k < kSlots; ++k)
      post_recv(s, s.qp[0], k, s.buf + k * kRcSlotBytes + kMaxWrite, kMaxSend);
  } else {
    for (int k = 0; k < kSlots * 2; ++k) post_recv(s, s.qp[0], 100 + k, nullptr, 0);
  }
}

End rc_server(Session& s, int sock, const Hello& peer) {
  auto wtarget = [&](int k) { return s.buf + k * kRcSlotBytes; };
  auto starget = [&](int k) { return s.buf + k * kRcSlotBytes + kMaxWrite; };
  uint64_t next = 0;
  Credits credits;
  End end;
  for (;;) {
    ibv_wc wc[16];
    const int n = ibv_poll_cq(s.cq, 16, wc);
    if (n < 0) die("ibv_poll_cq");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return completion_error(sock, wc[i], "rc server WR");
      if (wc[i].opcode != IBV_WC_RECV) {  // a credit SEND
        credits.completed(s, 0);
        continue;
      }
      const uint64_t it = ntohl(wc[i].imm_data);
      const int k = static_cast<int>(wc[i].wr_id);
      const uint32_t lw = size_of(peer.session, kTagWrite, it, kMaxWrite);
      const uint32_t ls = size_of(peer.session, kTagSend, it, kMaxSend);
      if (!(wc[i].wc_flags & IBV_WC_WITH_IMM) || it != (next & 0xffffffffu) ||
          k != static_cast<int>(next % kSlots)) {
        FAILED("rc: expected iteration %" PRIu64 " in receive %d, got %" PRIu64 " in %d",
               next, static_cast<int>(next % kSlots), it, k);
        return End::kError;
      }
      long bad;
      if (wc[i].byte_len != ls)
        FAILED("rc: iteration %" PRIu64 ": SEND of %u bytes arrived as %u", next, ls,
               wc[i].byte_len);
      else if ((bad = check(starget(k), ls, seed_of(peer.session, kTagSend, next))) >= 0)
        FAILED("rc: iteration %" PRIu64 ": SEND byte %ld of %u wrong", next, bad, ls);
      else
        tot.bytes_send += ls;
      if ((bad = check(wtarget(k), lw, seed_of(peer.session, kTagWrite, next))) >= 0)
        FAILED("rc: iteration %" PRIu64 ": WRITE byte %ld of %u wrong (checked at the SEND "
               "that follows it)", next, bad, lw);
      else
        tot.bytes_write += lw;
      ++tot.msgs;
      post_recv(s, s.qp[0], k, starget(k), kMaxSend);
      credits.send(s, 0, static_cast<uint32_t>(next));
      ++next;
    }
    if (control(sock, &end)) return end;
    maybe_progress();
    if (n == 0) idle_pause();
  }
}

End rc_client(Session& s, int sock, const Hello& peer, uint64_t session) {
  auto wsrc = [&](int k) { return s.buf + k * kRcSlotBytes; };
  auto ssrc = [&](int k) { return s.buf + k * kRcSlotBytes + kMaxWrite; };
  auto rdst = [&](int k) { return s.buf + k * kRcSlotBytes + kMaxWrite + kMaxSend; };
  // Per slot: the iteration in it and what it still waits for (3 send completions + credit).
  uint64_t slot_it[kSlots] = {};
  int slot_wait[kSlots] = {};
  uint64_t next = 0, credits = 0;
  int busy = 0;
  End end;
  for (;;) {
    const bool stopping = past_until();
    while (!stopping && busy < kSlots && slot_wait[next % kSlots] == 0) {
      const int k = static_cast<int>(next % kSlots);
      const uint32_t lw = size_of(session, kTagWrite, next, kMaxWrite);
      const uint32_t ls = size_of(session, kTagSend, next, kMaxSend);
      const uint32_t lr = size_of(session, kTagRead, next, kMaxRead);
      const uint32_t roff = static_cast<uint32_t>(mix(session ^ next) % (kReadRegion - lr + 1));
      fill(wsrc(k), lw, seed_of(session, kTagWrite, next));
      fill(ssrc(k), ls, seed_of(session, kTagSend, next));
      std::memset(rdst(k), 0, lr);
      ibv_sge w = sge_of(s, wsrc(k), lw);
      post_send(s.qp[0], IBV_WR_RDMA_WRITE, k * 4 + 0, &w, 1, peer.addr + k * kRcSlotBytes,
                peer.rkey);
      ibv_sge r = sge_of(s, rdst(k), lr);
      post_send(s.qp[0], IBV_WR_RDMA_READ, k * 4 + 1, &r, 1,
                peer.addr + kSlots * kRcSlotBytes + roff, peer.rkey);
      // Up to three SGEs over the SEND's bytes (no empty ones: a short message has fewer).
      ibv_sge three[3];
      int nsge = 0;
      for (uint32_t part = 0, at = 0; part < 3; ++part) {
        const uint32_t end = part == 2 ? ls : (part + 1) * (ls / 3);
        if (end > at) three[nsge++] = sge_of(s, ssrc(k) + at, end - at);
        at = end;
      }
      post_send(s.qp[0], IBV_WR_SEND_WITH_IMM, k * 4 + 2, three, nsge, 0, 0,
                static_cast<uint32_t>(next));
      slot_it[k] = next;
      slot_wait[k] = 4;
      ++busy;
      ++next;
    }
    if (stopping && busy == 0) return finish(sock);
    ibv_wc wc[16];
    const int n = ibv_poll_cq(s.cq, 16, wc);
    if (n < 0) die("ibv_poll_cq");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return completion_error(sock, wc[i], "rc client WR");
      int k;
      if (wc[i].opcode == IBV_WC_RECV) {  // a credit: the server checked iteration imm
        const uint64_t it = ntohl(wc[i].imm_data);
        k = static_cast<int>(credits % kSlots);
        if (it != (credits & 0xffffffffu) || slot_it[k] != credits)
          FAILED("rc: credit for iteration %" PRIu64 " where %" PRIu64 " was due", it, credits);
        ++credits;
        post_recv(s, s.qp[0], wc[i].wr_id, nullptr, 0);
      } else {
        k = static_cast<int>(wc[i].wr_id / 4);
        if (wc[i].wr_id % 4 == 1) {
          const uint64_t it = slot_it[k];
          const uint32_t lr = size_of(session, kTagRead, it, kMaxRead);
          const uint32_t roff = static_cast<uint32_t>(mix(session ^ it) % (kReadRegion - lr + 1));
          const long bad = check(rdst(k), lr, seed_of(session, kTagRead, 0), roff);
          if (bad >= 0)
            FAILED("rc: iteration %" PRIu64 ": READ byte %ld of %u (offset %u) wrong", it, bad,
                   lr, roff);
          else
            tot.bytes_read += lr;
        }
      }
      if (--slot_wait[k] == 0) --busy;
    }
    if (control(sock, &end)) return end;
    maybe_progress();
    if (n == 0) idle_pause();
  }
}

// -- srq -----------------------------------------------------------------------------------------
constexpr int kSrqQps = 4, kSrqWindow = 4, kSrqBuffers = 32;
constexpr uint32_t kMaxSrqSend = 16 << 10;
constexpr size_t kSrqBytes = size_t{kSrqBuffers} * kMaxSrqSend;

void srq_prepare(Session& s) {
  if (opt.server) {
    for (int b = 0; b < kSrqBuffers; ++b)
      post_recv(s, nullptr, b, s.buf + b * kMaxSrqSend, kMaxSrqSend);
  } else {
    for (int q = 0; q < kSrqQps; ++q)
      for (int k = 0; k < 2 * kSrqWindow; ++k) post_recv(s, s.qp[q], 100, nullptr, 0);
  }
}

End srq_server(Session& s, int sock, const Hello& peer) {
  uint64_t next[kSrqQps] = {};
  Credits credits;
  End end;
  for (;;) {
    ibv_wc wc[16];
    const int n = ibv_poll_cq(s.cq, 16, wc);
    if (n < 0) die("ibv_poll_cq");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return completion_error(sock, wc[i], "srq server WR");
      int q = -1;
      for (int j = 0; j < kSrqQps; ++j)
        if (s.qp[j]->qp_num == wc[i].qp_num) q = j;
      if (wc[i].opcode != IBV_WC_RECV) {  // a credit SEND
        if (q >= 0) credits.completed(s, q);
        continue;
      }
      const uint32_t imm = ntohl(wc[i].imm_data);
      const int b = static_cast<int>(wc[i].wr_id);
      if (q < 0 || static_cast<int>(imm >> 24) != q || (imm & 0xffffff) != (next[q] & 0xffffff)) {
        FAILED("srq: receive on QP %u (index %d) carries QP %u sequence %u, expected %" PRIu64,
               wc[i].qp_num, q, imm >> 24, imm & 0xffffff, q < 0 ? 0 : next[q]);
        return End::kError;
      }
      const uint64_t n_msg = (uint64_t{static_cast<uint32_t>(q)} << 40) | next[q];
      const uint32_t len = size_of(peer.session, kTagSrq, n_msg, kMaxSrqSend);
      long bad;
      if (wc[i].byte_len != len)
        FAILED("srq: QP %d message %" PRIu64 ": %u bytes arrived as %u", q, next[q], len,
               wc[i].byte_len);
      else if ((bad = check(s.buf + b * kMaxSrqSend, len,
                            seed_of(peer.session, kTagSrq, n_msg))) >= 0)
        FAILED("srq: QP %d message %" PRIu64 " byte %ld of %u wrong", q, next[q], bad, len);
      else
        tot.bytes_srq += len;
      ++tot.msgs;
      post_recv(s, nullptr, b, s.buf + b * kMaxSrqSend, kMaxSrqSend);
      credits.send(s, q, static_cast<uint32_t>(next[q]));
      ++next[q];
    }
    if (control(sock, &end)) return end;
    maybe_progress();
    if (n == 0) idle_pause();
  }
}

End srq_client(Session& s, int sock, uint64_t session) {
  auto src = [&](int q, int k) { return s.buf + (q * kSrqWindow + k) * kMaxSrqSend; };
  // A credit may come back before the SEND it answers completes (its acknowledgement held up
  // on a path that failed), so the send queue's room is counted apart from the window.
  uint64_t next[kSrqQps] = {}, credit[kSrqQps] = {};
  int sq_out[kSrqQps] = {};
  End end;
  for (;;) {
    const bool stopping = past_until();
    int outstanding = 0;
    for (int q = 0; q < kSrqQps; ++q) {
      while (!stopping && next[q] - credit[q] < kSrqWindow && sq_out[q] < kSendQueue) {
        const int k = static_cast<int>(next[q] % kSrqWindow);
        const uint64_t n_msg = (uint64_t{static_cast<uint32_t>(q)} << 40) | next[q];
        const uint32_t len = size_of(session, kTagSrq, n_msg, kMaxSrqSend);
        fill(src(q, k), len, seed_of(session, kTagSrq, n_msg));
        ibv_sge sge = sge_of(s, src(q, k), len);
        post_send(s.qp[q], IBV_WR_SEND_WITH_IMM, q, &sge, 1, 0, 0,
                  (static_cast<uint32_t>(q) << 24) | (next[q] & 0xffffff));
        ++next[q];
        ++sq_out[q];
      }
      outstanding += sq_out[q] + static_cast<int>(next[q] - credit[q]);
    }
    if (stopping && outstanding == 0) return finish(sock);
    ibv_wc wc[16];
    const int n = ibv_poll_cq(s.cq, 16, wc);
    if (n < 0) die("ibv_poll_cq");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return completion_error(sock, wc[i], "srq client WR");
      int q = -1;
      for (int j = 0; j < kSrqQps; ++j)
        if (s.qp[j]->qp_num == wc[i].qp_num) q = j;
      if (q < 0) {
        FAILED("srq: a completion of QP %u, not one of this session's", wc[i].qp_num);
        continue;
      }
      if (wc[i].opcode == IBV_WC_RECV) {
        if (ntohl(wc[i].imm_data) != (credit[q] & 0xffffffffu))
          FAILED("srq: credit %u on QP index %d where %" PRIu64 " was due",
                 ntohl(wc[i].imm_data), q, credit[q]);
        ++credit[q];
        post_recv(s, s.qp[q], 100, nullptr, 0);
      } else {
        --sq_out[q];
      }
    }
    if (control(sock, &end)) return end;
    maybe_progress();
    if (n == 0) idle_pause();
  }
}

// -- ud ------------------------------------------------------------------------------------------
constexpr int kUdWindow = 16, kUdRecvs = 64;
constexpr uint32_t kGrh = 40;
struct UdHeader {
  uint64_t session;
  uint64_t seq;
  uint32_t len;  // payload bytes after the header
  uint32_t pad;
};

uint32_t ud_payload_max(const Session& s) {
  const uint32_t mtu = 128u << std::min<int>(s.port.active_mtu, IBV_MTU_4096);
  return mtu - sizeof(UdHeader);
}

// Checks one datagram (header and payload) at p of `bytes` bytes; its seq in *seq.
bool ud_check(const uint8_t* p, uint32_t bytes, uint64_t session, uint32_t max, uint64_t* seq,
              const char* where) {
  UdHeader h;
  if (bytes < sizeof(h)) {
    FAILED("ud %s: %u bytes, shorter than a header", where, bytes);
    return false;
  }
  std::memcpy(&h, p, sizeof(h));
  *seq = h.seq;
  if (h.session != session) {
    FAILED("ud %s: datagram of session %" PRIx64 " in session %" PRIx64, where, h.session, session);
    return false;
  }
  const uint32_t len = size_of(session, kTagUd, h.seq, max);
  long bad;
  if (h.len != len || bytes != sizeof(h) + len) {
    FAILED("ud %s: datagram %" PRIu64 ": %u payload bytes expected, header says %u, %u arrived",
           where, h.seq, len, h.len, bytes);
    return false;
  }
  if ((bad = check(p + sizeof(h), len, seed_of(session, kTagUd, h.seq))) >= 0) {
    FAILED("ud %s: datagram %" PRIu64 " byte %ld of %u wrong", where, h.seq, bad, len);
    return false;
  }
  return true;
}

void ud_prepare(Session& s, const Hello& peer) {
  const uint32_t slot = kGrh + sizeof(UdHeader) + ud_payload_max(s);
  for (int b = 0; b < kUdRecvs; ++b) post_recv(s, s.qp[0], b, s.buf + b * slot, slot);
  s.ah = make_ah(s, peer.gid);
}

End ud_server(Session& s, int sock, const Hello& peer) {
  const uint32_t max = ud_payload_max(s), slot = kGrh + sizeof(UdHeader) + max;
  uint8_t* const echo = s.buf + kUdRecvs * slot;  // echo buffers after the receive buffers
  std::vector<bool> seen;
  int echo_next = 0, echo_out = 0;
  std::deque<int> pending;  // receive buffers whose echo waits for a free echo buffer
  End end;
  for (;;) {
    ibv_wc wc[16];
    const int n = ibv_poll_cq(s.cq, 16, wc);
    if (n < 0) die("ibv_poll_cq");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return completion_error(sock, wc[i], "ud server WR");
      if (wc[i].opcode != IBV_WC_RECV) {
        --echo_out;
        continue;
      }
      const int b = static_cast<int>(wc[i].wr_id);
      uint64_t seq = 0;
      if (!(wc[i].wc_flags & IBV_WC_GRH) || wc[i].src_qp != peer.qpn[0])
        FAILED("ud: datagram from QP %u without GRH flag %d", wc[i].src_qp,
               !!(wc[i].wc_flags & IBV_WC_GRH));
      if (wc[i].byte_len >= kGrh &&
          ud_check(s.buf + b * slot + kGrh, wc[i].byte_len - kGrh, peer.session, max, &seq,
                   "server")) {
        if (seq >= seen.size()) seen.resize(seq + 1024, false);
        if (seen[seq]) {
          FAILED("ud: datagram %" PRIu64 " delivered twice", seq);
        } else {
          seen[seq] = true;
          tot.bytes_ud += wc[i].byte_len - kGrh - sizeof(UdHeader);
          ++tot.msgs;
          pending.push_back(b);
          continue;
        }
      }
      post_recv(s, s.qp[0], b, s.buf + b * slot, slot);
    }
    // Echo what was received, from a copy, so the receive buffer goes back at once.
    while (!pending.empty() && echo_out < kUdWindow) {
      const int b = pending.front();
      pending.pop_front();
      uint8_t* e = echo + echo_next * (sizeof(UdHeader) + max);
      UdHeader h;
      std::memcpy(&h, s.buf + b * slot + kGrh, sizeof(h));
      const uint32_t bytes = static_cast<uint32_t>(sizeof(h)) + h.len;
      std::memcpy(e, s.buf + b * slot + kGrh, bytes);
      post_recv(s, s.qp[0], b, s.buf + b * slot, slot);
      ibv_sge sge = sge_of(s, e, bytes);
      post_send(s.qp[0], IBV_WR_SEND, 1000, &sge, 1, 0, 0, 0, s.ah, peer.qpn[0]);
      echo_next = (echo_next + 1) % kUdWindow;
      ++echo_out;
    }
    if (control(sock, &end)) return end;
    maybe_progress();
    if (n == 0) idle_pause();
  }
}

End ud_client(Session& s, int sock, const Hello& peer, uint64_t session) {
  const uint32_t max = ud_payload_max(s), slot = kGrh + sizeof(UdHeader) + max;
  uint8_t* const out = s.buf + kUdRecvs * slot;
  struct Out {
    uint64_t seq;
    Clock::time_point sent;
    bool echoed, completed;
  };
  std::deque<Out> window;  // in seq order
  uint64_t next = 0;
  End end;
  for (;;) {
    const bool stopping = past_until();
    // A datagram not echoed for 5 s is lost (UD may lose; this transport should not): counted.
    while (!window.empty() && (window.front().echoed || Clock::now() - window.front().sent >
                                                            std::chrono::seconds(5)) &&
           window.front().completed) {
      if (!window.front().echoed) ++tot.ud_lost;
      window.pop_front();
    }
    while (!stopping && window.size() < kUdWindow) {
      const uint32_t len = size_of(session, kTagUd, next, max);
      uint8_t* p = out + (next % (2 * kUdWindow)) * (sizeof(UdHeader) + max);
      UdHeader h{session, next, len, 0};
      std::memcpy(p, &h, sizeof(h));
      fill(p + sizeof(h), len, seed_of(session, kTagUd, next));
      ibv_sge sge = sge_of(s, p, static_cast<uint32_t>(sizeof(h)) + len);
      post_send(s.qp[0], IBV_WR_SEND, next, &sge, 1, 0, 0, 0, s.ah, peer.qpn[0]);
      window.push_back(Out{next, Clock::now(), false, false});
      ++next;
    }
    if (stopping && window.empty()) return finish(sock);
    ibv_wc wc[16];
    const int n = ibv_poll_cq(s.cq, 16, wc);
    if (n < 0) die("ibv_poll_cq");
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return completion_error(sock, wc[i], "ud client WR");
      if (wc[i].opcode != IBV_WC_RECV) {
        for (auto& o : window)
          if (o.seq == wc[i].wr_id) o.completed = true;
        continue;
      }
      const int b = static_cast<int>(wc[i].wr_id);
      uint64_t seq = 0;
      if (wc[i].byte_len >= kGrh &&
          ud_check(s.buf + b * slot + kGrh, wc[i].byte_len - kGrh, session, max, &seq, "echo")) {
        bool found = false;
        for (auto& o : window)
          if (o.seq == seq) {
            if (o.echoed) FAILED("ud: echo of datagram %" PRIu64 " twice", seq);
            o.echoed = found = true;
          }
        if (found) tot.bytes_ud += wc[i].byte_len - kGrh - sizeof(UdHeader);
      }
      post_recv(s, s.qp[0], b, s.buf + b * slot, slot);
    }
    if (control(sock, &end)) return end;
    maybe_progress();
    if (n == 0) idle_pause();
  }
}

// --- sessions -----------------------------------------------------------------------------------

uint32_t kind_code() { return opt.kind == "rc" ? 1 : opt.kind == "srq" ? 2 : 3; }

size_t session_bytes() {
  if (opt.kind == "rc") return kRcBytes;
  if (opt.kind == "srq") return kSrqBytes;
  return size_t{kUdRecvs + 2 * kUdWindow} * (kGrh + 4096 + sizeof(UdHeader));
}

// One session on a connected socket. Everything it created is destroyed when it returns.
End run_session(int sock) {
  Session s;
  open_session(s, session_bytes());
  const bool srq_side = opt.kind == "srq" && opt.server;
  if (srq_side) {
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = kSrqBuffers;
    sa.attr.max_sge = 1;
    s.srq = ibv_create_srq(s.pd, &sa);
    if (!s.srq) die("ibv_create_srq");
  }
  s.nqp = opt.kind == "srq" ? kSrqQps : 1;
  const ibv_qp_type type = opt.kind == "ud" ? IBV_QPT_UD : IBV_QPT_RC;
  for (int q = 0; q < s.nqp; ++q) s.qp[q] = make_qp(s, type, kSendQueue, kUdRecvs);
  Hello mine, peer;
  mine.kind = kind_code();
  mine.nqp = static_cast<uint32_t>(s.nqp);
  if (!opt.server) {
    uint64_t r = 0;
    const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, &r, sizeof(r)) != sizeof(r)) die("/dev/urandom");
    close(fd);
    mine.session = r | 1;
  }
  for (int q = 0; q < s.nqp; ++q) mine.qpn[q] = s.qp[q]->qp_num;
  std::memcpy(mine.gid, s.gid.raw, 16);
  mine.rkey = s.mr->rkey;
  mine.addr = reinterpret_cast<uint64_t>(s.buf);
  if (!write_full(sock, &mine, sizeof(mine)) || !read_full(sock, &peer, sizeof(peer)))
    return End::kPeerGone;
  if (peer.magic != mine.magic || peer.kind != mine.kind || peer.nqp != mine.nqp) {
    FAILED("the peer is of another kind (%u, %u QPs)", peer.kind, peer.nqp);
    return End::kError;
  }
  const uint64_t session = opt.server ? peer.session : mine.session;
  if (opt.server) peer.session = session;
  for (int q = 0; q < s.nqp; ++q) {
    if (type == IBV_QPT_UD) ud_ready(s.qp[q]);
    else rc_connect(s.qp[q], peer.qpn[q], peer.gid);
  }
  if (opt.kind == "rc") rc_prepare(s, session);
  else if (opt.kind == "srq") srq_prepare(s);
  else ud_prepare(s, peer);
  // Both sides ready before the first message (a SEND to a QP not yet in RTR is refused, and
  // the READ region must hold its pattern).
  char ready = 1;
  if (!write_full(sock, &ready, 1) || !read_full(sock, &ready, 1)) return End::kPeerGone;
  ++tot.sessions;
  if (opt.kind == "rc")
    return opt.server ? rc_server(s, sock, peer) : rc_client(s, sock, peer, session);
  if (opt.kind == "srq")
    return opt.server ? srq_server(s, sock, peer) : srq_client(s, sock, session);
  return opt.server ? ud_server(s, sock, peer) : ud_client(s, sock, peer, session);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "soak_traffic: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--kind") opt.kind = next();
    else if (a == "--dev") opt.dev = next();
    else if (a == "--server") opt.server = true;
    else if (a == "--connect") opt.host = next();
    else if (a == "--port") opt.port = std::atoi(next().c_str());
    else if (a == "--until") opt.until = std::atol(next().c_str());
    else {
      std::fprintf(stderr, "soak_traffic: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if ((opt.kind != "rc" && opt.kind != "srq" && opt.kind != "ud") || opt.dev.empty() ||
      opt.port <= 0 || (!opt.server && (opt.host.empty() || opt.until <= 0))) {
    std::fprintf(stderr,
                 "usage: soak_traffic --kind rc|srq|ud --dev NAME --port P "
                 "(--server | --connect HOST --until UNIX_SECONDS)\n");
    return 2;
  }
  const int ls = opt.server ? listen_on(opt.port) : -1;
  for (;;) {
    const int sock = opt.server ? accept4(ls, nullptr, nullptr, SOCK_CLOEXEC)
                                : connect_to(opt.host, opt.port);
    if (sock < 0) {
      FAILED("no %s", opt.server ? "client" : "server to connect to");
      break;
    }
    const End end = run_session(sock);
    close(sock);
    if (end == End::kFinished) break;
    if (end == End::kPeerGone) ++tot.sessions_lost;
  }
  if (ls >= 0) close(ls);
  print_totals("result");
  return tot.failures ? 1 : 0;
}
