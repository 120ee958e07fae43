// SPDX-License-Identifier: Apache-2.0
// fabric_probe: attaches a memif client to every endpoint and plane of a running fabric, sends
// UDP frames from endpoint 0 to endpoint 1 and back on every plane (source ports cycling, as
// MetaRoCE's paths do) and prints one JSON line of what arrived: the integration test's traffic.
//
//   fabric_probe --fabric NAME --endpoints E --planes P [--count N] [--size BYTES]
//                [--ports N] [--pps R] [--linger-ms T]
#include <getopt.h>
#include <unistd.h>

#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "datapath/fabric/fabric_control.h"
#include "datapath/wire/bytes.h"
#include "datapath/wire/frame.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using metaroce::wire::MacAddr;

constexpr uint16_t kUdpPort = 4793;
constexpr uint16_t kBurst = 32;

struct Options {
  std::string fabric;
  uint32_t endpoints = 2, planes = 1, count = 1000, size = 512, ports = 16, pps = 50000;
  uint32_t linger_ms = 500;
};

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "fabric_probe: %s\n", why.c_str());
  std::exit(1);
}

MacAddr mac_of(uint32_t e, uint32_t p) { return {0x02, 0xfa, 0, 0, uint8_t(p), uint8_t(e + 1)}; }
uint32_t ip_of(uint32_t e, uint32_t p) { return 0xc6120000u | (p << 8) | (e + 1); }  // 198.18.p.e+1

struct End {
  uint16_t port = 0;
  uint32_t endpoint = 0, plane = 0;
  uint64_t sent = 0, received = 0, ce = 0, bad = 0, reordered = 0, arp = 0;
  int64_t last_seq = -1;
  bool goodbye_acked = false;
};

void drain(End& end) {
  rte_mbuf* bufs[kBurst];
  const uint16_t n = rte_eth_rx_burst(end.port, 0, bufs, kBurst);
  for (uint16_t i = 0; i < n; ++i) {
    const auto* d = rte_pktmbuf_mtod(bufs[i], const uint8_t*);
    if (const auto kind = metaroce::wire::goodbye_kind({d, rte_pktmbuf_data_len(bufs[i])})) {
      end.goodbye_acked |= *kind == metaroce::wire::kGoodbyeAck;
      continue;  // link-local: not traffic (freed with the burst below)
    }
    const auto info = metaroce::wire::parse_frame({d, rte_pktmbuf_data_len(bufs[i])}, kUdpPort);
    if (info.kind == metaroce::wire::FrameKind::kArp) {
      ++end.arp;
    } else if (info.kind != metaroce::wire::FrameKind::kMetaRoce ||
               info.payload.size() < 4 || info.dst_mac != mac_of(end.endpoint, end.plane)) {
      ++end.bad;  // a corrupted checksum or a frame for someone else
    } else {
      ++end.received;
      if (info.ecn == metaroce::wire::Ecn::kCe) ++end.ce;
      const int64_t seq = metaroce::wire::load_be32(info.payload.data());
      if (seq < end.last_seq) ++end.reordered;
      end.last_seq = std::max(end.last_seq, seq);
    }
  }
  if (n != 0) rte_pktmbuf_free_bulk(bufs, n);
}

