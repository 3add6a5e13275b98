// perf::CompiledModel against Python eager on the same inputs. The packages and
// references come from tests/compiled/make_packages.py (run by CMake before the
// tests, cached across builds): an MLP, a CNN with frozen BatchNorm, and a
// two-input two-output model with int64 token ids, each with a dynamic batch 1..64.
#include <perf/bench.h>
#include <perf/compiled.h>
#include <perf/cuda_graph.h>
#include <perf/setup.h>
#include <perf/state_dict.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <iostream>
#include <iterator>
#include <thread>

#include "compiled/models.h"
#include "test_util.h"

#if PERF_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

namespace {

using test_util::TempDir;

using test_util::package;

struct Reference {
  std::vector<at::Tensor> in, out;
};

// <name>.ref.pt, written by Python's torch.save: {"b1_in": [...], "b1_out": [...], "b5_in": ...}
Reference reference(const std::string& name, int batch) {
  std::ifstream f(package(name + ".ref.pt"), std::ios::binary);
  EXPECT_TRUE(f.good()) << package(name + ".ref.pt");
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto dict = torch::pickle_load(bytes).toGenericDict();
  auto list = [&](const std::string& key) {
    std::vector<at::Tensor> v;
    for (const auto t : dict.at(key).toList()) v.push_back(t.get().toTensor());
    return v;
  };
  const auto b = "b" + std::to_string(batch);
  return {list(b + "_in"), list(b + "_out")};
}

using test_util::max_diff;

}  // namespace

TEST(Compiled, OutputsEqualPythonEagerAtEveryBatchSize) {
  for (const std::string name : {"mlp", "cnn", "two_in_two_out"}) {
    perf::CompiledModel model(package(name + ".pt2"));
    EXPECT_EQ(model.device(), c10::Device(c10::kCPU));
    for (int batch : {1, 5}) {
      const auto ref = reference(name, batch);
      const auto out = model.run(ref.in);
      ASSERT_EQ(out.size(), ref.out.size()) << name;
      ASSERT_EQ(model.num_outputs(), ref.out.size()) << name;
      for (size_t i = 0; i < out.size(); ++i) {
        EXPECT_EQ(out[i].size(0), batch) << name << " output " << i;
        EXPECT_LE(max_diff(out[i], ref.out[i]), 1e-5) << name << " batch " << batch << " output " << i;
      }
    }
  }
  // One in, one out: the call operator.
  perf::CompiledModel mlp(package("mlp.pt2"));
  const auto ref = reference("mlp", 5);
  EXPECT_LE(max_diff(mlp(ref.in[0]), ref.out[0]), 1e-5);
  EXPECT_LE(max_diff(mlp.forward(ref.in[0]), ref.out[0]), 1e-5);
}

TEST(Compiled, DynamicBatchCoversTheExportedRangeRowByRow) {
  perf::CompiledModel mlp(package("mlp.pt2"));
  ASSERT_EQ(mlp.inputs().size(), 1u);
  EXPECT_EQ(mlp.inputs()[0].min_batch, 1);
  EXPECT_EQ(mlp.inputs()[0].max_batch, 64);
  const auto ref = reference("mlp", 5);
  // Every batch size gives each row what it gives that row alone (rows are independent in an MLP).
  const auto x = at::cat({ref.in[0], ref.in[0], ref.in[0]}).repeat({5, 1}).slice(0, 0, 64);
  const auto y64 = mlp(x);
  for (int64_t b : {1, 2, 3, 17, 63, 64}) {
    const auto y = mlp(x.slice(0, 0, b));
    ASSERT_EQ(y.size(0), b);
    EXPECT_LE(max_diff(y, y64.slice(0, 0, b)), 1e-5) << "batch " << b;
  }
  PERF_EXPECT_THROW_MSG(mlp(at::randn({65, 16})), "input 0 has batch 65, the package was exported for batches 1..64");
  PERF_EXPECT_THROW_MSG(mlp(at::randn({0, 16})), "input 0 has batch 0");
}

TEST(Compiled, EveryBadInputIsRejectedWithItsMessage) {
  perf::CompiledModel mlp(package("mlp.pt2"));
  PERF_EXPECT_THROW_MSG(mlp.run({at::randn({2, 16}), at::randn({2, 16})}), "takes 1 input(s), got 2");
  PERF_EXPECT_THROW_MSG(mlp.run({}), "takes 1 input(s), got 0");
  PERF_EXPECT_THROW_MSG(mlp(at::randn({2, 16}, at::kDouble)),
                        "input 0 has dtype Double, the package was exported for Float (convert with .to(Float))");
  PERF_EXPECT_THROW_MSG(mlp(at::randn({2, 17})), "input 0 has shape [2, 17], the package was exported for [batch, 16]");
  PERF_EXPECT_THROW_MSG(mlp(at::randn({2, 16, 1})), "input 0 has shape [2, 16, 1]");
  PERF_EXPECT_THROW_MSG(mlp(at::randn({16})), "input 0 has shape [16]");
  PERF_EXPECT_THROW_MSG(mlp(at::Tensor()), "input 0 is an undefined tensor");
  perf::CompiledModel two(package("two_in_two_out.pt2"));
  const auto ref = reference("two_in_two_out", 5);
  PERF_EXPECT_THROW_MSG(two.run({ref.in[0].to(at::kFloat), ref.in[1]}),
                        "input 0 has dtype Float, the package was exported for Long");
  PERF_EXPECT_THROW_MSG(two.run({ref.in[0], ref.in[1].slice(0, 0, 4).t()}), "input 1 has shape [8, 4]");
  PERF_EXPECT_THROW_MSG(two(ref.in[0]), "takes 2 inputs: call run({...}) with all of them");
  // After all the refusals the model still answers correctly.
  const auto out = two.run(ref.in);
  EXPECT_LE(max_diff(out[0], ref.out[0]), 1e-5);
  EXPECT_LE(max_diff(out[1], ref.out[1]), 1e-5);
}

// A failure inside the package's own run is a c10::Error that names the package.
// Where its generated code failed (here its own input checks, which it makes under
// AOTI_RUNTIME_CHECK_INPUTS, given a Double input that check_inputs(false) lets
// through), LibTorch's runner throws a std::runtime_error that says only "API call
// failed" while the code writes the cause to stderr: perf's error says so. (On an
// H100 a CUDA training step failed that way, in a convolution, and the message that
// reached the caller named neither the package nor the cause.) The model still
// answers afterwards, its first call included.
TEST(Compiled, AFailureInsideThePackageNamesItAndWhereItsCauseWent) {
  const std::string who = "perf::CompiledModel '" + package("mlp.pt2") + "': the package's run failed: ";
  const auto ref = reference("mlp", 5);
  perf::CompiledModel unchecked(package("mlp.pt2"), perf::CompiledOptions().check_inputs(false));
  PERF_EXPECT_THROW_MSG(unchecked.run({}), who + "expected inputs vector size to be 1, but got 0");
  {
    test_util::ScopedEnv checks("AOTI_RUNTIME_CHECK_INPUTS", "1");  // read at the package's first run
    perf::CompiledModel checked_by_its_code(package("mlp.pt2"), perf::CompiledOptions().check_inputs(false));
    testing::internal::CaptureStderr();
    std::string what = "no error";
    try {
      checked_by_its_code(at::randn({2, 16}, at::kDouble));
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    }
    const std::string stderr_text = testing::internal::GetCapturedStderr();
    EXPECT_EQ(what.rfind(who, 0), 0u) << what;
    if (what.find("API call failed") != std::string::npos) {  // LibTorch 2.11, 2.12: the cause on stderr, said so
      EXPECT_EQ(what.rfind(who + "run_func_(", 0), 0u) << what;
      EXPECT_NE(what.find("API call failed"), std::string::npos) << what;
      EXPECT_NE(what.find("The package's code wrote the cause to stderr just before"), std::string::npos) << what;
      EXPECT_NE(stderr_text.find("input_handles[0]: unmatched dtype"), std::string::npos) << stderr_text;
    } else {  // 2.13 and later raise the cause itself
      EXPECT_EQ(what.rfind(who + "input_handles[0]: unmatched dtype", 0), 0u) << what;
    }
    EXPECT_LE(max_diff(checked_by_its_code(ref.in[0]), ref.out[0]), 1e-5);
  }
  EXPECT_LE(max_diff(unchecked(ref.in[0]), ref.out[0]), 1e-5);
}

