// SPDX-License-Identifier: Apache-2.0
// The software NIC's device: tables, the transport host callbacks, ARP, and the progress thread.
#include "datapath/nic/soft_device.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <optional>

#include "datapath/io/dpdk_port.h"
#include "datapath/transport/path_stats.h"
#include "datapath/wire/frame.h"
#include "datapath/wire/mrh.h"

namespace metaroce::nic {

using transport::Syndrome;
using transport::Time;

namespace {

constexpr uint64_t kReadRespTag = uint64_t{1} << 63;
constexpr uint32_t kRxBurst = 32;
// After the last work, spin this long before sleeping: a spinning thread is a real cost on
// these 2-core machines, but waking up costs a scheduler round trip (docs/design.md).
constexpr Time kSpinBeforeSleep = std::chrono::microseconds(20);
constexpr Time kMinSleep = std::chrono::microseconds(5);
constexpr Time kMaxSleep = std::chrono::milliseconds(1);
constexpr Time kArpRetry = std::chrono::milliseconds(10);
constexpr uint32_t kL2L4Header = wire::kUdpFrameHeaderLen;
constexpr uint32_t kEnginePathWindow = 64;      // packets: the transport's per-path maximum
constexpr uint32_t kEngineConnWindowMax = 4096;  // packets: 16 MiB in flight at 4 KiB
// Link goodbye (docs/spec/link.md): a port about to close tells its peer to stop touching the
// shared link first. DPDK 22.11's memif unmaps its rings from the interrupt thread when the peer
// disconnects, even while another thread is inside rx/tx on them.
constexpr uint16_t kGoodbyeEtherType = 0x88b5;  // IEEE local experimental
constexpr uint8_t kGoodbye = 1, kGoodbyeAck = 2;
constexpr uint32_t kGoodbyeFrameLen = 60;
// Long enough for a peer whose progress thread is napping or descheduled on a loaded host to
// answer; the close waits only until the answer comes (well under a millisecond when idle).
constexpr Time kGoodbyeWait = std::chrono::milliseconds(500);
constexpr Time kQuietMax = std::chrono::seconds(1);
constexpr Time kPublishEvery = std::chrono::milliseconds(100);  // `metaroce stat` refresh
// What a data packet adds to its payload inside the link MTU (an IP packet size).
constexpr uint32_t kFrameOverhead =
    wire::kIpv4HeaderLen + wire::kUdpHeaderLen + wire::kDataHeadersLen;
// Room the engine may ask for beyond the payload: the largest of a data and an ACK/NAK packet.
constexpr uint32_t kTransportHeaderRoom =
    std::max<uint32_t>(wire::kDataHeadersLen,
                       wire::kAckHeadersLen + wire::kMaxNakRecords * wire::kNakRecordLen);

uint32_t verbs_mtu_for(uint32_t link_mtu) {
  // Largest verbs MTU whose packets fit the link with every header in front of them.
  uint32_t room = link_mtu > kFrameOverhead ? link_mtu - kFrameOverhead : 0;
  for (uint32_t m = 4096; m >= 256; m /= 2)
    if (m <= room) return m;
  return 256;
}

}  // namespace

// Transmit sink: builds Ethernet/IPv4/UDP in front of what the engine writes, and sends each
// packet on the port of its path's plane. Buffers come from plane 0's port (the plane is known
// only at commit); a packet for another plane is copied into a buffer of that plane's port.
class SoftDevice::Sink final : public transport::TxSink {
 public:
  explicit Sink(SoftDevice& dev) : dev_(dev), batches_(dev.planes_.size()) {}
  ~Sink() override { flush(); }

  std::span<uint8_t> begin(uint32_t max_len) override {
    if (open_) give_back(open_frame_);
    if (!dev_.planes_[0].port->alloc_tx(open_frame_, max_len + kL2L4Header)) return {};
    open_ = true;
    return {open_frame_.data + kL2L4Header, max_len};
  }

