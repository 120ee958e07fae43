// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the engine's control protocol (datapath/hostif/control.h, served by
// datapath/engine): a HostEngine in this process, with two links joined by an in-memory wire,
// is sent what the input describes on one connection: a sequence of requests of any operation
// (administration that stops the engine or its links excepted), with bodies of any bytes and
// length, descriptors or not, after a proper hello or not. Each request gets its answer or the
// connection is dropped. Checked besides "no crash, no sanitizer report": the answer echoes the
// request; once the connection is closed the engine reclaims its session (no context of it is
// left) and serves a new one (hello, a protection domain, a completion queue).
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "datapath/engine/host_engine.h"
#include "datapath/hostif/control.h"
#include "datapath/hostif/queues.h"
#include "datapath/io/dpdk_port.h"
#include "datapath/io/mem_link.h"
#include "datapath/nic/link_config.h"

// The target is built without DPDK (its ports are in memory): the engine's default opener,
// never called here, has nothing to open.
namespace metaroce::io {
std::unique_ptr<Port> open_dpdk_port(const DpdkPortConfig&, std::string* why) {
  *why = "no DPDK in the fuzz target";
  return nullptr;
}
}  // namespace metaroce::io

namespace metaroce::engine {
namespace {

using hostif::Message;
using hostif::Op;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "control_fuzz: %s\n", what);
  std::abort();
}

// The operations a context may send, and the read-only administration ones.
constexpr Op kOps[] = {
    Op::kHello,        Op::kAllocPd,      Op::kDeallocPd,   Op::kRegMr,        Op::kDeregMr,
    Op::kCreateCq,     Op::kDestroyCq,    Op::kCreateSrq,   Op::kDestroySrq,   Op::kCreateQp,
    Op::kModifyQp,     Op::kDestroyQp,    Op::kModifySrq,   Op::kSetQpPaths,   Op::kQueryQpConn,
    Op::kQueryPaths,   Op::kRepath,       Op::kQueryDevice, Op::kReregMr,      Op::kCheckMr,
    Op::kAllocMw,      Op::kDeallocMw,    Op::kResizeCq,    Op::kOpenXrcd,     Op::kCloseXrcd,
    Op::kCreateXrcSrq, Op::kOpenQp,       Op::kCreateFlow,  Op::kDestroyFlow,  Op::kCreateIndTable,
    Op::kDestroyIndTable, Op::kCreateRssQp, Op::kCreateTmSrq, Op::kSrqTagOp,   Op::kEngineInfo,
    Op::kSessionInfo,
};
constexpr size_t kNumOps = sizeof(kOps) / sizeof(kOps[0]);

class Conn {
 public:
  explicit Conn(const std::string& path) {
    sock_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock_ < 0) fail("socket");
    int one = 1;
    setsockopt(sock_, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
    if (connect(sock_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) fail("connect");
  }
  ~Conn() {
    close(sock_);
    for (int fd : held_) close(fd);
  }
  // One request; false once the engine dropped the connection. *status: the answer's.
  bool call(Op op, const void* body, size_t len, bool with_fd, int* status) {
    Message req;
    req.header.op = op;
    req.header.seq = ++seq_;
    req.body.assign(static_cast<const uint8_t*>(body), static_cast<const uint8_t*>(body) + len);
    int p[2] = {-1, -1};
    if (with_fd) {
      if (pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) fail("pipe");
      req.fds.push_back(p[1]);
    }
    const int e = hostif::send_message(sock_, req);
    if (with_fd) {
      close(p[1]);
      held_.push_back(p[0]);  // the async pipe's read end, as a context keeps it
    }
    if (e) return false;
    // Within 10 s (libFuzzer's timer interrupts the wait: EINTR is not an answer).
    pollfd pf{sock_, POLLIN, 0};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) fail("no answer and no hang-up within 10 s");
      const int n = poll(&pf, 1, static_cast<int>(left.count()));
      if (n == 1) break;
      if (n < 0 && errno != EINTR) fail("poll");
    }
    Message resp;
    if (hostif::recv_message(sock_, &resp) != 0) return false;
    for (int fd : resp.fds) held_.push_back(fd);
    if (resp.header.seq != req.header.seq || resp.header.op != op) fail("an answer to another request");
    *status = resp.header.status;
    body_ = resp.body;
    return true;
  }
  const std::vector<uint8_t>& body() const { return body_; }

 private:
  int sock_ = -1;
  uint32_t seq_ = 0;
  std::vector<int> held_;
  std::vector<uint8_t> body_;
};

