"""fla's real Triton kernels on the CPU, under Triton's interpreter (``TRITON_INTERPRET=1``), for the tests only.

``make test-triton`` installs Triton and fla-core at pinned versions and runs the Triton path's tests with the
interpreter on; elsewhere ``interpreted_fla_kernels`` says why it cannot (and the tests that need it skip). Two shims
make fla 0.6.0 run there, both confined to the test process, neither touching the installed fla:

1. The autotuner times each kernel's configs with a GPU driver, which the interpreter has none of: every kernel is
   pinned to its first config (``Autotuner._bench`` ranks ``configs[0]`` first and times nothing).
2. ``fla/ops/common/chunk_h.py`` writes ``i_t.to(tl.int64)`` on a loop index, which is a plain Python int under the
   interpreter; ``tl.full([], i_t, tl.int64)`` computes the same. fla is imported from a private copy of the
   installed package with that line rewritten, first on ``sys.path``.

The interpreter runs each kernel instance in numpy, exactly in float32: slow, so the tests keep their shapes tiny
(a few heads of width 8 to 16, about 70 to 130 tokens to cross fla's 64-token chunks).
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from lrpe_hf.modeling import products_triton

INT64_LOOP_INDEX = "i_t.to(tl.int64)"


def why_not_available() -> str | None:
    """None where the interpreted kernels can be loaded in this process, otherwise why not."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton's interpreter is off (make test-triton runs these tests with TRITON_INTERPRET=1)"
    for package in ("triton", "fla"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (make test-triton installs it)"
    return None


def pin_autotuning_to_first_configs():
    from triton.runtime.autotuner import Autotuner

    def first_config_wins(self, *args, config, **meta):
        return 0.0 if config is self.configs[0] else float("inf")

    Autotuner._bench = first_config_wins


def import_fla_from_patched_copy(directory: Path):
    """Copies the installed fla into ``directory``, rewrites chunk_h.py's loop-index cast, and puts the copy first on
    ``sys.path``: the ``fla`` imported from now on is the copy."""
    if "fla" in sys.modules:
        raise RuntimeError("fla was imported before its interpreter copy: run these tests in a process of their own")
    installed = Path(importlib.util.find_spec("fla").submodule_search_locations[0])
    shutil.copytree(installed, directory / "fla", ignore=shutil.ignore_patterns("__pycache__"))
    chunk_h = directory / "fla" / "ops" / "common" / "chunk_h.py"
    source = chunk_h.read_text()
    if INT64_LOOP_INDEX not in source:
        raise RuntimeError(f"{chunk_h} has no {INT64_LOOP_INDEX!r}: this fla needs other shims")
    chunk_h.write_text(source.replace(INT64_LOOP_INDEX, "tl.full([], i_t, tl.int64)"))
    sys.path.insert(0, str(directory))


def interpreted_fla_kernels(directory: Path):
    """fla's (chunked, one-step) kernels as ``products_triton.load_fla`` imports them, from the patched copy in
    ``directory`` with autotuning pinned. Call once per process."""
    os.environ.setdefault("FLA_CACHE_RESULTS", "0")  # no autotuning results written to the user's Triton cache
    pin_autotuning_to_first_configs()
    import_fla_from_patched_copy(directory)
    products_triton.load_fla.cache_clear()
    kernels, why_not = products_triton.load_fla()
    if kernels is None:
        raise RuntimeError(why_not)
    assert sys.modules["fla"].__file__.startswith(str(directory))
    return kernels
