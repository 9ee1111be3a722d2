"""The kernel build's cache key and its progress messages, without compiling anything: the key (the
build folder's name) changes with every input of the build and only with them, so two virtualenvs
or two machines sharing one extensions folder each keep their own build; a first build says what
it is doing on stderr, and a cached one says nothing."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
from pathlib import Path

from tandem import kernels


def test_the_key_is_stable():
    assert kernels.build_inputs() == kernels.build_inputs()
    name = kernels.library_name()
    assert name == kernels.library_name(kernels.build_inputs())
    assert name.startswith("tandem_cpu_ops_")


def test_the_key_changes_with_every_input():
    base = kernels.build_inputs()
    seen = {kernels.library_name(base)}
    for f in dataclasses.fields(base):
        value = getattr(base, f.name)
        if isinstance(value, bool):
            changed: object = not value
        elif isinstance(value, tuple):
            changed = (*value, ("extra", "0") if value and isinstance(value[0], tuple) else "extra")
        else:
            changed = value + " changed"
        name = kernels.library_name(dataclasses.replace(base, **{f.name: changed}))
        assert name not in seen, f.name
        seen.add(name)


def test_the_inputs_follow_the_sources_compiler_torch_and_cpu(tmp_path, monkeypatch):
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }")
    one = kernels.build_inputs(sources=(src,))
    src.write_text("int f() { return 2; }")
    assert kernels.build_inputs(sources=(src,)).sources != one.sources

    # The compiler is the one PyTorch's builder runs ($CXX), by version.
    for version in ("1.0", "2.0"):
        cxx = tmp_path / f"cxx-{version}"
        cxx.write_text(f"#!/bin/sh\necho 'fakecc {version}'\n")
        cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(tmp_path / "cxx-1.0"))
    a = kernels.build_inputs()
    monkeypatch.setenv("CXX", str(tmp_path / "cxx-2.0"))
    b = kernels.build_inputs()
    assert "fakecc 1.0" in a.compiler and "fakecc 2.0" in b.compiler
    assert kernels.library_name(a) != kernels.library_name(b)

    import torch

    assert a.torch_version.startswith(torch.__version__)
    assert a.cxx11_abi == bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    # Another virtualenv's torch has its headers elsewhere: PyTorch's build commands name them.
    assert any(p.startswith(os.path.dirname(torch.__file__)) for p in a.include_paths)

    import tandem.cpu

    monkeypatch.setattr(tandem.cpu, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    c = kernels.build_inputs()
    monkeypatch.setattr(tandem.cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert kernels.build_inputs().cpu_features != c.cpu_features


def test_the_build_folder_is_under_the_extensions_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert kernels.build_directory("tandem_cpu_ops_x") == tmp_path / "tandem_cpu_ops_x"


def test_a_first_build_says_what_it_does_and_a_cached_one_is_quiet(tmp_path):
    name = "tandem_cpu_ops_test"
    sources = tuple(Path(f"{stem}.cpp") for stem in ("one", "two", "three"))
    out = io.StringIO()
    with kernels.BuildProgress(tmp_path, name, sources, out):
        # What ninja leaves behind, as it compiles each source.
        for src in sources:
            (tmp_path / f"{src.stem}.o").write_bytes(b"")
        (tmp_path / f"{name}.so").write_bytes(b"")
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0].startswith("tandem: compiling the CPU kernels"), text
    assert str(tmp_path) in lines[0] and "once" in lines[0]
    assert "3 of 3 sources compiled" in text
    assert lines[-1].startswith("tandem: CPU kernels built in "), text

    quiet = io.StringIO()
    with kernels.BuildProgress(tmp_path, name, sources, quiet):
        pass  # the library is there: a cached load
    assert quiet.getvalue() == ""


def test_progress_lines_name_the_sources_done():
    line = kernels.progress_line(["cpu_ops.cpp", "int4_ops.cpp"], 5, 42.4)
    assert line == "tandem: 2 of 5 sources compiled (cpu_ops.cpp, int4_ops.cpp), 42 s"
    assert kernels.progress_line([], 5, 75.0) == "tandem: still compiling the CPU kernels, 75 s"
