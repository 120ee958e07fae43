// SPDX-License-Identifier: Apache-2.0
// The verbs QP state machine for RC, UC, UD, XRC and raw packet QPs (IB spec vol. 1, 10.3.1 and
// table 91): which transitions exist and which ibv_modify_qp attribute bits each one requires and
// allows. Pure, so tested alone.
#pragma once

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstdint>

namespace metaroce::provider {

struct QpTransition {
  bool valid = false;
  uint32_t required = 0;  // attr_mask bits that must be present (besides IBV_QP_STATE)
  uint32_t optional = 0;  // further bits that may be present
};

// The RC row of the table.
constexpr QpTransition rc_transition(ibv_qp_state cur, ibv_qp_state next) {
  // Any state may be reset or moved to error, with no other attribute.
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    if (cur < IBV_QPS_RESET || cur > IBV_QPS_ERR) return {};
    return {true, 0, 0};
  }
  constexpr uint32_t kRtsTunables = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH |
                                    IBV_QP_PATH_MIG_STATE | IBV_QP_MIN_RNR_TIMER;
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT)
        return {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
      return {};
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT)
        return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
      if (next == IBV_QPS_RTR)
        return {true,
                IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX};
      return {};
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS)
        return {true,
                IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                    IBV_QP_MAX_QP_RD_ATOMIC,
                kRtsTunables};
      return {};
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS) return {true, 0, kRtsTunables};
      if (next == IBV_QPS_SQD) return {true, 0, IBV_QP_EN_SQD_ASYNC_NOTIFY};
      return {};
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS) return {true, 0, kRtsTunables};
      if (next == IBV_QPS_SQD)
        return {true, 0,
                IBV_QP_AV | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX |
                    IBV_QP_PATH_MIG_STATE | IBV_QP_MIN_RNR_TIMER | IBV_QP_TIMEOUT |
                    IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC |
                    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_PATH_MTU};
      return {};
    default:
      // SQE is a UD/UC state; ERR leaves only through RESET (handled above).
      return {};
  }
}

// The UD row (IB spec vol. 1, table 91): no peer, a Q_Key instead; the send queue starts at RTS.
constexpr QpTransition ud_transition(ibv_qp_state cur, ibv_qp_state next) {
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    if (cur < IBV_QPS_RESET || cur > IBV_QPS_ERR) return {};
    return {true, 0, 0};
  }
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT) return {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0};
      return {};
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT)
        return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY};
      if (next == IBV_QPS_RTR) return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY};
      return {};
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS) return {true, IBV_QP_SQ_PSN, IBV_QP_CUR_STATE | IBV_QP_QKEY};
      return {};
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS) return {true, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY};
      if (next == IBV_QPS_SQD) return {true, 0, IBV_QP_EN_SQD_ASYNC_NOTIFY};
      return {};
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS || next == IBV_QPS_SQD)
        return {true, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY | IBV_QP_PKEY_INDEX};
      return {};
    case IBV_QPS_SQE:
      if (next == IBV_QPS_RTS) return {true, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY};
      return {};
    default:
      return {};
  }
}

// The UC row: RC's without what only reliable service has (READ/atomic depths, the ACK timeout,
// retries, the RNR timer).
constexpr QpTransition uc_transition(ibv_qp_state cur, ibv_qp_state next) {
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    if (cur < IBV_QPS_RESET || cur > IBV_QPS_ERR) return {};
    return {true, 0, 0};
  }
  constexpr uint32_t kRtsTunables =
      IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE;
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT)
        return {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
      return {};
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT)
        return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
      if (next == IBV_QPS_RTR)
        return {true, IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN,
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX};
      return {};
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS) return {true, IBV_QP_SQ_PSN, kRtsTunables};
      return {};
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS) return {true, 0, kRtsTunables};
      if (next == IBV_QPS_SQD) return {true, 0, IBV_QP_EN_SQD_ASYNC_NOTIFY};
      return {};
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS) return {true, 0, kRtsTunables};
      if (next == IBV_QPS_SQD)
        return {true, 0,
                IBV_QP_AV | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX |
                    IBV_QP_PATH_MIG_STATE | IBV_QP_PATH_MTU};
      return {};
    case IBV_QPS_SQE:
      if (next == IBV_QPS_RTS) return {true, 0, IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS};
      return {};
    default:
      return {};
  }
}

// The XRC initiator row (the kernel's IB_QPT_XRC_INI): RC's requester side, no responder
// attributes (READ/atomic depth it answers, RNR timer).
constexpr QpTransition xrc_ini_transition(ibv_qp_state cur, ibv_qp_state next) {
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    if (cur < IBV_QPS_RESET || cur > IBV_QPS_ERR) return {};
    return {true, 0, 0};
  }
  constexpr uint32_t kRtsTunables =
      IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE;
  switch (cur) {
    case IBV_QPS_RESET:
    case IBV_QPS_INIT:
      if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT)
        return {true, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
      if (cur == IBV_QPS_INIT && next == IBV_QPS_INIT)
        return {true, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
      if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR)
        return {true, IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN,
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX};
      return {};
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS)
        return {true,
                IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                    IBV_QP_MAX_QP_RD_ATOMIC,
                kRtsTunables};
      return {};
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS) return {true, 0, kRtsTunables};
      if (next == IBV_QPS_SQD) return {true, 0, IBV_QP_EN_SQD_ASYNC_NOTIFY};
      return {};
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS) return {true, 0, kRtsTunables};
      if (next == IBV_QPS_SQD)
        return {true, 0,
                IBV_QP_PORT | IBV_QP_AV | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                    IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS |
                    IBV_QP_PKEY_INDEX | IBV_QP_PATH_MIG_STATE};
      return {};
    default:
      return {};
  }
}

