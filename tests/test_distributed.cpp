// Tests for perf/distributed.h: real c10d process groups over 127.0.0.1, two
// processes (this test binary starts a second copy of itself as rank 1), every
// wait bounded.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <perf/amp.h>
#include <perf/compiled.h>
#include <perf/cuda_graph.h>
#include <perf/distributed.h>
#include <perf/optim.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "compiled/models.h"
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

// Starts this test binary again as `rank` of `world`, running only `test`.
pid_t spawn_rank(const std::string& test, int port, int rank = 1, int world = 2) {
  std::vector<std::string> env = {"PERF_DIST_WORKER=1", "RANK=" + std::to_string(rank),
                                  "WORLD_SIZE=" + std::to_string(world), "MASTER_ADDR=127.0.0.1",
                                  "MASTER_PORT=" + std::to_string(port)};
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    if (kv.rfind("RANK=", 0) && kv.rfind("WORLD_SIZE=", 0) && kv.rfind("MASTER_", 0) && kv.rfind("GTEST_", 0))
      env.push_back(kv);
  }
  std::vector<char*> envp;
  envp.reserve(env.size() + 1);
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

// Rank `rank` of `world` on 127.0.0.1:`port` (backend left to the caller).
perf::ProcessGroupOptions loopback(int world, int rank, int port, std::chrono::milliseconds timeout) {
  return perf::ProcessGroupOptions()
      .world_size(world)
      .rank(rank)
      .master_addr("127.0.0.1")
      .master_port(port)
      .timeout(timeout);
}

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

