// SPDX-License-Identifier: Apache-2.0
// Unit tests of the provider's pure parts: the private libibverbs ABI layouts, the RC state
// machine of ibv_modify_qp, and the conversions and attributes the provider reports.
#include <endian.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstddef>
#include <string>
#include <vector>

#include "providers/metaroce/convert.h"
#include "providers/metaroce/device_attr.h"
#include "providers/metaroce/qp_transition.h"
#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {
namespace {

// ---- ABI layouts (figures measured from rdma-core 44's own driver.h, research notes §1.3) ----

TEST(ProviderAbi, PrivateStructSizesMatchRdmaCore44) {
  EXPECT_EQ(sizeof(abi::SysfsDev), 992u);
  EXPECT_EQ(sizeof(abi::VerbsDevice), 712u);
  EXPECT_EQ(offsetof(abi::VerbsDevice, ops), 664u);
  EXPECT_EQ(sizeof(abi::ContextOps), 608u);
  EXPECT_EQ(sizeof(abi::VerbsMr), 56u);
  EXPECT_EQ(sizeof(verbs_context), 648u);
  EXPECT_EQ(offsetof(verbs_context, context), 320u);
  EXPECT_EQ(sizeof(ibv_device_attr_ex), 400u);
}

TEST(ProviderAbi, SysfsDevExposesPathAfterTheTwoNames) {
  // match_device reads ibdev_path; it follows sysfs_name, the cdev and ibdev_name.
  EXPECT_EQ(offsetof(abi::SysfsDev, ibdev_name) - offsetof(abi::SysfsDev, sysfs_name),
            abi::kSysfsNameMax + 12u);  // 64 chars + 4 padding + 8 bytes of dev_t
  EXPECT_EQ(offsetof(abi::SysfsDev, ibdev_path), 176u);
  EXPECT_EQ(offsetof(abi::SysfsDev, modalias), 176u + abi::kSysfsPathMax);
}

TEST(ProviderAbi, ContextOpsSlotsAreTheSeventySixInAlphabeticalOrder) {
  struct Slot {
    const char* name;
    size_t offset;
  };
#define SLOT(n) Slot{#n, offsetof(abi::ContextOps, n)}
  const std::vector<Slot> slots = {
      SLOT(advise_mr), SLOT(alloc_dm), SLOT(alloc_mw), SLOT(alloc_null_mr),
      SLOT(alloc_parent_domain), SLOT(alloc_pd), SLOT(alloc_td), SLOT(async_event),
      SLOT(attach_counters_point_flow), SLOT(attach_mcast), SLOT(bind_mw), SLOT(close_xrcd),
      SLOT(cq_event), SLOT(create_ah), SLOT(create_counters), SLOT(create_cq),
      SLOT(create_cq_ex), SLOT(create_flow), SLOT(create_flow_action_esp), SLOT(create_qp),
      SLOT(create_qp_ex), SLOT(create_rwq_ind_table), SLOT(create_srq), SLOT(create_srq_ex),
      SLOT(create_wq), SLOT(dealloc_mw), SLOT(dealloc_pd), SLOT(dealloc_td), SLOT(dereg_mr),
      SLOT(destroy_ah), SLOT(destroy_counters), SLOT(destroy_cq), SLOT(destroy_flow),
      SLOT(destroy_flow_action), SLOT(destroy_qp), SLOT(destroy_rwq_ind_table),
      SLOT(destroy_srq), SLOT(destroy_wq), SLOT(detach_mcast), SLOT(free_context),
      SLOT(free_dm), SLOT(get_srq_num), SLOT(import_dm), SLOT(import_mr), SLOT(import_pd),
      SLOT(modify_cq), SLOT(modify_flow_action_esp), SLOT(modify_qp),
      SLOT(modify_qp_rate_limit), SLOT(modify_srq), SLOT(modify_wq), SLOT(open_qp),
      SLOT(open_xrcd), SLOT(poll_cq), SLOT(post_recv), SLOT(post_send), SLOT(post_srq_ops),
      SLOT(post_srq_recv), SLOT(query_device_ex), SLOT(query_ece), SLOT(query_port),
      SLOT(query_qp), SLOT(query_qp_data_in_order), SLOT(query_rt_values), SLOT(query_srq),
      SLOT(read_counters), SLOT(reg_dm_mr), SLOT(reg_dmabuf_mr), SLOT(reg_mr),
      SLOT(req_notify_cq), SLOT(rereg_mr), SLOT(resize_cq), SLOT(set_ece), SLOT(unimport_dm),
      SLOT(unimport_mr), SLOT(unimport_pd)};
#undef SLOT
  ASSERT_EQ(slots.size(), 76u);
  for (size_t i = 0; i < slots.size(); ++i) {
    EXPECT_EQ(slots[i].offset, i * sizeof(void*)) << slots[i].name;
    if (i > 0) {
      EXPECT_LT(std::string(slots[i - 1].name), std::string(slots[i].name));
    }
  }
}

TEST(ProviderAbi, VerbsQpPutsCompMaskAfterTheExtendedQp) {
  EXPECT_EQ(offsetof(abi::VerbsQp, qp), 0u);
  EXPECT_EQ(offsetof(abi::VerbsQp, comp_mask), sizeof(ibv_qp_ex));
  EXPECT_EQ(abi::kVerbsQpEx, 2u);
  EXPECT_EQ(offsetof(abi::VerbsMr, mr_type), sizeof(ibv_mr));
}

// ---- the RC state machine of ibv_modify_qp ----

constexpr int kInitMask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
constexpr int kRtrMask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
constexpr int kRtsMask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;

TEST(QpTransition, TheRcPingpongSequenceIsAccepted) {
  EXPECT_EQ(check_rc_modify(IBV_QPS_RESET, kInitMask, IBV_QPS_INIT), 0);
  EXPECT_EQ(check_rc_modify(IBV_QPS_INIT, kRtrMask, IBV_QPS_RTR), 0);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTR, kRtsMask, IBV_QPS_RTS), 0);
}

