"""Core floor: what the model *is* — configuration, number formats, the checkpoint, the reference forward
(``model/``), the layout algebra and repair specs (``layouts/``), plus errors, paths and provenance. It imports
nothing above it; the Triton kernels (``dsv4lab_kernels``) stand on this floor too."""
