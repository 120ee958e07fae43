#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# End-to-end check of the fabric emulator over DPDK memif: `metaroce fabric run` with 2 endpoints
# and 2 planes, fabric_probe attached to all four ports, then forwarding and ECMP spraying, random
# loss, a black-holed link changed live, ECN marking under congestion, the trace under both idle
# policies and endpoints that come and go, each checked both from what the probe received and
# from `metaroce fabric stat --json`. Usage: fabric.sh BUILD_DIR.
set -euo pipefail

BUILD=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)
M="$BUILD/util/metaroce"
PROBE="$BUILD/datapath/fabric/fabric_probe"
[ -x "$PROBE" ] || { echo "SKIP: built without DPDK (no fabric_probe)"; exit 77; }
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3

export METAROCE_RUNDIR
METAROCE_RUNDIR=$(mktemp -d /tmp/metaroce-fabric-it.XXXXXX)
LOG="$METAROCE_RUNDIR/fabric.log"
FAB="it$$"
FABRIC_PID=""

cleanup() {
  local rc=$?
  if [ -n "$FABRIC_PID" ]; then
    kill "$FABRIC_PID" 2>/dev/null || true
    wait "$FABRIC_PID" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ] && [ -f "$LOG" ]; then
    echo "--- fabric log ---"
    tail -n 40 "$LOG"
  fi
  rm -rf "$METAROCE_RUNDIR"
  exit "$rc"
}
trap cleanup EXIT
fail() { echo "FAIL fabric: $*" >&2; exit 1; }

# start_fabric OPTIONS...: a 2x2 fabric in the background, bounded to 120 s whatever happens.
start_fabric() {
  timeout -s INT 120 "$M" fabric run "$FAB" --endpoints 2 --planes 2 --seed 7 "$@" >"$LOG" 2>&1 &
  FABRIC_PID=$!
  for _ in $(seq 100); do
    [ -S "$METAROCE_RUNDIR/fabric/$FAB/control" ] && [ -f "$METAROCE_RUNDIR/fabric/$FAB/pid" ] && return 0
    kill -0 "$FABRIC_PID" 2>/dev/null || fail "fabric run exited early: $(cat "$LOG")"
    sleep 0.1
  done
  fail "fabric did not publish its state within 10 s"
}

stop_fabric() {
  "$M" fabric stop "$FAB" || fail "fabric stop"
  wait "$FABRIC_PID" || fail "fabric run exited with $?"
  FABRIC_PID=""
  [ ! -e "$METAROCE_RUNDIR/fabric/$FAB" ] || fail "state folder left behind"
}

probe() { timeout 60 "$PROBE" --fabric "$FAB" --endpoints 2 --planes 2 "$@"; }

# ctl REQUEST: one request on the control socket (the runner's own `trace`); its reply body.
ctl() {
  "$PY" - "$METAROCE_RUNDIR/fabric/$FAB/control" "$1" <<'EOF'
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n")
s.shutdown(socket.SHUT_WR)
reply = b"".join(iter(lambda: s.recv(65536), b"")).decode()
print(reply, end="")
sys.exit(0 if reply.startswith("ok") else 1)
EOF
}

