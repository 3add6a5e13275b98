// Tests for perf/distributed.h: real c10d process groups over 127.0.0.1, two
// processes (this test binary starts a second copy of itself as rank 1), every
// wait bounded.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <perf/distributed.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

extern char** environ;

namespace {

// A port the kernel says is free now (small race with other programs, fine on a CI machine).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// Starts this test binary again as rank 1, running only `test`.
pid_t spawn_rank1(const std::string& test, int port) {
  std::vector<std::string> env = {"PERF_DIST_WORKER=1", "RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                                  "MASTER_PORT=" + std::to_string(port)};
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("RANK=", 0) && kv.rfind("WORLD_SIZE=", 0) && kv.rfind("MASTER_", 0) && kv.rfind("GTEST_", 0))
      env.push_back(kv);
  }
  std::vector<char*> envp;
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  std::string self = "/proc/self/exe", filter = "--gtest_filter=" + test;
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t pid = 0;
  if (::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) != 0) return -1;
  return pid;
}

// Exit status of `pid`, killing it after `limit` (a test never hangs).
int wait_bounded(pid_t pid, std::chrono::seconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (std::chrono::steady_clock::now() < end) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

bool is_worker() { return std::getenv("PERF_DIST_WORKER") != nullptr; }

// What both ranks do: all-reduce (rank+1) * ones and broadcast from rank 0.
void allreduce_and_broadcast(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  const int rank = pg->getRank();
  std::vector<at::Tensor> t = {torch::full({4}, static_cast<float>(rank + 1))};
  pg->allreduce(t)->wait(std::chrono::milliseconds(20000));
  EXPECT_TRUE(torch::equal(t[0], torch::full({4}, 3.0f))) << t[0];
  std::vector<at::Tensor> b = {rank == 0 ? torch::arange(3, torch::kFloat) : torch::zeros({3})};
  pg->broadcast(b)->wait(std::chrono::milliseconds(20000));
  EXPECT_TRUE(torch::equal(b[0], torch::arange(3, torch::kFloat))) << b[0];
}

}  // namespace

TEST(Distributed, MissingOrMalformedSettingsNameTheVariable) {
  if (std::getenv("RANK") || std::getenv("WORLD_SIZE") || std::getenv("MASTER_ADDR")) {
    GTEST_SKIP() << "skipped: this process runs under a launcher (RANK/WORLD_SIZE/MASTER_ADDR set)";
  }
  PERF_EXPECT_THROW_MSG(perf::init_process_group(), "WORLD_SIZE is not set");
  PERF_EXPECT_THROW_MSG(perf::init_process_group(perf::ProcessGroupOptions().world_size(2)), "RANK is not set");
  PERF_EXPECT_THROW_MSG(perf::init_process_group(perf::ProcessGroupOptions().world_size(2).rank(0)),
                        "MASTER_ADDR is not set");
  PERF_EXPECT_THROW_MSG(
      perf::init_process_group(perf::ProcessGroupOptions().world_size(2).rank(0).master_addr("127.0.0.1")),
      "MASTER_PORT is not set");
  {
    test_util::ScopedEnv rank("RANK", "one");
    PERF_EXPECT_THROW_MSG(perf::init_process_group(perf::ProcessGroupOptions().world_size(2)),
                          "RANK=\"one\" is not an integer");
  }
  PERF_EXPECT_THROW_MSG(perf::init_process_group(perf::ProcessGroupOptions().world_size(2).rank(2)),
                        "rank (option) is 2; valid values: 0..1");
  PERF_EXPECT_THROW_MSG(perf::init_process_group(
                            perf::ProcessGroupOptions().world_size(1).rank(0).master_addr("127.0.0.1").master_port(0)),
                        "master_port (option) is 0; valid values: 1..65535");
  PERF_EXPECT_THROW_MSG(perf::init_process_group(perf::ProcessGroupOptions()
                                                     .world_size(1)
                                                     .rank(0)
                                                     .master_addr("127.0.0.1")
                                                     .master_port(free_port())
                                                     .backend("mpi")),
                        "\"auto\", \"gloo\", \"nccl\"");
}

TEST(Distributed, AnUnreachableMasterIsABoundedError) {
  const auto t0 = std::chrono::steady_clock::now();
  PERF_EXPECT_THROW_MSG(perf::init_process_group(perf::ProcessGroupOptions()
                                                     .world_size(2)
                                                     .rank(1)
                                                     .master_addr("127.0.0.1")
                                                     .master_port(free_port())
                                                     .timeout(std::chrono::milliseconds(1500))),
                        "could not reach the store at 127.0.0.1:");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(Distributed, GlooSingleProcessGroupWorks) {
#if PERF_WITH_GLOO
  auto pg = perf::init_process_group(perf::ProcessGroupOptions()
                                         .world_size(1)
                                         .rank(0)
                                         .master_addr("127.0.0.1")
                                         .master_port(free_port())
                                         .backend("gloo")
                                         .timeout(std::chrono::seconds(20)));
  EXPECT_EQ(pg->getSize(), 1);
  EXPECT_EQ(pg->getBackendName(), "gloo");
  std::vector<at::Tensor> t = {torch::full({3}, 2.0f)};
  pg->allreduce(t)->wait();
  EXPECT_TRUE(torch::equal(t[0], torch::full({3}, 2.0f)));
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// Rank 0 here, rank 1 in a second copy of this binary, over 127.0.0.1.
TEST(Distributed, TwoProcessesAllReduceAndBroadcastOverGloo) {
#if PERF_WITH_GLOO
  if (is_worker()) GTEST_SKIP() << "skipped: this is the rank-1 copy";
  const int port = free_port();
  ASSERT_GT(port, 0);
  const pid_t child = spawn_rank1("Distributed.Rank1OfTwoProcessTests", port);
  ASSERT_GT(child, 0);
  try {
    auto pg = perf::init_process_group(perf::ProcessGroupOptions()
                                           .world_size(2)
                                           .rank(0)
                                           .master_addr("127.0.0.1")
                                           .master_port(port)
                                           .backend("gloo")
                                           .timeout(std::chrono::seconds(30)));
    EXPECT_EQ(pg->getSize(), 2);
    allreduce_and_broadcast(pg);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  EXPECT_EQ(wait_bounded(child, std::chrono::seconds(60)), 0) << "rank 1 failed (its output is above)";
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// Not a test of its own: rank 1 of the test above, from torchrun-style variables.
TEST(Distributed, Rank1OfTwoProcessTests) {
  if (!is_worker()) GTEST_SKIP() << "skipped: runs only as rank 1, started by Distributed.TwoProcesses*";
  auto pg = perf::init_process_group(perf::ProcessGroupOptions().backend("gloo").timeout(std::chrono::seconds(30)));
  EXPECT_EQ(pg->getRank(), 1);
  allreduce_and_broadcast(pg);
}
