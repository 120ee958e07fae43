// SPDX-License-Identifier: Apache-2.0
// An MPI program that checks every byte it moves, for Open MPI's pml ucx over MetaRoCE
// (tests/clients/mpi.sh):
//   mpi_check            ping-pongs of 1 B to 4 MiB between rank 0 and every other rank,
//                        MPI_Allreduce, MPI_Alltoall, and one-sided MPI_Put / MPI_Get in
//                        fenced epochs (osc ucx); exit 0 only if every check passed
//   mpi_check --bench    the half round trip of an 8 B ping-pong (rank 0 and 1) and each rank's
//                        bandwidth streaming 1 MiB messages to its partner, as JSON lines
//   mpi_check --run S    ring exchanges of 1 MiB for S seconds (the fault test kills a rank)
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rank, size, failures;

#define CHECK(cond, ...)                              \
  do {                                                \
    if (!(cond)) {                                    \
      fprintf(stderr, "FAIL rank %d: ", rank);        \
      fprintf(stderr, __VA_ARGS__);                   \
      fputc('\n', stderr);                            \
      if (++failures > 20) MPI_Abort(MPI_COMM_WORLD, 1); \
    }                                                 \
  } while (0)

// The byte i of a message identified by seed: no two neighbours alike, every value taken.
static uint8_t pattern(uint32_t seed, size_t i) {
  return (uint8_t)(seed * 131u + i * 7u + (i >> 8) * 13u);
}

static void fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = pattern(seed, i);
}

// The first byte that differs from the pattern, or n.
static size_t first_bad(const uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != pattern(seed, i)) return i;
  return n;
}

enum { kMax = 4 << 20 };

