"""Flow-Factory: reinforcement-learning fine-tuning of flow-matching image and video models."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# FF_CPU_MIXED_PRECISION=1 runs a CPU in a GPU's precision (precision.py). Some CPUs that advertise
# AMX crash (SIGILL) in oneDNN's AMX bf16 kernels; the cap must be in the environment before torch
# runs its first kernel, so it is set here, at the package's import, unless the user chose one.
ONEDNN_CAP_TOO_LATE = False
if (_os.environ.get("FF_CPU_MIXED_PRECISION", "").strip().lower() in ("1", "true", "yes", "on")
        and "ONEDNN_MAX_CPU_ISA" not in _os.environ):
    _os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    ONEDNN_CAP_TOO_LATE = "torch" in _sys.modules  # torch may have run a kernel already


def _drop_torchvision_fallback_note(record) -> bool:
    # transformers says, once per class at import, that an image processor falls back to its PIL
    # backend without torchvision; that backend is the one this package runs, so the note tells a
    # user nothing (other transformers warnings still show)
    return "requires torchvision (not installed); falling back to" not in record.getMessage()


import logging as _logging  # noqa: E402

_logging.getLogger("transformers.utils.import_utils").addFilter(_drop_torchvision_fallback_note)
