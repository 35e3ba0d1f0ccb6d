"""``python -m dsv4lab`` — the same CLI as the ``dsv4lab`` command (needed under ``torchrun``)."""
import sys

from dsv4lab.faces.cli import main

sys.exit(main())
