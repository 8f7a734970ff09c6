// The shim's hot path in C++ (rrto_plugins.torch.hotpath): a replayed call that meets a step
// already seen, exactly as it met it, answered without the general path's Python.
//
// ``hotpath.HotPath._step`` is the specification, and the fallback where this is not built:
// every check here is one of its checks, in the same order, and anything it does not accept
// returns None having changed nothing (the call then takes the general path, which decides).
// Only after every check passed does it commit, as the general path commits: the proxy, its
// handle, the replay's position and counters, pending releases, the end of the sequence, and
// the call's journal entry (``journal.Journal.add`` for a result that is one proxy).
//
// Plain CPython API, no torch headers: the objects it works on are Python objects, and the
// module builds in seconds. Errors before the commit are cleared (the general path runs);
// after it they propagate, as they would from Python.

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <ctime>

#define RRTO_CONCAT2(a, b) a##b
#define RRTO_CONCAT(a, b) RRTO_CONCAT2(a, b)
#define RRTO_STR2(a) #a
#define RRTO_STR(a) RRTO_STR2(a)

namespace {

// Interned attribute names, made once at import.
struct Names {
  PyObject *lost, *give_up, *active, *joined, *timing, *base, *seq, *fast, *position, *root,
      *failed, *local, *rrto_handle, *id, *bindings, *steps, *replayed_ops, *hot, *released,
      *release_now, *ended, *full, *calls, *hash, *replay_shim_ns, *replay_timed, *session,
      *counters, *shim_ns, *ops, *sized, *strides, *dispatch;
};
Names N;

bool intern_names() {
  struct Item {
    PyObject** slot;
    const char* text;
  };
  const Item items[] = {
      {&N.lost, "lost"},
      {&N.give_up, "_give_up"},
      {&N.active, "active"},
      {&N.joined, "joined"},
      {&N.timing, "timing"},
      {&N.base, "base"},
      {&N.seq, "seq"},
      {&N.fast, "fast"},
      {&N.position, "position"},
      {&N.root, "root"},
      {&N.failed, "failed"},
      {&N.local, "local"},
      {&N.rrto_handle, "_rrto_handle"},
      {&N.id, "id"},
      {&N.bindings, "bindings"},
      {&N.steps, "steps"},
      {&N.replayed_ops, "replayed_ops"},
      {&N.hot, "hot"},
      {&N.released, "released"},
      {&N.release_now, "release_now"},
      {&N.ended, "ended"},
      {&N.full, "full"},
      {&N.calls, "_calls"},
      {&N.hash, "hash"},
      {&N.replay_shim_ns, "replay_shim_ns"},
      {&N.replay_timed, "replay_timed"},
      {&N.session, "session"},
      {&N.counters, "counters"},
      {&N.shim_ns, "shim_ns"},
      {&N.ops, "ops"},
      {&N.sized, "sized"},
      {&N.strides, "strides"},
      {&N.dispatch, "dispatch"},
  };
  for (const Item& item : items) {
    *item.slot = PyUnicode_InternFromString(item.text);
    if (*item.slot == nullptr) return false;
  }
  return true;
}

// A reference released at the end of its scope.
class Ref {
 public:
  explicit Ref(PyObject* p = nullptr) : p_(p) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p_); }
  PyObject* get() const { return p_; }
  PyObject* release() {
    PyObject* p = p_;
    p_ = nullptr;
    return p;
  }
  void reset(PyObject* p) {
    Py_XDECREF(p_);
    p_ = p;
  }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  PyObject* p_;
};

// Fast's items (hotpath.Fast, a NamedTuple).
enum FastItem { F_FUNC, F_INFO, F_GRAD, F_COUNT, F_TENSORS, F_PLAIN, F_LISTS, F_ALIAS, F_LOCAL,
                F_SHAPE, F_RANK, F_LAYOUT, F_SIZE };
// A tensor check's kinds (hotpath.PRODUCED, BOUND, CONSTANT).
enum Kind { PRODUCED = 0, BOUND = 1, CONSTANT = 2 };

struct Hot {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject *session, *replay, *journal, *tls;
  // containers that live as long as the session (never rebound): read per call
  PyObject *assigning, *late, *diverged, *broken, *sizes, *session_counters, *replay_counters;
  PyObject *remote_type, *handle_type, *make, *is_inference, *is_grad;
  PyObject *plain_types, *token, *id_mark, *persistent_mark;
  long long release_at, max_calls;
  long grad_enabled, no_grad, inference_mode;
  double share;
  uint64_t rng;
};

