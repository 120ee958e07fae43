// SPDX-License-Identifier: Apache-2.0
// The device and port attributes the provider reports, derived only from the interface's limits
// and the link configuration, so that query_device_ex/query_port stay honest and testable.
#pragma once

#include <endian.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "datapath/hostif/control.h"
#include "datapath/hostif/queues.h"
#include "datapath/nic/link_config.h"
#include "providers/metaroce/convert.h"

#ifndef METAROCE_VERSION
#define METAROCE_VERSION "0.0.0"
#endif

namespace metaroce::provider {

inline constexpr uint32_t kMaxAh = 1u << 20;  // an AH is an IPv4 address in host memory
inline constexpr uint32_t kMaxRdAtom = hostif::kMaxRdAtomic;  // outstanding READ/atomics per QP
inline constexpr uint32_t kVendorId = 0x4d5243;  // "MRC": no IEEE OUI is registered for us
inline constexpr uint32_t kVendorPartId = 1;
inline constexpr uint8_t kPortNum = 1;
inline constexpr uint32_t kMaxMsgSize = 1u << 31;
inline constexpr uint8_t kLocalCaAckDelay = 15;  // 4.096 us * 2^15 ~ 134 ms: software timers

// The node GUID in host order: the configured one, else one derived from the link's IPv4
// (locally administered, so it cannot collide with a vendor GUID), never zero.
using nic::node_guid_of;

// What one process may hold: its share of the link, within the link's own limits
// (verbs-mapping.md §20). The engine refuses the next object with ENOMEM.
inline nic::Limits process_limits(const nic::LinkConfig& cfg) {
  const nic::Limits& d = cfg.limits;
  const nic::Limits& p = cfg.process_limits;
  nic::Limits l;
  l.qp = std::min(d.qp, p.qp);
  l.cq = std::min(d.cq, p.cq);
  l.srq = std::min(d.srq, p.srq);
  l.pd = std::min(d.pd, p.pd);
  l.mr = std::min(d.mr, p.mr);
  return l;
}

// Whether plane 0 carries Ethernet frames: not a UDP-socket plane ("udp", "udp,iface=NAME";
// nic::parse_udp_plane, which the provider's tests cannot link), and the link kernel-free.
inline bool offers_multicast(const nic::LinkConfig& cfg) {
  const std::string plane0 = cfg.devargs.substr(0, cfg.devargs.find(nic::kPlaneSeparator));
  return cfg.kernel.empty() && plane0 != "udp" && !plane0.starts_with("udp,");
}

inline ibv_device_attr_ex device_attr(const nic::LinkConfig& cfg) {
  const nic::Limits lim = process_limits(cfg);
  ibv_device_attr_ex ex;
  std::memset(&ex, 0, sizeof(ex));
  ibv_device_attr& a = ex.orig_attr;
  std::strncpy(a.fw_ver, METAROCE_VERSION, sizeof(a.fw_ver) - 1);
  a.node_guid = htobe64(node_guid_of(cfg));
  a.sys_image_guid = a.node_guid;
  a.max_mr_size = hostif::kMaxMrSize;
  a.page_size_cap = ~uint64_t{4095};  // any power-of-two page size from 4 KiB up
  a.vendor_id = kVendorId;
  a.vendor_part_id = kVendorPartId;
  a.hw_ver = 1;
  a.max_qp = static_cast<int>(lim.qp);
  a.max_qp_wr = hostif::kMaxQpWr;
  // Honest flags only: RNR NAKs are generated; the GUID above is a system image GUID.
  a.device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_SYS_IMAGE_GUID |
                       IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B | IBV_DEVICE_XRC |
                       IBV_DEVICE_MANAGED_FLOW_STEERING;
  a.max_sge = hostif::kMaxSge;
  a.max_sge_rd = hostif::kMaxSge;
  a.max_cq = static_cast<int>(lim.cq);
  a.max_cqe = hostif::kMaxCqe;
  a.max_mr = static_cast<int>(lim.mr);
  a.max_pd = static_cast<int>(lim.pd);
  a.max_mw = static_cast<int>(lim.mr);  // windows and regions share the key space
  a.max_qp_rd_atom = kMaxRdAtom;
  a.max_ee_rd_atom = 0;
  a.max_res_rd_atom = static_cast<int>(kMaxRdAtom * lim.qp);
  a.max_qp_init_rd_atom = kMaxRdAtom;
  a.max_ee_init_rd_atom = 0;
  // Responder atomics are atomic among themselves (the engine carries them out one at a time),
  // not with the host CPU's own accesses: IBV_ATOMIC_HCA, as verbs defines it.
  a.atomic_cap = IBV_ATOMIC_HCA;
  // Multicast (verbs-mapping.md §7): UD QPs attached to IPv4 groups, where the link carries
  // Ethernet frames (a UDP-socket plane 0 leaves groups to the kernel; a kernel device's QPs
  // are the module's, which has none).
  if (offers_multicast(cfg)) {
    a.max_mcast_grp = static_cast<int>(hostif::kMaxMcastGroups);
    a.max_mcast_qp_attach = static_cast<int>(hostif::kMaxMcastQpAttach);
    a.max_total_mcast_qp_attach = static_cast<int>(hostif::kMaxMcastGroups * hostif::kMaxMcastQpAttach);
  }
  a.max_pkeys = 1;
  a.max_ah = kMaxAh;
  a.max_srq = static_cast<int>(lim.srq);
  a.max_srq_wr = hostif::kMaxSrqWr;
  a.max_srq_sge = hostif::kMaxSge;
  a.local_ca_ack_delay = kLocalCaAckDelay;
  a.phys_port_cnt = 1;
  ex.device_cap_flags_ex = a.device_cap_flags;
  // On-demand paging (verbs-mapping.md §12): the engine reaches memory through the kernel at
  // each access and never pins, so every region behaves as an ODP one, the whole address space
  // included (implicit ODP), for every operation of the QP types it has.
  constexpr uint32_t kRcOdp = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
                              IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_ATOMIC |
                              IBV_ODP_SUPPORT_SRQ_RECV;
  ex.odp_caps.general_caps = IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT;
  ex.odp_caps.per_transport_caps.rc_odp_caps = kRcOdp;
  ex.odp_caps.per_transport_caps.ud_odp_caps =
      IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_SRQ_RECV;
  ex.xrc_odp_caps = kRcOdp;  // XRC: RC's operations, receives from SRQs
  ex.phys_port_cnt_ex = a.phys_port_cnt;
  // RSS over receive WQs (verbs-mapping.md §18): Toeplitz over IP addresses and TCP/UDP ports,
  // from raw packet QPs only. No raw packet offload (VLAN stripping, checksums, FCS) is offered.
  ex.rss_caps.supported_qpts = 1u << IBV_QPT_RAW_PACKET;
  ex.rss_caps.max_rwq_indirection_tables = lim.qp;
  ex.rss_caps.max_rwq_indirection_table_size = 1u << hostif::kMaxIndTableLog;
  ex.rss_caps.rx_hash_fields_mask = hostif::kRssFields;
  ex.rss_caps.rx_hash_function = IBV_RX_HASH_FUNC_TOEPLITZ;
  ex.max_wq_type_rq = lim.qp;
  // Tag matching on RC (verbs-mapping.md §19): one SGE per tag; list operations are carried out
  // before ibv_post_srq_ops returns.
  ex.tm_caps.flags = IBV_TM_CAP_RC;
  ex.tm_caps.max_num_tags = hostif::kMaxTmTags;
  ex.tm_caps.max_ops = hostif::kMaxTmOps;
  ex.tm_caps.max_sge = 1;
  ex.tm_caps.max_rndv_hdr_size = hostif::kMaxRndvHdr;
  return ex;
}

inline ibv_port_attr port_attr(bool active, uint32_t active_mtu_bytes) {
  ibv_port_attr p;
  std::memset(&p, 0, sizeof(p));
  p.state = active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  p.max_mtu = IBV_MTU_4096;
  p.active_mtu = bytes_to_mtu(active_mtu_bytes);
  p.gid_tbl_len = static_cast<int>(nic::kGidTableLen);
  p.port_cap_flags = IBV_PORT_IP_BASED_GIDS;  // RoCE-style GIDs from the link's address
  p.max_msg_sz = kMaxMsgSize;
  p.pkey_tbl_len = 1;
  p.max_vl_num = 1;
  p.active_width = 2;      // 4X
  p.active_speed = 32;     // EDR (25 Gb/s per lane): 100 Gb/s, a plausible class for the link
  p.phys_state = active ? 5 : 3;  // LinkUp : Disabled (IBTA port physical states)
  p.link_layer = IBV_LINK_LAYER_ETHERNET;
  return p;
}

}  // namespace metaroce::provider