#if PERF_WITH_GLOO
// Jobs of 2 and then 3 processes over Gloo: rank 0 runs `suite` here, ranks 1.. run the test `worker` (which runs the
// same suite) in copies of this binary.
void run_in_worlds_of_2_and_3(const std::string& worker,
                              const std::function<void(const c10::intrusive_ptr<c10d::ProcessGroup>&)>& suite) {
  for (int world : {2, 3}) {
    const int port = free_port();
    ASSERT_GT(port, 0);
    std::vector<pid_t> children;
    for (int r = 1; r < world; ++r) children.push_back(spawn_rank(worker, port, r, world));
    test_util::ScopedJobThreads restore;
    try {
      suite(perf::init_process_group(loopback(world, 0, port, std::chrono::seconds(60)).backend("gloo")));
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
    for (pid_t c : children) EXPECT_EQ(wait_bounded(c, std::chrono::seconds(120)), 0) << "a worker rank failed";
  }
}
#endif

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
  PERF_EXPECT_THROW_MSG(perf::init_process_group(loopback(2, 1, free_port(), std::chrono::milliseconds(1500))),
                        "could not reach the store at 127.0.0.1:");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

// A world size larger than the processes started: rank 0 waits for the missing
// rank only as long as the timeout, then says what to check.
TEST(Distributed, AWrongWorldSizeIsABoundedError) {
  const auto t0 = std::chrono::steady_clock::now();
  PERF_EXPECT_THROW_MSG(perf::init_process_group(loopback(2, 0, free_port(), std::chrono::milliseconds(1500))),
                        "rank 0 of 2 could not host the store on port");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(Distributed, GlooSingleProcessGroupWorks) {
#if PERF_WITH_GLOO
  auto pg = perf::init_process_group(loopback(1, 0, free_port(), std::chrono::seconds(20)).backend("gloo"));
  EXPECT_EQ(pg->getSize(), 1);
  EXPECT_EQ(pg->getBackendName(), "gloo");
  std::vector<at::Tensor> t = {torch::full({3}, 2.0f)};
  pg->allreduce(t)->wait();
  EXPECT_TRUE(torch::equal(t[0], torch::full({3}, 2.0f)));
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// The intra-op threads init_process_group gives each process, by the rule alone.
TEST(Distributed, ProcessesSharingAMachineGetTheirShareOfItsCores) {
  using perf::detail::shared_core_threads;
  EXPECT_EQ(shared_core_threads(2, 8, 8, false), 4);
  EXPECT_EQ(shared_core_threads(3, 8, 8, false), 2);
  EXPECT_EQ(shared_core_threads(2, 2, 2, false), 1);
  EXPECT_EQ(shared_core_threads(16, 8, 8, false), 1) << "at least one each";
  EXPECT_EQ(shared_core_threads(2, 8, 16, false), 4) << "a default of one thread per hardware thread";
  EXPECT_EQ(shared_core_threads(1, 8, 8, false), 0) << "alone on the machine";
  EXPECT_EQ(shared_core_threads(2, 8, 8, true), 0) << "OMP_NUM_THREADS or MKL_NUM_THREADS set";
  EXPECT_EQ(shared_core_threads(2, 8, 4, false), 0) << "the program chose fewer threads";
  EXPECT_EQ(shared_core_threads(2, 0, 8, false), 0) << "cores unknown";
}

namespace {

// After init_process_group in a job of `processes` processes here: the count, and
// the threads the rule gives (the same as `before` where it leaves them).
void expect_core_share(int processes, int before) {
  EXPECT_EQ(perf::detail::job_processes_here().load(), processes);
  const int share = perf::detail::shared_core_threads(processes, perf::detail::physical_cores(), before,
                                                      perf::detail::thread_count_set_by_environment());
  EXPECT_EQ(at::get_num_threads(), share ? share : before)
      << processes << " processes on " << perf::detail::physical_cores() << " cores, " << before << " threads before";
}

}  // namespace

// Rank 0 here, rank 1 in a second copy of this binary, over 127.0.0.1: the
// collectives work, and each process counts two on this machine through the
// store and takes its share of the cores (rank 0 warns saying so); told by
// LOCAL_WORLD_SIZE=1 (a launcher's one process per machine), neither changes its threads.
TEST(Distributed, TwoProcessesAllReduceAndBroadcastOverGloo) {
#if PERF_WITH_GLOO
  if (is_worker()) GTEST_SKIP() << "skipped: this is the rank-1 copy";
  for (const std::string local : {"", "1"}) {
    SCOPED_TRACE(local.empty() ? "counted through the store" : "LOCAL_WORLD_SIZE=" + local);
    test_util::ScopedJobThreads restore;  // for the quick tests after this one in the process
    std::optional<test_util::ScopedEnv> local_world;
    if (!local.empty()) local_world.emplace("LOCAL_WORLD_SIZE", local.c_str());
    const int processes = local.empty() ? 2 : 1;
    test_util::ScopedEnv expect("PERF_DIST_EXPECT_PROCESSES", std::to_string(processes).c_str());
    const int before = at::get_num_threads();
    const int port = free_port();
    ASSERT_GT(port, 0);
    const pid_t child = spawn_rank("Distributed.Rank1OfTwoProcessTests", port);
    ASSERT_GT(child, 0);
    try {
      test_util::CollectWarnings warnings;
      auto pg = perf::init_process_group(loopback(2, 0, port, std::chrono::seconds(30)).backend("gloo"));
      EXPECT_EQ(pg->getSize(), 2);
      expect_core_share(processes, before);
      const bool changed = at::get_num_threads() != before;
      size_t said = 0;
      for (const auto& m : warnings.messages)
        said += m.find(std::to_string(processes) + " processes of this job share this machine's") != std::string::npos;
      EXPECT_EQ(said, changed ? 1u : 0u);
      allreduce_and_broadcast(pg);
      perf::destroy_process_group(pg);
      EXPECT_EQ(perf::detail::job_processes_here().load(), 1) << "the job has ended";
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
    EXPECT_EQ(wait_bounded(child, std::chrono::seconds(60)), 0) << "rank 1 failed (its output is above)";
  }
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// Not a test of its own: rank 1 of the test above, from torchrun-style variables.
TEST(Distributed, Rank1OfTwoProcessTests) {
  if (!is_worker()) GTEST_SKIP() << "skipped: runs only as rank 1, started by Distributed.TwoProcesses*";
  const char* expect = std::getenv("PERF_DIST_EXPECT_PROCESSES");
  ASSERT_NE(expect, nullptr);
  const int before = at::get_num_threads();
  auto pg = perf::init_process_group(perf::ProcessGroupOptions().backend("gloo").timeout(std::chrono::seconds(30)));
  EXPECT_EQ(pg->getRank(), 1);
  expect_core_share(std::stoi(expect), before);
  allreduce_and_broadcast(pg);
}

// --------------------------------------------------------------------------- DistributedDataParallel

namespace {

struct DdpNetImpl : torch::nn::Module {
  explicit DdpNetImpl(bool spare = false) {
    l1 = register_module("l1", torch::nn::Linear(8, 16));
    l2 = register_module("l2", torch::nn::Linear(16, 16));
    l3 = register_module("l3", torch::nn::Linear(16, 4));
    if (spare) l4 = register_module("spare", torch::nn::Linear(16, 16));
  }
  at::Tensor forward(const at::Tensor& x) { return l3(hidden(x)); }
  at::Tensor hidden(const at::Tensor& x) { return torch::relu(l2(torch::relu(l1(x)))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, l4{nullptr};
};
TORCH_MODULE(DdpNet);

// Two outputs, as a model with an auxiliary head: the logits and the spare layer's features.
struct DdpHeadsImpl : DdpNetImpl {
  explicit DdpHeadsImpl(bool /*spare: always*/ = true) : DdpNetImpl(true) {}
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    const auto h = hidden(x);
    return {l3(h), l4(h)};
  }
};
TORCH_MODULE(DdpHeads);

// Named outputs, as a Python model returning a dict.
struct DdpNamedImpl : DdpNetImpl {
  DdpNamedImpl() : DdpNetImpl(true) {}
  std::map<std::string, at::Tensor> forward(const at::Tensor& x) {
    const auto h = hidden(x);
    return {{"logits", l3(h)}, {"features", l4(h)}};
  }
};
TORCH_MODULE(DdpNamed);

// A tensor registered under two names (weights tied by registering one tensor in two modules): LibTorch's
// parameters() lists it twice.
struct DdpTiedImpl : DdpNetImpl {
  DdpTiedImpl() { register_parameter("l1_weight_again", l1->weight); }
};
TORCH_MODULE(DdpTied);

// An output type perf's DDP cannot look into.
struct OpaqueOutput {
  at::Tensor logits;
};
struct DdpOpaqueImpl : DdpNetImpl {
  OpaqueOutput forward(const at::Tensor& x) { return {DdpNetImpl::forward(x)}; }
};
TORCH_MODULE(DdpOpaque);

// Rank 0's flattened parameters equal this rank's, bit for bit.
void expect_same_on_every_rank(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, torch::nn::Module& m,
                               const std::string& what) {
  std::vector<at::Tensor> flat;
  for (const auto& p : m.parameters()) flat.push_back(p.detach().flatten());
  for (const auto& b : m.buffers()) flat.push_back(b.detach().flatten().to(torch::kFloat));
  const auto mine = torch::cat(flat);
  std::vector<at::Tensor> r0 = {mine.clone()};
  pg->broadcast(r0)->wait();
  EXPECT_TRUE(torch::equal(r0[0], mine)) << what << ": rank " << pg->getRank() << " differs from rank 0";
}

double max_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double d = 0;
  const auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) d = std::max(d, (pa[i] - pb[i]).abs().max().item<double>());
  return d;
}

enum class OptKind { sgd, adamw, torch_sgd, adamw_flat };

std::shared_ptr<torch::optim::Optimizer> make_opt(OptKind k, const std::vector<at::Tensor>& params) {
  switch (k) {
    case OptKind::sgd:
      return std::make_shared<perf::optim::SGD>(params, perf::optim::SGDOptions(0.05).momentum(0.9));
    case OptKind::adamw:
      return std::make_shared<perf::optim::AdamW>(params, perf::optim::AdamWOptions(1e-2));
    case OptKind::adamw_flat:
      return std::make_shared<perf::optim::AdamW>(params, perf::optim::AdamWOptions(1e-2).flat(true));
    case OptKind::torch_sgd:
      return std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return nullptr;
}

// perf::optim's own zero_grad; LibTorch's optimizers through perf::optim::zero_grad
// (their zero_grad's in-place detach_ refuses gradient_as_bucket_view's views).
void clear_ddp_grads(torch::optim::Optimizer& opt) {
  if (auto* fused = dynamic_cast<perf::optim::FusedOptimizer*>(&opt)) {
    fused->zero_grad();
  } else {
    perf::optim::zero_grad(opt);
  }
}

struct Case {
  std::string name;
  perf::DDPOptions options;
  OptKind opt = OptKind::sgd;
  bool spare = false;   // an unused parameter
  int micro = 1;        // micro-batches per step; all but the last under no_sync()
  bool scaler = false;  // perf::GradScaler around the step
  double tol = 1e-5;
  bool autocast = false;  // forward under perf::Autocast (CPU bf16)
  bool heads = false;     // DdpHeads (two outputs) instead of DdpNet
  bool aux_loss = false;  // heads: the second output enters the loss (else it is left out)
};

at::Tensor case_loss(const at::Tensor& out, const at::Tensor& y, const Case& /*c*/) {
  return torch::nn::functional::cross_entropy(out.to(torch::kFloat), y);
}

at::Tensor case_loss(const std::tuple<at::Tensor, at::Tensor>& out, const at::Tensor& y, const Case& c) {
  auto loss = torch::nn::functional::cross_entropy(std::get<0>(out).to(torch::kFloat), y);
  return c.aux_loss ? loss + 0.1 * std::get<1>(out).to(torch::kFloat).pow(2).mean() : loss;
}

// Trains with DDP on this rank's slice for 10 steps and a reference model on the
// whole batch in this process; both start from rank 0's initial weights.
template <typename Net>
void run_case(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const Case& c) {
  SCOPED_TRACE(c.name + " on " + std::to_string(pg->getSize()) + " ranks");
  const int rank = pg->getRank(), world = pg->getSize();
  torch::manual_seed(static_cast<uint64_t>(100 + rank));  // different on every rank: DDP must broadcast rank 0's
  Net model(c.spare);
  torch::manual_seed(100);  // rank 0's initial weights
  Net ref(c.spare);
  perf::DistributedDataParallel ddp(model, pg, c.options);
  EXPECT_LT(max_diff(*model, *ref), 1e-12) << "rank 0's parameters were not broadcast";
  auto opt = make_opt(c.opt, model->parameters());
  auto ref_opt = make_opt(c.opt, ref->parameters());
  perf::GradScaler scaler(perf::GradScalerOptions().enabled(c.scaler).init_scale(1024.0));
  perf::GradScaler ref_scaler(perf::GradScalerOptions().enabled(c.scaler).init_scale(1024.0));
  const int64_t b = 6;
  for (int step = 0; step < 10; ++step) {
    torch::manual_seed(static_cast<uint64_t>(1000 + step));  // the same global batch everywhere
    const auto x = torch::randn({c.micro, world * b, 8});
    const auto y = torch::randint(0, 4, {c.micro, world * b});
    clear_ddp_grads(*opt);
    clear_ddp_grads(*ref_opt);
    // static_graph learns the graph in a synchronised first step; no_sync() may follow it.
    const int micro = c.options.static_graph() && step == 0 ? 1 : c.micro;
    for (int m = 0; m < micro; ++m) {
      const auto xs = x[m].narrow(0, rank * b, b), ys = y[m].narrow(0, rank * b, b);
      auto local = [&] {
        perf::Autocast ac(torch::kCPU, torch::kBFloat16, c.autocast);
        scaler.scale(case_loss(ddp(xs), ys, c)).backward();
      };
      if (m + 1 < micro) {
        auto guard = ddp.no_sync();
        local();
      } else {
        local();
      }
      perf::Autocast ac(torch::kCPU, torch::kBFloat16, c.autocast);
      ref_scaler.scale(case_loss(ref(x[m]), y[m], c)).backward();
    }
    scaler.step(*opt);
    scaler.update();
    ref_scaler.step(*ref_opt);
    ref_scaler.update();
  }
  EXPECT_LT(max_diff(*model, *ref), c.tol) << "DDP training differs from one process on the whole batch";
  if (c.opt == OptKind::adamw_flat) {
    // Where the gradients live: the flat buffer (one tensor), or DDP's buckets (a tensor per parameter).
    const auto& line = static_cast<perf::optim::FusedOptimizer&>(*opt).kernels().at(0);
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad());
    const size_t tensors = perf::optim::detail::coalesce_flat(grads).size();
    if (c.options.gradient_as_bucket_view()) {
      EXPECT_NE(line.find("flat (6 tensors for 6 parameters)"), std::string::npos) << line;
      EXPECT_EQ(tensors, 6u) << "DDP's bucket views, not the optimizer's buffer";
    } else {
      EXPECT_NE(line.find("flat (1 tensor for 6 parameters)"), std::string::npos) << line;
      EXPECT_EQ(tensors, 1u) << "the gradients are the flat buffer";
    }
  }
  expect_same_on_every_rank(pg, *model, c.name);
  if (c.options.static_graph() || !c.options.find_unused_parameters()) {
    EXPECT_GE(ddp.buckets().size(), c.options.bucket_cap_mb() < 0.01 ? 2u : 1u) << "buckets after the rebuild";
  }
  if (c.spare && !c.aux_loss) {
    torch::manual_seed(100);
    DdpNet fresh(true);
    EXPECT_TRUE(torch::equal(model->l4->weight, fresh->l4->weight)) << "the unused parameter moved";
  }
}

// Buffers: rank 0's are broadcast before each synchronised forward, unless broadcast_buffers(false).
void run_buffers(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool broadcast) {
  SCOPED_TRACE(std::string("buffers, broadcast_buffers=") + (broadcast ? "true" : "false"));
  const int rank = pg->getRank();
  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::Linear(8, 2));
  perf::DistributedDataParallel ddp(seq, pg, perf::DDPOptions().broadcast_buffers(broadcast));
  auto* bn = seq[1]->as<torch::nn::BatchNorm1d>();
  EXPECT_TRUE(torch::equal(bn->running_mean, torch::zeros({8}))) << "constructor broadcast";
  {
    torch::NoGradGuard ng;
    bn->running_mean.fill_(static_cast<float>(rank));  // drift, as local batches would cause
  }
  seq->eval();  // running stats are used, not updated
  ddp(torch::randn({4, 8})).sum().backward();
  EXPECT_TRUE(torch::equal(bn->running_mean, torch::full({8}, broadcast ? 0.0f : static_cast<float>(rank))))
      << bn->running_mean;
}

void run_ddp_suite(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  // Every rank of these jobs runs on this machine, and init_process_group counted them.
  EXPECT_EQ(perf::detail::job_processes_here().load(), pg->getSize());
  const std::vector<Case> cases = {
      {"SGD, default options", perf::DDPOptions(), OptKind::sgd},
      {"AdamW, several small buckets", perf::DDPOptions().bucket_cap_mb(0.0005).first_bucket_cap_mb(0.0002),
       OptKind::adamw},
      {"SGD, gradient_as_bucket_view, torch::optim", perf::DDPOptions().gradient_as_bucket_view(true),
       OptKind::torch_sgd},
      {"AdamW, gradient_as_bucket_view, small buckets",
       perf::DDPOptions().gradient_as_bucket_view(true).bucket_cap_mb(0.0005), OptKind::adamw},
      {"SGD, no_sync accumulation over 3 micro-batches", perf::DDPOptions(), OptKind::sgd, false, 3},
      // Flat: DDP copies the averaged gradients into the flat buffer (one tensor per step) ...
      {"AdamW flat, small buckets, GradScaler", perf::DDPOptions().bucket_cap_mb(0.0005), OptKind::adamw_flat, false, 1,
       true},
      // ... or, with gradient_as_bucket_view, its buckets own them and the step reads them there.
      {"AdamW flat, gradient_as_bucket_view", perf::DDPOptions().gradient_as_bucket_view(true).bucket_cap_mb(0.0005),
       OptKind::adamw_flat},
      {"AdamW, unused parameter, find_unused_parameters",
       perf::DDPOptions().find_unused_parameters(true).bucket_cap_mb(0.001), OptKind::adamw, true},
      {"AdamW, unused parameter, find_unused_parameters, no_sync over 2 micro-batches",
       perf::DDPOptions().find_unused_parameters(true).bucket_cap_mb(0.001), OptKind::adamw, true, 2},
      {"SGD, static_graph with an unused parameter", perf::DDPOptions().static_graph(true), OptKind::sgd, true},
      {"SGD, GradScaler", perf::DDPOptions(), OptKind::sgd, false, 1, true},
      {"SGD, fp16 compression", perf::DDPOptions().compression("fp16"), OptKind::sgd, false, 1, false, 2e-3},
      {"SGD, bf16 compression", perf::DDPOptions().compression("bf16"), OptKind::sgd, false, 1, false, 2e-2},
      {"SGD, perf::Autocast bf16", perf::DDPOptions(), OptKind::sgd, false, 1, false, 2e-2, true},
      // Two outputs (as Python's DDP: every output passes its _DDPSink) ...
      {"AdamW, two outputs, the second left out of the loss, find_unused_parameters",
       perf::DDPOptions().find_unused_parameters(true).bucket_cap_mb(0.001), OptKind::adamw, true, 1, false, 1e-5,
       false, true, false},
      {"SGD, two outputs in the loss, static_graph", perf::DDPOptions().static_graph(true), OptKind::sgd, true, 1,
       false, 1e-5, false, true, true},
      {"SGD, no_sync over 2 micro-batches after the first step, static_graph", perf::DDPOptions().static_graph(true),
       OptKind::sgd, false, 2},
      {"SGD, two outputs in the loss, no_sync over 2 micro-batches after the first step, static_graph",
       perf::DDPOptions().static_graph(true), OptKind::sgd, true, 2, false, 1e-5, false, true, true},
  };
  for (const auto& c : cases) {
    if (c.heads) {
      run_case<DdpHeads>(pg, c);
    } else {
      run_case<DdpNet>(pg, c);
    }
  }
  run_buffers(pg, true);
  run_buffers(pg, false);
  // An unused parameter without find_unused_parameters: the Reducer's own error, on every rank alike.
  {
    torch::manual_seed(100);
    DdpNet model(true);
    perf::DistributedDataParallel ddp(model, pg);
    ddp(torch::randn({4, 8})).sum().backward();
    PERF_EXPECT_THROW_MSG(ddp(torch::randn({4, 8})), "find_unused_parameters");
  }
}

c10::intrusive_ptr<c10d::ProcessGroup> worker_group(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  return perf::init_process_group(perf::ProcessGroupOptions().backend("gloo").timeout(timeout));
}

c10::intrusive_ptr<c10d::ProcessGroup> single_group() {
  return perf::init_process_group(loopback(1, 0, free_port(), std::chrono::seconds(20)).backend("gloo"));
}

}  // namespace

TEST(DistributedDataParallel, RejectsBadOptionsAndUnsupportedUses) {
#if PERF_WITH_GLOO
  auto pg = single_group();
  DdpNet model;
  PERF_EXPECT_THROW_MSG(perf::DistributedDataParallel(model, nullptr), "process group is empty");
  PERF_EXPECT_THROW_MSG(perf::DistributedDataParallel(model, pg, perf::DDPOptions().bucket_cap_mb(0)),
                        "perf::DDPOptions::bucket_cap_mb: must be > 0");
  PERF_EXPECT_THROW_MSG(perf::DistributedDataParallel(model, pg, perf::DDPOptions().compression("int8")),
                        "valid values: \"none\", \"fp16\", \"bf16\"");
  PERF_EXPECT_THROW_MSG(
      perf::DistributedDataParallel(model, pg, perf::DDPOptions().static_graph(true).find_unused_parameters(true)),
      "static_graph(true) already handles unused parameters");
  {
    DdpNet frozen;
    for (auto& p : frozen->parameters()) p.requires_grad_(false);
    PERF_EXPECT_THROW_MSG(perf::DistributedDataParallel(frozen, pg), "no parameter that requires grad");
  }
  // TrainStep would capture the all-reduce hooks in a CUDA graph: refused while a DDP holds the parameters.
  {
    perf::DistributedDataParallel ddp(model, pg);
    perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.1));
    auto loss = [&](const at::Tensor& x, const at::Tensor& y) {
      return torch::nn::functional::cross_entropy(model(x), y);
    };
    PERF_EXPECT_THROW_MSG(perf::TrainStep(*model, loss, opt, torch::randn({4, 8}), torch::randint(0, 4, {4})),
                          "synchronised by a perf::DistributedDataParallel");
  }
  // static_graph learns the graph in the first synchronised iteration: no_sync() before it is refused, after it works.
  {
    DdpNet net;
    perf::DistributedDataParallel ddp(net, pg, perf::DDPOptions().static_graph(true));
    {
      auto guard = ddp.no_sync();
      PERF_EXPECT_THROW_MSG(ddp(torch::randn({4, 8})), "no_sync() cannot come before it");
      torch::NoGradGuard no_grad;
      EXPECT_NO_THROW(ddp(torch::randn({4, 8})));  // evaluation: no backward follows
    }
    ddp(torch::randn({4, 8})).sum().backward();
    auto guard = ddp.no_sync();
    EXPECT_NO_THROW(ddp(torch::randn({4, 8})).sum().backward());
  }
  // Named outputs, one left out of the loss: every iteration finishes its reduction.
  {
    DdpNamed named;
    perf::DistributedDataParallel ddp(named, pg, perf::DDPOptions().find_unused_parameters(true));
    for (int i = 0; i < 3; ++i) EXPECT_NO_THROW(ddp(torch::randn({4, 8})).at("logits").sum().backward());
    EXPECT_TRUE(named->l3->weight.grad().defined());
    EXPECT_FALSE(named->l4->weight.grad().defined());
  }
  {  // the backward of a forward whose DDP is gone: a clear error, not a read of the freed Reducer
    DdpNamed named;
    at::Tensor logits;
    {
      perf::DistributedDataParallel ddp(named, pg, perf::DDPOptions().find_unused_parameters(true));
      logits = ddp(torch::randn({4, 8})).at("logits");
    }
    PERF_EXPECT_THROW_MSG(logits.sum().backward(), "keep it alive until backward");
  }
  // An output perf cannot look into, where find_unused_parameters or static_graph needs its tensors.
  {
    DdpOpaque opaque;
    for (const auto& options :
         {perf::DDPOptions().find_unused_parameters(true), perf::DDPOptions().static_graph(true)}) {
      perf::DistributedDataParallel ddp(opaque, pg, options);
      PERF_EXPECT_THROW_MSG(ddp(torch::randn({4, 8})), "forward returned no tensor perf can find");
    }
    perf::DistributedDataParallel ddp(opaque, pg);  // neither: the Reducer needs no output
    EXPECT_NO_THROW(ddp(torch::randn({4, 8})).logits.sum().backward());
  }
  // A tied weight is one parameter to synchronise, as Python's DDP keeps a shared parameter once: it trains as the
  // model alone (the Reducer would otherwise see the same tensor's gradient ready twice, or reduce it twice).
  for (const bool as_view : {false, true}) {
    torch::manual_seed(2);
    DdpTied tied, alone;
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < tied->parameters().size(); ++i) alone->parameters()[i].copy_(tied->parameters()[i]);
    }
    ASSERT_EQ(tied->parameters().size(), 7u) << "LibTorch lists the tied weight twice";
    perf::DistributedDataParallel ddp(tied, pg,
                                      perf::DDPOptions().bucket_cap_mb(0.0005).gradient_as_bucket_view(as_view));
    EXPECT_EQ(ddp.parameters().size(), 6u);
    EXPECT_TRUE(ddp.parameters()[0].is_same(tied->l1->weight));
    perf::optim::SGD opt(tied->parameters(), perf::optim::SGDOptions(0.05).momentum(0.9));
    perf::optim::SGD opt_alone(alone->parameters(), perf::optim::SGDOptions(0.05).momentum(0.9));
    for (int k = 0; k < 4; ++k) {
      torch::manual_seed(static_cast<uint64_t>(30 + k));
      const auto x = torch::randn({6, 8});
      const auto y = torch::randint(0, 4, {6});
      opt.zero_grad();
      torch::nn::functional::cross_entropy(ddp(x), y).backward();
      opt.step();
      opt_alone.zero_grad();
      torch::nn::functional::cross_entropy(alone(x), y).backward();
      opt_alone.step();
    }
    EXPECT_LE(max_diff(*tied, *alone), 1e-6) << "gradient_as_bucket_view " << as_view;
  }
  // World size 1: DDP trains exactly as the model alone.
  run_case<DdpNet>(pg, {"world size 1", perf::DDPOptions(), OptKind::adamw});
  perf::destroy_process_group(pg);
  PERF_EXPECT_THROW_MSG(perf::destroy_process_group(nullptr), "the process group is empty");
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// Rank 0 here; ranks 1.. in copies of this binary. Worlds of 2 and 3.
TEST(DistributedDataParallel, TwoAndThreeProcessesTrainLikeOneProcessOnTheWholeBatch) {
#if PERF_WITH_GLOO
  if (is_worker()) GTEST_SKIP() << "skipped: this is a worker copy";
  run_in_worlds_of_2_and_3("DistributedDataParallel.WorkerRank", run_ddp_suite);
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// A rank that dies mid-training: rank 0's next backward fails within the timeout instead of hanging.
TEST(DistributedDataParallel, ARankThatDiesIsABoundedError) {
#if PERF_WITH_GLOO
  if (is_worker()) GTEST_SKIP() << "skipped: this is a worker copy";
  const int port = free_port();
  const pid_t child = spawn_rank("DistributedDataParallel.WorkerThatDies", port);
  test_util::ScopedJobThreads restore;  // the quick tests after this one in the process
  const auto t0 = std::chrono::steady_clock::now();
  try {
    auto pg = perf::init_process_group(loopback(2, 0, port, std::chrono::seconds(5)).backend("gloo"));
    torch::manual_seed(100);
    DdpNet model;
    perf::DistributedDataParallel ddp(model, pg);
    EXPECT_THROW(
        {
          for (int i = 0; i < 3; ++i) ddp(torch::randn({4, 8})).sum().backward();
        },
        std::exception);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "setup failed: " << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
  EXPECT_EQ(wait_bounded(child, std::chrono::seconds(30)), 3);
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// Not tests of their own: the worker ranks of the tests above.
TEST(DistributedDataParallel, WorkerRank) {
  if (!is_worker()) GTEST_SKIP() << "skipped: runs only as a worker rank, started by DistributedDataParallel.*";
  run_ddp_suite(worker_group());
}

TEST(DistributedDataParallel, WorkerThatDies) {
  if (!is_worker()) GTEST_SKIP() << "skipped: runs only as a worker rank, started by DistributedDataParallel.*";
  auto pg = worker_group(std::chrono::seconds(5));
  torch::manual_seed(100);
  DdpNet model;
  perf::DistributedDataParallel ddp(model, pg);
  std::_Exit(3);  // dies after joining, before the first step
}

// One GPU, NCCL, world size 1: DDP's bucketing, hooks and compression on CUDA
// tensors train exactly as the model alone (fp32; bf16 compression within 2e-2).
#if PERF_WITH_NCCL
namespace {

// At world size 1, 10 AdamW steps through a DDP on CUDA equal the model's
// alone (within c.tol); returns the DDP's buckets after them.
template <typename Net>
size_t nccl_trains_like_the_model(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const Case& c) {
  SCOPED_TRACE(c.name);
  torch::manual_seed(100);
  Net model(c.spare), ref(c.spare);
  model->to(torch::kCUDA);
  ref->to(torch::kCUDA);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < ref->parameters().size(); ++i) ref->parameters()[i].copy_(model->parameters()[i]);
  }
  perf::DistributedDataParallel ddp(model, pg, c.options);
  perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2));
  perf::optim::AdamW ref_opt(ref->parameters(), perf::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    const auto x = torch::randn({16, 8}, torch::kCUDA);
    const auto y = torch::randint(0, 4, {16}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kLong));
    opt.zero_grad();
    ref_opt.zero_grad();
    case_loss(ddp(x), y, c).backward();
    case_loss(ref(x), y, c).backward();
    opt.step();
    ref_opt.step();
  }
  EXPECT_LT(max_diff(*model, *ref), c.tol);
  return ddp.buckets().size();
}

}  // namespace
#endif

