"""The reference forward of DeepSeek-V4, one concept per file, with the spec's section numbers in the docstrings."""
