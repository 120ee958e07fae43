#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Unmodified ib_write_bw and our integrity program over a link with 8 paths; `metaroce stat`
# shows, while ib_write_bw runs, traffic on every one of the 8 paths.
source "$(dirname "$0")/lib.sh"
make_pair --paths 8
port=18640
timeout 60 ib_write_bw -d mrA -x 0 -p $port -s 65536 -D 4 >"$LOGDIR/bw.server" 2>&1 &
PIDS+=($!)
wait_listen $port
timeout 60 ib_write_bw -d mrB -x 0 -p $port -s 65536 -D 4 127.0.0.1 >"$LOGDIR/bw.client" 2>&1 &
client=$!
PIDS+=($client)
sleep 2.5
"$METAROCE" stat mrB >"$LOGDIR/stat.txt"
"$METAROCE" stat mrB --json >"$LOGDIR/stat.json"
cat "$LOGDIR/stat.txt"
wait "$client" || fail "ib_write_bw client failed"
/usr/bin/python3 - "$LOGDIR/stat.json" <<'PY' || fail "metaroce stat does not show traffic on all 8 paths"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["engine_pid"], "no engine publishes mrB"
conns = d["connections"]
assert len(conns) == 1 and conns[0]["peer"] == "198.18.0.1", conns
paths = conns[0]["paths"]
assert len(paths) == 8, f"{len(paths)} paths"
idle = [p["path"] for p in paths if p["tx_packets"] == 0]
assert not idle, f"paths without traffic: {idle}"
ports = {p["udp_src_port"] for p in paths}
assert len(ports) == 8, f"paths share UDP source ports: {sorted(ports)}"
print("every path carried traffic:", [p["tx_packets"] for p in paths])
PY
prog="$BUILD/tests/integration/integrity"
sizes=1,65536,1048576
run_pair integrity $((port + 1)) 120 -- "$prog" --dev mrA --server --port $((port + 1)) --sizes $sizes \
  -- "$prog" --dev mrB --connect 127.0.0.1 --port $((port + 1)) --sizes $sizes
echo "PASS stat"
