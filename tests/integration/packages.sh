#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian and RPM packages, end to end: build the .debs from a copy of the source, lintian
# (no errors), install them on this machine, create links with the installed command, run the
# unmodified ibv_devices and ibv_rc_pingpong through `metaroce exec`, build the direct-verbs
# example against the installed development package (pkg-config) and run it, purge, and check
# that no packaged file, link, run dir or /dev node is left; then rpmbuild and compare the RPM
# layout. metaroce-dkms: its dkms.conf and the module's sources, DKMS building metaroce_ib for the
# installed kernel headers (tests/kernel's kernel; this host's own kernel loads no modules), and
# purge taking every build away.
# Usage: packages.sh BUILD_DIR. Needs root and a throwaway machine (it installs packages).
# METAROCE_PKG_SOURCE=head builds from `git archive HEAD`; the default copies the working tree
# (tracked and untracked, not ignored), which on a clean clone is the same thing.
if [ "$(id -u)" -ne 0 ]; then echo "SKIP packages: needs root (installs packages)"; exit 77; fi
# Purging removes every /dev/infiniband node that is char 1:7, including those of links that
# other run dirs (a developer's tests) still use. Where possible the test therefore runs with a
# private /dev/infiniband (a tmpfs in its own mount namespace); the package scripts behave the same.
if [ -z "${METAROCE_PKG_NS:-}" ] && unshare -m --propagation private true 2>/dev/null; then
  exec unshare -m --propagation private env METAROCE_PKG_NS=1 bash -c \
    'mkdir -p /dev/infiniband && mount -t tmpfs -o mode=755 tmpfs /dev/infiniband && exec "$0" "$@"' \
    "$0" "$@"
fi
[ -n "${METAROCE_PKG_NS:-}" ] && echo "packages: private /dev/infiniband (mount namespace)"
source "$(dirname "$0")/lib.sh"
SRC=$(cd "$(dirname "$0")/../.." && pwd)
PKGS=(libmetaroce1 metaroce-provider libmetaroce-dev metaroce-tools metaroce-dkms)
# The RPM split: the library stays with the provider, as rdma-core's libibverbs package holds
# libmlx5.so.1; "RPM=DEB[,DEB]" pairs whose files must be the same.
RPM_LAYOUT=("metaroce-provider=libmetaroce1,metaroce-provider" "metaroce-devel=libmetaroce-dev"
            "metaroce-tools=metaroce-tools" "metaroce-dkms=metaroce-dkms")
# The kernel whose headers DKMS builds the module against (scripts/install-deps installs them).
KVER=${KG_KERNEL_VERSION:-6.1.0-57-amd64}
MULTIARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
WORK=$(mktemp -d /tmp/metaroce-packages.XXXXXX)
# The installed command, with nothing from the caller's environment that would point it (or the
# programs it runs) at a build tree or another run dir.
M=(env -u METAROCE_RUNDIR -u SYSFS_PATH -u RDMAV_DRIVERS /usr/bin/metaroce)

installed() { dpkg-query -W -f='${Status}\n' "$1" 2>/dev/null | grep -q ' installed$'; }
any_installed() { local p; for p in "${PKGS[@]}"; do installed "$p" && return 0; done; return 1; }
deb_of() { ls "$WORK"/"$1"_*.deb 2>/dev/null | head -n 1; }
step() { echo "== $(date +%T) $*"; }

pkg_cleanup() {
  if any_installed; then
    echo "cleanup: purging ${PKGS[*]}"
    [ -x /usr/bin/metaroce ] && "${M[@]}" link flush >/dev/null 2>&1
    apt-get purge -y -q "${PKGS[@]}" >"$LOGDIR/purge-cleanup" 2>&1 || dpkg -P "${PKGS[@]}" || true
  fi
  rm -rf "$WORK"
}
trap 'rc=$?; set +e; pkg_cleanup; (exit $rc); cleanup' EXIT

for tool in dpkg-buildpackage dh dh_dkms dkms lintian rpmbuild fakeroot ibv_devices ibv_rc_pingpong \
            cc make objdump pkg-config modinfo; do
  command -v "$tool" >/dev/null || fail "$tool is missing (scripts/install-deps installs it)"
