// SPDX-License-Identifier: Apache-2.0
// The UDP-socket port: one receiving socket bound to the link's address and port (to the
// plane's interface, if one is named) with UDP GRO, and one sending socket per UDP source port
// (a path's entropy: the kernel lets a socket send only from the port it is bound to), created
// on first use. A burst to send is grouped by (peer, source port), in order within each group,
// so that the packets of one path leave as one GSO message.
#include "datapath/io/udp_port.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "datapath/io/kernel_net.h"

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

namespace metaroce::io {
namespace {

constexpr uint32_t kIpUdpHeaders = 28;
constexpr uint32_t kRxBufBytes = 65536;      // a GRO'd datagram is at most 64 KiB
constexpr uint32_t kRxBatch = 16;            // datagrams per recvmmsg
constexpr uint32_t kMaxGsoSegments = 64;     // UDP_MAX_SEGMENTS of the kernels we support
constexpr uint32_t kMaxGsoBytes = 65535 - kIpUdpHeaders;
constexpr uint32_t kMaxSendMsgs = 64;
constexpr size_t kMaxTxSockets = 4096;       // past it, the sockets are closed and made anew
constexpr int kSocketBuffer = 4 << 20;
constexpr uint8_t kEct0 = 0x02;

std::string errno_text(int e) { return std::strerror(e); }

void set_buffer(int fd, int force_opt, int opt) {
  int v = kSocketBuffer;
  if (setsockopt(fd, SOL_SOCKET, force_opt, &v, sizeof(v)) != 0)
    setsockopt(fd, SOL_SOCKET, opt, &v, sizeof(v));
}

sockaddr_in inet(uint32_t ip, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(ip);
  a.sin_port = htons(port);
  return a;
}

class UdpPort final : public Port {
 public:
  UdpPort(const UdpPortConfig& cfg, int rx_fd)
      : cfg_(cfg), rx_fd_(rx_fd), tx_capacity_(std::max<uint32_t>(cfg.mtu, 2048)) {}

  ~UdpPort() override {
    close_tx_sockets();
    close(rx_fd_);
  }

  PortKind kind() const override { return PortKind::kUdp; }
  std::string kernel_interface() const override { return cfg_.iface; }
  const MacAddr& mac() const override { return mac_; }

  bool link_up() const override {
    if (cfg_.iface.empty()) return true;
    ifreq ifr{};
    std::strncpy(ifr.ifr_name, cfg_.iface.c_str(), IFNAMSIZ - 1);
    return ioctl(rx_fd_, SIOCGIFFLAGS, &ifr) == 0 && (ifr.ifr_flags & IFF_RUNNING) != 0;
  }

