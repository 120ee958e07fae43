// SPDX-License-Identifier: Apache-2.0
// A rank of a job as UCX, Open MPI or NCCL starts them: it opens every device of the host (and
// keeps them open), then runs RC traffic with one peer on the device it was given, every byte
// checked. What goes wrong is reported as it would reach an application: error completions,
// asynchronous events, a hang.
//
//   ranks --dev NAME (--server | --connect HOST) --port P [--open-all] [--seconds S] [--size B]
//         [--timeout T] [--stream]
//   ranks --hold S [--open-all | --dev NAME] [--qps N]
//                                    (open, make a QP on each device, wait S seconds; --qps: also
//                                     N more RC QPs per device, each moved to RTS towards the
//                                     device's own address, as a job's connections would be)
//
// Traffic: per iteration, the client WRITEs `size` bytes of a pattern into the server's buffer
// and SENDs the iteration number; the server checks every byte, answers the same way; the
// client checks. --stream: the client only WRITEs, back to back (up to 32 outstanding), so it
// always has work in flight; at the end the server checks the last pattern. --timeout is the
// QP's local ACK timeout exponent (4.096 us * 2^T).
// Exit status: 0 every check passed; 1 a check failed; 2 setup failed; 3 an error completion
// (its status, and the time since the last progress, printed); 4 the device went away
// (IBV_EVENT_DEVICE_FATAL, then error completions); 5 nothing happened for 30 s (a hang).
#include <infiniband/verbs.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "ranks";
using namespace metaroce::test;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kExitCheck = 1, kExitErrorCompletion = 3, kExitDeviceFatal = 4, kExitHang = 5;
constexpr auto kHang = std::chrono::seconds(30);

std::atomic<bool> g_device_fatal{false};
std::atomic<bool> g_stop{false};

uint8_t pattern(uint32_t seed, uint32_t iter, size_t i) {
  uint64_t x = (uint64_t{seed} << 32 | iter) * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return static_cast<uint8_t>(x ^ (x >> 13));
}

struct Opened {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
};

// An RC QP of 64 WRs each way, one SGE, both queues on cq.
ibv_qp* make_rc_qp(ibv_pd* pd, ibv_cq* cq) {
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = 64;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(pd, &qa);
  if (!qp) die("ibv_create_qp");
  return qp;
}

// Opens device d, queries it, and makes a PD, a CQ and an RC QP on it (what a library's device
// scan leaves behind in every rank).
Opened open_device(ibv_device* d) {
  Opened o;
  o.ctx = ibv_open_device(d);
  if (!o.ctx) die("ibv_open_device");
  ibv_device_attr attr;
  if (ibv_query_device(o.ctx, &attr)) die("ibv_query_device");
  ibv_port_attr port;
  if (ibv_query_port(o.ctx, 1, &port)) die("ibv_query_port");
  if (port.state != IBV_PORT_ACTIVE) {
    errno = ENETDOWN;
    die("port not active");
  }
  ibv_gid gid;
  if (ibv_query_gid(o.ctx, 1, 0, &gid)) die("ibv_query_gid");
  o.pd = ibv_alloc_pd(o.ctx);
  o.cq = o.pd ? ibv_create_cq(o.ctx, 256, nullptr, nullptr, 0) : nullptr;
  if (!o.cq) die("pd/cq");
  o.qp = make_rc_qp(o.pd, o.cq);
  return o;
}

void close_device(Opened& o) {
  if (o.qp) ibv_destroy_qp(o.qp);
  if (o.cq) ibv_destroy_cq(o.cq);
  if (o.pd) ibv_dealloc_pd(o.pd);
  if (o.ctx) ibv_close_device(o.ctx);
}

// Reports asynchronous events of a context as they come; remembers a device that went away.
void watch_events(ibv_context* ctx) {
  for (;;) {
    ibv_async_event ev;
    if (ibv_get_async_event(ctx, &ev)) return;  // the context closed
    std::fprintf(stderr, "ranks: async event %s\n", ibv_event_type_str(ev.event_type));
    if (ev.event_type == IBV_EVENT_DEVICE_FATAL) g_device_fatal.store(true);
    ibv_ack_async_event(&ev);
  }
}

struct Wire {
  uint32_t qpn;
  uint8_t gid[16];
  uint32_t rkey;
  uint64_t addr;
};