done
for p in "${PKGS[@]}"; do installed "$p" && fail "$p is already installed; this test needs a machine without it"; done
[ -z "$(ls -A /run/metaroce/sys/class/infiniband 2>/dev/null)" ] ||
  fail "/run/metaroce already holds links; this test needs a machine without any"
[ -d "/lib/modules/$KVER/build" ] || fail "linux-headers-$KVER is missing (scripts/install-deps installs it)"
[ -z "$(dkms status -m metaroce 2>/dev/null)" ] || fail "DKMS already knows metaroce: $(dkms status -m metaroce)"

# --- build ------------------------------------------------------------------------------------
# One snapshot of the source for both builds: dpkg-buildpackage works in a copy of it (and writes
# beside that copy), rpmbuild archives the snapshot itself.
step "copying the source"
mkdir -p "$WORK/pristine"
if [ "${METAROCE_PKG_SOURCE:-worktree}" = head ]; then
  git -C "$SRC" archive HEAD | tar -x -C "$WORK/pristine"
else
  (cd "$SRC" && git ls-files -z -co --exclude-standard | xargs -0 -r sh -c \
     'for f; do [ -e "$f" ] && printf "%s\0" "$f"; done' sh | tar --null -T - -cf -) |
    tar -x -C "$WORK/pristine"
fi
[ -f "$WORK/pristine/debian/control" ] || fail "the copied source has no debian/"
cp -a "$WORK/pristine" "$WORK/src"

step "dpkg-buildpackage"
(cd "$WORK/src" && DEB_BUILD_OPTIONS="nocheck parallel=${JOBS:-2}" timeout 1200 \
   dpkg-buildpackage -b -us -uc) >"$LOGDIR/dpkg-buildpackage" 2>&1 ||
  { tail -n 40 "$LOGDIR/dpkg-buildpackage"; fail "dpkg-buildpackage failed"; }
debs=()
for p in "${PKGS[@]}"; do
  f=$(deb_of "$p")
  [ -n "$f" ] || fail "no $p .deb was built"
  debs+=("$f")
done

step "lintian"
lint_rc=0
lintian --fail-on error --no-tag-display-limit "${debs[@]}" >"$LOGDIR/lintian" 2>&1 || lint_rc=$?
if grep -q '^W: ' "$LOGDIR/lintian"; then echo "lintian warnings:"; grep '^W: ' "$LOGDIR/lintian"; fi
[ "$lint_rc" -eq 0 ] || { cat "$LOGDIR/lintian"; fail "lintian reports errors"; }

# The library is the provider: it carries the private-ABI bound; the plugin package and the
# development files need exactly the library of their own build.
lib_deps=$(dpkg-deb -f "$(deb_of libmetaroce1)" Depends)
echo "libmetaroce1 Depends: $lib_deps"
[[ $lib_deps == *"libibverbs1 (<< 57~)"* && $lib_deps == *"libibverbs1 (>= 44)"* ]] ||
  fail "libmetaroce1 does not pin libibverbs1 to the verified private-ABI range"
version=$(dpkg-deb -f "$(deb_of libmetaroce1)" Version)
for p in metaroce-provider libmetaroce-dev; do
  dpkg-deb -f "$(deb_of "$p")" Depends | grep -qF "libmetaroce1 (= $version)" ||
    fail "$p does not depend on libmetaroce1 (= $version)"
done
dpkg-deb -I "$(deb_of libmetaroce1)" symbols >"$WORK/symbols" || fail "libmetaroce1 has no symbols file"
grep -qx ' mrdv_create_qp@METAROCE_1.0 0.1.0' "$WORK/symbols" || fail "libmetaroce1's symbols lack mrdv_create_qp@METAROCE_1.0"

