"""The optional C extension (fastpipe._jpegcrop: crop-aware JPEG decoding against the system libjpeg-turbo).

Everything else is in pyproject.toml. Without a C compiler or libjpeg-turbo's headers the build of the extension
fails, is reported, and fastpipe installs without it: the loaders then decode whole images, as before
(`fastpipe doctor` says which decoder is active and why).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing, whatever goes wrong (no compiler, no headers, no library)."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # e.g. no compiler at all, before any extension is tried
            self._skipped(e)

    def build_extension(self, ext):
        if self.compiler.compiler_type == "unix":  # the draws' and tables' arithmetic exactly as Python's: no FMA
            ext.extra_compile_args = [*ext.extra_compile_args, "-ffp-contract=off", "-fno-fast-math"]
        try:
            super().build_extension(ext)
        except Exception as e:
            self._skipped(e)

    def _skipped(self, e: Exception) -> None:
        self.warn(f"fastpipe's crop-aware JPEG decoder was not built ({type(e).__name__}: {e}); fastpipe works "
                  f"without it, decoding whole images. To build it: install a C compiler and libjpeg-turbo's headers "
                  f"(Debian/Ubuntu: apt-get install gcc libjpeg62-turbo-dev), then reinstall fastpipe.")


setup(
    ext_modules=[Extension("fastpipe._jpegcrop", ["fastpipe/_jpegcrop.c"], depends=["fastpipe/_trainchunk.c"],
                           libraries=["jpeg"], optional=True)],
    cmdclass={"build_ext": OptionalBuildExt},
)
