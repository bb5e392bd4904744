#!/usr/bin/env python3
"""Two properties of the built kernels that only their SASS shows.

1. The loads each kernel issues before its PDL wait are still before it. Every kernel of a step starts
   while its producer is still running (programmatic dependent launch) and issues the loads that do not
   depend on the producer (weights, host-written metadata) before `griddepcontrol.wait`, so their round
   trips overlap the producer's tail. Nothing in CUDA keeps them there: ptxas may move the wait (SASS
   `ACQBULK`) above them, and it did (value_kernel's W_UV `__ldg` loads, found 2026-12-05: the wait became
   the kernel's 7th instruction). Checked per kernel family: a minimum count of global loads (LDG, LDGSTS)
   before the first ACQBULK.
   And no non-coherent global load (LDG...CONSTANT: ld.global.nc, __ldg) comes before the wait in a family whose
   pre-wait loads are all plain by design (RULES' last field false): ptxas may also move such loads *above*
   the wait, and it did (the core's query-tile `__ldg`, found 2026-12-06: the uniform-deal split kernels read the
   query before the query kernel's grid was complete).
   And in the kernels of PREWAIT_NO_LOAD_USE no instruction before the wait reads a register that a load before it
   wrote: such an instruction holds the warp until the load lands, before the wait, so that the round trip no
   longer overlaps the producer (found 2026-12-07 in the query kernel: ptxas copied its 16 prefetched registers
   into its projection loop's registers right after their loads, ~60 MOVs at C = 1-4; removing them,
   bench/results/patches/query-prefetch-nomov.patch, measured 2-4 % slower on an H100, so the query family stays
   off the list).
2. No kernel touches local memory (STL/LDL: register spills or a stack array) unless listed in
   LOCAL_MEMORY_ALLOWED with the reason, so a change that makes a hot loop spill fails here, not silently
   in a benchmark; and every kernel listed there is built and does touch it (no stale excuses).
3. The kernels of REGISTER_CAPS use no more registers than their cap (cuobjdump -res-usage), where the count sets
   how many CTAs an SM holds (found 2026-12-07: the combine's pre-wait offsets took it from 64 to 80 registers, one
   512-thread CTA an SM instead of two).

usage: kernel_sass.py CUOBJDUMP_DIR LIBRARY...   (exit 77 = skipped: no cuobjdump/nvdisasm)
"""
import os
import re
import subprocess
import sys

# Kernel name (mangled, as cuobjdump prints it) -> fewest loads (LDG, LDGSTS) before the wait, and what they
# are. The counts are static SASS instructions (a predicated or unrolled load counts once per instruction): the
# designed loads where they are few (core, value_kernel), a floor well under today's count where they are many
# (the query kernels issue 18-27): the failure this guards against is the wait moving above them all.
# The last field: whether non-coherent loads may precede the wait (the query kernel streams its weights with
# ld.global.nc before it; every other family reads only plain host-written data there).
RULES = [
    (r"core_split_kernel", 2, "lengths and totals (src/core/kernel.cuh, cta_split)", False),
    (r"core_wgmma_pp_kernel", 2, "lengths and totals (kernel_wgmma_pp.cuh)", False),
    (r"core_combine_kernel", 1, "lengths (src/core/kernel.cuh, combine)", False),
    (r"value_kernel", 8, "the thread's eight W_UV rows (src/value/kernel.cuh)", False),
    (r"value_mma_kernel", 2, "the first stages' W_UV chunks (src/value/kernel_mma.cuh)", False),
    (r"fused_query_kernel", 12, "the W_UK slice's cp.async and the q_a_norm weights (src/query/kernel.cuh)", True),
    (r"gemm_norm_kernel", 2, "the q_a_norm and kv_a_norm weights (src/query/gemm_kernels.cuh)", False),
    (r"gemm_absorb_kernel", 1, "the W_UK_T slice's cp.async (src/query/gemm_kernels.cuh)", False),
]
# Kernels (regex on the demangled name) whose code before the PDL wait never waits for a load issued there (part 1),
# and the exceptions (demangled, exact) with the reason.
PREWAIT_NO_LOAD_USE = [r"mla::value::value_kernel<", r"mla::value::value_mma_kernel<", r"mla::query::gemm_norm_kernel",
                       r"mla::query::gemm_absorb_kernel"]