PyObject* env_item(PyObject* env, const char* key) {
  PyObject* v = PyDict_GetItemString(env, key);  // borrowed
  if (v == nullptr) {
    PyErr_Format(PyExc_KeyError, "shimstep: missing %s", key);
    return nullptr;
  }
  Py_INCREF(v);
  return v;
}

bool truthy_attr(PyObject* obj, PyObject* name, int* out) {
  Ref v(PyObject_GetAttr(obj, name));
  if (!v) return false;
  int t = PyObject_IsTrue(v.get());
  if (t < 0) return false;
  *out = t;
  return true;
}

bool add_to(PyObject* counter, PyObject* key, long long delta) {
  PyObject* old = PyDict_GetItemWithError(counter, key);  // borrowed
  long long v = 0;
  if (old != nullptr) {
    v = PyLong_AsLongLong(old);
    if (v == -1 && PyErr_Occurred()) return false;
  } else if (PyErr_Occurred()) {
    return false;
  }
  Ref n(PyLong_FromLongLong(v + delta));
  return n && PyDict_SetItem(counter, key, n.get()) == 0;
}

long long long_attr(PyObject* obj, PyObject* name, bool* ok) {
  Ref v(PyObject_GetAttr(obj, name));
  if (!v || !PyLong_CheckExact(v.get())) {
    *ok = false;
    return 0;
  }
  long long r = PyLong_AsLongLong(v.get());
  if (r == -1 && PyErr_Occurred()) *ok = false;
  return r;
}

uint64_t next_random(Hot* self) {  // xorshift64*: which calls are timed
  uint64_t x = self->rng;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  self->rng = x;
  return x * 2685821657736338717ULL;
}

long long thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// ``hotpath.grad_mode``.
bool grad_mode(Hot* self, long* out) {
  Ref inf(PyObject_CallNoArgs(self->is_inference));
  if (!inf) return false;
  if (inf.get() == Py_True) {
    *out = self->inference_mode;
    return true;
  }
  Ref grad(PyObject_CallNoArgs(self->is_grad));
  if (!grad) return false;
  *out = grad.get() == Py_True ? self->grad_enabled : self->no_grad;
  return true;
}

// ``journal._token`` for the arguments the hot path accepts; anything else goes to it.
PyObject* token(Hot* self, PyObject* x) {
  PyTypeObject* t = Py_TYPE(x);
  int plain = PySet_Contains(self->plain_types, reinterpret_cast<PyObject*>(t));
  if (plain < 0) return nullptr;
  if (plain) return Py_NewRef(x);
  if (t == &PyList_Type || t == &PyTuple_Type) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
    PyObject** items = PySequence_Fast_ITEMS(x);
    for (Py_ssize_t k = 0; k < n; k++) {
      int p = PySet_Contains(self->plain_types, reinterpret_cast<PyObject*>(Py_TYPE(items[k])));
      if (p < 0) return nullptr;
      if (!p) return PyObject_CallOneArg(self->token, x);
    }
    return t == &PyTuple_Type ? Py_NewRef(x) : PyList_GetSlice(x, 0, n);
  }
  if (PyObject_TypeCheck(x, reinterpret_cast<PyTypeObject*>(self->remote_type))) {
    Ref h(PyObject_GetAttr(x, N.rrto_handle));
    if (!h) return nullptr;
    Ref hash(PyObject_GetAttr(h.get(), N.hash));
    if (!hash) return nullptr;
    if (hash.get() == Py_None) {
      Ref id(PyObject_GetAttr(h.get(), N.id));
      if (!id) return nullptr;
      return PyTuple_Pack(2, self->id_mark, id.get());
    }
    return PyTuple_Pack(2, self->persistent_mark, h.get());
  }
  return PyObject_CallOneArg(self->token, x);
}

// ``Journal.add(func, args, {}, result)`` for a result that is one proxy with id ``out``.
bool journal_add(Hot* self, PyObject* func, PyObject* args, PyObject* out) {
  int full;
  if (!truthy_attr(self->journal, N.full, &full)) return false;
  if (full) return true;
  Ref calls(PyObject_GetAttr(self->journal, N.calls));
  if (!calls || !PyList_Check(calls.get())) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "shimstep: journal._calls");
    return false;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  Ref tokens(PyList_New(n));
  if (!tokens) return false;
  for (Py_ssize_t k = 0; k < n; k++) {
    PyObject* tk = token(self, PyTuple_GET_ITEM(args, k));
    if (tk == nullptr) return false;
    PyList_SET_ITEM(tokens.get(), k, tk);
  }
  Ref outs(PyList_New(1));
  if (!outs) return false;
  PyList_SET_ITEM(outs.get(), 0, Py_NewRef(out));
  Ref entry(PyTuple_Pack(4, func, tokens.get(), Py_None, outs.get()));
  if (!entry || PyList_Append(calls.get(), entry.get()) < 0) return false;
  if (PyList_GET_SIZE(calls.get()) >= self->max_calls &&
      PyObject_SetAttr(self->journal, N.full, Py_True) < 0)
    return false;
  return true;
}

