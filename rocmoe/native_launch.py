"""A compiled Triton kernel launched with one driver call, without Triton's Python layers.

Triton's own launch of a compiled kernel costs 20-30 us of host time on an H200 (the runner,
the tensor-descriptor wrapper that encodes every TMA map again, argument parsing), and the
JIT's specialisation of the arguments another 10-15 us: most of a GemmAllToAll call's host
time (benchmarks/probe_gemm_host.py). A `NativeLaunch` packs the kernel's parameters once,
as the driver's own parameter table gives them, and a call rewrites only the arguments that
change (pointers, M, strides, X's TMA map, cached by address and shape) and calls
`cuLaunchKernel` through librocmoe's cffi binding (`rocmoe_cu_launch`: the driver opened
by dlopen, so no CUDA headers and no ctypes).

It is built from a kernel the JIT compiled for the same arguments, so it launches exactly
that kernel, and only while a call's arguments would get the same specialisation: each
changing argument yields a token (a pointer's 16-byte alignment, an integer being 1 or a
multiple of 16, a descriptor's base alignment and the divisibility of its shape and
strides), which is at least as fine as what Triton specialises on; a call whose tokens
differ goes back through the JIT. The parameter layout must match the driver's
(`cuFuncGetParamInfo`: count and size of every parameter), or no native launch is made.

CUDA only, and only for kernels without clusters, cooperative grids or scratch buffers:
everywhere else (AMD included, where this has not run) callers keep Triton's launcher. A
kernel compiled for programmatic dependent launch (Triton's `launch_pdl`) is launched the
same way through `cuLaunchKernelEx` with the PDL attribute (`rocmoe_cu_launch_pdl`), as
Triton's own launcher does. ROCMOE_NATIVE_LAUNCH=0 turns it off.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Sequence

import torch

# sizes of Triton's scalar signature types as kernel parameters (Triton's launcher passes
# i1 as int8_t; floats are not used by rocmoe's kernels and are not supported here)
_SCALAR = {"i1": (1, True), "i8": (1, True), "i16": (2, True), "i32": (4, True),
           "i64": (8, True), "u1": (1, False), "u8": (1, False), "u16": (2, False),
           "u32": (4, False), "u64": (8, False)}
_CTYPE = {(1, True): "int8_t *", (2, True): "int16_t *", (4, True): "int32_t *",
          (8, True): "int64_t *", (1, False): "uint8_t *", (2, False): "uint16_t *",
          (4, False): "uint32_t *", (8, False): "uint64_t *"}
# Triton's TMA element types are numbered a little differently on the device and the host
# (the CUtensorMapDataType the driver takes)
_TMA_HOST_TYPE = {i: i for i in range(16)}
_TMA_HOST_TYPE.update({8: 10, 9: 8, 10: 9})
_TMA_MAP_BYTES = 128
_L2_PROMOTION_128B = 2
_MAX_MAPS = 16  # X's TMA maps kept per launch, by (address, shape, strides)

stats = {"native": 0, "fallback": 0}  # launches, for tests and benchmarks


class Unsupported(Exception):
    """This kernel (or this machine) cannot be launched natively; use Triton's launcher."""


def enabled() -> bool:
    return os.environ.get("ROCMOE_NATIVE_LAUNCH", "1") != "0"


class _Driver:
    """The three driver entry points, through librocmoe (hip/src/cuda_driver.cpp)."""

    def __init__(self):
        from ._native import ffi, lib
        if not lib.rocmoe_cu_available():
            raise Unsupported("no CUDA driver with cuLaunchKernel, cuFuncGetParamInfo and "
                              "cuTensorMapEncodeTiled")
        self.ffi, self.lib = ffi, lib
        self.launch = lib.rocmoe_cu_launch
        # (None: the driver has no cuLaunchKernelEx, so no native PDL launch)
        self.launch_pdl = lib.rocmoe_cu_launch_pdl if lib.rocmoe_cu_pdl_available() else None
        self.encode = lib.rocmoe_cu_encode_tiled

    def params_of(self, function: int) -> list:
        """[(offset, size)] of the kernel's parameters, as the driver sees them."""
        out = []
        off, size = self.ffi.new("uint64_t *"), self.ffi.new("uint64_t *")
        while len(out) < 1024:
            if self.lib.rocmoe_cu_param_info(function, len(out), off, size) != 0:
                break
            out.append((off[0], size[0]))
        return out


