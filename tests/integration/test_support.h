// SPDX-License-Identifier: Apache-2.0
// What the verbs test programs of the integration suite share: a non-fatal CHECK that counts
// failures, a fatal die(), and the TCP exchange two processes use to swap QP numbers and keys
// (as perftest and ibv_rc_pingpong do). Header-only; each program sets kProgram.
#pragma once

#include <arpa/inet.h>
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

// Server: accepts one connection on loopback:port. Client: connects to host:port, retrying for
// 10 s while the server is not up yet.
inline int tcp_open(const char* host, int port, bool server) {
  if (server) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
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

}  // namespace metaroce::test
