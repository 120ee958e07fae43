// SPDX-License-Identifier: Apache-2.0
// The engine's RDMA CM: librdmacm's commands (docs/spec/cm.md §3), one handler each, and
// multicast joins. The ids they name and the messages between engines are cm.cc's.
#include <rdma/rdma_user_cm.h>

#include <cerrno>

#include "datapath/engine/cm.h"
#include "datapath/engine/cm_internal.h"
#include "datapath/wire/mrh.h"

namespace metaroce::engine {

using namespace cm_detail;

// --- multicast ---------------------------------------------------------------------------------

// JOIN_IP_MCAST and JOIN_MCAST (docs/spec/cm.md §3.4). On Ethernet a join asks nothing of the
// fabric's subnet manager: as the kernel's CM does for RoCE, the answer is made here, and
// the application's QP joins the group's traffic with ibv_attach_mcast (librdmacm calls it
// when it reads the MULTICAST_JOIN event).
int CmService::join(uint32_t ch, uint32_t cmd, std::span<const uint8_t> body, uint16_t out,
                    std::vector<uint8_t>* resp) {
  Id* id = nullptr;
  uint64_t uid = 0;
  uint32_t group = 0;
  uint16_t port = 0;
  if (cmd == RDMA_USER_CM_CMD_JOIN_IP_MCAST) {
    rdma_ucm_join_ip_mcast c;
    if (!(id = id_of(ch, body, &c))) return EINVAL;
    uid = c.uid;
    if (!ipv4_of(&c.addr, &group, &port)) return EAFNOSUPPORT;
  } else {
    rdma_ucm_join_mcast c;
    if (!(id = id_of(ch, body, &c))) return EINVAL;
    uid = c.uid;
    if (c.join_flags != kJoinFull && c.join_flags != kJoinSendOnly) return EINVAL;
    const auto family = reinterpret_cast<const sockaddr*>(&c.addr)->sa_family;
    if (family != AF_INET) return family == AF_INET6 || family == AF_IB ? EAFNOSUPPORT : EINVAL;
    if (c.addr_size != sizeof(sockaddr_in)) return EINVAL;
    ipv4_of(&c.addr, &group, &port);
  }
  // As the kernel: a UD id with a device, i.e. bound to an address or resolved.
  if (id->qp_type != kQptUd || !((id->state == State::kBound && !id->any) ||
                                 id->state == State::kAddrResolved))
    return EINVAL;
  if (!wire::is_multicast_ipv4(group)) return EINVAL;
  const uint32_t handle = new_handle(id->owner, mcs_, next_mc_);
  if (!handle) return ENOMEM;
  Mc& mc = mcs_[key(id->owner, handle)];
  mc = {key(id->owner, id->handle), uid, handle, group};
  rdma_ucm_create_id_resp r{handle};
  resize_to(resp, &r, sizeof(r), out);
  // The event names the group as an address handle does: a datagram to it is a UD SEND to QP
  // 0xffffff at the group's GID, with the port space's Q_Key. It counts for the join (its
  // handle in `reserved`) and carries the join's uid.
  event(*id, kEvMulticastJoin, 0, ud_param(*id, {}, wire::kMulticastQpn, kUdpQkey, group), handle,
        uid);
  return 0;
}

// LEAVE_MCAST: the join ends; the preload answers how many of its events it handed out.
int CmService::leave(uint32_t ch, std::span<const uint8_t> body, uint16_t out,
                     std::vector<uint8_t>* resp) {
  rdma_ucm_destroy_id c;
  if (!read_body(body, &c)) return EINVAL;
  auto chan = channels_.find(ch);
  if (chan == channels_.end()) return EBADF;
  auto it = mcs_.find(key(chan->second.owner, c.id));
  if (it == mcs_.end()) return ENOENT;  // as the kernel: no such join
  auto id = ids_.find(it->second.id);
  if (id == ids_.end() || id->second.channel != ch) return EINVAL;  // another channel's
  mcs_.erase(it);
  rdma_ucm_destroy_id_resp r{0};
  resize_to(resp, &r, sizeof(r), out);
  return 0;
}

// --- commands ----------------------------------------------------------------------------------

int CmService::command(uint32_t ch, uint32_t cmd, std::span<const uint8_t> body,
                       std::span<const uint8_t> extra, uint16_t out, std::vector<uint8_t>* resp) {
  resp->clear();
  if (!channels_.count(ch)) return EBADF;
  switch (cmd) {
    case RDMA_USER_CM_CMD_CREATE_ID: return cmd_create_id(ch, body, out, resp);
    case RDMA_USER_CM_CMD_DESTROY_ID: return cmd_destroy_id(ch, body, out, resp);
    case RDMA_USER_CM_CMD_BIND_IP: return cmd_bind_ip(ch, body);
    case RDMA_USER_CM_CMD_BIND:
      return EAFNOSUPPORT;  // AF_IB addressing: librdmacm then uses BIND_IP and RESOLVE_IP
    case RDMA_USER_CM_CMD_RESOLVE_IP: return cmd_resolve_ip(ch, body);
    case RDMA_USER_CM_CMD_RESOLVE_ROUTE: return cmd_resolve_route(ch, body);
    case RDMA_USER_CM_CMD_QUERY_ROUTE: {
      rdma_ucm_query c;
      Id* id = id_of(ch, body, &c);
      if (!id) return EINVAL;
      return query_route(*id, out, resp);
    }
    case RDMA_USER_CM_CMD_QUERY:
      return ENOSYS;  // the AF_IB queries; librdmacm without AF_IB asks QUERY_ROUTE
    case RDMA_USER_CM_CMD_INIT_QP_ATTR: {
      rdma_ucm_init_qp_attr c;
      Id* id = id_of(ch, body, &c);
      if (!id) return EINVAL;
      return init_qp_attr(*id, c.qp_state, out, resp);
    }
    case RDMA_USER_CM_CMD_LISTEN: return cmd_listen(ch, body);
    case RDMA_USER_CM_CMD_CONNECT: return cmd_connect(ch, body);
    case RDMA_USER_CM_CMD_ACCEPT: return cmd_accept(ch, body);
    case RDMA_USER_CM_CMD_REJECT: return cmd_reject(ch, body);
    case RDMA_USER_CM_CMD_DISCONNECT: return cmd_disconnect(ch, body);
    case RDMA_USER_CM_CMD_NOTIFY: {
      rdma_ucm_notify c;
      if (!read_body(body, &c)) return EINVAL;
      return find(ch, c.id) ? 0 : EINVAL;
    }
    case RDMA_USER_CM_CMD_SET_OPTION: return cmd_set_option(ch, body, extra);
    case RDMA_USER_CM_CMD_MIGRATE_ID: return cmd_migrate_id(ch, body, out, resp);
    case RDMA_USER_CM_CMD_JOIN_IP_MCAST:
    case RDMA_USER_CM_CMD_JOIN_MCAST:
      return join(ch, cmd, body, out, resp);
    case RDMA_USER_CM_CMD_LEAVE_MCAST:
      return leave(ch, body, out, resp);
    case RDMA_USER_CM_CMD_GET_OPTION:
    default:
      return ENOSYS;
  }
}

int CmService::cmd_create_id(uint32_t ch, std::span<const uint8_t> body, uint16_t out,
                             std::vector<uint8_t>* resp) {
  rdma_ucm_create_id c;
  if (!read_body(body, &c)) return EINVAL;
  if (c.ps != RDMA_PS_TCP && c.ps != RDMA_PS_UDP && c.ps != RDMA_PS_IB &&
      c.ps != RDMA_PS_IPOIB)
    return EINVAL;
  if (c.ps == RDMA_PS_IB || c.ps == RDMA_PS_IPOIB) return EAFNOSUPPORT;  // IB addressing
  if ((c.ps == RDMA_PS_UDP) != (c.qp_type == kQptUd) || (c.qp_type != kQptRc && c.qp_type != kQptUd))
    return EINVAL;
  Id id;
  id.owner = channels_[ch].owner;
  id.handle = new_handle(id.owner, ids_, next_handle_);
  if (id.handle == 0) return ENOMEM;
  id.channel = ch;
  id.uid = c.uid;
  id.ps = c.ps;
  id.qp_type = c.qp_type;
  add(id);
  rdma_ucm_create_id_resp r{id.handle};
  resize_to(resp, &r, sizeof(r), out);
  return 0;
}

int CmService::cmd_destroy_id(uint32_t ch, std::span<const uint8_t> body, uint16_t out,
                              std::vector<uint8_t>* resp) {
  rdma_ucm_destroy_id c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  destroy(*id, true);
  rdma_ucm_destroy_id_resp r{0};  // the preload counts what it delivered
  resize_to(resp, &r, sizeof(r), out);
  return 0;
}

int CmService::cmd_bind_ip(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_bind_ip c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  if (id->state != State::kIdle) return EINVAL;
  uint32_t ip;
  uint16_t port;
  if (!ipv4_of(&c.addr, &ip, &port)) return EAFNOSUPPORT;
  return bind(*id, ip, port);
}

int CmService::cmd_resolve_ip(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_resolve_ip c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  uint32_t dst, src = 0;
  uint16_t dport, sport = 0;
  if (!ipv4_of(&c.dst_addr, &dst, &dport)) return EAFNOSUPPORT;
  const bool has_src = reinterpret_cast<const sockaddr*>(&c.src_addr)->sa_family == AF_INET;
  if (has_src) ipv4_of(&c.src_addr, &src, &sport);
  if (id->state != State::kIdle && id->state != State::kBound &&
      id->state != State::kAddrResolved)
    return EINVAL;
  const auto links = env_.links();
  dst = unloop(links, dst);
  src = unloop(links, src);
  const CmLinkInfo* l = nullptr;
  if (id->state == State::kBound && !id->any) l = link_of_ip(links, id->src_ip);
  else if (src) l = link_of_ip(links, src);
  else l = route(links, dst);
  if (!l) {
    event(*id, kEvAddrError, -EHOSTUNREACH);
    return 0;
  }
  if (id->state == State::kIdle || id->any) {
    const uint16_t keep = id->state == State::kBound ? id->src_port : sport;
    id->state = State::kIdle;
    if (int e = bind(*id, l->ip, keep)) return e;
  }
  id->dst_ip = dst;
  id->dst_port = dport;
  id->peer_ip = dst;
  id->state = State::kAddrResolved;
  event(*id, kEvAddrResolved, 0);
  return 0;
}

int CmService::cmd_resolve_route(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_resolve_route c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  if (id->state != State::kAddrResolved && id->state != State::kRouteResolved) return EINVAL;
  id->state = State::kRouteResolved;
  event(*id, kEvRouteResolved, 0);
  return 0;
}

int CmService::cmd_listen(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_listen c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  if (id->state == State::kIdle)
    if (int e = bind(*id, 0, 0)) return e;
  if (id->state != State::kBound && id->state != State::kListening) return EINVAL;
  for (const auto& [h, other] : ids_)
    if (&other != id && other.state == State::kListening && other.ps == id->ps &&
        other.src_port == id->src_port && (other.any || id->any || other.src_ip == id->src_ip))
      return EADDRINUSE;
  id->state = State::kListening;
  return 0;
}

int CmService::cmd_connect(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_connect c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  if (id->state != State::kRouteResolved) return EINVAL;
  const rdma_ucm_conn_param& p = c.conn_param;
  const bool ud = id->qp_type == kQptUd;
  if (p.private_data_len > private_limit(ud ? kSidrReq : kReq)) return EINVAL;
  id->local_qpn = p.qp_num;
  id->resp_res = p.responder_resources;
  id->init_depth = p.initiator_depth;
  id->retry_count = std::min<uint8_t>(p.retry_count, 7);
  id->rnr_retry = std::min<uint8_t>(p.rnr_retry_count, 7);
  id->local_psn = random_u32() & 0xffffff;
  id->deadline = env_.now() + kExchangeTimeout;
  id->state = ud ? State::kSidrReqSent : State::kReqSent;
  send(*id, ud ? kSidrReq : kReq, {p.private_data, p.private_data_len});
  return 0;
}

int CmService::cmd_accept(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_accept c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  const rdma_ucm_conn_param& p = c.conn_param;
  if (id->state == State::kRepRcvd) {  // the active side, after CONNECT_RESPONSE: RTU
    id->state = State::kEstablished;
    id->deadline = transport::Time{0};
    send(*id, kRtu, {});
    return 0;
  }
  if (id->state == State::kSidrReqRcvd) {
    if (p.private_data_len > private_limit(kSidrRep)) return EINVAL;
    id->uid = c.uid;
    id->local_qpn = p.qp_num;
    id->qkey = p.qkey ? p.qkey : kUdpQkey;
    id->state = State::kSidrDone;
    send(*id, kSidrRep, {p.private_data, p.private_data_len}, kSidrOk);
    return 0;
  }
  if (id->state != State::kReqRcvd) return EINVAL;
  if (p.private_data_len > private_limit(kRep)) return EINVAL;
  id->uid = c.uid;
  if (p.valid) {
    id->local_qpn = p.qp_num;
    id->resp_res = p.responder_resources;
    id->init_depth = p.initiator_depth;
    id->rnr_retry = std::min<uint8_t>(p.rnr_retry_count, 7);
  }
  id->state = State::kRepSent;
  id->deadline = env_.now() + kExchangeTimeout;
  send(*id, kRep, {p.private_data, p.private_data_len});
  return 0;
}

int CmService::cmd_reject(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_reject c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  if (id->state == State::kSidrReqRcvd) {
    id->state = State::kRejected;
    send(*id, kSidrRep, {c.private_data, std::min<size_t>(c.private_data_len, 136)}, kSidrReject);
    return 0;
  }
  if (id->state != State::kReqRcvd && id->state != State::kRepRcvd) return EINVAL;
  id->state = State::kRejected;
  send(*id, kRej, {c.private_data, std::min<size_t>(c.private_data_len, 148)}, kRejConsumer);
  return 0;
}

int CmService::cmd_disconnect(uint32_t ch, std::span<const uint8_t> body) {
  rdma_ucm_disconnect c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  if (id->state == State::kEstablished || id->state == State::kRepRcvd) {
    id->state = State::kDreqSent;
    id->deadline = env_.now() + kDreqTimeout;
    send(*id, kDreq, {});
    return 0;
  }
  if (id->state == State::kDisconnected || id->state == State::kDreqSent) return 0;
  return EINVAL;
}

int CmService::cmd_set_option(uint32_t ch, std::span<const uint8_t> body,
                              std::span<const uint8_t> extra) {
  rdma_ucm_set_option c;
  Id* id = id_of(ch, body, &c);
  if (!id) return EINVAL;
  if (extra.size() != c.optlen) return EINVAL;
  if (c.level != RDMA_OPTION_ID) return ENOSYS;  // RDMA_OPTION_IB_PATH: IB routing
  switch (c.optname) {
    case RDMA_OPTION_ID_TOS:
      if (extra.size() != 1) return EINVAL;
      id->tos = extra[0];
      return 0;
    case RDMA_OPTION_ID_REUSEADDR:
    case RDMA_OPTION_ID_AFONLY: {
      int v;
      if (extra.size() != sizeof(v)) return EINVAL;
      std::memcpy(&v, extra.data(), sizeof(v));
      if (c.optname == RDMA_OPTION_ID_REUSEADDR) {
        if (id->state != State::kIdle) return EINVAL;
        id->reuse = v != 0;
      }
      return 0;
    }
    case RDMA_OPTION_ID_ACK_TIMEOUT:
      if (extra.size() != 1 || extra[0] > 31) return EINVAL;
      id->ack_timeout = extra[0];
      return 0;
    default:
      return ENOSYS;
  }
}

int CmService::cmd_migrate_id(uint32_t ch, std::span<const uint8_t> body, uint16_t out,
                              std::vector<uint8_t>* resp) {
  rdma_ucm_migrate_id c;
  if (!read_body(body, &c)) return EINVAL;
  // Written to the new channel; fd names the one the id is on (its number, from the preload).
  Id* id = find(c.fd, c.id);
  if (!id || channels_[ch].owner != id->owner) return EINVAL;  // a process's own channels
  id->channel = ch;
  rdma_ucm_migrate_resp r{0};  // the preload counts what it delivered
  resize_to(resp, &r, sizeof(r), out);
  return 0;
}

}  // namespace metaroce::engine
