// SPDX-License-Identifier: Apache-2.0
// The UDP-socket backend of io::Port, for hosts without a DPDK-capable NIC or the privileges
// DPDK needs: MetaRoCE packets are the payloads of kernel UDP sockets, batched with
// sendmmsg/recvmmsg and segmented/coalesced by the kernel (UDP GSO and GRO). The wire is the
// same as a DPDK port's (docs/spec/link.md §5): the kernel writes the Ethernet, IPv4 and UDP
// headers, routes and resolves.
#pragma once

#include <memory>
#include <string>

#include "datapath/io/port.h"

namespace metaroce::io {

struct UdpPortConfig {
  uint32_t ip = 0;          // the link's address, host order: every packet's source; must be
                            // an address of this host (ip addr add ... dev lo will do)
  uint16_t udp_port = 4793; // the link's destination port: everything arrives there
  std::string iface;        // the plane's kernel interface; "" lets the kernel route
  uint32_t mtu = 9000;      // link MTU (IP packet bytes)
};

// Binds the receiving socket (and, with an interface, to that interface). nullptr and a one-line
// reason when the address is not this host's, the port is taken or the interface is missing.
std::unique_ptr<Port> open_udp_port(const UdpPortConfig& cfg, std::string* err);

}  // namespace metaroce::io
