# SPDX-License-Identifier: Apache-2.0
# Login shells: let libibverbs discover MetaRoCE links, but only on hosts whose kernel has no
# RDMA devices of its own, which SYSFS_PATH would hide. Elsewhere: metaroce exec -- PROGRAM.
if [ -z "${SYSFS_PATH:-}" ] && [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
  SYSFS_PATH="${METAROCE_RUNDIR:-/run/metaroce}/sys"
  export SYSFS_PATH
fi
