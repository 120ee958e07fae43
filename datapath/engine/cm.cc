// SPDX-License-Identifier: Apache-2.0
// The engine's RDMA CM (docs/spec/cm.md): its channels, the ids librdmacm's commands
// (cm_commands.cc) name, their queries, and the CM messages that carry connection requests
// between engines.
#include "datapath/engine/cm.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <rdma/rdma_user_cm.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "datapath/engine/cm_internal.h"
#include "datapath/nic/link_config.h"
#include "datapath/wire/bytes.h"
#include "datapath/wire/mrh.h"

namespace metaroce::engine {

using namespace cm_detail;

// --- channels ----------------------------------------------------------------------------------

uint32_t CmService::open_channel(int event_fd, uint32_t owner) {
  uint32_t ch = next_channel_++;
  if (ch == 0) ch = next_channel_++;
  channels_[ch].fd = event_fd;
  channels_[ch].owner = owner;
  return ch;
}

void CmService::close_channel(uint32_t ch) {
  auto it = channels_.find(ch);
  if (it == channels_.end()) return;
  std::vector<uint64_t> mine;
  for (auto& [k, id] : ids_)
    if (id.channel == ch) mine.push_back(k);
  for (uint64_t k : mine)
    if (auto i = ids_.find(k); i != ids_.end()) destroy(i->second, true);
  const uint32_t owner = it->second.owner;
  if (it->second.fd >= 0) close(it->second.fd);
  channels_.erase(ch);
  bool owner_left = false;
  for (const auto& [n, c] : channels_) owner_left |= c.owner == owner;
  if (!owner_left) {
    next_handle_.erase(owner);
    next_mc_.erase(owner);  // joins are numbered per process too
  }
}

void CmService::write_event(Channel& c, std::vector<uint8_t> ev) {
  if (c.pending.empty() &&
      ::send(c.fd, ev.data(), ev.size(), MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(ev.size()))
    return;
  c.pending.push_back(std::move(ev));  // written by tick() once the application reads
}

bool CmService::wants_tick_soon() const {
  for (const auto& [n, c] : channels_)
    if (!c.pending.empty()) return true;
  return false;
}

void CmService::event(Id& id, uint32_t type, int32_t status, std::span<const uint8_t> param,
                      uint32_t owner, uint64_t uid) {
  auto c = channels_.find(id.channel);
  if (c == channels_.end()) return;
  rdma_ucm_event_resp ev{};
  ev.uid = uid ? uid : id.uid;
  ev.id = id.handle;
  ev.event = type;
  ev.status = static_cast<uint32_t>(status);
  if (!param.empty()) std::memcpy(&ev.param, param.data(), std::min(param.size(), sizeof(ev.param)));
  ev.reserved = owner;  // the preload's to read (and zero): which id's count the event is in
  const auto* p = reinterpret_cast<const uint8_t*>(&ev);
  write_event(c->second, {p, p + sizeof(ev)});
}

// --- ids ---------------------------------------------------------------------------------------

CmService::Id& CmService::add(Id id) {
  do {
    id.comm = random_u32();
  } while (id.comm == 0 || comms_.count(id.comm));
  const uint64_t k = key(id.owner, id.handle);
  comms_[id.comm] = k;
  return ids_[k] = std::move(id);
}

CmService::Id* CmService::find(uint32_t ch, uint32_t handle) {
  auto c = channels_.find(ch);
  if (c == channels_.end()) return nullptr;
  auto it = ids_.find(key(c->second.owner, handle));
  return it == ids_.end() || it->second.channel != ch ? nullptr : &it->second;
}

CmService::Id* CmService::by_comm(uint32_t comm) {
  auto c = comms_.find(comm);
  if (c == comms_.end()) return nullptr;
  auto it = ids_.find(c->second);
  return it == ids_.end() ? nullptr : &it->second;
}

const CmLinkInfo* CmService::link_of_ip(const std::vector<CmLinkInfo>& links, uint32_t ip) const {
  for (const auto& l : links)
    if (l.ip == ip) return &l;
  return nullptr;
}

// The link a destination is reached on: its own address, then the link whose subnet holds
// it, then the only link there is.
const CmLinkInfo* CmService::route(const std::vector<CmLinkInfo>& links, uint32_t dst) const {
  if (auto* l = link_of_ip(links, dst)) return l;
  for (const auto& l : links) {
    const uint32_t mask = l.prefix == 0 ? 0 : ~uint32_t{0} << (32 - std::min<uint8_t>(l.prefix, 32));
    if ((l.ip & mask) == (dst & mask)) return &l;
  }
  return links.size() == 1 ? &links[0] : nullptr;
}

bool CmService::port_taken(uint16_t ps, uint32_t ip, uint16_t port, const Id* except) const {
  for (const auto& [h, id] : ids_) {
    if (&id == except || id.ps != ps || id.src_port != port || id.listener != 0) continue;
    if (id.state == State::kIdle) continue;
    if (id.any || ip == 0 || id.src_ip == ip) {
      if (except && except->reuse && id.reuse && id.state != State::kListening) continue;
      return true;
    }
  }
  return false;
}

uint16_t CmService::ephemeral(uint16_t ps, uint32_t ip) const {
  const uint32_t start = random_u32();
  for (uint32_t i = 0; i < 28232; ++i) {
    const auto port = static_cast<uint16_t>(32768 + (start + i) % 28232);
    if (!port_taken(ps, ip, port, nullptr)) return port;
  }
  return 0;
}

// A loopback address (127.0.0.0/8) stands for the host's first link, as the kernel's CM binds
// and resolves one on its first active device (cm.md §1): libfabric's verbs provider binds
// 127.0.0.1 to learn which device a passive endpoint would use.
uint32_t CmService::unloop(const std::vector<CmLinkInfo>& links, uint32_t ip) {
  return (ip >> 24) == 127 && !links.empty() ? links.front().ip : ip;
}

int CmService::bind(Id& id, uint32_t ip, uint16_t port) {
  const auto links = env_.links();
  std::string link;
  ip = unloop(links, ip);
  if (ip != 0) {
    const CmLinkInfo* l = link_of_ip(links, ip);
    if (!l) return EADDRNOTAVAIL;
    link = l->name;
  }
  if (port == 0) port = ephemeral(id.ps, ip);
  if (port == 0) return EADDRINUSE;
  if (port_taken(id.ps, ip, port, &id)) return EADDRINUSE;
  id.src_ip = ip;
  id.src_port = port;
  id.any = ip == 0;
  id.link = link;
  id.state = State::kBound;
  return 0;
}

void CmService::send(Id& id, uint8_t type, std::span<const uint8_t> priv, uint8_t reason) {
  Msg m;
  m.type = type;
  m.sender = id.comm;
  m.receiver = id.remote_comm;
  m.ps = id.ps;
  m.port = id.dst_port;
  m.src_ip = id.src_ip;
  m.src_port = id.src_port;
  m.dst_ip = id.dst_ip;
  m.resp_res = id.resp_res;
  m.init_depth = id.init_depth;
  m.qpn = id.local_qpn;
  m.psn_or_qkey = type == kSidrRep ? id.qkey : id.local_psn;
  m.retry = id.retry_count;
  m.rnr = id.rnr_retry;
  m.status = reason;
  m.priv = priv.subspan(0, std::min(priv.size(), private_limit(type)));
  const std::vector<uint8_t> bytes = encode(m);
  env_.send(id.link, id.peer_ip, bytes, (uint64_t{id.comm} << 8) | type);
}

// Destroys an id; notify_peer: its connection (or the exchange under way) is ended towards
// the peer first, as the kernel's CM does when an id is destroyed or its file closes.
void CmService::destroy(Id& id, bool notify_peer) {
  if (notify_peer) {
    switch (id.state) {
      case State::kEstablished:
      case State::kRepRcvd:
        send(id, kDreq, {});
        break;
      case State::kReqSent:
      case State::kReqRcvd:
      case State::kRepSent:
        send(id, kRej, {}, kRejConsumer);
        break;
      case State::kSidrReqRcvd:
        send(id, kSidrRep, {}, kSidrReject);
        break;
      default:
        break;
    }
  }
  const uint64_t k = key(id.owner, id.handle);
  std::erase_if(mcs_, [k](const auto& m) { return m.second.id == k; });  // its joins go with it
  comms_.erase(id.comm);
  ids_.erase(k);
}

std::vector<uint8_t> CmService::conn_param(const Id&, std::span<const uint8_t> priv, uint32_t qpn,
                                           uint8_t resp_res, uint8_t init_depth, uint8_t retry,
                                           uint8_t rnr, bool srq) const {
  rdma_ucm_conn_param p{};
  p.qp_num = qpn;
  const size_t n = std::min(priv.size(), sizeof(p.private_data));
  if (n) std::memcpy(p.private_data, priv.data(), n);
  p.private_data_len = static_cast<uint8_t>(n);
  p.responder_resources = resp_res;
  p.initiator_depth = init_depth;
  p.retry_count = retry;
  p.rnr_retry_count = rnr;
  p.srq = srq;
  const auto* b = reinterpret_cast<const uint8_t*>(&p);
  return {b, b + sizeof(p)};
}

std::vector<uint8_t> CmService::ud_param(const Id& id, std::span<const uint8_t> priv, uint32_t qpn,
                                         uint32_t qkey, uint32_t dst_ip) const {
  rdma_ucm_ud_param p{};
  p.qp_num = qpn;
  p.qkey = qkey;
  nic::ipv4_to_gid(dst_ip ? dst_ip : id.peer_ip, p.ah_attr.grh.dgid);
  p.ah_attr.grh.sgid_index = 0;
  p.ah_attr.grh.hop_limit = kHopLimit;
  p.ah_attr.grh.traffic_class = id.tos;
  p.ah_attr.is_global = 1;
  p.ah_attr.port_num = 1;
  const size_t n = std::min(priv.size(), sizeof(p.private_data));
  if (n) std::memcpy(p.private_data, priv.data(), n);
  p.private_data_len = static_cast<uint8_t>(n);
  const auto* b = reinterpret_cast<const uint8_t*>(&p);
  return {b, b + sizeof(p)};
}

// --- queries -----------------------------------------------------------------------------------

int CmService::query_route(const Id& id, uint16_t out, std::vector<uint8_t>* resp) const {
  rdma_ucm_query_route_resp r{};
  r.ibdev_index = ~0u;  // match the device by GUID
  r.port_num = 1;
  const auto links = env_.links();
  const CmLinkInfo* l = id.link.empty() ? nullptr : link_of_ip(links, id.src_ip);
  if (l) r.node_guid = htobe64(l->node_guid);
  put_ipv4(&r.src_addr, id.src_ip, id.src_port);
  if (id.dst_ip || id.dst_port) put_ipv4(&r.dst_addr, id.dst_ip, id.dst_port);
  const bool routed = l && id.peer_ip != 0 &&
                      id.state != State::kIdle && id.state != State::kBound &&
                      id.state != State::kAddrResolved && id.state != State::kListening;
  if (l) {
    ib_user_path_rec& p = r.ib_route[0];
    nic::ipv4_to_gid(id.src_ip, p.sgid);
    nic::ipv4_to_gid(id.peer_ip ? id.peer_ip : id.dst_ip, p.dgid);
    p.pkey = htons(0xffff);
    p.mtu = mtu_enum(l->active_mtu);
    p.hop_limit = kHopLimit;
    p.traffic_class = id.tos;
    p.numb_path = 1;
    p.reversible = 1;
    p.rate = 2;  // IB_RATE_2_5_GBPS: a value, not the link's speed (RoCE ignores it)
    p.packet_life_time = 14;
    p.mtu_selector = 2;
    p.rate_selector = 2;
    p.packet_life_time_selector = 2;
  }
  r.num_paths = routed ? 1 : 0;
  resize_to(resp, &r, sizeof(r), out);
  return 0;
}

int CmService::init_qp_attr(const Id& id, uint32_t state, uint16_t out,
                            std::vector<uint8_t>* resp) const {
  if (id.link.empty()) return EINVAL;
  ib_uverbs_qp_attr a{};
  a.qp_state = state;
  a.port_num = 1;
  a.pkey_index = 0;
  const bool ud = id.qp_type == kQptUd;
  if (state == kQpsInit) {
    a.qp_attr_mask = kMaskState | kMaskPkey | kMaskPort;
    if (ud) {
      a.qp_attr_mask |= kMaskQkey;
      a.qkey = id.ps == RDMA_PS_UDP ? kUdpQkey : id.qkey;
    } else {
      a.qp_attr_mask |= kMaskAccess;
      a.qp_access_flags = kAccessRemoteWrite;
      if (id.resp_res) a.qp_access_flags |= kAccessRemoteRead | kAccessRemoteAtomic;
    }
  } else if (state == kQpsRtr) {
    if (ud) {
      a.qp_attr_mask = kMaskState;
    } else {
      if (id.remote_qpn == 0) return EINVAL;  // no peer yet
      a.qp_attr_mask = kMaskState | kMaskAv | kMaskPathMtu | kMaskDestQpn | kMaskRqPsn |
                       kMaskMaxDestRdAtomic | kMaskMinRnr;
      const auto links = env_.links();
      const CmLinkInfo* l = link_of_ip(links, id.src_ip);
      a.path_mtu = mtu_enum(l ? l->active_mtu : 1024);
      a.dest_qp_num = id.remote_qpn;
      a.rq_psn = id.remote_psn;
      a.max_dest_rd_atomic = id.resp_res;
      a.min_rnr_timer = kMinRnrTimer;
      nic::ipv4_to_gid(id.peer_ip, a.ah_attr.grh.dgid);
      a.ah_attr.grh.sgid_index = 0;
      a.ah_attr.grh.hop_limit = kHopLimit;
      a.ah_attr.grh.traffic_class = id.tos;
      a.ah_attr.is_global = 1;
      a.ah_attr.port_num = 1;
    }
  } else if (state == kQpsRts) {
    a.qp_attr_mask = kMaskState | kMaskSqPsn;
    a.sq_psn = ud ? 0 : id.local_psn;
    if (!ud) {
      a.qp_attr_mask |= kMaskTimeout | kMaskRetry | kMaskRnrRetry | kMaskMaxQpRdAtomic;
      a.timeout = id.ack_timeout;
      a.retry_cnt = id.retry_count;
      a.rnr_retry = id.rnr_retry;
      a.max_rd_atomic = id.init_depth;
    }
  } else {
    return EINVAL;
  }
  resize_to(resp, &a, sizeof(a), out);
  return 0;
}

// --- messages ----------------------------------------------------------------------------------

void CmService::on_req(const std::string& link, uint32_t peer_ip, std::span<const uint8_t> b,
                       bool sidr) {
  Msg m;
  decode(b, &m);
  // A REQ seen again (the transport may give a packet twice) is the child it made.
  for (const auto& [h, id] : ids_)
    if (id.listener && id.peer_ip == peer_ip && id.remote_comm == m.sender) return;
  const auto links = env_.links();
  const CmLinkInfo* l = link_of_ip(links, m.dst_ip);
  Id* listener = nullptr;
  if (l && l->name == link)
    for (auto& [h, id] : ids_)
      if (id.state == State::kListening && id.ps == m.ps && id.src_port == m.port &&
          (id.any || id.src_ip == m.dst_ip)) {
        listener = &id;
        break;
      }
  Id child;
  child.comm = random_u32() | 1;  // for a rejection; add() gives a kept id its own
  child.remote_comm = m.sender;
  child.peer_ip = peer_ip;
  child.link = link;
  child.src_ip = m.dst_ip;
  child.src_port = m.port;
  child.dst_ip = m.src_ip;
  child.dst_port = m.src_port;
  child.ps = m.ps;
  if (!listener) {
    // Nobody listens there: the requester hears so (REJ, invalid service ID).
    send(child, sidr ? kSidrRep : kRej, {}, sidr ? kSidrNoListener : kRejInvalidService);
    return;
  }
  child.channel = listener->channel;
  child.listener = listener->handle;
  child.qp_type = listener->qp_type;
  child.tos = listener->tos;
  child.ack_timeout = listener->ack_timeout;
  child.remote_qpn = m.qpn;
  child.remote_psn = m.psn_or_qkey & 0xffffff;
  child.resp_res = m.init_depth;  // what the requester will read from us
  child.init_depth = m.resp_res;
  child.retry_count = m.retry;
  child.rnr_retry = m.rnr;
  child.local_psn = random_u32() & 0xffffff;
  child.state = sidr ? State::kSidrReqRcvd : State::kReqRcvd;
  child.owner = listener->owner;
  child.handle = new_handle(child.owner, ids_, next_handle_);
  if (child.handle == 0) {
    send(child, sidr ? kSidrRep : kRej, {}, sidr ? kSidrReject : kRejConsumer);
    return;
  }
  const uint64_t listen_uid = listener->uid;
  const uint32_t listen_handle = listener->handle;
  Id& c = add(child);
  // The event names the listener's uid and the new id's handle (librdmacm makes the id then).
  c.uid = listen_uid;
  if (sidr)
    event(c, kEvConnectRequest, 0, ud_param(c, m.priv, 0, 0), listen_handle);
  else
    event(c, kEvConnectRequest, 0,
          conn_param(c, m.priv, m.qpn, m.init_depth, m.resp_res, m.retry, m.rnr,
                     m.flags & kFlagSrq),
          listen_handle);
  c.uid = 0;  // until accept names it
}

void CmService::on_message(const std::string& link, uint32_t peer_ip, std::span<const uint8_t> b) {
  Msg m;
  if (!decode(b, &m)) {
    env_.log("cm: a malformed CM message dropped");
    return;
  }
  if (m.type == kReq || m.type == kSidrReq) {
    on_req(link, peer_ip, b, m.type == kSidrReq);
    return;
  }
  Id* id = m.receiver ? by_comm(m.receiver) : nullptr;
  if (!id && m.type == kRej) {
    // A requester that gave up before our REP reached it does not know our id: the request
    // it names is ours to forget.
    for (auto& [h, x] : ids_)
      if (x.listener && x.peer_ip == peer_ip && x.remote_comm == m.sender) {
        id = &x;
        break;
      }
  }
  if (!id || id->peer_ip != peer_ip) return;  // not ours (a stale or forged message)
  if (id->remote_comm != 0 && id->remote_comm != m.sender) return;
  switch (m.type) {
    case kRep:
      if (id->state != State::kReqSent) return;
      id->remote_comm = m.sender;
      id->remote_qpn = m.qpn;
      id->remote_psn = m.psn_or_qkey & 0xffffff;
      id->rnr_retry = m.rnr;
      id->state = State::kRepRcvd;
      id->deadline = transport::Time{0};
      event(*id, kEvConnectResponse, 0,
            conn_param(*id, m.priv, m.qpn, m.init_depth, m.resp_res, m.retry, m.rnr,
                       m.flags & kFlagSrq));
      return;
    case kRtu:
      if (id->state != State::kRepSent) return;
      id->state = State::kEstablished;
      id->deadline = transport::Time{0};
      event(*id, kEvEstablished, 0, conn_param(*id, {}, id->remote_qpn, 0, 0, 0, 0, false));
      return;
    case kRej: {
      const State was = id->state;
      if (was != State::kReqSent && was != State::kRepSent && was != State::kReqRcvd &&
          was != State::kRepRcvd)
        return;
      id->state = State::kRejected;
      id->deadline = transport::Time{0};
      // A child nobody accepted yet has no uid: librdmacm would drop the event anyway.
      if (was != State::kReqRcvd)
        event(*id, kEvRejected, m.status, conn_param(*id, m.priv, 0, 0, 0, 0, 0, false));
      return;
    }
    case kDreq:
      if (id->state == State::kEstablished || id->state == State::kRepRcvd ||
          id->state == State::kRepSent) {
        id->state = State::kDisconnected;
        send(*id, kDrep, {});
        event(*id, kEvDisconnected, 0);
      } else if (id->state == State::kDreqSent) {  // both ended it at once
        id->state = State::kDisconnected;
        id->deadline = transport::Time{0};
        send(*id, kDrep, {});
        event(*id, kEvDisconnected, 0);
      } else if (id->state == State::kDisconnected) {
        send(*id, kDrep, {});
      }
      return;
    case kDrep:
      if (id->state != State::kDreqSent) return;
      id->state = State::kDisconnected;
      id->deadline = transport::Time{0};
      event(*id, kEvDisconnected, 0);
      return;
    case kSidrRep:
      if (id->state != State::kSidrReqSent) return;
      id->deadline = transport::Time{0};
      if (m.status != kSidrOk) {
        id->state = State::kRejected;
        event(*id, kEvUnreachable, m.status == kSidrNoListener ? -ECONNREFUSED : -EINVAL,
              ud_param(*id, m.priv, 0, 0));
        return;
      }
      id->remote_comm = m.sender;
      id->remote_qpn = m.qpn;
      id->remote_qkey = m.psn_or_qkey;
      id->state = State::kSidrDone;
      event(*id, kEvEstablished, 0, ud_param(*id, m.priv, m.qpn, m.psn_or_qkey));
      return;
    default:
      return;
  }
}

void CmService::on_sent(uint64_t token, bool delivered) {
  if (delivered) return;
  Id* id = by_comm(static_cast<uint32_t>(token >> 8));
  if (!id) return;
  const auto type = static_cast<uint8_t>(token);
  // The peer's engine could not be reached: what waited for it ends now.
  if ((type == kReq && id->state == State::kReqSent) ||
      (type == kSidrReq && id->state == State::kSidrReqSent) ||
      (type == kRep && id->state == State::kRepSent)) {
    id->state = State::kRejected;
    id->deadline = transport::Time{0};
    event(*id, kEvUnreachable, -ETIMEDOUT);
  } else if (type == kDreq && id->state == State::kDreqSent) {
    id->state = State::kDisconnected;
    id->deadline = transport::Time{0};
    event(*id, kEvDisconnected, 0);
  }
}

void CmService::tick() {
  for (auto& [n, c] : channels_) {
    while (!c.pending.empty()) {
      const auto& ev = c.pending.front();
      if (::send(c.fd, ev.data(), ev.size(), MSG_DONTWAIT | MSG_NOSIGNAL) !=
          static_cast<ssize_t>(ev.size()))
        break;
      c.pending.pop_front();
    }
  }
  const transport::Time t = env_.now();
  for (auto& [h, id] : ids_) {
    if (id.deadline == transport::Time{0} || t < id.deadline) continue;
    id.deadline = transport::Time{0};
    switch (id.state) {
      case State::kReqSent:
      case State::kRepSent:
        send(id, kRej, {}, kRejTimeout);
        [[fallthrough]];
      case State::kSidrReqSent:
        id.state = State::kRejected;
        event(id, kEvUnreachable, -ETIMEDOUT);
        break;
      case State::kDreqSent:
        id.state = State::kDisconnected;
        event(id, kEvDisconnected, 0);
        break;
      default:
        break;
    }
  }
}

}  // namespace metaroce::engine
