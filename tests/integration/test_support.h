// SPDX-License-Identifier: Apache-2.0
// What the verbs test programs of the integration suite share: a non-fatal CHECK that counts
// failures, a fatal die(), opening a device by name, and the TCP exchange two processes use to swap QP numbers and keys
// (as perftest and ibv_rc_pingpong do), and the RC connection sequence. Header-only; each program
// sets kProgram.
#pragma once

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace metaroce::test {

// The program's name in messages; each program defines it.
extern const char* const kProgram;

inline int failures = 0;

// Records a failed expectation with its location and goes on (up to 20, so that a broken run
// does not flood the log; then it exits 1).
#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                        \
      std::fputc('\n', stderr);                                 \
      if (++::metaroce::test::failures > 20) std::exit(1);      \
    }                                                           \
  } while (0)

// A setup step failed: nothing more can be checked (exit status 2, not a test failure).
[[noreturn]] inline void die(const char* what) {
  std::fprintf(stderr, "%s: %s: %s\n", kProgram, what, std::strerror(errno));
  std::exit(2);
}

inline void write_all(int fd, const void* p, size_t n) {
  auto* b = static_cast<const uint8_t*>(p);
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w <= 0) die("tcp write");
    b += w;
    n -= static_cast<size_t>(w);
  }
}

inline void read_all(int fd, void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  while (n) {
    ssize_t r = read(fd, b, n);
    if (r <= 0) die("tcp read");
    b += r;
    n -= static_cast<size_t>(r);
  }
}

// Server: accepts one connection on host:port (loopback when host is empty: tests between
// namespaces name their management address). Client: connects to host:port, retrying for 10 s
// while the server is not up yet.
inline int tcp_open(const char* host, int port, bool server) {
  if (server) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (host && *host && inet_pton(AF_INET, host, &a.sin_addr) != 1) die("listen address");
    if (bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof(a)) || listen(ls, 1)) die("listen");
    int s = accept(ls, nullptr, nullptr);
    close(ls);
    if (s < 0) die("accept");
    return s;
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host, std::to_string(port).c_str(), &hints, &res)) die("resolve");
  for (int tries = 0; tries < 100; ++tries) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, res->ai_addr, res->ai_addrlen) == 0) {
      freeaddrinfo(res);
      return s;
    }
    close(s);
    usleep(100000);
  }
  die("connect");
}

// Opens the device called `name` (fatal when there is none).
inline ibv_context* open_device_named(const std::string& name) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) die("ibv_get_device_list");
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n && !ctx; ++i)
    if (name == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  if (!ctx) die("ibv_open_device");
  return ctx;
}

// What a test program opens a device for first: a PD, a CQ of `cqe` entries, and GID 0.
struct DeviceBasics {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_gid gid{};
};

inline DeviceBasics open_basics(const std::string& name, int cqe) {
  DeviceBasics d;
  d.ctx = open_device_named(name);
  d.pd = ibv_alloc_pd(d.ctx);
  d.cq = ibv_create_cq(d.ctx, cqe, nullptr, nullptr, 0);
  if (!d.pd || !d.cq) die("pd/cq");
  if (ibv_query_gid(d.ctx, 1, 0, &d.gid)) die("ibv_query_gid");
  return d;
}

// RESET -> INIT with the given remote access rights, on port 1.
inline void modify_to_init(ibv_qp* qp, unsigned int access) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = access;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    die("modify INIT");
}

// The far end of an RC QP and the attributes a program chooses for it.
struct RcPeer {
  uint32_t qpn = 0;
  const uint8_t* gid = nullptr;  // 16 bytes
  ibv_mtu mtu = IBV_MTU_1024;
  uint8_t hop_limit = 1;
  uint8_t timeout = 14;          // 4.096 us * 2^timeout
  uint8_t rd_atomic = 1;         // outstanding READs/atomics, each way
  uint8_t min_rnr_timer = 12;    // verbs code: 12 = 0.64 ms, 1 = 0.01 ms
};

// INIT -> RTR -> RTS towards peer (PSNs 0, peer.rd_atomic outstanding READs/atomics each way,
// retries 7).
inline void modify_to_rts(ibv_qp* qp, const RcPeer& peer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = peer.mtu;
  a.dest_qp_num = peer.qpn;
  a.max_dest_rd_atomic = peer.rd_atomic;
  a.min_rnr_timer = peer.min_rnr_timer;
  a.ah_attr.is_global = 1;
  std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
  a.ah_attr.grh.hop_limit = peer.hop_limit;
  a.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    die("modify RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = peer.timeout;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = peer.rd_atomic;
  if (ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    die("modify RTS");
}

}  // namespace metaroce::test
