// SPDX-License-Identifier: Apache-2.0
// `metaroce capture`: the frames a link sends and receives, written as a pcap file (Ethernet
// link type) to a descriptor the operator's command handed the engine. Frames of UDP-socket
// planes get the Ethernet, IPv4 and UDP headers the kernel would put on the wire, so the same
// tools (tshark with dist/wireshark/metaroce.lua) read both.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace metaroce::nic {

struct CaptureStats {
  uint64_t frames = 0;   // written
  uint64_t dropped = 0;  // not written: the file refused them
  bool done = false;     // max_frames reached, or the file failed
};

class Capture {
 public:
  // fd: where the pcap goes (owned: closed by the destructor); the global header is written
  // here. snaplen: bytes kept per frame; max_frames: 0 = no limit; planes: bit p = plane p.
  Capture(int fd, uint32_t snaplen, uint64_t max_frames, uint32_t planes);
  ~Capture();
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;

  bool wants(uint8_t plane) const { return !stats_.done && (planes_ >> plane & 1) != 0; }
  void frame(std::span<const uint8_t> bytes);
  // A UDP payload of a socket plane, framed as the kernel would have framed it.
  void datagram(uint32_t src_ip, uint32_t dst_ip, uint16_t src_port, uint16_t dst_port,
                bool ecn_ce, std::span<const uint8_t> payload);
  void flush();
  const CaptureStats& stats() const { return stats_; }

 private:
  void record(std::span<const uint8_t> head, std::span<const uint8_t> body);
  int fd_;
  uint32_t snaplen_;
  uint64_t max_frames_;
  uint32_t planes_;
  CaptureStats stats_;
  std::vector<uint8_t> buf_;
};

}  // namespace metaroce::nic