# metaroce-dkms: every source of kernel/metaroce_ib and a dkms.conf naming this version, in
# /usr/src/metaroce-VERSION; DKMS's scripts add it on configure and remove every build on removal.
step "metaroce-dkms: contents"
dkms_deb=$(deb_of metaroce-dkms)
upstream=${version%%-*}
dkms_src=/usr/src/metaroce-$upstream
[ "$(dpkg-deb -f "$dkms_deb" Architecture)" = all ] || fail "metaroce-dkms is not Architecture: all"
dpkg-deb -f "$dkms_deb" Depends | grep -qE '(^|, )dkms( |,|$)' || fail "metaroce-dkms does not depend on dkms"
dpkg-deb -c "$dkms_deb" | awk '{print $6}' | sed -n "s,^\.$dkms_src/\(.\),\1,p" | sort >"$WORK/dkms.files"
(cd "$WORK/pristine/kernel/metaroce_ib" && ls -A; echo dkms.conf) | sort >"$WORK/dkms.want"
diff -u "$WORK/dkms.want" "$WORK/dkms.files" ||
  fail "metaroce-dkms's $dkms_src is not kernel/metaroce_ib plus dkms.conf"
dpkg-deb --fsys-tarfile "$dkms_deb" | tar -xO ".$dkms_src/dkms.conf" >"$WORK/dkms.conf"
for line in 'PACKAGE_NAME="metaroce"' "PACKAGE_VERSION=\"$upstream\"" \
            'BUILT_MODULE_NAME[0]="metaroce_ib"' 'AUTOINSTALL="yes"'; do
  grep -qxF "$line" "$WORK/dkms.conf" || fail "dkms.conf lacks $line"
done
for f in main.c verbs.c engine.c; do
  dpkg-deb --fsys-tarfile "$dkms_deb" | tar -xO ".$dkms_src/$f" |
    cmp -s - "$WORK/pristine/kernel/metaroce_ib/$f" || fail "$dkms_src/$f is not the source's"
done
grep -q "MRIB_VERSION \"$upstream\"" "$WORK/pristine/kernel/metaroce_ib/metaroce_ib.h" ||
  fail "the module's MRIB_VERSION is not the package version $upstream"
dpkg-deb -I "$dkms_deb" postinst | grep -q 'common.postinst' || fail "metaroce-dkms's postinst does not run DKMS"
dpkg-deb -I "$dkms_deb" prerm | grep -q 'dkms remove -m \$DKMS_NAME' || fail "metaroce-dkms's prerm does not remove the DKMS builds"

# --- RPM -------------------------------------------------------------------------------------
step "rpmbuild"
JOBS=${JOBS:-2} timeout 1200 "$WORK/pristine/rpm/build-rpm.sh" "$WORK/rpms" "$WORK/pristine" \
  >"$LOGDIR/rpmbuild" 2>&1 || { tail -n 40 "$LOGDIR/rpmbuild"; fail "rpmbuild failed"; }

# --- install and use -------------------------------------------------------------------------
step "apt-get install"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${debs[@]}" \
  >"$LOGDIR/install" 2>&1 || { tail -n 30 "$LOGDIR/install"; fail "installing the .debs failed"; }
for p in "${PKGS[@]}"; do installed "$p" || fail "$p is not installed after apt-get install"; done
dpkg -L "${PKGS[@]}" | sort -u >"$WORK/files"
LIB=/usr/lib/$MULTIARCH
for f in "$LIB"/libibverbs/libmetaroce-rdmav34.so /etc/libibverbs.d/metaroce.driver \
         "$LIB"/metaroce/libmetaroce-preload.so "$LIB"/libmetaroce.so.1 "$LIB"/libmetaroce.so.1.0.0 \
         "$LIB"/libmetaroce.so "$LIB"/pkgconfig/libmetaroce.pc /usr/include/infiniband/metaroce_dv.h \
         /usr/share/man/man7/mrdv.7.gz /usr/share/man/man3/mrdv_create_qp.3.gz \
         /usr/share/man/man3/mrdv_query_paths.3.gz /usr/share/man/man3/mrdv_repath.3.gz \
         /usr/bin/metaroce /usr/sbin/metaroced /lib/systemd/system/metaroce.service \
         /lib/systemd/system/metaroced.service /etc/metaroce/links.conf \
         /etc/profile.d/metaroce.sh /usr/share/man/man8/metaroce.8.gz \
         /usr/share/man/man8/metaroced.8.gz \
         /usr/share/man/man5/metaroce-links.conf.5.gz; do
  grep -qxF "$f" "$WORK/files" || fail "$f is not in the packages"
  [ -e "$f" ] || fail "$f is not installed"