TEST(DistributedDataParallel, OnGpuNcclWorldSizeOneTrainsLikeTheModelAlone) {
#if PERF_WITH_NCCL
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto pg = perf::init_process_group(loopback(1, 0, free_port(), std::chrono::seconds(60)).backend("nccl"));
  EXPECT_EQ(pg->getBackendName(), "nccl");
  for (const std::string comp : {"none", "bf16"}) {
    Case c;
    c.name = "compression " + comp;
    c.options = perf::DDPOptions().compression(comp).bucket_cap_mb(0.0005).gradient_as_bucket_view(true);
    c.tol = comp == "none" ? 1e-5 : 2e-2;
    EXPECT_GE(nccl_trains_like_the_model<DdpNet>(pg, c), 2u) << c.name;
  }
  // The outputs' DDPSink on CUDA (its backward, and static_graph's queued all-reduce, run on the device thread).
  Case two;
  two.name = "two outputs, the second left out of the loss, find_unused_parameters";
  two.options = perf::DDPOptions().find_unused_parameters(true);
  two.heads = true;
  nccl_trains_like_the_model<DdpHeads>(pg, two);
  two.name = "two outputs in the loss, static_graph";
  two.options = perf::DDPOptions().static_graph(true);
  two.aux_loss = true;
  nccl_trains_like_the_model<DdpHeads>(pg, two);
  perf::destroy_process_group(pg);
#else
  GTEST_SKIP() << "skipped: perf was built without NCCL (needs CUDA and LibTorch's NCCL)";
#endif
}

