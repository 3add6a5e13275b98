// perf::perf_static: the definitions of every perf header, compiled once.
// Built with PERF_SEPARATE_COMPILATION (the CMake target sets it for this file
// and for every target that links perf::perf_static; see perf/config.h).
#ifndef PERF_SEPARATE_COMPILATION
#error "src/perf.cpp is the body of perf::perf_static: build it with PERF_SEPARATE_COMPILATION defined"
#endif

#include <perf/impl/advise-inl.h>
#include <perf/impl/amp-inl.h>
#include <perf/impl/attention-inl.h>
#include <perf/impl/bench-inl.h>
#include <perf/impl/compiled_model-inl.h>
#include <perf/impl/compiled_train_step-inl.h>
#include <perf/impl/cuda_graph-inl.h>
#include <perf/impl/data-inl.h>
#include <perf/impl/distributed-inl.h>
#include <perf/impl/environment-inl.h>
#include <perf/impl/gpu_monitor-inl.h>
#include <perf/impl/lr_scheduler-inl.h>
#include <perf/impl/memory-inl.h>
#include <perf/impl/memory_format-inl.h>
#include <perf/impl/model-inl.h>
#include <perf/impl/muon-inl.h>
#include <perf/impl/optim-inl.h>
#include <perf/impl/profile-inl.h>
#include <perf/impl/progress-inl.h>
#include <perf/impl/setup-inl.h>
#include <perf/impl/state_dict-inl.h>
#include <perf/impl/swa_utils-inl.h>