PREWAIT_LOAD_USE_ALLOWED = {}
# Kernels (demangled, exact) that use local memory today, and why that is accepted.
LOCAL_MEMORY_ALLOWED = {
    "void mla::core::core_wgmma_pp_kernel<64, 3, 0>(mla::core::CoreParams)":
        "the planned 64-row ping-pong tile at 255 registers: 16-40 B of stack (spill outside the MMA chains; its "
        "cost unmeasured, src/core/README.md)",
    "void mla::core::core_wgmma_pp_kernel<64, 2, 0>(mla::core::CoreParams)": "as <64, 3, 0>",
    "void mla::core::core_wgmma_pp_kernel<64, 3, 2>(mla::core::CoreParams)":
        "the flat-slot 64-row tile: 56 B of stack, the segment walk's state beside the page loop's 255 registers",
    "void mla::core::core_wgmma_pp_kernel<64, 2, 2>(mla::core::CoreParams)": "as <64, 3, 2>",
    "void mla::core::core_wgmma_pp_kernel<64, 3, 3>(mla::core::CoreParams)":
        "the flat-merged 64-row tile (one split): 64 B of stack, as <64, 3, 2> plus the merge's state",
    "void mla::core::core_wgmma_pp_kernel<64, 2, 3>(mla::core::CoreParams)": "as <64, 3, 3>",
    "void mla::query::fused_query_kernel<8, 2, false>(mla::query::QueryParams)":
        "64-row tiles, never planned since the GEMM path takes every shape from 33 rows (forced fused plans only): "
        "48 B of stack in an inner loop at its 168-register cap",
}
# Kernels (demangled, exact) whose register count sets how many CTAs an SM holds, the most registers a thread, and why.
REGISTER_CAPS = {
    "void mla::core::core_combine_kernel<0>(mla::core::CombineParams)":
        (64, "two 512-thread CTAs an SM (one request, G = 16 warps an entry: 192 CTAs at q4 x H12, one wave); at 80 "
             "registers it held one and 1 x 4k x 12 x q4 cores measured 0.895x (bench/results/branches.md)"),
    "void mla::query::gemm_absorb_kernel<64>(mla::query::QueryParams, __nv_bfloat16 const*)":
        (80, "three 256-thread CTAs an SM, as on mma.sync (its 3-CTA launch bound: past it ptxas spills; all eight k "
             "steps' A fragments at once took 90 registers)"),
    "void mla::query::gemm_absorb_kernel<32>(mla::query::QueryParams, __nv_bfloat16 const*)":
        (80, "three 256-thread CTAs an SM at least (its launch bound)"),
    "void mla::query::gemm_absorb_kernel<128>(mla::query::QueryParams, __nv_bfloat16 const*)":
        (128, "two 256-thread CTAs an SM (its launch bound: 64 accumulators a thread)"),
}
RESOURCES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+)")
LOAD = re.compile(r"(LDG|LDGSTS)(\.|$)")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def kernels(sass):
    """(name, [instructions]) per function of cuobjdump -sass output."""
    name, body = None, []
    for line in sass.splitlines():
        if "Function :" in line:
            if name:
                yield name, body
            name, body = line.split("Function :")[1].strip(), []
        elif name:
            m = INSTRUCTION.match(line)
            if m:
                body.append(m.group(1))
    if name:
        yield name, body


