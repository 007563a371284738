"""CPU feature detection reads /proc/cpuinfo's first processor block."""

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
