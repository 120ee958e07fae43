// SPDX-License-Identifier: Apache-2.0
// Conversions between verbs enumerations and the engine interface's terms (MTUs, QP states,
// work-request opcodes, completion values); pure functions so that the unit tests can pin every
// mapping.
#pragma once

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdint>
#include <optional>

#include "datapath/hostif/queues.h"

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

constexpr ibv_qp_state to_verbs(hostif::QpState s) {
  switch (s) {
    case hostif::QpState::kReset: return IBV_QPS_RESET;
    case hostif::QpState::kInit: return IBV_QPS_INIT;
    case hostif::QpState::kRtr: return IBV_QPS_RTR;
    case hostif::QpState::kRts: return IBV_QPS_RTS;
    case hostif::QpState::kErr: return IBV_QPS_ERR;
  }
  return IBV_QPS_ERR;
}

// The NIC has no SQD/SQE: those states have no NIC equivalent.
constexpr std::optional<hostif::QpState> to_nic(ibv_qp_state s) {
  switch (s) {
    case IBV_QPS_RESET: return hostif::QpState::kReset;
    case IBV_QPS_INIT: return hostif::QpState::kInit;
    case IBV_QPS_RTR: return hostif::QpState::kRtr;
    case IBV_QPS_RTS: return hostif::QpState::kRts;
    case IBV_QPS_ERR: return hostif::QpState::kErr;
    default: return std::nullopt;
  }
}

// The seven RC operations the NIC carries; MW binds, invalidations and TSO have no WQE.
constexpr std::optional<hostif::WqeOp> to_nic(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_SEND: return hostif::WqeOp::kSend;
    case IBV_WR_SEND_WITH_IMM: return hostif::WqeOp::kSendImm;
    case IBV_WR_RDMA_WRITE: return hostif::WqeOp::kWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM: return hostif::WqeOp::kWriteImm;
    case IBV_WR_RDMA_READ: return hostif::WqeOp::kRead;
    case IBV_WR_ATOMIC_CMP_AND_SWP: return hostif::WqeOp::kCmpSwp;
    case IBV_WR_ATOMIC_FETCH_AND_ADD: return hostif::WqeOp::kFetchAdd;
    case IBV_WR_BIND_MW: return hostif::WqeOp::kBindMw;
    case IBV_WR_LOCAL_INV: return hostif::WqeOp::kLocalInv;
    case IBV_WR_SEND_WITH_INV: return hostif::WqeOp::kSendInv;
    case IBV_WR_ATOMIC_WRITE: return hostif::WqeOp::kAtomicWrite;
    default: return std::nullopt;
  }
}

// The interface names completion and event values after verbs' own: pin them.
static_assert(static_cast<int>(hostif::WcStatus::kSuccess) == IBV_WC_SUCCESS);
static_assert(static_cast<int>(hostif::WcStatus::kLocLenErr) == IBV_WC_LOC_LEN_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kLocQpOpErr) == IBV_WC_LOC_QP_OP_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kLocProtErr) == IBV_WC_LOC_PROT_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kWrFlushErr) == IBV_WC_WR_FLUSH_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kLocAccessErr) == IBV_WC_LOC_ACCESS_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kRemInvReqErr) == IBV_WC_REM_INV_REQ_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kRemAccessErr) == IBV_WC_REM_ACCESS_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kRemOpErr) == IBV_WC_REM_OP_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kRetryExcErr) == IBV_WC_RETRY_EXC_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kRnrRetryExcErr) == IBV_WC_RNR_RETRY_EXC_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kFatalErr) == IBV_WC_FATAL_ERR);
static_assert(static_cast<int>(hostif::WcStatus::kGeneralErr) == IBV_WC_GENERAL_ERR);
static_assert(static_cast<int>(hostif::WcOpcode::kSend) == IBV_WC_SEND);
static_assert(static_cast<int>(hostif::WcOpcode::kRdmaWrite) == IBV_WC_RDMA_WRITE);
static_assert(static_cast<int>(hostif::WcOpcode::kRdmaRead) == IBV_WC_RDMA_READ);
static_assert(static_cast<int>(hostif::WcOpcode::kCompSwap) == IBV_WC_COMP_SWAP);
static_assert(static_cast<int>(hostif::WcOpcode::kFetchAdd) == IBV_WC_FETCH_ADD);
static_assert(static_cast<int>(hostif::WcOpcode::kAtomicWrite) == IBV_WC_ATOMIC_WRITE);
static_assert(static_cast<int>(hostif::WcOpcode::kRecv) == IBV_WC_RECV);
static_assert(static_cast<int>(hostif::WcOpcode::kRecvRdmaWithImm) == IBV_WC_RECV_RDMA_WITH_IMM);
static_assert(hostif::kWcWithImm == IBV_WC_WITH_IMM && hostif::kWcGrh == IBV_WC_GRH);
static_assert(static_cast<int>(hostif::AsyncEvent::kCqErr) == IBV_EVENT_CQ_ERR);
static_assert(static_cast<int>(hostif::AsyncEvent::kQpFatal) == IBV_EVENT_QP_FATAL);
static_assert(static_cast<int>(hostif::AsyncEvent::kQpReqErr) == IBV_EVENT_QP_REQ_ERR);
static_assert(static_cast<int>(hostif::AsyncEvent::kQpAccessErr) == IBV_EVENT_QP_ACCESS_ERR);
static_assert(static_cast<int>(hostif::AsyncEvent::kCommEst) == IBV_EVENT_COMM_EST);
static_assert(static_cast<int>(hostif::AsyncEvent::kDeviceFatal) == IBV_EVENT_DEVICE_FATAL);
static_assert(static_cast<int>(hostif::AsyncEvent::kSrqLimitReached) == IBV_EVENT_SRQ_LIMIT_REACHED);
static_assert(static_cast<int>(hostif::AsyncEvent::kQpLastWqeReached) == IBV_EVENT_QP_LAST_WQE_REACHED);
static_assert(IBV_ACCESS_LOCAL_WRITE == 1 && IBV_ACCESS_REMOTE_WRITE == 2 &&
              IBV_ACCESS_REMOTE_READ == 4 && IBV_ACCESS_REMOTE_ATOMIC == 8 &&
              IBV_ACCESS_MW_BIND == 16);

// ibv_qp_ex send_ops_flags we can honour, matching to_nic(ibv_wr_opcode).
inline constexpr uint64_t kSupportedSendOps =
    IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE |
    IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
    IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_SEND_WITH_INV |
    IBV_QP_EX_WITH_ATOMIC_WRITE;

// Memory access flags a verbs MR may carry here (ZERO_BASED is not offered).
inline constexpr unsigned kSupportedAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                             IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                                             IBV_ACCESS_MW_BIND | IBV_ACCESS_ON_DEMAND;
// Accepted, and changing nothing for a NIC that never pins and reaches memory through the
// kernel: huge pages are a hint, and the optional range (relaxed ordering, ...) may be ignored
// by definition (ibv_reg_mr(3)).
// What a memory window may grant (ibv_bind_mw(3)); LOCAL_WRITE, which applications pass too,
// means nothing for a window and is accepted.
inline constexpr unsigned kMwAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                      IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
inline constexpr unsigned kHintAccess =
    unsigned{IBV_ACCESS_HUGETLB} | unsigned{IBV_ACCESS_OPTIONAL_RANGE};

// 0 or EINVAL: remote write or atomic access needs local write (IB spec o10-37).
constexpr int check_mr_access(unsigned access) {
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE))
    return EINVAL;
  return 0;
}

}  // namespace metaroce::provider
