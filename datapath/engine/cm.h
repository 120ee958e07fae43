// SPDX-License-Identifier: Apache-2.0
// Connection management for librdmacm without a kernel (docs/spec/cm.md): the host's RDMA CM,
// run by the engine on its control thread. Channels are the `/dev/infiniband/rdma_cm` files the
// preload opens for librdmacm; commands are the kernel's ucma ABI (<rdma/rdma_user_cm.h>,
// version 4) with the caller's pointers resolved by the preload; events go to the channel's
// event socket, one struct rdma_ucm_event_resp per message. Connection requests, replies and
// disconnections travel between engines as CM messages on the link's transport (nic::Nic::
// cm_send).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "datapath/transport/engine.h"

namespace metaroce::engine {

// What the CM knows of a link of the engine.
struct CmLinkInfo {
  std::string name;
  uint32_t ip = 0;         // host order
  uint8_t prefix = 24;
  uint64_t node_guid = 0;  // host order, as sysfs shows it
  uint32_t active_mtu = 0; // bytes
};

class CmService {
 public:
  struct Env {
    // The engine's kernel-free links now.
    std::function<std::vector<CmLinkInfo>()> links;
    // Sends a CM message on link to the engine at peer_ip; on_sent(token, ...) follows.
    std::function<void(const std::string& link, uint32_t peer_ip, std::span<const uint8_t> msg,
                       uint64_t token)>
        send;
    std::function<transport::Time()> now;
    std::function<void(const char*)> log;
  };
  explicit CmService(Env env) : env_(std::move(env)) {}

  // A new channel of process `owner` whose events go to event_fd (taken; a SOCK_SEQPACKET
  // end). Its number. Ids are numbered per owner (librdmacm's table of them is per process).
  uint32_t open_channel(int event_fd, uint32_t owner = 0);
  // The channel's file was closed or its process died: every id of it is destroyed (peers hear
  // a disconnection or a rejection).
  void close_channel(uint32_t ch);
  bool has_channel(uint32_t ch) const { return channels_.count(ch) != 0; }
  // One ucma command of channel ch: cmd (RDMA_USER_CM_CMD_*), the body that follows the
  // header (pointers already resolved: `extra` carries SET_OPTION's value, MIGRATE_ID's fd
  // field names a channel number). The response (at most `out` bytes) goes to *resp. 0 or a
  // positive errno.
  int command(uint32_t ch, uint32_t cmd, std::span<const uint8_t> body,
              std::span<const uint8_t> extra, uint16_t out, std::vector<uint8_t>* resp);
  // A CM message from the engine at peer_ip, received on link.
  void on_message(const std::string& link, uint32_t peer_ip, std::span<const uint8_t> bytes);
  // Whether the peer's transport took message token (false: it could not be delivered).
  void on_sent(uint64_t token, bool delivered);
  // Timeouts; event writes a full socket put off. Call at least every second.
  void tick();
  bool wants_tick_soon() const;  // events wait for room in a channel's socket
  size_t id_count() const { return ids_.size(); }
  size_t mc_count() const { return mcs_.size(); }  // multicast joins
  size_t channel_count() const { return channels_.size(); }

 private:
  enum class State : uint8_t {
    kIdle, kBound, kAddrResolved, kRouteResolved, kListening,
    kReqSent,       // active RC: REQ out, waiting for REP
    kReqRcvd,       // passive RC: CONNECT_REQUEST given, waiting for accept
    kRepSent,       // passive RC: REP out, waiting for RTU
    kRepRcvd,       // active RC: CONNECT_RESPONSE given, waiting for accept (RTU)
    kEstablished,
    kDreqSent,      // DREQ out, waiting for DREP
    kDisconnected,
    kSidrReqSent,   // active UD: SIDR REQ out
    kSidrReqRcvd,   // passive UD: CONNECT_REQUEST given
    kSidrDone,
    kRejected,      // the peer rejected or went away before establishment
  };
  struct Id {
    uint32_t handle = 0;          // librdmacm's index for it: below 2^16 (its id map's size)
    uint32_t owner = 0;           // the process of its channel: handles are per process
    uint32_t comm = 0;            // its communication id in CM messages (random)
    uint32_t channel = 0;
    uint64_t uid = 0;
    uint16_t ps = 0;
    uint8_t qp_type = 0;
    State state = State::kIdle;
    std::string link;             // the device it is bound to ("" = every link, for listening)
    uint32_t src_ip = 0, dst_ip = 0;
    uint16_t src_port = 0, dst_port = 0;
    bool any = false;             // bound to the wildcard address
    bool reuse = false;
    uint8_t ack_timeout = 14;     // verbs timeout code of its QP (RDMA_OPTION_ID_ACK_TIMEOUT)
    uint8_t tos = 0;
    uint32_t listener = 0;        // a child: the listening id it came from
    // Connection.
    uint32_t peer_ip = 0;         // the other engine
    uint32_t remote_comm = 0;
    uint32_t local_qpn = 0, remote_qpn = 0, local_psn = 0, remote_psn = 0;
    uint32_t qkey = 0, remote_qkey = 0;
    uint8_t resp_res = 0, init_depth = 0;         // ours (what our QP offers / asks)
    uint8_t retry_count = 7, rnr_retry = 7;
    transport::Time deadline{0};  // of the state, 0 = none
  };
  struct Channel {
    int fd = -1;
    uint32_t owner = 0;
    std::deque<std::vector<uint8_t>> pending;  // events the socket had no room for
  };

