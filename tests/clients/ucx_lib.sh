# SPDX-License-Identifier: Apache-2.0
# What the UCX tests share: the integration suite's helpers (a run dir, devices mrA and mrB on a
# memif link), a skip where Debian's UCX is missing, and a ucx_perftest server/client pair.
source "$(dirname "$0")/../integration/lib.sh"
command -v ucx_perftest >/dev/null || { echo "SKIP: ucx_perftest (ucx-utils) is not installed"; exit 77; }
make_pair
# Few warm-up rounds: the figures are not what these tests check, the final line is.
PERF_ITERS=(-w 100 -n 1000)
PERF_PORT=13400
PASSED=0

# perf NAME SERVER_ENV CLIENT_ENV -- ARGS...: ucx_perftest ARGS as a server (environment
# SERVER_ENV, e.g. UCX_NET_DEVICES=mrA:1) and as its client; both must exit 0 within 60 s and
# the client must print its "Final:" line.
perf() {
  local name=$1 senv=$2 cenv=$3
  shift 4
  PERF_PORT=$((PERF_PORT + 1))
  env $senv timeout 60 ucx_perftest "$@" "${PERF_ITERS[@]}" -p "$PERF_PORT" \
    >"$LOGDIR/$name.server" 2>&1 &
  local spid=$!
  PIDS+=("$spid")
  wait_listen "$PERF_PORT"
  local crc=0 src=0
  env $cenv timeout 60 ucx_perftest "$@" "${PERF_ITERS[@]}" -p "$PERF_PORT" 127.0.0.1 \
    >"$LOGDIR/$name.client" 2>&1 || crc=$?
  wait "$spid" || src=$?
  local final
  final=$(grep '^Final:' "$LOGDIR/$name.client" || true)
  if [ "$crc" -ne 0 ] || [ "$src" -ne 0 ] || [ -z "$final" ]; then
    tail -n 15 "$LOGDIR/$name.server" "$LOGDIR/$name.client"
    local why
    why=$(grep -h -E 'ERROR|Fatal|error' "$LOGDIR/$name.client" "$LOGDIR/$name.server" |
      head -n 2 | tr -s ' \t\n' ' ')
    fail "ucx_perftest $name: server exit $src, client exit $crc${why:+: $why}"
  fi
  printf '%-28s %s\n' "$name" "$final"
  PASSED=$((PASSED + 1))
}