done
grep -qx 'driver metaroce' /etc/libibverbs.d/metaroce.driver || fail "metaroce.driver does not name the provider"
[ "$(readlink -f "$LIB"/libibverbs/libmetaroce-rdmav34.so)" = "$LIB"/libmetaroce.so.1.0.0 ] ||
  fail "the plugin libibverbs loads is not libmetaroce.so.1"

step "metaroce-dkms: DKMS builds metaroce_ib for $KVER"
dkms status -m metaroce -v "$upstream"
[ -n "$(dkms status -m metaroce -v "$upstream")" ] || fail "DKMS does not know metaroce/$upstream after install"
# The configure script built it for the running kernel, or (where that kernel has no headers or
# modules, as here) for the installed ones; ask for $KVER in any case.
built=$(dkms status -m metaroce -v "$upstream" -k "$KVER")
if ! grep -qE ': (built|installed)' <<<"$built"; then
  dkms build -m metaroce -v "$upstream" -k "$KVER" >"$LOGDIR/dkms-build" 2>&1 ||
    { tail -n 40 "$LOGDIR/dkms-build"; fail "dkms build for $KVER failed"; }
fi
ko=$(find "/var/lib/dkms/metaroce/$upstream/$KVER" -name 'metaroce_ib.ko*' | head -n 1)
[ -n "$ko" ] || fail "no metaroce_ib.ko under /var/lib/dkms/metaroce/$upstream/$KVER"
[ "$(modinfo -F vermagic "$ko" | cut -d' ' -f1)" = "$KVER" ] || fail "$ko is not built for $KVER"
[ "$(modinfo -F version "$ko")" = "$upstream" ] || fail "$ko says version $(modinfo -F version "$ko")"
modinfo -F alias "$ko" | grep -qx 'rdma-link-metaroce' || fail "$ko does not answer rdma link add ... type metaroce"
# (find fails on the build folder where DKMS removed it after the build.)
make_log=$({ find "/var/lib/dkms/metaroce/$upstream/$KVER" /var/lib/dkms/metaroce/"$upstream"/build \
              -name make.log 2>/dev/null || true; } | head -n 1)
[ -n "$make_log" ] || fail "DKMS kept no make.log of the build for $KVER"
grep -E 'warning:|error:' "$make_log" && fail "DKMS built metaroce_ib with warnings ($make_log)"
echo "dkms: $(basename "$ko") for $KVER, version $upstream"

step "the development files: pkg-config, versioned symbols"
flags=$(env -u PKG_CONFIG_PATH pkg-config --cflags --libs libmetaroce) || fail "pkg-config libmetaroce failed"
echo "pkg-config --cflags --libs libmetaroce: $flags"
[[ " $flags " == *" -lmetaroce "* && " $flags " == *" -libverbs "* ]] ||
  fail "pkg-config libmetaroce does not give -lmetaroce -libverbs"
objdump -T "$LIB"/libmetaroce.so.1 >"$WORK/dynsym"
# Every function of the released stanza, as the map file lists it, with that version.
api=$(sed -n '/^METAROCE_1.0 {/,/^}/p' "$WORK/pristine/providers/metaroce/libmetaroce.map" |
      sed -n 's/^ *\(mrdv_[a-z_]*\);$/\1/p')
[ "$(wc -w <<<"$api")" -ge 7 ] || fail "could not read the METAROCE_1.0 functions from libmetaroce.map"
for fn in $api; do
  grep -qE "[[:space:]]METAROCE_1\.0[[:space:]]+$fn\$" "$WORK/dynsym" ||
    fail "objdump -T libmetaroce.so.1: $fn is not exported with version METAROCE_1.0"
done
if grep -E '[[:space:]]mrdv_' "$WORK/dynsym" | grep -qvE '[[:space:]]METAROCE_[0-9.]+[[:space:]]'; then
  fail "libmetaroce.so.1 exports an mrdv_ symbol without a METAROCE_ version"
