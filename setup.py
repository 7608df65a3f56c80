"""Build of the optional C kernels (``dcr._kernels``); everything else is in pyproject.toml.

The extension is optional: where no C compiler is available dcr installs without it and
``dcr.native`` falls back to numpy (slower construction and apply, identical results).
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-std=c11", "-fno-strict-aliasing"]

setup(
    ext_modules=[
        Extension("dcr._kernels", ["dcr/_kernels.c"], extra_compile_args=flags, optional=True)
    ]
)
