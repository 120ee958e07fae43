// SPDX-License-Identifier: Apache-2.0
// The in-memory link: two ports joined by one bounded queue per direction, every buffer
// allocated up front so that sending and receiving never allocate.
#include "datapath/io/mem_link.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

namespace metaroce::io {
namespace {

// A fixed set of equal buffers handed out by index. Large pools come from one new[] that is
// never value-initialised, so the kernel only backs the pages a test actually touches.
class FramePool {
 public:
  FramePool(uint32_t count, uint32_t frame_size)
      : frame_size_(frame_size), memory_(new uint8_t[size_t{count} * frame_size]) {
    free_.reserve(count);
    for (uint32_t i = count; i > 0; --i) free_.push_back(i - 1);
  }
  // Returns the index of a free buffer, or -1.
  int64_t take() {
    std::lock_guard lock(mu_);
    if (free_.empty()) return -1;
    const uint32_t index = free_.back();
    free_.pop_back();
    return index;
  }
  void give(uint32_t index) {
    std::lock_guard lock(mu_);
    free_.push_back(index);  // never grows past the reserved count: each index is given once
  }
  uint8_t* data(uint32_t index) { return memory_.get() + size_t{index} * frame_size_; }
  uint32_t frame_size() const { return frame_size_; }

 private:
  const uint32_t frame_size_;
  std::unique_ptr<uint8_t[]> memory_;
  std::mutex mu_;
  std::vector<uint32_t> free_;
};

// One direction of the link: the wire queue and the receiver's buffers.
struct Direction {
  explicit Direction(const MemLinkConfig& cfg)
      // The receiver may hold as many frames as the queue holds before it releases them.
      : rx_pool(cfg.queue_frames * 2, cfg.frame_size),
        ring(cfg.queue_frames),
        event_fd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~Direction() {
    if (event_fd >= 0) close(event_fd);
  }

  struct Slot {
    uint32_t buffer = 0;
    uint32_t len = 0;
  };

  FramePool rx_pool;
  std::mutex mu;  // guards ring, head, count
  std::vector<Slot> ring;
  size_t head = 0, count = 0;
  uint64_t sent = 0;  // frames offered to the wire, for drop_every
  std::atomic<bool> armed{false};
  std::atomic<uint64_t> rx_missed{0};  // receiver held every buffer when a frame arrived
  const int event_fd;

  void wake() {
    const uint64_t one = 1;
    // A full eventfd counter (EAGAIN) still reads as readable, so the result needs no check.
    [[maybe_unused]] ssize_t n = write(event_fd, &one, sizeof(one));
  }
};

struct Link {
  explicit Link(const MemLinkConfig& cfg) : dirs{Direction(cfg), Direction(cfg)} {}
  Direction dirs[2];  // dirs[i] carries frames towards end i
  std::atomic<int> ends_alive{2};
};

struct AtomicStats {
  std::atomic<uint64_t> rx_frames{0}, rx_bytes{0}, tx_frames{0}, tx_bytes{0};
  std::atomic<uint64_t> tx_dropped{0};
};

constexpr uint32_t kTxStaging = 256;  // frames a sender may hold between alloc_tx and tx_burst

// Handles carry index + 1 so that a zero handle never names a buffer.
void* to_handle(uint32_t index) { return reinterpret_cast<void*>(uintptr_t{index} + 1); }
uint32_t from_handle(void* handle) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(handle) - 1);
}

class MemPort final : public Port {
 public:
  MemPort(std::shared_ptr<Link> link, int side, const MacAddr& mac, const MemLinkConfig& cfg)
      : link_(std::move(link)),
        in_(link_->dirs[side]),
        out_(link_->dirs[1 - side]),
        mac_(mac),
        drop_every_(cfg.drop_every),
        tx_pool_(kTxStaging, cfg.frame_size) {}
  ~MemPort() override { link_->ends_alive.fetch_sub(1); }

  const MacAddr& mac() const override { return mac_; }
  bool link_up() const override { return link_->ends_alive.load() == 2; }

  uint32_t rx_burst(std::span<RxFrame> out) override {
    uint32_t n = 0;
    uint64_t bytes = 0;
    {
      std::lock_guard lock(in_.mu);
      const size_t cap = in_.ring.size();
      while (n < out.size() && in_.count > 0) {
        const Direction::Slot& slot = in_.ring[in_.head];
        out[n] = RxFrame{in_.rx_pool.data(slot.buffer), slot.len, to_handle(slot.buffer)};
        bytes += slot.len;
        in_.head = (in_.head + 1) % cap;
        --in_.count;
        ++n;
      }
    }
    if (n > 0) {
      stats_.rx_frames.fetch_add(n, std::memory_order_relaxed);
      stats_.rx_bytes.fetch_add(bytes, std::memory_order_relaxed);
    }
    return n;
  }

  void release(std::span<RxFrame> frames) override {
    for (RxFrame& f : frames) {
      if (f.handle == nullptr) continue;
      in_.rx_pool.give(from_handle(f.handle));
      f.handle = nullptr;
    }
  }