_DRIVER: Optional[_Driver] = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


def stream_getter(device: torch.device):
    """The raw handle of `device`'s current stream, as cheaply as torch gives it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


def _int_token(v: int) -> tuple:
    return (v == 1, v % 16 == 0, -2**31 <= v < 2**31)


def _constant_token(a) -> tuple:
    """What an argument the JIT turned into a constant must equal: the same value of the
    same type (None, an integer 1)."""
    if a is None or isinstance(a, (bool, int, float, str)):
        return (type(a), a)
    return ("object", type(a))


def _block_of(a):
    """A descriptor's box (its shape is part of the kernel's signature); None for a tensor
    that stands for a descriptor whose box the caller fixes."""
    block = getattr(a, "block_shape", None)
    return tuple(block) if block is not None else None


def _desc_view(arg, ndim: int):
    """(base tensor, shape, strides) of a tensor-descriptor argument: a Triton
    TensorDescriptor, or a tensor that stands for its own descriptor (a 3-D one as the
    [G*K, N] matrix of its groups, as rocmoe's grouped GEMM describes it)."""
    if isinstance(arg, torch.Tensor):
        if arg.dim() == ndim:
            return arg, tuple(arg.shape), tuple(arg.stride())
        if arg.dim() == 3 and ndim == 2:
            return arg, (arg.shape[0] * arg.shape[1], arg.shape[2]), (arg.stride(1), arg.stride(2))
        raise Unsupported(f"a {arg.dim()}-D tensor for a {ndim}-D descriptor")
    return arg.base, tuple(arg.shape), tuple(arg.strides)


class _Field:
    """One kernel parameter: its kind (ptr, int, tma, shape, stride), size, offset in the
    parameter buffer, the typed pointer to it (scalars: `cell[0] = v` writes the value)
    or the descriptor's (meta, ndim)."""
    __slots__ = ("kind", "size", "signed", "cell", "desc", "offset")

    def __init__(self, kind, size, signed=True):
        self.kind, self.size, self.signed = kind, size, signed
        self.cell = self.desc = None
        self.offset = 0


def parameter_fields(signature: Sequence[str], tensordesc_meta) -> tuple[list, list]:
    """The kernel parameters of Triton's launch, in order: (fields, owner) where owner[i] is
    the JIT argument position each field comes from (-1: the two scratch pointers Triton
    appends). Mirrors Triton's launcher: constexprs take no parameter; a tensor descriptor
    that the compiler lowered to TMA is its CUtensorMap, then its shape (i32) and strides
    (i64); a pointer is 8 bytes."""
    fields, owner = [], []
    metas = list(tensordesc_meta or [])
    for pos, ty in enumerate(signature):
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            if not metas or metas[0] is None:
                raise Unsupported("a tensor descriptor the compiler did not lower to TMA")
            meta = metas.pop(0)
            ndim = re.match(r"tensordesc<[^[>]*\[([^]]*)\]", ty).group(1).count(",") + 1
            new = [_Field("tma", _TMA_MAP_BYTES)] + [_Field("shape", 4) for _ in range(ndim)] \
                + [_Field("stride", 8) for _ in range(ndim)]
            new[0].desc = (meta, ndim)
        elif ty.startswith("*"):
            new = [_Field("ptr", 8, False)]
        elif ty in _SCALAR:
            size, signed = _SCALAR[ty]
            new = [_Field("int", size, signed)]
        else:
            raise Unsupported(f"parameter type {ty}")
        fields += new
        owner += [pos] * len(new)
    fields += [_Field("ptr", 8, False), _Field("ptr", 8, False)]  # global / profile scratch
    owner += [-1, -1]
    return fields, owner


class NativeLaunch:
    """cuLaunchKernel of one compiled Triton kernel with the parameters of `args` (the
    arguments it was compiled for); `dynamic`: the argument positions a call may change."""

    def __init__(self, compiled, args: Sequence, dynamic: Sequence[int], device: torch.device):
        if not enabled() or device.type != "cuda" or getattr(torch.version, "hip", None):
            raise Unsupported("native launches are for CUDA only")
        md = compiled.metadata
        if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
                or getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0)):
            raise Unsupported("clusters, cooperative grids or scratch buffers")
        drv = _driver()
        self.pdl = bool(getattr(md, "launch_pdl", False))
        if self.pdl and drv.launch_pdl is None:
            raise Unsupported("a PDL kernel, and the driver has no cuLaunchKernelEx")
        # the driver call of every launch: PDL kernels keep their attribute
        self._launch = drv.launch_pdl if self.pdl else drv.launch
        # launch_as_written(pdl=False): a PDL kernel launched plainly, after everything
        # before it on its stream (its griddepcontrol.wait then returns at once)
        self._launch_plain = drv.launch
        compiled._init_handles()
        self.function = int(compiled.function)
        self.block = 32 * int(md.num_warps)
        self.shared = int(md.shared)
        signature = list(compiled.src.signature.values())
        if len(signature) < len(args):
            raise Unsupported("more arguments than the kernel's signature")
        if any(ty != "constexpr" for ty in signature[len(args):]):
            raise Unsupported("a kernel parameter passed by keyword (only constexprs may be)")
        fields, owner = parameter_fields(signature, getattr(md, "tensordesc_meta", None))
        driver_params = drv.params_of(self.function)
        if [s for _, s in driver_params] != [f.size for f in fields]:
            raise Unsupported(f"parameter layout {[f.size for f in fields]} is not the "
                              f"driver's {[s for _, s in driver_params]}")
        # one buffer, every parameter at an offset aligned to its size (a TMA map to 128 bytes,
        # as Triton keeps its own)
        offset = 0
        for f in fields:
            align = 128 if f.kind == "tma" else f.size
            offset = (offset + align - 1) // align * align
            f.offset = offset
            offset += f.size
        ffi = drv.ffi
        self._storage = ffi.new("uint8_t[]", offset + 128)
        base = int(ffi.cast("uintptr_t", self._storage))
        self._base = base + (-base) % 128
        self._params = ffi.new("void *[]", [ffi.cast("void *", self._base + f.offset)
                                            for f in fields])
        for f in fields:
            if f.kind != "tma":
                f.cell = ffi.cast(_CTYPE[(f.size, f.signed)], self._base + f.offset)
        by_pos: dict = {}
        for f, pos in zip(fields, owner):
            by_pos.setdefault(pos, []).append(f)
        self._by_pos = by_pos
        self._maps: dict = {}
        self._stream = stream_getter(device)
        self._drv = drv
        tokens = [self._token(pos, args[pos]) for pos in dynamic]
        for pos in range(len(args)):  # every argument once
            self._write(pos, args[pos])
        # one step per changing argument (it writes the argument and says whether its token
        # is the one the kernel was compiled for); a call runs them as one generated function
        self._steps = [(pos, self._step(pos, tok)) for pos, tok in zip(dynamic, tokens)]
        self._want = dict(zip(dynamic, tokens))
        self._write_args = self._generated(dynamic, tokens)
        # launch() counts its calls; `written`: the last one's arguments are all in the
        # parameter buffer (a caller that rewrites only what changed, launch_as_written,
        # must know nobody else wrote the buffer since)
        self.generation = 0
        self.written = False

    # -- writing arguments -----------------------------------------------------------
    def _token(self, pos: int, a):
        """What the JIT could specialise argument `pos` on (see the module's docstring)."""
        fields = self._by_pos.get(pos)
        if fields is None:  # a constexpr-specialised argument (a None, an integer 1)
            return _constant_token(a)
        if fields[0].kind == "tma":
            base, shape, strides = _desc_view(a, fields[0].desc[1])
            return (base.data_ptr() % 16 == 0, tuple(_int_token(v) for v in shape),
                    tuple(_int_token(v) for v in strides), _block_of(a), base.dtype)
        if fields[0].kind == "ptr":
            return (a.data_ptr() % 16 == 0, a.dtype)
        return _int_token(a)

    def _write(self, pos: int, a) -> None:
        fields = self._by_pos.get(pos)
        if fields is None:
            return
        first = fields[0]
        if first.kind == "ptr":
            first.cell[0] = a.data_ptr() if isinstance(a, torch.Tensor) else int(a or 0)
        elif first.kind == "int":
            first.cell[0] = int(a)
        else:
            meta, ndim = first.desc
            base, shape, strides = _desc_view(a, ndim)
            key = (base.data_ptr(), shape, strides)
            kept = self._maps.get((first.offset, key))
            if kept is None:
                kept = self._encode(meta, base, shape, strides)
                if len(self._maps) >= _MAX_MAPS:
                    self._maps.pop(next(iter(self._maps)))
                self._maps[(first.offset, key)] = kept
            self._drv.ffi.memmove(self._drv.ffi.cast("void *", self._base + first.offset),
                                  kept[1], _TMA_MAP_BYTES)
            for f, v in zip(fields[1:1 + ndim], shape):
                f.cell[0] = v
            for f, v in zip(fields[1 + ndim:], strides):
                f.cell[0] = v

    def _step(self, pos: int, want):
        """The per-call work of argument `pos` as one function (the fast path is a handful
        of attribute reads: host time per call is what this module is for)."""
        fields = self._by_pos.get(pos)
        if fields is None:
            return lambda a: _constant_token(a) == want
        first = fields[0]
        cell = first.cell
        if first.kind == "ptr":
            aligned, dtype = want

            def ptr(a):
                p = a.data_ptr()
                cell[0] = p
                # (a tensor off the GPU, a meta one among them, must not reach the kernel)
                return (p % 16 == 0) == aligned and a.dtype is dtype and a.is_cuda
            return ptr
        if first.kind == "int":
            def integer(a):
                cell[0] = a
                return _int_token(a) == want
            return integer
        ndim = first.desc[1]
        last = [None]  # the key of the map in the buffer now
        # keys whose specialisation was checked: a tensor that comes back (X of a layer
        # takes turns among a few addresses of the caching allocator) skips the check
        checked: dict = {}

        def descriptor(a):
            base, shape, strides = _desc_view(a, ndim)
            key = (base.data_ptr(), shape, strides, _block_of(a), base.dtype)
            if key == last[0]:
                return True
            if key not in checked:
                if self._token(pos, a) != want or not base.is_cuda:
                    return False
                if len(checked) >= _MAX_MAPS:
                    checked.pop(next(iter(checked)))
                checked[key] = True
            self._write(pos, a)
            last[0] = key
            return True
        return descriptor

    def _generated(self, dynamic, tokens):
        """The steps as one generated function `write(args) -> bool`: pointers and integers
        written and checked inline (a call per argument cost about as much as the check),
        descriptors and folded constants through their step. Same results as the steps."""
        lines, env = ["def write(args):"], {}
        for (pos, step), want in zip(self._steps, tokens):
            fields = self._by_pos.get(pos)
            kind = fields[0].kind if fields is not None else None
            env[f"c{pos}"] = fields[0].cell if kind in ("ptr", "int") else None
            if kind == "ptr":
                env[f"d{pos}"] = want[1]
                lines += [f"    a = args[{pos}]", "    p = a.data_ptr()", f"    c{pos}[0] = p",
                          f"    if ((p & 15) == 0) is not {bool(want[0])} or a.dtype is not "
                          f"d{pos} or not a.is_cuda:", "        return False"]
            elif kind == "int":
                one, by16, narrow = (bool(v) for v in want)
                lines += [f"    a = args[{pos}]", f"    c{pos}[0] = a",
                          f"    if (a == 1) is not {one} or (a % 16 == 0) is not {by16} or "
                          f"(-2147483648 <= a < 2147483648) is not {narrow}:",
                          "        return False"]
            else:
                env[f"s{pos}"] = step
                lines += [f"    if not s{pos}(args[{pos}]):", "        return False"]
        lines.append("    return True")
        exec("\n".join(lines), env)  # noqa: S102 - our own text, from the kernel's fields
        return env["write"]

    def _encode(self, meta: dict, base: torch.Tensor, shape, strides):
        """(buffer, address) of the CUtensorMap of a descriptor, as Triton's
        fill_tma_descriptor makes it (dimensions innermost first, byte strides, no
        interleave, 128-byte L2 promotion, no NaN fill)."""
        if meta.get("fp4_padded") or strides[-1] != 1 or min(shape) <= 0:
            raise Unsupported("an fp4-padded, empty or non-unit inner stride descriptor")
        rank = len(shape)
        elem = int(meta["elem_size"])
        ffi = self._drv.ffi
        dims = ffi.new("uint64_t[]", [int(s) for s in reversed(shape)])
        byte_strides = ffi.new("uint64_t[]", [elem * int(s) for s in reversed(strides[:-1])]
                               + [0])
        box = ffi.new("uint32_t[]", [int(b) for b in reversed(meta["block_size"])])
        ones = ffi.new("uint32_t[]", [1] * rank)
        buf = ffi.new("uint8_t[]", 2 * _TMA_MAP_BYTES)
        addr = int(ffi.cast("uintptr_t", buf))
        addr += (-addr) % _TMA_MAP_BYTES
        rc = self._drv.encode(ffi.cast("void *", addr), _TMA_HOST_TYPE[int(meta["elem_type"])],
                              rank, base.data_ptr(), dims, byte_strides, box, ones, 0,
                              int(meta["swizzle"]), _L2_PROMOTION_128B, 0)
        if rc != 0:
            raise Unsupported(f"cuTensorMapEncodeTiled refused the map ({rc})")
        return buf, ffi.cast("void *", addr)

    def set_fixed(self, pos: int, value: int) -> None:
        """Rewrite integer argument `pos`, one that calls do not change (a GEMM plan's wait
        budget after its first launch), for every later launch. Its specialisation must stay
        the one compiled."""
        fields = self._by_pos.get(pos)
        if fields is None or fields[0].kind != "int":
            raise Unsupported(f"argument {pos} is not an integer parameter")
        cell = fields[0].cell
        if _int_token(value) != _int_token(int(cell[0])):
            raise Unsupported(f"argument {pos}: {value} is not specialised as {int(cell[0])} "
                              "was")
        cell[0] = value

    # -- pieces for a caller that rewrites only what changed ----------------------------
    def step(self, pos: int):
        """The step of dynamic argument `pos`: step(a) writes it and says whether its
        specialisation is the compiled one."""
        return dict(self._steps)[pos]

    def pointer_cell(self, pos: int):
        """(typed cell, compiled 16-byte alignment) of pointer argument `pos`."""
        fields = self._by_pos.get(pos)
        if fields is None or fields[0].kind != "ptr":
            raise Unsupported(f"argument {pos} is not a pointer parameter")
        return fields[0].cell, bool(self._want[pos][0])

    def launch_as_written(self, grid_x: int, stream: int, pdl: bool = True) -> None:
        """Launch a 1-D grid on `stream` (a raw handle, as stream_getter gives it) with the
        parameter buffer as it stands; `pdl` False: without a PDL kernel's attribute."""
        launch = self._launch if pdl else self._launch_plain
        rc = launch(self.function, grid_x, 1, 1, self.block, self.shared, stream, self._params)
        if rc != 0:
            from ._native import check
            check(rc, "native launch")
        stats["native"] += 1

    # -- launching ---------------------------------------------------------------------
    def launch(self, grid: Sequence[int], args: Sequence) -> bool:
        """Launch with `args` (the changing positions are rewritten). False, with nothing
        launched, when their specialisation is not the one this kernel was compiled for."""
        self.generation += 1
        self.written = False
        try:
            if not self._write_args(args):
                stats["fallback"] += 1
                return False
        except Exception:  # noqa: BLE001 - a map the driver will not encode, an argument of
            # another kind than the kernel was compiled for (None for a tensor): the JIT decides
            stats["fallback"] += 1
            return False
        self.written = True
        n = len(grid)
        rc = self._launch(self.function, grid[0], grid[1] if n > 1 else 1,
                          grid[2] if n > 2 else 1, self.block, self.shared, self._stream(),
                          self._params)
        if rc != 0:
            from ._native import check
            check(rc, "native launch")
        stats["native"] += 1
        return True


