#include <perf/perf.h>

#include <iostream>

int main(int argc, char** argv) {
  const perf::Report r = perf::setup();
  std::cout << r;
  const int expect_cuda = argc > 1 ? std::atoi(argv[1]) : -1;
  if (expect_cuda >= 0 && expect_cuda != PERF_WITH_CUDA) {
    std::cerr << "PERF_WITH_CUDA=" << PERF_WITH_CUDA << ", expected " << expect_cuda << "\n";
    return 1;
  }
  if (r.at("matmul_precision").read_back != "high") return 1;
  std::cout << "consumer ok (PERF_WITH_CUDA=" << PERF_WITH_CUDA << ")\n";
  return 0;
}
