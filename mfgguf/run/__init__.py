"""The RUN directory: its layout and contract (rundir.py), module files and their typed records
(records.py), atomic file helpers (files.py) and the f32 safetensors writers (safetensors_f32.py).

Every stage imports these names from `mfgguf.run`; the modules of this package import each other
directly, never through this file.
"""

from mfgguf.run.rundir import *  # noqa: F401,F403  (the names every stage reads: rundir.__all__)
from mfgguf.run.rundir import __all__  # noqa: F401
