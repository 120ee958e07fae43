// SPDX-License-Identifier: Apache-2.0
// Tests of the `metaroce` command library against a temporary run dir and device dir.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "datapath/fabric/fabric_control.h"
#include "datapath/nic/link_config.h"
#include "util/cli.h"

#include <nlohmann/json.hpp>

namespace metaroce::util {
namespace {

namespace fs = std::filesystem;

// `--json` output is read with the same JSON library the command writes it with; a parse error
// (nlohmann::json::parse_error) fails the test that printed it.
using nlohmann::json;

// --- fixture ------------------------------------------------------------------------------

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/metaroce-cli-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    ctx_.rundir = root_ + "/run";
    ctx_.dev_dir = root_ + "/dev/infiniband";  // never the real /dev: tests plant fake nodes
    ctx_.is_root = ::geteuid() == 0;
    ctx_.build_root = root_ + "/build";
    ctx_.exe_dir = root_ + "/bin";
    ctx_.out = &out_;
    ctx_.err = &err_;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  int run(std::vector<std::string> args) {
    out_.str("");
    err_.str("");
    return util::run(args, ctx_);
  }
  int add(const std::string& name, const std::string& ip, std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {"link", "add", name, "--dpdk", "net_memif0,role=server", "--ip", ip};
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a);
  }
  // Link creation needs mknod; without root only the refusal can be tested.
  bool can_mknod() const { return ::geteuid() == 0; }

  // Every entry under dir: files with their content, directories and device nodes marked.
  static std::map<std::string, std::string> snapshot(const std::string& dir) {
    std::map<std::string, std::string> m;
    std::error_code ec;
    if (!fs::exists(dir, ec)) return m;
    for (auto it = fs::recursive_directory_iterator(dir, ec); it != fs::end(it); it.increment(ec)) {
      std::string rel = fs::relative(it->path(), dir).string();
      struct stat st {};
      ::lstat(it->path().c_str(), &st);
      if (S_ISDIR(st.st_mode)) {
        m[rel] = "<dir>";
      } else if (S_ISCHR(st.st_mode)) {
        m[rel] = "<chr " + std::to_string(major(st.st_rdev)) + ":" + std::to_string(minor(st.st_rdev)) +
                 " " + std::to_string(st.st_mode & 07777) + ">";
      } else {
        std::ifstream f(it->path());
        std::stringstream ss;
        ss << f.rdbuf();
        m[rel] = ss.str();
      }
    }
    return m;
  }
  std::map<std::string, std::string> state() const {
    auto m = snapshot(ctx_.sysfs());
    for (auto& [k, v] : snapshot(ctx_.dev_dir)) m["dev/" + k] = v;
    return m;
  }
  void make_node(const std::string& entry, unsigned maj, unsigned min) {
    fs::create_directories(ctx_.dev_dir);
    ASSERT_EQ(::mknod((ctx_.dev_dir + "/" + entry).c_str(), S_IFCHR | 0600, makedev(maj, min)), 0);
  }
  std::string uverbs_of(const std::string& name) {
    std::string err;
    auto c = nic::LinkConfig::load(ctx_.sysfs() + "/class/infiniband/" + name + "/metaroce.conf", &err);
    return c ? c->uverbs : "<" + err + ">";
  }
  // The single stderr line every failure must produce.
  void expect_one_error_line() {
    std::string e = err_.str();
    EXPECT_EQ(e.rfind("metaroce: ", 0), 0u) << e;
    EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 1) << e;
  }

  std::string root_;
  Context ctx_;
  std::ostringstream out_, err_;
};

TEST_F(CliTest, AddCreatesExactlyTheSysfsTreeAndNode) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(add("mr0", "10.0.0.1/24"), kExitOk) << err_.str();
  EXPECT_EQ(err_.str(), "");

  std::map<std::string, std::string> want = {
      {"class", "<dir>"},
      {"class/infiniband_verbs", "<dir>"},
      {"class/infiniband_verbs/abi_version", "6\n"},
      // The RDMA CM's ABI for librdmacm, and the marker for the preload (docs/spec/cm.md §1).
      {"class/misc", "<dir>"},
      {"class/misc/rdma_cm", "<dir>"},
      {"class/misc/rdma_cm/abi_version", "4\n"},
      {"class/misc/rdma_cm/metaroce", "served by the MetaRoCE engine of this run dir\n"},
      {"class/infiniband_verbs/uverbs0", "<dir>"},
      {"class/infiniband_verbs/uverbs0/ibdev", "mr0\n"},
      {"class/infiniband_verbs/uverbs0/dev", "1:7\n"},
      {"class/infiniband_verbs/uverbs0/abi_version", std::to_string(nic::kUverbsAbi) + "\n"},
      {"class/infiniband", "<dir>"},
      {"class/infiniband/mr0", "<dir>"},
      {"class/infiniband/mr0/node_type", "1: CA\n"},
      {"class/infiniband/mr0/node_guid", "0200:0aff:fe00:0001\n"},
      {"class/infiniband/mr0/ports", "<dir>"},
      {"class/infiniband/mr0/ports/1", "<dir>"},
      {"class/infiniband/mr0/ports/1/state", "4: ACTIVE\n"},
      {"class/infiniband/mr0/ports/1/link_layer", "Ethernet\n"},
      {"class/infiniband/mr0/ports/1/pkeys", "<dir>"},
      {"class/infiniband/mr0/ports/1/pkeys/0", "0xffff\n"},
      {"class/infiniband/mr0/ports/1/gids", "<dir>"},
      {"class/infiniband/mr0/ports/1/gid_attrs", "<dir>"},
      {"class/infiniband/mr0/ports/1/gid_attrs/types", "<dir>"},
  };
  for (uint32_t i = 0; i < nic::kGidTableLen; ++i) {
    want["class/infiniband/mr0/ports/1/gids/" + std::to_string(i)] =
        i == 0 ? "0000:0000:0000:0000:0000:ffff:0a00:0001\n" : "0000:0000:0000:0000:0000:0000:0000:0000\n";
    want["class/infiniband/mr0/ports/1/gid_attrs/types/" + std::to_string(i)] = "RoCE v2\n";
  }
  auto got = snapshot(ctx_.sysfs());
  ASSERT_TRUE(got.count("class/infiniband/mr0/metaroce.conf"));
  got.erase("class/infiniband/mr0/metaroce.conf");  // checked field by field below
  EXPECT_EQ(got, want);

  std::string err;
  auto c = nic::LinkConfig::load(ctx_.sysfs() + "/class/infiniband/mr0/metaroce.conf", &err);
  ASSERT_TRUE(c) << err;
  EXPECT_EQ(c->name, "mr0");
  EXPECT_EQ(c->devargs, "net_memif0,role=server");
  EXPECT_EQ(nic::format_ipv4(c->ip), "10.0.0.1");
  EXPECT_EQ(c->prefix, 24);
  EXPECT_EQ(c->mtu, nic::kDefaultMtu);
  EXPECT_EQ(c->paths, nic::kDefaultPaths);
  EXPECT_EQ(c->udp_port, nic::kDefaultUdpPort);
  EXPECT_EQ(c->node_guid, 0x02000afffe000001ull);
  EXPECT_EQ(c->uverbs, "uverbs0");

  EXPECT_EQ(snapshot(ctx_.dev_dir), (std::map<std::string, std::string>{{"uverbs0", "<chr 1:7 438>"}}));
  // No staging or trash left beside the tree.
  for (const auto& e : fs::directory_iterator(ctx_.rundir))
    EXPECT_TRUE(e.path().filename() == "sys" || e.path().filename() == ".lock") << e.path();
}

