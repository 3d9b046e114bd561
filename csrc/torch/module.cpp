// The Python module opmesh._C: loading it registers the operators. It also reports which SIMD
// levels the CPU kernels can use here, for tests and diagnostics.
#include <Python.h>

#include "cpu_features.h"
#include "errors.h"

namespace {

PyObject* supported_simd_levels(PyObject*, PyObject*) {
  const auto levels = opmesh::core::supported_isas();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(levels.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < levels.size(); ++i) {
    PyList_SET_ITEM(list, i, PyUnicode_FromString(opmesh::core::isa_name(levels[i])));
  }
  return list;
}

PyObject* active_simd_level(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(opmesh::core::isa_name(opmesh::core::active_isa()));
  } catch (const opmesh::core::ArgumentError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {{"supported_simd_levels", supported_simd_levels, METH_NOARGS,
                          "SIMD levels this CPU and build support, lowest first."},
                         {"active_simd_level", active_simd_level, METH_NOARGS,
                          "The level the CPU kernels use now (capped by OPMESH_SIMD_MAX)."},
                         {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "opmesh operators (loaded for registration).",
                      -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
