// SPDX-License-Identifier: Apache-2.0
// A ring all-reduce over verbs, one process per rank, each on its own device: what NCCL's ring
// algorithm does, without a GPU, where bench/gpu/run cannot run NCCL (its --cpu part). The
// buffer of floats is cut into one chunk per rank; 2(N-1) steps (reduce-scatter, then
// all-gather) each SEND one chunk to the right neighbour and receive one from the left over RC
// QPs. A receive is posted only into a free buffer, so the sender's RNR retries are the flow
// control (no data lands before its buffer is free). Every element of every result is checked.
//
//   ring_allreduce --dev NAME --rank R --ranks N [--host H] [--port P] [--min-bytes B]
//                  [--max-bytes B] [--iters K] [--warmup W]
// Rank R accepts its left neighbour on TCP port P+R and connects to its right one's port.
// Prints, per size (x4 from min to max), a line like nccl-tests': bytes, time per all-reduce
// (us), algorithm and bus bandwidth (GB/s, busbw = algbw * 2(N-1)/N) and wrong elements.
// Exit status: 0 every result right; 1 a result was wrong; 2 setup failed; 3 an error completion.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/test_support.h"

const char* const metaroce::test::kProgram = "ring_allreduce";
using namespace metaroce::test;

namespace {

struct Options {
  std::string dev, host = "127.0.0.1";
  int rank = -1, ranks = 0, port = 19500, iters = 20, warmup = 3;
  size_t min_bytes = 1024, max_bytes = 64u << 20;
};

struct Wire {  // what a rank tells its neighbour about the QP facing it
  uint32_t qpn;
  uint8_t gid[16];
};

enum : uint64_t { kSendId = 1, kRecvId = 2 };

class Ring {
 public:
  explicit Ring(const Options& o) : o_(o), dev_(open_basics(o.dev, 64)) {
    const size_t floats = o.max_bytes / sizeof(float);
    data_.resize(floats);
    stage_.resize(2 * (floats / static_cast<size_t>(o.ranks) + 1));
    data_mr_ = ibv_reg_mr(dev_.pd, data_.data(), data_.size() * sizeof(float), IBV_ACCESS_LOCAL_WRITE);
    stage_mr_ = ibv_reg_mr(dev_.pd, stage_.data(), stage_.size() * sizeof(float), IBV_ACCESS_LOCAL_WRITE);
    if (!data_mr_ || !stage_mr_) die("ibv_reg_mr");
    right_ = make_qp();
    left_ = make_qp();
  }

  // TCP to both neighbours, QP numbers exchanged, both QPs to RTS, then a barrier.
  void connect() {
    const int n = o_.ranks;
    int from_left = -1;
    std::thread accept([&] { from_left = tcp_open(o_.host.c_str(), o_.port + o_.rank, true); });
    const int to_right = tcp_open(o_.host.c_str(), o_.port + (o_.rank + 1) % n, false);
    accept.join();
    Wire mine_r{right_->qp_num, {}}, mine_l{left_->qp_num, {}}, theirs_r{}, theirs_l{};
    std::memcpy(mine_r.gid, dev_.gid.raw, 16);
    std::memcpy(mine_l.gid, dev_.gid.raw, 16);
    write_all(to_right, &mine_r, sizeof(mine_r));
    write_all(from_left, &mine_l, sizeof(mine_l));
    read_all(to_right, &theirs_r, sizeof(theirs_r));
    read_all(from_left, &theirs_l, sizeof(theirs_l));
    // A SEND that comes before its receive is refused and resent after our min_rnr_timer: the
    // smallest (10 us), since a step's receive is often posted just after the neighbour sent.
    RcPeer right{theirs_r.qpn, theirs_r.gid, IBV_MTU_4096}, left{theirs_l.qpn, theirs_l.gid, IBV_MTU_4096};
    right.min_rnr_timer = left.min_rnr_timer = 1;
    modify_to_rts(right_, right);
    modify_to_rts(left_, left);
    char token = 1;
    write_all(to_right, &token, 1);
    write_all(from_left, &token, 1);
    read_all(to_right, &token, 1);
    read_all(from_left, &token, 1);
    close(to_right);
    close(from_left);
  }

