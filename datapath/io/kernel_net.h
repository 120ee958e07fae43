// SPDX-License-Identifier: Apache-2.0
// What the kernel knows about the network of a port that has a kernel interface (af_packet,
// af_xdp, the UDP-socket backend): the interface's index, MTU and carrier, the route towards a
// peer through that interface, and the neighbour (ARP) entry of its next hop. Read through
// libnl (rtnetlink), in the network namespace of the calling process.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "datapath/io/port.h"

struct nl_sock;  // libnl

namespace metaroce::io {

struct InterfaceInfo {
  int ifindex = 0;
  uint32_t mtu = 0;
  bool up = false;       // administratively up
  bool running = false;  // up with carrier
};

// Facts about one interface by name; nullopt and a one-line reason when there is none.
std::optional<InterfaceInfo> interface_info(const std::string& ifname, std::string* err);

class KernelNet {
 public:
  // Opens a netlink socket for questions about interface `ifname`; nullptr and *err when the
  // interface does not exist or netlink cannot be reached.
  static std::unique_ptr<KernelNet> open(const std::string& ifname, std::string* err);
  ~KernelNet();
  KernelNet(const KernelNet&) = delete;
  KernelNet& operator=(const KernelNet&) = delete;

  const std::string& ifname() const { return ifname_; }
  int ifindex() const { return ifindex_; }
  // Whether the interface is up with carrier now (one netlink round trip).
  bool running();
  // The next hop towards peer_ip (host byte order) leaving through this interface: the gateway
  // of the kernel's route restricted to the interface (`ip route get PEER oif IFACE`), or the
  // peer itself when the route is direct or there is none; with the next hop's MAC when the
  // kernel's neighbour table holds a usable entry for it on this interface.
  NextHop next_hop(uint32_t peer_ip);

 private:
  KernelNet() = default;
  ::nl_sock* sock_ = nullptr;
  std::string ifname_;
  int ifindex_ = 0;
};

}  // namespace metaroce::io
