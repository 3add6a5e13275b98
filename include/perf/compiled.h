// perf/compiled.h — what torch.compile's ahead-of-time compiler (AOTInductor)
// gives C++: perf::CompiledModel runs inference packages, perf::CompiledTrainStep
// runs compiled training steps. tools/export_compiled.py writes both kinds.
#pragma once

#include <perf/compiled_model.h>
#include <perf/compiled_train_step.h>