TEST(Compiled, InputsInAnotherLayoutAreCopiedToTheExportedOne) {
  perf::CompiledModel mlp(package("mlp.pt2"));
  const auto ref = reference("mlp", 5);
  const auto transposed = ref.in[0].t().contiguous().t();  // same values, column-major strides
  ASSERT_FALSE(transposed.is_contiguous());
  EXPECT_LE(max_diff(mlp(transposed), ref.out[0]), 1e-5);
  perf::CompiledModel cnn(package("cnn.pt2"));
  const auto cref = reference("cnn", 5);
  const auto nhwc = cref.in[0].contiguous(at::MemoryFormat::ChannelsLast);
  ASSERT_FALSE(nhwc.is_contiguous());
  EXPECT_LE(max_diff(cnn(nhwc), cref.out[0]), 1e-5);
  // Without the check, the generated code would read channels-last memory as NCHW.
  perf::CompiledModel unchecked(package("cnn.pt2"), perf::CompiledOptions().check_inputs(false));
  EXPECT_GT(max_diff(unchecked(nhwc), cref.out[0]), 1e-3) << "the unchecked path should show why the copy exists";
}

TEST(Compiled, MissingCorruptWrongNameAndCudaPackagesAreClearErrors) {
  PERF_EXPECT_THROW_MSG(perf::CompiledModel("/nonexistent/model.pt2"),
                        "cannot open '/nonexistent/model.pt2' (no such file or not readable)");
  TempDir dir;
  const auto garbage = dir / "garbage.pt2";
  std::ofstream(garbage) << "this is not a zip archive";
  PERF_EXPECT_THROW_MSG(perf::CompiledModel{garbage}, "is not a readable AOTInductor package for model 'model'");
  // A truncated package: the first half of a real one.
  const auto truncated = dir / "truncated.pt2";
  {
    std::ifstream in(package("mlp.pt2"), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(truncated, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  PERF_EXPECT_THROW_MSG(perf::CompiledModel{truncated}, "is not a readable AOTInductor package");
  PERF_EXPECT_THROW_MSG(perf::CompiledModel(package("mlp.pt2"), perf::CompiledOptions().model_name("encoder")),
                        "for model 'encoder'");
  PERF_EXPECT_THROW_MSG(perf::CompiledModel(package("mlp.pt2"), perf::CompiledOptions().runners(0)),
                        "runners must be >= 1, got 0");
  const int64_t negative = -2;
  PERF_EXPECT_THROW_MSG(
      perf::CompiledModel(package("mlp.pt2"), perf::CompiledOptions().runners(static_cast<size_t>(negative))),
      "runners must be >= 1, got -2 (a negative value, converted to size_t)");
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) {
    PERF_EXPECT_THROW_MSG(perf::CompiledModel(package("mlp_cuda_marked.pt2")),
                          "was compiled for CUDA, and this process sees no CUDA device");
  }
#else
  PERF_EXPECT_THROW_MSG(perf::CompiledModel(package("mlp_cuda_marked.pt2")),
                        "was compiled for CUDA, and this program was built without CUDA");
#endif
}

// A CPU package that computes in bfloat16, opened on a CPU without bfloat16 instructions, warns: its kernels
// emulate bf16 (bench_compiled on an AVX2 CPU: the CNN's bf16 package 7-10x slower than its fp32 one). Not on a
// CPU with them, and not for a float32 package.
TEST(Compiled, Bf16PackageOnACpuWithoutBf16InstructionsWarns) {
  using perf::detail::emulated_bf16_reason;
  perf::detail::CpuBf16 avx2, amx;
  amx.amx_bf16 = true;
  perf::CompiledInput fp32_in, bf16_in;
  bf16_in.dtype = at::kBFloat16;
  const auto why = emulated_bf16_reason({}, {fp32_in, bf16_in}, avx2);
  EXPECT_NE(why.find("it computes in bfloat16 (input 1 is BFloat16), and this CPU has no bfloat16 instructions "
                     "(avx512_bf16=no amx_bf16=no), so its bfloat16 kernels are emulated"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("export it in float32 (tools/export_compiled.py without --dtype bfloat16; for a training "
                     "step, --amp off)"),
            std::string::npos)
      << why;
  EXPECT_EQ(emulated_bf16_reason({}, {fp32_in, bf16_in}, amx), "");
  EXPECT_EQ(emulated_bf16_reason({}, {fp32_in}, avx2), "");
  // Training steps (perf::CompiledTrainStep opens packages the same way): bf16 autocast, or bf16 state.
  const auto amp = emulated_bf16_reason({{"perf.train.amp", "bf16"}}, {fp32_in}, avx2);
  EXPECT_NE(amp.find("(the step runs under bf16 autocast)"), std::string::npos) << amp;
  std::unordered_map<std::string, std::string> step = {{"perf.train.amp", "off"},
                                                       {"perf.train.state.0", "name=w kind=param dtype=float32"}};
  EXPECT_EQ(emulated_bf16_reason(step, {fp32_in}, avx2), "");
  step["perf.train.state.1"] = "name=fc.weight kind=param dtype=bfloat16";
  const auto state = emulated_bf16_reason(step, {fp32_in}, avx2);
  EXPECT_NE(state.find("(its state 'fc.weight' is BFloat16)"), std::string::npos) << state;
  EXPECT_EQ(emulated_bf16_reason(step, {fp32_in}, amx), "");

  // Opened: the MLP's package relabelled as taking a bf16 input (its metadata only; it is not run).
  TempDir dir;
  const std::string relabelled = dir / "mlp_bf16_marked.pt2";
  ASSERT_EQ(test_util::python("import zipfile\n"
                              "with zipfile.ZipFile('" +
                              package("mlp.pt2") + "') as zin, zipfile.ZipFile('" + relabelled +
                              "', 'w') as zout:\n"
                              "    for item in zin.infolist():\n"
                              "        data = zin.read(item.filename)\n"
                              "        if item.filename.endswith('_metadata.json'):\n"
                              "            data = data.replace(b'dtype=float32', b'dtype=bfloat16')\n"
                              "        zout.writestr(item, data)\n"
                              "print('relabelled')"),
            "relabelled");
  {
    const test_util::ScopedCpuBf16 cpu(/*native=*/false);
    test_util::CollectWarnings warnings;
    perf::CompiledModel model(relabelled);
    EXPECT_EQ(model.inputs().at(0).dtype, at::kBFloat16);
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_EQ(warnings.messages[0].rfind("perf::CompiledModel '" + relabelled +
                                             "': it computes in bfloat16 (input 0 is BFloat16), and this CPU has no "
                                             "bfloat16 instructions",
                                         0),
              0u)
        << warnings.messages[0];
    perf::CompiledModel fp32(package("mlp.pt2"));
    EXPECT_EQ(warnings.messages.size(), 1u) << "a float32 package: no warning";
  }
  const test_util::ScopedCpuBf16 cpu(/*native=*/true);
  test_util::CollectWarnings warnings;
  perf::CompiledModel model(relabelled);
  EXPECT_TRUE(warnings.messages.empty()) << warnings.messages[0];
}

TEST(Compiled, RunsUnderInferenceModeAndInsidePerfBenchmark) {
  perf::CompiledModel cnn(package("cnn.pt2"));
  const auto ref = reference("cnn", 5);
  {
    c10::InferenceMode guard;
    const auto x = ref.in[0].clone();
    ASSERT_TRUE(x.is_inference());
    EXPECT_LE(max_diff(cnn(x), ref.out[0]), 1e-5);
  }
  int calls = 0;
  const auto stats = perf::benchmark(
      [&] {
        cnn(ref.in[0]);
        ++calls;
      },
      perf::BenchOptions().warmup(2).iters(5));
  EXPECT_EQ(stats.iterations, 5);
  EXPECT_EQ(calls, 7);
}

namespace {

// Four threads call one model 25 times each, batch sizes 1..5 in turn: each
// caller's answer against Python eager's on the same rows.
void expect_concurrent_callers_get_their_answers(perf::CompiledModel& mlp) {
  const auto ref = reference("mlp", 5);
  std::vector<double> worst(4, 0.0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < worst.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        const int64_t b = 1 + static_cast<int64_t>((t + static_cast<size_t>(i)) % 5);
        worst[t] = std::max(worst[t], max_diff(mlp(ref.in[0].slice(0, 0, b)), ref.out[0].slice(0, 0, b)));
      }
    });
  }
  for (auto& th : threads) th.join();
  for (double w : worst) EXPECT_LE(w, 1e-5);
}

}  // namespace

