"""Tools floor: everything that measures, checks or serves through the engine — ``verify/``, ``perf/``,
``bench/``, ``train/``, ``serve/``, the layout drill and the shared option parsers. Imports the engine and the core,
never the faces."""
