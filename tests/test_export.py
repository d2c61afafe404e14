"""Export of every kernel variant for every arch on a CPU-only machine: manifest contents,
SASS fingerprints of each design's fast path, and the header <-> runtime ABI round trip."""
import ctypes
import json
import re

import pytest

from helpers import dsl_installed
from cutekern.arch import ARCHES
from cutekern.registry import OPS
from cutekern.runtime import tensor_struct

pytestmark = pytest.mark.skipif(not dsl_installed(), reason="needs nvidia-cutlass-dsl")

# design -> (required SASS opcodes, forbidden ones): gpu.md's fingerprints for the MMA ops
FINGERPRINTS = {
    "sm90": ({"HGMMA", "UTMALDG", "SYNCS"}, {"HMMA"}),
    "ada": ({"LDGSTS", "LDSM", "HMMA"}, {"HGMMA", "UTCHMMA"}),
    "sm100": ({"UTCHMMA", "UTCBAR", "LDTM", "UTMALDG"}, {"HMMA", "HGMMA"}),
}
# memory-bound ops have no MMA: each design proves its copy path instead (bulk/TMA copies
# and mbarriers on sm90, cp.async on Ada, tensor memory on sm100), and the deterministic
# BGMV kernels must contain no atomics at all
ATOMICS = {"ATOM", "ATOMG", "ATOMS", "RED", "REDG"}
OP_FINGERPRINTS = {
    ("attn_res", "sm90"): ({"UBLKCP", "SYNCS"}, {"LDGSTS"}),
    ("attn_res", "ada"): ({"LDGSTS", "LDGDEPBAR"}, {"UTMALDG", "UBLKCP", "SYNCS"}),
    ("attn_res", "sm100"): ({"STTM", "LDTM", "UBLKCP", "SYNCS"}, {"LDGSTS"}),
    # sm90 BGMV: tensor-core dots (mma.sync: M = a few pairs, too skinny for WGMMA) in both
    # schedules, so the pair and bin schedules share one arithmetic
    ("bgmv_shrink", "sm90"): ({"LDGSTS", "LDGDEPBAR", "VOTE", "HMMA"}, ATOMICS),
    ("bgmv_expand", "sm90"): ({"LDGSTS", "LDGDEPBAR", "VOTE", "HMMA"}, ATOMICS),
    # the large-batch plan kernel (shrink + expand per bin, one launch): both groups' device
    # code, and no PDL wait (nothing runs before it in the plan)
    ("bgmv_binplan", "sm90"): ({"LDGSTS", "LDGDEPBAR", "VOTE", "HMMA", "STG"},
                             ATOMICS | {"ACQBULK"}),
    # Ada: the sm90 BGMV kernels built without PDL (neither griddepcontrol instruction)
    ("bgmv_shrink", "ada"): ({"LDGSTS", "LDGDEPBAR", "VOTE", "HMMA"},
                             ATOMICS | {"UTMALDG", "HGMMA", "ACQBULK", "PREEXIT"}),
    ("bgmv_expand", "ada"): ({"LDGSTS", "LDGDEPBAR", "VOTE", "HMMA"},
                             ATOMICS | {"UTMALDG", "HGMMA", "ACQBULK", "PREEXIT"}),
    ("bgmv_binplan", "ada"): ({"LDGSTS", "LDGDEPBAR", "VOTE", "HMMA", "STG"},
                              ATOMICS | {"UTMALDG", "HGMMA", "ACQBULK", "PREEXIT"}),
    ("bgmv_shrink", "sm100"): ({"UBLKCP", "SYNCS", "VOTE"}, ATOMICS | {"LDGSTS"}),
    # the KDA chain: cp.async + ldmatrix + mma.sync, one writer per output (no atomics), the
    # fp32 state block in registers (no local memory)
    ("kda_chain", "ada"): ({"LDGSTS", "LDSM", "HMMA"},
                           ATOMICS | {"HGMMA", "UTCHMMA", "UTMALDG", "LDL", "STL"}),
    # the KDA intra kernel: no local memory either since G's slabs are kept in a
    # bank-conflict-free order (its K = 128 builds spilled a few registers before)
    ("kda_intra", "ada"): ({"LDGSTS", "LDSM", "HMMA"},
                           ATOMICS | {"HGMMA", "UTCHMMA", "UTMALDG", "LDL", "STL"}),
    ("bgmv_expand", "sm100"): ({"UTMALDG", "UBLKCP", "SYNCS", "VOTE"}, ATOMICS | {"LDGSTS"}),
    # the W4A16 GEMM: cp.async rings and mma.sync on codes dequantized in registers (packed
    # HFMA2), activations read back as 16-byte vectors (LDS, no ldmatrix: a lane's vector is
    # its own A fragment), no atomics, no local memory
    ("w4a16_gemm", "ada"): ({"LDGSTS", "LDGDEPBAR", "HMMA", "HFMA2"},
                            ATOMICS | {"HGMMA", "UTCHMMA", "UTMALDG", "LDL", "STL"}),
    # the one-launch MLP block: the GEMM's device code twice, its CTAs meeting through
    # release / acquire flags (strong gpu-scope stores and loads, a gpu membar, L1
    # invalidation on acquire), still no atomics
    ("w4a16_mlp", "ada"): ({"LDGSTS", "LDGDEPBAR", "HMMA", "HFMA2", "MEMBAR", "CCTL"},
                           ATOMICS | {"HGMMA", "UTCHMMA", "UTMALDG", "LDL", "STL"}),
    # decode attention: CUDA-core dots over 16-byte cache loads, butterfly sums, exp2; a
    # fixed-order combine (no atomics), no local memory
    ("decode_attn", "ada"): ({"LDG", "SHFL", "MUFU", "FFMA"},
                             ATOMICS | {"HGMMA", "UTCHMMA", "UTMALDG", "LDL", "STL"}),
    # residual add + RMSNorm: 16-byte loads and stores, butterfly + shared-memory sum, rsqrt
    ("add_rms_norm", "ada"): ({"LDG", "STG", "SHFL", "MUFU", "BAR"},
                              ATOMICS | {"HGMMA", "UTCHMMA", "UTMALDG", "LDL", "STL"}),
}


