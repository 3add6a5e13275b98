"""Export the CompiledModel tests' packages and their eager references into OUT.

Exporting takes about a minute per model on 2 cores, so results are cached under
$PERF_CACHE_DIR (default ~/.cache/perf), keyed on the sources and torch's version.
Writes OUT/<name>.pt2 and OUT/<name>.ref.pt (inputs and eager outputs for batch 1
and 5, read back by tests/test_compiled.cpp), OUT/mlp_cuda_marked.pt2 (the MLP
package relabelled as a CUDA one) and OUT/stamp.
"""
import argparse
import hashlib
import io
import os
import shutil
import sys
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "export_compiled.py")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(TOOL))
import models  # noqa: E402
from export_compiled import export_compiled  # noqa: E402

# name -> (factory, example inputs for one sample (batch dim added), dynamic batch)
def specs():
    return {
        "mlp": (models.make_mlp, lambda b: (torch.randn(b, 16),)),
        "cnn": (models.make_cnn, lambda b: (torch.randn(b, 3, 32, 32),)),
        "two_in_two_out": (models.make_two_in_two_out,
                           lambda b: (torch.randint(0, 50, (b, 12)), torch.randn(b, 8))),
    }


def cache_key() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for f in (TOOL, os.path.join(HERE, "models.py"), __file__):
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def build(out: str) -> None:
    for name, (factory, make_inputs) in specs().items():
        torch.manual_seed(0)
        model = factory().eval()
        torch.manual_seed(1)
        ref = {}
        with torch.no_grad():
            for b in (1, 5):
                xs = make_inputs(b)
                ys = model(*xs)
                ys = list(ys) if isinstance(ys, tuple) else [ys]
                ref[f"b{b}_in"] = list(xs)
                ref[f"b{b}_out"] = ys
        torch.save(ref, os.path.join(out, f"{name}.ref.pt"))
        export_compiled(model, make_inputs(4), os.path.join(out, f"{name}.pt2"), dynamic_batch=(1, 64))
    # A CUDA package without compiling one: the MLP with its device key changed.
    src, dst = os.path.join(out, "mlp.pt2"), os.path.join(out, "mlp_cuda_marked.pt2")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("wrapper_metadata.json"):
                data = data.replace(b'"AOTI_DEVICE_KEY": "cpu"', b'"AOTI_DEVICE_KEY": "cuda"')
                assert b'"cuda"' in data, data
            zout.writestr(item, data)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    cache_root = os.environ.get("PERF_CACHE_DIR", os.path.expanduser("~/.cache/perf"))
    cached = os.path.join(cache_root, "aoti-test-packages", cache_key())
    if not os.path.exists(os.path.join(cached, "stamp")):
        tmp = cached + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        build(tmp)
        open(os.path.join(tmp, "stamp"), "w").write(torch.__version__ + "\n")
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
        print(f"exported test packages into {cached}")
    else:
        print(f"test packages from the cache {cached}")
    os.makedirs(a.out, exist_ok=True)
    for f in os.listdir(cached):
        shutil.copy2(os.path.join(cached, f), os.path.join(a.out, f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
