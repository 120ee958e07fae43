#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Unmodified ibv_devices and ibv_devinfo see MetaRoCE devices created by `metaroce link add`.
source "$(dirname "$0")/lib.sh"
make_pair

out=$(ibv_devices)
echo "$out"
grep -qw mrA <<<"$out" || fail "ibv_devices does not list mrA"
grep -qw mrB <<<"$out" || fail "ibv_devices does not list mrB"

info=$(timeout 30 ibv_devinfo -v -d mrA)
echo "$info"
grep -q 'state:.*PORT_ACTIVE' <<<"$info" || fail "mrA port is not PORT_ACTIVE"
grep -q 'link_layer:.*Ethernet' <<<"$info" || fail "mrA link_layer is not Ethernet"
grep -q 'GID\[  0\]:.*::ffff:198.18.0.1, RoCE v2' <<<"$info" || fail "mrA GID 0 is not ::ffff:198.18.0.1 RoCE v2"
grep -q 'transport:.*InfiniBand' <<<"$info" || fail "transport is not reported"
echo "PASS devices"
