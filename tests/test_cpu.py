"""jax_tinybert.speed.cpu: /proc/cpuinfo as Linux writes it, and the bfloat16 rule read from it."""
import subprocess
import sys

from jax_tinybert.speed import cpu

BLOCK = ("processor\t: {n}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
         "model name\t: {name}\nflags\t\t: {flags}\n\n")


def write(path, vendor="AuthenticAMD", family=25, model=17, name="AMD EPYC", flags="fpu",
          cores=2):
    path.write_text("".join(BLOCK.format(n=n, vendor=vendor, family=family, model=model,
                                         name=name, flags=flags) for n in range(cores)))
    return str(path)


def test_cpuinfo_reads_the_first_processor(tmp_path):
    """One block per core, separated by blank lines: the first block's fields, stripped; a value
    holding ':' is kept whole; a missing file gives {}."""
    p = tmp_path / "cpuinfo"
    p.write_text("\n" + BLOCK.format(n=0, vendor="GenuineIntel", family=6, model=207,
                                     name="Intel(R) Xeon(R) Processor @ 2.50GHz", flags="fpu a:b")
                 + BLOCK.format(n=1, vendor="AuthenticAMD", family=25, model=17, name="other",
                                flags="x"))
    info = cpu.cpuinfo(str(p))
    assert info["processor"] == "0" and info["vendor_id"] == "GenuineIntel"
    assert info["model name"] == "Intel(R) Xeon(R) Processor @ 2.50GHz"
    assert info["cpu family"] == "6" and info["model"] == "207" and info["flags"] == "fpu a:b"
    assert cpu.cpuinfo(str(tmp_path / "missing")) == {}


def test_cpu_name_names_family_and_model(tmp_path):
    info = cpu.cpuinfo(write(tmp_path / "c", name="AMD EPYC", family=25, model=17))
    assert cpu.cpu_name(info).startswith("AMD EPYC (family 25 model 17, ")
    assert cpu.cpu_name({}) == "unknown CPU"


def test_fast_bf16_reads_vendor_and_flags(tmp_path):
    """AMX on any vendor; AVX512-BF16 only on AMD (an Intel Xeon with it but no AMX ran bf16
    products slower than float32); a missing file, or flags that only contain the names as
    substrings, read as no fast bf16."""
    def rule(vendor, flags):
        return cpu.fast_bf16(cpu.cpuinfo(write(tmp_path / "c", vendor=vendor, flags=flags)))

    assert rule("GenuineIntel", "fpu avx512f amx_bf16 amx_tile avx512_bf16") == "AMX"
    assert rule("GenuineIntel", "fpu avx512f avx512_bf16") is None
    assert rule("AuthenticAMD", "fpu avx512f avx512_bf16 avx512_vnni") == "AVX512-BF16 on AMD"
    assert rule("AuthenticAMD", "fpu avx2 fma") is None                 # Zen 3: no bf16
    assert rule("AuthenticAMD", "fpu xavx512_bf16 amx_bf16x") is None   # whole flags only
    assert cpu.fast_bf16(cpu.cpuinfo(str(tmp_path / "missing"))) is None


def test_importing_it_leaves_jax_unloaded():
    """The benchmarks read the CPU before they set XLA's flags: the module must not load JAX."""
    code = ("import sys; from jax_tinybert.speed import cpu; cpu.fast_bf16(); cpu.cpu_name(); "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
