// The Python module attn_ext._C exists only so that `from attn_ext import _C` loads this
// shared library, whose static initialisers register the ops with the dispatcher. It has no
// functions and no pybind11: built against the limited API, one .so serves every
// CPython >= 3.10. (The pure C++ library built by CMakeLists.txt leaves this file out.)
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "attn_ext compiled ops; use torch.ops.attn_ext.*",
      -1,       // no per-interpreter state
      nullptr,  // no methods
  };
  return PyModule_Create(&module_def);
}
}