TEST_F(CliTest, AddRecordsEveryOptionInBothSpellings) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(run({"link", "add", "--mtu=4200", "mr1", "--paths", "256", "--udp-port=5000", "--ip",
                 "192.168.7.9/16", "--dpdk=net_af_packet0,iface=lo", "--rx-capacity", "25000"}),
            kExitOk)
      << err_.str();
  std::string err;
  auto c = nic::LinkConfig::load(ctx_.sysfs() + "/class/infiniband/mr1/metaroce.conf", &err);
  ASSERT_TRUE(c) << err;
  EXPECT_EQ(c->mtu, 4200u);
  EXPECT_EQ(c->paths, 256);
  EXPECT_EQ(c->udp_port, 5000);
  EXPECT_EQ(c->rx_capacity_mbps, 25000u);
  EXPECT_EQ(c->prefix, 16);
  EXPECT_EQ(c->devargs, "net_af_packet0,iface=lo");
}

// Limits (verbs-mapping.md §20): recorded, read back, a process's share defaulting to the
// device's; malformed ones and a share above the device's refused, leaving nothing.
TEST_F(CliTest, AddRecordsLimitsAndRefusesBadOnes) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(run({"link", "add", "mr1", "--ip", "198.18.7.9/24", "--dpdk=net_af_packet0,iface=lo",
                 "--limit", "qp=100,mr=500,ring-mib=64", "--process-limit=qp=10,ring-mib=8"}),
            kExitOk)
      << err_.str();
  std::string err;
  auto c = nic::LinkConfig::load(ctx_.sysfs() + "/class/infiniband/mr1/metaroce.conf", &err);
  ASSERT_TRUE(c) << err;
  EXPECT_EQ(c->limits.qp, 100u);
  EXPECT_EQ(c->limits.mr, 500u);
  EXPECT_EQ(c->limits.ring_mib, 64u);
  EXPECT_EQ(c->limits.cq, nic::Limits{}.cq);
  EXPECT_EQ(c->process_limits.qp, 10u);
  EXPECT_EQ(c->process_limits.mr, 500u) << "not given: the device's";
  EXPECT_EQ(c->process_limits.ring_mib, 8u);
  for (std::vector<std::string> bad : {std::vector<std::string>{"--limit", "qp=0"},
                                       {"--limit", "qp"}, {"--limit", "nic=4"},
                                       {"--limit", "qp=1,,cq=2"}, {"--process-limit", "mr=x"},
                                       {"--limit", "qp=5", "--process-limit", "qp=6"},
                                       {"--limit", "ring-mib=4", "--process-limit", "ring-mib=5"}}) {
    std::vector<std::string> args = {"link", "add", "mr2", "--ip", "198.18.7.10/24",
                                     "--dpdk=net_af_packet1,iface=lo"};
    args.insert(args.end(), bad.begin(), bad.end());
    err_.str("");
    EXPECT_EQ(run(args), kExitError) << bad[1];
    EXPECT_NE(err_.str().find("limit"), std::string::npos) << err_.str();
    EXPECT_FALSE(fs::exists(ctx_.sysfs() + "/class/infiniband/mr2")) << bad[1];
  }
}

TEST_F(CliTest, ShowPrintsTableAndParsableJson) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(run({"link", "show", "--json"}), kExitOk);
  const json empty = json::parse(out_.str());
  EXPECT_TRUE(empty.is_array());
  EXPECT_TRUE(empty.empty());

  ASSERT_EQ(add("mr1", "10.0.0.2/24", {"--mtu", "4200"}), kExitOk) << err_.str();
  ASSERT_EQ(run({"link", "add", "mr0", "--dpdk", "net_memif1,role=client,socket=/tmp/a\"b", "--ip",
                 "10.0.0.1/24"}),
            kExitOk)
      << err_.str();

  ASSERT_EQ(run({"link", "show"}), kExitOk);
  std::string table = out_.str();
  EXPECT_EQ(table.rfind("NAME", 0), 0u) << table;
  auto mr0_at = table.find("\nmr0 "), mr1_at = table.find("\nmr1 ");
  ASSERT_NE(mr0_at, std::string::npos) << table;
  ASSERT_NE(mr1_at, std::string::npos) << table;
  EXPECT_LT(mr0_at, mr1_at) << "sorted by name";
  EXPECT_NE(table.find("10.0.0.2/24"), std::string::npos);
  EXPECT_NE(table.find("4200"), std::string::npos);

  ASSERT_EQ(run({"link", "show", "--json"}), kExitOk);
  const json all = json::parse(out_.str());
  ASSERT_TRUE(all.is_array());
  ASSERT_EQ(all.size(), 2u);
  const json& mr0 = all[0];
  ASSERT_TRUE(mr0.is_object());
  EXPECT_EQ(mr0.at("name"), "mr0");
  EXPECT_EQ(mr0.at("devargs"), "net_memif1,role=client,socket=/tmp/a\"b");
  EXPECT_EQ(mr0.at("ip"), "10.0.0.1");
  EXPECT_EQ(mr0.at("prefix"), 24);
  EXPECT_EQ(mr0.at("uverbs"), "uverbs1");
  EXPECT_EQ(mr0.at("node_guid"), "0200:0aff:fe00:0001");
  EXPECT_EQ(all[1].at("mtu"), 4200);
  EXPECT_EQ(all[1].at("paths"), nic::kDefaultPaths);
  EXPECT_EQ(all[1].at("udp_port"), nic::kDefaultUdpPort);

  ASSERT_EQ(run({"link", "show", "mr1", "--json"}), kExitOk);
  const json one = json::parse(out_.str());
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].at("name"), "mr1");

  EXPECT_EQ(run({"link", "show", "mr9"}), kExitError);
  expect_one_error_line();
}