// The checks: the step's Fast (new reference, with act, seq and the base), or nullptr with no
// exception when the general path must answer (nullptr with one: a real error, cleared by the
// caller before the commit).
struct Matched {
  Ref act, seq, fast, result;
  long long base = 0, position = 0;
  Py_ssize_t steps = 0;
  bool sized = false;  // the result has the sizes the host pushed
};

// C-contiguous strides of ``dims`` (``codec.contiguous_strides``), or nullptr (no exception)
// where they overflow: no tensor has those sizes.
PyObject* contiguous_strides(PyObject* dims) {
  Py_ssize_t n = PyTuple_GET_SIZE(dims);
  Ref out(PyTuple_New(n));
  if (!out) return nullptr;
  long long step = 1;
  for (Py_ssize_t k = n - 1; k >= 0; k--) {
    long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(dims, k));
    if (size == -1 && PyErr_Occurred()) return nullptr;
    PyObject* v = PyLong_FromLongLong(step);
    if (v == nullptr) return nullptr;
    PyTuple_SET_ITEM(out.get(), k, v);
    if (k > 0 && __builtin_mul_overflow(step, size > 1 ? size : 1, &step)) return nullptr;
  }
  return out.release();
}

// The call's result, made before anything changes (``HotPath._step``): the argument written
// in place, or a new proxy of the recorded layout or of the sizes the host pushed. nullptr
// with no exception: the general path answers.
bool make_result(Hot* self, PyObject* args, Matched* m) {
  PyObject* f = m->fast.get();
  long alias = PyLong_AsLong(PyTuple_GET_ITEM(f, F_ALIAS));
  if (alias == -1 && PyErr_Occurred()) return false;
  if (alias >= 0) {
    if (alias >= PyTuple_GET_SIZE(args)) return false;
    PyObject* target = PyTuple_GET_ITEM(args, alias);
    Ref h(PyObject_GetAttr(target, N.rrto_handle));
    if (!h) return false;
    Ref local(PyObject_GetAttr(h.get(), N.local));
    if (!local || local.get() != Py_None) return false;  // a value the robot made
    m->result.reset(Py_NewRef(target));
    return true;
  }
  PyObject* shape = PyTuple_GET_ITEM(f, F_SHAPE);
  Ref layout;
  Ref dims;
  if (shape != Py_None) {
    dims.reset(Py_NewRef(shape));
    layout.reset(Py_NewRef(PyTuple_GET_ITEM(f, F_LAYOUT)));
  } else {
    Ref base(PyLong_FromLongLong(m->base));
    if (!base) return false;
    PyObject* known = PyDict_GetItemWithError(self->sizes, base.get());  // borrowed
    if (known == nullptr || !PyDict_Check(known)) return false;
    Ref position(PyLong_FromLongLong(m->position));
    if (!position) return false;
    PyObject* got = PyDict_GetItemWithError(known, position.get());  // borrowed
    if (got == nullptr || !PyTuple_CheckExact(got)) return false;
    dims.reset(Py_NewRef(got));
    long rank = PyLong_AsLong(PyTuple_GET_ITEM(f, F_RANK));
    if (PyTuple_GET_SIZE(dims.get()) != rank) return false;
    Ref strides(contiguous_strides(dims.get()));
    if (!strides) return false;
    layout.reset(PyDict_Copy(PyTuple_GET_ITEM(f, F_LAYOUT)));
    if (!layout || PyDict_SetItem(layout.get(), N.strides, strides.get()) < 0) return false;
    m->sized = true;
  }
  Ref make_args(PyTuple_Pack(2, self->remote_type, dims.get()));
  if (!make_args) return false;
  m->result.reset(PyObject_Call(self->make, make_args.get(), layout.get()));
  return static_cast<bool>(m->result);  // (sizes no tensor can have: the general path)
}