TEST(QpTransition, EachRequiredAttributeIsRequired) {
  for (int mask : {kInitMask, kRtrMask, kRtsMask}) {
    const ibv_qp_state from = mask == kInitMask ? IBV_QPS_RESET
                              : mask == kRtrMask ? IBV_QPS_INIT
                                                 : IBV_QPS_RTR;
    const ibv_qp_state to = mask == kInitMask ? IBV_QPS_INIT
                            : mask == kRtrMask ? IBV_QPS_RTR
                                               : IBV_QPS_RTS;
    for (int bit = 1; bit < (1 << 26); bit <<= 1) {
      if (!(mask & bit) || bit == IBV_QP_STATE) continue;
      EXPECT_EQ(check_rc_modify(from, mask & ~bit, to), EINVAL) << "mask bit " << bit;
    }
  }
}

TEST(QpTransition, AttributesOutsideTheTransitionAreRejected) {
  EXPECT_EQ(check_rc_modify(IBV_QPS_RESET, kInitMask | IBV_QP_AV, IBV_QPS_INIT), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RESET, kInitMask | IBV_QP_QKEY, IBV_QPS_INIT), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_INIT, kRtrMask | IBV_QP_SQ_PSN, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTR, kRtsMask | IBV_QP_CAP, IBV_QPS_RTS), EINVAL);
  // Optional ones are fine.
  EXPECT_EQ(check_rc_modify(IBV_QPS_INIT, kRtrMask | IBV_QP_ACCESS_FLAGS, IBV_QPS_RTR), 0);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTR, kRtsMask | IBV_QP_MIN_RNR_TIMER, IBV_QPS_RTS), 0);
}

TEST(QpTransition, SkippingAStateIsInvalid) {
  EXPECT_EQ(check_rc_modify(IBV_QPS_RESET, kRtrMask, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RESET, kRtsMask, IBV_QPS_RTS), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_INIT, kRtsMask, IBV_QPS_RTS), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTS, kRtrMask, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_ERR, kInitMask, IBV_QPS_INIT), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTS, IBV_QP_STATE, IBV_QPS_SQE), EINVAL);
}