TEST_F(CliTest, ShowJsonEscapesWhatJsonMust) {
  // A socket path is the user's text: quotes and backslashes come back exactly.
  ASSERT_EQ(run({"link", "add", "mr0", "--dpdk", "net_memif0,role=client,socket=/tmp/q\"\\\\.s",
                 "--ip", "10.0.0.1/24"}),
            kExitOk)
      << err_.str();
  ASSERT_EQ(run({"link", "show", "--json"}), kExitOk);
  EXPECT_NE(out_.str().find("socket=/tmp/q\\\"\\\\\\\\.s"), std::string::npos) << out_.str();
  const json all = json::parse(out_.str());
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].at("devargs"), "net_memif0,role=client,socket=/tmp/q\"\\\\.s");
}

TEST_F(CliTest, DelRemovesTreeAndRecordButKeepsNode) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(add("mr0", "10.0.0.1/24"), kExitOk) << err_.str();
  ASSERT_EQ(add("mr1", "10.0.0.2/24"), kExitOk) << err_.str();
  ASSERT_EQ(run({"link", "del", "mr1"}), kExitOk) << err_.str();
  ASSERT_EQ(run({"link", "del", "mr0"}), kExitOk) << err_.str();
  auto after = snapshot(ctx_.sysfs());
  // Only the shared skeleton stays.
  const std::map<std::string, std::string> skeleton = {
      {"class", "<dir>"},
      {"class/infiniband", "<dir>"},
      {"class/infiniband_verbs", "<dir>"},
      {"class/infiniband_verbs/abi_version", "6\n"},
      {"class/misc", "<dir>"},
      {"class/misc/rdma_cm", "<dir>"},
      {"class/misc/rdma_cm/abi_version", "4\n"},
      {"class/misc/rdma_cm/metaroce", "served by the MetaRoCE engine of this run dir\n"}};
  EXPECT_EQ(after, skeleton);
  EXPECT_EQ(snapshot(ctx_.dev_dir).size(), 2u) << "device nodes are shared and stay";
  EXPECT_EQ(run({"link", "del", "mr0"}), kExitError);
  expect_one_error_line();
  EXPECT_NE(err_.str().find("no link named mr0"), std::string::npos);
  // Round trip: the same name and address can be added again, and get the lowest number back.
  ASSERT_EQ(add("mr0", "10.0.0.1/24"), kExitOk) << err_.str();
  EXPECT_EQ(uverbs_of("mr0"), "uverbs0");
}

TEST_F(CliTest, NumberingSkipsForeignNodesAndReusesFreedOnes) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  make_node("uverbs0", 231, 192);  // what a real RDMA NIC's node looks like
  fs::create_directories(ctx_.dev_dir);
  std::ofstream(ctx_.dev_dir + "/uverbs1") << "not a device\n";
  make_node("uverbs3", 1, 7);  // left over from another run dir: ours, reusable
  ASSERT_EQ(add("a", "10.0.0.1/24"), kExitOk) << err_.str();
  ASSERT_EQ(add("b", "10.0.0.2/24"), kExitOk) << err_.str();
  ASSERT_EQ(add("c", "10.0.0.3/24"), kExitOk) << err_.str();
  EXPECT_EQ(uverbs_of("a"), "uverbs2");
  EXPECT_EQ(uverbs_of("b"), "uverbs3");
  EXPECT_EQ(uverbs_of("c"), "uverbs4");
  ASSERT_EQ(run({"link", "del", "b"}), kExitOk) << err_.str();
  ASSERT_EQ(add("d", "10.0.0.4/24"), kExitOk) << err_.str();
  EXPECT_EQ(uverbs_of("d"), "uverbs3");
  auto dev = snapshot(ctx_.dev_dir);
  EXPECT_EQ(dev["uverbs0"], "<chr 231:192 384>") << "a real node is never touched";
  EXPECT_EQ(dev["uverbs1"], "not a device\n");
  EXPECT_EQ(dev["uverbs2"], "<chr 1:7 438>");
  EXPECT_EQ(dev["uverbs4"], "<chr 1:7 438>");
}

struct BadCase {
  std::vector<std::string> args;
  int status;
  const char* says;  // a fragment the error line must contain
};