bool check(Hot* self, PyObject* func, PyObject* args, Matched* m) {
  int t;
  if (PyDict_GET_SIZE(self->assigning) || PySet_GET_SIZE(self->late) ||
      PySet_GET_SIZE(self->diverged))
    return false;
  Ref lost(PyObject_GetAttr(self->session, N.lost));
  if (!lost || lost.get() != Py_None) return false;
  if (!truthy_attr(self->replay, N.give_up, &t) || t) return false;
  m->act.reset(PyObject_GetAttr(self->tls, N.active));
  if (!m->act) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
    return false;
  }
  PyObject* act = m->act.get();
  if (act == Py_None) return false;
  Ref joined(PyObject_GetAttr(act, N.joined));
  if (!joined || joined.get() != Py_None) return false;
  Ref timing(PyObject_GetAttr(act, N.timing));
  if (!timing || timing.get() != Py_None) return false;
  Ref base(PyObject_GetAttr(act, N.base));
  if (!base || !PyLong_CheckExact(base.get())) return false;
  if (PyDict_GET_SIZE(self->broken)) {
    int in = PyDict_Contains(self->broken, base.get());
    if (in != 0) return false;
  }
  m->base = PyLong_AsLongLong(base.get());
  if (m->base == -1 && PyErr_Occurred()) return false;
  m->seq.reset(PyObject_GetAttr(act, N.seq));
  if (!m->seq) return false;
  PyObject* seq = m->seq.get();
  Ref fast(PyObject_GetAttr(seq, N.fast));
  if (!fast || !PyList_Check(fast.get())) return false;
  bool ok = true;
  m->position = long_attr(act, N.position, &ok);
  if (!ok || m->position < 0 || m->position >= PyList_GET_SIZE(fast.get())) return false;
  PyObject* f = PyList_GET_ITEM(fast.get(), m->position);
  if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) != F_SIZE) return false;  // None, False
  m->fast.reset(Py_NewRef(f));
  if (PyTuple_GET_ITEM(f, F_FUNC) != func) return false;
  long count = PyLong_AsLong(PyTuple_GET_ITEM(f, F_COUNT));
  if (count == -1 && PyErr_Occurred()) return false;
  if (PyTuple_GET_SIZE(args) != count) return false;
  if (!truthy_attr(PyTuple_GET_ITEM(f, F_INFO), N.local, &t) || t) return false;
  Ref root(PyObject_GetAttr(seq, N.root));
  if (!root) return false;
  if (!truthy_attr(root.get() == Py_None ? seq : root.get(), N.failed, &t) || t) return false;
  long gm;
  if (!grad_mode(self, &gm)) return false;
  long want = PyLong_AsLong(PyTuple_GET_ITEM(f, F_GRAD));
  if (want != gm) return false;
  // plain arguments: exactly the recorded types (items too), and equal
  PyObject* plain = PyTuple_GET_ITEM(f, F_PLAIN);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(plain); k++) {
    PyObject* p = PyTuple_GET_ITEM(plain, k);
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(p, 0));
    if (i < 0 || i >= PyTuple_GET_SIZE(args)) return false;
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (reinterpret_cast<PyObject*>(Py_TYPE(a)) != PyTuple_GET_ITEM(p, 2)) return false;
    PyObject* item_types = PyTuple_GET_ITEM(p, 3);
    if (item_types != Py_None) {
      if (!PyList_CheckExact(a) && !PyTuple_CheckExact(a)) return false;
      Py_ssize_t n = PySequence_Fast_GET_SIZE(a);  // a list or tuple: its recorded type
      if (!PyTuple_Check(item_types) || PyTuple_GET_SIZE(item_types) != n) return false;
      PyObject** items = PySequence_Fast_ITEMS(a);
      for (Py_ssize_t j = 0; j < n; j++)
        if (reinterpret_cast<PyObject*>(Py_TYPE(items[j])) != PyTuple_GET_ITEM(item_types, j))
          return false;
    }
    if (PyObject_RichCompareBool(a, PyTuple_GET_ITEM(p, 1), Py_EQ) != 1) return false;
  }
  // lists that hold tensors: of the recorded type and length, their other items as recorded
  PyObject* lists = PyTuple_GET_ITEM(f, F_LISTS);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(lists); k++) {
    PyObject* l = PyTuple_GET_ITEM(lists, k);
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(l, 0));
    if (i < 0 || i >= PyTuple_GET_SIZE(args)) return false;
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (reinterpret_cast<PyObject*>(Py_TYPE(a)) != PyTuple_GET_ITEM(l, 1)) return false;
    if (!PyList_CheckExact(a) && !PyTuple_CheckExact(a)) return false;
    if (PySequence_Fast_GET_SIZE(a) != PyLong_AsSsize_t(PyTuple_GET_ITEM(l, 2))) return false;
    PyObject** items = PySequence_Fast_ITEMS(a);
    PyObject* others = PyTuple_GET_ITEM(l, 3);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(others); j++) {
      PyObject* o = PyTuple_GET_ITEM(others, j);
      Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(o, 0));
      if (at < 0 || at >= PySequence_Fast_GET_SIZE(a)) return false;
      if (reinterpret_cast<PyObject*>(Py_TYPE(items[at])) != PyTuple_GET_ITEM(o, 2)) return false;
      if (PyObject_RichCompareBool(items[at], PyTuple_GET_ITEM(o, 1), Py_EQ) != 1) return false;
    }
  }
  // tensor arguments: this inference's outputs, the bound weights, the recorded constants
  Ref bindings(PyObject_GetAttr(seq, N.bindings));
  if (!bindings || !PyDict_Check(bindings.get())) return false;
  PyObject* tensors = PyTuple_GET_ITEM(f, F_TENSORS);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(tensors); k++) {
    PyObject* c = PyTuple_GET_ITEM(tensors, k);
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(c, 0));
    if (i < 0 || i >= PyTuple_GET_SIZE(args)) return false;
    PyObject* a = PyTuple_GET_ITEM(args, i);
    Py_ssize_t item = PyLong_AsSsize_t(PyTuple_GET_ITEM(c, 1));
    if (item >= 0) {  // an item of a list checked above
      if ((!PyList_CheckExact(a) && !PyTuple_CheckExact(a)) ||
          item >= PySequence_Fast_GET_SIZE(a))
        return false;
      a = PySequence_Fast_ITEMS(a)[item];
    }
    if (!PyObject_TypeCheck(a, reinterpret_cast<PyTypeObject*>(self->remote_type))) return false;
    Ref h(PyObject_GetAttr(a, N.rrto_handle));
    if (!h) return false;
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(c, 2));
    PyObject* aux = PyTuple_GET_ITEM(c, 3);
    if (kind == BOUND) {
      PyObject* bound = PyDict_GetItemWithError(bindings.get(), aux);  // borrowed
      if (bound != h.get()) return false;
      continue;
    }
    long long id = long_attr(h.get(), N.id, &ok);
    if (!ok) return false;
    long long want_id = PyLong_AsLongLong(aux);
    if (want_id == -1 && PyErr_Occurred()) return false;
    if (kind == PRODUCED) want_id += m->base;
    else if (kind != CONSTANT) return false;
    if (id != want_id) return false;
  }
  Ref steps(PyObject_GetAttr(seq, N.steps));
  if (!steps || !PyList_Check(steps.get())) return false;
  m->steps = PyList_GET_SIZE(steps.get());
  return make_result(self, args, m);
}