bool hello(Conn& c, const char* link) {
  hostif::HelloReq h;
  hostif::put_name(h.link, link);
  int st = -1;
  return c.call(Op::kHello, &h, sizeof(h), true, &st) && st == 0;
}

class World {
 public:
  World() {
    char tmpl[] = "/tmp/metaroce-control-fuzz-XXXXXX";
    if (!mkdtemp(tmpl)) fail("mkdtemp");
    rundir_ = tmpl;
    io::MemLinkConfig lc;
    lc.queue_frames = 256;
    auto [pa, pb] = io::make_mem_link(lc);
    ports_[0] = std::move(pa);
    ports_[1] = std::move(pb);
    const char* names[] = {"a", "b"};
    for (int i = 0; i < 2; ++i) {
      nic::LinkConfig c;
      c.name = names[i];
      c.devargs = "mem";
      c.ip = 0xC6120001 + i;  // 198.18.0.1, .2
      c.paths = 4;
      const std::string dir = rundir_ + "/sys/class/infiniband/" + c.name;
      std::filesystem::create_directories(dir);
      std::string why;
      if (!c.save(dir + "/" + nic::kConfigFile, &why)) fail("link record");
    }
    EngineOptions opt;
    opt.rundir = rundir_;
    opt.open_recorded_links = false;
    opt.open_ports = [this](const nic::LinkConfig& cfg, std::string*) {
      std::vector<std::unique_ptr<io::Port>> v;
      auto& p = ports_[cfg.name == "a" ? 0 : 1];
      if (p) v.push_back(std::move(p));
      return v;
    };
    engine_ = std::make_unique<HostEngine>(opt);
    std::string why;
    if (engine_->open_link("a", &why) || engine_->open_link("b", &why) || !engine_->start(&why)) {
      std::fprintf(stderr, "control_fuzz: engine: %s\n", why.c_str());
      std::abort();
    }
  }
  const std::string& socket_path() const { return engine_->socket_path(); }

  // Every context gone but `keep` (counted by asking a context of our own).
  void expect_only_one_session() {
    for (int i = 0; i < 2000; ++i) {
      Conn c(socket_path());
      if (!hello(c, "a")) fail("a new context is refused");
      hostif::SessionInfoReq q;
      q.index = 1;
      int st = -1;
      if (!c.call(Op::kSessionInfo, &q, sizeof(q), false, &st)) fail("session info dropped");
      if (st == ENOENT) {
        // And the fresh context works.
        int pd_st = -1, cq_st = -1;
        if (!c.call(Op::kAllocPd, nullptr, 0, false, &pd_st) || pd_st != 0)
          fail("a new context cannot allocate a protection domain");
        hostif::CreateCqReq cq;
        cq.cqe = 16;
        if (!c.call(Op::kCreateCq, &cq, sizeof(cq), false, &cq_st) || cq_st != 0)
          fail("a new context cannot create a completion queue");
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    fail("the closed connection's context was not reclaimed within 10 s");
  }

 private:
  std::string rundir_;
  std::unique_ptr<io::Port> ports_[2];
  std::unique_ptr<HostEngine> engine_;
};

World& world() {
  static World* w = new World();  // never destroyed: the engine's threads outlive the fuzzing loop
  return *w;
}

}  // namespace
}  // namespace metaroce::engine

// Input: byte 0 bit 0: hello on link "a" first. Then requests: [op index][flags][length][body],
// flags bit 0: attach a descriptor, bit 1: the body is the previous answer's (ids the engine
// gave), with the length's bytes of the input overwriting its start.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace metaroce::engine;
  World& w = world();
  if (size == 0) return 0;
  {
    Conn c(w.socket_path());
    size_t i = 1;
    bool open = !(data[0] & 1) || hello(c, "a");
    std::vector<uint8_t> body;
    for (int n = 0; open && n < 16 && i + 3 <= size; ++n) {
      const Op op = kOps[data[i] % kNumOps];
      const uint8_t flags = data[i + 1];
      size_t len = data[i + 2];
      i += 3;
      len = std::min(len, size - i);
      if (flags & 2) {
        body = c.body();
        if (body.size() < len) body.resize(len);
      } else {
        body.assign(len, 0);
      }
      if (len) std::memcpy(body.data(), data + i, len);
      i += len;
      int st = 0;
      open = c.call(op, body.data(), body.size(), flags & 1, &st);
    }
  }
  w.expect_only_one_session();
  return 0;
}
