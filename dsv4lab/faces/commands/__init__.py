"""One module per ``dsv4lab`` subcommand (see :mod:`dsv4lab.faces.cli`)."""
