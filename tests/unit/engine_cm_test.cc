// SPDX-License-Identifier: Apache-2.0
// The engine's RDMA CM (datapath/engine/cm.h, docs/spec/cm.md) alone: two CmService instances,
// "engine A" (link a, 198.18.0.1) and "engine B" (link b, 198.18.0.2), whose CM messages are
// handed to each other by the test instead of a transport, on a clock the test moves. Channels
// are socket pairs whose far ends the test reads events from, as the preload does.
#include "datapath/engine/cm.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <rdma/rdma_user_cm.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <optional>
#include <vector>

namespace metaroce::engine {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kIpA = 0xc6120001, kIpB = 0xc6120002;
enum : uint32_t { kAddrResolved = 0, kRouteResolved = 2, kConnectRequest = 4,
                  kConnectResponse = 5, kUnreachable = 7, kRejected = 8, kEstablished = 9,
                  kDisconnected = 10 };

struct Wire {
  struct Msg {
    int to;  // 0: A, 1: B
    uint32_t from_ip;
    std::vector<uint8_t> bytes;
    uint64_t token;
    int sender;
  };
  std::deque<Msg> queue;
  bool lose = false;  // messages fail delivery (a peer engine that cannot be reached)
};

class Engine {
 public:
  Engine(Wire& w, int self, uint32_t ip, const char* link, transport::Time& clock)
      : wire_(w),
        cm_(CmService::Env{
            .links = [ip, link] { return std::vector<CmLinkInfo>{{link, ip, 24, 0x1234 + ip, 4096}}; },
            .send =
                [this, self, ip](const std::string&, uint32_t peer, std::span<const uint8_t> m,
                                 uint64_t token) {
                  sent.push_back({m.begin(), m.end()});
                  wire_.queue.push_back({peer == kIpA ? 0 : 1, ip, {m.begin(), m.end()}, token, self});
                },
            .now = [&clock] { return clock; },
            .log = [](const char*) {},
        }) {}

  // A channel; returns (channel number, the socket events are read from).
  std::pair<uint32_t, int> channel(uint32_t owner = 0) {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
    return {cm_.open_channel(sv[1], owner), sv[0]};
  }

  template <typename T>
  int cmd(uint32_t ch, uint32_t c, const T& body, std::vector<uint8_t>* resp = nullptr,
          std::span<const uint8_t> extra = {}) {
    std::vector<uint8_t> r;
    const auto* b = reinterpret_cast<const uint8_t*>(&body);
    const int e = cm_.command(ch, c, {b, sizeof(T)}, extra, 512, resp ? resp : &r);
    return e;
  }

  uint32_t create(uint32_t ch, uint16_t ps = RDMA_PS_TCP, uint64_t uid = 77) {
    rdma_ucm_create_id c{};
    c.uid = uid;
    c.ps = ps;
    c.qp_type = ps == RDMA_PS_UDP ? 4 : 2;
    std::vector<uint8_t> r;
    EXPECT_EQ(cmd(ch, RDMA_USER_CM_CMD_CREATE_ID, c, &r), 0);
    rdma_ucm_create_id_resp id{};
    std::memcpy(&id, r.data(), std::min(r.size(), sizeof(id)));
    return id.id;
  }

  // ip:port (host order) as the kernel's ucma structures carry it.
  static sockaddr_in v4(uint32_t ip, uint16_t port) {
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_addr.s_addr = htonl(ip);
    in.sin_port = htons(port);
    return in;
  }

  int bind(uint32_t ch, uint32_t id, uint32_t ip, uint16_t port) {
    rdma_ucm_bind_ip b{};
    b.id = id;
    const sockaddr_in in = v4(ip, port);
    std::memcpy(&b.addr, &in, sizeof(in));
    return cmd(ch, RDMA_USER_CM_CMD_BIND_IP, b);
  }