TEST_F(CliTest, RejectsEveryBadInputWithoutChangingAnything) {
  if (can_mknod()) {
    ASSERT_EQ(add("mr0", "10.0.0.1/24"), kExitOk) << err_.str();
  }
  const std::string ok_dev = "net_memif9";
  auto a = [&](std::string name, std::string ip, std::string dev = "net_memif9",
               std::vector<std::string> extra = {}) {
    std::vector<std::string> v = {"link", "add", name, "--dpdk", dev, "--ip", ip};
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
  };
  std::vector<BadCase> cases = {
      {a("", "10.0.0.9/24"), kExitError, "bad link name"},
      {a(std::string(64, 'x'), "10.0.0.9/24"), kExitError, "bad link name"},
      {a("a/b", "10.0.0.9/24"), kExitError, "bad link name"},
      {a("a.b", "10.0.0.9/24"), kExitError, "bad link name"},
      {a("a b", "10.0.0.9/24"), kExitError, "bad link name"},
      {a("mr9", "10.0.0.9"), kExitError, "ADDR/PREFIX"},
      {a("mr9", "10.0.0.256/24"), kExitError, "not an IPv4 address"},
      {a("mr9", "10.0.0.9/0"), kExitError, "prefix"},
      {a("mr9", "10.0.0.9/33"), kExitError, "prefix"},
      {a("mr9", "10.0.0.9/x"), kExitError, "prefix"},
      {a("mr9", "0.0.0.0/8"), kExitError, "unicast"},
      {a("mr9", "127.0.0.1/8"), kExitError, "unicast"},
      {a("mr9", "224.0.0.1/24"), kExitError, "unicast"},
      {a("mr9", "10.0.0.0/24"), kExitError, "network or broadcast"},
      {a("mr9", "10.0.0.255/24"), kExitError, "network or broadcast"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--mtu", "575"}), kExitError, "--mtu"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--mtu", "9601"}), kExitError, "--mtu"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--mtu", "9k"}), kExitError, "--mtu"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--mtu", "-1"}), kExitError, "--mtu"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--paths", "0"}), kExitError, "--paths"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--paths", "257"}), kExitError, "--paths"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--udp-port", "0"}), kExitError, "--udp-port"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--udp-port", "65536"}), kExitError, "--udp-port"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--rx-capacity", "0"}), kExitError, "--rx-capacity"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--rx-capacity", "10Gb"}), kExitError, "--rx-capacity"},
      {a("mr9", "10.0.0.9/24", ""), kExitError, "--dpdk"},
      {a("mr9", "10.0.0.9/24", ",role=server"), kExitError, "--dpdk"},
      {a("mr9", "10.0.0.9/24", "net_memif9,role"), kExitError, "key=value"},
      {a("mr9", "10.0.0.9/24", "net_memif9,=x"), kExitError, "key=value"},
      {a("mr9", "10.0.0.9/24", "net_memif9,role="), kExitError, "key=value"},
      {a("mr9", "10.0.0.9/24", "net_memif9,a=[1,2"), kExitError, "unbalanced"},
      {a("mr9", "10.0.0.9/24", "net_memif9,a=b c"), kExitError, "spaces"},
      {a("mr9", "10.0.0.9/24", "net_memif9,a=b\nip=1.2.3.4"), kExitError, "control"},
      {a("mr9", "10.0.0.9/24", "net memif9"), kExitError, "--dpdk"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--bogus", "1"}), kExitUsage, "unknown option"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--mtu"}), kExitUsage, "needs a value"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"--ip", "10.0.0.8/24"}), kExitUsage, "twice"},
      {a("mr9", "10.0.0.9/24", ok_dev, {"extra"}), kExitUsage, "unexpected argument"},
      {{"link", "add", "mr9", "--ip", "10.0.0.9/24"}, kExitUsage, "missing --dpdk"},
      {{"link", "add", "mr9", "--dpdk", "net_memif9"}, kExitUsage, "missing --ip"},
      {{"link", "add"}, kExitUsage, "missing NAME"},
      {{"link", "frob"}, kExitUsage, "unknown subcommand"},
      {{"link"}, kExitUsage, "missing subcommand"},
      {{"frob"}, kExitUsage, "unknown command"},
      {{}, kExitUsage, "missing command"},
      {{"link", "del"}, kExitUsage, "missing NAME"},
      {{"link", "del", "mr9"}, kExitError, "no link named mr9"},
      {{"link", "del", "../x"}, kExitError, "bad link name"},
      {{"link", "show", "--xml"}, kExitUsage, "unknown option"},
      {{"env", "x"}, kExitUsage, "unexpected argument"},
  };
#ifdef METAROCE_HAVE_DPDK
  cases.push_back({a("mr9", "10.0.0.9/24", "net_nosuchdriver0"), kExitError, "no DPDK bus"});
#endif
  if (can_mknod()) {
    cases.push_back({a("mr0", "10.0.0.9/24"), kExitError, "already exists"});
    cases.push_back({a("mr9", "10.0.0.1/16"), kExitError, "already used by link mr0"});
  }
  const auto before = state();
  for (const auto& c : cases) {
    std::string shown;
    for (const auto& s : c.args) shown += "[" + s + "] ";
    SCOPED_TRACE(shown);
    EXPECT_EQ(run(c.args), c.status);
    expect_one_error_line();
    EXPECT_NE(err_.str().find(c.says), std::string::npos) << err_.str();
    EXPECT_EQ(state(), before);
  }
}

TEST_F(CliTest, WithoutRootRefusesToCreateANodeAndChangesNothing) {
  ctx_.is_root = false;
  const auto before = state();
  EXPECT_EQ(add("mr0", "10.0.0.1/24"), kExitError);
  expect_one_error_line();
  EXPECT_NE(err_.str().find("permission denied"), std::string::npos) << err_.str();
  EXPECT_NE(err_.str().find("(run as root)"), std::string::npos) << err_.str();
  EXPECT_EQ(state(), before);
  if (!can_mknod()) return;
  // Where the node already is /dev/full's twin, nothing needs root (the run dir is writable).
  make_node("uverbs0", 1, 7);
  EXPECT_EQ(add("mr0", "10.0.0.1/24"), kExitOk) << err_.str();
}

TEST_F(CliTest, FailureMidwayLeavesNoPartialLink) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(add("mr0", "10.0.0.1/24"), kExitOk) << err_.str();
  // The next node cannot be made: its directory path is now a file.
  fs::rename(ctx_.dev_dir, root_ + "/saved-dev");
  fs::create_directories(fs::path(ctx_.dev_dir).parent_path());
  std::ofstream(ctx_.dev_dir) << "in the way\n";
  const auto before = snapshot(ctx_.sysfs());
  EXPECT_EQ(add("mr1", "10.0.0.2/24"), kExitError);
  expect_one_error_line();
  EXPECT_EQ(snapshot(ctx_.sysfs()), before);
  for (const auto& e : fs::directory_iterator(ctx_.rundir))
    EXPECT_TRUE(e.path().filename() == "sys" || e.path().filename() == ".lock") << e.path();
  ASSERT_EQ(run({"link", "show", "--json"}), kExitOk);
  EXPECT_EQ(json::parse(out_.str()).size(), 1u);
}

TEST_F(CliTest, EnvPointsAtRunDirAndAtTheProviderOnlyFromTheBuildTree) {
  fs::create_directories(ctx_.build_root + "/util");
  fs::create_directories(ctx_.exe_dir);
  ASSERT_EQ(run({"env"}), kExitOk);
  EXPECT_EQ(out_.str(), "export SYSFS_PATH=" + ctx_.rundir + "/sys\n");
  ctx_.exe_dir = ctx_.build_root + "/util";
  ASSERT_EQ(run({"env"}), kExitOk);
  EXPECT_EQ(out_.str(), "export SYSFS_PATH=" + ctx_.rundir + "/sys\nexport RDMAV_DRIVERS=" +
                            ctx_.build_root + "/providers/metaroce/libmetaroce\n");
  ctx_.rundir = root_ + "/odd dir";
  ASSERT_EQ(run({"env"}), kExitOk);
  EXPECT_EQ(out_.str().rfind("export SYSFS_PATH='" + root_ + "/odd dir/sys'\n", 0), 0u) << out_.str();
}

