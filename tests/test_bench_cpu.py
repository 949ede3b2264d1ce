"""The benchmark names the CPU with every ratio: model and the flags that decide integer and matrix speed."""
from __future__ import annotations

from pathlib import Path

from enginelib.bench.cpu import FLAGS, cpu_info, cpu_label, parse_cpuinfo

FIXTURES = Path(__file__).parent / "fixtures" / "cpuinfo"


def test_the_recorded_amd_epyc_is_named_with_vnni_and_without_amx():
    # /proc/cpuinfo's first processor, recorded on the 2-core AMD EPYC VM the team measures on
    info = cpu_info(FIXTURES / "amd-epyc-2core-vm.txt", machine="x86_64", cores=2)
    assert info["model"] == "AMD EPYC" and info["source"].endswith("amd-epyc-2core-vm.txt")
    flags = info["flags"]
    assert flags["avx512_vnni"] and flags["avx512f"] and flags["avx2"] and flags["avx512_bf16"]
    assert not flags["amx_tile"] and not flags["amx_int8"] and not flags["avx_vnni"] and not flags["avx512_fp16"]
    assert set(flags) == set(FLAGS)
    assert cpu_label(info) == "AMD EPYC (x86_64, 2 cores: AVX-512 VNNI, AVX-512 BF16, AVX2; no AMX)"


def test_an_amx_xeon_names_amx_int8_first(tmp_path):
    # constructed, not recorded: the flags the issue lists for the team's Intel Xeon (AMX, AVX-512 VNNI, AVX-VNNI, FP16)
    flags = ("fpu avx avx2 fma f16c avx512f avx512bw avx512_vnni avx_vnni avx512_bf16 avx512_fp16 "
             "amx_tile amx_int8 amx_bf16")
    (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz\n"
                                      f"flags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    label = cpu_label(cpu_info(tmp_path / "cpuinfo", machine="x86_64", cores=2))
    assert label == ("Intel(R) Xeon(R) Platinum 8581C CPU @ 2.10GHz (x86_64, 2 cores: AMX-INT8, AVX-512 VNNI, "
                     "AVX-VNNI, AVX-512 FP16, AVX-512 BF16, AVX2)")


def test_an_avx2_only_cpu_says_what_it_lacks_and_arm_names_its_dot_products(tmp_path):
    (tmp_path / "x86").write_text("model name\t: Some CPU\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert cpu_label(cpu_info(tmp_path / "x86", machine="x86_64", cores=4)) == \
        "Some CPU (x86_64, 4 cores: AVX2; no AMX, no AVX-512)"
    # arm64 Linux spells its flags "Features" and has no "model name": the label names dotprod and i8mm
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd asimddp i8mm sve\nCPU implementer\t: 0x41\n")
    model, flags = parse_cpuinfo((tmp_path / "arm").read_text())
    assert model is None and {"asimddp", "i8mm", "sve"} <= flags
    info = cpu_info(tmp_path / "arm", machine="aarch64", cores=8)
    assert cpu_label(info).endswith("(aarch64, 8 cores: I8MM, NEON dotprod, SVE)")


def test_where_no_flags_can_be_read_the_label_says_so(tmp_path):
    info = cpu_info(tmp_path / "no-such-file", machine="arm64", cores=8)
    assert info["model"] and info["source"] in ("platform", "sysctl")
    if info["source"] == "platform":  # not macOS: no flags at all
        assert all(v is None for v in info["flags"].values())
        assert cpu_label(info).endswith("(arm64, 8 cores; CPU flags not read on this OS)")


def test_this_machine_is_named():
    info = cpu_info()
    assert info["model"] and info["cores"] >= 1 and info["model"] in cpu_label(info)
