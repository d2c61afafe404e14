"""The compile-cache key covers every codegen argument; the disk cache is atomic."""
import dataclasses
import json
import multiprocessing as mp
import os

import pytest

from cutekern.registry import OPS, KernelKey, all_keys
from helpers import dsl_installed

BASE = KernelKey("lce_gemm", "sm90", "sm_90a", (("ab", "float16"), ("c", "float16")),
                 (("has_addend", True),), (("tile_m", 128), ("tile_n", 256), ("stages", 4)))


def _variants():
    yield dataclasses.replace(BASE, op="other")
    yield dataclasses.replace(BASE, design="ada")
    yield dataclasses.replace(BASE, arch="sm_100a")
    yield dataclasses.replace(BASE, dtypes=(("ab", "bfloat16"), ("c", "float16")))
    yield dataclasses.replace(BASE, dtypes=(("ab", "float16"), ("c", "float32")))
    yield dataclasses.replace(BASE, flags=(("has_addend", False),))
    for i, (k, v) in enumerate(BASE.config):
        cfg = list(BASE.config)
        cfg[i] = (k, v * 2)
        yield dataclasses.replace(BASE, config=tuple(cfg))


def test_key_changes_with_every_codegen_argument():
    seen = {BASE.digest}
    for v in _variants():
        assert v.digest not in seen, v
        assert v.prefix != BASE.prefix
        seen.add(v.digest)
    assert dataclasses.replace(BASE).digest == BASE.digest  # and is deterministic


def test_prefix_is_a_c_identifier():
    assert BASE.prefix.replace("_", "").isalnum()


def test_registry_covers_every_arch():
    keys = all_keys(("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_103a"), with_config=False)
    designs = {(k.arch, k.design) for k in keys}
    # SM100 also builds the Ada design of the ops without an sm100 design (KDA, W4A16 GEMM,
    # MLP block, decode attention, add + RMSNorm)
    assert designs == {("sm_80", "ada"), ("sm_89", "ada"), ("sm_90a", "sm90"), ("sm_90a", "ada"),
                       ("sm_100a", "sm100"), ("sm_103a", "sm100"), ("sm_100a", "ada"),
                       ("sm_103a", "ada")}
    assert {k.op for k in keys if k.arch == "sm_100a" and k.design == "ada"} == {
        "kda_chain", "kda_intra", "w4a16_gemm", "w4a16_mlp", "decode_attn", "add_rms_norm"}
    want = sum(len(op.variants_for(design)) for arch in {a for a, _ in designs}
               for op in OPS.values() for design in op.designs_on(arch))
    assert len(keys) == want and len(keys) >= 6 * len(OPS["lce_gemm"].variants)


needs_dsl = pytest.mark.skipif(not dsl_installed(), reason="needs nvidia-cutlass-dsl")


@needs_dsl
def test_config_in_key_comes_from_the_design(session_cache):
    keys = all_keys(("sm_90a",))
    assert all(k.config for k in keys)


@needs_dsl
def test_source_hash_covers_dsl_version_and_source(session_cache, tmp_path, monkeypatch):
    from cutekern import compile as ck
    key = all_keys(("sm_80",))[0]
    d = ck.entry_dir(key)
    assert f"dsl-{ck.dsl_version()}" in str(d) and ck.source_hash(key.op, key.design) in d.name
    ck.source_hash.cache_clear()
    h1 = ck.source_hash(key.op, key.design)
    # an edited shared source file must give a new hash
    src = ck._PKG_ROOT / "layout.py"
    text = src.read_text()
    try:
        src.write_text(text + "\n# edit\n")
        ck.source_hash.cache_clear()
        assert ck.source_hash(key.op, key.design) != h1
    finally:
        src.write_text(text)
        ck.source_hash.cache_clear()


def test_source_hash_covers_sibling_kernels():
    """bgmv_binplan runs the shrink's and the expand's device code, and the Ada design's BGMV
    kernels and the Ada and sm100 AttnRes split kernels run the sm90 ones: editing
    one changes the hash of every op that runs it (a stale kernel would otherwise be served
    from the cache)."""
    from cutekern import compile as ck
    ck.source_hash.cache_clear()
    users = {"bgmv_shrink.py": (("bgmv_binplan", "sm90"), ("bgmv_shrink", "ada")),
             "bgmv_expand.py": (("bgmv_binplan", "sm90"), ("bgmv_expand", "ada")),
             "attn_res.py": (("attn_res", "ada"), ("attn_res", "sm100"))}
    before = {u: ck.source_hash(*u) for us in users.values() for u in us}
    for name, us in users.items():
        src = ck._REPO_ROOT / "kernels" / "sm90" / name
        text = src.read_text()
        try:
            src.write_text(text + "\n# edit\n")
            ck.source_hash.cache_clear()
            for u in us:
                assert ck.source_hash(*u) != before[u], (name, u)
        finally:
            src.write_text(text)
            ck.source_hash.cache_clear()
    assert {u: ck.source_hash(*u) for u in before} == before


