"""`pip install --no-build-isolation [-e] .` — CMake (CMakeLists.txt) is the single source of truth.

The build runs in build/ (TORCHPAR_BUILD_DIR), the directory scripts/setup.sh and developers use,
so pip reuses an existing build instead of compiling everything again.
"""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = pathlib.Path(os.environ.get("TORCHPAR_BUILD_DIR", ROOT / "build"))
        subprocess.check_call(
            ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
             f"-DPython3_EXECUTABLE={sys.executable}"]
        )
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "torchpar_python", "-j2"])
        # CMake writes _C into python/torchpar (what an editable install imports); a regular
        # install copies it, with the libtorchpar it loads through $ORIGIN, into the wheel.
        built = next((ROOT / "python" / "torchpar").glob("_C*.so"))
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        if built.resolve() != target.resolve():
            shutil.copy2(built, target)
            # _C needs libtorchpar under its soname (libtorchpar.so.<major>), found through $ORIGIN.
            for library in (build_dir / "lib").glob("libtorchpar.so.[0-9]"):
                shutil.copy2(library, target.parent / library.name, follow_symlinks=True)


setup(ext_modules=[CMakeExtension("torchpar._C")], cmdclass={"build_ext": CMakeBuild})
