"""Triton launches without the binder's per-call work: a kernel is specialised once per
plan on the arguments a call cannot change, and a call passes only the ones it does.
"""

from __future__ import annotations

import os

import torch

from ..._triton import interpreting as _interpreting


_PLATFORM = "hip" if getattr(torch.version, "hip", None) else "cuda"


class _Launcher:
    """Launches one Triton kernel of triton_gemm_a2a. The first launch of a configuration
    goes through the JIT (compiles and specialises); later ones call the compiled kernel
    directly, which skips the JIT's cache lookup, option parsing and launch hooks (most of
    the host time of a Triton launch).

    A compiled kernel is only valid for arguments the JIT would have specialised the same
    way: the same pointer dtypes and 16-byte alignments, integers equal to 1 (constants),
    divisible by 16 and of the same width, and on AMD the buffer-range flags of tensors.
    So every launch is keyed by Triton's own specialisation of its arguments (its native
    specialize function, with the kernel's backend), next to the constexprs in `key`. A
    caller may name the `dynamic` argument positions, those that can change from call to
    call; it then vouches that `key` holds the specialisation of every other argument
    (`specialize` computes it, once per plan)."""

    def __init__(self, name: str):
        self.name = name
        self._compiled: dict = {}
        self.fast = os.environ.get("ROCMOE_TRITON_FAST_LAUNCH", "1") != "0"
        self._spec = None  # (specialize function, per-parameter flags), made on first use

    def _specializer(self):
        if self._spec is None:
            from .. import triton_gemm_a2a as tk
            self._spec = _make_specializer(tk.get(self.name))
        return self._spec

    def specialize(self, args: tuple, positions) -> tuple:
        """Triton's specialisation of args[i] for i in positions (a key part); nothing under
        the interpreter, which compiles nothing."""
        if _interpreting():
            return ()
        spec, flags = self._specializer()
        return tuple(spec(args[i], *flags[i]) for i in positions)

    def __call__(self, grid, args: tuple, constexprs: dict, options: dict, key,
                 dynamic=None):
        """Launch; returns the compiled kernel that ran (None under the interpreter)."""
        from .. import triton_gemm_a2a as tk
        fn = tk.get(self.name)
        if _interpreting():
            fn[grid](*args, **constexprs, **options)
            return
        full_key = (key, self.specialize(args, range(len(args)) if dynamic is None else dynamic))
        compiled = self._compiled.get(full_key)
        if compiled is None:
            compiled = fn[grid](*args, **constexprs, **options)
            names = fn.arg_names
            self._compiled[full_key] = (compiled, [constexprs.get(n) for n in names[len(args):]])
            return compiled
        kernel, tail = compiled
        if self.fast:
            # The compiled kernel's launcher reads three grid dimensions (the JIT pads them).
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            try:
                kernel[grid3](*args, *tail)
                return kernel
            except TypeError:  # this Triton's compiled-kernel launch takes other arguments
                self.fast = False
        return fn[grid](*args, **constexprs, **options)


def _make_specializer(fn):
    """(specialize(arg, is_const, specialize, align) -> its JIT specialisation, the flags of
    each non-constexpr parameter), with the backend of the current GPU. Triton's native
    function where it has one; otherwise the properties it specialises on, from Python."""
    flags = [(p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
             for p in fn.params if not p.is_constexpr]
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver
        backend = make_backend(driver.active.get_current_target())

        def spec(arg, is_const, specialize, align):
            return native_specialize_impl(backend, arg, is_const, specialize, align)
        spec(16, False, True, True)  # this Triton's native function takes these arguments
    except (ImportError, AttributeError, RuntimeError, TypeError):  # another Triton
        def spec(arg, is_const, specialize, align):
            if isinstance(arg, torch.Tensor):
                return (arg.dtype, align and arg.data_ptr() % 16 == 0)
            if isinstance(arg, bool) or not isinstance(arg, int):
                return (type(arg), getattr(arg, "dtype", None),
                        tuple(getattr(arg, "block_shape", ()) or ()))
            width = 32 if -2**31 <= arg < 2**31 else 64 if -2**63 <= arg < 2**63 else 65
            return (width, specialize and arg == 1, specialize and arg % 16 == 0)
    return spec, flags


_LAUNCHERS = {name: _Launcher(name) for name in
              ("gemm_a2a_kernel", "split_sum_kernel", "collect_kernel", "abort_kernel",
               "grouped_weight_grad_kernel", "grouped_plan_kernel", "grouped_tiles_kernel")}