  void commit(uint32_t peer_ip, uint16_t udp_src_port, uint8_t plane, uint32_t len) override {
    open_ = false;
    io::TxFrame f = open_frame_;
    if (peer_ip == dev_.cfg_.ip) {
      // Two QPs of this device talking to each other: the packet never leaves the NIC.
      dev_.loop_back(udp_src_port, {f.data + kL2L4Header, len});
      give_back(f);
      return;
    }
    const uint32_t p = plane % dev_.planes_.size();
    Plane& pl = dev_.planes_[p];
    if (pl.quiet) {
      give_back(f);  // the peer is closing that plane: as a loss, the transport resends
      return;
    }
    if (p != 0) {
      io::TxFrame g;
      if (!pl.port->alloc_tx(g, kL2L4Header + len)) {
        give_back(f);
        return;  // no buffer on that plane: as a drop on the wire, the transport recovers it
      }
      std::memcpy(g.data + kL2L4Header, f.data + kL2L4Header, len);
      give_back(f);
      f = g;
    }
    auto known = pl.arp.find(peer_ip);
    wire::UdpFrameParams a;
    a.src_mac = pl.port->mac();
    // Until ARP answers, broadcast: every link we run on is point to point or a fabric plane.
    a.dst_mac = known != pl.arp.end() ? known->second : wire::kBroadcastMac;
    a.src_ip = dev_.cfg_.ip;
    a.dst_ip = peer_ip;
    a.src_port = udp_src_port;
    a.dst_port = dev_.cfg_.udp_port;
    wire::write_udp_headers({f.data, kL2L4Header}, a, len);
    f.len = kL2L4Header + len;
    push(p, f);
  }

  void flush() {
    if (open_) {
      give_back(open_frame_);
      open_ = false;
    }
    for (size_t p = 0; p < batches_.size(); ++p) flush_plane(p);
  }

 private:
  static constexpr uint32_t kBurst = 32;
  struct Batch {
    io::TxFrame frames[kBurst];
    uint32_t count = 0;
  };

  // An unused plane-0 buffer goes back to its port unsent (len 0).
  void give_back(io::TxFrame f) {
    f.len = 0;
    push(0, f);
  }
  void push(size_t plane, const io::TxFrame& f) {
    Batch& b = batches_[plane];
    b.frames[b.count++] = f;
    if (b.count == kBurst) flush_plane(plane);
  }
  void flush_plane(size_t plane) {
    Batch& b = batches_[plane];
    if (b.count == 0) return;
    uint32_t real = 0;
    for (uint32_t i = 0; i < b.count; ++i) real += b.frames[i].len != 0;
    dev_.planes_[plane].port->tx_burst({b.frames, b.count});
    dev_.counters_.tx_frames += real;
    b.count = 0;
  }

