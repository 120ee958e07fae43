// SPDX-License-Identifier: Apache-2.0
// The answers to a driver context's object requests (hostif::Op): one handler per operation, in
// a file per object family. HostEngine::serve (serve.cc) finds the handler in the table,
// refuses what a kernel context may not make, applies the process's limits around it and makes
// its answer; the handler checks the request, runs the NIC operation on the datapath
// (HostEngine::on_datapath) and fills in what the answer carries.
//   serve_memory.cc  protection domains, memory regions and windows
//   serve_queues.cc  completion queues and shared receive queues (XRC, tag matching)
//   serve_qps.cc     queue pairs, XRC domains, RSS tables and flows, multicast
//   serve_paths.cc   a QP's paths (metaroce_dv.h) and the device's state
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "datapath/engine/host_engine.h"

namespace metaroce::engine {

// An answer to req: its header, with status.
hostif::Message reply_to(const hostif::Message& req, int status);
// A descriptor of the request, now the caller's (-1 when absent).
int take_fd(hostif::Message& m, size_t i);

class Server {
 public:
  explicit Server(HostEngine& engine) : engine_(engine) {}

  // A handler: 0 or an errno; what the answer carries (its body, descriptors) goes in r. One
  // that keeps a descriptor of req sets its entry to -1.
  using Handler = int (Server::*)(Session& s, hostif::Message& req, hostif::Message& r);
  // The handler of op; nullptr when serve does not answer op (EOPNOTSUPP).
  static Handler handler_for(hostif::Op op);

  // Memory (serve_memory.cc).
  int alloc_pd(Session& s, hostif::Message& req, hostif::Message& r);
  int dealloc_pd(Session& s, hostif::Message& req, hostif::Message& r);
  int reg_mr(Session& s, hostif::Message& req, hostif::Message& r);
  int rereg_mr(Session& s, hostif::Message& req, hostif::Message& r);
  int map_pages(Session& s, hostif::Message& req, hostif::Message& r);
  int check_mr(Session& s, hostif::Message& req, hostif::Message& r);
  int dereg_mr(Session& s, hostif::Message& req, hostif::Message& r);
  int alloc_mw(Session& s, hostif::Message& req, hostif::Message& r);
  int dealloc_mw(Session& s, hostif::Message& req, hostif::Message& r);
  // Queues (serve_queues.cc).
  int create_cq(Session& s, hostif::Message& req, hostif::Message& r);
  int resize_cq(Session& s, hostif::Message& req, hostif::Message& r);
  int destroy_cq(Session& s, hostif::Message& req, hostif::Message& r);
  int create_srq(Session& s, hostif::Message& req, hostif::Message& r);
  int create_xrc_srq(Session& s, hostif::Message& req, hostif::Message& r);
  int create_tm_srq(Session& s, hostif::Message& req, hostif::Message& r);
  int srq_tag_op(Session& s, hostif::Message& req, hostif::Message& r);
  int destroy_srq(Session& s, hostif::Message& req, hostif::Message& r);
  // Queue pairs and what routes to them (serve_qps.cc).
  int create_qp(Session& s, hostif::Message& req, hostif::Message& r);
  int modify_qp(Session& s, hostif::Message& req, hostif::Message& r);
  int destroy_qp(Session& s, hostif::Message& req, hostif::Message& r);
  int open_xrcd(Session& s, hostif::Message& req, hostif::Message& r);
  int close_xrcd(Session& s, hostif::Message& req, hostif::Message& r);
  int open_qp(Session& s, hostif::Message& req, hostif::Message& r);
  int close_qp(Session& s, hostif::Message& req, hostif::Message& r);
  int create_ind_table(Session& s, hostif::Message& req, hostif::Message& r);
  int destroy_ind_table(Session& s, hostif::Message& req, hostif::Message& r);
  int create_rss_qp(Session& s, hostif::Message& req, hostif::Message& r);
  int create_flow(Session& s, hostif::Message& req, hostif::Message& r);
  int destroy_flow(Session& s, hostif::Message& req, hostif::Message& r);
  int attach_mcast(Session& s, hostif::Message& req, hostif::Message& r);  // and detach
  // Paths and the device (serve_paths.cc).
  int set_qp_paths(Session& s, hostif::Message& req, hostif::Message& r);
  int query_qp_conn(Session& s, hostif::Message& req, hostif::Message& r);
  int query_paths(Session& s, hostif::Message& req, hostif::Message& r);
  int repath(Session& s, hostif::Message& req, hostif::Message& r);
  int query_device(Session& s, hostif::Message& req, hostif::Message& r);

 private:
  void on_datapath(const std::function<void()>& fn) { engine_.on_datapath(fn); }
  int room(const Session& s, int kind, size_t ring_bytes) const {
    return engine_.room(s, kind, ring_bytes);
  }
  // *seg: a new shared segment for an object's ring of `bytes`, within s's ring memory limits
  // (room); 0 or ENOMEM.
  int new_ring(const Session& s, const char* name, size_t bytes, Segment* seg) const;
  // r's descriptor of a new object's ring segment, which s keeps under (kind, id).
  static void hand_over(Session& s, hostif::Message& r, char kind, uint32_t id, Segment seg);
  // kRegMr of a kernel context: the region's pages mapped through the module.
  int reg_kernel_mr(Session& s, const hostif::RegMrReq& b, hostif::RegMrResp* m);
  // kMapPages: pieces of a region of s that it may reach in the memfd fd.
  int map_pieces(Session& s, const hostif::MapPagesReq& b, int fd);
  // Every kind of SRQ: its ring in a shared segment, made by `create` on the datapath.
  template <class Create>
  int new_srq(Session& s, hostif::Message& r, uint32_t max_wr, uint32_t max_sge, Create create);

  HostEngine& engine_;
};

}  // namespace metaroce::engine