  // The first all-reduce's first receive, posted while the QP is still in INIT (allowed), so
  // that it waits before the left neighbour can send.
  void arm() { post_recv(0, 0, 0); }

  // This rank's contribution to all-reduce number `iter`.
  void fill(size_t floats, int iter) {
    for (size_t i = 0; i < floats; ++i) data_[i] = value(o_.rank, i, iter);
  }

  // One all-reduce of the first `floats` elements.
  void run(size_t floats) {
    const int n = o_.ranks, r = o_.rank;
    auto chunk = [&](int c) { return ((c % n) + n) % n; };
    const int steps = 2 * (n - 1);
    // Step 0's receive was posted by connect() or by the previous all-reduce.
    for (int k = 0; k < steps; ++k) {
      const bool reduce = k < n - 1;
      const int s = reduce ? k : k - (n - 1);
      const int send_c = chunk(reduce ? r - s : r + 1 - s);
      const int recv_c = chunk(reduce ? r - s - 1 : r - s);
      post_send(send_c, floats);
      wait(kRecvId);
      // The next step's receive goes into a buffer no step in flight uses (file comment).
      if (k + 1 < steps) {
        const bool next_reduce = k + 1 < n - 1;
        const int ns = next_reduce ? k + 1 : k + 1 - (n - 1);
        post_recv(k + 1, chunk(next_reduce ? r - ns - 1 : r - ns), floats);
      }
      if (reduce) {
        const auto [lo, hi] = bounds(recv_c, floats);
        const float* in = &stage_[(k % 2) * stride()];
        for (size_t i = lo; i < hi; ++i) data_[i] += in[i - lo];
      }
      wait(kSendId);
    }
    post_recv(0, 0, 0);  // the next all-reduce's first step: its left neighbour may start first
  }

  // Elements of the result of all-reduce number `iter` that are not the sum of every rank's.
  size_t wrong(size_t floats, int iter) const {
    size_t bad = 0;
    for (size_t i = 0; i < floats; ++i) {
      float want = 0;
      for (int q = 0; q < o_.ranks; ++q) want += value(q, i, iter);
      bad += data_[i] != want;
    }
    return bad;
  }

 private:
  static float value(int rank, size_t i, int iter) {
    return static_cast<float>((rank + 1) * 3 + static_cast<int>(i % 251) + iter % 7);
  }
  size_t stride() const { return stage_.size() / 2; }
  std::pair<size_t, size_t> bounds(int c, size_t floats) const {
    const size_t n = static_cast<size_t>(o_.ranks);
    return {floats * static_cast<size_t>(c) / n, floats * static_cast<size_t>(c + 1) / n};
  }

  ibv_qp* make_qp() {
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = dev_.cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = a.cap.max_recv_wr = 4;
    a.cap.max_send_sge = a.cap.max_recv_sge = 1;
    ibv_qp* qp = ibv_create_qp(dev_.pd, &a);
    if (!qp) die("ibv_create_qp");
    modify_to_init(qp, 0);
    return qp;
  }

  // Receive of step k: reduce-scatter steps into a whole stage slot (whatever the size, so that
  // it can be posted before the size is known), all-gather steps into chunk c in place.
  void post_recv(int k, int c, size_t floats) {
    ibv_sge sge{};
    if (k < o_.ranks - 1) {
      sge = {reinterpret_cast<uintptr_t>(&stage_[(k % 2) * stride()]),
             static_cast<uint32_t>(stride() * sizeof(float)), stage_mr_->lkey};
    } else {
      const auto [lo, hi] = bounds(c, floats);
      sge = {reinterpret_cast<uintptr_t>(&data_[lo]), static_cast<uint32_t>((hi - lo) * sizeof(float)),
             data_mr_->lkey};
    }
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = kRecvId;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (ibv_post_recv(left_, &wr, &bad)) die("ibv_post_recv");
  }