TEST(QpTransition, ResetAndErrorAreReachableFromEveryState) {
  for (ibv_qp_state s : {IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD,
                         IBV_QPS_SQE, IBV_QPS_ERR}) {
    EXPECT_EQ(check_rc_modify(s, IBV_QP_STATE, IBV_QPS_RESET), 0) << s;
    EXPECT_EQ(check_rc_modify(s, IBV_QP_STATE, IBV_QPS_ERR), 0) << s;
    // ... but with no other attribute.
    EXPECT_EQ(check_rc_modify(s, IBV_QP_STATE | IBV_QP_PORT, IBV_QPS_ERR), EINVAL) << s;
  }
}

TEST(QpTransition, WithoutTheStateBitTheQpStaysAndOnlyTunablesApply) {
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTS, IBV_QP_MIN_RNR_TIMER, IBV_QPS_RESET), 0);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTS, IBV_QP_DEST_QPN, IBV_QPS_RESET), EINVAL);
  EXPECT_EQ(check_rc_modify(IBV_QPS_INIT, IBV_QP_ACCESS_FLAGS, IBV_QPS_RESET), 0);
  EXPECT_EQ(check_rc_modify(IBV_QPS_RTR, IBV_QP_MIN_RNR_TIMER, IBV_QPS_RESET), EINVAL);
}

