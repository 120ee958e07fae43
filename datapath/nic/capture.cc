// SPDX-License-Identifier: Apache-2.0
// pcap records, buffered and written when 64 KiB are pending or the capture ends.
#include "datapath/nic/capture.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>

#include "datapath/wire/frame.h"

namespace metaroce::nic {
namespace {

constexpr size_t kFlushAt = 64 << 10;
constexpr uint32_t kPcapMagicNs = 0xa1b23c4d;  // nanosecond timestamps
constexpr uint32_t kLinkTypeEthernet = 1;

template <typename T>
void put(std::vector<uint8_t>& b, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  b.insert(b.end(), p, p + sizeof(v));
}

}  // namespace

Capture::Capture(int fd, uint32_t snaplen, uint64_t max_frames, uint32_t planes)
    : fd_(fd), snaplen_(std::max<uint32_t>(snaplen, 64)), max_frames_(max_frames),
      planes_(planes) {
  // Native byte order, as libpcap writes it; readers swap by the magic.
  put(buf_, kPcapMagicNs);
  put(buf_, uint16_t{2});
  put(buf_, uint16_t{4});
  put(buf_, int32_t{0});
  put(buf_, uint32_t{0});
  put(buf_, snaplen_);
  put(buf_, kLinkTypeEthernet);
  flush();
}

Capture::~Capture() {
  flush();
  if (fd_ >= 0) close(fd_);
}

void Capture::record(std::span<const uint8_t> head, std::span<const uint8_t> body) {
  if (stats_.done) return;
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  const uint32_t orig = static_cast<uint32_t>(head.size() + body.size());
  const uint32_t incl = std::min(orig, snaplen_);
  put(buf_, static_cast<uint32_t>(ts.tv_sec));
  put(buf_, static_cast<uint32_t>(ts.tv_nsec));
  put(buf_, incl);
  put(buf_, orig);
  const size_t h = std::min<size_t>(head.size(), incl);
  buf_.insert(buf_.end(), head.begin(), head.begin() + static_cast<ptrdiff_t>(h));
  buf_.insert(buf_.end(), body.begin(), body.begin() + static_cast<ptrdiff_t>(incl - h));
  ++stats_.frames;
  if (max_frames_ != 0 && stats_.frames >= max_frames_) stats_.done = true;
  if (buf_.size() >= kFlushAt || stats_.done) flush();
}

void Capture::frame(std::span<const uint8_t> bytes) { record({}, bytes); }

void Capture::datagram(uint32_t src_ip, uint32_t dst_ip, uint16_t src_port, uint16_t dst_port,
                       bool ecn_ce, std::span<const uint8_t> payload) {
  uint8_t head[wire::kUdpFrameHeaderLen];
  wire::UdpFrameParams a;
  a.src_mac = {0x02, 0, 0, 0, 0, 1};  // the kernel's frame is not ours to see
  a.dst_mac = {0x02, 0, 0, 0, 0, 2};
  a.src_ip = src_ip;
  a.dst_ip = dst_ip;
  a.src_port = src_port;
  a.dst_port = dst_port;
  a.ecn = ecn_ce ? wire::Ecn::kCe : wire::Ecn::kEct0;
  wire::write_udp_headers({head, sizeof(head)}, a, static_cast<uint32_t>(payload.size()));
  record({head, sizeof(head)}, payload);
}

void Capture::flush() {
  size_t off = 0;
  while (off < buf_.size() && fd_ >= 0) {
    const ssize_t n = write(fd_, buf_.data() + off, buf_.size() - off);
    if (n <= 0) {
      stats_.done = true;  // a full disk or a closed pipe: stop, keep the engine going
      ++stats_.dropped;
      break;
    }
    off += static_cast<size_t>(n);
  }
  buf_.clear();
}

}  // namespace metaroce::nic