// The XRC target row (IB_QPT_XRC_TGT): RC's responder side; RTS asks only the ACK timeout and
// the send PSN (it sends nothing but answers).
constexpr QpTransition xrc_tgt_transition(ibv_qp_state cur, ibv_qp_state next) {
  if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS)
    return {true, IBV_QP_TIMEOUT | IBV_QP_SQ_PSN,
            IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
                IBV_QP_PATH_MIG_STATE};
  if (cur == IBV_QPS_SQD && next == IBV_QPS_SQD)
    return {true, 0,
            IBV_QP_PORT | IBV_QP_AV | IBV_QP_TIMEOUT | IBV_QP_MAX_DEST_RD_ATOMIC |
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX |
                IBV_QP_MIN_RNR_TIMER | IBV_QP_PATH_MIG_STATE};
  return rc_transition(cur, next);
}

// The raw packet row (the kernel's IB_QPT_RAW_PACKET): a port, and nothing else to say.
constexpr QpTransition raw_transition(ibv_qp_state cur, ibv_qp_state next) {
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    if (cur < IBV_QPS_RESET || cur > IBV_QPS_ERR) return {};
    return {true, 0, 0};
  }
  if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT) return {true, IBV_QP_PORT, 0};
  if (cur == IBV_QPS_INIT && (next == IBV_QPS_INIT || next == IBV_QPS_RTR)) return {true, 0, 0};
  // A rate limit is allowed here by verbs; none is offered (modify_qp answers EOPNOTSUPP).
  if ((cur == IBV_QPS_RTR || cur == IBV_QPS_RTS) && next == IBV_QPS_RTS)
    return {true, 0, IBV_QP_RATE_LIMIT};
  return {};
}

// 0 or EINVAL: mask (with or without IBV_QP_STATE) against one row of the table.
constexpr int check_transition(const QpTransition& t, uint32_t mask) {
  if (!t.valid) return EINVAL;
  const uint32_t given = mask & ~static_cast<uint32_t>(IBV_QP_STATE);
  if ((given & t.required) != t.required) return EINVAL;
  if (given & ~(t.required | t.optional)) return EINVAL;
  return 0;
}

// Checks an ibv_modify_qp call on an RC QP in state cur: 0 or EINVAL, as the kernel answers.
// Without IBV_QP_STATE the QP stays where it is and the mask is checked against cur -> cur.
constexpr int check_rc_modify(ibv_qp_state cur, int attr_mask, ibv_qp_state requested_next) {
  const uint32_t mask = static_cast<uint32_t>(attr_mask);
  const ibv_qp_state next = (mask & IBV_QP_STATE) ? requested_next : cur;
  return check_transition(rc_transition(cur, next), mask);
}

// The same for a UC QP.
constexpr int check_uc_modify(ibv_qp_state cur, int attr_mask, ibv_qp_state requested_next) {
  const uint32_t mask = static_cast<uint32_t>(attr_mask);
  const ibv_qp_state next = (mask & IBV_QP_STATE) ? requested_next : cur;
  return check_transition(uc_transition(cur, next), mask);
}

// The same for XRC initiators and targets.
constexpr int check_xrc_ini_modify(ibv_qp_state cur, int attr_mask, ibv_qp_state requested_next) {
  const uint32_t mask = static_cast<uint32_t>(attr_mask);
  const ibv_qp_state next = (mask & IBV_QP_STATE) ? requested_next : cur;
  return check_transition(xrc_ini_transition(cur, next), mask);
}
constexpr int check_xrc_tgt_modify(ibv_qp_state cur, int attr_mask, ibv_qp_state requested_next) {
  const uint32_t mask = static_cast<uint32_t>(attr_mask);
  const ibv_qp_state next = (mask & IBV_QP_STATE) ? requested_next : cur;
  return check_transition(xrc_tgt_transition(cur, next), mask);
}

// The same for a raw packet QP.
constexpr int check_raw_modify(ibv_qp_state cur, int attr_mask, ibv_qp_state requested_next) {
  const uint32_t mask = static_cast<uint32_t>(attr_mask);
  const ibv_qp_state next = (mask & IBV_QP_STATE) ? requested_next : cur;
  return check_transition(raw_transition(cur, next), mask);
}

// The same for a UD QP.
constexpr int check_ud_modify(ibv_qp_state cur, int attr_mask, ibv_qp_state requested_next) {
  const uint32_t mask = static_cast<uint32_t>(attr_mask);
  const ibv_qp_state next = (mask & IBV_QP_STATE) ? requested_next : cur;
  return check_transition(ud_transition(cur, next), mask);
}

}  // namespace metaroce::provider