  void post_send(int c, size_t floats) {
    const auto [lo, hi] = bounds(c, floats);
    ibv_sge sge{reinterpret_cast<uintptr_t>(&data_[lo]), static_cast<uint32_t>((hi - lo) * sizeof(float)),
                data_mr_->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = kSendId;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (ibv_post_send(right_, &wr, &bad)) die("ibv_post_send");
  }

  // Polls until the completion `id` arrives (the other kind may come first: kept for later).
  void wait(uint64_t id) {
    while (pending_[id] == 0) {
      ibv_wc wc[4];
      const int got = ibv_poll_cq(dev_.cq, 4, wc);
      if (got < 0) die("ibv_poll_cq");
      for (int i = 0; i < got; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          std::fprintf(stderr, "ring_allreduce: rank %d: %s completion: %s\n", o_.rank,
                       wc[i].wr_id == kSendId ? "send" : "receive", ibv_wc_status_str(wc[i].status));
          std::exit(3);
        }
        ++pending_[wc[i].wr_id];
      }
    }
    --pending_[id];
  }

  Options o_;
  DeviceBasics dev_;
  std::vector<float> data_, stage_;
  ibv_mr* data_mr_ = nullptr;
  ibv_mr* stage_mr_ = nullptr;
  ibv_qp* right_ = nullptr;
  ibv_qp* left_ = nullptr;
  int pending_[3] = {0, 0, 0};
};

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--dev") o->dev = v;
    else if (k == "--host") o->host = v;
    else if (k == "--rank") o->rank = std::atoi(v.c_str());
    else if (k == "--ranks") o->ranks = std::atoi(v.c_str());
    else if (k == "--port") o->port = std::atoi(v.c_str());
    else if (k == "--iters") o->iters = std::atoi(v.c_str());
    else if (k == "--warmup") o->warmup = std::atoi(v.c_str());
    else if (k == "--min-bytes") o->min_bytes = std::strtoull(v.c_str(), nullptr, 0);
    else if (k == "--max-bytes") o->max_bytes = std::strtoull(v.c_str(), nullptr, 0);
    else return false;
  }
  return argc % 2 == 1 && !o->dev.empty() && o->ranks >= 2 && o->rank >= 0 && o->rank < o->ranks &&
         o->iters > 0 && o->warmup >= 0 && o->min_bytes >= 4 * sizeof(float) * o->ranks &&
         o->min_bytes <= o->max_bytes && o->max_bytes <= (1u << 30);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: ring_allreduce --dev NAME --rank R --ranks N [--host H] [--port P]\n"
                 "       [--min-bytes B] [--max-bytes B (<= 1 GiB)] [--iters K] [--warmup W]\n");
    return 2;
  }
  Ring ring(o);
  ring.arm();
  ring.connect();
  std::printf("# ring all-reduce, %d ranks, float sum; rank %d on %s\n", o.ranks, o.rank, o.dev.c_str());
  std::printf("#%12s %10s %10s %10s %8s\n", "bytes", "time_us", "algbw_GBs", "busbw_GBs", "wrong");
  size_t wrong_total = 0;
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 4) {
    const size_t floats = bytes / sizeof(float);
    size_t wrong = 0;
    double busy_s = 0;  // the all-reduces alone: filling and checking the buffer excluded
    for (int it = -o.warmup; it < o.iters; ++it) {
      ring.fill(floats, it);
      const auto t0 = std::chrono::steady_clock::now();
      ring.run(floats);
      if (it >= 0) busy_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      wrong += ring.wrong(floats, it);
    }
    const double t = busy_s / o.iters;
    const double algbw = static_cast<double>(floats * sizeof(float)) / t / 1e9;
    const double busbw = algbw * 2.0 * (o.ranks - 1) / o.ranks;
    std::printf(" %12zu %10.1f %10.3f %10.3f %8zu\n", floats * sizeof(float), t * 1e6, algbw, busbw,
                wrong);
    std::fflush(stdout);
    wrong_total += wrong;
  }
  return wrong_total == 0 ? 0 : 1;
}