[[noreturn]] void error_completion(const ibv_wc& wc, Clock::time_point last_progress) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_progress);
  // The watcher may still be writing the event down: give it a moment.
  for (int i = 0; i < 100 && !g_device_fatal.load(); ++i) usleep(10000);
  std::printf("ERROR_COMPLETION wr_id=%llu status=%d (%s) %lld ms after the last progress%s\n",
              static_cast<unsigned long long>(wc.wr_id), wc.status, ibv_wc_status_str(wc.status),
              static_cast<long long>(ms.count()), g_device_fatal ? " DEVICE_FATAL" : "");
  std::fflush(stdout);
  std::_Exit(g_device_fatal ? kExitDeviceFatal : kExitErrorCompletion);
}

ibv_wc wait_wc(ibv_cq* cq, Clock::time_point last_progress) {
  ibv_wc wc{};
  for (;;) {
    const int n = ibv_poll_cq(cq, 1, &wc);
    if (n < 0) die("ibv_poll_cq");
    if (n == 1) {
      if (wc.status != IBV_WC_SUCCESS) error_completion(wc, last_progress);
      return wc;
    }
    if (Clock::now() - last_progress > kHang) {
      std::printf("HANG: nothing completed for %lld s\n",
                  static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(kHang).count()));
      std::fflush(stdout);
      std::_Exit(kExitHang);
    }
  }
}

void post_recv(ibv_qp* qp, ibv_mr* mr, uint8_t* at) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(at), 8, mr->lkey};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (ibv_post_recv(qp, &wr, &bad)) die("ibv_post_recv");
}

// WRITE of `size` bytes from local offset 0 to the peer's buffer, then a SEND of the iteration.
void send_iteration(ibv_qp* qp, ibv_mr* mr, uint8_t* buf, size_t size, const Wire& peer,
                    uint32_t iter, uint8_t* note) {
  std::memcpy(note, &iter, sizeof(iter));
  ibv_sge data{reinterpret_cast<uintptr_t>(buf), static_cast<uint32_t>(size), mr->lkey};
  ibv_sge msg{reinterpret_cast<uintptr_t>(note), sizeof(iter), mr->lkey};
  ibv_send_wr w[2]{}, *bad = nullptr;
  w[0].wr_id = 10;
  w[0].opcode = IBV_WR_RDMA_WRITE;
  w[0].sg_list = &data;
  w[0].num_sge = 1;
  w[0].wr.rdma.remote_addr = peer.addr;
  w[0].wr.rdma.rkey = peer.rkey;
  w[0].next = &w[1];
  w[1].wr_id = 11;
  w[1].opcode = IBV_WR_SEND;
  w[1].sg_list = &msg;
  w[1].num_sge = 1;
  w[1].send_flags = IBV_SEND_SIGNALED;
  if (ibv_post_send(qp, w, &bad)) die("ibv_post_send");
}

}  // namespace

