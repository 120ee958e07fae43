// SPDX-License-Identifier: Apache-2.0
// incast: several senders RDMA-WRITE into ONE receiving device, the many-to-one pattern perftest
// cannot make (its server serves exactly one client). Plain libibverbs, so it runs over any
// device; bench/run puts the receiver behind a rate-limited fabric edge link.
//
//   incast --dev NAME --server --senders N [--port P] [--size BYTES] [--seconds S]
//   incast --dev NAME --connect HOST [--port P] [--size BYTES] [--seconds S] [--depth D]
//
// The server accepts N TCP connections, gives each sender a QP and a region of its memory, and
// starts them all at once; each sender keeps D writes of SIZE bytes in flight for S seconds,
// then prints one JSON line (bytes, Gbit/s) and reports to the server. Exit status 0 only if
// every write completed successfully; every wait is bounded.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMaxSenders = 16;
constexpr int kTcpTimeoutMs = 30000;  // a peer silent this long is gone

struct Options {
  std::string dev;
  std::string host;
  bool server = false;
  int senders = 0;
  int port = 18900;
  uint32_t size = 65536;
  double seconds = 5;
  int depth = 16;
};

// What the two sides exchange over TCP, in host byte order (both ends are on this host).
struct Wire {
  uint32_t qpn;
  uint8_t gid[16];
  uint32_t rkey;
  uint64_t addr;
};

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "incast: %s: %s\n", what, errno ? std::strerror(errno) : "failed");
  std::exit(2);
}

void io_all(int fd, void* p, size_t n, bool write) {
  auto* b = static_cast<uint8_t*>(p);
  while (n) {
    pollfd pf{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    if (::poll(&pf, 1, kTcpTimeoutMs) <= 0) {
      errno = ETIMEDOUT;
      die(write ? "tcp write" : "tcp read");
    }
    const ssize_t r = write ? ::write(fd, b, n) : ::read(fd, b, n);
    if (r <= 0) die(write ? "tcp write" : "tcp read (peer left)");
    b += r;
    n -= static_cast<size_t>(r);
  }
}

int tcp_listen(int port) {
  const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)) || listen(ls, kMaxSenders)) die("listen");
  return ls;
}

int tcp_accept(int ls) {
  pollfd pf{ls, POLLIN, 0};
  if (::poll(&pf, 1, kTcpTimeoutMs) <= 0) {
    errno = ETIMEDOUT;
    die("accept");
  }
  const int s = accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
  if (s < 0) die("accept");
  return s;
}

int tcp_connect(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res)) die("resolve");
  for (int tries = 0; tries < 100; ++tries) {
    const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(s, res->ai_addr, res->ai_addrlen) == 0) {
      freeaddrinfo(res);
      return s;
    }
    close(s);
    usleep(100000);
  }
  die("connect");
}

struct Device {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<uint8_t> buf;
  uint8_t gid[16] = {};

  Device(const std::string& name, size_t bytes, int cqe) : buf(bytes) {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr) die("ibv_get_device_list");
    for (int i = 0; i < n && ctx == nullptr; ++i)
      if (name == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
    ibv_free_device_list(list);
    if (ctx == nullptr) die(("no device " + name).c_str());
    ibv_gid g{};
    if (ibv_query_gid(ctx, 1, 0, &g)) die("ibv_query_gid");
    std::memcpy(gid, g.raw, 16);
    pd = ibv_alloc_pd(ctx);
    cq = pd ? ibv_create_cq(ctx, cqe, nullptr, nullptr, 0) : nullptr;
    mr = cq ? ibv_reg_mr(pd, buf.data(), buf.size(),
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)
            : nullptr;
    if (mr == nullptr) die("pd/cq/mr");
  }
  ~Device() {
    if (mr) ibv_dereg_mr(mr);
    if (cq) ibv_destroy_cq(cq);
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
  }

  ibv_qp* make_qp(int depth) {
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = static_cast<uint32_t>(depth);
    a.cap.max_recv_wr = 1;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    ibv_qp* qp = ibv_create_qp(pd, &a);
    if (qp == nullptr) die("ibv_create_qp");
    return qp;
  }
};

