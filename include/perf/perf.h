// perf — everything: include this, call perf::setup() first.
#pragma once

#include <perf/config.h>
#include <perf/setup.h>
