"""Reading AMD CDNA assembly (tests' helper): the release sequence a signal needs, and what a
kernel holds of a compute unit (resources()).

A signal is a flag store that a peer GPU, or the host, may read: the data stored before it
must be visible at system scope first. On CDNA the L2 cache of a GPU is not coherent with
other agents, so a system-scope release is an L2 write-back, a wait for it (and for the data
stores) to complete, then the flag store. What the compilers emit (LLVM's AMDGPU memory
model; checked with clang-19 and Triton 3.x for both targets):

    gfx942 (MI300X)   buffer_wbl2 sc0 sc1 ; s_waitcnt vmcnt(0) ; <flag store ... sc1>
    gfx90a (MI250X)   buffer_wbl2         ; s_waitcnt vmcnt(0) ; <flag store>

A release at agent (GPU) scope instead writes back with `buffer_wbl2 sc1` on gfx942 and not
at all on gfx90a; a relaxed store has no write-back: neither is visible to a peer GPU in
order, and release_problems() reports both.

The wait after the write-back is what makes the flag follow the data out of L2 ("a
S_WAITCNT vmcnt(0) is needed after to ensure the writeback has completed", LLVM's
SIMemoryLegalizer). LLVM's waitcnt pass did not count buffer_wbl2 as outstanding and dropped
that wait wherever vmcnt had just been waited to 0 (WAIT_DROPPED_BY): clang-19 emits every
HIP signal of rocmoe that way, Triton's newer LLVM does not.
"""


from __future__ import annotations

import re

WAIT_DROPPED_BY = ("LLVM before llvm/llvm-project#178316 (2026-01, 'Fix missing waitcnt after "
                   "buffer_wbl2') drops the s_waitcnt vmcnt(0) after the write-back")
SYSTEM_WRITEBACK = {"gfx942": "buffer_wbl2 sc0 sc1", "gfx90a": "buffer_wbl2"}
# how far before the flag store the write-back may be: a few moves of the flag's address
# and value may sit in between, no other memory access
# how far before a flag store its write-back may sit: the address of a peer's slot is often
# computed between the two (register arithmetic and loads only; a store there is reported)
WINDOW = 16
_VECTOR_MEMORY = re.compile(r"^(global|flat|buffer|scratch)_(store|atomic)")


def instructions(asm: str) -> list[str]:
    """The instructions and labels (branch targets, "...:") of `asm`, comments and
    assembler directives dropped."""
    out = []
    for line in asm.splitlines():
        text = line.split(";")[0].strip()
        if text and (text.endswith(":") or not text.startswith(".")):
            out.append(" ".join(text.split()))
    return out


def flag_stores(asm: str, pattern: str) -> list[int]:
    """Indexes (into instructions(asm)) of the instructions matching `pattern`."""
    regex = re.compile(pattern)
    return [i for i, ins in enumerate(instructions(asm)) if regex.search(ins)]


def release_problems(asm: str, arch: str, flag_pattern: str, wait: bool = True) -> list[str]:
    """Why each flag store matching `flag_pattern` is not a system-scope release on `arch`
    (empty: every one is); a listing with no such store is a problem too. wait=False leaves
    out the s_waitcnt after the write-back (see WAIT_DROPPED_BY)."""
    code = instructions(asm)
    stores = flag_stores(asm, flag_pattern)
    if not stores:
        return [f"no flag store matching {flag_pattern!r}"]
    writeback = SYSTEM_WRITEBACK[arch]
    problems = []
    for i in stores:
        before = code[max(0, i - WINDOW):i]
        where = f"flag store #{i} `{code[i]}`"
        wb = [k for k, ins in enumerate(before) if ins.startswith("buffer_wbl2")]
        if not wb:
            problems.append(f"{where}: no L2 write-back (buffer_wbl2) before it")
            continue
        last = wb[-1]
        if before[last] != writeback:
            problems.append(f"{where}: `{before[last]}` is not the system-scope write-back "
                            f"`{writeback}`")
            continue
        between = before[last + 1:]
        if any(ins.endswith(":") for ins in between):
            problems.append(f"{where}: a branch target between the write-back and the store")
        if wait and not any(ins.startswith("s_waitcnt") and "vmcnt(0)" in ins
                            for ins in between):
            problems.append(f"{where}: no s_waitcnt vmcnt(0) after the write-back")
        if any(_VECTOR_MEMORY.match(ins) for ins in between):
            problems.append(f"{where}: another store between the write-back and the flag")
        if arch == "gfx942" and " sc1" not in f" {code[i]}":
            problems.append(f"{where}: not a system-scope (sc1) access")
    return problems


# the register and scratch figures LLVM's AMDGPU back end writes into a kernel's listing:
# its comment block ("; NumVgprs: 153") and the code object's metadata (".vgpr_spill_count:")
_COMMENT_FIGURES = {"vgprs": "NumVgprs", "agprs": "NumAgprs", "scratch_bytes": "ScratchSize",
                    "occupancy": "Occupancy"}
_METADATA_FIGURES = {"sgprs": ".sgpr_count", "vgpr_spills": ".vgpr_spill_count",
                     "sgpr_spills": ".sgpr_spill_count"}


def resources(asm: str) -> dict:
    """A kernel's registers (VGPRs and AGPRs a lane, SGPRs a wave), its spills (VGPRs go to
    scratch memory, SGPRs into lanes of VGPRs), its scratch bytes a lane and the waves a SIMD
    it allows, read from an AMDGPU listing of one kernel. A figure missing from the listing
    raises KeyError: a check on it must not pass for want of the figure."""
    found = {}
    for key, name in _COMMENT_FIGURES.items():
        m = re.search(rf"^\s*; {name}: (\d+)\s*$", asm, re.M)
        if m:
            found[key] = int(m.group(1))
    for key, name in _METADATA_FIGURES.items():
        m = re.search(rf"^\s*{re.escape(name)}:\s+(\d+)\s*$", asm, re.M)
        if m:
            found[key] = int(m.group(1))
    missing = sorted((set(_COMMENT_FIGURES) | set(_METADATA_FIGURES)) - set(found))
    if missing:
        raise KeyError(f"the listing has no {missing}")
    return found


def kernel_metadata(asm: str) -> dict:
    """{kernel symbol: {field: int}} from the code object metadata of an AMDGPU listing with
    several kernels (the `amdhsa.kernels` list: ".private_segment_fixed_size" is the scratch
    bytes a lane, ".vgpr_count", ".vgpr_spill_count", ...); integer fields only."""
    if "amdhsa.kernels:" not in asm:
        raise KeyError("the listing has no amdhsa.kernels metadata")
    section = asm.split("amdhsa.kernels:", 1)[1]
    kernels = {}
    for entry in re.split(r"\n  - (?=\.)", "\n" + section)[1:]:
        fields = dict(re.findall(r"^\s{0,4}(\.[a-z_]+):\s+(\d+)\s*$", "    " + entry, re.M))
        name = re.search(r"^\s{0,4}\.name:\s+(\S+)", "    " + entry, re.M)
        if name:
            kernels[name.group(1)] = {k: int(v) for k, v in fields.items()}
    return kernels

