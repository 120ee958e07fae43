# SPDX-License-Identifier: Apache-2.0
# For clients that reach their peer over TCP at the same address they then give the RDMA CM
# (qperf -cm1, libfabric's verbs provider): a network namespace of the test's own where a veth
# interface `va` holds both devices' addresses. The RDMA traffic still goes through the engine;
# only the clients' own TCP exchange uses the kernel. Sourced after lib.sh and make_pair;
# run_in_ns CMD... runs a command there. Removed with everything else on exit.
NS="mrc$$"
# lib.sh's cleanup reads the exit status from $?: handed on with errexit off, or the subshell
# that hands it on would end the trap before cleanup runs.
trap 'rc=$?; ip netns del "$NS" 2>/dev/null; set +e; (exit $rc); cleanup' EXIT
ip netns add "$NS" || { echo "SKIP: no network namespaces here"; exit 77; }
ip -n "$NS" link set lo up
ip -n "$NS" link add va type veth peer name vb
ip -n "$NS" link set va up
ip -n "$NS" link set vb up
ip -n "$NS" addr add 198.18.0.1/32 dev va
ip -n "$NS" addr add 198.18.0.2/32 dev va
run_in_ns() { ip netns exec "$NS" "$@"; }
# ns_wait_listen PORT: until a TCP listener is up on PORT inside the namespace (10 s at most).
ns_wait_listen() {
  for _ in $(seq 100); do
    run_in_ns ss -ltnH "sport = :$1" | grep -q . && return 0
    sleep 0.1
  done
  fail "nothing listens on TCP port $1 in $NS"
}