int main(int argc, char** argv) {
  std::string dev, host;
  bool server = false, open_all = false, stream = false;
  int port = 18900;
  double seconds = 3, hold = -1;
  size_t size = 65536;
  int timeout = 14;
  int extra_qps = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ranks: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::string(argv[++i]);
    };
    if (a == "--dev") dev = next();
    else if (a == "--server") server = true;
    else if (a == "--connect") host = next();
    else if (a == "--port") port = std::atoi(next().c_str());
    else if (a == "--open-all") open_all = true;
    else if (a == "--seconds") seconds = std::atof(next().c_str());
    else if (a == "--size") size = std::strtoul(next().c_str(), nullptr, 10);
    else if (a == "--timeout") timeout = std::atoi(next().c_str());
    else if (a == "--hold") hold = std::atof(next().c_str());
    else if (a == "--stream") stream = true;
    else if (a == "--qps") extra_qps = std::atoi(next().c_str());
    else {
      std::fprintf(stderr, "ranks: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  signal(SIGTERM, [](int) { g_stop.store(true); });

  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n == 0) die("no RDMA devices");
  std::vector<Opened> opened;
  opened.reserve(static_cast<size_t>(n));  // `mine` points into it
  Opened* mine = nullptr;
  for (int i = 0; i < n; ++i) {
    const bool wanted = dev == ibv_get_device_name(list[i]);
    if (!open_all && !wanted) continue;
    opened.push_back(open_device(list[i]));
    if (wanted) mine = &opened.back();
  }
  std::vector<std::thread> watchers;
  for (Opened& o : opened) watchers.emplace_back(watch_events, o.ctx);
  for (auto& w : watchers) w.detach();
  std::printf("ranks: opened %zu device(s)\n", opened.size());
  std::fflush(stdout);

  if (hold >= 0) {
    std::vector<ibv_qp*> extra;
    for (Opened& o : opened) {
      ibv_gid gid;
      if (ibv_query_gid(o.ctx, 1, 0, &gid)) die("ibv_query_gid");
      RcPeer self;  // the device's own QP: a connection to its own address
      self.qpn = o.qp->qp_num;
      self.gid = gid.raw;
      self.mtu = IBV_MTU_4096;
      for (int q = 0; q < extra_qps; ++q) {
        ibv_qp* qp = make_rc_qp(o.pd, o.cq);
        extra.push_back(qp);
        modify_to_init(qp, IBV_ACCESS_REMOTE_WRITE);
        modify_to_rts(qp, self);
      }
    }
    if (extra_qps) {
      std::printf("ranks: holding %zu more QP(s)\n", extra.size());
      std::fflush(stdout);
    }
    const auto until = Clock::now() + std::chrono::duration<double>(hold);
    while (!g_stop.load() && Clock::now() < until && !g_device_fatal.load()) usleep(20000);
    for (ibv_qp* qp : extra) ibv_destroy_qp(qp);
    for (Opened& o : opened) close_device(o);
    ibv_free_device_list(list);
    return g_device_fatal ? kExitDeviceFatal : 0;
  }
  if (!mine) {
    errno = ENODEV;
    die(("no device " + dev).c_str());
  }

  // The traffic QP is the device's own from the scan, as a library would use it.
  const size_t region = size + 64;
  std::vector<uint8_t> mem(2 * region);
  uint8_t* out = mem.data();            // what we write to the peer (offset 0), then our notes
  uint8_t* in = mem.data() + region;    // what the peer writes here, then its notes
  ibv_mr* mr = ibv_reg_mr(mine->pd, mem.data(), mem.size(),
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!mr) die("ibv_reg_mr");
  ibv_gid gid;
  if (ibv_query_gid(mine->ctx, 1, 0, &gid)) die("ibv_query_gid");
  Wire me{mine->qp->qp_num, {}, mr->rkey, reinterpret_cast<uintptr_t>(in)};
  std::memcpy(me.gid, gid.raw, 16);
  const int s = tcp_open(host.c_str(), port, server);
  Wire peer;
  write_all(s, &me, sizeof(me));
  read_all(s, &peer, sizeof(peer));
  modify_to_init(mine->qp, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  RcPeer rp;
  rp.qpn = peer.qpn;
  rp.gid = peer.gid;
  rp.timeout = static_cast<uint8_t>(timeout);
  post_recv(mine->qp, mr, in + size);
  modify_to_rts(mine->qp, rp);
  char ready = 1;
  write_all(s, &ready, 1);
  read_all(s, &ready, 1);

  const uint32_t my_seed = server ? 2 : 1, peer_seed = server ? 1 : 2;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  if (stream) {
    uint32_t iter = 0;
    if (!server) {
      // WRITE after WRITE into the same place; every 8th signaled, at most 32 outstanding.
      Clock::time_point progress = Clock::now();
      uint32_t outstanding = 0;
      ibv_sge data{reinterpret_cast<uintptr_t>(out), static_cast<uint32_t>(size), mr->lkey};
      while (Clock::now() < end && !g_stop.load()) {
        for (size_t i = 0; i < size; i += 512) out[i] = pattern(my_seed, iter, i);
        ibv_send_wr w{}, *bad = nullptr;
        w.wr_id = iter;
        w.opcode = IBV_WR_RDMA_WRITE;
        w.sg_list = &data;
        w.num_sge = 1;
        w.send_flags = iter % 8 == 7 ? IBV_SEND_SIGNALED : 0;
        w.wr.rdma.remote_addr = peer.addr;
        w.wr.rdma.rkey = peer.rkey;
        if (ibv_post_send(mine->qp, &w, &bad)) die("ibv_post_send");
        ++iter;
        if (++outstanding == 32) {
          for (int k = 0; k < 4; ++k) wait_wc(mine->cq, progress);
          progress = Clock::now();
          outstanding = 0;
        }
      }
      // Drain: a last signaled WRITE covers everything before it (RC order).
      ibv_send_wr w{}, *bad = nullptr;
      w.wr_id = iter;
      w.opcode = IBV_WR_RDMA_WRITE;
      w.sg_list = &data;
      w.num_sge = 1;
      w.send_flags = IBV_SEND_SIGNALED;
      w.wr.rdma.remote_addr = peer.addr;
      w.wr.rdma.rkey = peer.rkey;
      if (ibv_post_send(mine->qp, &w, &bad)) die("ibv_post_send");
      for (uint32_t k = 0; k < outstanding / 8 + 1; ++k) wait_wc(mine->cq, progress);
      --iter;  // the pattern now in the peer's buffer
    }
    // The writer says which WRITE was its last; the receiver checks it and echoes the number.
    if (!server) {
      write_all(s, &iter, sizeof(iter));
      read_all(s, &iter, sizeof(iter));
    } else {
      read_all(s, &iter, sizeof(iter));
    }
    if (server) {
      for (size_t i = 0; i < size; i += 512)
        if (in[i] != pattern(peer_seed, iter, i)) {
          std::fprintf(stderr, "FAIL: stream byte %zu of WRITE %u is %u\n", i, iter, in[i]);
          return kExitCheck;
        }
    }
    if (server) write_all(s, &iter, sizeof(iter));
    std::printf("ranks: stream of %u WRITEs, last one checked\n", iter + 1);
    std::fflush(stdout);
    close(s);
    ibv_dereg_mr(mr);
    for (Opened& o : opened) close_device(o);
    ibv_free_device_list(list);
    return 0;
  }
  Clock::time_point progress = Clock::now();
  uint32_t iter = 0;
  uint64_t checked = 0;
  // The client leads; both stop after the iteration in which the client saw time run out
  // (its note carries the iteration number with the high bit set for "last").
  bool last = false;
  // Completions of our SEND and of the peer's note come in either order.
  bool send_done = true, note_in = false;
  auto wait_for = [&](bool want_send, bool want_note) {
    while ((want_send && !send_done) || (want_note && !note_in)) {
      const ibv_wc wc = wait_wc(mine->cq, progress);
      progress = Clock::now();
      if (wc.opcode == IBV_WC_RECV) note_in = true;
      else send_done = true;
    }
  };
  while (!last) {
    if (!server) {
      last = Clock::now() >= end || g_stop.load();
      for (size_t i = 0; i < size; ++i) out[i] = pattern(my_seed, iter, i);
      send_done = false;
      send_iteration(mine->qp, mr, out, size, peer, iter | (last ? 0x80000000u : 0), out + size);
    }
    wait_for(!server, true);  // our SEND (the WRITE before it is unsignaled) and the peer's note
    note_in = false;
    uint32_t note;
    std::memcpy(&note, in + size, sizeof(note));
    post_recv(mine->qp, mr, in + size);
    if ((note & 0x7fffffffu) != iter) {
      std::fprintf(stderr, "FAIL: iteration %u announced as %u\n", iter, note & 0x7fffffffu);
      return kExitCheck;
    }
    for (size_t i = 0; i < size; ++i) {
      if (in[i] != pattern(peer_seed, iter, i)) {
        std::fprintf(stderr, "FAIL: iteration %u byte %zu is %u, expected %u\n", iter, i, in[i],
                     pattern(peer_seed, iter, i));
        return kExitCheck;
      }
    }
    checked += size;
    if (server) {
      last = note & 0x80000000u;
      wait_for(true, false);  // our previous SEND, before its buffer is reused
      for (size_t i = 0; i < size; ++i) out[i] = pattern(my_seed, iter, i);
      send_done = false;
      send_iteration(mine->qp, mr, out, size, peer, iter | (last ? 0x80000000u : 0), out + size);
    }
    ++iter;
  }
  wait_for(true, false);
  std::printf("ranks: %u iterations, %llu bytes checked, 0 failures\n", iter,
              static_cast<unsigned long long>(checked));
  std::fflush(stdout);
  write_all(s, &ready, 1);  // both sides done before either tears down
  read_all(s, &ready, 1);
  close(s);
  ibv_dereg_mr(mr);
  for (Opened& o : opened) close_device(o);
  ibv_free_device_list(list);
  return 0;
}