  uint32_t rx_burst(std::span<RxFrame> out) override {
    uint32_t filled = 0;
    while (filled < out.size() && pending_pos_ < pending_.size())
      out[filled++] = pending_[pending_pos_++];
    if (pending_pos_ < pending_.size() || filled == out.size()) return filled;
    pending_.clear();
    pending_pos_ = 0;

    const uint32_t want = std::min<uint32_t>(kRxBatch, static_cast<uint32_t>(out.size() - filled));
    RxBuf* bufs[kRxBatch];
    mmsghdr msgs[kRxBatch];
    iovec iov[kRxBatch];
    sockaddr_in from[kRxBatch];
    alignas(cmsghdr) char ctrl[kRxBatch][CMSG_SPACE(sizeof(int)) * 2 + 32];
    for (uint32_t i = 0; i < want; ++i) {
      bufs[i] = take_rx_buf();
      iov[i] = {bufs[i]->data.get(), kRxBufBytes};
      msgs[i] = {};
      msgs[i].msg_hdr.msg_name = &from[i];
      msgs[i].msg_hdr.msg_namelen = sizeof(from[i]);
      msgs[i].msg_hdr.msg_iov = &iov[i];
      msgs[i].msg_hdr.msg_iovlen = 1;
      msgs[i].msg_hdr.msg_control = ctrl[i];
      msgs[i].msg_hdr.msg_controllen = sizeof(ctrl[i]);
    }
    const int got = recvmmsg(rx_fd_, msgs, want, MSG_DONTWAIT, nullptr);
    uint64_t frames = 0, bytes = 0, bad = 0;
    for (uint32_t i = 0; i < want; ++i) {
      RxBuf* b = bufs[i];
      if (got <= 0 || i >= static_cast<uint32_t>(got)) {
        free_rx_.push_back(b);
        continue;
      }
      const msghdr& h = msgs[i].msg_hdr;
      const uint32_t len = msgs[i].msg_len;
      if ((h.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || len == 0 ||
          h.msg_namelen != sizeof(sockaddr_in)) {
        ++bad;
        free_rx_.push_back(b);
        continue;
      }
      uint32_t seg = len;
      bool ce = false;
      for (cmsghdr* c = CMSG_FIRSTHDR(&h); c; c = CMSG_NXTHDR(const_cast<msghdr*>(&h), c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
          int v;
          std::memcpy(&v, CMSG_DATA(c), sizeof(v));
          if (v > 0) seg = static_cast<uint32_t>(v);
        } else if (c->cmsg_level == SOL_IP && c->cmsg_type == IP_TOS) {
          ce = (*CMSG_DATA(c) & 3) == 3;
        }
      }
      RxFrame f;
      f.handle = b;
      f.src_ip = ntohl(from[i].sin_addr.s_addr);
      f.src_port = ntohs(from[i].sin_port);
      f.ecn_ce = ce;
      // A coalesced datagram is segments of `seg` bytes, the last one possibly shorter.
      for (uint32_t off = 0; off < len; off += seg) {
        f.data = b->data.get() + off;
        f.len = std::min(seg, len - off);
        ++b->refs;
        if (filled < out.size()) out[filled++] = f;
        else pending_.push_back(f);
        ++frames;
        bytes += f.len;
      }
    }
    rx_frames_.fetch_add(frames, std::memory_order_relaxed);
    rx_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    if (bad) rx_bad_.fetch_add(bad, std::memory_order_relaxed);
    return filled;
  }

  void release(std::span<RxFrame> frames) override {
    for (RxFrame& f : frames) {
      auto* b = static_cast<RxBuf*>(f.handle);
      f.handle = nullptr;
      if (b && --b->refs == 0) free_rx_.push_back(b);
    }
  }

  bool alloc_tx(TxFrame& frame, uint32_t size) override {
    if (size > tx_capacity_) return false;
    TxBuf* b;
    if (free_tx_.empty()) {
      tx_pool_.push_back(std::make_unique<TxBuf>());
      b = tx_pool_.back().get();
      b->data = std::make_unique<uint8_t[]>(tx_capacity_);
    } else {
      b = free_tx_.back();
      free_tx_.pop_back();
    }
    frame = TxFrame{b->data.get(), tx_capacity_, 0, b, 0, 0};
    return true;
  }

  // sendmmsg copies every frame, tails too, before it returns.
  bool takes_tails() const override { return true; }

  void tx_burst(std::span<TxFrame> frames) override {
    // Groups by (peer, source port) in order of first appearance; within a group, in order.
    groups_.clear();
    for (uint32_t i = 0; i < frames.size(); ++i) {
      TxFrame& f = frames[i];
      if (!f.handle) continue;
      if (f.len == 0) {  // an unused buffer given back
        give_back(f);
        continue;
      }
      Group* g = nullptr;
      for (Group& x : groups_)
        if (x.ip == f.dst_ip && x.port == f.src_port) g = &x;
      if (!g) {
        groups_.push_back(Group{f.dst_ip, f.src_port, {}});
        g = &groups_.back();
      }
      g->frames.push_back(i);
    }
    for (Group& g : groups_) send_group(g, frames);
    for (Group& g : groups_)
      for (uint32_t i : g.frames) give_back(frames[i]);
  }

  int rx_wait_fd() override { return rx_fd_; }
  void rx_arm() override {}
  void rx_disarm() override {}

  PortStats stats() const override {
    PortStats s;
    s.rx_frames = rx_frames_.load(std::memory_order_relaxed);
    s.rx_bytes = rx_bytes_.load(std::memory_order_relaxed);
    s.tx_frames = tx_frames_.load(std::memory_order_relaxed);
    s.tx_bytes = tx_bytes_.load(std::memory_order_relaxed);
    s.tx_dropped = tx_dropped_.load(std::memory_order_relaxed);
    s.rx_missed = rx_bad_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  struct RxBuf {
    std::unique_ptr<uint8_t[]> data;
    uint32_t refs = 0;
  };
  struct TxBuf {
    std::unique_ptr<uint8_t[]> data;
  };
  struct Group {
    uint32_t ip;
    uint16_t port;
    std::vector<uint32_t> frames;
  };

  RxBuf* take_rx_buf() {
    if (!free_rx_.empty()) {
      RxBuf* b = free_rx_.back();
      free_rx_.pop_back();
      return b;
    }
    rx_pool_.push_back(std::make_unique<RxBuf>());
    rx_pool_.back()->data = std::make_unique<uint8_t[]>(kRxBufBytes);
    return rx_pool_.back().get();
  }

  void give_back(TxFrame& f) {
    free_tx_.push_back(static_cast<TxBuf*>(f.handle));
    f.handle = nullptr;
  }

  // The socket that sends from `port`, bound on first use. A port another program holds is
  // served by the receiving socket (source port = the link's): those packets still arrive, on
  // whatever path the network gives that port.
  int tx_socket(uint16_t port) {
    if (auto it = tx_.find(port); it != tx_.end()) return it->second;
    if (tx_.size() >= kMaxTxSockets) close_tx_sockets();
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
      configure_sender(fd, cfg_.iface);
      const sockaddr_in a = inet(cfg_.ip, port);
      if (bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
        close(fd);
        fd = -1;
      }
    }
    if (fd < 0) {
      fd = rx_fd_;
      port_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    }
    tx_[port] = fd;
    return fd;
  }

  void close_tx_sockets() {
    for (auto& [port, fd] : tx_)
      if (fd != rx_fd_) close(fd);
    tx_.clear();
  }

  void send_group(const Group& g, std::span<TxFrame> frames) {
    const int fd = tx_socket(g.port);
    const sockaddr_in dst = inet(g.ip, cfg_.udp_port);
    size_t next = 0;
    while (next < g.frames.size()) {
      // Messages of up to kMaxSendMsgs, each a GSO run of equal segments (the last may be
      // shorter) when the kernel takes them, else one packet each.
      uint32_t nmsg = 0, niov = 0;
      while (next < g.frames.size() && nmsg < kMaxSendMsgs) {
        msg_seg_[nmsg] = frames[g.frames[next]].len;
        msg_count_[nmsg] = 0;
        msg_first_[nmsg] = static_cast<uint32_t>(next);
        const uint32_t first_iov = niov;
        uint32_t bytes = 0;
        while (next < g.frames.size() && niov + 2 <= kMaxIov) {
          const TxFrame& f = frames[g.frames[next]];
          const uint32_t n = msg_count_[nmsg];
          if (n > 0 && (!gso_ || f.len > msg_seg_[nmsg] || n == kMaxGsoSegments ||
                        bytes + f.len > kMaxGsoBytes))
            break;
          niov += frame_iov(f, &iov_[niov]);
          bytes += f.len;
          ++msg_count_[nmsg];
          ++next;
          if (f.len < msg_seg_[nmsg]) break;  // a short segment ends the run
        }
        mmsghdr& m = msgs_[nmsg];
        m = {};
        m.msg_hdr.msg_name = const_cast<sockaddr_in*>(&dst);
        m.msg_hdr.msg_namelen = sizeof(dst);
        m.msg_hdr.msg_iov = &iov_[first_iov];
        m.msg_hdr.msg_iovlen = niov - first_iov;
        if (msg_count_[nmsg] > 1) {
          m.msg_hdr.msg_control = ctrl_[nmsg];
          m.msg_hdr.msg_controllen = CMSG_SPACE(sizeof(uint16_t));
          cmsghdr* c = CMSG_FIRSTHDR(&m.msg_hdr);
          c->cmsg_level = SOL_UDP;
          c->cmsg_type = UDP_SEGMENT;
          c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
          const auto seg = static_cast<uint16_t>(msg_seg_[nmsg]);
          std::memcpy(CMSG_DATA(c), &seg, sizeof(seg));
        }
        ++nmsg;
        if (niov + 2 > kMaxIov) break;
      }
      uint32_t done = 0;
      while (done < nmsg) {
        const int r = sendmmsg(fd, msgs_ + done, nmsg - done, MSG_DONTWAIT);
        if (r > 0) {
          for (int k = 0; k < r; ++k) count_sent(msgs_[done + k], msg_count_[done + k]);
          done += static_cast<uint32_t>(r);
          continue;
        }
        const int e = errno;
        if (gso_ && msg_count_[done] > 1 && (e == EIO || e == EINVAL || e == EOPNOTSUPP)) {
          // This route's device cannot segment: packet by packet from now on, this one too.
          gso_ = false;
          for (uint32_t k = 0; k < msg_count_[done]; ++k)
            send_one(fd, dst, frames[g.frames[msg_first_[done] + k]]);
        } else {
          tx_dropped_.fetch_add(msg_count_[done], std::memory_order_relaxed);
        }
        ++done;
      }
    }
  }

  // The frame as out[0] (and, with a tail, out[1]); returns how many iovecs it took.
  static uint32_t frame_iov(const TxFrame& f, iovec* out) {
    const uint32_t tail = f.tail ? std::min(f.tail_len, f.len) : 0;
    out[0] = {f.data, f.len - tail};
    if (tail == 0) return 1;
    out[1] = {const_cast<uint8_t*>(f.tail), tail};
    return 2;
  }

  void send_one(int fd, const sockaddr_in& dst, const TxFrame& f) {
    msghdr m{};
    m.msg_name = const_cast<sockaddr_in*>(&dst);
    m.msg_namelen = sizeof(dst);
    m.msg_iov = iov_one_;
    m.msg_iovlen = frame_iov(f, iov_one_);
    if (sendmsg(fd, &m, MSG_DONTWAIT) < 0) {
      tx_dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    tx_frames_.fetch_add(1, std::memory_order_relaxed);
    tx_bytes_.fetch_add(f.len, std::memory_order_relaxed);
  }

  void count_sent(const mmsghdr& m, uint32_t frames) {
    tx_frames_.fetch_add(frames, std::memory_order_relaxed);
    tx_bytes_.fetch_add(m.msg_len, std::memory_order_relaxed);
  }

 public:
  // ECT(0) on every packet (the fabric may mark CE), DF without path-MTU discovery (the link's
  // MTU is what we size packets to), roomy buffers, and the plane's interface.
  static void configure_sender(int fd, const std::string& iface) {
    const int tos = kEct0, pmtu = IP_PMTUDISC_PROBE;
    setsockopt(fd, SOL_IP, IP_TOS, &tos, sizeof(tos));
    setsockopt(fd, SOL_IP, IP_MTU_DISCOVER, &pmtu, sizeof(pmtu));
    set_buffer(fd, SO_SNDBUFFORCE, SO_SNDBUF);
    if (!iface.empty())
      setsockopt(fd, SOL_SOCKET, SO_BINDTODEVICE, iface.c_str(),
                 static_cast<socklen_t>(iface.size()));
  }

 private:
  static constexpr uint32_t kMaxIov = 1024;

  const UdpPortConfig cfg_;
  const int rx_fd_;
  const uint32_t tx_capacity_;
  const MacAddr mac_{};
  bool gso_ = true;
  std::vector<std::unique_ptr<RxBuf>> rx_pool_;
  std::vector<RxBuf*> free_rx_;
  std::vector<RxFrame> pending_;  // segments of a coalesced datagram that did not fit a burst
  size_t pending_pos_ = 0;
  std::vector<std::unique_ptr<TxBuf>> tx_pool_;
  std::vector<TxBuf*> free_tx_;
  std::unordered_map<uint16_t, int> tx_;
  std::vector<Group> groups_;
  mmsghdr msgs_[kMaxSendMsgs];
  uint32_t msg_seg_[kMaxSendMsgs];
  uint32_t msg_count_[kMaxSendMsgs];
  uint32_t msg_first_[kMaxSendMsgs];  // the message's first frame, an index into its group
  iovec iov_one_[2];                  // send_one's
  alignas(cmsghdr) char ctrl_[kMaxSendMsgs][CMSG_SPACE(sizeof(uint16_t))];
  iovec iov_[kMaxIov];
  std::atomic<uint64_t> rx_frames_{0}, rx_bytes_{0}, tx_frames_{0}, tx_bytes_{0};
  std::atomic<uint64_t> tx_dropped_{0}, rx_bad_{0}, port_fallbacks_{0};
};

}  // namespace

std::unique_ptr<Port> open_udp_port(const UdpPortConfig& cfg, std::string* err) {
  std::string scratch;
  if (!err) err = &scratch;
  const std::string addr = [&] {
    in_addr a{htonl(cfg.ip)};
    char buf[INET_ADDRSTRLEN];
    return std::string(inet_ntop(AF_INET, &a, buf, sizeof(buf)));
  }();
  if (!cfg.iface.empty()) {
    auto info = interface_info(cfg.iface, err);
    if (!info) return nullptr;
    if (info->mtu < cfg.mtu) {
      *err = "interface " + cfg.iface + " has MTU " + std::to_string(info->mtu) +
             ", below the link's " + std::to_string(cfg.mtu);
      return nullptr;
    }
  }
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = "cannot open a UDP socket: " + errno_text(errno);
    return nullptr;
  }
  auto fail = [&](std::string why) {
    close(fd);
    *err = std::move(why);
    return nullptr;
  };
  UdpPort::configure_sender(fd, {});
  if (!cfg.iface.empty() && setsockopt(fd, SOL_SOCKET, SO_BINDTODEVICE, cfg.iface.c_str(),
                                       static_cast<socklen_t>(cfg.iface.size())) != 0) {
    if (errno == EPERM)
      return fail("binding to interface " + cfg.iface +
                  " needs CAP_NET_RAW (run as root, or name no interface)");
    return fail("cannot bind to interface " + cfg.iface + ": " + errno_text(errno));
  }
  const int on = 1;
  setsockopt(fd, SOL_IP, IP_RECVTOS, &on, sizeof(on));
  setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof(on));  // kernels before 5.0: one datagram each
  set_buffer(fd, SO_RCVBUFFORCE, SO_RCVBUF);
  const sockaddr_in a = inet(cfg.ip, cfg.udp_port);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
    const int e = errno;
    if (e == EADDRNOTAVAIL)
      return fail(addr + " is not an address of this host: a UDP-socket link sends and receives "
                  "as it (ip addr add " + addr + "/32 dev lo)");
    if (e == EADDRINUSE)
      return fail("UDP port " + std::to_string(cfg.udp_port) + " of " + addr +
                  " is taken (another link or program)");
    return fail("cannot bind " + addr + ":" + std::to_string(cfg.udp_port) + ": " + errno_text(e));
  }
  return std::make_unique<UdpPort>(cfg, fd);
}

}  // namespace metaroce::io