// ---- perf::TrainStep and perf::CompiledTrainStep with data_parallel(pg): the step averages its own gradients after
// backward, with collectives a CUDA graph can capture (no autograd hooks).
namespace {

struct DpCase {
  std::string name;
  perf::DataParallelOptions options;
  bool flat = false;           // a flat AdamW: its gradient buffer all-reduced where it lies
  int64_t accumulation = 1;    // micro-batches per step
  bool scaler = false;         // perf::GradScaler in the step
  std::optional<double> clip;  // max_grad_norm
  bool sgd = false;            // SGD with momentum instead of AdamW
  double tol = 1e-5;           // against one process on the whole batch
};

at::Tensor dp_loss(DdpNet& m, const at::Tensor& x, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(m(x), y);
}

// 10 steps on this rank's rows of each global batch against one TrainStep on the whole batch in this process, both
// from rank 0's initial weights: the data-parallel step's construction must broadcast them.
void run_dp_case(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const DpCase& c) {
  SCOPED_TRACE("TrainStep, " + c.name + " on " + std::to_string(pg->getSize()) + " ranks");
  const int rank = pg->getRank(), world = pg->getSize();
  torch::manual_seed(static_cast<uint64_t>(100 + rank));
  DdpNet model;
  torch::manual_seed(100);
  DdpNet ref;
  auto make_opt = [&](DdpNet& m) -> std::unique_ptr<torch::optim::Optimizer> {
    if (c.sgd)
      return std::make_unique<perf::optim::SGD>(m->parameters(),
                                                perf::optim::SGDOptions(0.05).momentum(0.9).flat(c.flat));
    return std::make_unique<perf::optim::AdamW>(m->parameters(), perf::optim::AdamWOptions(1e-2).flat(c.flat));
  };
  auto opt = make_opt(model), ref_opt = make_opt(ref);
  perf::GradScaler scaler(perf::GradScalerOptions().init_scale(1024.0));
  perf::GradScaler ref_scaler(perf::GradScalerOptions().init_scale(1024.0));
  auto options = [&](perf::GradScaler& s) {
    return perf::TrainStepOptions()
        .accumulation_steps(c.accumulation)
        .max_grad_norm(c.clip)
        .scaler(c.scaler ? &s : nullptr);
  };
  const int64_t b = 6;
  const auto x0 = torch::zeros({b, 8});
  const auto y0 = torch::zeros({b}, torch::kLong);
  perf::TrainStep step(
      model, [&](const at::Tensor& x, const at::Tensor& y) { return dp_loss(model, x, y); }, *opt, x0, y0,
      options(scaler).data_parallel(pg, c.options));
  EXPECT_LT(max_diff(*model, *ref), 1e-12) << "rank 0's parameters were not broadcast";
  perf::TrainStep ref_step(
      ref, [&](const at::Tensor& x, const at::Tensor& y) { return dp_loss(ref, x, y); }, *ref_opt,
      torch::zeros({world * b, 8}), torch::zeros({world * b}, torch::kLong), options(ref_scaler));
  for (int i = 0; i < 10; ++i) {
    torch::manual_seed(static_cast<uint64_t>(1000 + i));  // the same global batch everywhere
    const auto x = torch::randn({world * b, 8});
    const auto y = torch::randint(0, 4, {world * b});
    const auto loss = step.step(x.narrow(0, rank * b, b), y.narrow(0, rank * b, b));
    ref_step.step(x, y);
    EXPECT_TRUE(torch::isfinite(loss).item<bool>());
  }
  EXPECT_LT(max_diff(*model, *ref), c.tol) << "data-parallel steps differ from one process on the whole batch";
  if (c.options.compression() != "none") {
    EXPECT_GT(max_diff(*model, *ref), 1e-7) << "compressed, the exchanged gradients are rounded to half precision";
  }
  if (c.clip) {
    EXPECT_NEAR(step.grad_norm().item<double>(), ref_step.grad_norm().item<double>(), 1e-5)
        << "the norm of the averaged gradients is the whole batch's";
  }
  if (c.flat) {
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad());
    EXPECT_EQ(perf::optim::detail::coalesce_flat(grads).size(), 1u) << "the averaged gradients stay in the buffer";
  }
  expect_same_on_every_rank(pg, *model, c.name);
}