@pytest.fixture(scope="session")
def exported(session_cache, tmp_path_factory):
    from cutekern.export import export
    out = tmp_path_factory.mktemp("export")
    manifest = export(ARCHES, out, log=lambda *a: None)
    return out, manifest


def test_manifest_lists_every_variant_for_every_arch(exported):
    out, manifest = exported
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["kernels"] == json.loads(json.dumps(manifest["kernels"], default=str))
    got = {(e["op"], e["design"], e["arch"], tuple(sorted(e["dtypes"].items())),
            tuple(sorted(e["flags"].items()))) for e in on_disk["kernels"]}
    from cutekern.arch import DESIGNS_FOR_ARCH
    want = sum(len(op.variants_for(d)) for arch in ARCHES for op in OPS.values()
               for d in op.designs_on(arch))
    assert len(got) == len(on_disk["kernels"]) == want
    # every arch carries every LCE variant
    for arch in ARCHES:
        n = sum(e["arch"] == arch and e["op"] == "lce_gemm" for e in on_disk["kernels"])
        assert n == sum(len(OPS["lce_gemm"].variants_for(d)) for d in DESIGNS_FOR_ARCH[arch])
    for e in on_disk["kernels"]:
        assert (out / e["object"]).stat().st_size > 0 and (out / e["header"]).exists()
        assert e["prefix"] in (out / e["header"]).read_text()
        assert e["config"], "tile config must be recorded"


def _opcodes(sass: str) -> set:
    from cutekern.compile import sass_opcodes
    return sass_opcodes(sass)


# The sm90 AttnRes split kernels with few chunks per thread (split_direct) load every source
# straight into registers: 16-byte LDGs and the DSMEM exchange's mbarriers, no ring at all.
ATTN_RES_SM90_DIRECT = ({"LDG", "SYNCS"}, {"LDGSTS", "UBLKCP"})


# The Ada design's AttnRes split kernels (no clusters on sm_80 / sm_89) are those kernels
# with the exchange through global memory: no mbarrier, no cluster barrier, no ring.
ATTN_RES_ADA_SPLIT = ({"LDG", "STG"},
                      {"LDGSTS", "UBLKCP", "SYNCS", "UCGABAR_ARV", "UCGABAR_WAIT", "UTMALDG"})
# The sm100 design's split kernels are the sm90 ones built for sm_100a / sm_103a: registers
# and the DSMEM exchange, no ring and no tensor memory.
ATTN_RES_SM100_SPLIT = ({"LDG", "SYNCS"}, {"LDGSTS", "UBLKCP", "STTM", "LDTM"})