  SoftDevice& dev_;
  std::vector<Batch> batches_;
  io::TxFrame open_frame_;
  bool open_ = false;
};

std::shared_ptr<Device> Device::open(const LinkConfig& cfg, int* err, std::string* why) {
  // One device per link per process, shared by every context that opens it.
  static std::mutex registry_mu;
  static std::map<std::string, std::weak_ptr<Device>> registry;
  std::lock_guard lock(registry_mu);
  if (auto existing = registry[cfg.name].lock()) return existing;
  std::vector<std::unique_ptr<io::Port>> ports;
  size_t start = 0;
  for (;;) {
    const size_t end = cfg.devargs.find(kPlaneSeparator, start);
    io::DpdkPortConfig pc;
    pc.devargs = cfg.devargs.substr(start, end == std::string::npos ? end : end - start);
    pc.mtu = cfg.mtu;
    std::string reason;
    auto port = io::open_dpdk_port(pc, &reason);
    if (!port) {
      if (err) *err = ENODEV;
      if (why) *why = "cannot open DPDK device '" + pc.devargs + "': " + reason;
      return nullptr;
    }
    ports.push_back(std::move(port));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  SoftDeviceOptions opt;
  opt.engine.local_ip = cfg.ip;
  opt.engine.num_paths = cfg.paths;
  opt.engine.mtu_payload = verbs_mtu_for(cfg.mtu);
  opt.engine.max_packet = opt.engine.mtu_payload + kTransportHeaderRoom;
  // Windows start full (congestion.md §2.1: the initial window is one BDP, no slow start). A
  // software NIC's RTT is scheduling-bound, hundreds of microseconds to milliseconds on these
  // 2-core machines, so one BDP at tens of Gbit/s is thousands of packets: every path's full
  // window. ECN marks and the receiver's hints bring them down where the fabric needs it.
  opt.engine.path_window_init = kEnginePathWindow;
  opt.engine.conn_window_max =
      std::min<uint32_t>(uint32_t{cfg.paths} * kEnginePathWindow, kEngineConnWindowMax);
  opt.engine.conn_window_init = opt.engine.conn_window_max;
  opt.engine.rx_capacity_mbps = cfg.rx_capacity_mbps;
  opt.engine.seed = (uint64_t{cfg.ip} << 32) ^ static_cast<uint64_t>(getpid()) ^
                    static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  auto dev = std::make_shared<SoftDevice>(cfg, std::move(ports), opt);
  registry[cfg.name] = dev;
  return dev;
}

SoftDevice::SoftDevice(const LinkConfig& cfg, std::unique_ptr<io::Port> port,
                       const SoftDeviceOptions& opt)
    : SoftDevice(cfg, [&] {
        std::vector<std::unique_ptr<io::Port>> v;
        v.push_back(std::move(port));
        return v;
      }(), opt) {}

SoftDevice::SoftDevice(const LinkConfig& cfg, std::vector<std::unique_ptr<io::Port>> ports,
                       const SoftDeviceOptions& opt)
    : cfg_(cfg), clock_(opt.clock), linger_quiet_(opt.linger_quiet),
      linger_max_(opt.linger_max), active_mtu_(verbs_mtu_for(cfg.mtu)),
      next_qpn_(0x100 + static_cast<uint32_t>(opt.engine.seed % 0x1000)) {
  for (auto& p : ports) {
    Plane pl;
    pl.port = std::move(p);
    planes_.push_back(std::move(pl));
  }
  transport::EngineConfig ec = opt.engine;
  if (ec.local_ip == 0) ec.local_ip = cfg.ip;
  ec.num_planes = static_cast<uint8_t>(planes_.size());
  engine_ = transport::Engine::create(ec, *this);
  sink_ = std::make_unique<Sink>(*this);
  telemetry_ = std::make_unique<TelemetryWriter>(cfg.run_dir, cfg.name,
                                                 static_cast<uint32_t>(planes_.size()));
  doorbell_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (opt.start_thread) thread_ = std::thread([this] { run(); });
}

SoftDevice::~SoftDevice() {
  if (thread_.joinable()) linger();
  stop_.store(true);
  kick();
  if (thread_.joinable()) thread_.join();
  for (Plane& p : planes_) say_goodbye(p);
  if (doorbell_fd_ >= 0) close(doorbell_fd_);
}

// The last acknowledgement (congestion.md §4.6): acknowledging belongs to the connection, not
// to a QP nor to the application's lifetime. The application is gone (its QPs destroyed, the
// device closed), but a peer whose final packets we accepted may have lost our ACK; the progress
// thread keeps answering its resends until no peer has needed an answer for linger_quiet.
void SoftDevice::linger() {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    Time last, t;
    {
      std::lock_guard lock(mu_);
      last = engine_->last_answered();
      t = now();
    }
    if (last == Time::min() || t - last >= linger_quiet_) return;
    if (std::chrono::steady_clock::now() - start >= linger_max_) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

Time SoftDevice::now() const {
  if (clock_) return clock_();
  return std::chrono::duration_cast<Time>(std::chrono::steady_clock::now().time_since_epoch());
}

void SoftDevice::kick() {
  // Pairs with the fence in idle_wait(): either the sleeper sees the new WQE or we see it asleep.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_relaxed)) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(doorbell_fd_, &one, sizeof(one));
  }
}

int SoftDevice::reg_mr(uint32_t pd, uint64_t addr, uint64_t length, unsigned int access,
                       uint32_t* lkey, uint32_t* rkey) {
  if (length > kMaxMrSize) return EINVAL;
  std::lock_guard lock(mu_);
  uint32_t key = mrs_.add(pd, addr, length, access);
  if (key == 0) return ENOMEM;
  *lkey = *rkey = key;
  return 0;
}

int SoftDevice::dereg_mr(uint32_t lkey) {
  std::lock_guard lock(mu_);
  return mrs_.remove(lkey) ? 0 : EINVAL;
}

Cq* SoftDevice::create_cq(uint32_t cqe, int* err) {
  if (cqe < 1 || cqe > kMaxCqe) {
    if (err) *err = EINVAL;
    return nullptr;
  }
  std::lock_guard lock(mu_);
  cqs_.push_back(std::make_unique<CompletionQueue>(cqe));
  // With a progress thread (not under a test's hand-driven clock), pollers help it.
  if (thread_.joinable()) cqs_.back()->set_idle_hook(&SoftDevice::assist, this);
  return cqs_.back().get();
}

int SoftDevice::destroy_cq(Cq* cq) {
  std::lock_guard lock(mu_);
  auto it = std::find_if(cqs_.begin(), cqs_.end(), [&](auto& p) { return p.get() == cq; });
  if (it == cqs_.end()) return EINVAL;
  if ((*it)->users > 0) return EBUSY;
  cqs_.erase(it);
  return 0;
}

Srq* SoftDevice::create_srq(uint32_t pd, uint32_t max_wr, uint32_t max_sge, int* err) {
  if (max_wr < 1 || max_wr > kMaxSrqWr || max_sge < 1 || max_sge > kMaxSge) {
    if (err) *err = EINVAL;
    return nullptr;
  }
  std::lock_guard lock(mu_);
  srqs_.push_back(std::make_unique<SharedReceiveQueue>(pd, max_wr, max_sge));
  return srqs_.back().get();
}

int SoftDevice::destroy_srq(Srq* srq) {
  std::lock_guard lock(mu_);
  auto it = std::find_if(srqs_.begin(), srqs_.end(), [&](auto& p) { return p.get() == srq; });
  if (it == srqs_.end()) return EINVAL;
  if ((*it)->users > 0) return EBUSY;
  srqs_.erase(it);
  return 0;
}

Qp* SoftDevice::create_qp(const QpInit& init, int* err) {
  if (init.max_send_wr > kMaxQpWr || init.max_recv_wr > kMaxQpWr ||
      init.max_send_sge > kMaxSge || init.max_recv_sge > kMaxSge ||
      init.max_inline > kMaxInline || !init.send_cq || !init.recv_cq) {
    if (err) *err = EINVAL;
    return nullptr;
  }
  std::lock_guard lock(mu_);
  uint32_t qpn;
  do {
    qpn = next_qpn_++ & 0xffffff;
  } while (qpn < 2 || qps_.count(qpn));
  auto qp = std::make_unique<QueuePair>(*this, qpn, init);
  static_cast<CompletionQueue*>(init.send_cq)->users++;
  static_cast<CompletionQueue*>(init.recv_cq)->users++;
  if (init.srq) static_cast<SharedReceiveQueue*>(init.srq)->users++;
  QueuePair* raw = qp.get();
  qps_.emplace(qpn, std::move(qp));
  qp_list_.push_back(raw);
  return raw;
}

int SoftDevice::destroy_qp(Qp* qp) {
  std::lock_guard lock(mu_);
  auto it = qps_.find(qp->qpn());
  if (it == qps_.end() || it->second.get() != qp) return EINVAL;
  engine_->drop_stream(qp->qpn());
  static_cast<CompletionQueue*>(it->second->init().send_cq)->users--;
  static_cast<CompletionQueue*>(it->second->init().recv_cq)->users--;
  if (Srq* srq = it->second->init().srq) static_cast<SharedReceiveQueue*>(srq)->users--;
  qp_list_.erase(std::find(qp_list_.begin(), qp_list_.end(), it->second.get()));
  qps_.erase(it);
  return 0;
}

DeviceCounters SoftDevice::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

QueuePair* SoftDevice::find_qp(uint32_t qpn) {
  auto it = qps_.find(qpn);
  return it == qps_.end() ? nullptr : it->second.get();
}

void SoftDevice::queue_read_response(const transport::MessageDesc& msg, uint64_t local_addr) {
  transport::MessageDesc m = msg;
  m.cookie = kReadRespTag | next_read_id_++;
  reads_[m.cookie] = ReadResponse{local_addr, m.length};
  pending_reads_.push_back(m);
}

void SoftDevice::loop_back(uint16_t udp_src_port, std::span<const uint8_t> udp_payload) {
  LoopPacket* p;
  if (loop_free_.empty()) {
    loop_pool_.push_back(std::make_unique<LoopPacket>());
    p = loop_pool_.back().get();
  } else {
    p = loop_free_.back();
    loop_free_.pop_back();
  }
  p->src_port = udp_src_port;
  p->bytes.assign(udp_payload.begin(), udp_payload.end());
  loop_queue_.push_back(p);
}

void SoftDevice::resolve(uint32_t ip) {
  if (ip == 0 || ip == cfg_.ip || planes_[0].arp.count(ip)) return;
  // The progress thread sends the request; a UD QP asks on every send, which must not restart
  // the retry timer of a request already out.
  if (arp_asked_.try_emplace(ip, Time::min()).second) kick();
}

// --- transport::Host ------------------------------------------------------------------------

void SoftDevice::gather(uint64_t cookie, uint32_t offset, std::span<uint8_t> out) {
  if (cookie & kReadRespTag) {
    auto it = reads_.find(cookie);
    if (it != reads_.end())
      std::memcpy(out.data(), reinterpret_cast<const uint8_t*>(it->second.addr) + offset,
                  out.size());
    return;
  }
  if (QueuePair* qp = find_qp(static_cast<uint32_t>(cookie >> 32)))
    qp->gather(static_cast<uint32_t>(cookie), offset, out);
}

Syndrome SoftDevice::deliver(const transport::Segment& seg) {
  QueuePair* qp = find_qp(seg.dst_stream);
  // No such QP (destroyed, or never made): drop as a NIC does, without answering; a peer whose
  // QP still sends to it runs out of retries (IBV_WC_RETRY_EXC_ERR), as on RC hardware.
  Syndrome s = qp ? qp->deliver(seg) : Syndrome::kUnreachable;
  if (s == Syndrome::kRnr) counters_.rnr++;
  else if (s != Syndrome::kOk && s != Syndrome::kUnreachable) counters_.naks_access++;
  return s;
}

void SoftDevice::message_acked(uint64_t cookie) {
  if (cookie & kReadRespTag) {
    reads_.erase(cookie);
    return;
  }
  if (QueuePair* qp = find_qp(static_cast<uint32_t>(cookie >> 32)))
    qp->on_message_acked(static_cast<uint32_t>(cookie));
}

void SoftDevice::message_failed(uint64_t cookie, Syndrome why) {
  if (cookie & kReadRespTag) {
    reads_.erase(cookie);
    return;
  }
  if (QueuePair* qp = find_qp(static_cast<uint32_t>(cookie >> 32)))
    qp->on_message_failed(static_cast<uint32_t>(cookie), why);
}

// --- progress ---------------------------------------------------------------------------------

void SoftDevice::send_arp(Plane& pl, bool reply, uint32_t target_ip,
                          const io::MacAddr& target_mac) {
  io::TxFrame f;
  if (!pl.port->alloc_tx(f, wire::kArpFrameLen)) return;
  wire::ArpPacket arp;
  arp.op = reply ? wire::ArpOp::kReply : wire::ArpOp::kRequest;
  arp.sender_mac = pl.port->mac();
  arp.sender_ip = cfg_.ip;
  arp.target_mac = reply ? target_mac : io::MacAddr{};
  arp.target_ip = target_ip;
  f.len = static_cast<uint32_t>(wire::build_arp({f.data, f.capacity}, arp));
  pl.port->tx_burst({&f, 1});
  if (reply) counters_.arp_replies++;
  else counters_.arp_requests++;
}

void SoftDevice::send_goodbye(Plane& pl, uint8_t kind) {
  io::TxFrame f;
  if (!pl.port->alloc_tx(f, kGoodbyeFrameLen)) return;
  std::memset(f.data, 0, kGoodbyeFrameLen);
  std::memcpy(f.data, wire::kBroadcastMac.data(), 6);
  std::memcpy(f.data + 6, pl.port->mac().data(), 6);
  f.data[12] = kGoodbyeEtherType >> 8;
  f.data[13] = kGoodbyeEtherType & 0xff;
  f.data[14] = kind;
  f.len = kGoodbyeFrameLen;
  pl.port->tx_burst({&f, 1});
}

std::optional<uint8_t> SoftDevice::goodbye_kind(const io::RxFrame& f) {
  if (f.len < 15 || f.data[12] != (kGoodbyeEtherType >> 8) ||
      f.data[13] != (kGoodbyeEtherType & 0xff))
    return std::nullopt;
  return f.data[14];
}

void SoftDevice::say_goodbye(Plane& pl) {
  if (!pl.port->link_up()) return;
  send_goodbye(pl, kGoodbye);
  // Real time even under a test clock: this waits for another process.
  const auto deadline = std::chrono::steady_clock::now() + kGoodbyeWait;
  io::RxFrame rx[kRxBurst];
  while (std::chrono::steady_clock::now() < deadline) {
    uint32_t n = pl.port->rx_burst(rx);
    bool acked = false;
    for (uint32_t i = 0; i < n; ++i) acked |= goodbye_kind(rx[i]) == kGoodbyeAck;
    pl.port->release({rx, n});
    if (acked) return;
    if (n == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void SoftDevice::handle_frame(Time t, Plane& pl, const io::RxFrame& f) {
  counters_.rx_frames++;
  if (auto kind = goodbye_kind(f)) {
    if (*kind == kGoodbye) {
      // The peer is closing its end: answer, then leave the link alone until it is back.
      send_goodbye(pl, kGoodbyeAck);
      pl.quiet = true;
      pl.quiet_since = t;
      pl.quiet_saw_down = false;
    }
    return;
  }
  const wire::FrameInfo p = wire::parse_frame({f.data, f.len}, cfg_.udp_port);
  if (p.kind == wire::FrameKind::kMalformed) {
    counters_.rx_drop_malformed++;
    return;
  }
  const bool to_us = p.dst_mac == pl.port->mac() || p.dst_mac == wire::kBroadcastMac;
  if (p.kind == wire::FrameKind::kArp) {
    if (!to_us || p.arp.target_ip != cfg_.ip) {
      counters_.rx_drop_not_ours++;
      return;
    }
    pl.arp[p.arp.sender_ip] = p.arp.sender_mac;
    if (p.arp.op == wire::ArpOp::kRequest) send_arp(pl, true, p.arp.sender_ip, p.arp.sender_mac);
    return;
  }
  if (p.kind != wire::FrameKind::kMetaRoce || !to_us || p.dst_ip != cfg_.ip) {
    counters_.rx_drop_not_ours++;
    return;
  }
  // Every frame of ours teaches the peer's address, so ARP is rarely on the critical path.
  if (!pl.arp.count(p.src_ip)) pl.arp[p.src_ip] = p.src_mac;
  engine_->on_packet(t, p.src_ip, p.src_port, p.ecn == wire::Ecn::kCe, p.payload);
}

void SoftDevice::assist(void* self) {
  auto* dev = static_cast<SoftDevice*>(self);
  std::unique_lock lock(dev->mu_, std::try_to_lock);
  if (lock) dev->progress_locked();
}

bool SoftDevice::progress() {
  std::lock_guard lock(mu_);
  return progress_locked();
}

bool SoftDevice::progress_locked() {
  bool work = false;
  Time t = now();
  io::RxFrame rx[kRxBurst];
  for (Plane& pl : planes_) {
    if (pl.quiet) {
      // Resume once the old peer is gone and a new one connected (or after kQuietMax).
      const bool up = pl.port->link_up();
      pl.quiet_saw_down |= !up;
      if (up && (pl.quiet_saw_down || t - pl.quiet_since > kQuietMax)) pl.quiet = false;
      if (pl.quiet) continue;
    }
    const uint32_t n = pl.port->rx_burst(rx);
    if (n == 0) continue;
    for (uint32_t i = 0; i < n; ++i) handle_frame(t, pl, rx[i]);
    pl.port->release({rx, n});
    work = true;
  }
  if (!pending_reads_.empty()) {
    for (const auto& m : pending_reads_) engine_->submit(m);
    pending_reads_.clear();
  }
  for (QueuePair* qp : qp_list_) work |= qp->drain_send_queue();
  for (auto it = arp_asked_.begin(); it != arp_asked_.end();) {
    if (planes_[0].arp.count(it->first)) {
      it = arp_asked_.erase(it);
      continue;
    }
    if (it->second == Time::min() || t - it->second >= kArpRetry) {
      for (Plane& pl : planes_)
        if (!pl.quiet) send_arp(pl, false, it->first, wire::kBroadcastMac);
      it->second = t;
    }
    ++it;
  }
  if (!loop_queue_.empty()) {
    // Packets this device sent itself, delivered as if they had come back from the wire.
    std::vector<LoopPacket*> batch;
    batch.swap(loop_queue_);
    for (LoopPacket* p : batch) {
      engine_->on_packet(t, cfg_.ip, p->src_port, false, p->bytes);
      loop_free_.push_back(p);
    }
    work = true;
  }
  if (engine_->next_deadline() <= t) engine_->on_timer(t);
  // A quiet plane (peer closing) takes no packets: they count as lost and are resent.
  if (engine_->poll_tx(t, *sink_) > 0) work = true;
  sink_->flush();
  if (t >= next_publish_) publish_stats(t);
  return work;
}

void SoftDevice::idle_wait(Time t, Time idle_for) {
  Time deadline;
  {
    std::lock_guard lock(mu_);
    deadline = engine_->next_deadline();
  }
  Time sleep = std::min(kMaxSleep, deadline > t ? deadline - t : Time::zero());
  if (sleep <= Time::zero()) return;
  io::Port& port0 = *planes_[0].port;  // the only one slept on; others are polled on wake
  int rx_fd = planes_.size() == 1 ? port0.rx_wait_fd() : -1;
  pollfd fds[2] = {{doorbell_fd_, POLLIN, 0}, {rx_fd, POLLIN, 0}};
  if (rx_fd >= 0) port0.rx_arm();
  sleeping_.store(true, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sends_pending()) {
    sleeping_.store(false, std::memory_order_relaxed);
    if (rx_fd >= 0) port0.rx_disarm();
    return;
  }
  // Without an rx descriptor, arriving frames are noticed only when we wake. Sleep in
  // proportion to how long the link has been idle: a ping-pong keeps the naps short (its next
  // packet is near), a quiet link ends up polled once a millisecond.
  if (rx_fd < 0) sleep = std::min(sleep, std::clamp(idle_for / 2, kMinSleep, kMaxSleep));
  timespec ts{0, static_cast<long>(sleep.count())};
  ppoll(fds, rx_fd >= 0 ? 2 : 1, &ts, nullptr);
  sleeping_.store(false, std::memory_order_release);
  if (rx_fd >= 0) port0.rx_disarm();
  uint64_t drain;
  [[maybe_unused]] ssize_t r = read(doorbell_fd_, &drain, sizeof(drain));
}

void SoftDevice::publish_stats(Time t) {
  next_publish_ = t + kPublishEvery;
  TelemetryBlock* b = telemetry_->begin_update();
  if (!b) return;
  uint32_t n = 0;
  auto put = [&](const char* name, uint64_t v) {
    if (n == kTelemetryCounters) return;
    std::snprintf(b->counters[n].name, sizeof(b->counters[n].name), "%s", name);
    b->counters[n++].value = v;
  };
  const DeviceCounters& d = counters_;
  put("rx_frames", d.rx_frames);
  put("tx_frames", d.tx_frames);
  put("rx_drop_malformed", d.rx_drop_malformed);
  put("rx_drop_not_ours", d.rx_drop_not_ours);
  put("arp_requests", d.arp_requests);
  put("arp_replies", d.arp_replies);
  put("naks_sent_access", d.naks_access);
  put("rnr", d.rnr);
  const transport::EngineStats& e = engine_->stats();
  put("tx_packets", e.tx_packets);
  put("tx_bytes", e.tx_bytes);
  put("rx_packets", e.rx_packets);
  put("rx_bytes", e.rx_bytes);
  put("retransmits", e.retransmits);
  put("timeouts", e.timeouts);
  put("acks_sent", e.acks_sent);
  put("acks_received", e.acks_received);
  put("duplicates", e.duplicates);
  put("naks_sent", e.naks_sent);
  put("naks_received", e.naks_received);
  put("drop_malformed", e.drop_malformed);
  put("drop_version", e.drop_version);
  put("drop_unknown_conn", e.drop_unknown_conn);
  put("drop_token", e.drop_token);
  put("drop_out_of_window", e.drop_out_of_window);
  put("drop_rnr", e.drop_rnr);
  put("drop_unreachable", e.drop_unreachable);
  put("ecn_decreases", e.ecn_decreases);
  put("sack_gaps", e.sack_gaps);
  put("tail_probes", e.tail_probes);
  put("paths_failed", e.paths_failed);
  put("paths_suspected", e.paths_suspected);
  put("paths_recovered", e.paths_recovered);
  put("failover_resends", e.failover_resends);
  put("pacing_waits", e.pacing_waits);
  b->num_counters = n;
  // Connections: one per peer some QP talks to.
  uint32_t c = 0;
  std::vector<uint32_t> peers;
  for (const QueuePair* qp : qp_list_) {
    const uint32_t ip = qp->remote().ip;
    if (ip != 0 && std::find(peers.begin(), peers.end(), ip) == peers.end()) peers.push_back(ip);
  }
  for (uint32_t ip : peers) {
    if (c == kTelemetryConns) break;
    const transport::ConnStats cs = transport::conn_stats(*engine_, ip);
    if (!cs.exists) continue;
    TelemetryConn& tc = b->conns[c++];
    tc.peer_ip = ip;
    tc.window = cs.window;
    tc.in_flight = cs.in_flight;
    tc.rate_hint_mbps = cs.rate_hint_mbps;
    tc.rx_rate_mbps = cs.rx_rate_mbps;
    tc.rx_hint_mbps = cs.rx_hint_mbps;
    tc.paths_active = cs.paths_active;
    const auto paths = transport::path_stats(*engine_, ip);
    tc.num_paths = static_cast<uint32_t>(std::min<size_t>(paths.size(), kTelemetryPaths));
    for (uint32_t i = 0; i < tc.num_paths; ++i) {
      const transport::PathStats& ps = paths[i];
      TelemetryPath& tp = tc.paths[i];
      tp.path_id = ps.path_id;
      tp.udp_src_port = ps.udp_src_port;
      tp.plane = ps.plane;
      tp.state = static_cast<uint8_t>(ps.state);
      tp.window = ps.window;
      tp.in_flight = ps.in_flight;
      tp.tx_packets = ps.tx_packets;
      tp.tx_bytes = ps.tx_bytes;
      tp.retransmits = ps.retransmits;
      tp.timeouts = ps.timeouts;
      tp.ecn_ce_echoed = ps.ecn_ce_echoed;
      tp.sack_gaps = ps.sack_gaps;
      tp.failures = ps.failures;
      tp.rx_packets = ps.rx_packets;
      tp.rx_bytes = ps.rx_bytes;
      tp.duplicates = ps.duplicates;
      tp.ecn_ce_received = ps.ecn_ce_received;
      tp.srtt_ns = ps.srtt_ns;
      tp.rto_ns = ps.rto_ns;
    }
  }
  b->num_conns = c;
  telemetry_->end_update();
}

bool SoftDevice::sends_pending() const {
  std::lock_guard lock(mu_);
  for (const QueuePair* qp : qp_list_)
    if (qp->has_new_work()) return true;
  return false;
}

void SoftDevice::run() {
  prctl(PR_SET_NAME, "metaroce-nic", 0, 0, 0);
  prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);  // short sleeps stay short
  Time last_work = now();
  while (!stop_.load(std::memory_order_acquire)) {
    if (progress()) {
      last_work = now();
      continue;
    }
    Time t = now();
    if (t - last_work < kSpinBeforeSleep) {
      __builtin_ia32_pause();
      continue;
    }
    idle_wait(t, t - last_work);
  }
}

}  // namespace metaroce::nic