// The compiled MLP of tests/compiled (dynamic batch 2..64) the same way: 8 rows per rank against the whole batch.
void run_dp_compiled(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool flat) {
  SCOPED_TRACE(std::string("CompiledTrainStep, ") + (flat ? "flat " : "") + "AdamW, small buckets on " +
               std::to_string(pg->getSize()) + " ranks");
  const int rank = pg->getRank(), world = pg->getSize();
  torch::manual_seed(static_cast<uint64_t>(100 + rank));
  compiled_models::Mlp model;
  torch::manual_seed(100);
  compiled_models::Mlp ref;
  perf::optim::AdamW opt(model.parameters(), perf::optim::AdamWOptions(1e-2).weight_decay(0.01).flat(flat));
  perf::optim::AdamW ref_opt(ref.parameters(), perf::optim::AdamWOptions(1e-2).weight_decay(0.01).flat(flat));
  const std::string pkg = test_util::package("mlp_train.pt2");
  perf::CompiledTrainStep step(pkg, model, opt,
                               perf::CompiledTrainOptions().data_parallel(
                                   pg, perf::DataParallelOptions().bucket_cap_mb(0.001)));  // 1 KiB: 5 buckets
  EXPECT_LT(max_diff(model, ref), 1e-12) << "rank 0's parameters were not broadcast at construction";
  perf::CompiledTrainStep ref_step(pkg, ref, ref_opt);
  const int64_t b = 8;
  for (int i = 0; i < 10; ++i) {
    torch::manual_seed(static_cast<uint64_t>(2000 + i));
    const auto x = torch::randn({world * b, 16});
    const auto y = torch::randint(0, 4, {world * b});
    step.step(x.narrow(0, rank * b, b), y.narrow(0, rank * b, b));
    ref_step.step(x, y);
  }
  EXPECT_LT(max_diff(model, ref), 1e-5) << "data-parallel compiled steps differ from one process on the whole batch";
  expect_same_on_every_rank(pg, model, "compiled");
  std::ostringstream printed;
  printed << step;
  EXPECT_NE(
      printed.str().find("data-parallel: rank " + std::to_string(rank) + " of " + std::to_string(world) + " (gloo)"),
      std::string::npos)
      << printed.str();
}

