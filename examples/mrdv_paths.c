/* SPDX-License-Identifier: Apache-2.0 */
/*
 * mrdv_paths: the MetaRoCE direct verbs in one program. Opens the first MetaRoCE device (or
 * -d NAME), prints its MetaRoCE attributes, creates an RC queue pair with a chosen path count
 * and plane mask and connects it to a second queue pair of its own on the same device (its
 * own GID, as ibv_rc_pingpong connects two processes of one host), RDMA-writes a buffer
 * many times, prints the connection and its paths, gives one path a new UDP source port,
 * writes again and checks every byte that arrived.
 *
 * Build: make (pkg-config libmetaroce libibverbs). Run: metaroce exec -- ./mrdv_paths
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <infiniband/metaroce_dv.h>
#include <infiniband/verbs.h>

#define PORT 1
#define GID_INDEX 0
#define WINDOW 16 /* RDMA writes in flight at most */

struct opts {
  const char *dev;
  uint16_t paths;
  uint32_t plane_mask; /* 0: every plane of the device */
  unsigned writes;
  size_t size;
};

static void die(const char *what, int err) {
  fprintf(stderr, "mrdv_paths: %s: %s\n", what, strerror(err));
  exit(1);
}

static void usage(void) {
  fprintf(stderr,
          "usage: mrdv_paths [-d DEVICE] [-p PATHS] [-m PLANE_MASK] [-n WRITES] [-s BYTES]\n"
          "  defaults: the first MetaRoCE device, 4 paths, every plane, 300 writes of 4096\n");
  exit(2);
}

static struct ibv_context *open_device(const char *name) {
  struct ibv_device **list = ibv_get_device_list(NULL);
  struct ibv_context *ctx = NULL;
  if (!list) die("ibv_get_device_list", errno);
  for (int i = 0; list[i] && !ctx; i++) {
    if (!mrdv_is_supported(list[i])) continue;
    if (name && strcmp(ibv_get_device_name(list[i]), name) != 0) continue;
    ctx = ibv_open_device(list[i]);
    if (!ctx) die("ibv_open_device", errno);
  }
  ibv_free_device_list(list);
  if (!ctx) {
    fprintf(stderr, "mrdv_paths: no MetaRoCE device%s%s (run it with metaroce exec)\n",
            name ? " named " : "", name ? name : "");
    exit(1);
  }
  return ctx;
}

static void print_device(struct ibv_context *ctx, const struct mrdv_device_attr *a) {
  static const char *const caps[] = {"plane-mask", "live-paths", "isolated-conn", "rate-hints",
                                     "repath"};
  printf("device %s: wire version %u, %u plane(s) (up 0x%x, at most %u), paths %u by default, "
         "%u at most, SACK %u, %u streams per connection, UDP port %u, rx capacity %u Mbit/s\n",
         ibv_get_device_name(ctx->device), a->wire_version, a->planes, a->planes_up,
         a->max_planes, a->default_paths, a->max_paths, a->sack_bits, a->max_streams,
         a->udp_dport, a->rx_capacity_mbps);
  printf("  caps:");
  for (unsigned i = 0; i < sizeof(caps) / sizeof(caps[0]); i++)
    if (a->device_caps & (1ull << i)) printf(" %s", caps[i]);
  printf("\n");
}

static void to_init(struct ibv_qp *qp) {
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                          .port_num = PORT,
                          .qp_access_flags = IBV_ACCESS_REMOTE_WRITE};
  int err = ibv_modify_qp(qp, &a,
                          IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (err) die("ibv_modify_qp INIT", err);
}

