/* SPDX-License-Identifier: Apache-2.0 */
/*
 * MetaRoCE direct verbs: what a MetaRoCE device offers beyond the verbs of libibverbs (planes
 * chosen by the endpoint, the paths of a connection, how queue pairs ride connections, per-path
 * telemetry). Installed as <infiniband/metaroce_dv.h>; link with -lmetaroce (pkg-config
 * libmetaroce). Overview: mrdv(7); one manual page per function.
 *
 * Every structure starts with comp_mask and is passed with its length (inlen), so that later
 * versions can grow it: a caller built against an older header passes its shorter length and
 * keeps working; unknown comp_mask bits are refused with EINVAL. Functions that return int
 * return 0 or a positive errno value; mrdv_create_qp returns NULL and sets errno. Calls on
 * a context or queue pair of another provider return EOPNOTSUPP.
 */
#ifndef METAROCE_DV_H
#define METAROCE_DV_H

#include <stdbool.h>
#include <stdint.h>

#include <infiniband/verbs.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the MetaRoCE wire protocol (docs/spec/wire.md) this library speaks. */
#define MRDV_WIRE_VERSION 1
/* Most planes (device ports) a device has; plane masks are 32-bit with bits above it zero. */
#define MRDV_MAX_PLANES 16

/* True when device is a MetaRoCE device (any other: false). */
bool mrdv_is_supported(struct ibv_device *device);

/* The resource_type a parent domain's alloc() and free() are called with (ibv_alloc_parent_domain(3)):
 * the provider's memory for a QP, CQ or SRQ created with that parent domain. */
enum mrdv_resource_type {
  MRDV_RES_TYPE_QP = 1,
  MRDV_RES_TYPE_CQ = 2,
  MRDV_RES_TYPE_SRQ = 3,
};

/* --- device ----------------------------------------------------------------------------- */

enum mrdv_device_caps {
  MRDV_CAP_PLANE_MASK = 1 << 0,     /* a QP chooses the planes its paths use */
  MRDV_CAP_LIVE_PATHS = 1 << 1,     /* plane mask and path count change on a live QP */
  MRDV_CAP_ISOLATED_CONN = 1 << 2,  /* a QP may ride a connection of its own */
  MRDV_CAP_RATE_HINTS = 1 << 3,     /* this device sends fair-share hints as a receiver */
  MRDV_CAP_REPATH = 1 << 4,         /* a path's entropy can be re-picked on demand */
};

struct mrdv_device_attr {
  uint64_t comp_mask;         /* in: 0 */
  uint32_t wire_version;      /* MRDV_WIRE_VERSION of the engine */
  uint32_t sack_bits;         /* SACK span of a path (256) */
  uint16_t planes;            /* ports of this device, plane 0 first */
  uint16_t max_planes;        /* MRDV_MAX_PLANES */
  uint16_t default_paths;     /* paths of a QP created without MRDV_QP_INIT_PATHS */
  uint16_t max_paths;         /* paths per connection at most */
  uint32_t planes_up;         /* mask: planes whose port is up and not set down */
  uint32_t max_streams;       /* QPs one connection carries at most */
  uint64_t device_caps;       /* enum mrdv_device_caps */
  uint16_t udp_dport;         /* the device's UDP port */
  uint16_t reserved;
  uint32_t rx_capacity_mbps;  /* inbound capacity shared by rate hints, 0 = no hints */
};

/* EINVAL: comp_mask not 0, inlen too short for the fields up to device_caps, or a NULL
 * argument; EOPNOTSUPP: not a MetaRoCE context; ENODEV: the engine is gone. */
int mrdv_query_device(struct ibv_context *context, struct mrdv_device_attr *attr,
                            uint32_t inlen);

/* --- queue pairs ------------------------------------------------------------------------ */

enum mrdv_qp_init_attr_mask {
  MRDV_QP_INIT_PATHS = 1 << 0,       /* num_paths is set */
  MRDV_QP_INIT_PLANE_MASK = 1 << 1,  /* plane_mask is set */
  MRDV_QP_INIT_FLAGS = 1 << 2,       /* flags is set */
};

enum mrdv_qp_flags {
  /* The QP rides a connection of its own (its own paths, windows and sequence spaces) instead
   * of sharing the connection of every QP with the same settings to the same peer device. */
  MRDV_QP_ISOLATED = 1 << 0,
  /* The QP's connection ignores the receiver's fair-share rate hints (ECN AIMD still applies). */
  MRDV_QP_NO_RATE_HINTS = 1 << 1,
};

struct mrdv_qp_init_attr {
  uint64_t comp_mask;   /* enum mrdv_qp_init_attr_mask */
  uint16_t num_paths;   /* 1..max_paths; default: the device's default_paths */
  uint16_t reserved;
  uint32_t plane_mask;  /* non-zero, only planes the device has; default: every plane */
  uint32_t flags;       /* enum mrdv_qp_flags */
  uint32_t reserved2;
};

/* Creates an RC QP as ibv_create_qp_ex would, with MetaRoCE attributes. NULL with errno:
 * EINVAL for a bad attribute (unknown comp_mask or flag bits, num_paths out of range, empty plane
 * mask or one naming a plane the device lacks, inlen too short), EOPNOTSUPP for a QP type other
 * than IBV_QPT_RC or a context of another provider, and the errors of ibv_create_qp_ex.
 * Destroy it with ibv_destroy_qp. */
