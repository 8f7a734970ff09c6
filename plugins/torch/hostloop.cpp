// The GPU host's replay of a run of prepared calls in one native call (rrto_plugins.torch.batch).
//
// The Python replay loop spends 10-25 us around each operator (binding ids, the store, the
// checks, the call through OpOverload); a replayed inference of a detector is over a thousand
// calls. A run of calls that return only tensors (and write in place only what they return) is
// replayed here instead: the operators are called through the dispatcher with their recorded
// arguments and this inference's tensors, without the GIL, with the same per-output checks as
// the Python path (the output stays inside its storage; it is laid out as the app's proxy
// describes it). The run stops before the first call that raises or fails a check, or whose
// output differs from the calibrated layout (in a *bounded* run, whose sizes follow the data:
// whose new outputs take more bytes than its cap): the caller steps through that call and the
// rest (``step``: one call at a time, each admitted for its own sizes), and the Python path
// reports what went wrong. Nothing here decides what may run: every call was prepared by the executor
// from the allowlist, and the bytes it allocates were admitted by the caller.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// Where a tensor argument goes and where it comes from.
struct Hole {
  int arg;     // index in the schema's arguments
  int item;    // index in that argument's list; -1: the argument itself
  int source;  // >= 0: an external tensor; < 0: value -(source + 1) the run made (in order)
};

// The layout the app's proxy describes for an output.
struct Layout {
  std::vector<int64_t> shape, stride;
  bool dense;  // it spans exactly its elements
};

struct Call {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // per schema argument; holes hold undefined tensors
  std::vector<Hole> holes;
  std::vector<Layout> layouts;  // per output
  // The outputs as calibrated (sizes, strides): a run whose outputs differ stops there.
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> seen;
};

struct Signature {
  at::ScalarType dtype;
  at::Device device;
  std::vector<int64_t> sizes, strides;
  int64_t offset;

  explicit Signature(const at::Tensor& t)
      : dtype(t.scalar_type()),
        device(t.device()),
        sizes(t.sizes().vec()),
        strides(t.strides().vec()),
        offset(t.storage_offset()) {}

  bool matches(const at::Tensor& t) const {
    return t.defined() && t.layout() == at::kStrided && t.scalar_type() == dtype &&
           t.device() == device && t.storage_offset() == offset && t.sizes().equals(sizes) &&
           t.strides().equals(strides);
  }
};

// rrto_plugins.torch.bounds.check_view for a strided tensor: every element it can reach lies
// inside its storage.
bool inside_storage(const at::Tensor& t) {
  if (t.layout() != at::kStrided) return false;  // the Python path checks (or refuses) others
  const int64_t offset = t.storage_offset();
  if (offset < 0) return false;
  int64_t low = offset, high = offset;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return true;  // no element at all
    if (strides[d] >= 0)
      high += (sizes[d] - 1) * strides[d];
    else
      low += (sizes[d] - 1) * strides[d];
  }
  if (!t.has_storage()) return false;
  const int64_t elements =
      static_cast<int64_t>(t.storage().nbytes()) / static_cast<int64_t>(t.element_size());
  return low >= 0 && high < elements;
}

// executor._conform: the output copied into the recorded layout where the kernel laid a dense
// result out otherwise (a meta decomposition and a device kernel can disagree on strides).
at::Tensor conform(const at::Tensor& t, const Layout& l) {
  const auto strides = t.strides();
  if (strides.equals(l.stride) || !t.sizes().equals(l.shape) || !l.dense) return t;
  if (strides.size() != l.stride.size() || t.numel() <= 1) return t;
  bool same = true;
  for (size_t d = 0; d < l.shape.size(); ++d)
    if (l.shape[d] != 1 && strides[d] != l.stride[d]) same = false;
  if (same) return t;
  return at::empty_strided(l.shape, l.stride, t.options()).copy_(t);
}

// A recorded argument as the operator takes it. A Python number where the schema says Tensor
// (``x * 0.5``, ``x / 2``) becomes the tensor Python's argument parser makes of it: a 0-dim
// *wrapped number*, which type promotion treats as a Python scalar (an int64 tensor times 0.5
// is float32, not float64), so the loop computes what the one-by-one path does.
c10::IValue argument(const py::handle& value, const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType &&
      (PyBool_Check(value.ptr()) || PyLong_Check(value.ptr()) || PyFloat_Check(value.ptr()))) {
    at::Scalar number = PyBool_Check(value.ptr())   ? at::Scalar(value.cast<bool>())
                        : PyLong_Check(value.ptr()) ? at::Scalar(value.cast<int64_t>())
                                                    : at::Scalar(value.cast<double>());
    at::Tensor t = at::scalar_to_tensor(number);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  }
  return torch::jit::toIValue(value, type);
}