def try_native(compiled, args, dynamic, device) -> Optional[NativeLaunch]:
    """A NativeLaunch of `compiled`, or None where the kernel or the machine has none (the
    reason is kept in `last_refusal`)."""
    global last_refusal
    try:
        return NativeLaunch(compiled, args, dynamic, device)
    except Unsupported as exc:
        last_refusal = str(exc)
    except Exception as exc:  # noqa: BLE001 - another Triton's objects: its launcher stays
        last_refusal = f"{type(exc).__name__}: {exc}"
    return None


last_refusal: Optional[str] = None


# ---------------------------------------------------------------------------------------
# Any jitted kernel: the JIT on the first call of a specialisation, the driver after
# ---------------------------------------------------------------------------------------

_MAX_SPECIALISATIONS = 4  # native launches kept per (device, argument count, constexprs)


class FastKernel:
    """A jitted Triton kernel launched as `fast[grid](*args, **constexprs)`, like the
    JITFunction itself, with the host work of every launch after the first cut to a
    NativeLaunch's argument steps and one cuLaunchKernel.

    Launches are grouped by the current device, the number of positional arguments and the
    keyword arguments (the constexprs and launch options, which must be hashable); within a
    group each specialisation the JIT compiled gets its own NativeLaunch (up to four), and a
    call whose arguments fit none of them goes through the JIT, which compiles or finds the
    kernel, and then gets one. Every positional argument may change from call to call; the
    NativeLaunch's tokens say when a call needs another kernel. Where the kernel or the
    machine has no native launch (AMD, the interpreter, a float argument, a cooperative
    grid) every call goes through the JIT, as before. A grid given as a function goes
    through the JIT too."""

    __slots__ = ("jit", "_groups", "_device_of")

    def __init__(self, jit_fn):
        self.jit = jit_fn
        self._groups: dict = {}
        self._device_of = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        if self._device_of is None:
            self._device_of = _current_device_getter()
        try:
            key = (self._device_of(), len(args), tuple(kwargs.items()))
            group = self._groups.get(key)
        except TypeError:  # an unhashable keyword argument: no grouping, the JIT launches
            return self.jit[grid](*args, **kwargs)
        if group and not callable(grid):
            for native in group:
                if native.launch(grid, args):
                    return None
        compiled = self.jit[grid](*args, **kwargs)
        if group is None:
            group = self._groups[key] = []
        if (compiled is not None and group is not False and len(group) < _MAX_SPECIALISATIONS
                and not callable(grid)):
            # (the JIT launched on the current device's stream: so does the native launch)
            device = torch.device("cuda", key[0]) if key[0] >= 0 and _on_cuda(args) else None
            native = try_native(compiled, args, range(len(args)), device) if device else None
            if native is not None:
                group.append(native)
            elif not group:
                self._groups[key] = False  # refused: this group stays on the JIT
        return compiled

    def __getattr__(self, name):  # the JITFunction's own attributes (arg_names, params, ...)
        return getattr(self.jit, name)


def _current_device_getter():
    if torch.cuda.is_available():
        return torch.cuda.current_device
    return lambda: -1


def _on_cuda(args) -> bool:
    """Whether the first tensor among the arguments (a descriptor's base counts) is on a
    CUDA device."""
    for a in args:
        t = a if isinstance(a, torch.Tensor) else getattr(a, "base", None)
        if isinstance(t, torch.Tensor):
            return t.is_cuda
    return False
