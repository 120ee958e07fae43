#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What UCX, Open MPI and perftest rely on of a verbs device (client_verbs.cc), through the real
# libibverbs on a MetaRoCE device: channels freed after their CQs, UCX's empty-WRITE flush, UD
# receives as a RoCEv2 NIC reports them, every limit at its value and one past it.
source "$(dirname "$0")/../integration/lib.sh"
PROG="$BUILD/tests/clients/client_verbs"
[ -x "$PROG" ] || fail "$PROG is not built"
make_pair
timeout 120 "$PROG" mrA >"$LOGDIR/client_verbs" 2>&1 || { cat "$LOGDIR/client_verbs"; fail "client_verbs"; }
cat "$LOGDIR/client_verbs"