// A bundle (scripts/bundle) is found from its bin/ by the mark in its top folder; from there
// programs get its provider and, first in their search path, its libibverbs.
TEST_F(CliTest, EnvFromABundleNamesItsProviderLibrariesAndPreload) {
  const std::string top = root_ + "/unpacked/metaroce";
  fs::create_directories(top + "/bin");
  EXPECT_EQ(bundle_root_of(top + "/bin"), "") << "no mark: not a bundle";
  EXPECT_EQ(bundle_root_of(""), "");
  fs::create_directories(top + "/share/metaroce");
  std::ofstream(top + "/share/metaroce/bundle") << "metaroce 0.1.0\n";
  EXPECT_EQ(bundle_root_of(top + "/bin"), top);
  fs::create_directories(top + "/lib/metaroce");
  std::ofstream(top + "/lib/metaroce/libmetaroce-preload.so") << "x";
  ctx_.bundle_root = top;
  ctx_.exe_dir = ctx_.build_root + "/util";  // the bundle wins over the build tree's rule
  ::unsetenv("LD_LIBRARY_PATH");
  ::unsetenv("LD_PRELOAD");
  ASSERT_EQ(run({"env"}), kExitOk);
  EXPECT_EQ(out_.str(), "export SYSFS_PATH=" + ctx_.rundir + "/sys\nexport RDMAV_DRIVERS=" + top +
                            "/lib/libibverbs/libmetaroce\nexport LD_LIBRARY_PATH=" + top +
                            "/lib\nexport LD_PRELOAD=" + top +
                            "/lib/metaroce/libmetaroce-preload.so\n");
  auto library_path = [&] {
    for (const auto& [k, v] : verbs_environment(ctx_))
      if (k == "LD_LIBRARY_PATH") return v;
    return std::string();
  };
  ::setenv("LD_LIBRARY_PATH", "/opt/cuda/lib64", 1);
  EXPECT_EQ(library_path(), top + "/lib:/opt/cuda/lib64");
  ::setenv("LD_LIBRARY_PATH", (top + "/lib:/opt/cuda/lib64").c_str(), 1);
  EXPECT_EQ(library_path(), top + "/lib:/opt/cuda/lib64") << "kept once";
  ::unsetenv("LD_LIBRARY_PATH");
}

TEST_F(CliTest, HelpAndVersionSucceed) {
  for (auto args : std::vector<std::vector<std::string>>{
           {"--help"}, {"-h"}, {"link", "--help"}, {"link", "add", "--help"}, {"env", "--help"}}) {
    EXPECT_EQ(run(args), kExitOk);
    EXPECT_NE(out_.str().find("Usage"), std::string::npos) << out_.str();
    EXPECT_EQ(err_.str(), "");
  }
  EXPECT_EQ(run({"--version"}), kExitOk);
  EXPECT_EQ(out_.str().rfind("metaroce ", 0), 0u);
}

TEST(CliHelpers, GuidIsNonZeroUniqueAndShownInFourGroups) {
  EXPECT_EQ(format_guid(node_guid_for_ip(0x0a000001)), "0200:0aff:fe00:0001");
  EXPECT_EQ(format_guid(node_guid_for_ip(0xc0a80709)), "0200:c0ff:fea8:0709");
  EXPECT_NE(node_guid_for_ip(0x0a000001), node_guid_for_ip(0x0b000001));
  EXPECT_NE(node_guid_for_ip(0x0a000001), node_guid_for_ip(0x0a000002));
  EXPECT_NE(node_guid_for_ip(0), 0u);
}

TEST(CliHelpers, GidIsEightHexGroups) {
  uint8_t gid[16];
  nic::ipv4_to_gid(0xc0a80709, gid);
  EXPECT_EQ(format_gid(gid), "0000:0000:0000:0000:0000:ffff:c0a8:0709");
}

TEST(CliHelpers, AddressAcceptsUnicastHostsOnly) {
  std::string err;
  auto a = parse_address("10.1.2.3/8", &err);
  ASSERT_TRUE(a) << err;
  EXPECT_EQ(a->first, 0x0a010203u);
  EXPECT_EQ(a->second, 8);
  EXPECT_TRUE(parse_address("10.0.0.0/31", &err)) << "a /31 has no network address";
  EXPECT_TRUE(parse_address("10.0.0.255/32", &err));
  EXPECT_FALSE(parse_address("10.0.0.1/24/1", &err));
  EXPECT_FALSE(parse_address("255.255.255.255/32", &err));
}

TEST(CliHelpers, DevargsSyntax) {
  std::string err;
  EXPECT_TRUE(check_devargs("net_memif0", &err)) << err;
  EXPECT_TRUE(check_devargs("net_memif0,role=server,socket=/run/m.sock,mac=02:00:00:00:00:01", &err))
      << err;
  EXPECT_TRUE(check_devargs("0000:00:01.0", &err)) << err;
  EXPECT_TRUE(check_devargs("vdev:net_memif0,role=client", &err)) << err;
  EXPECT_FALSE(check_devargs("net_memif0,,role=server", &err));
  EXPECT_FALSE(check_devargs("net_memif0,role=server,", &err));
  EXPECT_FALSE(check_devargs("net_memif0,a]=b", &err));
}

// --- the fabric commands -----------------------------------------------------------------------

// A fabric's published state, as `metaroce fabric run` leaves it (no process behind it).
void plant_fabric(const std::string& rundir, const std::string& name, uint32_t endpoints,
                  uint32_t planes) {
  const std::string dir = fabric::state_dir(rundir, name);
  fs::create_directories(dir);
  std::string err;
  ASSERT_TRUE(fabric::write_info(dir, {endpoints, planes, 4, 0}, &err)) << err;
}

TEST_F(CliTest, LinkAddFabricRecordsOneDeviceStringPerPlane) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  plant_fabric(ctx_.rundir, "fab", 3, 2);
  ASSERT_EQ(run({"link", "add", "mr0", "--fabric", "fab:2", "--ip", "10.0.0.1/24"}), kExitOk)
      << err_.str();
  ASSERT_EQ(run({"link", "add", "mr1", "--fabric=fab:0", "--ip", "10.0.0.2/24"}), kExitOk)
      << err_.str();
  std::string err;
  auto c = nic::LinkConfig::load(ctx_.sysfs() + "/class/infiniband/mr0/metaroce.conf", &err);
  ASSERT_TRUE(c) << err;
  EXPECT_EQ(c->planes, 2);
  EXPECT_EQ(c->devargs,
            "net_memif_mr0_p0,role=client,id=0,socket=metaroce-fabric-fab-e2-p0;"
            "net_memif_mr0_p1,role=client,id=0,socket=metaroce-fabric-fab-e2-p1");
  auto d = nic::LinkConfig::load(ctx_.sysfs() + "/class/infiniband/mr1/metaroce.conf", &err);
  ASSERT_TRUE(d) << err;
  EXPECT_EQ(d->devargs.find("net_memif_mr1_p0,"), 0u);
  EXPECT_NE(d->devargs.find("socket=metaroce-fabric-fab-e0-p1"), std::string::npos);
  ASSERT_EQ(run({"link", "show", "mr0", "--json"}), kExitOk);
  EXPECT_NE(out_.str().find("\"planes\": 2"), std::string::npos) << out_.str();
}

