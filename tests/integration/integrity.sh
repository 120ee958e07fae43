#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Our data-integrity program: every byte of WRITE, WRITE_WITH_IMM, SEND and READ checked, and
# the remote/local errors verbs specifies.
source "$(dirname "$0")/lib.sh"
make_pair
port=18620
prog="$BUILD/tests/integration/integrity"
run_pair integrity $port 120 -- "$prog" --dev mrA --server --port $port \
  -- "$prog" --dev mrB --connect 127.0.0.1 --port $port
cat "$LOGDIR/integrity.client"
echo "PASS integrity"
