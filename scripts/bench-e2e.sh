#!/usr/bin/env bash
# End-to-end: Python PyTorch (eager, recipe, torch.compile) against C++ (stock
# LibTorch, perf) on the same training jobs; table and charts into docs/.
#   bash scripts/bench-e2e.sh [--quick] [--device cuda] [--jobs cnn,transformer,mlp] [--full] [--repeat N]
# --quick: CI-sized (about 10 minutes on a 2-core CPU). --repeat N: every configuration N times, in
# rounds; the table gives the median run (a VM's speed varies by 10-15% between runs). PERF_PYTHON: the Python
# (default: the venv that provides LibTorch; matplotlib is installed into it if missing). PERF_DOCS_SUFFIX=avx2: the
# page is docs/e2e-<device>-avx2.md, for a kind of CPU whose page should not replace the main one (scripts/common.sh).
source "$(dirname "$0")/common.sh"
python=${PERF_PYTHON:-${PERF_TORCH_PREFIX%/lib/python*}/bin/python}
"$python" -c "import matplotlib" 2>/dev/null ||
  "$python" -m pip install --quiet --disable-pip-version-check matplotlib >&2
perf_configure build --log-level=ERROR >/dev/null
cmake --build build --target e2e >/dev/null
device=cpu
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do [[ ${args[i]} == --device ]] && device=${args[i + 1]}; done
kind=${device%%:*}
"$python" bench/e2e/run.py --e2e build/bench/e2e --out "bench-results/e2e-$kind" "$@"
# The run's rows are kept in docs/runs/ (report.py --keep), from which a later report can write a job's section.
"$python" bench/e2e/report.py "bench-results/e2e-$kind/results.jsonl" --docs docs \
  --name "e2e-$kind${PERF_DOCS_SUFFIX:+-$PERF_DOCS_SUFFIX}" --machine "$(perf_machine "$kind")" --keep docs/runs \
  --command "bash scripts/bench-e2e.sh $*"
