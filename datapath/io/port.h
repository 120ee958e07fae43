// SPDX-License-Identifier: Apache-2.0
// Packet I/O as the software NIC sees it: a port that receives and sends in bursts, either
// Ethernet frames (DPDK, any PMD: dpdk_port.h; the in-memory link for tests) or the UDP payloads
// of the link's port through the kernel's sockets (udp_port.h).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace metaroce::io {

using MacAddr = std::array<uint8_t, 6>;

// What a port carries. kEthernet: whole frames; the link layer frames, addresses and resolves
// them. kUdp: UDP payloads (MetaRoCE headers first); the kernel routes, resolves and frames them,
// so a frame's addressing travels beside its bytes (RxFrame/TxFrame's UDP fields).
enum class PortKind : uint8_t { kEthernet, kUdp };

// Where a packet for a peer goes first on a port's network (link.md §2): the next hop (the peer
// itself when it is on the link, else a router) and, when the kernel already knows it, the next
// hop's MAC.
struct NextHop {
  uint32_t ip = 0;        // host byte order
  bool mac_known = false;
  MacAddr mac{};
};

// A received frame; the bytes stay valid until the port's release() is called for it.
struct RxFrame {
  const uint8_t* data = nullptr;
  uint32_t len = 0;
  void* handle = nullptr;  // backend's buffer (an rte_mbuf for DPDK)
  // kUdp ports: the sender's address and port, and whether the IP header was CE-marked.
  uint32_t src_ip = 0;
  uint16_t src_port = 0;
  bool ecn_ce = false;
};

// A frame being built for transmission.
struct TxFrame {
  uint8_t* data = nullptr;
  uint32_t capacity = 0;
  uint32_t len = 0;        // set by the caller before send()
  void* handle = nullptr;
  // kUdp ports: where the payload goes and from which UDP source port (the path's entropy).
  uint32_t dst_ip = 0;
  uint16_t src_port = 0;
  // With tail set (ports that takes_tails() only), the frame's last tail_len bytes (of len) are
  // sent from tail instead of from data + len - tail_len: a payload the port copies straight
  // from application memory, once, instead of the NIC copying it into the frame first.
  const uint8_t* tail = nullptr;
  uint32_t tail_len = 0;
};

struct PortStats {
  uint64_t rx_frames = 0, rx_bytes = 0, tx_frames = 0, tx_bytes = 0;
  uint64_t tx_dropped = 0;   // no room on the link
  uint64_t rx_missed = 0;    // from the backend, where it reports one
  // Kicks that sent frames the backend had left in its TX ring (af_xdp, af_packet:
  // DpdkPort::kick_late).
  uint64_t tx_late_kicks = 0;
};

class Port {
 public:
  virtual ~Port() = default;
  virtual PortKind kind() const { return PortKind::kEthernet; }
  // The kernel interface the port sends through ("" for none: memif, a PCI port bound to DPDK).
  virtual std::string kernel_interface() const { return {}; }
  // The next hop towards peer_ip (kEthernet ports). Ports with a kernel interface ask the
  // kernel's routes and neighbours (a blocking netlink call: only on the first packet to a peer
  // and at a slow refresh); others say the peer is on the link, and ARP finds its MAC.
  virtual NextHop next_hop(uint32_t peer_ip) { return NextHop{peer_ip, false, {}}; }
  virtual const MacAddr& mac() const = 0;
  virtual bool link_up() const = 0;
  // Fills up to out.size() frames; returns how many.
  virtual uint32_t rx_burst(std::span<RxFrame> out) = 0;
  virtual void release(std::span<RxFrame> frames) = 0;
  // Gets a buffer of at least `size` bytes; false when none is free.
  virtual bool alloc_tx(TxFrame& frame, uint32_t size) = 0;
  // Whether tx_burst reads a frame's tail (TxFrame::tail) before it returns, so that the tail
  // may point at memory that stays valid only until then: ports whose backend copies each frame
  // into its own ring as it sends (memif, af_packet, the in-memory link), not one whose device
  // reads the buffer later (DMA) or one that keeps frames queued.
  virtual bool takes_tails() const { return false; }
  // Sends the frames (each with len set); frames the link cannot take are freed and counted in
  // tx_dropped. A frame with len 0 is freed unsent (how a caller gives back a buffer it did not
  // use). The port owns the frames afterwards.
  virtual void tx_burst(std::span<TxFrame> frames) = 0;
  // Sends the frames in order while the link has room and returns how many it took; those it did
  // not take stay the caller's (handles kept, nothing counted), to be offered again or given back.
  // How a NIC's own datagrams wait for room instead of being lost (link_layer.cc, send_raw).
  // Every frame has its len set (none is given back here) and none has a tail. Ports that
  // cannot tell take all.
  virtual uint32_t tx_try(std::span<TxFrame> frames) {
    tx_burst(frames);
    return static_cast<uint32_t>(frames.size());
  }
  // A descriptor that becomes readable when frames arrive, or -1 if the backend has none; the
  // progress thread sleeps on it when idle. rx_arm() must be called before sleeping on it.
  virtual int rx_wait_fd() = 0;
  virtual void rx_arm() = 0;
  virtual void rx_disarm() = 0;
  virtual PortStats stats() const = 0;
};

}  // namespace metaroce::io
