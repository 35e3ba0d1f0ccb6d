"""Triton kernels of dsv4lab, imported as ``dsv4lab_kernels`` (the folder is ``kernels/``).

One family per file, each with its launcher (a thin wrapper that asserts the layout, allocates the output and
computes the grid) and a torch reference next to it. Importing this package does not import triton; the
kernel modules do. On a machine without a GPU set ``TRITON_INTERPRET=1`` *before* importing a kernel module
to run it in Triton's CPU interpreter.
"""