bool send_frame(End& from, rte_mempool* pool, const std::vector<uint8_t>& bytes) {
  rte_mbuf* m = rte_pktmbuf_alloc(pool);
  if (m == nullptr) return false;
  std::memcpy(rte_pktmbuf_mtod(m, void*), bytes.data(), bytes.size());
  m->data_len = static_cast<uint16_t>(bytes.size());
  m->pkt_len = static_cast<uint32_t>(bytes.size());
  if (rte_eth_tx_burst(from.port, 0, &m, 1) != 1) {
    rte_pktmbuf_free(m);
    return false;
  }
  ++from.sent;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  static const option longs[] = {
      {"fabric", required_argument, nullptr, 'f'}, {"endpoints", required_argument, nullptr, 'e'},
      {"planes", required_argument, nullptr, 'p'}, {"count", required_argument, nullptr, 'c'},
      {"size", required_argument, nullptr, 's'},   {"ports", required_argument, nullptr, 'P'},
      {"pps", required_argument, nullptr, 'r'},    {"linger-ms", required_argument, nullptr, 'l'},
      {nullptr, 0, nullptr, 0}};
  for (int c; (c = getopt_long(argc, argv, "", longs, nullptr)) != -1;) {
    const auto v = optarg ? static_cast<uint32_t>(std::strtoul(optarg, nullptr, 10)) : 0;
    switch (c) {
      case 'f': o.fabric = optarg; break;
      case 'e': o.endpoints = v; break;
      case 'p': o.planes = v; break;
      case 'c': o.count = v; break;
      case 's': o.size = v; break;
      case 'P': o.ports = v; break;
      case 'r': o.pps = v; break;
      case 'l': o.linger_ms = v; break;
      default: die("usage: fabric_probe --fabric NAME --endpoints E --planes P [--count N] "
                   "[--size B] [--ports N] [--pps R] [--linger-ms T]");
    }
  }
  if (o.fabric.empty() || o.endpoints < 2 || o.planes < 1 || o.size < 64 || o.size > 9000 ||
      o.ports < 1 || o.pps < 1)
    die("bad arguments (need --fabric, --endpoints >= 2, --size 64..9000)");

  std::vector<std::string> args = {"fabric_probe", "--no-pci", "--no-huge", "-m", "256",
                                   "--no-shconf", "--no-telemetry", "--file-prefix",
                                   "fabric-probe-" + std::to_string(getpid()),
                                   "--lcores=0@(0-1)", "--log-level=*:error"};
  std::vector<End> ends;
  for (uint32_t e = 0; e < 2; ++e)
    for (uint32_t p = 0; p < o.planes; ++p) {
      args.push_back("--vdev=net_memif_probe" + std::to_string(ends.size()) +
                     ",role=client,id=0,bsize=9216,socket=" +
                     metaroce::fabric::socket_name(o.fabric, e, p));
      End end;
      end.endpoint = e;
      end.plane = p;
      ends.push_back(end);
    }
  std::vector<char*> argv_eal;
  for (auto& a : args) argv_eal.push_back(a.data());
  argv_eal.push_back(nullptr);
  if (rte_eal_init(static_cast<int>(args.size()), argv_eal.data()) < 0)
    die(std::string("EAL init: ") + rte_strerror(rte_errno));
  const std::string eal_dir = rte_eal_get_runtime_dir();
  rte_mempool* pool = rte_pktmbuf_pool_create("probe", 4095, 256, 0, 9216 + RTE_PKTMBUF_HEADROOM,
                                              static_cast<int>(rte_socket_id()));
  if (pool == nullptr) die("mbuf pool");
  for (size_t i = 0; i < ends.size(); ++i) {
    const std::string dev = "net_memif_probe" + std::to_string(i);
    if (rte_eth_dev_get_port_by_name(dev.c_str(), &ends[i].port) != 0) die("no port " + dev);
    rte_eth_conf conf{};
    if (rte_eth_dev_configure(ends[i].port, 1, 1, &conf) != 0 ||
        rte_eth_rx_queue_setup(ends[i].port, 0, 1024, rte_socket_id(), nullptr, pool) != 0 ||
        rte_eth_tx_queue_setup(ends[i].port, 0, 1024, rte_socket_id(), nullptr) != 0 ||
        rte_eth_dev_start(ends[i].port) != 0)
      die("cannot start " + dev);
  }
  // Every client connected (a client that came before its server retries by restarting).
  const auto connect_deadline = Clock::now() + 10s;
  for (auto& end : ends) {
    auto retry = Clock::now() + 500ms;
    for (;;) {
      rte_eth_link link{};
      if (rte_eth_link_get_nowait(end.port, &link) == 0 && link.link_status) break;
      if (Clock::now() > connect_deadline)
        die("endpoint " + std::to_string(end.endpoint) + " plane " + std::to_string(end.plane) +
            " did not connect");
      if (Clock::now() > retry) {
        rte_eth_dev_stop(end.port);
        rte_eth_dev_start(end.port);
        retry = Clock::now() + 500ms;
      }
      drain(end);  // memif clients hand the server their RX buffers from inside rx_burst
      std::this_thread::sleep_for(2ms);
    }
  }

  // Clients hand the server their receive buffers only from inside rx_burst: poll every port
  // once more so none drops the first frames sent to it.
  for (auto until = Clock::now() + 20ms; Clock::now() < until;) {
    for (auto& end : ends) drain(end);
    std::this_thread::sleep_for(1ms);
  }

  // Learning first: each endpoint announces itself on every plane with a broadcast ARP.
  for (auto& end : ends) {
    metaroce::wire::ArpPacket a;
    a.sender_mac = mac_of(end.endpoint, end.plane);
    a.sender_ip = ip_of(end.endpoint, end.plane);
    a.target_ip = ip_of(1 - end.endpoint, end.plane);
    std::vector<uint8_t> f(metaroce::wire::kArpFrameLen);
    metaroce::wire::build_arp(f, a);
    send_frame(end, pool, f);
  }
  for (auto until = Clock::now() + 100ms; Clock::now() < until;) {
    for (auto& end : ends) drain(end);
    std::this_thread::sleep_for(1ms);
  }

  // Both directions on every plane, paced at --pps frames per second in total.
  const auto gap = std::chrono::duration<double>(1.0 / o.pps);
  const auto begin = Clock::now();
  uint64_t sent_total = 0, send_failed = 0;
  std::vector<uint8_t> payload(o.size - metaroce::wire::kUdpFrameHeaderLen);
  std::vector<uint8_t> frame(o.size);
  for (uint32_t i = 0; i < o.count; ++i) {
    for (auto& from : ends) {
      const uint32_t to = 1 - from.endpoint;
      metaroce::wire::UdpFrameParams pr;
      pr.src_mac = mac_of(from.endpoint, from.plane);
      pr.dst_mac = mac_of(to, from.plane);
      pr.src_ip = ip_of(from.endpoint, from.plane);
      pr.dst_ip = ip_of(to, from.plane);
      pr.src_port = static_cast<uint16_t>(49152 + i % o.ports);
      pr.dst_port = kUdpPort;
      pr.ecn = metaroce::wire::Ecn::kEct0;
      metaroce::wire::store_be32(payload.data(), i);
      metaroce::wire::build_udp_frame(frame, pr, payload);
      // A full TX ring (or an empty pool) is backpressure from a fabric that has not had the CPU
      // yet, not loss: keep receiving and try again, for up to a second.
      bool sent_ok = send_frame(from, pool, frame);
      for (auto until = Clock::now() + std::chrono::seconds(1); !sent_ok && Clock::now() < until;) {
        for (auto& end : ends) drain(end);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        sent_ok = send_frame(from, pool, frame);
      }
      if (!sent_ok) ++send_failed;
      ++sent_total;
    }
    for (auto& end : ends) drain(end);
    const auto due = begin + std::chrono::duration_cast<Clock::duration>(gap * sent_total);
    while (Clock::now() < due) {
      for (auto& end : ends) drain(end);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  for (auto until = Clock::now() + std::chrono::milliseconds(o.linger_ms); Clock::now() < until;) {
    for (auto& end : ends) drain(end);
    std::this_thread::sleep_for(200us);
  }

  // Goodbye first (docs/spec/link.md §4): memif unmaps the rings from the fabric's interrupt
  // thread when this client disconnects, and a fabric still polling them then crashed. The fabric
  // answers and leaves the port alone until the link goes down, or for 1 s: so every port says
  // it at once and all close together. A fabric that does not answer within 5 s (far longer than
  // the NIC waits: this is a test's tool) is left anyway, and the summary says so.
  std::vector<uint8_t> bye(metaroce::wire::kGoodbyeFrameLen);
  for (auto& end : ends) {
    metaroce::wire::build_goodbye(bye, mac_of(end.endpoint, end.plane), metaroce::wire::kGoodbye);
    if (send_frame(end, pool, bye)) --end.sent;  // not traffic
  }
  const auto all_acked = [&] {
    return std::all_of(ends.begin(), ends.end(), [](const End& e) { return e.goodbye_acked; });
  };
  for (auto until = Clock::now() + 5s; !all_acked() && Clock::now() < until;) {
    for (auto& end : ends) drain(end);
    std::this_thread::sleep_for(50us);
  }
  uint64_t sent = 0, received = 0, ce = 0, bad = 0, reordered = 0;
  std::string per;
  for (const auto& end : ends) {
    sent += end.sent;
    received += end.received;
    ce += end.ce;
    bad += end.bad;
    reordered += end.reordered;
    char buf[256];
    std::snprintf(buf, sizeof(buf),
                  "%s{\"endpoint\":%u,\"plane\":%u,\"sent\":%" PRIu64 ",\"received\":%" PRIu64
                  ",\"ce\":%" PRIu64 ",\"arp\":%" PRIu64 ",\"goodbye_acked\":%s}",
                  per.empty() ? "" : ",", end.endpoint, end.plane, end.sent, end.received, end.ce,
                  end.arp, end.goodbye_acked ? "true" : "false");
    per += buf;
  }
  std::printf("{\"sent\":%" PRIu64 ",\"send_failed\":%" PRIu64 ",\"received\":%" PRIu64
              ",\"ce\":%" PRIu64 ",\"bad\":%" PRIu64 ",\"reordered\":%" PRIu64 ",\"ends\":[%s]}\n",
              sent, send_failed, received, ce, bad, reordered, per.c_str());
  std::fflush(stdout);
  // The fabric (the memif server) never hangs up first, so stopping here cannot race it.
  for (auto& end : ends) rte_eth_dev_stop(end.port);
  std::error_code ec;
  std::filesystem::remove_all(eal_dir, ec);
  return 0;
}