/* INIT -> RTR -> RTS towards remote_qpn on the device of gid. */
static void to_rts(struct ibv_qp *qp, uint32_t remote_qpn, const union ibv_gid *gid,
                   enum ibv_mtu mtu) {
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR,
                          .path_mtu = mtu,
                          .dest_qp_num = remote_qpn,
                          .max_dest_rd_atomic = 1,
                          .min_rnr_timer = 12,
                          .ah_attr = {.is_global = 1,
                                      .port_num = PORT,
                                      .grh = {.dgid = *gid, .sgid_index = GID_INDEX,
                                              .hop_limit = 1}}};
  int err = ibv_modify_qp(qp, &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (err) die("ibv_modify_qp RTR", err);
  struct ibv_qp_attr s = {.qp_state = IBV_QPS_RTS,
                          .timeout = 14,
                          .retry_cnt = 7,
                          .rnr_retry = 7,
                          .max_rd_atomic = 1};
  err = ibv_modify_qp(qp, &s,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (err) die("ibv_modify_qp RTS", err);
}

static uint8_t pattern(unsigned round, unsigned write, size_t byte) {
  return (uint8_t)(round * 131u + write * 7u + byte);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* Writes o->writes buffers of o->size bytes from src to consecutive slots of dst (WINDOW in
 * flight), waits for every completion, then checks dst byte by byte. */
static void write_round(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mr *src,
                        struct ibv_mr *dst, const struct opts *o, unsigned round) {
  uint8_t *s = src->addr, *d = dst->addr;
  unsigned posted = 0, done = 0;
  double deadline = now_s() + 30;
  memset(d, 0, (size_t)o->writes * o->size);
  for (unsigned w = 0; w < o->writes; w++)
    for (size_t b = 0; b < o->size; b++) s[(size_t)w * o->size + b] = pattern(round, w, b);
  double start = now_s();
  while (done < o->writes) {
    while (posted < o->writes && posted - done < WINDOW) {
      struct ibv_sge sge = {.addr = (uintptr_t)(s + (size_t)posted * o->size),
                            .length = (uint32_t)o->size,
                            .lkey = src->lkey};
      struct ibv_send_wr wr = {.wr_id = posted,
                               .sg_list = &sge,
                               .num_sge = 1,
                               .opcode = IBV_WR_RDMA_WRITE,
                               .send_flags = IBV_SEND_SIGNALED,
                               .wr.rdma = {.remote_addr =
                                               (uintptr_t)(d + (size_t)posted * o->size),
                                           .rkey = dst->rkey}};
      struct ibv_send_wr *bad = NULL;
      int err = ibv_post_send(qp, &wr, &bad);
      if (err) die("ibv_post_send", err);
      posted++;
    }
    struct ibv_wc wc[WINDOW];
    int n = ibv_poll_cq(cq, WINDOW, wc);
    if (n < 0) die("ibv_poll_cq", -n);
    for (int i = 0; i < n; i++) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        fprintf(stderr, "mrdv_paths: write %" PRIu64 " completed with %s\n", wc[i].wr_id,
                ibv_wc_status_str(wc[i].status));
        exit(1);
      }
    }
    done += (unsigned)n;
    if (n == 0 && now_s() > deadline) {
      fprintf(stderr, "mrdv_paths: %u of %u writes completed in 30 s\n", done, o->writes);
      exit(1);
    }
  }
  double secs = now_s() - start;
  for (unsigned w = 0; w < o->writes; w++)
    for (size_t b = 0; b < o->size; b++)
      if (d[(size_t)w * o->size + b] != pattern(round, w, b)) {
        fprintf(stderr, "mrdv_paths: round %u: write %u byte %zu is 0x%02x, not 0x%02x\n", round,
                w, b, d[(size_t)w * o->size + b], pattern(round, w, b));
        exit(1);
      }
  printf("round %u: %u writes of %zu bytes in %.3f s, data checked\n", round, o->writes, o->size,
         secs);
}

static void print_conn(struct ibv_qp *qp) {
  struct mrdv_qp_conn c = {0};
  char ip[INET_ADDRSTRLEN] = "?";
  int err = mrdv_query_qp_conn(qp, &c, sizeof(c));
  if (err) die("mrdv_query_qp_conn", err);
  inet_ntop(AF_INET, &c.peer_ipv4, ip, sizeof(ip));
  printf("qp 0x%x: connection 0x%08x lane %u to %s, %u of %u paths active, planes 0x%x, "
         "flags 0x%x, %u stream(s), rate hint %u Mbit/s\n",
         qp->qp_num, c.conn_id, c.lane, ip, c.paths_active, c.num_paths, c.plane_mask, c.flags,
         c.streams, c.rate_hint_mbps);
}

static const char *path_state(uint8_t s) {
  switch (s) {
    case MRDV_PATH_ACTIVE: return "active";
    case MRDV_PATH_FAILED: return "failed";
    case MRDV_PATH_PROBING: return "probing";
    case MRDV_PATH_PLANE_DOWN: return "down";
    default: return "?";
  }
}

/* Prints the path table and returns the UDP source port of path 0. */
static uint16_t print_paths(struct ibv_qp *qp) {
  struct mrdv_path_stats p[64];
  uint32_t n = 0;
  int err = mrdv_query_paths(qp, p, 64, sizeof(p[0]), &n);
  if (err) die("mrdv_query_paths", err);
  printf("  path  sport  plane  state    cwnd  inflight    tx_pkts     tx_bytes  retx  ecn  "
         "gaps  rto  srtt_us\n");
  for (uint32_t i = 0; i < n && i < 64; i++)
    printf("  %4u  %5u  %5u  %-7s %5u  %8u %10" PRIu64 " %12" PRIu64 " %5" PRIu64 " %4" PRIu64
           " %5" PRIu64 " %4" PRIu64 " %8.1f\n",
           p[i].path_id, p[i].udp_sport, p[i].plane, path_state(p[i].state), p[i].cwnd_pkts,
           p[i].inflight_pkts, p[i].tx_pkts, p[i].tx_bytes, p[i].retx_pkts, p[i].ecn_marks,
           p[i].sack_gaps, p[i].timeouts, p[i].srtt_ns / 1e3);
  if (n > 64) printf("  (%u paths, 64 shown)\n", n);
  return n ? p[0].udp_sport : 0;
}

