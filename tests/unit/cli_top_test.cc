// SPDX-License-Identifier: Apache-2.0
// `metaroce top` and `metaroce record`: the rows, the frame, the record's round
// trip and the errors a user sees (util/top.h, util/record.h).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "util/operator.h"
#include "util/record.h"
#include "util/top.h"

namespace metaroce::util {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kPeer = 0xc6120002;  // 198.18.0.2

// A link's snapshot at t seconds: one connection of four paths, path 2 failed
// when `failed`, every active path having sent `pkts` packets of 4 KiB, path 3
// at four times the others' RTT.
nic::TelemetrySnapshot snapshot(double t, uint64_t pkts, bool failed) {
  nic::TelemetrySnapshot s;
  s.pid = 42;
  s.planes = 2;
  s.updated_unix_ns = static_cast<int64_t>(t * 1e9) + 1'700'000'000'000'000'000;
  nic::TelemetryCounter c{};
  std::strcpy(c.name, "failover_resends");
  c.value = failed ? 7 : 0;
  s.counters.push_back(c);
  nic::TelemetryConn conn{};
  conn.peer_ip = kPeer;
  conn.num_paths = 4;
  conn.paths_active = failed ? 3 : 4;
  for (uint16_t i = 0; i < 4; ++i) {
    nic::TelemetryPath& p = conn.paths[i];
    p.path_id = i;
    p.udp_src_port = static_cast<uint16_t>(50000 + i);
    p.plane = i % 2;
    p.window = 32;
    p.srtt_ns = i == 3 ? 40'000 : 10'000;
    p.tx_packets = pkts;
    p.tx_bytes = pkts * 4096;
    p.retransmits = i == 1 ? pkts / 20 : 0;  // path 1 resends 5 %
    if (i == 2 && failed) {
      p.state = 1;
      p.failures = 1;
    }
  }
  s.conns.push_back(conn);
  return s;
}

TEST(TopRows, RatesComeFromTwoSnapshotsAndTheWorstPathsAreMarked) {
  const auto a = snapshot(0, 1000, false);
  const auto b = snapshot(0.5, 2000, true);
  auto rows = path_rows("mr0", &a, b);
  ASSERT_EQ(rows.size(), 4u);
  // 1,000 packets of 4 KiB in half a second.
  EXPECT_NEAR(rows[0].rate_mbps, 1000 * 4096 * 8 / 0.5 / 1e6, 1e-6);
  EXPECT_DOUBLE_EQ(rows[0].rtt_ratio, 1.0);
  EXPECT_DOUBLE_EQ(rows[3].rtt_ratio, 4.0);
  EXPECT_NEAR(rows[1].retx_pct, 5.0, 1e-9);
  EXPECT_FALSE(rows[0].worst);
  EXPECT_TRUE(rows[1].worst);  // resends 5 %
  EXPECT_TRUE(rows[2].worst);  // failed
  EXPECT_TRUE(rows[3].worst);  // 4x the best RTT
  // A path that failed since the earlier snapshot and is active again has flapped: marked.
  auto c = snapshot(0.6, 2100, false);
  c.conns[0].paths[0].failures = 1;
  const auto after = path_rows("mr0", &b, c);
  EXPECT_TRUE(after[0].flapped);
  EXPECT_TRUE(after[0].worst);
  EXPECT_FALSE(after[2].flapped);  // failed before, and its count did not rise since
  EXPECT_NE(render_top(after, {}, "now", TopSort::kState, 80, 24, false)[2].find(" flapped "),
            std::string::npos);
  // Without an earlier snapshot there is no rate yet.
  for (const auto& r : path_rows("mr0", nullptr, b)) EXPECT_EQ(r.rate_mbps, 0);
  sort_rows(rows, TopSort::kRtt);
  EXPECT_EQ(rows[0].path, 3);
  sort_rows(rows, TopSort::kState);
  EXPECT_EQ(rows[0].path, 2);
}

TEST(TopFrame, FitsEightyByTwentyFourWithTheLastEventsAtTheBottom) {
  const auto a = snapshot(0, 1000, false);
  auto b = snapshot(1, 2000, true);
  // Forty paths: more than the frame holds.
  b.conns[0].num_paths = 40;
  for (uint16_t i = 4; i < 40; ++i) {
    b.conns[0].paths[i] = b.conns[0].paths[0];
    b.conns[0].paths[i].path_id = i;
  }
  auto rows = path_rows("mr0", &a, b);
  sort_rows(rows, TopSort::kState);
  std::vector<std::string> events;
  for (int i = 0; i < 11; ++i) events.push_back("event " + std::to_string(i));
  // As metaroce events prints it; a terminal leaves out the date, "peer" and lane 0.
  events.push_back(
      "2026-12-07T12:43:17.093Z fB peer 198.18.0.1 lane 0x0 path 5 (plane 0): "
      "failed (1 time), its packets moved");
  const auto lines = render_top(rows, events, "now", TopSort::kState, 80, 24, false);
  ASSERT_EQ(lines.size(), 24u);
  for (const auto& l : lines) EXPECT_LE(l.size(), 80u) << l;
  EXPECT_EQ(lines[2].substr(0, 1), "*");  // the failed path first, marked
  EXPECT_NE(lines[2].find("failed"), std::string::npos);
  EXPECT_EQ(lines[17], "  ... 25 more paths");
  EXPECT_EQ(lines[18], "EVENTS");
  EXPECT_EQ(lines[23],
            "12:43:17.093Z fB 198.18.0.1 path 5 (plane 0): failed (1 time), its packets moved");
  EXPECT_EQ(lines[19], "event 7");
  // With colour the worst rows are red and nothing else changes their text.
  const auto colored = render_top(rows, events, "now", TopSort::kState, 80, 24, true);
  EXPECT_EQ(colored[2], "\x1b[1;31m" + lines[2] + "\x1b[0m");
  // Without a height limit every row and event is there.
  const auto plain = render_top(rows, events, "now", TopSort::kState, 80, 0, false);
  EXPECT_EQ(plain.back(), events.back());  // plain frames keep events whole
  EXPECT_EQ(plain.size(), 2 + 40 + 1 + 12u);
}

class RecordTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("metaroce-top-" + std::to_string(getpid()));
    fs::create_directories(dir_ / "sys/class/infiniband");
    ctx_.rundir = dir_.string();
    ctx_.out = &out_;
    ctx_.err = &err_;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
    return (dir_ / name).string();
  }

  fs::path dir_;
  Context ctx_;
  std::ostringstream out_, err_;
};