// The XRC rows (the kernel's IB_QPT_XRC_INI and IB_QPT_XRC_TGT), as pyverbs drives them.
TEST(QpTransition, XrcInitiatorsAndTargetsFollowTheirOwnRows) {
  constexpr int kIniRtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                          IBV_QP_RQ_PSN;
  constexpr int kTgtRts = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN;
  // An initiator: RC's requester side, no responder attributes at RTR.
  EXPECT_EQ(check_xrc_ini_modify(IBV_QPS_RESET, kInitMask, IBV_QPS_INIT), 0);
  EXPECT_EQ(check_xrc_ini_modify(IBV_QPS_INIT, kIniRtr, IBV_QPS_RTR), 0);
  EXPECT_EQ(check_xrc_ini_modify(IBV_QPS_INIT, kRtrMask, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_xrc_ini_modify(IBV_QPS_RTR, kRtsMask, IBV_QPS_RTS), 0);
  EXPECT_EQ(check_xrc_ini_modify(IBV_QPS_RTS, IBV_QP_MIN_RNR_TIMER, IBV_QPS_RTS), EINVAL);
  // A target: RC's responder side; RTS asks only the timeout and the send PSN.
  EXPECT_EQ(check_xrc_tgt_modify(IBV_QPS_RESET, kInitMask, IBV_QPS_INIT), 0);
  EXPECT_EQ(check_xrc_tgt_modify(IBV_QPS_INIT, kRtrMask, IBV_QPS_RTR), 0);
  EXPECT_EQ(check_xrc_tgt_modify(IBV_QPS_INIT, kIniRtr, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_xrc_tgt_modify(IBV_QPS_RTR, kTgtRts, IBV_QPS_RTS), 0);
  EXPECT_EQ(check_xrc_tgt_modify(IBV_QPS_RTR, kTgtRts & ~IBV_QP_TIMEOUT, IBV_QPS_RTS), EINVAL);
  EXPECT_EQ(check_xrc_tgt_modify(IBV_QPS_RTR, kRtsMask, IBV_QPS_RTS), EINVAL);  // retry_cnt
  EXPECT_EQ(check_xrc_tgt_modify(IBV_QPS_RTS, IBV_QP_STATE, IBV_QPS_ERR), 0);
  EXPECT_EQ(check_xrc_ini_modify(IBV_QPS_ERR, IBV_QP_STATE, IBV_QPS_RESET), 0);
}

// ---- conversions ----

TEST(Convert, MtuEnumsAndBytesRoundTrip) {
  for (int m = IBV_MTU_256; m <= IBV_MTU_4096; ++m)
    EXPECT_EQ(bytes_to_mtu(mtu_to_bytes(m)), m);
  EXPECT_EQ(mtu_to_bytes(IBV_MTU_1024), 1024u);
  EXPECT_EQ(mtu_to_bytes(0), 0u);
  EXPECT_EQ(mtu_to_bytes(6), 0u);
  EXPECT_EQ(bytes_to_mtu(9000), IBV_MTU_4096);
  EXPECT_EQ(bytes_to_mtu(1500), IBV_MTU_1024);
  EXPECT_EQ(bytes_to_mtu(100), IBV_MTU_256);
}

TEST(Convert, TheRcOperationsAndWindowOperationsReachTheNicAndNothingElse) {
  EXPECT_EQ(to_nic(IBV_WR_RDMA_WRITE_WITH_IMM), hostif::WqeOp::kWriteImm);
  EXPECT_EQ(to_nic(IBV_WR_RDMA_READ), hostif::WqeOp::kRead);
  EXPECT_EQ(to_nic(IBV_WR_ATOMIC_CMP_AND_SWP), hostif::WqeOp::kCmpSwp);
  EXPECT_EQ(to_nic(IBV_WR_ATOMIC_FETCH_AND_ADD), hostif::WqeOp::kFetchAdd);
  EXPECT_EQ(to_nic(IBV_WR_LOCAL_INV), hostif::WqeOp::kLocalInv);
  EXPECT_EQ(to_nic(IBV_WR_BIND_MW), hostif::WqeOp::kBindMw);
  EXPECT_EQ(to_nic(IBV_WR_SEND_WITH_INV), hostif::WqeOp::kSendInv);
  EXPECT_EQ(to_nic(IBV_WR_ATOMIC_WRITE), hostif::WqeOp::kAtomicWrite);
  EXPECT_FALSE(to_nic(IBV_WR_TSO).has_value());
  EXPECT_NE(kSupportedSendOps & IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP, 0u);
  EXPECT_NE(kSupportedSendOps & IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD, 0u);
  EXPECT_NE(kSupportedSendOps & IBV_QP_EX_WITH_BIND_MW, 0u);
  EXPECT_NE(kSupportedSendOps & IBV_QP_EX_WITH_ATOMIC_WRITE, 0u);
  EXPECT_FALSE(hostif::needs_response(hostif::WqeOp::kAtomicWrite));  // acknowledged as a WRITE
  EXPECT_TRUE(hostif::is_local(hostif::WqeOp::kBindMw));
  EXPECT_FALSE(hostif::is_local(hostif::WqeOp::kSendInv));
  EXPECT_TRUE(hostif::needs_response(hostif::WqeOp::kRead));
  EXPECT_TRUE(hostif::needs_response(hostif::WqeOp::kFetchAdd));
  EXPECT_FALSE(hostif::needs_response(hostif::WqeOp::kWriteImm));
}

TEST(Convert, QpStatesMapBothWaysAndSqdHasNoNicState) {
  for (auto s : {hostif::QpState::kReset, hostif::QpState::kInit, hostif::QpState::kRtr,
                 hostif::QpState::kRts, hostif::QpState::kErr})
    EXPECT_EQ(to_nic(to_verbs(s)), s);
  EXPECT_FALSE(to_nic(IBV_QPS_SQD).has_value());
}

TEST(Convert, RemoteWriteOrAtomicNeedLocalWrite) {
  EXPECT_EQ(check_mr_access(IBV_ACCESS_REMOTE_WRITE), EINVAL);
  EXPECT_EQ(check_mr_access(IBV_ACCESS_REMOTE_ATOMIC), EINVAL);
  EXPECT_EQ(check_mr_access(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE), 0);
  EXPECT_EQ(check_mr_access(IBV_ACCESS_REMOTE_READ), 0);
  EXPECT_EQ(check_mr_access(0), 0);
}

// ---- attributes ----

TEST(QpTransition, TheUcSequenceIsRcsWithoutItsReliabilityAttributes) {
  constexpr int kInit = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  constexpr int kRtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  EXPECT_EQ(check_uc_modify(IBV_QPS_RESET, kInit, IBV_QPS_INIT), 0);
  EXPECT_EQ(check_uc_modify(IBV_QPS_INIT, kRtr, IBV_QPS_RTR), 0);
  EXPECT_EQ(check_uc_modify(IBV_QPS_INIT, kRtr & ~IBV_QP_DEST_QPN, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_uc_modify(IBV_QPS_RTR, IBV_QP_STATE | IBV_QP_SQ_PSN, IBV_QPS_RTS), 0);
  // What only a reliable connection has is refused.
  EXPECT_EQ(check_uc_modify(IBV_QPS_INIT, kRtr | IBV_QP_MIN_RNR_TIMER, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_uc_modify(IBV_QPS_INIT, kRtr | IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QPS_RTR), EINVAL);
  EXPECT_EQ(check_uc_modify(IBV_QPS_RTR, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT, IBV_QPS_RTS),
            EINVAL);
  EXPECT_EQ(check_uc_modify(IBV_QPS_RTR, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_RETRY_CNT,
                            IBV_QPS_RTS),
            EINVAL);
  EXPECT_EQ(check_uc_modify(IBV_QPS_RTS, IBV_QP_STATE, IBV_QPS_ERR), 0);
  // RC's own sequence needs them.
  EXPECT_EQ(check_rc_modify(IBV_QPS_INIT, kRtr, IBV_QPS_RTR), EINVAL);
}

TEST(QpTransition, TheUdPingpongSequenceIsAcceptedAndNeedsAQkey) {
  constexpr int kUdInit = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY;
  EXPECT_EQ(check_ud_modify(IBV_QPS_RESET, kUdInit, IBV_QPS_INIT), 0);
  EXPECT_EQ(check_ud_modify(IBV_QPS_RESET, kUdInit & ~IBV_QP_QKEY, IBV_QPS_INIT), EINVAL);
  EXPECT_EQ(check_ud_modify(IBV_QPS_INIT, IBV_QP_STATE, IBV_QPS_RTR), 0);
  EXPECT_EQ(check_ud_modify(IBV_QPS_RTR, IBV_QP_STATE | IBV_QP_SQ_PSN, IBV_QPS_RTS), 0);
  EXPECT_EQ(check_ud_modify(IBV_QPS_RTR, IBV_QP_STATE, IBV_QPS_RTS), EINVAL);
  // A UD QP has no peer: the RC connection attributes are refused, and RC wants no Q_Key.
  EXPECT_EQ(check_ud_modify(IBV_QPS_INIT, IBV_QP_STATE | IBV_QP_AV | IBV_QP_DEST_QPN, IBV_QPS_RTR),
            EINVAL);
  EXPECT_EQ(check_ud_modify(IBV_QPS_INIT, kUdInit & ~IBV_QP_STATE, IBV_QPS_RESET), 0);
  EXPECT_EQ(check_ud_modify(IBV_QPS_RTS, IBV_QP_QKEY, IBV_QPS_RESET), 0);
  EXPECT_EQ(check_ud_modify(IBV_QPS_RTS, IBV_QP_STATE, IBV_QPS_ERR), 0);
  EXPECT_EQ(check_ud_modify(IBV_QPS_ERR, IBV_QP_STATE, IBV_QPS_RESET), 0);
}

TEST(DeviceAttr, ReportsSrqAndAhLimits) {
  nic::LinkConfig cfg;
  cfg.ip = 0x0a4d0001;
  const ibv_device_attr& a = device_attr(cfg).orig_attr;
  EXPECT_GT(a.max_srq, 0);
  EXPECT_EQ(a.max_srq_wr, static_cast<int>(hostif::kMaxSrqWr));
  EXPECT_EQ(a.max_srq_sge, static_cast<int>(hostif::kMaxSge));
  EXPECT_GT(a.max_ah, 0);
  // No SRQ resize: modify_srq with IBV_SRQ_MAX_WR answers EINVAL, as the flag promises.
  EXPECT_EQ(a.device_cap_flags & IBV_DEVICE_SRQ_RESIZE, 0u);
}

TEST(DeviceAttr, ReportsTheNicLimitsAndANonZeroGuid) {
  nic::LinkConfig cfg;
  cfg.ip = 0x0a4d0001;  // 10.77.0.1, no GUID configured
  const ibv_device_attr_ex ex = device_attr(cfg);
  const ibv_device_attr& a = ex.orig_attr;
  EXPECT_NE(a.node_guid, 0u);
  EXPECT_EQ(a.sys_image_guid, a.node_guid);
  EXPECT_NE(a.vendor_id, 0u);
  EXPECT_GT(a.max_mr_size, 4096u);
  EXPECT_EQ(a.max_qp_wr, static_cast<int>(hostif::kMaxQpWr));
  EXPECT_EQ(a.max_sge, static_cast<int>(hostif::kMaxSge));
  EXPECT_EQ(a.max_cqe, static_cast<int>(hostif::kMaxCqe));
  EXPECT_EQ(a.max_qp_rd_atom, 16);
  EXPECT_EQ(a.max_qp_init_rd_atom, 16);
  EXPECT_EQ(a.atomic_cap, IBV_ATOMIC_HCA);
  EXPECT_EQ(a.max_qp_rd_atom, static_cast<int>(hostif::kMaxRdAtomic));
  EXPECT_EQ(a.max_pkeys, 1);
  EXPECT_EQ(a.phys_port_cnt, 1);
  EXPECT_EQ(ex.phys_port_cnt_ex, a.phys_port_cnt);
  EXPECT_NE(a.fw_ver[0], '\0');

  cfg.node_guid = 0x0200a4fffe4d0001ull;
  EXPECT_EQ(be64toh(device_attr(cfg).orig_attr.node_guid), cfg.node_guid);
  cfg.ip = 0;
  cfg.node_guid = 0;
  EXPECT_NE(device_attr(cfg).orig_attr.node_guid, 0u);
}

TEST(DeviceAttr, MulticastOnlyWherePlaneZeroCarriesEthernetFrames) {
  nic::LinkConfig cfg;
  cfg.ip = 0x0a4d0001;
  for (const char* devargs : {"net_memif0,role=server", "net_af_packet0,iface=v0;udp"}) {
    cfg.devargs = devargs;
    const ibv_device_attr a = device_attr(cfg).orig_attr;
    EXPECT_EQ(a.max_mcast_grp, static_cast<int>(hostif::kMaxMcastGroups)) << devargs;
    EXPECT_EQ(a.max_mcast_qp_attach, static_cast<int>(hostif::kMaxMcastQpAttach));
    EXPECT_EQ(a.max_total_mcast_qp_attach, a.max_mcast_grp * a.max_mcast_qp_attach);
  }
  for (const char* devargs : {"udp", "udp,iface=eth1", "udp,iface=eth1;net_memif0"}) {
    cfg.devargs = devargs;
    EXPECT_EQ(device_attr(cfg).orig_attr.max_mcast_grp, 0) << devargs;
  }
  cfg.devargs = "net_memif0";
  cfg.kernel = "veth0";  // a kernel device: the module's QPs
  EXPECT_EQ(device_attr(cfg).orig_attr.max_mcast_grp, 0);
  EXPECT_EQ(device_attr(cfg).orig_attr.max_total_mcast_qp_attach, 0);
}

TEST(DeviceAttr, PortIsEthernetWithTheLinksMtu) {
  ibv_port_attr up = port_attr(true, 1500);
  EXPECT_EQ(up.state, IBV_PORT_ACTIVE);
  EXPECT_EQ(up.link_layer, IBV_LINK_LAYER_ETHERNET);
  EXPECT_EQ(up.active_mtu, IBV_MTU_1024);
  EXPECT_EQ(up.max_mtu, IBV_MTU_4096);
  EXPECT_EQ(up.gid_tbl_len, static_cast<int>(nic::kGidTableLen));
  EXPECT_EQ(up.pkey_tbl_len, 1);
  EXPECT_GT(up.max_msg_sz, 0x1000u);
  EXPECT_EQ(up.lid, 0);
  EXPECT_EQ(port_attr(true, 9000).active_mtu, IBV_MTU_4096);
  EXPECT_EQ(port_attr(false, 9000).state, IBV_PORT_DOWN);
}

}  // namespace
}  // namespace metaroce::provider
