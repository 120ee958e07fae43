// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the engine's RDMA CM (datapath/engine/cm.cc, docs/spec/cm.md): CM
// messages from the network (what any peer engine with a connection can send on stream 1) and
// librdmacm commands from a channel (what any local process can write), interleaved, with the
// clock moved between them, against one engine that has a listener, a connection in each state
// the input drives it to, and a second channel. Checked besides "no crash, no sanitizer report":
// every command is answered 0 or an errno, an answer is never longer than asked, every event
// written is a whole struct rdma_ucm_event_resp, nothing is sent that its receiver would drop as
// malformed, and a closed channel leaves no id behind.
#include <arpa/inet.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <netinet/in.h>
#include <rdma/rdma_user_cm.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "datapath/engine/cm.h"

namespace metaroce::engine {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kIp = 0xc6120001, kPeer = 0xc6120002;

void check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "cm_fuzz: %s\n", what);
  std::abort();
}

struct World {
  transport::Time clock{1s};
  std::vector<std::vector<uint8_t>> sent;
  CmService cm{CmService::Env{
      .links = [] { return std::vector<CmLinkInfo>{{"a", kIp, 24, 0x1234, 1024}}; },
      .send =
          [this](const std::string&, uint32_t, std::span<const uint8_t> m, uint64_t) {
            sent.emplace_back(m.begin(), m.end());
          },
      .now = [this] { return clock; },
      .log = [](const char*) {},
  }};
};

// Drains a channel's socket: every message must be one whole event.
void drain(int fd) {
  uint8_t buf[1024];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0) return;
    check(n == static_cast<ssize_t>(sizeof(rdma_ucm_event_resp)), "an event of the wrong size");
  }
}

void one(FuzzedDataProvider& in) {
  World w;
  int a[2], b[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, a) != 0) return;
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, b) != 0) {
    close(a[0]);
    close(a[1]);
    return;
  }
  const uint32_t ch[2] = {w.cm.open_channel(a[1]), w.cm.open_channel(b[1])};
  const int fds[2] = {a[0], b[0]};
  // A listener on 198.18.0.1:7471, so that requests find someone.
  {
    rdma_ucm_create_id c{};
    c.uid = 1;
    c.ps = RDMA_PS_TCP;
    c.qp_type = 2;
    std::vector<uint8_t> r;
    w.cm.command(ch[0], RDMA_USER_CM_CMD_CREATE_ID, {reinterpret_cast<uint8_t*>(&c), sizeof(c)},
                 {}, sizeof(rdma_ucm_create_id_resp), &r);
    rdma_ucm_bind_ip bi{};
    bi.id = 1;
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(kIp);
    sa.sin_port = htons(7471);
    std::memcpy(&bi.addr, &sa, sizeof(sa));
    w.cm.command(ch[0], RDMA_USER_CM_CMD_BIND_IP, {reinterpret_cast<uint8_t*>(&bi), sizeof(bi)},
                 {}, 0, &r);
    rdma_ucm_listen l{1, 4};
    w.cm.command(ch[0], RDMA_USER_CM_CMD_LISTEN, {reinterpret_cast<uint8_t*>(&l), sizeof(l)}, {},
                 0, &r);
  }
  while (in.remaining_bytes() > 0) {
    switch (in.ConsumeIntegralInRange<int>(0, 4)) {
      case 0: {  // a CM message from the peer's engine
        const auto bytes = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 300));
        w.cm.on_message("a", in.ConsumeBool() ? kPeer : kIp, bytes);
        break;
      }
      case 1: {  // a command of a channel
        const uint32_t c = ch[in.ConsumeIntegralInRange<int>(0, 1)];
        const uint32_t cmd = in.ConsumeIntegralInRange<uint32_t>(0, 24);
        const uint16_t out = in.ConsumeIntegral<uint16_t>();
        const auto body = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 400));
        const auto extra = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 8));
        std::vector<uint8_t> resp;
        const int e = w.cm.command(c, cmd, body, extra, out, &resp);
        check(e >= 0, "a negative answer");
        check(resp.size() <= out, "an answer longer than asked");
        check(e == 0 || resp.empty(), "an error with an answer");
        break;
      }
      case 2:  // the clock moves (timeouts)
        w.clock += std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 40000));
        w.cm.tick();
        break;
      case 3: {  // the fate of something sent
        w.cm.on_sent(in.ConsumeIntegral<uint64_t>(), in.ConsumeBool());
        break;
      }
      case 4:  // a message it sent comes back to it, as from a peer (loopback)
        if (!w.sent.empty()) {
          const auto m = w.sent[in.ConsumeIntegralInRange<size_t>(0, w.sent.size() - 1)];
          w.cm.on_message("a", in.ConsumeBool() ? kPeer : kIp, m);
        }
        break;
    }
  }
  // What it sent is well formed: its own messages, received, are not dropped as malformed
  // (their length and private data agree; checked by the header's arithmetic here).
  for (const auto& m : w.sent) {
    check(m.size() >= 40 && m.size() <= 256, "a CM message of a size the spec does not allow");
    check(m.size() == 40u + ((m[2] << 8) | m[3]), "a CM message whose length is not its header's");
    check(m[1] == 1 && m[0] >= 1 && m[0] <= 8, "a CM message of an unknown version or type");
  }
  for (int fd : fds) drain(fd);
  w.cm.close_channel(ch[0]);
  w.cm.close_channel(ch[1]);
  check(w.cm.id_count() == 0, "ids left after their channels closed");
  check(w.cm.channel_count() == 0, "channels left after they closed");
  check(w.cm.mc_count() == 0, "multicast joins left after their channels closed");
  close(a[0]);
  close(b[0]);
}

}  // namespace
}  // namespace metaroce::engine

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  metaroce::engine::one(in);
  return 0;
}
