// SPDX-License-Identifier: Apache-2.0
// The direct verbs' refusals that need no engine (mrdv_*(3) RETURN VALUE): NULL arguments, and
// contexts and queue pairs of another provider, which a program that opens every device (as
// perftest and NCCL do) hands them. What needs an engine is tests/integration/dv.cc.
#include <gtest/gtest.h>
#include <infiniband/metaroce_dv.h>

#include <cerrno>

#include "providers/metaroce/verbs_abi.h"

namespace metaroce::provider {
namespace {

// A device and context of some other provider: its own ops table, nothing of ours.
struct Foreign {
  abi::DeviceOps ops{};
  abi::VerbsDevice dev{};
  ibv_context ctx{};
  ibv_qp qp{};
  Foreign() {
    ops.name = "other";
    dev.ops = &ops;
    ctx.device = &dev.device;
    qp.context = &ctx;
    qp.qp_type = IBV_QPT_RC;
  }
};

TEST(DirectVerbs, AnotherProvidersDeviceIsNotSupported) {
  Foreign f;
  EXPECT_FALSE(mrdv_is_supported(&f.dev.device));
  EXPECT_FALSE(mrdv_is_supported(nullptr));
}

TEST(DirectVerbs, AnotherProvidersContextAndQpGetEopnotsupp) {
  Foreign f;
  mrdv_device_attr d{};
  EXPECT_EQ(mrdv_query_device(&f.ctx, &d, sizeof(d)), EOPNOTSUPP);
  ibv_qp_init_attr_ex qa{};
  qa.qp_type = IBV_QPT_RC;
  mrdv_qp_init_attr m{};
  errno = 0;
  EXPECT_EQ(mrdv_create_qp(&f.ctx, &qa, &m, sizeof(m)), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  mrdv_qp_attr a{};
  EXPECT_EQ(mrdv_modify_qp(&f.qp, &a, sizeof(a)), EOPNOTSUPP);
  mrdv_qp_conn c{};
  EXPECT_EQ(mrdv_query_qp_conn(&f.qp, &c, sizeof(c)), EOPNOTSUPP);
  mrdv_path_stats p{};
  uint32_t n = 0;
  EXPECT_EQ(mrdv_query_paths(&f.qp, &p, 1, sizeof(p), &n), EOPNOTSUPP);
  uint16_t port = 0;
  EXPECT_EQ(mrdv_repath(&f.qp, 0, &port), EOPNOTSUPP);
}

TEST(DirectVerbs, NullArgumentsAreEinval) {
  Foreign f;
  mrdv_device_attr d{};
  EXPECT_EQ(mrdv_query_device(nullptr, &d, sizeof(d)), EINVAL);
  EXPECT_EQ(mrdv_query_device(&f.ctx, nullptr, sizeof(d)), EINVAL);
  ibv_qp_init_attr_ex qa{};
  mrdv_qp_init_attr m{};
  errno = 0;
  EXPECT_EQ(mrdv_create_qp(nullptr, &qa, &m, sizeof(m)), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(mrdv_create_qp(&f.ctx, nullptr, &m, sizeof(m)), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(mrdv_modify_qp(nullptr, nullptr, 0), EINVAL);
  EXPECT_EQ(mrdv_modify_qp(&f.qp, nullptr, sizeof(mrdv_qp_attr)), EINVAL);
  EXPECT_EQ(mrdv_query_qp_conn(nullptr, nullptr, 0), EINVAL);
  mrdv_path_stats p{};
  EXPECT_EQ(mrdv_query_paths(&f.qp, &p, 1, sizeof(p), nullptr), EINVAL);
  EXPECT_EQ(mrdv_query_paths(&f.qp, nullptr, 1, sizeof(p), nullptr), EINVAL);
  EXPECT_EQ(mrdv_repath(nullptr, 0, nullptr), EINVAL);
}

// The public structures: what the ABI baseline pins, said here too so a change fails at once.
TEST(DirectVerbs, PublicStructuresKeepTheirLayout) {
  EXPECT_EQ(sizeof(mrdv_device_attr), 48u);
  EXPECT_EQ(sizeof(mrdv_qp_init_attr), 24u);
  EXPECT_EQ(sizeof(mrdv_qp_attr), 16u);
  EXPECT_EQ(sizeof(mrdv_qp_conn), 48u);
  EXPECT_EQ(sizeof(mrdv_path_stats), 96u);
}

}  // namespace
}  // namespace metaroce::provider