// Buffers: rank 0's before each step, unless broadcast_buffers(false); in eval() the step leaves them as they come.
void run_dp_buffers(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, bool broadcast) {
  SCOPED_TRACE(std::string("TrainStep buffers, broadcast_buffers=") + (broadcast ? "true" : "false"));
  const int rank = pg->getRank();
  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::Linear(8, 2));
  perf::optim::SGD opt(seq->parameters(), perf::optim::SGDOptions(0.1));
  perf::TrainStep step(
      seq,
      [&](const at::Tensor& x, const at::Tensor& y) {
        return torch::nn::functional::cross_entropy(seq->forward(x), y);
      },
      opt, torch::zeros({4, 8}), torch::zeros({4}, torch::kLong),
      perf::TrainStepOptions().data_parallel(pg, perf::DataParallelOptions().broadcast_buffers(broadcast)));
  auto* bn = seq[1]->as<torch::nn::BatchNorm1d>();
  {
    torch::NoGradGuard ng;
    bn->running_mean.fill_(static_cast<float>(rank));  // drift, as local batches would cause
  }
  seq->eval();  // running statistics used, not updated
  step.step(torch::randn({4, 8}), torch::randint(0, 2, {4}));
  EXPECT_TRUE(torch::equal(bn->running_mean, torch::full({8}, broadcast ? 0.0f : static_cast<float>(rank))))
      << bn->running_mean;
}