// With one runner (the default) perf opens a package through LibTorch's
// single-threaded entry point: LibTorch's multi-threaded container would make
// the host wait, on CUDA, for each call's kernels before it starts the next
// (Compiled.OnGpuSingleThreadedCallsDoNotWaitForTheGpu), and with one runner it
// runs no two calls at once anyway. Several runners get the multi-threaded
// container; either can be asked for; single-threaded with several runners is
// refused, naming both ways out.
TEST(Compiled, OneRunnerRunsSingleThreadedUnlessAskedOtherwise) {
  const auto ref = reference("mlp", 5);
  const auto printed = [](const perf::CompiledModel& m) {
    std::ostringstream s;
    s << m;
    return s.str();
  };
  perf::CompiledModel plain(package("mlp.pt2"));
  EXPECT_FALSE(plain.options().single_threaded().has_value());
  EXPECT_TRUE(plain.single_threaded());
  EXPECT_NE(printed(plain).find(", single-threaded (capturable)\n"), std::string::npos) << printed(plain);
  EXPECT_LE(max_diff(plain(ref.in[0]), ref.out[0]), 1e-5);
  perf::CompiledModel shared(package("mlp.pt2"), perf::CompiledOptions().runners(2));
  EXPECT_FALSE(shared.single_threaded());
  EXPECT_NE(printed(shared).find(", multi-threaded (2 runners)\n"), std::string::npos) << printed(shared);
  perf::CompiledModel multi(package("mlp.pt2"), perf::CompiledOptions().single_threaded(false));
  EXPECT_FALSE(multi.single_threaded());
  EXPECT_NE(printed(multi).find(", multi-threaded (1 runner)\n"), std::string::npos) << printed(multi);
  EXPECT_LE(max_diff(multi(ref.in[0]), ref.out[0]), 1e-5);
  PERF_EXPECT_THROW_MSG(
      perf::CompiledModel(package("mlp.pt2"), perf::CompiledOptions().single_threaded(true).runners(2)),
      "single_threaded(true) runs one model instance, so runners(2) would not run at once; for several threads at "
      "once leave single_threaded unset (or false), for one caller leave runners at 1");
}

TEST(Compiled, ConcurrentRunsWithSeveralRunnersGiveEachCallerItsAnswer) {
  perf::CompiledModel mlp(package("mlp.pt2"), perf::CompiledOptions().runners(2));
  expect_concurrent_callers_get_their_answers(mlp);
}

// LibTorch's single-threaded entry point is "unsafe to call in a threaded
// context" (aoti_runtime/model_base.h): perf lets one call in at a time, so
// threads sharing a single-threaded model each get their own answer.
TEST(Compiled, SingleThreadedModelCalledFromSeveralThreadsGivesEachCallerItsAnswer) {
  perf::CompiledModel mlp(package("mlp.pt2"));  // one runner: single-threaded
  expect_concurrent_callers_get_their_answers(mlp);
}

// LibTorch's container folds a package's constants on its first run(), under an
// exclusive lock it takes after giving up its shared one, while a caller that
// found no free model instance waits for one with its shared lock held: more
// first callers than runners can deadlock (pytorch/pytorch#181941; torch 2.11
// has the old code). The test above, whose four threads start together there,
// did not finish in 100 s on a 16-core GPU machine; on two cores 2,000 such
// starts of LibTorch's loader never hit the window. Here a barrier starts eight
// first calls at once on fresh models, again and again; a deadlock ends the
// process after 60 s instead of hanging the suite.
TEST(Compiled, FirstCallsFromMoreThreadsThanRunnersDoNotDeadlock) {
  const auto ref = reference("mlp", 5);
  for (int trial = 0; trial < 20; ++trial) {
    perf::CompiledModel mlp(package("mlp.pt2"), perf::CompiledOptions().runners(2));
    constexpr int kThreads = 8;
    std::atomic<int> waiting{kThreads};
    std::vector<std::future<double>> calls;
    calls.reserve(kThreads);
    for (int t = 0; t < kThreads; ++t)
      calls.push_back(std::async(std::launch::async, [&] {
        waiting.fetch_sub(1);
        while (waiting.load() > 0) std::this_thread::yield();
        return max_diff(mlp(ref.in[0]), ref.out[0]);
      }));
    for (auto& call : calls) {
      if (call.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
        std::cerr << "Compiled.FirstCallsFromMoreThreadsThanRunnersDoNotDeadlock: trial " << trial
                  << ": the first calls deadlocked (no answer in 60 s)" << std::endl;
        std::_Exit(1);  // the stuck threads cannot be joined
      }
      EXPECT_LE(call.get(), 1e-5) << "trial " << trial;
    }
  }
}

