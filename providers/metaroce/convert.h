// SPDX-License-Identifier: Apache-2.0
// Conversions between verbs enumerations and the software NIC's terms (MTUs, QP states,
// work-request opcodes); pure functions so that the unit tests can pin every mapping.
#pragma once

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdint>
#include <optional>

#include "datapath/nic/device.h"

namespace metaroce::provider {

// IBV_MTU_256..IBV_MTU_4096 -> 256..4096 bytes; 0 for anything else.
constexpr uint32_t mtu_to_bytes(int mtu) {
  if (mtu < IBV_MTU_256 || mtu > IBV_MTU_4096) return 0;
  return 128u << mtu;
}

// The largest verbs MTU not above `bytes`; IBV_MTU_256 below 512 (the verbs minimum).
constexpr ibv_mtu bytes_to_mtu(uint32_t bytes) {
  if (bytes >= 4096) return IBV_MTU_4096;
  if (bytes >= 2048) return IBV_MTU_2048;
  if (bytes >= 1024) return IBV_MTU_1024;
  if (bytes >= 512) return IBV_MTU_512;
  return IBV_MTU_256;
}

constexpr ibv_qp_state to_verbs(nic::QpState s) {
  switch (s) {
    case nic::QpState::kReset: return IBV_QPS_RESET;
    case nic::QpState::kInit: return IBV_QPS_INIT;
    case nic::QpState::kRtr: return IBV_QPS_RTR;
    case nic::QpState::kRts: return IBV_QPS_RTS;
    case nic::QpState::kErr: return IBV_QPS_ERR;
  }
  return IBV_QPS_ERR;
}

// The NIC has no SQD/SQE: those states have no NIC equivalent.
constexpr std::optional<nic::QpState> to_nic(ibv_qp_state s) {
  switch (s) {
    case IBV_QPS_RESET: return nic::QpState::kReset;
    case IBV_QPS_INIT: return nic::QpState::kInit;
    case IBV_QPS_RTR: return nic::QpState::kRtr;
    case IBV_QPS_RTS: return nic::QpState::kRts;
    case IBV_QPS_ERR: return nic::QpState::kErr;
    default: return std::nullopt;
  }
}

// The seven RC operations the NIC carries; MW binds, invalidations and TSO have no WQE.
constexpr std::optional<nic::WqeOp> to_nic(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_SEND: return nic::WqeOp::kSend;
    case IBV_WR_SEND_WITH_IMM: return nic::WqeOp::kSendImm;
    case IBV_WR_RDMA_WRITE: return nic::WqeOp::kWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM: return nic::WqeOp::kWriteImm;
    case IBV_WR_RDMA_READ: return nic::WqeOp::kRead;
    case IBV_WR_ATOMIC_CMP_AND_SWP: return nic::WqeOp::kCmpSwp;
    case IBV_WR_ATOMIC_FETCH_AND_ADD: return nic::WqeOp::kFetchAdd;
    default: return std::nullopt;
  }
}

// ibv_qp_ex send_ops_flags we can honour, matching to_nic(ibv_wr_opcode).
inline constexpr uint64_t kSupportedSendOps =
    IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE |
    IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;

// Memory access flags a verbs MR may carry here (RELAXED_ORDERING is stripped by libibverbs
// before we see it, ON_DEMAND and ZERO_BASED are not offered).
inline constexpr unsigned kSupportedAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                             IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                                             IBV_ACCESS_MW_BIND;

// 0 or EINVAL: remote write or atomic access needs local write (IB spec o10-37).
constexpr int check_mr_access(unsigned access) {
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE))
    return EINVAL;
  return 0;
}

}  // namespace metaroce::provider
