"""A static check for host reads of device values in Python source (used by
tests/moe/test_no_host_reads.py on the layer's modules).

A GPU layer step must not wait for the device: no value may travel back to the host. The
GPU test (tests/moe/test_gpu.py, sync-debug mode "error") proves it at run time on a GPU;
this finds the same mistakes on CPU CI, in every code path, by reading the code:

* reads:       .item() .cpu() .tolist() .numpy(); torch.nonzero / argwhere / masked_select /
               unique / bincount / where(cond) (their output size is a device value), also as
               methods; repeat_interleave with tensor repeats and no output_size
* conversions: int() float() bool() complex() range() of a tensor
* branches:    if / while / assert / `x if c else y` / and / or / not on a tensor's value
* masks:       indexing (read or write) with a boolean tensor, e.g. x[x > 0] (a nonzero)

What is a tensor is inferred inside each function: parameters annotated torch.Tensor, names
used as only tensors are (x.shape, x.view(...): TENSOR_EVIDENCE), names assigned from torch
calls or from other tensors, tensor methods and operators, and the attributes named in
`tensor_attributes` (dataclass fields and module parameters known to be tensors). Shapes, dtypes, devices, numel() and the like are host values. Functions compiled
by Triton (device code) are not checked: a branch there runs on the GPU.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

READ_METHODS = {"item", "cpu", "tolist", "numpy", "nonzero", "argwhere", "masked_select",
                "unique", "unique_consecutive", "bincount"}
READ_FUNCTIONS = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                  "bincount"}
CONVERSIONS = {"int", "float", "bool", "complex", "range"}
# tensor methods and attributes whose result is a host value (metadata, not data)
HOST_METHODS = {"dim", "numel", "size", "stride", "element_size", "is_floating_point",
                "is_contiguous", "data_ptr", "get_device", "storage_offset", "ndimension",
                "nelement", "is_complex", "is_signed", "untyped_storage", "type", "__len__"}
HOST_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout",
                   "grad_fn", "is_leaf", "names", "itemsize", "nbytes", "is_sparse",
                   "is_quantized", "is_meta"}
# torch.<name>(...) calls that do not return a tensor
HOST_TORCH = {"finfo", "iinfo", "device", "dtype", "promote_types", "is_tensor",
              "is_floating_point", "is_complex", "get_default_dtype", "is_grad_enabled",
              "is_inference_mode_enabled", "Size", "Generator", "no_grad", "enable_grad",
              "inference_mode", "result_type", "can_cast", "Stream", "Event", "compile",
              "set_grad_enabled", "empty_strided_meta"}
HOST_TORCH_MODULES = {"cuda", "backends", "library", "autograd", "jit", "compiler", "fx",
                      "_dynamo", "distributed", "version", "testing", "nn", "utils"}
# using one of these on a name (x.shape, x.view(...)) shows that it is a tensor, also where
# it has no annotation: an unannotated parameter or the result of an unknown call
TENSOR_EVIDENCE = {"shape", "dtype", "stride", "numel", "view", "reshape", "contiguous",
                   "new_empty", "new_zeros", "new_full", "new_ones", "new_tensor",
                   "is_floating_point", "element_size", "data_ptr", "unsqueeze", "squeeze",
                   "transpose", "permute", "expand", "flatten", "clamp", "clamp_min",
                   "masked_fill", "index_select", "gather", "scatter_", "index_copy_",
                   "cumsum", "detach", "requires_grad_", "is_contiguous", "storage_offset",
                   "untyped_storage", "float", "half", "bfloat16", "double", "long",
                   "zero_", "copy_", "fill_", "add_", "mul_", "sum", "amax", "amin",
                   "argmax", "topk", "softmax", "exp", "abs", "sqrt", "matmul", "mm", "bmm"}
BOOL_METHODS = {"bool", "eq", "ne", "lt", "le", "gt", "ge", "isfinite", "isnan", "isinf",
                "logical_and", "logical_or", "logical_not", "logical_xor", "isin", "any",
                "all", "isneginf", "isposinf", "signbit"}


@dataclass
class Finding:
    path: str
    function: str
    line: int
    kind: str
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}(): {self.kind}: {self.code}"


def _is_torch(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "torch"


def _annotation_is_tensor(node) -> bool:
    if node is None:
        return False
    text = ast.unparse(node)
    return "Tensor" in text and "list" not in text.lower() and "tuple" not in text.lower() \
        and "dict" not in text.lower() and "Sequence" not in text


def _decorated_for_device(fn: ast.FunctionDef) -> bool:
    for dec in fn.decorator_list:
        text = ast.unparse(dec)
        if "jit" in text or "triton" in text:
            return True
    return False


def _has_constexpr_parameter(fn: ast.FunctionDef) -> bool:
    args = fn.args.args + fn.args.kwonlyargs
    return any(a.annotation is not None and "constexpr" in ast.unparse(a.annotation)
               for a in args)


class _FunctionChecker(ast.NodeVisitor):
    def __init__(self, path: str, fn: ast.FunctionDef, tensor_attributes: set[str]):
        self.path = path
        self.fn = fn
        self.attrs = tensor_attributes
        self.tensors: set[str] = set()
        self.bool_tensors: set[str] = set()
        self.findings: list[Finding] = []
        for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs:
            if _annotation_is_tensor(a.annotation):
                self.tensors.add(a.arg)
        # names used the way only tensors are used stay tensors whatever they are bound to
        self.known_tensors = {n.value.id for n in ast.walk(fn)
                              if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                              and n.attr in TENSOR_EVIDENCE and n.value.id not in ("self", "ctx")}
        self.tensors |= self.known_tensors

    # -- what is a tensor ----------------------------------------------------------------
    def is_tensor(self, node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.tensors
        if isinstance(node, ast.Attribute):
            if node.attr in HOST_ATTRIBUTES:
                return False
            if node.attr in self.attrs:
                return True
            return node.attr in ("T", "mT", "data", "grad", "real", "imag") and \
                self.is_tensor(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                if _is_torch(func.value):
                    return func.attr not in HOST_TORCH
                if isinstance(func.value, ast.Attribute) and _is_torch(func.value.value):
                    return func.value.attr not in HOST_TORCH_MODULES  # torch.linalg.x, ...
                if func.attr in HOST_METHODS:
                    return False
                return self.is_tensor(func.value)
            return False
        if isinstance(node, ast.Subscript):
            return self.is_tensor(node.value)
        if isinstance(node, ast.BinOp):
            return self.is_tensor(node.left) or self.is_tensor(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.is_tensor(node.operand)
        if isinstance(node, ast.Compare):
            if any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in node.ops):
                return False
            return self.is_tensor(node.left) or any(self.is_tensor(c) for c in node.comparators)
        if isinstance(node, ast.IfExp):
            return self.is_tensor(node.body) or self.is_tensor(node.orelse)
        if isinstance(node, ast.NamedExpr):
            return self.is_tensor(node.value)
        return False

    def is_bool_tensor(self, node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.bool_tensors
        if isinstance(node, ast.Compare):
            return self.is_tensor(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not)):
            return self.is_bool_tensor(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            return self.is_bool_tensor(node.left) or self.is_bool_tensor(node.right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in BOOL_METHODS and (self.is_tensor(node.func.value) or
                                         _is_torch(node.func.value)):
                return True
            if name == "to" and any("bool" in ast.unparse(a) for a in node.args):
                return self.is_tensor(node.func.value)
        return False

    def _bind(self, target, value_is_tensor: bool, value_is_bool: bool) -> None:
        if isinstance(target, ast.Name):
            if value_is_tensor or target.id in self.known_tensors:
                self.tensors.add(target.id)
            else:
                self.tensors.discard(target.id)
            (self.bool_tensors.add if value_is_bool else self.bool_tensors.discard)(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:  # a tensor op's tuple result: each part a tensor
                self._bind(element, value_is_tensor, False)

    # -- findings ----------------------------------------------------------------------
    def report(self, node, kind: str) -> None:
        self.findings.append(Finding(self.path, self.fn.name, node.lineno, kind,
                                     ast.unparse(node)[:100]))

    def check_test(self, test) -> None:
        if self.is_tensor(test):
            self.report(test, "branch on a tensor's value")
        elif isinstance(test, ast.BoolOp):
            for value in test.values:
                self.check_test(value)
        elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            self.check_test(test.operand)

    # -- visitors ------------------------------------------------------------------------
    def visit_FunctionDef(self, node):
        if node is self.fn:
            self.generic_visit(node)
        # nested functions are checked on their own (they are collected separately)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self.generic_visit(node)

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)
            self._bind(target, self.is_tensor(node.value), self.is_bool_tensor(node.value))

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
            self._bind(node.target, self.is_tensor(node.value) or
                       _annotation_is_tensor(node.annotation), self.is_bool_tensor(node.value))

    def visit_AugAssign(self, node):
        self.visit(node.value)
        self.visit(node.target)
        if isinstance(node.target, ast.Name) and self.is_tensor(node.value):
            self.tensors.add(node.target.id)

    def visit_For(self, node):
        self.visit(node.iter)
        if self.is_tensor(node.iter):
            self.report(node.iter, "iterating over a tensor's values")
        self._bind(node.target, False, False)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    def visit_If(self, node):
        self.check_test(node.test)
        self.generic_visit(node)

    def visit_While(self, node):
        self.check_test(node.test)
        self.generic_visit(node)

    def visit_Assert(self, node):
        self.check_test(node.test)
        self.generic_visit(node)

    def visit_IfExp(self, node):
        self.check_test(node.test)
        self.generic_visit(node)

    def visit_comprehension(self, node):
        for cond in node.ifs:
            self.check_test(cond)
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        # `a and b` / `a or b` call bool() on every operand but the last
        for value in node.values[:-1]:
            if self.is_tensor(value):
                self.report(value, "branch on a tensor's value")
        self.generic_visit(node)

    def visit_Subscript(self, node):
        if self.is_tensor(node.value) and self.is_bool_tensor(node.slice):
            self.report(node, "boolean-mask indexing")
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute):
            if func.attr in READ_METHODS and not _is_torch(func.value):
                self.report(node, f".{func.attr}() reads device values")
            elif _is_torch(func.value) and func.attr in READ_FUNCTIONS:
                self.report(node, f"torch.{func.attr}() sizes its output by device values")
            elif _is_torch(func.value) and func.attr == "where" and len(node.args) == 1:
                self.report(node, "torch.where(condition) is a nonzero")
            elif func.attr == "repeat_interleave" and not any(
                    k.arg == "output_size" for k in node.keywords):
                repeats = node.args[1:2] if _is_torch(func.value) else node.args[:1]
                if any(self.is_tensor(r) for r in repeats):
                    self.report(node, "repeat_interleave by tensor repeats without output_size")
        elif isinstance(func, ast.Name) and func.id in CONVERSIONS:
            if any(self.is_tensor(a) for a in node.args):
                self.report(node, f"{func.id}() of a tensor reads its value")
        self.generic_visit(node)


def check_source(source: str, path: str = "<source>", tensor_attributes=(),
                 skip_functions=()) -> list[Finding]:
    """Every host read in the functions of `source` (module-level code is not a step)."""
    tree = ast.parse(source)
    findings = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name in skip_functions or _decorated_for_device(node) or \
                _has_constexpr_parameter(node):
            continue
        checker = _FunctionChecker(path, node, set(tensor_attributes))
        checker.visit(node)
        for finding in checker.findings:  # `if a and b` is seen as a test and as a BoolOp
            if all((f.line, f.code) != (finding.line, finding.code) for f in findings):
                findings.append(finding)
    return findings