void run_dp_suite(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  const std::vector<DpCase> cases = {
      {"AdamW, default options", perf::DataParallelOptions(), false, 1, false, std::nullopt, false, 1e-5},
      {"AdamW, several small buckets", perf::DataParallelOptions().bucket_cap_mb(0.0005), false, 1, false, std::nullopt,
       false, 1e-5},
      {"flat AdamW", perf::DataParallelOptions().bucket_cap_mb(0.0005), true, 1, false, std::nullopt, false, 1e-5},
      {"AdamW, 3 micro-batches, GradScaler, clipping", perf::DataParallelOptions(), false, 3, true, 0.5, false, 1e-5},
      {"flat AdamW, GradScaler, clipping", perf::DataParallelOptions(), true, 1, true, 0.5, false, 1e-5},
      // Compressed: the gradients cross in half precision (bounds as DistributedDataParallel's test).
      {"SGD, fp16 compression", perf::DataParallelOptions().compression("fp16"), false, 1, false, std::nullopt, true,
       2e-3},
      {"SGD, bf16 compression, small buckets", perf::DataParallelOptions().compression("bf16").bucket_cap_mb(0.0005),
       false, 1, false, std::nullopt, true, 2e-2},
      {"flat SGD, bf16 compression", perf::DataParallelOptions().compression("bf16"), true, 1, false, std::nullopt,
       true, 2e-2},
  };
  for (const auto& c : cases) run_dp_case(pg, c);
  run_dp_buffers(pg, true);
  run_dp_buffers(pg, false);
  run_dp_compiled(pg, false);
  run_dp_compiled(pg, true);
}

}  // namespace