TEST(Compiled, PrintsDeviceInputsAndOutputs) {
  perf::CompiledModel two(package("two_in_two_out.pt2"));
  std::ostringstream s;
  s << two;
  const auto text = s.str();
  EXPECT_NE(text.find("on cpu"), std::string::npos) << text;
  EXPECT_NE(text.find("input 0: Long [batch, 12] batch 1..64"), std::string::npos) << text;
  EXPECT_NE(text.find("input 1: Float [batch, 8] batch 1..64"), std::string::npos) << text;
  EXPECT_NE(text.find("outputs: 2"), std::string::npos) << text;
  EXPECT_NE(text.find("exported with torch 2."), std::string::npos) << text;
  EXPECT_EQ(two.metadata().at("AOTI_DEVICE_KEY"), "cpu");
}

// A package exported with --max-autotune (Inductor times its GEMM templates
// against ATen's and keeps the faster) says so when printed, and computes what
// eager Python does; one exported without it does not say so.
TEST(Compiled, AutotunedPackageSaysSoAndMatchesEager) {
  perf::CompiledModel tuned(package("mlp_autotuned.pt2"));
  perf::CompiledModel plain(package("mlp.pt2"));
  std::ostringstream a, b;
  a << tuned;
  b << plain;
  EXPECT_NE(a.str().find(", max-autotune"), std::string::npos) << a.str();
  EXPECT_EQ(b.str().find("max-autotune"), std::string::npos) << b.str();
  EXPECT_NE(a.str().find("input 0: Float [5, 16]"), std::string::npos) << a.str();
  const auto ref = reference("mlp", 5);
  EXPECT_LE(max_diff(tuned(ref.in[0]), ref.out[0]), 1e-5);
}

// An Inductor option passed through the exporter (--inductor-config KEY=VALUE;
// inductor_configs= from Python) reaches the compiler and is recorded: the MLP
// exported with cpp.simdlen=1 has kernels without SIMD (no at::vec::Vectorized
// in its generated source, where the default export has some), computes what
// eager Python does, and says so when printed. Options are checked before
// anything is compiled: an unknown name (with the near ones), one the exporter
// sets from its own arguments, a value of another type than the option's. And
// --max-autotune hands Inductor what torch.compile(mode="max-autotune") does,
// less its CUDA graphs (perf::graph captures the package), under the user's options.
TEST(Compiled, ExporterPassesInductorOptionsThroughAndRecordsThem) {
  perf::CompiledModel scalar(package("mlp_scalar.pt2"));
  perf::CompiledModel plain(package("mlp.pt2"));
  std::ostringstream a, b;
  a << scalar;
  b << plain;
  EXPECT_NE(a.str().find("\n  Inductor options: cpp.simdlen=1\n"), std::string::npos) << a.str();
  EXPECT_EQ(b.str().find("Inductor options"), std::string::npos) << b.str();
  EXPECT_EQ(scalar.metadata().at("perf.inductor_configs"), "cpp.simdlen=1");
  const auto ref = reference("mlp", 5);
  EXPECT_LE(max_diff(scalar(ref.in[0]), ref.out[0]), 1e-5);

  const auto out = test_util::lines(test_util::exporter_python(
      "for option in ('layout_optimisation=False', 'max_autotune=True', 'cpp.threads=2.5', 'cpp.threads'):\n"
      "    try:\n"
      "        e.main(['models.py:make_mlp', '-o', 'x.pt2', '--input', '4,16', '--inductor-config', option])\n"
      "    except SystemExit as x:\n"
      "        print(x)\n"
      "try:\n"
      "    e.export_train(None, print, (), 'x.pt2', inductor_configs={'fallback_random': False})\n"
      "except ValueError as x:\n"
      "    print(x)\n"
      // What the exporter hands Inductor for --max-autotune: Python's max-autotune mode less its CUDA graphs.
      "import torch\n"
      "seen = []\n"
      "torch._inductor.aoti_compile_and_package = lambda p, package_path, inductor_configs: "
      "seen.append(inductor_configs) or package_path\n"
      "e.check_cxx_runtime = lambda path: None\n"  // nothing was compiled
      "m, x = torch.nn.Linear(4, 2), torch.randn(2, 4)\n"
      "e.export_compiled(m, (x,), 'y.pt2', max_autotune=True, verify=False)\n"
      "e.export_compiled(m, (x,), 'y.pt2', max_autotune=True, inductor_configs={'coordinate_descent_tuning': "
      "False}, verify=False)\n"
      "e.export_compiled(m, (x,), 'y.pt2', verify=False)\n"
      "keys = ('max_autotune', 'coordinate_descent_tuning', 'triton.cudagraphs')\n"
      "print(' '.join('/'.join(str(c.get(k)) for k in keys) for c in seen))\n"));
  EXPECT_EQ(test_util::vectorized_mentions(package("mlp_scalar.pt2")), 0) << "cpp.simdlen=1 left SIMD code";
  // Since LibTorch 2.13 oneDNN's linear takes the MLP's bias and ReLU, leaving Inductor no loop of its own to
  // vectorize: there the option's effect shows in the training step's export only
  // (CompiledTrain.ExportedInductorOptionsReachTheStep), here in what the package records.
  if (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13) {
    EXPECT_GT(test_util::vectorized_mentions(package("mlp.pt2")), 0)
        << "the default export has no SIMD code: this test no longer shows the option's effect";
  }
  ASSERT_EQ(out.size(), 6u);
  EXPECT_NE(out[0].find("export_compiled.py: --inductor-config 'layout_optimisation' is not an option of "
                        "torch._inductor.config (did you mean layout_optimization"),
            std::string::npos)
      << out[0];
  EXPECT_NE(out[1].find("'max_autotune' is set by the exporter: use --max-autotune (max_autotune=True)"),
            std::string::npos)
      << out[1];
  EXPECT_NE(out[2].find("'cpp.threads' takes int (default -1), got 2.5"), std::string::npos) << out[2];
  EXPECT_NE(out[3].find("'cpp.threads': expected KEY=VALUE"), std::string::npos) << out[3];
  EXPECT_NE(out[4].find("inductor_configs 'fallback_random' is set by the exporter: use --inductor-random"),
            std::string::npos)
      << out[4];
  // max_autotune/coordinate_descent_tuning/triton.cudagraphs of three exports: --max-autotune, the same with
  // coordinate_descent_tuning=False given, without --max-autotune.
  EXPECT_EQ(out[5], "True/True/None True/False/None False/None/None");
}