// Matched: make the proxy and move on, as ``ReplayClient.dispatch`` and ``_advance`` do.
PyObject* commit(Hot* self, PyObject* func, PyObject* args, Matched* m) {
  PyObject* f = m->fast.get();
  Ref result(m->result.release());
  Ref id;
  long alias = PyLong_AsLong(PyTuple_GET_ITEM(f, F_ALIAS));
  if (alias == -1 && PyErr_Occurred()) return nullptr;
  if (alias >= 0) {
    Ref h(PyObject_GetAttr(result.get(), N.rrto_handle));
    if (!h) return nullptr;
    id.reset(PyObject_GetAttr(h.get(), N.id));
    if (!id) return nullptr;
  } else {
    long long local = PyLong_AsLongLong(PyTuple_GET_ITEM(f, F_LOCAL));
    if (local == -1 && PyErr_Occurred()) return nullptr;
    id.reset(PyLong_FromLongLong(m->base + local));
    if (!id) return nullptr;
    Ref handle(PyObject_CallFunctionObjArgs(self->handle_type, self->session, id.get(),
                                            nullptr));
    if (!handle || PyObject_SetAttr(result.get(), N.rrto_handle, handle.get()) < 0)
      return nullptr;
  }
  Ref next(PyLong_FromLongLong(m->position + 1));
  if (!next || PyObject_SetAttr(m->act.get(), N.position, next.get()) < 0) return nullptr;
  if ((m->sized && !add_to(self->replay_counters, N.sized, 1)) ||
      !add_to(self->replay_counters, N.replayed_ops, 1) ||
      !add_to(self->replay_counters, N.hot, 1))
    return nullptr;
  // ``RemoteSession.release_now(RELEASE_STREAM_AT)``, called only when it would send
  Ref released(PyObject_GetAttr(self->session, N.released));
  if (!released) return nullptr;
  Py_ssize_t pending = PyObject_Length(released.get());
  if (pending < 0) return nullptr;
  if (pending >= self->release_at) {
    Ref at(PyLong_FromLongLong(self->release_at));
    if (!at) return nullptr;
    Ref r(PyObject_CallMethodOneArg(self->session, N.release_now, at.get()));
    if (!r) return nullptr;
  }
  if (m->position + 1 == m->steps) {
    Ref r(PyObject_CallMethodOneArg(self->replay, N.ended, m->act.get()));
    if (!r) return nullptr;
  }
  if (!journal_add(self, func, args, id.get())) return nullptr;
  return result.release();
}