def _fingerprint(e):
    if (e["op"], e["design"]) == ("attn_res", "sm90") and "UBLKCP" not in e["sass"]["required"]:
        assert e["flags"]["row_split"] > 1, f"{e['prefix']}: only split kernels skip the ring"
        return ATTN_RES_SM90_DIRECT
    if (e["op"], e["design"]) == ("attn_res", "ada") and e["flags"]["row_split"] > 1:
        return ATTN_RES_ADA_SPLIT
    if (e["op"], e["design"]) == ("attn_res", "sm100") and e["flags"]["row_split"] > 1:
        return ATTN_RES_SM100_SPLIT
    return OP_FINGERPRINTS.get((e["op"], e["design"])) or FINGERPRINTS[e["design"]]


@pytest.mark.parametrize("arch", ARCHES)
def test_sass_fingerprints(exported, arch):
    out, manifest = exported
    entries = [e for e in manifest["kernels"] if e["arch"] == arch]
    assert entries
    for e in entries:
        ops = _opcodes((out / e["object"]).with_suffix(".sass").read_text())
        need, forbid = _fingerprint(e)
        missing = {f for f in need if not any(o.startswith(f) for o in ops)}
        assert not missing, f"{e['prefix']}: fast-path instructions missing: {missing}"
        assert not (ops & forbid), f"{e['prefix']}: slow-path instructions present: {ops & forbid}"
        assert set(e["sass"]["required_found"]) >= set(e["sass"]["required"])


def _op_sass(exported, op):
    """(manifest entry, disassembly) of every exported variant of ``op``."""
    out, manifest = exported
    return [(e, (out / e["object"]).with_suffix(".sass").read_text())
            for e in manifest["kernels"] if e["op"] == op]


def _instructions(sass):
    """The disassembly's instruction lines (address comment, then an opcode or predicate)."""
    import re
    return [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+[A-Z@]", ln)]


def test_decode_attn_reads_the_cache_in_16_byte_vectors(exported):
    """Each lane's K and V rows are one 16-byte load per position (a 2-byte load per element
    came out of a column-major register layout once); the splits exchange single-copy-atomic
    8-byte words."""
    import re
    variants = _op_sass(exported, "decode_attn")
    for e, sass in variants:
        wide = len(re.findall(r"LDG\.E\.128", sass))
        assert wide >= 2 * dict(e["config"])["unroll"], (e["prefix"], wide)
        assert not re.search(r"LDG\.E\.(U16|S16)", sass), e["prefix"]
        # the splits' exchange: tagged 8-byte words, strong gpu-scope loads and stores, no
        # fence (the tag vouches for the value)
        assert re.search(r"STG\.E\.64\.STRONG\.GPU", sass), e["prefix"]
        assert re.search(r"LDG\.E\.64\.STRONG\.GPU", sass), e["prefix"]
        assert "MEMBAR" not in sass, e["prefix"]
        # split 0 loads a split's 4 words together (not 4 dependent polls): 4 strong loads
        # within 8 instructions somewhere
        at = [i for i, ln in enumerate(_instructions(sass)) if "LDG.E.64.STRONG.GPU" in ln]
        assert any(at[k + 3] - at[k] < 8 for k in range(len(at) - 3)), (e["prefix"], at)
        # cutekern.decode.RESIDENT_PER_SM = 2 CTAs of 256 threads share an SM's 64K
        # registers: at most 128 a thread (2 reserved and the rounding to 8 included)
        regs = max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) + 1
        assert 32 * dict(e["config"])["warps"] == 256 and regs + 2 <= 128, (e["prefix"], regs)
    assert len(variants) >= 2


def test_add_rms_norm_moves_16_byte_vectors(exported):
    """x (fp32) and w in two 16-byte pieces per 8 elements, y and out in one: 7 wide loads
    (x twice: the add, then the norm) and 3 wide stores, nothing narrower touching memory."""
    import re
    variants = _op_sass(exported, "add_rms_norm")
    for e, sass in variants:
        assert len(re.findall(r"LDG\.E\.128", sass)) == 7, e["prefix"]
        assert len(re.findall(r"STG\.E\.128", sass)) == 3, e["prefix"]
        assert not re.search(r"(LDG|STG)\.E(\.(U16|S16|64))?\s", sass), e["prefix"]
    assert len(variants) >= 2


