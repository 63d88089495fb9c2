"""Generate the cffi extension source for librocmoe from hip/include/rocmoe/rocmoe.h.

The declarations between the ROCMOE_CDEF_BEGIN / ROCMOE_CDEF_END markers of the header are
the cdef: one source of truth for the ABI, so the binding cannot drift from the library.
CMake compiles the emitted C file into the `rocmoe._rocmoe_cffi` extension module and links
it against librocmoe (API mode: the C compiler checks every declaration against the header).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import cffi

MODULE = "rocmoe._rocmoe_cffi"


def extract_cdef(header_text: str) -> str:
    match = re.search(r"/\* ROCMOE_CDEF_BEGIN \*/(.*?)/\* ROCMOE_CDEF_END \*/", header_text, re.S)
    if match is None:
        raise SystemExit("rocmoe.h has no ROCMOE_CDEF_BEGIN/END section")
    return match.group(1)


def make_ffi(header: Path) -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(extract_cdef(header.read_text()))
    ffi.set_source(MODULE, '#include "rocmoe/rocmoe.h"')
    return ffi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--header", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    make_ffi(args.header).emit_c_code(str(args.out))


if __name__ == "__main__":
    main()
