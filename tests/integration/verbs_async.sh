#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Asynchronous events (COMM_EST, SRQ_LIMIT_REACHED, QP_FATAL, QP_LAST_WQE_REACHED) read with
# ibv_get_async_event, and fork with a device open (with and without ibv_fork_init): our
# verbs_async program on one MetaRoCE device, over NIC loopback.
source "$(dirname "$0")/lib.sh"
PROG="$BUILD/tests/integration/verbs_async"
[ -x "$PROG" ] || fail "$PROG is not built"
make_pair
timeout 60 "$PROG" --dev mrA --test events >"$LOGDIR/events" 2>&1 || { cat "$LOGDIR/events"; fail "events"; }
timeout 60 "$PROG" --dev mrA --test fork >"$LOGDIR/fork" 2>&1 || { cat "$LOGDIR/fork"; fail "fork with ibv_fork_init"; }
timeout 60 "$PROG" --dev mrA --test fork --no-fork-init >"$LOGDIR/fork_noinit" 2>&1 ||
  { cat "$LOGDIR/fork_noinit"; fail "fork without ibv_fork_init"; }
echo "PASS verbs_async"