PyObject* hot_call(PyObject* op, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  Hot* self = reinterpret_cast<Hot*>(op);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != 2 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames)) ||
      !PyTuple_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "HotPath(func, args: tuple)");
    return nullptr;
  }
  bool timed = static_cast<double>(next_random(self) >> 11) * 0x1.0p-53 < self->share;
  long long t0 = timed ? thread_ns() : 0;
  Matched m;
  if (!check(self, argv[0], argv[1], &m)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* result = commit(self, argv[0], argv[1], &m);
  if (result != nullptr && timed) {
    if (!add_to(self->session_counters, N.replay_shim_ns, thread_ns() - t0) ||
        !add_to(self->session_counters, N.replay_timed, 1)) {
      Py_DECREF(result);
      return nullptr;
    }
  }
  return result;
}

int hot_init(PyObject* op, PyObject* args, PyObject* kwargs) {
  Hot* self = reinterpret_cast<Hot*>(op);
  PyObject* env;
  if (!PyArg_ParseTuple(args, "O!:HotPath", &PyDict_Type, &env)) return -1;
  struct Item {
    PyObject** slot;
    const char* key;
  };
  const Item items[] = {
      {&self->session, "session"},       {&self->replay, "replay"},
      {&self->journal, "journal"},       {&self->tls, "tls"},
      {&self->assigning, "assigning"},   {&self->late, "late"},
      {&self->diverged, "diverged"},     {&self->broken, "broken"},
      {&self->sizes, "sizes"},
      {&self->session_counters, "session_counters"},
      {&self->replay_counters, "replay_counters"},
      {&self->remote_type, "remote_type"}, {&self->handle_type, "handle_type"},
      {&self->make, "make"},             {&self->is_inference, "is_inference"},
      {&self->is_grad, "is_grad"},       {&self->plain_types, "plain_types"},
      {&self->token, "token"},           {&self->id_mark, "id_mark"},
      {&self->persistent_mark, "persistent_mark"},
  };
  for (const Item& item : items) {
    PyObject* v = env_item(env, item.key);
    if (v == nullptr) return -1;
    Py_XSETREF(*item.slot, v);
  }
  if (!PyDict_Check(self->assigning) || !PyAnySet_Check(self->late) ||
      !PyAnySet_Check(self->diverged) || !PyDict_Check(self->broken) ||
      !PyDict_Check(self->sizes) ||
      !PyDict_Check(self->session_counters) || !PyDict_Check(self->replay_counters) ||
      !PyAnySet_Check(self->plain_types) || !PyType_Check(self->remote_type)) {
    PyErr_SetString(PyExc_TypeError, "shimstep: an environment item has the wrong type");
    return -1;
  }
  const char* numbers[] = {"release_at", "max_calls", "grad_enabled", "no_grad",
                           "inference_mode", "seed"};
  long long values[6];
  for (int k = 0; k < 6; k++) {
    PyObject* v = PyDict_GetItemString(env, numbers[k]);
    if (v == nullptr) {
      PyErr_Format(PyExc_KeyError, "shimstep: missing %s", numbers[k]);
      return -1;
    }
    values[k] = PyLong_AsLongLong(v);
    if (values[k] == -1 && PyErr_Occurred()) return -1;
  }
  self->release_at = values[0];
  self->max_calls = values[1];
  self->grad_enabled = static_cast<long>(values[2]);
  self->no_grad = static_cast<long>(values[3]);
  self->inference_mode = static_cast<long>(values[4]);
  self->rng = static_cast<uint64_t>(values[5]) | 1;
  PyObject* share = PyDict_GetItemString(env, "share");
  if (share == nullptr) {
    PyErr_SetString(PyExc_KeyError, "shimstep: missing share");
    return -1;
  }
  self->share = PyFloat_AsDouble(share);
  if (self->share == -1.0 && PyErr_Occurred()) return -1;
  self->vectorcall = hot_call;
  return 0;
}

