// SPDX-License-Identifier: Apache-2.0
// The engine's per-packet path, in one process for instruction counting (bench/run --only cpu
// runs it under callgrind): two NIC cores joined by an in-memory link, a fixed number of 4 KiB
// RDMA WRITEs (one packet each) from one to the other, every byte placed, every ACK handled.
// Deterministic (virtual clock), so the instruction count per packet is repeatable.
//
//   engine_path [--packets N] [--size BYTES] [--qps Q] [--pingpong 1]
// Prints one JSON line: packets, bytes, and the completions seen. With --pingpong, N round trips
// of one signaled WRITE each way (ib_write_lat's pattern): each side writes back once the
// other's bytes have landed in its buffer.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "datapath/io/mem_link.h"
#include "datapath/nic/link_layer.h"
#include "datapath/nic/nic.h"

using namespace metaroce;
using nic::Owner;

namespace {

class BenchOwner final : public Owner {
 public:
  nic::Memory& memory() override { return mem_; }
  void async_event(uint64_t, hostif::AsyncEvent) override {}
  void cq_event(uint32_t, uint64_t) override {}
  uint32_t pid() const override { return 0; }

 private:
  nic::DirectMemory mem_;
};

struct Ring {
  explicit Ring(size_t n) : mem(static_cast<uint8_t*>(std::aligned_alloc(4096, n))) { std::memset(mem, 0, n); }
  ~Ring() { std::free(mem); }
  uint8_t* mem;
};

struct Side {
  std::unique_ptr<nic::Nic> nic;
  std::unique_ptr<nic::LinkLayer> link;
  BenchOwner owner;
  uint32_t pd = 0, cq = 0, key = 0;
  std::unique_ptr<Ring> cq_ring;
  std::vector<std::unique_ptr<Ring>> qp_rings;
  std::vector<uint32_t> qpns;
  std::vector<uint8_t> buf;
};

// One signaled WRITE of `size` bytes from side `from` to the other, its first byte `mark`.
void post_write(Side* side, int from, uint32_t size, uint8_t mark) {
  Side& a = side[from];
  Side& b = side[1 - from];
  a.buf[0] = mark;
  auto* h = reinterpret_cast<hostif::QpHeader*>(a.qp_rings[0]->mem);
  uint8_t* slot = hostif::sq_reserve(h);
  hostif::SendWqe* w = hostif::send_wqe(slot);
  std::memset(w, 0, sizeof(*w));
  w->op = hostif::WqeOp::kWrite;
  w->flags = hostif::kSignaled;
  w->num_sge = 1;
  w->rkey = b.key;
  w->remote_addr = reinterpret_cast<uintptr_t>(b.buf.data());
  hostif::send_sges(slot)[0] = {reinterpret_cast<uintptr_t>(a.buf.data()), size, a.key};
  hostif::sq_post(h);
}

// Round trips as ib_write_lat makes them; completions reaped on both sides.
int ping_pong(Side* side, uint32_t rounds, uint32_t size, transport::Time now) {
  hostif::Cqe cqes[64];
  uint64_t polls = 0;
  for (uint32_t r = 0; r < rounds; ++r) {
    for (int from = 0; from < 2; ++from) {
      const auto mark = static_cast<uint8_t>(2 * r + from + 1);
      post_write(side, from, size, mark);
      while (side[1 - from].buf[0] != mark) {
        if (++polls > 100000000) return 1;
        now += std::chrono::microseconds(1);
        side[0].link->poll(now);
        side[1].link->poll(now);
        for (Side* s : {&side[0], &side[1]}) {
          const int n = hostif::cq_poll(reinterpret_cast<hostif::CqHeader*>(s->cq_ring->mem), 64, cqes);
          for (int i = 0; i < n; ++i)
            if (cqes[i].status != hostif::WcStatus::kSuccess) return 1;
        }
      }
    }
  }
  const auto& st = side[1].nic->engine().stats();
  std::printf("{\"round_trips\": %u, \"size\": %u, \"rx_packets\": %llu, \"acks\": %llu, "
              "\"polls\": %llu}\n",
              rounds, size, static_cast<unsigned long long>(st.rx_packets),
              static_cast<unsigned long long>(side[0].nic->engine().stats().acks_received),
              static_cast<unsigned long long>(polls));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t packets = 20000, size = 4096, nqp = 1, pingpong = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const uint32_t v = static_cast<uint32_t>(std::strtoul(argv[i + 1], nullptr, 10));
    if (a == "--packets") packets = v;
    else if (a == "--size") size = v;
    else if (a == "--qps") nqp = v;
    else if (a == "--pingpong") pingpong = v;
  }
  io::MemLinkConfig lc;
  lc.queue_frames = 2048;
  auto [pa, pb] = io::make_mem_link(lc);
  Side side[2];
  const uint32_t ips[2] = {0xC6120101, 0xC6120102};
  std::unique_ptr<io::Port> ports[2] = {std::move(pa), std::move(pb)};
  for (int s = 0; s < 2; ++s) {
    nic::LinkConfig link;
    link.name = std::string(1, s ? 'b' : 'a');
    link.ip = ips[s];
    link.paths = 8;
    side[s].nic = std::make_unique<nic::Nic>(nic::nic_config(link, 1 + s));
    std::vector<std::unique_ptr<io::Port>> v;
    v.push_back(std::move(ports[s]));
    side[s].link = std::make_unique<nic::LinkLayer>(*side[s].nic, std::move(v), false);
    Side& x = side[s];
    x.buf.assign(size_t{size} * 64, static_cast<uint8_t>(s + 1));
    x.nic->alloc_pd(&x.owner, &x.pd);
    uint32_t rkey;
    x.nic->reg_mr(&x.owner, x.pd, reinterpret_cast<uintptr_t>(x.buf.data()), x.buf.size(),
                  nic::kLocalWrite | nic::kRemoteWrite, &x.key, &rkey);
    x.cq_ring = std::make_unique<Ring>(hostif::cq_layout(4096).bytes);
    hostif::init_cq(x.cq_ring->mem, 4096);
    x.nic->create_cq(&x.owner, reinterpret_cast<hostif::CqHeader*>(x.cq_ring->mem), 0, false, &x.cq);
    hostif::QpCaps caps;
    caps.max_send_wr = caps.max_recv_wr = 1024;
    for (uint32_t q = 0; q < nqp; ++q) {
      x.qp_rings.push_back(std::make_unique<Ring>(hostif::qp_layout(caps).bytes));
      hostif::init_qp(x.qp_rings.back()->mem, 0, hostif::QpType::kRc, caps);
      hostif::CreateQpReq req;
      req.pd = x.pd;
      req.send_cq = req.recv_cq = x.cq;
      req.caps = caps;
      uint32_t qpn = 0;
      x.nic->create_qp(&x.owner, req, reinterpret_cast<hostif::QpHeader*>(x.qp_rings.back()->mem), &qpn);
      x.qpns.push_back(qpn);
    }
  }
  for (int s = 0; s < 2; ++s) {
    for (uint32_t q = 0; q < nqp; ++q) {
      hostif::ModifyQpReq m;
      m.qpn = side[s].qpns[q];
      m.what = hostif::kModAccess | hostif::kModRemote | hostif::kModState;
      m.access = nic::kLocalWrite | nic::kRemoteWrite;
      m.remote.ip = ips[1 - s];
      m.remote.qpn = side[1 - s].qpns[q];
      for (auto st : {hostif::QpState::kInit, hostif::QpState::kRtr, hostif::QpState::kRts}) {
        m.state = st;
        side[s].nic->modify_qp(&side[s].owner, m);
      }
    }
  }
  transport::Time now{std::chrono::seconds(1)};
  if (pingpong) return ping_pong(side, packets, size, now);
  // Post WRITEs as the ring has room, every 16th signaled; run until all completed.
  uint32_t posted = 0, completed = 0, signaled_done = 0;
  const uint32_t signaled_every = 16;
  const uint32_t want_signaled = (packets + signaled_every - 1) / signaled_every;
  hostif::Cqe cqes[64];
  for (uint64_t round = 0; signaled_done < want_signaled && round < 100000000; ++round) {
    for (uint32_t q = 0; q < nqp && posted < packets; ++q) {
      auto* h = reinterpret_cast<hostif::QpHeader*>(side[0].qp_rings[q]->mem);
      while (posted < packets) {
        uint8_t* slot = hostif::sq_reserve(h);
        if (!slot) break;
        hostif::SendWqe* w = hostif::send_wqe(slot);
        std::memset(w, 0, sizeof(*w));
        w->wr_id = posted;
        w->op = hostif::WqeOp::kWrite;
        const bool last = posted + 1 == packets;
        w->flags = (posted % signaled_every == signaled_every - 1 || last) ? hostif::kSignaled : 0;
        w->num_sge = 1;
        w->rkey = side[1].key;
        w->remote_addr = reinterpret_cast<uintptr_t>(side[1].buf.data()) + size_t{posted % 64} * size;
        hostif::send_sges(slot)[0] = {reinterpret_cast<uintptr_t>(side[0].buf.data()) +
                                          size_t{posted % 64} * size, size, side[0].key};
        hostif::sq_post(h);
        ++posted;
      }
    }
    now += std::chrono::microseconds(2);
    side[0].link->poll(now);
    side[1].link->poll(now);
    const int n = hostif::cq_poll(reinterpret_cast<hostif::CqHeader*>(side[0].cq_ring->mem), 64, cqes);
    for (int i = 0; i < n; ++i) {
      ++completed;
      if (cqes[i].status != hostif::WcStatus::kSuccess) {
        std::fprintf(stderr, "engine_path: completion %d failed\n", static_cast<int>(cqes[i].status));
        return 1;
      }
      ++signaled_done;
    }
  }
  const auto& st = side[1].nic->engine().stats();
  std::printf("{\"packets\": %u, \"size\": %u, \"qps\": %u, \"rx_packets\": %llu, "
              "\"acks\": %llu, \"retransmits\": %llu, \"completions\": %u}\n",
              packets, size, nqp, static_cast<unsigned long long>(st.rx_packets),
              static_cast<unsigned long long>(side[0].nic->engine().stats().acks_received),
              static_cast<unsigned long long>(side[0].nic->engine().stats().retransmits), completed);
  return signaled_done == want_signaled ? 0 : 1;
}
