"""Building and loading the native CPU kernel (kernels/native.py, kernels/cache_dir.py): the variant
chosen from the CPU's flags, the cache key, the private cache directory, and what a failed build says.

The kernels' answers, per variant, are checked in tests/test_native_attention.py.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import stat

import pytest
import torch

from radixserve.kernels import cache_dir, native

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "sse2"}
needs_cc = pytest.mark.skipif(native.cannot_build() is not None, reason=f"{native.cannot_build()}")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache and no library loaded yet; the usual one loaded again afterwards."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    native.reset()
    yield tmp_path
    native.reset()


def _fake_cc(folder, body: str) -> str:
    """A compiler script: `--version` prints "fakecc 1.0"; anything else runs body."""
    path = folder / "fakecc"
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\n{body}\n')
    path.chmod(0o755)
    return str(path)


def test_the_variant_follows_the_cpu_flags_and_the_env(monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    assert native.chosen_isa(AVX512).name == "avx512"
    assert native.chosen_isa({"avx2", "fma", "f16c", "avx512f"}).name == "avx2"  # AVX-512F alone is not enough
    assert native.chosen_isa({"avx2", "f16c"}).name == "portable"  # AVX2 without FMA
    assert native.chosen_isa({"avx2", "fma"}).name == "portable"  # nor without F16C (fp16 scales widened by it)
    assert native.chosen_isa(set()).name == "portable"
    monkeypatch.setenv(native.ISA_ENV, "Portable")
    assert native.chosen_isa(AVX512).name == "portable"
    monkeypatch.setenv(native.ISA_ENV, "avx512")
    with pytest.raises(native.Unavailable, match="avx512=?.*no avx512f, avx512bw, avx512vl, avx512dq"):
        native.chosen_isa({"avx2", "fma"})
    monkeypatch.setenv(native.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="RADIXSERVE_NATIVE_ISA='avx3': expected auto or one of avx512, avx2, "
                                         "portable"):
        native.chosen_isa(AVX512)


def test_a_forced_variant_the_cpu_lacks_is_unavailable_not_run(monkeypatch, fresh, caplog):
    monkeypatch.setattr(native, "this_cpu_flags", lambda: frozenset({"sse2", "avx2", "fma"}))
    monkeypatch.setenv(native.ISA_ENV, "avx512")
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.native"):
        assert native.load() is None
    assert native.status() == ("unavailable: RADIXSERVE_NATIVE_ISA=avx512, but this CPU has no avx512f, avx512bw, "
                               "avx512vl, avx512dq")
    assert [r.levelname for r in caplog.records] == ["WARNING"]  # nothing compiled


def test_the_cache_key_holds_the_sources_compiler_and_isa_flags():
    avx2 = next(isa for isa in native.ISAS if isa.name == "avx2")
    names = {isa.name: native.library_name(isa, "cc", "cc 12.2") for isa in native.ISAS}
    assert len(set(names.values())) == len(native.ISAS)
    assert all(name.startswith(f"cpu_kernels-{isa}-") and name.endswith(".so") for isa, name in names.items())
    assert native.library_name(avx2, "cc", "cc 12.2") == names["avx2"]  # a key, not a random name
    assert native.library_name(avx2, "cc", "cc 13.1") != names["avx2"]
    assert native.library_name(avx2, "clang", "cc 12.2") != names["avx2"]
    more_flags = dataclasses.replace(avx2, cc_flags=(*avx2.cc_flags, "-mf16c"))
    assert native.library_name(more_flags, "cc", "cc 12.2") != names["avx2"]


def test_the_compiler_version_is_the_first_line(tmp_path):
    assert native.compiler_version(_fake_cc(tmp_path, "exit 1")) == "fakecc 1.0"
    with pytest.raises(native.Unavailable, match="no-such-cc --version failed"):
        native.compiler_version(str(tmp_path / "no-such-cc"))


def test_a_failed_build_says_why_and_what_it_costs_once(monkeypatch, fresh, caplog):
    monkeypatch.setenv("CC", _fake_cc(fresh, 'echo "cpu_kernels.c:1: error: boom" >&2; exit 1'))
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.native"):
        assert native.load() is None
        assert not native.supports(torch.float32, 64, torch.device("cpu"))
        assert native.argmax_rows(torch.tensor([[1.0, 3.0, 2.0]])).tolist() == [1]  # torch's argmax
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert records[0] == ("INFO", "compiling the native CPU kernel (once, ~15 s)")
    assert len(records) == 2 and records[1][0] == "WARNING"
    assert "error: boom" in records[1][1] and records[1][1].endswith(native.FALLBACK_COST)
    assert native.status().startswith("unavailable: ") and "error: boom" in native.status()


def test_the_cache_is_created_private(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "a" / "cache"))
    old = os.umask(0)  # the modes must come from the code, not from the umask
    try:
        folder, problem = cache_dir.private_cache_dir("kernels")
    finally:
        os.umask(old)
    assert problem is None
    for path in (tmp_path / "a" / "cache", folder):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_cache_writable_by_others_is_refused(monkeypatch, tmp_path, mode):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv("RADIXSERVE_CACHE", str(root))
    folder, problem = cache_dir.private_cache_dir("kernels")
    assert problem == f"{root} is writable by its group or others (mode {mode:o})"
    root.chmod(0o755)  # readable by others is fine: no one else can plant a library
    assert cache_dir.private_cache_dir("kernels") == (folder, None)
    os.chmod(folder, 0o775)
    assert cache_dir.private_cache_dir("kernels") == (folder, f"{folder} is writable by its group or others "
                                                               "(mode 775)")


@needs_cc
def test_a_cache_owned_by_another_user_is_refused(monkeypatch, fresh, caplog):
    """A cache folder another user owns (here: uid 65534; not root: this process pretends to be
    another uid) is never loaded from, even with a file of the right name in it: the kernel is
    built in a private temp dir instead, and the WARNING says why."""
    root = fresh / "cache"
    (root / "kernels").mkdir(parents=True)
    monkeypatch.setenv(native.ISA_ENV, "portable")
    cc = os.environ.get("CC", "cc")
    planted = root / "kernels" / native.library_name(native.chosen_isa(), cc, native.compiler_version(cc))
    planted.write_bytes(b"not a library: loading it would fail the build")
    if os.getuid() == 0:
        for path in (root, root / "kernels", planted):
            os.chown(path, 65534, 65534)
        owner, me = 65534, 0
    else:
        owner, me = os.getuid(), os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: me)
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.native"):
        lib = native.load()
    assert lib is not None and native.status() == "native portable"
    assert not lib._name.startswith(str(root)) and not os.path.exists(lib._name)  # temp dir, removed
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"{root} belongs to uid {owner}, not to this user (uid {me}): compiling the native CPU "
                        "kernel into a fresh private temp dir instead, on every start (~15 s); make the cache "
                        "folder yours and private (chmod 700), or set RADIXSERVE_CACHE to one that is"]
    assert planted.read_bytes() == b"not a library: loading it would fail the build"
    x = torch.randn(5, 300)
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))


@needs_cc
def test_a_library_built_for_more_than_asked_is_not_loaded(monkeypatch, fresh):
    """The library says which instruction set it was compiled for: a compiler that adds AVX2 to the
    portable build (a distro default, a wrapper) does not pass for portable."""
    monkeypatch.setenv("CC", _fake_cc(fresh, 'exec cc -mavx2 -mfma "$@"'))
    monkeypatch.setenv(native.ISA_ENV, "portable")
    if "avx2" not in native.runnable_isas():
        pytest.skip("this CPU cannot run the AVX2 build the wrapper makes")
    assert native.load() is None
    assert native.status().endswith("was asked for portable but compiled for avx2")


@needs_cc
def test_a_library_built_under_a_loose_umask_is_private_and_loaded(monkeypatch, fresh):
    """The linker gives its output the umask's mode (0775 under umask 002): the build makes it 0700,
    or the check before loading would refuse what was just built."""
    monkeypatch.setenv(native.ISA_ENV, "portable")
    old = os.umask(0o002)
    try:
        lib = native.load()
    finally:
        os.umask(old)
    assert lib is not None, native.status()
    assert lib._name.startswith(str(fresh / "cache" / "kernels"))
    assert stat.S_IMODE(os.stat(lib._name).st_mode) == 0o700