// Rank 0 sends seed s to `peer`, which answers with seed s + 1: both check every byte.
static void pingpongs(uint8_t* sb, uint8_t* rb) {
  for (size_t n = 1; n <= kMax; n *= 2) {
    for (int peer = 1; peer < size; ++peer) {
      const uint32_t seed = (uint32_t)(n * 31 + peer);
      if (rank == 0) {
        fill(sb, n, seed);
        memset(rb, 0, n);
        MPI_Send(sb, (int)n, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
        MPI_Recv(rb, (int)n, MPI_BYTE, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        size_t bad = first_bad(rb, n, seed + 1);
        CHECK(bad == n, "ping-pong of %zu B with rank %d: byte %zu differs", n, peer, bad);
      } else if (rank == peer) {
        memset(rb, 0, n);
        MPI_Recv(rb, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        size_t bad = first_bad(rb, n, seed);
        CHECK(bad == n, "ping of %zu B from rank 0: byte %zu differs", n, bad);
        fill(sb, n, seed + 1);
        MPI_Send(sb, (int)n, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
      }
    }
  }
}

static void allreduce(void) {
  const int counts[] = {1, 1000, 1 << 20};
  for (size_t c = 0; c < sizeof counts / sizeof counts[0]; ++c) {
    const int n = counts[c];
    int64_t* in = malloc(sizeof(int64_t) * (size_t)n);
    int64_t* out = malloc(sizeof(int64_t) * (size_t)n);
    for (int i = 0; i < n; ++i) in[i] = (int64_t)(rank + 1) * (i + 7);
    MPI_Allreduce(in, out, n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    const int64_t ranks = (int64_t)size * (size + 1) / 2;
    int bad = -1;
    for (int i = 0; i < n && bad < 0; ++i)
      if (out[i] != ranks * (i + 7)) bad = i;
    CHECK(bad < 0, "MPI_Allreduce of %d int64: element %d is wrong", n, bad);
    free(in);
    free(out);
  }
}

static void alltoall(void) {
  const size_t block = 64 << 10;
  uint8_t* sb = malloc(block * (size_t)size);
  uint8_t* rb = malloc(block * (size_t)size);
  for (int d = 0; d < size; ++d) fill(sb + block * (size_t)d, block, (uint32_t)(rank * 64 + d));
  memset(rb, 0, block * (size_t)size);
  MPI_Alltoall(sb, (int)block, MPI_BYTE, rb, (int)block, MPI_BYTE, MPI_COMM_WORLD);
  for (int s = 0; s < size; ++s) {
    size_t bad = first_bad(rb + block * (size_t)s, block, (uint32_t)(s * 64 + rank));
    CHECK(bad == block, "MPI_Alltoall: the block from rank %d differs at byte %zu", s, bad);
  }
  free(sb);
  free(rb);
}

// Each rank puts 1 MiB into its right neighbour's window, then gets 1 MiB from its left
// neighbour's, each in a fenced epoch.
static void one_sided(void) {
  const size_t n = 1 << 20;
  uint8_t* win_mem;
  MPI_Win win;
  MPI_Win_allocate((MPI_Aint)(2 * n), 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win_mem, &win);
  memset(win_mem, 0, 2 * n);
  fill(win_mem + n, n, (uint32_t)(900 + rank));  // what the left neighbour gets
  uint8_t* src = malloc(n);
  uint8_t* dst = malloc(n);
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  fill(src, n, (uint32_t)(500 + rank));
  MPI_Win_fence(0, win);
  MPI_Put(src, (int)n, MPI_BYTE, right, 0, (int)n, MPI_BYTE, win);
  MPI_Win_fence(0, win);
  size_t bad = first_bad(win_mem, n, (uint32_t)(500 + left));
  CHECK(bad == n, "MPI_Put from rank %d: byte %zu differs", left, bad);
  memset(dst, 0, n);
  MPI_Win_fence(0, win);
  MPI_Get(dst, (int)n, MPI_BYTE, left, (MPI_Aint)n, (int)n, MPI_BYTE, win);
  MPI_Win_fence(0, win);
  bad = first_bad(dst, n, (uint32_t)(900 + left));
  CHECK(bad == n, "MPI_Get from rank %d: byte %zu differs", left, bad);
  MPI_Win_free(&win);
  free(src);
  free(dst);
}

// JSON lines on rank 0: the 8 B half round trip, and every rank's streaming bandwidth.
static void bench(uint8_t* sb, uint8_t* rb) {
  const int iters = 2000;
  if (rank < 2) {
    const int peer = 1 - rank;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = 0;
    for (int i = -100; i < iters; ++i) {
      if (i == 0) t0 = MPI_Wtime();
      if (rank == 0) {
        MPI_Send(sb, 8, MPI_BYTE, peer, 3, MPI_COMM_WORLD);
        MPI_Recv(rb, 8, MPI_BYTE, peer, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else {
        MPI_Recv(rb, 8, MPI_BYTE, peer, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(sb, 8, MPI_BYTE, peer, 3, MPI_COMM_WORLD);
      }
    }
    if (rank == 0)
      printf("{\"half_rtt_8B_us\": %.3f}\n", (MPI_Wtime() - t0) / iters / 2 * 1e6);
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
  }
  // Even ranks stream to odd ones, all pairs at once (a lone rank sits it out).
  const int n = 1 << 20, msgs = 200, window = 8;
  const int partner = rank ^ 1;
  double gbps = 0;
  MPI_Barrier(MPI_COMM_WORLD);
  if (partner < size) {
    MPI_Request req[8];
    const double t0 = MPI_Wtime();
    for (int i = 0; i < msgs; i += window) {
      for (int w = 0; w < window; ++w) {
        if (rank % 2 == 0)
          MPI_Isend(sb, n, MPI_BYTE, partner, 4, MPI_COMM_WORLD, &req[w]);
        else
          MPI_Irecv(rb + (size_t)(w % 2) * n, n, MPI_BYTE, partner, 4, MPI_COMM_WORLD, &req[w]);
      }
      MPI_Waitall(window, req, MPI_STATUSES_IGNORE);
    }
    gbps = (double)n * msgs * 8 / (MPI_Wtime() - t0) / 1e9;
  }
  double* all = calloc((size_t)size, sizeof(double));
  MPI_Gather(&gbps, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    printf("{\"ranks\": %d, \"stream_gbps\": [", size);
    for (int r = 0; r < size; ++r) printf("%s%.3f", r ? ", " : "", all[r]);
    printf("]}\n");
  }
  free(all);
}

// Ring exchanges until `secs` have passed (on rank 0's clock, broadcast each round).
static void run_for(uint8_t* sb, uint8_t* rb, double secs) {
  const int n = 1 << 20;
  const double t0 = MPI_Wtime();
  int more = 1;
  printf("rank %d pid %d running\n", rank, (int)getpid());
  fflush(stdout);
  while (more) {
    MPI_Sendrecv(sb, n, MPI_BYTE, (rank + 1) % size, 5, rb, n, MPI_BYTE, (rank + size - 1) % size,
                 5, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    more = MPI_Wtime() - t0 < secs;
    MPI_Bcast(&more, 1, MPI_INT, 0, MPI_COMM_WORLD);
  }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  uint8_t* sb = malloc(2 * (size_t)kMax);
  uint8_t* rb = malloc(2 * (size_t)kMax);
  if (!sb || !rb) MPI_Abort(MPI_COMM_WORLD, 2);
  const char* mode = argc > 1 ? argv[1] : "";
  if (strcmp(mode, "--bench") == 0) {
    bench(sb, rb);
  } else if (strcmp(mode, "--run") == 0 && argc > 2) {
    run_for(sb, rb, atof(argv[2]));
  } else {
    pingpongs(sb, rb);
    allreduce();
    alltoall();
    one_sided();
    int total = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0 && total == 0)
      printf("mpi_check: %d ranks, all checks passed\n", size);
    failures = total;
  }
  free(sb);
  free(rb);
  MPI_Finalize();
  return failures != 0;
}
