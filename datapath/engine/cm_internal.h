// SPDX-License-Identifier: Apache-2.0
// What the engine's RDMA CM's two files share (cm.cc: ids, queries and the CM messages between
// engines; cm_commands.cc: librdmacm's commands): librdmacm's and verbs' numbers, the CM
// messages' layout (docs/spec/cm.md §2), and small helpers. Internal to the CM.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "datapath/engine/cm.h"
#include "datapath/transport/engine.h"
#include "datapath/wire/bytes.h"

namespace metaroce::engine::cm_detail {

// librdmacm's event numbers (enum rdma_cm_event_type, rdma_cma.h).
enum : uint32_t {
  kEvAddrResolved = 0, kEvAddrError = 1, kEvRouteResolved = 2, kEvRouteError = 3,
  kEvConnectRequest = 4, kEvConnectResponse = 5, kEvConnectError = 6, kEvUnreachable = 7,
  kEvRejected = 8, kEvEstablished = 9, kEvDisconnected = 10, kEvDeviceRemoval = 11,
  kEvMulticastJoin = 12,
};
constexpr uint16_t kJoinFull = 0, kJoinSendOnly = 1;  // RDMA_MC_JOIN_FLAG_*
constexpr uint8_t kQptRc = 2, kQptUd = 4;   // ibv_qp_type
constexpr uint32_t kUdpQkey = 0x01234567;  // RDMA_UDP_QKEY
// Verbs values INIT_QP_ATTR answers with (enum ibv_qp_attr_mask, ibv_qp_state, ibv_access_flags).
enum : uint32_t {
  kMaskState = 1, kMaskAccess = 1 << 3, kMaskPkey = 1 << 4, kMaskPort = 1 << 5,
  kMaskQkey = 1 << 6, kMaskAv = 1 << 7, kMaskPathMtu = 1 << 8, kMaskTimeout = 1 << 9,
  kMaskRetry = 1 << 10, kMaskRnrRetry = 1 << 11, kMaskRqPsn = 1 << 12,
  kMaskMaxQpRdAtomic = 1 << 13, kMaskMinRnr = 1 << 15, kMaskSqPsn = 1 << 16,
  kMaskMaxDestRdAtomic = 1 << 17, kMaskDestQpn = 1 << 20,
};
enum : uint32_t { kQpsInit = 1, kQpsRtr = 2, kQpsRts = 3 };
enum : uint32_t { kAccessRemoteWrite = 2, kAccessRemoteRead = 4, kAccessRemoteAtomic = 8 };
constexpr uint8_t kMinRnrTimer = 12;   // 0.64 ms
constexpr uint8_t kHopLimit = 64;
// How long an exchange may wait for its answer (a passive side that never accepts, a peer
// that never sends RTU): then UNREACHABLE, as the kernel's CM gives up on a REQ.
constexpr transport::Time kExchangeTimeout = std::chrono::seconds(30);
constexpr transport::Time kDreqTimeout = std::chrono::seconds(2);
constexpr uint32_t kMaxIds = 65535;  // librdmacm's id map holds 2^16 entries

// CM messages (docs/spec/cm.md §2).
enum : uint8_t { kReq = 1, kRep = 2, kRtu = 3, kRej = 4, kDreq = 5, kDrep = 6, kSidrReq = 7, kSidrRep = 8 };
constexpr uint8_t kCmVersion = 1;
constexpr size_t kHeader = 40;
constexpr size_t kMaxPrivate = 216;
// Private data each message carries at most (the kernel's CM, less its 36-byte header where it
// puts one: REQ and SIDR REQ).
inline size_t private_limit(uint8_t type) {
  switch (type) {
    case kReq: return 56;
    case kRep: return 196;
    case kRej: return 148;
    case kSidrReq: return 180;
    case kSidrRep: return 136;
    default: return kMaxPrivate;
  }
}
// Reject reasons (IBTA CM REJ codes librdmacm reports as the event's status).
constexpr uint8_t kRejInvalidService = 8, kRejConsumer = 28, kRejTimeout = 1;
constexpr uint8_t kSidrOk = 0, kSidrReject = 1, kSidrNoListener = 2;

struct Msg {
  uint8_t type = 0;
  uint16_t priv_len = 0;
  uint32_t sender = 0, receiver = 0;
  uint16_t ps = 0, port = 0;
  uint32_t src_ip = 0;
  uint16_t src_port = 0;
  uint8_t resp_res = 0, init_depth = 0;
  uint32_t qpn = 0, psn_or_qkey = 0;
  uint8_t retry = 0, rnr = 0, flags = 0, status = 0;
  uint32_t dst_ip = 0;
  std::span<const uint8_t> priv;
};
constexpr uint8_t kFlagSrq = 1;

inline std::vector<uint8_t> encode(const Msg& m) {
  std::vector<uint8_t> b(kHeader + m.priv.size());
  b[0] = m.type;
  b[1] = kCmVersion;
  wire::store_be16(&b[2], static_cast<uint16_t>(m.priv.size()));
  wire::store_be32(&b[4], m.sender);
  wire::store_be32(&b[8], m.receiver);
  wire::store_be16(&b[12], m.ps);
  wire::store_be16(&b[14], m.port);
  wire::store_be32(&b[16], m.src_ip);
  wire::store_be16(&b[20], m.src_port);
  b[22] = m.resp_res;
  b[23] = m.init_depth;
  wire::store_be32(&b[24], m.qpn & 0xffffff);
  wire::store_be32(&b[28], m.psn_or_qkey);
  b[32] = m.retry;
  b[33] = m.rnr;
  b[34] = m.flags;
  b[35] = m.status;
  wire::store_be32(&b[36], m.dst_ip);
  if (!m.priv.empty()) std::memcpy(&b[kHeader], m.priv.data(), m.priv.size());
  return b;
}

inline bool decode(std::span<const uint8_t> b, Msg* m) {
  if (b.size() < kHeader || b[1] != kCmVersion) return false;
  m->type = b[0];
  m->priv_len = wire::load_be16(&b[2]);
  if (m->type < kReq || m->type > kSidrRep || kHeader + m->priv_len != b.size() ||
      m->priv_len > private_limit(m->type))
    return false;
  m->sender = wire::load_be32(&b[4]);
  m->receiver = wire::load_be32(&b[8]);
  m->ps = wire::load_be16(&b[12]);
  m->port = wire::load_be16(&b[14]);
  m->src_ip = wire::load_be32(&b[16]);
  m->src_port = wire::load_be16(&b[20]);
  m->resp_res = b[22];
  m->init_depth = b[23];
  m->qpn = wire::load_be32(&b[24]) & 0xffffff;
  m->psn_or_qkey = wire::load_be32(&b[28]);
  m->retry = b[32];
  m->rnr = b[33];
  m->flags = b[34];
  m->status = b[35];
  m->dst_ip = wire::load_be32(&b[36]);
  m->priv = b.subspan(kHeader);
  return m->sender != 0;
}

template <typename T>
bool read_body(std::span<const uint8_t> body, T* out) {
  if (body.size() < sizeof(T)) return false;
  std::memcpy(out, body.data(), sizeof(T));
  return true;
}

// An IPv4 address and port from a sockaddr librdmacm passed (sockaddr_in inside a larger
// buffer). False for other families.
inline bool ipv4_of(const void* sa, uint32_t* ip, uint16_t* port) {
  sockaddr_in in;
  std::memcpy(&in, sa, sizeof(in));
  if (in.sin_family != AF_INET) return false;
  *ip = ntohl(in.sin_addr.s_addr);
  *port = ntohs(in.sin_port);
  return true;
}
inline void put_ipv4(void* sa, uint32_t ip, uint16_t port) {
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_addr.s_addr = htonl(ip);
  in.sin_port = htons(port);
  std::memcpy(sa, &in, sizeof(in));
}

inline uint8_t mtu_enum(uint32_t bytes) {  // enum ibv_mtu
  uint8_t e = 1;
  for (uint32_t b = 256; b < bytes && e < 5; b <<= 1) ++e;
  return e;
}

inline uint32_t random_u32() {
  uint32_t v = 0;
  if (getrandom(&v, sizeof(v), 0) != sizeof(v)) v = static_cast<uint32_t>(::getpid()) * 2654435761u;
  return v;
}

inline void resize_to(std::vector<uint8_t>* v, const void* p, size_t n, uint16_t out) {
  v->assign(static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + std::min<size_t>(n, out));
}

}  // namespace metaroce::engine::cm_detail

namespace metaroce::engine {

// Handles go round 1..65535 (librdmacm indexes a table by them), so that one is reused as late
// as can be: an event of a destroyed id still in a socket is told apart by the preload.
// Joins are numbered the same way (LEAVE_MCAST names one by it). 0 when all are taken.
template <typename T>
uint32_t CmService::new_handle(uint32_t owner, const std::map<uint64_t, T>& taken,
                               std::unordered_map<uint32_t, uint32_t>& next_of) {
  uint32_t& next = next_of[owner];
  for (uint32_t i = 0; i < cm_detail::kMaxIds; ++i) {
    next = next % cm_detail::kMaxIds + 1;
    if (!taken.count(key(owner, next))) return next;
  }
  return 0;
}

template <typename T>
CmService::Id* CmService::id_of(uint32_t ch, std::span<const uint8_t> body, T* c) {
  return cm_detail::read_body(body, c) ? find(ch, c->id) : nullptr;
}

}  // namespace metaroce::engine
