"""Importing the Triton kernels (``dsv4lab_kernels``) whether or not the package is installed.

The kernels live in the folder ``kernels/`` and import as ``dsv4lab_kernels`` (installed by ``pip install -e .``
or from a wheel). Run from a bare source tree (``PYTHONPATH=$PWD``, as on a GPU machine where nothing can be
installed), :func:`kernel_module` registers that folder under the package name first. The Triton backend and
the prefill kernels both import through here.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

from dsv4lab.core.paths import KERNELS_DIR

PDL_ENV = "DSV4LAB_PDL"
"""``0``: the decode kernels launch without programmatic dependent launch, which is on by default on sm_90+ GPUs
(``kernels/dsv4lab_kernels/launch.py`` reads it; named here so the tools can set it without importing triton)."""


def kernel_module(name: str):
    """``dsv4lab_kernels.<name>`` (importing triton); from a bare source tree, ``kernels/`` is registered as
    ``dsv4lab_kernels`` first."""
    if importlib.util.find_spec("dsv4lab_kernels") is None:
        init = KERNELS_DIR / "__init__.py"
        if not init.exists():
            raise ImportError("dsv4lab_kernels is not installed and no kernels/ folder was found beside dsv4lab/")
        spec = importlib.util.spec_from_file_location("dsv4lab_kernels", init,
                                                      submodule_search_locations=[str(KERNELS_DIR)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dsv4lab_kernels"] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"dsv4lab_kernels.{name}")
