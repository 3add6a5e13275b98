// What perf::setup() costs: the first (cold) call in a process, then warm calls.
#include <benchmark/benchmark.h>
#include <perf/perf.h>

#include <chrono>
#include <iostream>

namespace {

void BM_setup_warm(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(perf::setup());
}

void BM_scoped_settings(benchmark::State& state) {
  for (auto _ : state) {
    perf::ScopedSettings guard(perf::Settings().deterministic(true).num_threads(1));
    benchmark::DoNotOptimize(&guard);
  }
}

void BM_environment(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(perf::environment());
}

}  // namespace

int main(int argc, char** argv) {
  // Cold: the first call pays for LibTorch's lazy initialisation (thread pools,
  // CUDA device queries). It happens once per process, so it is timed once.
  const auto t0 = std::chrono::steady_clock::now();
  perf::Report r = perf::setup();  // not const: Google Benchmark >= 1.8 deprecates DoNotOptimize(const T&)
  const double cold_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "perf::setup() cold (first call in this process): " << cold_us << " us\n";
  benchmark::DoNotOptimize(r);
  // Registered here, not by BENCHMARK() at static initialisation: CI compiles perf's programs as one
  // translation unit (PERF_PROGRAMS_UNITY), and every program would then carry these benchmarks.
  benchmark::RegisterBenchmark("BM_setup_warm", BM_setup_warm);
  benchmark::RegisterBenchmark("BM_scoped_settings", BM_scoped_settings);
  benchmark::RegisterBenchmark("BM_environment", BM_environment);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
