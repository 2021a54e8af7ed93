"""Shims for Triton 3.6's CPU interpreter (`TRITON_INTERPRET=1`), shared by the kernel tests:
bf16 `tl.dot` multiplies the raw bits instead of the values, and loop bounds taken from
scalar arguments or loads fail under NumPy >= 2.3 (a one-element array is not an index)."""

from __future__ import annotations


def install_interpreter_shims() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    create_dot = interp.InterpreterBuilder.create_dot

    def upcast(x):
        if x.dtype == tl.bfloat16:  # stored as uint16: convert the bits, don't multiply them
            data = interp._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return x

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    patch_tensor = interp._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp.InterpreterBuilder.create_dot = create_dot_bf16
    interp._patch_lang_tensor = patch_tensor_index