def test_source_hash_covers_design_helpers():
    """kernels/<design>/_*.py (device code shared by a design's kernels) is part of the
    hash of that design's ops and of the ops that run its kernels (the Ada design's BGMV
    kernels and its AttnRes split kernels are the sm90 ones), and of no other design's."""
    from cutekern import compile as ck
    ck.source_hash.cache_clear()
    ops = (("bgmv_shrink", "sm90"), ("bgmv_expand", "sm90"), ("bgmv_shrink", "ada"),
           ("bgmv_expand", "ada"), ("attn_res", "sm90"), ("attn_res", "ada"), ("lce_gemm", "ada"),
           ("ikbo_attn", "ada"))
    before = {(op, d): ck.source_hash(op, d) for op, d in ops}
    src = ck._REPO_ROOT / "kernels" / "sm90" / "_bin_scan.py"
    text = src.read_text()
    try:
        src.write_text(text + "\n# edit\n")
        ck.source_hash.cache_clear()
        for op_design in ops[:6]:
            assert ck.source_hash(*op_design) != before[op_design], op_design
        for op_design in ops[6:]:
            assert ck.source_hash(*op_design) == before[op_design], op_design
    finally:
        src.write_text(text)
        ck.source_hash.cache_clear()


def _build_in_child(cache, arch_key_json, q):
    os.environ["CUTEKERN_CACHE_DIR"] = cache
    from cutekern import compile as ck
    k = json.loads(arch_key_json)
    key = KernelKey(k["op"], k["design"], k["arch"], tuple(map(tuple, k["dtypes"])),
                    tuple(map(tuple, k["flags"])), tuple(map(tuple, k["config"])))
    q.put(str(ck.build(key)))


@needs_dsl
def test_disk_cache_is_atomic_across_processes(tmp_path):
    key = all_keys(("sm_80",))[0]
    blob = json.dumps({"op": key.op, "design": key.design, "arch": key.arch, "dtypes": key.dtypes,
                       "flags": key.flags, "config": key.config})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), blob, q)) for _ in range(2)]
    for p in procs:
        p.start()
    paths = {q.get(timeout=600) for _ in procs}
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert len(paths) == 1
    entry = paths.pop()
    assert sorted(os.listdir(entry)) == ["kernel.h", "kernel.o", "kernel.sass", "meta.json"]
    leftovers = [p for p in os.listdir(os.path.dirname(entry)) if p.startswith(".tmp-")]
    assert leftovers == []
    mtime = os.path.getmtime(os.path.join(entry, "kernel.o"))
    # a third process finds the entry and does not rebuild it
    p = ctx.Process(target=_build_in_child, args=(str(tmp_path), blob, q))
    p.start(); q.get(timeout=600); p.join()
    assert os.path.getmtime(os.path.join(entry, "kernel.o")) == mtime


@needs_dsl
def test_export_prebuild_compiles_in_worker_processes(tmp_path, monkeypatch):
    """export's parallel pass: worker interpreters fill the shared cache, so the serial pass
    finds every entry built (it would otherwise compile them itself)."""
    from cutekern import compile as ck
    from cutekern.export import _prebuild, export_jobs
    monkeypatch.setenv("CUTEKERN_CACHE_DIR", str(tmp_path))
    keys = [k for k in all_keys(("sm_80",)) if k.op == "ikbo_attn"][:2]
    assert len(keys) == 2 and not any(ck.entry_dir(k).exists() for k in keys)
    lines = []
    _prebuild(keys, 2, lines.append)
    assert "in 2 processes" in lines[0] and "exit codes" not in lines[0]
    for k in keys:
        assert sorted(os.listdir(ck.entry_dir(k))) == ["kernel.h", "kernel.o", "kernel.sass", "meta.json"]
    monkeypatch.setenv("CUTEKERN_EXPORT_JOBS", "3")
    assert export_jobs() == 3