  bool alloc_tx(TxFrame& frame, uint32_t size) override {
    if (size > tx_pool_.frame_size()) return false;
    const int64_t index = tx_pool_.take();
    if (index < 0) return false;
    const auto i = static_cast<uint32_t>(index);
    frame = TxFrame{tx_pool_.data(i), tx_pool_.frame_size(), 0, to_handle(i)};
    return true;
  }

  bool takes_tails() const override { return true; }  // send copies every frame, tails too
  void tx_burst(std::span<TxFrame> frames) override { send(frames, false); }
  uint32_t tx_try(std::span<TxFrame> frames) override { return send(frames, true); }

  // With keep, the frames from the first one the full queue cannot take stay the caller's.
  uint32_t send(std::span<TxFrame> frames, bool keep) {
    size_t taken = frames.size();
    uint64_t sent = 0, bytes = 0, dropped = 0, missed = 0;
    bool queued = false;
    {
      std::lock_guard lock(out_.mu);
      const size_t cap = out_.ring.size();
      for (size_t i = 0; i < frames.size(); ++i) {
        TxFrame& f = frames[i];
        const uint32_t len = std::min(f.len, tx_pool_.frame_size());
        if (len == 0) continue;  // an unused buffer given back: freed below
        if (out_.count == cap) {
          if (keep) {
            taken = i;
            break;
          }
          ++dropped;  // the bounded queue is full: the frame never reaches the wire
          continue;
        }
        ++sent;
        bytes += len;
        ++out_.sent;
        if (drop_every_ != 0 && out_.sent % drop_every_ == 0) continue;  // lost on the wire
        const int64_t buffer = out_.rx_pool.take();
        if (buffer < 0) {
          ++missed;  // the receiver holds every buffer: it misses the frame, as a NIC would
          continue;
        }
        const auto b = static_cast<uint32_t>(buffer);
        const uint32_t tail = f.tail ? std::min(f.tail_len, len) : 0;
        std::memcpy(out_.rx_pool.data(b), f.data, len - tail);
        if (tail != 0) std::memcpy(out_.rx_pool.data(b) + len - tail, f.tail, tail);
        out_.ring[(out_.head + out_.count) % cap] = Direction::Slot{b, len};
        ++out_.count;
        queued = true;
      }
    }
    for (TxFrame& f : frames.first(taken)) {
      if (f.handle != nullptr) tx_pool_.give(from_handle(f.handle));
      f.handle = nullptr;
    }
    if (queued && out_.armed.exchange(false)) out_.wake();
    stats_.tx_frames.fetch_add(sent, std::memory_order_relaxed);
    stats_.tx_bytes.fetch_add(bytes, std::memory_order_relaxed);
    if (dropped != 0) stats_.tx_dropped.fetch_add(dropped, std::memory_order_relaxed);
    if (missed != 0) out_.rx_missed.fetch_add(missed, std::memory_order_relaxed);
    return static_cast<uint32_t>(sent);
  }

  int rx_wait_fd() override { return in_.event_fd; }

  void rx_arm() override {
    in_.armed.store(true);
    // A frame queued between the caller's last rx_burst and this store would otherwise sleep
    // until the next one.
    bool pending;
    {
      std::lock_guard lock(in_.mu);
      pending = in_.count > 0;
    }
    if (pending && in_.armed.exchange(false)) in_.wake();
  }

  void rx_disarm() override {
    in_.armed.store(false);
    uint64_t drained;
    [[maybe_unused]] ssize_t n = read(in_.event_fd, &drained, sizeof(drained));
  }

  PortStats stats() const override {
    PortStats s;
    s.rx_frames = stats_.rx_frames.load(std::memory_order_relaxed);
    s.rx_bytes = stats_.rx_bytes.load(std::memory_order_relaxed);
    s.tx_frames = stats_.tx_frames.load(std::memory_order_relaxed);
    s.tx_bytes = stats_.tx_bytes.load(std::memory_order_relaxed);
    s.tx_dropped = stats_.tx_dropped.load(std::memory_order_relaxed);
    s.rx_missed = in_.rx_missed.load(std::memory_order_relaxed);
    return s;
  }

 private:
  std::shared_ptr<Link> link_;
  Direction& in_;
  Direction& out_;
  MacAddr mac_;
  const uint32_t drop_every_;
  FramePool tx_pool_;
  AtomicStats stats_;
};

}  // namespace

std::pair<std::unique_ptr<Port>, std::unique_ptr<Port>> make_mem_link(const MemLinkConfig& cfg) {
  // Each link gets its own pair of locally administered MACs, so that several links in one
  // test never share an address.
  static std::atomic<uint32_t> next_link{0};
  const uint32_t id = next_link.fetch_add(1);
  MemLinkConfig c = cfg;
  c.queue_frames = std::max<uint32_t>(c.queue_frames, 1);
  c.frame_size = std::max<uint32_t>(c.frame_size, 64);
  auto link = std::make_shared<Link>(c);
  auto mac = [id](uint8_t end) {
    return MacAddr{0x02, 0x4d, 0x52, static_cast<uint8_t>(id >> 8), static_cast<uint8_t>(id),
                   end};
  };
  auto a = std::make_unique<MemPort>(link, 0, mac(1), c);
  auto b = std::make_unique<MemPort>(link, 1, mac(2), c);
  return {std::move(a), std::move(b)};
}

}  // namespace metaroce::io