def test_kda_intra_code_fits_the_instruction_cache(exported):
    """The KDA intra kernel's K-slab loops are runtime loops: unrolled, its straight-line
    code (21k SASS instructions) spent a third of its time on instruction fetch (ncu on the
    H200); looped, every variant is ~7.5k (perf/NOTES.md, 24th session)."""
    _, manifest = exported
    sizes = {e["prefix"]: len(_instructions(sass)) for e, sass in _op_sass(exported, "kda_intra")}
    assert sizes and len(sizes) == sum(e["op"] == "kda_intra" for e in manifest["kernels"])
    big = {k: v for k, v in sizes.items() if not 1000 < v <= 9000}
    assert not big, f"kda_intra variants outside 1k..9k SASS instructions: {big}"


def test_kda_chain_waits_for_its_second_half_late(exported):
    """Each chunk step of the KDA chain kernel waits at its top for the first cp.async group
    only (w, qg, u: `DEPBAR.LE SB0, 0x1`) and for the second (Aqk, kg, exp(Gamma)) after
    v_new: waiting for both at the top put a memory latency into every step (chain 0.37 ->
    0.27 ms at 1 x 8192 H = 64 on the H200, perf/NOTES.md, 25th session)."""
    import re
    out, manifest = exported
    chains = [e for e in manifest["kernels"] if e["op"] == "kda_chain"]
    assert chains
    for e in chains:
        sass = (out / e["object"]).with_suffix(".sass").read_text()
        waits = re.findall(r"DEPBAR\.LE\s+SB0,\s*0x([0-9a-f]+)", sass)
        assert "1" in waits and "0" in waits, f"{e['prefix']}: cp.async waits {waits}"


def test_lce_sm90_phases_overlap_through_pdl(exported):
    """The sm_90a user phase lets the candidate phase launch early (PREEXIT = griddepcontrol
    .launch_dependents) and the candidate phase waits for it before reading the addend
    (ACQBULK = griddepcontrol.wait); without the wait the addend could be read stale."""
    out, manifest = exported
    seen = set()
    for e in manifest["kernels"]:
        if (e["op"], e["design"], e["arch"]) != ("lce_gemm", "sm90", "sm_90a"):
            continue
        ops = _opcodes((out / e["object"]).with_suffix(".sass").read_text())
        add = e["flags"]["has_addend"]
        want = "ACQBULK" if add else "PREEXIT"
        assert want in ops, f"{e['prefix']}: {want} missing"
        seen.add(add)
    assert seen == {True, False}


def test_lce_sm90_tail_tiles(exported):
    """The sm_90a LCE kernels hold one WGMMA shape per width the last M tile may run
    (kernels/sm90/lce.py, m_tail) besides the full tile's: 433 rows cost 224 + 216; the wide
    build (flag `wide`) runs 256-wide tiles, the user phase's narrow build (flag `narrow`)
    112-wide ones (433 = 3 x 112 + 104)."""
    from kernels.sm90.lce import LceSm90Config, _m_tail_widths
    from dataclasses import replace
    out, manifest = exported
    want = {"wide": {256, 248, 240}, "narrow": {112, 104, 96}, None: {224, 216, 208}}
    seen = set()
    for e in manifest["kernels"]:
        if (e["op"], e["design"], e["arch"]) != ("lce_gemm", "sm90", "sm_90a"):
            continue
        c, fl = e["config"], e["flags"]
        build = "wide" if fl["wide"] else "narrow" if fl["narrow"] else None
        assert not (build == "narrow" and fl["has_addend"]), "narrow is a user-phase build"
        cfg = replace(LceSm90Config(), tile_m=c[f"{build}_tile_m" if build else "tile_m"])
        widths = {cfg.tile_m, *_m_tail_widths(cfg)}
        assert widths == want[build]
        sass = (out / e["object"]).with_suffix(".sass").read_text()
        got = {int(w) for w in re.findall(r"HGMMA\.64x(\d+)x16", sass)}
        assert got == widths, f"{e['prefix']}: WGMMA widths {sorted(got)}"
        seen.add((build, fl["has_addend"], e["dtypes"]["ab"]))
    assert len(seen) == len(OPS["lce_gemm"].variants_for("sm90")) == 10