TEST(CliHelpers, FabricDevargsNamesNeverCollideAndFitDpdk) {
  const std::string a = fabric_devargs(std::string(63, 'a'), "f", 0, 16);
  const std::string b = fabric_devargs(std::string(62, 'a') + "b", "f", 0, 16);
  std::set<std::string> names;
  for (const auto& s : {a, b}) {
    std::stringstream in(s);
    std::string part;
    int n = 0;
    while (std::getline(in, part, ';')) {
      ++n;
      const std::string dev = part.substr(0, part.find(','));
      EXPECT_LE(dev.size(), 63u) << dev;
      EXPECT_TRUE(names.insert(dev).second) << "duplicate " << dev;
      std::string err;
      EXPECT_TRUE(check_devargs(part, &err)) << err;
    }
    EXPECT_EQ(n, 16);
  }
  EXPECT_EQ(fabric_devargs("mr0", "f", 1, 1), "net_memif_mr0_p0,role=client,id=0,socket=metaroce-fabric-f-e1-p0");
}

TEST_F(CliTest, FabricCommandsRejectBadArgumentsWithOneLine) {
  plant_fabric(ctx_.rundir, "two", 2, 1);
  auto add = [](std::vector<std::string> extra) {
    std::vector<std::string> v = {"link", "add", "mr9", "--ip", "10.0.0.9/24"};
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
  };
  std::vector<BadCase> cases = {
      {{"fabric"}, kExitUsage, "missing subcommand"},
      {{"fabric", "frob"}, kExitUsage, "unknown subcommand"},
      {{"fabric", "run"}, kExitUsage, "missing NAME"},
      {{"fabric", "run", "f", "--planes", "2"}, kExitUsage, "missing --endpoints"},
      {{"fabric", "run", "f", "--endpoints", "2"}, kExitUsage, "missing --planes"},
      {{"fabric", "run", "f", "g", "--endpoints", "2", "--planes", "1"}, kExitUsage, "unexpected"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--bogus", "1"}, kExitUsage,
       "unknown option"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes"}, kExitUsage, "needs a value"},
      {{"fabric", "run", "f", "--endpoints", "2", "--endpoints", "3", "--planes", "1"}, kExitUsage,
       "twice"},
      {{"fabric", "run", "a/b", "--endpoints", "2", "--planes", "1"}, kExitError, "bad fabric name"},
      {{"fabric", "run", "f", "--endpoints", "0", "--planes", "1"}, kExitError, "--endpoints"},
      {{"fabric", "run", "f", "--endpoints", "65", "--planes", "1"}, kExitError, "--endpoints"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "17"}, kExitError, "--planes"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--links-per-plane", "0"},
       kExitError, "--links-per-plane"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--rate", "fast"}, kExitError,
       "--rate"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--edge-rate", "-1G"},
       kExitError, "--edge-rate"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--loss", "1.5"}, kExitError,
       "--loss"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--reorder", "x"}, kExitError,
       "--reorder"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--duplicate", "1.01"},
       kExitError, "--duplicate"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--delay", "-3"}, kExitError,
       "--delay"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--queue", "0"}, kExitError,
       "--queue"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--seconds", "0"}, kExitError,
       "--seconds"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--spin", "nap"}, kExitError,
       "expected adaptive or always"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--spin-us", "-1"}, kExitError,
       "--spin-us"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--spin-us", "1000001"},
       kExitError, "--spin-us"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--max-nap-us", "0"},
       kExitError, "--max-nap-us"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--spin", "always",
        "--spin-us", "50"}, kExitError, "adaptive only"},
      {{"fabric", "run", "f", "--endpoints", "2", "--planes", "1", "--spin"}, kExitUsage,
       "needs a value"},
      {{"fabric", "set"}, kExitUsage, "missing NAME"},
      {{"fabric", "set", "two"}, kExitUsage, "missing SETTING"},
      {{"fabric", "set", "two", "loss=2"}, kExitError, "bad setting"},
      {{"fabric", "set", "two", "sideways"}, kExitError, "bad setting"},
      {{"fabric", "set", "two", "--plane", "x", "up"}, kExitError, "--plane"},
      {{"fabric", "set", "two", "--link", "spine3", "up"}, kExitError, "--link"},
      {{"fabric", "set", "two", "loss=0.1"}, kExitError, "does not answer"},
      {{"fabric", "stat"}, kExitUsage, "missing NAME"},
      {{"fabric", "stat", "two", "--json=yes"}, kExitUsage, "takes no value"},
      {{"fabric", "stat", "nosuch"}, kExitError, "does not answer"},
      {{"fabric", "stop"}, kExitUsage, "missing NAME"},
      {{"fabric", "stop", "nosuch"}, kExitError, "no fabric named nosuch"},
      {{"fabric", "stop", "two"}, kExitError, "no live process"},
      {add({"--fabric", "two:1", "--dpdk", "net_memif0"}), kExitUsage, "not both"},
      {add({"--fabric", "two"}), kExitError, "FABRIC:ENDPOINT"},
      {add({"--fabric", "two:x"}), kExitError, "FABRIC:ENDPOINT"},
      {add({"--fabric", "two:2"}), kExitError, "endpoints 0..1"},
      {add({"--fabric", "nosuch:0"}), kExitError, "no fabric named nosuch"},
      {add({"--fabric", "a b:0"}), kExitError, "bad fabric name"},
      {add({"--dpdk", "net_memif0,a=b;net_memif1"}), kExitError, "';'"},
  };
  const auto before = state();
  for (const auto& c : cases) {
    std::string shown;
    for (const auto& s : c.args) shown += "[" + s + "] ";
    SCOPED_TRACE(shown);
    EXPECT_EQ(run(c.args), c.status);
    expect_one_error_line();
    EXPECT_NE(err_.str().find(c.says), std::string::npos) << err_.str();
    EXPECT_EQ(state(), before);
  }
  EXPECT_EQ(run({"fabric", "--help"}), kExitOk);
  EXPECT_NE(out_.str().find("Usage: metaroce fabric run"), std::string::npos);
}