// The exporter's command line refuses what it cannot use before anything is compiled, each time with the
// setting named and what it takes, never with a traceback: keyword arguments that are not a JSON object, a
// factory that returns no module, sizes that are not numbers, a training batch of another length than the loss
// takes, more inputs than the model's forward takes, a loss that is not one number, --device cuda where torch
// sees no GPU. From Python, a model that is not a module is a TypeError.
TEST(Compiled, ExporterRefusesBadArgumentsNamingTheSetting) {
  const std::string models = test_util::source_dir() + "/tests/compiled/models.py";
  const auto out = test_util::lines(test_util::exporter_python(
      "def refused(error, f, *args):\n"
      "    try:\n"
      "        f(*args)\n"
      "        print('accepted')\n"
      "    except error as x:\n"
      "        print(x)\n"
      "def run(*args):\n"
      "    refused(SystemExit, e.main, list(args) + ['-o', 'x.pt2'])\n"
      "m = '" +
      models +
      "'\n"
      "run(m + ':make_mlp', '--input', '4,16', '--kwargs', '{bad')\n"
      "run(m + ':make_mlp', '--input', '4,16', '--kwargs', '[1]')\n"
      "run('builtins:object', '--input', '4,16')\n"
      "run(m + ':make_mlp', '--input', '4,x')\n"
      "run(m + ':make_mlp', '--train', '--loss', m + ':classify_loss', '--input', '4,16')\n"
      "run(m + ':make_mlp', '--input', '4,16', '--input', '4,16')\n"
      "def per_sample(model, x, y):\n"
      "    return torch.nn.functional.cross_entropy(model(x), y, reduction='none')\n"
      "refused(ValueError, e.export_train, e.load_factory(m + ':make_mlp')(), per_sample, (torch.randn(4, 16), "
      "torch.zeros(4, dtype=torch.long)), 'x.pt2')\n"
      "refused(TypeError, e.export_compiled, 3, (torch.ones(1),), 'x.pt2')\n"
      "if torch.cuda.is_available():\n"
      "    print('a GPU here: --device cuda exports')\n"
      "else:\n"
      "    run(m + ':make_mlp', '--input', '4,16', '--device', 'cuda')\n"));
  ASSERT_EQ(out.size(), 9u);
  EXPECT_EQ(out[0].rfind("--kwargs must be a JSON object of the factory's keyword arguments, e.g. '{\"width\": 64}', "
                         "got '{bad' (Expecting property name",
                         0),
            0u)
      << out[0];
  EXPECT_EQ(out[1],
            "--kwargs must be a JSON object of the factory's keyword arguments, e.g. '{\"width\": 64}', got '[1]'");
  EXPECT_EQ(out[2], "FACTORY: builtins:object returned object, not a torch.nn.Module");
  EXPECT_EQ(out[3], "--input '4,x': sizes must be integers separated by commas, e.g. 8,3,224,224");
  EXPECT_EQ(out[4],
            "export_compiled.py: the loss classify_loss(model, x, y) cannot take (model, 1 batch tensor): missing a "
            "required argument: 'y'; give one example tensor (--input) per tensor it takes");
  EXPECT_EQ(out[5],
            "export_compiled.py: the model's Mlp.forward(x) cannot take 2 inputs: too many positional arguments; "
            "give one example tensor (--input) per tensor it takes");
  EXPECT_EQ(out[6], "loss must return a floating-point scalar tensor (one element), got a float32 tensor of shape [4]");
  EXPECT_EQ(out[7], "model must be a torch.nn.Module, got int");
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(out[8],
              "export_compiled.py: --device cuda needs a CUDA GPU in this Python (torch.cuda.is_available() "
              "is False): export where the package will run, or --device cpu");
  }
}

// Every package is run once on the example inputs before it is kept: a compiler that builds a wrong program
// (here a custom op whose fake kernel says contiguous where the real one returns channels-last, which
// AOTInductor's generated code does not check) is refused, with the kernel named, and the file removed.
TEST(Compiled, ExporterRefusesAWrongInferencePackageAndNamesTheKernel) {
  TempDir dir;
  const std::string pkg = dir / "lying.pt2";
  const auto out = test_util::lines(test_util::exporter_python(
      std::string(test_util::kMispredictedRelayoutOp) +
      "class M(torch.nn.Module):\n"
      "    def __init__(self):\n"
      "        super().__init__()\n"
      "        self.fc = torch.nn.Linear(20, 3)\n"
      "    def forward(self, x):\n"
      "        h = relayout(x) * 2\n"
      "        return self.fc(h[:, :, 0, :].reshape(x.shape[0], -1)), x.argmax(1)\n"
      "torch.manual_seed(0)\n"
      "x = torch.randn(2, 4, 3, 5)\n"
      "for verify in (True, False):\n"
      "    try:\n"
      "        e.export_compiled(M(), (x,), '" +
      pkg +
      "', dynamic_batch=None, verify=verify)\n"
      "        print('accepted')\n"
      "    except ValueError as err:\n"
      "        print(str(err).replace(chr(10), ' '))\n"
      "    print('kept' if os.path.exists('" +
      pkg +
      "') else 'not kept')\n"
      // The check's rule on its own: rounding passes, a misplaced value does not; an integer output (a tie
      // broken the other way) is checked for its shape only.
      "a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1])\n"
      "for got, want, dtype in (([a], [a + 0.005], torch.float32), ([b], [a], torch.bfloat16), ([b, b], [a, a], "
      "torch.float32), ([a, torch.tensor([1])], [a, torch.tensor([0])], torch.float32), ([a], [a, a], "
      "torch.float32)):\n"
      "    try:\n"
      "        e.check_compiled_outputs(got, want, dtype)\n"
      "        print('right')\n"
      "    except ValueError as err:\n"
      "        print(str(err).split(' The compiler')[0])\n"));
  ASSERT_EQ(out.size(), 9u);
  EXPECT_NE(out[0].find("the compiled model is wrong: output 0 differs from the eager model's on the example inputs: "
                        "max |difference|"),
            std::string::npos)
      << out[0];
  EXPECT_NE(out[0].find("against the model in float64, the compiled one is"), std::string::npos) << out[0];
  EXPECT_NE(out[0].find("Error in op: torch.ops.perf_test.relayout.default"), std::string::npos) << out[0];
  EXPECT_EQ(out[0].find("output 1"), std::string::npos) << "the argmax output is right: " << out[0];
  EXPECT_EQ(out[1], "not kept");
  EXPECT_EQ(out[2], "accepted");  // verify=False (--no-verify)
  EXPECT_EQ(out[3], "kept");
  EXPECT_EQ(out[4], "right");
  EXPECT_EQ(out[5], "right");  // 0.1 off in bf16: within a bf16 model's bound (0.1 of 2.1)
  EXPECT_EQ(out[6],
            "the compiled model is wrong: output 0 differs from the eager model's on the example inputs: max "
            "|difference| 0.1, max |value| 2 (allowed 0.01 of it). Also past their bounds: output 1.");
  EXPECT_EQ(out[7], "right");
  EXPECT_EQ(out[8], "the compiled model returned 1 outputs, the eager model 2");
}