  // RESOLVE_IP of id towards ip:port, then RESOLVE_ROUTE (each answers with its event): the
  // first command's error, or 0.
  int resolve(uint32_t ch, uint32_t id, uint32_t ip, uint16_t port) {
    rdma_ucm_resolve_ip r{};
    r.id = id;
    const sockaddr_in dst = v4(ip, port);
    std::memcpy(&r.dst_addr, &dst, sizeof(dst));
    if (int e = cmd(ch, RDMA_USER_CM_CMD_RESOLVE_IP, r)) return e;
    rdma_ucm_resolve_route rr{id, 1000};
    return cmd(ch, RDMA_USER_CM_CMD_RESOLVE_ROUTE, rr);
  }

  CmService& cm() { return cm_; }
  std::vector<std::vector<uint8_t>> sent;

 private:
  Wire& wire_;
  CmService cm_;
};

std::optional<rdma_ucm_event_resp> next_event(int fd) {
  rdma_ucm_event_resp ev{};
  const ssize_t n = recv(fd, &ev, sizeof(ev), MSG_DONTWAIT);
  if (n != static_cast<ssize_t>(sizeof(ev))) return std::nullopt;
  return ev;
}

class CmTest : public ::testing::Test {
 protected:
  // Delivers every queued message (and what the deliveries queue in turn).
  void pump() {
    while (!wire.queue.empty()) {
      Wire::Msg m = std::move(wire.queue.front());
      wire.queue.pop_front();
      Engine& from = m.sender == 0 ? a : b;
      if (wire.lose) {
        from.cm().on_sent(m.token, false);
        continue;
      }
      (m.to == 0 ? a : b).cm().on_message(m.to == 0 ? "a" : "b", m.from_ip, m.bytes);
      from.cm().on_sent(m.token, true);
    }
  }

  // A listens on 198.18.0.1:port; B connects from 198.18.0.2. Returns B's id, A's child.
  struct Conn {
    uint32_t a_ch, b_ch, listen, child, active;
    int a_fd, b_fd;
  };
  Conn connect_rc(uint16_t port = 7471, bool accept = true) {
    Conn c{};
    std::tie(c.a_ch, c.a_fd) = a.channel();
    std::tie(c.b_ch, c.b_fd) = b.channel();
    c.listen = a.create(c.a_ch, RDMA_PS_TCP, 1);
    EXPECT_EQ(a.bind(c.a_ch, c.listen, kIpA, port), 0);
    rdma_ucm_listen l{c.listen, 8};
    EXPECT_EQ(a.cmd(c.a_ch, RDMA_USER_CM_CMD_LISTEN, l), 0);
    c.active = b.create(c.b_ch, RDMA_PS_TCP, 2);
    EXPECT_EQ(b.bind(c.b_ch, c.active, kIpB, 0), 0);
    EXPECT_EQ(b.resolve(c.b_ch, c.active, kIpA, port), 0);
    EXPECT_EQ(next_event(c.b_fd)->event, kAddrResolved);
    EXPECT_EQ(next_event(c.b_fd)->event, kRouteResolved);
    rdma_ucm_connect cn{};
    cn.id = c.active;
    cn.conn_param.qp_num = 0x111;
    cn.conn_param.responder_resources = 1;
    cn.conn_param.initiator_depth = 1;
    cn.conn_param.retry_count = 7;
    cn.conn_param.rnr_retry_count = 7;
    cn.conn_param.private_data_len = 3;
    std::memcpy(cn.conn_param.private_data, "abc", 3);
    EXPECT_EQ(b.cmd(c.b_ch, RDMA_USER_CM_CMD_CONNECT, cn), 0);
    pump();
    auto req = next_event(c.a_fd);
    EXPECT_TRUE(req);
    if (!req) return c;
    EXPECT_EQ(req->event, kConnectRequest);
    EXPECT_EQ(req->uid, 1u);  // the listener's
    EXPECT_EQ(req->reserved, c.listen);  // the preload counts it for the listener
    EXPECT_EQ(req->param.conn.qp_num, 0x111u);
    EXPECT_EQ(std::memcmp(req->param.conn.private_data, "abc", 3), 0);
    c.child = req->id;
    if (!accept) return c;
    rdma_ucm_accept ac{};
    ac.id = c.child;
    ac.uid = 3;
    ac.conn_param.qp_num = 0x222;
    ac.conn_param.valid = 1;
    ac.conn_param.responder_resources = 1;
    ac.conn_param.initiator_depth = 1;
    EXPECT_EQ(a.cmd(c.a_ch, RDMA_USER_CM_CMD_ACCEPT, ac), 0);
    pump();
    auto rep = next_event(c.b_fd);
    EXPECT_TRUE(rep && rep->event == kConnectResponse && rep->param.conn.qp_num == 0x222u);
    rdma_ucm_accept rtu{};
    rtu.id = c.active;
    EXPECT_EQ(b.cmd(c.b_ch, RDMA_USER_CM_CMD_ACCEPT, rtu), 0);
    pump();
    auto est = next_event(c.a_fd);
    EXPECT_TRUE(est && est->event == kEstablished && est->uid == 3u);
    return c;
  }

