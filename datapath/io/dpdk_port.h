// SPDX-License-Identifier: Apache-2.0
// DPDK backend of io::Port: EAL brought up once per process on a dedicated thread, ports opened
// by device string (vdev or PCI address) through hot-plug.
#pragma once

#include <memory>
#include <string>

#include "datapath/io/port.h"

namespace metaroce::io {

// The largest link MTU an af_xdp port carries: DPDK 22.11 makes each buffer one UMEM chunk of a
// page, of which headers, headrooms and alignment take 640 bytes (dpdk_port.cc).
inline constexpr uint32_t kAfXdpMaxMtu = 3442;

struct DpdkPortConfig {
  std::string devargs;        // "net_memif0,role=server,socket=/run/x.sock" or "0000:03:00.0"
  uint32_t mtu = 9000;        // link MTU (IP packet bytes); frames up to mtu + 14
  uint16_t rx_descriptors = 1024;
  uint16_t tx_descriptors = 1024;
  bool hugepages = false;     // EAL on hugepages; the first port opened in a process decides
};

// Opens (or re-attaches to, within one process) the DPDK port. Returns nullptr and a one-line
// reason in *err when EAL or the device refuses.
std::unique_ptr<Port> open_dpdk_port(const DpdkPortConfig& cfg, std::string* err);

}  // namespace metaroce::io
