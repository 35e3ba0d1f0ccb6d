"""Faces floor: what a person touches — the command line (``cli``, ``commands/``) and what only the notebooks use
(run folders, figures, their data and measurements). Nothing below imports from here."""
