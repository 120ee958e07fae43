// SPDX-License-Identifier: Apache-2.0
// Packet I/O as the software NIC sees it: a port that receives and sends Ethernet frames in
// bursts. Backends: DPDK (any PMD, see dpdk_port.h) and an in-memory link for tests.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace metaroce::io {

using MacAddr = std::array<uint8_t, 6>;

// A received frame; the bytes stay valid until the port's release() is called for it.
struct RxFrame {
  const uint8_t* data = nullptr;
  uint32_t len = 0;
  void* handle = nullptr;  // backend's buffer (an rte_mbuf for DPDK)
};

// A frame being built for transmission.
struct TxFrame {
  uint8_t* data = nullptr;
  uint32_t capacity = 0;
  uint32_t len = 0;        // set by the caller before send()
  void* handle = nullptr;
};

struct PortStats {
  uint64_t rx_frames = 0, rx_bytes = 0, tx_frames = 0, tx_bytes = 0;
  uint64_t tx_dropped = 0;   // no room on the link
  uint64_t rx_missed = 0;    // from the backend, where it reports one
};

class Port {
 public:
  virtual ~Port() = default;
  virtual const MacAddr& mac() const = 0;
  virtual bool link_up() const = 0;
  // Fills up to out.size() frames; returns how many.
  virtual uint32_t rx_burst(std::span<RxFrame> out) = 0;
  virtual void release(std::span<RxFrame> frames) = 0;
  // Gets a buffer of at least `size` bytes; false when none is free.
  virtual bool alloc_tx(TxFrame& frame, uint32_t size) = 0;
  // Sends the frames (each with len set); frames the link cannot take are freed and counted in
  // tx_dropped. A frame with len 0 is freed unsent (how a caller gives back a buffer it did not
  // use). The port owns the frames afterwards.
  virtual void tx_burst(std::span<TxFrame> frames) = 0;
  // A descriptor that becomes readable when frames arrive, or -1 if the backend has none; the
  // progress thread sleeps on it when idle. rx_arm() must be called before sleeping on it.
  virtual int rx_wait_fd() = 0;
  virtual void rx_arm() = 0;
  virtual void rx_disarm() = 0;
  virtual PortStats stats() const = 0;
};

}  // namespace metaroce::io
