// perf/state_dict.h — model weights to and from Python's torch.save files.
//
//   // weights trained in Python (torch.save(model.state_dict(), "resnet.pt")) into the C++ model
//   perf::load_state_dict(model, perf::load("resnet.pt"));
//   // and back: in Python, model.load_state_dict(torch.load("trained.pt"))
//   perf::save(perf::state_dict(model), "trained.pt");
//   // a whole checkpoint, torch.save({"model": model.state_dict(), "epoch": 3}, "ckpt.pt")
//   auto ckpt = perf::load("ckpt.pt").toGenericDict();
//   perf::load_state_dict(model, ckpt.at("model"));
//   // and its optimizer and scaler, as Python's: opt.load_state_dict(ckpt.at("optim")) (perf/optim.h, amp.h)
//
// LibTorch's own torch::save/torch::load write and read a TorchScript archive
// that Python's torch.load does not read, and LibTorch's torch::pickle_load
// fails on a Python state_dict (an OrderedDict: pytorch/pytorch#100741). These
// read and write the file torch.save writes, with the names of Python's
// state_dict(): LibTorch's modules name their parameters and buffers as
// PyTorch's do, so a C++ model and its Python twin share one file.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <perf/config.h>
#include <perf/module.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace perf {

/// Python's `module.state_dict()`: every parameter and buffer by its dotted
/// name, in Python's order (a module's own parameters, then its own buffers,
/// then each child's, depth first), detached; a tensor registered under two
/// names (tied weights) is there under both, as in Python.
c10::Dict<std::string, at::Tensor> state_dict(ModuleRef module);

/// What `load_state_dict(..., /*strict=*/false)` left out (Python's
/// `_IncompatibleKeys`): names the module has and the state lacks, and the
/// other way round.
struct IncompatibleKeys {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};
std::ostream& operator<<(std::ostream& os, const IncompatibleKeys& keys);

/// Python's `module.load_state_dict(state, strict)`: `state` is a dict of name
/// -> tensor (what perf::load returns for a saved state_dict, or
/// perf::state_dict of another module). Each tensor is copied into the
/// module's tensor of that name, which keeps its own dtype and device (as
/// Python's `copy_`). Everything is checked before anything is copied: a
/// shape that differs, or a value that is not a tensor, is refused naming it
/// (with or without `strict`); with `strict`, so is a missing or unexpected
/// name. Python copies what it can before it raises; here a refused state
/// leaves the module as it was.
IncompatibleKeys load_state_dict(ModuleRef module, const c10::IValue& state, bool strict = true);

/// An empty dict of any key and value (Python's `{}`), for a checkpoint of
/// several things: `auto ckpt = perf::dict(); ckpt.insert("epoch", 3);`.
/// c10::Dict<std::string, c10::IValue> cannot be built empty by its
/// default constructor.
c10::impl::GenericDict dict();

/// Writes `value` as Python's `torch.save(value, path)` does: a zip archive
/// whose pickle Python's `torch.load(path)` reads with its default
/// `weights_only=True`. Tensors (any device; a storage shared by several is
/// written once, as Python does, so views and tied weights stay shared), dicts
/// (c10::Dict, GenericDict: Python dicts), lists, tuples, int, double, complex,
/// bool, string (a Python str where it is UTF-8 text, Python bytes where it is
/// not), None. The file is written beside `path` and renamed over it at the
/// end, so an earlier checkpoint at `path` survives a failed save.
void save(const c10::IValue& value, const std::string& path);

/// Reads a file written by Python's `torch.save` (or perf::save), as Python's
/// `torch.load(path, map_location="cpu")` with its default `weights_only=True`
/// does: dicts (OrderedDict too) as GenericDict in their order, lists, tuples,
/// tensors (on the CPU, in their saved dtype; storages shared in the file stay
/// shared), parameters as tensors, numbers (complex too), strings, bytes and
/// bytearray (a string of the bytes), bool, None, torch.Size (a tuple), sets
/// (a list of the items), Counter (a dict), torch.device and dtypes. A Python
/// object of any other class (an argparse.Namespace, a numpy array) is refused
/// naming its class, as Python's default refuses it; so are quantized, sparse
/// and nested tensors (Python reads them; perf reads dense tensors). Files of
/// the format before PyTorch 1.6 (not a zip archive: torchvision's older
/// weights) are read too, as Python reads them.
c10::IValue load(const std::string& path);

}  // namespace perf

#ifdef PERF_HEADER_ONLY
#include <perf/impl/state_dict-inl.h>
#endif
