"""Builds kvserve's compiled CPU kernels at install (`pip install .` or `pip install -e .`).

Every kernel in kvserve/kernels/csrc is built once for every instruction-set level it has code for
(kvserve/kernels/levels.py lists them), as an ordinary extension module
kvserve.kernels.built.<kernel>_<level>; at run time kvserve imports the best build this CPU runs.
Nothing is compiled while a user waits, and no cache directory or lock is shared between installs.

The builds run in parallel, one compiler process a core. One that fails (no compiler, a compiler
without a level's flags) does not fail the install: the report beside the modules
(kvserve/kernels/built/report.json) says which builds exist and why any does not, and kvserve
runs the torch path in its place and says so once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = Path("kvserve", "kernels", "csrc")


def _levels():
    """kvserve/kernels/levels.py, read without importing the kvserve package (its dependencies
    may not be installed yet)."""
    spec = importlib.util.spec_from_file_location("_kvserve_levels", ROOT / "kvserve" / "kernels" / "levels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


levels = _levels()


def _extensions(cpp_extension) -> list:
    """One extension a (kernel, level); its source is written at build time (BuildKernels)."""
    extensions = []
    for kernel, isa in levels.all_builds():
        ext = cpp_extension.CppExtension(
            name=f"{levels.BUILT_PACKAGE}.{levels.module_name(kernel, isa)}",
            sources=[str(CSRC / f"{kernel}.cpp")],
            extra_compile_args=list(levels.BASE_FLAGS + levels.ISAS[isa].cflags + levels.KERNEL_CFLAGS.get(kernel, ())),
            extra_link_args=list(levels.LINK_FLAGS),
            depends=[str(p) for p in sorted(CSRC.glob("*.h"))])
        ext.kernel, ext.isa = kernel, isa
        extensions.append(ext)
    return extensions


def _build_command(cpp_extension):
    class BuildKernels(cpp_extension.BuildExtension):
        """torch's BuildExtension, every build in parallel, a failed build reported, not raised."""

        def finalize_options(self) -> None:
            super().finalize_options()
            if not self.parallel:
                self.parallel = os.cpu_count() or 1

        def run(self) -> None:
            self.report: dict[str, dict] = {}
            # The compiler wrapper torch would add (ccache) is swapped in and out of one compiler
            # object shared by the parallel builds; without it each build runs the same compiler.
            os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"
            inplace = self.inplace
            try:
                super().run()
            except Exception as e:  # no compiler at all: nothing could be built
                for ext in self.extensions:
                    self.report.setdefault(ext.name.rsplit(".", 1)[1], {"built": False, "reason": _reason(e)})
            self._write_report(Path(self.build_lib, *levels.BUILT_PACKAGE.split(".")))
            if inplace:
                self._write_report(self._source_dir())

        def build_extension(self, ext) -> None:
            name = ext.name.rsplit(".", 1)[1]
            entry = {"built": True, "sources": levels.source_digest(ROOT / CSRC, ext.kernel),
                     "torch": self._torch_version(), "flags": " ".join(ext.extra_compile_args)}
            if self._reuse(ext, name, entry):
                return
            # Each level of a kernel compiles its own one-line source that includes the kernel's,
            # so the levels' objects never share a path (and can build at once).
            wrapper = Path(self.build_temp, "kernel_sources", f"{name}.cpp")
            wrapper.parent.mkdir(parents=True, exist_ok=True)
            wrapper.write_text(f'#include "{(ROOT / CSRC / (ext.kernel + ".cpp")).as_posix()}"\n')
            ext.sources = [str(wrapper)]
            start = time.perf_counter()
            try:
                super().build_extension(ext)
                self.report[name] = {**entry, "seconds": round(time.perf_counter() - start, 1)}
            except Exception as e:  # one level this compiler cannot build: the others still can
                self.report[name] = {"built": False, "reason": _reason(e)}
                print(f"kvserve: kernel build {name} failed: {_reason(e)}", file=sys.stderr)

        def _reuse(self, ext, name: str, entry: dict) -> bool:
            """Take the module an earlier install of this checkout built from the same sources,
            flags and torch (kept beside the sources), instead of compiling it again."""
            built = self._source_dir() / Path(self.get_ext_fullpath(ext.name)).name
            prior = _read_report(self._source_dir()).get(name, {})
            if not built.exists() or any(prior.get(k) != v for k, v in entry.items()):
                return False
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            if built.resolve() != target.resolve():
                shutil.copy2(built, target)
            self.report[name] = {**prior, "reused": True}
            return True

        def _source_dir(self) -> Path:
            return Path(self.get_finalized_command("build_py").get_package_dir(levels.BUILT_PACKAGE))

        @staticmethod
        def _torch_version() -> str:
            import torch
            return torch.__version__

        def _write_report(self, directory: Path) -> None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / levels.REPORT_FILE).write_text(json.dumps(self.report, indent=1, sort_keys=True) + "\n")

    return BuildKernels


def _read_report(directory: Path) -> dict:
    try:
        return json.loads((directory / levels.REPORT_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def _kernel_build_options() -> dict:
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # installed without torch at build time: the torch paths run
        print(f"kvserve: torch is not importable at build time ({e}); no kernel is built", file=sys.stderr)
        return {}
    return {"ext_modules": _extensions(cpp_extension),
            "cmdclass": {"build_ext": _build_command(cpp_extension).with_options(use_ninja=False)}}


setup(**_kernel_build_options())