// CUDA convolutions of a channels-last CNN, planned by AOTInductor as cuDNN lays them out: torch.export traces
// with cuDNN off, FakeTensorMode cached those contiguous layouts, and AOTInductor planned from the cache (the wrong
// channels-last CUDA training steps; docs/compiled-training.md). The exporter empties the cache before compiling
// (forget_export_fake_results). Shown without a GPU on fake CUDA tensors, lowered up to code
// generation for a simulated H100 (tests/compiled/simulated_cuda.py), through the exporter's own
// compile_and_package; and before that with the cache left alone, to show the plan this test would catch.
// The parameters do not require grad, as in a training package (state passed in) or a model frozen with
// requires_grad_(false): grad-requiring ones key the cache apart.
TEST(Compiled, ExporterPlansCudaConvolutionsAsCudnnLaysThemOut) {
  TempDir dir;
  const auto out = test_util::lines(test_util::simulated_cuda_python(
      // Without the fix first: in a fresh process, so that no lowering with cuDNN on has cached
      // its own (right) answer yet under the same key.
      "forget_export_fake_results = e.forget_export_fake_results\n"
      "for forget in (False, True):\n"
      "    program = sim.export_on_fake_cuda(models.make_cnn, (8, 3, 32, 32), channels_last=True)\n"
      "    e.forget_export_fake_results = forget_export_fake_results if forget else (lambda program: None)\n"
      "    plans = []\n"
      "    with sim.planned_only(e, plans):\n"
      "        e.compile_and_package(program, '" +
      (dir / "never.pt2") +
      "', {'freezing': True})\n"
      "    print(len(plans), plans[0]['layout_opt'], plans[0]['extern'].get('convolution'))\n"
      "mode = torch._subclasses.fake_tensor.FakeTensorMode()\n"
      "with mode:\n"
      "    x = torch.empty(8, 3, 32, 32, device='cuda').contiguous(memory_format=torch.channels_last)\n"
      "    w = torch.empty(16, 3, 3, 3, device='cuda').contiguous(memory_format=torch.channels_last)\n"
      "    print(torch.ops.aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1).stride())\n"));
  ASSERT_FALSE(out.empty());
  if (out[0].rfind("skipped:", 0) == 0) GTEST_SKIP() << out[0];
  ASSERT_EQ(out.size(), 3u);
  // What cuDNN returns for conv1 on channels-last inputs (its fake kernel, cuDNN on): channels-last.
  EXPECT_EQ(out[2], "(16384, 1, 512, 16)");
  // With the export's cached fake results: contiguous, the stale plan.
  EXPECT_EQ(out[0], "1 True (16384, 1024, 32, 1)");
  // Emptied first: one graph lowered, layout optimization on, conv1's output planned as cuDNN returns it.
  EXPECT_EQ(out[1], "1 True " + out[2]);
}

// A g++ that finds no libstdc++.so development link links the static libstdc++ into a package (seen on a GPU
// machine's Ubuntu g++ 13.3), and such a package crashed in std::regex when Python loaded it next to torch's
// shared runtime, the exporter's own check of every training package included. Two stand-in compilers: one that
// links the static runtime into shared libraries, and one that also finds no shared libstdc++.so.6 at all.
TEST(Compiled, ExporterLinksTheSharedCppRuntimeWhereTheCompilerWouldNot) {
#ifndef __linux__
  GTEST_SKIP() << "skipped: the package's link to the C++ runtime is checked on Linux (ELF) only";
#endif
  // The stand-in needs the static runtime to link (Fedora, say, ships it apart: libstdc++-static).
  if (test_util::output_of("g++ -print-file-name=libstdc++.a").rfind('/', 0) != 0)
    GTEST_SKIP() << "skipped: g++ has no static libstdc++.a for the stand-in compiler to link";
  TempDir dir;
  const std::string static_cxx = dir / "g++-static", blind_cxx = dir / "g++-blind";
  // Both exec the compiler Inductor would use (PERF_TEST_CXX, set below) as Inductor names it: its `-v`
  // output, which names the compiler as called, keys Inductor's vector-ISA checks, and the exporter's
  // remembered checks (remember_vec_isa_checks) then answer them. Calling plain `g++` where Inductor calls it
  // otherwise (CXX=/usr/bin/g++, say) ran the checks again: 38 s of this test's 67 on an H200 host.
  std::ofstream(static_cxx)
      << "#!/bin/sh\n"
         "case \" $* \" in *\" -shared \"*) exec \"$PERF_TEST_CXX\" \"$@\" -static-libstdc++ ;; esac\n"
         "exec \"$PERF_TEST_CXX\" \"$@\"\n";
  std::ofstream(blind_cxx)
      << "#!/bin/sh\n"
         "for a in \"$@\"; do case $a in -print-file-name=*) echo \"${a#*=}\"; exit 0 ;; esac; done\n"
         "exec "
      << static_cxx << " \"$@\"\n";
  ASSERT_EQ(::chmod(static_cxx.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(blind_cxx.c_str(), 0755), 0);
  const auto out = test_util::lines(test_util::exporter_python(
      "import zipfile\n"
      "from torch._inductor import config\n"
      // No precompiled header: Inductor keeps one per compiler path for good (about 120 MB in
      // /tmp/torchinductor_<user>), and these compilers' paths are new in every run; without one the two
      // exports take 37 s here, against 56 s with it.
      "config.aot_inductor.precompile_headers = False\n"
      "from torch._inductor.cpp_builder import get_cpp_compiler\n"
      "os.environ['PERF_TEST_CXX'] = get_cpp_compiler()\n"
      "def needs_libstdcxx(p):\n"
      "    with zipfile.ZipFile(p) as z:\n"
      "        return any('libstdc++.so.6' in e._elf_needed(z.read(n)) for n in z.namelist() if n.endswith('.so'))\n"
      "x = torch.ones(3, 16)\n"
      "config.cpp.cxx = (None, '" +
      static_cxx +
      "')\n"
      "torch.manual_seed(2)\n"
      "m = torch.nn.Linear(16, 4)\n"
      "fixed = e.export_compiled(m, (x,), '" +
      (dir / "fixed.pt2") +
      "')\n"
      "print(needs_libstdcxx(fixed))\n"
      "print(torch._inductor.aoti_load_package(fixed)(x).sum().item(), m(x).sum().item())\n"
      "config.cpp.cxx = (None, '" +
      blind_cxx +
      "')\n"
      "try:\n"
      "    e.export_compiled(m, (x,), '" +
      (dir / "blind.pt2") +
      "')\n"
      "    print('accepted')\n"
      "except RuntimeError as err:\n"
      "    print(str(err).replace(chr(10), ' '))\n"
      "print('kept' if os.path.exists('" +
      (dir / "blind.pt2") + "') else 'not kept')\n"));
  ASSERT_EQ(out.size(), 4u);
  // The exporter's package needs the shared runtime and loads; the refusal below, of the same stand-in's
  // product where the shared runtime cannot be found, shows that the stand-in links a private copy otherwise.
  EXPECT_EQ(out[0], "True");
  const auto loaded = test_util::parse_numbers(out[1]);  // the package's sum, eager's
  ASSERT_EQ(loaded.size(), 2u) << out[1];
  EXPECT_NEAR(loaded[0], loaded[1], 1e-4) << out[1];
  EXPECT_NE(out[2].find("carries its own copy of the C++ runtime"), std::string::npos) << out[2];
  EXPECT_NE(out[2].find("the compiler " + blind_cxx + " found no shared libstdc++.so to link"), std::string::npos)
      << out[2];
  EXPECT_NE(out[2].find("libstdc++-<version>-dev"), std::string::npos) << out[2];
  EXPECT_EQ(out[3], "not kept");
}

// The README's route for a model that exists only in C++: its Python twin
// (same parameter names) loads the C++ weights, written with torch::pickle_save,
// and is exported from there. Checked end to end: C++ forward == twin forward.
TEST(Compiled, CppWeightsReachThePythonTwinThroughPerfSave) {
  torch::manual_seed(3);
  auto mlp = std::make_shared<compiled_models::Mlp>();
  TempDir dir;
  const auto weights = dir / "mlp_weights.pt";
  perf::save(perf::state_dict(mlp), weights);
  const std::string src = test_util::source_dir();
  const auto out = test_util::python("import sys,torch; sys.path.insert(0,'" + src +
                                     "/tests/compiled'); "
                                     "import models; m=models.make_mlp(); "
                                     "m.load_state_dict(torch.load('" +
                                     weights +
                                     "')); "
                                     "x=torch.linspace(-2,2,32).reshape(2,16); print(*m(x).flatten().tolist())");
  const auto want = at::tensor(test_util::parse_numbers(out)).reshape({2, 4}).to(at::kFloat);
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_diff(mlp->forward(at::linspace(-2, 2, 32).reshape({2, 16})), want), 1e-6);
}

