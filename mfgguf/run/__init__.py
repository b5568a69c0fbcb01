"""The RUN directory: its layout and contract (rundir.py), module files and their typed records
(records.py; the manifest and the sync plans: plans.py), the questions stages ask of its state (state.py), atomic file helpers (files.py) and the
f32 safetensors writers (safetensors_f32.py).

Every stage imports these names from `mfgguf.run`; the modules of this package import each other
directly, never through this file.
"""

from mfgguf.run.rundir import *  # noqa: F401,F403  (the names every stage reads: rundir.__all__)
from mfgguf.run.rundir import __all__ as _rundir_all
from mfgguf.run.state import *  # noqa: F401,F403  (the answers about its state: state.__all__)
from mfgguf.run.state import __all__ as _state_all
from mfgguf.run.plans import *  # noqa: F401,F403  (manifest.json and the sync plans, typed: plans.__all__)
from mfgguf.run.plans import __all__ as _plans_all

__all__ = [*_rundir_all, *_state_all, *_plans_all]
