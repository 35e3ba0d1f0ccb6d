"""Which compiled binary each Triton launch needs: a recorder of launch *specialization keys*.

Triton compiles one binary per kernel and **specialization**, and a launch whose key it has not seen compiles on
the spot (seconds for a big kernel, on the request path if nothing compiled it before). The key, as Triton 3.x
builds it (``triton/runtime/jit.py``: ``create_function_from_signature`` binds the arguments and calls the backend's
``specialize_impl`` on each; ``triton/backends/compiler.py``: ``BaseBackend.get_int_specialization`` and
``get_tensor_specialization``), holds, per kernel parameter:

* a ``tl.constexpr`` parameter: its value;
* a tensor: its element type and whether its address is a multiple of 16 bytes (``"D"``; unless the parameter is
  in ``do_not_specialize_on_alignment``; in ``do_not_specialize``: its type only);
* an integer, unless the parameter is in ``do_not_specialize``: ``1`` becomes a compile-time constant; otherwise
  its type (``i32``, ``i64`` or ``u64`` by range) and whether it is a multiple of 16 (``"D"``; not for a parameter
  in ``do_not_specialize_on_alignment``); in ``do_not_specialize``: its type only;
* a float or bool: its type only (never specialized);

plus the launch options (``num_warps``, ``num_stages``, ``launch_pdl``, …). :func:`arg_key` restates that rule in
Python (``tests/test_prefill_warmup.py`` checks it against Triton's own ``native_specialize_impl``), so the keys can
be recorded on a CPU, where the interpreter compiles nothing.

:class:`LaunchRecorder` wraps the one method every launch goes through (``JITFunction.run``, and
``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``; ``kernel[grid](...)`` calls it) and records each launch's
:class:`LaunchKey`. The engine's warm-up (:mod:`dsv4lab.engine.warmup`) reports the distinct keys it launched —
every binary a prompt can need — and the tests check that prompts of any length after it launch no other key.
``execute=False`` records without running the kernels (under the interpreter only: a test sweeping many prompt
lengths through a path whose launches cannot depend on values — the static prefill step's — learns its keys in
seconds instead of minutes).
"""
from __future__ import annotations

import inspect
import threading
from collections import Counter
from dataclasses import dataclass

import torch

_INT_RANGES = (("i32", -2 ** 31, 2 ** 31 - 1), ("i64", -2 ** 63, 2 ** 63 - 1), ("u64", 2 ** 63, 2 ** 64 - 1))
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
                torch.bool: "u1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def arg_key(value, specialize: bool = True, align: bool = True) -> tuple:
    """The key of one non-constexpr argument by Triton's rule (see the module docstring): ``("constexpr", 1)``,
    ``("i32", "D")``, ``("*bf16", "")``, ``("fp32", None)`` …"""
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        kind = next((name for name, lo, hi in _INT_RANGES if lo <= value <= hi), None)
        if kind is None:
            raise ValueError(f"integer argument {value} is outside Triton's 64-bit range")
        if not specialize:
            return (kind, None)
        if value == 1:
            return ("constexpr", 1)
        return (kind, "D" if align and value % 16 == 0 else "")
    if isinstance(value, float):
        return ("fp32", None)
    if isinstance(value, torch.Tensor):
        name = _DTYPE_NAMES.get(value.dtype, str(value.dtype).replace("torch.", ""))
        if not specialize:
            return ("*" + name, None)
        return ("*" + name, "D" if align and value.data_ptr() % 16 == 0 else "")
    return (type(value).__name__, None)


@dataclass(frozen=True)
class LaunchKey:
    """One specialization: the kernel's name, its arguments' keys (name → :func:`arg_key` or the constexpr's
    value) and its launch options."""

    kernel: str
    args: tuple
    options: tuple

    def describe(self) -> str:
        args = ", ".join(f"{n}={v}" for n, v in self.args)
        return f"{self.kernel}({args}; {', '.join(f'{n}={v}' for n, v in self.options)})"


def _constexpr_value(value):
    return getattr(value, "value", value)  # a tl.constexpr wrapper → its value


class _Signature:
    """What the key needs of a kernel's Python function: its parameters, which are constexpr, which are not
    specialized (by name or position, as ``triton.jit`` accepts them)."""

    def __init__(self, kernel):
        fn = kernel.fn
        self.name = fn.__name__
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters.values())
        self.names = [p.name for p in params]
        self.constexpr = {p.name for p in params if "constexpr" in str(p.annotation)}
        opts = getattr(kernel, "kwargs", None) or {}  # InterpretedFunction keeps the jit keywords here
        dns = getattr(kernel, "do_not_specialize", None) or opts.get("do_not_specialize") or ()
        dna = getattr(kernel, "do_not_specialize_on_alignment", None) or \
            opts.get("do_not_specialize_on_alignment") or ()
        self.not_specialized = {self.names[i] if isinstance(i, int) else i for i in dns}
        self.not_aligned = {self.names[i] if isinstance(i, int) else i for i in dna}

    def key(self, args: tuple, kwargs: dict) -> LaunchKey:
        params = {k: v for k, v in kwargs.items() if k in self.signature.parameters}
        options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in self.signature.parameters))
        bound = self.signature.bind(*args, **params)
        bound.apply_defaults()
        keyed = []
        for name, value in bound.arguments.items():
            if name in self.constexpr:
                keyed.append((name, repr(_constexpr_value(value))))
            else:
                keyed.append((name, arg_key(value, name not in self.not_specialized, name not in self.not_aligned)))
        return LaunchKey(self.name, tuple(keyed), options)


def _launch_classes() -> list:
    """The classes whose ``run`` every ``kernel[grid](...)`` call goes through (the compiled and the interpreted)."""
    from triton.runtime.jit import JITFunction
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # an older Triton without the interpreter class
        pass
    return classes


class LaunchRecorder:
    """Records every Triton launch's :class:`LaunchKey` while active (a context manager; not re-entrant).

    Attributes:
        keys: how many launches had each key (a Counter: ``set(keys)`` are the distinct specializations).
        execute: whether the kernels run (``False``: recorded only; allowed under the interpreter only).
    """

    _lock = threading.Lock()

    def __init__(self, execute: bool = True):
        self.execute = execute
        self.keys: Counter = Counter()
        self._signatures: dict[int, _Signature] = {}
        self._saved: list = []

    @property
    def kernels(self) -> set[str]:
        return {k.kernel for k in self.keys}

    def __enter__(self) -> "LaunchRecorder":
        from .formats import interpreting
        if not self.execute and not interpreting():
            raise RuntimeError("LaunchRecorder(execute=False) is for the interpreter: a compiled launch must run")
        recorder = self
        with self._lock:
            for cls in _launch_classes():
                original = cls.run

                def run(kernel, *args, grid, warmup, _original=original, **kwargs):
                    if not warmup:
                        recorder.record(kernel, args, kwargs)
                        if not recorder.execute:
                            return None
                    return _original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
                self._saved.append((cls, original))
                cls.run = run
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            for cls, original in reversed(self._saved):
                cls.run = original
            self._saved.clear()

    def record(self, kernel, args: tuple, kwargs: dict) -> LaunchKey:
        sig = self._signatures.get(id(kernel))
        if sig is None:
            sig = self._signatures[id(kernel)] = _Signature(kernel)
        key = sig.key(args, kwargs)
        self.keys[key] += 1
        return key


__all__ = ["arg_key", "LaunchKey", "LaunchRecorder"]