#if PERF_WITH_CUDA
namespace {
// The MLP exported as a CUDA package by the tool a user runs, on the GPU machine itself.
std::string export_cuda_mlp(const TempDir& dir) {
  return test_util::cuda_test_package(
      "mlp_cuda.pt2", test_util::compiled_models() + ":make_mlp --input 4,16 --dynamic-batch 1:64", dir);
}

// The same MLP eager in Python on the same GPU, fp32 without TF32 (the tool
// seeds 0 before the factory, as here): rows of linspace(-2, 2) inputs.
at::Tensor python_cuda_mlp(int64_t rows) {
  const std::string src = test_util::source_dir();
  const auto out = test_util::lines(test_util::python(
      "import sys,torch; sys.path.insert(0,'" + src +
      "/tests/compiled'); import models; torch.backends.cuda.matmul.allow_tf32=False; "
      "torch.backends.cudnn.allow_tf32=False; torch.manual_seed(0); m=models.make_mlp().eval().cuda(); "
      "x=torch.linspace(-2,2," +
      std::to_string(rows * 16) + ").reshape(" + std::to_string(rows) +
      ",16).cuda(); print(*m(x).flatten().tolist())"));
  return at::tensor(test_util::parse_numbers(out.at(0))).reshape({rows, 4}).to(at::kFloat);
}
}  // namespace
#endif