TEST_F(RecordTest, AReplayedRecordGivesTheSameEventsInTheSameOrder) {
  const std::vector<nic::TelemetrySnapshot> live = {
      snapshot(0, 1000, false), snapshot(0.1, 1100, false), snapshot(0.2, 1200, true)};
  std::string text = record_header("mr0", live[0].updated_unix_ns) + "\n";
  for (const auto& s : live) text += record_sample(s) + "\n";
  std::string err;
  auto rec = read_record(write("run.rec", text), &err);
  ASSERT_TRUE(rec) << err;
  EXPECT_EQ(rec->link, "mr0");
  ASSERT_EQ(rec->samples.size(), live.size());
  for (size_t i = 1; i < live.size(); ++i)
    EXPECT_EQ(path_events("mr0", rec->samples[i - 1], rec->samples[i]),
              path_events("mr0", live[i - 1], live[i]));
  const auto ev = path_events("mr0", rec->samples[1], rec->samples[2]);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_NE(ev[0].find("path 2 (plane 0): failed"), std::string::npos) << ev[0];
  // top --replay shows the failed path and the event, as plain frames (not a
  // terminal).
  EXPECT_EQ(
      run({"top", "--replay", (dir_ / "run.rec").string(), "--speed", "1000", "-d", "0.1"}, ctx_),
      kExitOk);
  EXPECT_NE(out_.str().find("failed (1 time), its packets moved"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("*mr0>198.18.0.2"), std::string::npos);
}

TEST_F(RecordTest, TruncatedForeignOrLaterRecordsAreRefusedByLine) {
  const std::string header = record_header("mr0", 1);
  const std::string sample = record_sample(snapshot(0, 1, false));
  std::string err;
  EXPECT_FALSE(
      read_record(write("cut.rec", header + "\n" + sample.substr(0, sample.size() / 2)), &err));
  EXPECT_NE(err.find("line 2"), std::string::npos) << err;
  EXPECT_FALSE(read_record(write("foreign.rec", "{\"hello\": 1}\n"), &err));
  EXPECT_NE(err.find("not a metaroce record"), std::string::npos) << err;
  EXPECT_FALSE(read_record(write("pcap.rec", std::string("\xd4\xc3\xb2\xa1\x02\x00", 6)), &err));
  EXPECT_NE(err.find("line 1"), std::string::npos) << err;
  EXPECT_FALSE(read_record(write("empty.rec", ""), &err));
  EXPECT_FALSE(read_record(write("later.rec",
                                 "{\"format\": \"metaroce-record\", \"version\": 99, \"link\": "
                                 "\"x\", \"started_unix_ns\": 0}\n"),
                           &err));
  EXPECT_NE(err.find("version 99"), std::string::npos) << err;
  // A record cut at a line's end is whole: what was written before the cut
  // replays.
  EXPECT_TRUE(read_record(write("whole.rec", header + "\n" + sample + "\n"), &err)) << err;
  // The command says so and exits non-zero.
  EXPECT_EQ(run({"top", "--replay", (dir_ / "foreign.rec").string()}, ctx_), kExitError);
  EXPECT_NE(err_.str().find("not a metaroce record"), std::string::npos) << err_.str();
}

TEST_F(RecordTest, UnknownLinksAndBadArgumentsChangeNothing) {
  EXPECT_EQ(run({"top", "nosuch"}, ctx_), kExitError);
  EXPECT_NE(err_.str().find("no link 'nosuch'"), std::string::npos) << err_.str();
  EXPECT_EQ(run({"top"}, ctx_), kExitError);  // no links at all
  EXPECT_EQ(run({"top", "--sort", "colour"}, ctx_), kExitUsage);
  EXPECT_EQ(run({"top", "-d", "0"}, ctx_), kExitUsage);
  EXPECT_EQ(run({"top", "--replay"}, ctx_), kExitUsage);
  const fs::path out = dir_ / "never.rec";
  EXPECT_EQ(run({"record", "nosuch", "-o", out.string()}, ctx_), kExitError);
  EXPECT_EQ(run({"record", "nosuch"}, ctx_), kExitUsage);
  EXPECT_EQ(run({"record", "nosuch", "-o", out.string(), "--max-size", "-1"}, ctx_), kExitUsage);
  EXPECT_FALSE(fs::exists(out));
  // A name no link can have is refused by every operator tool (it crashed them: check_name
  // wrote its reason through a null pointer).
  for (const char* cmd : {"top", "record", "events", "stat", "capture"}) {
    const int st = run({cmd, "bad/name", "-o", out.string(), "-w", out.string()}, ctx_);
    EXPECT_TRUE(st == kExitError || st == kExitUsage) << cmd << " exited " << st;
  }
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace metaroce::util