def opcode(instruction):
    """The opcode of a SASS instruction, past its predicate (`@!P0 LDG.E ...` -> `LDG.E`)."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


REGISTER = re.compile(r"^R(\d+)$")
# Opcodes whose first operand is read, not written (stores, reductions, barriers, branches, async copies).
NO_DESTINATION = re.compile(r"^(ST|RED|BAR|BRA|BSYNC|BSSY|WARPSYNC|LDGSTS|ACQBULK|EXIT|RET|CALL|DEPBAR|MEMBAR|ERRBAR)")


def load_uses_before_wait(body, ops, wait):
    """Instructions before the wait that read a register a load before the wait wrote (and nothing rewrote)."""
    loaded, uses = set(), []
    for ins, op in zip(body[:wait], ops[:wait]):
        skip = 2 if ins.startswith("@") else 1  # the predicate and the opcode
        words = ins.split(None, skip)
        operands = [o.strip() for o in re.split(r"[,\[\]]", words[-1])] if len(words) > skip else []
        regs = [int(m.group(1)) for o in operands for m in [REGISTER.match(o.split(".")[0].lstrip("-|!~"))] if m]
        has_destination = bool(operands) and not NO_DESTINATION.match(op) and REGISTER.match(operands[0])
        sources = regs[1:] if has_destination else regs
        if any(r in loaded for r in sources):
            uses.append(ins)
        if has_destination:
            dest = int(REGISTER.match(operands[0]).group(1))
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            written = set(range(dest, dest + width))
            if LOAD.match(op):
                loaded |= written
            elif not ins.startswith("@"):
                loaded -= written
    return uses


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    tools, libraries = sys.argv[1], sys.argv[2:]
    cuobjdump = os.path.join(tools, "cuobjdump")
    if not (os.access(cuobjdump, os.X_OK) and os.access(os.path.join(tools, "nvdisasm"), os.X_OK)):
        print(f"SKIPPED: no cuobjdump/nvdisasm in {tools} (scripts/setup.sh installs them)")
        return 77
    env = dict(os.environ, PATH=tools + os.pathsep + os.environ.get("PATH", ""))
    all_kernels, registers = [], {}
    for library in libraries:
        sass = subprocess.run([cuobjdump, "-sass", library], env=env, check=True, capture_output=True,
                              text=True).stdout
        all_kernels.extend(kernels(sass))
        usage = subprocess.run([cuobjdump, "-res-usage", library], env=env, check=True, capture_output=True,
                               text=True).stdout
        registers.update({m.group(1): int(m.group(2)) for m in RESOURCES.finditer(usage)})
    if not all_kernels:
        print("FAILED: no kernel in " + " ".join(libraries))
        return 1
    readable = demangle([name for name, _ in all_kernels])
    failures, waits_checked, local_users = [], 0, set()
    for name, body in all_kernels:
        ops = [opcode(ins) for ins in body]
        # 1. Loads before the PDL wait.
        rule = next((r for r in RULES if re.search(r[0] + r"I|" + r[0] + r"E", name)), None)
        if rule is not None:
            wait = next((i for i, op in enumerate(ops) if op.startswith("ACQBULK")), None)
            if wait is None:
                failures.append(f"{readable[name]}: no ACQBULK (griddepcontrol.wait) at all")
            else:
                before = sum(1 for op in ops[:wait] if LOAD.match(op))
                waits_checked += 1
                line = (f"{readable[name]}: wait at SASS instruction {wait}, {before} loads before it "
                        f"(need >= {rule[1]}: {rule[2]})")
                print(line)
                if before < rule[1]:
                    failures.append("loads after the PDL wait: " + line)
                nc_before = [ins for ins, op in zip(body[:wait], ops[:wait]) if LOAD.match(op) and ".CONSTANT" in op]
                if nc_before and not rule[3]:
                    failures.append(f"{readable[name]}: {len(nc_before)} non-coherent loads before the PDL wait "
                                    f"(ptxas hoisted an ld.global.nc / __ldg of the producer's data?), the first: "
                                    f"{nc_before[0]}")
                if any(re.search(pattern, readable[name]) for pattern in PREWAIT_NO_LOAD_USE):
                    uses = load_uses_before_wait(body, ops, wait)
                    allowed = PREWAIT_LOAD_USE_ALLOWED.get(readable[name])
                    if uses and allowed is None:
                        failures.append(f"{readable[name]}: {len(uses)} instructions before the PDL wait wait for "
                                        f"a load issued before it (the first: {uses[0]}): the round trip no longer "
                                        f"overlaps the producer")
                    elif not uses and allowed is not None:
                        failures.append(f"PREWAIT_LOAD_USE_ALLOWED lists {readable[name]}, which waits for no load "
                                        f"before the wait now (remove it)")
        # 2. Local memory.
        local = sum(1 for op in ops if op.startswith(("STL", "LDL")))
        if local:
            local_users.add(readable[name])
            why = LOCAL_MEMORY_ALLOWED.get(readable[name])
            line = f"{readable[name]}: {local} local-memory instructions (STL/LDL)"
            print(line + (f": allowed, {why}" if why else ""))
            if why is None:
                failures.append("local memory: " + line + " (spills? see ptxas -v; or list it with the reason)")
    # 3. Register caps.
    by_readable = {readable[name]: name for name, _ in all_kernels}
    for listed, (cap, why) in REGISTER_CAPS.items():
        if listed not in by_readable:
            failures.append(f"REGISTER_CAPS lists {listed}, which is not built (renamed? remove it)")
            continue
        count = registers.get(by_readable[listed])
        print(f"{listed}: {count} registers (cap {cap}: {why})")
        if count is None or count > cap:
            failures.append(f"registers: {listed} uses {count}, more than its cap {cap} ({why})")
    # 4. The lists themselves: an entry whose kernel is gone or no longer touches local memory is stale (its reason
    #    would excuse a later spill unseen).
    built = set(readable.values())
    for listed in PREWAIT_LOAD_USE_ALLOWED:
        if listed not in built:
            failures.append(f"PREWAIT_LOAD_USE_ALLOWED lists {listed}, which is not built (renamed? remove it)")
    for listed in LOCAL_MEMORY_ALLOWED:
        if listed not in built:
            failures.append(f"LOCAL_MEMORY_ALLOWED lists {listed}, which is not built (renamed? remove it)")
        elif listed not in local_users:
            failures.append(f"LOCAL_MEMORY_ALLOWED lists {listed}, which uses no local memory now (remove it)")
    if waits_checked == 0:
        print("FAILED: no kernel matched a PDL-wait rule (renamed kernels? update RULES)")
        return 1
    if failures:
        print("\nFAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print(f"\nPASSED: {len(all_kernels)} kernels, {waits_checked} with a PDL-wait rule")
    return 0


if __name__ == "__main__":
    sys.exit(main())