// Checked against the same model eager in Python on the same GPU, like with
// like: fp32 with TF32 off on both sides (perf::setup() elsewhere in the process
// may have turned it on; with TF32 a 16-wide dot product already differs by
// ~1e-4). What remains is the kernels' summation order: 1e-5.
TEST(Compiled, OnGpuCudaPackageRunsOnTheCurrentStreamAndRefusesCapture) {
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest"));
  TempDir dir;
  const auto pkg = export_cuda_mlp(dir);
  if (pkg.empty()) return;  // cuda_test_package failed or skipped the test, saying why
  perf::CompiledModel model(pkg, perf::CompiledOptions().single_threaded(false));  // LibTorch's default container
  EXPECT_TRUE(model.device().is_cuda());
  EXPECT_FALSE(model.metadata().at("AOTI_COMPUTE_CAPABILITY").empty());
  const auto want = python_cuda_mlp(3);
  const auto x = at::linspace(-2, 2, 48).reshape({3, 16}).cuda();
  EXPECT_LE(max_diff(model(x).cpu(), want), 1e-5);
  PERF_EXPECT_THROW_MSG(model(x.cpu()), "input 0 is on cpu, the package runs on cuda:0");
  // On a side stream: the output is produced on that stream (no sync with the default one).
  auto side = c10::cuda::getStreamFromPool();
  {
    c10::cuda::CUDAStreamGuard g(side);
    auto y = model(x);
    side.synchronize();
    EXPECT_LE(max_diff(y.cpu(), want), 1e-5);
  }
  // Multi-threaded (LibTorch's default; perf's with runners(n > 1)), a capture is
  // refused before the container is touched (it would poison the container's
  // completion event), naming the fix, and eager calls keep working afterwards.
  const auto x2 = (x * 0.5).contiguous();
  const auto before = model(x2).cpu();
  try {
    auto refused = perf::graph(model, x, perf::GraphOptions().warmup(1));
    ADD_FAILURE() << "capturing a multi-threaded AOTInductor package should be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Open it single-threaded to capture it (perf's default with one runner"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LE(max_diff(model(x2).cpu(), before), 0.0) << "eager calls after the refused capture";
  auto fallback = perf::graph(model, x, perf::GraphOptions().warmup(1).eager_fallback(true));
  EXPECT_FALSE(fallback.graphed());
  EXPECT_LE(max_diff(fallback(x2).cpu(), before), 0.0);
  EXPECT_LE(max_diff(model(x).cpu(), want), 1e-5);
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// A channels-last CNN whose parameters do not require grad, exported for CUDA: the model AOTInductor planned
// from torch.export's stale fake convolutions (Compiled.ExporterPlansCudaConvolutionsAsCudnnLaysThemOut shows
// the plan without a GPU). Its output equals Python eager's on the same GPU; the exporter checked the same
// before keeping it. A misplaced first convolution is off by about the output's own size.
TEST(Compiled, OnGpuChannelsLastCnnWithFrozenWeightsMatchesEager) {
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest"));
  TempDir dir;
  const auto pkg = test_util::cuda_test_package(
      "cnn_cl_frozen_cuda.pt2",
      test_util::compiled_models() + ":make_cnn_frozen --input 8,3,32,32 --dynamic-batch static --channels-last", dir);
  if (pkg.empty()) return;  // cuda_test_package failed or skipped the test, saying why
  perf::CompiledModel model(pkg);
  const auto out = test_util::lines(test_util::python(
      "import sys,torch; sys.path.insert(0,'" + test_util::source_dir() +
      "/tests/compiled'); import models; torch.backends.cuda.matmul.allow_tf32=False; "
      "torch.backends.cudnn.allow_tf32=False; torch.manual_seed(0); "
      "m=models.make_cnn_frozen().eval().cuda().to(memory_format=torch.channels_last); "
      "x=torch.linspace(-2,2,8*3*32*32).reshape(8,3,32,32).cuda().contiguous(memory_format=torch.channels_last); "
      "print(*m(x).flatten().tolist())"));
  ASSERT_FALSE(out.empty());
  const auto want = at::tensor(test_util::parse_numbers(out.at(0))).reshape({8, 10}).to(at::kFloat);
  const auto x = at::linspace(-2, 2, int64_t{8} * 3 * 32 * 32)
                     .reshape({8, 3, 32, 32})
                     .cuda()
                     .contiguous(at::MemoryFormat::ChannelsLast);
  const auto got = model(x).cpu();
  EXPECT_LE(max_diff(got, want), 1e-3 * want.abs().max().item<double>() + 1e-5)
      << "max |value| " << want.abs().max().item<double>();
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// Opened single-threaded, the package's kernels are captured by perf::graph and
// replayed: per batch bucket, with the input changing between replays, equal
// to the same package called uncaptured (the same kernels) and to Python eager.
// A package never called before is refused under capture (constant folding).
TEST(Compiled, OnGpuSingleThreadedPackageIsCapturedByPerfGraph) {
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  perf::ScopedSettings fp32(perf::Settings().tf32(false).matmul_precision("highest"));
  TempDir dir;
  const auto pkg = export_cuda_mlp(dir);
  if (pkg.empty()) return;  // cuda_test_package failed or skipped the test, saying why
  perf::CompiledModel model(pkg, perf::CompiledOptions().single_threaded(true));
  perf::CompiledModel plain(pkg, perf::CompiledOptions().single_threaded(false));  // uncaptured: the reference
  const auto example = at::zeros({8, 16}, at::kCUDA);
  {
    // Never run before: its first call would fold the package's constants into
    // memory from the graph's pool. Refused before the container is touched;
    // the same model then runs and is captured after a warm-up.
    perf::CompiledModel fresh(pkg, perf::CompiledOptions().single_threaded(true));
    PERF_EXPECT_THROW_MSG(perf::graph(fresh, example, perf::GraphOptions().warmup(0)),
                          "its first call folds the package's constants into new device memory");
    EXPECT_LE(max_diff(fresh(example).cpu(), plain(example).cpu()), 1e-6);
    auto later = perf::graph(fresh, example, perf::GraphOptions().warmup(0));
    ASSERT_TRUE(later.graphed());
    const auto x = at::randn({8, 16}, at::kCUDA);
    EXPECT_LE(max_diff(later(x).cpu(), plain(x).cpu()), 1e-6);
  }
  auto graphed = perf::graph(model, example, perf::GraphOptions().batch_sizes({1, 4, 8}));
  ASSERT_TRUE(graphed.graphed());
  double worst = 0;
  for (int i = 0; i < 60; ++i) {
    const int64_t b = 1 + i % 8;
    const auto x = at::randn({b, 16}, at::kCUDA);
    const auto y = graphed(x);
    ASSERT_EQ(y.size(0), b);
    worst = std::max(worst, max_diff(y.cpu(), plain(x).cpu()));
  }
  EXPECT_LE(worst, 1e-6) << "a replay runs the package's own kernels";
  const auto x = at::linspace(-2, 2, 48).reshape({3, 16}).cuda();
  EXPECT_LE(max_diff(graphed(x).cpu(), python_cuda_mlp(3)), 1e-5);
  // Uncaptured calls of the same single-threaded model still work between replays.
  EXPECT_LE(max_diff(model(x).cpu(), plain(x).cpu()), 1e-6);
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// A CUDA call only launches the package's kernels on the current stream. Behind
// about a second of GPU work (a sleep kernel), two calls of a single-threaded
// model (perf's default with one runner) return while that work still runs.
// LibTorch's multi-threaded container waits, once its one runner has been used,
// for the previous run's completion event before it starts the next
// (cudaEventSynchronize in model_container.h's reclaim_finished_models): its
// second call returns only after the sleep, a host sync in every call of a loop,
// which is why perf opens one runner single-threaded. No timing race: the sleep
// is hundreds of times longer than the calls' host time.
TEST(Compiled, OnGpuSingleThreadedCallsDoNotWaitForTheGpu) {
#if PERF_WITH_CUDA
  if (!torch::cuda::is_available()) GTEST_SKIP() << "skipped: no CUDA device on this machine";
  TempDir dir;
  const auto pkg = export_cuda_mlp(dir);
  if (pkg.empty()) return;  // cuda_test_package failed or skipped the test, saying why
  // perf's default: one runner, single-threaded.
  perf::CompiledModel single(pkg);
  perf::CompiledModel multi(pkg, perf::CompiledOptions().single_threaded(false));
  ASSERT_TRUE(single.single_threaded());
  const auto x = at::randn({8, 16}, at::kCUDA);
  const auto want = multi(x).cpu();  // the first calls fold the constants
  single(x);
  at::cuda::sleep(1000);  // the sleep kernel loaded
  c10::cuda::device_synchronize();
  const int64_t cycles = 2'000'000'000;  // 0.4 s at 5 GHz, faster than any GPU clock; about 1 s on an H100
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::cuda::CUDAEvent slept;
  at::cuda::sleep(cycles);
  slept.record(stream);
  const auto a = single(x);
  const auto b = single(x);
  EXPECT_FALSE(slept.query()) << "a single-threaded call waited for the GPU";
  EXPECT_LE(max_diff(b.cpu(), want), 1e-6);
  c10::cuda::device_synchronize();
  at::cuda::sleep(cycles);
  slept.record(stream);
  multi(x);  // its runner's last run has finished: no wait
  EXPECT_FALSE(slept.query()) << "the multi-threaded container's first call waited";
  const auto c = multi(x);  // waits for the previous run's event, behind the sleep
  EXPECT_TRUE(slept.query()) << "LibTorch's multi-threaded container no longer waits for its runner's last run: "
                                "README 'Compiled models' says it does";
  EXPECT_LE(max_diff(c.cpu(), want), 1e-6);
#else
  GTEST_SKIP() << "skipped: perf built without CUDA (PERF_WITH_CUDA=0)";
#endif
}

// A package exported the way PyTorch's docs show (torch.export +
// aoti_compile_and_package, no perf metadata) is checked too, from the input
// checks inductor generates into it: a 4-channel image for a 3-channel CNN is
// refused (it once ran and returned numbers), the right input runs and equals
// eager, an NHWC input is re-laid-out. A package with nothing to read specs
// from is refused unless the caller opts out of checks.
TEST(Compiled, PackagesWithoutPerfMetadataAreCheckedFromTheirGeneratedCode) {
  perf::CompiledModel plain(package("cnn_plain.pt2"));
  EXPECT_EQ(plain.inputs_from(), "generated code");
  ASSERT_EQ(plain.inputs().size(), 1u);
  EXPECT_EQ(plain.inputs()[0].sizes, (std::vector<int64_t>{-1, 3, 32, 32}));
  EXPECT_EQ(plain.inputs()[0].dtype, at::kFloat);
  PERF_EXPECT_THROW_MSG(plain(at::randn({6, 4, 32, 32})),
                        "input 0 has shape [6, 4, 32, 32], the package was exported for [batch, 3, 32, 32]");
  PERF_EXPECT_THROW_MSG(plain(at::randn({6, 3, 32, 32}, at::kDouble)), "input 0 has dtype Double");
  PERF_EXPECT_THROW_MSG(plain(at::randn({3, 32, 32})), "input 0 has shape [3, 32, 32]");
  const auto ref = reference("cnn", 5);
  EXPECT_LE(max_diff(plain(ref.in[0]), ref.out[0]), 1e-5);
  EXPECT_LE(max_diff(plain(ref.in[0].contiguous(at::MemoryFormat::ChannelsLast)), ref.out[0]), 1e-5);
  // Batches up to the export's 64 run, beyond what the generated range checks say (2..15 in torch 2.11).
  const auto big = ref.in[0].repeat({12, 1, 1, 1}).slice(0, 0, 64);
  EXPECT_LE(max_diff(plain(big).slice(0, 0, 5), ref.out[0]), 1e-5);
  std::ostringstream s;
  s << plain;
  EXPECT_NE(s.str().find("inputs as the package's generated code checks them"), std::string::npos) << s.str();

  PERF_EXPECT_THROW_MSG(perf::CompiledModel(package("cnn_plain_nosource.pt2")), "carries no input specs perf can read");
  perf::CompiledModel unchecked(package("cnn_plain_nosource.pt2"), perf::CompiledOptions().check_inputs(false));
  EXPECT_TRUE(unchecked.inputs().empty());
  EXPECT_LE(max_diff(unchecked(ref.in[0]), ref.out[0]), 1e-5) << "unchecked, at the caller's risk";
  // perf's own packages: their metadata, which the generated checks agree with.
  perf::CompiledModel cnn(package("cnn.pt2"));
  EXPECT_EQ(cnn.inputs_from(), "perf metadata");
  const auto generated = perf::detail::specs_from_generated_code(package("cnn.pt2"), "model", 1);
  ASSERT_TRUE(generated.has_value());
  EXPECT_EQ(generated->at(0).sizes, cnn.inputs()[0].sizes);
  EXPECT_EQ(generated->at(0).dtype, cnn.inputs()[0].dtype);
}