// Now, on the clock of Python's ``time.monotonic`` (CLOCK_MONOTONIC on Linux, as
// ``steady_clock``), in seconds.
double monotonic() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A time ``on_call`` returned: a Python float, else none (0).
double deadline(const py::object& when) {
  return PyFloat_Check(when.ptr()) ? PyFloat_AS_DOUBLE(when.ptr()) : 0;
}

class Batch {
 public:
  // One call: the operator's schema name and overload, its arguments in schema order (Python
  // values; a hole's place holds any tensor), then per hole (argument, item, source), and per
  // output the recorded layout (shape, stride, dense).
  void add(const std::string& name, const std::string& overload, const py::list& values,
           const py::list& defaulted, const std::vector<std::tuple<int, int, int>>& holes,
           const std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, bool>>& outs) {
    Call c{c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()),
           {}, {}, {}, {}};
    for (const auto& [shape, stride, dense] : outs) c.layouts.push_back(Layout{shape, stride, dense});
    const auto& schema = c.op.schema();
    const auto& arguments = schema.arguments();
    TORCH_CHECK(values.size() == arguments.size(), name, ": ", values.size(),
                " values for ", arguments.size(), " arguments");
    TORCH_CHECK(!c.layouts.empty(), name, ": no output");
    for (const auto& r : schema.returns()) {
      const auto kind = r.type()->kind();
      TORCH_CHECK(kind == c10::TypeKind::TensorType ||
                  (kind == c10::TypeKind::ListType &&
                   r.type()->containedType(0)->kind() == c10::TypeKind::TensorType),
                  name, ": returns more than tensors");
    }
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (defaulted[i].cast<bool>()) {
        TORCH_CHECK(arguments[i].default_value().has_value(), name, ": argument ",
                    arguments[i].name(), " has no default");
        c.args.push_back(*arguments[i].default_value());
      } else {
        c.args.push_back(argument(values[i], arguments[i].type()));
      }
    }
    for (const auto& [arg, item, source] : holes) {
      TORCH_CHECK(arg >= 0 && static_cast<size_t>(arg) < c.args.size(), name, ": bad hole");
      TORCH_CHECK(source >= 0 ? source < externals_ : -(source + 1) < values_,
                  name, ": a hole's source is not before it");
      if (item >= 0) {
        TORCH_CHECK(c.args[arg].isList() && item < static_cast<int>(c.args[arg].toListRef().size()),
                    name, ": bad list hole");
        c.args[arg].toList().set(item, c10::IValue(at::Tensor()));  // held by no template
      } else {
        c.args[arg] = c10::IValue();
      }
      c.holes.push_back(Hole{arg, item, source});
    }
    values_ += static_cast<int>(c.layouts.size());
    calls_.push_back(std::move(c));
  }

  void set_externals(int n) {
    TORCH_CHECK(calls_.empty(), "externals are set before calls");
    externals_ = n;
  }

  // Every call stepped with these external tensors: their metadata, and the outputs' layouts
  // each step saw, are what later runs must match (the caller admitted their bytes per call
  // from the same sizes).
  void calibrate(const std::vector<at::Tensor>& externals) {
    TORCH_CHECK(static_cast<int>(externals.size()) == externals_, "calibrate: externals");
    for (const Call& c : calls_) TORCH_CHECK(!c.seen.empty(), "calibrate: a call not stepped");
    expected_.clear();
    for (const auto& t : externals) expected_.emplace_back(t);
    calibrated_ = true;
  }

  bool calibrated() const { return calibrated_; }

  // Call ``j`` with its tensors given (a calibrating run, one call at a time): its checked,
  // conformed outputs (their layouts kept for ``calibrate``), or None where it raised or
  // failed a check.
  std::optional<std::vector<at::Tensor>> step(size_t j, const std::vector<at::Tensor>& tensors) {
    TORCH_CHECK(j < calls_.size(), "step: no call ", j);
    Call& c = calls_[j];
    TORCH_CHECK(tensors.size() == c.holes.size(), "step: one tensor per hole");
    calibrated_ = false;  // until ``calibrate`` says every call was stepped with these sizes
    std::vector<at::Tensor> outs;
    {
      py::gil_scoped_release no_gil;
      c10::InferenceMode guard(true);
      if (!invoke(c, [&](size_t h) -> const at::Tensor& { return tensors[h]; }, outs))
        return std::nullopt;
    }
    c.seen.clear();
    for (const auto& t : outs) c.seen.emplace_back(t.sizes().vec(), t.strides().vec());
    return outs;
  }

  // The whole run with these external tensors: (calls run, the values they made, in order,
  // the copies taken). It stops before a call that raised or failed a check, and runs nothing
  // when an external tensor is not as calibrated. ``caps`` (one per call, or none): a run
  // whose sizes follow the data (a detector's per-class loop), *bounded* instead of
  // calibrated: any external sizes, any output sizes, but it stops before a call whose new
  // outputs take more bytes than its cap (the most it allocated when stepped; the caller
  // admitted their sum). ``drops``: (call, value) pairs in call
  // order: the value is let go of once that call ran (the app released it, and nothing after
  // that call reads it), so that later calls reuse its memory, as the one-by-one path frees
  // it; it comes back undefined. ``copies``: (call, hole) pairs in call order: that tensor is
  // copied just before the call writes it in place (an abort before the call restores it), as
  // (call, tensor, copy). ``notify``: calls, in order, after which ``on_call(call, outputs)``
  // is called with the GIL (the app waits for their answer: it goes out before the run ends).
  // ``on_call`` may return a time (seconds of CLOCK_MONOTONIC, Python's ``time.monotonic``)
  // by which replies it holds for the stream must go: if the run is still going then, it
  // calls ``on_call(-1, [])`` between two calls, which returns the next such time (0 or
  // None: nothing held). So an answer held to share a message is never kept waiting behind
  // the rest of a long run.
  std::tuple<int, std::vector<at::Tensor>, std::vector<std::tuple<int, at::Tensor, at::Tensor>>>
  run(const std::vector<at::Tensor>& externals, const std::vector<std::pair<int, int>>& drops,
      const std::vector<std::pair<int, int>>& copies, const std::vector<int>& notify,
      const py::object& on_call, const std::vector<int64_t>& caps) {
    std::vector<at::Tensor> outs;
    std::vector<std::tuple<int, at::Tensor, at::Tensor>> copied;
    const bool bounded = !caps.empty();
    TORCH_CHECK(!bounded || caps.size() == calls_.size(), "run: one cap per call");
    if ((!bounded && !calibrated_) || static_cast<int>(externals.size()) != externals_)
      return {0, std::move(outs), std::move(copied)};
    for (size_t e = 0; e < externals.size(); ++e)
      if (bounded ? !externals[e].defined() : !expected_[e].matches(externals[e]))
        return {0, std::move(outs), std::move(copied)};
    outs.reserve(values_);
    py::gil_scoped_release no_gil;
    c10::InferenceMode guard(true);
    int done = 0;
    size_t next_drop = 0, next_copy = 0, next_notify = 0;
    double due = 0;  // when ``on_call`` wants to be asked again (0: never)
    for (const Call& c : calls_) {
      if (due > 0 && monotonic() >= due) {
        py::gil_scoped_acquire gil;
        due = deadline(on_call(-1, std::vector<at::Tensor>()));
      }
      const size_t before = outs.size();
      auto tensor = [&](size_t h) -> const at::Tensor& {
        const int s = c.holes[h].source;
        return s >= 0 ? externals[s] : outs[-(s + 1)];
      };
      const size_t copies_before = copied.size();
      for (; next_copy < copies.size() && copies[next_copy].first <= done; ++next_copy) {
        const int h = copies[next_copy].second;
        if (copies[next_copy].first < done || h < 0 || static_cast<size_t>(h) >= c.holes.size())
          continue;
        const at::Tensor& t = tensor(h);
        if (t.defined()) copied.emplace_back(done, t, t.clone());
      }
      bool ok = invoke(c, tensor, outs);
      if (bounded) {
        ok = ok && new_bytes(c, tensor, outs, before) <= caps[done];
      } else {
        for (size_t o = 0; ok && o < c.seen.size(); ++o)
          ok = outs[before + o].sizes().equals(c.seen[o].first) &&
               outs[before + o].strides().equals(c.seen[o].second);
      }
      if (!ok) {  // nothing of it is kept: what it may have written is written back
        outs.resize(before);
        for (size_t i = copies_before; i < copied.size(); ++i)
          std::get<1>(copied[i]).copy_(std::get<2>(copied[i]));
        copied.resize(copies_before);
        break;
      }
      for (; next_notify < notify.size() && notify[next_notify] <= done; ++next_notify) {
        if (notify[next_notify] < done) continue;
        py::gil_scoped_acquire gil;
        std::vector<at::Tensor> made(outs.begin() + before, outs.end());
        due = deadline(on_call(done, made));  // never raises (the caller's callback catches)
      }
      for (; next_drop < drops.size() && drops[next_drop].first <= done; ++next_drop) {
        const int v = drops[next_drop].second;
        if (v >= 0 && static_cast<size_t>(v) < outs.size()) outs[v] = at::Tensor();
      }
      ++done;
    }
    return {done, std::move(outs), std::move(copied)};
  }

 private:
  // Bytes of the storages a call's outputs (``outs`` from ``first``) took that are none of its
  // tensor arguments' (views and in-place results take none), each storage once.
  template <typename Tensors>
  static int64_t new_bytes(const Call& c, Tensors tensor, const std::vector<at::Tensor>& outs,
                           size_t first) {
    int64_t n = 0;
    for (size_t o = first; o < outs.size(); ++o) {
      const at::Tensor& out = outs[o];
      if (!out.has_storage()) continue;
      bool old = false;
      for (size_t h = 0; h < c.holes.size() && !old; ++h) {
        const at::Tensor& t = tensor(h);
        old = t.defined() && t.has_storage() && out.storage().is_alias_of(t.storage());
      }
      for (size_t p = first; p < o && !old; ++p)
        old = outs[p].has_storage() && outs[p].storage().is_alias_of(out.storage());
      if (!old) n += static_cast<int64_t>(out.storage().nbytes());
    }
    return n;
  }

  // Run one call, appending its checked, conformed outputs to ``outs`` (false, with ``outs``
  // possibly longer, where it raised or failed a check).
  template <typename Tensors>
  bool invoke(const Call& c, Tensors tensor, std::vector<at::Tensor>& outs) const {
    torch::jit::Stack stack(c.args);
    std::vector<bool> copied(stack.size(), false);
    for (size_t h = 0; h < c.holes.size(); ++h) {
      const Hole& hole = c.holes[h];
      const at::Tensor& t = tensor(h);
      if (!t.defined()) return false;
      if (hole.item < 0) {
        stack[hole.arg] = t;
      } else {
        if (!copied[hole.arg]) {  // the template's list stays as recorded
          stack[hole.arg] = c10::IValue(stack[hole.arg].toList().copy());
          copied[hole.arg] = true;
        }
        stack[hole.arg].toList().set(hole.item, t);
      }
    }
    try {
      c.op.callBoxed(stack);
    } catch (const std::exception&) {
      return false;  // the Python path runs it again and says what went wrong
    }
    const size_t first = outs.size();
    for (const auto& v : stack) {  // a tuple's tensors, or one list of them
      if (v.isTensor()) {
        outs.push_back(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) outs.push_back(t);
      } else {
        return false;
      }
    }
    if (outs.size() - first != c.layouts.size()) return false;
    for (size_t o = 0; o < c.layouts.size(); ++o) {
      at::Tensor& out = outs[first + o];
      if (!out.defined() || !inside_storage(out)) return false;
      out = conform(out, c.layouts[o]);
    }
    return true;
  }

  std::vector<Call> calls_;
  std::vector<Signature> expected_;
  int externals_ = 0;
  int values_ = 0;  // outputs of all calls
  bool calibrated_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rrtod's native host replay loop (rrto_plugins.torch.batch)";
  py::class_<Batch>(m, "Batch")
      .def(py::init<>())
      .def("set_externals", &Batch::set_externals)
      .def("add", &Batch::add)
      .def("calibrate", &Batch::calibrate)
      .def("calibrated", &Batch::calibrated)
      .def("step", &Batch::step)
      .def("run", &Batch::run, py::arg("externals"), py::arg("drops"), py::arg("copies"),
           py::arg("notify"), py::arg("on_call"), py::arg("caps") = std::vector<int64_t>());
}
