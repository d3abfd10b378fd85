"""Triton's CPU interpreter, without its per-call re-patching of triton.language.

Under TRITON_INTERPRET=1 every call of a @triton.jit helper from inside a kernel walks the language
modules again (`inspect.getmembers`) to patch builtins the running kernel has already patched: about
a third of the interpreted forward's time in tests/test_gpu_forward.py. `apply()` makes a helper call
skip that walk when every language module the helper sees is patched already; the kernel launch
itself still patches and restores as before. Nothing else about interpretation changes.
"""

from __future__ import annotations

import inspect
import os
import sys


def apply() -> bool:
    """Install the skip once Triton's interpreter is imported and on; returns whether it is in place.
    Triton is not imported here: tests set TRITON_INTERPRET before their first import of it."""
    interp = sys.modules.get("triton.runtime.interpreter")
    if interp is None or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    original = interp._patch_lang
    if getattr(original, "skips_patched", False):
        return True
    import triton.language as tl

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return interp._LangPatchScope()  # the running kernel's patches stand; nothing to restore
        return original(fn)

    patch_lang.skips_patched = True
    interp._patch_lang = patch_lang
    return True