// --- link apply / flush / exec ------------------------------------------------------------

class CliApplyTest : public CliTest {
 protected:
  std::string write_conf(const std::string& text) {
    std::string path = root_ + "/links.conf";
    std::ofstream(path) << text;
    return path;
  }
  std::set<std::string> link_names() {
    std::set<std::string> names;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(ctx_.sysfs() + "/class/infiniband", ec))
      names.insert(e.path().filename().string());
    return names;
  }
};

TEST_F(CliApplyTest, ApplyAddsEveryLinkAndCanRunAgain) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  const std::string conf = write_conf(
      "# links of this host\n"
      "\n"
      "mr0 --dpdk net_memif0,role=server --ip 198.18.0.1/24   # the server side\n"
      "   mr1 --ip=198.18.0.2/24 --dpdk net_memif1,role=client --mtu 4200\n");
  ASSERT_EQ(run({"link", "apply", conf}), kExitOk) << err_.str();
  EXPECT_EQ(link_names(), (std::set<std::string>{"mr0", "mr1"}));
  std::string err;
  auto mr1 = nic::LinkConfig::load(ctx_.sysfs() + "/class/infiniband/mr1/metaroce.conf", &err);
  ASSERT_TRUE(mr1) << err;
  EXPECT_EQ(mr1->mtu, 4200u);
  EXPECT_EQ(mr1->devargs, "net_memif1,role=client");
  // Unchanged links are kept as they are (a service reload), a new line is added.
  const auto before = state();
  ASSERT_EQ(run({"link", "apply", conf}), kExitOk) << err_.str();
  EXPECT_EQ(state(), before);
  std::ofstream(conf, std::ios::app) << "mr2 --dpdk net_memif2 --ip 198.18.0.3/24\n";
  ASSERT_EQ(run({"link", "apply", conf}), kExitOk) << err_.str();
  EXPECT_EQ(link_names(), (std::set<std::string>{"mr0", "mr1", "mr2"}));
}

TEST_F(CliApplyTest, ApplyRejectsABadFileWithoutAddingAnything) {
  struct Bad {
    std::string text;
    int status;
    const char* says;
  };
  const std::string good = "mr0 --dpdk net_memif0 --ip 198.18.0.1/24\n";
  const std::vector<Bad> cases = {
      {good + "mr1 --dpdk net_memif1 --ip 198.18.0.300/24\n", kExitError, ":2: bad --ip"},
      {good + "mr1 --dpdk net_memif1\n", kExitUsage, ":2: link add: missing --ip"},
      {good + "mr1 --dpdk net_memif1 --ip 198.18.0.2/24 --frob 1\n", kExitUsage, ":2: link add: unknown option"},
      {good + "\n# comment\nmr0 --dpdk net_memif1 --ip 198.18.0.2/24\n", kExitError,
       ":4: link mr0 is also defined on line 1"},
      {good + "mr1 --dpdk net_memif1 --ip 198.18.0.1/24\n", kExitError,
       ":2: address 198.18.0.1 is also used on line 1"},
      {good + "mr1 --dpdk 'net_memif1' --ip 198.18.0.2/24\n", kExitError, ":2: bad --dpdk"},
      {good + "mr1 --help\n", kExitError, ":2: --help is not a link setting"},
  };
  for (const auto& c : cases) {
    const std::string conf = write_conf(c.text);
    const auto before = state();
    EXPECT_EQ(run({"link", "apply", conf}), c.status) << c.text;
    expect_one_error_line();
    EXPECT_NE(err_.str().find(conf + c.says), std::string::npos) << err_.str();
    EXPECT_EQ(state(), before) << c.text;
    EXPECT_EQ(run({"link", "apply", "--check", conf}), c.status) << c.text;
  }
  EXPECT_EQ(run({"link", "apply", root_ + "/missing.conf"}), kExitError);
  expect_one_error_line();
  EXPECT_EQ(run({"link", "apply", "a", "b"}), kExitUsage);
  EXPECT_EQ(run({"link", "apply", "--frob"}), kExitUsage);
}

TEST_F(CliApplyTest, ApplyRefusesToChangeAnExistingLink) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(add("mr0", "198.18.0.1/24"), kExitOk) << err_.str();  // net_memif0,role=server
  const auto before = state();
  std::string conf = write_conf(
      "mrX --dpdk net_memif5 --ip 198.18.0.9/24\n"
      "mr0 --dpdk net_memif0,role=server --ip 198.18.0.1/24 --paths 4\n");
  EXPECT_EQ(run({"link", "apply", conf}), kExitError);
  EXPECT_NE(err_.str().find(":2: link mr0 already exists with other settings"), std::string::npos)
      << err_.str();
  EXPECT_EQ(state(), before);
  conf = write_conf("mr1 --dpdk net_memif1 --ip 198.18.0.1/24\n");
  EXPECT_EQ(run({"link", "apply", conf}), kExitError);
  EXPECT_NE(err_.str().find(":1: address 198.18.0.1 is already used by link mr0"), std::string::npos)
      << err_.str();
  EXPECT_EQ(state(), before);
  // --check touches nothing even for a good file.
  conf = write_conf("mr1 --dpdk net_memif1 --ip 198.18.0.2/24\n");
  EXPECT_EQ(run({"link", "apply", "--check", conf}), kExitOk) << err_.str();
  EXPECT_EQ(state(), before);
}

TEST_F(CliApplyTest, ApplyTakesBackItsLinksWhenALaterOneCannotBeCreated) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  // Without privilege only a link whose node already exists can be made: the first one here.
  make_node("uverbs0", 1, 7);
  ctx_.is_root = false;
  const auto before = state();
  const std::string conf = write_conf(
      "mr0 --dpdk net_memif0 --ip 198.18.0.1/24\n"
      "mr1 --dpdk net_memif1 --ip 198.18.0.2/24\n");
  EXPECT_EQ(run({"link", "apply", conf}), kExitError);
  expect_one_error_line();
  EXPECT_NE(err_.str().find(conf + ":2: permission denied"), std::string::npos) << err_.str();
  EXPECT_NE(err_.str().find("deleted again"), std::string::npos) << err_.str();
  EXPECT_TRUE(link_names().empty());
  auto after = state();
  // The shared skeleton (class dirs, abi_version) may stay, as after `link del`; no link does.
  for (const auto& [path, what] : after)
    EXPECT_TRUE(before.count(path) || path.rfind("class", 0) == 0) << path;
  EXPECT_EQ(after.count("class/infiniband/mr0"), 0u);
  EXPECT_EQ(after.count("class/infiniband_verbs/uverbs0"), 0u);
}

