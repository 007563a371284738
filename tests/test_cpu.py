"""CPU feature detection reads /proc/cpuinfo's first processor block."""

import pytest

from engine.cpu import cpu_info, parse_cpuinfo

AVX2_ONLY = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""


def test_parse_avx2_only():
    info = parse_cpuinfo(AVX2_ONLY)
    assert info.model == "AMD EPYC"
    assert info.features == ("avx2", "fma")
    assert info.num_logical_cores == 2
    assert not info.has_vnni and not info.has("avx512f")


def test_parse_avx512_vnni():
    info = parse_cpuinfo(AVX2_ONLY.replace("bmi2", "bmi2 avx512f avx512bw avx512_vnni avx512_bf16"))
    assert info.has("avx512f") and info.has_vnni
    assert info.as_dict()["features"] == ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"]


def test_this_machine_is_described():
    info = cpu_info()
    assert info.model and info.num_logical_cores >= 1
    assert info.model in info.describe()


def test_restricted_cpu_keeps_only_the_named_features():
    info = parse_cpuinfo(AVX2_ONLY.replace("bmi2", "bmi2 avx512f avx512bw avx512_vnni")).restricted("avx2, fma")
    assert info.features == ("avx2", "fma") and not info.has_vnni
    assert info.as_dict()["restricted_from"] == ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"]
    assert "restricted by STEPWISE_CPU_FEATURES" in info.describe()
    assert info.compiler_flags() == ["-mavx2", "-mf16c", "-mfma"]  # never -march=native when restricted
    assert parse_cpuinfo(AVX2_ONLY).compiler_flags() == ["-march=native"]
    assert parse_cpuinfo(AVX2_ONLY).restricted("").features == ()


def test_restriction_names_what_it_cannot_do():
    info = parse_cpuinfo(AVX2_ONLY)
    with pytest.raises(ValueError, match=r"lacks \['avx512f'\]"):
        info.restricted("avx2,avx512f")
    with pytest.raises(ValueError, match="unknown feature"):
        info.restricted("sse9")


def test_the_environment_restricts_what_the_kernels_choose(monkeypatch):
    if not cpu_info().has("avx2") or not cpu_info().has("fma"):
        pytest.skip("this CPU lacks AVX2 and FMA: nothing to restrict to")
    from engine.cpu import kernel_max_rows
    from engine.model import quant_kernel

    monkeypatch.setenv("STEPWISE_CPU_FEATURES", "avx2,fma")
    cpu_info.cache_clear()
    try:
        assert cpu_info().features == ("avx2", "fma") and cpu_info().restricted_from is not None
        assert quant_kernel.best_isa() == "avx2" and not quant_kernel.isa_supported("avx512")
        assert kernel_max_rows(quant_kernel.best_isa()) == 64  # the AVX2 path's switch to the dense copies
        assert kernel_max_rows(quant_kernel.best_isa(), int8_activations=True) == 16
    finally:
        monkeypatch.delenv("STEPWISE_CPU_FEATURES")
        cpu_info.cache_clear()