void connect_qp(ibv_qp* qp, const Wire& peer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    die("modify INIT");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer.qpn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
  a.ah_attr.grh.hop_limit = 1;
  a.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    die("modify RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    die("modify RTS");
}

// The receiver: one device, one QP and one region per sender; it never polls (RDMA WRITE
// completes nothing at the responder), it only waits for the senders' reports.
int serve(const Options& o) {
  Device dev(o.dev, size_t{o.size} * static_cast<size_t>(o.senders), 16);
  const int ls = tcp_listen(o.port);
  std::vector<int> socks;
  std::vector<ibv_qp*> qps;
  for (int i = 0; i < o.senders; ++i) {
    const int s = tcp_accept(ls);
    ibv_qp* qp = dev.make_qp(1);
    Wire mine{qp->qp_num, {}, dev.mr->rkey,
              reinterpret_cast<uint64_t>(dev.buf.data()) + uint64_t{o.size} * static_cast<uint64_t>(i)};
    std::memcpy(mine.gid, dev.gid, 16);
    Wire peer{};
    io_all(s, &peer, sizeof(peer), false);
    io_all(s, &mine, sizeof(mine), true);
    connect_qp(qp, peer);
    socks.push_back(s);
    qps.push_back(qp);
  }
  close(ls);
  // Everyone is connected: start them together, so shares are compared over the same time.
  for (int s : socks) {
    uint8_t go = 1;
    io_all(s, &go, 1, true);
  }
  int failed = 0;
  for (int s : socks) {
    int32_t status = 0;
    io_all(s, &status, sizeof(status), false);
    failed += status != 0;
    close(s);
  }
  for (ibv_qp* qp : qps) ibv_destroy_qp(qp);
  std::printf("{\"bench\":\"incast_server\",\"senders\":%d,\"failed\":%d}\n", o.senders, failed);
  return failed ? 1 : 0;
}

int send(const Options& o) {
  Device dev(o.dev, o.size, o.depth * 2);
  ibv_qp* qp = dev.make_qp(o.depth);
  Wire mine{qp->qp_num, {}, dev.mr->rkey, reinterpret_cast<uint64_t>(dev.buf.data())};
  std::memcpy(mine.gid, dev.gid, 16);
  const int s = tcp_connect(o.host, o.port);
  Wire peer{};
  io_all(s, &mine, sizeof(mine), true);
  io_all(s, &peer, sizeof(peer), false);
  connect_qp(qp, peer);
  uint8_t go = 0;
  io_all(s, &go, 1, false);

  ibv_sge sge{reinterpret_cast<uint64_t>(dev.buf.data()), o.size, dev.mr->lkey};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = peer.addr;
  wr.wr.rdma.rkey = peer.rkey;
  const auto start = Clock::now();
  const auto window = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(o.seconds));
  const auto give_up = start + window + std::chrono::seconds(30);  // outstanding writes drain
  int outstanding = 0;
  uint64_t done = 0;
  int32_t status = 0;
  ibv_wc wc[16];
  for (;;) {
    const auto now = Clock::now();
    const bool sending = now - start < window;
    if (!sending && outstanding == 0) break;
    if (now > give_up) {
      std::fprintf(stderr, "incast: %d writes never completed\n", outstanding);
      status = 1;
      break;
    }
    while (sending && outstanding < o.depth) {
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(qp, &wr, &bad)) die("ibv_post_send");
      ++outstanding;
    }
    const int n = ibv_poll_cq(dev.cq, 16, wc);
    if (n < 0) die("ibv_poll_cq");
    for (int i = 0; i < n; ++i) {
      --outstanding;
      if (wc[i].status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "incast: write failed: %s\n", ibv_wc_status_str(wc[i].status));
        status = 1;
      } else {
        ++done;
      }
    }
    if (status != 0) break;
    // Two-core hosts: leave the CPU to the progress threads when nothing completed.
    if (n == 0) sched_yield();
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  io_all(s, &status, sizeof(status), true);
  close(s);
  ibv_destroy_qp(qp);
  std::printf("{\"bench\":\"incast_sender\",\"bytes\":%" PRIu64 ",\"seconds\":%.3f,\"gbps\":%.4f}\n",
              done * o.size, elapsed, static_cast<double>(done * o.size) * 8 / elapsed / 1e9);
  return status;
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "incast: %s\nusage: incast --dev NAME --server --senders N [--port P] [--size B] "
               "[--seconds S]\n       incast --dev NAME --connect HOST [--port P] [--size B] "
               "[--seconds S] [--depth D]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value of " + a).c_str());
      return argv[++i];
    };
    if (a == "--dev") o.dev = val();
    else if (a == "--server") o.server = true;
    else if (a == "--connect") o.host = val();
    else if (a == "--senders") o.senders = std::atoi(val().c_str());
    else if (a == "--port") o.port = std::atoi(val().c_str());
    else if (a == "--size") o.size = static_cast<uint32_t>(std::strtoul(val().c_str(), nullptr, 10));
    else if (a == "--seconds") o.seconds = std::strtod(val().c_str(), nullptr);
    else if (a == "--depth") o.depth = std::atoi(val().c_str());
    else usage(("unknown option " + a).c_str());
  }
  if (o.dev.empty()) usage("--dev is required");
  if (o.server == !o.host.empty()) usage("give exactly one of --server, --connect HOST");
  if (o.server && (o.senders < 1 || o.senders > kMaxSenders)) usage("--senders must be 1..16");
  if (o.port < 1 || o.port > 65535) usage("bad --port");
  if (o.size < 1 || o.size > (1u << 30)) usage("--size must be 1..2^30");
  if (!(o.seconds > 0 && o.seconds <= 600)) usage("--seconds must be in (0, 600]");
  if (o.depth < 1 || o.depth > 1024) usage("--depth must be 1..1024");
  return o.server ? serve(o) : send(o);
}