TEST(DataParallel, RejectsBadOptionsAndUnsupportedUses) {
#if PERF_WITH_GLOO
  auto pg = single_group();
  PERF_EXPECT_THROW_MSG(perf::TrainStepOptions().data_parallel(c10::intrusive_ptr<c10d::ProcessGroup>()),
                        "data_parallel: the process group is empty");
  PERF_EXPECT_THROW_MSG(perf::CompiledTrainOptions().data_parallel(pg, perf::DataParallelOptions().bucket_cap_mb(0)),
                        "perf::DataParallelOptions::bucket_cap_mb: must be > 0 MiB, got 0");
  PERF_EXPECT_THROW_MSG(perf::TrainStepOptions().data_parallel(pg, perf::DataParallelOptions().compression("int8")),
                        "compression: invalid value \"int8\"; valid values: \"none\", \"fp16\", \"bf16\"");
  const auto x = torch::randn({4, 8});
  const auto y = torch::randint(0, 4, {4});
  // A DDP and the step would both average: the step refuses the DDP's parameters and names the way.
  {
    DdpNet model;
    perf::DistributedDataParallel ddp(model, pg);
    perf::optim::SGD opt(model->parameters(), perf::optim::SGDOptions(0.1));
    PERF_EXPECT_THROW_MSG(perf::TrainStep(
                              model, [&](const at::Tensor& a, const at::Tensor& b) { return dp_loss(model, a, b); },
                              opt, x, y, perf::TrainStepOptions().data_parallel(pg)),
                          "Give the step the process group instead of the DDP wrapper");
  }
  {
    DdpNet frozen;
    for (auto& p : frozen->parameters()) p.requires_grad_(false);
    perf::optim::SGD opt(frozen->parameters(), perf::optim::SGDOptions(0.1));
    PERF_EXPECT_THROW_MSG(perf::TrainStep(
                              frozen, [&](const at::Tensor& a, const at::Tensor& b) { return dp_loss(frozen, a, b); },
                              opt, x, y, perf::TrainStepOptions().data_parallel(pg)),
                          "data_parallel: the model has no parameter that requires grad");
  }
  // A parameter the loss does not reach has no gradient to average.
  {
    DdpNet spare(true);
    perf::optim::SGD opt(spare->parameters(), perf::optim::SGDOptions(0.1));
    perf::TrainStep step(
        spare, [&](const at::Tensor& a, const at::Tensor& b) { return dp_loss(spare, a, b); }, opt, x, y,
        perf::TrainStepOptions().data_parallel(pg));
    PERF_EXPECT_THROW_MSG(step.step(x, y), "a parameter of shape [16, 16] got no gradient in this step on rank 0");
  }
  perf::destroy_process_group(pg);
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// Rank 0 here; ranks 1.. in copies of this binary. Worlds of 2 and 3.
TEST(DataParallel, TwoAndThreeProcessesTrainLikeOneProcessOnTheWholeBatch) {
#if PERF_WITH_GLOO
  if (is_worker()) GTEST_SKIP() << "skipped: this is a worker copy";
  run_in_worlds_of_2_and_3("DataParallel.WorkerRank", run_dp_suite);
#else
  GTEST_SKIP() << "skipped: perf was built without Gloo's headers (install libgloo-dev)";
#endif
}

// Not a test of its own: the worker ranks of the test above.
TEST(DataParallel, WorkerRank) {
  if (!is_worker()) GTEST_SKIP() << "skipped: runs only as a worker rank, started by DataParallel.*";
  run_dp_suite(worker_group());
}

// One GPU, NCCL, world size 1: the all-reduce is captured with the rest of the step, and a graphed step with
// data_parallel trains as the same step without it (averaging over one rank changes nothing); the compiled step too.
TEST(DataParallel, OnGpuNcclWorldSizeOneGraphedStepsTrainAsWithoutIt) {
#if PERF_WITH_NCCL
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  auto pg = perf::init_process_group(loopback(1, 0, free_port(), std::chrono::seconds(60)).backend("nccl"));
  const c10::Device cuda(c10::kCUDA, 0);
  for (const bool flat : {false, true}) {
    SCOPED_TRACE(flat ? "flat AdamW" : "AdamW");
    torch::manual_seed(100);
    DdpNet model, ref;
    model->to(cuda);
    ref->to(cuda);
    {
      torch::NoGradGuard ng;
      for (size_t i = 0; i < ref->parameters().size(); ++i) ref->parameters()[i].copy_(model->parameters()[i]);
    }
    perf::optim::AdamW opt(model->parameters(), perf::optim::AdamWOptions(1e-2).flat(flat));
    perf::optim::AdamW ref_opt(ref->parameters(), perf::optim::AdamWOptions(1e-2).flat(flat));
    const auto x0 = torch::zeros({16, 8}, cuda);
    const auto y0 = torch::zeros({16}, torch::TensorOptions(cuda).dtype(torch::kLong));
    perf::TrainStep step(
        model, [&](const at::Tensor& a, const at::Tensor& b) { return dp_loss(model, a, b); }, opt, x0, y0,
        perf::TrainStepOptions().data_parallel(pg, perf::DataParallelOptions().bucket_cap_mb(0.0005)));
    perf::TrainStep ref_step(
        ref, [&](const at::Tensor& a, const at::Tensor& b) { return dp_loss(ref, a, b); }, ref_opt, x0, y0);
    EXPECT_TRUE(step.graphed()) << "the step with its all-reduce is one CUDA graph";
    for (int i = 0; i < 10; ++i) {
      const auto x = torch::randn({16, 8}, cuda);
      const auto y = torch::randint(0, 4, {16}, torch::TensorOptions(cuda).dtype(torch::kLong));
      step.step(x, y);
      ref_step.step(x, y);
    }
    EXPECT_LT(max_diff(*model, *ref), 1e-6);
  }
  {
    test_util::TempDir dir;
    const std::string models = test_util::compiled_models();
    const std::string pkg = test_util::cuda_test_package(
        "mlp_train_cuda.pt2",
        models + ":make_mlp --train --loss " + models + ":classify_loss --input 8,16 --input 8:int64", dir);
    if (!pkg.empty()) {
      torch::manual_seed(100);
      compiled_models::Mlp model, ref;
      model.to(cuda);
      ref.to(cuda);
      {
        torch::NoGradGuard ng;
        for (size_t i = 0; i < ref.parameters().size(); ++i) ref.parameters()[i].copy_(model.parameters()[i]);
      }
      perf::optim::AdamW opt(model.parameters(), perf::optim::AdamWOptions(1e-2));
      perf::optim::AdamW ref_opt(ref.parameters(), perf::optim::AdamWOptions(1e-2));
      perf::CompiledTrainStep step(pkg, model, opt, perf::CompiledTrainOptions().data_parallel(pg));
      perf::CompiledTrainStep ref_step(pkg, ref, ref_opt);
      for (int i = 0; i < 10; ++i) {
        const auto x = torch::randn({8, 16}, cuda);
        const auto y = torch::randint(0, 4, {8}, torch::TensorOptions(cuda).dtype(torch::kLong));
        step.step(x, y);
        ref_step.step(x, y);
      }
      EXPECT_TRUE(step.graphed()) << "the compiled step with its all-reduce is one CUDA graph";
      EXPECT_LT(max_diff(model, ref), 1e-6);
    }
  }
  perf::destroy_process_group(pg);
#else
  GTEST_SKIP() << "skipped: perf was built without NCCL (needs CUDA and LibTorch's NCCL)";
#endif
}