struct ibv_qp *mrdv_create_qp(struct ibv_context *context,
                                    struct ibv_qp_init_attr_ex *qp_attr,
                                    struct mrdv_qp_init_attr *metaroce_attr,
                                    uint32_t inlen);

enum mrdv_qp_attr_mask {
  MRDV_QP_ATTR_PATHS = 1 << 0,
  MRDV_QP_ATTR_PLANE_MASK = 1 << 1,
};

struct mrdv_qp_attr {
  uint64_t comp_mask;   /* enum mrdv_qp_attr_mask: what to change */
  uint16_t num_paths;
  uint16_t reserved;
  uint32_t plane_mask;
};

/* Changes the path count and/or plane mask of an RC QP, in any state, while traffic flows: its
 * later packets use the new paths and planes; packets in flight complete where they are. An
 * isolated QP changes its own connection; a shared one moves to the connection of its new
 * settings. EINVAL: bad comp_mask or values (as mrdv_create_qp); EOPNOTSUPP: not a MetaRoCE
 * RC QP; ENODEV: the engine is gone. */
int mrdv_modify_qp(struct ibv_qp *qp, const struct mrdv_qp_attr *attr, uint32_t inlen);

/* How a QP rides its connection. */
struct mrdv_qp_conn {
  uint64_t comp_mask;       /* in: 0 */
  uint32_t conn_id;         /* our direction's connection id on the wire; 0 before the QP has
                             * a peer (RTR) */
  uint32_t lane;            /* the engine's name of the connection among those to the peer
                             * device: 0 is the shared connection of QPs with default settings */
  uint32_t peer_ipv4;       /* the peer device's address, network byte order; 0 before RTR */
  uint16_t num_paths;
  uint16_t paths_active;    /* of num_paths: in service now */
  uint32_t plane_mask;
  uint32_t flags;           /* enum mrdv_qp_flags in force */
  uint32_t streams;         /* QPs of this device on the same connection, this one included */
  uint32_t rate_hint_mbps;  /* the peer's fair-share hint in force, 0 = none */
  uint32_t reserved;
};

/* EINVAL: comp_mask not 0, inlen too short, NULL argument; EOPNOTSUPP: not a MetaRoCE RC QP. */
int mrdv_query_qp_conn(struct ibv_qp *qp, struct mrdv_qp_conn *conn, uint32_t inlen);

/* --- paths ------------------------------------------------------------------------------ */

enum mrdv_path_state {
  MRDV_PATH_ACTIVE = 0,   /* carries data */
  MRDV_PATH_FAILED = 1,   /* declared failed; its packets moved to other paths */
  MRDV_PATH_PROBING = 2,  /* probed under a new entropy value; back when answered */
  MRDV_PATH_PLANE_DOWN = 3, /* its plane is down: it carries nothing until it is up */
};

/* One path of a QP's connection, as the sender sees it. Times in nanoseconds, 0 until the
 * first sample. Counters count since the connection was made. */
struct mrdv_path_stats {
  uint16_t path_id;
  uint16_t udp_sport;        /* current entropy value */
  uint8_t plane;
  uint8_t state;             /* enum mrdv_path_state */
  uint16_t reserved;
  uint32_t cwnd_pkts;        /* congestion window */
  uint32_t inflight_pkts;
  uint64_t inflight_bytes;
  uint64_t srtt_ns;
  uint64_t min_rtt_ns;
  uint64_t tx_pkts;
  uint64_t tx_bytes;
  uint64_t retx_pkts;        /* resent on this path, for any reason */
  uint64_t ecn_marks;        /* CE marks the receiver echoed for this path */
  uint64_t sack_gaps;        /* packets found missing by SACK */
  uint64_t timeouts;         /* retransmission timer expiries */
  uint32_t rate_hint_mbps;   /* the connection's last rate hint from the receiver, 0 = none */
  uint32_t reserved2;
};

/* Copies up to max_entries paths of qp's connection into entries, each entry_len bytes apart
 * (sizeof(struct mrdv_path_stats) of the caller's header; longer entries get zero tails),
 * and the connection's path count into *num_paths (which may exceed max_entries). EINVAL:
 * entry_len shorter than this version's structure, NULL argument with max_entries > 0;
 * ENOTCONN: the QP has no peer yet (before RTR); EOPNOTSUPP: not a MetaRoCE RC QP. */
int mrdv_query_paths(struct ibv_qp *qp, struct mrdv_path_stats *entries,
                           uint32_t max_entries, uint32_t entry_len, uint32_t *num_paths);

/* Gives path path_id of qp's connection a new UDP source port (entropy), as when the path is
 * re-probed after a failure, and returns it in *udp_sport (may be NULL). For a route that is
 * slow but not failed. Shared connections: every QP on it sees the change. EINVAL: path_id
 * past the connection's paths; ENOTCONN: no peer yet; EOPNOTSUPP: not a MetaRoCE RC QP. */
int mrdv_repath(struct ibv_qp *qp, uint16_t path_id, uint16_t *udp_sport);

#ifdef __cplusplus
}
#endif

#endif /* METAROCE_DV_H */