  // Resolves id's address (kIpA:port) and route on b, and connects it (UD or RC by its port
  // space); ADDR_RESOLVED and ROUTE_RESOLVED are read from bfd.
  void resolve_and_connect(uint32_t bch, int bfd, uint32_t id, uint16_t port) {
    ASSERT_EQ(b.resolve(bch, id, kIpA, port), 0);
    rdma_ucm_connect cn{};
    cn.id = id;
    ASSERT_EQ(b.cmd(bch, RDMA_USER_CM_CMD_CONNECT, cn), 0);
    pump();
    EXPECT_EQ(next_event(bfd)->event, kAddrResolved);
    EXPECT_EQ(next_event(bfd)->event, kRouteResolved);
  }

  ib_uverbs_qp_attr qp_attr(Engine& e, uint32_t ch, uint32_t id, uint32_t state) {
    rdma_ucm_init_qp_attr q{};
    q.id = id;
    q.qp_state = state;
    std::vector<uint8_t> r;
    EXPECT_EQ(e.cmd(ch, RDMA_USER_CM_CMD_INIT_QP_ATTR, q, &r), 0);
    ib_uverbs_qp_attr a{};
    std::memcpy(&a, r.data(), std::min(r.size(), sizeof(a)));
    return a;
  }

  transport::Time clock{1s};
  Wire wire;
  Engine a{wire, 0, kIpA, "a", clock};
  Engine b{wire, 1, kIpB, "b", clock};
};

TEST_F(CmTest, ConnectAcceptDisconnectAndTheQpAttributesMatchAcross) {
  Conn c = connect_rc();
  // Each side's RTR names the other's QP and its starting PSN; RTS its own PSN.
  const auto a_rtr = qp_attr(a, c.a_ch, c.child, 2), b_rtr = qp_attr(b, c.b_ch, c.active, 2);
  const auto a_rts = qp_attr(a, c.a_ch, c.child, 3), b_rts = qp_attr(b, c.b_ch, c.active, 3);
  EXPECT_EQ(a_rtr.dest_qp_num, 0x111u);
  EXPECT_EQ(b_rtr.dest_qp_num, 0x222u);
  EXPECT_EQ(a_rtr.rq_psn, b_rts.sq_psn);
  EXPECT_EQ(b_rtr.rq_psn, a_rts.sq_psn);
  EXPECT_EQ(a_rtr.ah_attr.grh.dgid[15], 2);  // ::ffff:198.18.0.2
  EXPECT_EQ(b_rtr.ah_attr.grh.dgid[15], 1);
  EXPECT_EQ(a_rtr.ah_attr.is_global, 1);
  rdma_ucm_disconnect d{c.active};
  EXPECT_EQ(b.cmd(c.b_ch, RDMA_USER_CM_CMD_DISCONNECT, d), 0);
  pump();
  EXPECT_EQ(next_event(c.a_fd)->event, kDisconnected);
  EXPECT_EQ(next_event(c.b_fd)->event, kDisconnected);
  EXPECT_FALSE(next_event(c.a_fd));
  EXPECT_FALSE(next_event(c.b_fd));
}

TEST_F(CmTest, NobodyListeningIsARejectionWithInvalidServiceId) {
  auto [ach, afd] = a.channel();
  auto [bch, bfd] = b.channel();
  (void)ach;
  (void)afd;
  const uint32_t id = b.create(bch);
  resolve_and_connect(bch, bfd, id, 9);
  auto ev = next_event(bfd);
  ASSERT_TRUE(ev);
  EXPECT_EQ(ev->event, kRejected);
  EXPECT_EQ(ev->status, 8u);
}

TEST_F(CmTest, AClosedChannelDisconnectsItsPeersAndFreesItsPort) {
  Conn c = connect_rc();
  a.cm().close_channel(c.a_ch);  // the server process died
  pump();
  EXPECT_EQ(next_event(c.b_fd)->event, kDisconnected);
  EXPECT_EQ(a.cm().id_count(), 0u);
  auto [ch, fd] = a.channel();
  (void)fd;
  const uint32_t id = a.create(ch);
  EXPECT_EQ(a.bind(ch, id, kIpA, 7471), 0) << "the dead listener's port";
}

TEST_F(CmTest, AListenerThatNeverAcceptsTimesTheRequesterOut) {
  Conn c = connect_rc(7471, /*accept=*/false);
  clock += 29s;
  a.cm().tick();
  b.cm().tick();
  pump();
  EXPECT_FALSE(next_event(c.b_fd)) << "before the timeout";
  clock += 2s;
  b.cm().tick();
  pump();
  auto ev = next_event(c.b_fd);
  ASSERT_TRUE(ev);
  EXPECT_EQ(ev->event, kUnreachable);
  EXPECT_EQ(static_cast<int32_t>(ev->status), -ETIMEDOUT);
  // The passive side learned it too: accepting now is refused.
  rdma_ucm_accept ac{};
  ac.id = c.child;
  ac.conn_param.qp_num = 5;
  EXPECT_EQ(a.cmd(c.a_ch, RDMA_USER_CM_CMD_ACCEPT, ac), EINVAL);
}

TEST_F(CmTest, ARequestThePeersEngineNeverGotIsUnreachableAtOnce) {
  wire.lose = true;
  auto [bch, bfd] = b.channel();
  const uint32_t id = b.create(bch);
  resolve_and_connect(bch, bfd, id, 7471);
  auto ev = next_event(bfd);
  ASSERT_TRUE(ev);
  EXPECT_EQ(ev->event, kUnreachable);
}

TEST_F(CmTest, MalformedMessagesAreDroppedWithoutAnswer) {
  Conn c = connect_rc(7471, false);
  ASSERT_FALSE(b.sent.empty());
  const std::vector<uint8_t> req = b.sent.front();  // the REQ
  const size_t ids = a.cm().id_count();
  std::vector<std::vector<uint8_t>> bad;
  bad.push_back({});
  bad.push_back({req.begin(), req.begin() + 39});  // short header
  auto v = req;
  v[1] = 9;  // version
  bad.push_back(v);
  v = req;
  v[0] = 0;  // type
  bad.push_back(v);
  v = req;
  v[0] = 99;
  bad.push_back(v);
  v = req;
  v[3] = static_cast<uint8_t>(v[3] + 1);  // private length beyond the message
  bad.push_back(v);
  v = req;
  v.resize(40 + 57);  // a REQ with more private data than 56 bytes
  v[2] = 0;
  v[3] = 57;
  bad.push_back(v);
  v = req;
  std::memset(&v[4], 0, 4);  // no sender id
  bad.push_back(v);
  for (const auto& m : bad) a.cm().on_message("a", kIpB, m);
  EXPECT_TRUE(wire.queue.empty()) << "nothing answered";
  EXPECT_EQ(a.cm().id_count(), ids);
  EXPECT_FALSE(next_event(c.a_fd));
  // A REQ seen twice is the request it made, not a second one.
  a.cm().on_message("a", kIpB, req);
  EXPECT_EQ(a.cm().id_count(), ids);
  EXPECT_FALSE(next_event(c.a_fd));
}

TEST_F(CmTest, BindRefusesTakenPortsAndAddressesNoLinkHas) {
  auto [ch, fd] = a.channel();
  (void)fd;
  const uint32_t x = a.create(ch), y = a.create(ch), z = a.create(ch);
  EXPECT_EQ(a.bind(ch, x, kIpA, 7000), 0);
  EXPECT_EQ(a.bind(ch, y, kIpA, 7000), EADDRINUSE);
  EXPECT_EQ(a.bind(ch, z, kIpB, 7001), EADDRNOTAVAIL);
  // An id of another channel is not this channel's to name.
  auto [ch2, fd2] = a.channel();
  (void)fd2;
  rdma_ucm_listen l{x, 1};
  EXPECT_EQ(a.cmd(ch2, RDMA_USER_CM_CMD_LISTEN, l), EINVAL);
  // Commands of kinds not offered say so (QUERY: AF_IB's).
  rdma_ucm_query q{};
  q.id = x;
  EXPECT_EQ(a.cmd(ch, RDMA_USER_CM_CMD_QUERY, q), ENOSYS);
}

// 127.0.0.1 is the host's first link, bound or resolved (the kernel's CM binds a loopback
// address to its first active device): a listener bound there takes a connection resolved to it.
TEST_F(CmTest, ALoopbackAddressStandsForTheFirstLink) {
  constexpr uint32_t kLoopback = 0x7f000001;
  auto [ch, fd] = a.channel();
  const uint32_t listen = a.create(ch, RDMA_PS_TCP, 1);
  ASSERT_EQ(a.bind(ch, listen, kLoopback, 7300), 0);
  rdma_ucm_listen l{listen, 8};
  ASSERT_EQ(a.cmd(ch, RDMA_USER_CM_CMD_LISTEN, l), 0);
  const uint32_t active = a.create(ch, RDMA_PS_TCP, 2);
  ASSERT_EQ(a.resolve(ch, active, kLoopback, 7300), 0);
  EXPECT_EQ(next_event(fd)->event, kAddrResolved);
  EXPECT_EQ(next_event(fd)->event, kRouteResolved);
  rdma_ucm_connect cn{};
  cn.id = active;
  cn.conn_param.qp_num = 0x333;
  cn.conn_param.responder_resources = 1;
  cn.conn_param.initiator_depth = 1;
  ASSERT_EQ(a.cmd(ch, RDMA_USER_CM_CMD_CONNECT, cn), 0);
  pump();
  const auto req = next_event(fd);
  ASSERT_TRUE(req);
  EXPECT_EQ(req->event, kConnectRequest) << "the listener on 127.0.0.1 takes the request";
  // Any other 127/8 address is the same link; an address no link has is still refused.
  const uint32_t other = a.create(ch);
  EXPECT_EQ(a.bind(ch, other, 0x7f000002, 7301), 0);
  const uint32_t none = a.create(ch);
  EXPECT_EQ(a.bind(ch, none, 0x0a000001, 7302), EADDRNOTAVAIL);
}

TEST_F(CmTest, IdsAreNumberedPerProcessAndNamedOnlyByTheirOwn) {
  auto [p, pfd] = a.channel(100);
  auto [q, qfd] = a.channel(200);
  (void)pfd;
  (void)qfd;
  const uint32_t x = a.create(p), y = a.create(q);
  EXPECT_EQ(x, y) << "each process numbers its own ids";
  EXPECT_EQ(a.bind(p, x, kIpA, 7100), 0);
  EXPECT_EQ(a.bind(q, y, kIpA, 7101), 0) << "process 200's id, not process 100's (bound)";
  // Moving an id to a channel of another process is refused.
  auto [p2, p2fd] = a.channel(100);
  (void)p2fd;
  rdma_ucm_migrate_id m{};
  m.id = y;
  m.fd = q;
  EXPECT_EQ(a.cmd(p2, RDMA_USER_CM_CMD_MIGRATE_ID, m), EINVAL);
  m.id = x;
  m.fd = p;
  EXPECT_EQ(a.cmd(p2, RDMA_USER_CM_CMD_MIGRATE_ID, m), 0);
  rdma_ucm_listen l{x, 1};
  EXPECT_EQ(a.cmd(p2, RDMA_USER_CM_CMD_LISTEN, l), 0) << "named on its new channel";
  EXPECT_EQ(a.cmd(p, RDMA_USER_CM_CMD_LISTEN, l), EINVAL) << "and no longer on its old one";
}

TEST_F(CmTest, UdExchangeGivesTheRequesterThePeersQpAndQkey) {
  auto [ach, afd] = a.channel();
  auto [bch, bfd] = b.channel();
  const uint32_t listen = a.create(ach, RDMA_PS_UDP, 1);
  ASSERT_EQ(a.bind(ach, listen, kIpA, 7174), 0);
  rdma_ucm_listen l{listen, 8};
  ASSERT_EQ(a.cmd(ach, RDMA_USER_CM_CMD_LISTEN, l), 0);
  const uint32_t id = b.create(bch, RDMA_PS_UDP, 2);
  ASSERT_EQ(b.resolve(bch, id, kIpA, 7174), 0);
  // A UD QP's INIT carries the UDP port space's Q_Key.
  EXPECT_EQ(qp_attr(b, bch, id, 1).qkey, 0x01234567u);
  rdma_ucm_connect cn{};
  cn.id = id;
  ASSERT_EQ(b.cmd(bch, RDMA_USER_CM_CMD_CONNECT, cn), 0);
  pump();
  auto req = next_event(afd);
  ASSERT_TRUE(req && req->event == kConnectRequest);
  rdma_ucm_accept ac{};
  ac.id = req->id;
  ac.uid = 9;
  ac.conn_param.qp_num = 0x333;
  ASSERT_EQ(a.cmd(ach, RDMA_USER_CM_CMD_ACCEPT, ac), 0);
  pump();
  next_event(bfd);
  next_event(bfd);
  auto est = next_event(bfd);
  ASSERT_TRUE(est);
  EXPECT_EQ(est->event, kEstablished);
  EXPECT_EQ(est->param.ud.qp_num, 0x333u);
  EXPECT_EQ(est->param.ud.qkey, 0x01234567u);
  EXPECT_EQ(est->param.ud.ah_attr.grh.dgid[15], 1);
}


TEST_F(CmTest, MulticastJoinAnswersWithTheGroupsAddressAndLeaveEndsIt) {
  auto [ch, fd] = a.channel(100);
  auto join = [&](uint32_t c, uint32_t id, uint32_t group, uint64_t uid, uint32_t* handle,
                  uint16_t flags = 0, bool extended = false) {
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_addr.s_addr = htonl(group);
    std::vector<uint8_t> r;
    int e;
    if (extended) {
      rdma_ucm_join_mcast j{};
      j.uid = uid;
      j.id = id;
      j.addr_size = sizeof(in);
      j.join_flags = flags;
      std::memcpy(&j.addr, &in, sizeof(in));
      e = a.cmd(c, RDMA_USER_CM_CMD_JOIN_MCAST, j, &r);
    } else {
      rdma_ucm_join_ip_mcast j{};
      j.uid = uid;
      j.id = id;
      std::memcpy(&j.addr, &in, sizeof(in));
      e = a.cmd(c, RDMA_USER_CM_CMD_JOIN_IP_MCAST, j, &r);
    }
    if (!e && handle) std::memcpy(handle, r.data(), sizeof(*handle));
    return e;
  };
  constexpr uint32_t kGroup = 0xe6120001;  // 230.18.0.1
  const uint32_t ud = a.create(ch, RDMA_PS_UDP, 5), rc = a.create(ch, RDMA_PS_TCP, 6);
  uint32_t h = 0;
  EXPECT_EQ(join(ch, ud, kGroup, 50, &h), EINVAL) << "an id with no address yet";
  ASSERT_EQ(a.bind(ch, ud, kIpA, 7200), 0);
  ASSERT_EQ(a.bind(ch, rc, kIpA, 7201), 0);
  EXPECT_EQ(join(ch, rc, kGroup, 50, &h), EINVAL) << "an RC id";
  EXPECT_EQ(join(ch, ud, kIpB, 50, &h), EINVAL) << "not a group address";
  EXPECT_EQ(join(ch, ud, kGroup, 50, &h, 2, true), EINVAL) << "join flags unknown";
  ASSERT_EQ(join(ch, ud, kGroup, 50, &h), 0);
  auto ev = next_event(fd);
  ASSERT_TRUE(ev);
  EXPECT_EQ(ev->event, 12u);  // RDMA_CM_EVENT_MULTICAST_JOIN
  EXPECT_EQ(ev->uid, 50u) << "the join's uid, which librdmacm finds the join by";
  EXPECT_EQ(ev->id, ud);
  EXPECT_EQ(ev->status, 0u);
  EXPECT_EQ(ev->reserved, h) << "for the preload's count of the join's events";
  EXPECT_EQ(ev->param.ud.qp_num, 0xffffffu);
  EXPECT_EQ(ev->param.ud.qkey, 0x01234567u);
  EXPECT_EQ(ev->param.ud.ah_attr.is_global, 1);
  const uint8_t gid[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 230, 18, 0, 1};
  EXPECT_EQ(std::memcmp(ev->param.ud.ah_attr.grh.dgid, gid, 16), 0);
  uint32_t h2 = 0;
  ASSERT_EQ(join(ch, ud, kGroup + 1, 51, &h2, 1, true), 0) << "send-only, extended";
  EXPECT_NE(h2, h);
  ASSERT_TRUE(next_event(fd));
  EXPECT_EQ(a.cm().mc_count(), 2u);
  // Leave: a join of this channel; unknown ones are ENOENT, another channel's EINVAL.
  auto [other, ofd] = a.channel(100);
  (void)ofd;
  rdma_ucm_destroy_id lv{};
  lv.id = h;
  EXPECT_EQ(a.cmd(other, RDMA_USER_CM_CMD_LEAVE_MCAST, lv), EINVAL);
  ASSERT_EQ(a.cmd(ch, RDMA_USER_CM_CMD_LEAVE_MCAST, lv), 0);
  EXPECT_EQ(a.cmd(ch, RDMA_USER_CM_CMD_LEAVE_MCAST, lv), ENOENT);
  EXPECT_EQ(a.cm().mc_count(), 1u);
  // Destroying the id ends its other join.
  rdma_ucm_destroy_id d{};
  d.id = ud;
  ASSERT_EQ(a.cmd(ch, RDMA_USER_CM_CMD_DESTROY_ID, d), 0);
  EXPECT_EQ(a.cm().mc_count(), 0u);
  lv.id = h2;
  EXPECT_EQ(a.cmd(ch, RDMA_USER_CM_CMD_LEAVE_MCAST, lv), ENOENT);
}

}  // namespace
}  // namespace metaroce::engine
