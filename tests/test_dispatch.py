"""Dispatch: targets, the CUTEKERN_ARCH/DESIGN overrides, and a DSL-free import."""
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, dsl_installed
from cutekern.arch import arch_from_capability, parse_arches, target_arch, target_design


def test_capability_mapping():
    assert arch_from_capability(8, 0) == "sm_80" and arch_from_capability(8, 6) == "sm_80"
    assert arch_from_capability(8, 9) == "sm_89"
    assert arch_from_capability(9, 0) == "sm_90a"
    assert arch_from_capability(10, 0) == "sm_100a" and arch_from_capability(10, 3) == "sm_103a"
    with pytest.raises(RuntimeError, match="compute capability 7.5"):
        arch_from_capability(7, 5)


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("CUTEKERN_ARCH", "sm_89")
    assert target_arch() == "sm_89" and target_design("sm_89") == "ada"
    monkeypatch.setenv("CUTEKERN_ARCH", "sm_42")
    with pytest.raises(ValueError, match="CUTEKERN_ARCH"):
        target_arch()
    monkeypatch.setenv("CUTEKERN_DESIGN", "ada")
    assert target_design("sm_90a") == "ada"
    with pytest.raises(ValueError, match="cannot run on sm_100a"):
        target_design("sm_100a")
    assert parse_arches("all")[0] == "sm_80"
    with pytest.raises(ValueError, match="unknown arch"):
        parse_arches("sm_90a,sm_70")


@pytest.mark.skipif(not dsl_installed(), reason="needs nvidia-cutlass-dsl")
@pytest.mark.parametrize("arch,design", [("sm_100a", "sm100"), ("sm_89", "ada"), ("sm_90a", "sm90")])
def test_any_arch_traces_on_cpu(session_cache, monkeypatch, arch, design):
    from cutekern import compile as ck
    from cutekern.dispatch import resolve_key
    monkeypatch.setenv("CUTEKERN_ARCH", arch)
    key = resolve_key("lce_gemm", {"ab": "bfloat16", "c": "bfloat16"}, {"has_addend": True})
    assert (key.arch, key.design) == (arch, design)
    meta = ck.read_meta(ck.build(key))
    assert meta["arch"] == arch and set(meta["sass"]["required_found"]) == set(meta["sass"]["required"])


def test_runtime_side_imports_without_the_dsl():
    """The serving path (API, dispatch, runtime) never imports the DSL compiler."""
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('cutlass', 'nvidia_cutlass_dsl', 'kernels'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(REPO)!r})
        import cutekern, cutekern.ikbo, cutekern.runtime, cutekern.dispatch, cutekern.export
        assert 'cutlass' not in sys.modules
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_lce_wide_build_choice():
    """The API runs the sm90 wide build (256-row M tiles) only when it covers M in fewer tiles
    than the default build (224), and a design without one gets no `wide` flag at all."""
    from types import SimpleNamespace
    from cutekern.ikbo import pick_lce_function

    def lookup(fl):  # every build's key carries the design's default config
        return SimpleNamespace(meta={"config": {"tile_m": 224, "wide_tile_m": 256}}, flags=fl)

    def pick(m, has_wide=True):
        return pick_lce_function(lookup, True, m, has_wide).flags

    assert pick(433) == {"has_addend": True, "wide": False}      # 2 tiles either way
    assert pick(449) == {"has_addend": True, "wide": True}       # 2 x 256 < 3 x 224
    assert pick(256)["wide"] and pick(700)["wide"] and pick(1000)["wide"]
    assert not pick(224)["wide"] and not pick(300)["wide"] and not pick(1)["wide"]
    assert pick(449, has_wide=False) == {"has_addend": True}


def test_lce_narrow_user_build_choice():
    """The user phase runs the sm90 narrow build (112-row tiles) when its CTAs still fit in
    one wave and the SMs they leave free still host every candidate-phase CTA that gets an
    extra tile (those start first); the candidate phase never runs it."""
    from types import SimpleNamespace
    from cutekern.ikbo import pick_lce_function
    cfg = {"tile_m": 224, "wide_tile_m": 256, "narrow_tile_m": 112, "tile_n": 128, "num_ctas": 132}

    def lookup(fl):
        return SimpleNamespace(meta={"config": cfg, "flags": fl}, flags=fl)

    def narrow(m, users, cand_tiles, add=False, sms=None, n=256):
        return pick_lce_function(lookup, add, m, True, True, users, n, sms, cand_tiles).flags["narrow"]

    assert narrow(433, 15, 1024 * 4)             # reference: 120 CTAs, 12 free >= 4 extra
    assert not narrow(433, 15, 1024 * 4, add=True)
    assert not narrow(433, 17, 1024 * 4)         # 136 CTAs: two waves
    assert not narrow(433, 11, 512 * 4)          # 88 CTAs leave 44 SMs, 68 CTAs get an extra tile
    assert narrow(433, 3, 2048 * 4)
    assert not narrow(433, 15, 1024 * 4, sms=114)  # a smaller part: 120 CTAs do not fit
    assert narrow(100, 1, 50 * 2)                # one tile either way, a narrower WGMMA
    flags = pick_lce_function(lookup, False, 449, True, True, 31, 256, None, 0).flags
    assert flags == {"has_addend": False, "narrow": False, "wide": True}  # 310 CTAs: wide pick


def test_sm100_hosts_the_ada_design_only_for_kda(monkeypatch):
    """KDA has no sm100 design: SM100 dispatches its Ada design's build (an op's own choice);
    any other op asking for the Ada design on SM100 is refused, naming the choices."""
    from cutekern.dispatch import _cached_function, get_function
    from cutekern.registry import OPS
    monkeypatch.setenv("CUTEKERN_ARCH", "sm_100a")
    assert OPS["kda_intra"].designs_on("sm_100a") == ("ada",)
    assert OPS["lce_gemm"].designs_on("sm_100a") == ("sm100",)
    _cached_function.cache_clear()
    with pytest.raises(ValueError, match=r"design 'ada' cannot run on sm_100a \(choices: \('sm100',\)\)"):
        get_function("lce_gemm", {"ab": "bfloat16", "c": "bfloat16"}, {"has_addend": True},
                     design="ada")