TEST_F(CliApplyTest, ApplyWithoutTheDefaultFileHasNothingToDo) {
  // /etc/metaroce/links.conf is absent on a build machine; a present one may not be ours to read.
  if (fs::exists("/etc/metaroce/links.conf")) GTEST_SKIP() << "a links.conf is installed here";
  EXPECT_EQ(run({"link", "apply"}), kExitOk) << err_.str();
  EXPECT_TRUE(state().empty());
}

TEST_F(CliApplyTest, FlushDeletesEveryLinkEvenADamagedOne) {
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(add("mr0", "198.18.0.1/24"), kExitOk) << err_.str();
  ASSERT_EQ(add("mr1", "198.18.0.2/24"), kExitOk) << err_.str();
  std::ofstream(ctx_.sysfs() + "/class/infiniband/mr1/metaroce.conf") << "garbage\n";
  ASSERT_EQ(run({"link", "flush"}), kExitOk) << err_.str();
  EXPECT_TRUE(link_names().empty());
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ctx_.sysfs() + "/class/infiniband_verbs", ec))
    EXPECT_EQ(e.path().filename(), "abi_version");
  EXPECT_EQ(run({"link", "flush"}), kExitOk) << "nothing left to flush is fine";
  EXPECT_EQ(run({"link", "flush", "mr0"}), kExitUsage);
  expect_one_error_line();
}

// Runs `metaroce exec ARGS` in a child (a successful exec replaces the process) and returns its
// exit status, or -1 when it did not exit normally.
int exec_in_child(const Context& ctx, const std::vector<std::string>& args) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::ostringstream sink;
    Context c = ctx;
    c.out = &sink;
    c.err = &sink;
    ::_exit(run(args, c));
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

std::string read_all(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST_F(CliApplyTest, ExecRunsTheProgramWithTheDiscoverySettings) {
  fs::create_directories(ctx_.build_root + "/util");
  fs::create_directories(ctx_.exe_dir);
  const std::string out = root_ + "/seen";
  const std::string script =
      "printf '%s|%s|%s' \"$SYSFS_PATH\" \"${RDMAV_DRIVERS-unset}\" \"$1\" > " + out + "; exit 7";
  // Installed binary: SYSFS_PATH replaces an inherited one, RDMAV_DRIVERS is left alone.
  ::setenv("SYSFS_PATH", "/somewhere/else", 1);
  ::unsetenv("RDMAV_DRIVERS");
  EXPECT_EQ(exec_in_child(ctx_, {"exec", "--", "sh", "-c", script, "sh", "arg one"}), 7);
  EXPECT_EQ(read_all(out), ctx_.rundir + "/sys|unset|arg one");
  // From the build tree the provider next to the binary is named too; "--" is optional.
  ctx_.exe_dir = ctx_.build_root + "/util";
  EXPECT_EQ(exec_in_child(ctx_, {"exec", "sh", "-c", script, "sh", "x"}), 7);
  EXPECT_EQ(read_all(out),
            ctx_.rundir + "/sys|" + ctx_.build_root + "/providers/metaroce/libmetaroce|x");
  ::unsetenv("SYSFS_PATH");
  EXPECT_EQ(verbs_environment(ctx_).size(), 2u);
}

// With metaroce_ib loaded, kernel devices need no redirect, but a kernel-free link (memif) is
// only in the generated tree: its programs still get it.
TEST_F(CliApplyTest, WithTheKernelModuleOnlyKernelFreeLinksAreRedirected) {
  ctx_.kernel_module = true;
  fs::create_directories(ctx_.build_root + "/providers/metaroce/preload");
  std::ofstream(ctx_.build_root + "/providers/metaroce/preload/libmetaroce-preload.so") << "x";
  ctx_.exe_dir = ctx_.build_root + "/util";
  auto names = [&] {
    std::set<std::string> n;
    for (const auto& [k, v] : verbs_environment(ctx_)) n.insert(k);
    return n;
  };
  EXPECT_EQ(names(), (std::set<std::string>{"RDMAV_DRIVERS"})) << "no link: nothing to redirect";
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(add("mr0", "198.18.0.1/24"), kExitOk) << err_.str();
  EXPECT_EQ(names(), (std::set<std::string>{"SYSFS_PATH", "RDMAV_DRIVERS", "LD_PRELOAD"}));
}

// A sanitizer's runtime the caller preloads stays first (ASan refuses to start otherwise): the
// sanitized integration suite runs the system's programs so (docs/security.md).
TEST_F(CliApplyTest, ASanitizerRuntimeStaysFirstInLdPreload) {
  ctx_.kernel_module = true;
  const std::string ours = ctx_.build_root + "/providers/metaroce/preload/libmetaroce-preload.so";
  fs::create_directories(ctx_.build_root + "/providers/metaroce/preload");
  std::ofstream(ours) << "x";
  ctx_.exe_dir = ctx_.build_root + "/util";
  if (!can_mknod()) GTEST_SKIP() << "mknod needs root";
  ASSERT_EQ(add("mr0", "198.18.0.1/24"), kExitOk) << err_.str();
  ::setenv("LD_PRELOAD", "/usr/lib/x/libfoo.so:/usr/lib/gcc/12/libasan.so", 1);
  std::string value;
  for (const auto& [k, v] : verbs_environment(ctx_))
    if (k == "LD_PRELOAD") value = v;
  ::unsetenv("LD_PRELOAD");
  EXPECT_EQ(value, "/usr/lib/gcc/12/libasan.so " + ours + " /usr/lib/x/libfoo.so");
}

TEST_F(CliApplyTest, ExecReportsAMissingProgramLikeAShell) {
  EXPECT_EQ(run({"exec", "--", "metaroce-no-such-program"}), kExitNotFound);
  expect_one_error_line();
  EXPECT_NE(err_.str().find("metaroce-no-such-program: command not found"), std::string::npos)
      << err_.str();
  EXPECT_EQ(run({"exec", "--", root_ + "/nothing/here"}), kExitNotFound);
  expect_one_error_line();
  EXPECT_EQ(run({"exec", "--", root_}), kExitCannotRun);  // a directory
  expect_one_error_line();
  EXPECT_EQ(run({"exec"}), kExitUsage);
  expect_one_error_line();
  EXPECT_EQ(run({"exec", "--"}), kExitUsage);
  expect_one_error_line();
}

}  // namespace
}  // namespace metaroce::util