fi
step "building examples/mrdv_paths.c against the installed package"
cp -r "$WORK/pristine/examples" "$WORK/example"
make -C "$WORK/example" >"$LOGDIR/example-build" 2>&1 || { cat "$LOGDIR/example-build"; fail "make examples failed"; }
# (/lib is /usr/lib on merged-/usr systems: compare the files, not the names.)
linked=$(ldd "$WORK/example/mrdv_paths" | sed -n 's/^[[:space:]]*libmetaroce\.so\.1 => \([^ ]*\) .*/\1/p')
[ -n "$linked" ] && [ "$(readlink -f "$linked")" = "$(readlink -f "$LIB"/libmetaroce.so.1)" ] ||
  fail "the example does not link the installed libmetaroce.so.1: $(ldd "$WORK/example/mrdv_paths")"

step "links from /etc/metaroce/links.conf, as metaroce.service makes them"
sock="metaroce-packages-$$"
cat >/etc/metaroce/links.conf <<CONF
# written by tests/integration/packages.sh
mrA --dpdk net_memif0,role=server,socket=$sock --ip 198.18.0.1/24
mrB --dpdk net_memif1,role=client,socket=$sock --ip 198.18.0.2/24
CONF
if [ -d /run/systemd/system ]; then
  systemctl restart metaroce.service || fail "metaroce.service did not start"
else
  # Without systemd, `link apply` starts the installed engine itself.
  "${M[@]}" link apply || fail "metaroce link apply failed"
fi
"${M[@]}" link show
"${M[@]}" engine status || fail "no engine serves the links"
# The installed engine, not one that a test running beside this one started from the build tree.
pgrep -f '^/usr/sbin/metaroced ' >/dev/null || fail "the installed metaroced does not run"
[ "$("${M[@]}" link show --json | grep -c '"name"')" -eq 2 ] || fail "the two links are not there"

step "ibv_devices and ibv_rc_pingpong through metaroce exec"
devices=$("${M[@]}" exec -- ibv_devices) || fail "metaroce exec -- ibv_devices failed"
echo "$devices"
grep -qw mrA <<<"$devices" && grep -qw mrB <<<"$devices" || fail "ibv_devices does not list mrA and mrB"
set +e
"${M[@]}" exec -- metaroce-no-such-program 2>"$LOGDIR/exec-missing"
missing_rc=$?
set -e
[ "$missing_rc" -eq 127 ] && grep -q 'command not found' "$LOGDIR/exec-missing" ||
  fail "metaroce exec of a missing program: exit $missing_rc, $(cat "$LOGDIR/exec-missing")"
port=18710
# run_pair splits its commands at "--", so here exec gets the program without one.
# -e: completion channels, through the installed libmetaroce-preload.so that exec preloads.
run_pair pkg_pingpong $port 60 -- "${M[@]}" exec ibv_rc_pingpong -g 0 -d mrA -p $port -n 100 -e \
  -- "${M[@]}" exec ibv_rc_pingpong -g 0 -d mrB -p $port -n 100 -e 127.0.0.1
grep -q '819200 bytes in' "$LOGDIR/pkg_pingpong.client" || fail "client did not report 100 x 4096-byte round trips"

step "the direct-verbs example, built against the package, through metaroce exec"
timeout 60 "${M[@]}" exec "$WORK/example/mrdv_paths" -d mrA -p 4 -m 0x1 -n 200 >"$LOGDIR/example" 2>&1 ||
  { cat "$LOGDIR/example"; fail "the example failed"; }
cat "$LOGDIR/example"
grep -q '^mrdv_paths: OK$' "$LOGDIR/example" || fail "the example did not finish"

# --- purge -----------------------------------------------------------------------------------
step "apt-get purge"
DEBIAN_FRONTEND=noninteractive apt-get purge -y -q "${PKGS[@]}" >"$LOGDIR/purge" 2>&1 ||
  { tail -n 30 "$LOGDIR/purge"; fail "purging the packages failed"; }
for p in "${PKGS[@]}"; do dpkg-query -W "$p" >/dev/null 2>&1 && fail "$p is still known to dpkg"; done
left=()
while read -r f; do
  [ -d "$f" ] && continue  # directories are shared (/usr/bin, /etc/libibverbs.d, ...)
  [ -e "$f" ] || [ -L "$f" ] && left+=("$f")
