// SPDX-License-Identifier: Apache-2.0
// KernelNet: rtnetlink questions through libnl-route (RTM_GETLINK, RTM_GETROUTE, RTM_GETNEIGH).
#include "datapath/io/kernel_net.h"

#include <arpa/inet.h>
#include <linux/neighbour.h>
#include <linux/rtnetlink.h>
#include <net/if.h>

#include <netlink/addr.h>
#include <netlink/msg.h>
#include <netlink/netlink.h>
#include <netlink/route/link.h>
#include <netlink/route/neighbour.h>
#include <netlink/route/nexthop.h>
#include <netlink/route/route.h>
#include <netlink/socket.h>

#include <cstring>

namespace metaroce::io {
namespace {

struct SockDeleter {
  void operator()(nl_sock* s) const { nl_socket_free(s); }
};
using SockPtr = std::unique_ptr<nl_sock, SockDeleter>;

SockPtr connect_route(std::string* err) {
  SockPtr s(nl_socket_alloc());
  if (!s) {
    *err = "cannot allocate a netlink socket";
    return nullptr;
  }
  if (const int rc = nl_connect(s.get(), NETLINK_ROUTE); rc < 0) {
    *err = std::string("cannot reach rtnetlink: ") + nl_geterror(rc);
    return nullptr;
  }
  // One request, one answer: an acknowledgement left behind would be read as the next answer.
  nl_socket_disable_auto_ack(s.get());
  return s;
}

std::optional<InterfaceInfo> query_link(nl_sock* s, const std::string& ifname, std::string* err) {
  if (ifname.empty() || ifname.size() >= IFNAMSIZ) {
    *err = "bad interface name '" + ifname + "'";
    return std::nullopt;
  }
  rtnl_link* link = nullptr;
  if (const int rc = rtnl_link_get_kernel(s, 0, ifname.c_str(), &link); rc < 0 || !link) {
    *err = "no interface " + ifname + " in this network namespace";
    return std::nullopt;
  }
  InterfaceInfo info;
  info.ifindex = rtnl_link_get_ifindex(link);
  info.mtu = rtnl_link_get_mtu(link);
  const unsigned flags = rtnl_link_get_flags(link);
  info.up = (flags & IFF_UP) != 0;
  info.running = (flags & IFF_RUNNING) != 0;
  rtnl_link_put(link);
  return info;
}

// The gateway (host order) of the route the kernel picks for dst leaving through ifindex; 0
// when the route is direct, nullopt when there is none.
std::optional<uint32_t> route_gateway(nl_sock* s, uint32_t dst, int ifindex) {
  nl_msg* msg = nlmsg_alloc_simple(RTM_GETROUTE, 0);
  if (!msg) return std::nullopt;
  rtmsg rtm{};
  rtm.rtm_family = AF_INET;
  rtm.rtm_dst_len = 32;
  const uint32_t be = htonl(dst);
  if (nlmsg_append(msg, &rtm, sizeof(rtm), NLMSG_ALIGNTO) < 0 ||
      nla_put(msg, RTA_DST, sizeof(be), &be) < 0 ||
      nla_put_u32(msg, RTA_OIF, static_cast<uint32_t>(ifindex)) < 0) {
    nlmsg_free(msg);
    return std::nullopt;
  }
  const int sent = nl_send_auto(s, msg);
  nlmsg_free(msg);
  if (sent < 0) return std::nullopt;
  struct Result {
    bool found = false;
    uint32_t gateway = 0;
  } result;
  auto on_valid = [](nl_msg* m, void* arg) -> int {
    auto* r = static_cast<Result*>(arg);
    rtnl_route* route = nullptr;
    if (rtnl_route_parse(nlmsg_hdr(m), &route) < 0 || !route) return NL_SKIP;
    if (rtnl_route_get_type(route) == RTN_UNICAST || rtnl_route_get_type(route) == RTN_LOCAL) {
      r->found = true;
      if (rtnl_route_get_nnexthops(route) > 0) {
        nl_addr* gw = rtnl_route_nh_get_gateway(rtnl_route_nexthop_n(route, 0));
        if (gw && nl_addr_get_family(gw) == AF_INET && nl_addr_get_len(gw) == 4) {
          uint32_t g;
          std::memcpy(&g, nl_addr_get_binary_addr(gw), 4);
          r->gateway = ntohl(g);
        }
      }
    }
    rtnl_route_put(route);
    return NL_OK;
  };
  nl_socket_modify_cb(s, NL_CB_VALID, NL_CB_CUSTOM, on_valid, &result);
  // A destination without a route answers with an error (ENETUNREACH): no route.
  if (nl_recvmsgs_default(s) < 0 || !result.found) return std::nullopt;
  return result.gateway;
}

// The MAC of ip on ifindex from the kernel's neighbour table, when the entry is usable.
bool neighbour_mac(nl_sock* s, uint32_t ip, int ifindex, MacAddr* mac) {
  nl_cache* cache = nullptr;
  if (rtnl_neigh_alloc_cache(s, &cache) < 0 || !cache) return false;
  const uint32_t be = htonl(ip);
  nl_addr* addr = nl_addr_build(AF_INET, &be, sizeof(be));
  bool ok = false;
  if (addr) {
    if (rtnl_neigh* n = rtnl_neigh_get(cache, ifindex, addr)) {
      const int state = rtnl_neigh_get_state(n);
      nl_addr* ll = rtnl_neigh_get_lladdr(n);
      // STALE and DELAY still name the right station; INCOMPLETE and FAILED name none.
      constexpr int kUsable = NUD_REACHABLE | NUD_STALE | NUD_DELAY | NUD_PROBE | NUD_PERMANENT |
                              NUD_NOARP;
      if ((state & kUsable) && ll && nl_addr_get_len(ll) == 6) {
        std::memcpy(mac->data(), nl_addr_get_binary_addr(ll), 6);
        ok = true;
      }
      rtnl_neigh_put(n);
    }
    nl_addr_put(addr);
  }
  nl_cache_free(cache);
  return ok;
}

}  // namespace

std::optional<InterfaceInfo> interface_info(const std::string& ifname, std::string* err) {
  std::string scratch;
  if (!err) err = &scratch;
  SockPtr s = connect_route(err);
  if (!s) return std::nullopt;
  return query_link(s.get(), ifname, err);
}

std::unique_ptr<KernelNet> KernelNet::open(const std::string& ifname, std::string* err) {
  std::string scratch;
  if (!err) err = &scratch;
  SockPtr s = connect_route(err);
  if (!s) return nullptr;
  auto info = query_link(s.get(), ifname, err);
  if (!info) return nullptr;
  std::unique_ptr<KernelNet> k(new KernelNet());
  k->sock_ = s.release();
  k->ifname_ = ifname;
  k->ifindex_ = info->ifindex;
  return k;
}

KernelNet::~KernelNet() {
  if (sock_) nl_socket_free(sock_);
}

bool KernelNet::running() {
  std::string err;
  auto info = query_link(sock_, ifname_, &err);
  return info && info->running;
}

NextHop KernelNet::next_hop(uint32_t peer_ip) {
  NextHop h{peer_ip, false, {}};
  if (auto gw = route_gateway(sock_, peer_ip, ifindex_); gw && *gw != 0) h.ip = *gw;
  h.mac_known = neighbour_mac(sock_, h.ip, ifindex_, &h.mac);
  return h;
}

}  // namespace metaroce::io