int hot_traverse(PyObject* op, visitproc visit, void* arg) {
  Hot* self = reinterpret_cast<Hot*>(op);
  Py_VISIT(self->session);
  Py_VISIT(self->replay);
  Py_VISIT(self->journal);
  Py_VISIT(self->tls);
  Py_VISIT(self->assigning);
  Py_VISIT(self->late);
  Py_VISIT(self->diverged);
  Py_VISIT(self->broken);
  Py_VISIT(self->sizes);
  Py_VISIT(self->session_counters);
  Py_VISIT(self->replay_counters);
  Py_VISIT(self->remote_type);
  Py_VISIT(self->handle_type);
  Py_VISIT(self->make);
  Py_VISIT(self->is_inference);
  Py_VISIT(self->is_grad);
  Py_VISIT(self->plain_types);
  Py_VISIT(self->token);
  Py_VISIT(self->id_mark);
  Py_VISIT(self->persistent_mark);
  return 0;
}

int hot_clear(PyObject* op) {
  Hot* self = reinterpret_cast<Hot*>(op);
  Py_CLEAR(self->session);
  Py_CLEAR(self->replay);
  Py_CLEAR(self->journal);
  Py_CLEAR(self->tls);
  Py_CLEAR(self->assigning);
  Py_CLEAR(self->late);
  Py_CLEAR(self->diverged);
  Py_CLEAR(self->broken);
  Py_CLEAR(self->sizes);
  Py_CLEAR(self->session_counters);
  Py_CLEAR(self->replay_counters);
  Py_CLEAR(self->remote_type);
  Py_CLEAR(self->handle_type);
  Py_CLEAR(self->make);
  Py_CLEAR(self->is_inference);
  Py_CLEAR(self->is_grad);
  Py_CLEAR(self->plain_types);
  Py_CLEAR(self->token);
  Py_CLEAR(self->id_mark);
  Py_CLEAR(self->persistent_mark);
  return 0;
}

void hot_dealloc(PyObject* op) {
  PyObject_GC_UnTrack(op);
  hot_clear(op);
  Py_TYPE(op)->tp_free(op);
}

PyObject* hot_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* op = type->tp_alloc(type, 0);
  if (op != nullptr) reinterpret_cast<Hot*>(op)->vectorcall = nullptr;
  return op;
}

PyObject* hot_tp_call(PyObject* op, PyObject* args, PyObject* kwargs) {
  Hot* self = reinterpret_cast<Hot*>(op);
  if (self->vectorcall == nullptr) {
    PyErr_SetString(PyExc_TypeError, "HotPath not initialised");
    return nullptr;
  }
  return PyVectorcall_Call(op, args, kwargs);
}

PyTypeObject HotType = {PyVarObject_HEAD_INIT(nullptr, 0)};

long long monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// ``RemoteTensor.__torch_dispatch__`` (``classmethod(Dispatch(general))``): a call whose first
// argument is a proxy of a session with a native hot path, and no keyword arguments, asks the
// hot path first and, where it declines, the session's ``dispatch``, as ``general`` (the
// Python one) does; every other call goes to ``general``. Counted as ``general`` counts:
// ``ops`` and ``shim_ns`` (wall time) in the session's counters.
struct Dispatch {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject *general, *remote_type;
};

PyObject* dispatch_call(PyObject* op, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  Dispatch* self = reinterpret_cast<Dispatch*>(op);
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  // (cls, func, types, args, kwargs), all positional, as torch calls it
  if (kwnames == nullptr && nargs >= 4 && PyTuple_Check(argv[3]) && PyTuple_GET_SIZE(argv[3]) &&
      (nargs == 4 || argv[4] == Py_None || (PyDict_Check(argv[4]) && !PyDict_GET_SIZE(argv[4]))) &&
      PyObject_TypeCheck(PyTuple_GET_ITEM(argv[3], 0),
                         reinterpret_cast<PyTypeObject*>(self->remote_type))) {
    long long t0 = monotonic_ns();
    Ref h(PyObject_GetAttr(PyTuple_GET_ITEM(argv[3], 0), N.rrto_handle));
    Ref session(h ? PyObject_GetAttr(h.get(), N.session) : nullptr);
    Ref hot(session ? PyObject_GetAttr(session.get(), N.hot) : nullptr);
    if (hot && Py_TYPE(hot.get()) == &HotType) {
      PyObject* call[2] = {argv[1], argv[3]};
      PyObject* result = hot_call(hot.get(), call, 2, nullptr);
      if (result == Py_None) {
        // declined: ``session.dispatch(func, args, kwargs or {})``, as the Python one
        // calls it after its own try of the hot path (not asked twice)
        Py_DECREF(result);
        Ref kwargs(nargs > 4 && PyDict_Check(argv[4]) ? Py_NewRef(argv[4]) : PyDict_New());
        result = kwargs ? PyObject_CallMethodObjArgs(session.get(), N.dispatch, argv[1],
                                                     argv[3], kwargs.get(), nullptr)
                        : nullptr;
      }
      // counted whatever happened, as the Python one counts in its ``finally``
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);
      Ref counters(PyObject_GetAttr(session.get(), N.counters));
      bool counted = counters && PyDict_Check(counters.get()) &&
                     add_to(counters.get(), N.shim_ns, monotonic_ns() - t0) &&
                     add_to(counters.get(), N.ops, 1);
      if (type != nullptr) {  // the call's own error wins
        PyErr_Clear();
        PyErr_Restore(type, value, trace);
      } else if (!counted) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "shimstep: counters");
        Py_XDECREF(result);
        return nullptr;
      }
      return result;
    }
    PyErr_Clear();  // no handle, session or native hot path: the Python one finds out why
  }
  return PyObject_Vectorcall(self->general, argv, nargsf, kwnames);
}