def test_bgmv_sm90_expand_overlaps_shrink_through_pdl(exported):
    """The sm_90a shrink lets the next kernel launch early (PREEXIT); the expand variant a
    plan launches after it waits for it (ACQBULK) before it reads s, and the stand-alone
    expand (launched after an arbitrary kernel) has no PDL wait because it is launched
    without PDL (it must not start early at all)."""
    out, manifest = exported
    seen = set()
    for e in manifest["kernels"]:
        if e["design"] != "sm90" or e["arch"] != "sm_90a" or \
                e["op"] not in ("bgmv_shrink", "bgmv_expand"):
            continue
        ops = _opcodes((out / e["object"]).with_suffix(".sass").read_text())
        if e["op"] == "bgmv_shrink":
            assert "PREEXIT" in ops, f"{e['prefix']}: PREEXIT missing"
            seen.add("shrink")
        else:
            plan = e["flags"]["after_shrink"]
            assert ("ACQBULK" in ops) == plan, f"{e['prefix']}: ACQBULK {'missing' if plan else 'present'}"
            seen.add(f"expand after_shrink={plan}")
    assert seen == {"shrink", "expand after_shrink=True", "expand after_shrink=False"}


def test_bgmv_ada_small_batches_in_one_launch(exported):
    """The Ada design's plan kernel holds the one-launch small-batch kernel, whose CTAs
    exchange the shrink's segment partials as 8-byte relaxed gpu-scope words (no atomics, no
    fences: the SASS fingerprints above forbid ATOM / RED); the sm90 plan kernel has none
    (its small batches keep the PDL-overlapped pair kernels)."""
    seen = set()
    for e, sass in _op_sass(exported, "bgmv_binplan"):
        has = "pair_kernel" in sass
        assert has == (e["design"] == "ada"), f"{e['prefix']}: pair_kernel {'present' if has else 'missing'}"
        if has:
            body = re.search(r"^\.text\.\S*pair_kernel\S*:\n(.*?)(?=^//-{5}|\Z)", sass,
                             re.S | re.M).group(1)
            assert "LDG.E.64.STRONG.GPU" in body and "STG.E.64.STRONG.GPU" in body, e["prefix"]
            assert "HMMA" in body and "LDGSTS" in body and "MEMBAR" not in body, e["prefix"]
        seen.add((e["design"], e["arch"]))
    assert seen == {("sm90", "sm_90a"), ("ada", "sm_80"), ("ada", "sm_89"), ("ada", "sm_90a")}


_STRUCT = re.compile(r"typedef struct \{\s*void \*data;\s*int32_t dynamic_shapes\[(\d+)\];"
                     r"(?:\s*int64_t dynamic_strides\[(\d+)\];)?\s*\}\s*(\w+)_Tensor_(\w+)_t;")
_WRAPPER = re.compile(r"cute_dsl_(\w+)_wrapper\(\w+_Kernel_Module_t \*module, ([^)]*)\)")


def test_header_abi_round_trip(exported):
    """The C structs the exported header declares are the ones the runtime builds."""
    out, manifest = exported
    for e in manifest["kernels"]:
        text = (out / e["header"]).read_text()
        structs = {m.group(4): (int(m.group(1)), int(m.group(2) or 0)) for m in _STRUCT.finditer(text)}
        w = _WRAPPER.search(text)
        assert w and w.group(1) == e["prefix"]
        params = [p.strip().split()[-1].lstrip("*") for p in w.group(2).split(",")]
        assert params == [a["name"] for a in e["abi"]], "argument order"
        ctypes_of = {p.strip().split()[-1].lstrip("*"): p.strip().split()[0] for p in w.group(2).split(",")}
        for a in e["abi"]:
            if a["kind"] == "scalar":  # passed by value: the runtime points at a c_int32 / c_float
                assert ctypes_of[a["name"]] == {"int32": "int32_t", "float32": "float"}[a["dtype"]], a
            if a["kind"] != "tensor":
                continue
            assert structs[a["name"]] == (a["dynamic_shapes"], a["dynamic_strides"]), a
            st = tensor_struct(a["rank"])
            # pointer + int32 shapes (+ padding) + int64 strides, as the C compiler lays it out
            want = 8 + 4 * a["rank"]
            if a["rank"] > 1:
                want = -(-want // 8) * 8 + 8 * (a["rank"] - 1)
            assert ctypes.sizeof(st) == -(-want // 8) * 8
            assert st.dynamic_shapes.offset == 8


def test_runtime_loads_every_exported_object(exported):
    """The DSL-free runtime accepts every object (module creation needs no GPU; looking up
    and launching the function does, and is covered by the GPU self-test)."""
    from cutekern.runtime import _library
    out, manifest = exported
    lib = _library(None)
    for e in manifest["kernels"]:
        data = (out / e["object"]).read_bytes()
        mod = ctypes.c_void_p()
        err = lib.lib.CuteDSLRT_Module_Create_From_Bytes(ctypes.byref(mod), data, len(data), None, 0)
        assert err == 0 and mod.value, e["prefix"]