int main(int argc, char **argv) {
  struct opts o = {.dev = NULL, .paths = 4, .plane_mask = 0, .writes = 300, .size = 4096};
  int c;
  while ((c = getopt(argc, argv, "d:p:m:n:s:h")) != -1) {
    switch (c) {
      case 'd': o.dev = optarg; break;
      case 'p': o.paths = (uint16_t)strtoul(optarg, NULL, 0); break;
      case 'm': o.plane_mask = (uint32_t)strtoul(optarg, NULL, 0); break;
      case 'n': o.writes = (unsigned)strtoul(optarg, NULL, 0); break;
      case 's': o.size = strtoul(optarg, NULL, 0); break;
      default: usage();
    }
  }
  if (optind != argc || o.writes == 0 || o.size == 0 || o.size > (1u << 20))
    usage();

  struct ibv_context *ctx = open_device(o.dev);
  struct mrdv_device_attr dattr = {0};
  int err = mrdv_query_device(ctx, &dattr, sizeof(dattr));
  if (err) die("mrdv_query_device", err);
  print_device(ctx, &dattr);

  struct ibv_port_attr port;
  union ibv_gid gid;
  if ((err = ibv_query_port(ctx, PORT, &port))) die("ibv_query_port", err);
  if ((err = ibv_query_gid(ctx, PORT, GID_INDEX, &gid))) die("ibv_query_gid", err);
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  if (!pd) die("ibv_alloc_pd", errno);
  struct ibv_cq *cq = ibv_create_cq(ctx, 2 * WINDOW, NULL, NULL, 0);
  if (!cq) die("ibv_create_cq", errno);
  size_t len = (size_t)o.writes * o.size;
  void *sbuf = calloc(1, len), *dbuf = calloc(1, len);
  if (!sbuf || !dbuf) die("calloc", ENOMEM);
  struct ibv_mr *src = ibv_reg_mr(pd, sbuf, len, 0);
  struct ibv_mr *dst = ibv_reg_mr(pd, dbuf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!src || !dst) die("ibv_reg_mr", errno);

  /* Both queue pairs with the same MetaRoCE settings: the writer and its target. */
  struct mrdv_qp_init_attr mattr = {.comp_mask = MRDV_QP_INIT_PATHS, .num_paths = o.paths};
  if (o.plane_mask) {
    mattr.comp_mask |= MRDV_QP_INIT_PLANE_MASK;
    mattr.plane_mask = o.plane_mask;
  }
  struct ibv_qp *qp[2];
  for (int i = 0; i < 2; i++) {
    struct ibv_qp_init_attr_ex qattr = {
        .qp_type = IBV_QPT_RC,
        .send_cq = cq,
        .recv_cq = cq,
        .cap = {.max_send_wr = WINDOW, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1},
        .comp_mask = IBV_QP_INIT_ATTR_PD,
        .pd = pd,
    };
    qp[i] = mrdv_create_qp(ctx, &qattr, &mattr, sizeof(mattr));
    if (!qp[i]) die("mrdv_create_qp", errno);
    to_init(qp[i]);
  }
  to_rts(qp[0], qp[1]->qp_num, &gid, port.active_mtu);
  to_rts(qp[1], qp[0]->qp_num, &gid, port.active_mtu);

  write_round(qp[0], cq, src, dst, &o, 1);
  print_conn(qp[0]);
  uint16_t before = print_paths(qp[0]);

  if (dattr.device_caps & MRDV_CAP_REPATH) {
    uint16_t sport = 0;
    err = mrdv_repath(qp[0], 0, &sport);
    if (err) die("mrdv_repath", err);
    printf("repath: path 0 moved from UDP source port %u to %u\n", before, sport);
    write_round(qp[0], cq, src, dst, &o, 2);
    print_conn(qp[0]);
    uint16_t after = print_paths(qp[0]);
    /* It keeps the new port unless the engine re-picked it meanwhile (a failure, a probe). */
    if (after != sport) printf("note: path 0 is on port %u now\n", after);
  } else {
    printf("repath: the device cannot re-pick a path's entropy\n");
  }

  for (int i = 0; i < 2; i++)
    if ((err = ibv_destroy_qp(qp[i]))) die("ibv_destroy_qp", err);
  ibv_dereg_mr(src);
  ibv_dereg_mr(dst);
  free(sbuf);
  free(dbuf);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  printf("mrdv_paths: OK\n");
  return 0;
}