# check 'PYTHON EXPRESSION' PROBE_JSON STAT_JSON: p = probe result, s = stat, with helpers.
check() {
  local what=$1 expr=$2 probe_json=$3 stat_json=$4
  "$PY" - "$expr" "$probe_json" "$stat_json" <<'EOF' || fail "$what: $2"
import json, sys
expr, p, s = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
links = s["links"]
def total(field, kind=None, plane=None):
    return sum(l[field] for l in links
               if (kind is None or l["kind"] == kind) and (plane is None or l["plane"] == plane))
def end(e, plane):
    return next(x for x in p["ends"] if x["endpoint"] == e and x["plane"] == plane)
ok = eval("(" + expr + ")")
if not ok:
    print("probe:", json.dumps(p), file=sys.stderr)
    print("links:", json.dumps([(l["name"], l["frames_in"], l["frames_out"], l["drop_queue"],
                                 l["drop_loss"], l["drop_down"], l["ce_marked"]) for l in links]),
          file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
  echo "ok: $what"
}

# Argument errors of the new commands come back as one line and status 2 or 1.
set +e
"$M" fabric run "$FAB" --planes 2 >/dev/null 2>&1; [ $? = 2 ] || fail "run without --endpoints"
"$M" fabric stat nosuch >/dev/null 2>&1; [ $? = 1 ] || fail "stat of a missing fabric"
set -e

# 1. Forwarding and spraying: every frame arrives, intact, and the source ports spread over
#    every core link of both planes.
start_fabric --links-per-plane 4
P=$(probe --count 2000 --ports 32) || fail "probe: $P"
S=$("$M" fabric stat "$FAB" --json)
check "all 8000 frames delivered intact" \
  'p["received"] == 8000 and p["bad"] == 0 and p["send_failed"] == 0' "$P" "$S"
check "every core link of both planes carries traffic" \
  'all(l["frames_out"] > 100 for l in links if l["kind"] == "core")' "$P" "$S"
check "edge links count what endpoints received" \
  'total("frames_out", "edge") >= 8000 and total("drop_queue") == 0' "$P" "$S"
"$M" fabric stat "$FAB" | grep -q '^p1.edge1 ' || fail "stat table lacks p1.edge1"
# The probe said goodbye on each port before it disconnected (link.md §4), and the fabric answered
# and counted it: without it, memif's teardown raced the fabric's polling and crashed it.
check "every port's goodbye was answered" 'all(e["goodbye_acked"] for e in p["ends"])' "$P" "$S"
[ "$("$M" fabric stat "$FAB" | grep -c ', goodbyes 1$')" = 4 ] ||
  fail "the fabric did not count one goodbye per port: $("$M" fabric stat "$FAB" | grep '^port')"

# 2. A link changed live: endpoint 1's edge link of plane 1 black-holes, then comes back.
"$M" fabric set "$FAB" --plane 1 --link edge1 down >/dev/null
P=$(probe --count 500) || fail "probe: $P"
S=$("$M" fabric stat "$FAB" --json)
check "a down edge link black-holes only its own traffic" \
  'end(1, 1)["received"] == 0 and end(0, 1)["received"] == 500 and end(1, 0)["received"] == 500
   and [l["drop_down"] for l in links if l["name"] == "p1.edge1"][0] >= 500' "$P" "$S"
"$M" fabric set "$FAB" --plane 1 --link edge1 up >/dev/null
P=$(probe --count 500) || fail "probe: $P"
check "the link carries traffic again once up" 'p["received"] == 2000' "$P" "$S"
stop_fabric

# 3. Random loss on the core links: about 10 %, every loss counted where it happened.
start_fabric --links-per-plane 2 --loss 0.1
P=$(probe --count 2500) || fail "probe: $P"
S=$("$M" fabric stat "$FAB" --json)
check "about 10% lost" '0.85 * 10000 < p["received"] < 0.95 * 10000' "$P" "$S"
check "losses counted on the core links" \
  'abs(total("drop_loss", "core") - (p["sent"] - p["received"] - sum(e["arp"] for e in p["ends"]))) <= 2' \
  "$P" "$S"
stop_fabric

# 4. Congestion: 10 Mbit/s links offered ~16 Mbit/s per plane; ECT frames get CE with valid
#    IPv4 checksums (the probe's parser checks them), and the queue tail-drops past its size.
start_fabric --links-per-plane 1 --rate 10M --queue 65536 --ecn-threshold 8000
P=$(probe --count 600 --size 1000 --pps 8000 --linger-ms 1500) || fail "probe: $P"
S=$("$M" fabric stat "$FAB" --json)
check "CE marks arrive, checksums intact" 'p["ce"] > 50 and p["bad"] == 0' "$P" "$S"
check "marks counted on the links, queues held above the threshold" \
  'total("ce_marked") >= p["ce"] and max(l["max_queue_bytes"] for l in links) > 8000' "$P" "$S"
check "the byte-bounded queue never exceeded its size" \
  'max(l["max_queue_bytes"] for l in links) <= 65536' "$P" "$S"
stop_fabric

# 5. The trace under both idle policies: a fabric that never sleeps (--spin always) still
#    samples at its interval, and one that naps wakes for its samples; either way the last
#    sample, taken once the probe has gone, accounts for every byte the links forwarded.
for spin in always adaptive; do
  start_fabric --links-per-plane 2 --spin "$spin"
  TRACE="$METAROCE_RUNDIR/trace-$spin"
  ctl "trace 1000 $TRACE" >/dev/null || fail "trace request refused"
  probe --count 500 >/dev/null || fail "probe under --spin $spin"
  S=$("$M" fabric stat "$FAB" --json)
  ctl "trace off" >/dev/null || fail "trace off refused"
  T=$("$PY" - "$TRACE" <<'EOF'
import json, sys
lines = [l.split() for l in open(sys.argv[1]) if not l.startswith("#")]
cols, rows = lines[0], [[int(v) for v in l] for l in lines[1:] if len(l) == len(lines[0])]
out = [i for i, c in enumerate(cols) if c.endswith(".bytes_out")]
print(json.dumps({"rows": len(rows), "bytes_out": sum(rows[-1][i] for i in out) if rows else -1}))
EOF
  ) || fail "trace $TRACE unreadable"
  check "--spin $spin: the trace's last sample accounts for every byte forwarded" \
    'p["rows"] >= 2 and p["bytes_out"] == total("bytes_out") > 0' "$T" "$S"
  stop_fabric
done
# 6. Endpoints that come and go: twenty probes in a row, each leaving right after its traffic.
#    Before probes said goodbye, memif's teardown raced the fabric's polling: the fabric died of
#    SIGSEGV within 20 such probes in 4 runs of 5 (docs/design.md, "Goodbye before close").
start_fabric --links-per-plane 2 --spin always
for i in $(seq 20); do
  probe --count 200 --pps 200000 --linger-ms 0 >/dev/null || fail "probe $i of 20"
  kill -0 "$FABRIC_PID" 2>/dev/null || fail "the fabric died after probe $i of 20"
done
echo "ok: the fabric outlived 20 probes that came and went"
stop_fabric
echo "PASS fabric"
