// _rocmoe_records: the per-table words of an embedding launch, written from Python lists of
// tensors in C++.
//
// Why: EmbeddingAllToAll's per-table call (rocmoe/ops/gpu/embedding_launch.py,
// TableEmbeddingLaunch.prepare) checks each table's indices and offsets and writes their
// addresses and sizes into the launch's records. In Python that is about a dozen attribute
// reads and method calls a table, 0.9 us a table on CI's host and more on the GPU hosts:
// 36-48 us a call at 16-26 tables (results/fused_gpu_h100_thirtyninth_session_full.jsonl),
// against issue 14's goal of 20 us. Here the same checks read the C++ tensor behind each
// Python object (THPVariable_Unpack): about 10 ns a table.
//
// The module is optional. It is built against the torch it was configured with (CMake asks
// Python for torch's headers and libraries); rocmoe/ops/gpu/records.py falls back to the
// Python writer when it is missing or does not import (another torch), so every check here
// has its twin there, and tests/test_table_records.py runs both against the same cases.

#include <Python.h>

#include <cstdint>

#include <torch/csrc/autograd/python_variable.h>

namespace {

// The codes write_lookups returns (rocmoe/ops/gpu/records.py names them).
constexpr long kWritten = 0;  // every table's words written
constexpr long kDecline = 1;  // a table the fast path does not take: the general path decides
constexpr long kMoved = 2;    // a table's storage is not the adopted one: adopt again

// One tensor of a table's lookups as the kernel reads it: int64, 1-D, unit stride, on the
// handle's device (get_device(), as Python's tensor.get_device() reports it).
bool plain_lookups(PyObject* obj, int64_t device) {
  if (!THPVariable_CheckExact(obj)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  return t.defined() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
         t.get_device() == device;
}

// write_lookups(weights, indices, offsets, records, stride, fields, device, batch, most)
//
// weights, indices, offsets: lists (or tuples) of one tensor a table, of the same length;
// records: the address of the launch's int64 records, `stride` words a table; fields: the
// word offsets (weights, indices, offsets, num_indices) inside a table's record.
// For each table: indices at most `most` long and offsets exactly `batch`, both plain int64
// 1-D unit-stride tensors on `device`, else kDecline. Its weight word holds the address
// adopted last: a weight whose data_ptr() differs gives kMoved (one that is not a plain
// tensor or Parameter: kDecline). Writes the indices' and offsets' addresses and the
// indices' count; returns kWritten, or kDecline / kMoved (records of the tables before the
// one that failed may have been rewritten: the caller writes them all again or launches
// nothing).
PyObject* write_lookups(PyObject*, PyObject* args) {
  PyObject *weights, *indices, *offsets;
  unsigned long long records;
  Py_ssize_t stride;
  int f_weight, f_index, f_offset, f_count;
  long long device, batch, most;
  if (!PyArg_ParseTuple(args, "OOOKn(iiii)LLL", &weights, &indices, &offsets, &records,
                        &stride, &f_weight, &f_index, &f_offset, &f_count, &device, &batch,
                        &most)) {
    return nullptr;
  }
  if (!PyList_CheckExact(weights) && !PyTuple_CheckExact(weights)) {
    return PyLong_FromLong(kDecline);
  }
  if (!PyList_CheckExact(indices) && !PyTuple_CheckExact(indices)) {
    return PyLong_FromLong(kDecline);
  }
  if (!PyList_CheckExact(offsets) && !PyTuple_CheckExact(offsets)) {
    return PyLong_FromLong(kDecline);
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(weights);
  if (PySequence_Fast_GET_SIZE(indices) != n || PySequence_Fast_GET_SIZE(offsets) != n) {
    return PyLong_FromLong(kDecline);
  }
  PyObject** w_items = PySequence_Fast_ITEMS(weights);
  PyObject** i_items = PySequence_Fast_ITEMS(indices);
  PyObject** o_items = PySequence_Fast_ITEMS(offsets);
  auto* rec = reinterpret_cast<int64_t*>(static_cast<uintptr_t>(records));
  for (Py_ssize_t t = 0; t < n; ++t) {
    PyObject* idx_obj = i_items[t];
    PyObject* off_obj = o_items[t];
    if (!plain_lookups(idx_obj, device) || !plain_lookups(off_obj, device)) {
      return PyLong_FromLong(kDecline);
    }
    const at::Tensor& idx = THPVariable_Unpack(idx_obj);
    const at::Tensor& off = THPVariable_Unpack(off_obj);
    if (off.numel() != batch || idx.numel() > most) {
      return PyLong_FromLong(kDecline);
    }
    int64_t* words = rec + t * stride;
    PyObject* w_obj = w_items[t];
    if (!THPVariable_CheckExact(w_obj)) {
      // a subclass (its data_ptr may be Python's business): the general path takes it,
      // and never kMoved, which would have the caller adopt it and ask again forever
      return PyLong_FromLong(kDecline);
    }
    if (reinterpret_cast<int64_t>(THPVariable_Unpack(w_obj).data_ptr()) != words[f_weight]) {
      return PyLong_FromLong(kMoved);
    }
    words[f_index] = reinterpret_cast<int64_t>(idx.data_ptr());
    words[f_offset] = reinterpret_cast<int64_t>(off.data_ptr());
    words[f_count] = idx.numel();
  }
  return PyLong_FromLong(kWritten);
}

PyMethodDef methods[] = {
    {"write_lookups", write_lookups, METH_VARARGS,
     "Check each table's lookups and write their words into a launch's records."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rocmoe_records",
                      "Per-table launch records written from lists of tensors.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__rocmoe_records(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr) {
    // what records.py checks before it trusts the codes
    PyModule_AddIntConstant(m, "WRITTEN", kWritten);
    PyModule_AddIntConstant(m, "DECLINE", kDecline);
    PyModule_AddIntConstant(m, "MOVED", kMoved);
  }
  return m;
}