done <"$WORK/files"
[ "${#left[@]}" -eq 0 ] || fail "files left after purge: ${left[*]}"
[ ! -e /etc/metaroce ] || fail "/etc/metaroce is left after purge"
[ ! -e /run/metaroce ] || fail "/run/metaroce is left after purge"
[ ! -e /etc/systemd/system/multi-user.target.wants/metaroce.service ] || fail "the unit is still enabled"
for node in /dev/infiniband/uverbs*; do
  [ -c "$node" ] && [ "$(stat -c '%t:%T' "$node")" = 1:7 ] && fail "our device node $node is left"
done
SYSFS_PATH=/run/metaroce/sys ibv_devices 2>/dev/null | grep -qw 'mr[AB]' && fail "a link is still visible"
pgrep -f '^/usr/sbin/metaroced ' >/dev/null && fail "the installed metaroced still runs after purge"
[ -z "$(dkms status -m metaroce 2>/dev/null)" ] || fail "DKMS still knows metaroce after purge: $(dkms status -m metaroce)"
[ ! -e /var/lib/dkms/metaroce ] || fail "/var/lib/dkms/metaroce is left after purge"
left_ko=$(find /lib/modules -path '*/updates/dkms/metaroce_ib.ko*' 2>/dev/null)
[ -z "$left_ko" ] || fail "DKMS builds left after purge: $left_ko"
echo "deb: installed, used and purged without leftovers"

# --- RPM layout --------------------------------------------------------------------------------
step "rpm -qlp"
# The same files in the same places, modulo each distribution's libdir and unit dir.
normalize() {
  sed -e "s,^/usr/lib/$MULTIARCH/,LIBDIR/,; s,^/usr/lib64/,LIBDIR/,; s,^/lib/systemd/system/,UNITDIR/," \
      -e 's,^/usr/lib/systemd/system/,UNITDIR/,; s,\.gz$,,' |
    grep -v -e '^/usr/share/doc/' -e '^/usr/lib/\.build-id/' | sort -u
}
for pair in "${RPM_LAYOUT[@]}"; do
  rp=${pair%%=*}
  rpmfile=$(ls "$WORK"/rpms/"$rp"-[0-9]*.rpm | head -n 1)
  [ -n "$rpmfile" ] || fail "no $rp RPM was built"
  rpm -qp --qf '[%{FILEMODES:perms} %{FILENAMES}\n]' "$rpmfile" | awk '$1 !~ /^d/ {print $2}' |
    normalize >"$WORK/$rp.rpm.list"
  IFS=, read -r -a dps <<<"${pair#*=}"
  for dp in "${dps[@]}"; do
    dpkg-deb -c "$(deb_of "$dp")" | awk '{print $6}' | sed 's,^\.,,' | grep -v '/$'
  done | normalize >"$WORK/$rp.deb.list"
  diff -u "$WORK/$rp.deb.list" "$WORK/$rp.rpm.list" || fail "$rp: RPM and .deb (${pair#*=}) layouts differ"
done
provider_rpm=$(ls "$WORK"/rpms/metaroce-provider-[0-9]*.rpm | head -n 1)
rpm -qp --requires "$provider_rpm" | grep -qF 'libibverbs.so.1(IBVERBS_PRIVATE_34)(64bit)' ||
  fail "the provider RPM does not require libibverbs' private ABI 34"
rpm -qp --provides "$provider_rpm" | grep -qF 'libmetaroce.so.1(METAROCE_1.0)(64bit)' ||
  fail "the provider RPM does not provide libmetaroce.so.1(METAROCE_1.0)"
dkms_rpm=$(ls "$WORK"/rpms/metaroce-dkms-[0-9]*.noarch.rpm | head -n 1)
[ -n "$dkms_rpm" ] || fail "the metaroce-dkms RPM is not noarch"
rpm -qp --requires "$dkms_rpm" | grep -qx 'dkms' || fail "the metaroce-dkms RPM does not require dkms"
rpm -qp --scripts "$dkms_rpm" >"$WORK/dkms-rpm.scripts"
grep -q "dkms add -m metaroce -v $upstream" "$WORK/dkms-rpm.scripts" &&
  grep -q "dkms remove -m metaroce -v $upstream --all" "$WORK/dkms-rpm.scripts" ||
  { cat "$WORK/dkms-rpm.scripts"; fail "the metaroce-dkms RPM's scripts do not add and remove it with DKMS"; }
echo "rpm: same layout as the .debs"
echo "PASS packages"