int dispatch_init(PyObject* op, PyObject* args, PyObject* kwargs) {
  Dispatch* self = reinterpret_cast<Dispatch*>(op);
  PyObject *general, *remote_type;
  if (!PyArg_ParseTuple(args, "OO!:Dispatch", &general, &PyType_Type, &remote_type)) return -1;
  Py_XSETREF(self->general, Py_NewRef(general));
  Py_XSETREF(self->remote_type, Py_NewRef(remote_type));
  self->vectorcall = dispatch_call;
  return 0;
}

int dispatch_traverse(PyObject* op, visitproc visit, void* arg) {
  Dispatch* self = reinterpret_cast<Dispatch*>(op);
  Py_VISIT(self->general);
  Py_VISIT(self->remote_type);
  return 0;
}

int dispatch_clear(PyObject* op) {
  Dispatch* self = reinterpret_cast<Dispatch*>(op);
  Py_CLEAR(self->general);
  Py_CLEAR(self->remote_type);
  return 0;
}

void dispatch_dealloc(PyObject* op) {
  PyObject_GC_UnTrack(op);
  dispatch_clear(op);
  Py_TYPE(op)->tp_free(op);
}

PyObject* dispatch_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* op = type->tp_alloc(type, 0);
  if (op != nullptr) reinterpret_cast<Dispatch*>(op)->vectorcall = nullptr;
  return op;
}

PyObject* dispatch_tp_call(PyObject* op, PyObject* args, PyObject* kwargs) {
  if (reinterpret_cast<Dispatch*>(op)->vectorcall == nullptr) {
    PyErr_SetString(PyExc_TypeError, "Dispatch not initialised");
    return nullptr;
  }
  return PyVectorcall_Call(op, args, kwargs);
}

PyTypeObject DispatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT};

}  // namespace

PyMODINIT_FUNC RRTO_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  if (!intern_names()) return nullptr;
  HotType.tp_name = RRTO_STR(TORCH_EXTENSION_NAME) ".HotPath";
  HotType.tp_doc = "The shim's hot path (rrto_plugins.torch.hotpath.HotPath, in C++).";
  HotType.tp_basicsize = sizeof(Hot);
  HotType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  HotType.tp_vectorcall_offset = offsetof(Hot, vectorcall);
  HotType.tp_new = hot_new;
  HotType.tp_init = hot_init;
  HotType.tp_call = hot_tp_call;
  HotType.tp_traverse = hot_traverse;
  HotType.tp_clear = hot_clear;
  HotType.tp_dealloc = hot_dealloc;
  if (PyType_Ready(&HotType) < 0) return nullptr;
  DispatchType.tp_name = RRTO_STR(TORCH_EXTENSION_NAME) ".Dispatch";
  DispatchType.tp_doc = "RemoteTensor.__torch_dispatch__ that asks the native hot path first.";
  DispatchType.tp_basicsize = sizeof(Dispatch);
  DispatchType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  DispatchType.tp_vectorcall_offset = offsetof(Dispatch, vectorcall);
  DispatchType.tp_new = dispatch_new;
  DispatchType.tp_init = dispatch_init;
  DispatchType.tp_call = dispatch_tp_call;
  DispatchType.tp_traverse = dispatch_traverse;
  DispatchType.tp_clear = dispatch_clear;
  DispatchType.tp_dealloc = dispatch_dealloc;
  if (PyType_Ready(&DispatchType) < 0) return nullptr;
  module_def.m_name = RRTO_STR(TORCH_EXTENSION_NAME);
  module_def.m_doc = "rrtod's native shim hot path (rrto_plugins.torch.hotpath)";
  module_def.m_size = -1;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddObjectRef(m, "HotPath", reinterpret_cast<PyObject*>(&HotType)) < 0 ||
      PyModule_AddObjectRef(m, "Dispatch", reinterpret_cast<PyObject*>(&DispatchType)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