  // A multicast join of an id (JOIN_IP_MCAST/JOIN_MCAST; docs/spec/cm.md §3.4): what the
  // MULTICAST_JOIN event names, and what LEAVE_MCAST ends. Handles are per process, as ids'.
  struct Mc {
    uint64_t id = 0;   // key of its id
    uint64_t uid = 0;  // librdmacm's for it (its events carry it)
    uint32_t handle = 0;
    uint32_t group = 0;
  };

  Id* find(uint32_t ch, uint32_t handle);
  // librdmacm's commands that take more than a line (cm_commands.cc), as command() names them.
  int cmd_create_id(uint32_t ch, std::span<const uint8_t> body, uint16_t out,
                    std::vector<uint8_t>* resp);
  int cmd_destroy_id(uint32_t ch, std::span<const uint8_t> body, uint16_t out,
                     std::vector<uint8_t>* resp);
  int cmd_bind_ip(uint32_t ch, std::span<const uint8_t> body);
  int cmd_resolve_ip(uint32_t ch, std::span<const uint8_t> body);
  int cmd_resolve_route(uint32_t ch, std::span<const uint8_t> body);
  int cmd_listen(uint32_t ch, std::span<const uint8_t> body);
  int cmd_connect(uint32_t ch, std::span<const uint8_t> body);
  int cmd_accept(uint32_t ch, std::span<const uint8_t> body);
  int cmd_reject(uint32_t ch, std::span<const uint8_t> body);
  int cmd_disconnect(uint32_t ch, std::span<const uint8_t> body);
  int cmd_set_option(uint32_t ch, std::span<const uint8_t> body, std::span<const uint8_t> extra);
  int cmd_migrate_id(uint32_t ch, std::span<const uint8_t> body, uint16_t out,
                     std::vector<uint8_t>* resp);
  int join(uint32_t ch, uint32_t cmd, std::span<const uint8_t> body, uint16_t out,
           std::vector<uint8_t>* resp);
  int leave(uint32_t ch, std::span<const uint8_t> body, uint16_t out, std::vector<uint8_t>* resp);
  // A command's structure read from body into *c, and the id of channel ch it names; nullptr
  // when the body is short or names no id of the channel (EINVAL either way).
  template <typename T>
  Id* id_of(uint32_t ch, std::span<const uint8_t> body, T* c);
  Id* by_comm(uint32_t comm);  // ids are their own communication ids
  const CmLinkInfo* link_of_ip(const std::vector<CmLinkInfo>& links, uint32_t ip) const;
  const CmLinkInfo* route(const std::vector<CmLinkInfo>& links, uint32_t dst) const;
  static uint32_t unloop(const std::vector<CmLinkInfo>& links, uint32_t ip);
  bool port_taken(uint16_t ps, uint32_t ip, uint16_t port, const Id* except) const;
  uint16_t ephemeral(uint16_t ps, uint32_t ip) const;
  int bind(Id& id, uint32_t ip, uint16_t port);
  // owner: the id the event counts for when it is not id (a connection request: its listener;
  // a multicast event: its join). uid: the event's when not the id's (a join's; librdmacm's
  // uids are its pointers, never 0).
  void event(Id& id, uint32_t type, int32_t status, std::span<const uint8_t> param = {},
             uint32_t owner = 0, uint64_t uid = 0);
  void write_event(Channel& c, std::vector<uint8_t> ev);
  void send(Id& id, uint8_t type, std::span<const uint8_t> priv, uint8_t reason = 0);
  void destroy(Id& id, bool notify_peer);
  // A handle of owner's that `taken` (ids_, or mcs_ for joins) does not hold, going round
  // 1..65535 from next_of[owner]; 0 when every one is taken.
  template <typename T>
  static uint32_t new_handle(uint32_t owner, const std::map<uint64_t, T>& taken,
                             std::unordered_map<uint32_t, uint32_t>& next_of);
  static uint64_t key(uint32_t owner, uint32_t handle) { return (uint64_t{owner} << 32) | handle; }
  Id& add(Id id);  // a new id, given its handle and communication id
  std::vector<uint8_t> conn_param(const Id& id, std::span<const uint8_t> priv, uint32_t qpn,
                                  uint8_t resp_res, uint8_t init_depth, uint8_t retry,
                                  uint8_t rnr, bool srq) const;
  // dst_ip: the address handle's destination when not the id's peer (a multicast group).
  std::vector<uint8_t> ud_param(const Id& id, std::span<const uint8_t> priv, uint32_t qpn,
                                uint32_t qkey, uint32_t dst_ip = 0) const;
  int query_route(const Id& id, uint16_t out, std::vector<uint8_t>* resp) const;
  int init_qp_attr(const Id& id, uint32_t state, uint16_t out, std::vector<uint8_t>* resp) const;
  void on_req(const std::string& link, uint32_t peer_ip, std::span<const uint8_t> m, bool sidr);

  Env env_;
  std::unordered_map<uint32_t, Channel> channels_;
  std::map<uint64_t, Id> ids_;  // by key(owner, handle)
  std::unordered_map<uint32_t, uint64_t> comms_;  // communication id -> key
  uint32_t next_channel_ = 1;
  std::unordered_map<uint32_t, uint32_t> next_handle_;  // per owner
  std::map<uint64_t, Mc> mcs_;                          // by key(owner, handle)
  std::unordered_map<uint32_t, uint32_t> next_mc_;      // per owner
};

}  // namespace metaroce::engine
